//! The segment registry: which segments the pool holds from its upstream, and how big the next one is.
//!
//! Segments are only touched on the slow path (growth, release, statistics), so the registry sits
//! behind one mutex. It also keeps the reserved-bytes counters and the growth state.
//!
//! ```
//! use cumem_pool::{CachingPool, Growth, HostOrdering, HostUpstream, PoolConfig};
//!
//! let config = PoolConfig { growth: Growth::Doubling { max: 80 << 20 }, ..PoolConfig::default() };
//! let pool = CachingPool::new(HostUpstream::new(1 << 30), HostOrdering::new(), config);
//! let mut blocks: Vec<_> = (0..3).map(|_| pool.allocate(10 << 20, 512, 0).unwrap()).collect();
//! // 20 MiB (holds the first two blocks), then 40 MiB (the third).
//! let lengths = |pool: &CachingPool<_, _>| pool.segments().iter().map(|s| s.1 >> 20).collect::<Vec<_>>();
//! assert_eq!(lengths(&pool), vec![20, 40]);
//! // Above the split limit (10 MiB), a request that no free range fits gets a dedicated segment
//! // of its own size, whatever the growth policy.
//! blocks.push(pool.allocate(36 << 20, 512, 0).unwrap());
//! assert_eq!(blocks[3].kind(), cumem_pool::size_class::Kind::Dedicated);
//! assert_eq!(lengths(&pool), vec![20, 40, 36]);
//! # for b in blocks {
//! #     // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! #     unsafe { pool.deallocate(b, 0) }.unwrap();
//! # }
//! ```

use std::collections::BTreeMap;

use crate::PoolError;
use crate::config::{Growth, LARGE_ROUNDING, PoolConfig};
use crate::free_set::Seg;
use crate::size_class::{Kind, SMALL_LIMIT, round_up};

/// The pool's segments and reserved-memory counters.
#[derive(Debug, Default)]
pub(crate) struct Segments {
    pub map: BTreeMap<u64, (u64, Kind)>,
    pub reserved: u64,
    pub peak_reserved: u64,
    pub upstream_allocations: u64,
    pub upstream_frees: u64,
    pub oom_ladders: u64,
    pub oom_errors: u64,
    /// Current minimum for the next large segment under `Growth::Doubling`.
    next_large: usize,
    /// Expandable segments (their mapped bytes are in `reserved`; they are not in `map`).
    pub expandable: crate::expandable::Registry,
    /// Blocks freed on a stream the pool could not order its later users behind (an ordering
    /// failure), as `(addr, len, seg, kind)`: counted as cached, in no arena (nothing reuses them)
    /// until a synchronisation under the pool's locks makes them safe for every stream.
    pub stranded: Vec<(u64, u64, Seg, Kind)>,
    /// Bytes in `stranded`.
    pub stranded_bytes: u64,
    /// How many blocks ever left the front of `stranded` (returned to the cache): with
    /// `stranded.len()` it numbers every block ever stranded, so a synchronisation that let go of
    /// the locks still knows which blocks were stranded before it started.
    pub stranded_taken: u64,
}

impl Segments {
    /// Segment sizes to try for a free range of `need` bytes: the preferred size, then the minimal one.
    ///
    /// A small request's minimal segment is [`SMALL_LIMIT`] (1 MiB, the most a small request needs),
    /// so that when the device has less than a full small segment left, that memory still serves
    /// small requests instead of being lost to the pool.
    pub(crate) fn plan(
        &self,
        config: &PoolConfig,
        kind: Kind,
        need: u64,
    ) -> Result<(usize, usize), PoolError> {
        let need = usize::try_from(need).map_err(|_| PoolError::SizeOverflow { requested: usize::MAX })?;
        if kind == Kind::Small {
            // `need <= SMALL_LIMIT <= small_segment_bytes` for small requests (normalized config).
            return Ok((config.small_segment_bytes, SMALL_LIMIT.min(config.small_segment_bytes).max(need)));
        }
        let minimal = round_up(need, LARGE_ROUNDING).ok_or(PoolError::SizeOverflow { requested: need })?;
        let floor = match config.growth {
            Growth::Exact => config.large_segment_bytes,
            Growth::Doubling { max } => {
                self.next_large.max(config.large_segment_bytes).min(max.max(config.large_segment_bytes))
            }
        };
        Ok((minimal.max(floor), minimal))
    }

    /// Records a segment obtained from upstream.
    pub(crate) fn add(&mut self, config: &PoolConfig, seg: Seg, kind: Kind) {
        self.map.insert(seg.base, (seg.len, kind));
        self.reserved += seg.len;
        self.peak_reserved = self.peak_reserved.max(self.reserved);
        self.upstream_allocations += 1;
        if kind == Kind::Large
            && let Growth::Doubling { max } = config.growth
        {
            let cur = self.next_large.max(config.large_segment_bytes);
            self.next_large = cur.saturating_mul(2).min(max.max(config.large_segment_bytes));
        }
    }

    /// Records a segment given back to upstream.
    pub(crate) fn remove(&mut self, base: u64) {
        if let Some((len, _)) = self.map.remove(&base) {
            self.reserved -= len;
            self.upstream_frees += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_follow_the_growth_policy() {
        let mib = 1 << 20;
        let mut s = Segments::default();
        let exact = PoolConfig::default().normalized();
        assert_eq!(s.plan(&exact, Kind::Small, 512).unwrap(), (2 * mib, mib));
        assert_eq!(s.plan(&exact, Kind::Large, 3 * mib as u64).unwrap(), (20 * mib, 4 * mib));
        assert_eq!(s.plan(&exact, Kind::Large, 30 * mib as u64).unwrap(), (30 * mib, 30 * mib));
        let dbl =
            PoolConfig { growth: Growth::Doubling { max: 64 * mib }, ..PoolConfig::default() }.normalized();
        let mut sizes = vec![];
        for _ in 0..4 {
            let (p, _) = s.plan(&dbl, Kind::Large, mib as u64).unwrap();
            sizes.push(p / mib);
            s.add(&dbl, Seg { base: (sizes.len() as u64) << 40, len: p as u64 }, Kind::Large);
        }
        assert_eq!(sizes, vec![20, 40, 64, 64]);
        assert_eq!(s.reserved, (20 + 40 + 64 + 64) * mib as u64);
        s.remove(1 << 40);
        assert_eq!((s.reserved, s.upstream_frees), ((40 + 64 + 64) * mib as u64, 1));
        assert!(s.plan(&exact, Kind::Large, u64::MAX).is_err());
    }
}
