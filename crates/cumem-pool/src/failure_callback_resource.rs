//! An adaptor that asks a callback what to do when any resource runs out of memory: retry (after
//! the callback freed something: a cache, a pool's spare memory) or give up, at most a bounded
//! number of times per request.
//!
//! Only [`Error::OutOfMemory`] reaches the callback; every other error is returned at once. The
//! callback runs on the allocating thread, with no lock of the adaptor held, so it may free memory
//! through the same adaptor. As the upstream of a [`CachingResource`](crate::CachingResource) that
//! takes segments it runs with no lock of that pool held either (the pool calls a segment upstream
//! with none), so it may also drop buffers of that pool or trim it (an allocation from that pool
//! inside the callback may reach the callback again, recursively). With
//! [`PoolConfig::expandable_segments`](crate::PoolConfig::expandable_segments) the pool maps the
//! device's memory itself rather than allocating from this adaptor, so the callback is not
//! consulted when mapping runs out of memory (the pool's own out-of-memory ladder still runs).
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use parking_lot::Mutex;
//! use cumem_core::{Device, DeviceBuffer, DriverResource, Stream};
//! use cumem_pool::{FailureCallbackResource, LimitingResource};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! let capped = Arc::new(LimitingResource::new(Arc::new(DriverResource::new(&ctx)), 4096));
//! // A cache the program can drop when memory runs out.
//! let cache = Arc::new(Mutex::new(vec![DeviceBuffer::<u8>::zeroed_in(&capped, &stream, 4096)?]));
//! let evict = cache.clone();
//! let retrying = Arc::new(FailureCallbackResource::new(capped.clone(), 2, move |failure| {
//!     assert_eq!(failure.bytes, 1000);
//!     evict.lock().pop().is_some() // retry only if something was freed
//! }));
//! let buf = DeviceBuffer::<u8>::zeroed_in(&retrying, &stream, 1000)?;
//! assert!(cache.lock().is_empty());
//! assert_eq!((capped.used(), retrying.retries()), (1000, 1));
//! # drop(buf);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cumem_core::{AllocLayout, Allocation, Context, DeviceResource, Error, Result, Stream};

/// What the callback is told about a failed allocation.
#[derive(Debug)]
pub struct AllocationFailure<'a> {
    /// Bytes requested.
    pub bytes: usize,
    /// The stream of the request.
    pub stream: &'a Stream,
    /// Which failure of this request this is (1 for the first).
    pub attempt: u32,
    /// The error the wrapped resource returned.
    pub error: &'a Error,
}

/// The callback: `true` to retry the allocation, `false` to return the error.
type Callback = dyn Fn(&AllocationFailure<'_>) -> bool + Send + Sync;

/// Calls back on out-of-memory and retries while the callback asks, up to a bound.
pub struct FailureCallbackResource<R: ?Sized> {
    inner: Arc<R>,
    max_retries: u32,
    callback: Box<Callback>,
    retries: AtomicU64,
}

impl<R: DeviceResource + ?Sized> FailureCallbackResource<R> {
    /// Wraps `inner`; on out-of-memory `callback` decides whether to retry, at most `max_retries`
    /// times per request (after that the last error is returned without asking again).
    pub fn new(
        inner: Arc<R>,
        max_retries: u32,
        callback: impl Fn(&AllocationFailure<'_>) -> bool + Send + Sync + 'static,
    ) -> Self {
        FailureCallbackResource {
            inner,
            max_retries,
            callback: Box::new(callback),
            retries: AtomicU64::new(0),
        }
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &Arc<R> {
        &self.inner
    }

    /// Retries made so far, over all requests.
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    #[cold]
    fn on_failure(&self, layout: AllocLayout, stream: &Stream, error: Error) -> Result<Allocation> {
        let mut error = error;
        for attempt in 1..=self.max_retries {
            let failure = AllocationFailure { bytes: layout.bytes, stream, attempt, error: &error };
            if !(self.callback)(&failure) {
                tracing::debug!(bytes = layout.bytes, attempt, "failure callback: gave up");
                return Err(error);
            }
            self.retries.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(bytes = layout.bytes, attempt, "failure callback: retrying");
            match self.inner.allocate(layout, stream) {
                Ok(allocation) => return Ok(allocation),
                Err(e @ Error::OutOfMemory { .. }) => error = e,
                Err(e) => return Err(e),
            }
        }
        tracing::debug!(
            bytes = layout.bytes,
            retries = self.max_retries,
            "failure callback: retries exhausted"
        );
        Err(error)
    }
}

impl<R: fmt::Debug + ?Sized> fmt::Debug for FailureCallbackResource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FailureCallbackResource")
            .field("inner", &self.inner)
            .field("max_retries", &self.max_retries)
            .field("retries", &self.retries.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

// SAFETY: forwards every request unchanged to the wrapped resource, which upholds the contract; a
// retry is a new request, and only the allocation that succeeded is returned.
unsafe impl<R: DeviceResource + ?Sized> DeviceResource for FailureCallbackResource<R> {
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
        match self.inner.allocate(layout, stream) {
            Err(e @ Error::OutOfMemory { .. }) => self.on_failure(layout, stream, e),
            other => other,
        }
    }

    unsafe fn deallocate(&self, allocation: Allocation, layout: AllocLayout, stream: &Stream) {
        // SAFETY: forwarded unchanged from our caller, who upholds the contract.
        unsafe { self.inner.deallocate(allocation, layout, stream) }
    }
}
