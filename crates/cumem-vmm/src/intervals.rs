//! The mapped parts of one reservation, as disjoint half-open byte intervals.
//!
//! The driver refuses a mapping over mapped space with a bare `INVALID_VALUE`; tracking what is
//! mapped lets cumem refuse it first, with an error that says so, and lets a reservation know
//! whether anything is still mapped before it is freed.

/// Disjoint `[start, end)` intervals of offsets, sorted by start.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Intervals {
    spans: Vec<(usize, usize)>,
}

impl Intervals {
    /// Adds `[start, end)` if it overlaps nothing; otherwise returns the first interval it overlaps.
    pub(crate) fn claim(&mut self, start: usize, end: usize) -> Result<(), (usize, usize)> {
        debug_assert!(start < end);
        // The first interval that ends after `start` is the only one that can overlap from below.
        let i = self.spans.partition_point(|&(_, e)| e <= start);
        if let Some(&(s, e)) = self.spans.get(i)
            && s < end
        {
            return Err((s, e));
        }
        self.spans.insert(i, (start, end));
        Ok(())
    }

    /// Removes exactly `[start, end)`; `false` if it is not one of the intervals.
    pub(crate) fn release(&mut self, start: usize, end: usize) -> bool {
        match self.spans.binary_search(&(start, end)) {
            Ok(i) => {
                self.spans.remove(i);
                true
            }
            Err(_) => false,
        }
    }

    /// Whether nothing is claimed.
    pub(crate) fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Total bytes claimed.
    pub(crate) fn bytes(&self) -> usize {
        self.spans.iter().map(|(s, e)| e - s).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disjoint_claims_are_kept_in_order() {
        let mut set = Intervals::default();
        set.claim(4, 6).unwrap();
        set.claim(0, 2).unwrap();
        set.claim(2, 4).unwrap(); // touching both neighbours is not overlapping
        assert_eq!(set.spans, [(0, 2), (2, 4), (4, 6)]);
        assert_eq!(set.bytes(), 6);
    }

    #[test]
    fn overlaps_are_refused_with_the_interval_hit() {
        let mut set = Intervals::default();
        set.claim(10, 20).unwrap();
        assert_eq!(set.claim(5, 11), Err((10, 20)));
        assert_eq!(set.claim(19, 30), Err((10, 20)));
        assert_eq!(set.claim(12, 14), Err((10, 20)));
        assert_eq!(set.claim(0, 100), Err((10, 20)));
        assert_eq!(set.spans, [(10, 20)]);
    }

    #[test]
    fn only_whole_intervals_are_released() {
        let mut set = Intervals::default();
        set.claim(0, 8).unwrap();
        assert!(!set.release(0, 4));
        assert!(!set.is_empty());
        assert!(set.release(0, 8));
        assert!(set.is_empty());
        assert!(!set.release(0, 8));
    }
}
