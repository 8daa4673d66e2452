//! Per-thread caches of recently freed small blocks: the caching pool's fast path without a lock.
//!
//! A thread that frees a small block (at most [`THREAD_CACHE_MAX_BLOCK`]) keeps it in its own cache
//! for that pool, under the stream it was freed on; the thread's next allocation of the same size
//! class **on the same stream** takes it back without locking anything (stream order protects it,
//! as in the stream's arena). A block is never taken from a thread cache for another stream: that
//! goes through the stream's arena, where migration orders the taker after the freeing stream.
//!
//! Each cache holds at most [`THREAD_CACHE_BLOCKS`] blocks and [`THREAD_CACHE_BYTES`] bytes; when
//! full, its older three quarters go to the streams' arenas' bins (and a cache that filled up
//! without serving a single request is bypassed for the next frees). A thread's own cache goes to the arenas before
//! its allocation migrates memory from another stream or grows the pool; every cache (other
//! threads' too) goes there before `trim`, the release threshold, the out-of-memory ladder, a sweep
//! of dropped streams, `validate` and `cached_ranges`. A thread that exits leaves its cache to the
//! pool, which takes it at its next slow path. Statistics count a thread-cached block as cached
//! (reserved, not live): each cache has its own counters, summed on read like the arenas'.
//!
//! Another thread takes a cache's blocks through an asymmetric fence: the
//! owner marks itself busy, fences (a compiler fence where the process uses `membarrier`) and checks
//! that the cache is not revoked; the flusher revokes, fences heavily and waits until the owner is
//! not busy. The owner's fast path has no atomic read-modify-write.
//!
//! ```
//! use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig};
//!
//! let pool = CachingPool::new(HostUpstream::new(1 << 30), HostOrdering::new(), PoolConfig::default());
//! let a = pool.allocate(256, 256, 1).unwrap();
//! let addr = a.addr();
//! // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! unsafe { pool.deallocate(a, 1) }.unwrap(); // into this thread's cache, under stream 1
//! let s = pool.stats();
//! assert_eq!((s.current_bytes, s.cached_bytes), (0, 2 << 20)); // cached, not live
//! let b = pool.allocate(256, 256, 1).unwrap(); // taken back without a lock
//! assert_eq!(b.addr(), addr);
//! // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! unsafe { pool.deallocate(b, 1) }.unwrap();
//! assert_eq!(pool.trim().unwrap().released_bytes, 2 << 20); // trim sees thread-cached blocks
//! ```

use std::any::Any;
use std::cell::{Cell, RefCell, UnsafeCell};
use std::sync::Arc;
use std::sync::atomic::{
    AtomicBool, AtomicI64, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};

use parking_lot::{Mutex, MutexGuard};

use crate::caching_fence;
use crate::free_set::Seg;
use crate::stats::{Counters, Histogram};

/// The most blocks one thread keeps for one pool.
pub const THREAD_CACHE_BLOCKS: usize = 16;
/// The largest block a thread cache keeps; larger ones go to the stream's arena.
pub const THREAD_CACHE_MAX_BLOCK: usize = 256 << 10;
/// The most bytes one thread keeps for one pool.
pub const THREAD_CACHE_BYTES: u64 = 2 << 20;

/// A cached block: the stream it was freed on, its size class, address and segment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry<S> {
    pub stream: S,
    pub bin: u32,
    pub addr: u64,
    pub seg: Seg,
}

#[derive(Debug)]
struct Slots<S> {
    /// Oldest first.
    entries: Vec<Entry<S>>,
    bytes: u64,
    /// Bit `bin % 64` set when an entry of size class `bin` may be held: a miss (most requests
    /// of varied sizes) skips the scan. Stale bits only cost a scan; rebuilt when entries leave.
    classes: u64,
    /// Whether a block was taken back since the cache last filled up (a flag, not a count: a
    /// thread that allocates and frees one size for ever never fills it, and a count would
    /// overflow).
    served: bool,
    /// Frees still to send straight to the arenas: a cache that filled up without serving a
    /// single request (every size different) only adds a copy to each free for a while.
    bypass: u32,
}

/// What [`ThreadCache::put`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Put {
    /// Kept (and counted).
    Kept,
    /// Not kept: the cache is full; [`ThreadCache::evict`] makes room.
    Full,
    /// Not kept: the caller frees to the arena (the cache is being flushed, or bypassed).
    Declined,
}

/// How many frees skip a cache that filled up without a hit.
const BYPASS_FREES: u32 = 256;

impl<S> Slots<S> {
    fn rebuild_classes(&mut self) {
        self.classes = self.entries.iter().fold(0, |m, e| m | class_bit(e.bin));
    }
}

#[inline(always)]
fn class_bit(bin: u32) -> u64 {
    1 << (bin % 64)
}

/// Live counts of the blocks a thread cache handed out and took back: written by one thread at a
/// time (the owner; the registry's lock for the counts of exited threads), read by anyone.
#[derive(Debug)]
pub(crate) struct CacheCounters {
    /// Live bytes and blocks, with limits for the peaks (see [`crate::stats`]).
    pub counters: Counters,
    requested: AtomicI64,
    allocations: AtomicU64,
    histogram: [AtomicU64; 64],
}

impl Default for CacheCounters {
    fn default() -> Self {
        CacheCounters {
            counters: Counters::default(),
            requested: AtomicI64::new(0),
            allocations: AtomicU64::new(0),
            histogram: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// Adds to an atomic that only the caller writes.
#[inline(always)]
fn bump_i(a: &AtomicI64, v: i64) {
    a.store(a.load(Relaxed) + v, Relaxed);
}

#[inline(always)]
fn bump_u(a: &AtomicU64, v: u64) {
    a.store(a.load(Relaxed) + v, Relaxed);
}

impl CacheCounters {
    /// Counts an allocation; true when a peak limit was crossed (the caller rebalances).
    #[inline]
    fn alloc(&self, size: u64, requested: usize) -> bool {
        bump_i(&self.requested, requested as i64);
        bump_u(&self.allocations, 1);
        bump_u(&self.histogram[Histogram::bucket(requested)], 1);
        self.counters.add(size as i64, 1)
    }

    /// Counts a free.
    #[inline]
    fn free(&self, size: u64, requested: usize) {
        bump_i(&self.requested, -(requested as i64));
        self.counters.add(-(size as i64), -1);
    }

    /// Adds `other`'s counts to these (the caller is the only writer of both).
    fn absorb(&self, other: &CacheCounters) {
        self.counters.add(other.counters.bytes(), other.counters.count());
        bump_i(&self.requested, other.requested.load(Relaxed));
        bump_u(&self.allocations, other.allocations.load(Relaxed));
        for (a, b) in self.histogram.iter().zip(&other.histogram) {
            bump_u(a, b.load(Relaxed));
        }
    }

    /// Adds these counts to statistics being summed: `(requested, allocations)` and the histogram.
    pub(crate) fn add_to(&self, requested: &mut i64, allocations: &mut u64, histogram: &mut Histogram) {
        *requested += self.requested.load(Relaxed);
        *allocations += self.allocations.load(Relaxed);
        for (h, a) in histogram.0.iter_mut().zip(&self.histogram) {
            *h += a.load(Relaxed);
        }
    }
}

/// One thread's cache for one pool.
#[derive(Debug)]
pub(crate) struct ThreadCache<S> {
    /// Set by the owner while it uses `slots`.
    busy: AtomicBool,
    /// Set by a flusher while it uses `slots`; the owner then keeps out.
    revoked: AtomicBool,
    /// The owner thread exited: the pool takes the cache over.
    orphaned: AtomicBool,
    /// The pool was dropped: the owner forgets the cache at its next registration.
    dead: AtomicBool,
    /// The registry's "a thread exited" flag.
    orphans: Arc<AtomicBool>,
    slots: UnsafeCell<Slots<S>>,
    pub counters: CacheCounters,
}

// SAFETY: `slots` is used only by the owner between `enter` and `leave` (busy set, revoked seen
// clear after the store→load fence) or by a flusher between `revoke_all` and `unrevoke` (revoked
// set, busy seen clear after the heavy fence, flushers serialised by the registry's mutex); the
// asymmetric fence makes these two windows exclusive. Once the owner has exited (`orphaned` seen
// set), only a flusher holding the registry's mutex uses them. Everything else is atomic.
unsafe impl<S: Send> Sync for ThreadCache<S> {}

impl<S: Copy + Eq> ThreadCache<S> {
    fn new(orphans: Arc<AtomicBool>) -> Self {
        ThreadCache {
            busy: AtomicBool::new(false),
            revoked: AtomicBool::new(false),
            orphaned: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            orphans,
            slots: UnsafeCell::new(Slots {
                entries: Vec::with_capacity(THREAD_CACHE_BLOCKS),
                bytes: 0,
                classes: 0,
                served: false,
                bypass: 0,
            }),
            counters: CacheCounters::default(),
        }
    }

    /// Runs `f` on the slots as the owner; `None` while a flusher holds them.
    #[inline(always)]
    fn owned<R>(&self, f: impl FnOnce(&mut Slots<S>) -> R) -> Option<R> {
        self.busy.store(true, Relaxed);
        caching_fence::light();
        if self.revoked.load(Acquire) {
            self.busy.store(false, Release);
            return None;
        }
        // Clears busy even if `f` panics: a flusher waiting for it holds the registry's mutex.
        let _leave = Leave(&self.busy);
        // SAFETY: busy is set and revoked was seen clear after the fence: no flusher uses the
        // slots until busy is cleared (see the `Sync` impl), and only the owner thread calls this.
        Some(f(unsafe { &mut *self.slots.get() }))
    }

    /// Takes a block of size class `bin` (`size` bytes) freed on `stream`, as the owner, and counts
    /// its allocation: `(addr, segment, peak limit crossed)`.
    #[inline]
    pub(crate) fn take(&self, stream: S, bin: u32, size: u64, requested: usize) -> Option<(u64, Seg, bool)> {
        let (addr, seg) = self
            .owned(|s| {
                if s.classes & class_bit(bin) == 0 {
                    return None;
                }
                let i = s.entries.iter().rposition(|e| e.bin == bin && e.stream == stream)?;
                // Usually the newest entry: a pop, without `remove`'s move of the tail.
                let e = if i + 1 == s.entries.len() { s.entries.pop()? } else { s.entries.remove(i) };
                s.bytes -= size;
                s.served = true;
                Some((e.addr, e.seg))
            })
            .flatten()?;
        Some((addr, seg, self.counters.alloc(size, requested)))
    }

    /// Keeps a freed block of `size` bytes as the owner and counts its free.
    #[inline]
    pub(crate) fn put(&self, e: Entry<S>, size: u64, requested: usize) -> Put {
        let put = self
            .owned(|s| {
                if s.bypass > 0 {
                    s.bypass -= 1;
                    return Put::Declined;
                }
                if s.entries.len() == THREAD_CACHE_BLOCKS || s.bytes + size > THREAD_CACHE_BYTES {
                    return Put::Full;
                }
                s.entries.push(e);
                s.bytes += size;
                s.classes |= class_bit(e.bin);
                Put::Kept
            })
            .unwrap_or(Put::Declined);
        if put == Put::Kept {
            self.counters.free(size, requested);
        }
        put
    }

    /// Makes room in a full cache, as the owner: returns the older entries (oldest first), which
    /// the caller files in the arenas. A cache that served nothing since it last filled up is
    /// bypassed for the next frees.
    #[cold]
    pub(crate) fn evict(&self) -> Vec<Entry<S>> {
        // Allocated before the owner's window: nothing in it allocates (a flusher may be waiting).
        let mut out = Vec::with_capacity(THREAD_CACHE_BLOCKS);
        self.owned(|s| {
            if !s.served {
                s.bypass = BYPASS_FREES;
            }
            s.served = false;
            evict_older(s, &mut out);
        });
        out
    }

    /// Counts an allocation from an arena, as the owner; true when a peak limit was crossed.
    #[inline]
    pub(crate) fn count_alloc(&self, size: u64, requested: usize) -> bool {
        self.counters.alloc(size, requested)
    }

    /// Counts a free to an arena, as the owner.
    #[inline]
    pub(crate) fn count_free(&self, size: u64, requested: usize) {
        self.counters.free(size, requested)
    }

    /// Takes every entry, as the owner (empty while a flusher holds them). The cache keeps its
    /// capacity, so its next `put` does not allocate.
    pub(crate) fn take_all(&self) -> Vec<Entry<S>> {
        let mut out = Vec::with_capacity(THREAD_CACHE_BLOCKS);
        self.owned(|s| {
            s.bytes = 0;
            s.classes = 0;
            out.append(&mut s.entries);
        });
        out
    }
}

/// Clears the owner's busy flag when the owner's window ends, by return or by unwinding.
struct Leave<'a>(&'a AtomicBool);

impl Drop for Leave<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.0.store(false, Release);
    }
}

/// Removes the older three quarters of the entries (at least enough bytes for one more block of
/// the largest size kept): the newest, likeliest to be asked for again, stay.
#[cold]
fn evict_older<S>(s: &mut Slots<S>, out: &mut Vec<Entry<S>>) {
    let mut n = (s.entries.len() * 3).div_ceil(4);
    let mut freed: u64 =
        s.entries[..n].iter().map(|e| crate::size_class::bin_bytes(e.bin as usize) as u64).sum();
    while n < s.entries.len() && s.bytes - freed + THREAD_CACHE_MAX_BLOCK as u64 > THREAD_CACHE_BYTES {
        freed += crate::size_class::bin_bytes(s.entries[n].bin as usize) as u64;
        n += 1;
    }
    s.bytes -= freed;
    // `out` has room for every entry: no allocation inside the owner's window.
    out.extend(s.entries.drain(..n));
    s.rebuild_classes();
}

/// What the thread-local list holds: any pool's cache, whatever its stream type.
trait Held: Send + Sync {
    fn orphan(&self);
    fn dead(&self) -> bool;
    fn any(&self) -> &dyn Any;
}

impl<S: Copy + Eq + Send + Sync + 'static> Held for ThreadCache<S> {
    fn orphan(&self) {
        // SeqCst with the drainer's clear-then-check below: two stores against a store and a
        // load (store buffering), so weaker orderings could let the drainer miss this cache while
        // its clear hides the flag from the next drain.
        self.orphaned.store(true, std::sync::atomic::Ordering::SeqCst);
        self.orphans.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    fn dead(&self) -> bool {
        self.dead.load(Acquire)
    }
    fn any(&self) -> &dyn Any {
        self
    }
}

/// A cache in the thread-local list; dropping it (thread exit) leaves the cache to its pool.
struct Slot {
    key: u64,
    /// The `ThreadCache<S>` of the pool with this key (`cache`'s own address).
    typed: *const (),
    cache: Arc<dyn Held>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The fast lookup must not name a cache this thread no longer holds.
        let _ = LAST.try_with(|last| {
            if last.get().0 == self.key {
                last.set((0, std::ptr::null()));
            }
        });
        self.cache.orphan();
    }
}

thread_local! {
    /// This thread's caches, one per pool it freed memory to.
    static HELD: RefCell<Vec<Slot>> = const { RefCell::new(Vec::new()) };
    /// The key and `typed` pointer of the slot used last: the fast path's lookup, a plain
    /// thread-local load (no destructor, no borrow flag). Cleared before its slot is dropped.
    static LAST: Cell<(u64, *const ())> = const { Cell::new((0, std::ptr::null())) };
}

static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// A pool's thread caches.
#[derive(Debug)]
pub(crate) struct Registry<S> {
    /// Names the pool in threads' lists; never reused.
    key: u64,
    caches: Mutex<Vec<Arc<ThreadCache<S>>>>,
    /// The counts of caches whose threads exited (written under `caches`' lock).
    pub folded: CacheCounters,
    /// Set when a thread with a cache exited.
    orphans: Arc<AtomicBool>,
}

impl<S: Copy + Eq + Send + Sync + 'static> Registry<S> {
    pub(crate) fn new() -> Self {
        caching_fence::init();
        Registry {
            key: NEXT_KEY.fetch_add(1, Relaxed),
            caches: Mutex::new(Vec::new()),
            folded: CacheCounters::default(),
            orphans: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Runs `f` on this thread's cache for the pool, if it has one.
    #[inline(always)]
    pub(crate) fn with_own<R>(&self, f: impl FnOnce(&ThreadCache<S>) -> R) -> Option<R> {
        let (key, typed) = LAST.get();
        if key == self.key {
            // SAFETY: `LAST` names a slot this thread's `HELD` holds (a slot clears it before it
            // is dropped), whose `Arc` keeps the cache alive for this call (slots are dropped only
            // by this thread, never during `f`, which does not touch the thread-local list); keys
            // are unique per pool, and the slot with this pool's key was made by this pool's
            // `register`, with this pool's stream type.
            return Some(f(unsafe { &*typed.cast::<ThreadCache<S>>() }));
        }
        self.with_own_slow(f)
    }

    /// [`with_own`](Self::with_own) when the last cache used was another pool's.
    #[inline(never)]
    fn with_own_slow<R>(&self, f: impl FnOnce(&ThreadCache<S>) -> R) -> Option<R> {
        let cache: *const ThreadCache<S> = HELD
            .try_with(|held| {
                let held = held.try_borrow().ok()?;
                let slot = held.iter().find(|s| s.key == self.key)?;
                let cache = slot.cache.any().downcast_ref::<ThreadCache<S>>()?;
                LAST.set((self.key, slot.typed));
                Some(std::ptr::from_ref(cache))
            })
            .ok()
            .flatten()?;
        // SAFETY: as in `with_own`: the slot's `Arc` (held by this thread) keeps it alive.
        Some(f(unsafe { &*cache }))
    }

    /// Gives this thread a cache for the pool (and forgets caches of dropped pools); false when the
    /// thread is exiting and has no thread-local storage left.
    #[cold]
    pub(crate) fn register(&self) -> bool {
        let cache = Arc::new(ThreadCache::new(self.orphans.clone()));
        let registered = HELD
            .try_with(|held| {
                let Ok(mut held) = held.try_borrow_mut() else { return false };
                held.retain(|s| !s.cache.dead());
                let typed = Arc::as_ptr(&cache).cast::<()>();
                held.push(Slot { key: self.key, typed, cache: cache.clone() });
                true
            })
            .unwrap_or(false);
        if registered {
            self.caches.lock().push(cache);
        }
        registered
    }

    /// The caches, locked (lock order: after the table and arena locks).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Vec<Arc<ThreadCache<S>>>> {
        self.caches.lock()
    }

    /// Counts an allocation (`bytes` > 0) or a free (`bytes` < 0) for a thread that has no cache
    /// and cannot make one (it is exiting), in [`folded`](Self::folded) under the lock; true
    /// when a peak limit was crossed. A thread that can make one gets one first.
    #[cold]
    pub(crate) fn count_slow(&self, bytes: i64, requested: i64) -> bool {
        if self.register() {
            let counted = self.with_own(|c| {
                if bytes > 0 {
                    c.count_alloc(bytes as u64, requested as usize)
                } else {
                    c.count_free(bytes.unsigned_abs(), requested.unsigned_abs() as usize);
                    false
                }
            });
            if let Some(breach) = counted {
                return breach;
            }
        }
        let _caches = self.caches.lock();
        if bytes > 0 {
            self.folded.alloc(bytes as u64, requested as usize)
        } else {
            self.folded.free(bytes.unsigned_abs(), requested.unsigned_abs() as usize);
            false
        }
    }

    /// Whether a thread with a cache exited since the last [`drain_all`](Self::drain_all).
    #[inline]
    pub(crate) fn orphans_pending(&self) -> bool {
        self.orphans.load(Relaxed)
    }

    /// Takes every entry of every cache (flushing other threads' caches through the heavy fence),
    /// and folds the counts of exited threads' caches into [`folded`](Self::folded), forgetting
    /// them. The caller then returns the entries to the arenas.
    pub(crate) fn drain_all(&self) -> Vec<Entry<S>> {
        let mut caches = self.caches.lock();
        if caches.is_empty() {
            self.orphans.store(false, Relaxed);
            return Vec::new();
        }
        for c in caches.iter() {
            c.revoked.store(true, Relaxed);
        }
        let fenced = caching_fence::heavy();
        let mut out = Vec::new();
        for c in caches.iter() {
            if fenced {
                let mut spins = 0u32;
                while c.busy.load(Acquire) {
                    spins += 1;
                    if spins < 64 {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
                // SAFETY: revoked is set and busy was seen clear after the heavy fence, and the
                // registry's lock is held: no one else uses the slots (see the `Sync` impl).
                let slots = unsafe { &mut *c.slots.get() };
                out.append(&mut slots.entries);
                slots.bytes = 0;
                slots.classes = 0;
            }
            c.revoked.store(false, Release);
        }
        if !fenced {
            // The exited threads' caches were not taken: the next slow path tries again.
            drop(caches);
            caching_fence::warn_unfenced();
            return out;
        }
        #[cfg(test)]
        tests::after_the_drain();
        // Cleared before the caches are examined (under the lock): a thread exiting from now on
        // sets it again, and one that exited before is folded below.
        self.orphans.store(false, std::sync::atomic::Ordering::SeqCst);
        caches.retain(|c| {
            if !c.orphaned.load(std::sync::atomic::Ordering::SeqCst) {
                return true;
            }
            // The owner is gone (it wrote its counts and entries before orphaning, released by the
            // flag). It may have freed into its cache after the loop above emptied it and exited
            // since: those entries are taken too, or their blocks would be lost to every arena.
            // SAFETY: the owner set `orphaned` after its last use of the slots (its thread's exit;
            // a live thread orphans only dead caches, which `kill` took out of this list first)
            // and this load saw it, so it never uses them again; the registry's lock is held, so
            // no other flusher does either.
            let slots = unsafe { &mut *c.slots.get() };
            out.append(&mut slots.entries);
            self.folded.absorb(&c.counters);
            false
        });
        out
    }

    /// The largest block held in any thread cache (0 when none), looked at through the heavy
    /// fence as [`drain_all`](Self::drain_all) does, without taking anything.
    pub(crate) fn largest(&self, bin_bytes: impl Fn(u32) -> u64) -> u64 {
        let caches = self.caches.lock();
        if caches.is_empty() {
            return 0;
        }
        for c in caches.iter() {
            c.revoked.store(true, Relaxed);
        }
        let fenced = caching_fence::heavy();
        let mut largest = 0;
        for c in caches.iter() {
            if fenced {
                while c.busy.load(Acquire) {
                    std::thread::yield_now();
                }
                // SAFETY: as in `drain_all`.
                let slots = unsafe { &*c.slots.get() };
                largest = slots.entries.iter().map(|e| bin_bytes(e.bin)).max().unwrap_or(0).max(largest);
            }
            c.revoked.store(false, Release);
        }
        drop(caches);
        if !fenced {
            caching_fence::warn_unfenced();
        }
        largest
    }

    /// The pool is dropped: every cache is forgotten by its thread at its next registration.
    pub(crate) fn kill(&self) {
        for c in self.caches.lock().drain(..) {
            c.dead.store(true, Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::caching_fence::tests::BARRIER_FAILS;

    thread_local! {
        /// Run by this thread's next [`Registry::drain_all`] between emptying the caches and
        /// forgetting those of exited threads.
        static AFTER_THE_DRAIN: std::cell::RefCell<Option<Box<dyn FnOnce()>>> = const { std::cell::RefCell::new(None) };
    }

    pub(super) fn after_the_drain() {
        if let Some(hook) = AFTER_THE_DRAIN.with(|h| h.borrow_mut().take()) {
            hook();
        }
    }

    /// A thread that frees into its cache after a flush emptied it, and exits before the flush
    /// forgets the caches of exited threads: its entry comes back with the others, not lost with
    /// the cache.
    #[test]
    fn an_entry_cached_by_a_thread_exiting_during_a_flush_is_flushed() {
        let registry = Arc::new(Registry::<u32>::new());
        let entry = |addr| Entry { stream: 3, bin: 1, addr, seg: Seg { base: 0, len: 2 << 20 } };
        let (go, gone) = (std::sync::mpsc::channel::<()>(), std::sync::mpsc::channel::<()>());
        let owner = {
            let registry = registry.clone();
            let (go, gone) = (go.1, gone.0);
            std::thread::spawn(move || {
                assert!(registry.register());
                registry.with_own(|c| assert_eq!(c.put(entry(512), 512, 512), Put::Kept)).unwrap();
                gone.send(()).unwrap();
                go.recv().unwrap();
                registry.with_own(|c| assert_eq!(c.put(entry(1024), 512, 512), Put::Kept)).unwrap();
            })
        };
        gone.1.recv().unwrap();
        let hook: Box<dyn FnOnce()> = Box::new(move || {
            go.0.send(()).unwrap();
            owner.join().unwrap();
        });
        AFTER_THE_DRAIN.with(|h| *h.borrow_mut() = Some(hook));
        let drained = registry.drain_all();
        let addrs: Vec<u64> = drained.iter().map(|e| e.addr).collect();
        assert_eq!(addrs, [512, 1024], "the entry cached before the flush, and the one after");
        assert!(registry.lock().is_empty(), "the exited thread's cache is forgotten");
        registry.kill();
    }

    /// A flush whose barrier failed warns once the registry's lock is let go: a subscriber that
    /// reads the pool's statistics on that warning (which takes the lock) does not wait for itself.
    #[test]
    fn a_failed_barrier_is_logged_with_the_registry_unlocked() {
        let registry = Arc::new(Registry::<u32>::new());
        assert!(registry.register());
        let unlocked = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let subscriber = {
            let (registry, unlocked) = (registry.clone(), unlocked.clone());
            cumem_sys::testing::OnEvent(move |event: &tracing::Event<'_>| {
                let message = cumem_sys::testing::event_message(event);
                if message == "membarrier failed after registration; thread caches not flushed" {
                    unlocked.lock().push(registry.caches.try_lock().is_some());
                }
            })
        };
        BARRIER_FAILS.set(true);
        cumem_sys::testing::with_subscriber(subscriber, || {
            assert!(registry.drain_all().is_empty());
            assert_eq!(registry.largest(|_| 1), 0);
        });
        BARRIER_FAILS.set(false);
        assert_eq!(*unlocked.lock(), [true, true], "drain_all, then largest, warned unlocked");
        registry.kill();
    }
}
