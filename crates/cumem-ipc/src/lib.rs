//! `cumem-ipc`: sharing device memory and events with other processes.
//!
//! A process exports a [`DeviceBuffer`](cumem_core::DeviceBuffer) as an [`IpcMemHandle`]: a few
//! bytes it sends to another process over any channel (a pipe, a socket, a file). That process
//! opens the handle as an [`ImportedBuffer`], a device view of the same memory that closes the
//! import when dropped. [`IpcEvent`]s order work across the two: one process records, the other
//! waits. Only memory from `cuMemAlloc` can be exported this way, and the driver exports whole
//! allocations: a [`DriverResource`](cumem_core::DriverResource) buffer is one, while a caching-pool
//! block goes with its whole segment (other blocks included, so prefer the driver resource for
//! shared buffers); the driver's pools and VMM memory answer `Error::InvalidValue`. [`fd_passing`] moves file descriptors between
//! processes over a Unix socket (`SCM_RIGHTS`), for the handle kinds that are descriptors.
//!
//! Pools export too: a [`ShareablePool`] (a driver pool created with POSIX-descriptor handle
//! types) serves typed buffers, exports itself as a descriptor and each buffer as a
//! [`PoolPointerExport`]; the other process imports the descriptor as an [`ImportedPool`] and the
//! pointers through it, as [`ImportedBuffer`]s that free the import on drop (see
//! [`ImportedPool`] for an example, `crates/cumem-ipc/tests/pool_two_processes.rs` for two
//! processes).
//!
//! The memory stays the exporter's: it must outlive every import (keep the buffer until the
//! importers say they closed it), which is why [`IpcMemHandle::open`] is `unsafe`; an exported
//! event likewise outlives its imports ([`IpcEventHandle::open`] is `unsafe`). The complete
//! two-process example is the test
//! `crates/cumem-ipc/tests/two_processes.rs`; the handle round trip looks like this:
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DeviceBuffer, DriverResource, Stream};
//! use cumem_ipc::IpcMemHandle;
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! let driver = Arc::new(DriverResource::new(&ctx)); // cuMemAlloc memory: exportable
//! let buf = DeviceBuffer::<u32>::zeroed_in(&driver, &stream, 256)?;
//! let handle = IpcMemHandle::export(&buf)?;
//! let wire = handle.to_bytes(); // send these to the other process
//! let received = IpcMemHandle::from_bytes(&wire)?;
//! assert_eq!(received.bytes(), 1024);
//! // In this process, opening fails as on a GPU: the exporter cannot import its own memory.
//! // SAFETY: `buf` outlives the attempt, and nothing else touches it meanwhile.
//! let opened = unsafe { received.open::<u32>(&stream) };
//! assert!(matches!(opened, Err(cumem_core::Error::InvalidContext { .. })));
//! # Ok::<(), cumem_core::Error>(())
//! ```

mod event;
pub mod fd_passing;
mod ffi;
mod imported;
mod imported_pool;
mod live_imports;
mod mem_handle;
mod pool_pointer;
mod shareable_pool;

pub use event::{IpcEvent, IpcEventHandle};
pub use imported::ImportedBuffer;
pub use imported_pool::ImportedPool;
pub use mem_handle::IpcMemHandle;
pub use pool_pointer::PoolPointerExport;
pub use shareable_pool::ShareablePool;
