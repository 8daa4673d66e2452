//! Typed, sound transfers between host and device memory.
//!
//! Two families: [`copy_h2d`]/[`copy_d2h`]/[`copy_d2d`] (and [`copy_2d`]/[`copy_3d`]) block the
//! host and take ordinary slices; [`StreamCopy`] queues copies and memsets on a stream and, for
//! host memory, takes page-locked kinds ([`HostMemory`](cumem_core::HostMemory): pinned, mapped,
//! registered) whose trackers make the host wait for the queued copies: reading the host data
//! waits for a queued device write into it, writing it waits for queued device reads and writes,
//! and freeing it waits for both; a queued device read does not hold up host reads. 2D/3D copies
//! work between any of these and device views or [`PitchedBuffer`]s (a blocking one needs a
//! device side), with extents checked before the driver is called. Host→device needs `T: NoUninit`, device→host
//! `T: AnyBitPattern`; lengths must match; out-of-range views are refused before any driver call.
//!
//! Two more tools sit beside the copies:
//! - [`StagingRing`] copies ordinary `&[T]`/`&mut [T]` through a reusable ring of pinned chunks,
//!   filling one chunk while the device copies another ([`StagingRing::copy_h2d`],
//!   [`StagingRing::copy_d2h`]; see [`staging`] for the rules that make it sound);
//! - [`Profiler`] ([`profile`]) observes copies on a stream or everywhere and reports kind, count,
//!   bytes, device time and throughput per size class; off, it costs a copy one relaxed atomic
//!   load. Every copy also runs inside a `trace` span `copy` (fields `device`, `stream`, `bytes`,
//!   `kind`), and every staged copy inside a `debug` span `staged_copy`. The span is made and
//!   entered before the copy takes any cumem lock or binds its context, and the profiler's
//!   warnings are logged after the copy has let go of its locks: a subscriber may use the same
//!   buffers from another thread and wait for it.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{DeviceBuffer, Device, PinnedBuffer, Stream};
//! use cumem_copy::StreamCopy;
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! let host = PinnedBuffer::from_slice(&ctx, &[1.5f32; 64])?;
//! let mut dev = DeviceBuffer::<f32>::zeroed(&stream, 64)?;
//! stream.copy_h2d(&host, &mut dev)?;
//! assert_eq!(dev.to_vec()?, vec![1.5; 64]);
//! # Ok::<(), cumem_core::Error>(())
//! ```

mod blocking;
mod extent;
mod ffi;
mod nd;
mod pitched;
pub mod profile;
mod region;
pub mod staging;
mod stream_ordered;
mod validate;

pub use blocking::{copy_d2d, copy_d2h, copy_h2d};
pub use extent::{Copy2D, Copy3D, Rect2D};
pub use nd::{copy_2d, copy_3d};
pub use pitched::{PITCHED_ROW_ALIGNMENT, PitchedBuffer};
pub use profile::{CopyKind, Observing, ProfileReport, Profiler, SizeClass, Totals};
pub use region::{CopyDst, CopySrc, Pitched, QueuedDst, QueuedSrc};
pub use staging::{MAX_FILL_THREADS, StagingConfig, StagingRing, StagingStats};
pub use stream_ordered::StreamCopy;
