//! Typed, sound transfers between host and device memory.
//!
//! Two families: [`copy_h2d`]/[`copy_d2h`]/[`copy_d2d`] block the host and take ordinary slices;
//! [`StreamCopy`] queues copies and memsets on a stream and, for host memory, takes
//! [`PinnedBuffer`](cumem_core::PinnedBuffer)s that cannot be read, written or freed by the host
//! until the device is done with them. Host→device needs `T: NoUninit`, device→host
//! `T: AnyBitPattern`; lengths must match; out-of-range views are refused before any driver call.
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
mod ffi;
mod stream_ordered;
mod validate;

pub use blocking::{copy_d2d, copy_d2h, copy_h2d};
pub use stream_ordered::StreamCopy;
