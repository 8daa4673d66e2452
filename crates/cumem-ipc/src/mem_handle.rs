//! [`IpcMemHandle`]: an exported allocation, as bytes another process can receive.

use bytemuck::Pod;
use cumem_core::{DeviceBuffer, Error, ErrorContext, Result, Stream};

use crate::ffi::{self, HANDLE_SIZE};
use crate::imported::Source;
use crate::{ImportedBuffer, live_imports};

/// An exported buffer: the driver's 64-byte handle of the allocation holding it, plus where the
/// buffer lies in that allocation, so the importer knows which memory it names.
///
/// The driver exports whole allocations. A buffer carved from a larger one (a block of cumem's
/// caching pool) is exported with its whole segment: the other process can reach the segment's
/// other blocks too. Export buffers from [`DriverResource`](cumem_core::DriverResource) (one
/// allocation each) to share exactly the buffer.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcMemHandle {
    raw: [u8; HANDLE_SIZE],
    offset: u64,
    bytes: u64,
}

impl std::fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMemHandle")
            .field("offset", &self.offset)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl IpcMemHandle {
    /// Length of [`IpcMemHandle::to_bytes`]: the driver's handle, then the buffer's offset in
    /// its allocation and its size (little endian).
    pub const ENCODED_LEN: usize = HANDLE_SIZE + 16;

    /// Exports `buf`, which must lie in `cuMemAlloc` memory (the driver resource, or the caching
    /// pool's segments): the driver's pools and VMM memory give [`Error::InvalidValue`]. The
    /// driver's handle is that of the allocation's base (as the driver documents), and the
    /// buffer's offset in the allocation travels beside it. The importer may use the memory as
    /// soon as it opens it; order its work after this process's writes with an
    /// [`IpcEvent`](crate::IpcEvent) or by synchronising `buf.order()` before sending the handle.
    pub fn export<T>(buf: &DeviceBuffer<T>) -> Result<IpcMemHandle> {
        buf.context().bind()?;
        // The driver documents the handle of an allocation's base; the H100 took an interior
        // pointer too (driver-api.md §17), but which address an open of that handle returns is
        // not on record. The base's handle with the offset carried alongside names the buffer
        // either way.
        let (base, _) = ffi::address_range(buf.device_ptr())?;
        let Some(offset) = buf.device_ptr().checked_sub(base) else {
            return Err(Error::InvalidValue {
                ctx: ErrorContext::op(
                    "IpcMemHandle::export (the driver's allocation base lies past the buffer)",
                ),
            });
        };
        let raw = ffi::mem_handle(base)?;
        Ok(IpcMemHandle { raw, offset, bytes: buf.bytes() as u64 })
    }

    /// Size in bytes of the exported buffer (not of the allocation holding it).
    pub fn bytes(&self) -> usize {
        self.bytes as usize
    }

    /// The bytes to send to the other process.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..HANDLE_SIZE].copy_from_slice(&self.raw);
        out[HANDLE_SIZE..HANDLE_SIZE + 8].copy_from_slice(&self.offset.to_le_bytes());
        out[HANDLE_SIZE + 8..].copy_from_slice(&self.bytes.to_le_bytes());
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
        let word = |at: usize| u64::from_le_bytes(all[at..at + 8].try_into().expect("8 bytes"));
        Ok(IpcMemHandle { raw, offset: word(HANDLE_SIZE), bytes: word(HANDLE_SIZE + 8) })
    }

    /// Opens the exported memory in this process, in `stream`'s context, as `bytes() /
    /// size_of::<T>()` elements whose first use is on `stream`. In the exporting process the
    /// driver answers [`Error::InvalidContext`]; for memory already freed, the simulator answers
    /// [`Error::InvalidValue`] (what a GPU answers is not on record: safety item 1 is what keeps
    /// that from happening) and so does a handle whose buffer does not lie inside the allocation
    /// the driver maps; a size
    /// that is not a whole number of `T`s, or an offset not aligned for `T`, gives
    /// [`Error::Misaligned`], as does an address the driver mapped that is not aligned for `T`.
    /// The address the open returned must be the start of the mapping the driver reports for it
    /// (`cuMemGetAddressRange`: the handle names an allocation's base), and the view must lie
    /// inside that mapping; otherwise [`Error::InvalidValue`]. On each of these refusals after
    /// the driver's open, the open is closed again at once (nothing was queued on it, so `stream`
    /// is not waited for). Opening bytes that are already open
    /// here, through another live [`ImportedBuffer`] of the same handle whose range of the
    /// allocation overlaps this one's, in any context (another device's too), gives [`Error::AlreadyMapped`]: two imports
    /// would be two exclusive views of the same memory. Disjoint ranges of one allocation (two
    /// buffers of one caching-pool segment) open together; the driver counts the opens and each
    /// import closes its own.
    ///
    /// # Safety
    ///
    /// Neither the memory's lifetime nor the other processes' accesses to it can be checked from
    /// here, so the caller promises:
    ///
    /// 1. The exporter keeps the allocation alive, and does not reuse the exported memory for
    ///    anything else (a caching pool hands a freed block to its next allocation), until the
    ///    returned [`ImportedBuffer`] is dropped. Using an import of freed memory is undefined
    ///    behaviour on a GPU.
    /// 2. Other processes' accesses to the memory are ordered with this process's, through an
    ///    [`IpcEvent`](crate::IpcEvent) or the program's own protocol: no other process writes
    ///    it while this one reads or writes it, nor reads it while this one writes it.
    /// 3. The 64 driver bytes are those [`IpcMemHandle::export`] gave, unaltered, and no other
    ///    handle of the same allocation with different driver bytes is open in this process in
    ///    another context while the returned [`ImportedBuffer`] lives. An open of an overlapping,
    ///    non-empty range of the same bytes is refused in every context (an empty range overlaps
    ///    nothing and opens any number of times), and one the driver maps at a live import's
    ///    address (the same context) too, but differing bytes that name the same allocation map
    ///    elsewhere in another context and cannot be recognised. (Exporting one buffer twice gives
    ///    the same bytes on the simulator; on a GPU it is not on record.)
    ///
    /// Safe code cannot open an import:
    ///
    /// ```compile_fail,E0133
    /// fn open_it(handle: &cumem_ipc::IpcMemHandle, stream: &cumem_core::Stream) {
    ///     let _ = handle.open::<u32>(stream);
    /// }
    /// ```
    pub unsafe fn open<T: Pod>(&self, stream: &Stream) -> Result<ImportedBuffer<T>> {
        // The offset and size are untrusted bytes: check what needs no driver before opening, so
        // that a forged handle neither overflows nor leaves an import open.
        let size = std::mem::size_of::<T>().max(1);
        if !self.bytes.is_multiple_of(size as u64) {
            return Err(Error::Misaligned { what: "exported size", value: self.bytes, align: size as u64 });
        }
        let align = std::mem::align_of::<T>() as u64;
        if !self.offset.is_multiple_of(align) {
            return Err(Error::Misaligned { what: "exported offset", value: self.offset, align });
        }
        let Some(end) = self.offset.checked_add(self.bytes) else {
            return Err(Error::InvalidValue {
                ctx: ErrorContext::op("IpcMemHandle::open (offset + size overflows)").bytes(self.bytes()),
            });
        };
        stream.context().bind()?;
        let already = || Error::AlreadyMapped {
            ctx: ErrorContext::op(
                "IpcMemHandle::open (already open in this process; drop the other ImportedBuffer first)",
            )
            .bytes(self.bytes()),
        };
        let Some(ticket) = live_imports::claim_handle(&self.raw, self.offset..end) else {
            return Err(already());
        };
        let base = match ffi::mem_open(self.raw) {
            Ok(base) => base,
            Err(e) => {
                live_imports::release(ticket);
                return Err(e);
            }
        };
        if !live_imports::place(&ticket, base) {
            // The driver counted this open: undo it, leaving the live import as it was.
            // SAFETY: `base` was opened just above and nothing else holds this open.
            if let Err(e) = unsafe { ffi::mem_close(base) } {
                tracing::warn!(error = %e, "cumem-ipc: closing a refused second open failed");
            }
            return Err(already());
        }
        // Until the import exists, a refusal closes the open itself: nothing was queued on the
        // memory, so unlike dropping an `ImportedBuffer` it need not wait for the caller's stream
        // (which might wait for this thread) and cannot fail that wait and leak the open.
        let refuse = |ticket, e: Error| {
            live_imports::release(ticket);
            // SAFETY: `base` was opened just above, nothing else holds this open, and no view of it
            // was made.
            if let Err(close) = unsafe { ffi::mem_close(base) } {
                tracing::warn!(error = %close, "cumem-ipc: closing a refused open failed");
            }
            Err(e)
        };
        // The handle names the allocation's base (`export`), so the driver's address must be the
        // start of the mapping it reports for it; the view is then checked against that mapping's
        // size, not against a size assumed from the handle.
        let (range_base, range_size) = match ffi::address_range(base) {
            Ok(range) => range,
            Err(e) => return refuse(ticket, e),
        };
        if range_base != base {
            return refuse(
                ticket,
                Error::InvalidValue {
                    ctx: ErrorContext::op(
                        "IpcMemHandle::open (the driver opened the allocation inside a mapping)",
                    )
                    .bytes(self.bytes()),
                },
            );
        }
        if end > range_size as u64 {
            return refuse(
                ticket,
                Error::InvalidValue {
                    ctx: ErrorContext::op("IpcMemHandle::open (buffer outside the exported allocation)")
                        .bytes(self.bytes()),
                },
            );
        }
        // In range: `base + offset` does not overflow, as `base + range_size` does not.
        let ptr = base + self.offset;
        // The offset is aligned, but the driver's address need not be for a `T` aligned beyond
        // what it guarantees (a `#[repr(align(4096))]` type, say).
        if !ptr.is_multiple_of(align) {
            return refuse(ticket, Error::Misaligned { what: "imported address", value: ptr, align });
        }
        Ok(ImportedBuffer::new(base, ptr, self.bytes() / size, stream, Source::IpcHandle(ticket)))
    }
}
