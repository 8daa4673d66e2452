//! `schedule`: which of several independent streams' ready operations the engine starts first
//! (`enqueued`: the oldest, `reversed`: the newest), and that dependencies order work under
//! either. Every test sets the schedule it needs, whatever the process was configured with.

mod common;

use std::ffi::c_void;
use std::sync::Mutex;

use common::*;
use cudarc::driver::sys::{self as cu, CUevent, CUstream};
use serial_test::serial;

const NON_BLOCKING: u32 = 1;

/// The streams' numbers, in the order their host functions ran.
static ORDER: Mutex<Vec<usize>> = Mutex::new(Vec::new());

extern "C" fn note(data: *mut c_void) {
    ORDER.lock().unwrap().push(data as usize);
}

fn event() -> CUevent {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuEventCreate(&mut e, 0) });
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

fn word(d: cu::CUdeviceptr) -> u32 {
    u32::from_le_bytes(read_back(d, 4).try_into().unwrap())
}

/// Work queued while a gate holds it back, so that everything is ready when the gate opens and
/// only the schedule decides the order: a gated stream records `start`; the caller's `queue`
/// makes the other streams wait for `start` and queue their work.
struct Start {
    gated: CUstream,
    start: CUevent,
    gate: Gate,
}

impl Start {
    fn new() -> Start {
        let gated = stream(NON_BLOCKING);
        let gate = Gate::block(gated);
        let start = event();
        // SAFETY: handles from this test.
        ok(unsafe { cu::cuEventRecord(start, gated) });
        Start { gated, start, gate }
    }

    /// Makes `s` wait for the start.
    fn after(&self, s: CUstream) {
        // SAFETY: handles from this test.
        ok(unsafe { cu::cuStreamWaitEvent(s, self.start, 0) });
    }

    /// Lets everything run once it is past its latency.
    fn open(self) {
        settle();
        self.gate.open();
        sync(self.gated);
        edestroy(self.start);
        destroy(self.gated);
    }
}

/// Three non-blocking streams, each waiting for one start and then setting one device word to
/// its number and running a host function naming it, with nothing ordering them among
/// themselves. Returns the host functions' order and the word's final value.
fn race(schedule: &str) -> (Vec<usize>, u32) {
    let ctl = bind(0);
    ctl.configure(&format!("schedule={schedule}")).unwrap();
    ORDER.lock().unwrap().clear();
    let d = dalloc(4);
    let start = Start::new();
    let streams: Vec<CUstream> = (0..3).map(|_| stream(NON_BLOCKING)).collect();
    for &s in &streams {
        start.after(s);
    }
    for (i, &s) in streams.iter().enumerate() {
        let n = i + 1;
        // SAFETY: a live 4-byte allocation; `note` is valid to call with any integer.
        unsafe {
            ok(cu::cuMemsetD32Async(d, n as u32, 1, s));
            ok(cu::cuLaunchHostFunc(s, Some(note), n as *mut c_void));
        }
    }
    start.open();
    for &s in &streams {
        sync(s);
        destroy(s);
    }
    let last = word(d);
    dfree(d);
    assert!(ctl.live_report().is_clean(), "{}", ctl.live_report());
    (std::mem::take(&mut *ORDER.lock().unwrap()), last)
}

/// By default independent streams' ready work runs in enqueue order (a GPU does not promise
/// this); `reversed` runs the newest ready head first, so the same unordered program ends with
/// the other stream's write and the host functions in the opposite order.
#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn independent_streams_run_oldest_first_by_default_and_newest_first_reversed() {
    assert_eq!(race("enqueued"), (vec![1, 2, 3], 3));
    assert_eq!(race("reversed"), (vec![3, 2, 1], 1));
    assert_eq!(race("enqueued"), (vec![1, 2, 3], 3), "the schedule changes back at run time");
}

/// Under `reversed` an event wait still orders the streams: the newer stream's write waits for
/// the older one's, and lands last, where without the wait it lands first (the race above).
#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn an_event_wait_still_orders_streams_under_reversed() {
    let ctl = bind(0);
    ctl.configure("schedule=reversed").unwrap();
    let d = dalloc(4);
    let start = Start::new();
    let (older, newer) = (stream(NON_BLOCKING), stream(NON_BLOCKING));
    let done = event();
    start.after(older);
    start.after(newer);
    // SAFETY: a live 4-byte allocation; handles from this test.
    unsafe {
        ok(cu::cuMemsetD32Async(d, 1, 1, older));
        ok(cu::cuEventRecord(done, older));
        ok(cu::cuStreamWaitEvent(newer, done, 0));
        ok(cu::cuMemsetD32Async(d, 2, 1, newer));
    }
    start.open();
    sync(newer);
    assert_eq!(word(d), 2, "the waiting stream's write ran before the one it waits for");
    sync(older);
    edestroy(done);
    destroy(older);
    destroy(newer);
    dfree(d);
    ctl.configure("schedule=enqueued").unwrap();
    assert!(ctl.live_report().is_clean(), "{}", ctl.live_report());
}

/// A stream's own operations stay in FIFO order under `reversed`: only the choice among
/// different streams' heads changes.
#[test]
#[serial] // changes the schedule of the whole process
fn one_streams_work_stays_in_order_under_reversed() {
    let ctl = bind(0);
    ctl.configure("schedule=reversed").unwrap();
    ORDER.lock().unwrap().clear();
    let s = stream(NON_BLOCKING);
    for i in 0..20usize {
        // SAFETY: `note` is valid to call with any integer.
        ok(unsafe { cu::cuLaunchHostFunc(s, Some(note), i as *mut c_void) });
    }
    sync(s);
    destroy(s);
    ctl.configure("schedule=enqueued").unwrap();
    assert_eq!(std::mem::take(&mut *ORDER.lock().unwrap()), (0..20).collect::<Vec<_>>());
    assert!(ctl.live_report().is_clean(), "{}", ctl.live_report());
}
