//! Implicit synchronisation holds the device, as observed on an H100 (§17 of the driver
//! reference): while one thread waits in `cuMemFree` for a stream held by a blocked host
//! function, other threads' calls that queue work or allocate wait until it returns, and
//! queries, `cuMemGetInfo` and `cuMemAllocAsync` do not.
//!
//! Every call runs on its own thread and reports through a channel, so a call that blocks when it
//! should not fails the test after a timeout instead of hanging it. "Still blocked" is judged
//! after a pause far longer than any of these calls takes when nothing holds it back.

mod common;

use std::ffi::c_void;
use std::sync::mpsc::TryRecvError;
use std::time::Duration;

use common::*;
use cudarc::driver::sys::{self as cu, CUcontext, CUevent, CUresult, CUstream};

const NON_BLOCKING: u32 = 1;
/// How long a held call must stay blocked (and a free call has to return).
const PAUSE: Duration = Duration::from_millis(400);
/// How long a call may take to return once nothing holds it: only reached when the simulator is
/// wrong, which then fails instead of hanging.
const LIMIT: Duration = Duration::from_secs(20);

extern "C" fn nothing(_: *mut c_void) {}

#[test]
#[serial_test::serial] // holds a stream with a gate
fn a_thread_in_cu_mem_free_holds_back_queueing_calls_but_not_queries() {
    let ctl = bind(0);
    let n = 4096;
    let held = stream(NON_BLOCKING);
    let other = stream(NON_BLOCKING) as usize;
    let idle = dalloc(n);
    let target = dalloc(n);
    let host = pinned(n) as usize;
    let gate = Gate::block(held);

    let free = free_waiting(ctl, idle, PAUSE, LIMIT);

    let held_handle = held as usize;
    // SAFETY: plain FFI call with live handles and valid out-pointers.
    let query = on_thread(move || unsafe { cu::cuStreamQuery(held_handle as CUstream) });
    let info = on_thread(|| {
        let (mut free, mut total) = (0, 0);
        // SAFETY: plain FFI call with live handles and valid out-pointers.
        unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) }
    });
    let alloc_async = on_thread(move || {
        let mut p = 0;
        // SAFETY: plain FFI call with live handles and valid out-pointers.
        let r = unsafe { cu::cuMemAllocAsync(&mut p, 256, other as CUstream) };
        (r, p)
    });
    assert_eq!(query.recv_timeout(LIMIT), Ok(CUresult::CUDA_ERROR_NOT_READY), "cuStreamQuery returns");
    assert_eq!(info.recv_timeout(LIMIT), Ok(CUresult::CUDA_SUCCESS), "cuMemGetInfo returns");
    let (r, pool_ptr) = alloc_async.recv_timeout(LIMIT).expect("cuMemAllocAsync returns");
    ok(r);
    assert!(free.try_recv().is_err(), "cuMemFree is still waiting");

    // SAFETY: plain FFI call with live handles and valid out-pointers.
    let memset = on_thread(move || unsafe { cu::cuMemsetD8Async(target, 1, n, other as CUstream) });
    // SAFETY: plain FFI call with live handles and valid out-pointers.
    let copy = on_thread(move || unsafe {
        cu::cuMemcpyHtoDAsync_v2(target, host as *const c_void, n, other as CUstream)
    });
    // SAFETY: plain FFI call with live handles and valid out-pointers.
    let event = on_thread(move || unsafe {
        let mut e: CUevent = std::ptr::null_mut();
        let created = cu::cuEventCreate(&mut e, 0);
        let recorded = cu::cuEventRecord(e, other as CUstream);
        (created, recorded, e as usize)
    });
    // SAFETY: plain FFI call with live handles and valid out-pointers.
    let host_fn = on_thread(move || unsafe {
        cu::cuLaunchHostFunc(other as CUstream, Some(nothing), std::ptr::null_mut())
    });
    let alloc = on_thread(|| {
        let mut p = 0;
        // SAFETY: plain FFI call with live handles and valid out-pointers.
        let r = unsafe { cu::cuMemAlloc_v2(&mut p, 256) };
        (r, p)
    });
    let create = on_thread(|| {
        let mut s: CUstream = std::ptr::null_mut();
        // SAFETY: plain FFI call with live handles and valid out-pointers.
        let r = unsafe { cu::cuStreamCreate(&mut s, NON_BLOCKING) };
        (r, s as usize)
    });
    let alloc_host = on_thread(|| {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: plain FFI call with live handles and valid out-pointers.
        let r = unsafe { cu::cuMemAllocHost_v2(&mut p, 256) };
        (r, p as usize)
    });
    std::thread::sleep(PAUSE);
    let still_blocked = [
        ("cuMemsetD8Async", memset.try_recv().err()),
        ("cuMemcpyHtoDAsync", copy.try_recv().err()),
        ("cuLaunchHostFunc", host_fn.try_recv().err()),
    ];
    for (name, state) in still_blocked {
        assert_eq!(state, Some(TryRecvError::Empty), "{name} waits while cuMemFree holds the device");
    }
    assert!(event.try_recv().is_err(), "cuEventCreate + cuEventRecord wait");
    assert!(alloc.try_recv().is_err(), "cuMemAlloc waits");
    assert!(create.try_recv().is_err(), "cuStreamCreate waits");
    assert!(alloc_host.try_recv().is_err(), "cuMemAllocHost waits");
    assert!(free.try_recv().is_err(), "cuMemFree is still waiting");

    gate.open();
    assert_eq!(
        free.recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "cuMemFree returns once the stream drains"
    );
    assert_eq!(memset.recv_timeout(LIMIT), Ok(CUresult::CUDA_SUCCESS));
    assert_eq!(copy.recv_timeout(LIMIT), Ok(CUresult::CUDA_SUCCESS));
    assert_eq!(host_fn.recv_timeout(LIMIT), Ok(CUresult::CUDA_SUCCESS));
    let (created, recorded, e) = event.recv_timeout(LIMIT).expect("the event calls return");
    ok(created);
    ok(recorded);
    let (r, p) = alloc.recv_timeout(LIMIT).expect("cuMemAlloc returns");
    ok(r);
    let (r, s) = create.recv_timeout(LIMIT).expect("cuStreamCreate returns");
    ok(r);
    let (r, h) = alloc_host.recv_timeout(LIMIT).expect("cuMemAllocHost returns");
    ok(r);

    let other = other as CUstream;
    // SAFETY: live handles and allocations, each released once.
    unsafe {
        ok(cu::cuMemFreeAsync(pool_ptr, other));
        ok(cu::cuStreamSynchronize(other));
        ok(cu::cuEventDestroy_v2(e as CUevent));
    }
    destroy(s as CUstream);
    destroy(other);
    destroy(held);
    dfree(p);
    dfree(target);
    pfree(h as *mut u8);
    pfree(host as *mut u8);
    assert_all_released();
}

#[test]
#[serial_test::serial] // holds a stream with a gate
fn cu_ctx_synchronize_waits_for_the_current_contexts_streams_only() {
    bind(0);
    let mut b: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; NULL parameters are allowed. The created context is current.
    ok(unsafe { cu::cuCtxCreate_v4(&mut b, std::ptr::null_mut(), 0, 0) });
    let held = stream(NON_BLOCKING);
    let gate = Gate::block(held);
    let mut popped: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuCtxPopCurrent_v2(&mut popped) });
    assert_eq!(popped, b);
    // SAFETY: plain FFI call.
    let primary = on_thread(|| unsafe { cu::cuCtxSynchronize() });
    assert_eq!(
        primary.recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "the primary context's cuCtxSynchronize does not wait for another context's stream"
    );
    let b_handle = b as usize;
    // SAFETY: a live context handle; plain FFI calls.
    let created = on_thread(move || unsafe {
        ok(cu::cuCtxSetCurrent(b_handle as CUcontext));
        cu::cuCtxSynchronize()
    });
    assert!(
        created.recv_timeout(PAUSE).is_err(),
        "the created context's cuCtxSynchronize waits for its stream"
    );
    gate.open();
    assert_eq!(created.recv_timeout(LIMIT), Ok(CUresult::CUDA_SUCCESS));
    destroy(held);
    // SAFETY: the context created above, destroyed once.
    ok(unsafe { cu::cuCtxDestroy_v2(b) });
    assert_all_released();
}

#[test]
#[serial_test::serial] // holds a stream with a gate
fn of_two_releases_of_the_last_reference_waiting_together_one_fails() {
    let ctl = setup();
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; device 2 is left unretained by the shared setup.
    ok(unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, 2) });
    // SAFETY: the handle just retained.
    ok(unsafe { cu::cuCtxSetCurrent(ctx) });
    let held = stream(NON_BLOCKING);
    let gate = Gate::block(held);
    let releases = ctl.calls("cuDevicePrimaryCtxRelease_v2");
    // SAFETY: plain FFI calls; one of the two releases is the misuse under test.
    let first = on_thread(|| unsafe { cu::cuDevicePrimaryCtxRelease_v2(2) });
    // SAFETY: as above.
    let second = on_thread(|| unsafe { cu::cuDevicePrimaryCtxRelease_v2(2) });
    let entered = std::time::Instant::now();
    while ctl.calls("cuDevicePrimaryCtxRelease_v2") < releases + 2 {
        assert!(entered.elapsed() < LIMIT, "the threads never called cuDevicePrimaryCtxRelease");
        std::thread::yield_now();
    }
    // Both wait for the held stream before the count changes.
    std::thread::sleep(PAUSE);
    gate.open();
    let mut results = [first.recv_timeout(LIMIT).unwrap(), second.recv_timeout(LIMIT).unwrap()];
    results.sort_by_key(|r| *r as u32);
    assert_eq!(
        results,
        [CUresult::CUDA_SUCCESS, CUresult::CUDA_ERROR_INVALID_CONTEXT],
        "one reference, one release"
    );
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: valid out-pointers.
    ok(unsafe { cu::cuDevicePrimaryCtxGetState(2, &mut flags, &mut active) });
    assert_eq!(active, 0, "the context was released");
    ctl.clear_violations();
    bind(0);
}
