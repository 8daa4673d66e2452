//! `cuMemUnmap` and the other VMM calls wait for no stream and hold no device, as observed on an
//! H100 (2026-11-24, raw driver calls; `docs/vmm.md`, "Observed on a GPU"): an unmap of a mapping
//! no work uses returned in 0.1 ms while an unrelated stream was held by a host function, and
//! `cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap` and
//! `cuMemRelease` returned at once while another thread waited in `cuMemFree` (which holds the
//! device). Work still queued over an unmapped range is reported at the unmap and again when it
//! runs, and moves no bytes (the simulator's host view has no pages there any more). The one wait
//! an unmap keeps, for the engine's copy in progress over its bytes, is raced on purpose in the
//! last test.
//!
//! Every call that must not wait runs on its own thread and reports through a channel, so a
//! regression fails after a timeout instead of hanging; a gate left closed by a failing assertion
//! opens when it is dropped.

mod common;

use std::time::{Duration, Instant};

use common::*;
use cudarc::driver::sys::{self as cu, CUdeviceptr, CUresult, CUstream};
use cumem_sim::control::current_os_tid;
use serial_test::serial;

const G: usize = 2 << 20;
const NON_BLOCKING: u32 = 1;
/// How long a held call must stay blocked.
const PAUSE: Duration = Duration::from_millis(400);
/// How long a call that waits for nothing may take to return: only reached when the simulator is
/// wrong, which then fails instead of hanging.
const LIMIT: Duration = Duration::from_secs(20);

/// Physical memory of `size` bytes on device 0.
fn create(size: usize) -> u64 {
    // SAFETY: an all-zero CUmemAllocationProp is a valid value (every enum has a 0 variant).
    let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 };
    let mut h = 0;
    // SAFETY: valid pointers.
    ok(unsafe { cu::cuMemCreate(&mut h, size, &prop, 0) });
    h
}

/// `size` bytes of address space.
fn reserve(size: usize) -> CUdeviceptr {
    let mut va = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAddressReserve(&mut va, size, 0, 0, 0) });
    va
}

/// `cuMemSetAccess` giving device 0 read-write access to `[va, va + size)`.
fn set_rw(va: CUdeviceptr, size: usize) -> CUresult {
    let desc = cu::CUmemAccessDesc {
        location: cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 },
        flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: one valid descriptor.
    unsafe { cu::cuMemSetAccess(va, size, &desc, 1) }
}

/// Maps all of `h` (`size` bytes) at `va`, read-write for device 0.
fn map_rw(va: CUdeviceptr, size: usize, h: u64) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuMemMap(va, size, 0, h, 0) });
    ok(set_rw(va, size));
}

fn unmap(va: CUdeviceptr, size: usize) -> CUresult {
    // SAFETY: plain FFI call.
    unsafe { cu::cuMemUnmap(va, size) }
}

/// Unmaps `[va, +size)`, releases `handles` and frees the reservation.
fn unmap_release_free(va: CUdeviceptr, size: usize, handles: &[u64]) {
    ok(unmap(va, size));
    for &h in handles {
        // SAFETY: plain FFI call.
        ok(unsafe { cu::cuMemRelease(h) });
    }
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuMemAddressFree(va, size) });
}

/// A reservation of one granule with a new allocation mapped over it, read-write for device 0.
fn mapped_granule() -> (CUdeviceptr, u64) {
    let (va, h) = (reserve(G), create(G));
    map_rw(va, G, h);
    (va, h)
}

/// Releases `h` and frees the reservation `[va, +G)` (the mapping is gone already).
fn release_and_free(va: CUdeviceptr, h: u64) {
    // SAFETY: plain FFI calls on a live handle and reservation.
    unsafe {
        ok(cu::cuMemRelease(h));
        ok(cu::cuMemAddressFree(va, G));
    }
}

/// Waits until `function` has been called more than `before` times (the simulator counts a call
/// as it starts): another thread is in it.
fn until_called(ctl: &cumem_sim::control::Control, function: &str, before: u64) {
    let entered = Instant::now();
    while ctl.calls(function) == before {
        assert!(entered.elapsed() < LIMIT, "the thread never called {function}");
        std::thread::yield_now();
    }
}

/// Every VMM call once, on a mapping no work uses (plus an unmap of `old`, mapped before): each
/// call's name and result, in order, stopping at the first failure. The H100 was not timed on
/// `cuMemAddressFree` (behind a held stream or a thread in `cuMemFree`): that it returns too is the
/// simulator's choice, asserted here with the observed calls.
fn vmm_calls(old: CUdeviceptr) -> Vec<(&'static str, CUresult)> {
    let mut done = Vec::new();
    let mut call = |name: &'static str, r: CUresult| {
        done.push((name, r));
        r == CUresult::CUDA_SUCCESS
    };
    let (mut va, mut h) = (0, 0);
    // SAFETY: an all-zero CUmemAllocationProp is a valid value; then plain FFI calls with valid
    // pointers, on handles and addresses the calls before returned.
    unsafe {
        let mut prop: cu::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location =
            cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 };
        let _ = call("cuMemUnmap (mapped before)", cu::cuMemUnmap(old, G))
            && call("cuMemAddressReserve", cu::cuMemAddressReserve(&mut va, G, 0, 0, 0))
            && call("cuMemCreate", cu::cuMemCreate(&mut h, G, &prop, 0))
            && call("cuMemMap", cu::cuMemMap(va, G, 0, h, 0))
            && call("cuMemSetAccess", set_rw(va, G))
            && call("cuMemUnmap", cu::cuMemUnmap(va, G))
            && call("cuMemRelease", cu::cuMemRelease(h))
            && call("cuMemAddressFree", cu::cuMemAddressFree(va, G));
    }
    done
}

/// Asserts that [`vmm_calls`] on another thread returned within [`LIMIT`], every call succeeding.
#[track_caller]
fn assert_returned(calls: std::sync::mpsc::Receiver<Vec<(&'static str, CUresult)>>, why: &str) {
    let done = calls.recv_timeout(LIMIT).unwrap_or_else(|_| panic!("the VMM calls return {why}"));
    assert_eq!(done.len(), 8, "every VMM call ran: {done:?}");
    for (name, r) in done {
        assert_eq!(r, CUresult::CUDA_SUCCESS, "{name}");
    }
}

/// Asserts that the stream `s` is still held (its gate has not opened).
#[track_caller]
fn assert_held(s: CUstream) {
    // SAFETY: a live stream.
    let r = unsafe { cu::cuStreamQuery(s) };
    assert_eq!(r, CUresult::CUDA_ERROR_NOT_READY, "the gate still holds the stream");
}

/// Synchronises and destroys `s`, then checks that everything the test made is released.
fn finish(ctl: &cumem_sim::control::Control, s: CUstream) {
    // SAFETY: a live stream.
    ok(unsafe { cu::cuStreamSynchronize(s) });
    destroy(s);
    let report = ctl.live_report();
    assert!(report.is_clean(), "everything the test made is released: {report}");
}

/// An unmap of a mapping no work uses, and every other VMM call, return while an unrelated
/// non-blocking stream is held by a host function. (Before the unmap stopped draining every device,
/// its unmaps waited for the held stream: this failed after `LIMIT`.)
#[test]
#[serial] // holds a stream with a gate
fn vmm_calls_return_while_an_unrelated_stream_is_held() {
    let ctl = bind(0);
    let (old, h) = mapped_granule();
    let held = stream(NON_BLOCKING);
    let gate = Gate::block(held);
    assert_returned(on_thread(move || vmm_calls(old)), "while an unrelated stream is held");
    assert_held(held);
    gate.open();
    release_and_free(old, h);
    finish(ctl, held);
    assert!(ctl.violations_on_this_thread().is_empty(), "{:?}", ctl.violations_on_this_thread());
}

/// While a stream is held by a host function and another thread waits in `cuMemFree` for it
/// (which holds the device: queueing calls of other threads wait, `implicit_sync.rs`), a third
/// thread's VMM calls return at once, as observed on an H100 (but for `cuMemAddressFree`, not
/// observed: the simulator's choice, see [`vmm_calls`]). (Failed before: its unmaps waited.)
#[test]
#[serial] // holds a stream with a gate
fn vmm_calls_do_not_wait_behind_a_thread_in_cu_mem_free() {
    let ctl = bind(0);
    let (old, h) = mapped_granule();
    let held = stream(NON_BLOCKING);
    let idle = dalloc(4096);
    let gate = Gate::block(held);
    let frees = ctl.calls("cuMemFree_v2");
    // SAFETY: plain FFI call on a live allocation.
    let free = on_thread(move || unsafe { cu::cuMemFree_v2(idle) });
    until_called(ctl, "cuMemFree_v2", frees);
    assert!(free.recv_timeout(PAUSE).is_err(), "cuMemFree waits for the stream held by the host function");

    assert_returned(on_thread(move || vmm_calls(old)), "while another thread waits in cuMemFree");
    assert!(free.try_recv().is_err(), "cuMemFree is still waiting");
    assert_held(held);

    gate.open();
    assert_eq!(
        free.recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "cuMemFree returns once the stream drains"
    );
    release_and_free(old, h);
    finish(ctl, held);
}

/// An unmap holds no device: while one thread unmaps (a stream of the device held meanwhile),
/// another thread's memset on a third stream is queued, runs and completes. (Before, the unmap
/// drained the device holding it, waiting for the held stream: the memset's call waited too.)
#[test]
#[serial] // holds a stream with a gate
fn an_unmap_holds_no_device() {
    let ctl = bind(0);
    let (va, h) = mapped_granule();
    let held = stream(NON_BLOCKING);
    let other = stream(NON_BLOCKING) as usize;
    let target = dalloc(4096);
    let gate = Gate::block(held);
    let unmaps = ctl.calls("cuMemUnmap");
    let unmapped = on_thread(move || unmap(va, G));
    until_called(ctl, "cuMemUnmap", unmaps);
    settle();
    // SAFETY: plain FFI calls on a live allocation and stream.
    let memset = on_thread(move || unsafe {
        (cu::cuMemsetD8Async(target, 5, 4096, other as CUstream), cu::cuStreamSynchronize(other as CUstream))
    });
    assert_eq!(
        memset.recv_timeout(LIMIT),
        Ok((CUresult::CUDA_SUCCESS, CUresult::CUDA_SUCCESS)),
        "another thread's memset on another stream is queued and completes during the unmap"
    );
    assert_eq!(unmapped.recv_timeout(LIMIT), Ok(CUresult::CUDA_SUCCESS), "the unmap returns");
    assert_held(held);
    assert_eq!(read_back(target, 4096), vec![5; 4096]);
    gate.open();
    release_and_free(va, h);
    dfree(target);
    destroy(other as CUstream);
    finish(ctl, held);
}

/// Work queued over a mapping that is then unmapped: the unmap returns at once and reports it ("a
/// GPU would fault"); when the work runs, each operation is reported again as a use of unmapped
/// memory (the enqueueing call and thread named) and moves no bytes: a copy out of the unmapped
/// mapping leaves its destination as it was, and a memset running on from the mapping still
/// mapped into the unmapped one leaves the mapped part too. Nothing crashes (the simulator's host
/// view has `PROT_NONE` pages there). (Failed before: the unmap waited for the held stream.)
#[test]
#[serial] // holds a stream with a gate
fn work_queued_over_an_unmapped_range_is_reported_at_the_unmap_and_when_it_runs() {
    let ctl = bind(0);
    let va = reserve(2 * G);
    let (first, second) = (create(G), create(G));
    map_rw(va, G, first);
    map_rw(va + G as u64, G, second);
    let tail = va + G as u64 - 64;
    // SAFETY: plain FFI call on mapped, writable memory.
    ok(unsafe { cu::cuMemsetD8_v2(tail, 0x11, 64) });
    let host = pinned(256);
    poke(host, 256, 0xaa);
    let s = stream(NON_BLOCKING);
    let gate = Gate::block(s);
    let gone = va + G as u64;
    // SAFETY: plain FFI calls on mapped, writable memory and a live pinned buffer; they wait
    // behind the gate.
    unsafe {
        ok(cu::cuMemsetD8Async(gone + 4096, 7, 128, s));
        ok(cu::cuMemcpyDtoHAsync_v2(host.cast(), gone, 256, s));
        ok(cu::cuMemsetD8Async(tail, 9, 128, s));
    }

    let unmapped = on_thread(move || (unmap(gone, G), current_os_tid()));
    let (r, tid) = unmapped.recv_timeout(LIMIT).expect("the unmap returns while its work is queued");
    ok(r);
    assert_held(s);
    let at_unmap: Vec<_> = ctl
        .violations()
        .into_iter()
        .filter(|v| v.os_tid == tid && v.function == "cuMemUnmap" && v.message.contains("a GPU would fault"))
        .collect();
    assert_eq!(at_unmap.len(), 1, "the unmap reports the queued work: {at_unmap:?}");

    gate.open();
    // SAFETY: a live stream.
    ok(unsafe { cu::cuStreamSynchronize(s) });
    let mine = ctl.violations_on_this_thread();
    let ran = |function: &str, what: &str| {
        mine.iter().filter(|v| v.function == function && v.code == 0 && v.message.contains(what)).count()
    };
    let freed = format!("[{gone:#x}, +{G}) used after its free: cuMemUnmap unmapped it");
    assert_eq!(ran("cuMemsetD8Async", &freed), 1, "{mine:?}");
    assert_eq!(ran("cuMemcpyDtoHAsync_v2", &freed), 1, "{mine:?}");
    assert_eq!(ran("cuMemsetD8Async", &format!("[{tail:#x}, +128) used after cuMemUnmap")), 1, "{mine:?}");
    assert_eq!(mine.len(), 3, "nothing else: {mine:?}");
    assert_eq!(peek(host, 256), vec![0xaa; 256], "the copy from the unmapped mapping moved nothing");
    assert_eq!(read_back(tail, 64), vec![0x11; 64], "the memset into the unmapped mapping moved nothing");

    // The range can be mapped again and used as usual.
    map_rw(gone, G, second);
    // SAFETY: plain FFI call on mapped, writable memory.
    ok(unsafe { cu::cuMemsetD8_v2(gone, 3, 64) });
    assert_eq!(read_back(gone, 64), vec![3; 64]);
    pfree(host);
    unmap_release_free(va, 2 * G, &[first, second]);
    finish(ctl, s);
}

/// A crash test: unmaps racing the engine as it writes the mapping. Each round queues a memset of
/// the whole mapping and unmaps it after a pause around the simulated latency, so that some unmaps
/// come while the memset's bytes are moving. The unmap waits for that memset (the simulator's host
/// view must keep its pages under a running copy), so the process must not die of SIGSEGV: that is
/// what this checks. (Without that wait it crashed within a few rounds.) The counts asserted at
/// the end hold by construction (every memset still queued at its unmap is reported there); they
/// only check that nothing else is reported.
#[test]
#[serial] // reads the whole live report
fn unmaps_racing_the_engine_wait_for_its_running_memset() {
    let ctl = bind(0);
    let (va, h) = mapped_granule();
    let s = stream(NON_BLOCKING);
    for round in 0..300u64 {
        if round > 0 {
            map_rw(va, G, h);
        }
        // SAFETY: plain FFI call on mapped, writable memory.
        ok(unsafe { cu::cuMemsetD8Async(va, round as u8, G, s) });
        std::thread::sleep(Duration::from_micros(100 + round % 7 * 50));
        ok(unmap(va, G));
    }
    // SAFETY: a live stream.
    ok(unsafe { cu::cuStreamSynchronize(s) });
    let mine = ctl.violations_on_this_thread();
    let at_unmap = mine.iter().filter(|v| v.function == "cuMemUnmap").count();
    let at_run = mine.iter().filter(|v| v.function == "cuMemsetD8Async").count();
    assert_eq!(at_unmap + at_run, mine.len(), "{mine:?}");
    assert!(at_run <= at_unmap, "every memset reported when it ran was reported at its unmap");
    release_and_free(va, h);
    finish(ctl, s);
}

/// An unmap waits for at most the engine's batch in progress over its bytes, not for the stream's
/// whole backlog of ready work over them: 500 memsets of the whole mapping (one per batch) queued
/// behind a gate, the gate opened, and the mapping unmapped as soon as the first has run (an event
/// recorded after it completes). The unmap returns, and nearly every memset after the first, run
/// after it, moves nothing and is reported as a use of the unmapped memory. (Failed before: the
/// woken unmap always found the next batch in flight over its bytes, so it waited until the
/// stream's memsets ran out, all of them moving bytes, none reported.) The bound leaves room for a
/// slow, loaded machine: half the memsets (about 15 ms of a debug build's work) may run between the
/// first one's completion and the unmap.
#[test]
#[serial] // holds a stream with a gate
fn an_unmap_waits_for_one_batch_not_the_backlog_over_its_bytes() {
    const MEMSETS: usize = 500;
    let ctl = bind(0);
    let (va, h) = mapped_granule();
    let s = stream(NON_BLOCKING);
    let gate = Gate::block(s);
    let mut first = std::ptr::null_mut();
    // SAFETY: plain FFI calls with a valid out-pointer, on mapped, writable memory and a live
    // stream; the memsets wait behind the gate.
    unsafe {
        ok(cu::cuEventCreate(&mut first, 0));
        ok(cu::cuMemsetD8Async(va, 0, G, s));
        ok(cu::cuEventRecord(first, s));
        for i in 1..MEMSETS {
            ok(cu::cuMemsetD8Async(va, i as u8, G, s));
        }
    }
    let opened = Instant::now();
    gate.open();
    // SAFETY: a live event.
    while unsafe { cu::cuEventQuery(first) } == CUresult::CUDA_ERROR_NOT_READY {
        assert!(opened.elapsed() < LIMIT, "the first memset runs");
        std::thread::yield_now();
    }
    ok(unmap(va, G));
    // SAFETY: a live stream, then a live event.
    unsafe {
        ok(cu::cuStreamSynchronize(s));
        ok(cu::cuEventDestroy_v2(first));
    }
    let mine = ctl.violations_on_this_thread();
    let after = mine.iter().filter(|v| v.function == "cuMemsetD8Async" && v.code == 0).count();
    assert!(after >= MEMSETS / 2, "{after} of {MEMSETS} memsets reported as run after the unmap");
    release_and_free(va, h);
    finish(ctl, s);
}
