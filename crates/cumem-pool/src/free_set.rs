//! Best-fit free lists with splitting and coalescing inside upstream segments.
//!
//! A [`FreeSet`] holds the free ranges of one arena for one segment kind. Ranges are indexed twice:
//! by `(size, address)` for best fit in O(log n) and by address for coalescing in O(log n). A range
//! never crosses a segment boundary, even when the upstream handed out two segments back to back, and
//! two ranges of the same segment are never left adjacent (they are merged on insert).
//!
//! ```
//! use cumem_pool::free_set::{FreeSet, Seg};
//!
//! let seg = Seg { base: 0x10000, len: 4096 };
//! let mut set = FreeSet::default();
//! set.insert(seg.base, seg.len, seg);
//! let (a, _) = set.take(1024, 512).unwrap(); // best fit, split
//! let (b, _) = set.take(1024, 2048).unwrap(); // aligned: 0x10800
//! assert_eq!((a, b), (0x10000, 0x10800));
//! assert_eq!(set.bytes(), 2048);
//! set.insert(a, 1024, seg);
//! set.insert(b, 1024, seg); // coalesces back into one range
//! assert_eq!(set.ranges().collect::<Vec<_>>(), vec![(0x10000, 4096, seg)]);
//! ```

use std::collections::{BTreeMap, BTreeSet};

use crate::size_class::{QUANTUM, align_up_u64};

/// An upstream segment: the unit the pool takes from and returns to its upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Seg {
    /// First address of the segment.
    pub base: u64,
    /// Length of the segment in bytes.
    pub len: u64,
}

impl Seg {
    /// One past the last address of the segment.
    #[inline]
    pub fn end(&self) -> u64 {
        self.base + self.len
    }
}

/// How many of the smallest candidates an aligned request inspects before padding.
const ALIGNED_PROBES: usize = 8;

#[derive(Debug, Clone, Copy)]
struct Range {
    len: u64,
    seg: Seg,
}

/// Free ranges of one arena and segment kind, with best fit, splitting and coalescing.
#[derive(Debug, Default)]
pub struct FreeSet {
    by_size: BTreeSet<(u64, u64)>,
    by_addr: BTreeMap<u64, Range>,
    bytes: u64,
}

impl FreeSet {
    /// Total free bytes.
    #[inline]
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Number of free ranges.
    pub fn len(&self) -> usize {
        self.by_addr.len()
    }

    /// Whether there are no free ranges.
    pub fn is_empty(&self) -> bool {
        self.by_addr.is_empty()
    }

    /// The largest free range in bytes (0 when empty).
    pub fn largest(&self) -> u64 {
        self.by_size.last().map_or(0, |&(len, _)| len)
    }

    /// All free ranges as `(addr, len, segment)`, in address order.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64, Seg)> + '_ {
        self.by_addr.iter().map(|(&a, r)| (a, r.len, r.seg))
    }

    /// Adds `[addr, addr + len)` of `seg`, merging it with adjacent free ranges of the same segment.
    pub fn insert(&mut self, mut addr: u64, mut len: u64, seg: Seg) {
        debug_assert!(len > 0 && addr >= seg.base && addr + len <= seg.end());
        self.bytes += len;
        let end = addr + len;
        if let Some((&prev, &r)) = self.by_addr.range(..addr).next_back()
            && r.seg == seg
            && prev + r.len == addr
        {
            self.unlink(prev, r.len);
            addr = prev;
            len += r.len;
        }
        if let Some(&r) = self.by_addr.get(&end)
            && r.seg == seg
        {
            self.unlink(end, r.len);
            len += r.len;
        }
        self.link(addr, len, seg);
    }

    /// Removes a best-fit block of `size` bytes aligned to `align` (a power of two, at least
    /// [`QUANTUM`]), splitting off and keeping what is left of the range. Returns the block's address and
    /// segment, or `None` when no range fits.
    pub fn take(&mut self, size: u64, align: u64) -> Option<(u64, Seg)> {
        let (len, addr) = self.fit(size, align)?;
        let start = align_up_u64(addr, align)?;
        self.by_size.remove(&(len, addr));
        let r = self.by_addr.remove(&addr)?;
        self.bytes -= len;
        if start > addr {
            self.bytes += start - addr;
            self.link(addr, start - addr, r.seg);
        }
        let tail = addr + len - (start + size);
        if tail > 0 {
            self.bytes += tail;
            self.link(start + size, tail, r.seg);
        }
        Some((start, r.seg))
    }

    /// The length of the range [`take`](Self::take) would split, without changing anything.
    pub fn fit_len(&self, size: u64, align: u64) -> Option<u64> {
        self.fit(size, align).map(|(len, _)| len)
    }

    /// Removes the exact range starting at `addr`, returning its length and segment.
    pub fn remove(&mut self, addr: u64) -> Option<(u64, Seg)> {
        let r = *self.by_addr.get(&addr)?;
        self.unlink(addr, r.len);
        self.bytes -= r.len;
        Some((r.len, r.seg))
    }

    /// Removes every range, returning them in address order.
    pub fn drain(&mut self) -> Vec<(u64, u64, Seg)> {
        let out = self.ranges().collect();
        *self = FreeSet::default();
        out
    }

    /// Checks the internal indexes agree and that ranges are coalesced.
    pub fn check(&self) -> Result<(), String> {
        if self.by_size.len() != self.by_addr.len() {
            return Err(format!("index sizes differ: {} vs {}", self.by_size.len(), self.by_addr.len()));
        }
        let mut total = 0;
        let mut prev: Option<(u64, Range)> = None;
        for (&a, &r) in &self.by_addr {
            if !self.by_size.contains(&(r.len, a)) {
                return Err(format!("range {a:#x}+{} missing from size index", r.len));
            }
            if r.len == 0 || a < r.seg.base || a + r.len > r.seg.end() {
                return Err(format!("range {a:#x}+{} outside its segment {:?}", r.len, r.seg));
            }
            if let Some((pa, pr)) = prev {
                if pa + pr.len > a {
                    return Err(format!("ranges {pa:#x}+{} and {a:#x} overlap", pr.len));
                }
                if pa + pr.len == a && pr.seg == r.seg {
                    return Err(format!("ranges {pa:#x}+{} and {a:#x} not coalesced", pr.len));
                }
            }
            total += r.len;
            prev = Some((a, r));
        }
        if total != self.bytes {
            return Err(format!("byte count {} != sum of ranges {total}", self.bytes));
        }
        Ok(())
    }

    /// `(len, addr)` of the range to split: the first of the few smallest ranges of at least `size`
    /// bytes that fits after aligning its start, else the smallest range that fits `size` plus the
    /// worst-case alignment padding.
    fn fit(&self, size: u64, align: u64) -> Option<(u64, u64)> {
        for &(len, addr) in self.by_size.range((size, 0)..).take(ALIGNED_PROBES) {
            if align_up_u64(addr, align).is_some_and(|start| start - addr + size <= len) {
                return Some((len, addr));
            }
        }
        let padded = size.checked_add(align - QUANTUM as u64)?;
        let &(len, addr) = self.by_size.range((padded, 0)..).next()?;
        Some((len, addr))
    }

    #[inline]
    fn link(&mut self, addr: u64, len: u64, seg: Seg) {
        self.by_size.insert((len, addr));
        self.by_addr.insert(addr, Range { len, seg });
    }

    #[inline]
    fn unlink(&mut self, addr: u64, len: u64) {
        self.by_size.remove(&(len, addr));
        self.by_addr.remove(&addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: u64 = QUANTUM as u64;

    fn seg(base: u64, len: u64) -> Seg {
        Seg { base, len }
    }

    #[test]
    fn best_fit_picks_the_smallest_range_that_fits() {
        let s = seg(0, 100 * A);
        let mut f = FreeSet::default();
        // Free ranges of 8, 3 and 5 quanta, separated by used memory.
        f.insert(0, 8 * A, s);
        f.insert(10 * A, 3 * A, s);
        f.insert(20 * A, 5 * A, s);
        assert_eq!(f.take(4 * A, A), Some((20 * A, s)));
        assert_eq!(f.take(3 * A, A), Some((10 * A, s)));
        assert_eq!(f.take(9 * A, A), None);
        assert_eq!(f.largest(), 8 * A);
        f.check().unwrap();
    }

    #[test]
    fn split_keeps_the_remainder_and_alignment_padding() {
        let s = seg(A, 64 * A);
        let mut f = FreeSet::default();
        f.insert(A, 64 * A, s);
        let (addr, _) = f.take(2 * A, 8 * A).unwrap();
        assert_eq!(addr, 8 * A);
        let r: Vec<_> = f.ranges().map(|(a, l, _)| (a / A, l / A)).collect();
        assert_eq!(r, vec![(1, 7), (10, 55)]);
        assert_eq!(f.bytes(), 62 * A);
        f.check().unwrap();
    }

    #[test]
    fn aligned_request_prefers_an_aligned_exact_fit() {
        let s = seg(0, 64 * A);
        let mut f = FreeSet::default();
        f.insert(A, 2 * A, s); // misaligned for 4*A
        f.insert(4 * A, 2 * A, s); // aligned
        f.insert(16 * A, 40 * A, s);
        // The smallest range is misaligned: fall back to the smallest padded fit.
        assert_eq!(f.take(2 * A, 4 * A), Some((4 * A, s)));
        f.check().unwrap();
    }

    #[test]
    fn coalesces_both_sides_but_never_across_segments() {
        let s1 = seg(0, 8 * A);
        let s2 = seg(8 * A, 8 * A); // directly after s1 in the address space
        let mut f = FreeSet::default();
        f.insert(0, 2 * A, s1);
        f.insert(4 * A, 4 * A, s1);
        f.insert(8 * A, 8 * A, s2);
        assert_eq!(f.len(), 3);
        f.insert(2 * A, 2 * A, s1); // fills the gap: s1 is one range again
        let r: Vec<_> = f.ranges().map(|(a, l, s)| (a / A, l / A, s)).collect();
        assert_eq!(r, vec![(0, 8, s1), (8, 8, s2)]);
        f.check().unwrap();
        assert_eq!(f.remove(0), Some((8 * A, s1)));
        assert_eq!(f.remove(0), None);
        assert_eq!(f.drain().len(), 1);
        assert!(f.is_empty());
    }

    #[test]
    fn check_detects_uncoalesced_ranges() {
        let s = seg(0, 8 * A);
        let mut f = FreeSet::default();
        f.link(0, A, s);
        f.link(A, A, s);
        f.bytes = 2 * A;
        assert!(f.check().unwrap_err().contains("not coalesced"));
    }
}
