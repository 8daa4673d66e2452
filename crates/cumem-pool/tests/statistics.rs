//! The statistics adaptor over a real resource: values, peaks, histogram and nested scopes.

use std::sync::Arc;

use cumem_core::{Device, DeviceBuffer, DriverResource, Stream};
use cumem_pool::{CachingResource, PoolConfig, ScopeCounters, StatisticsResource};
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
    assert_eq!(c.histogram[ScopeCounters::bucket(1000)], 1);
    assert_eq!(c.histogram[ScopeCounters::bucket(4000)], 1);
    assert_eq!(c.histogram[ScopeCounters::bucket(100)], 1);
    assert_eq!(c.histogram.iter().sum::<u64>(), 3);
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
    drop(bufs);
    assert_eq!((stats.counters().current_count, pool.stats().current_count), (0, 0));
}
