//! The one door for device work cumem does not queue itself (`view.on(&stream)`): a raw driver
//! call stands in for a kernel, queued through the guard on a stream held back by a host function;
//! a later copy on another stream must see its result, so it was made to wait for that stream.
//!
//! The gated test is `#[serial]` and the others `#[parallel]`: see `common` for why.

mod common;

use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::sys::{self, CUresult};
use cumem_core::{Device, DeviceBuffer, Error, PinnedBuffer, Stream};
use cumem_sys::testing;
use serial_test::{parallel, serial};

fn ctx() -> cumem_core::Context {
    testing::init();
    Device::get(0).unwrap().context().unwrap()
}

#[test]
#[serial] // holds a gate
fn work_queued_through_the_door_orders_later_users_on_other_streams() {
    let ctx = ctx();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    // Made on `b`, so that only the door can tell `b` about the work on `a`.
    let mut buf = DeviceBuffer::<u32>::zeroed(&b, 1024).unwrap();
    b.synchronize().unwrap();
    let mut seen = PinnedBuffer::<u32>::zeroed(&ctx, 1024).unwrap();
    let gate = common::hold(&a);
    {
        let on = buf.on_mut(&a).unwrap();
        assert_eq!((on.len(), on.bytes(), on.stream()), (1024, 4096, &a));
        ctx.bind().unwrap();
        // SAFETY: the range is the guard's (1024 u32s), queued on the guard's stream while it lives.
        let code = unsafe { sys::cuMemsetD32Async(on.device_ptr(), 5, on.len(), on.stream().raw()) };
        assert_eq!(code, CUresult::CUDA_SUCCESS);
    } // the buffer's later users now wait for `a`, whose memset is still held back
    b.copy_d2h(&buf, &mut seen).unwrap(); // on `b`: must wait for `a`
    let opener = gate.release_after(Duration::from_millis(100));
    let data = seen.as_slice().unwrap().to_vec(); // waits for `b`, hence for `a`
    opener.join().unwrap();
    assert!(data.iter().all(|&v| v == 5), "the copy on b ran before the work queued through the door on a");
}

#[test]
#[serial] // holds a gate
fn a_shared_guard_orders_its_stream_after_earlier_writes() {
    let ctx = ctx();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
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
    let ctx = ctx();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let mut buf = DeviceBuffer::<u32>::zeroed(&b, 1024).unwrap();
    b.synchronize().unwrap();
    let mut seen = PinnedBuffer::<u32>::zeroed(&ctx, 1024).unwrap();
    let gate = common::hold(&a);
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
    b.copy_d2h(&buf, &mut seen).unwrap(); // on `b`: must wait for `a`
    let opener = gate.release_after(Duration::from_millis(100));
    let data = seen.as_slice().unwrap().to_vec();
    opener.join().unwrap();
    assert!(data.iter().all(|&v| v == 5), "the copy on b ran before the work queued through the scoped door");
}

#[test]
#[parallel]
fn the_scoped_door_refuses_the_same_memory_inside_and_records_a_failed_queue() {
    let ctx = ctx();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
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
    let ctx = ctx();
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
