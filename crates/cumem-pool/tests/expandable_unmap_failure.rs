//! A failed unmap while trimming an expandable segment leaves the chunk mapped and cached: the pool
//! keeps counting it as reserved, later growth maps only above it, and a later trim or the pool's
//! drop unmaps it; the statistics agree with the upstream throughout.

mod common;

use std::sync::Arc;

use common::Free;
use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig, TrimReport, UpstreamError};

const MIB: usize = 1 << 20;
const CHUNK: u64 = 2 << 20;

type Pool = CachingPool<Arc<HostUpstream>, Arc<HostOrdering>>;

fn pool(up: &Arc<HostUpstream>) -> Pool {
    let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
    CachingPool::new(up.clone(), Arc::new(HostOrdering::new()), config)
}

/// The one reservation's mapped bytes, checked against the pool's segments and statistics.
fn mapped(p: &Pool) -> u64 {
    let r = p.upstream().reservations();
    assert_eq!(r.len(), 1, "one stream, one kind: one reservation ({r:x?})");
    let (base, _, mapped) = r[0];
    assert_eq!(p.segments(), vec![(base, mapped)]);
    assert_eq!((p.stats().reserved_bytes, p.upstream().live_bytes()), (mapped, mapped));
    p.validate().unwrap();
    mapped
}

/// Maps 6 MiB (three chunks) with one block, frees it, and makes unmap call `fail` of the next trim
/// fail (0 is the top chunk).
fn three_free_chunks_with_a_failing_unmap(fail: u64) -> (Arc<HostUpstream>, Pool, u64) {
    let up = Arc::new(HostUpstream::new(1 << 30));
    let p = pool(&up);
    let a = p.allocate(6 * MIB, 512, 0).unwrap();
    let base = a.addr();
    p.free(a, 0).unwrap();
    assert_eq!(mapped(&p), 3 * CHUNK);
    up.fail_unmap(up.unmap_calls() + fail, UpstreamError::Other(1));
    (up, p, base)
}

#[test]
fn a_failed_unmap_keeps_the_chunk_and_growth_maps_above_it() {
    let (up, p, base) = three_free_chunks_with_a_failing_unmap(0);
    let frees = p.stats().upstream_frees;
    assert_eq!(p.trim().unwrap(), TrimReport::default(), "the top chunk failed: nothing was given back");
    assert_eq!(mapped(&p), 3 * CHUNK);
    assert_eq!(p.stats().upstream_frees, frees);
    // 8 MiB needs one more chunk: mapped above the three kept ones, the block starts at the base.
    let b = p.allocate(8 * MIB, 512, 0).unwrap();
    assert_eq!(b.addr(), base);
    assert_eq!(mapped(&p), 4 * CHUNK);
    p.free(b, 0).unwrap();
    // The unmap works again: everything goes, reservation included.
    assert_eq!(p.trim().unwrap(), TrimReport { released_segments: 1, released_bytes: 4 * CHUNK });
    assert!(up.reservations().is_empty());
    assert_eq!((p.stats().reserved_bytes, up.live_bytes()), (0, 0));
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

#[test]
fn a_failure_part_way_gives_back_only_the_chunks_above_it() {
    let (up, p, base) = three_free_chunks_with_a_failing_unmap(1);
    assert_eq!(p.trim().unwrap(), TrimReport { released_segments: 0, released_bytes: CHUNK });
    assert_eq!(mapped(&p), 2 * CHUNK);
    assert_eq!(p.stats().upstream_frees, 1);
    // The two kept chunks are still one free range at the base: 10 MiB grows by three chunks.
    let b = p.allocate(10 * MIB, 512, 0).unwrap();
    assert_eq!(b.addr(), base);
    assert_eq!(mapped(&p), 5 * CHUNK);
    p.free(b, 0).unwrap();
    drop(p);
    assert!(up.reservations().is_empty() && up.live_bytes() == 0, "the drop unmaps the kept chunks");
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}
