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
    let _schedule = Schedule::set(bind(0), schedule);
    race_as_configured()
}

/// [`race`] on the schedule in force.
fn race_as_configured() -> (Vec<usize>, u32) {
    let ctl = bind(0);
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

/// A test that fails while it holds another schedule leaves the process on the one it was
/// configured with (`CUMEM_SIM`'s, else `enqueued`): the next test runs on that.
#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn a_failing_test_puts_the_configured_schedule_back() {
    let ctl = bind(0);
    let reversed = configured_schedule() == "reversed";
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _schedule = Schedule::set(ctl, if reversed { "enqueued" } else { "reversed" });
        panic!("a failing assertion while the other schedule is set (expected)");
    }));
    assert!(failed.is_err());
    let expected = if reversed { (vec![3, 2, 1], 1) } else { (vec![1, 2, 3], 3) };
    assert_eq!(race_as_configured(), expected);
}

/// Under `reversed` an event wait still orders the streams: the newer stream's write waits for
/// the older one's, and lands last, where without the wait it lands first (the race above).
#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn an_event_wait_still_orders_streams_under_reversed() {
    let ctl = bind(0);
    let schedule = Schedule::set(ctl, "reversed");
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
    drop(schedule);
    assert!(ctl.live_report().is_clean(), "{}", ctl.live_report());
}

/// A stream's own operations stay in FIFO order under `reversed`: only the choice among
/// different streams' heads changes. Three streams with their host functions queued interleaved
/// (stream 0's first, stream 1's first, stream 2's first, stream 0's second, …) all become ready
/// at once when the start opens: the engine picks the newest head, so the first host function to
/// run is the last stream's first one and the first three run in the reverse of their enqueue
/// order (the engine dispatches them in one look, before any of them returns); after that the
/// interleaving depends on when each returns, but each stream's own notes stay in order.
#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn each_streams_work_stays_in_order_under_reversed() {
    const STREAMS: usize = 3;
    const EACH: usize = 8;
    let ctl = bind(0);
    let schedule = Schedule::set(ctl, "reversed");
    ORDER.lock().unwrap().clear();
    let start = Start::new();
    let streams: Vec<CUstream> = (0..STREAMS).map(|_| stream(NON_BLOCKING)).collect();
    for &s in &streams {
        start.after(s);
    }
    for i in 0..EACH {
        for (n, &s) in streams.iter().enumerate() {
            // SAFETY: `note` is valid to call with any integer.
            ok(unsafe { cu::cuLaunchHostFunc(s, Some(note), (n * 100 + i) as *mut c_void) });
        }
    }
    start.open();
    for &s in &streams {
        sync(s);
        destroy(s);
    }
    drop(schedule);
    let order = std::mem::take(&mut *ORDER.lock().unwrap());
    assert_eq!(order.len(), STREAMS * EACH, "{order:?}");
    for n in 0..STREAMS {
        let own: Vec<usize> = order.iter().filter(|&&v| v / 100 == n).map(|&v| v % 100).collect();
        assert_eq!(own, (0..EACH).collect::<Vec<_>>(), "stream {n} out of order: {order:?}");
    }
    assert_eq!(order[..STREAMS], [200, 100, 0], "the newest ready head runs first: {order:?}");
    assert!(ctl.live_report().is_clean(), "{}", ctl.live_report());
}
