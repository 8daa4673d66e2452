//! A held stream's gate has a deadline: a test whose own call waits for the stream it holds is
//! let go when the deadline opens the gate, and fails when it releases the gate; a gate released
//! in time leaves no trace.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use cumem_sys::sys::{self, CUresult};
use cumem_sys::testing;

fn ok(code: CUresult, what: &str) {
    assert_eq!(code, CUresult::CUDA_SUCCESS, "{what}");
}

#[test]
fn a_gate_the_test_waits_for_opens_at_its_deadline_and_fails_the_release() {
    testing::init();
    let (mut dev, mut ctx, mut stream) = (0, std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid out-pointers; the driver is initialised; the context is made current before
    // the stream is created in it, and everything is released below, once.
    unsafe {
        ok(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
        ok(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain");
        ok(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
        ok(sys::cuStreamCreate(&mut stream, 1), "cuStreamCreate");
    }

    // Released in time: nothing to report.
    // SAFETY: `stream` is live and its context current.
    let gate = unsafe { testing::hold_for(stream, Duration::from_secs(60)) };
    gate.release();
    // SAFETY: a live stream.
    ok(unsafe { sys::cuStreamSynchronize(stream) }, "synchronize after an in-time release");

    // The test waits for the stream it holds: the deadline lets it go, and the release fails.
    let deadline = Duration::from_millis(200);
    // Taken before the hold: the deadline counts from inside `hold_for`.
    let waited = Instant::now();
    // SAFETY: as above.
    let gate = unsafe { testing::hold_for(stream, deadline) };
    // The wait a gated test must never make; without the deadline it would never return.
    let (raw, raw_ctx) = (stream as usize, ctx as usize);
    testing::within_watchdog("synchronize under the gate", move || {
        // SAFETY: the retained primary context and a live stream of it (both released only below,
        // after this returns); the watchdog's thread makes the context current first.
        unsafe {
            ok(sys::cuCtxSetCurrent(raw_ctx as sys::CUcontext), "cuCtxSetCurrent on the watchdog's thread");
            ok(sys::cuStreamSynchronize(raw as sys::CUstream), "synchronize under the gate");
        }
    });
    assert!(waited.elapsed() >= deadline, "the gate opened before its deadline");
    let released = catch_unwind(AssertUnwindSafe(|| gate.release()));
    let message = released.expect_err("a gate opened by its deadline fails its release");
    let message = message
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| message.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default();
    assert!(message.contains("opened by its deadline"), "{message}");

    // SAFETY: the stream is idle and destroyed once; the primary context was retained above.
    unsafe {
        ok(sys::cuStreamDestroy_v2(stream), "cuStreamDestroy");
        ok(sys::cuDevicePrimaryCtxRelease_v2(dev), "cuDevicePrimaryCtxRelease");
    }
}
