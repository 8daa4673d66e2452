//! Upstream failures through the simulator: `cuMemAlloc_v2` fails at each step of a sequence in
//! turn; the pool returns the error, stays consistent, and leaks nothing.

use std::sync::Arc;

use cumem_core::sys::CUresult;
use cumem_core::{Device, DeviceBuffer, DeviceResource, Error, Stream};
use cumem_pool::{CachingResource, PoolConfig};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::testing;

/// Sizes that need new segments now and then: small ones share 2 MiB segments, large ones get their own.
const SIZES: [usize; 10] =
    [1 << 10, 3 << 20, 700, 1 << 20, 25 << 20, 64 << 10, 21 << 20, 300, 40 << 20, 2 << 20];

fn run<R: DeviceResource + ?Sized + 'static>(
    resource: &Arc<R>,
    stream: &Stream,
) -> (Vec<DeviceBuffer<u8>>, Option<(usize, Error)>) {
    let mut live = Vec::new();
    for (i, &n) in SIZES.iter().enumerate() {
        match DeviceBuffer::<u8>::new_in(resource, stream, n) {
            Ok(b) => live.push(b),
            Err(e) => return (live, Some((i, e))),
        }
        if i % 3 == 2 {
            live.remove(0);
        }
    }
    (live, None)
}

#[test]
fn every_upstream_failure_surfaces_and_leaves_the_pool_consistent() {
    testing::init();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    // How many upstream allocations does the sequence make when nothing fails?
    let upstream_calls = {
        let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
        let resource = pool.clone();
        let (live, failed) = run(&resource, &stream);
        assert!(failed.is_none());
        drop(live);
        pool.stats().upstream_allocations
    };
    assert!(upstream_calls >= 4, "the sequence should need several segments");
    for (code, persistent) in
        [(CUresult::CUDA_ERROR_OUT_OF_MEMORY, true), (CUresult::CUDA_ERROR_INVALID_VALUE, false)]
    {
        for nth in 1..=upstream_calls {
            let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
            let resource = pool.clone();
            // An injected OOM stays (times 0) so the pool's release-and-retry ladder cannot hide it.
            let times = if persistent { 0 } else { 1 };
            let rule = ctl.inject_fault(FaultRule {
                function: "cuMemAlloc_v2".into(),
                nth,
                code,
                times,
                this_thread_only: true,
            });
            let (live, failed) = run(&resource, &stream);
            ctl.remove_fault(rule);
            let (_, err) = failed.unwrap_or_else(|| panic!("failure {nth} ({code:?}) did not surface"));
            match code {
                CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}")
                }
                _ => assert!(matches!(err, Error::InvalidValue { .. }), "{err}"),
            }
            pool.pool().validate().unwrap();
            // By id: a freed segment's address may be reused by another test's allocation.
            let before = ctl.live_report();
            let segments: Vec<u64> = pool
                .pool()
                .segments()
                .iter()
                .map(|&(base, _)| {
                    before.id_of(base).unwrap_or_else(|| panic!("segment {base:#x}:\n{before}"))
                })
                .collect();
            drop(live);
            let stats = pool.stats();
            assert_eq!((stats.current_bytes, stats.current_count), (0, 0));
            pool.trim().unwrap();
            assert_eq!(pool.stats().reserved_bytes, 0);
            let report = ctl.live_report();
            assert!(segments.iter().all(|&id| !report.contains_allocation(id)), "{report}");
        }
    }
}

#[test]
fn exhaustion_reports_what_the_pool_holds() {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let resource = pool.clone();
    let keep = DeviceBuffer::<u8>::new_in(&resource, &stream, 1 << 20).unwrap();
    let total = ctx.device().total_memory().unwrap();
    match DeviceBuffer::<u8>::new_in(&resource, &stream, total).unwrap_err() {
        Error::OutOfMemory { report: Some(report), ctx } => {
            assert_eq!((report.requested, ctx.bytes), (total as u64, Some(total)));
            assert!(report.allocated >= 1 << 20 && report.reserved >= report.allocated, "{report:?}");
            assert_eq!(report.cached, report.reserved - report.allocated);
        }
        other => panic!("expected a pool out-of-memory report, got {other}"),
    }
    assert_eq!(pool.stats().current_count, 1, "the failed request left the pool as it was");
    drop(keep);
}
