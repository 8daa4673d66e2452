//! A per-stream arena: the free memory one stream may reuse without any synchronisation.
//!
//! Everything in an arena was last used on (freed on, or migrated to) the arena's stream, so an
//! allocation on that stream may take it at once: stream order protects it. The arena holds the
//! front-cache [`Bins`] and one [`FreeSet`] per segment kind behind its own mutex. Arenas of
//! different streams share nothing; live counts are kept per thread (see [`crate::stats`]).
//!
//! ```
//! use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig};
//!
//! let pool = CachingPool::new(HostUpstream::new(1 << 30), HostOrdering::new(), PoolConfig::default());
//! let a = pool.allocate(4096, 256, 7).unwrap();
//! let addr = a.addr();
//! pool.deallocate(a, 7).unwrap();
//! // Freed on stream 7: stream 7 gets the very same block back from its bin.
//! let b = pool.allocate(4096, 256, 7).unwrap();
//! assert_eq!(b.addr(), addr);
//! # pool.deallocate(b, 7).unwrap();
//! ```

use std::sync::atomic::AtomicU64;

use parking_lot::Mutex;

use crate::bins::Bins;
use crate::free_set::FreeSet;
use crate::size_class::Kind;

/// One stream's arena. Aligned to two cache lines so that arenas of different streams never share one.
///
/// An arena is never freed while its pool lives, but it can be *vacated* (its stream retired) and
/// reused for another stream, so which stream it serves is read under its lock.
#[repr(align(128))]
#[derive(Debug)]
pub(crate) struct Arena<S> {
    /// Hash of the stream served (0 when vacant): lets a lookup skip arenas of other streams without
    /// taking their lock. Only a hint; the stream itself is checked under the lock.
    pub hash: AtomicU64,
    /// Position in the pool's arena list (lock order).
    pub index: usize,
    /// The arena's stream and free memory.
    pub inner: Mutex<ArenaInner<S>>,
}

impl<S> Arena<S> {
    pub(crate) fn new(index: usize) -> Self {
        Arena { hash: AtomicU64::new(0), index, inner: Mutex::new(ArenaInner::new()) }
    }
}

/// The locked part of an arena.
#[derive(Debug)]
pub(crate) struct ArenaInner<S> {
    /// The stream whose order protects everything in this arena; `None` while the arena is vacant.
    pub stream: Option<S>,
    /// Exact-size small blocks, not coalesced.
    pub bins: Bins,
    /// Free ranges of small segments.
    pub small: FreeSet,
    /// Free ranges of large segments.
    pub large: FreeSet,
}

impl<S> ArenaInner<S> {
    fn new() -> Self {
        ArenaInner {
            stream: None,
            bins: Bins::default(),
            small: FreeSet::default(),
            large: FreeSet::default(),
        }
    }

    /// Moves everything this arena caches into `to` (a retired stream's arena into the arena of
    /// retired streams), leaving it empty.
    pub(crate) fn move_into(&mut self, to: &mut ArenaInner<S>) {
        self.flush_bins();
        for kind in [Kind::Small, Kind::Large] {
            for (addr, len, seg) in self.set(kind).drain() {
                to.set(kind).insert(addr, len, seg);
            }
        }
    }
    /// The free set of a segment kind.
    #[inline]
    pub(crate) fn set(&mut self, kind: Kind) -> &mut FreeSet {
        match kind {
            Kind::Small => &mut self.small,
            Kind::Large => &mut self.large,
        }
    }

    /// Moves every binned block into the small free set, coalescing.
    pub(crate) fn flush_bins(&mut self) {
        if self.bins.bytes() > 0 {
            let small = &mut self.small;
            self.bins.drain(|addr, len, seg| small.insert(addr, len, seg));
        }
    }

    /// The arena's insert counters: its bins' pushes and both free sets' inserts. Every way memory
    /// that may be under work enters the arena (a free, a flush of a thread cache or of the bins,
    /// a sweep moving a retired stream's memory here, reclaimed stranded blocks, a failed wait
    /// putting a block back) bumps one of them, and none is ever reset (an arena is vacated,
    /// never dropped), so equal counters read under two locks mean nothing entered the arena in
    /// between that may be under work of any stream. Not counted: memory safe for every stream
    /// without a wait: fresh memory (a new segment, a newly mapped chunk of an expandable one)
    /// and moves between arenas under every arena lock after a synchronisation that followed
    /// every free in them (consolidation, gathering, the pieces a trim leaves around an unmapped
    /// gap); see [`FreeSet::insert_uncounted`](crate::free_set::FreeSet::insert_uncounted).
    pub(crate) fn inserts(&self) -> [u64; 3] {
        [self.bins.pushes(), self.small.inserts(), self.large.inserts()]
    }

    /// The largest cached block.
    pub(crate) fn largest(&self) -> u64 {
        self.bins.largest().max(self.small.largest()).max(self.large.largest())
    }
}
