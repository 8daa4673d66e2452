//! An adaptor that counts what flows through any resource: bytes and allocations, current and
//! peak, a size histogram, in nested scopes.
//!
//! Wrap any [`DeviceResource`] and allocate through the wrapper; the wrapped resource does the
//! work. [`counters`](StatisticsResource::counters) on a thread with no scope open gives everything
//! that went through the adaptor, from every thread.
//!
//! Scopes (as RMM's `push_counters`/`pop_counters`) measure a region of a program: the code one
//! thread runs between opening a scope and closing it. A scope starts from zero and counts the
//! allocations and frees **its own thread** makes through the adaptor while it is open (a free of
//! memory allocated before it takes its `current_bytes` below zero); scopes of one thread nest,
//! and what an inner scope counts, its outer scopes and the adaptor's totals count too (peaks
//! included: an outer scope's peak is its own highest level). Threads have scopes of their own:
//! scopes that overlap in time on different threads never see each other's allocations, however
//! they interleave, and closing one closes nothing another thread opened. Work a region hands to
//! other threads (a `std::thread::scope`, a thread pool) is therefore not in its scope; those
//! threads count it in their own scopes and in the totals. A buffer allocated in a scope on one
//! thread and freed on another stays in the first scope's `current_bytes` and takes the other
//! thread's open scopes below zero (the totals are right). An async task that moves between
//! threads at an `.await` cannot keep a scope open across it, nor can a thread-pool task that
//! opens a scope in one job and closes it in another: a scope is opened and closed on one thread.
//! The scopes a thread leaves open go with it when it exits (or with the adaptor, if the thread
//! drops it).
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DeviceBuffer, DriverResource, Stream};
//! use cumem_pool::{LimitingResource, StatisticsResource};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! // Statistics over a 1 MiB cap over the driver (adaptors stack in any order).
//! let capped = Arc::new(LimitingResource::new(Arc::new(DriverResource::new(&ctx)), 1 << 20));
//! let stats = Arc::new(StatisticsResource::new(capped.clone()));
//! let a = DeviceBuffer::<u8>::zeroed_in(&stats, &stream, 1000)?;
//! let (b, inner) = stats.with_scope(|| DeviceBuffer::<u8>::zeroed_in(&stats, &stream, 24));
//! let b = b?;
//! assert_eq!((inner.current_bytes, inner.peak_bytes, inner.total_count), (24, 24, 1));
//! assert_eq!((stats.counters().current_bytes, capped.used()), (1024, 1024));
//! drop((a, b));
//! assert_eq!((stats.counters().current_bytes, stats.counters().peak_bytes), (0, 1024));
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cumem_core::{AllocLayout, Allocation, CacheUsage, Context, DeviceResource, Result, Stream};
use parking_lot::Mutex;

use crate::Histogram;

/// Number of power-of-two size buckets of a [`Histogram`] (up to 2^63 bytes).
pub const HISTOGRAM_BUCKETS: usize = 64;

/// Counts of one scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScopeCounters {
    /// Bytes allocated and not yet freed (negative if the scope freed memory allocated before it).
    pub current_bytes: i64,
    /// Highest `current_bytes` seen.
    pub peak_bytes: i64,
    /// Allocations not yet freed (negative, as `current_bytes`, if the scope freed allocations made
    /// before it or on another thread).
    pub current_count: i64,
    /// Highest `current_count` seen.
    pub peak_count: i64,
    /// Bytes ever allocated.
    pub total_bytes: u64,
    /// Allocations ever made.
    pub total_count: u64,
    /// Allocations ever made by size, in the caching pool's buckets ([`Histogram`]: bucket `i`
    /// counts `2^i ..= 2^(i+1) - 1` bytes; `histogram.count(bytes)` reads the bucket of a size).
    pub histogram: Histogram,
}

impl ScopeCounters {
    fn on_alloc(&mut self, bytes: usize) {
        self.current_bytes += bytes as i64;
        self.current_count += 1;
        self.peak_bytes = self.peak_bytes.max(self.current_bytes);
        self.peak_count = self.peak_count.max(self.current_count);
        self.total_bytes += bytes as u64;
        self.total_count += 1;
        self.histogram.0[Histogram::bucket(bytes)] += 1;
    }

    fn on_free(&mut self, bytes: usize) {
        self.current_bytes -= bytes as i64;
        self.current_count -= 1;
    }
}

/// Counts allocations made through it, then forwards them to the wrapped resource.
#[derive(Debug)]
pub struct StatisticsResource {
    inner: Arc<dyn DeviceResource>,
    /// Names this adaptor's scopes in each thread's [`SCOPES`].
    id: u64,
    /// Everything that went through the adaptor, from every thread.
    total: Mutex<ScopeCounters>,
}

/// The next [`StatisticsResource::id`].
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One thread's open scopes of one adaptor (by its id), innermost last.
type Stack = (u64, Vec<ScopeCounters>);

thread_local! {
    /// The calling thread's open scopes, per adaptor: only the thread itself opens, counts into,
    /// reads and closes them, so they need no lock, and they go with the thread (a few adaptors
    /// at most, so a list: no hashing on the allocation path).
    static SCOPES: RefCell<Vec<Stack>> = const { RefCell::new(Vec::new()) };
}

impl StatisticsResource {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn DeviceResource>) -> Self {
        StatisticsResource { inner, id: NEXT_ID.fetch_add(1, Ordering::Relaxed), total: Mutex::default() }
    }

    /// `f` of the calling thread's open scopes of this adaptor; `R::default()` when it has none
    /// open, or once its thread-local storage is gone (a buffer dropped by another thread-local's
    /// destructor: the thread has no scopes any more).
    fn with_mine<R: Default>(&self, f: impl FnOnce(&mut Vec<ScopeCounters>) -> R) -> R {
        SCOPES
            .try_with(|scopes| {
                // Never borrowed across a call out of this module, so the borrow does not fail.
                let mut scopes = scopes.try_borrow_mut().ok()?;
                let (_, stack) = scopes.iter_mut().find(|(id, _)| *id == self.id)?;
                Some(f(stack))
            })
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// Applies `f` to the totals and to every scope the calling thread has open.
    fn count(&self, f: impl Fn(&mut ScopeCounters)) {
        f(&mut self.total.lock());
        self.with_mine(|stack| stack.iter_mut().for_each(&f));
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &Arc<dyn DeviceResource> {
        &self.inner
    }

    /// How fragmented the wrapped resource's cache is ([`CacheUsage::fragmentation`]: 0 when
    /// its cached memory is one block, towards 1 as it splits), when it caches and can tell (a
    /// caching pool, also under other adaptors); `None` for one that does not (the driver) or
    /// cannot (the driver's pools). It reads a caching pool's stats: not from a tracing subscriber
    /// of the events an expandable upstream emits under the pool's locks (docs/pools.md).
    ///
    /// ```
    /// # cumem_sys::testing::init();
    /// use std::sync::Arc;
    /// use cumem_core::{Device, DeviceBuffer, DriverResource, Stream};
    /// use cumem_pool::{CachingResource, PoolConfig, StatisticsResource};
    /// let ctx = Device::get(0)?.context()?;
    /// let stream = Stream::new(&ctx)?;
    /// let caching = StatisticsResource::new(Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default())));
    /// assert_eq!(caching.fragmentation(), Some(0.0));
    /// let driver = StatisticsResource::new(Arc::new(DriverResource::new(&ctx)));
    /// assert_eq!(driver.fragmentation(), None);
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn fragmentation(&self) -> Option<f64> {
        self.inner.cache_usage().map(|usage| usage.fragmentation())
    }

    /// The counts of the calling thread's innermost open scope; with none open, the counts of
    /// everything that went through the adaptor.
    pub fn counters(&self) -> ScopeCounters {
        self.with_mine(|stack| stack.last().copied()).unwrap_or_else(|| *self.total.lock())
    }

    /// Opens a new innermost scope on the calling thread, counting from zero; returns how many
    /// scopes the thread has open with it (1 for the first). On a thread whose thread-local
    /// storage is being destroyed (in a thread-local's destructor, once the scopes' own storage
    /// is gone) no scope opens and 0 is returned.
    pub fn push_scope(&self) -> usize {
        let pushed = SCOPES.try_with(|scopes| {
            let Ok(mut scopes) = scopes.try_borrow_mut() else { return 0 };
            match scopes.iter_mut().find(|(id, _)| *id == self.id) {
                Some((_, stack)) => {
                    stack.push(ScopeCounters::default());
                    stack.len()
                }
                None => {
                    scopes.push((self.id, vec![ScopeCounters::default()]));
                    1
                }
            }
        });
        pushed.unwrap_or(0)
    }

    /// Closes the calling thread's innermost scope and returns its counts (which its outer scopes
    /// and the totals already hold). `None` if the thread has no scope open.
    pub fn pop_scope(&self) -> Option<ScopeCounters> {
        SCOPES
            .try_with(|scopes| {
                let mut scopes = scopes.try_borrow_mut().ok()?;
                let at = scopes.iter().position(|(id, _)| *id == self.id)?;
                let stack = &mut scopes[at].1;
                let scope = stack.pop();
                if stack.is_empty() {
                    scopes.swap_remove(at);
                }
                scope
            })
            .ok()
            .flatten()
    }

    /// How many scopes the calling thread has open.
    fn depth(&self) -> usize {
        self.with_mine(|stack| stack.len())
    }

    /// Runs `f` in a new scope of the calling thread and returns its result with the scope's
    /// counts: what this thread allocated and freed through the adaptor while `f` ran.
    ///
    /// The scope (and any scope `f` opened and left open) is closed even if `f` panics; buffers
    /// allocated inside it stay counted in the outer scopes and the totals.
    pub fn with_scope<R>(&self, f: impl FnOnce() -> R) -> (R, ScopeCounters) {
        let guard = ScopeGuard { stats: self, depth: self.push_scope(), armed: true };
        let out = f();
        let counters = guard.close();
        (out, counters)
    }
}

impl Drop for StatisticsResource {
    fn drop(&mut self) {
        // The dropping thread's scopes of this adaptor go now; another thread's go when it exits
        // (nothing reads them any more: ids are never reused).
        let _ = SCOPES.try_with(|scopes| {
            if let Ok(mut scopes) = scopes.try_borrow_mut() {
                scopes.retain(|(id, _)| *id != self.id);
            }
        });
    }
}

/// Closes the calling thread's scopes opened since `depth` when dropped, so that unwinding out of
/// [`StatisticsResource::with_scope`] leaves the thread's scopes as it found them.
struct ScopeGuard<'a> {
    stats: &'a StatisticsResource,
    /// Depth of the scope `with_scope` opened: it and everything above it are closed.
    depth: usize,
    /// Cleared by [`close`](Self::close), so the drop after a normal return closes nothing.
    armed: bool,
}

impl ScopeGuard<'_> {
    /// Closes the scopes on the normal path and returns the counts of the one at `depth`.
    fn close(mut self) -> ScopeCounters {
        self.armed = false;
        self.pop_to_depth()
    }

    /// Closes every scope of this thread at or above `depth` and returns the counts of the one at
    /// `depth`.
    fn pop_to_depth(&self) -> ScopeCounters {
        let mut counters = ScopeCounters::default();
        // The last one closed is ours.
        while self.stats.depth() >= self.depth {
            match self.stats.pop_scope() {
                Some(c) => counters = c,
                None => break,
            }
        }
        counters
    }
}

impl Drop for ScopeGuard<'_> {
    fn drop(&mut self) {
        // Only while unwinding out of `f`: close the scopes the panic left open. Closing cannot
        // panic (no indexing, no unwrap), so this never aborts an unwinding thread.
        if self.armed {
            self.pop_to_depth();
        }
    }
}

// SAFETY: forwards every request unchanged to the wrapped resource, which upholds the contract.
unsafe impl DeviceResource for StatisticsResource {
    fn context(&self) -> &Context {
        self.inner.context()
    }

    fn usable_on_every_stream_at_once(&self) -> bool {
        self.inner.usable_on_every_stream_at_once()
    }

    fn cache_usage(&self) -> Option<CacheUsage> {
        self.inner.cache_usage()
    }

    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> Result<Allocation> {
        let ptr = self.inner.allocate(layout, stream)?;
        self.count(|scope| scope.on_alloc(layout.bytes));
        Ok(ptr)
    }

    unsafe fn deallocate(&self, allocation: Allocation, layout: AllocLayout, stream: &Stream) {
        self.count(|scope| scope.on_free(layout.bytes));
        // SAFETY: forwarded unchanged from our caller, who upholds the contract.
        unsafe { self.inner.deallocate(allocation, layout, stream) }
    }
}
