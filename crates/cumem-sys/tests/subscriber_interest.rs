//! A test's subscriber sees its events even when another thread reaches their call site first,
//! while that subscriber is the only one the process has registered: tracing then caches the call
//! site's interest from the other thread's default (none, so "never"), unless
//! [`with_subscriber`] is how the test installed its subscriber. One test in this binary, so that
//! nothing else registers a subscriber first.

use std::sync::{Arc, Barrier, Mutex};

use cumem_sys::testing::{OnEvent, event_message, with_subscriber};

/// One call site, reached from both threads.
fn probe(n: u32) {
    tracing::warn!("probe {n}");
}

#[test]
fn a_subscriber_sees_a_call_site_another_thread_reached_first() {
    cumem_sys::testing::init();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let installed = Arc::new(Barrier::new(2));
    let reached = Arc::new(Barrier::new(2));
    let other = {
        let (installed, reached) = (installed.clone(), reached.clone());
        std::thread::spawn(move || {
            installed.wait();
            probe(1);
            reached.wait();
        })
    };
    let log = seen.clone();
    let subscriber = OnEvent(move |e: &tracing::Event<'_>| log.lock().unwrap().push(event_message(e)));
    with_subscriber(subscriber, || {
        installed.wait();
        reached.wait();
        probe(2);
    });
    other.join().unwrap();
    assert_eq!(*seen.lock().unwrap(), ["probe 2"], "the call site was cached as unwanted");
}
