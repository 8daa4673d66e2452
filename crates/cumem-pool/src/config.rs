//! Pool configuration: segment sizes, the growth policy and the release threshold.
//!
//! Small requests (≤ 1 MiB) share segments of [`PoolConfig::small_segment_bytes`]. A large request
//! takes a segment of at least its size rounded up to [`LARGE_ROUNDING`] (2 MiB) and at least
//! [`PoolConfig::large_segment_bytes`]; with [`Growth::Doubling`] that minimum doubles after every
//! large segment, up to `max`. If the upstream cannot provide the preferred size, the pool retries with
//! just the rounded request (for a small request, a 1 MiB segment) before running its out-of-memory
//! ladder, so the last memory of a nearly full device is still used.
//!
//! A request of more than half `large_segment_bytes` ([`PoolConfig::split_limit`]) that nothing
//! cached fits gets a segment of its own (its need, alignment padding included, rounded up to
//! 2 MiB), and once freed that segment serves only such requests, leaving at most the split limit
//! behind (or fitting the segment made for one like them), so that smaller blocks do not pin it
//! and the out-of-memory ladder can give it back; the ladder lets any request use it as its last
//! step.
//!
//! ```
//! use cumem_pool::{Growth, PoolConfig};
//!
//! let c = PoolConfig {
//!     growth: Growth::Doubling { max: 256 << 20 },
//!     release_threshold: 64 << 20, // keep at most 64 MiB cached after `CachingPool::synchronize`
//!     ..PoolConfig::default()
//! };
//! assert_eq!(c.small_segment_bytes, 2 << 20);
//! assert_eq!(c.large_segment_bytes, 20 << 20);
//! ```

use std::time::Duration;

/// Large segments are multiples of this.
pub const LARGE_ROUNDING: usize = 2 << 20;

/// How the size of new large segments grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Growth {
    /// Every large segment is `max(request rounded to 2 MiB, large_segment_bytes)`.
    Exact,
    /// Like `Exact`, but the minimum starts at `large_segment_bytes` and doubles after each large
    /// segment taken from upstream, up to `max` bytes.
    Doubling {
        /// Upper bound of the doubling minimum.
        max: usize,
    },
}

/// Configuration of a [`CachingPool`](crate::CachingPool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Size of segments serving small requests (≤ 1 MiB). Raised to at least 1 MiB and rounded up to a
    /// multiple of 512 B. Default 2 MiB.
    pub small_segment_bytes: usize,
    /// Minimum size of segments serving large requests; large requests of at most half of it share
    /// such segments, larger ones get a segment of their own with plain segments (see
    /// [`PoolConfig::split_limit`]).
    /// Rounded up to a multiple of [`LARGE_ROUNDING`]. Default 20 MiB.
    pub large_segment_bytes: usize,
    /// Growth policy for large segments. Default [`Growth::Exact`].
    pub growth: Growth,
    /// Bytes of cached memory kept when [`CachingPool::synchronize`](crate::CachingPool::synchronize)
    /// runs; fully free segments beyond it are released to the upstream then. `trim` ignores it.
    /// Default `usize::MAX` (keep everything until `trim` or out-of-memory).
    pub release_threshold: usize,
    /// Grow one [expandable segment](crate::expandable) per stream and kind by mapping chunks of
    /// physical memory at its end, instead of taking new segments (the sizes and growth policy above
    /// then do not apply). Needs an upstream with
    /// [`ExpandableUpstream`](crate::ExpandableUpstream) operations (a device with virtual memory
    /// management); without them the pool warns once and takes segments. Default `false`.
    pub expandable_segments: bool,
    /// Bytes of address space each expandable segment reserves (rounded up to whole chunks; a
    /// block larger than this gets a reservation of its own size). `None`: the upstream's
    /// [`reservation_bytes`](crate::ExpandableUpstream::reservation_bytes), the device's memory size.
    /// A segment that is full makes the pool reserve another, so this bounds no allocation; lower
    /// it when reservations fail ([`PoolError::AddressSpaceExhausted`](crate::PoolError::AddressSpaceExhausted)),
    /// e.g. with many pools or streams per device. Default `None`.
    pub expandable_reservation_bytes: Option<usize>,
    /// Keep recently freed small blocks in per-thread caches (the lock-free fast path, see
    /// [`caching_thread_cache`](crate::caching_thread_cache)). Each thread that frees to the pool
    /// may hold up to 2 MiB there, which other threads and streams cannot use until a flush; with
    /// `false` every free goes to the stream's arena. Default `true`.
    pub thread_cache: bool,
    /// How long an allocation under memory pressure waits for memory other threads are returning
    /// before it reports [`PoolError::OutOfMemory`](crate::PoolError::OutOfMemory). When the pool
    /// cannot grow even after releasing its own cached segments, segments that other threads'
    /// `trim`, `synchronize` or out-of-memory ladders took out of the pool may still be on their
    /// way back to the upstream (their `cuMemFree` has not returned). The allocation waits, up to
    /// this long, for the frees already in flight when it starts waiting (frees started later are
    /// not waited for), and asks the upstream once more if one of them returned memory. The bound
    /// matters because such a free may itself wait for the allocating thread (`cuMemFree` waits
    /// for the whole device, host functions included). `Duration::ZERO`: no waiting;
    /// `Duration::MAX`, or any duration too long to add to the current `Instant`: no bound. With
    /// [expandable segments](crate::expandable), the ladder whose growth fails waits likewise for
    /// the unmaps of free chunks in flight (another thread's `trim`, release threshold or ladder:
    /// they run with no lock held) and grows once more if one of them returned memory; an
    /// allocation that needs memory such an unmap returns fails with out-of-memory if the unmap
    /// takes longer than this. Default 1 s.
    pub oom_free_wait: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            small_segment_bytes: 2 << 20,
            large_segment_bytes: 20 << 20,
            growth: Growth::Exact,
            release_threshold: usize::MAX,
            expandable_segments: false,
            expandable_reservation_bytes: None,
            thread_cache: true,
            oom_free_wait: Duration::from_secs(1),
        }
    }
}

impl PoolConfig {
    /// The largest request (rounded to its size class) that grows the pool by a shared large
    /// segment: half of [`large_segment_bytes`](Self::large_segment_bytes) as the pool rounds it
    /// (10 MiB by default). A larger request that nothing cached fits (a large segment's free
    /// range may) gets a *dedicated* segment of its own: its need, alignment padding included,
    /// rounded up to [`LARGE_ROUNDING`], whatever the growth policy. Once freed, that segment's
    /// memory serves only requests above the split limit whose block leaves at most the split
    /// limit of the free range behind, or which fit the segment made for one like them; smaller
    /// requests take other segments, except as the out-of-memory ladder's last step. Without this
    /// rule, a block of a few MiB cut from a freed 60 MiB segment pins it: the ladder can only give
    /// back segments that are entirely free, and a fragmented pool refuses requests that the device
    /// could still serve (measured in `docs/benchmarks.md`, "Dedicated segments"). Pools that grow
    /// expandable segments make no dedicated ones.
    ///
    /// ```
    /// use cumem_pool::PoolConfig;
    /// assert_eq!(PoolConfig::default().split_limit(), 10 << 20);
    /// let c = PoolConfig { large_segment_bytes: 64 << 20, ..PoolConfig::default() };
    /// assert_eq!(c.split_limit(), 32 << 20);
    /// ```
    pub fn split_limit(&self) -> u64 {
        let large = crate::size_class::round_up(self.large_segment_bytes.max(1), LARGE_ROUNDING)
            .unwrap_or(LARGE_ROUNDING);
        (large / 2) as u64
    }

    /// The configuration with sizes clamped and rounded as documented on each field.
    pub(crate) fn normalized(mut self) -> PoolConfig {
        use crate::size_class::{QUANTUM, SMALL_LIMIT, round_up};
        self.small_segment_bytes =
            round_up(self.small_segment_bytes.max(SMALL_LIMIT), QUANTUM).unwrap_or(SMALL_LIMIT);
        self.large_segment_bytes =
            round_up(self.large_segment_bytes.max(1), LARGE_ROUNDING).unwrap_or(LARGE_ROUNDING);
        self
    }
}
