//! Where managed memory can live or be accessed from, and the hints that name those places.
//!
//! A [`Location`] is the host (the CPU) or a device. [`Advice`] is one of the driver's hints about a
//! range of managed memory (`cuMemAdvise`); [`UnifiedBuffer::advise`](crate::UnifiedBuffer::advise)
//! sets one and [`UnifiedBuffer::unadvise`](crate::UnifiedBuffer::unadvise) removes it.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::Device;
//! use cumem_unified::{Advice, Location};
//! let gpu = Location::Device(Device::get(0)?);
//! assert_ne!(gpu, Location::Host);
//! assert_eq!(Advice::PreferredLocation(Location::Host).location(), Some(Location::Host));
//! assert_eq!(Advice::ReadMostly.location(), None);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use cumem_core::{Device, Feature, Result};

use crate::ffi::Target;

/// A processor that managed memory can reside on or be accessed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Location {
    /// The host: the CPU's memory (`CU_DEVICE_CPU`, or `CU_MEM_LOCATION_TYPE_HOST`).
    Host,
    /// A device's memory.
    Device(Device),
}

impl Location {
    pub(crate) fn target(self) -> Target {
        match self {
            Location::Host => Target::Host,
            Location::Device(d) => Target::Device(d.raw()),
        }
    }

    /// Decodes a location id from a range-attribute answer: `-1` is the host, `-2` (or any other
    /// negative id) is no location.
    pub(crate) fn from_id(id: i32) -> Result<Option<Location>> {
        Ok(match id {
            crate::ffi::DEVICE_CPU => Some(Location::Host),
            id if id >= 0 => Some(Location::Device(Device::get(id as usize)?)),
            _ => None,
        })
    }

    /// `NotSupported { ConcurrentManagedAccess }` unless the location is the host or a device that
    /// can access managed memory concurrently with the host (needed to place or map pages there).
    pub(crate) fn require_concurrent(self) -> Result<()> {
        match self {
            Location::Host => Ok(()),
            Location::Device(d) => d.capabilities()?.require(Feature::ConcurrentManagedAccess),
        }
    }
}

/// A migration hint for a range of managed memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Advice {
    /// The range is mostly read: processors that read it get their own read-only copy.
    ReadMostly,
    /// The range should live at this location; other processors map it rather than migrate it.
    PreferredLocation(Location),
    /// The range should stay mapped for this processor wherever it lives.
    AccessedBy(Location),
}

impl Advice {
    /// The location the hint names (`None` for [`Advice::ReadMostly`]).
    pub fn location(&self) -> Option<Location> {
        match *self {
            Advice::ReadMostly => None,
            Advice::PreferredLocation(l) | Advice::AccessedBy(l) => Some(l),
        }
    }
}
