//! The caching pool: per-stream arenas, cross-stream migration, the out-of-memory ladder and trim.
//!
//! An allocation on stream `T` tries, in order: the calling thread's cache of blocks freed on `T`
//! (no lock, see [`caching_thread_cache`](crate::caching_thread_cache)); `T`'s front-cache bin for
//! its size class (O(1)); a best fit in `T`'s free ranges (O(log n)); the same after flushing `T`'s
//! bins; the same after moving this thread's cache to the arenas; *migration*: a best
//! fit taken from another stream `S`'s arena, after `ordering.wait(T, S)`; a new segment from the
//! upstream (for a request above [`PoolConfig::split_limit`](crate::PoolConfig::split_limit), a
//! [dedicated](crate::size_class::Kind::Dedicated) segment of its own size, whose free memory later
//! serves only such requests); and finally the out-of-memory ladder (synchronise, coalesce all
//! cached memory across streams and retry, including memory of the other segment kinds; release
//! every fully free segment and retry the upstream with the minimal segment; with plain segments,
//! synchronise again and take a dedicated segment's range for any request; report). The ladder
//! synchronises with no lock held, then takes every arena lock and synchronises again (unlocked)
//! if memory was freed into the pool meanwhile, and holds the locks until it has decided what to
//! release; with segments, it gives them back and asks the upstream for the minimal one with no
//! lock held (the upstream may run user code that frees into this pool or trims it). With
//! [expandable segments](crate::expandable) the driver's calls that grow (reserve, map) run under
//! the locks, while those that shrink (unmap, release of an emptied reservation) run with none
//! held (see "Locking" on [`CachingPool`]). A free on stream `S` keeps a
//! small block in the calling thread's cache under `S`, else puts the block into `S`'s arena,
//! whichever stream allocated it.
//!
//! ```
//! use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig};
//!
//! let pool = CachingPool::new(HostUpstream::new(64 << 20), HostOrdering::new(), PoolConfig::default());
//! let a = pool.allocate(1 << 20, 256, 1).unwrap(); // stream 1
//! let addr = a.addr();
//! // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! unsafe { pool.deallocate(a, 1) }.unwrap();
//! // Stream 2 misses, migrates stream 1's free memory and orders itself after stream 1.
//! let b = pool.allocate(1 << 20, 256, 2).unwrap();
//! assert_eq!((b.addr(), pool.ordering().waits()), (addr, 1));
//! // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! unsafe { pool.deallocate(b, 2) }.unwrap();
//! let report = pool.trim().unwrap();
//! assert_eq!((report.released_bytes, pool.upstream().live_bytes()), (2 << 20, 0));
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::arena::{Arena, ArenaInner};
use crate::bins::BinEntry;
use crate::block::Request;
use crate::caching_thread_cache::{Entry, Put, Registry, THREAD_CACHE_MAX_BLOCK, ThreadCache};
use crate::free_set::Seg;
use crate::segment::Segments;
use crate::size_class::{FINE_LIMIT, Kind, QUANTUM, SMALL_LIMIT, bin_bytes, bin_of};
use crate::stats::{Peaks, PoolStats};
use crate::table::{ArenaTable, TableState};
use crate::{
    Block, ExpandableUpstream, ForeignBlock, Ordering, PoolConfig, PoolError, SEGMENT_ALIGN, Upstream,
    expandable,
};

static NEXT_POOL_ID: AtomicU32 = AtomicU32::new(1);

/// Streams in use at once that get an arena of their own in a pool made by
/// [`CachingPool::new`]; more streams still work (see "No stream limit").
pub const STREAM_ARENAS: usize = 1024;

/// The most arenas a table holds (its index is 32-bit).
const MAX_STREAM_ARENAS: usize = (1 << 24) - 1;

type Guards<'a, S> = Vec<MutexGuard<'a, ArenaInner<S>>>;

/// The table's mutex and every arena lock, as [`CachingPool::lock_all`] takes them.
type AllLocks<'a, S> = (MutexGuard<'a, TableState>, Guards<'a, S>);

/// What [`CachingPool::trim`], [`trim_to`](CachingPool::trim_to) and
/// [`synchronize`](CachingPool::synchronize) gave back to the upstream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrimReport {
    /// Segments released.
    pub released_segments: u64,
    /// Bytes released.
    pub released_bytes: u64,
}

/// A caching memory pool over an [`Upstream`], with stream-ordered reuse through an [`Ordering`].
///
/// # Stream safety
/// A block freed on stream `S` is reused at once by allocations on `S` (from the freeing thread's
/// cache or `S`'s arena). It is given to another stream
/// `T` only after `ordering.wait(T, S)` was called following the free (lazily, when `T` needs the
/// memory), or after `ordering.synchronize()` returned following the free. Segments are returned to the
/// upstream only after `ordering.synchronize()` following every free in them.
///
/// # Retired streams
/// When the ordering reports streams the program dropped ([`Ordering::orphans`]: nothing new can be
/// queued on them), the pool retires them on slow paths (a new
/// stream when the table is full or the number of streams doubled, `trim`, the release threshold,
/// the ladder): `ordering.retire(S)` makes `wait(T, retired)` cover S's work so far, S's cached
/// memory moves to the arena of the retired name, and S's arena is reused.
///
/// # No stream limit
/// The first [`STREAM_ARENAS`] streams in use at once get an arena each (see
/// [`with_stream_arenas`](Self::with_stream_arenas)); beyond that, when no dropped stream can be
/// retired to make room, a stream shares the first arena: it takes a block from it, then waits
/// for that arena's stream (memory freed into the arena while it grows the pool is not taken
/// without another wait; the new segment needs none), and its frees (when they
/// reach the arenas rather than the thread's cache) first order the memory for everyone (an event
/// through `retire` where the ordering retires streams, else a synchronisation). Slower, never an
/// error.
///
/// # Locking
/// The fast path (a thread-cache hit) takes no lock. Each stream's arena has its own mutex; an
/// arena allocation or free takes only that one and looks the arena up without locking. Migration
/// locks one other arena at a time, and takes its block out under that lock but orders itself
/// after the arena's stream ([`Ordering::wait`]) with no lock held: the wait's driver calls
/// (event record, stream wait) block while another thread is in `cuMemFree`, which waits for
/// host functions, and a host function may free into the pool. So does a stream sharing the
/// first arena, and growth of an expandable segment by such a stream (it locks the arena again
/// and waits again, unlocked, if memory was freed into it meanwhile). The ladder, `trim`, `synchronize`, `validate` and sweeps first
/// flush the thread caches (under the cache registry's mutex alone), then take the table's mutex,
/// lock arenas in position order, then the segment registry; `stats` locks arenas one at a time.
/// `trim` and `synchronize` synchronise the streams ([`Ordering::synchronize`], which on a device
/// waits for host functions) with every lock let go, and so does the out-of-memory ladder: they
/// note each arena's insert counters under the locks, synchronise, lock again, and synchronise
/// again (unlocked) if memory that may be under work was put into any arena meanwhile (a counted
/// insert: moves of idle memory and fresh segments are not counted), so that what they release, and
/// what the ladder hands to its stream from any arena (or joins to a mapped chunk), was freed
/// before a synchronisation started. Each retry means another thread freed into the pool
/// meanwhile; after four races `trim` and `synchronize` release nothing, and the ladder only
/// asks the upstream for a new plain segment (with expandable segments it reports out of
/// memory), so that they end under sustained traffic. A sweep's [`Ordering::retire`] runs under
/// those locks; for a stream whose drop recorded its event (the usual case) it records none, else
/// it records one, and it queries the events of streams retired before: those complete are
/// destroyed ([`Ordering::drop_deferred`]) once the locks are let go.
/// The cache registry's mutex comes after arena locks. The upstream's `allocate` and `deallocate`
/// (segment upstreams) are called with no lock held (segments to release are first taken out of
/// the arenas and the books, under the locks, after the synchronisation). With expandable
/// segments, these run under the arena locks and the segment registry: [`Upstream::expandable`]
/// and the [`ExpandableUpstream`]'s `reserve` and `map` (and `release` of a reservation growth
/// could not use), the driver's own calls (such an upstream must not call into the pool, see its
/// contract). Its `unmap` and the `release` of a reservation left empty run with no lock held, as
/// segment frees do: the driver brief lists `cuMemUnmap` as synchronous (an H100's waits for no
/// unrelated stream, observed on 2026-11-24, but an upstream's `unmap` may take long and may use
/// the pool). The chunks are taken out of the arenas and
/// the books first, under the locks after the synchronisation, and recorded as unmapped under
/// the locks taken again afterwards.
pub struct CachingPool<U: Upstream, O: Ordering> {
    id: u32,
    upstream: U,
    ordering: O,
    config: PoolConfig,
    /// [`PoolConfig::split_limit`], or `None` when the pool grows expandable segments (which unmap
    /// free chunks wherever they are, so fragmentation does not keep memory from the device).
    split_limit: Option<u64>,
    arenas: ArenaTable<O::Stream>,
    /// Per-thread caches of recently freed small blocks (the fast path).
    caches: Registry<O::Stream>,
    /// The ordering's name for retired streams (no allocation ever uses it).
    retired: Option<O::Stream>,
    segments: Mutex<Segments>,
    /// Segments taken out of the books but not yet back with the upstream.
    returning: Returning,
    peaks: Peaks,
}

/// Segments [`release`](CachingPool::release) took out of the books whose upstream free has not
/// finished yet. A ladder without expandable segments whose growth fails (after it has given its
/// own released segments back) waits for the frees in flight when it starts waiting (each free
/// is a ticket; frees started later are not waited for, so threads trimming back to back cannot
/// keep it waiting), for at most [`PoolConfig::oom_free_wait`], and asks the upstream once more if
/// a free returned memory since it asked: that memory is about to be back with the upstream (before frees were made with no
/// lock held, the ladder would have waited for the locks instead). A ladder with expandable
/// segments whose growth fails (out of memory or of address space) waits likewise for the unmaps
/// in flight (each stretch of chunks taken out is a ticket; one whose reservation was left empty
/// until that is released), then grows once more; none waits when run from inside an upstream
/// free, unmap or release. An allocation that needs memory an unmap is returning for longer than
/// the wait fails with out of memory (before unmaps were made with no lock held, it waited for
/// the locks as long as the unmap took).
#[derive(Default)]
struct Returning {
    state: Mutex<ReturningState>,
    done: Condvar,
}

#[derive(Default)]
struct ReturningState {
    /// The ticket the next free gets.
    next: u64,
    /// The frees in flight: ticket → bytes.
    in_flight: BTreeMap<u64, u64>,
    /// Their bytes in all.
    bytes: u64,
    /// How many frees have returned their memory so far (leaked segments do not count).
    finished: u64,
}

thread_local! {
    /// How many upstream frees and unmaps (`give_back`, `unmap_unlocked`, of any pool) this
    /// thread is inside: an upstream call that uses a pool must not wait for the frees and unmaps
    /// in flight, its own among them.
    static GIVING_BACK: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// This thread is inside an upstream free or unmap (see `GIVING_BACK`) until dropped, even if
/// the upstream panics.
struct Giving;

impl Giving {
    fn enter() -> Self {
        GIVING_BACK.with(|g| g.set(g.get() + 1));
        Giving
    }
}

impl Drop for Giving {
    fn drop(&mut self) {
        GIVING_BACK.with(|g| g.set(g.get() - 1));
    }
}

impl Returning {
    /// A free of `bytes` is in flight: its ticket.
    fn start(&self, bytes: u64) -> u64 {
        let mut st = self.state.lock();
        let ticket = st.next;
        st.next += 1;
        st.in_flight.insert(ticket, bytes);
        st.bytes += bytes;
        ticket
    }

    /// The free with `ticket` is over: the segment is back with the upstream if `freed`, else
    /// leaked (a panic cut it short), which brings no memory back for a ladder to retry with.
    fn finish(&self, ticket: u64, freed: bool) {
        let mut st = self.state.lock();
        if let Some(bytes) = st.in_flight.remove(&ticket) {
            st.bytes -= bytes;
            st.finished += u64::from(freed);
        }
        drop(st);
        self.done.notify_all();
    }

    /// How many segment frees have returned their memory to the upstream so far.
    fn finished(&self) -> u64 {
        self.state.lock().finished
    }

    /// After a failed growth: waits (no lock of the pool held), for at most `wait`, for the frees
    /// in flight now, unless this thread is inside one; whether a free returned memory since
    /// `seen` (from [`finished`](Self::finished) before the growth), so that growing again may
    /// succeed.
    ///
    /// Bounded because a free may wait for the allocating thread itself: `cuMemFree` waits for
    /// the whole device, host functions included (driver brief §17), and a host function may wait
    /// for something the allocating thread does after its allocation returns.
    fn wait_for_frees(&self, seen: u64, wait: Duration) -> bool {
        if GIVING_BACK.with(|g| g.get()) == 0 {
            self.wait_for_in_flight(wait);
        }
        self.state.lock().finished != seen
    }

    /// Waits, for at most `wait`, until the frees in flight now are over.
    fn wait_for_in_flight(&self, wait: Duration) {
        let (started, frees, bytes) = {
            let st = self.state.lock();
            (st.next, st.in_flight.len(), st.bytes)
        };
        // `Duration::ZERO`: no waiting, and nothing to say about it.
        if frees == 0 || wait.is_zero() {
            return;
        }
        // Logged with the lock let go, here and below: a subscriber may read the pool's stats,
        // which take it. The frees waited for are fixed already (tickets below `started`).
        tracing::debug!(frees, bytes, "waiting for segment frees in flight");
        // `None` (past what an `Instant` can hold): no bound.
        let deadline = Instant::now().checked_add(wait);
        let mut st = self.state.lock();
        let mut timed_out = false;
        while st.in_flight.first_key_value().is_some_and(|(&t, _)| t < started) {
            match deadline {
                Some(deadline) => {
                    if self.done.wait_until(&mut st, deadline).timed_out() {
                        timed_out = true;
                        break;
                    }
                }
                None => self.done.wait(&mut st),
            }
        }
        drop(st);
        if timed_out {
            tracing::debug!("segment frees still in flight after {wait:?}; not waiting longer");
        }
    }
}

/// Segments [`release`](CachingPool::release) took out of the books, on their way to the upstream
/// ([`give_back`](CachingPool::give_back)). Each one counts as a free in flight from the moment it
/// leaves the books; whatever is dropped here without having been freed (a panic on the way) stops
/// counting, so that no ladder waits for it. Such a segment is leaked: the pool no longer knows
/// it, and the upstream keeps it.
struct InFlight<'a> {
    returning: &'a Returning,
    /// `(addr, len, ticket)`; those before `freed` are back with the upstream.
    segs: Vec<(u64, u64, u64)>,
    freed: usize,
}

impl<'a> InFlight<'a> {
    fn new(returning: &'a Returning) -> Self {
        Self { returning, segs: Vec::new(), freed: 0 }
    }

    fn push(&mut self, addr: u64, len: u64) {
        // Room first: a ticket not in `segs` would never be settled.
        self.segs.reserve(1);
        let ticket = self.returning.start(len);
        self.segs.push((addr, len, ticket));
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let left = &self.segs[self.freed..];
        if left.is_empty() {
            return;
        }
        // Settled, so that no ladder waits for them.
        for &(_, _, ticket) in left {
            self.returning.finish(ticket, false);
        }
        // Nothing is logged: segments are left only when a panic cut `release`, its caller or
        // `give_back` short, so this runs while unwinding, where a subscriber that panicked would
        // abort the process, and the panic itself is reported anyway.
    }
}

/// What [`release`](CachingPool::release) took out of the books of the expandable segments, for
/// [`unmap_unlocked`](CachingPool::unmap_unlocked) to unmap and release with no lock held: whole
/// free chunks, and reservations with nothing mapped. Each stretch of chunks counts as a free in
/// flight from the moment it leaves the books until it is settled. Whatever is dropped here
/// unsettled (a panic on the way, the upstream's `unmap` panicking) stops counting: its chunks
/// stay `leaving` (out of every free set, still marked mapped, so growth never maps there and
/// the reservation is never taken for empty), and the pool's teardown unmaps them (a chunk the
/// panicking call had already unmapped is then unmapped twice, which the upstream refuses); a
/// reservation already taken out of the books is not released before the upstream is dropped.
struct Unmapping<'a> {
    returning: &'a Returning,
    stretches: Vec<expandable::Stretch>,
    /// Reservations taken out of the books, as `(base, len)`.
    empty: Vec<(u64, u64)>,
}

impl<'a> Unmapping<'a> {
    fn new(returning: &'a Returning) -> Self {
        Self { returning, stretches: Vec::new(), empty: Vec::new() }
    }
}

impl Drop for Unmapping<'_> {
    fn drop(&mut self) {
        // Settled, so that no ladder waits for them; nothing logged (see `InFlight`'s drop).
        for s in self.stretches.drain(..) {
            self.returning.finish(s.ticket, false);
        }
    }
}

impl<U: Upstream, O: Ordering> fmt::Debug for CachingPool<U, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachingPool")
            .field("id", &self.id)
            .field("config", &self.config)
            .field("streams", &self.arenas.lock_state().live)
            .finish_non_exhaustive()
    }
}

impl<U: Upstream, O: Ordering> CachingPool<U, O> {
    /// A pool drawing segments from `upstream` and ordering streams through `ordering`.
    pub fn new(upstream: U, ordering: O, config: PoolConfig) -> Self {
        Self::with_stream_arenas(upstream, ordering, config, STREAM_ARENAS)
    }

    /// A pool in which the first `arenas` streams in use at once get an arena of their own (the
    /// rest share one, see "No stream limit"); [`new`](Self::new) gives [`STREAM_ARENAS`].
    pub fn with_stream_arenas(upstream: U, ordering: O, config: PoolConfig, arenas: usize) -> Self {
        let config = config.normalized();
        if config.expandable_segments && upstream.expandable().is_none() {
            tracing::warn!(
                "expandable segments asked for, but the upstream cannot map memory: taking segments"
            );
        }
        let retired = ordering.retired_stream();
        // One more arena for retired streams, created first.
        let split_limit =
            (!(config.expandable_segments && upstream.expandable().is_some())).then(|| config.split_limit());
        let arenas = ArenaTable::new(
            arenas.clamp(1, MAX_STREAM_ARENAS) + usize::from(retired.is_some()),
            config.split_limit(),
        );
        if let Some(retired) = retired {
            drop(arenas.lock_or_insert(retired));
        }
        CachingPool {
            id: NEXT_POOL_ID.fetch_add(1, Relaxed),
            upstream,
            ordering,
            split_limit,
            arenas,
            caches: Registry::new(),
            retired,
            config,
            segments: Mutex::new(Segments::default()),
            returning: Returning::default(),
            peaks: Peaks::default(),
        }
    }

    /// The configuration in use (after normalisation).
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// The stream-ordering implementation.
    pub fn ordering(&self) -> &O {
        &self.ordering
    }

    /// The upstream's mapping operations when the pool grows [expandable
    /// segments](crate::expandable) (configured, and the upstream has them); `None`: segments.
    pub fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        self.upstream.expandable().filter(|_| self.config.expandable_segments)
    }

    /// Allocates `bytes` bytes aligned to `align` (a power of two up to [`MAX_ALIGN`](crate::MAX_ALIGN);
    /// every block is at least 512-byte aligned) for use on `stream`.
    ///
    /// The memory is ready for work queued on `stream` from now on, and for no other: the work of
    /// its earlier users has completed or is ordered before that work (a block freed on `stream`
    /// comes back at once; one of another stream after [`Ordering::wait`]`(stream, other)`). A
    /// block used on another stream must be freed as [`deallocate`](Self::deallocate)'s contract
    /// says. Safe to call with any stream: a block is of use on the device only through an
    /// `unsafe` call, and comes back into the pool only through `deallocate`.
    ///
    /// # Errors
    /// [`PoolError::ZeroSize`], [`PoolError::InvalidAlignment`], [`PoolError::AlignmentTooLarge`],
    /// [`PoolError::SizeOverflow`] for bad input; [`PoolError::OutOfMemory`] with a report when the
    /// upstream is exhausted after the ladder (also when the synchronisation of its last step, which
    /// may serve a range of a [dedicated segment](crate::size_class::Kind::Dedicated), fails: that
    /// step's failure is logged, and the request answered as without it);
    /// [`PoolError::AddressSpaceExhausted`] when, with [expandable segments](crate::expandable), no
    /// segment has room and the upstream refuses another reservation; [`PoolError::Upstream`] / [`PoolError::Ordering`] /
    /// [`PoolError::MisalignedSegment`] when the upstream or the ordering fails. A failed wait to
    /// migrate memory from another stream's arena is logged and answered only when neither
    /// growth nor the ladder serves the request instead (the ladder's `OutOfMemory` or
    /// `AddressSpaceExhausted` gives way to it); the waits for an arena shared with another
    /// stream (a full arena table, or growth into such an arena) are answered at once.
    /// [`PoolError::RetiredStream`] when `stream` is the ordering's
    /// [retired name](Ordering::retired_stream), which no stream has: the memory cached under it
    /// may still be in use by retired streams' work, which is ordered before no stream's work
    /// but through a wait on that name.
    #[inline]
    pub fn allocate(&self, bytes: usize, align: usize, stream: O::Stream) -> Result<Block, PoolError> {
        // The thread cache first, for the common request (at most 64 KiB, default alignment)
        // without building the full request.
        if (1..=FINE_LIMIT).contains(&bytes)
            && align.is_power_of_two()
            && align <= QUANTUM
            && let Some(Some((addr, seg, breach))) = self.caches.with_own(|c| {
                let bin = bytes.div_ceil(QUANTUM);
                c.take(stream, bin as u32, (bin * QUANTUM) as u64, bytes)
            })
        {
            if breach {
                self.rebalance();
            }
            let size = (bytes.div_ceil(QUANTUM) * QUANTUM) as u64;
            return Ok(Block { addr, requested: bytes, size, seg, kind: Kind::Small, pool: self.id });
        }
        let req = Request::new(bytes, align)?;
        if req.bin != 0
            && req.size > FINE_LIMIT as u64
            && req.size <= THREAD_CACHE_MAX_BLOCK as u64
            && let Some(Some((addr, seg, breach))) =
                self.caches.with_own(|c| c.take(stream, req.bin as u32, req.size, req.requested))
        {
            if breach {
                self.rebalance();
            }
            return Ok(self.block(&req, addr, seg));
        }
        // No thread cache keeps blocks under the retired name (`deallocate` files them in its
        // arena), so it is refused here, off the fastest path.
        if self.retired == Some(stream) {
            return Err(PoolError::RetiredStream);
        }
        let (arena, mut g) = match self.arenas.lock(stream) {
            Some(found) => found,
            None => match self.arena_slow(stream) {
                Some(found) => found,
                None => return self.allocate_shared(stream, req),
            },
        };
        if req.bin != 0
            && let Some(e) = g.bins.pop(req.bin)
        {
            return Ok(self.finish(g, &req, e.addr, e.seg));
        }
        self.allocate_slow(arena, g, stream, req)
    }

    /// The pool's id, which its blocks carry.
    #[inline]
    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    /// Gives `block` back; `stream` is the stream it was last used on (its work up to now is what
    /// must finish before another stream may reuse the memory). It may differ from the stream the
    /// block was allocated on.
    ///
    /// The pool hands the memory to the next allocation on `stream` at once, with no wait, and to
    /// another stream `t` after [`Ordering::wait`]`(t, stream)` or [`Ordering::synchronize`]: the
    /// `stream` named here is all that orders later users after the block's work, so naming a
    /// wrong one (see [`CachingResource::pool`](crate::CachingResource::pool)) gives memory still
    /// in use to other work, hence `unsafe`. The block itself needs no promise: a [`Block`] is
    /// neither `Clone` nor `Copy` and only a pool makes one, so it is given back once, and a block
    /// of another pool is refused ([`ForeignBlock`]).
    ///
    /// # Safety
    /// 1. Every use of the block's memory has completed, or is queued on `stream`, or is ordered
    ///    before all work queued on `stream` after this call (by an event `stream` waits for).
    ///    That includes the work of the block's earlier users, which the pool ordered before the
    ///    work queued after the [allocation](Self::allocate) on its stream, and before no other:
    ///    a block allocated on stream `a` and freed on `b` needs `b` ordered after `a`'s work
    ///    since the allocation (as using it on `b` first needed), or that work complete.
    /// 2. The pool's ordering can order other streams after `stream`, from any thread:
    ///    `wait(t, stream)` and `synchronize` cover the work queued on it. For
    ///    [`StreamOrdering`](crate::StreamOrdering): `stream` is a key its
    ///    [`register`](crate::StreamOrdering::register) returned (an unregistered key is taken for
    ///    a retired stream), not a per-thread default stream's (the pool may order it from
    ///    another thread, where that handle names another stream); or
    ///    [`StreamKey::RETIRED`](crate::StreamKey::RETIRED), for a block whose work has completed
    ///    (no work is queued on that name, item 1). The host models name any stream.
    /// 3. Nothing uses the memory after this call but the work item 1 covers (no work queued
    ///    through the address later): the pool may hand it out again at once.
    ///
    /// # Errors
    /// A block of another pool is handed back untouched as [`ForeignBlock`].
    #[inline]
    pub unsafe fn deallocate(&self, block: Block, stream: O::Stream) -> Result<(), ForeignBlock> {
        if block.pool != self.id {
            tracing::warn!(addr = block.addr, "deallocate: block belongs to another pool");
            return Err(ForeignBlock(block));
        }
        if block.kind == Kind::Small
            && block.size <= THREAD_CACHE_MAX_BLOCK as u64
            && self.config.thread_cache
            && self.retired != Some(stream)
            && self.free_to_thread_cache(&block, stream)
        {
            return Ok(());
        }
        let found = match self.arenas.lock(stream) {
            Some(found) => Some(found),
            None => self.arena_slow(stream),
        };
        match found {
            Some((_, g)) => self.free_into(g, block),
            None => self.free_untracked_stream(block, stream),
        }
        Ok(())
    }

    /// Releases every fully free segment to the upstream and, with [expandable
    /// segments](crate::expandable), unmaps every whole free chunk (releasing a reservation left
    /// with nothing mapped), synchronising first if there is anything to release (or
    /// [stranded](PoolStats::stranded_bytes) memory to return to the cache), after retiring the
    /// streams only the ordering still holds. It synchronises with no lock of the pool held (a host
    /// function may use the pool meanwhile), and again while memory was freed into the pool during
    /// the last synchronisation; after four such races it releases nothing (see "Locking" on
    /// [`CachingPool`]). With nothing to release it returns an empty report at once, without
    /// synchronising.
    ///
    /// # Errors
    /// [`PoolError::Ordering`] when synchronising fails (nothing is released then).
    pub fn trim(&self) -> Result<TrimReport, PoolError> {
        self.trim_to(0)
    }

    /// Releases fully free segments, largest first, then unmaps whole free chunks of expandable
    /// segments, highest address first, until at most `keep` bytes are cached. Does nothing (and
    /// does not synchronise) when that is already so or nothing is releasable (no segment fully
    /// free, no whole chunk free), unless memory is stranded (then it synchronises, which returns
    /// that memory to the cache). When memory is freed into the pool during each of four
    /// synchronisations (other threads allocating and freeing all along), it releases nothing and
    /// returns an empty report (see "Locking" on [`CachingPool`]).
    ///
    /// # Errors
    /// [`PoolError::Ordering`] when synchronising fails (nothing is released then).
    pub fn trim_to(&self, keep: usize) -> Result<TrimReport, PoolError> {
        let _span = tracing::debug_span!("trim", device = self.upstream.device(), keep).entered();
        self.flush_thread_caches();
        let (mut st, mut guards) = self.lock_all();
        let unretired = self.sweep(&mut st, &mut guards);
        for g in guards.iter_mut() {
            g.flush_bins();
        }
        let stranded = self.segments.lock().stranded_bytes > 0;
        if !stranded && !self.releasable(&guards, keep as u64) {
            drop((guards, st));
            unretired.log();
            return Ok(TrimReport::default());
        }
        self.release_after_synchronising(st, guards, unretired, keep as u64)
    }

    /// Synchronises all streams (`ordering.synchronize()`), then applies the release threshold: when
    /// more than [`PoolConfig::release_threshold`] bytes are cached, cached memory of all streams is
    /// coalesced and fully free segments are released (whole free chunks of expandable segments
    /// unmapped) until at most the threshold is cached, unless memory is freed into the pool during
    /// each of four synchronisations (then it releases nothing, as [`trim_to`](Self::trim_to)):
    /// under such sustained traffic only the out-of-memory ladder bounds the cache.
    ///
    /// # Errors
    /// [`PoolError::Ordering`] when synchronising fails.
    pub fn synchronize(&self) -> Result<TrimReport, PoolError> {
        let threshold = self.config.release_threshold as u64;
        // Stranded memory takes the slow path: the synchronisation there returns it to the cache.
        if self.cached_estimate() <= threshold && self.segments.lock().stranded_bytes == 0 {
            self.ordering.synchronize().map_err(PoolError::Ordering)?;
            return Ok(TrimReport::default());
        }
        self.flush_thread_caches();
        let (mut st, mut guards) = self.lock_all();
        let unretired = self.sweep(&mut st, &mut guards);
        // Flushed before the wait, as `trim_to` does: a migration scan flushing them meanwhile
        // would count as memory freed in and cost another synchronisation.
        for g in guards.iter_mut() {
            g.flush_bins();
        }
        self.release_after_synchronising(st, guards, unretired, threshold)
    }

    /// The end of `trim_to` and `synchronize`: synchronises with no lock held
    /// ([`synchronize_unlocked`](Self::synchronize_unlocked)), then consolidates and releases
    /// until at most `keep` bytes are cached, logging with the locks let go; an empty report when
    /// frees raced with every synchronisation.
    fn release_after_synchronising(
        &self,
        st: MutexGuard<'_, TableState>,
        guards: Guards<'_, O::Stream>,
        unretired: Unretired<'_, O>,
        keep: u64,
    ) -> Result<TrimReport, PoolError> {
        let Some((st, mut guards)) = self.synchronize_unlocked(st, guards, unretired)? else {
            // Frees raced with every synchronisation: nothing is known to be safe to release.
            tracing::debug!("memory freed into the pool during every synchronisation; releasing nothing");
            return Ok(TrimReport::default());
        };
        consolidate(&mut guards);
        let mut notes = expandable::Notes::default();
        let (mut report, unlinked, unmapping) = self.release(&mut guards, keep);
        drop((guards, st));
        self.unmap_unlocked(unmapping, &mut report, &mut notes);
        notes.log();
        self.log_upstream_notes();
        Self::log_released(&report);
        self.give_back(unlinked);
        Ok(report)
    }

    /// A snapshot of the statistics (summed over arenas on read).
    ///
    /// Exact at rest. While other threads allocate and free, it is read without stopping them:
    /// each thread counts a free just after the block is back in its cache or arena, so a trim in
    /// between can release the block's segment first, and a snapshot may then show live bytes
    /// above the reserved ones for that moment. A released segment leaves `reserved_bytes` (and
    /// counts in `upstream_frees`) when it is taken out of the books, under the locks, and reaches
    /// the upstream only after them: for that moment it counts in
    /// [`returning_bytes`](PoolStats::returning_bytes) instead (a snapshot counts it in exactly one
    /// of the two).
    pub fn stats(&self) -> PoolStats {
        let mut s = PoolStats::default();
        let (mut bytes, mut count, mut requested) = (0i64, 0i64, 0i64);
        for a in self.arenas.iter() {
            s.largest_free_block = s.largest_free_block.max(a.inner.lock().largest());
        }
        {
            let caches = self.caches.lock();
            for c in caches.iter().map(|c| &c.counters).chain(std::iter::once(&self.caches.folded)) {
                bytes += c.counters.bytes();
                count += c.counters.count();
                c.add_to(&mut requested, &mut s.allocations_total, &mut s.histogram);
            }
        }
        let in_threads = self.caches.largest(|bin| bin_bytes(bin as usize) as u64);
        s.largest_free_block = s.largest_free_block.max(in_threads);
        let (peak_bytes, peak_count) = self.peaks.get();
        s.current_bytes = bytes.max(0) as u64;
        s.current_count = count.max(0) as u64;
        s.requested_bytes = requested.max(0) as u64;
        s.peak_bytes = (peak_bytes.max(0) as u64).max(s.current_bytes);
        s.peak_count = (peak_count.max(0) as u64).max(s.current_count);
        let segs = self.segments.lock();
        s.reserved_bytes = segs.reserved;
        s.peak_reserved_bytes = segs.peak_reserved;
        s.cached_bytes = segs.reserved.saturating_sub(s.current_bytes);
        s.stranded_bytes = segs.stranded_bytes;
        s.segments = (segs.map.len() + segs.expandable.segs.len()) as u64;
        s.upstream_allocations = segs.upstream_allocations;
        s.upstream_frees = segs.upstream_frees;
        // Under the segments' lock, as `release` counts a segment out of them (the same order):
        // a segment is in `reserved_bytes` or here, never in neither while it is on its way.
        s.returning_bytes = self.returning.state.lock().bytes;
        s.oom_ladders = segs.oom_ladders;
        s.oom_errors = segs.oom_errors;
        s
    }

    /// Resets `peak_bytes`, `peak_count` and `peak_reserved_bytes` to the current values.
    pub fn reset_peaks(&self) {
        {
            let caches = self.caches.lock();
            self.peaks.reset(self.all_counters(&caches));
        }
        let mut segs = self.segments.lock();
        segs.peak_reserved = segs.reserved;
    }

    /// The segments held from the upstream as `(base, len)`, in address order; for an expandable
    /// segment, each run of mapped chunks.
    pub fn segments(&self) -> Vec<(u64, u64)> {
        let segs = self.segments.lock();
        let mut out: Vec<(u64, u64)> = segs.map.iter().map(|(&b, &(l, _))| (b, l)).collect();
        out.extend(segs.expandable.mapped_runs());
        out.sort_unstable();
        out
    }

    /// Every cached (free or binned) block of every stream as `(addr, len)`, in address order,
    /// stranded ones included (see [`PoolStats::stranded_bytes`]).
    pub fn cached_ranges(&self) -> Vec<(u64, u64)> {
        self.flush_thread_caches();
        let mut out = vec![];
        let (_st, guards) = self.lock_all();
        for g in &guards {
            out.extend(
                g.sets()
                    .into_iter()
                    .flat_map(|(set, _)| set.ranges())
                    .chain(g.bins.entries())
                    .map(|(a, l, _)| (a, l)),
            );
        }
        out.extend(self.segments.lock().stranded.iter().map(|&(a, l, _, _)| (a, l)));
        out.sort_unstable();
        out
    }

    /// Checks the pool's internal consistency: free indexes agree and are coalesced, every cached block
    /// lies in a live segment of the right kind, cached blocks do not overlap, and cached plus live bytes
    /// equal reserved bytes. O(n); meant for tests and debugging, exact when no operation is in flight.
    ///
    /// # Errors
    /// A description of the first inconsistency found.
    pub fn validate(&self) -> Result<(), String> {
        self.flush_thread_caches();
        let (_st, guards) = self.lock_all();
        let segs = self.segments.lock();
        let mut items: Vec<(u64, u64, Seg, Kind)> = vec![];
        for g in &guards {
            for (set, kind) in g.sets() {
                set.check()?;
                items.extend(set.ranges().map(|(a, l, s)| (a, l, s, kind)));
            }
            items.extend(g.bins.entries().into_iter().map(|(a, l, s)| (a, l, s, Kind::Small)));
        }
        items.extend(segs.stranded.iter().copied());
        if segs.stranded.iter().map(|x| x.1).sum::<u64>() != segs.stranded_bytes {
            return Err(format!("stranded blocks do not sum to {}", segs.stranded_bytes));
        }
        items.sort_unstable_by_key(|x| x.0);
        let mut end = 0;
        for &(addr, len, seg, kind) in &items {
            if segs.map.get(&seg.base) != Some(&(seg.len, kind)) {
                segs.expandable.check(addr, len, seg, kind)?;
            }
            if addr < seg.base || addr + len > seg.end() || addr % QUANTUM as u64 != 0 || len == 0 {
                return Err(format!("cached block {addr:#x}+{len} misplaced in segment {seg:?}"));
            }
            if addr < end {
                return Err(format!("cached block {addr:#x}+{len} overlaps the previous one"));
            }
            end = addr + len;
        }
        let cached: u64 = items.iter().map(|x| x.1).sum();
        let live = self.live_bytes();
        let seg_total: u64 = segs.map.values().map(|&(l, _)| l).sum::<u64>() + segs.expandable.mapped();
        if seg_total != segs.reserved {
            return Err(format!("segments sum to {seg_total} but reserved is {}", segs.reserved));
        }
        if cached as i64 + live != segs.reserved as i64 {
            return Err(format!("cached {cached} + live {live} != reserved {}", segs.reserved));
        }
        Ok(())
    }

    // ----- internals -----

    /// Lets go of the arena (its guard `g`), counts the allocation and builds the block.
    #[inline]
    fn finish<G>(&self, g: G, req: &Request, addr: u64, seg: Seg) -> Block {
        drop(g);
        self.count_alloc(req.size, req.requested);
        self.block(req, addr, seg)
    }

    /// Counts an allocation in this thread's counters (see [`crate::stats`]).
    #[inline]
    fn count_alloc(&self, size: u64, requested: usize) {
        let breach = match self.caches.with_own(|c| c.count_alloc(size, requested)) {
            Some(breach) => breach,
            None => self.caches.count_slow(size as i64, requested as i64),
        };
        if breach {
            self.rebalance();
        }
    }

    /// Counts a free in this thread's counters.
    #[inline]
    fn count_free(&self, size: u64, requested: usize) {
        if self.caches.with_own(|c| c.count_free(size, requested)).is_none() {
            self.caches.count_slow(-(size as i64), -(requested as i64));
        }
    }

    #[inline]
    fn block(&self, req: &Request, addr: u64, seg: Seg) -> Block {
        Block { addr, requested: req.requested, size: req.size, seg, kind: req.kind, pool: self.id }
    }

    #[cold]
    fn rebalance(&self) {
        let caches = self.caches.lock();
        self.peaks.rebalance(self.all_counters(&caches));
    }

    /// Every live counter: the threads' and that of exited threads.
    fn all_counters<'a>(
        &'a self,
        caches: &'a [std::sync::Arc<ThreadCache<O::Stream>>],
    ) -> impl Iterator<Item = &'a crate::stats::Counters> + Clone {
        caches.iter().map(|c| &c.counters.counters).chain(std::iter::once(&self.caches.folded.counters))
    }

    /// Live bytes: the threads' counts. Takes the registry's lock (after any arena lock the
    /// caller holds).
    fn live_bytes(&self) -> i64 {
        let caches = self.caches.lock();
        self.all_counters(&caches).map(|c| c.bytes()).sum()
    }

    /// Keeps a freed small block in this thread's cache; false when it cannot (the thread is
    /// exiting, or another thread is flushing the cache): the caller frees to the arena.
    #[inline]
    fn free_to_thread_cache(&self, block: &Block, stream: O::Stream) -> bool {
        let e = Entry { stream, bin: bin_of(block.size as usize) as u32, addr: block.addr, seg: block.seg };
        for _ in 0..3 {
            match self.caches.with_own(|c| c.put(e, block.size, block.requested)) {
                Some(Put::Kept) => return true,
                Some(Put::Declined) => return false,
                Some(Put::Full) => {
                    let evicted = self.caches.with_own(|c| c.evict()).unwrap_or_default();
                    self.cache_entries(evicted);
                }
                None => {
                    if !self.caches.register() {
                        return false;
                    }
                }
            }
        }
        false
    }

    /// Moves every thread cache's blocks (other threads' too) to their streams' arenas and takes
    /// over the caches of exited threads. Call with no lock held.
    fn flush_thread_caches(&self) {
        let entries = self.caches.drain_all();
        self.cache_entries(entries);
        // Folded caches' limits are gone: recompute every limit from the sums.
        self.rebalance();
    }

    /// Moves this thread's own cache to the arenas; whether it held anything.
    fn flush_own_cache(&self) -> bool {
        match self.caches.with_own(|c| c.take_all()) {
            Some(entries) if !entries.is_empty() => {
                self.cache_entries(entries);
                true
            }
            _ => false,
        }
    }

    /// Files thread-cached blocks (counted as cached already) in their streams' arenas' bins.
    /// Call with no lock held.
    fn cache_entries(&self, mut entries: Vec<Entry<O::Stream>>) {
        let mut i = 0;
        while i < entries.len() {
            // Gather the entries of one stream at `i..n` (few entries, usually one stream).
            let stream = entries[i].stream;
            let first_other = i + 1;
            let mut n = first_other;
            for k in first_other..entries.len() {
                if entries[k].stream == stream {
                    entries.swap(n, k);
                    n += 1;
                }
            }
            let group = &entries[i..n];
            i = n;
            // Never an arena for a stream that has none (any more): a sweep may have retired it
            // since the blocks were cached, and an arena made now would never be swept again.
            // Ordered behind every stream instead, the blocks go to position 0 (as a free on a
            // stream beyond the table does).
            let arena = match self.arenas.lock(stream) {
                Some(found) => Some(found),
                None if self.order_untracked(stream) => {
                    self.arenas.iter().next().map(|a| (a, a.inner.lock()))
                }
                // Not ordered: no stream may reuse the blocks until the pool has synchronised.
                None => {
                    self.strand(
                        group.iter().map(|e| (e.addr, bin_bytes(e.bin as usize) as u64, e.seg, Kind::Small)),
                    );
                    continue;
                }
            };
            let Some((_, mut g)) = arena else { continue };
            for e in group {
                g.bins.push(e.bin as usize, BinEntry { addr: e.addr, seg: e.seg });
            }
        }
    }

    /// Keeps cached blocks that no stream may reuse yet (see [`Segments::stranded`](crate::segment::Segments::stranded)) out of every
    /// arena. Call with no arena lock held.
    #[cold]
    fn strand(&self, blocks: impl IntoIterator<Item = (u64, u64, Seg, Kind)>) {
        let mut segs = self.segments.lock();
        for b in blocks {
            segs.stranded_bytes += b.1;
            segs.stranded.push(b);
        }
    }

    /// Numbers the blocks stranded so far (every block ever stranded, those returned to the cache
    /// since included): those a synchronisation that starts next covers.
    fn stranded_mark(&self) -> u64 {
        let segs = self.segments.lock();
        segs.stranded_taken + segs.stranded.len() as u64
    }

    /// For `trim`, `synchronize` and the out-of-memory ladder: synchronises the ordering with no lock of the pool held, and
    /// returns the table's mutex and every arena lock (`None`: see below), taken again after a
    /// synchronisation that followed every free into the arenas, and with the blocks stranded before it started back
    /// in the cache. `st` and `guards` (every arena, after the caller's sweep and flushes) are let
    /// go first, and `unretired` is logged then; on error the locks stay let go.
    ///
    /// Why unlocked: on a device `synchronize` waits for the streams' work, host functions
    /// included, and a host function may allocate or free through the pool, which needs an arena
    /// lock (the premise of `lock_ordered` and `take_ordered`).
    ///
    /// Why sound: what the caller does next (consolidate arenas' memory, release segments, unmap
    /// chunks; the ladder: hand memory of any arena to its stream, map chunks that join free
    /// ranges) needs every block in the arenas to have been freed before the synchronisation
    /// started. Under the locks, before letting go, every arena's [insert
    /// counters](crate::arena::ArenaInner::inserts) are read; everything the arenas then hold was
    /// freed before the synchronisation starts. Taken again after it, unchanged counters (an arena
    /// new to the table counts as all zero: a fresh arena's) mean nothing entered any arena
    /// meanwhile that may be under work: allocations only took memory out, which the release then
    /// does not see, and what enters uncounted is idle (ranges already in the arenas, moved under
    /// every lock after a synchronisation that covered them, by another thread's consolidation,
    /// gathering, or a trim's pieces around chunks it unmaps and chunks whose unmap failed, which
    /// were in no arena meanwhile; fresh segments and newly mapped
    /// expandable chunks, on which nothing was queued: contract item 1 of [`Upstream`]).
    /// A changed counter means memory was freed in (or moved by a sweep, flushed, put back)
    /// meanwhile, possibly under work queued after the synchronisation started: the locks are let
    /// go and it synchronises again. After four such races (other threads allocating and freeing all along)
    /// it returns `None` with every lock let go (the caller logs why, with no lock held), and the
    /// caller releases nothing (the ladder only
    /// grows a plain segment): a trim or a ladder ends under sustained traffic without ever
    /// waiting under a lock. (Stranded blocks covered by a
    /// synchronisation are back in the cache either way.)
    ///
    /// Memory a thread cache holds (a free after the caller's flush lands there with no arena
    /// lock) is in no arena: the release, which only takes segments whose whole range lies in the
    /// arenas' free sets, never sees it, and it reaches an arena only through a flush, which
    /// counts as an insert. Blocks stranded meanwhile (no lock of the arenas needed) stay
    /// stranded: only those numbered below the mark taken before the last synchronisation
    /// started are returned, and the numbering ([`stranded_mark`](Self::stranded_mark)) survives
    /// another thread's `trim` reclaiming some meanwhile. Another thread's sweep, trim or ladder
    /// running meanwhile merges, releases or consolidates only under the locks; what a sweep moves
    /// into an arena counts as an insert, and what a trim or ladder moves after its own covering
    /// synchronisation is idle.
    fn synchronize_unlocked<'a>(
        &'a self,
        mut st: MutexGuard<'a, TableState>,
        mut guards: Guards<'a, O::Stream>,
        unretired: Unretired<'_, O>,
    ) -> Result<Option<AllLocks<'a, O::Stream>>, PoolError> {
        /// Unlocked synchronisations that may race with frees before the caller gives up.
        const UNLOCKED_TRIES: usize = 4;
        let mut unretired = Some(unretired);
        let mut races = 0;
        loop {
            let before = self.arena_inserts(&guards);
            let covered = self.stranded_mark();
            drop((guards, st));
            if let Some(unretired) = unretired.take() {
                unretired.log();
            }
            if races > 0 {
                // Logged with no lock held (a subscriber may read the pool's stats).
                tracing::debug!("memory freed into the pool while synchronising; synchronising again");
            }
            self.ordering.synchronize().map_err(PoolError::Ordering)?;
            (st, guards) = self.lock_all();
            let unchanged = inserts_unchanged(&before, &self.arena_inserts(&guards));
            // Whatever the arenas held, the stranded blocks below the mark were stranded before
            // the synchronisation started: they go back to the cache either way.
            self.reclaim_stranded(&mut guards, covered);
            if unchanged {
                return Ok(Some((st, guards)));
            }
            races += 1;
            if races == UNLOCKED_TRIES {
                // Frees keep landing during each wait (other threads allocating and freeing all
                // along), and waiting with the locks held could deadlock with a host function
                // that uses the pool: give up on releasing this time, rather than wait for ever or
                // under the locks.
                drop((guards, st));
                return Ok(None);
            }
        }
    }

    /// Every arena's insert counters by its position, in position order. The caller holds the
    /// table's mutex (so the arenas listed are those `guards` locked, in the same order).
    fn arena_inserts(&self, guards: &Guards<'_, O::Stream>) -> Vec<(usize, [u64; 4])> {
        self.arenas.iter().zip(guards).map(|(a, g)| (a.index, g.inserts())).collect()
    }

    /// Returns the stranded blocks numbered below `covered` to the cache (the first arena;
    /// `consolidate` spreads them) once a synchronisation has made them safe for every stream:
    /// `covered` is [`stranded_mark`](Self::stranded_mark) taken before that synchronisation
    /// started. Blocks stranded meanwhile (by a free on another thread: `strand` takes no arena
    /// lock) may be under work queued after the synchronisation looked at their stream, so they
    /// stay stranded. Blocks leave `stranded` only from its front, so those still there below
    /// the mark are its first ones.
    fn reclaim_stranded(&self, guards: &mut Guards<'_, O::Stream>, covered: u64) {
        let Some(g) = guards.first_mut() else { return };
        let mut segs = self.segments.lock();
        let left = covered.saturating_sub(segs.stranded_taken);
        let n = usize::try_from(left).unwrap_or(usize::MAX).min(segs.stranded.len());
        let reclaimed: Vec<_> = segs.stranded.drain(..n).collect();
        segs.stranded_taken += n as u64;
        for (addr, len, seg, kind) in reclaimed {
            segs.stranded_bytes -= len;
            g.set(kind).insert(addr, len, seg);
        }
    }

    #[inline(always)]
    fn free_into(&self, mut g: MutexGuard<'_, ArenaInner<O::Stream>>, block: Block) {
        // A large request served from a small segment under memory pressure has no bin.
        if block.kind == Kind::Small && block.size <= SMALL_LIMIT as u64 {
            let bin = bin_of(block.size as usize);
            g.bins.push(bin, BinEntry { addr: block.addr, seg: block.seg });
        } else {
            g.set(block.kind).insert(block.addr, block.size, block.seg);
        }
        drop(g);
        self.count_free(block.size, block.requested);
    }

    /// The arena table is full of streams in use: `stream` allocates from the first arena: a
    /// block taken out under its lock, then ordered after that arena's stream with the lock let
    /// go (see [`take_ordered`](Self::take_ordered)); else the slow path (migration, growth).
    #[cold]
    #[inline(never)]
    fn allocate_shared(&self, stream: O::Stream, req: Request) -> Result<Block, PoolError> {
        let mut req = req.split_above(self.split_limit);
        tracing::debug!(
            arenas = self.arenas.capacity(),
            "allocation on a stream beyond the arena table: sharing"
        );
        let arena = self.arenas.iter().next().expect("a full table has arenas");
        let mut g = arena.inner.lock();
        let mut taken = g.take(&mut req);
        if taken.is_none() && req.kind == Kind::Small && g.bins.bytes() > 0 {
            g.flush_bins();
            taken = g.small.take(req.size, req.align);
        }
        let Some((addr, seg)) = taken else { return self.allocate_slow(arena, g, stream, req) };
        match g.stream.filter(|&owner| owner != stream) {
            Some(owner) => {
                self.take_ordered(arena, g, owner, stream, &req, addr, seg)?;
                Ok(self.finish((), &req, addr, seg))
            }
            None => Ok(self.finish(g, &req, addr, seg)),
        }
    }

    /// Orders `stream` after `from_stream`, whose arena `from` (locked by `g`) `[addr, +req.size)`
    /// was just taken out of, with the lock let go: the wait makes driver calls (an event record,
    /// a stream wait) that block while another thread is in `cuMemFree` (driver brief §17), which
    /// waits for host functions, and a host function may free into this arena. On error the
    /// block goes back into the arena if it still serves `from_stream`, else it is
    /// [stranded](Self::strand): nothing orders it for the arena's new stream.
    ///
    /// Sound without the lock: the block is out of every free set, so no one else takes it, and
    /// every use of it was queued on `from_stream` before its free put it into the arena, which
    /// happened before it was taken here. If `from_stream` is retired in between, its retirement
    /// covers its work so far (the [`Ordering::retire`] contract), and a `wait` on it afterwards
    /// still covers that work ([`Ordering::wait`]: `StreamOrdering` lists the retired event
    /// before it forgets the stream, and a wait that no longer finds the stream waits for the
    /// list). If the arena is reused for another stream, that changes nothing for this block:
    /// only its stream of origin, read under the lock, matters.
    #[allow(clippy::too_many_arguments)]
    fn take_ordered(
        &self,
        from: &Arena<O::Stream>,
        g: MutexGuard<'_, ArenaInner<O::Stream>>,
        from_stream: O::Stream,
        stream: O::Stream,
        req: &Request,
        addr: u64,
        seg: Seg,
    ) -> Result<(), PoolError> {
        drop(g);
        let Err(e) = self.ordering.wait(stream, from_stream) else { return Ok(()) };
        let mut g = from.inner.lock();
        if g.stream == Some(from_stream) {
            g.set(req.kind).insert(addr, req.size, seg);
        } else {
            drop(g);
            self.strand([(addr, req.size, seg, req.kind)]);
        }
        Err(PoolError::Ordering(e))
    }

    /// The arena table is full: the freeing stream gets no arena. Make the memory safe for every
    /// stream (an event standing for `stream`'s work so far where the ordering retires streams,
    /// else a synchronisation), then cache it in the first arena: the retired streams' one, if any.
    #[cold]
    fn free_untracked_stream(&self, block: Block, stream: O::Stream) {
        tracing::debug!(arenas = self.arenas.capacity(), "deallocate on a stream beyond the arena table");
        if !self.order_untracked(stream) {
            self.strand([(block.addr, block.size, block.seg, block.kind)]);
            self.count_free(block.size, block.requested);
            return;
        }
        // Position 0: the arena of retired streams where there is one, else the first stream's.
        if let Some(arena) = self.arenas.iter().next() {
            self.free_into(arena.inner.lock(), block);
        }
    }

    /// Makes memory freed on `stream` (which has no arena) safe for every stream: an event through
    /// `retire` where the ordering retires streams, else a synchronisation. False (logged) when
    /// that failed: the memory must then not be reused before the pool synchronises (the caller
    /// [strands](Self::strand) it).
    #[cold]
    fn order_untracked(&self, stream: O::Stream) -> bool {
        let ordered = if self.ordering.retired_stream().is_some() {
            self.ordering.retire(stream)
        } else {
            self.ordering.synchronize()
        };
        // This thread holds no lock of the pool (see the callers).
        self.ordering.drop_deferred();
        if let Err(e) = ordered {
            tracing::warn!(
                error = %e,
                ?stream,
                "ordering a free on a stream without an arena failed; memory kept aside until the pool synchronises"
            );
            return false;
        }
        true
    }

    /// The arena of a stream new to the pool (or one the lock-free lookup missed); when the table
    /// is full, streams the program dropped are retired first to make room. Also runs a due sweep.
    #[cold]
    #[inline(never)]
    fn arena_slow(&self, stream: O::Stream) -> Option<crate::table::Locked<'_, O::Stream>> {
        if let Some(found) = self.arenas.lock_or_insert(stream) {
            // Never wait for the table's mutex while holding an arena lock (lock order).
            if !self.arenas.sweep_due() {
                return Some(found);
            }
            // Amortised: a sweep after the number of streams doubled since the last one.
            drop(found);
            return self.sweep_and_insert(stream);
        }
        // Full: only an ordering that retires streams can make room.
        self.ordering.retired_stream()?;
        self.sweep_and_insert(stream)
    }

    /// Retires every stream the ordering reports only it still holds (see [`Ordering::orphans`]),
    /// then finds or inserts `stream`'s arena without letting go of the table, so the room the
    /// sweep made cannot be taken by another stream first.
    #[cold]
    fn sweep_and_insert(&self, stream: O::Stream) -> Option<crate::table::Locked<'_, O::Stream>> {
        // Blocks thread-cached for a dropped stream go to its arena before the sweep retires it.
        self.flush_thread_caches();
        let (mut st, mut guards) = self.lock_all();
        let unretired = self.sweep(&mut st, &mut guards);
        drop(guards);
        let found = self.arenas.insert_locked(&mut st, stream);
        if unretired.is_empty() {
            return found;
        }
        // Logged (and what the ordering let go of dropped) with no lock held: a subscriber may
        // read the pool's stats. The stream's arena, inserted above, is looked up again
        // afterwards (or inserted, if the table was full).
        drop((found, st));
        unretired.log();
        self.arenas.lock_or_insert(stream)
    }

    /// Retires orphaned streams: the ordering records that their work so far must precede any reuse
    /// of memory cached under the retired name and forgets them; their arenas' memory and counts
    /// move to the retired streams' arena, and their arenas are vacated for other streams. The
    /// caller holds the table's mutex and every arena lock, and logs the streams that could not be
    /// retired once it has let go of them.
    fn sweep(&self, st: &mut TableState, guards: &mut Guards<'_, O::Stream>) -> Unretired<'_, O> {
        let mut unretired = Unretired { ordering: &self.ordering, failed: Vec::new(), retired: false };
        self.arenas.sweep_done(st);
        let Some(retired) = self.ordering.retired_stream() else {
            st.sweep_at = usize::MAX; // this ordering never retires a stream
            return unretired;
        };
        let Some(ri) = guards.iter().position(|g| g.stream == Some(retired)) else { return unretired };
        let orphans = self.ordering.orphans();
        if !orphans.is_empty() {
            let positions: HashMap<O::Stream, usize> =
                guards.iter().enumerate().filter_map(|(i, g)| g.stream.map(|s| (s, i))).collect();
            let arenas: Vec<&Arena<O::Stream>> = self.arenas.iter().collect();
            for stream in orphans {
                if stream == retired {
                    continue;
                }
                if let Err(e) = self.ordering.retire(stream) {
                    unretired.failed.push((stream, e));
                    continue;
                }
                unretired.retired = true;
                let Some(&i) = positions.get(&stream) else { continue };
                let Some((from, to)) = two_mut(guards, i, ri) else { continue };
                from.move_into(to);
                self.arenas.remove(st, arenas[i], &mut guards[i]);
            }
            self.rebalance();
        }
        st.sweep_at = (2 * st.live).max(crate::table::SWEEP_MIN).min(self.arenas.capacity());
        unretired
    }

    #[cold]
    #[inline(never)]
    fn allocate_slow<'a>(
        &'a self,
        arena: &'a Arena<O::Stream>,
        mut g: MutexGuard<'a, ArenaInner<O::Stream>>,
        stream: O::Stream,
        req: Request,
    ) -> Result<Block, PoolError> {
        // Classified here, off the fast path: the arena's bins serve small requests only.
        let mut req = req.split_above(self.split_limit);
        if let Some((addr, seg)) = g.take(&mut req) {
            return Ok(self.finish(g, &req, addr, seg));
        }
        if req.kind == Kind::Small && g.bins.bytes() > 0 {
            g.flush_bins();
            if let Some((addr, seg)) = g.small.take(req.size, req.align) {
                return Ok(self.finish(g, &req, addr, seg));
            }
        }
        drop(g);
        // From here on the pool migrates, grows or runs its ladder: what a user traces.
        let _span = tracing::debug_span!(
            "allocate_slow",
            device = self.upstream.device(),
            ?stream,
            bytes = req.requested
        )
        .entered();
        // Blocks thread caches hold are invisible to migration and growth: this thread's go to
        // their arenas first, and every cache when a thread exited since the last flush.
        let flushed = if self.caches.orphans_pending() {
            self.flush_thread_caches();
            true
        } else {
            self.flush_own_cache()
        };
        if flushed {
            let mut g = arena.inner.lock();
            // Only memory of this stream's own arena is safe without a wait (a shared arena is not).
            if g.stream == Some(stream) {
                if let Some((addr, seg)) = g.take(&mut req) {
                    return Ok(self.finish(g, &req, addr, seg));
                }
                if req.kind == Kind::Small && g.bins.bytes() > 0 {
                    g.flush_bins();
                    if let Some((addr, seg)) = g.small.take(req.size, req.align) {
                        return Ok(self.finish(g, &req, addr, seg));
                    }
                }
            }
        }
        // A failed wait is answered only if nothing else serves the request.
        let migrated = self.migrate(arena, stream, &mut req);
        if let Ok(Some((addr, seg))) = migrated {
            return Ok(self.finish((), &req, addr, seg));
        }
        let wait_failed = migrated.err();
        match self.grow_or_ladder(arena, stream, req) {
            Err(PoolError::OutOfMemory { .. } | PoolError::AddressSpaceExhausted { .. })
                if let Some(e) = wait_failed =>
            {
                Err(e)
            }
            answer => answer,
        }
    }

    /// The end of [`allocate_slow`](Self::allocate_slow), after migration: growth, then the
    /// out-of-memory ladder.
    fn grow_or_ladder(
        &self,
        arena: &Arena<O::Stream>,
        stream: O::Stream,
        req: Request,
    ) -> Result<Block, PoolError> {
        if let Some(up) = self.expandable() {
            if let Some(block) = self.grow_expandable(up, arena, stream, &req)? {
                return Ok(block);
            }
        } else if let Some(seg) = self.grow(&req, false)? {
            let mut g = arena.inner.lock();
            let set = g.set(req.kind);
            // Fresh memory: no thread comparing insert counters needs to wait for it.
            set.insert_uncounted(seg.base, seg.len, seg);
            // From the new segment only: a shared arena may have taken memory freed after this
            // stream's wait since the lock was let go, and best fit could prefer it.
            if let Some((addr, seg)) = set.take_at(seg.base, req.size, req.align) {
                return Ok(self.finish(g, &req, addr, seg));
            }
        }
        self.oom_ladder(arena, stream, &req)
    }

    /// Grows one of `arena`'s expandable segments for `stream` (locked by
    /// [`lock_ordered`](Self::lock_ordered)): the block, or `None` when the upstream has no memory
    /// or no address space for it.
    fn grow_expandable(
        &self,
        up: &dyn ExpandableUpstream,
        arena: &Arena<O::Stream>,
        stream: O::Stream,
        req: &Request,
    ) -> Result<Option<Block>, PoolError> {
        let mut g = self.lock_ordered(arena, stream, req.kind)?;
        let reservation = self.config.expandable_reservation_bytes;
        let mut notes = expandable::Notes::default();
        let grown = expandable::grow(
            up,
            &mut self.segments.lock(),
            g.set(req.kind),
            arena.index,
            req,
            reservation,
            &mut notes,
        );
        // Logged with the locks let go (the registry's went with the statement): a subscriber
        // may read `stats()`, which takes them.
        if let Ok(expandable::Grown::Block(addr, seg)) = grown {
            let block = self.finish(g, req, addr, seg);
            notes.log();
            self.log_upstream_notes();
            return Ok(Some(block));
        }
        drop(g);
        notes.log();
        self.log_upstream_notes();
        grown.map(|_| None)
    }

    /// Locks `arena` for growth by `stream`. Growth joins the free ranges around a gap, so where
    /// the arena serves another stream (a shared arena), `stream` must first wait for that
    /// stream's work on every free range of `kind` there. The wait runs with the lock let go (its
    /// driver calls may block behind another thread's `cuMemFree`, driver brief §17); the lock
    /// is then taken again, and the wait holds if the arena still serves the stream waited for
    /// and nothing was freed into the set since the lock was let go (a range freed later may be
    /// under work queued after the wait). Else it waits again, unlocked every time: waiting under
    /// the lock could deadlock with a host function that frees into this arena while another
    /// thread's `cuMemFree` waits for it. Each retry means another thread freed into the arena
    /// meanwhile (progress), so this ends unless frees into it never pause.
    fn lock_ordered<'a>(
        &'a self,
        arena: &'a Arena<O::Stream>,
        stream: O::Stream,
        kind: Kind,
    ) -> Result<MutexGuard<'a, ArenaInner<O::Stream>>, PoolError> {
        let mut g = arena.inner.lock();
        loop {
            let Some(owner) = g.stream.filter(|&owner| owner != stream) else { return Ok(g) };
            let inserts = g.set(kind).inserts();
            drop(g);
            self.ordering.wait(stream, owner).map_err(PoolError::Ordering)?;
            g = arena.inner.lock();
            if g.stream == Some(owner) && g.set(kind).inserts() == inserts {
                return Ok(g);
            }
        }
    }

    /// Takes a best fit from another stream's arena and orders `to` (serving `stream`) after that
    /// arena's stream. Arenas are tried from the best fit found by a scan; one that changed since
    /// (vacated, reused, or its fit taken), or whose wait failed (its block put back or stranded
    /// by [`take_ordered`](Self::take_ordered)), gives way to the next best; each failure is
    /// logged as it comes, with no lock held. `Err`: no fit served, and a wait failed (the first
    /// failure): the caller grows and runs the ladder (whose synchronisation may clear what
    /// failed) before it answers that. A block served from another kind of segment than the
    /// request's (see [`ArenaInner::take`]) leaves `req` of that kind; otherwise `req` is unchanged.
    fn migrate(
        &self,
        to: &Arena<O::Stream>,
        stream: O::Stream,
        req: &mut Request,
    ) -> Result<Option<(u64, Seg)>, PoolError> {
        let asked = *req;
        let mut fits: Vec<(u64, &Arena<O::Stream>)> = Vec::new();
        for a in self.arenas.iter().filter(|a| a.index != to.index) {
            let mut g = a.inner.lock();
            if req.kind == Kind::Small {
                g.flush_bins();
            }
            if let Some(len) = g.fit_len(req) {
                fits.push((len, a));
            }
        }
        // Stable: among equal fits, the scan's order (the first found wins, as it always did).
        fits.sort_by_key(|&(len, _)| len);
        let mut failed = None;
        for (_, from) in fits {
            // The arena may have been vacated or reused since: its stream is read under the lock,
            // together with the block taken.
            let mut g = from.inner.lock();
            let Some(from_stream) = g.stream else { continue };
            *req = asked;
            let Some((addr, seg)) = g.take(req) else { continue };
            // The wait runs with the lock let go (see `take_ordered`, which says why that is
            // sound); so does the log: a subscriber may read `stats()`, which takes every lock.
            if let Err(e) = self.take_ordered(from, g, from_stream, stream, req, addr, seg) {
                tracing::warn!(error = %e, from = ?from_stream, "ordering a migration failed; trying elsewhere");
                failed.get_or_insert(e);
                continue;
            }
            tracing::debug!(from = ?from_stream, bytes = req.size, "cross-stream migration");
            return Ok(Some((addr, seg)));
        }
        *req = asked;
        failed.map_or(Ok(None), Err)
    }

    /// Takes a new segment from the upstream for a free range that fits `req`: the growth policy's
    /// preferred size, then the minimal one; a [dedicated](Kind::Dedicated) request, the minimal
    /// one only. `Ok(None)` when the upstream is out of memory.
    fn grow(&self, req: &Request, minimal_only: bool) -> Result<Option<Seg>, PoolError> {
        let (kind, need) = (req.kind, req.need);
        let _span =
            tracing::debug_span!("grow", device = self.upstream.device(), bytes = need, ?kind).entered();
        let (preferred, minimal) = self.segments.lock().plan(&self.config, kind, need)?;
        let sizes = if minimal_only || kind == Kind::Dedicated || preferred == minimal {
            &[minimal][..]
        } else {
            &[preferred, minimal][..]
        };
        for &size in sizes {
            match self.upstream.allocate(size) {
                Ok(addr) => {
                    if addr % SEGMENT_ALIGN as u64 != 0 || addr.checked_add(size as u64).is_none() {
                        // SAFETY: `addr` is what `allocate(size)` just returned, given back once
                        // and never handed out: nothing was queued on it, nothing uses it.
                        unsafe { self.upstream.deallocate(addr, size) };
                        return Err(PoolError::MisalignedSegment { addr });
                    }
                    let seg = Seg { base: addr, len: size as u64 };
                    self.segments.lock().add(&self.config, seg, kind);
                    tracing::debug!(segment_bytes = size, "segment added");
                    return Ok(Some(seg));
                }
                Err(e) if e.is_out_of_memory() => {}
                Err(e) => return Err(PoolError::Upstream(e)),
            }
        }
        Ok(None)
    }

    /// The out-of-memory ladder: synchronise, coalesce all cached memory, retry; release every fully
    /// free segment, retry the upstream; with plain segments, as the last step, when the dedicated
    /// ranges (stranded ones included) hold the request's bytes, synchronise again and take a range
    /// of a dedicated segment that the split limit kept from the request
    /// ([`dedicated_last_resort`](Self::dedicated_last_resort)); report.
    ///
    /// With a segment upstream, segments are given back, and a new one asked for, with no lock
    /// held: the upstream may run user code (a
    /// [`FailureCallbackResource`](crate::FailureCallbackResource)'s callback) that frees into this
    /// pool or trims it, and `cuMemFree` waits for the whole device. It synchronises with no lock
    /// held ([`synchronize_unlocked`](Self::synchronize_unlocked)); with expandable segments it
    /// unmaps the chunks its release took out with no lock held, then maps under the locks taken
    /// again after that (the free ranges it joins are safe without another wait only while they are
    /// held, and only if nothing was freed into the arenas while they were let go: else it
    /// synchronises again, see [`unmap_in_ladder`](Self::unmap_in_ladder)); its own release then
    /// holds no plain segment (the pool takes none with expandable segments), and the upstream's
    /// mapping calls must not call into the pool.
    #[cold]
    fn oom_ladder(
        &self,
        to: &Arena<O::Stream>,
        stream: O::Stream,
        req: &Request,
    ) -> Result<Block, PoolError> {
        let _span =
            tracing::debug_span!("oom_ladder", device = self.upstream.device(), bytes = req.requested)
                .entered();
        self.flush_thread_caches();
        let (mut st, mut guards) = self.lock_all();
        self.segments.lock().oom_ladders += 1;
        let unretired = self.sweep(&mut st, &mut guards);
        for g in guards.iter_mut() {
            g.flush_bins();
        }
        // Synchronised with no lock held (a host function may use the pool meanwhile). Once the
        // locks are back, every cached byte is safe for every stream (of the stranded ones, those
        // stranded before the synchronisation started, which it returns to the cache).
        let Some((st, mut guards)) = self.synchronize_unlocked(st, guards, unretired)? else {
            // Frees raced with every synchronisation: no cached memory is known to be safe for
            // this stream, but a new segment is.
            return self.oom_ladder_grow_only(to, req);
        };
        consolidate(&mut guards);
        let ti = to.index;
        // Own kind first, own arena first; then memory of the other segment kinds.
        let kinds: &[Kind] = match req.kind {
            Kind::Small => &[Kind::Small, Kind::Large],
            Kind::Large => &[Kind::Large, Kind::Small],
            Kind::Dedicated => &[Kind::Dedicated, Kind::Large, Kind::Small],
        };
        let mut found = None;
        let mut no_address_space = None;
        'search: for &kind in kinds {
            for i in std::iter::once(ti).chain((0..guards.len()).filter(|&i| i != ti)) {
                if let Some((addr, seg)) = guards[i].take_kind(kind, req) {
                    found = Some((addr, seg, kind));
                    break 'search;
                }
            }
        }
        if found.is_none() {
            let mut notes = expandable::Notes::default();
            let (mut released, unlinked, unmapping) = self.release(&mut guards, 0);
            if let Some(up) = self.expandable() {
                // Plain segments unlinked here would be freed only after the mapping below, too
                // late to help it; there are none: with expandable segments the pool never takes
                // a plain segment (`grow` is not called), so `unlinked` is empty.
                // The chunks taken out are unmapped with no lock held, then the locks are taken
                // again: the free ranges are still safe for every stream if nothing was freed
                // into any arena meanwhile (see `synchronize_unlocked`), else it synchronises again.
                let (st, mut guards) =
                    match self.unmap_in_ladder(st, guards, unmapping, &mut released, &mut notes) {
                        Ok(Some(locked)) => locked,
                        // `Err`: synchronising again failed (as the ladder's first synchronisation
                        // would have); `Ok(None)`: frees raced with every synchronisation.
                        answer => {
                            notes.log();
                            Self::log_released(&released);
                            self.log_upstream_notes();
                            answer?;
                            return self.oom_ladder_grow_only(to, req);
                        }
                    };
                // Mapping is the driver's own call (no user code), and joins the free ranges around
                // a gap, which are safe without another wait only while the locks taken again
                // after the synchronisation (counters unchanged) are held.
                let mut segs = self.segments.lock();
                // Under the registry's lock, where unmaps in flight are settled.
                let seen = self.returning.finished();
                expandable::gather(&segs, &mut guards, ti, req.kind);
                let reservation = self.config.expandable_reservation_bytes;
                // Growth's events after the release's: logged in the order they happened.
                let mut grown_notes = expandable::Notes::default();
                let grown = expandable::grow(
                    up,
                    &mut segs,
                    guards[ti].set(req.kind),
                    ti,
                    req,
                    reservation,
                    &mut grown_notes,
                );
                drop(segs);
                drop((guards, st));
                // The block, taken out of the free set, is counted live before anything is logged:
                // a subscriber that panics then leaks a block still counted (as in
                // `allocate_slow`), not a range neither cached nor live.
                let out_of_memory = matches!(grown, Ok(expandable::Grown::OutOfMemory));
                let block = match grown {
                    Ok(expandable::Grown::Block(addr, seg)) => Ok(Some(self.finish((), req, addr, seg))),
                    Ok(expandable::Grown::OutOfAddressSpace { reservation }) => {
                        no_address_space = Some(reservation);
                        Ok(None)
                    }
                    Ok(expandable::Grown::OutOfMemory) => Ok(None),
                    Err(e) => Err(e),
                };
                notes.log();
                Self::log_released(&released);
                grown_notes.log();
                // The upstream's own warnings (of the release's unmaps and the growth's maps)
                // last: it keeps them in one list.
                self.log_upstream_notes();
                self.give_back(unlinked);
                if let Some(block) = block? {
                    return Ok(block);
                }
                // Another thread's trim or ladder may have taken chunks out before this ladder
                // locked the arenas, and not unmapped them yet: wait for the unmaps in flight now
                // (for a bounded time: an unmap may wait for this very thread), then grow once
                // more, as a stream's growth does (no other arena's memory is joined: the locks
                // were let go).
                if (out_of_memory || no_address_space.is_some())
                    && self.returning.wait_for_frees(seen, self.config.oom_free_wait)
                    && let Some(block) = self.grow_expandable(up, to, stream, req)?
                {
                    return Ok(block);
                }
            } else {
                drop((guards, st));
                // Nothing to unmap without expandable segments: `unmapping` is empty.
                drop(unmapping);
                notes.log();
                self.log_upstream_notes();
                Self::log_released(&released);
                self.give_back(unlinked);
                found = self.grow_new_segment(to, req)?;
                if found.is_none() {
                    found = self.dedicated_last_resort(to, req)?;
                    if found.is_some() {
                        // Counted live before it is logged, as everything the ladder serves.
                        let block = self.ladder_answer(found, req, None);
                        tracing::debug!(
                            bytes = req.size,
                            "out of memory: served from a dedicated segment after all"
                        );
                        return block;
                    }
                }
            }
        } else {
            drop((guards, st));
        }
        self.ladder_answer(found, req, no_address_space)
    }

    /// For the ladder with expandable segments, after its release under the locks (`st`, `guards`):
    /// unmaps the chunks taken out with the locks let go
    /// ([`unmap_unlocked`](Self::unmap_unlocked)), then returns every lock taken again with every
    /// cached block freed before a synchronisation started, as
    /// [`synchronize_unlocked`](Self::synchronize_unlocked) does: at once if no arena's insert
    /// counters changed meanwhile, else after synchronising again (`None`: frees raced with every
    /// synchronisation; the locks are let go).
    fn unmap_in_ladder<'a>(
        &'a self,
        st: MutexGuard<'a, TableState>,
        guards: Guards<'a, O::Stream>,
        unmapping: Unmapping<'_>,
        released: &mut TrimReport,
        notes: &mut expandable::Notes,
    ) -> Result<Option<AllLocks<'a, O::Stream>>, PoolError> {
        if unmapping.stretches.is_empty() && unmapping.empty.is_empty() {
            return Ok(Some((st, guards)));
        }
        let before = self.arena_inserts(&guards);
        drop((guards, st));
        self.unmap_unlocked(unmapping, released, notes);
        let (st, guards) = self.lock_all();
        if inserts_unchanged(&before, &self.arena_inserts(&guards)) {
            return Ok(Some((st, guards)));
        }
        let unretired = Unretired { ordering: &self.ordering, failed: Vec::new(), retired: false };
        self.synchronize_unlocked(st, guards, unretired)
    }

    /// The ladder's last step with plain segments, once nothing cached fitted and the upstream had
    /// no segment for `req` even after the release: a range of a dedicated segment that the split
    /// limit kept from it (see [`ArenaInner::take`]; a smaller request, or one that would leave more
    /// than the limit behind). Pinning that segment beats refusing memory the pool holds; it comes
    /// last because giving back wholly free segments and growing keeps dedicated segments whole.
    /// The locks were let go for the growth, so it synchronises again first, as the ladder does,
    /// unless the dedicated ranges (stranded ones included) hold fewer bytes than the request.
    #[cold]
    fn dedicated_last_resort(
        &self,
        to: &Arena<O::Stream>,
        req: &Request,
    ) -> Result<Option<(u64, Seg, Kind)>, PoolError> {
        self.flush_thread_caches();
        let (mut st, mut guards) = self.lock_all();
        // Without the dedicated bytes for it, another synchronisation of the device would be spent
        // for nothing. Blocks stranded since the ladder's synchronisation (a free or a migration
        // racing the growth whose ordering failed) count: this synchronisation returns them.
        let in_arenas: u64 = guards.iter().map(|g| g.dedicated.bytes()).sum();
        let stranded: u64 =
            (self.segments.lock().stranded.iter()).filter(|b| b.3 == Kind::Dedicated).map(|b| b.1).sum();
        if in_arenas + stranded < req.size {
            return Ok(None);
        }
        let unretired = self.sweep(&mut st, &mut guards);
        for g in guards.iter_mut() {
            g.flush_bins();
        }
        let (st, mut guards) = match self.synchronize_unlocked(st, guards, unretired) {
            Ok(Some(locked)) => locked,
            Ok(None) => {
                tracing::debug!(
                    "memory freed into the pool during every synchronisation; not trying dedicated segments"
                );
                return Ok(None);
            }
            // The request is answered as the ladder would have answered it without this step (its
            // own synchronisation succeeded): out of memory, with the report. No lock is held.
            Err(e) => {
                tracing::warn!(error = %e, "the out-of-memory ladder's last synchronisation failed");
                return Ok(None);
            }
        };
        // Frees since the ladder's first step may have left pieces of one segment in two arenas.
        consolidate(&mut guards);
        let ti = to.index;
        let found = std::iter::once(ti)
            .chain((0..guards.len()).filter(|&i| i != ti))
            .find_map(|i| guards[i].dedicated.take(req.size, req.align));
        drop((guards, st));
        Ok(found.map(|(addr, seg)| (addr, seg, Kind::Dedicated)))
    }

    /// The ladder when memory was freed into the pool during each of its synchronisations (other
    /// threads allocating and freeing all along): no cached memory is known to be safe for the
    /// requesting stream, and waiting under the locks could deadlock with a host function that
    /// uses the pool, so only a new segment may serve it. With expandable segments growth joins
    /// cached ranges, which need that synchronisation: out of memory.
    #[cold]
    fn oom_ladder_grow_only(&self, to: &Arena<O::Stream>, req: &Request) -> Result<Block, PoolError> {
        tracing::debug!("memory freed into the pool during every synchronisation; only growing");
        let found = if self.expandable().is_none() { self.grow_new_segment(to, req)? } else { None };
        self.ladder_answer(found, req, None)
    }

    /// The ladder's answer: the block `found` (counted live), or its out-of-memory error (see
    /// [`out_of_memory`](Self::out_of_memory)).
    fn ladder_answer(
        &self,
        found: Option<(u64, Seg, Kind)>,
        req: &Request,
        no_address_space: Option<u64>,
    ) -> Result<Block, PoolError> {
        match found {
            Some((addr, seg, kind)) => {
                self.count_alloc(req.size, req.requested);
                Ok(Block { kind, ..self.block(req, addr, seg) })
            }
            None => Err(self.out_of_memory(req, no_address_space)),
        }
    }

    /// For the ladder, with no lock held: a new plain segment from the upstream, inserted into
    /// `to` with the request's block taken out of it (`None`: the upstream has no memory).
    fn grow_new_segment(
        &self,
        to: &Arena<O::Stream>,
        req: &Request,
    ) -> Result<Option<(u64, Seg, Kind)>, PoolError> {
        let seen = self.returning.finished();
        let mut grown = self.grow(req, true)?;
        // Another thread's release may have taken segments out before this ladder locked
        // the arenas, and not returned them yet: wait for the frees in flight now (for a
        // bounded time: such a free may wait for this very thread), then try once more.
        if grown.is_none() && self.returning.wait_for_frees(seen, self.config.oom_free_wait) {
            grown = self.grow(req, true)?;
        }
        let Some(seg) = grown else { return Ok(None) };
        // Memory freed into the arena since the locks were let go is not ordered for
        // this stream (the arena may be shared): only the new segment serves it.
        let mut g = to.inner.lock();
        let set = g.set(req.kind);
        // Fresh memory: no thread comparing insert counters needs to wait for it.
        set.insert_uncounted(seg.base, seg.len, seg);
        Ok(set.take_at(seg.base, req.size, req.align).map(|(addr, seg)| (addr, seg, req.kind)))
    }

    /// Counts and logs the ladder's failure, with no lock held (a subscriber may read the pool's
    /// stats), and returns its error: out of address space when an expandable segment's
    /// reservation was full (`no_address_space`: its size), else out of memory.
    fn out_of_memory(&self, req: &Request, no_address_space: Option<u64>) -> PoolError {
        let allocated = self.live_bytes().max(0) as u64;
        let largest = self.arenas.iter().map(|a| a.inner.lock().largest()).max().unwrap_or(0);
        let mut segs = self.segments.lock();
        segs.oom_errors += 1;
        if let Some(reservation_bytes) = no_address_space {
            let err = PoolError::AddressSpaceExhausted {
                requested: req.requested,
                reservation_bytes,
                segments: segs.expandable.segs.len() as u64,
                reserved_address_space: segs.expandable.segs.values().map(|e| e.len).sum(),
                mapped: segs.expandable.mapped(),
            };
            // Logged with the lock let go, as below: a subscriber may read the pool's stats.
            drop(segs);
            tracing::warn!(%err, "caching pool out of address space");
            return err;
        }
        let err = PoolError::OutOfMemory {
            requested: req.requested,
            allocated,
            reserved: segs.reserved,
            free_cached: segs.reserved.saturating_sub(allocated),
            largest_free_block: largest,
        };
        drop(segs);
        tracing::warn!(%err, "caching pool out of memory");
        err
    }

    /// Logs what the expandable upstream noted under the pool's locks (call with none held).
    fn log_upstream_notes(&self) {
        if let Some(up) = self.upstream.expandable() {
            up.log_deferred();
        }
    }

    /// Takes the table's mutex (no arena comes or goes), then locks every arena in position order.
    fn lock_all(&self) -> AllLocks<'_, O::Stream> {
        let st = self.arenas.lock_state();
        (st, self.arenas.iter().map(|a| a.inner.lock()).collect())
    }

    fn cached_estimate(&self) -> u64 {
        let live = self.live_bytes();
        self.segments.lock().reserved.saturating_sub(live.max(0) as u64)
    }

    /// Whether more than `keep` bytes are cached and some segment is entirely cached (possibly split
    /// between arenas). Bins must have been flushed.
    fn releasable(&self, guards: &Guards<'_, O::Stream>, keep: u64) -> bool {
        if self.cached_estimate() <= keep {
            return false;
        }
        if let Some(up) = self.upstream.expandable()
            && expandable::releasable(up.chunk_bytes() as u64, &self.segments.lock(), guards)
        {
            return true;
        }
        let mut per_seg: HashMap<u64, u64> = HashMap::new();
        for g in guards {
            for (_, len, seg) in g.sets().into_iter().flat_map(|(set, _)| set.ranges()) {
                let sum = per_seg.entry(seg.base).or_default();
                *sum += len;
                if *sum == seg.len {
                    return true;
                }
            }
        }
        false
    }

    /// Releases fully free segments, largest first, while more than `keep` bytes are cached: takes
    /// them out of the arenas and the books and returns them as `(addr, len)` for
    /// [`give_back`](Self::give_back) once no lock is held (nothing can reach them any more), then
    /// takes whole free chunks of expandable segments out of the arenas and the books, and the
    /// reservations with nothing mapped, for [`unmap_unlocked`](Self::unmap_unlocked) once no lock
    /// is held (which adds what it unmapped and released to the report). The caller holds all arena
    /// locks and has synchronised after every free in them.
    fn release(
        &self,
        guards: &mut Guards<'_, O::Stream>,
        keep: u64,
    ) -> (TrimReport, InFlight<'_>, Unmapping<'_>) {
        let live = self.live_bytes();
        let mut segs = self.segments.lock();
        let mut cached = segs.reserved.saturating_sub(live.max(0) as u64);
        let mut candidates = vec![];
        for (i, g) in guards.iter().enumerate() {
            for (set, kind) in g.sets() {
                for (addr, len, seg) in set.ranges() {
                    if addr == seg.base && len == seg.len && segs.map.contains_key(&addr) {
                        candidates.push((len, addr, i, kind));
                    }
                }
            }
        }
        candidates.sort_unstable_by_key(|c| std::cmp::Reverse((c.0, c.1)));
        let mut report = TrimReport::default();
        // From here on a panic must not leave frees counted as in flight.
        let mut unlinked = InFlight::new(&self.returning);
        for (len, addr, i, kind) in candidates {
            if cached <= keep {
                break;
            }
            guards[i].set(kind).remove(addr);
            segs.remove(addr);
            unlinked.push(addr, len);
            cached = cached.saturating_sub(len);
            report.released_segments += 1;
            report.released_bytes += len;
        }
        let mut unmapping = Unmapping::new(&self.returning);
        if let Some(up) = self.upstream.expandable() {
            // Out of `reserved_bytes` and into the returning bytes under the registry's lock, as
            // segments are (see `stats`).
            let returning = &self.returning;
            let start = |bytes| returning.start(bytes);
            let chunk = up.chunk_bytes() as u64;
            let out = &mut unmapping.stretches;
            expandable::take_chunks(chunk, &mut segs, guards, &mut cached, keep, start, out);
            unmapping.empty = expandable::take_empty(&mut segs);
        }
        (report, unlinked, unmapping)
    }

    /// Unmaps the chunks [`release`](Self::release) took out, then, with every lock taken again,
    /// records the gaps (a chunk whose unmap failed goes back to the cache, as it was) and takes the
    /// reservations left empty out of the books; releases those with the locks let go again. Adds
    /// what it unmapped and released to `report`. Call with no lock held: the driver brief lists
    /// `cuMemUnmap` as synchronous (an H100's waits for no unrelated stream, observed on
    /// 2026-11-24, but an upstream's `unmap` may take long), and the upstream's `unmap` may use the
    /// pool.
    fn unmap_unlocked(
        &self,
        mut unmapping: Unmapping<'_>,
        report: &mut TrimReport,
        notes: &mut expandable::Notes,
    ) {
        let Some(up) = self.upstream.expandable() else { return };
        // An upstream whose unmap or release uses this pool must not wait for these tickets.
        let _giving = Giving::enter();
        if !unmapping.stretches.is_empty() {
            expandable::unmap_chunks(up, &mut unmapping.stretches, notes);
            let (st, mut guards) = self.lock_all();
            let mut segs = self.segments.lock();
            let chunk = up.chunk_bytes() as u64;
            let empty =
                expandable::settle(chunk, &mut segs, &mut guards, &unmapping.stretches, report, notes);
            // Out of the returning bytes under the registry's lock, as what stayed mapped came
            // back into `reserved_bytes` (a snapshot counts it in exactly one of the two); but
            // the stretches of a reservation left empty only once it is released: a ladder
            // waiting for them may need that address space to grow.
            let (releasing, settled): (Vec<_>, Vec<_>) = unmapping
                .stretches
                .drain(..)
                .partition(|s| empty.iter().any(|&(base, _)| base == s.seg_base()));
            for s in settled {
                self.returning.finish(s.ticket, s.unmapped_any());
            }
            unmapping.stretches = releasing;
            unmapping.empty.extend(empty);
            drop(segs);
            drop((guards, st));
        }
        for (base, len) in std::mem::take(&mut unmapping.empty) {
            // SAFETY: a reservation `settle`/`take_empty` took out of the books as `reserve(len)`
            // returned it, once; nothing was mapped in it (nor being unmapped), so no block or
            // cached range lies there, and growth can no longer map into it.
            unsafe { up.release(base, len as usize) };
            report.released_segments += 1;
        }
        // Wholly unmapped (their reservation was empty): nothing came back into `reserved_bytes`.
        for s in unmapping.stretches.drain(..) {
            self.returning.finish(s.ticket, s.unmapped_any());
        }
    }

    /// Logs what a [`release`](Self::release) took out. Call with no lock of the pool held (a
    /// subscriber may read the pool's stats, which take them) and before
    /// [`give_back`](Self::give_back), with the segments still in their [`InFlight`]: a subscriber
    /// that panics here leaves them to its drop, which settles them.
    fn log_released(report: &TrimReport) {
        if report.released_segments > 0 {
            tracing::debug!(
                released_bytes = report.released_bytes,
                segments = report.released_segments,
                "segments released"
            );
        }
    }

    /// Returns segments [`release`](Self::release) took out to the upstream. Call with no lock
    /// held: `cuMemFree` waits for the whole device, host functions included, and an upstream may
    /// run user code.
    fn give_back(&self, mut unlinked: InFlight<'_>) {
        if unlinked.segs.is_empty() {
            return;
        }
        let _giving = Giving::enter();
        while let Some(&(addr, len, ticket)) = unlinked.segs.get(unlinked.freed) {
            // SAFETY: `release` took this whole free segment (`allocate`d with `len` bytes: the
            // books keep the size it was added with) out of the arenas and the books, so nothing
            // can reach it and it is given back once; its caller synchronised after every free in
            // it, so no work of any stream uses it.
            unsafe { self.upstream.deallocate(addr, len as usize) };
            // Only now: if the upstream panics, `unlinked`'s drop settles this free too.
            unlinked.freed += 1;
            self.returning.finish(ticket, true);
        }
    }
}

/// What a sweep leaves for after the pool's locks: the dropped streams it could not retire (each
/// kept, with its arena), to log (a subscriber may read the pool's stats, which take the locks),
/// and, where it retired any, what the ordering let go of meanwhile, to drop
/// ([`Ordering::drop_deferred`]: destroying an event makes driver calls and may log). Both done by
/// [`log`](Self::log).
#[must_use = "log them once the locks are let go"]
struct Unretired<'a, O: Ordering> {
    ordering: &'a O,
    failed: Vec<(O::Stream, crate::UpstreamError)>,
    /// Whether a stream was retired.
    retired: bool,
}

impl<O: Ordering> Unretired<'_, O> {
    /// Whether nothing is left for after the locks.
    fn is_empty(&self) -> bool {
        self.failed.is_empty() && !self.retired
    }

    /// Warns about each stream not retired, then has the ordering drop what it kept. Call with no
    /// lock of the pool held.
    fn log(self) {
        for (stream, e) in self.failed {
            tracing::warn!(error = %e, ?stream, "retiring a dropped stream failed; kept");
        }
        if self.retired {
            self.ordering.drop_deferred();
        }
    }
}

/// Merges the cached memory of all arenas (bins flushed) so that ranges of one segment split between
/// streams become one range, kept by the arena that held its lowest piece. Only valid after a
/// synchronisation that followed every free in the arenas. The moves are not counted as inserts:
/// the memory is safe for every stream, and a trim or ladder waiting meanwhile need not
/// synchronise again for it (concurrent ladders would otherwise take each other's
/// consolidations for frees racing their waits).
fn consolidate<S>(guards: &mut Guards<'_, S>) {
    for g in guards.iter_mut() {
        g.flush_bins();
    }
    if guards.len() < 2 {
        return;
    }
    for kind in Kind::ALL {
        let mut all: Vec<(u64, u64, Seg, usize)> = vec![];
        for (i, g) in guards.iter_mut().enumerate() {
            all.extend(g.set(kind).drain().into_iter().map(|(a, l, s)| (a, l, s, i)));
        }
        all.sort_unstable_by_key(|x| x.0);
        let mut it = all.into_iter();
        let Some(mut cur) = it.next() else { continue };
        for x in it {
            if x.2 == cur.2 && cur.0 + cur.1 == x.0 {
                cur.1 += x.1;
            } else {
                guards[cur.3].set(kind).insert_uncounted(cur.0, cur.1, cur.2);
                cur = x;
            }
        }
        guards[cur.3].set(kind).insert_uncounted(cur.0, cur.1, cur.2);
    }
}

/// Whether the arenas' insert counters `after` (from [`CachingPool::arena_inserts`]) are those noted
/// `before`; an arena new to the table counts as all zero then (a fresh arena's).
fn inserts_unchanged(before: &[(usize, [u64; 4])], after: &[(usize, [u64; 4])]) -> bool {
    after.iter().all(|(index, now)| {
        let then = before.binary_search_by_key(index, |x| x.0).map_or([0; 4], |k| before[k].1);
        *now == then
    })
}

/// Two distinct elements of `v`, mutably; `None` when `i == j`.
fn two_mut<T>(v: &mut [T], i: usize, j: usize) -> Option<(&mut T, &mut T)> {
    if i < j {
        let (a, b) = v.split_at_mut(j);
        Some((&mut a[i], &mut b[0]))
    } else if j < i {
        let (a, b) = v.split_at_mut(i);
        Some((&mut b[0], &mut a[j]))
    } else {
        None
    }
}

impl<U: Upstream, O: Ordering> Drop for CachingPool<U, O> {
    fn drop(&mut self) {
        let live: i64 = {
            let caches = self.caches.lock();
            self.all_counters(&caches).map(|c| c.count()).sum()
        };
        // Threads forget their caches of this pool (whose blocks the segments below take along).
        self.caches.kill();
        let segs = std::mem::take(self.segments.get_mut());
        if segs.map.is_empty() && segs.expandable.segs.is_empty() {
            return;
        }
        if live > 0 {
            tracing::warn!(live, "caching pool dropped with live blocks; releasing their segments anyway");
        }
        if let Err(e) = self.ordering.synchronize() {
            // Work may still be queued on these segments: freeing them could let the upstream hand
            // the memory to someone else under that work. Leak them instead.
            tracing::warn!(error = %e, segments = segs.map.len(), "caching pool drop: synchronize failed; leaking segments");
            // The expandable upstream is dropped with the pool: its mappings would unmap there.
            if let Some(up) = self.upstream.expandable() {
                up.abandon();
            }
            return;
        }
        for (base, (len, _)) in segs.map {
            // SAFETY: each segment of the books as `allocate` returned it, taken out of them, so
            // given back once; `synchronize` succeeded after every use. The pool is being
            // dropped: no block of it can be used any more (a `CachingResource`'s buffers hold
            // it alive, and a `Block` is only an address).
            unsafe { self.upstream.deallocate(base, len as usize) };
        }
        if let Some(up) = self.upstream.expandable() {
            expandable::teardown(up, segs.expandable);
            up.log_deferred();
        }
    }
}
