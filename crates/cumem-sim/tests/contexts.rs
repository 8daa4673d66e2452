//! Contexts made by `cuCtxCreate`: current on creation, their own allocations, streams and
//! events, all freed by `cuCtxDestroy` (observed on an H100, §17 of the driver reference), the
//! per-thread stack, flags, limits and the API version. Created contexts live on device 2, which
//! the shared setup leaves unretained.

mod common;

use std::ffi::c_void;

use common::*;
use cudarc::driver::sys::{self as cu, CUcontext, CUevent, CUresult};

const DEV: i32 = 2;

/// `cuCtxCreate_v4` with NULL parameters, as observed on the H100.
fn create(flags: u32) -> CUcontext {
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; NULL parameters are allowed.
    ok(unsafe { cu::cuCtxCreate_v4(&mut c, std::ptr::null_mut(), flags, DEV) });
    c
}

fn ctx_destroy(c: CUcontext) -> CUresult {
    // SAFETY: plain FFI call; the simulator checks the handle.
    unsafe { cu::cuCtxDestroy_v2(c) }
}

fn current() -> CUcontext {
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuCtxGetCurrent(&mut c) });
    c
}

fn pop() -> Result<CUcontext, CUresult> {
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    match unsafe { cu::cuCtxPopCurrent_v2(&mut c) } {
        CUresult::CUDA_SUCCESS => Ok(c),
        e => Err(e),
    }
}

fn try_alloc(bytes: usize) -> Result<u64, CUresult> {
    let mut p = 0;
    // SAFETY: valid out-pointer.
    match unsafe { cu::cuMemAlloc_v2(&mut p, bytes) } {
        CUresult::CUDA_SUCCESS => Ok(p),
        e => Err(e),
    }
}

/// Empties the calling thread's context stack (test threads are reused between tests).
fn clear_stack() {
    while pop().is_ok() {}
}

#[test]
fn a_created_context_is_current_allocates_and_goes_away_when_destroyed() {
    let ctl = setup();
    clear_stack();
    let c = create(0);
    assert_eq!(current(), c, "cuCtxCreate pushes the new context");
    let mut dev = -1;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuCtxGetDevice(&mut dev) });
    assert_eq!(dev, DEV);
    let mut version = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuCtxGetApiVersion(c, &mut version) });
    assert_eq!(version, 3020);
    let p = dalloc(4096);
    let mut owner: CUcontext = std::ptr::null_mut();
    // SAFETY: CONTEXT is a pointer-sized attribute.
    ok(unsafe {
        cu::cuPointerGetAttribute(
            (&mut owner as *mut CUcontext).cast::<c_void>(),
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT,
            p,
        )
    });
    assert_eq!(owner, c, "the allocation belongs to the created context");
    let report = ctl.live_report();
    let listed: Vec<_> = report.created_contexts().filter(|l| l.handle == c as u64).collect();
    assert_eq!(listed.len(), 1, "a live created context is reported: {report}");
    assert_eq!(listed[0].device, DEV);
    assert!(!report.is_clean(), "a created context not destroyed counts as a leak");
    dfree(p);
    ok(ctx_destroy(c));
    assert!(current().is_null(), "destroying the current context pops it");
    let report = ctl.live_report();
    assert!(report.created_contexts().all(|l| l.handle != c as u64), "destroyed contexts are not listed");
}

#[test]
fn destroying_a_context_frees_its_memory_streams_and_events() {
    let ctl = setup();
    clear_stack();
    bind(0);
    let primary = current();
    let c = create(0);
    let p = dalloc(1 << 20);
    let s = stream(0);
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuEventCreate(&mut e, 0) });
    // SAFETY: `p` holds 1 MiB; the stream belongs to the same context.
    ok(unsafe { cu::cuMemsetD8Async(p, 7, 1 << 20, s) });
    let before = ctl.live_report();
    let id = before.id_of(p).expect("the allocation is listed");
    assert!(before.contains_stream(s as u64) && before.contains_event(e as u64));

    ok(ctx_destroy(c));
    assert_eq!(current(), primary, "the context below the destroyed one is current again");
    let after = ctl.live_report();
    assert!(!after.contains_allocation(id), "the allocation died with its context: {after}");
    assert!(!after.contains_stream(s as u64), "the stream died with its context");
    assert!(!after.contains_event(e as u64), "the event died with its context");
    // SAFETY: plain FFI calls on dead handles, which the simulator refuses.
    unsafe {
        assert_eq!(cu::cuMemsetD8_v2(p, 0, 16), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuMemFree_v2(p), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuStreamQuery(s), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(cu::cuEventQuery(e), CUresult::CUDA_ERROR_INVALID_HANDLE);
        let mut version = 0;
        assert_eq!(cu::cuCtxGetApiVersion(c, &mut version), CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED);
        assert_eq!(cu::cuCtxPushCurrent_v2(c), CUresult::CUDA_ERROR_INVALID_CONTEXT);
    }
    assert_eq!(ctx_destroy(c), CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED, "destroying twice");
    let codes: Vec<u32> = ctl
        .violations_on_this_thread()
        .iter()
        .filter(|v| v.function == "cuCtxDestroy_v2")
        .map(|v| v.code)
        .collect();
    assert!(codes.contains(&(CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED as u32)));
}

#[test]
fn memory_of_one_context_is_usable_from_another_context_of_the_device() {
    setup();
    clear_stack();
    let a = create(0);
    let n = 4096;
    let p = dalloc(n);
    let src: Vec<u8> = (0..n).map(|i| i as u8).collect();
    // SAFETY: `src` holds `n` bytes.
    ok(unsafe { cu::cuMemcpyHtoD_v2(p, src.as_ptr().cast(), n) });
    let b = create(0);
    assert_eq!(current(), b);
    assert_eq!(read_back(p, n), src, "context B reads context A's memory");
    // SAFETY: `p` holds `n` bytes.
    ok(unsafe { cu::cuMemsetD8_v2(p, 0xab, n) });
    assert!(read_back(p, n).iter().all(|&x| x == 0xab), "context B writes context A's memory");
    dfree(p);
    ok(ctx_destroy(b));
    assert_eq!(current(), a);
    ok(ctx_destroy(a));
    assert!(current().is_null());
}

#[test]
fn the_context_stack_follows_push_pop_and_destroy() {
    setup();
    clear_stack();
    assert_eq!(pop(), Err(CUresult::CUDA_ERROR_INVALID_CONTEXT), "pop of an empty stack");
    // SAFETY: plain FFI call.
    assert_eq!(unsafe { cu::cuCtxPushCurrent_v2(std::ptr::null_mut()) }, CUresult::CUDA_ERROR_INVALID_VALUE);
    let a = create(0);
    assert_eq!(pop(), Ok(a));
    assert!(current().is_null());
    bind(0);
    let primary = current();
    // SAFETY: plain FFI call with a live handle.
    ok(unsafe { cu::cuCtxPushCurrent_v2(a) });
    ok(ctx_destroy(a));
    assert_eq!(current(), primary, "destroying the top pops it");
    let b = create(0);
    // SAFETY: plain FFI call with a live handle.
    ok(unsafe { cu::cuCtxPushCurrent_v2(primary) });
    ok(ctx_destroy(b));
    assert_eq!(current(), primary, "destroying a context below the top leaves the top current");
    assert_eq!(pop(), Ok(primary));
    assert_eq!(current(), b, "the destroyed context stays on the stack until popped");
    assert_eq!(try_alloc(256), Err(CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED));
    assert_eq!(pop(), Ok(b));
    assert_eq!(pop(), Ok(primary));
    clear_stack();
}

#[test]
fn another_thread_with_the_context_current_sees_it_destroyed() {
    setup();
    clear_stack();
    let a = create(0);
    let handle = a as usize;
    let (to_main, from_thread) = std::sync::mpsc::channel();
    let (to_thread, from_main) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        // SAFETY: a live handle.
        ok(unsafe { cu::cuCtxSetCurrent(handle as CUcontext) });
        to_main.send(()).unwrap();
        from_main.recv().unwrap();
        let mut dev = -1;
        // SAFETY: valid out-pointer.
        let get = unsafe { cu::cuCtxGetDevice(&mut dev) };
        (get, try_alloc(256).err())
    });
    from_thread.recv().unwrap();
    ok(ctx_destroy(a));
    to_thread.send(()).unwrap();
    let (get, alloc) = t.join().unwrap();
    assert_eq!(get, CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED);
    assert_eq!(alloc, Some(CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED));
}

#[test]
fn flags_limits_and_creation_variants() {
    setup();
    clear_stack();
    for bad in [3u32, 5, 6, 7, 0x100, 0xfe] {
        let mut c: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let r = unsafe { cu::cuCtxCreate_v2(&mut c, bad, DEV) };
        assert_eq!(r, CUresult::CUDA_ERROR_INVALID_VALUE, "flags {bad:#x}");
        assert!(c.is_null() && current().is_null(), "no context created for flags {bad:#x}");
    }
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { cu::cuCtxCreate_v2(&mut c, 0, 99) }, CUresult::CUDA_ERROR_INVALID_DEVICE);
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuCtxCreate_v2(&mut c, 0x8 | 0x1, DEV) });
    let mut flags = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuCtxGetFlags(&mut flags) });
    assert_eq!(flags, 0x9);
    // SAFETY: plain FFI calls.
    unsafe {
        ok(cu::cuCtxSetFlags(0x2));
        ok(cu::cuCtxGetFlags(&mut flags));
        assert_eq!(flags, 0x2);
        assert_eq!(cu::cuCtxSetFlags(0x8), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuCtxSetFlags(0x3), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let stack = cu::CUlimit::CU_LIMIT_STACK_SIZE;
    let mut v = 0usize;
    // SAFETY: valid out-pointers; raw limit numbers go through a signature taking `u32`.
    unsafe {
        ok(cu::cuCtxGetLimit(&mut v, stack));
        assert_eq!(v, 1024);
        ok(cu::cuCtxSetLimit(stack, 4096));
        ok(cu::cuCtxGetLimit(&mut v, stack));
        assert_eq!(v, 4096);
        let get: unsafe extern "C" fn(*mut usize, u32) -> CUresult = raw("cuCtxGetLimit");
        assert_eq!(get(&mut v, 8), CUresult::CUDA_ERROR_UNSUPPORTED_LIMIT);
        assert_eq!(get(&mut v, 42), CUresult::CUDA_ERROR_INVALID_VALUE);
        let (mut least, mut greatest) = (1, 1);
        ok(cu::cuCtxGetStreamPriorityRange(&mut least, &mut greatest));
        assert_eq!((least, greatest), (0, -5));
    }
    // A second context starts from the defaults.
    let d = create(0);
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuCtxGetLimit(&mut v, stack) });
    assert_eq!(v, 1024, "limits are per context");
    ok(ctx_destroy(d));
    ok(ctx_destroy(c));

    // SAFETY: valid out-pointer; `param` is only compared with NULL by the simulator.
    unsafe {
        let mut param: cu::CUexecAffinityParam = std::mem::zeroed();
        assert_eq!(
            cu::cuCtxCreate_v3(&mut c, &mut param, 1, 0, DEV),
            CUresult::CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY
        );
        ok(cu::cuCtxCreate_v3(&mut c, std::ptr::null_mut(), 0, 0, DEV));
    }
    ok(ctx_destroy(c));
    assert!(current().is_null());
    bind(0);
    let primary = current();
    assert_eq!(ctx_destroy(primary), CUresult::CUDA_ERROR_INVALID_CONTEXT, "primary contexts are released");
    assert_eq!(ctx_destroy(std::ptr::null_mut()), CUresult::CUDA_ERROR_INVALID_VALUE);
    clear_stack();
}
