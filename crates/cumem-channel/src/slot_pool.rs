//! A pool of fixed-size message buffers: acquired and released without the allocator once warm,
//! with hits, misses and returns counted.
//!
//! A channel's batch reads ([`RingChannel::poll_batch`](crate::RingChannel::poll_batch)) land in a
//! slot from the pool, so a steady host loop allocates nothing per batch. A slot goes back to the
//! pool when it is dropped; a pool already holding `max_idle` free slots lets it go instead.
//!
//! ```
//! use cumem_channel::SlotPool;
//! let pool = SlotPool::<u32>::new(256, 2)?;
//! let a = pool.acquire();           // prefilled: a hit
//! let b = pool.acquire();           // a hit
//! let c = pool.acquire();           // empty: a miss, allocated
//! assert_eq!(a.len(), 256);
//! drop((a, b, c));                  // two returned, the third discarded (max_idle = 2)
//! let s = pool.stats();
//! assert_eq!((s.hits, s.misses, s.returns, s.discarded), (2, 1, 2, 1));
//! assert!(SlotPool::<u64>::new(usize::MAX / 4, 1).is_err()); // more bytes than memory can hold
//! # Ok::<(), cumem_channel::ChannelError>(())
//! ```

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use bytemuck::Zeroable;
use parking_lot::Mutex;

use crate::ChannelError;

/// Counters of a [`SlotPool`], by value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotPoolStats {
    /// Acquisitions served by a free slot.
    pub hits: u64,
    /// Acquisitions that had to allocate.
    pub misses: u64,
    /// Slots given back and kept.
    pub returns: u64,
    /// Slots given back while the pool was full, freed.
    pub discarded: u64,
    /// Free slots now.
    pub idle: usize,
}

#[derive(Debug)]
struct Shared<T> {
    slot_len: usize,
    max_idle: usize,
    state: Mutex<State<T>>,
}

#[derive(Debug)]
struct State<T> {
    free: Vec<Box<[T]>>,
    stats: SlotPoolStats,
}

/// Fixed-size slots of `slot_len` values each; cheap to clone (clones share the slots).
#[derive(Debug)]
pub struct SlotPool<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Clone for SlotPool<T> {
    fn clone(&self) -> Self {
        SlotPool { shared: Arc::clone(&self.shared) }
    }
}

impl<T: Zeroable + Copy> SlotPool<T> {
    /// A pool of slots of `slot_len` values, prefilled with `max_idle` free slots (the most it keeps).
    ///
    /// `EmptySlots` if `slot_len` is 0. `SlotTooLarge` if one slot, or the `max_idle` prefilled
    /// ones together, would exceed the largest allocation Rust allows (`isize::MAX` bytes) or
    /// cannot be allocated now: an error, never an abort.
    pub fn new(slot_len: usize, max_idle: usize) -> Result<Self, ChannelError> {
        if slot_len == 0 {
            return Err(ChannelError::EmptySlots);
        }
        let too_large = || ChannelError::SlotTooLarge { slot_len, max_idle };
        let total = slot_len.checked_mul(size_of::<T>()).and_then(|b| b.checked_mul(max_idle.max(1)));
        if total.is_none_or(|t| t > isize::MAX as usize) {
            return Err(too_large());
        }
        let mut free = Vec::new();
        free.try_reserve_exact(max_idle).map_err(|_| too_large())?;
        for _ in 0..max_idle {
            free.push(Self::try_fresh(slot_len).ok_or_else(too_large)?);
        }
        if max_idle == 0 {
            // Nothing prefilled: still find out now whether one slot can be had at all, rather
            // than at the first `acquire`, which cannot fail.
            Vec::<T>::new().try_reserve_exact(slot_len).map_err(|_| too_large())?;
        }
        Ok(SlotPool {
            shared: Arc::new(Shared {
                slot_len,
                max_idle,
                state: Mutex::new(State { free, stats: SlotPoolStats::default() }),
            }),
        })
    }

    fn fresh(slot_len: usize) -> Box<[T]> {
        vec![T::zeroed(); slot_len].into_boxed_slice()
    }

    fn try_fresh(slot_len: usize) -> Option<Box<[T]>> {
        let mut slot = Vec::new();
        slot.try_reserve_exact(slot_len).ok()?;
        slot.resize(slot_len, T::zeroed());
        Some(slot.into_boxed_slice())
    }

    /// Values per slot.
    pub fn slot_len(&self) -> usize {
        self.shared.slot_len
    }

    /// A slot (its values are whatever its last user left), from the free list when it has one.
    pub fn acquire(&self) -> Slot<T> {
        let reused = {
            let mut state = self.shared.state.lock();
            let slot = state.free.pop();
            if slot.is_some() {
                state.stats.hits += 1;
            } else {
                state.stats.misses += 1;
            }
            slot
        };
        // Allocate outside the lock: a miss should not stall other threads' hits.
        let data = reused.unwrap_or_else(|| Self::fresh(self.shared.slot_len));
        Slot { data: Some(data), len: self.shared.slot_len, pool: Arc::clone(&self.shared) }
    }

    /// The counters now.
    pub fn stats(&self) -> SlotPoolStats {
        let state = self.shared.state.lock();
        SlotPoolStats { idle: state.free.len(), ..state.stats }
    }
}

/// A slot from a [`SlotPool`], returned to it on drop. Dereferences to its first [`Slot::len`]
/// values (all of them unless [`Slot::truncate`] shortened the view).
#[derive(Debug)]
pub struct Slot<T> {
    data: Option<Box<[T]>>,
    len: usize,
    pool: Arc<Shared<T>>,
}

impl<T> Slot<T> {
    /// Values visible through the slot.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slot shows no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Shows only the first `len` values (no-op if `len` is larger); the slot keeps its size.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Every value of the slot, past any truncation (to fill it).
    pub fn full_mut(&mut self) -> &mut [T] {
        self.data.as_deref_mut().unwrap_or_default()
    }
}

impl<T> Deref for Slot<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data.as_deref().unwrap_or_default()[..self.len]
    }
}

impl<T> DerefMut for Slot<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        let len = self.len;
        &mut self.data.as_deref_mut().unwrap_or_default()[..len]
    }
}

impl<T> Drop for Slot<T> {
    fn drop(&mut self) {
        let Some(data) = self.data.take() else { return };
        let mut state = self.pool.state.lock();
        if state.free.len() < self.pool.max_idle {
            state.free.push(data);
            state.stats.returns += 1;
        } else {
            state.stats.discarded += 1;
        }
    }
}
