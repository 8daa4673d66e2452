//! Size classes: how a request is rounded and which kind of segment serves it.
//!
//! Requests of at most [`FINE_LIMIT`] (64 KiB) are rounded up to a multiple of [`QUANTUM`] (512 B).
//! Larger requests are rounded up to a multiple of 1/16 of their power of two, so at most 6.25 % is
//! wasted (100 KiB + 1 B becomes 104 KiB, 1 MiB + 1 B becomes 1 MiB + 64 KiB, 100 MiB + 1 B becomes 104 MiB).
//! Requests of at most [`SMALL_LIMIT`] (1 MiB) are *small*: they share small segments and each of
//! their [`SMALL_BINS`] (192) classes has a front-cache bin. Larger ones are served from *large*
//! segments. Keeping the two apart stops small blocks from pinning large segments.
//!
//! ```
//! use cumem_pool::size_class::{SizeClass, Kind, bin_bytes};
//!
//! let c = SizeClass::of(1000).unwrap();
//! assert_eq!((c.bytes, c.kind, c.bin), (1024, Kind::Small, Some(2)));
//! let c = SizeClass::of((100 << 10) + 1).unwrap();
//! assert_eq!((c.bytes, c.kind), (104 << 10, Kind::Small));
//! assert_eq!(bin_bytes(c.bin.unwrap()), 104 << 10);
//! let c = SizeClass::of((1 << 20) + 1).unwrap();
//! assert_eq!((c.bytes, c.kind, c.bin), ((1 << 20) + (64 << 10), Kind::Large, None));
//! assert!(SizeClass::of(0).is_err());
//! assert!(SizeClass::of(usize::MAX).is_err());
//! ```

use crate::PoolError;

/// Granularity of fine size classes, and the minimum alignment of every block.
pub const QUANTUM: usize = 512;
/// Largest request rounded to a multiple of [`QUANTUM`].
pub const FINE_LIMIT: usize = 64 << 10;
/// Largest request served from small segments.
pub const SMALL_LIMIT: usize = 1 << 20;
/// Classes above [`FINE_LIMIT`] are multiples of `2^floor(log2(bytes)) >> STEP_SHIFT`.
pub const STEP_SHIFT: u32 = 4;
const FINE_BINS: usize = FINE_LIMIT / QUANTUM;
const FINE_LOG2: u32 = FINE_LIMIT.trailing_zeros();
/// Number of small size classes (bins are indexed `1..=SMALL_BINS`).
pub const SMALL_BINS: usize = FINE_BINS + ((SMALL_LIMIT.trailing_zeros() - FINE_LOG2) << STEP_SHIFT) as usize;

/// Which kind of segment a block lives in. More kinds may come: match with a wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Kind {
    /// Segments of [`PoolConfig::small_segment_bytes`](crate::PoolConfig::small_segment_bytes) serving
    /// requests of at most [`SMALL_LIMIT`].
    Small,
    /// Segments sized by the growth policy serving larger requests.
    Large,
    /// A segment of its own for a request above the split limit
    /// ([`PoolConfig::split_limit`](crate::PoolConfig::split_limit)) that nothing cached fits;
    /// once freed, its memory serves only such requests that leave at most the split limit of a
    /// free range behind (or fit the segment made for one like them), so smaller blocks do not pin
    /// it, except as the out-of-memory ladder's last step. Pools with expandable segments make
    /// none.
    Dedicated,
}

impl Kind {
    /// Every kind, in the order the pool's loops visit them.
    pub const ALL: [Kind; 3] = [Kind::Small, Kind::Large, Kind::Dedicated];
}

/// The size class of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeClass {
    /// Rounded size in bytes (a multiple of [`QUANTUM`]).
    pub bytes: usize,
    /// Segment kind serving this class.
    pub kind: Kind,
    /// Front-cache bin of a small class ([`bin_of`]).
    pub bin: Option<usize>,
}

impl SizeClass {
    /// The class of a request of `bytes` bytes.
    ///
    /// # Errors
    /// [`PoolError::ZeroSize`] for 0, [`PoolError::SizeOverflow`] when rounding overflows `usize`.
    #[inline]
    pub fn of(bytes: usize) -> Result<SizeClass, PoolError> {
        if bytes == 0 {
            return Err(PoolError::ZeroSize);
        }
        if bytes <= FINE_LIMIT {
            let rounded = (bytes + QUANTUM - 1) & !(QUANTUM - 1);
            return Ok(SizeClass { bytes: rounded, kind: Kind::Small, bin: Some(rounded / QUANTUM) });
        }
        let step = 1usize << (usize::BITS - 1 - bytes.leading_zeros() - STEP_SHIFT);
        let rounded = round_up(bytes, step).ok_or(PoolError::SizeOverflow { requested: bytes })?;
        if rounded <= SMALL_LIMIT {
            Ok(SizeClass { bytes: rounded, kind: Kind::Small, bin: Some(bin_of(rounded)) })
        } else {
            Ok(SizeClass { bytes: rounded, kind: Kind::Large, bin: None })
        }
    }
}

/// The bin of a small class size (`rounded` must be a class size of at most [`SMALL_LIMIT`]).
#[inline]
pub fn bin_of(rounded: usize) -> usize {
    if rounded <= FINE_LIMIT {
        rounded / QUANTUM
    } else {
        let log2 = usize::BITS - 1 - rounded.leading_zeros();
        let k = (rounded - (1 << log2)) >> (log2 - STEP_SHIFT);
        FINE_BINS + (((log2 - FINE_LOG2) as usize) << STEP_SHIFT) + k
    }
}

/// The class size of a bin (`1..=SMALL_BINS`); the inverse of [`bin_of`].
#[inline]
pub fn bin_bytes(bin: usize) -> usize {
    if bin <= FINE_BINS {
        bin * QUANTUM
    } else {
        let j = bin - FINE_BINS;
        let log2 = FINE_LOG2 + (j >> STEP_SHIFT) as u32;
        (1 << log2) + ((j & ((1 << STEP_SHIFT) - 1)) << (log2 - STEP_SHIFT))
    }
}

/// `value` rounded up to a multiple of the power of two `to`, or `None` on overflow.
#[inline]
pub(crate) fn round_up(value: usize, to: usize) -> Option<usize> {
    debug_assert!(to.is_power_of_two());
    Some(value.checked_add(to - 1)? & !(to - 1))
}

/// `value` rounded up to a multiple of the power of two `to` (u64 addresses), or `None` on overflow.
#[inline]
pub(crate) fn align_up_u64(value: u64, to: u64) -> Option<u64> {
    debug_assert!(to.is_power_of_two());
    Some(value.checked_add(to - 1)? & !(to - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fine_classes_round_to_quantum() {
        for (req, want) in [(1, 512), (511, 512), (512, 512), (513, 1024), (FINE_LIMIT, FINE_LIMIT)] {
            let c = SizeClass::of(req).unwrap();
            assert_eq!(c.bytes, want, "request {req}");
            assert_eq!(c.kind, Kind::Small);
            assert_eq!(c.bin, Some(want / QUANTUM));
        }
    }

    #[test]
    fn coarse_classes_waste_at_most_a_sixteenth() {
        assert_eq!(SizeClass::of(FINE_LIMIT + 1).unwrap().bytes, FINE_LIMIT + 4096);
        let c = SizeClass::of(SMALL_LIMIT + 1).unwrap();
        assert_eq!(c.bytes, SMALL_LIMIT + (64 << 10));
        assert_eq!(c.kind, Kind::Large);
        assert_eq!(SizeClass::of(SMALL_LIMIT).unwrap().kind, Kind::Small);
        assert_eq!(SizeClass::of(2 << 20).unwrap().bytes, 2 << 20);
        assert_eq!(SizeClass::of((2 << 20) - 1).unwrap().bytes, 2 << 20);
        assert_eq!(SizeClass::of(100 << 20).unwrap().bytes, 100 << 20);
        assert_eq!(SizeClass::of((100 << 20) + 1).unwrap().bytes, 104 << 20);
        let mut x: usize = FINE_LIMIT + 1;
        while x < (1 << 40) {
            let c = SizeClass::of(x).unwrap();
            assert!(c.bytes >= x && c.bytes.is_multiple_of(QUANTUM));
            assert!((c.bytes - x) as f64 <= x as f64 / 16.0, "{x} -> {}", c.bytes);
            x = x * 9 / 8 + 7;
        }
    }

    #[test]
    fn bins_are_dense_and_invert() {
        assert_eq!(SMALL_BINS, 192);
        let mut seen = [false; SMALL_BINS + 1];
        let mut bytes = 1;
        while bytes <= SMALL_LIMIT {
            let c = SizeClass::of(bytes).unwrap();
            let bin = c.bin.unwrap();
            assert!((1..=SMALL_BINS).contains(&bin));
            assert_eq!(bin_of(c.bytes), bin);
            assert_eq!(bin_bytes(bin), c.bytes, "bin {bin}");
            seen[bin] = true;
            bytes += 97;
        }
        assert_eq!(SizeClass::of(SMALL_LIMIT).unwrap().bin, Some(SMALL_BINS));
        assert!(seen[1..].iter().all(|&s| s), "every bin is used");
        for bin in 2..=SMALL_BINS {
            assert!(bin_bytes(bin) > bin_bytes(bin - 1));
        }
    }

    #[test]
    fn bad_sizes_are_typed_errors() {
        assert_eq!(SizeClass::of(0), Err(PoolError::ZeroSize));
        assert_eq!(SizeClass::of(usize::MAX), Err(PoolError::SizeOverflow { requested: usize::MAX }));
        // The largest representable class still works.
        let top = usize::MAX - (usize::MAX >> (STEP_SHIFT + 1));
        assert_eq!(SizeClass::of(top).unwrap().bytes, top);
        assert!(SizeClass::of(top + 1).is_err());
    }

    #[test]
    fn round_helpers() {
        assert_eq!(round_up(5, 4), Some(8));
        assert_eq!(round_up(usize::MAX, 2), None);
        assert_eq!(align_up_u64(4096, 4096), Some(4096));
        assert_eq!(align_up_u64(u64::MAX, 8), None);
    }
}
