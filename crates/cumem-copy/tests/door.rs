//! The one door for device work cumem does not queue itself (`view.on(&stream)`): a raw driver
//! call stands in for a kernel, queued through the guard on a stream held back by a host function;
//! a later copy on another stream must see its result, so it was made to wait for that stream.
//!
//! The gated test is `#[serial]` and the others `#[parallel]`: see `common` for why.

mod common;

use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::sys::{self, CUresult};
use cumem_core::{
    Device, DeviceBuffer, Error, HostAccess, HostRegistered, MappedBuffer, PinnedBuffer, Stream,
};
use cumem_sys::testing;
use cumem_sys::testing::within_watchdog;
use serial_test::{parallel, serial};

#[test]
#[serial] // holds a gate
fn work_queued_through_the_door_orders_later_users_on_other_streams() {
    let ctx = common::ctx();
    let (a, b) = common::two_streams(&ctx);
    // Made on `b`, so that only the door can tell `b` about the work on `a`.
    let data = common::seen_on_b_after_held_work_on_a(&ctx, &a, &b, |buf| {
        let on = buf.on_mut(&a).unwrap();
        assert_eq!((on.len(), on.bytes(), on.stream()), (1024, 4096, &a));
        ctx.bind().unwrap();
        // SAFETY: the range is the guard's (1024 u32s), queued on the guard's stream while it lives.
        let code = unsafe { sys::cuMemsetD32Async(on.device_ptr(), 5, on.len(), on.stream().raw()) };
        assert_eq!(code, CUresult::CUDA_SUCCESS);
    }); // the buffer's later users waited for `a`, whose memset was held back
    assert!(data.iter().all(|&v| v == 5), "the copy on b ran before the work queued through the door on a");
}

/// Queues a memset of 5s on `a` through the door of `buf` and forgets the guard instead of
/// dropping it: its stream is never recorded as a user, only kept as pending.
fn memset_through_a_forgotten_guard(ctx: &cumem_core::Context, buf: &mut DeviceBuffer<u32>, a: &Stream) {
    let on = buf.on_mut(a).unwrap();
    ctx.bind().unwrap();
    // SAFETY: the range is the guard's, queued on the guard's stream while it lives (it is
    // forgotten, never dropped, so it lives on as far as the order can tell).
    let code = unsafe { sys::cuMemsetD32Async(on.device_ptr(), 5, on.len(), on.stream().raw()) };
    assert_eq!(code, CUresult::CUDA_SUCCESS);
    std::mem::forget(on);
}

#[test]
#[serial] // holds a gate
fn a_write_through_an_exclusive_borrow_waits_for_a_forgotten_guards_stream() {
    let ctx = common::ctx();
    let (a, b) = common::two_streams(&ctx);
    // Made on `b`, so that only the forgotten guard's pending stream can tell `b` about `a`.
    let mut buf = DeviceBuffer::<u32>::zeroed(&b, 1024).unwrap();
    b.synchronize().unwrap();
    common::with_a_held(&a, &b, || {
        memset_through_a_forgotten_guard(&ctx, &mut buf, &a); // held back on `a`
        b.memset_d8(&mut buf, 9).unwrap(); // `&mut buf`: no lock; must wait for `a`
    });
    let data = buf.to_vec().unwrap();
    assert!(
        data.iter().all(|&v| v == 0x0909_0909),
        "the memset on b ran before the work of the forgotten guard on a"
    );
}

#[test]
#[serial] // holds a gate
fn a_read_through_the_locked_door_waits_for_a_forgotten_guards_stream() {
    let ctx = common::ctx();
    let (a, b) = common::two_streams(&ctx);
    // The copy on `b` takes a shared view: the locked door.
    let data = common::seen_on_b_after_held_work_on_a(&ctx, &a, &b, |buf| {
        memset_through_a_forgotten_guard(&ctx, buf, &a);
    });
    assert!(data.iter().all(|&v| v == 5), "the copy on b ran before the work of the forgotten guard on a");
}

#[test]
#[serial] // holds a gate
fn a_shared_guard_orders_its_stream_after_earlier_writes() {
    let ctx = common::ctx();
    let (a, b) = common::two_streams(&ctx);
    let mut buf = DeviceBuffer::<u32>::zeroed(&a, 256).unwrap();
    let mut out = PinnedBuffer::<u32>::zeroed(&ctx, 256).unwrap();
    let host = out.as_mut_slice().unwrap().as_mut_ptr();
    let gate = common::hold(&a);
    a.fill(&mut buf, 9u32).unwrap(); // held back
    {
        let on = buf.on(&b).unwrap(); // b now waits for the fill on a
        ctx.bind().unwrap();
        // SAFETY: the source is the guard's range, read on the guard's stream; `host` is the pinned
        // buffer, which nothing touches until `b` is synchronised below.
        let code =
            unsafe { sys::cuMemcpyDtoHAsync_v2(host.cast(), on.device_ptr(), on.bytes(), on.stream().raw()) };
        assert_eq!(code, CUresult::CUDA_SUCCESS);
    }
    let opener = gate.release_after(Duration::from_millis(100));
    b.synchronize().unwrap();
    opener.join().unwrap();
    assert_eq!(out.as_slice().unwrap(), &[9; 256][..], "the read on b ran before the fill on a");
    assert_eq!(buf.to_vec().unwrap(), vec![9; 256]);
}

#[test]
#[serial] // holds a gate
fn work_queued_through_the_scoped_door_orders_later_users_on_other_streams() {
    let ctx = common::ctx();
    let (a, b) = common::two_streams(&ctx);
    let data = common::seen_on_b_after_held_work_on_a(&ctx, &a, &b, |buf| {
        let mut view = buf.as_mut_slice();
        let len = view.len();
        view.queue_on(&a, |ptr| {
            ctx.bind()?;
            // SAFETY: the range is the view's (1024 u32s), queued on the stream ordered for it.
            let code = unsafe { sys::cuMemsetD32Async(ptr, 5, len, a.raw()) };
            assert_eq!(code, CUresult::CUDA_SUCCESS);
            Ok(())
        })
        .unwrap(); // the buffer's later users now wait for `a`, whose memset is still held back
    });
    assert!(data.iter().all(|&v| v == 5), "the copy on b ran before the work queued through the scoped door");
}

#[test]
#[parallel]
fn the_scoped_door_refuses_the_same_memory_inside_and_records_a_failed_queue() {
    let ctx = common::ctx();
    let (a, b) = common::two_streams(&ctx);
    let buf = DeviceBuffer::<u32>::from_slice(&a, &[1, 2, 3]).unwrap();
    let view = buf.as_slice();
    // Using the memory again inside would wait for itself: refused, and the outer use goes on.
    let inside = view.queue_on(&b, |_| Ok(view.to_vec()));
    assert!(matches!(inside, Ok(Err(Error::NotPermitted { .. }))), "{inside:?}");
    assert_eq!(buf.order().last().unwrap(), b);
    // A closure that fails may have queued something first: its stream is recorded all the same.
    let failed: Result<(), Error> = view.queue_on(&a, |_| Err(Error::ZeroSize { what: "test" }));
    assert!(matches!(failed, Err(Error::ZeroSize { .. })));
    assert_eq!(buf.order().last().unwrap(), a);
    assert_eq!(buf.to_vec().unwrap(), [1, 2, 3]);
    let other_thread = std::thread::scope(|s| s.spawn(|| view.to_vec()).join().unwrap());
    assert_eq!(other_thread.unwrap(), [1, 2, 3]);
}

#[test]
#[parallel]
fn the_door_refuses_a_stream_of_another_device() {
    let ctx = common::ctx();
    if !testing::needs_devices(2) {
        return;
    }
    let other = Stream::non_blocking(&Device::get(1).unwrap().context().unwrap()).unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let mut buf = DeviceBuffer::<u8>::zeroed(&s, 16).unwrap();
    assert!(matches!(buf.on(&other), Err(Error::WrongDevice { expected: 0, actual: 1 })));
    assert!(matches!(buf.on_mut(&other), Err(Error::WrongDevice { expected: 0, actual: 1 })));
    assert_eq!(buf.to_vec().unwrap(), vec![0; 16]);
}

#[test]
#[parallel]
fn the_scoped_door_refuses_other_cumem_memory_inside() {
    let ctx = common::ctx();
    let s = Stream::non_blocking(&ctx).unwrap();
    let a = DeviceBuffer::<u32>::from_slice(&s, &[1, 2, 3]).unwrap();
    let b = DeviceBuffer::<u32>::from_slice(&s, &[4, 5, 6]).unwrap();
    let mut pinned = PinnedBuffer::<u32>::zeroed(&ctx, 3).unwrap();
    let view = a.as_slice();
    // Waiting for another memory's lock inside could deadlock with a thread copying the other way
    // (it holds that lock and waits for `a`'s order): refused on the spot, whoever holds it.
    let copy = view.queue_on(&s, |_| Ok(s.copy_d2h(&b, &mut pinned)));
    assert!(matches!(copy, Ok(Err(Error::NotPermitted { .. }))), "{copy:?}");
    let read = view.queue_on(&s, |_| Ok(pinned.as_slice().map(<[u32]>::to_vec)));
    assert!(matches!(read, Ok(Err(Error::NotPermitted { .. }))), "{read:?}");
    let door = view.queue_on(&s, |_| Ok(b.on(&s).map(|on| on.len())));
    assert!(matches!(door, Ok(Err(Error::NotPermitted { .. }))), "{door:?}");
    // Outside a closure everything works again.
    s.copy_d2h(&b, &mut pinned).unwrap();
    assert_eq!(pinned.as_slice().unwrap(), &[4, 5, 6][..]);
    assert_eq!(a.to_vec().unwrap(), [1, 2, 3]);
}

#[test]
#[parallel]
fn crossing_copies_whose_closures_use_the_other_memory_do_not_deadlock() {
    let ctx = common::ctx();
    let (s, t) = common::two_streams(&ctx);
    let a = DeviceBuffer::<u32>::from_slice(&s, &[1; 64]).unwrap();
    let b = DeviceBuffer::<u32>::from_slice(&s, &[2; 64]).unwrap();
    s.synchronize().unwrap();
    let barrier = std::sync::Barrier::new(2);
    // Each thread locks one order and, inside, uses the other: without the refusal both would wait
    // for each other forever once both are inside.
    let cross = |mine: &DeviceBuffer<u32>, other: &DeviceBuffer<u32>, stream: &Stream| {
        let mut host = PinnedBuffer::<u32>::zeroed(&ctx, 64).unwrap();
        let inside = mine.as_slice().queue_on(stream, |_| {
            barrier.wait();
            Ok(stream.copy_d2h(other, &mut host))
        });
        assert!(matches!(inside, Ok(Err(Error::NotPermitted { .. }))), "{inside:?}");
    };
    std::thread::scope(|scope| {
        let one = scope.spawn(|| cross(&a, &b, &s));
        cross(&b, &a, &t);
        one.join().unwrap();
    });
    assert_eq!((a.to_vec().unwrap(), b.to_vec().unwrap()), (vec![1; 64], vec![2; 64]));
}

#[test]
#[serial] // holds a gate
fn a_closure_that_unwinds_after_queueing_a_copy_leaves_the_host_waiting_for_it() {
    let ctx = common::ctx();
    let s = Stream::non_blocking(&ctx).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&s, 256).unwrap();
    let mut src = PinnedBuffer::<u32>::zeroed(&ctx, 256).unwrap();
    src.as_mut_slice().unwrap().fill(1);
    s.synchronize().unwrap();
    let gate = common::hold(&s);
    let unwound: std::thread::Result<Result<(), Error>> =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let enqueue = |from: *const u32, len: usize| {
                dst.as_mut_slice().queue_on(&s, |to| {
                    ctx.bind()?;
                    // SAFETY: `from` is the pinned buffer's 256 values, kept unwritten by its tracker
                    // until the copy completes; `to` is the view's 256 values, ordered on `s`.
                    let code = unsafe { sys::cuMemcpyHtoDAsync_v2(to, from.cast(), len * 4, s.raw()) };
                    assert_eq!(code, CUresult::CUDA_SUCCESS);
                    panic!("after queueing the copy");
                })
            };
            // SAFETY: `enqueue` queues one copy on `s` reading the 256 values it is given.
            unsafe { src.device_read(&s, enqueue) }
        }));
    assert!(unwound.is_err());
    let opener = gate.release_after(Duration::from_millis(100));
    // The host write must wait for the held copy, which would otherwise read the new values.
    src.as_mut_slice().unwrap().fill(9);
    opener.join().unwrap();
    assert_eq!(dst.to_vec().unwrap(), vec![1; 256], "the host wrote the source before the copy read it");
}

#[test]
#[parallel]
fn guards_of_other_memory_dropped_inside_crossing_closures_do_not_deadlock() {
    within_watchdog("two closures each dropping a guard of the other's memory", || {
        let ctx = common::ctx();
        let (s, t) = common::two_streams(&ctx);
        let a = DeviceBuffer::<u32>::from_slice(&s, &[1; 64]).unwrap();
        let b = DeviceBuffer::<u32>::from_slice(&s, &[2; 64]).unwrap();
        s.synchronize().unwrap();
        let barrier = std::sync::Barrier::new(2);
        // Each thread holds a guard of the other memory and drops it inside its own closure, once
        // both closures hold their orders: a drop that waited for the other order's lock would
        // wait for a thread that waits for this one. (Both guards are taken before either closure
        // starts, as taking one waits for a closure holding its order.)
        let cross = |mine: &DeviceBuffer<u32>, other: &DeviceBuffer<u32>, stream: &Stream| {
            let guard = other.on(stream).unwrap();
            barrier.wait();
            mine.as_slice()
                .queue_on(stream, |_| {
                    barrier.wait();
                    drop(guard);
                    Ok(())
                })
                .unwrap();
        };
        std::thread::scope(|scope| {
            let one = scope.spawn(|| cross(&a, &b, &s));
            cross(&b, &a, &t);
            one.join().unwrap();
        });
        // The dropped guards were recorded all the same: each memory has both streams as users
        // (a lost drop would leave one).
        assert_eq!((a.order().users().unwrap(), b.order().users().unwrap()), (2, 2));
        assert_eq!((a.to_vec().unwrap(), b.to_vec().unwrap()), (vec![1; 64], vec![2; 64]));
    });
}

#[test]
#[parallel]
fn a_view_of_mapped_memory_taken_inside_a_closure_does_not_wait_for_its_tracker() {
    within_watchdog(
        "a mapped view taken inside a closure while a copy from it waits for that closure",
        || {
            let ctx = common::ctx();
            let (s, t) = common::two_streams(&ctx);
            let mapped = MappedBuffer::from_slice(&ctx, &[7u32; 64]).unwrap();
            let mut dst = DeviceBuffer::<u32>::zeroed(&s, 128).unwrap();
            s.synchronize().unwrap();
            let barrier = std::sync::Barrier::new(2);
            {
                let (mut left, mut right) = dst.split_at_mut(64).unwrap();
                std::thread::scope(|scope| {
                    let inside = scope.spawn(|| {
                        left.queue_on(&s, |_| {
                            barrier.wait();
                            // Lets the other thread lock the mapped buffer's tracker (the copy's host
                            // side) and wait for this order (its device side) before the view asks
                            // the tracker; the test passes whatever the interleaving.
                            std::thread::sleep(Duration::from_millis(100));
                            Ok(mapped.as_device_slice().len())
                        })
                    });
                    barrier.wait();
                    t.copy_h2d(&mapped, &mut right).unwrap();
                    assert_eq!(inside.join().unwrap().unwrap(), 64);
                });
            }
            assert_eq!(dst.to_vec().unwrap(), [vec![0; 64], vec![7; 64]].concat());
        },
    );
}

#[test]
#[parallel]
fn a_host_tracker_asked_whether_idle_inside_a_closure_does_not_wait_for_its_lock() {
    within_watchdog("is_idle inside a closure while a tracked read waits for that closure", || {
        let ctx = common::ctx();
        let (s, t) = common::two_streams(&ctx);
        let mut dst = DeviceBuffer::<u32>::zeroed(&s, 128).unwrap();
        s.synchronize().unwrap();
        let host = [0u32; 64];
        let access = HostAccess::new();
        let barrier = std::sync::Barrier::new(2);
        let (mut left, mut right) = dst.split_at_mut(64).unwrap();
        std::thread::scope(|scope| {
            let inside = scope.spawn(|| {
                left.queue_on(&s, |_| {
                    barrier.wait();
                    // As above: lets the other thread hold the tracker's lock and wait for this
                    // order first.
                    std::thread::sleep(Duration::from_millis(100));
                    Ok(access.is_idle())
                })
            });
            barrier.wait();
            let enqueue = |_: *const u32, _| right.queue_on(&t, |_| Ok(()));
            // SAFETY: `enqueue` queues nothing, so it reads nothing; `host` outlives the tracker.
            unsafe { access.device_read(&t, host.as_ptr(), host.len(), enqueue).unwrap() };
            inside.join().unwrap().unwrap();
        });
        // Exclusive: a shared wait keeps the tracker's first read stream (`t`) tracked.
        let mut access = access;
        access.wait_idle_mut().unwrap();
        assert!(access.is_idle());
    });
}

#[test]
#[parallel]
fn a_pitched_buffer_dropped_inside_a_closure_returns_its_memory() {
    within_watchdog("a pitched buffer dropped inside a closure", || {
        let ctx = common::ctx();
        let Some(ctl) = testing::sim_control() else {
            return testing::skip("reads the live report: simulator only");
        };
        let s = Stream::non_blocking(&ctx).unwrap();
        let buf = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
        // From the driver, so that its free shows in the live report at once (no cache between).
        let driver = std::sync::Arc::new(cumem_core::DriverResource::new(&ctx));
        let pitched = cumem_copy::PitchedBuffer::<u32>::zeroed_in(&driver, &s, 16, 4).unwrap();
        let id = ctl.live_report().id_of(pitched.device_ptr()).expect("live");
        // The drop has exclusive access to its order, so it needs no lock, which a closure refuses.
        buf.as_slice()
            .queue_on(&s, |_| {
                drop(pitched);
                Ok(())
            })
            .unwrap();
        s.synchronize().unwrap();
        let live = ctl.live_report();
        assert!(!live.contains_allocation(id), "leaked instead of freed:\n{live}");
    });
}

#[test]
#[serial] // holds a gate
fn host_memory_written_inside_a_closure_waits_for_its_copies_without_a_lock() {
    let ctx = common::ctx();
    let (s, t) = common::two_streams(&ctx);
    let buf = DeviceBuffer::<u32>::zeroed(&s, 16).unwrap();
    let src = DeviceBuffer::from_slice(&t, &[7u32; 64]).unwrap();
    let mut pinned = PinnedBuffer::<u32>::zeroed(&ctx, 64).unwrap();
    let mut mapped = MappedBuffer::<u32>::zeroed(&ctx, 64).unwrap();
    let gate = common::hold(&t);
    t.copy_d2h(&src, &mut pinned).unwrap(); // tracked by stream
    t.copy_d2h(&src, &mut mapped).unwrap(); // tracked by the mapped buffer's stream order
    let opener = gate.release_after(Duration::from_millis(100));
    // `&mut` proves nothing else reaches the trackers: waiting needs no lock, which a closure
    // refuses, and the borrows see the copies' values once the gate opens.
    let seen = buf
        .as_slice()
        .queue_on(&s, |_| {
            let p = pinned.as_mut_slice()?.to_vec();
            let m = mapped.as_mut_slice()?.to_vec();
            Ok((p, m))
        })
        .unwrap();
    opener.join().unwrap();
    assert_eq!(seen, (vec![7; 64], vec![7; 64]));
}

#[test]
#[parallel]
fn host_memory_dropped_inside_a_closure_is_freed_not_leaked() {
    within_watchdog("host memory dropped inside a closure", || {
        let ctx = common::ctx();
        let Some(ctl) = testing::sim_control() else {
            return testing::skip("reads the live report: simulator only");
        };
        let (s, t) = common::two_streams(&ctx);
        let buf = DeviceBuffer::<u32>::zeroed(&s, 16).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(&t, 64).unwrap();
        let pinned = PinnedBuffer::from_slice(&ctx, &[3u32; 64]).unwrap();
        let mapped = MappedBuffer::from_slice(&ctx, &[4u32; 64]).unwrap();
        t.copy_h2d(&pinned, &mut dst).unwrap(); // a pending read of the pinned buffer
        t.copy_d2d(&mapped.as_device_slice(), &mut dst).unwrap(); // and of the mapped one
        let before = ctl.live_report();
        let [p, m] = [pinned.as_ptr(), mapped.as_ptr()].map(|ptr| before.id_of(ptr as u64).expect("live"));
        buf.as_slice()
            .queue_on(&s, |_| {
                drop(pinned);
                drop(mapped);
                Ok(())
            })
            .unwrap();
        let live = ctl.live_report();
        assert!(
            !live.contains_allocation(p) && !live.contains_allocation(m),
            "leaked instead of freed:\n{live}"
        );
        assert_eq!(dst.to_vec().unwrap(), [4; 64]);
    });
}

#[test]
#[parallel]
fn a_registration_scoped_inside_a_closure_answers_what_its_body_answered() {
    within_watchdog("a registration scoped inside a closure", || {
        let ctx = common::ctx();
        let s = Stream::non_blocking(&ctx).unwrap();
        let buf = DeviceBuffer::<u8>::zeroed(&s, 16).unwrap();
        let mut v = vec![0u8; 4096];
        let base = v.as_ptr() as u64;
        let got = buf
            .as_slice()
            .queue_on(&s, |_| {
                HostRegistered::scope(&ctx, &mut v, |reg| {
                    reg.as_mut_slice()?[0] = 9;
                    Ok(reg.len())
                })
            })
            .unwrap();
        assert_eq!((got, v[0]), (4096, 9));
        if let Some(ctl) = testing::sim_control() {
            assert!(!ctl.live_report().contains_registration(base), "still registered");
        }
    });
}
