//! An adaptor that counts what flows through any resource: bytes and allocations, current and
//! peak, a size histogram, in nested scopes.
//!
//! Wrap any [`DeviceResource`] and allocate through the wrapper; the wrapped resource does the
//! work. Scopes (as RMM's `push_counters`/`pop_counters`) measure a region of a program: a pushed
//! scope starts from zero, and when popped its counts are folded into the scope below (peaks by
//! maximum), so outer scopes still see everything.
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

use std::sync::Arc;

use cumem_core::{AllocLayout, Allocation, Context, DeviceResource, Result, Stream};
use parking_lot::Mutex;

/// Number of power-of-two size buckets (up to 2^63 bytes).
pub const HISTOGRAM_BUCKETS: usize = 64;

/// Counts of one scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScopeCounters {
    /// Bytes allocated and not yet freed (negative if the scope freed memory allocated before it).
    pub current_bytes: i64,
    /// Highest `current_bytes` seen.
    pub peak_bytes: i64,
    /// Allocations not yet freed.
    pub current_count: i64,
    /// Highest `current_count` seen.
    pub peak_count: i64,
    /// Bytes ever allocated.
    pub total_bytes: u64,
    /// Allocations ever made.
    pub total_count: u64,
    /// Allocations ever made by size: bucket `i` counts sizes in `(2^(i-1), 2^i]` (bucket 0: 1 byte).
    pub histogram: [u64; HISTOGRAM_BUCKETS],
}

impl Default for ScopeCounters {
    fn default() -> Self {
        ScopeCounters {
            current_bytes: 0,
            peak_bytes: 0,
            current_count: 0,
            peak_count: 0,
            total_bytes: 0,
            total_count: 0,
            histogram: [0; HISTOGRAM_BUCKETS],
        }
    }
}

impl ScopeCounters {
    /// The histogram bucket of an allocation of `bytes` bytes.
    pub fn bucket(bytes: usize) -> usize {
        (usize::BITS - bytes.saturating_sub(1).leading_zeros()) as usize
    }

    fn on_alloc(&mut self, bytes: usize) {
        self.current_bytes += bytes as i64;
        self.current_count += 1;
        self.peak_bytes = self.peak_bytes.max(self.current_bytes);
        self.peak_count = self.peak_count.max(self.current_count);
        self.total_bytes += bytes as u64;
        self.total_count += 1;
        self.histogram[Self::bucket(bytes).min(HISTOGRAM_BUCKETS - 1)] += 1;
    }

    fn on_free(&mut self, bytes: usize) {
        self.current_bytes -= bytes as i64;
        self.current_count -= 1;
    }

    /// Folds an inner scope into this one: its activity happened inside this scope.
    fn absorb(&mut self, inner: &ScopeCounters) {
        self.peak_bytes = self.peak_bytes.max(self.current_bytes + inner.peak_bytes);
        self.peak_count = self.peak_count.max(self.current_count + inner.peak_count);
        self.current_bytes += inner.current_bytes;
        self.current_count += inner.current_count;
        self.total_bytes += inner.total_bytes;
        self.total_count += inner.total_count;
        for (a, b) in self.histogram.iter_mut().zip(inner.histogram.iter()) {
            *a += b;
        }
    }
}

/// Counts allocations made through it, then forwards them to the wrapped resource.
#[derive(Debug)]
pub struct StatisticsResource {
    inner: Arc<dyn DeviceResource>,
    /// The scope stack; the bottom scope lives as long as the adaptor.
    scopes: Mutex<Vec<ScopeCounters>>,
}

impl StatisticsResource {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn DeviceResource>) -> Self {
        StatisticsResource { inner, scopes: Mutex::new(vec![ScopeCounters::default()]) }
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &Arc<dyn DeviceResource> {
        &self.inner
    }

    /// The counts of the innermost scope.
    pub fn counters(&self) -> ScopeCounters {
        *self.scopes.lock().last().expect("the bottom scope is never popped")
    }

    /// Starts a new innermost scope, counting from zero; returns its depth (1 for the first).
    pub fn push_scope(&self) -> usize {
        let mut scopes = self.scopes.lock();
        scopes.push(ScopeCounters::default());
        scopes.len() - 1
    }

    /// Ends the innermost scope and returns its counts, which are folded into the scope below.
    /// `None` if no scope was pushed.
    pub fn pop_scope(&self) -> Option<ScopeCounters> {
        let mut scopes = self.scopes.lock();
        if scopes.len() == 1 {
            return None;
        }
        let inner = scopes.pop()?;
        scopes.last_mut()?.absorb(&inner);
        Some(inner)
    }

    /// Runs `f` in a new scope and returns its result with the scope's counts.
    ///
    /// The scope (and any scope `f` pushed and left open) is closed even if `f` panics: its counts
    /// are then folded into the scope below, so buffers allocated before or inside it stay counted.
    pub fn with_scope<R>(&self, f: impl FnOnce() -> R) -> (R, ScopeCounters) {
        let guard = ScopeGuard { stats: self, depth: self.push_scope(), armed: true };
        let out = f();
        let counters = guard.close();
        (out, counters)
    }
}

/// Closes the scopes opened since `depth` when dropped, so that unwinding out of
/// [`StatisticsResource::with_scope`] leaves the stack as it found it.
struct ScopeGuard<'a> {
    stats: &'a StatisticsResource,
    /// Depth of the scope `with_scope` pushed: it and everything above it are closed.
    depth: usize,
    /// Cleared by [`close`](Self::close), so the drop after a normal return pops nothing (not
    /// even a scope another thread pushed in between).
    armed: bool,
}

impl ScopeGuard<'_> {
    /// Closes the scopes on the normal path and returns the counts of the one at `depth`.
    fn close(mut self) -> ScopeCounters {
        self.armed = false;
        self.pop_to_depth()
    }

    /// Pops every scope at or above `depth` and returns the counts of the one at `depth`.
    fn pop_to_depth(&self) -> ScopeCounters {
        let mut counters = ScopeCounters::default();
        // Each pop folds the popped scope into the one below; the last one popped is ours.
        while self.stats.scopes.lock().len() > self.depth {
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
        // Only while unwinding out of `f`: close the scopes the panic left open. Popping cannot
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

    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> Result<Allocation> {
        let ptr = self.inner.allocate(layout, stream)?;
        if let Some(top) = self.scopes.lock().last_mut() {
            top.on_alloc(layout.bytes);
        }
        Ok(ptr)
    }

    unsafe fn deallocate(&self, allocation: Allocation, layout: AllocLayout, stream: &Stream) {
        if let Some(top) = self.scopes.lock().last_mut() {
            top.on_free(layout.bytes);
        }
        // SAFETY: forwarded unchanged from our caller, who upholds the contract.
        unsafe { self.inner.deallocate(allocation, layout, stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two() {
        assert_eq!(ScopeCounters::bucket(1), 0);
        assert_eq!(ScopeCounters::bucket(2), 1);
        assert_eq!(ScopeCounters::bucket(3), 2);
        assert_eq!(ScopeCounters::bucket(4), 2);
        assert_eq!(ScopeCounters::bucket(5), 3);
        assert_eq!(ScopeCounters::bucket(1 << 20), 20);
    }

    #[test]
    fn inner_scopes_fold_into_outer_ones() {
        let mut outer = ScopeCounters::default();
        outer.on_alloc(100);
        let mut inner = ScopeCounters::default();
        inner.on_alloc(50);
        inner.on_alloc(30);
        inner.on_free(50);
        inner.on_free(100); // frees memory from before the scope
        outer.absorb(&inner);
        assert_eq!((outer.current_bytes, outer.current_count), (30, 1));
        assert_eq!(outer.peak_bytes, 180);
        assert_eq!((outer.total_bytes, outer.total_count), (180, 3));
        assert_eq!(inner.current_bytes, -70);
    }
}
