//! Work queued through an exclusive borrow of a `DeviceBuffer` (`&mut buf`, or one sub-view of
//! it) skips the lock of the buffer's stream order; the halves of a split, which two threads may
//! use at once, keep it. Both must order the work exactly as before: a stream held back by a gate
//! shows whether later work on another stream, and the host, waited for it.
//!
//! The gated tests are `#[serial]` and the others `#[parallel]`: see `common` for why.

mod common;

use std::sync::Barrier;
use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::{DeviceBuffer, Error, PinnedBuffer, Stream};
use serial_test::{parallel, serial};

#[test]
#[serial] // holds a gate
fn a_memset_through_an_exclusive_borrow_waits_for_a_copy_on_another_stream() {
    let ctx = common::ctx();
    let (a, b) = common::two_streams(&ctx);
    let src = PinnedBuffer::from_slice(&ctx, &[5u8; 4096]).unwrap();
    let mut buf = DeviceBuffer::<u8>::zeroed(&a, 4096).unwrap();
    a.synchronize().unwrap();
    // Waited for on both streams, not the buffer's order: the order could only tell what it was
    // told.
    common::with_a_held(&a, &b, || {
        a.copy_h2d(&src, &mut buf).unwrap(); // held back on `a`
        // Through `&mut buf` (no lock): `b` must wait for the copy, or the copy lands last.
        b.memset_d8(&mut buf, 9).unwrap();
        // Through one exclusive sub-view (no lock either), on `b` again: ordered after the memset.
        b.memset_d8(&mut buf.slice_mut(..16).unwrap(), 7).unwrap();
    });
    let data = buf.to_vec().unwrap();
    assert_eq!(data[..16], [7; 16], "the sub-view's memset ran before the copy on a");
    assert!(data[16..].iter().all(|&v| v == 9), "the memset on b ran before the copy on a");
}

#[test]
#[serial] // holds a gate
fn a_copy_on_another_stream_waits_for_work_queued_through_an_exclusive_borrow() {
    let ctx = common::ctx();
    let (a, b) = common::two_streams(&ctx);
    // Made on `b`, so that only the exclusive path's record can tell `b` about the work on `a`.
    let data = common::seen_on_b_after_held_work_on_a(&ctx, &a, &b, |buf| {
        a.fill(buf, 5u32).unwrap(); // `&mut DeviceBuffer`: no lock
    });
    assert!(data.iter().all(|&v| v == 5), "the copy on b ran before the fill through &mut buf on a");
}

#[test]
#[serial] // holds a gate
fn halves_used_from_two_threads_on_two_streams_are_both_waited_for_by_the_host() {
    let ctx = common::ctx();
    let (a, b) = common::two_streams(&ctx);
    let left_src = PinnedBuffer::from_slice(&ctx, &[3u32; 512]).unwrap();
    let mut buf = DeviceBuffer::<u32>::zeroed(&b, 1024).unwrap();
    b.synchronize().unwrap();
    let barrier = Barrier::new(2);
    let gate = common::hold(&a);
    {
        // The halves share the order: each records its stream under the order's lock, so
        // neither record is lost when both are queued at once.
        let (mut left, mut right) = buf.split_at_mut(512).unwrap();
        std::thread::scope(|scope| {
            let one = scope.spawn(|| {
                barrier.wait();
                a.copy_h2d(&left_src, &mut left) // held back on `a`
            });
            barrier.wait();
            b.fill(&mut right, 4u32).unwrap();
            one.join().unwrap().unwrap();
        });
    }
    let opener = gate.release_after(Duration::from_millis(100));
    let data = buf.to_vec().unwrap(); // must wait for both streams
    opener.join().unwrap();
    assert!(data[..512].iter().all(|&v| v == 3), "the host read did not wait for the half on a");
    assert!(data[512..].iter().all(|&v| v == 4), "the host read did not wait for the half on b");
}

#[test]
#[parallel]
fn the_exclusive_path_refuses_as_the_locked_one() {
    let ctx = common::ctx();
    let s = Stream::non_blocking(&ctx).unwrap();
    let mut buf = DeviceBuffer::<u32>::from_slice(&s, &[1, 2, 3]).unwrap();
    let other = DeviceBuffer::<u32>::from_slice(&s, &[4, 5, 6]).unwrap();
    // Inside another memory's closure: refused, though the exclusive path itself takes no lock.
    let inside = other.as_slice().queue_on(&s, |_| Ok(s.memset_d8(&mut buf, 0)));
    assert!(matches!(inside, Ok(Err(Error::NotPermitted { .. }))), "{inside:?}");
    // Other cumem memory inside the exclusive path's own closure: refused.
    let used = buf.as_mut_slice().queue_on(&s, |_| Ok(other.to_vec()));
    assert!(matches!(used, Ok(Err(Error::NotPermitted { .. }))), "{used:?}");
    // A closure that fails may have queued something: its stream is recorded all the same.
    let t = Stream::non_blocking(&ctx).unwrap();
    let failed: Result<(), Error> =
        buf.as_mut_slice().queue_on(&t, |_| Err(Error::ZeroSize { what: "test" }));
    assert!(matches!(failed, Err(Error::ZeroSize { .. })));
    assert_eq!(buf.order().last().unwrap(), t);
    assert_eq!((buf.to_vec().unwrap(), other.to_vec().unwrap()), (vec![1, 2, 3], vec![4, 5, 6]));
}

#[test]
#[serial] // holds a gate
fn a_device_copy_into_an_exclusive_borrow_waits_for_earlier_work_on_it() {
    let ctx = common::ctx();
    let (a, b) = common::two_streams(&ctx);
    let src = DeviceBuffer::<u32>::from_slice(&b, &[8; 1024]).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&a, 1024).unwrap();
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    common::with_a_held(&a, &b, || {
        a.fill(&mut dst, 1u32).unwrap(); // held back on `a`
        b.copy_d2d(&src, &mut dst).unwrap(); // `&mut dst`: no lock; must wait for the fill
    });
    assert!(dst.to_vec().unwrap().iter().all(|&v| v == 8), "the copy on b ran before the fill on a");
}

#[test]
#[serial] // holds a gate
fn a_device_copy_waits_for_earlier_writes_of_its_source() {
    let ctx = common::ctx();
    let (a, b) = common::two_streams(&ctx);
    let mut src = DeviceBuffer::<u32>::zeroed(&b, 1024).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&b, 1024).unwrap();
    b.synchronize().unwrap();
    common::with_a_held(&a, &b, || {
        a.fill(&mut src, 8u32).unwrap(); // held back on `a`
        b.copy_d2d(&src, &mut dst).unwrap(); // only the source's guard tells `b` about `a`
    });
    assert!(
        dst.to_vec().unwrap().iter().all(|&v| v == 8),
        "the copy on b read the source before the fill on a"
    );
}

#[test]
#[serial] // holds a gate
fn a_device_copy_between_the_halves_of_one_buffer_is_queued_in_order() {
    let ctx = common::ctx();
    let (a, b) = common::two_streams(&ctx);
    let mut buf = DeviceBuffer::<u32>::zeroed(&b, 1024).unwrap();
    b.synchronize().unwrap();
    let gate = common::hold(&a);
    a.fill(&mut buf.slice_mut(..512).unwrap(), 6u32).unwrap(); // one sub-view: no lock; held back
    {
        // The source's guard and the destination's scoped door share one order: the guard holds
        // no lock, so the door is not refused.
        let (left, mut right) = buf.split_at_mut(512).unwrap();
        b.copy_d2d(&left, &mut right).unwrap(); // must wait for the fill on `a`
    }
    let opener = gate.release_after(Duration::from_millis(100));
    let data = buf.to_vec().unwrap(); // waits for both streams
    opener.join().unwrap();
    assert!(data.iter().all(|&v| v == 6), "the copy on b read the source before the fill on a");
}
