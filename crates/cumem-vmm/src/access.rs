//! What a device may do with mapped memory (`CU_MEM_ACCESS_FLAGS_PROT_*`).
//!
//! A new mapping is inaccessible to every device until access is set on it: copies and memsets
//! on it fail at the call, as a real driver does (`driver-api.md` §17).
//!
//! ```
//! use cumem_vmm::Access;
//! assert!(Access::ReadWrite.can_write());
//! assert!(Access::Read.can_read() && !Access::Read.can_write());
//! assert_eq!(Access::from_flags(3), Some(Access::ReadWrite));
//! ```

use cumem_core::{Device, Error, Feature, Result};
use cumem_sys::sys::CUmemAccess_flags;

/// One device's access to a mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Access {
    /// No access (`PROT_NONE`): the state of every new mapping.
    #[default]
    None,
    /// Reads only (`PROT_READ`).
    Read,
    /// Reads and writes (`PROT_READWRITE`).
    ReadWrite,
}

impl Access {
    /// The driver's flags for this access.
    pub fn flags(self) -> CUmemAccess_flags {
        match self {
            Access::None => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
            Access::Read => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
            Access::ReadWrite => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }

    /// The access that the driver's flag value stands for (`None` for a value it never reports).
    pub fn from_flags(flags: u64) -> Option<Access> {
        match flags {
            0 => Some(Access::None),
            1 => Some(Access::Read),
            3 => Some(Access::ReadWrite),
            _ => None,
        }
    }

    /// Whether device work may read the memory.
    pub fn can_read(self) -> bool {
        self != Access::None
    }

    /// Whether device work may write the memory.
    pub fn can_write(self) -> bool {
        self == Access::ReadWrite
    }
}

/// `Ok` if `device` may be given access to memory on `owner`: it supports VMM
/// (`NotSupported { feature: VirtualMemory }`) and is `owner` or can access `owner`'s memory
/// (`cuDeviceCanAccessPeer`; `NotSupported { feature: PeerAccess, device }` otherwise). No VMM
/// call is made, so callers check this before reserving or mapping anything.
pub(crate) fn require_reach(device: Device, owner: Device) -> Result<()> {
    crate::granularity::require_vmm(device)?;
    if device != owner && !device.can_access_peer(owner)? {
        return Err(Error::NotSupported { feature: Feature::PeerAccess, device: Some(device.raw()) });
    }
    Ok(())
}
