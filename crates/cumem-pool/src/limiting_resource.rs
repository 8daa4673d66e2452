//! An adaptor that caps the bytes live through any resource: a request that would go over the cap
//! fails with [`Error::OutOfMemory`] before the wrapped resource sees it.
//!
//! The error's report names the cap (as `reserved`: all the adaptor may ever hold), the bytes live
//! through it (`allocated`) and the request (`requested`), so a program can tell its own budget
//! from the device running out. Bytes are counted as requested, so the cap bounds what the program
//! asked for; a pool underneath may hold more (its rounding and cache).
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DeviceBuffer, DriverResource, Error, Stream};
//! use cumem_pool::{LimitingResource, StatisticsResource};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! // A 1 MiB budget, counted by a statistics adaptor underneath (only what the cap lets through).
//! let stats = Arc::new(StatisticsResource::new(Arc::new(DriverResource::new(&ctx))));
//! let capped = Arc::new(LimitingResource::new(stats.clone(), 1 << 20));
//! let a = DeviceBuffer::<u8>::zeroed_in(&capped, &stream, 768 << 10)?;
//! match DeviceBuffer::<u8>::zeroed_in(&capped, &stream, 512 << 10) {
//!     Err(Error::OutOfMemory { report: Some(r), .. }) => {
//!         assert_eq!((r.requested, r.allocated, r.reserved), (512 << 10, 768 << 10, 1 << 20));
//!     }
//!     other => panic!("expected the cap to refuse, got {other:?}"),
//! }
//! assert_eq!((capped.used(), stats.counters().total_count), (768 << 10, 1));
//! drop(a);
//! assert_eq!(capped.used(), 0);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cumem_core::{
    AllocLayout, Allocation, Context, DeviceResource, Error, ErrorContext, MemoryReport, Result, Stream,
};

/// Refuses requests that would take the bytes live through it above a cap, then forwards the rest.
#[derive(Debug)]
pub struct LimitingResource<R: ?Sized> {
    inner: Arc<R>,
    limit: usize,
    used: AtomicUsize,
}

impl<R: DeviceResource + ?Sized> LimitingResource<R> {
    /// Wraps `inner`, letting at most `limit` bytes be live through the adaptor at once.
    pub fn new(inner: Arc<R>, limit: usize) -> Self {
        LimitingResource { inner, limit, used: AtomicUsize::new(0) }
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &Arc<R> {
        &self.inner
    }

    /// The cap, in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes live through the adaptor now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Takes `bytes` of the budget, or reports what stood in the way.
    fn reserve(&self, bytes: usize) -> std::result::Result<(), usize> {
        self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
            used.checked_add(bytes).filter(|&after| after <= self.limit)
        })?;
        Ok(())
    }

    #[cold]
    fn over_limit(&self, bytes: usize, used: usize) -> Error {
        let report = MemoryReport {
            requested: bytes as u64,
            allocated: used as u64,
            reserved: self.limit as u64,
            cached: 0,
            largest_free_block: self.limit.saturating_sub(used) as u64,
        };
        let device = self.inner.context().device().ordinal() as i32;
        tracing::debug!(device, bytes, used, limit = self.limit, "limiting adaptor: over the cap");
        Error::OutOfMemory {
            ctx: ErrorContext::op("LimitingResource::allocate (over its cap, reported as `reserved`)")
                .bytes(bytes)
                .device(device),
            report: Some(report),
        }
    }
}

/// Gives `bytes` of the budget back when dropped: on every way out of a request except success.
struct Refund<'a> {
    used: &'a AtomicUsize,
    bytes: usize,
}

impl Drop for Refund<'_> {
    fn drop(&mut self) {
        self.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

// SAFETY: forwards every request it lets through unchanged to the wrapped resource, which upholds
// the contract; refusing a request hands out nothing.
unsafe impl<R: DeviceResource + ?Sized> DeviceResource for LimitingResource<R> {
    fn context(&self) -> &Context {
        self.inner.context()
    }

    fn usable_on_every_stream_at_once(&self) -> bool {
        self.inner.usable_on_every_stream_at_once()
    }

    fn cache_usage(&self) -> Option<cumem_core::CacheUsage> {
        self.inner.cache_usage()
    }

    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> Result<Allocation> {
        if let Err(used) = self.reserve(layout.bytes) {
            return Err(self.over_limit(layout.bytes, used));
        }
        // Given back unless the wrapped resource hands out the memory: when it fails, and when it
        // panics (a failure callback below that panics), so the budget never shrinks for good.
        let refund = Refund { used: &self.used, bytes: layout.bytes };
        let allocation = self.inner.allocate(layout, stream)?;
        std::mem::forget(refund);
        Ok(allocation)
    }

    unsafe fn deallocate(&self, allocation: Allocation, layout: AllocLayout, stream: &Stream) {
        // SAFETY: forwarded unchanged from our caller, who upholds the contract.
        unsafe { self.inner.deallocate(allocation, layout, stream) };
        self.used.fetch_sub(layout.bytes, Ordering::AcqRel);
    }
}
