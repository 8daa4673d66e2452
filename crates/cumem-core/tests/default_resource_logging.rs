//! A device's first allocation makes its default resource; what that logs (here: a pool named by
//! `CUMEM_ALLOCATOR` in a program without `cumem-pool`, or an unknown allocator) reaches a subscriber that may itself look
//! a current resource up, and must not wait for a lock its own thread holds.
//!
//! Each warning is logged once per process, so the check runs in a child process of its own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cumem_core::{Device, DeviceBuffer, Stream};
use cumem_sys::testing;
use tracing::Event;

const CHILD: &str = "CUMEM_TEST_DEFAULT_LOGGING_CHILD";

/// The child's half: the first allocation of device 0, with the subscriber above.
#[test]
fn logging_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    testing::init();
    // Looks device 0's current resource up inside the first warning, as a subscriber that reports
    // memory use might.
    let looked_up = std::sync::Arc::new(AtomicBool::new(false));
    let seen = looked_up.clone();
    let subscriber = testing::OnEvent(move |event: &Event<'_>| {
        if *event.metadata().level() == tracing::Level::WARN && !seen.swap(true, Ordering::SeqCst) {
            let device = Device::get(0).unwrap();
            cumem_core::current_resource(&device).unwrap();
        }
    });
    cumem_sys::testing::with_subscriber(subscriber, || {
        let ctx = Device::get(0).unwrap().context().unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let buf = DeviceBuffer::from_slice(&stream, &[5u32; 64]).unwrap();
        assert_eq!(buf.to_vec().unwrap(), [5; 64]);
    });
    assert!(looked_up.load(Ordering::SeqCst), "no warning was logged");
}

#[test]
fn a_subscriber_that_looks_up_a_resource_inside_the_pool_not_linked_warning_does_not_hang() {
    if std::env::var_os(CHILD).is_none() {
        run_child("caching");
    }
}

#[test]
fn a_subscriber_that_looks_up_a_resource_inside_the_unknown_allocator_warning_does_not_hang() {
    if std::env::var_os(CHILD).is_none() {
        run_child("bogus");
    }
}

/// Runs [`logging_child`] with `CUMEM_ALLOCATOR` set to `allocator`.
fn run_child(allocator: &str) {
    testing::init();
    let child = testing::child_process::run_child_test(
        "logging_child",
        &[(CHILD, "1"), (cumem_core::ALLOCATOR_ENV, allocator)],
        &[],
        Duration::from_secs(30),
    );
    let log = child.log;
    assert!(
        child.status.is_some(),
        "the first allocation hung: the subscriber waited for the registry's lock\n{log}"
    );
    assert!(child.status.unwrap().success(), "{log}");
    assert!(log.contains("1 passed"), "the child ran no test:\n{log}");
}
