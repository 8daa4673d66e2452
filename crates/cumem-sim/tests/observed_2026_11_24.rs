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
use std::time::Duration;

use common::*;
use cudarc::driver::sys::{self as cu, CUevent, CUresult, CUstream};

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

/// A held stream accepts 1021 copies and memsets (event recordings between them do not count);
/// the next one waits until the stream moves, and while it waits other threads' `cuEventCreate`
/// and `cuMemAlloc` wait too, while a memset on another stream, and a host function (not measured,
/// so not counted) on the full stream, return.
#[test]
#[serial_test::serial] // holds a stream with a gate
fn a_held_stream_accepts_1021_work_items_and_the_next_one_waits() {
    bind(0);
    let n = 4096;
    let held = stream(NON_BLOCKING);
    let other = stream(NON_BLOCKING);
    let a = dalloc(n);
    let b = dalloc(n);
    let c = dalloc(n);
    let marker = event();
    let gate = Gate::block(held);
    for i in 0..DEPTH {
        // SAFETY: live allocations and handles.
        unsafe {
            if i % 2 == 0 {
                ok(cu::cuMemsetD8Async(a, i as u8, n, held));
            } else {
                ok(cu::cuMemcpyDtoDAsync_v2(b, a, n, held));
            }
            ok(cu::cuEventRecord(marker, held));
            ok(cu::cuEventRecord(marker, held));
        }
    }
    let held_h = held as usize;
    // SAFETY: live allocations and handles.
    let next = on_thread(move || unsafe { cu::cuMemsetD8Async(a, 0x5A, n, held_h as CUstream) });
    assert!(next.recv_timeout(PAUSE).is_err(), "the 1022nd work item waits for room");

    let other_h = other as usize;
    // SAFETY: as above.
    let elsewhere = on_thread(move || unsafe { cu::cuMemsetD8Async(c, 1, n, other_h as CUstream) });
    extern "C" fn nothing(_: *mut c_void) {}
    // SAFETY: a live stream and a function that does nothing.
    let host_fn = on_thread(move || unsafe {
        cu::cuLaunchHostFunc(held_h as CUstream, Some(nothing), std::ptr::null_mut())
    });
    let create = on_thread(|| {
        let mut e: CUevent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let r = unsafe { cu::cuEventCreate(&mut e, 0) };
        (r, e as usize)
    });
    let alloc = on_thread(|| {
        let mut p = 0;
        // SAFETY: a valid out-pointer.
        let r = unsafe { cu::cuMemAlloc_v2(&mut p, 256) };
        (r, p)
    });
    assert_eq!(
        elsewhere.recv_timeout(LIMIT),
        Ok(CUresult::CUDA_SUCCESS),
        "a memset on another stream returns"
    );
    assert_eq!(host_fn.recv_timeout(LIMIT), Ok(CUresult::CUDA_SUCCESS), "a host function does not count");
    std::thread::sleep(PAUSE);
    assert!(create.try_recv().is_err(), "cuEventCreate waits while a thread waits for room");
    assert!(alloc.try_recv().is_err(), "cuMemAlloc waits while a thread waits for room");
    assert!(next.try_recv().is_err(), "the 1022nd work item still waits");

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
