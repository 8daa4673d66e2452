//! The stream → arena map: read without locks, appended to under a lock.
//!
//! Lookups happen twice per allocate/free pair, so they must not take a lock or write shared memory.
//! Arenas live in an append-only list (never removed while the pool lives) and an open-addressing
//! index of list positions; both are published with release stores, so a lookup is a hash, a few
//! acquire loads and a comparison. Inserting a new stream takes a mutex; the capacity is fixed at
//! creation ([`PoolConfig::max_streams`](crate::PoolConfig::max_streams)).
//!
//! ```
//! use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig, PoolError};
//!
//! let config = PoolConfig { max_streams: 2, ..PoolConfig::default() };
//! let pool = CachingPool::new(HostUpstream::new(1 << 30), HostOrdering::new(), config);
//! let a = pool.allocate(512, 1, 1).unwrap();
//! let b = pool.allocate(512, 1, 2).unwrap();
//! assert_eq!(pool.allocate(512, 1, 3).unwrap_err(), PoolError::TooManyStreams { max: 2 });
//! # pool.deallocate(a, 1).unwrap();
//! # pool.deallocate(b, 2).unwrap();
//! ```

use std::hash::{Hash, Hasher};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::Acquire, Ordering::Release};

use parking_lot::Mutex;

use crate::arena::Arena;

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

/// Append-only map from stream to arena.
#[derive(Debug)]
pub(crate) struct ArenaTable<S> {
    list: Box<[OnceLock<Box<Arena<S>>>]>,
    /// 0 = empty, else list position + 1.
    index: Box<[AtomicU32]>,
    shift: u32,
    len: AtomicUsize,
    insert: Mutex<()>,
}

impl<S: Copy + Eq + Hash> ArenaTable<S> {
    /// A table for at most `max` streams.
    pub(crate) fn new(max: usize) -> Self {
        let max = max.clamp(1, 1 << 24);
        let slots = (2 * max).next_power_of_two().max(2);
        ArenaTable {
            list: (0..max).map(|_| OnceLock::new()).collect(),
            index: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            shift: 64 - slots.trailing_zeros(),
            len: AtomicUsize::new(0),
            insert: Mutex::new(()),
        }
    }

    /// Capacity in streams.
    pub(crate) fn capacity(&self) -> usize {
        self.list.len()
    }

    #[inline]
    fn slot(&self, stream: &S) -> usize {
        let mut h = Fx::default();
        stream.hash(&mut h);
        (h.finish().wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    /// The arena of `stream`, if it exists.
    #[inline]
    pub(crate) fn find(&self, stream: S) -> Option<&Arena<S>> {
        let mask = self.index.len() - 1;
        let mut i = self.slot(&stream);
        loop {
            let v = self.index[i].load(Acquire) as usize;
            if v == 0 {
                return None;
            }
            let a = self.list[v - 1].get()?;
            if a.stream == stream {
                return Some(a);
            }
            i = (i + 1) & mask;
        }
    }

    /// The arena of `stream`, created if needed; `None` when the table is full.
    #[inline]
    pub(crate) fn get_or_insert(&self, stream: S) -> Option<&Arena<S>> {
        match self.find(stream) {
            Some(a) => Some(a),
            None => self.insert_slow(stream),
        }
    }

    #[cold]
    fn insert_slow(&self, stream: S) -> Option<&Arena<S>> {
        let _guard = self.insert.lock();
        if let Some(a) = self.find(stream) {
            return Some(a);
        }
        let pos = self.len.load(Acquire);
        if pos == self.list.len() {
            return None;
        }
        let arena = self.list[pos].get_or_init(|| Box::new(Arena::new(stream, pos)));
        let mask = self.index.len() - 1;
        let mut i = self.slot(&stream);
        while self.index[i].load(Acquire) != 0 {
            i = (i + 1) & mask;
        }
        self.index[i].store(pos as u32 + 1, Release);
        self.len.store(pos + 1, Release);
        Some(arena)
    }

    /// All arenas in creation order (which is the lock order).
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Arena<S>> + Clone {
        self.list[..self.len.load(Acquire)].iter().filter_map(|a| a.get().map(|b| &**b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_insert_and_capacity() {
        let t: ArenaTable<u64> = ArenaTable::new(100);
        assert!(t.find(5).is_none());
        for s in 0..100u64 {
            let a = t.get_or_insert(s * 0x1000).unwrap();
            assert_eq!((a.stream, a.index), (s * 0x1000, s as usize));
        }
        assert!(t.get_or_insert(1).is_none());
        for s in 0..100u64 {
            assert_eq!(t.find(s * 0x1000).unwrap().index, s as usize);
        }
        assert_eq!(t.iter().count(), 100);
        assert_eq!(t.capacity(), 100);
    }

    #[test]
    fn concurrent_inserts_agree() {
        let t: ArenaTable<u32> = ArenaTable::new(64);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for k in 0..64 {
                        t.get_or_insert(k).unwrap();
                    }
                });
            }
        });
        assert_eq!(t.iter().count(), 64);
        for k in 0..64 {
            assert_eq!(t.find(k).unwrap().stream, k);
        }
    }
}
