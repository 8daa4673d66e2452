//! Pool statistics, and how they are kept without a shared counter on the fast path.
//!
//! Each thread counts its own allocations and frees (whichever arena or thread cache they use) in
//! counters only it writes, with plain loads and stores; [`CachingPool::stats`] sums the threads'
//! counters on read (and those of exited threads, folded into one). Counting per thread rather than
//! per stream keeps an alloc+free pair in one counter when the free goes to the thread's cache and
//! the next allocation to an arena. Peaks need a global view, which a shared atomic would give at
//! the price of a cache line bouncing between cores (and an atomic read-modify-write) on every
//! operation. Instead each counter has a *limit*: as long as every counter stays under its limit,
//! the sum cannot exceed the recorded peak, because the limits sum to at most that peak. Only a
//! counter that crosses its limit takes the peak lock, sums all counters, records a new peak if
//! there is one and hands out the remaining slack as new limits. Peaks are
//! therefore exact whenever pool operations do not overlap in time (each one happens before the next);
//! under true concurrency a transient peak can be missed by the bytes of the racing operations.
//!
//! [`CachingPool::stats`]: crate::CachingPool::stats
//!
//! ```
//! use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig};
//!
//! let pool = CachingPool::new(HostUpstream::new(1 << 30), HostOrdering::new(), PoolConfig::default());
//! let a = pool.allocate(1000, 256, 0).unwrap();
//! let b = pool.allocate(3000, 256, 1).unwrap();
//! // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! unsafe { pool.deallocate(a, 0) }.unwrap();
//! let s = pool.stats();
//! assert_eq!((s.current_bytes, s.peak_bytes, s.current_count, s.peak_count), (3072, 4096, 1, 2));
//! // One 2 MiB small segment: stream 1 migrated the rest of stream 0's segment.
//! assert_eq!((s.reserved_bytes, pool.ordering().waits()), (2 << 20, 1));
//! assert_eq!(s.cached_bytes, s.reserved_bytes - s.current_bytes);
//! assert_eq!(s.histogram.count(1000) + s.histogram.count(3000), 2);
//! assert!(s.fragmentation() > 0.0);
//! # // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! # unsafe { pool.deallocate(b, 1) }.unwrap();
//! ```

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use parking_lot::Mutex;

use crate::HISTOGRAM_BUCKETS;

/// Counts of allocation requests by power-of-two size bucket: bucket `i` counts requests of
/// `2^i ..= 2^(i+1) - 1` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Histogram(pub [u64; HISTOGRAM_BUCKETS]);

impl Default for Histogram {
    fn default() -> Self {
        Histogram([0; HISTOGRAM_BUCKETS])
    }
}

impl Histogram {
    /// The bucket of a request of `bytes` (> 0) bytes.
    #[inline]
    pub fn bucket(bytes: usize) -> usize {
        (usize::BITS - 1 - bytes.max(1).leading_zeros()) as usize
    }
    /// Count of requests in the bucket of `bytes`.
    pub fn count(&self, bytes: usize) -> u64 {
        self.0[Self::bucket(bytes)]
    }
    /// Non-empty buckets as `(lower bound in bytes, count)`.
    pub fn nonzero(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0.iter().enumerate().filter(|&(_, &c)| c > 0).map(|(i, &c)| (1u64 << i, c))
    }
}

/// A snapshot of a pool's statistics. Byte counts of blocks are size-class rounded unless named
/// `requested`. Under concurrent use the fields are read one counter at a time, so they need not be
/// mutually consistent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes in blocks handed out and not yet freed.
    pub current_bytes: u64,
    /// Highest `current_bytes` since creation or [`reset_peaks`](crate::CachingPool::reset_peaks).
    pub peak_bytes: u64,
    /// Blocks handed out and not yet freed.
    pub current_count: u64,
    /// Highest `current_count` since creation or the last peak reset.
    pub peak_count: u64,
    /// Sum of the requested (unrounded) sizes of live blocks.
    pub requested_bytes: u64,
    /// Bytes held from the upstream (sum of live segments). A segment being released (or an
    /// expandable segment's chunk being unmapped) leaves this count before the upstream gets it
    /// back (it is taken out under the pool's locks and freed after them); until then it counts in
    /// [`returning_bytes`](Self::returning_bytes), so the
    /// upstream holds `reserved_bytes + returning_bytes` of the pool's memory (and any segment a
    /// panic leaked on its way back).
    pub reserved_bytes: u64,
    /// Highest `reserved_bytes` since creation or the last peak reset.
    pub peak_reserved_bytes: u64,
    /// Reserved bytes not handed out: `reserved_bytes - current_bytes`.
    pub cached_bytes: u64,
    /// Of `cached_bytes`, bytes freed on a stream the pool could not order other streams behind
    /// (the ordering failed: logged): they are reused by no stream, nor released, until `trim`,
    /// `synchronize` or the out-of-memory ladder has synchronised, which makes them safe for
    /// every stream and returns them to the cache.
    pub stranded_bytes: u64,
    /// The largest contiguous cached block (free range or binned block) of any stream.
    pub largest_free_block: u64,
    /// Live upstream segments.
    pub segments: u64,
    /// Successful allocations since creation.
    pub allocations_total: u64,
    /// Successful upstream allocations since creation: plain segments, and with [expandable
    /// segments](crate::expandable) each successful map (one per growth, however many chunks it
    /// maps; reservations are not counted). So with expandable segments it need not match
    /// `upstream_frees`, which counts unmapped chunks one by one.
    pub upstream_allocations: u64,
    /// Segments returned to the upstream since creation, and unmaps of expandable segments' chunks
    /// (one per chunk, where `upstream_allocations` counts one per map). A segment is counted when
    /// it is taken out of the books, just before its upstream free (see `reserved_bytes`); a chunk
    /// once it is unmapped.
    pub upstream_frees: u64,
    /// Bytes of segments (and expandable segments' chunks) taken out of the books (no longer in
    /// `reserved_bytes`) whose upstream free (unmap) has not returned yet: what the upstream still
    /// holds beyond `reserved_bytes`. Zero
    /// whenever no release or trim is under way; a segment lost to a panic on its way back is
    /// leaked (the panic is what reports it) and not counted here.
    pub returning_bytes: u64,
    /// Times the out-of-memory ladder ran (cache released, synchronised, retried).
    pub oom_ladders: u64,
    /// Allocations whose out-of-memory ladder failed: with
    /// [`PoolError::OutOfMemory`](crate::PoolError::OutOfMemory), or, with expandable segments,
    /// [`PoolError::AddressSpaceExhausted`](crate::PoolError::AddressSpaceExhausted) (counted
    /// too). One the ladder failed whose request had also met a failed migration wait counts
    /// here even though the caller gets that [`PoolError::Ordering`](crate::PoolError::Ordering).
    pub oom_errors: u64,
    /// Allocation requests by power-of-two size bucket (requested sizes).
    pub histogram: Histogram,
}

impl PoolStats {
    /// `1 - largest_free_block / cached_bytes`: 0 when all cached memory is one block (or there is
    /// none), close to 1 when it is in many small pieces. Kept in `0..=1` (under concurrent use
    /// the two fields are read at different moments).
    pub fn fragmentation(&self) -> f64 {
        self.cache_usage().fragmentation()
    }

    /// What [`DeviceResource::cache_usage`](cumem_core::DeviceResource::cache_usage) answers for
    /// these stats: reserved, cached and the largest free block.
    pub fn cache_usage(&self) -> cumem_core::CacheUsage {
        cumem_core::CacheUsage {
            reserved_bytes: self.reserved_bytes,
            cached_bytes: self.cached_bytes,
            largest_free_block: self.largest_free_block,
        }
    }

    /// `current_bytes / reserved_bytes`: how much of the memory taken from upstream is in use
    /// (1 when nothing is reserved).
    pub fn utilization(&self) -> f64 {
        if self.reserved_bytes == 0 { 1.0 } else { self.current_bytes as f64 / self.reserved_bytes as f64 }
    }
}

/// Live counters, written by one thread at a time (their thread) and read by anyone.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    bytes: AtomicI64,
    count: AtomicI64,
    limit_bytes: AtomicI64,
    limit_count: AtomicI64,
}

impl Counters {
    /// Adds to the counters (the caller is their only writer). Returns whether a limit was crossed,
    /// in which case the caller must call [`Peaks::rebalance`].
    #[inline]
    pub(crate) fn add(&self, bytes: i64, count: i64) -> bool {
        let b = self.bytes.load(Relaxed) + bytes;
        let c = self.count.load(Relaxed) + count;
        self.bytes.store(b, Relaxed);
        self.count.store(c, Relaxed);
        b > self.limit_bytes.load(Relaxed) || c > self.limit_count.load(Relaxed)
    }

    pub(crate) fn bytes(&self) -> i64 {
        self.bytes.load(Relaxed)
    }

    pub(crate) fn count(&self) -> i64 {
        self.count.load(Relaxed)
    }
}

/// The global peaks (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct Peaks {
    state: Mutex<(i64, i64)>,
}

impl Peaks {
    /// Sums all counters, records a new peak if there is one and redistributes the slack as limits.
    pub(crate) fn rebalance<'a>(&self, all: impl Iterator<Item = &'a Counters> + Clone) {
        let mut st = self.state.lock();
        let (n, b, c) =
            all.clone().fold((0i64, 0i64, 0i64), |(n, b, c), x| (n + 1, b + x.bytes(), c + x.count()));
        st.0 = st.0.max(b);
        st.1 = st.1.max(c);
        Self::distribute(*st, n, b, c, all);
    }

    /// Sets the peaks to the current sums.
    pub(crate) fn reset<'a>(&self, all: impl Iterator<Item = &'a Counters> + Clone) {
        let mut st = self.state.lock();
        let (n, b, c) =
            all.clone().fold((0i64, 0i64, 0i64), |(n, b, c), x| (n + 1, b + x.bytes(), c + x.count()));
        *st = (b, c);
        Self::distribute(*st, n, b, c, all);
    }

    /// `(peak_bytes, peak_count)`.
    pub(crate) fn get(&self) -> (i64, i64) {
        *self.state.lock()
    }

    fn distribute<'a>(peak: (i64, i64), n: i64, b: i64, c: i64, all: impl Iterator<Item = &'a Counters>) {
        let n = n.max(1);
        let (sb, sc) = ((peak.0 - b) / n, (peak.1 - c) / n);
        for x in all {
            x.limit_bytes.store(x.bytes() + sb, Relaxed);
            x.limit_count.store(x.count() + sc, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets() {
        assert_eq!(Histogram::bucket(1), 0);
        assert_eq!(Histogram::bucket(2), 1);
        assert_eq!(Histogram::bucket(1023), 9);
        assert_eq!(Histogram::bucket(1024), 10);
        assert_eq!(Histogram::bucket(usize::MAX), 63);
        let mut h = Histogram::default();
        h.0[10] = 2;
        assert_eq!(h.nonzero().collect::<Vec<_>>(), vec![(1024, 2)]);
    }

    #[test]
    fn peaks_are_exact_for_sequential_operations_across_arenas() {
        let arenas = [Counters::default(), Counters::default()];
        let peaks = Peaks::default();
        let step = |i: usize, b: i64, c: i64| {
            if arenas[i].add(b, c) {
                peaks.rebalance(arenas.iter());
            }
        };
        step(0, 100, 1); // 100
        step(1, 50, 1); // 150
        step(0, -100, -1); // 50
        step(1, 80, 1); // 130: below the peak, may or may not rebalance
        step(0, 30, 1); // 160: new peak
        assert_eq!(peaks.get(), (160, 3));
        step(1, -130, -2); // freed on the other arena: counters may go negative per arena
        step(0, -30, -1);
        assert_eq!(peaks.get(), (160, 3));
        peaks.reset(arenas.iter());
        assert_eq!(peaks.get(), (0, 0));
        step(1, 10, 1);
        assert_eq!(peaks.get(), (10, 1));
    }

    #[test]
    fn fragmentation_and_utilization() {
        let mut s = PoolStats::default();
        assert_eq!((s.fragmentation(), s.utilization()), (0.0, 1.0));
        s.reserved_bytes = 100;
        s.current_bytes = 50;
        s.cached_bytes = 50;
        s.largest_free_block = 25;
        assert_eq!((s.fragmentation(), s.utilization()), (0.5, 0.5));
    }
}
