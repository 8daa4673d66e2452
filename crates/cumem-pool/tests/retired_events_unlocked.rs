//! A sweep retires dropped streams under the pool's locks, and each retirement lets go of the
//! retired events of earlier streams known complete: those are destroyed only once the locks are
//! let go, so a failed `cuEventDestroy` warns where a subscriber that reads the pool's stats on
//! the warning goes on instead of waiting for itself. The work runs on a thread, waited for under
//! a bound, since a deadlock hangs rather than fails.

use std::sync::Arc;

use cumem_core::{Device, DeviceBuffer, Stream, sys};
use cumem_pool::{CachingResource, PoolConfig, PoolStats};
use cumem_sys::testing;
use parking_lot::Mutex;
use serial_test::serial;
use tracing_subscriber::layer::SubscriberExt;

mod common;
use common::events::{OnEvent, on_a_thread_within_20s};
use common::fails_once_on_this_thread;

const DESTROY_FAILED: &str = "destroying an event failed";

/// Two streams, each used by the pool, synchronised and dropped (each drop records its retired
/// event, complete at once); a trim's sweep retires both, and the second retirement finds the
/// first one's event complete. Its destroy fails (the simulator's fault injection): the warning
/// comes with no lock of the pool held, and the trim then synchronises and releases as usual.
#[test]
#[serial]
fn a_failed_destroy_of_a_retired_event_warns_with_the_pool_unlocked() {
    testing::init_with("devices=1");
    // Injecting failures needs the simulator.
    let Some(ctl) = testing::sim_control() else {
        testing::skip("injects driver faults: simulator only");
        return;
    };
    let ctx = Device::get(0).unwrap().context().unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    for _ in 0..2 {
        let s = Stream::non_blocking(&ctx).unwrap();
        drop(DeviceBuffer::<u8>::zeroed_in(&pool, &s, 4096).unwrap());
        s.synchronize().unwrap();
    }
    ctx.synchronize().unwrap();
    let reserved = pool.stats().reserved_bytes;
    assert!(reserved > 0);
    let (reader, p) = (pool.clone(), pool.clone());
    let (report, seen) = on_a_thread_within_20s(
        "deadlocked: a failed event destroy was logged under the pool's locks",
        move || {
            let seen: Arc<Mutex<Vec<PoolStats>>> = Arc::default();
            let read = seen.clone();
            let subscriber = tracing_subscriber::registry().with(OnEvent(move |m: &str| {
                if m == DESTROY_FAILED {
                    read.lock().push(reader.stats());
                }
            }));
            let report = cumem_sys::testing::with_subscriber(subscriber, || {
                let ctl = testing::sim_control().expect("the simulator, checked above");
                let rule = ctl.inject_fault(fails_once_on_this_thread("cuEventDestroy_v2", 1));
                let report = p.pool().trim();
                ctl.remove_fault(rule);
                report
            });
            let seen = std::mem::take(&mut *seen.lock());
            (report, seen)
        },
    );
    let report = report.unwrap();
    assert_eq!(report.released_bytes, reserved, "the trim went on: everything cached went back");
    let seen: Vec<u64> = seen.iter().map(|s| s.reserved_bytes).collect();
    assert_eq!(seen, [reserved], "one warning, before the release");
    assert_eq!(pool.pool().ordering().streams_held(), 0, "both streams retired");
    drop(pool);
    // The event whose destroy failed stays with the driver, and nothing else: destroyed here.
    let live = ctl.live_report();
    assert_eq!(live.events.len(), 1, "{live}");
    ctx.bind().unwrap();
    // SAFETY: the handle is of a live event of the current context, which nothing else holds
    // (its `Event` was dropped when the destroy failed).
    let code = unsafe { sys::cuEventDestroy_v2(live.events[0].handle as sys::CUevent) };
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    drop(ctx);
    assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
    let live = ctl.live_report();
    assert!(live.is_clean(), "{live}");
}
