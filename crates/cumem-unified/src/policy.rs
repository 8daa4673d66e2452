//! `MigrationPolicy`: where a unified buffer's pages should live, as one choice instead of hints.
//!
//! Each policy names the location it stands for, and [`UnifiedBuffer::set_policy`] turns it into
//! the driver's hints: [`MigrationPolicy::PreferHost`] really is the CPU (`CU_DEVICE_CPU` /
//! `CU_MEM_LOCATION_TYPE_HOST`), [`MigrationPolicy::PreferDevice`] the given device, and
//! [`MigrationPolicy::ReadMostly`] replicates pages for readers instead of placing them.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, Stream};
//! use cumem_unified::{Location, MigrationPolicy, UnifiedBuffer};
//! let stream = Stream::new(&Device::get(0)?.context()?)?;
//! let buf = UnifiedBuffer::<f32>::zeroed(&stream, 1 << 16)?;
//! buf.set_policy(MigrationPolicy::PreferHost)?;
//! assert_eq!(buf.attributes()?.preferred_location, Some(Location::Host));
//! buf.set_policy(MigrationPolicy::OnDemand)?;
//! assert_eq!(buf.attributes()?.preferred_location, None);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use cumem_core::Device;

use crate::Location;

/// Where a unified buffer's pages should live.
///
/// [`UnifiedBuffer`]: crate::UnifiedBuffer
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MigrationPolicy {
    /// No hints: pages migrate to whichever processor touches them (the driver's default).
    #[default]
    OnDemand,
    /// Pages live on this device; other processors map them rather than pull them over.
    PreferDevice(Device),
    /// Pages live in host memory (the CPU); devices map them rather than pull them over.
    PreferHost,
    /// Pages are mostly read: each reading processor gets its own read-only copy.
    ReadMostly,
}

impl MigrationPolicy {
    /// The location the policy prefers (`None` for on-demand and read-mostly).
    pub fn preferred_location(&self) -> Option<Location> {
        match *self {
            MigrationPolicy::PreferDevice(d) => Some(Location::Device(d)),
            MigrationPolicy::PreferHost => Some(Location::Host),
            MigrationPolicy::OnDemand | MigrationPolicy::ReadMostly => None,
        }
    }

    /// Whether the policy marks pages read-mostly.
    pub fn read_mostly(&self) -> bool {
        matches!(self, MigrationPolicy::ReadMostly)
    }
}
