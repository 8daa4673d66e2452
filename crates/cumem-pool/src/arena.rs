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
//! // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! unsafe { pool.deallocate(a, 7) }.unwrap();
//! // Freed on stream 7: stream 7 gets the very same block back from its bin.
//! let b = pool.allocate(4096, 256, 7).unwrap();
//! assert_eq!(b.addr(), addr);
//! # // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! # unsafe { pool.deallocate(b, 7) }.unwrap();
//! ```

use std::sync::atomic::AtomicU64;

use parking_lot::Mutex;

use crate::bins::Bins;
use crate::block::Request;
use crate::config::LARGE_ROUNDING;
use crate::free_set::{FreeSet, Seg};
use crate::size_class::{Kind, align_up_u64};

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
    /// An arena whose dedicated segments serve requests within `split_limit` (see
    /// [`ArenaInner::take`]).
    pub(crate) fn new(index: usize, split_limit: u64) -> Self {
        Arena { hash: AtomicU64::new(0), index, inner: Mutex::new(ArenaInner::new(split_limit)) }
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
    /// Free ranges of dedicated segments. Boxed: most arenas never hold one, and a third set's
    /// bitmaps inline would spread the arena's fast path over more cache lines.
    pub dedicated: Box<FreeSet>,
    /// [`PoolConfig::split_limit`](crate::PoolConfig::split_limit): which requests dedicated
    /// segments serve (see [`ArenaInner::take`]).
    split_limit: u64,
}

impl<S> ArenaInner<S> {
    fn new(split_limit: u64) -> Self {
        ArenaInner {
            stream: None,
            bins: Bins::default(),
            small: FreeSet::default(),
            large: FreeSet::default(),
            dedicated: Box::default(),
            split_limit,
        }
    }

    /// Moves everything this arena caches into `to` (a retired stream's arena into the arena of
    /// retired streams), leaving it empty.
    pub(crate) fn move_into(&mut self, to: &mut ArenaInner<S>) {
        self.flush_bins();
        for kind in Kind::ALL {
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
            Kind::Dedicated => &mut self.dedicated,
        }
    }

    /// The free set of `kind`, read-only.
    pub(crate) fn set_ref(&self, kind: Kind) -> &FreeSet {
        match kind {
            Kind::Small => &self.small,
            Kind::Large => &self.large,
            Kind::Dedicated => &self.dedicated,
        }
    }

    /// The free sets with their kinds, for what reads every cached range.
    pub(crate) fn sets(&self) -> [(&FreeSet, Kind); 3] {
        [(&self.small, Kind::Small), (&self.large, Kind::Large), (&self.dedicated, Kind::Dedicated)]
    }

    /// Takes a best fit for `req` from the free set of its kind.
    ///
    /// Dedicated segments serve only requests above the split limit, and only from a range that
    /// the block leaves at most the split limit of, or that is no longer than the segment growth
    /// would make for it (see `dedicated_fit`): a smaller block would pin a segment made for
    /// something far larger, which the out-of-memory ladder could then not give back (PyTorch's
    /// caching allocator has `max_split_size_mb` for the same reason). A
    /// [dedicated](Kind::Dedicated) request may also take a large segment's range, whichever of
    /// the two fits is smaller; then `req` becomes a large one, the kind of the segment its block
    /// lives in.
    #[inline]
    pub(crate) fn take(&mut self, req: &mut Request) -> Option<(u64, Seg)> {
        if req.kind == Kind::Dedicated
            && let Some(large) = self.large.fit_len(req.size, req.align)
            && self.dedicated_fit(req).is_none_or(|own| large < own)
        {
            req.kind = Kind::Large;
        }
        self.take_kind(req.kind, req)
    }

    /// Takes a best fit for `req` from the free set of `kind` only, as [`take`](Self::take) allows
    /// it for dedicated segments.
    #[inline]
    pub(crate) fn take_kind(&mut self, kind: Kind, req: &Request) -> Option<(u64, Seg)> {
        if kind == Kind::Dedicated {
            self.dedicated_fit(req)?;
        }
        self.set(kind).take(req.size, req.align)
    }

    /// The length of the range [`take`](Self::take) would split.
    pub(crate) fn fit_len(&self, req: &Request) -> Option<u64> {
        if req.kind != Kind::Dedicated {
            return self.set_ref(req.kind).fit_len(req.size, req.align);
        }
        match (self.dedicated_fit(req), self.large.fit_len(req.size, req.align)) {
            (Some(own), Some(large)) => Some(own.min(large)),
            (own, large) => own.or(large),
        }
    }

    /// The length of the dedicated segments' best fit for `req`, if that range may serve it: it
    /// leaves at most the split limit behind, or it is no longer than the segment growth would
    /// take for `req` (its need rounded up to [`LARGE_ROUNDING`]), so a request always fits the
    /// segment made for one like it, whatever the alignment and the limit. The best fit is the
    /// shortest range that holds the block (for an aligned request, nearly: see
    /// [`FreeSet::fit_len`]), so when it is too long, so is every other.
    fn dedicated_fit(&self, req: &Request) -> Option<u64> {
        if req.size <= self.split_limit {
            return None;
        }
        let len = self.dedicated.fit_len(req.size, req.align)?;
        let fresh = align_up_u64(req.need, LARGE_ROUNDING as u64);
        (len - req.size <= self.split_limit || fresh.is_some_and(|fresh| len <= fresh)).then_some(len)
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
    pub(crate) fn inserts(&self) -> [u64; 4] {
        [self.bins.pushes(), self.small.inserts(), self.large.inserts(), self.dedicated.inserts()]
    }

    /// The largest cached block.
    pub(crate) fn largest(&self) -> u64 {
        self.bins.largest().max(self.small.largest()).max(self.large.largest()).max(self.dedicated.largest())
    }
}
