//! [`IpcMemHandle`]: an exported allocation, as bytes another process can receive.

use bytemuck::Pod;
use cumem_core::{DeviceBuffer, Error, Result, Stream};

use crate::ImportedBuffer;
use crate::ffi::{self, HANDLE_SIZE};

/// An exported device allocation: the driver's 64-byte handle plus the allocation's size, so
/// the importer knows how much memory it names.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcMemHandle {
    raw: [u8; HANDLE_SIZE],
    bytes: u64,
}

impl std::fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMemHandle").field("bytes", &self.bytes).finish_non_exhaustive()
    }
}

impl IpcMemHandle {
    /// Length of [`IpcMemHandle::to_bytes`]: the driver's handle, then the size (little endian).
    pub const ENCODED_LEN: usize = HANDLE_SIZE + 8;

    /// Exports `buf`, which must come from `cuMemAlloc` (the driver resource): pool and VMM
    /// memory give [`Error::InvalidValue`]. The importer may use the memory as soon as it opens
    /// it; order its work after this process's writes with an [`IpcEvent`](crate::IpcEvent) or by
    /// synchronising `buf.order()` before sending the handle.
    pub fn export<T>(buf: &DeviceBuffer<T>) -> Result<IpcMemHandle> {
        buf.context().bind()?;
        let raw = ffi::mem_handle(buf.device_ptr())?;
        Ok(IpcMemHandle { raw, bytes: buf.bytes() as u64 })
    }

    /// Size in bytes of the exported allocation.
    pub fn bytes(&self) -> usize {
        self.bytes as usize
    }

    /// The bytes to send to the other process.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..HANDLE_SIZE].copy_from_slice(&self.raw);
        out[HANDLE_SIZE..].copy_from_slice(&self.bytes.to_le_bytes());
        out
    }

    /// Reads what [`IpcMemHandle::to_bytes`] wrote; any other length gives
    /// [`Error::LengthMismatch`]. (Whether the bytes name live memory is the driver's to say, at
    /// [`IpcMemHandle::open`].)
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcMemHandle> {
        let Ok(all) = <&[u8; Self::ENCODED_LEN]>::try_from(bytes) else {
            return Err(Error::LengthMismatch { expected: Self::ENCODED_LEN, actual: bytes.len() });
        };
        let mut raw = [0u8; HANDLE_SIZE];
        raw.copy_from_slice(&all[..HANDLE_SIZE]);
        let size = u64::from_le_bytes(all[HANDLE_SIZE..].try_into().expect("8 bytes"));
        Ok(IpcMemHandle { raw, bytes: size })
    }

    /// Opens the exported memory in this process, in `stream`'s context, as `bytes() /
    /// size_of::<T>()` elements whose first use is on `stream`. In the exporting process the
    /// driver answers [`Error::InvalidContext`]; for memory already freed, [`Error::InvalidValue`];
    /// a size that is not a whole number of `T`s gives [`Error::Misaligned`].
    pub fn open<T: Pod>(&self, stream: &Stream) -> Result<ImportedBuffer<T>> {
        let size = std::mem::size_of::<T>().max(1);
        if !self.bytes.is_multiple_of(size as u64) {
            return Err(Error::Misaligned { what: "exported size", value: self.bytes, align: size as u64 });
        }
        stream.context().bind()?;
        let ptr = ffi::mem_open(self.raw)?;
        Ok(ImportedBuffer::new(ptr, self.bytes() / size, stream))
    }
}
