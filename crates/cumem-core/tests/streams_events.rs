//! Streams and events: creation, ordering, waiting and timing.

use cumem_core::{Device, DeviceBuffer, Error, Event, Stream, StreamOptions};
use cumem_sys::testing;

fn ctx() -> cumem_core::Context {
    testing::init();
    Device::get(0).unwrap().context().unwrap()
}

#[test]
#[serial_test::parallel]
fn streams_are_created_with_their_options() {
    let ctx = ctx();
    let blocking = Stream::new(&ctx).unwrap();
    let free = Stream::non_blocking(&ctx).unwrap();
    let (_, greatest) = ctx.stream_priority_range().unwrap();
    let urgent =
        Stream::with_options(&ctx, StreamOptions { non_blocking: true, priority: greatest }).unwrap();
    assert!(!blocking.options().non_blocking && free.options().non_blocking);
    assert_eq!(urgent.options().priority, greatest);
    assert!(!blocking.raw().is_null() && !blocking.is_legacy());
    assert_ne!(blocking, free);
    assert_eq!(blocking.clone(), blocking);
    assert_eq!(Stream::legacy(&ctx), ctx.default_stream());
    assert_eq!(blocking.context(), &ctx);
    assert!(format!("{urgent:?}").contains("non_blocking: true"));
    ctx.default_stream().synchronize().unwrap();
    // Only streams this test owns: other tests queue work on the shared legacy stream meanwhile.
    for s in [&blocking, &free, &urgent] {
        s.synchronize().unwrap();
        assert!(s.query().unwrap());
    }
}

#[test]
#[serial_test::parallel]
fn dropping_a_stream_destroys_it() {
    let ctx = ctx();
    let s = Stream::new(&ctx).unwrap();
    let raw = s.raw() as u64;
    let clone = s.clone();
    drop(s);
    if let Some(ctl) = testing::sim_control() {
        assert!(
            ctl.live_report().streams.iter().any(|st| st.handle == raw),
            "a clone still holds the stream"
        );
        drop(clone);
        assert!(!ctl.live_report().streams.iter().any(|st| st.handle == raw));
    }
}

#[test]
#[serial_test::parallel]
fn events_record_query_and_synchronize() {
    let ctx = ctx();
    let stream = Stream::new(&ctx).unwrap();
    let mut e = Event::new(&ctx).unwrap();
    assert!(e.query().unwrap(), "a never-recorded event is complete");
    let _buf = DeviceBuffer::<u8>::zeroed(&stream, 1 << 20).unwrap();
    e.record(&stream).unwrap();
    e.synchronize().unwrap();
    assert!(e.query().unwrap());
    assert_eq!(e.context(), &ctx);
    assert!(!e.raw().is_null());
    assert!(format!("{e:?}").contains("timed: false"));
}

#[test]
#[serial_test::parallel]
fn elapsed_time_needs_timed_recorded_events() {
    let ctx = ctx();
    let stream = Stream::new(&ctx).unwrap();
    let (mut start, mut end) = (Event::timed(&ctx).unwrap(), Event::timed(&ctx).unwrap());
    start.record(&stream).unwrap();
    let _buf = DeviceBuffer::<u8>::zeroed(&stream, 1 << 20).unwrap();
    end.record(&stream).unwrap();
    end.synchronize().unwrap();
    let d = end.elapsed_since(&start).unwrap();
    assert!(d.as_secs_f64() >= 0.0 && d.as_secs_f64() < 60.0);
    let mut untimed = Event::new(&ctx).unwrap();
    untimed.record(&stream).unwrap();
    assert!(matches!(end.elapsed_since(&untimed), Err(Error::InvalidHandle { .. })));
    let never = Event::timed(&ctx).unwrap();
    assert!(matches!(end.elapsed_since(&never), Err(Error::InvalidHandle { .. })));
}

#[test]
#[serial_test::parallel]
fn recording_on_another_devices_stream_is_wrong_device() {
    let ctx = ctx();
    if !testing::needs_devices(2) {
        return;
    }
    let other = Device::get(1).unwrap().context().unwrap();
    let mut e = Event::new(&ctx).unwrap();
    let s = Stream::new(&other).unwrap();
    assert!(matches!(e.record(&s), Err(Error::WrongDevice { expected: 0, actual: 1 })));
}

#[test]
#[serial_test::parallel]
fn wait_orders_one_stream_after_another() {
    let ctx = ctx();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let data: Vec<u32> = (0..(1 << 16)).collect();
    let buf = DeviceBuffer::from_slice(&a, &data).unwrap();
    let done = a.record().unwrap();
    b.wait(&done).unwrap();
    b.wait_for(&a).unwrap();
    b.wait_for(&b).unwrap(); // waiting for itself is a no-op
    b.synchronize().unwrap();
    assert!(done.query().unwrap(), "b finished, so the event it waited for has too");
    assert_eq!(buf.to_vec().unwrap(), data);
}

#[test]
#[serial_test::parallel]
fn a_refusal_of_device_work_names_the_memorys_device_not_the_streams() {
    testing::init();
    if !testing::needs_devices(2) {
        return;
    }
    let (mem_dev, other) = (Device::get(0).unwrap(), Device::get(1).unwrap());
    let home = Stream::non_blocking(&mem_dev.context().unwrap()).unwrap();
    let away = Stream::non_blocking(&other.context().unwrap()).unwrap();
    // Memory of device 0 whose host reads exclude device work, refused during a scoped read.
    let access = cumem_core::HostAccess::with_exclusive_order(&home);
    let refused = access.read_scoped(|| access.order().unwrap().use_on(&away).map(drop)).unwrap();
    match refused {
        Err(Error::NotSupported { feature: cumem_core::Feature::ConcurrentManagedAccess, device }) => {
            assert_eq!(device, Some(mem_dev.ordinal() as i32));
        }
        other => panic!("expected a refusal naming device 0, got {other:?}"),
    }
}

/// A cache keeps a stream's tail, not the stream: the stream is destroyed when the program drops
/// it, and the event its drop recorded still stands for its work, which another stream can wait
/// for through the tail.
#[test]
#[serial_test::serial] // holds a gate
fn a_dropped_stream_s_tail_stands_for_its_work() {
    use std::time::Duration;
    let ctx = ctx();
    let a = Stream::non_blocking(&ctx).unwrap();
    let b = Stream::non_blocking(&ctx).unwrap();
    let tail = a.tail().clone();
    assert_eq!((tail.id(), tail.is_alive(), tail.is_legacy()), (a.id(), true, false));
    assert!(tail.retired().is_none(), "a live stream has no retired event");
    let raw = a.raw() as u64;
    ctx.bind().unwrap();
    // SAFETY: `a` is alive and its context current.
    let gate = unsafe { testing::hold(a.raw()) };
    // Opened from another thread: dropping `a` below may wait for its work on a real driver.
    let opener = gate.release_after(Duration::from_millis(200));
    drop(a);
    assert!(!tail.is_alive());
    if let Some(ctl) = testing::sim_control() {
        assert!(!ctl.live_report().streams.iter().any(|s| s.handle == raw), "the tail kept the stream alive");
    }
    let retired = tail.retired().expect("the drop of a stream whose tail is shared records an event");
    let ticket = tail.after_work().unwrap().expect("a dropped stream's work is its retired event");
    assert!(std::sync::Arc::ptr_eq(&retired, &ticket));
    b.wait(&ticket).unwrap();
    tail.wait(&ticket).unwrap(); // a dropped stream takes no more work: nothing to order
    tail.synchronize().unwrap(); // returns once the gate opened and `a`'s work ran
    assert!(retired.query().unwrap());
    opener.join().unwrap();
    b.synchronize().unwrap();
    // The legacy stream's tail never dies.
    let legacy = ctx.default_stream();
    let legacy_tail = legacy.tail().clone();
    drop(legacy);
    assert!(legacy_tail.is_alive() && legacy_tail.is_legacy());
}

/// A simulator fault that fails the next call of `function` on this thread, once.
fn fail_next_on_this_thread(function: &str) -> cumem_sys::sim_control::FaultRule {
    fail_nth_on_this_thread(function, 1)
}

/// Fails the `nth` next call of `function` on this thread (`CUDA_ERROR_UNKNOWN`).
fn fail_nth_on_this_thread(function: &str, nth: u64) -> cumem_sys::sim_control::FaultRule {
    cumem_sys::sim_control::FaultRule {
        this_thread_only: true,
        ..cumem_sys::sim_control::FaultRule::nth_call(
            function,
            nth,
            cumem_sys::sys::CUresult::CUDA_ERROR_UNKNOWN,
        )
    }
}

/// A stream's drop logs with its tail unlocked: a subscriber that asks the tail something from
/// the warning of a failed retired event gets an answer (the stream already gone) instead of
/// waiting for the drop that called it.
#[test]
#[serial_test::serial] // injects faults on this thread only, but keeps the fault counts simple
fn a_stream_drop_warns_with_its_tail_unlocked() {
    let ctx = ctx();
    if testing::sim_control().is_none() {
        return testing::skip("injects driver faults: simulator only");
    }
    testing::within_watchdog("a subscriber asking the tail from a stream drop's warning", move || {
        let ctl = testing::sim_control().unwrap();
        let a = Stream::non_blocking(&ctx).unwrap();
        let tail = a.tail().clone();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (asked, noted) = (tail.clone(), seen.clone());
        let subscriber = testing::OnEvent(move |e: &tracing::Event<'_>| {
            let message = testing::event_message(e);
            if message.contains("dropped stream") {
                noted.lock().unwrap().push((message, asked.is_alive()));
            }
        });
        let rule = ctl.inject_fault(fail_next_on_this_thread("cuEventRecord"));
        cumem_sys::testing::with_subscriber(subscriber, || drop(a));
        ctl.remove_fault(rule);
        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            seen,
            [("recording a dropped stream's last event failed; synchronising it".to_string(), false)]
        );
        // The drop synchronised the stream instead: nothing of it is pending.
        assert!(tail.retired().is_none());
        tail.synchronize().unwrap();
    });
}

/// `StreamTail::synchronize` waits with the tail unlocked: while it waits for a held stream,
/// another thread can still ask the tail whether the stream lives.
#[test]
#[serial_test::serial] // holds a gate
fn a_tail_s_synchronize_waits_with_the_tail_unlocked() {
    use std::time::Duration;
    let ctx = ctx();
    let a = Stream::non_blocking(&ctx).unwrap();
    let tail = a.tail().clone();
    ctx.bind().unwrap();
    // SAFETY: `a` is alive and its context current.
    let gate = unsafe { testing::hold(a.raw()) };
    let waiter = {
        let tail = tail.clone();
        std::thread::spawn(move || tail.synchronize())
    };
    // Time for the waiter to reach its wait (were it holding the lock, the check below hangs).
    std::thread::sleep(Duration::from_millis(200));
    let asked = tail.clone();
    testing::within_watchdog("asking a tail whether it lives while it is being synchronised", move || {
        assert!(asked.is_alive());
    });
    assert!(!waiter.is_finished(), "the waiter returned while the stream was held");
    gate.release();
    waiter.join().unwrap().unwrap();
    drop(a);
}

/// A tail's record that the driver holds back (`cuEventCreate`/`cuEventRecord` wait while another
/// thread's `cuMemFree` waits for a held stream: §17 of the driver brief) leaves the tail
/// unlocked: another thread can still ask whether the stream lives.
#[test]
#[serial_test::serial] // holds a gate
fn a_tail_s_record_held_back_by_the_driver_leaves_the_tail_unlocked() {
    use std::time::Duration;
    let ctx = ctx();
    let a = Stream::non_blocking(&ctx).unwrap();
    let tail = a.tail().clone();
    let held = Stream::non_blocking(&ctx).unwrap();
    let driver = std::sync::Arc::new(cumem_core::DriverResource::new(&ctx));
    let buffer = DeviceBuffer::<u8>::new_in(&driver, &a, 4096).unwrap();
    ctx.bind().unwrap();
    // SAFETY: `held` is alive and its context current.
    let gate = unsafe { testing::hold(held.raw()) };
    // Its `cuMemFree` waits for the held stream, and holds the device meanwhile.
    let freeing = std::thread::spawn(move || drop(buffer));
    std::thread::sleep(Duration::from_millis(200));
    let recording = {
        let tail = tail.clone();
        std::thread::spawn(move || tail.after_work().map(|event| event.is_some()))
    };
    std::thread::sleep(Duration::from_millis(200));
    let asked = tail.clone();
    testing::within_watchdog("asking a tail whether it lives while its record is held back", move || {
        assert!(asked.is_alive());
    });
    assert!(!recording.is_finished(), "the record returned while the device was held");
    gate.release();
    freeing.join().unwrap();
    assert!(recording.join().unwrap().unwrap(), "a live stream's tail records an event");
    drop(a);
}

/// A stream whose last handle an order lets go of (its user covered by a later one) is destroyed
/// with the order unlocked and cumem locks refused on the thread: a subscriber that asks the
/// order something from the destroyed stream's warning is answered (refused) instead of waiting
/// for the thread that holds the order.
#[test]
#[serial_test::serial] // injects faults on this thread only, but keeps the fault counts simple
fn an_order_destroys_the_streams_it_lets_go_of_unlocked() {
    let ctx = ctx();
    if testing::sim_control().is_none() {
        return testing::skip("injects driver faults: simulator only");
    }
    testing::within_watchdog("a subscriber asking an order from a dropped user's warning", move || {
        let ctl = testing::sim_control().unwrap();
        let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
        // A shared tail makes the drop record a retired event, which is made to fail and warn.
        let tail = a.tail().clone();
        let order = std::sync::Arc::new(cumem_core::StreamOrder::new(&a));
        drop(a); // the order holds a's last handle
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (asked, noted) = (order.clone(), seen.clone());
        let subscriber = testing::OnEvent(move |e: &tracing::Event<'_>| {
            let message = testing::event_message(e);
            if message.contains("dropped stream") {
                // Answered at once: refused (a caller may hold another cumem lock around the
                // order's, e.g. a host tracker's), not left waiting for this thread.
                let refused = matches!(asked.users(), Err(Error::NotPermitted { .. }));
                // Another thread is not refused: its answer shows the order is unlocked.
                let elsewhere = std::thread::scope(|s| s.spawn(|| asked.users().ok()).join().unwrap());
                noted.lock().unwrap().push((message, refused, elsewhere));
            }
        });
        let ticket = order.use_on(&b).unwrap(); // b waits for a
        let rule = ctl.inject_fault(fail_next_on_this_thread("cuEventRecord"));
        // Recording b covers a: the order lets go of a, its last handle.
        cumem_sys::testing::with_subscriber(subscriber, || drop(ticket));
        ctl.remove_fault(rule);
        assert!(!tail.is_alive(), "a was destroyed");
        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            seen,
            [("recording a dropped stream's last event failed; synchronising it".to_string(), true, Some(1))]
        );
        assert_eq!(order.join().unwrap(), b);
    });
}

/// As above, with a host tracker's lock held around the order's closure (a copy from pinned memory
/// does that): the stream the order lets go of is destroyed while cumem locks are still refused on
/// this thread, so a subscriber that asks the tracker from the stream's warning is refused instead
/// of waiting for the lock its own thread holds.
#[test]
#[serial_test::serial] // injects faults on this thread only, but keeps the fault counts simple
fn a_stream_let_go_of_inside_a_tracked_copy_is_destroyed_while_locks_are_refused() {
    use std::sync::{Arc, Mutex};
    static DATA: [u8; 16] = [3; 16];
    let ctx = ctx();
    if testing::sim_control().is_none() {
        return testing::skip("injects driver faults: simulator only");
    }
    testing::within_watchdog(
        "a subscriber asking a host tracker from a dropped stream's warning",
        move || {
            let ctl = testing::sim_control().unwrap();
            let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
            let tail = a.tail().clone();
            let order = cumem_core::StreamOrder::new(&a);
            drop(a); // the order holds a's last handle
            let access = Arc::new(cumem_core::HostAccess::new());
            let seen = Arc::new(Mutex::new(Vec::new()));
            let (asked, noted) = (access.clone(), seen.clone());
            let subscriber = testing::OnEvent(move |e: &tracing::Event<'_>| {
                if testing::event_message(e).contains("dropped stream") {
                    let refused = matches!(asked.wait_writes(), Err(Error::NotPermitted { .. }));
                    noted.lock().unwrap().push(refused);
                }
            });
            // The first record on this thread is a's marker (b waits for it); the second, a's retired
            // event when the order lets go of a, fails and warns.
            let rule = ctl.inject_fault(fail_nth_on_this_thread("cuEventRecord", 2));
            cumem_sys::testing::with_subscriber(subscriber, || {
                // SAFETY: `DATA` lives forever and the closure queues nothing.
                unsafe {
                    access.device_read(&b, DATA.as_ptr(), DATA.len(), |_, _| order.queue_on(&b, || Ok(())))
                }
            })
            .unwrap();
            ctl.remove_fault(rule);
            assert!(!tail.is_alive(), "a was destroyed");
            assert_eq!(*seen.lock().unwrap(), [true], "the subscriber was refused, once");
            access.wait_writes().unwrap();
        },
    );
}

/// As above, through a ticket: a tracker that orders device work through a stream order (mapped
/// memory's does) holds its lock while the ticket's drop lets go of the stream.
#[test]
#[serial_test::serial] // injects faults on this thread only, but keeps the fault counts simple
fn a_stream_let_go_of_by_a_ticket_inside_a_tracked_read_is_destroyed_while_locks_are_refused() {
    use std::sync::{Arc, Mutex};
    static DATA: [u8; 16] = [5; 16];
    let ctx = ctx();
    if testing::sim_control().is_none() {
        return testing::skip("injects driver faults: simulator only");
    }
    testing::within_watchdog(
        "a subscriber reading through a tracker from a dropped stream's warning",
        move || {
            let ctl = testing::sim_control().unwrap();
            let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
            let tail = a.tail().clone();
            let access = Arc::new(cumem_core::HostAccess::with_order(&a));
            drop(a); // the tracker's order holds a's last handle
            let seen = Arc::new(Mutex::new(Vec::new()));
            let (asked, noted, on) = (access.clone(), seen.clone(), b.clone());
            let subscriber = testing::OnEvent(move |e: &tracing::Event<'_>| {
                if testing::event_message(e).contains("dropped stream") {
                    // SAFETY: `DATA` lives forever and the closure queues nothing.
                    let read = unsafe { asked.device_read(&on, DATA.as_ptr(), DATA.len(), |_, _| Ok(())) };
                    noted.lock().unwrap().push(matches!(read, Err(Error::NotPermitted { .. })));
                }
            });
            // The first record on this thread is a's marker (b waits for it); the second, a's retired
            // event when the ticket's drop lets go of a, fails and warns.
            let rule = ctl.inject_fault(fail_nth_on_this_thread("cuEventRecord", 2));
            cumem_sys::testing::with_subscriber(subscriber, || {
                // SAFETY: `DATA` lives forever and the closure queues nothing.
                unsafe { access.device_read(&b, DATA.as_ptr(), DATA.len(), |_, _| Ok(())) }
            })
            .unwrap();
            ctl.remove_fault(rule);
            assert!(!tail.is_alive(), "a was destroyed");
            assert_eq!(*seen.lock().unwrap(), [true], "the subscriber was refused, once");
        },
    );
}

/// A host wait through `&self` lets go of the streams it forgot as the tracker's other paths do:
/// the handle it waited on is the stream's last once the tracker forgot it, and the stream is
/// destroyed with cumem locks refused (a subscriber of its warning that asks another tracker is
/// refused), as after an exclusive wait.
#[test]
#[serial_test::serial] // injects faults on this thread only, but keeps the fault counts simple
fn a_stream_a_shared_host_wait_forgets_is_destroyed_while_locks_are_refused() {
    use std::sync::{Arc, Mutex};
    let ctx = ctx();
    if testing::sim_control().is_none() {
        return testing::skip("injects driver faults: simulator only");
    }
    testing::within_watchdog(
        "a subscriber asking a host tracker from a dropped stream's warning",
        move || {
            let ctl = testing::sim_control().unwrap();
            let a = Stream::non_blocking(&ctx).unwrap();
            let tail = a.tail().clone();
            let mut data = [0u8; 16];
            let mut access = cumem_core::HostAccess::new();
            // SAFETY: `data` outlives the tracker's use (waited below) and the closure queues nothing.
            unsafe { access.device_write(&a, data.as_mut_ptr(), data.len(), |_, _| Ok(())).unwrap() };
            drop(a); // the tracker holds a's last handle
            let other = Arc::new(cumem_core::HostAccess::new());
            let seen = Arc::new(Mutex::new(Vec::new()));
            let (asked, noted) = (other.clone(), seen.clone());
            let subscriber = testing::OnEvent(move |e: &tracing::Event<'_>| {
                if testing::event_message(e).contains("dropped stream") {
                    let refused = matches!(asked.wait_writes(), Err(Error::NotPermitted { .. }));
                    noted.lock().unwrap().push(refused);
                }
            });
            // The wait records nothing; the first record on this thread is a's retired event when
            // the last handle goes, which fails and warns.
            let rule = ctl.inject_fault(fail_nth_on_this_thread("cuEventRecord", 1));
            cumem_sys::testing::with_subscriber(subscriber, || access.wait_writes()).unwrap();
            ctl.remove_fault(rule);
            assert!(!tail.is_alive(), "a was destroyed");
            assert_eq!(*seen.lock().unwrap(), [true], "the subscriber was refused, once");
            assert!(access.is_idle());
        },
    );
}

/// A host wait does not keep the tracker locked: while `wait_idle` waits for a held read stream,
/// another thread tracks a new read on that same stream; that read, queued after the wait began,
/// is still tracked once the wait returns.
#[test]
#[serial_test::serial] // holds a gate
fn a_host_wait_leaves_the_tracker_unlocked_and_keeps_reads_queued_meanwhile() {
    use std::sync::Arc;
    use std::time::Duration;
    /// The memory the device "reads" (the closures queue nothing).
    static DATA: [u8; 16] = [7; 16];
    let ctx = ctx();
    let (q, r) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let access = Arc::new(cumem_core::HostAccess::new());
    // The tracker's first read stream is tracked without the lock from then on and never
    // forgotten by a shared wait; `q` takes that place, so that `r` is tracked by number.
    // SAFETY: `DATA` lives forever and the closures queue nothing.
    unsafe { access.device_read(&q, DATA.as_ptr(), DATA.len(), |_, _| Ok(())).unwrap() };
    // SAFETY: as above.
    unsafe { access.device_read(&r, DATA.as_ptr(), DATA.len(), |_, _| Ok(())).unwrap() };
    ctx.bind().unwrap();
    // SAFETY: `r` is alive and its context current. Longer than the watchdog: were the tracker
    // locked, the read below must not be let through by the gate opening on its own.
    let gate = unsafe { testing::hold_for(r.raw(), 2 * testing::DEADLOCK_WATCHDOG) };
    let waiter = {
        let access = access.clone();
        std::thread::spawn(move || access.wait_idle())
    };
    // Time for the waiter to reach its wait (were it holding the lock, the read below hangs).
    std::thread::sleep(Duration::from_millis(200));
    let (reader, stream) = (access.clone(), r.clone());
    testing::within_watchdog("tracking a read while a host wait waits", move || {
        // SAFETY: as above.
        unsafe { reader.device_read(&stream, DATA.as_ptr(), DATA.len(), |_, _| Ok(())).unwrap() };
    });
    assert!(!waiter.is_finished(), "the wait returned while the read stream was held");
    gate.release();
    waiter.join().unwrap().unwrap();
    assert!(!r.is_unique(), "the read tracked during the wait was forgotten");
    access.wait_idle().unwrap();
    assert!(r.is_unique(), "a shared wait forgets a read stream it saw complete");
    assert!(!q.is_unique(), "the first read stream stays tracked past a shared wait");
    let mut access = Arc::into_inner(access).expect("the other handles are gone");
    access.wait_idle_mut().unwrap();
    assert!(access.is_idle() && q.is_unique(), "an exclusive wait forgets every stream");
}

/// A stream whose drop could neither record its retired event nor synchronise it leaves a tail
/// that says so: `after_work` and `synchronize` fail with the synchronisation's error, rather
/// than claiming that nothing of the stream is pending.
#[test]
#[serial_test::serial] // injects faults on this thread only, but keeps the fault counts simple
fn a_tail_whose_stream_could_not_be_retired_fails() {
    let ctx = ctx();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let a = Stream::non_blocking(&ctx).unwrap();
    let tail = a.tail().clone();
    let record = ctl.inject_fault(fail_next_on_this_thread("cuEventRecord"));
    let sync = ctl.inject_fault(fail_next_on_this_thread("cuStreamSynchronize"));
    drop(a);
    ctl.remove_fault(record);
    ctl.remove_fault(sync);
    assert!(!tail.is_alive() && tail.retired().is_none());
    for _ in 0..2 {
        let err = tail.after_work().map(drop).expect_err("nothing stands for the dropped stream's work");
        assert_eq!(err.code(), Some(cumem_sys::sys::CUresult::CUDA_ERROR_UNKNOWN), "{err}");
        assert!(err.to_string().contains("cuStreamSynchronize"), "{err}");
    }
    // A synchronisation of the context covers the work: nothing is pending afterwards.
    let ctx_syncs = ctl.inject_fault(fail_next_on_this_thread("cuCtxSynchronize"));
    let err = tail.synchronize().expect_err("the context's synchronisation failed");
    assert!(err.to_string().contains("cuCtxSynchronize"), "{err}");
    ctl.remove_fault(ctx_syncs);
    assert!(tail.after_work().is_err(), "a failed wait cleared nothing");
    tail.synchronize().unwrap();
    assert!(tail.after_work().unwrap().is_none());
    // Nothing to order: the stream takes no more work.
    let b = Stream::non_blocking(&ctx).unwrap();
    tail.wait(&b.record().unwrap()).unwrap();
}
