//! Streams and host functions.

use std::ffi::{c_int, c_uint, c_void};

use cudarc::driver::sys::{CUcontext, CUdevice, CUevent, CUhostFn, CUresult, CUstream};

use crate::api::{self, Init};
use crate::state::SIM;
pub(crate) use crate::stream::resolve;
use crate::stream::{self, Stream};

/// # Safety
/// 1. `ph` is NULL or valid for writing a `CUstream`.
unsafe fn create(name: &'static str, ph: *mut CUstream, flags: c_uint, priority: c_int) -> CUresult {
    api::call(name, Init::Required, || {
        api::non_null(ph, "phStream")?;
        let h = stream::create(flags, priority)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(ph, h as CUstream, "phStream") }
    })
}

/// `CUresult cuStreamCreate(CUstream *phStream, unsigned Flags)`: `Flags` is 0 or
/// `CU_STREAM_NON_BLOCKING`.
///
/// # Safety
/// 1. `ph_stream` is NULL or valid for writing a `CUstream`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(ph_stream: *mut CUstream, flags: c_uint) -> CUresult {
    // SAFETY: forwarded caller contract.
    unsafe { create("cuStreamCreate", ph_stream, flags, 0) }
}

/// `CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned flags, int priority)`:
/// the priority is clamped to the range (0 least, -5 greatest).
///
/// # Safety
/// 1. `ph_stream` is NULL or valid for writing a `CUstream`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    ph_stream: *mut CUstream,
    flags: c_uint,
    priority: c_int,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    unsafe { create("cuStreamCreateWithPriority", ph_stream, flags, priority) }
}

/// `CUresult cuStreamDestroy(CUstream hStream)` (symbol `_v2`): returns at once; queued work
/// still runs. The handle is dead immediately. NULL/legacy/per-thread give `INVALID_HANDLE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(h_stream: CUstream) -> CUresult {
    api::call("cuStreamDestroy_v2", Init::Required, || stream::destroy(h_stream))
}

/// `CUresult cuStreamSynchronize(CUstream hStream)`: waits for everything queued so far (for the
/// legacy stream, also the prior work of the context's blocking streams); then every memory pool
/// of the stream's device releases unused memory above its RELEASE_THRESHOLD.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(h_stream: CUstream) -> CUresult {
    api::call("cuStreamSynchronize", Init::Required, || stream::synchronize(h_stream))
}

/// `CUresult cuStreamQuery(CUstream hStream)`: `SUCCESS` when idle, `NOT_READY` otherwise.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamQuery(h_stream: CUstream) -> CUresult {
    api::call("cuStreamQuery", Init::Required, || stream::query(h_stream))
}

/// `CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned Flags)`: later work
/// of the stream waits for the event's captured work (a never-recorded event is a no-op).
/// `Flags` must be 0 (`CU_EVENT_WAIT_EXTERNAL` is for stream capture only).
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(h_stream: CUstream, h_event: CUevent, flags: c_uint) -> CUresult {
    api::call("cuStreamWaitEvent", Init::Required, || stream::wait_event(h_stream, h_event, flags))
}

/// Reads one property of a stream.
///
/// # Safety
/// 1. `out` is NULL or valid for writing a `T`.
unsafe fn property<T>(
    name: &'static str,
    h: CUstream,
    out: *mut T,
    get: impl FnOnce(&Stream) -> T,
) -> CUresult {
    api::call(name, Init::Required, || {
        api::non_null(out, "out")?;
        let mut st = SIM.st.lock();
        let id = resolve(&mut st, h)?;
        let v = get(&st.streams[&id]);
        // SAFETY: forwarded caller contract.
        unsafe { api::out(out, v, "out") }
    })
}

/// `CUresult cuStreamGetPriority(CUstream hStream, int *priority)`.
///
/// # Safety
/// 1. `priority` is NULL or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetPriority(h_stream: CUstream, priority: *mut c_int) -> CUresult {
    // SAFETY: forwarded caller contract.
    unsafe { property("cuStreamGetPriority", h_stream, priority, |s| s.priority) }
}

/// `CUresult cuStreamGetFlags(CUstream hStream, unsigned *flags)`.
///
/// # Safety
/// 1. `flags` is NULL or valid for writing an `unsigned`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetFlags(h_stream: CUstream, flags: *mut c_uint) -> CUresult {
    // SAFETY: forwarded caller contract.
    unsafe { property("cuStreamGetFlags", h_stream, flags, |s| s.flags) }
}

/// `CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx)`.
///
/// # Safety
/// 1. `pctx` is NULL or valid for writing a `CUcontext`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCtx(h_stream: CUstream, pctx: *mut CUcontext) -> CUresult {
    // SAFETY: forwarded caller contract.
    unsafe { property("cuStreamGetCtx", h_stream, pctx, |s| s.ctx as CUcontext) }
}

/// `CUresult cuStreamGetDevice(CUstream hStream, CUdevice *device)`.
///
/// # Safety
/// 1. `device` is NULL or valid for writing a `CUdevice`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetDevice(h_stream: CUstream, device: *mut CUdevice) -> CUresult {
    // SAFETY: forwarded caller contract.
    unsafe { property("cuStreamGetDevice", h_stream, device, |s| s.device as CUdevice) }
}

/// `CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)`: `fn(userData)`
/// runs on the simulator's callback thread in stream order; CUDA calls made from it fail with
/// `NOT_PERMITTED`.
///
/// # Safety
/// 1. Calling `f(user_data)` once, on another thread, after all prior work of the stream, is valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchHostFunc(
    h_stream: CUstream,
    f: CUhostFn,
    user_data: *mut c_void,
) -> CUresult {
    api::call("cuLaunchHostFunc", Init::Required, || stream::launch_host_fn(h_stream, f, user_data as usize))
}
