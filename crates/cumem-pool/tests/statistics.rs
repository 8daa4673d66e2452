//! The statistics adaptor over a real resource: values, peaks, histogram, nested scopes, and the
//! fragmentation of a caching pool under it.

use std::sync::Arc;

use cumem_core::{Device, DeviceBuffer, DriverResource, Stream};
use cumem_pool::{
    CachingResource, FailureCallbackResource, LimitingResource, LoggingResource, PoolConfig, ScopeCounters,
    StatisticsResource, TrackingResource,
};
use cumem_sys::testing;

fn setup() -> (Stream, Arc<StatisticsResource>, Arc<StatisticsResource>) {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stats = Arc::new(StatisticsResource::new(Arc::new(DriverResource::new(&ctx))));
    let r = stats.clone();
    (Stream::new(&ctx).unwrap(), stats, r)
}

#[test]
fn counts_bytes_allocations_and_peaks() {
    let (s, stats, r) = setup();
    let a = DeviceBuffer::<u8>::zeroed_in(&r, &s, 1000).unwrap();
    let b = DeviceBuffer::<u32>::zeroed_in(&r, &s, 1000).unwrap();
    let c = stats.counters();
    assert_eq!((c.current_bytes, c.current_count, c.peak_bytes, c.peak_count), (5000, 2, 5000, 2));
    drop(b);
    let _d = DeviceBuffer::<u8>::zeroed_in(&r, &s, 100).unwrap();
    let c = stats.counters();
    assert_eq!(
        (c.current_bytes, c.current_count, c.peak_bytes, c.total_bytes, c.total_count),
        (1100, 2, 5000, 5100, 3)
    );
    assert_eq!(c.histogram.count(1000), 1);
    assert_eq!(c.histogram.count(4000), 1);
    assert_eq!(c.histogram.count(100), 1);
    assert_eq!(c.histogram.0.iter().sum::<u64>(), 3);
    // The caching pool's buckets: `2^i ..= 2^(i+1) - 1` bytes, by lower bound.
    assert_eq!(c.histogram.nonzero().collect::<Vec<_>>(), [(64, 1), (512, 1), (2048, 1)]);
    assert_eq!(stats.fragmentation(), None, "the driver caches nothing");
    drop(a);
    assert!(Arc::ptr_eq(stats.inner(), stats.inner()));
}

#[test]
fn scopes_nest_and_fold_into_their_parent() {
    let (s, stats, r) = setup();
    let outer = DeviceBuffer::<u8>::zeroed_in(&r, &s, 64).unwrap();
    assert_eq!(stats.push_scope(), 1);
    let x = DeviceBuffer::<u8>::zeroed_in(&r, &s, 256).unwrap();
    let ((), inner) = stats.with_scope(|| {
        let y = DeviceBuffer::<u8>::zeroed_in(&r, &s, 512).unwrap();
        drop(y);
    });
    assert_eq!((inner.current_bytes, inner.peak_bytes, inner.total_count), (0, 512, 1));
    drop(outer); // allocated before the scope: the scope's current goes below zero
    let scope = stats.pop_scope().unwrap();
    assert_eq!((scope.current_bytes, scope.peak_bytes, scope.total_bytes), (256 - 64, 768, 768));
    assert!(stats.pop_scope().is_none(), "the bottom scope cannot be popped");
    let total = stats.counters();
    assert_eq!((total.current_bytes, total.peak_bytes, total.total_count), (256, 64 + 768, 3));
    drop(x);
    assert_eq!(stats.counters().current_bytes, 0);
}

/// Two threads whose scopes overlap in time: each scope counts its own thread's allocations, by
/// value, and closing one leaves the other open.
#[test]
fn scopes_of_threads_that_overlap_count_their_own_thread() {
    let (s, stats, r) = setup();
    // A side that fails leaves the other waiting at a barrier: the watchdog turns that into a
    // failure.
    testing::within_watchdog("threads with overlapping scopes", move || overlapping_scopes(&s, &stats, &r));
}

fn overlapping_scopes(s: &Stream, stats: &StatisticsResource, r: &Arc<StatisticsResource>) {
    let steps = std::sync::Barrier::new(2);
    let ((a_buf, a), (b_buf, b)) = std::thread::scope(|scope| {
        let a = scope.spawn(|| {
            stats.with_scope(|| {
                steps.wait(); // 1: both scopes open
                let x = DeviceBuffer::<u8>::zeroed_in(r, s, 1000).unwrap();
                steps.wait(); // 2: A allocated
                steps.wait(); // 3: B allocated
                x
            })
        });
        let b = scope.spawn(|| {
            let out = stats.with_scope(|| {
                steps.wait(); // 1
                steps.wait(); // 2
                let y = DeviceBuffer::<u32>::zeroed_in(r, s, 750).unwrap();
                steps.wait(); // 3
                steps.wait(); // 4: A's scope closed
                assert_eq!(stats.counters().current_bytes, 3000, "B's scope is still open");
                drop(DeviceBuffer::<u8>::zeroed_in(r, s, 24).unwrap());
                y
            });
            assert!(stats.pop_scope().is_none(), "B closed only its own scope");
            out
        });
        let a = a.join().unwrap();
        steps.wait(); // 4
        assert!(stats.pop_scope().is_none(), "A's scope closed nothing of this thread");
        (a, b.join().unwrap())
    });
    let by_value = |c: &ScopeCounters| {
        (c.current_bytes, c.current_count, c.peak_bytes, c.peak_count, c.total_bytes, c.total_count)
    };
    assert_eq!(by_value(&a), (1000, 1, 1000, 1, 1000, 1), "A's scope");
    assert_eq!(a.histogram.count(1000), 1);
    assert_eq!(a.histogram.0.iter().sum::<u64>(), 1);
    assert_eq!(by_value(&b), (3000, 1, 3024, 2, 3024, 2), "B's scope");
    assert_eq!((b.histogram.count(3000), b.histogram.count(24)), (1, 1));
    assert_eq!(b.histogram.0.iter().sum::<u64>(), 2);
    // The totals saw both threads.
    assert_eq!(by_value(&stats.counters()), (4000, 2, 4024, 3, 4024, 3));
    drop((a_buf, b_buf));
    assert_eq!(stats.counters().current_bytes, 0);
}

#[test]
fn wraps_a_pool_as_well_as_the_driver() {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let stats = Arc::new(StatisticsResource::new(pool.clone()));
    let r = stats.clone();
    let bufs: Vec<_> = (1..=4).map(|i| DeviceBuffer::<u8>::zeroed_in(&r, &s, i * 1000).unwrap()).collect();
    assert_eq!(stats.counters().current_bytes, 10_000);
    assert_eq!(pool.stats().current_count, 4);
    assert!(pool.stats().current_bytes >= 10_000, "the pool counts rounded sizes");
    assert_eq!(stats.fragmentation(), Some(0.0), "the cache is the segment's tail, one block");
    // A hole below the tail: two cached blocks, the tail the largest.
    let mut bufs = bufs;
    drop(bufs.remove(1));
    let p = pool.stats();
    assert!(p.fragmentation() > 0.0, "{p:?}");
    assert_eq!(stats.fragmentation(), Some(p.fragmentation()));
    // Through every other adaptor, the same answer.
    let limited = Arc::new(LimitingResource::new(pool.clone(), 1 << 30));
    let tracked = Arc::new(TrackingResource::new(limited));
    let logged = Arc::new(LoggingResource::new(tracked, std::io::sink()).unwrap());
    let called = Arc::new(FailureCallbackResource::new(logged, 1, |_| false));
    assert_eq!(StatisticsResource::new(called).fragmentation(), Some(p.fragmentation()));
    drop(bufs);
    assert_eq!((stats.counters().current_count, pool.stats().current_count), (0, 0));
}
