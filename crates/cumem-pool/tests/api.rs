//! Behaviour a user observes through the public API: errors by variant, foreign blocks, the stream
//! limit, the release threshold, growth, peaks and drop.

mod common;

use std::sync::Arc;

use common::Free;
use cumem_pool::{
    CachingPool, Growth, HostOrdering, HostUpstream, MAX_ALIGN, PoolConfig, PoolError, TrimReport,
    UpstreamError,
};

fn host_pool(capacity: usize, config: PoolConfig) -> CachingPool<Arc<HostUpstream>, Arc<HostOrdering>> {
    CachingPool::new(Arc::new(HostUpstream::new(capacity)), Arc::new(HostOrdering::new()), config)
}

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let pool = host_pool(1 << 30, PoolConfig::default());
    assert_eq!(pool.allocate(0, 1, 0).unwrap_err(), PoolError::ZeroSize);
    assert_eq!(pool.allocate(1, 0, 0).unwrap_err(), PoolError::InvalidAlignment { align: 0 });
    assert_eq!(pool.allocate(1, 24, 0).unwrap_err(), PoolError::InvalidAlignment { align: 24 });
    assert_eq!(
        pool.allocate(1, MAX_ALIGN << 1, 0).unwrap_err(),
        PoolError::AlignmentTooLarge { align: MAX_ALIGN << 1, max: MAX_ALIGN }
    );
    assert_eq!(
        pool.allocate(usize::MAX, 1, 0).unwrap_err(),
        PoolError::SizeOverflow { requested: usize::MAX }
    );
    let s = pool.stats();
    assert_eq!((s.allocations_total, s.reserved_bytes, pool.upstream().allocate_calls()), (0, 0, 0));
}

#[test]
fn huge_request_runs_the_ladder_and_reports() {
    let pool = host_pool(64 << 20, PoolConfig::default());
    let keep = pool.allocate(1 << 20, 1, 0).unwrap();
    let e = pool.allocate(1 << 40, 1, 1).unwrap_err();
    assert_eq!(
        e,
        PoolError::OutOfMemory {
            requested: 1 << 40,
            allocated: 1 << 20,
            reserved: 2 << 20,
            free_cached: 1 << 20,
            largest_free_block: 1 << 20,
        }
    );
    assert_eq!(pool.ordering().synchronizations(), 1, "the ladder synchronised once");
    let s = pool.stats();
    assert_eq!((s.oom_ladders, s.oom_errors), (1, 1));
    pool.free(keep, 0).unwrap();
}

#[test]
fn other_upstream_errors_are_returned_without_the_ladder() {
    let pool = host_pool(1 << 30, PoolConfig::default());
    pool.upstream().fail_call(0, UpstreamError::Other(2));
    assert_eq!(pool.allocate(512, 1, 0).unwrap_err(), PoolError::Upstream(UpstreamError::Other(2)));
    assert_eq!((pool.ordering().synchronizations(), pool.stats().oom_ladders), (0, 0));
    let b = pool.allocate(512, 1, 0).unwrap();
    pool.free(b, 0).unwrap();
}

#[test]
fn foreign_blocks_are_handed_back() {
    let a = host_pool(1 << 30, PoolConfig::default());
    let b = host_pool(1 << 30, PoolConfig::default());
    let block = a.allocate(4096, 1, 0).unwrap();
    let addr = block.addr();
    let back = b.free(block, 0).unwrap_err();
    assert_eq!(back.0.addr(), addr);
    assert_eq!(b.stats().current_count, 0);
    a.free(back.0, 0).unwrap();
    assert_eq!(a.stats().current_count, 0);
}

#[test]
fn streams_beyond_the_arena_table_share_the_first_arena() {
    let pool = CachingPool::with_stream_arenas(
        HostUpstream::new(1 << 30),
        HostOrdering::new(),
        PoolConfig::default(),
        1,
    );
    let block = pool.allocate(4096, 1, 0).unwrap();
    pool.free(block, 0).unwrap();
    // Stream 1 has no arena: it allocates from stream 0's cache after waiting for stream 0.
    let shared = pool.allocate(4096, 1, 1).unwrap();
    assert_eq!((pool.ordering().waits(), pool.stats().upstream_allocations), (1, 1));
    // Stream 9 has no arena: the block stays in this thread's cache under stream 9 (only stream 9
    // takes it from there) until the cache is flushed, here by `validate`: synchronise, cache in
    // arena 0.
    pool.free(shared, 9).unwrap();
    assert_eq!(pool.ordering().synchronizations(), 0);
    pool.validate().unwrap();
    assert_eq!(pool.ordering().synchronizations(), 1);
    assert_eq!(pool.stats().current_count, 0);
}

#[test]
fn release_threshold_applies_at_synchronize_not_before() {
    let config =
        PoolConfig { release_threshold: 4 << 20, large_segment_bytes: 2 << 20, ..PoolConfig::default() };
    let pool = host_pool(1 << 30, config);
    let blocks: Vec<_> = (0..4).map(|_| pool.allocate(3 << 20, 1, 0).unwrap()).collect();
    for b in blocks {
        pool.free(b, 0).unwrap();
    }
    assert_eq!(pool.stats().reserved_bytes, 16 << 20, "frees keep the cache");
    let r = pool.synchronize().unwrap();
    assert_eq!(r, TrimReport { released_segments: 3, released_bytes: 12 << 20 });
    assert_eq!(pool.stats().cached_bytes, 4 << 20);
    assert_eq!(pool.synchronize().unwrap(), TrimReport::default());
    assert_eq!(pool.trim_to(8 << 20).unwrap(), TrimReport::default());
    assert_eq!(pool.trim().unwrap().released_bytes, 4 << 20);
    assert_eq!(pool.upstream().live_bytes(), 0);
}

#[test]
fn trim_without_fully_free_segments_does_not_synchronise() {
    let pool = host_pool(1 << 30, PoolConfig::default());
    let b = pool.allocate(4096, 1, 0).unwrap();
    assert_eq!(pool.trim().unwrap(), TrimReport::default());
    assert_eq!(pool.ordering().synchronizations(), 0);
    pool.free(b, 0).unwrap();
    assert_eq!(pool.trim().unwrap().released_segments, 1);
    assert_eq!(pool.ordering().synchronizations(), 1);
}

#[test]
fn growth_doubling_and_fallback_to_minimal_segment() {
    let config = PoolConfig { growth: Growth::Doubling { max: 64 << 20 }, ..PoolConfig::default() };
    let pool = host_pool(76 << 20, config);
    // 10 MiB requests: the most that share large segments (the split limit, half of 20 MiB).
    let a = pool.allocate(10 << 20, 1, 0).unwrap(); // 20 MiB segment
    let b = pool.allocate(10 << 20, 1, 0).unwrap(); // fits in it
    let c = pool.allocate(10 << 20, 1, 0).unwrap(); // doubled: 40 MiB
    let mib = |v: Vec<(u64, u64)>| v.iter().map(|s| s.1 >> 20).collect::<Vec<_>>();
    assert_eq!(mib(pool.segments()), vec![20, 40]);
    let rest: Vec<_> = (0..3).map(|_| pool.allocate(10 << 20, 1, 0).unwrap()).collect(); // fill it
    assert_eq!(mib(pool.segments()), vec![20, 40]);
    // Nothing is cached. Doubling wants 64 MiB but 16 MiB are left upstream: the pool falls back
    // to the minimal 10 MiB segment.
    let d = pool.allocate(10 << 20, 1, 0).unwrap();
    assert_eq!(mib(pool.segments()), vec![20, 40, 10]);
    assert_eq!(pool.stats().oom_ladders, 0);
    // Now nothing fits anywhere: the ladder runs and reports.
    assert!(matches!(pool.allocate(10 << 20, 1, 0), Err(PoolError::OutOfMemory { .. })));
    for x in [a, b, c, d].into_iter().chain(rest) {
        pool.free(x, 0).unwrap();
    }
}

#[test]
fn peaks_and_reset() {
    let pool = host_pool(1 << 30, PoolConfig::default());
    let a = pool.allocate(1 << 20, 1, 0).unwrap();
    let b = pool.allocate(1 << 20, 1, 1).unwrap();
    pool.free(a, 1).unwrap();
    let s = pool.stats();
    assert_eq!((s.current_bytes, s.peak_bytes, s.current_count, s.peak_count), (1 << 20, 2 << 20, 1, 2));
    pool.reset_peaks();
    let s = pool.stats();
    assert_eq!((s.peak_bytes, s.peak_count, s.peak_reserved_bytes), (1 << 20, 1, s.reserved_bytes));
    pool.free(b, 1).unwrap();
    assert!(pool.stats().utilization() < 1.0);
}

#[test]
fn drop_returns_every_segment_even_with_live_blocks() {
    let up = Arc::new(HostUpstream::new(1 << 30));
    let ord = Arc::new(HostOrdering::new());
    {
        let pool = CachingPool::new(up.clone(), ord.clone(), PoolConfig::default());
        let _leaked = pool.allocate(3 << 20, 1, 0).unwrap();
        let b = pool.allocate(512, 1, 1).unwrap();
        pool.free(b, 1).unwrap();
        assert_eq!(up.live().len(), 2);
    }
    assert_eq!((up.live_bytes(), ord.synchronizations()), (0, 1));
    assert!(up.violations().is_empty());
}

/// As documented: a trim with nothing to release waits for no stream; one with a free segment
/// synchronises first.
#[test]
fn a_trim_with_nothing_to_release_does_not_synchronise() {
    let pool = host_pool(1 << 30, PoolConfig::default());
    let block = pool.allocate(1000, 256, 0).unwrap();
    let syncs = pool.ordering().synchronizations();
    assert_eq!(pool.trim().unwrap(), TrimReport::default());
    assert_eq!(pool.ordering().synchronizations(), syncs, "nothing to release: no synchronisation");
    pool.free(block, 0).unwrap();
    let report = pool.trim().unwrap();
    assert_eq!((report.released_segments, report.released_bytes), (1, 2 << 20));
    assert_eq!(pool.ordering().synchronizations(), syncs + 1);
}
