//! Dedicated segments: a request above the split limit that nothing cached fits gets a segment of
//! its own, and once freed that segment serves only requests above the limit that leave at most the
//! limit of it behind (or fit the segment made for one like them), so smaller blocks do not pin it
//! and the out-of-memory ladder can give it back; only as the ladder's last step does it serve
//! anything. On the host model, with a bounded upstream: the device that a fragmented pool would
//! have refused.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::Free;
use cumem_pool::size_class::Kind;
use cumem_pool::trace_format::{TraceAction, parse_trace};
use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig, PoolError};

const MIB: usize = 1 << 20;

fn host_pool(capacity: usize) -> CachingPool<Arc<HostUpstream>, Arc<HostOrdering>> {
    host_pool_with(capacity, PoolConfig::default())
}

fn host_pool_with(capacity: usize, config: PoolConfig) -> CachingPool<Arc<HostUpstream>, Arc<HostOrdering>> {
    CachingPool::new(Arc::new(HostUpstream::new(capacity)), Arc::new(HostOrdering::new()), config)
}

#[test]
fn a_freed_dedicated_segment_is_not_split_by_smaller_requests() {
    // 52 MiB: a 30 MiB segment and one 20 MiB large segment fit, two 30 MiB segments do not.
    let pool = host_pool(52 * MIB);
    let a = pool.allocate(30 * MIB, 256, 0).unwrap();
    let dedicated = a.segment();
    assert_eq!(a.kind(), Kind::Dedicated);
    assert_eq!(dedicated.len, 30 << 20, "its own size, not the 20 MiB large segment floor");
    pool.free(a, 0).unwrap();

    // A 3 MiB request would best-fit into the free 30 MiB range and pin it; it takes a new large
    // segment instead.
    let b = pool.allocate(3 * MIB, 256, 0).unwrap();
    assert_ne!(b.segment().base, dedicated.base);
    assert_eq!((b.segment().len, b.kind()), (20 << 20, Kind::Large));

    // So the next 30 MiB request finds its segment whole, where it would otherwise have run the
    // ladder (nothing fully free to give back) and failed.
    let c = pool.allocate(30 * MIB, 256, 0).unwrap();
    assert_eq!((c.segment(), c.kind()), (dedicated, Kind::Dedicated));
    let s = pool.stats();
    assert_eq!((s.reserved_bytes, s.oom_ladders, s.oom_errors), (50 << 20, 0, 0));
    pool.free(b, 0).unwrap();
    pool.free(c, 0).unwrap();
}

#[test]
fn a_dedicated_segment_serves_a_smaller_large_request_only_within_the_split_limit() {
    let pool = host_pool(1 << 30);
    let limit = PoolConfig::default().split_limit() as usize;
    let a = pool.allocate(40 * MIB, 256, 0).unwrap();
    let dedicated = a.segment();
    pool.free(a, 0).unwrap();

    // 24 MiB would leave 16 MiB (more than the 10 MiB limit) of the segment behind: a new one.
    let far = pool.allocate(24 * MIB, 256, 0).unwrap();
    assert_ne!(far.segment().base, dedicated.base);
    // 32 MiB leaves 8 MiB: served from the freed segment, whose tail stays dedicated.
    let near = pool.allocate(32 * MIB, 256, 0).unwrap();
    assert_eq!(near.segment(), dedicated);
    assert!(40 * MIB - 32 * MIB <= limit);
    // The 8 MiB tail serves no request: 8 MiB is below the limit, so it would pin the segment.
    let small = pool.allocate(8 * MIB, 256, 0).unwrap();
    assert_ne!(small.segment().base, dedicated.base);
    // A request above the limit may take a large segment's range too (the smaller fit of the two
    // kinds): 11 MiB fits the 12 MiB that `small` left of its 20 MiB large segment, where no
    // dedicated range fits; the block is then of the large segment's kind.
    let large_fit = pool.allocate(11 * MIB, 256, 0).unwrap();
    assert_eq!((large_fit.segment(), large_fit.kind()), (small.segment(), Kind::Large));
    for b in [far, near, small, large_fit] {
        pool.free(b, 0).unwrap();
    }
    pool.validate().unwrap();
}

#[test]
fn a_dedicated_segment_serves_its_own_request_again_whatever_the_limit() {
    // A 2 MiB large segment puts the split limit at 1 MiB: a 2.5 MiB request's own segment (4 MiB)
    // leaves 1.5 MiB, more than the limit, yet serves the same request again.
    let pool = host_pool_with(1 << 30, PoolConfig { large_segment_bytes: 2 << 20, ..PoolConfig::default() });
    for _ in 0..10 {
        let b = pool.allocate(5 * MIB / 2, 512, 0).unwrap();
        assert_eq!((b.kind(), b.segment().len), (Kind::Dedicated, 4 << 20));
        pool.free(b, 0).unwrap();
    }
    assert_eq!((pool.stats().reserved_bytes, pool.upstream().allocate_calls()), (4 << 20, 1));
    // Aligned to 2 MiB, its own segment would be 6 MiB (the need with the padding): the 4 MiB one,
    // no longer, serves it too, on another stream as well.
    for _ in 0..3 {
        let b = pool.allocate(5 * MIB / 2, 2 << 20, 1).unwrap();
        assert_eq!(b.kind(), Kind::Dedicated);
        pool.free(b, 1).unwrap();
    }
    assert_eq!(pool.upstream().allocate_calls(), 1);
}

#[test]
fn under_pressure_a_dedicated_tail_serves_a_smaller_request_as_the_last_resort() {
    let pool = host_pool(40 * MIB);
    let a = pool.allocate(40 * MIB, 256, 0).unwrap();
    let dedicated = a.segment();
    pool.free(a, 0).unwrap();
    let b = pool.allocate(31 * MIB, 256, 0).unwrap(); // leaves 9 MiB, within the limit
    assert_eq!(b.segment(), dedicated);
    // 8 MiB may not pin the segment while anything else could serve it, but the device is full and
    // nothing cached is wholly free: the ladder's last step takes the 9 MiB tail rather than refuse.
    let c = pool.allocate(8 * MIB, 256, 0).unwrap();
    assert_eq!((c.segment(), c.kind()), (dedicated, Kind::Dedicated));
    let s = pool.stats();
    assert_eq!((s.oom_ladders, s.oom_errors, s.reserved_bytes), (1, 0, 40 << 20));
    pool.free(c, 0).unwrap();
    pool.free(b, 0).unwrap();
    pool.validate().unwrap();
    assert_eq!(pool.cached_ranges(), vec![(dedicated.base, dedicated.len)]);
}

#[test]
fn a_freed_block_coalesces_back_into_its_dedicated_segment() {
    let pool = host_pool(1 << 30);
    let a = pool.allocate(31 * MIB, 256, 0).unwrap();
    let dedicated = a.segment();
    assert_eq!((dedicated.len, a.kind()), (32 << 20, Kind::Dedicated), "rounded up to 2 MiB");
    pool.free(a, 0).unwrap();
    // The free range is whole again, in the dedicated set, and the trim gives the segment back.
    assert_eq!(pool.cached_ranges(), vec![(dedicated.base, dedicated.len)]);
    pool.validate().unwrap();
    let report = pool.trim().unwrap();
    assert_eq!((report.released_segments, report.released_bytes), (1, 32 << 20));
    assert_eq!(pool.stats().reserved_bytes, 0);
}

/// Replays a trace's allocations and frees on a pool over a host upstream of `capacity` bytes,
/// each logged stream on one of the pool's streams; returns the allocations refused.
fn failures_replaying(trace: &str, capacity: usize) -> usize {
    let rows = parse_trace(trace.as_bytes()).unwrap();
    let pool = host_pool(capacity);
    let mut streams = HashMap::new();
    let mut live = HashMap::new();
    let mut failed = 0;
    for row in &rows {
        let next = streams.len() as u32;
        let stream = *streams.entry(row.stream).or_insert(next);
        match row.action {
            TraceAction::Allocate => match pool.allocate(row.size, 256, stream) {
                Ok(block) => {
                    live.insert(row.pointer, (block, stream));
                }
                Err(PoolError::OutOfMemory { .. }) => failed += 1,
                Err(e) => panic!("{e}"),
            },
            // A failure the log recorded: nothing to replay.
            TraceAction::AllocateFailure => {}
            TraceAction::Free => {
                if let Some((block, _)) = live.remove(&row.pointer) {
                    pool.free(block, stream).unwrap();
                }
            }
        }
    }
    for (_, (block, stream)) in live {
        pool.free(block, stream).unwrap();
    }
    pool.validate().unwrap();
    failed
}

/// Two of the repository's traces (`cargo xtask traces`), on upstreams that a fragmented pool could
/// not serve them from. Inference, four streams: live bytes peak at 284 MiB, in blocks of up to
/// 64 MiB; without dedicated segments the pool refused 27 of its requests with 400 MiB and 9 with
/// 480 MiB (none from 590 MiB on). Training, one stream: live bytes peak at 428 MiB; 21 refusals
/// with 460 MiB (none from 486 MiB on).
#[test]
fn the_traces_run_where_a_fragmented_pool_refused_them() {
    let inference = include_str!("../../../traces/inference.csv");
    for capacity in [400 * MIB, 480 * MIB] {
        assert_eq!(failures_replaying(inference, capacity), 0, "inference, {} MiB", capacity / MIB);
    }
    let training = include_str!("../../../traces/training.csv");
    assert_eq!(failures_replaying(training, 460 * MIB), 0, "training, 460 MiB");
}
