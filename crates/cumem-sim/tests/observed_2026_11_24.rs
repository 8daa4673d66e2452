//! What an H100 (driver 580.159.04) showed on 2026-11-24 through a raw-driver probe, and the
//! simulator must follow: which calls wait while another thread's `cuMemFree` holds the device,
//! the per-stream queue depth of 1021 work items, and two error codes.
//!
//! Every call that may block runs on its own thread and reports through a channel, so a call
//! that blocks when it should not fails the test after a timeout instead of hanging it. "Still
//! blocked" is judged after a pause far longer than any of these calls takes when nothing holds
//! it back.

mod common;

use std::ffi::c_void;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use common::*;
use cudarc::driver::sys::{self as cu, CUdeviceptr, CUevent, CUresult, CUstream};
use cumem_sim::control::Control;

const NON_BLOCKING: u32 = 1;
/// How long a held call must stay blocked (and a free call has to return).
const PAUSE: Duration = Duration::from_millis(400);
/// How long a call may take to return once nothing holds it: only reached when the simulator is
/// wrong, which then fails instead of hanging.
const LIMIT: Duration = Duration::from_secs(20);
/// The queue depth observed: work items a held stream accepted before the next one blocked.
const DEPTH: usize = 1021;
/// `CU_DEVICE_ATTRIBUTE_MAX_PITCH` of the simulated device (and of the H100).
const MAX_PITCH: usize = 2147483647;

fn event() -> CUevent {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: plain FFI call with a valid out-pointer.
    ok(unsafe { cu::cuEventCreate(&mut e, 0) });
    e
}

/// While another thread waits in `cuMemFree` for a held stream, `cuEventDestroy`,
/// `cuStreamDestroy` and `cuMemHostRegister` wait too, and `cuStreamWaitEvent` and
/// `cuIpcGetMemHandle` return (observed).
#[test]
#[serial_test::serial] // holds a stream with a gate
fn a_thread_in_cu_mem_free_holds_back_event_and_stream_destruction_and_registration() {
    let ctl = bind(0);
    let n = 4096;
    let held = stream(NON_BLOCKING);
    let other = stream(NON_BLOCKING);
    let idle_stream = stream(NON_BLOCKING);
    let idle = dalloc(n);
    let exported = dalloc(n);
    let completed = event();
    let never_recorded = event();
    // SAFETY: live handles.
    unsafe {
        ok(cu::cuEventRecord(completed, other));
        ok(cu::cuStreamSynchronize(other));
    }
    let mut host = vec![0u8; 2 * n];
    let host_addr = host.as_mut_ptr() as usize;
    let gate = Gate::block(held);
    gate.wait_started();
    let free = free_waiting(ctl, idle, PAUSE, LIMIT);

    let (completed_h, never_h) = (completed as usize, never_recorded as usize);
    // SAFETY: a live event, destroyed once.
    let destroy_completed = on_thread(move || unsafe { cu::cuEventDestroy_v2(completed_h as CUevent) });
    // SAFETY: as above.
    let destroy_never = on_thread(move || unsafe { cu::cuEventDestroy_v2(never_h as CUevent) });
    let idle_h = idle_stream as usize;
    // SAFETY: a live, idle stream, destroyed once.
    let destroy_stream = on_thread(move || unsafe { cu::cuStreamDestroy_v2(idle_h as CUstream) });
    // SAFETY: `host` outlives the registration, which is undone below.
    let register = on_thread(move || unsafe { cu::cuMemHostRegister_v2(host_addr as *mut c_void, n, 0) });
    let other_h = other as usize;
    // SAFETY: live handles; the event completed.
    let wait =
        on_thread(move || unsafe { cu::cuStreamWaitEvent(other_h as CUstream, completed_h as CUevent, 0) });
    let ipc = on_thread(move || {
        let mut h = cu::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: a live cuMemAlloc allocation and a valid out-pointer.
        unsafe { cu::cuIpcGetMemHandle(&mut h, exported) }
    });
    // The ones that return; cuStreamWaitEvent before the event is destroyed (it may be, once the
    // device is free again).
    assert_eq!(wait.recv_timeout(LIMIT), Ok(CUresult::CUDA_SUCCESS), "cuStreamWaitEvent returns");
    assert_eq!(ipc.recv_timeout(LIMIT), Ok(CUresult::CUDA_SUCCESS), "cuIpcGetMemHandle returns");
    std::thread::sleep(PAUSE);
    assert!(destroy_completed.try_recv().is_err(), "cuEventDestroy of a completed event waits");
    assert!(destroy_never.try_recv().is_err(), "cuEventDestroy of a never-recorded event waits");
    assert!(destroy_stream.try_recv().is_err(), "cuStreamDestroy of an idle stream waits");
    assert!(register.try_recv().is_err(), "cuMemHostRegister waits");
    assert!(free.try_recv().is_err(), "cuMemFree is still waiting");

    gate.open();
    assert_eq!(
        free.recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "cuMemFree returns once the stream drains"
    );
    for (name, rx) in [
        ("cuEventDestroy (completed)", destroy_completed),
        ("cuEventDestroy (never recorded)", destroy_never),
        ("cuStreamDestroy", destroy_stream),
        ("cuMemHostRegister", register),
    ] {
        assert_eq!(
            rx.recv_timeout(LIMIT),
            Ok(CUresult::CUDA_SUCCESS),
            "{name} returns once the device is free"
        );
    }
    // SAFETY: registered above.
    ok(unsafe { cu::cuMemHostUnregister(host.as_mut_ptr().cast()) });
    // SAFETY: live handles.
    ok(unsafe { cu::cuStreamSynchronize(other) });
    destroy(other);
    destroy(held);
    dfree(exported);
    drop(host);
    assert_all_released();
}

/// Starts `f`, a call of the simulator's `name`, on another thread and returns once the thread
/// has entered the call (the simulator's call counter says so) and is still in it after
/// [`PAUSE`].
fn waiting<T: Send + 'static>(
    ctl: &Control,
    name: &str,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Receiver<T> {
    let before = ctl.calls(name);
    let rx = on_thread(f);
    let entered = Instant::now();
    while ctl.calls(name) == before {
        assert!(entered.elapsed() < LIMIT, "the thread never called {name} ({what})");
        std::thread::yield_now();
    }
    assert!(rx.recv_timeout(PAUSE).is_err(), "{what} waits");
    rx
}

/// Queues `count` memsets of `n` bytes at `dst` on `s` from another thread, failing (instead of
/// hanging) if one of them waits.
fn fill(dst: CUdeviceptr, n: usize, s: CUstream, count: usize) {
    let s = s as usize;
    let done = on_thread(move || {
        for i in 0..count {
            // SAFETY: a live allocation of `n` bytes and a live stream.
            ok(unsafe { cu::cuMemsetD8Async(dst, i as u8, n, s as CUstream) });
        }
    });
    assert_eq!(done.recv_timeout(LIMIT), Ok(()), "{count} memsets are accepted without waiting");
}

extern "C" fn nothing(_: *mut c_void) {}

/// `cuLaunchHostFunc(s, nothing)` from another thread.
fn launch(s: CUstream) -> impl FnOnce() -> CUresult + Send + 'static {
    let s = s as usize;
    // SAFETY: a live stream and a function that does nothing.
    move || unsafe { cu::cuLaunchHostFunc(s as CUstream, Some(nothing), std::ptr::null_mut()) }
}

/// `cuMemsetD8Async(dst, 1, n, s)` from another thread.
fn memset_on(dst: CUdeviceptr, n: usize, s: CUstream) -> impl FnOnce() -> CUresult + Send + 'static {
    let s = s as usize;
    // SAFETY: a live allocation of `n` bytes and a live stream.
    move || unsafe { cu::cuMemsetD8Async(dst, 1, n, s as CUstream) }
}

/// `cuEventRecord(e, s)` from another thread.
fn record_on(e: CUevent, s: CUstream) -> impl FnOnce() -> CUresult + Send + 'static {
    let (e, s) = (e as usize, s as usize);
    // SAFETY: a live event and stream of the same context.
    move || unsafe { cu::cuEventRecord(e as CUevent, s as CUstream) }
}

/// `cuEventCreate` from another thread: the result and the event.
fn create_event() -> (CUresult, usize) {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let r = unsafe { cu::cuEventCreate(&mut e, 0) };
    (r, e as usize)
}

/// `cuMemAlloc` of 256 bytes from another thread: the result and the pointer.
fn alloc_small() -> (CUresult, CUdeviceptr) {
    let mut p = 0;
    // SAFETY: a valid out-pointer.
    let r = unsafe { cu::cuMemAlloc_v2(&mut p, 256) };
    (r, p)
}

/// Asserts that each of `calls` is still blocked (after the waits already made).
fn still_blocked<T>(calls: &[(&str, &Receiver<T>)]) {
    std::thread::sleep(PAUSE);
    for (what, rx) in calls {
        assert!(rx.try_recv().is_err(), "{what} waits");
    }
}

/// A held stream accepts 1021 copies and memsets (event recordings between them do not count);
/// the next one waits until the stream moves, and while it waits other threads' `cuEventCreate`
/// and `cuMemAlloc` wait too, while a memset and an event recording on another stream return.
#[test]
#[serial_test::serial] // holds a stream with a gate
fn a_held_stream_accepts_1021_work_items_and_the_next_one_waits() {
    let ctl = bind(0);
    let n = 4096;
    let held = stream(NON_BLOCKING);
    let other = stream(NON_BLOCKING);
    let a = dalloc(n);
    let b = dalloc(n);
    let c = dalloc(n);
    let marker = event();
    let elsewhere_marker = event();
    let gate = Gate::block(held);
    gate.wait_started();
    let (held_h, marker_h) = (held as usize, marker as usize);
    let queued = on_thread(move || {
        let (held, marker) = (held_h as CUstream, marker_h as CUevent);
        for i in 0..DEPTH {
            // SAFETY: live allocations and handles.
            unsafe {
                if i % 2 == 0 {
                    ok(cu::cuMemsetD8Async(a, i as u8, n, held));
                } else {
                    ok(cu::cuMemcpyDtoDAsync_v2(b, a, n, held));
                }
                // Not after the last one: a recording on a full stream waits for room.
                if i + 1 < DEPTH {
                    ok(cu::cuEventRecord(marker, held));
                    ok(cu::cuEventRecord(marker, held));
                }
            }
        }
    });
    assert_eq!(queued.recv_timeout(LIMIT), Ok(()), "1021 work items are accepted without waiting");
    // SAFETY: live allocations and handles.
    let next = waiting(ctl, "cuMemsetD8Async", "the 1022nd work item", move || unsafe {
        cu::cuMemsetD8Async(a, 0x5A, n, held_h as CUstream)
    });

    let elsewhere = on_thread(memset_on(c, n, other));
    let record_elsewhere = on_thread(record_on(elsewhere_marker, other));
    let create = on_thread(create_event);
    let alloc = on_thread(alloc_small);
    assert_eq!(
        elsewhere.recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "a memset on another stream returns"
    );
    assert_eq!(
        record_elsewhere.recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "an event recording on another stream returns"
    );
    still_blocked(&[("the 1022nd work item", &next)]);
    still_blocked(&[("cuEventCreate", &create)]);
    still_blocked(&[("cuMemAlloc", &alloc)]);

    gate.open();
    assert_eq!(
        next.recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "the 1022nd work item is queued once the stream moves"
    );
    let (r, e) = create.recv_timeout(LIMIT).expect("cuEventCreate returns");
    ok(r);
    let (r, p) = alloc.recv_timeout(LIMIT).expect("cuMemAlloc returns");
    ok(r);
    // SAFETY: live handles, each destroyed once.
    unsafe {
        ok(cu::cuStreamSynchronize(held));
        ok(cu::cuStreamSynchronize(other));
        ok(cu::cuEventDestroy_v2(e as CUevent));
        ok(cu::cuEventDestroy_v2(marker));
        ok(cu::cuEventDestroy_v2(elsewhere_marker));
    }
    assert!(read_back(a, n).iter().all(|&x| x == 0x5A), "the waiting memset ran last");
    dfree(p);
    dfree(a);
    dfree(b);
    dfree(c);
    destroy(other);
    destroy(held);
    assert_all_released();
}

/// A queued host function takes a slot of the queue: after 1020 memsets and a host function the
/// next memset waits; after 1019 memsets and a host function it returns (observed). The second
/// stream is held by a wait for an event recorded behind the gate (neither takes a slot): the
/// simulator runs one host function at a time, so a second gate would not start.
#[test]
#[serial_test::serial] // holds streams with gates
fn a_queued_host_function_takes_a_slot() {
    let ctl = bind(0);
    let n = 4096;
    let (full, roomy) = (stream(NON_BLOCKING), stream(NON_BLOCKING));
    let a = dalloc(n);
    let gate = Gate::block(full);
    gate.wait_started();
    let behind_gate = event();
    // SAFETY: live handles of the same context.
    unsafe {
        ok(cu::cuEventRecord(behind_gate, full));
        ok(cu::cuStreamWaitEvent(roomy, behind_gate, 0));
    }
    fill(a, n, full, DEPTH - 1);
    fill(a, n, roomy, DEPTH - 2);
    for s in [full, roomy] {
        assert_eq!(on_thread(launch(s)).recv_timeout(LIMIT), Ok(CUresult::CUDA_SUCCESS), "the host function");
    }
    assert_eq!(
        on_thread(memset_on(a, n, roomy)).recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "1019 memsets and a host function leave room for a memset"
    );
    let next = waiting(
        ctl,
        "cuMemsetD8Async",
        "a memset after 1020 memsets and a host function",
        memset_on(a, n, full),
    );
    gate.open();
    assert_eq!(
        next.recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "the memset is queued once the stream moves"
    );
    // SAFETY: live streams.
    unsafe {
        ok(cu::cuStreamSynchronize(full));
        ok(cu::cuStreamSynchronize(roomy));
        ok(cu::cuEventDestroy_v2(behind_gate));
    }
    dfree(a);
    destroy(full);
    destroy(roomy);
    assert_all_released();
}

/// Puts the simulated latency back however the test ends.
struct Latency(&'static Control);

impl Drop for Latency {
    fn drop(&mut self) {
        let _ = self.0.configure("latency_us=200");
    }
}

/// A call waiting for room behind a host function that is queued (it takes a slot) goes on once
/// the host function starts (it then no longer does), not once it returns: on a GPU a stream held
/// by a started host function took 1021 more items.
#[test]
#[serial_test::serial] // holds a stream with a gate, changes the latency
fn a_call_waiting_behind_a_queued_host_function_goes_on_when_it_starts() {
    let ctl = bind(0);
    let n = 4096;
    let held = stream(NON_BLOCKING);
    let a = dalloc(n);
    // The gate is due only after the latency, so the memsets find it still queued.
    ctl.configure("latency_us=1000000").unwrap();
    let latency = Latency(ctl);
    let gate = Gate::block(held);
    fill(a, n, held, DEPTH - 1);
    let next = waiting(
        ctl,
        "cuMemsetD8Async",
        "a memset behind a queued gate and 1020 memsets",
        memset_on(a, n, held),
    );
    gate.wait_started();
    assert_eq!(
        next.recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "the memset is queued once the gate's host function starts"
    );
    drop(latency);
    gate.open();
    // SAFETY: a live stream.
    ok(unsafe { cu::cuStreamSynchronize(held) });
    dfree(a);
    destroy(held);
    assert_all_released();
}

/// `cuLaunchHostFunc` on a full stream waits for room, and while it waits other threads' memsets
/// and event recordings on another stream, `cuMemAlloc` and `cuEventCreate` wait too (observed).
#[test]
#[serial_test::serial] // holds a stream with a gate
fn a_host_function_launch_on_a_full_stream_waits_and_holds_queueing_and_creation() {
    let ctl = bind(0);
    let n = 4096;
    let (held, other) = (stream(NON_BLOCKING), stream(NON_BLOCKING));
    let (a, c) = (dalloc(n), dalloc(n));
    let marker = event();
    let gate = Gate::block(held);
    gate.wait_started();
    fill(a, n, held, DEPTH);
    let host_fn = waiting(ctl, "cuLaunchHostFunc", "cuLaunchHostFunc on the full stream", launch(held));
    let elsewhere = on_thread(memset_on(c, n, other));
    let record = on_thread(record_on(marker, other));
    let create = on_thread(create_event);
    let alloc = on_thread(alloc_small);
    still_blocked(&[
        ("cuLaunchHostFunc on the full stream", &host_fn),
        ("a memset on another stream", &elsewhere),
        ("an event recording on another stream", &record),
    ]);
    still_blocked(&[("cuEventCreate", &create)]);
    still_blocked(&[("cuMemAlloc", &alloc)]);

    gate.open();
    for (what, rx) in [("cuLaunchHostFunc", host_fn), ("the memset", elsewhere), ("the recording", record)] {
        assert_eq!(
            rx.recv_timeout(LIMIT),
            Ok(CUresult::CUDA_SUCCESS),
            "{what} returns once the stream moves"
        );
    }
    let (r, e) = create.recv_timeout(LIMIT).expect("cuEventCreate returns");
    ok(r);
    let (r, p) = alloc.recv_timeout(LIMIT).expect("cuMemAlloc returns");
    ok(r);
    // SAFETY: live handles, each destroyed once.
    unsafe {
        ok(cu::cuStreamSynchronize(held));
        ok(cu::cuStreamSynchronize(other));
        ok(cu::cuEventDestroy_v2(e as CUevent));
        ok(cu::cuEventDestroy_v2(marker));
    }
    for p in [p, a, c] {
        dfree(p);
    }
    destroy(other);
    destroy(held);
    assert_all_released();
}

/// `cuEventRecord` on a full stream waits for room (a recording takes no slot but needs a free
/// one), and while it waits other threads' recordings on another stream, `cuMemAlloc` and
/// `cuEventCreate` wait, while a memset on another stream returns (observed).
#[test]
#[serial_test::serial] // holds a stream with a gate
fn an_event_record_on_a_full_stream_waits_and_holds_recordings_and_creation() {
    let ctl = bind(0);
    let n = 4096;
    let (held, other) = (stream(NON_BLOCKING), stream(NON_BLOCKING));
    let (a, c) = (dalloc(n), dalloc(n));
    let (marker, elsewhere_marker) = (event(), event());
    let gate = Gate::block(held);
    gate.wait_started();
    fill(a, n, held, DEPTH);
    let record = waiting(ctl, "cuEventRecord", "cuEventRecord on the full stream", record_on(marker, held));
    let elsewhere = on_thread(memset_on(c, n, other));
    assert_eq!(
        elsewhere.recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "a memset on another stream returns"
    );
    let record_elsewhere = on_thread(record_on(elsewhere_marker, other));
    let create = on_thread(create_event);
    let alloc = on_thread(alloc_small);
    still_blocked(&[
        ("cuEventRecord on the full stream", &record),
        ("an event recording on another stream", &record_elsewhere),
    ]);
    still_blocked(&[("cuEventCreate", &create)]);
    still_blocked(&[("cuMemAlloc", &alloc)]);

    gate.open();
    for (what, rx) in [("the recording", record), ("the recording elsewhere", record_elsewhere)] {
        assert_eq!(
            rx.recv_timeout(LIMIT),
            Ok(CUresult::CUDA_SUCCESS),
            "{what} returns once the stream moves"
        );
    }
    let (r, e) = create.recv_timeout(LIMIT).expect("cuEventCreate returns");
    ok(r);
    let (r, p) = alloc.recv_timeout(LIMIT).expect("cuMemAlloc returns");
    ok(r);
    // SAFETY: live handles, each destroyed once.
    unsafe {
        ok(cu::cuStreamSynchronize(held));
        ok(cu::cuStreamSynchronize(other));
        for e in [e as CUevent, marker, elsewhere_marker] {
            ok(cu::cuEventDestroy_v2(e));
        }
    }
    for p in [p, a, c] {
        dfree(p);
    }
    destroy(other);
    destroy(held);
    assert_all_released();
}

/// The hold of a full stream is per context: while a memset waits for room in the primary
/// context, `cuMemAlloc` in that context waits, but `cuMemAlloc` and `cuEventCreate` in a second
/// context (`cuCtxCreate`) of the same device return (observed).
#[test]
#[serial_test::serial] // holds a stream with a gate
fn the_hold_of_a_full_stream_is_per_context() {
    let ctl = bind(0);
    let n = 4096;
    let held = stream(NON_BLOCKING);
    let a = dalloc(n);
    let mut second: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer, NULL parameters (as observed to work); the new context is
    // popped again at once, leaving the primary one current.
    unsafe {
        ok(cu::cuCtxCreate_v4(&mut second, std::ptr::null_mut(), 0, 0));
        let mut popped: cu::CUcontext = std::ptr::null_mut();
        ok(cu::cuCtxPopCurrent_v2(&mut popped));
        assert_eq!(popped, second);
    }
    let second_h = second as usize;
    let gate = Gate::block(held);
    gate.wait_started();
    fill(a, n, held, DEPTH);
    let next = waiting(ctl, "cuMemsetD8Async", "the 1022nd memset", memset_on(a, n, held));
    let in_second = on_thread(move || {
        // SAFETY: a live context.
        ok(unsafe { cu::cuCtxSetCurrent(second_h as cu::CUcontext) });
        (alloc_small(), create_event())
    });
    let ((r, p), (r2, e)) =
        in_second.recv_timeout(LIMIT).expect("cuMemAlloc and cuEventCreate in a second context return");
    ok(r);
    ok(r2);
    let alloc = on_thread(alloc_small);
    still_blocked(&[("cuMemAlloc in the same context", &alloc)]);
    still_blocked(&[("the 1022nd memset", &next)]);

    gate.open();
    assert_eq!(
        next.recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "the memset returns once the stream moves"
    );
    let (r, p0) = alloc.recv_timeout(LIMIT).expect("cuMemAlloc returns");
    ok(r);
    let cleanup = on_thread(move || {
        // SAFETY: live handles of the second context, each released once.
        unsafe {
            ok(cu::cuCtxSetCurrent(second_h as cu::CUcontext));
            ok(cu::cuEventDestroy_v2(e as CUevent));
            ok(cu::cuMemFree_v2(p));
            ok(cu::cuCtxDestroy_v2(second_h as cu::CUcontext));
        }
    });
    assert_eq!(cleanup.recv_timeout(LIMIT), Ok(()), "the second context is released");
    // SAFETY: a live stream.
    ok(unsafe { cu::cuStreamSynchronize(held) });
    dfree(p0);
    dfree(a);
    destroy(held);
    assert_all_released();
}

/// An invalid memset or copy on a full stream fails at once with its error instead of waiting for
/// room (observed for `cuMemsetD8Async` with a bad pointer and past the end of its allocation).
#[test]
#[serial_test::serial] // holds a stream with a gate
fn an_invalid_call_on_a_full_stream_fails_at_once() {
    bind(0);
    let n = 4096;
    let held = stream(NON_BLOCKING);
    let a = dalloc(n);
    let gate = Gate::block(held);
    gate.wait_started();
    fill(a, n, held, DEPTH);
    let h = held as usize;
    let calls = on_thread(move || {
        let s = h as CUstream;
        // SAFETY: the pointers are invalid on purpose; the simulator checks them before use.
        unsafe {
            [
                ("memset at a bad pointer", cu::cuMemsetD8Async(0x10, 1, n, s)),
                ("memset past the end", cu::cuMemsetD8Async(a, 1, n + 1, s)),
                ("copy from a bad pointer", cu::cuMemcpyDtoDAsync_v2(a, 0x10, n, s)),
                ("2D memset past the end", cu::cuMemsetD2D8Async(a, n, 1, n, 2, s)),
            ]
        }
    });
    let results = calls.recv_timeout(PAUSE * 5).expect("the invalid calls return while the stream is full");
    for (what, r) in results {
        assert_eq!(r, CUresult::CUDA_ERROR_INVALID_VALUE, "{what}");
    }
    gate.open();
    // SAFETY: a live stream.
    ok(unsafe { cu::cuStreamSynchronize(held) });
    dfree(a);
    destroy(held);
    assert_all_released();
}

/// The first `cuIpcGetMemHandle` of an allocation with a memset queued on a held stream returns
/// at once (observed), and the memset, run later, writes the exported memory.
#[test]
#[serial_test::serial] // holds a stream with a gate
fn exporting_an_allocation_with_queued_work_returns_at_once() {
    bind(0);
    let n = 4096;
    let held = stream(NON_BLOCKING);
    let a = dalloc(n);
    let gate = Gate::block(held);
    gate.wait_started();
    // SAFETY: a live allocation and stream.
    ok(unsafe { cu::cuMemsetD8Async(a, 0x3C, n, held) });
    let export = on_thread(move || {
        let mut h = cu::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: a live cuMemAlloc allocation and a valid out-pointer.
        unsafe { cu::cuIpcGetMemHandle(&mut h, a) }
    });
    assert_eq!(
        export.recv_timeout(PAUSE * 5),
        Ok(CUresult::CUDA_SUCCESS),
        "cuIpcGetMemHandle returns at once"
    );
    gate.open();
    // SAFETY: a live stream.
    ok(unsafe { cu::cuStreamSynchronize(held) });
    assert!(read_back(a, n).iter().all(|&x| x == 0x3C), "the queued memset wrote the exported memory");
    dfree(a);
    destroy(held);
    assert_all_released();
}

/// `cuMemPoolImportFromShareableHandle` of a regular file's descriptor → `UNKNOWN`; of a
/// descriptor that is no file (here a pipe; the H100 was shown descriptor 0) → `INVALID_VALUE`.
#[test]
#[serial_test::parallel]
fn importing_a_regular_file_as_a_pool_is_unknown() {
    bind(0);
    let import = |fd: i32| {
        let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the descriptor is passed by value.
        unsafe {
            cu::cuMemPoolImportFromShareableHandle(
                &mut pool,
                fd as isize as *mut c_void,
                cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        }
    };
    let path = std::env::temp_dir().join(format!("cumem-sim-not-a-pool-{}", std::process::id()));
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(&[7u8; 4096]).unwrap();
    assert_eq!(import(file.as_raw_fd()), CUresult::CUDA_ERROR_UNKNOWN, "a regular file");
    drop(file);
    std::fs::remove_file(&path).unwrap();
    let mut fds = [0i32; 2];
    // SAFETY: `fds` holds two descriptors.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    assert_eq!(import(fds[0]), CUresult::CUDA_ERROR_INVALID_VALUE, "a pipe");
    for fd in fds {
        // SAFETY: opened above, closed once.
        unsafe { libc::close(fd) };
    }
}

/// A one-row device-to-device `cuMemcpy2D` and `cuMemcpy2DAsync` with both pitches above
/// MAX_PITCH succeed (observed with MAX_PITCH + 512) and copy the row; with two rows they are
/// refused (not tried on the GPU: the documentation's rule).
#[test]
#[serial_test::parallel]
fn a_one_row_2d_copy_ignores_max_pitch() {
    bind(0);
    let n = 256;
    let src = dalloc(n);
    let dst = dalloc(n);
    let s = stream(NON_BLOCKING);
    let pitch = MAX_PITCH + 512;
    let mut c = device_2d(dst, pitch, src, pitch, n, 1);
    // SAFETY: the rows lie in live allocations.
    unsafe {
        ok(cu::cuMemsetD8_v2(src, 0x11, n));
        ok(cu::cuMemcpy2D_v2(&c));
        assert!(read_back(dst, n).iter().all(|&x| x == 0x11), "the synchronous copy moved the row");
        ok(cu::cuMemsetD8_v2(src, 0x22, n));
        ok(cu::cuMemcpy2DAsync_v2(&c, s));
        ok(cu::cuStreamSynchronize(s));
        assert!(read_back(dst, n).iter().all(|&x| x == 0x22), "the asynchronous copy moved the row");
        c.Height = 2;
        assert_eq!(cu::cuMemcpy2D_v2(&c), CUresult::CUDA_ERROR_INVALID_VALUE, "two rows");
        assert_eq!(cu::cuMemcpy2DAsync_v2(&c, s), CUresult::CUDA_ERROR_INVALID_VALUE, "two rows");
    }
    destroy(s);
    dfree(src);
    dfree(dst);
}
