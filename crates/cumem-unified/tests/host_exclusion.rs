//! Host access to managed memory versus device work on it (issue 7, items 5 and 8): on a device
//! without concurrent managed access the host must not read a buffer that device work uses, reads
//! included (the real driver faults the host; the simulator protects the pages the same way), so a
//! shared host borrow refuses device work through shared views until an exclusive access ends it;
//! on a device with concurrent access host reads and device reads overlap as with pinned memory.
//! And attachments the driver refuses are refused first.

use std::process::Command;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_copy::{Copy2D, Pitched};
use cumem_core::{Context, Device, DeviceBuffer, Error, Feature, Stream};
use cumem_sys::testing;
use cumem_sys::testing::Gate;
use cumem_unified::{Attach, UnifiedBuffer};

/// Device 1 has managed memory without concurrent access (like Windows/WSL or pre-Pascal GPUs).
/// Streams start work 5 ms late, so work queued just before a host read is still pending.
const SIM: &str = "devices=2,latency_us=5000,dev1.concurrent_managed_access=0";

/// A managed-memory device with (`true`) or without concurrent managed access.
fn device(concurrent: bool) -> Option<(Device, Context, Stream)> {
    testing::init_with(SIM);
    let Some(d) = Device::all().unwrap().into_iter().find(|d| {
        let c = d.capabilities().unwrap();
        c.managed_memory && c.concurrent_managed_access == concurrent
    }) else {
        testing::skip(format_args!("needs a managed-memory device with concurrent access {concurrent}"));
        return None;
    };
    let ctx = d.context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    Some((d, ctx, stream))
}

fn pattern(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i + 7).wrapping_mul(2_654_435_761)).collect()
}

/// What the simulator logged as misuse on this thread (nothing on a real driver).
fn misuse_here() -> Vec<String> {
    testing::sim_control().map_or_else(Vec::new, |ctl| {
        ctl.violations_on_this_thread().into_iter().map(|v| v.to_string()).collect()
    })
}

fn refused_on(e: &Error, device: Device) -> bool {
    matches!(e, Error::NotSupported { feature: Feature::ConcurrentManagedAccess, device: Some(d) } if *d == device.ordinal() as i32)
}

/// Runs `body` in a child process (this test binary, filtered to `name`), so that a host access
/// the simulator faults (as the real driver does) kills the child and fails this test, not the
/// whole binary.
fn in_child(name: &str, body: impl FnOnce()) {
    const CHILD: &str = "CUMEM_HOST_EXCLUSION_CHILD";
    if std::env::var(CHILD).as_deref() == Ok(name) {
        body();
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--test-threads=1", "--nocapture"])
        .env(CHILD, name)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the child running {name} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("1 passed"), "the child ran no test: {stdout}");
}

/// Holds `stream` here: work queued on it from now on does not start until the gate opens.
/// Declare the gate after the buffers it holds work for. The calling test must be `#[serial]`
/// (checked): see [`Gate`] for why.
fn hold(stream: &Stream) -> Gate {
    assert!(
        serial_test::is_locked_serially(None),
        "a test that holds a stream must be #[serial] (see cumem_sys::testing::Gate)"
    );
    stream.context().bind().unwrap();
    // SAFETY: `stream` is alive (borrowed), and its context was just made current.
    unsafe { testing::hold(stream.raw()) }
}

/// Runs `body` on another thread and fails the test if it has not returned within 20 s: what it
/// tests would otherwise hang the test binary.
fn without_hanging<R: Send + 'static>(what: &str, body: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let _ = tx.send(body());
    });
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(out) => {
            worker.join().unwrap();
            out
        }
        Err(RecvTimeoutError::Timeout) => panic!("{what} hung"),
        Err(RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(worker.join().expect_err("the worker sent nothing"))
        }
    }
}

#[test]
#[serial_test::serial] // holds a gate
fn without_concurrent_access_a_host_read_refuses_device_reads_through_shared_views() {
    in_child("without_concurrent_access_a_host_read_refuses_device_reads_through_shared_views", || {
        let Some((device, _, stream)) = device(false) else { return };
        let data = pattern(4096);
        // Attached to the host: the only attachment whose host borrows outlive a call there.
        let mut buf = UnifiedBuffer::from_slice_attached(&stream, &data, Attach::Host).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 4096).unwrap();
        {
            let view = buf.as_device_slice();
            let host = buf.as_slice().unwrap();
            let gate = hold(&stream);
            // Queued, this copy would read the pages while the host reads them below: the real
            // driver faults the host there, and so does the simulator.
            let queued = stream.copy_d2d(&view, &mut dst);
            assert_eq!(host, &data[..]);
            gate.release();
            assert!(queued.as_ref().is_err_and(|e| refused_on(e, device)), "{queued:?}");
            // The blocking form too (after the gate: a copy of managed memory is synchronous).
            let blocking = cumem_copy::copy_d2d(&view, &mut dst);
            assert!(blocking.as_ref().is_err_and(|e| refused_on(e, device)), "{blocking:?}");
            assert_eq!(host, &data[..]);
        }
        // Attached to the host, the memory takes no device work at all (the driver's rule without
        // concurrent managed access), borrowed by the host or not.
        buf.end_host_reads();
        let still = stream.copy_d2d(&buf, &mut dst);
        assert!(still.as_ref().is_err_and(|e| refused_on(e, device)), "{still:?}");
        // Attached to the stream, it takes that stream's work (`attach` is an exclusive access).
        buf.attach(&stream, Attach::Single(stream.clone())).unwrap();
        stream.copy_d2d(&buf, &mut dst).unwrap();
        assert_eq!(dst.to_vec().unwrap(), data);
        // A copy to a Vec ends its host read (and its host attachment) when it returns.
        assert_eq!(buf.to_vec().unwrap(), data);
        let mut again = DeviceBuffer::<u32>::zeroed(&stream, 4096).unwrap();
        stream.copy_d2d(&buf, &mut again).unwrap();
        assert_eq!(again.to_vec().unwrap(), data);
        stream.memset_d32(&mut buf, 5).unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![5; 4096]);
        assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    });
}

#[test]
#[serial_test::parallel]
fn without_concurrent_access_a_host_read_waits_for_device_reads_before_the_host_attachment() {
    in_child(
        "without_concurrent_access_a_host_read_waits_for_device_reads_before_the_host_attachment",
        || {
            let Some((_, _, stream)) = device(false) else { return };
            let data = pattern(1 << 16);
            // Attached to the stream: its work may read the memory (no other stream's may).
            let mut buf = UnifiedBuffer::from_slice(&stream, &data).unwrap();
            buf.attach(&stream, Attach::Single(stream.clone())).unwrap();
            let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 1 << 16).unwrap();
            // A device read, still queued (5 ms of latency) when the host reads below.
            stream.copy_d2d(&buf, &mut dst).unwrap();
            // Attached to the host behind it: the attachment rules alone ask for no wait before host
            // access, but the read queued before must have completed.
            buf.attach(&stream, Attach::Host).unwrap();
            assert_eq!(buf.as_slice().unwrap(), &data[..]);
            assert_eq!(dst.to_vec().unwrap(), data);
            assert!(misuse_here().is_empty(), "{:?}", misuse_here());
        },
    );
}

#[test]
#[serial_test::parallel]
fn with_concurrent_access_host_reads_and_device_reads_overlap() {
    let Some((_, _, stream)) = device(true) else { return };
    let data = pattern(4096);
    let buf = UnifiedBuffer::from_slice(&stream, &data).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 4096).unwrap();
    let view = buf.as_device_slice();
    let host = buf.as_slice().unwrap();
    stream.copy_d2d(&view, &mut dst).unwrap();
    assert_eq!(host, &data[..]);
    assert_eq!(dst.to_vec().unwrap(), data);
}

#[test]
#[serial_test::parallel]
fn attaching_a_single_legacy_stream_is_refused_before_the_driver() {
    for concurrent in [true, false] {
        let Some((_, ctx, stream)) = device(concurrent) else { continue };
        let mut buf = UnifiedBuffer::from_slice(&stream, &[1u16, 2, 3]).unwrap();
        let legacy = Stream::legacy(&ctx);
        match buf.attach(&legacy, Attach::Single(legacy.clone())) {
            Err(Error::InvalidValue { .. }) => {}
            other => panic!("expected InvalidValue, got {other:?}"),
        }
        assert_eq!(buf.attachment(), &Attach::Global, "a refused attachment changes nothing");
        assert!(misuse_here().is_empty(), "reached the driver as misuse: {:?}", misuse_here());
        // The legacy stream may still take the other attachments.
        buf.attach(&legacy, Attach::Host).unwrap();
        assert_eq!(buf.to_vec().unwrap(), [1, 2, 3]);
    }
}

#[test]
#[serial_test::parallel]
fn without_concurrent_access_a_host_read_while_a_ticket_is_held_is_refused_not_waited_for() {
    let Some((device, ctx, stream)) = device(false) else { return };
    let refused = without_hanging("a host read while this thread holds a ticket", move || {
        let data = pattern(1024);
        // Attached to the stream, whose work alone may use it (memory attached to the host takes
        // no ticket at all).
        let mut buf = UnifiedBuffer::from_slice(&stream, &data).unwrap();
        buf.attach(&stream, Attach::Single(stream.clone())).unwrap();
        let vec = {
            let view = buf.as_device_slice();
            // Work is being queued (by this very thread): waiting for it would wait forever.
            let _ticket = view.order().use_on(&stream).unwrap();
            buf.to_vec()
        };
        // The refusal changed nothing: device work is still allowed, and host reads work again.
        let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 1024).unwrap();
        stream.copy_d2d(&buf, &mut dst).unwrap();
        assert_eq!(buf.to_vec().unwrap(), data);
        stream.copy_d2d(&buf, &mut dst).unwrap();
        assert_eq!(dst.to_vec().unwrap(), data);
        // A ticket never dropped keeps refusing host reads, without hanging them, until the
        // owner's exclusive access proves it gone (its work was queued before its borrow ended).
        for _ in 0..3 {
            std::mem::forget(buf.as_device_slice().order().use_on(&stream).unwrap());
        }
        let forgotten = buf.to_vec();
        buf.with_host_slice_mut(|v| v[0] = 7).unwrap();
        let mut expected = data.clone();
        expected[0] = 7;
        assert_eq!(buf.to_vec().unwrap(), expected);
        // The legacy stream is not the attached stream: its tickets are refused.
        let legacy = buf.as_device_slice().order().use_on(&Stream::legacy(&ctx)).map(drop);
        (vec, forgotten, legacy)
    });
    let (vec, vec_after_forget, legacy) = refused;
    assert!(vec.as_ref().is_err_and(|e| refused_on(e, device)), "{vec:?}");
    assert!(vec_after_forget.as_ref().is_err_and(|e| refused_on(e, device)), "{vec_after_forget:?}");
    assert!(legacy.as_ref().is_err_and(|e| refused_on(e, device)), "{legacy:?}");
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

#[test]
#[serial_test::parallel]
fn a_refused_or_panicking_scoped_read_leaves_no_exclusion_behind() {
    let Some((_, _, stream)) = device(false) else { return };
    let data = pattern(1024);
    let buf = UnifiedBuffer::from_slice(&stream, &data).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 1024).unwrap();
    // A closure that panics inside a scoped read (as `to_vec` runs one) ends its exclusion.
    let access = cumem_core::HostAccess::with_exclusive_order(&stream);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        access.read_scoped(|| panic!("the read failed")).unwrap();
    }));
    assert!(panicked.is_err());
    let order = access.order().unwrap();
    drop(order.use_on(&stream).expect("the panicked read ended its exclusion"));
    // A scoped read refused while a ticket is held begins no exclusion, so ends none: another
    // scoped read's exclusion stays in place.
    let ticket = order.use_on(&stream).unwrap();
    assert!(access.read_scoped(|| ()).is_err());
    drop(ticket);
    access
        .read_scoped(|| {
            assert!(order.use_on(&stream).is_err(), "device work is refused during a scoped read");
        })
        .unwrap();
    drop(order.use_on(&stream).unwrap());
    stream.copy_d2d(&buf, &mut dst).unwrap();
    assert_eq!(dst.to_vec().unwrap(), data);
}

#[test]
#[serial_test::serial] // holds a gate
fn without_concurrent_access_a_blocking_copy_from_a_shared_host_slice_is_refused() {
    in_child("without_concurrent_access_a_blocking_copy_from_a_shared_host_slice_is_refused", || {
        let Some((device, ctx, stream)) = device(false) else { return };
        let data = pattern(4096);
        let buf = UnifiedBuffer::from_slice_attached(&stream, &data, Attach::Host).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 4096).unwrap();
        let host = buf.as_slice().unwrap();
        let legacy = Stream::legacy(&ctx);
        let gate = hold(&legacy);
        let copied = std::thread::scope(|scope| {
            let copier = scope.spawn(|| cumem_copy::copy_h2d(host, &mut dst));
            std::thread::sleep(Duration::from_millis(100));
            // Had the copy been queued (behind the gate), the device would own the memory now and
            // this read would fault, on the real driver as on the simulator.
            assert_eq!(host, &data[..]);
            gate.release();
            copier.join().unwrap()
        });
        assert!(copied.as_ref().is_err_and(|e| refused_on(e, device)), "{copied:?}");
        // Every other blocking copy that takes a plain host slice refuses it too.
        let from = DeviceBuffer::from_slice(&stream, host);
        assert!(from.as_ref().is_err_and(|e| refused_on(e, device)), "{from:?}");
        let two_d = cumem_copy::copy_2d(
            &Pitched::new(host, 64),
            &mut Pitched::new(dst.as_mut_slice(), 64),
            Copy2D::new(64, 64),
        );
        assert!(two_d.as_ref().is_err_and(|e| refused_on(e, device)), "{two_d:?}");
        let mut out = UnifiedBuffer::<u32>::zeroed_attached(&stream, 4096, Attach::Host).unwrap();
        let back = cumem_copy::copy_d2h(&dst, out.as_mut_slice().unwrap());
        assert!(back.as_ref().is_err_and(|e| refused_on(e, device)), "{back:?}");
        assert_eq!(host, &data[..]);
        assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    });
}

#[test]
#[serial_test::serial] // holds a gate
fn with_concurrent_access_a_blocking_copy_from_a_managed_slice_completes_before_returning() {
    let Some((_, ctx, stream)) = device(true) else { return };
    let data = pattern(4096);
    let mut buf = UnifiedBuffer::from_slice(&stream, &data).unwrap();
    // The destinations were last used on `held`, so each copy is ordered after the gate below.
    let held = Stream::non_blocking(&ctx).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&held, 4096).unwrap();
    let mut pitched = DeviceBuffer::<u32>::zeroed(&held, 4096).unwrap();
    held.synchronize().unwrap();
    for copy in 0..2 {
        buf.as_mut_slice().unwrap().copy_from_slice(&data);
        let gate = hold(&held);
        let opener = gate.release_after(Duration::from_millis(50));
        let host = buf.as_slice().unwrap();
        if copy == 0 {
            cumem_copy::copy_h2d(host, &mut dst).unwrap();
        } else {
            cumem_copy::copy_2d(
                &Pitched::new(host, 64),
                &mut Pitched::new(pitched.as_mut_slice(), 64),
                Copy2D::new(64, 64),
            )
            .unwrap();
        }
        // The source is overwritten at once (its own order knows nothing of the copy, so nothing
        // waits here): a copy still in flight would read the new values.
        buf.as_mut_slice().unwrap().fill(u32::MAX);
        opener.join().unwrap();
    }
    assert_eq!(dst.to_vec().unwrap(), data);
    assert_eq!(pitched.to_vec().unwrap(), data);
    // The other blocking copies with a plain host side are waited for too.
    buf.as_mut_slice().unwrap().copy_from_slice(&data);
    let made = DeviceBuffer::from_slice(&stream, buf.as_slice().unwrap()).unwrap();
    buf.as_mut_slice().unwrap().fill(u32::MAX);
    assert_eq!(made.to_vec().unwrap(), data);
    cumem_copy::copy_d2h(&dst, buf.as_mut_slice().unwrap()).unwrap();
    assert_eq!(buf.as_slice().unwrap(), &data[..]);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}
