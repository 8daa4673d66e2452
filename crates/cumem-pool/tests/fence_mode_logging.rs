//! The first pool of a process chooses the thread caches' fence mode and logs it; a subscriber that
//! makes a pool of its own on that event (it allocates, or looks the current pool up) must not wait
//! for the choice its own thread is making.
//!
//! The mode is chosen once per process, so the check runs in a child process of its own, killed if
//! it does not end.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cumem_core::{Device, DeviceBuffer, Stream};
use cumem_pool::{CachingResource, PoolConfig};
use cumem_sys::testing::{self, OnEvent, event_message};
use tracing::Event;

const CHILD: &str = "CUMEM_TEST_FENCE_MODE_LOGGING_CHILD";

/// The child's half: the process's first pool, with a subscriber that allocates from a second pool
/// inside the fence-mode event.
#[test]
fn fence_mode_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let allocated = Arc::new(AtomicBool::new(false));
    let subscriber = {
        let (ctx, allocated) = (ctx.clone(), allocated.clone());
        OnEvent(move |event: &Event<'_>| {
            if event_message(event) == "thread-cache fence mode" && !allocated.swap(true, Ordering::SeqCst) {
                let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
                let stream = Stream::new(&ctx).unwrap();
                let buf = DeviceBuffer::<u32>::from_slice_in(&pool, &stream, &[7; 64]).unwrap();
                assert_eq!(buf.to_vec().unwrap(), [7; 64]);
            }
        })
    };
    cumem_sys::testing::with_subscriber(subscriber, || {
        let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
        let stream = Stream::new(&ctx).unwrap();
        let buf = DeviceBuffer::<u32>::from_slice_in(&pool, &stream, &[5; 64]).unwrap();
        assert_eq!(buf.to_vec().unwrap(), [5; 64]);
    });
    assert!(allocated.load(Ordering::SeqCst), "the fence mode was not logged");
    drop(ctx);
    if let Some(ctl) = testing::sim_control() {
        assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
        let live = ctl.live_report();
        assert!(live.is_clean(), "{live}");
    }
}

#[test]
fn a_subscriber_that_allocates_inside_the_fence_mode_event_does_not_hang() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    testing::init();
    let child = testing::child_process::run_child_test(
        "fence_mode_child",
        &[(CHILD, "1")],
        &[],
        Duration::from_secs(30),
    );
    let (status, log) = (child.status, child.log);
    assert!(
        status.is_some(),
        "the first pool hung: the subscriber's pool waited for the fence-mode choice\n{log}"
    );
    assert!(status.unwrap().success(), "{log}");
    assert!(log.contains("1 passed"), "the child ran no test:\n{log}");
    if let Some(ctl) = testing::sim_control() {
        let live = ctl.live_report();
        assert!(live.is_clean(), "{live}");
    }
}
