//! `cuEventElapsedTime` (and `_v2`): one test per result code, matched by value against what an
//! H100 returned (§17 of the driver reference) or, where §17 is silent, the documented contract.
//! Every failing call must leave `*pMilliseconds` untouched.

mod common;

use common::*;
use cudarc::driver::sys::{self as cu, CUevent, CUresult, CUstream};
use serial_test::{parallel, serial};

const NON_BLOCKING: u32 = 1;
const DISABLE_TIMING: u32 = 2;
const UNTOUCHED: f32 = -123.0;

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

fn record(e: CUevent, s: CUstream) {
    // SAFETY: plain FFI call on live handles.
    ok(unsafe { cu::cuEventRecord(e, s) });
}

fn esync(e: CUevent) {
    // SAFETY: plain FFI call on a live handle.
    ok(unsafe { cu::cuEventSynchronize(e) });
}

/// Both entry points' answers for `(start, end)`, each with what it left in the out-value.
fn elapsed(start: CUevent, end: CUevent) -> [(CUresult, f32); 2] {
    let (mut a, mut b) = (UNTOUCHED, UNTOUCHED);
    // SAFETY: valid out-pointers; the handles may be dead or NULL, which is what is under test.
    unsafe {
        [(cu::cuEventElapsedTime(&mut a, start, end), a), (cu::cuEventElapsedTime_v2(&mut b, start, end), b)]
    }
}

/// Two timed events recorded one after the other on a fresh stream and complete.
fn completed_pair() -> (CUevent, CUevent, CUstream) {
    let s = stream(NON_BLOCKING);
    let (start, end) = (event(0), event(0));
    record(start, s);
    record(end, s);
    esync(end);
    (start, end, s)
}

fn release(events: &[CUevent], s: CUstream) {
    for &e in events {
        edestroy(e);
    }
    destroy(s);
}

#[test]
#[parallel]
fn complete_events_give_success_and_a_non_negative_time() {
    bind(0);
    let (start, end, s) = completed_pair();
    for (r, ms) in elapsed(start, end) {
        assert_eq!(r, CUresult::CUDA_SUCCESS);
        assert!(ms >= 0.0, "end completed after start: {ms}");
    }
    release(&[start, end], s);
}

#[test]
#[parallel]
fn the_same_event_twice_gives_zero() {
    bind(0);
    let (start, end, s) = completed_pair();
    assert_eq!(elapsed(start, start), [(CUresult::CUDA_SUCCESS, 0.0); 2]);
    release(&[start, end], s);
}

#[test]
#[parallel]
fn a_null_out_pointer_is_invalid_handle() {
    bind(0);
    let (start, end, s) = completed_pair();
    // SAFETY: NULL out-pointer is the misuse under test; the handles are live.
    unsafe {
        assert_eq!(
            cu::cuEventElapsedTime(std::ptr::null_mut(), start, end),
            CUresult::CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(
            cu::cuEventElapsedTime_v2(std::ptr::null_mut(), start, end),
            CUresult::CUDA_ERROR_INVALID_HANDLE
        );
    }
    release(&[start, end], s);
}

#[test]
#[parallel]
fn a_disable_timing_event_is_invalid_handle_in_either_place() {
    bind(0);
    let (start, end, s) = completed_pair();
    let untimed = event(DISABLE_TIMING);
    record(untimed, s);
    esync(untimed);
    let refused = [(CUresult::CUDA_ERROR_INVALID_HANDLE, UNTOUCHED); 2];
    assert_eq!(elapsed(start, untimed), refused);
    assert_eq!(elapsed(untimed, end), refused);
    assert_eq!(elapsed(untimed, untimed), refused);
    release(&[start, end, untimed], s);
}

#[test]
#[serial] // holds a stream with a gate: a free elsewhere (implicit synchronisation) would wait for it
fn a_never_recorded_event_is_invalid_handle_even_beside_a_pending_one() {
    bind(0);
    let (start, end, s) = completed_pair();
    let never = event(0);
    let refused = [(CUresult::CUDA_ERROR_INVALID_HANDLE, UNTOUCHED); 2];
    assert_eq!(elapsed(never, end), refused);
    assert_eq!(elapsed(start, never), refused);
    // The other event's recording is not complete: the missing recording still decides.
    let gate = Gate::block(s);
    let pending = event(0);
    record(pending, s);
    assert_eq!(elapsed(never, pending), refused);
    assert_eq!(elapsed(pending, never), refused);
    gate.open();
    esync(pending);
    release(&[start, end, never, pending], s);
}

#[test]
#[serial] // holds a stream with a gate: a free elsewhere (implicit synchronisation) would wait for it
fn a_recording_not_yet_complete_is_not_ready_then_success() {
    bind(0);
    let (start, end, s) = completed_pair();
    let gate = Gate::block(s);
    // Re-recording `end` behind the gate: only the latest recording counts.
    record(end, s);
    assert_eq!(elapsed(start, end), [(CUresult::CUDA_ERROR_NOT_READY, UNTOUCHED); 2]);
    assert_eq!(elapsed(end, start), [(CUresult::CUDA_ERROR_NOT_READY, UNTOUCHED); 2]);
    gate.open();
    esync(end);
    for (r, ms) in elapsed(start, end) {
        assert_eq!(r, CUresult::CUDA_SUCCESS);
        assert!(ms >= 0.0, "{ms}");
    }
    release(&[start, end], s);
}

#[test]
#[parallel]
fn dead_and_null_handles_are_invalid_handle() {
    bind(0);
    let (start, end, s) = completed_pair();
    let dead = event(0);
    record(dead, s);
    esync(dead);
    edestroy(dead);
    let refused = [(CUresult::CUDA_ERROR_INVALID_HANDLE, UNTOUCHED); 2];
    assert_eq!(elapsed(dead, end), refused);
    assert_eq!(elapsed(start, dead), refused);
    assert_eq!(elapsed(std::ptr::null_mut(), end), refused);
    assert_eq!(elapsed(start, std::ptr::null_mut()), refused);
    release(&[start, end], s);
}

#[test]
#[parallel]
fn events_of_different_contexts_are_invalid_handle() {
    bind(1);
    let other_stream = stream(NON_BLOCKING);
    let other = event(0);
    record(other, other_stream);
    esync(other);
    bind(0);
    let (start, end, s) = completed_pair();
    let refused = [(CUresult::CUDA_ERROR_INVALID_HANDLE, UNTOUCHED); 2];
    assert_eq!(elapsed(start, other), refused);
    assert_eq!(elapsed(other, end), refused);
    release(&[start, end], s);
    bind(1);
    release(&[other], other_stream);
}
