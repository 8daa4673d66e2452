//! The stream → arena map: read without locks, changed under a lock.
//!
//! Lookups happen twice per allocate/free pair, so they must not take a lock other than the arena's
//! own (which the caller takes anyway) or write shared memory. Arenas live in a list of fixed
//! capacity ([`STREAM_ARENAS`](crate::caching::STREAM_ARENAS) by default, plus one for retired
//! streams; streams beyond it share an arena) and are never freed while the pool lives, only vacated and reused; an open-addressing
//! index of list positions finds them. A lookup is a hash, a few acquire loads, and the arena's
//! lock, under which the arena's stream is compared: an arena vacated or reused meanwhile is simply
//! not a match. A lookup that misses (a stream new to the pool, or one raced with a change) retries
//! under the table's mutex, which every change holds, so the slow path is exact.
//!
//! ```
//! use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig};
//!
//! let up = HostUpstream::new(1 << 30);
//! let pool = CachingPool::with_stream_arenas(up, HostOrdering::new(), PoolConfig::default(), 2);
//! let a = pool.allocate(512, 1, 1).unwrap();
//! let b = pool.allocate(512, 1, 2).unwrap();
//! // A third stream shares the first arena, and its free synchronises (this ordering retires
//! // nothing); a block too large for the thread cache, which would keep it under stream 3.
//! let c = pool.allocate(1 << 20, 1, 3).unwrap();
//! // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! unsafe { pool.deallocate(c, 3) }.unwrap();
//! assert_eq!(pool.ordering().synchronizations(), 1);
//! # // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! # unsafe { pool.deallocate(a, 1) }.unwrap();
//! # // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! # unsafe { pool.deallocate(b, 2) }.unwrap();
//! ```

use std::hash::{Hash, Hasher};
use std::sync::OnceLock;
use std::sync::atomic::{
    AtomicBool, AtomicU32, AtomicUsize, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};

use parking_lot::{Mutex, MutexGuard};

use crate::arena::{Arena, ArenaInner};

/// A multiplicative hasher (FxHash-like): streams are small handles, SipHash would dominate a lookup.
#[derive(Default)]
struct Fx(u64);

const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl Hasher for Fx {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(buf));
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(K);
    }
    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.write_u64(n.into());
    }
    #[inline]
    fn write_u8(&mut self, n: u8) {
        self.write_u64(n.into());
    }
    #[inline]
    fn write_u16(&mut self, n: u16) {
        self.write_u64(n.into());
    }
    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// Index slot value of a removed entry (lookups probe past it).
const TOMB: u32 = u32::MAX;

/// An arena found and locked, serving the stream looked up.
pub(crate) type Locked<'a, S> = (&'a Arena<S>, MutexGuard<'a, ArenaInner<S>>);

/// Map from stream to arena with a fixed capacity; entries can be removed and positions reused.
#[derive(Debug)]
pub(crate) struct ArenaTable<S> {
    list: Box<[OnceLock<Box<Arena<S>>>]>,
    /// 0 = empty, [`TOMB`] = removed, else list position + 1.
    index: Box<[AtomicU32]>,
    shift: u32,
    /// Positions ever used: every position below it holds an initialised arena.
    len: AtomicUsize,
    state: Mutex<TableState>,
    /// Set when an insertion made the number of live arenas reach `sweep_at`; read without the
    /// mutex (by a thread that may hold an arena lock, which must not then wait for the mutex).
    sweep_due: AtomicBool,
    /// The split limit every arena's dedicated segments serve requests within
    /// ([`PoolConfig::split_limit`](crate::PoolConfig::split_limit)).
    split_limit: u64,
}

/// What changes to the table are decided by; held while changing it (and, by the pool, while it
/// holds every arena lock).
#[derive(Debug)]
pub(crate) struct TableState {
    /// Vacated positions below `len`, reused first.
    free: Vec<usize>,
    /// Arenas serving a stream.
    pub live: usize,
    /// Index slots holding [`TOMB`].
    tombs: usize,
    /// When `live` reaches this, a sweep for retirable streams is due.
    pub sweep_at: usize,
}

/// The fewest live arenas at which a sweep is considered.
pub(crate) const SWEEP_MIN: usize = 16;

impl<S: Copy + Eq + Hash> ArenaTable<S> {
    /// A table for at most `max` streams, whose arenas' dedicated segments serve requests within
    /// `split_limit`.
    pub(crate) fn new(max: usize, split_limit: u64) -> Self {
        let max = max.clamp(1, 1 << 24);
        let slots = (2 * max).next_power_of_two().max(2);
        ArenaTable {
            list: (0..max).map(|_| OnceLock::new()).collect(),
            index: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            shift: 64 - slots.trailing_zeros(),
            len: AtomicUsize::new(0),
            state: Mutex::new(TableState { free: Vec::new(), live: 0, tombs: 0, sweep_at: SWEEP_MIN }),
            sweep_due: AtomicBool::new(false),
            split_limit,
        }
    }

    /// Capacity in streams.
    pub(crate) fn capacity(&self) -> usize {
        self.list.len()
    }

    /// The full hash of a stream, never 0 (0 marks a vacant arena).
    #[inline]
    fn hash(stream: &S) -> u64 {
        let mut h = Fx::default();
        stream.hash(&mut h);
        h.finish().wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
    }

    #[inline]
    fn slot(&self, hash: u64) -> usize {
        (hash >> self.shift) as usize
    }

    /// The arena of `stream`, locked, if it exists. May miss while the table changes; the caller
    /// then asks [`lock_or_insert`](Self::lock_or_insert), which is exact.
    #[inline(always)]
    pub(crate) fn lock(&self, stream: S) -> Option<Locked<'_, S>> {
        let hash = Self::hash(&stream);
        let i = self.slot(hash);
        // The first probe inline (the usual hit); collisions and misses out of line.
        let v = self.index[i].load(Acquire);
        if v != 0
            && v != TOMB
            && let Some(a) = self.list[v as usize - 1].get()
            && a.hash.load(Acquire) == hash
        {
            let g = a.inner.lock();
            if g.stream == Some(stream) {
                return Some((&**a, g));
            }
        }
        if v == 0 { None } else { self.lock_probe(stream, hash, i) }
    }

    /// [`lock`](Self::lock) past the first slot.
    #[inline(never)]
    fn lock_probe(&self, stream: S, hash: u64, first: usize) -> Option<Locked<'_, S>> {
        let mask = self.index.len() - 1;
        let mut i = (first + 1) & mask;
        for _ in 1..self.index.len() {
            let v = self.index[i].load(Acquire);
            if v == 0 {
                return None;
            }
            if v != TOMB
                && let Some(a) = self.list[v as usize - 1].get()
                && a.hash.load(Acquire) == hash
            {
                let g = a.inner.lock();
                if g.stream == Some(stream) {
                    return Some((&**a, g));
                }
            }
            i = (i + 1) & mask;
        }
        None
    }

    /// The arena of `stream`, locked, created if needed; `None` when the table is full.
    #[inline]
    pub(crate) fn lock_or_insert(&self, stream: S) -> Option<Locked<'_, S>> {
        match self.lock(stream) {
            Some(found) => Some(found),
            None => self.insert_slow(stream),
        }
    }

    #[cold]
    fn insert_slow(&self, stream: S) -> Option<Locked<'_, S>> {
        let mut st = self.state.lock();
        self.insert_locked(&mut st, stream)
    }

    /// [`lock_or_insert`](Self::lock_or_insert) for a caller holding the table's mutex (and no
    /// arena lock).
    pub(crate) fn insert_locked(&self, st: &mut TableState, stream: S) -> Option<Locked<'_, S>> {
        if let Some(found) = self.lock(stream) {
            return Some(found);
        }
        if st.live == self.list.len() {
            return None;
        }
        let pos = match st.free.pop() {
            Some(pos) => pos,
            None => self.len.load(Acquire),
        };
        if st.live + st.tombs + 1 > self.index.len() * 3 / 4 {
            // Before the new arena gets its hash, so the rebuild does not index it too.
            self.rebuild(st);
        }
        let arena = &**self.list[pos].get_or_init(|| Box::new(Arena::new(pos, self.split_limit)));
        let mut g = arena.inner.lock();
        g.stream = Some(stream);
        let hash = Self::hash(&stream);
        arena.hash.store(hash, Release);
        let mask = self.index.len() - 1;
        let mut i = self.slot(hash);
        loop {
            match self.index[i].load(Acquire) {
                0 => break,
                TOMB => {
                    st.tombs -= 1;
                    break;
                }
                _ => i = (i + 1) & mask,
            }
        }
        self.index[i].store(pos as u32 + 1, Release);
        if pos == self.len.load(Acquire) {
            self.len.store(pos + 1, Release);
        }
        st.live += 1;
        if st.live >= st.sweep_at {
            self.sweep_due.store(true, Relaxed);
        }
        Some((arena, g))
    }

    /// Rewrites the index without tombstones. Lookups running meanwhile may miss and retry under
    /// the mutex, which the caller holds.
    fn rebuild(&self, st: &mut TableState) {
        for slot in self.index.iter() {
            slot.store(0, Release);
        }
        let mask = self.index.len() - 1;
        for a in self.iter() {
            let hash = a.hash.load(Acquire);
            if hash == 0 {
                continue;
            }
            let mut i = self.slot(hash);
            while self.index[i].load(Acquire) != 0 {
                i = (i + 1) & mask;
            }
            self.index[i].store(a.index as u32 + 1, Release);
        }
        st.tombs = 0;
    }

    /// Whether an insertion asked for a sweep (a hint: the sweep itself runs under the mutex).
    pub(crate) fn sweep_due(&self) -> bool {
        self.sweep_due.load(Relaxed)
    }

    /// Clears [`sweep_due`](Self::sweep_due); the caller holds the mutex and sweeps.
    pub(crate) fn sweep_done(&self, _st: &mut TableState) {
        self.sweep_due.store(false, Relaxed);
    }

    /// Takes the table's mutex: no arena is added or removed while it is held. Take it before any
    /// arena lock.
    pub(crate) fn lock_state(&self) -> MutexGuard<'_, TableState> {
        self.state.lock()
    }

    /// Vacates `arena` (whose guard `g` the caller holds, and `st`): its stream is forgotten and its
    /// position reused. The caller has moved its contents elsewhere.
    pub(crate) fn remove(&self, st: &mut TableState, arena: &Arena<S>, g: &mut ArenaInner<S>) {
        if g.stream.take().is_none() {
            return;
        }
        let hash = arena.hash.swap(0, Release);
        let mask = self.index.len() - 1;
        let mut i = self.slot(hash);
        for _ in 0..self.index.len() {
            match self.index[i].load(Acquire) {
                0 => break,
                v if v as usize == arena.index + 1 => {
                    self.index[i].store(TOMB, Release);
                    st.tombs += 1;
                    break;
                }
                _ => i = (i + 1) & mask,
            }
        }
        st.live -= 1;
        st.free.push(arena.index);
    }

    /// All arenas (vacant ones included) in position order, which is the lock order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Arena<S>> + Clone {
        self.list[..self.len.load(Acquire)].iter().filter_map(|a| a.get().map(|b| &**b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_insert_remove_and_capacity() {
        let t: ArenaTable<u64> = ArenaTable::new(100, u64::MAX);
        assert!(t.lock(5).is_none());
        for s in 0..100u64 {
            let (a, g) = t.lock_or_insert(s * 0x1000).unwrap();
            assert_eq!((g.stream, a.index), (Some(s * 0x1000), s as usize));
        }
        assert!(t.lock_or_insert(1).is_none());
        for s in 0..100u64 {
            assert_eq!(t.lock(s * 0x1000).unwrap().0.index, s as usize);
        }
        assert_eq!(t.iter().count(), 100);
        assert_eq!(t.capacity(), 100);
        // Removing and inserting many times over reuses positions and keeps lookups exact.
        for round in 0..50u64 {
            let victim = (round % 100) * 0x1000;
            let (a, mut g) = t.lock(victim).unwrap();
            let mut st = t.lock_state();
            t.remove(&mut st, a, &mut g);
            drop((st, g));
            assert!(t.lock(victim).is_none());
            let fresh = 0x10_0000 + round;
            let (b, g) = t.lock_or_insert(fresh).unwrap();
            assert_eq!((b.index, g.stream), (a.index, Some(fresh)));
            drop(g);
            let (a, mut g) = t.lock(fresh).unwrap();
            let mut st = t.lock_state();
            t.remove(&mut st, a, &mut g);
            drop((st, g));
            drop(t.lock_or_insert(victim).unwrap());
        }
        for s in 0..100u64 {
            assert_eq!(t.lock(s * 0x1000).unwrap().1.stream, Some(s * 0x1000));
        }
        assert_eq!(t.iter().count(), 100);
    }

    #[test]
    fn concurrent_inserts_agree() {
        let t: ArenaTable<u32> = ArenaTable::new(64, u64::MAX);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for k in 0..64 {
                        drop(t.lock_or_insert(k).unwrap());
                    }
                });
            }
        });
        assert_eq!(t.iter().count(), 64);
        for k in 0..64 {
            assert_eq!(t.lock(k).unwrap().1.stream, Some(k));
        }
    }
}
