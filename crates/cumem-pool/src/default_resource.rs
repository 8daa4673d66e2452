//! The pools as every device's default resource, and a way back to the current caching pool.
//!
//! `cumem-core` keeps a current resource per device (see [`cumem_core::current_resource`]), but
//! the pools live here, above it. So this crate installs, before `main`, the factory that makes a
//! device's default: the caching pool over `cuMemAlloc`, or with `CUMEM_ALLOCATOR=native` the
//! device's default driver pool (`cuMemAlloc` where the device has no pools, with a warning). A
//! program that links `cumem` (or `cumem-pool`) gets the caching pool without doing anything.
//!
//! The caching pool keeps freed memory for reuse; [`trim_current`] returns what the current pool
//! caches to the driver, and [`current_caching`] gives the pool itself (statistics, `trim`).
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, DeviceBuffer, Stream};
//! let device = Device::get(0)?;
//! let stream = Stream::new(&device.context()?)?;
//! let a = DeviceBuffer::<u8>::zeroed(&stream, 4096)?;
//! let first = a.device_ptr();
//! drop(a);
//! let b = DeviceBuffer::<u8>::zeroed(&stream, 4096)?;
//! // The caching pool, unless CUMEM_ALLOCATOR chose another default.
//! if let Some(pool) = cumem_pool::current_caching(&device)? {
//!     assert_eq!(b.device_ptr(), first); // the same block, from the cache
//!     assert!(pool.stats().reserved_bytes >= 2 << 20);
//! }
//! drop(b);
//! if let Some(report) = cumem_pool::trim_current(&device)? {
//!     assert!(report.released_bytes >= 2 << 20); // the whole segment went back to the driver
//! }
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::sync::Arc;

use cumem_core::{AllocatorKind, Context, Device, DeviceResource, DriverResource, Result};

use crate::{CachingResource, NativePoolResource, PoolConfig, TrimReport};

/// Makes the default resource of `ctx`'s device (the factory installed in `cumem-core`).
fn make_default(kind: AllocatorKind, ctx: &Context) -> Result<Arc<dyn DeviceResource>> {
    Ok(match kind {
        AllocatorKind::Caching => Arc::new(CachingResource::with_driver(ctx, PoolConfig::default())),
        AllocatorKind::Native => {
            if ctx.device().capabilities()?.memory_pools {
                Arc::new(NativePoolResource::default_pool(ctx)?)
            } else {
                tracing::warn!(
                    device = ctx.device().ordinal(),
                    "CUMEM_ALLOCATOR=native, but the device has no memory pools; using cuMemAlloc"
                );
                Arc::new(DriverResource::new(ctx))
            }
        }
        AllocatorKind::Driver => Arc::new(DriverResource::new(ctx)),
    })
}

// SAFETY: runs before `main` (the `unsafe` that `ctor` asks for); it only stores a function
// pointer in a `OnceLock`, which needs nothing of the standard library's runtime.
#[ctor::ctor(unsafe)]
fn install() {
    cumem_core::install_default_factory(make_default);
}

/// The current resource of `device` if it is a [`CachingResource`] (the default), `None` if it is
/// another kind of resource.
pub fn current_caching(device: &Device) -> Result<Option<Arc<CachingResource>>> {
    let current = cumem_core::current_resource(device)?;
    Ok(current.into_any().downcast::<CachingResource>().ok())
}

/// Returns the memory the current caching pool of `device` caches to the driver (see
/// [`CachingResource::trim`]); `None`, doing nothing, if the current resource is not a caching
/// pool.
pub fn trim_current(device: &Device) -> Result<Option<TrimReport>> {
    current_caching(device)?.map(|pool| pool.trim()).transpose()
}
