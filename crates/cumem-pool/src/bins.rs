//! The front cache: per-arena LIFO bins of exact-size small blocks.
//!
//! A small block freed on a stream goes into its arena's bin for its size class without touching the
//! best-fit indexes; the next allocation of that class on the same stream pops it in O(1). Binned
//! blocks are not coalesced until they are needed: when a best-fit search misses, when another stream
//! migrates memory from this arena, and before segments are released, the bins are flushed into the
//! arena's [`FreeSet`](crate::free_set::FreeSet).
//!
//! A bin miss is served from the free set first and the bins are flushed only when that misses too,
//! so a block may sit binned while its neighbours are coalesced. Flushing on every bin miss instead
//! keeps the free set tidiest but was measured to lose more than it gains: with 10,000 live blocks of
//! random sizes the bins keep blocks of most classes and serve many requests in O(1), and flushing
//! them turned 60 ns per alloc+free pair into 160 ns; with few live blocks it made no measurable
//! difference. The flush is O(1) per binned block (each is flushed once), so flushing late costs no
//! more in total; its price is a pause proportional to the binned blocks when the free set runs dry.
//!
//! ```
//! use cumem_pool::bins::{BinEntry, Bins};
//! use cumem_pool::free_set::Seg;
//!
//! let seg = Seg { base: 0x10000, len: 1 << 21 };
//! let mut bins = Bins::default();
//! bins.push(2, BinEntry { addr: 0x10000, seg });
//! assert_eq!(bins.bytes(), 1024);
//! assert_eq!(bins.pop(2).map(|e| e.addr), Some(0x10000));
//! assert!(bins.pop(2).is_none());
//! ```

use crate::free_set::Seg;
use crate::size_class::{SMALL_BINS, bin_bytes};

const WORDS: usize = (SMALL_BINS + 1).div_ceil(64);

/// A cached small block: its address and the segment it lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BinEntry {
    /// Address of the block.
    pub addr: u64,
    /// The segment containing the block.
    pub seg: Seg,
}

/// LIFO bins indexed by small size class ([`bin_of`](crate::size_class::bin_of), `1..=SMALL_BINS`).
#[derive(Debug)]
pub struct Bins {
    bins: Vec<Vec<BinEntry>>,
    nonempty: [u64; WORDS],
    bytes: u64,
    /// How many blocks were ever pushed (wrapping): lets a caller that let go of the arena's lock
    /// tell whether memory was freed into the bins since it looked.
    pushes: u64,
}

impl Default for Bins {
    fn default() -> Self {
        Bins { bins: Vec::new(), nonempty: [0; WORDS], bytes: 0, pushes: 0 }
    }
}

impl Bins {
    /// Bytes held in all bins.
    #[inline]
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// How many blocks were pushed so far (wrapping): unchanged between two reads under one lock,
    /// and no block was freed into the bins in between.
    #[inline]
    pub fn pushes(&self) -> u64 {
        self.pushes
    }

    /// Pops the most recently pushed block of class `bin`.
    #[inline]
    pub fn pop(&mut self, bin: usize) -> Option<BinEntry> {
        let v = self.bins.get_mut(bin)?;
        let e = v.pop()?;
        if v.is_empty() {
            self.nonempty[bin / 64] &= !(1 << (bin % 64));
        }
        self.bytes -= bin_bytes(bin) as u64;
        Some(e)
    }

    /// Pushes a block of class `bin` (`1..=SMALL_BINS`).
    #[inline]
    pub fn push(&mut self, bin: usize, e: BinEntry) {
        debug_assert!((1..=SMALL_BINS).contains(&bin));
        if bin >= self.bins.len() {
            self.bins.resize_with(bin + 1, Vec::new);
        }
        self.bins[bin].push(e);
        self.nonempty[bin / 64] |= 1 << (bin % 64);
        self.bytes += bin_bytes(bin) as u64;
        self.pushes = self.pushes.wrapping_add(1);
    }

    /// Size in bytes of the largest binned block (0 when empty).
    pub fn largest(&self) -> u64 {
        for (w, &word) in self.nonempty.iter().enumerate().rev() {
            if word != 0 {
                let bin = w * 64 + 63 - word.leading_zeros() as usize;
                return bin_bytes(bin) as u64;
            }
        }
        0
    }

    /// Removes every block, calling `f(addr, len, seg)` for each.
    pub fn drain(&mut self, mut f: impl FnMut(u64, u64, Seg)) {
        for w in 0..WORDS {
            let mut word = self.nonempty[w];
            while word != 0 {
                let bin = w * 64 + word.trailing_zeros() as usize;
                word &= word - 1;
                for e in self.bins[bin].drain(..) {
                    f(e.addr, bin_bytes(bin) as u64, e.seg);
                }
            }
            self.nonempty[w] = 0;
        }
        self.bytes = 0;
    }

    /// Every binned block as `(addr, len, seg)`, by size class.
    pub fn entries(&self) -> Vec<(u64, u64, Seg)> {
        let mut out = Vec::new();
        for (w, &word) in self.nonempty.iter().enumerate() {
            let mut word = word;
            while word != 0 {
                let bin = w * 64 + word.trailing_zeros() as usize;
                word &= word - 1;
                out.extend(self.bins[bin].iter().map(|e| (e.addr, bin_bytes(bin) as u64, e.seg)));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifo_per_class_and_flush() {
        let seg = Seg { base: 0, len: 1 << 21 };
        let mut b = Bins::default();
        assert!(b.pop(1).is_none());
        b.push(1, BinEntry { addr: 0, seg });
        b.push(1, BinEntry { addr: 512, seg });
        b.push(SMALL_BINS, BinEntry { addr: 1 << 20, seg });
        assert_eq!(b.largest(), 1 << 20);
        assert_eq!(b.pop(1).unwrap().addr, 512);
        assert_eq!(b.bytes(), 512 + (1 << 20));
        assert_eq!(b.entries().len(), 2);
        let mut out = vec![];
        b.drain(|a, l, _| out.push((a, l)));
        out.sort();
        assert_eq!(out, vec![(0, 512), (1 << 20, 1 << 20)]);
        assert_eq!((b.bytes(), b.largest(), b.entries().len()), (0, 0, 0));
        assert!(b.pop(1).is_none());
    }
}
