//! Unified (managed) memory for cumem: [`UnifiedBuffer<T>`], migration hints, prefetching.
//!
//! Managed memory has one address on the host and on every device, and the driver migrates its
//! pages to whichever processor touches them. [`UnifiedBuffer`] owns such an allocation: shared
//! host access first waits for the device work that writes it, exclusive host access for all
//! device work on it (and, on devices without concurrent managed access, shared access too, and
//! for what its attachment requires; there, the host reads and writes memory only while it is
//! attached to the host, which the scoped accessors arrange for their duration, see
//! [`UnifiedBuffer::with_host_slice`]), and device views make it usable in every cumem copy. Hints
//! ([`Advice`], [`MigrationPolicy`]) and prefetches ([`PrefetchPlan`]) tell the
//! driver where pages should be; [`RangeAttributes`] reads back what is in effect. The CUDA 12.2
//! location-based entry points are used when the driver has them, the older device-ordinal ones
//! otherwise; a device without managed memory (or without concurrent access, where a device
//! location needs it) is `NotSupported` before any driver call.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, Stream};
//! use cumem_unified::{Location, MigrationPolicy, UnifiedBuffer};
//! let device = Device::get(0)?;
//! let stream = Stream::new(&device.context()?)?;
//! let buf = UnifiedBuffer::from_slice(&stream, &[1.0f64; 1024])?;
//! buf.set_policy(MigrationPolicy::PreferDevice(device))?;
//! buf.prefetch(Location::Device(device), &stream)?;
//! // A prefetch changes no data: shared reads need not wait for it (`as_mut_slice` and
//! // `wait_idle` do).
//! assert_eq!(buf.as_slice()?[1023], 1.0);
//! # Ok::<(), cumem_core::Error>(())
//! ```

mod buffer;
mod ffi;
mod location;
mod policy;
mod prefetch;

pub use buffer::{Attach, RangeAttributes, UnifiedBuffer};
pub use location::{Advice, Location};
pub use policy::MigrationPolicy;
pub use prefetch::PrefetchPlan;
