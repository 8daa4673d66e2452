//! Allocation granularity: the unit of every size, offset and address in the VMM calls.
//!
//! The driver answers per device and per set of [`HandleTypes`], in two flavours: the *minimum*,
//! which every physical size, mapping offset and reservation size must be a multiple of, and the
//! *recommended*, a size that performs well as a chunk. Both are 2 MiB on current discrete GPUs
//! (`driver-api.md` §17), but they can differ, so cumem always asks. Answers are cached per
//! process (they cannot change while a driver is loaded), so validating costs no driver call.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::Device;
//! use cumem_vmm::Granularity;
//! let device = Device::get(0)?;
//! if device.capabilities()?.virtual_memory {
//!     let g = Granularity::of(device)?;
//!     assert!(g.minimum.is_power_of_two() && g.recommended % g.minimum == 0);
//!     assert_eq!(g.round_up(1), Some(g.minimum));
//! }
//! # Ok::<(), cumem_core::Error>(())
//! ```

use cumem_core::{Device, Error, Feature, Result};
use parking_lot::Mutex;

use crate::{HandleTypes, ffi};

/// The allocation granularity of one device for one set of handle types, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Granularity {
    /// The device asked about.
    pub device: Device,
    /// The handle types asked about.
    pub handle_types: HandleTypes,
    /// Every size, offset and address of a VMM call must be a multiple of this.
    pub minimum: usize,
    /// A multiple of `minimum` that the driver recommends as an allocation size.
    pub recommended: usize,
}

impl Granularity {
    /// The granularity of pinned memory on `device` without export handles.
    ///
    /// `NotSupported { feature: VirtualMemory }` on a device without VMM, before any VMM call.
    pub fn of(device: Device) -> Result<Granularity> {
        Granularity::with_handle_types(device, HandleTypes::NONE)
    }

    /// The granularity of pinned memory on `device` that may be exported as `handle_types`.
    ///
    /// `NotSupported { feature: ShareableHandle(name), device }` for a handle type the device's
    /// attributes (`HANDLE_TYPE_*_SUPPORTED`) say it cannot export, before any VMM call.
    pub fn with_handle_types(device: Device, handle_types: HandleTypes) -> Result<Granularity> {
        static CACHE: Mutex<Vec<Granularity>> = Mutex::new(Vec::new());
        if let Some(g) = CACHE.lock().iter().find(|g| g.device == device && g.handle_types == handle_types) {
            return Ok(*g);
        }
        require_vmm(device)?;
        let raw = device.raw();
        // The driver's own answer differs by type and version (§17); the attributes say it first.
        for bit in (0..u32::BITS).map(|i| 1u32 << i).filter(|b| handle_types.bits() & b != 0) {
            if let Some(supported) = ffi::handle_type_supported(raw, bit) {
                let (supported, name) = supported?;
                if !supported {
                    return Err(Error::NotSupported {
                        feature: Feature::ShareableHandle(name),
                        device: Some(raw),
                    });
                }
            }
        }
        let minimum = ffi::allocation_granularity(raw, handle_types.bits(), false)?;
        let recommended = ffi::allocation_granularity(raw, handle_types.bits(), true)?;
        if minimum == 0 || !recommended.is_multiple_of(minimum) {
            // A driver that broke its own contract: refuse rather than divide by zero later.
            return Err(Error::Misaligned {
                what: "recommended granularity",
                value: recommended as u64,
                align: minimum as u64,
            });
        }
        let g = Granularity { device, handle_types, minimum, recommended };
        CACHE.lock().push(g);
        Ok(g)
    }

    /// `bytes` rounded up to a multiple of the minimum (`None` on overflow).
    pub fn round_up(&self, bytes: usize) -> Option<usize> {
        bytes.checked_next_multiple_of(self.minimum)
    }

    /// `Ok` if `value` is a multiple of the minimum, else `Misaligned { what, value, align }`.
    pub fn check(&self, what: &'static str, value: u64) -> Result<()> {
        if value.is_multiple_of(self.minimum as u64) {
            Ok(())
        } else {
            Err(Error::Misaligned { what, value, align: self.minimum as u64 })
        }
    }
}

/// `NotSupported { feature: VirtualMemory }` unless `device` supports VMM (read from its cached
/// capabilities, so no driver call once they are known).
pub(crate) fn require_vmm(device: Device) -> Result<()> {
    device.capabilities()?.require(Feature::VirtualMemory)
}
