//! The caching pool as a [`DeviceResource`]: what `DeviceBuffer`s allocate from.
//!
//! Wraps a [`CachingPool`] over a [`DeviceUpstream`] (any resource, usually `cuMemAlloc`) and
//! [`StreamOrdering`] (events and stream waits). A buffer's memory comes back on the stream the
//! buffer was last used on; the pool reuses it at once on that stream and on another stream only
//! after ordering that stream behind it. The pool keeps no table of live blocks: an allocation's
//! token names its block's segment and kind, and the free rebuilds the block from it.
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DeviceBuffer, Stream};
//! use cumem_pool::{CachingResource, PoolConfig};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::non_blocking(&ctx)?;
//! let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
//! let a = DeviceBuffer::<f32>::zeroed_in(&pool, &stream, 1000)?;
//! let first = a.device_ptr();
//! drop(a);
//! let b = DeviceBuffer::<f32>::zeroed_in(&pool, &stream, 1000)?; // the same block, from the cache
//! assert_eq!(b.device_ptr(), first);
//! assert_eq!(pool.stats().upstream_allocations, 1);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::sync::Arc;

use crate::{
    Block, CachingPool, DeviceUpstream, PoolConfig, PoolError, PoolStats, StreamKey, StreamOrdering,
    TrimReport, UpstreamError,
};
use cumem_core::{
    AllocLayout, Allocation, Context, DeviceResource, DriverResource, Error, ErrorContext, Feature,
    MemoryReport, Result, Stream,
};

/// A caching pool serving device buffers.
pub struct CachingResource {
    pool: CachingPool<DeviceUpstream, Arc<StreamOrdering>>,
    ordering: Arc<StreamOrdering>,
}

impl CachingResource {
    /// A caching pool over `upstream` (segments are taken from it and returned to it). With
    /// [`PoolConfig::expandable_segments`], the pool maps memory of `upstream`'s device instead
    /// (where the device has virtual memory management; else it warns and takes segments), and
    /// `upstream` is not asked for memory at all: an adaptor there (a
    /// [`FailureCallbackResource`](crate::FailureCallbackResource), a
    /// [`LimitingResource`](crate::LimitingResource)) does not see the mapping.
    pub fn new(upstream: Arc<dyn DeviceResource>, config: PoolConfig) -> Self {
        let ordering = Arc::new(StreamOrdering::new(upstream.context()));
        let upstream = if config.expandable_segments {
            DeviceUpstream::with_expandable(upstream)
        } else {
            DeviceUpstream::new(upstream)
        };
        let pool = CachingPool::new(upstream, ordering.clone(), config);
        CachingResource { pool, ordering }
    }

    /// A caching pool over `cuMemAlloc` of `ctx`'s device.
    pub fn with_driver(ctx: &Context, config: PoolConfig) -> Self {
        Self::new(Arc::new(DriverResource::new(ctx)), config)
    }

    /// Statistics: current and peak bytes and counts, reserved and cached bytes, the size histogram
    /// and fragmentation.
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Resets the peaks of [`stats`](Self::stats) to the current values.
    pub fn reset_peaks(&self) {
        self.pool.reset_peaks()
    }

    /// Returns every fully free cached segment to the upstream (with expandable segments, every
    /// whole free chunk), after waiting for every stream that used cached memory (on whichever
    /// device); streams the program dropped are forgotten. When nothing can be released and no
    /// memory is [stranded](crate::PoolStats::stranded_bytes) it returns an empty report at once
    /// and waits for no stream: it is not a way to synchronise.
    pub fn trim(&self) -> Result<TrimReport> {
        self.pool.trim().map_err(|e| pool_error(e, "CachingPool::trim", 0))
    }

    /// Waits for every stream that used cached memory (on whichever device) and releases cached
    /// segments down to the release threshold.
    pub fn synchronize(&self) -> Result<TrimReport> {
        self.pool.synchronize().map_err(|e| pool_error(e, "CachingPool::synchronize", 0))
    }

    fn device(&self) -> usize {
        self.ordering.context().device().ordinal()
    }

    /// The pool behind the resource, for its inspection methods.
    ///
    /// Its [`deallocate`](CachingPool::deallocate) is `unsafe`: the pool hands a block freed on a
    /// stream to that stream's next allocation at once, so a free that named another stream than
    /// the one still using the block would give a buffer's memory to another buffer while work
    /// on it is pending. Here `x`'s block, still in use by stream `a`'s work, is taken out of `a`'s
    /// cache (legal: for work on `a`) and filed under `b` with no event, and `y` gets it:
    ///
    /// ```compile_fail,E0133
    /// # cumem_sys::testing::init();
    /// use std::sync::Arc;
    /// use cumem_core::{Device, DeviceBuffer, Stream};
    /// use cumem_pool::{CachingResource, PoolConfig, StreamKey};
    /// let ctx = Device::get(0)?.context()?;
    /// let (a, b) = (Stream::non_blocking(&ctx)?, Stream::non_blocking(&ctx)?);
    /// let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    /// let x = DeviceBuffer::<u32>::zeroed_in(&pool, &a, 4096)?;
    /// let x_ptr = x.device_ptr();
    /// drop(x); // freed on `a`, where its memset may still be pending
    /// let block = pool.pool().allocate(4096 * 4, 256, StreamKey::of(&a)).unwrap();
    /// pool.pool().deallocate(block, StreamKey::of(&b)).unwrap(); // filed under `b`, no event
    /// let y = DeviceBuffer::<u32>::zeroed_in(&pool, &b, 4096)?; // `b`'s memset races `a`'s work
    /// assert_eq!(y.device_ptr(), x_ptr);
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn pool(&self) -> &CachingPool<DeviceUpstream, Arc<StreamOrdering>> {
        &self.pool
    }
}

/// The error a user sees for `e`, met by the pool operation `op` (for `bytes` bytes).
fn pool_error(e: PoolError, op: &'static str, bytes: usize) -> Error {
    let ctx = ErrorContext::op(op).bytes(bytes);
    match e {
        PoolError::ZeroSize => Error::ZeroSize { what: "allocation size" },
        PoolError::SizeOverflow { requested } => Error::SizeOverflow { count: requested, elem_size: 1 },
        // As `AllocLayout::new` reports it (a `DeviceResource` called with a hand-made layout).
        PoolError::InvalidAlignment { align } => match cumem_core::check_power_of_two(align) {
            Err(e) => e,
            Ok(()) => Error::InvalidValue { ctx },
        },
        // A power of two, only larger than the pool serves: as `DeviceBuffer` reports one.
        PoolError::AlignmentTooLarge { align, .. } => {
            Error::NotSupported { feature: Feature::Alignment(align), device: None }
        }
        PoolError::OutOfMemory { requested, allocated, reserved, free_cached, largest_free_block } => {
            let report = MemoryReport {
                requested: requested as u64,
                allocated,
                reserved,
                cached: free_cached,
                largest_free_block,
            };
            Error::OutOfMemory { ctx, report: Some(report) }
        }
        // The driver's own error, as the upstream or the stream ordering met it.
        PoolError::Upstream(UpstreamError::Driver(e)) | PoolError::Ordering(UpstreamError::Driver(e)) => e,
        // The device upstream and ordering report only driver errors; keep the code of any other.
        PoolError::Upstream(e) | PoolError::Ordering(e) => {
            tracing::warn!(error = %e, "caching pool: a non-driver upstream or ordering error");
            Error::InvalidValue { ctx }
        }
        PoolError::AddressSpaceExhausted { reservation_bytes, .. } => {
            tracing::warn!(%e, "caching pool: out of address space");
            // The error's text reads "limit reached: at most {limit} {what}": `what` says that
            // the number is the size of the reservation refused, not a cap on segments.
            match usize::try_from(reservation_bytes) {
                Ok(limit) => Error::LimitExceeded {
                    what: "bytes: a reservation of that many bytes of address space for a new \
                           expandable segment was refused (no segment had room); set \
                           PoolConfig::expandable_reservation_bytes lower",
                    limit,
                },
                // A reservation past a 32-bit address space cannot be named in a `usize`.
                Err(_) => Error::LimitExceeded {
                    what: "bytes (the address space): a larger reservation for a new expandable \
                           segment was refused (no segment had room); set \
                           PoolConfig::expandable_reservation_bytes lower",
                    limit: usize::MAX,
                },
            }
        }
        // Never asked for: the resource allocates on registered streams only.
        PoolError::RetiredStream => Error::InvalidValue { ctx },
        PoolError::MisalignedSegment { addr } => Error::Misaligned {
            what: "segment from the upstream",
            value: addr,
            align: crate::SEGMENT_ALIGN as u64,
        },
    }
}

/// The caching pool cannot order the per-thread default stream from other threads.
#[cold]
fn per_thread_refused(stream: &Stream) -> Error {
    Error::NotSupported {
        feature: Feature::Driver("the per-thread default stream with the caching pool"),
        device: Some(stream.context().device().ordinal() as i32),
    }
}

// SAFETY: the pool hands out non-overlapping ranges of segments it got from the upstream resource
// (which upholds the contract), aligned as requested; `deallocate` rebuilds the block from the
// token `allocate` returned, which the caller passes back unchanged with the same layout (its item
// 1), so it frees exactly the range handed out. A range freed on stream S is handed to another
// stream only after that stream waits for an event after S's work (recorded on S then, or the one
// S's drop recorded), and segments return to the upstream only after every named stream and every
// retired stream's event is synchronised.
unsafe impl DeviceResource for CachingResource {
    fn context(&self) -> &Context {
        self.ordering.context()
    }

    fn cache_usage(&self) -> Option<cumem_core::CacheUsage> {
        Some(self.pool.stats().cache_usage())
    }

    #[inline]
    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> Result<Allocation> {
        if StreamOrdering::is_per_thread(stream) {
            return Err(per_thread_refused(stream));
        }
        let key = self.ordering.register(stream);
        let block = self
            .pool
            .allocate(layout.bytes, layout.align, key)
            .map_err(|e| pool_error(e, "CachingPool::allocate", layout.bytes))?;
        // Fields are evaluated only when trace is enabled for this target: the fast path pays a
        // load and a branch. The stream as a `u64` (its id), as `DriverResource` and
        // `NativePoolResource` record it, so a subscriber that filters events by that field's
        // value sees one type from all three (`EnvFilter`'s field directives match spans only).
        tracing::trace!(
            device = self.device(),
            stream = stream.id(),
            bytes = layout.bytes,
            ptr = block.addr(),
            "allocate"
        );
        // The token names the block's segment, so the free rebuilds the block without a table.
        Ok(Allocation { ptr: block.addr(), token: block.token() })
    }

    #[inline]
    unsafe fn deallocate(&self, allocation: Allocation, layout: AllocLayout, stream: &Stream) {
        let ptr = allocation.ptr;
        let key = if StreamOrdering::is_per_thread(stream) {
            // Only this thread can order its per-thread stream: wait for it here, after which the
            // memory is safe for every stream.
            if let Err(e) = stream.synchronize() {
                tracing::warn!(ptr, error = %e, "synchronising the per-thread stream failed; block leaked");
                return;
            }
            StreamKey::RETIRED
        } else {
            self.ordering.register(stream)
        };
        // The caller passes back this pool's allocation unchanged (contract item 1), so the block
        // rebuilt from it is the one handed out.
        let Some(block) = Block::from_token(ptr, layout.bytes, allocation.token, self.pool.id()) else {
            tracing::warn!(
                ptr,
                bytes = layout.bytes,
                "freeing an allocation this pool did not hand out; ignored"
            );
            return;
        };
        tracing::trace!(device = self.device(), stream = stream.id(), bytes = layout.bytes, ptr, "free");
        // SAFETY: item 1: the caller's uses of the allocation are queued on `stream` or ordered
        // before its later work (its contract item 2); the pool's earlier users' work precedes the
        // allocation stream's work since `allocate`, which precedes any use on `stream` (the
        // memory is usable elsewhere only once ordered after the allocation's stream, trait item
        // 2). Item 2: `key` is the one `register` returned for `stream` just now, not a per-thread
        // default stream's: that stream was synchronised above, its work is complete, and the
        // block goes to the retired name. Item 3: no Rust value refers to the memory afterwards
        // (the caller's item 3).
        let freed = unsafe { self.pool.deallocate(block, key) };
        if let Err(foreign) = freed {
            // Cannot happen: the block was rebuilt with this pool's id.
            tracing::warn!(ptr = foreign.0.addr(), "a block of another pool; not returned");
        }
    }
}

impl std::fmt::Debug for CachingResource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingResource").field("stats", &self.pool.stats()).finish()
    }
}
