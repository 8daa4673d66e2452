//! [`PoolPointerExport`]: a buffer of a [`ShareablePool`](crate::ShareablePool), as bytes another
//! process can receive.
//!
//! ```
//! use cumem_ipc::{IpcMemHandle, PoolPointerExport};
//! // Bytes of another kind are refused by their length or their tag, before any driver call.
//! let legacy = [0u8; IpcMemHandle::ENCODED_LEN];
//! assert!(matches!(PoolPointerExport::from_bytes(&legacy), Err(cumem_core::Error::LengthMismatch { .. })));
//! let untagged = [0u8; PoolPointerExport::ENCODED_LEN];
//! assert!(matches!(PoolPointerExport::from_bytes(&untagged), Err(cumem_core::Error::InvalidValue { .. })));
//! ```

use cumem_core::{Error, ErrorContext, Result};

use crate::ffi::POOL_EXPORT_SIZE;

/// What the encoding starts with, so that other bytes of the right length (a legacy handle plus
/// padding, say) are not taken for a pool pointer.
const TAG: &[u8; 8] = b"cumemPP1";

/// An exported buffer of a shareable pool: the driver's 64-byte `CUmemPoolPtrExportData` of the
/// allocation holding it, plus where the buffer lies in that allocation and its size.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PoolPointerExport {
    raw: [u8; POOL_EXPORT_SIZE],
    offset: u64,
    bytes: u64,
}

impl std::fmt::Debug for PoolPointerExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolPointerExport")
            .field("offset", &self.offset)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl PoolPointerExport {
    /// Length of [`PoolPointerExport::to_bytes`]: an 8-byte tag, the driver's export data, then
    /// the buffer's offset in its allocation and its size (little endian).
    pub const ENCODED_LEN: usize = TAG.len() + POOL_EXPORT_SIZE + 16;

    pub(crate) fn new(raw: [u8; POOL_EXPORT_SIZE], offset: u64, bytes: u64) -> Self {
        PoolPointerExport { raw, offset, bytes }
    }

    pub(crate) fn raw(&self) -> [u8; POOL_EXPORT_SIZE] {
        self.raw
    }

    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// Size in bytes of the exported buffer.
    pub fn bytes(&self) -> usize {
        self.bytes as usize
    }

    /// The bytes to send to the other process.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        let raw_end = TAG.len() + POOL_EXPORT_SIZE;
        out[..TAG.len()].copy_from_slice(TAG);
        out[TAG.len()..raw_end].copy_from_slice(&self.raw);
        out[raw_end..raw_end + 8].copy_from_slice(&self.offset.to_le_bytes());
        out[raw_end + 8..].copy_from_slice(&self.bytes.to_le_bytes());
        out
    }

    /// Reads what [`PoolPointerExport::to_bytes`] wrote. Another length gives
    /// [`Error::LengthMismatch`]; bytes without its tag (another kind of handle),
    /// [`Error::InvalidValue`]. Whether they name live memory is the driver's to say, at
    /// [`ImportedPool::import_pointer`](crate::ImportedPool::import_pointer).
    pub fn from_bytes(bytes: &[u8]) -> Result<PoolPointerExport> {
        let Ok(all) = <&[u8; Self::ENCODED_LEN]>::try_from(bytes) else {
            return Err(Error::LengthMismatch { expected: Self::ENCODED_LEN, actual: bytes.len() });
        };
        if &all[..TAG.len()] != TAG {
            return Err(Error::InvalidValue {
                ctx: ErrorContext::op("PoolPointerExport::from_bytes (not a pool pointer export)"),
            });
        }
        let raw_end = TAG.len() + POOL_EXPORT_SIZE;
        let mut raw = [0u8; POOL_EXPORT_SIZE];
        raw.copy_from_slice(&all[TAG.len()..raw_end]);
        let word = |at: usize| u64::from_le_bytes(all[at..at + 8].try_into().expect("8 bytes"));
        Ok(PoolPointerExport { raw, offset: word(raw_end), bytes: word(raw_end + 8) })
    }
}
