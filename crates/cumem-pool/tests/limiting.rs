//! The limiting adaptor: a request over the cap is `OutOfMemory` with a report naming the cap, the
//! bytes live and the request, before the wrapped resource sees it; frees give the budget back; many
//! threads together never get past the cap.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cumem_core::{Device, DeviceBuffer, Error, Stream};
use cumem_pool::{
    CachingResource, FailureCallbackResource, LimitingResource, PoolConfig, StatisticsResource,
};
use cumem_sys::testing;
use serial_test::parallel;

fn setup(limit: usize) -> (Stream, Arc<StatisticsResource>, Arc<LimitingResource<StatisticsResource>>) {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let stats = Arc::new(StatisticsResource::new(pool));
    let capped = Arc::new(LimitingResource::new(stats.clone(), limit));
    (Stream::non_blocking(&ctx).unwrap(), stats, capped)
}

#[test]
#[parallel]
fn over_the_cap_is_out_of_memory_with_a_report_naming_it() {
    let (s, stats, capped) = setup(10_000);
    let a = DeviceBuffer::<u8>::zeroed_in(&capped, &s, 6000).unwrap();
    let err = DeviceBuffer::<u8>::zeroed_in(&capped, &s, 4001).unwrap_err();
    let Error::OutOfMemory { ctx, report: Some(report) } = &err else {
        panic!("expected OutOfMemory, got {err:?}")
    };
    assert_eq!((report.requested, report.allocated, report.reserved), (4001, 6000, 10_000));
    assert_eq!(report.largest_free_block, 4000);
    assert_eq!((ctx.bytes, ctx.device), (Some(4001), Some(0)));
    let message = err.to_string();
    assert!(message.contains("LimitingResource") && message.contains("10000 reserved"), "{message}");
    assert_eq!(stats.counters().total_count, 1, "the refused request never reached the resource below");
    let b = DeviceBuffer::<u8>::zeroed_in(&capped, &s, 4000).unwrap(); // exactly up to the cap
    assert_eq!(capped.used(), capped.limit());
    drop(a);
    assert_eq!(capped.used(), 4000);
    let c = DeviceBuffer::<u8>::zeroed_in(&capped, &s, 6000).unwrap();
    drop((b, c));
    assert_eq!((capped.used(), stats.counters().current_bytes), (0, 0));
}

#[test]
#[parallel]
fn threads_together_never_pass_the_cap() {
    let (s, stats, capped) = setup(64 * 1000);
    let peak = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for t in 0..4 {
            let (capped, s, peak) = (&capped, &s, &peak);
            scope.spawn(move || {
                let mut held = Vec::new();
                for i in 0..200 {
                    match DeviceBuffer::<u8>::zeroed_in(capped, s, 1000 + (i * 7 + t) % 100) {
                        Ok(buf) => held.push(buf),
                        Err(Error::OutOfMemory { .. }) => drop(held.drain(..held.len() / 2)),
                        Err(e) => panic!("unexpected {e:?}"),
                    }
                    peak.fetch_max(capped.used(), Ordering::Relaxed);
                }
            });
        }
    });
    assert!(peak.load(Ordering::Relaxed) <= 64 * 1000);
    assert!(stats.counters().peak_bytes <= 64 * 1000, "the resource below never held more");
    assert_eq!((capped.used(), stats.counters().current_bytes), (0, 0));
}

/// A request that panics below the cap (here a failure callback that panics) gives its bytes of
/// the budget back, like one that fails: the cap is not lowered for good by a panic someone
/// caught.
#[test]
#[parallel]
fn a_panic_below_the_cap_gives_the_budget_back() {
    let (s, stats, tight) = setup(100);
    let panicking =
        Arc::new(FailureCallbackResource::new(tight, 3, |_| panic!("the callback panicked (on purpose)")));
    let capped = Arc::new(LimitingResource::new(panicking, 10_000));
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        DeviceBuffer::<u8>::zeroed_in(&capped, &s, 1000).map(drop)
    }));
    assert!(caught.is_err(), "the callback's panic reaches the caller");
    assert_eq!(capped.used(), 0, "the panicked request's bytes are back in the budget");
    let full = DeviceBuffer::<u8>::zeroed_in(&capped, &s, 100).unwrap();
    assert_eq!((capped.used(), stats.counters().current_bytes), (100, 100));
    drop(full);
}
