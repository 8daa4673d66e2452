//! Asynchrony: streams really run later, in order; events and waits order work across streams;
//! the legacy stream synchronises with blocking streams only.

mod common;

use std::ffi::c_void;
use std::sync::Mutex;

use common::*;
use cudarc::driver::sys::{self as cu, CUevent, CUresult, CUstream};
use serial_test::{parallel, serial};

const NON_BLOCKING: u32 = 1;

fn event(flags: u32) -> CUevent {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuEventCreate(&mut e, flags) });
    e
}

fn edestroy(e: CUevent) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuEventDestroy_v2(e) });
}

fn sync(s: CUstream) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
}

fn query(s: CUstream) -> CUresult {
    // SAFETY: plain FFI call.
    unsafe { cu::cuStreamQuery(s) }
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn async_h2d_from_pinned_reads_the_source_when_it_runs() {
    bind(0);
    let n = 4096;
    let d = dalloc(n);
    let h = pinned(n);
    poke(h, n, 1);
    let s = stream(0);
    let gate = Gate::block(s);
    // SAFETY: `h` is pinned with `n` bytes and outlives the stream's work (synchronised below).
    ok(unsafe { cu::cuMemcpyHtoDAsync_v2(d, h.cast(), n, s) });
    poke(h, n, 2); // the copy has not run yet: it must see this
    gate.open();
    sync(s);
    assert!(read_back(d, n).iter().all(|&b| b == 2), "the copy read the pinned source early");
    destroy(s);
    pfree(h);
    dfree(d);
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn async_h2d_from_pageable_memory_is_staged_at_the_call() {
    bind(0);
    let n = 4096;
    let d = dalloc(n);
    let mut src = vec![1u8; n];
    let s = stream(0);
    let gate = Gate::block(s);
    // SAFETY: `src` has `n` bytes; pageable sources are staged before the call returns.
    ok(unsafe { cu::cuMemcpyHtoDAsync_v2(d, src.as_ptr().cast(), n, s) });
    src.fill(2);
    gate.open();
    sync(s);
    assert!(read_back(d, n).iter().all(|&b| b == 1));
    destroy(s);
    dfree(d);
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn async_d2h_into_pinned_is_stale_until_synchronised() {
    bind(0);
    let n = 1024;
    let d = dalloc(n);
    // SAFETY: plain FFI call on a live allocation.
    ok(unsafe { cu::cuMemsetD8_v2(d, 7, n) });
    let h = pinned(n);
    poke(h, n, 0);
    let s = stream(0);
    let gate = Gate::block(s);
    // SAFETY: `h` is pinned with `n` bytes.
    ok(unsafe { cu::cuMemcpyDtoHAsync_v2(h.cast(), d, n, s) });
    assert_eq!(query(s), CUresult::CUDA_ERROR_NOT_READY);
    settle();
    assert!(peek(h, n).iter().all(|&b| b == 0), "the copy ran before its turn");
    gate.open();
    sync(s);
    assert_eq!(query(s), CUresult::CUDA_SUCCESS);
    assert!(peek(h, n).iter().all(|&b| b == 7));
    destroy(s);
    pfree(h);
    dfree(d);
}

#[test]
#[parallel]
fn latency_alone_makes_a_missing_sync_visible() {
    bind(0);
    let n = 256;
    let d = dalloc(n);
    let h = pinned(n);
    poke(h, n, 0);
    let s = stream(NON_BLOCKING);
    let t0 = std::time::Instant::now();
    // SAFETY: live allocations of `n` bytes.
    unsafe {
        ok(cu::cuMemsetD8Async(d, 9, n, s));
        ok(cu::cuMemcpyDtoHAsync_v2(h.cast(), d, n, s));
    }
    // No synchronisation: with 200 µs of simulated latency nothing has landed yet. (If this
    // thread was descheduled for longer than the latency, the observation proves nothing.)
    let seen = peek(h, n);
    let pending = query(s);
    if t0.elapsed() < std::time::Duration::from_micros(150) {
        assert!(seen.iter().all(|&b| b == 0));
        assert_eq!(pending, CUresult::CUDA_ERROR_NOT_READY);
    }
    sync(s);
    assert!(peek(h, n).iter().all(|&b| b == 9));
    destroy(s);
    pfree(h);
    dfree(d);
}

#[test]
#[parallel]
fn stream_work_runs_in_fifo_order() {
    bind(0);
    static ORDER: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    extern "C" fn note(data: *mut c_void) {
        ORDER.lock().unwrap().push(data as usize);
    }
    let d = dalloc(4);
    let h = pinned(4);
    let s = stream(0);
    for i in 0..50u32 {
        // SAFETY: live allocations; `note` is valid to call with any integer.
        unsafe {
            ok(cu::cuMemsetD32Async(d, i, 1, s));
            ok(cu::cuLaunchHostFunc(s, Some(note), i as usize as *mut c_void));
        }
    }
    // SAFETY: `h` is pinned with 4 bytes.
    ok(unsafe { cu::cuMemcpyDtoHAsync_v2(h.cast(), d, 4, s) });
    sync(s);
    assert_eq!(u32::from_le_bytes(peek(h, 4).try_into().unwrap()), 49);
    assert_eq!(*ORDER.lock().unwrap(), (0..50).collect::<Vec<_>>());
    destroy(s);
    pfree(h);
    dfree(d);
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn stream_wait_event_orders_work_across_streams() {
    bind(0);
    let n = 512;
    let d = dalloc(n);
    let h = pinned(n);
    let h3 = pinned(n);
    poke(h, n, 0);
    let (s1, s2, s3) = (stream(NON_BLOCKING), stream(NON_BLOCKING), stream(NON_BLOCKING));
    // The fill must be complete before anything below is queued. A synchronous `cuMemsetD8` of
    // device memory would not do: it returns at once and runs on the legacy stream, which no
    // non-blocking stream is ordered against, and which waits for every blocking stream of the
    // context — other tests' gated ones included. Such a fill once landed after s1's memset and
    // before s2's copy (s2 copied 1s; see the test after this one).
    // SAFETY: live allocation.
    ok(unsafe { cu::cuMemsetD8Async(d, 1, n, s1) });
    sync(s1);
    let e = event(0);
    let gate = Gate::block(s1);
    // SAFETY: live allocations; handles from this test.
    unsafe {
        ok(cu::cuMemsetD8Async(d, 5, n, s1));
        ok(cu::cuEventRecord(e, s1));
        ok(cu::cuStreamWaitEvent(s2, e, 0));
        ok(cu::cuMemcpyDtoHAsync_v2(h.cast(), d, n, s2));
        // An unrelated stream is not held up.
        ok(cu::cuMemcpyDtoHAsync_v2(h3.cast(), d, n, s3));
        assert_eq!(cu::cuStreamWaitEvent(s2, e, 1), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    sync(s3);
    assert_eq!(query(s2), CUresult::CUDA_ERROR_NOT_READY);
    // SAFETY: plain FFI call.
    assert_eq!(unsafe { cu::cuEventQuery(e) }, CUresult::CUDA_ERROR_NOT_READY);
    settle();
    let early = peek(h, n);
    assert!(early.iter().all(|&b| b == 0), "s2 ran before the event it waits for: {:?}…", &early[..4]);
    gate.open();
    sync(s2);
    let seen = peek(h, n);
    assert!(seen.iter().all(|&b| b == 5), "s2 did not copy s1's memset: {:?}…", &seen[..4]);
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuEventQuery(e) });
    edestroy(e);
    for s in [s1, s2, s3] {
        destroy(s);
    }
    pfree(h);
    pfree(h3);
    dfree(d);
}

/// The trap behind a flaky run of the test above (issue 7, item 13): its fill was a synchronous
/// device memset, i.e. legacy-stream work, ordered only against *blocking* streams. An event
/// between two non-blocking streams does not order it. Here a blocking stream finishes right
/// after s1's memset, so the legacy fill becomes runnable between that memset and s2's copy;
/// the engine starts runnable work in the order it was queued (by default: `schedule=enqueued`;
/// under `schedule=reversed` this test's assertion does not hold), so the fill lands in that window
/// every time (a GPU may land it either side of the copy): s2 honours its wait and still copies
/// the fill's 1s. In the flaky run, another test's gated blocking stream played this part.
#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn legacy_stream_work_is_not_ordered_by_an_event_between_non_blocking_streams() {
    // Device 1: no other test of this binary queues work there, so nothing but `blocking`
    // holds the legacy fill back. The default schedule, whatever `CUMEM_SIM` says: the window
    // the fill lands in is the enqueue order's.
    let _schedule = Schedule::set(bind(1), "enqueued");
    let n = 512;
    let d = dalloc(n);
    let h = pinned(n);
    poke(h, n, 0);
    let (s1, s2, blocking) = (stream(NON_BLOCKING), stream(NON_BLOCKING), stream(0));
    let (mid, e) = (event(0), event(0));
    let gate = Gate::block(s1);
    // SAFETY: live allocations; handles from this test.
    unsafe {
        ok(cu::cuMemsetD8Async(d, 5, n, s1));
        ok(cu::cuEventRecord(mid, s1));
        ok(cu::cuStreamWaitEvent(blocking, mid, 0));
        ok(cu::cuMemsetD8_v2(d, 1, n)); // returns at once; waits for `blocking` only
        ok(cu::cuEventRecord(e, s1));
        ok(cu::cuStreamWaitEvent(s2, e, 0));
        ok(cu::cuMemcpyDtoHAsync_v2(h.cast(), d, n, s2));
    }
    gate.open();
    sync(s2);
    let seen = peek(h, n);
    assert!(seen.iter().all(|&b| b == 1), "s2 copied {:?}…, not the legacy fill", &seen[..4]);
    // The fill is ordered after `blocking`, hence after s1's memset: it is what remains.
    sync(std::ptr::null_mut());
    assert!(read_back(d, n).iter().all(|&b| b == 1));
    for ev in [mid, e] {
        edestroy(ev);
    }
    for s in [s1, s2, blocking] {
        destroy(s);
    }
    pfree(h);
    dfree(d);
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn legacy_stream_waits_for_blocking_streams_but_not_non_blocking_ones() {
    bind(0);
    let n = 256;
    let d = dalloc(n);
    let h = pinned(n);
    poke(h, n, 0);
    let blocking = stream(0);
    let free_running = stream(NON_BLOCKING);
    let gate = Gate::block(blocking);
    let null: CUstream = std::ptr::null_mut();
    // SAFETY: live allocations.
    unsafe {
        ok(cu::cuMemsetD8_v2(d, 3, n)); // device memset: queued on the legacy stream
        ok(cu::cuMemcpyDtoHAsync_v2(h.cast(), d, n, null));
        ok(cu::cuMemsetD8Async(d, 4, 1, free_running));
    }
    // The non-blocking stream is exempt from the legacy stream's implicit synchronisation.
    sync(free_running);
    assert_eq!(query(null), CUresult::CUDA_ERROR_NOT_READY);
    settle();
    assert!(peek(h, n).iter().all(|&b| b == 0), "legacy work overtook a blocking stream");
    gate.open();
    sync(null);
    assert!(peek(h, n).iter().all(|&b| b == 3));

    // And the other way: blocking streams wait for prior legacy-stream work.
    poke(h, n, 0);
    let legacy_gate = Gate::block(null);
    // SAFETY: live allocations.
    unsafe {
        ok(cu::cuMemcpyDtoHAsync_v2(h.cast(), d, n, blocking));
        ok(cu::cuMemsetD8Async(d, 4, 1, free_running));
    }
    sync(free_running);
    settle();
    assert!(peek(h, n).iter().all(|&b| b == 0), "a blocking stream overtook the legacy stream");
    legacy_gate.open();
    sync(blocking);
    assert_eq!(peek(h, 2), vec![4, 3]);
    destroy(blocking);
    destroy(free_running);
    pfree(h);
    dfree(d);
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn sync_copies_wait_but_device_to_device_returns_immediately() {
    bind(0);
    let n = 128;
    let a = dalloc(n);
    let b = dalloc(n);
    let blocking = stream(0);
    let gate = Gate::block(blocking);
    // SAFETY: live allocations.
    unsafe {
        ok(cu::cuMemsetD8_v2(a, 6, n));
        ok(cu::cuMemcpyDtoD_v2(b, a, n)); // returns although the legacy stream is held up
    }
    assert_eq!(query(std::ptr::null_mut()), CUresult::CUDA_ERROR_NOT_READY);
    gate.open();
    // A synchronous device-to-host copy returns only when the data has arrived.
    assert!(read_back(b, n).iter().all(|&x| x == 6));
    destroy(blocking);
    dfree(a);
    dfree(b);
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn event_query_synchronize_and_elapsed_time_rules() {
    bind(0);
    let (start, end) = (event(0), event(0));
    let never = event(0);
    let untimed = event(2);
    let mut ms = -1.0f32;
    // SAFETY: valid pointers and handles throughout.
    unsafe {
        ok(cu::cuEventQuery(never));
        ok(cu::cuEventSynchronize(never));
        assert_eq!(cu::cuEventElapsedTime(&mut ms, never, end), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(cu::cuEventQuery(std::ptr::null_mut()), CUresult::CUDA_ERROR_INVALID_HANDLE);
        let mut bad: CUevent = std::ptr::null_mut();
        assert_eq!(cu::cuEventCreate(&mut bad, 4), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuEventCreate(&mut bad, 8), CUresult::CUDA_ERROR_INVALID_VALUE);

        // Non-blocking: a blocking stream would also wait for other tests' legacy-stream work.
        let s = stream(NON_BLOCKING);
        ok(cu::cuEventRecord(start, s));
        // `start` completes before the 5 ms below begin. (Without this, a loaded machine could
        // run its marker late, well into the 5 ms, and the elapsed time came out shorter.)
        ok(cu::cuEventSynchronize(start));
        let gate = Gate::block(s);
        ok(cu::cuEventRecord(end, s));
        ok(cu::cuEventRecord(untimed, s));
        assert_eq!(cu::cuEventQuery(end), CUresult::CUDA_ERROR_NOT_READY);
        assert_eq!(cu::cuEventElapsedTime(&mut ms, start, end), CUresult::CUDA_ERROR_NOT_READY);
        assert_eq!(ms, -1.0);
        std::thread::sleep(std::time::Duration::from_millis(5));
        gate.open();
        ok(cu::cuEventSynchronize(end));
        ok(cu::cuEventElapsedTime(&mut ms, start, end));
        // `end` ran after the gate opened, which was at least 5 ms after `start` had run.
        assert!(ms >= 5.0, "elapsed {ms} ms must span the 5 ms the gate was closed");
        ok(cu::cuEventElapsedTime_v2(&mut ms, start, end));
        assert_eq!(cu::cuEventElapsedTime(&mut ms, start, untimed), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(
            cu::cuEventElapsedTime(std::ptr::null_mut(), start, end),
            CUresult::CUDA_ERROR_INVALID_HANDLE
        );
        ok(cu::cuEventRecordWithFlags(start, s, 0));
        assert_eq!(cu::cuEventRecordWithFlags(start, s, 1), CUresult::CUDA_ERROR_INVALID_VALUE);
        ok(cu::cuEventSynchronize(start));
        // Destroying a pending event is allowed; the handle is dead at once.
        let gate = Gate::block(s);
        ok(cu::cuEventRecord(never, s));
        ok(cu::cuEventDestroy_v2(never));
        assert_eq!(cu::cuEventQuery(never), CUresult::CUDA_ERROR_INVALID_HANDLE);
        drop(gate);
        sync(s);
        destroy(s);
    }
    for e in [start, end, untimed] {
        edestroy(e);
    }
}

#[test]
#[parallel]
fn host_functions_cannot_call_the_api() {
    bind(0);
    static SEEN: Mutex<Vec<CUresult>> = Mutex::new(Vec::new());
    extern "C" fn reenter(_: *mut c_void) {
        let mut p = 0u64;
        // SAFETY: valid out-pointer; the simulator refuses the call.
        let r = unsafe { cu::cuMemAlloc_v2(&mut p, 16) };
        let mut cur: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: as above.
        let r2 = unsafe { cu::cuCtxGetCurrent(&mut cur) };
        SEEN.lock().unwrap().extend([r, r2]);
    }
    let s = stream(0);
    // SAFETY: `reenter` is valid to call with any pointer.
    unsafe {
        ok(cu::cuLaunchHostFunc(s, Some(reenter), std::ptr::null_mut()));
        assert_eq!(cu::cuLaunchHostFunc(s, None, std::ptr::null_mut()), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    sync(s);
    assert_eq!(*SEEN.lock().unwrap(), vec![CUresult::CUDA_ERROR_NOT_PERMITTED; 2]);
    destroy(s);
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn destroyed_streams_drain_and_their_handles_die() {
    let ctl = bind(0);
    let d = dalloc(64);
    let s = stream(0);
    assert!(ctl.live_report().contains_stream(s as u64));
    let gate = Gate::block(s);
    // SAFETY: live allocation; then the destroyed handle is the misuse under test.
    unsafe {
        ok(cu::cuMemsetD8Async(d, 8, 64, s));
        ok(cu::cuStreamDestroy_v2(s));
        assert_eq!(cu::cuStreamQuery(s), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(cu::cuMemsetD8Async(d, 9, 64, s), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(cu::cuStreamDestroy_v2(std::ptr::null_mut()), CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    assert!(!ctl.live_report().contains_stream(s as u64));
    gate.open();
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuCtxSynchronize() });
    assert!(read_back(d, 64).iter().all(|&b| b == 8));
    dfree(d);
}

#[test]
#[parallel]
fn per_thread_stream_and_stream_properties() {
    bind(0);
    let per_thread = 0x2 as CUstream;
    let legacy = 0x1 as CUstream;
    let d = dalloc(16);
    // SAFETY: valid pointers and handles.
    unsafe {
        ok(cu::cuMemsetD8Async(d, 2, 16, per_thread));
        ok(cu::cuStreamSynchronize(per_thread));
        ok(cu::cuStreamSynchronize(legacy));
        let mut s: CUstream = std::ptr::null_mut();
        ok(cu::cuStreamCreateWithPriority(&mut s, NON_BLOCKING, -100));
        let (mut prio, mut flags) = (0, 0u32);
        ok(cu::cuStreamGetPriority(s, &mut prio));
        ok(cu::cuStreamGetFlags(s, &mut flags));
        assert_eq!((prio, flags), (-5, NON_BLOCKING));
        let mut ctx: cu::CUcontext = std::ptr::null_mut();
        let mut cur: cu::CUcontext = std::ptr::null_mut();
        ok(cu::cuStreamGetCtx(s, &mut ctx));
        ok(cu::cuCtxGetCurrent(&mut cur));
        assert_eq!(ctx, cur);
        assert_eq!(cu::cuStreamCreate(&mut s, 2), CUresult::CUDA_ERROR_INVALID_VALUE);
        ok(cu::cuStreamGetPriority(s, &mut prio));
        destroy(s);
    }
    assert!(read_back(d, 16).iter().all(|&b| b == 2));
    dfree(d);
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn copies_that_become_ready_together_keep_stream_and_legacy_order() {
    bind(0);
    const N: usize = 300;
    let d1 = dalloc(4);
    let d2 = dalloc(4);
    let scratch = dalloc(1);
    let src = pinned(4);
    let out = pinned(4);
    let slots = pinned(N);
    poke(src, 4, 7);
    poke(out, 4, 0);
    poke(slots, N, 0xff);
    let blocking = stream(0);
    let null: CUstream = std::ptr::null_mut();
    // Everything below is queued behind the gate, so it all becomes ready at once when the gate
    // opens and the engine takes it together: each copy must still see the one before it.
    let gate = Gate::block(blocking);
    // SAFETY: live allocations of the sizes given; synchronised before they are read or freed.
    unsafe {
        for i in 0..N {
            ok(cu::cuMemsetD8Async(scratch, i as u8, 1, blocking));
            ok(cu::cuMemcpyDtoHAsync_v2(slots.add(i).cast(), scratch, 1, blocking));
        }
        ok(cu::cuMemcpyHtoDAsync_v2(d1, src.cast(), 4, blocking));
        // Queued on the legacy stream: after the blocking stream's copy above, by the legacy rules
        // alone (no event between them).
        ok(cu::cuMemcpyDtoDAsync_v2(d2, d1, 4, null));
        // And back on the blocking stream: after the legacy stream's copy.
        ok(cu::cuMemcpyDtoHAsync_v2(out.cast(), d2, 4, blocking));
    }
    gate.open();
    sync(blocking);
    assert_eq!(peek(out, 4), vec![7; 4], "a copy ran before the copy it depends on");
    let seen = peek(slots, N);
    assert!(
        seen.iter().enumerate().all(|(i, &b)| b == i as u8),
        "copies on one stream ran out of order: {seen:?}"
    );
    destroy(blocking);
    pfree(slots);
    pfree(out);
    pfree(src);
    dfree(scratch);
    dfree(d2);
    dfree(d1);
}
