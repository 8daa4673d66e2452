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

/// What one failed destroy left: the trim's report, the bytes reserved before it, and what the
/// subscriber's reaction returned on each warning.
struct Outcome<T> {
    report: Result<cumem_pool::TrimReport, cumem_pool::PoolError>,
    reserved: u64,
    seen: Vec<T>,
}

/// Two streams, each used by `pool`, synchronised and dropped (each drop records its retired
/// event, complete at once); a trim's sweep retires both, and the second retirement finds the
/// first one's event complete. Its destroy fails (the simulator's fault injection), and a
/// subscriber runs `react` on the pool at the warning. Then checks that the failed event is all the
/// driver still holds, and destroys it. `None` where there is no simulator.
fn trim_with_a_failed_destroy<T: Send + 'static>(
    react: impl Fn(&CachingResource) -> T + Send + Sync + 'static,
    check: impl FnOnce(&CachingResource, Outcome<T>),
) {
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
        "deadlocked: a failed event destroy was logged under a lock the subscriber needs",
        move || {
            let seen: Arc<Mutex<Vec<T>>> = Arc::default();
            let read = seen.clone();
            let subscriber = tracing_subscriber::registry().with(OnEvent(move |m: &str| {
                if m == DESTROY_FAILED {
                    read.lock().push(react(&reader));
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
    check(&pool, Outcome { report, reserved, seen });
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

/// The warning comes with no lock of the pool held (the subscriber reads its stats), and the trim
/// then synchronises and releases as usual.
#[test]
#[serial]
fn a_failed_destroy_of_a_retired_event_warns_with_the_pool_unlocked() {
    trim_with_a_failed_destroy(
        |pool| pool.stats(),
        |_, out: Outcome<PoolStats>| {
            assert_eq!(
                out.report.unwrap().released_bytes,
                out.reserved,
                "the trim went on: everything cached went back"
            );
            let seen: Vec<u64> = out.seen.iter().map(|s| s.reserved_bytes).collect();
            assert_eq!(seen, [out.reserved], "one warning, before the release");
        },
    );
}

/// Nor is the ordering's own list of what it destroys later locked then: a subscriber that
/// synchronises the pool on the warning (which drops that list too) goes on, and the trim and
/// the synchronisation between them give everything back.
#[test]
#[serial]
fn a_subscriber_may_synchronise_the_pool_on_a_failed_destroy() {
    trim_with_a_failed_destroy(
        |pool| pool.pool().synchronize().map(|r| r.released_bytes),
        |pool, out: Outcome<Result<u64, cumem_pool::PoolError>>| {
            let nested: Vec<u64> = out.seen.into_iter().map(Result::unwrap).collect();
            assert_eq!(nested.len(), 1, "one warning");
            assert_eq!(out.report.unwrap().released_bytes + nested[0], out.reserved);
            assert_eq!(pool.stats().reserved_bytes, 0);
        },
    );
}
