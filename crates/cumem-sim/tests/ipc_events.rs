//! Interprocess events across two processes (this binary re-executed, running one `child_*` test):
//! a stream wait on another process's recording is queued on the stream and returns at once, as
//! the driver queues it, so a handshake after it cannot deadlock; a wait captures one recording and
//! is not released by a later recording that completes first; an importer's recording is seen by
//! the exporter's query, synchronize and stream waits; an imported event destroyed under a pending
//! wait still releases it; a stream wait and a recording held up by another process's incomplete
//! recording each say so once on stderr and go on waiting; imported events are in the live report,
//! and both reports end clean.
//!
//! The order of events is set by socket handshakes, stream gates and queries, never by timing.
//! Nothing the parent waits for can hang it: a child that has not connected, a socket read, the
//! parent's own waiting simulator calls (run on a helper thread) and the child's exit each fail the
//! test once they have waited far longer than any step needs, and the parent kills its child when
//! it fails.

mod common;

use std::ffi::c_void;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};

use common::child_process::{ChildTest, WATCHDOG, connect_to_parent, expect};
use common::*;
use cudarc::driver::sys::{self as cu, CUevent, CUipcEventHandle, CUresult, CUstream};
use serial_test::serial;

const CHILD_ENV: &str = "CUMEM_SIM_IPC_EVENTS_CHILD";
/// `CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS`.
const IPC_FLAGS: u32 = 2 | 4;
const NON_BLOCKING: u32 = 1;
const N: usize = 64;
/// Recordings of one interprocess event that may be incomplete at once: the shared page's slots.
const PAGE_SLOTS: usize = 510;

/// Host functions run in this process (each process has its own count).
static HOST_FN_RUNS: AtomicU32 = AtomicU32::new(0);

extern "C" fn count_run(_: *mut c_void) {
    HOST_FN_RUNS.fetch_add(1, Ordering::SeqCst);
}

fn runs() -> u32 {
    HOST_FN_RUNS.load(Ordering::SeqCst)
}

fn launch_count(s: CUstream) {
    // SAFETY: `count_run` ignores its argument and may run on any thread.
    ok(unsafe { cu::cuLaunchHostFunc(s, Some(count_run), std::ptr::null_mut()) });
}

fn ipc_event() -> CUevent {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuEventCreate(&mut e, IPC_FLAGS) });
    e
}

fn export(e: CUevent) -> [u8; 64] {
    let mut h = CUipcEventHandle { reserved: [0; 64] };
    // SAFETY: valid out-pointer and live event.
    ok(unsafe { cu::cuIpcGetEventHandle(&mut h, e) });
    h.reserved.map(|c| c as u8)
}

fn import(bytes: &[u8; 64]) -> CUevent {
    let mut e: CUevent = std::ptr::null_mut();
    let h = CUipcEventHandle { reserved: bytes.map(|b| b as std::ffi::c_char) };
    // SAFETY: valid out-pointer; the handle is passed by value.
    ok(unsafe { cu::cuIpcOpenEventHandle(&mut e, h) });
    e
}

fn record(e: CUevent, s: CUstream) {
    // SAFETY: live event and stream.
    ok(unsafe { cu::cuEventRecord(e, s) });
}

fn wait(s: CUstream, e: CUevent) {
    // SAFETY: live stream and event.
    ok(unsafe { cu::cuStreamWaitEvent(s, e, 0) });
}

fn query_event(e: CUevent) -> CUresult {
    // SAFETY: live event.
    unsafe { cu::cuEventQuery(e) }
}

fn query_stream(s: CUstream) -> CUresult {
    // SAFETY: live stream.
    unsafe { cu::cuStreamQuery(s) }
}

fn sync_event(e: CUevent) {
    // SAFETY: live event.
    ok(unsafe { cu::cuEventSynchronize(e) });
}

fn sync_stream(s: CUstream) {
    // SAFETY: live stream.
    ok(unsafe { cu::cuStreamSynchronize(s) });
}

fn destroy_event(e: CUevent) {
    // SAFETY: live event, destroyed once.
    ok(unsafe { cu::cuEventDestroy_v2(e) });
}

/// Runs `f`, a simulator call of the parent that waits, on a helper thread, and fails the test if it
/// has not returned within [`WATCHDOG`]: a lost wakeup in the simulator would otherwise hang the
/// parent, and CI with it (the stuck thread is left behind; the failed test ends the binary).
fn within(what: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        bind(0);
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(WATCHDOG) {
        Ok(()) => {}
        Err(RecvTimeoutError::Timeout) => panic!("{what} did not return within {WATCHDOG:?}"),
        Err(RecvTimeoutError::Disconnected) => panic!("{what} failed (see the helper thread's panic)"),
    }
}

/// `cuEventSynchronize` in the parent, under the watchdog.
fn watched_sync_event(e: CUevent) {
    let e = e as usize;
    within("cuEventSynchronize", move || sync_event(e as CUevent));
}

/// `cuStreamSynchronize` in the parent, under the watchdog.
fn watched_sync_stream(s: CUstream) {
    let s = s as usize;
    within("cuStreamSynchronize", move || sync_stream(s as CUstream));
}

fn note(sock: &mut UnixStream, what: &[u8; 1]) {
    sock.write_all(what).unwrap();
}

fn receive_handle(sock: &mut UnixStream) -> [u8; 64] {
    let mut raw = [0u8; 64];
    sock.read_exact(&mut raw).unwrap();
    raw
}

/// The parent records on a gated stream; the child's stream wait on that recording returns at
/// once (a wait that blocked the calling thread would never let the child tell the parent to open
/// the gate), holds back the child's later work until the parent's recording completes, and is
/// still released when the child destroyed its imported event meanwhile. Then the other way round:
/// the child records its import on a gated stream, and the exporter's query, stream wait and
/// synchronize follow that recording.
#[test]
#[serial] // gates hold streams (see `Gate`)
fn wait_on_another_process_recording_is_queued() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let ctl = bind(0);
    let ev = ipc_event();
    let s = stream(NON_BLOCKING);
    let gate = Gate::block(s);
    record(ev, s);
    assert_eq!(query_event(ev), CUresult::CUDA_ERROR_NOT_READY);
    let (reap, mut sock) = ChildTest::spawn("child_queues_wait", CHILD_ENV);
    sock.write_all(&export(ev)).unwrap();
    // The child has queued its wait and work behind it, and returned.
    expect(&mut sock, b"Q");
    gate.open();
    watched_sync_event(ev);
    note(&mut sock, b"G");

    // The child records its import on a gated stream: the exporter sees that recording.
    expect(&mut sock, b"R");
    assert_eq!(query_event(ev), CUresult::CUDA_ERROR_NOT_READY, "the importer's recording is pending");
    let before = runs();
    wait(s, ev);
    launch_count(s);
    assert_eq!(query_stream(s), CUresult::CUDA_ERROR_NOT_READY);
    assert_eq!(runs(), before, "work behind a wait on a pending recording ran");
    note(&mut sock, b"O");
    expect(&mut sock, b"D");
    watched_sync_event(ev);
    ok(query_event(ev));
    watched_sync_stream(s);
    assert_eq!(runs(), before + 1);
    note(&mut sock, b"E");
    reap.finish();
    destroy_event(ev);
    destroy(s);
    assert!(ctl.live_report().is_clean(), "{}", ctl.live_report());
}

#[test]
#[serial]
fn child_queues_wait() {
    let Some(mut sock) = connect_to_parent(CHILD_ENV) else {
        return;
    };
    let ctl = bind(0);
    let handle = receive_handle(&mut sock);
    let ev = import(&handle);
    assert!(ctl.live_report().contains_event(ev as u64), "an imported event is live: {}", ctl.live_report());
    assert_eq!(query_event(ev), CUresult::CUDA_ERROR_NOT_READY, "the exporter's recording is gated");
    let t = stream(NON_BLOCKING);
    wait(t, ev);
    launch_count(t);
    assert_eq!(query_stream(t), CUresult::CUDA_ERROR_NOT_READY);
    assert_eq!(runs(), 0, "work behind the wait ran before the recording completed");
    // The queued wait outlives its event's handle, as the captured recording does.
    destroy_event(ev);
    assert!(!ctl.live_report().contains_event(ev as u64));
    note(&mut sock, b"Q");
    expect(&mut sock, b"G");
    sync_stream(t);
    assert_eq!(runs(), 1);

    // Recording an imported event: the exporter waits for it.
    let ev2 = import(&handle);
    let u = stream(NON_BLOCKING);
    let gate = Gate::block(u);
    record(ev2, u);
    note(&mut sock, b"R");
    expect(&mut sock, b"O");
    gate.open();
    sync_stream(u);
    ok(query_event(ev2));
    note(&mut sock, b"D");
    expect(&mut sock, b"E");
    destroy_event(ev2);
    destroy(t);
    destroy(u);
    assert!(ctl.live_report().is_clean(), "{}", ctl.live_report());
}

/// Recording 1 (parent, gated) completes after recording 2 (child): the child's wait on 1 is not
/// released when 2 completes, only when 1 does.
#[test]
#[serial] // gates hold streams (see `Gate`)
fn a_later_recording_completing_first_does_not_release_a_wait() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let ctl = bind(0);
    let ev = ipc_event();
    let s = stream(NON_BLOCKING);
    let gate = Gate::block(s);
    record(ev, s);
    let (reap, mut sock) = ChildTest::spawn("child_out_of_order", CHILD_ENV);
    sock.write_all(&export(ev)).unwrap();
    expect(&mut sock, b"C");
    // The child's recording completed; the parent's is still gated.
    ok(query_event(ev));
    assert_eq!(query_stream(s), CUresult::CUDA_ERROR_NOT_READY);
    gate.open();
    watched_sync_stream(s);
    note(&mut sock, b"G");
    expect(&mut sock, b"E");
    reap.finish();
    destroy_event(ev);
    destroy(s);
    assert!(ctl.live_report().is_clean(), "{}", ctl.live_report());
}

#[test]
#[serial]
fn child_out_of_order() {
    let Some(mut sock) = connect_to_parent(CHILD_ENV) else {
        return;
    };
    let ctl = bind(0);
    let ev = import(&receive_handle(&mut sock));
    let host = pinned(N);
    poke(host, N, 0);
    let (t, u) = (stream(NON_BLOCKING), stream(NON_BLOCKING));
    // Captures the parent's recording (1), still gated there.
    wait(t, ev);
    // SAFETY: `host` is pinned memory of N bytes, device-accessible.
    ok(unsafe { cu::cuMemsetD8Async(host as cu::CUdeviceptr, 0x5A, N, t) });
    // Recording 2 completes first.
    record(ev, u);
    sync_event(ev);
    ok(query_event(ev));
    // Work queued after the wait's memset, on another stream, has run by the time `u` is
    // synchronized; the engine would have run the memset first had the wait been released.
    // SAFETY: as above, a disjoint byte range would do; the same bytes make the order visible.
    ok(unsafe { cu::cuMemsetD8Async(host as cu::CUdeviceptr + N as u64 / 2, 0x11, N / 2, u) });
    sync_stream(u);
    assert_eq!(query_stream(t), CUresult::CUDA_ERROR_NOT_READY, "the wait on recording 1 was released");
    let seen = peek(host, N);
    assert_eq!(&seen[..N / 2], &[0u8; N / 2][..], "the memset behind the wait ran");
    assert_eq!(&seen[N / 2..], &[0x11u8; N / 2][..]);
    note(&mut sock, b"C");
    expect(&mut sock, b"G");
    sync_stream(t);
    let seen = peek(host, N);
    assert_eq!(seen, vec![0x5A; N], "the memset behind the wait ran after recording 1");
    note(&mut sock, b"E");
    destroy_event(ev);
    destroy(t);
    destroy(u);
    pfree(host);
    assert!(ctl.live_report().is_clean(), "{}", ctl.live_report());
}

/// The lines `r` yields, from a reader thread, each also copied to this process's stderr.
fn lines(r: impl Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            eprintln!("child: {line}");
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The child's waits for the parent's gated recording 1 cannot end while the gate is shut: its
/// queued stream wait, and (with `PAGE_SLOTS` recordings incomplete) its next `cuEventRecord`. Each
/// says so once on stderr, naming recording 1, and goes on waiting; opening the gate ends both.
#[test]
#[serial] // gates hold streams (see `Gate`)
fn a_wait_stuck_on_another_process_says_so_once() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let ctl = bind(0);
    let ev = ipc_event();
    let s = stream(NON_BLOCKING);
    let gate = Gate::block(s);
    record(ev, s);
    let (mut reap, mut sock) = ChildTest::spawn_with("child_fills_the_page", CHILD_ENV, Stdio::piped());
    let stderr = lines(reap.take_stderr().unwrap());
    sock.write_all(&export(ev)).unwrap();
    expect(&mut sock, b"F");
    let is_record_note =
        |l: &str| l.contains("cuEventRecord on interprocess event") && l.contains("oldest recording 1;");
    let is_stream_note =
        |l: &str| l.contains("has waited") && l.contains("for recording 1 of interprocess event");
    let mut seen: Vec<String> = Vec::new();
    while !(seen.iter().any(|l| is_record_note(l)) && seen.iter().any(|l| is_stream_note(l))) {
        match stderr.recv_timeout(WATCHDOG) {
            Ok(line) => seen.push(line),
            Err(e) => panic!("the child's stuck waits said nothing within {WATCHDOG:?} ({e}): {seen:?}"),
        }
    }
    gate.open();
    watched_sync_stream(s);
    expect(&mut sock, b"E");
    reap.finish();
    loop {
        match stderr.recv_timeout(WATCHDOG) {
            Ok(line) => seen.push(line),
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => panic!("the child's stderr stayed open after it exited"),
        }
    }
    assert_eq!(seen.iter().filter(|l| is_record_note(l)).count(), 1, "{seen:?}");
    assert_eq!(seen.iter().filter(|l| is_stream_note(l)).count(), 1, "{seen:?}");
    destroy_event(ev);
    destroy(s);
    assert!(ctl.live_report().is_clean(), "{}", ctl.live_report());
}

#[test]
#[serial]
fn child_fills_the_page() {
    let Some(mut sock) = connect_to_parent(CHILD_ENV) else {
        return;
    };
    let ctl = bind(0);
    let ev = import(&receive_handle(&mut sock));
    let (t, u) = (stream(NON_BLOCKING), stream(NON_BLOCKING));
    // Queued on the parent's recording 1.
    wait(t, ev);
    launch_count(t);
    for _ in 1..PAGE_SLOTS {
        record(ev, u);
    }
    sync_stream(u);
    assert_eq!(query_stream(t), CUresult::CUDA_ERROR_NOT_READY, "the wait on recording 1 was released");
    note(&mut sock, b"F");
    // Recordings 2..=510 completed, 1 has not: this one waits for room until the gate opens.
    record(ev, u);
    sync_stream(u);
    sync_stream(t);
    assert_eq!(runs(), 1);
    note(&mut sock, b"E");
    destroy_event(ev);
    destroy(t);
    destroy(u);
    assert!(ctl.live_report().is_clean(), "{}", ctl.live_report());
}
