//! An asynchronous copy whose source and destination are both host memory is synchronous, as
//! observed on an H100, 2026-11-23: with the stream held by a blocking host function, such a copy
//! (pinned, mapped through its device pointer, registered or pageable, through any of the async
//! copy calls) blocks in the call until the host function has returned, and returns with the
//! bytes copied; a copy with one end in device memory, and a memset (of device or mapped memory),
//! returns at once and runs when the stream gets to it.
//!
//! The gate of a held stream is opened from another thread after a delay: a copy that should
//! block must find it opened when it returns (and the bytes copied, with no synchronisation); a
//! copy that should be queued must return while it is still closed (and the bytes not yet there).
//! Either way the gate opens by itself in the end, so a wrong rule fails the test instead of
//! hanging it.

mod common;

use std::sync::mpsc::{RecvTimeoutError, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

use common::*;
use cudarc::driver::sys::{self as cu, CUdeviceptr, CUmemorytype, CUstream};
use serial_test::serial;

const NON_BLOCKING: u32 = 1;
/// `CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`.
const MAPPED: u32 = 3;
/// `CU_STREAM_PER_THREAD`.
const PER_THREAD: CUstream = 2 as CUstream;
/// Bytes per copy; every buffer holds two such halves, a source and a destination.
const N: usize = 256;
/// How long the gate of a copy that must block stays closed.
const PAUSE: Duration = Duration::from_millis(300);
/// How long the gate of a copy that must return at once may stay closed: only reached when the
/// simulator is wrong, which then fails instead of hanging.
const LIMIT: Duration = Duration::from_secs(20);

/// Opens a gate from another thread: after a delay, or when told to.
struct Opener {
    now: Sender<()>,
    thread: JoinHandle<bool>,
}

impl Opener {
    fn after(gate: Gate, delay: Duration) -> Opener {
        let (now, told) = channel();
        let thread = std::thread::spawn(move || {
            let ran_out = matches!(told.recv_timeout(delay), Err(RecvTimeoutError::Timeout));
            drop(gate);
            ran_out
        });
        Opener { now, thread }
    }

    /// Opens the gate now if it is still closed; whether the delay had run out first.
    fn open(self) -> bool {
        let _ = self.now.send(());
        self.thread.join().unwrap()
    }
}

/// Every kind of memory the cases copy between, `2 * N` bytes each.
struct Memories {
    pinned: *mut u8,
    mapped: *mut u8,
    mapped_dev: CUdeviceptr,
    registered: Vec<u8>,
    pageable: Vec<u8>,
    device: CUdeviceptr,
}

impl Memories {
    fn new() -> Memories {
        let mut mapped: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut mapped_dev = 0;
        let mut registered = vec![0u8; 2 * N];
        // SAFETY: valid out-pointers; `registered` outlives its registration (see `free`).
        unsafe {
            ok(cu::cuMemHostAlloc(&mut mapped, 2 * N, MAPPED));
            ok(cu::cuMemHostGetDevicePointer_v2(&mut mapped_dev, mapped, 0));
            ok(cu::cuMemHostRegister_v2(registered.as_mut_ptr().cast(), 2 * N, 0));
        }
        Memories {
            pinned: pinned(2 * N),
            mapped: mapped.cast(),
            mapped_dev,
            registered,
            pageable: vec![0u8; 2 * N],
            device: dalloc(2 * N),
        }
    }

    fn free(mut self) {
        // SAFETY: registered in `new`, no work queued on it any more.
        ok(unsafe { cu::cuMemHostUnregister(self.registered.as_mut_ptr().cast()) });
        pfree(self.mapped);
        pfree(self.pinned);
        dfree(self.device);
    }
}

/// One copy: fills its source with a value, clears its destination, queues the copy on a stream,
/// and reads the destination back.
struct Case {
    name: &'static str,
    /// Sets the source half to the value and the destination half to 0.
    prepare: fn(&mut Memories, u8),
    /// Queues the copy (or memset, which writes the value) on the stream.
    call: fn(&mut Memories, CUstream, u8) -> cu::CUresult,
    /// The destination half as the host reads it now (device memory: with a synchronous copy on
    /// the legacy stream, which no non-blocking stream holds back).
    read: fn(&mut Memories) -> Vec<u8>,
}

fn fill(p: *mut u8, v: u8) {
    poke(p, N, v);
}

fn pinned_src(m: &mut Memories, v: u8) {
    fill(m.pinned, v);
}

fn mapped_src(m: &mut Memories, v: u8) {
    fill(m.mapped, v);
}

fn to_mapped_dst(m: &mut Memories) {
    fill(m.mapped.wrapping_add(N), 0);
}

fn read_mapped_dst(m: &mut Memories) -> Vec<u8> {
    peek(m.mapped.wrapping_add(N), N)
}

fn read_pinned_dst(m: &mut Memories) -> Vec<u8> {
    peek(m.pinned.wrapping_add(N), N)
}

fn read_device_dst(m: &mut Memories) -> Vec<u8> {
    read_back(m.device + N as u64, N)
}

fn ctx() -> cu::CUcontext {
    let mut c: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuCtxGetCurrent(&mut c) });
    c
}

/// Copies between two host memories: each blocks until the stream's earlier work is done.
fn host_to_host() -> Vec<Case> {
    vec![
        Case {
            name: "cuMemcpyHtoDAsync pinned -> mapped",
            prepare: |m, v| {
                pinned_src(m, v);
                to_mapped_dst(m);
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemcpyHtoDAsync_v2(m.mapped_dev + N as u64, m.pinned.cast(), N, s) }
            },
            read: read_mapped_dst,
        },
        Case {
            name: "cuMemcpyDtoHAsync mapped -> pinned",
            prepare: |m, v| {
                mapped_src(m, v);
                fill(m.pinned.wrapping_add(N), 0);
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemcpyDtoHAsync_v2(m.pinned.wrapping_add(N).cast(), m.mapped_dev, N, s) }
            },
            read: read_pinned_dst,
        },
        Case {
            name: "cuMemcpyHtoDAsync pageable -> mapped",
            prepare: |m, v| {
                m.pageable[..N].fill(v);
                to_mapped_dst(m);
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemcpyHtoDAsync_v2(m.mapped_dev + N as u64, m.pageable.as_ptr().cast(), N, s) }
            },
            read: read_mapped_dst,
        },
        Case {
            name: "cuMemcpyDtoDAsync mapped -> mapped",
            prepare: |m, v| {
                mapped_src(m, v);
                to_mapped_dst(m);
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemcpyDtoDAsync_v2(m.mapped_dev + N as u64, m.mapped_dev, N, s) }
            },
            read: read_mapped_dst,
        },
        Case {
            name: "cuMemcpyHtoDAsync pinned -> pinned (a pinned address as the device end)",
            prepare: |m, v| {
                pinned_src(m, v);
                fill(m.pinned.wrapping_add(N), 0);
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe {
                    cu::cuMemcpyHtoDAsync_v2(m.pinned.wrapping_add(N) as CUdeviceptr, m.pinned.cast(), N, s)
                }
            },
            read: read_pinned_dst,
        },
        Case {
            name: "cuMemcpyAsync pinned -> mapped",
            prepare: |m, v| {
                pinned_src(m, v);
                to_mapped_dst(m);
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemcpyAsync(m.mapped_dev + N as u64, m.pinned as CUdeviceptr, N, s) }
            },
            read: read_mapped_dst,
        },
        Case {
            name: "cuMemcpyAsync registered -> pageable",
            prepare: |m, v| {
                m.registered[..N].fill(v);
                m.pageable[N..].fill(0);
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe {
                    cu::cuMemcpyAsync(
                        m.pageable.as_mut_ptr().wrapping_add(N) as CUdeviceptr,
                        m.registered.as_ptr() as CUdeviceptr,
                        N,
                        s,
                    )
                }
            },
            read: |m| m.pageable[N..].to_vec(),
        },
        Case {
            name: "cuMemcpyPeerAsync mapped -> pinned",
            prepare: |m, v| {
                mapped_src(m, v);
                fill(m.pinned.wrapping_add(N), 0);
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe {
                    cu::cuMemcpyPeerAsync(
                        m.pinned.wrapping_add(N) as CUdeviceptr,
                        ctx(),
                        m.mapped_dev,
                        ctx(),
                        N,
                        s,
                    )
                }
            },
            read: read_pinned_dst,
        },
        Case {
            name: "cuMemcpy2DAsync pinned (host) -> mapped (device)",
            prepare: |m, v| {
                pinned_src(m, v);
                to_mapped_dst(m);
            },
            call: |m, s, _| {
                let c = cu::CUDA_MEMCPY2D {
                    srcXInBytes: 0,
                    srcY: 0,
                    srcMemoryType: CUmemorytype::CU_MEMORYTYPE_HOST,
                    srcHost: m.pinned.cast(),
                    srcDevice: 0,
                    srcArray: std::ptr::null_mut(),
                    srcPitch: N / 4,
                    dstXInBytes: 0,
                    dstY: 0,
                    dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    dstHost: std::ptr::null_mut(),
                    dstDevice: m.mapped_dev + N as u64,
                    dstArray: std::ptr::null_mut(),
                    dstPitch: N / 4,
                    WidthInBytes: N / 4,
                    Height: 4,
                };
                // SAFETY: `c` names live allocations of `2 * N` bytes.
                unsafe { cu::cuMemcpy2DAsync_v2(&c, s) }
            },
            read: read_mapped_dst,
        },
    ]
}

/// Copies with one end in device memory, and memsets: each returns at once.
fn queued() -> Vec<Case> {
    vec![
        Case {
            name: "cuMemcpyDtoDAsync device -> mapped",
            prepare: |m, v| {
                // SAFETY: a live allocation of `2 * N` bytes.
                ok(unsafe { cu::cuMemsetD8_v2(m.device, v, N) });
                to_mapped_dst(m);
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemcpyDtoDAsync_v2(m.mapped_dev + N as u64, m.device, N, s) }
            },
            read: read_mapped_dst,
        },
        Case {
            name: "cuMemcpyDtoDAsync mapped -> device",
            prepare: |m, v| {
                mapped_src(m, v);
                // SAFETY: as above.
                ok(unsafe { cu::cuMemsetD8_v2(m.device + N as u64, 0, N) });
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemcpyDtoDAsync_v2(m.device + N as u64, m.mapped_dev, N, s) }
            },
            read: read_device_dst,
        },
        Case {
            name: "cuMemsetD8Async mapped",
            prepare: |m, _| to_mapped_dst(m),
            call: |m, s, v| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemsetD8Async(m.mapped_dev + N as u64, v, N, s) }
            },
            read: read_mapped_dst,
        },
        Case {
            name: "cuMemcpyHtoDAsync pinned -> device",
            prepare: |m, v| {
                pinned_src(m, v);
                // SAFETY: as above.
                ok(unsafe { cu::cuMemsetD8_v2(m.device + N as u64, 0, N) });
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemcpyHtoDAsync_v2(m.device + N as u64, m.pinned.cast(), N, s) }
            },
            read: read_device_dst,
        },
        Case {
            name: "cuMemcpyHtoDAsync pageable -> device",
            prepare: |m, v| {
                m.pageable[..N].fill(v);
                // SAFETY: as above.
                ok(unsafe { cu::cuMemsetD8_v2(m.device + N as u64, 0, N) });
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemcpyHtoDAsync_v2(m.device + N as u64, m.pageable.as_ptr().cast(), N, s) }
            },
            read: read_device_dst,
        },
        Case {
            name: "cuMemcpyDtoHAsync device -> pinned",
            prepare: |m, v| {
                // SAFETY: as above.
                ok(unsafe { cu::cuMemsetD8_v2(m.device, v, N) });
                fill(m.pinned.wrapping_add(N), 0);
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemcpyDtoHAsync_v2(m.pinned.wrapping_add(N).cast(), m.device, N, s) }
            },
            read: read_pinned_dst,
        },
        Case {
            name: "cuMemcpyAsync device -> registered",
            prepare: |m, v| {
                // SAFETY: as above.
                ok(unsafe { cu::cuMemsetD8_v2(m.device, v, N) });
                m.registered[N..].fill(0);
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe {
                    cu::cuMemcpyAsync(
                        m.registered.as_mut_ptr().wrapping_add(N) as CUdeviceptr,
                        m.device,
                        N,
                        s,
                    )
                }
            },
            read: |m| peek(m.registered.as_ptr().wrapping_add(N), N),
        },
        Case {
            name: "cuMemcpyDtoDAsync device -> device",
            prepare: |m, v| {
                // SAFETY: as above.
                ok(unsafe { cu::cuMemsetD8_v2(m.device, v, N) });
                // SAFETY: as above.
                ok(unsafe { cu::cuMemsetD8_v2(m.device + N as u64, 0, N) });
            },
            call: |m, s, _| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemcpyDtoDAsync_v2(m.device + N as u64, m.device, N, s) }
            },
            read: read_device_dst,
        },
        Case {
            name: "cuMemsetD8Async device",
            prepare: |m, _| {
                // SAFETY: as above.
                ok(unsafe { cu::cuMemsetD8_v2(m.device + N as u64, 0, N) });
            },
            call: |m, s, v| {
                // SAFETY: live allocations of `2 * N` bytes (pageable and registered memory outlives the call).
                unsafe { cu::cuMemsetD8Async(m.device + N as u64, v, N, s) }
            },
            read: read_device_dst,
        },
    ]
}

fn sync(s: CUstream) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
}

/// Runs `case` on `on` while `held` is held by a gate (they differ when the legacy stream's
/// ordering after blocking streams is what holds the copy back): it must block until the gate
/// opens (`blocks`) or return while it is closed, and land its bytes either way.
fn run(m: &mut Memories, case: &Case, held: CUstream, on: CUstream, v: u8, blocks: bool) {
    let name = case.name;
    (case.prepare)(m, v);
    sync(std::ptr::null_mut());
    let gate = Gate::block(held);
    let opener = Opener::after(gate, if blocks { PAUSE } else { LIMIT });
    ok((case.call)(m, on, v));
    if blocks {
        // Read before anything synchronises: the call itself completed the copy.
        let seen = (case.read)(m);
        assert!(opener.open(), "{name}: returned while the stream's earlier work was held");
        assert!(seen.iter().all(|&b| b == v), "{name}: returned before the bytes were copied");
    } else {
        assert!((case.read)(m).iter().all(|&b| b == 0), "{name}: ran before the held stream got to it");
        assert!(!opener.open(), "{name}: blocked in the call until the held stream's gate opened");
        sync(on);
        sync(held);
        assert!((case.read)(m).iter().all(|&b| b == v), "{name}: never ran");
    }
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn an_async_copy_between_two_host_memories_waits_for_the_streams_earlier_work() {
    bind(0);
    let mut m = Memories::new();
    let s = stream(NON_BLOCKING);
    for (i, case) in host_to_host().iter().enumerate() {
        run(&mut m, case, s, s, 10 + i as u8, true);
    }
    destroy(s);
    m.free();
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn the_rule_holds_on_the_legacy_and_per_thread_streams() {
    bind(0);
    let mut m = Memories::new();
    let blocking = stream(0);
    let first = &host_to_host()[0];
    run(&mut m, first, std::ptr::null_mut(), std::ptr::null_mut(), 31, true);
    run(&mut m, first, PER_THREAD, PER_THREAD, 32, true);
    // The legacy stream's earlier work includes a blocking stream's.
    run(&mut m, first, blocking, std::ptr::null_mut(), 33, true);
    destroy(blocking);
    m.free();
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn a_copy_with_one_end_in_device_memory_and_memsets_stay_queued() {
    bind(0);
    let mut m = Memories::new();
    let s = stream(NON_BLOCKING);
    for (i, case) in queued().iter().enumerate() {
        run(&mut m, case, s, s, 40 + i as u8, false);
    }
    destroy(s);
    m.free();
}
