//! Host access to managed memory versus device work on it (issue 7, items 5 and 8): on a device
//! without concurrent managed access the host must not read a buffer that device work uses, reads
//! included (the real driver faults the host; the simulator protects the pages the same way), so a
//! shared host borrow refuses device work through shared views until an exclusive access ends it;
//! on a device with concurrent access host reads and device reads overlap as with pinned memory.
//! And attachments the driver refuses are refused first.

use std::ffi::c_void;
use std::process::Command;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use cumem_copy::StreamCopy;
use cumem_core::sys::{self, CUresult};
use cumem_core::{Context, Device, DeviceBuffer, Error, Feature, Stream};
use cumem_sys::testing;
use cumem_unified::{Attach, UnifiedBuffer};

/// Device 1 has managed memory without concurrent access (like Windows/WSL or pre-Pascal GPUs).
/// Streams start work 5 ms late, so work queued just before a host read is still pending.
const SIM: &str = "devices=2,latency_us=5000,dev1.concurrent_managed_access=0";

/// A managed-memory device with (`true`) or without concurrent managed access.
fn device(concurrent: bool) -> Option<(Device, Context, Stream)> {
    testing::init_with(SIM);
    let d = Device::all().unwrap().into_iter().find(|d| {
        let c = d.capabilities().unwrap();
        c.managed_memory && c.concurrent_managed_access == concurrent
    })?;
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

struct GateState {
    open: Mutex<bool>,
    cv: Condvar,
}

/// Holds a stream until dropped, so that work queued behind it has certainly not run. Declare it
/// after the buffers it holds work for (dropped first, so their drops can wait for the stream).
#[must_use = "the stream is held until the gate is dropped"]
struct Gate(Arc<GateState>);

impl Drop for Gate {
    fn drop(&mut self) {
        *self.0.open.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.0.cv.notify_all();
    }
}

unsafe extern "C" fn wait_at_gate(user: *mut c_void) {
    // SAFETY: `user` is the count of the `Arc<GateState>` that `hold` leaked for this call, which
    // runs once: reclaiming it here keeps the state alive until the callback has returned.
    let state = unsafe { Arc::from_raw(user.cast_const().cast::<GateState>()) };
    let mut open = state.open.lock().unwrap_or_else(PoisonError::into_inner);
    while !*open {
        open = state.cv.wait(open).unwrap_or_else(PoisonError::into_inner);
    }
}

/// Holds `stream` here: work queued on it from now on does not start until the gate opens.
fn hold(stream: &Stream) -> Gate {
    let state = Arc::new(GateState { open: Mutex::new(false), cv: Condvar::new() });
    let user = Arc::into_raw(state.clone()).cast_mut().cast::<c_void>();
    stream.context().bind().unwrap();
    // SAFETY: the callback only waits on the state, and owns the count passed to it.
    let code = unsafe { sys::cuLaunchHostFunc(stream.raw(), Some(wait_at_gate), user) };
    if code != CUresult::CUDA_SUCCESS {
        // SAFETY: not queued, so the count passed as `user` is still ours to reclaim.
        drop(unsafe { Arc::from_raw(user.cast_const().cast::<GateState>()) });
        panic!("cuLaunchHostFunc failed: {code:?}");
    }
    Gate(state)
}

#[test]
#[serial_test::parallel]
fn without_concurrent_access_a_host_read_refuses_device_reads_through_shared_views() {
    in_child("without_concurrent_access_a_host_read_refuses_device_reads_through_shared_views", || {
        let Some((device, _, stream)) = device(false) else { return };
        let data = pattern(4096);
        let mut buf = UnifiedBuffer::from_slice(&stream, &data).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 4096).unwrap();
        {
            let view = buf.as_device_slice();
            let host = buf.as_slice().unwrap();
            let gate = hold(&stream);
            // Queued, this copy would read the pages while the host reads them below: the real
            // driver faults the host there, and so does the simulator.
            let queued = stream.copy_d2d(&view, &mut dst);
            assert_eq!(host, &data[..]);
            drop(gate);
            assert!(queued.as_ref().is_err_and(|e| refused_on(e, device)), "{queued:?}");
            // The blocking form too (after the gate: a copy of managed memory is synchronous).
            let blocking = cumem_copy::copy_d2d(&view, &mut dst);
            assert!(blocking.as_ref().is_err_and(|e| refused_on(e, device)), "{blocking:?}");
            assert_eq!(host, &data[..]);
        }
        // An exclusive access proves the host's borrow over: device reads are allowed again.
        buf.end_host_reads();
        stream.copy_d2d(&buf, &mut dst).unwrap();
        assert_eq!(dst.to_vec().unwrap(), data);
        // A copy to a Vec ends its host read when it returns.
        assert_eq!(buf.to_vec().unwrap(), data);
        let mut again = DeviceBuffer::<u32>::zeroed(&stream, 4096).unwrap();
        stream.copy_d2d(&buf, &mut again).unwrap();
        assert_eq!(again.to_vec().unwrap(), data);
        // So does every other `&mut self` method, here a host write and a device write.
        let _ = buf.as_slice().unwrap();
        buf.as_mut_slice().unwrap()[0] = 1;
        stream.copy_d2d(&buf, &mut again).unwrap();
        let _ = buf.as_slice().unwrap();
        stream.memset_d32(&mut buf, 5).unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![5; 4096]);
        assert_eq!(again.to_vec().unwrap()[..2], [1, data[1]]);
        assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    });
}

#[test]
#[serial_test::parallel]
fn without_concurrent_access_a_host_read_waits_for_device_reads_of_host_attached_memory() {
    in_child("without_concurrent_access_a_host_read_waits_for_device_reads_of_host_attached_memory", || {
        let Some((_, _, stream)) = device(false) else { return };
        let data = pattern(1 << 16);
        // Attached to the host: the attachment rules alone ask for no wait before host access.
        let buf = UnifiedBuffer::from_slice_attached(&stream, &data, Attach::Host).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 1 << 16).unwrap();
        // A device read, still queued (5 ms of latency) when the host reads below.
        stream.copy_d2d(&buf, &mut dst).unwrap();
        assert_eq!(buf.as_slice().unwrap(), &data[..]);
        assert_eq!(dst.to_vec().unwrap(), data);
        assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    });
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
