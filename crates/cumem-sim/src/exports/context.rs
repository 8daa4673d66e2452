//! Primary contexts and the per-thread context stack.

use std::ffi::{c_int, c_uint};

use cudarc::driver::sys::{CUcontext, CUctxCreateParams, CUdevice, CUexecAffinityParam, CUresult};

use crate::api::{self, Fail, Init};
use crate::context;
use crate::state::SIM;

/// `CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)`: activates (first time)
/// and references the primary context; does not make it current.
///
/// # Safety
/// 1. `pctx` is NULL or valid for writing a `CUcontext`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    api::call("cuDevicePrimaryCtxRetain", Init::Required, || {
        api::non_null(pctx, "pctx")?;
        let h = context::primary_retain(dev)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(pctx, h as CUcontext, "pctx") }
    })
}

/// `CUresult cuDevicePrimaryCtxRelease(CUdevice dev)` (symbol `_v2`): at retain count zero the
/// context is reset (its queued work drains, then its allocations, streams and events are freed).
/// Releasing a context that is not retained gives `INVALID_CONTEXT`.
#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    api::call("cuDevicePrimaryCtxRelease_v2", Init::Required, || context::primary_release(dev))
}

/// `CUresult cuDevicePrimaryCtxReset(CUdevice dev)` (symbol `_v2`): frees everything the context
/// owns and clears its flags and active state, leaving the retain count unchanged.
#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    api::call("cuDevicePrimaryCtxReset_v2", Init::Required, || context::primary_reset(dev))
}

/// `CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned *flags, int *active)`.
///
/// # Safety
/// 1. `flags` and `active` are NULL or valid for writing.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    api::call("cuDevicePrimaryCtxGetState", Init::Required, || {
        api::non_null(flags, "flags")?;
        api::non_null(active, "active")?;
        let st = SIM.st.lock();
        let d = st.ordinal(dev)?;
        let pc = &st.devices[d].ctx;
        // SAFETY: forwarded caller contract (both checked non-NULL).
        unsafe {
            api::out(flags, pc.flags, "flags")?;
            api::out(active, c_int::from(pc.active), "active")
        }
    })
}

/// `CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned flags)` (symbol `_v2`): one
/// scheduling value plus LMEM_RESIZE/COREDUMP/SYNC_MEMOPS bits; MAP_HOST or two scheduling bits
/// give `INVALID_VALUE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) -> CUresult {
    api::call("cuDevicePrimaryCtxSetFlags_v2", Init::Required, || context::primary_set_flags(dev, flags))
}

/// `CUresult cuCtxSetCurrent(CUcontext ctx)`: replaces the top of the thread's stack; NULL pops.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    api::call("cuCtxSetCurrent", Init::Required, || {
        if ctx.is_null() {
            context::set_current(None);
            return Ok(());
        }
        let h = ctx as u64;
        context::check_bindable(h)?;
        context::set_current(Some(h));
        Ok(())
    })
}

/// `CUresult cuCtxGetCurrent(CUcontext *pctx)`: NULL when none is bound.
///
/// # Safety
/// 1. `pctx` is NULL or valid for writing a `CUcontext`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    api::call("cuCtxGetCurrent", Init::Required, || {
        let cur = context::current().unwrap_or(0) as CUcontext;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(pctx, cur, "pctx") }
    })
}

/// `CUresult cuCtxPushCurrent(CUcontext ctx)` (symbol `_v2`).
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    api::call("cuCtxPushCurrent_v2", Init::Required, || {
        if ctx.is_null() {
            return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, "cuCtxPushCurrent(NULL)"));
        }
        let h = ctx as u64;
        context::check_bindable(h)?;
        context::push(h);
        Ok(())
    })
}

/// `CUresult cuCtxPopCurrent(CUcontext *pctx)` (symbol `_v2`): `pctx` may be NULL; an empty
/// stack gives `INVALID_CONTEXT`.
///
/// # Safety
/// 1. `pctx` is NULL or valid for writing a `CUcontext`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    api::call("cuCtxPopCurrent_v2", Init::Required, || {
        let Some(h) = context::pop() else {
            return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_CONTEXT, "context stack is empty"));
        };
        if !pctx.is_null() {
            // SAFETY: non-NULL and valid per the caller contract.
            unsafe { pctx.write(h as CUcontext) };
        }
        Ok(())
    })
}

/// `CUresult cuCtxGetDevice(CUdevice *device)`.
///
/// # Safety
/// 1. `out_device` is NULL or valid for writing a `CUdevice`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(out_device: *mut CUdevice) -> CUresult {
    api::call("cuCtxGetDevice", Init::Required, || {
        api::non_null(out_device, "device")?;
        let d = context::require(&SIM.st.lock())?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(out_device, d as CUdevice, "device") }
    })
}

/// `CUresult cuCtxGetFlags(unsigned *flags)`: a primary context's flags always include
/// MAP_HOST; a created context answers the flags it was created (or last set) with.
///
/// # Safety
/// 1. `flags` is NULL or valid for writing an `unsigned`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetFlags(flags: *mut c_uint) -> CUresult {
    api::call("cuCtxGetFlags", Init::Required, || {
        api::non_null(flags, "flags")?;
        let f = context::flags()?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(flags, f, "flags") }
    })
}

/// `CUresult cuCtxSetFlags(unsigned flags)`: replaces the current context's flags, with the
/// rules of `cuDevicePrimaryCtxSetFlags` (MAP_HOST, two scheduling bits or bits above 0xff give
/// `INVALID_VALUE`).
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetFlags(flags: c_uint) -> CUresult {
    api::call("cuCtxSetFlags", Init::Required, || context::set_flags(flags))
}

/// `CUresult cuCtxCreate(CUcontext *pctx, unsigned flags, CUdevice dev)` (symbol `_v2`): a new
/// context on `dev`, made current (pushed). One scheduling value plus MAP_HOST, LMEM_RESIZE,
/// COREDUMP and SYNC_MEMOPS bits; other flags give `INVALID_VALUE`, a bad device
/// `INVALID_DEVICE`.
///
/// # Safety
/// 1. `pctx` is NULL or valid for writing a `CUcontext`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult {
    api::call("cuCtxCreate_v2", Init::Required, || {
        api::non_null(pctx, "pctx")?;
        let h = context::create(flags, dev)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(pctx, h as CUcontext, "pctx") }
    })
}

/// Refuses execution-affinity parameters: SM partitioning is not modelled, so the simulator
/// answers like a device without affinity support (`UNSUPPORTED_EXEC_AFFINITY`, documented).
fn no_affinity(params: *const CUexecAffinityParam, count: c_int) -> Result<(), Fail> {
    match count {
        0 => Ok(()),
        n if n < 0 => Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("{n} execution-affinity parameters"),
        )),
        _ if params.is_null() => {
            Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, "NULL execution-affinity parameters"))
        }
        _ => Err(Fail::quiet(CUresult::CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY)),
    }
}

/// `CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
/// unsigned flags, CUdevice dev)`: as `cuCtxCreate_v2` when `numParams` is 0; execution-affinity
/// parameters give `UNSUPPORTED_EXEC_AFFINITY` (not modelled), a negative count or NULL array
/// `INVALID_VALUE`.
///
/// # Safety
/// 1. `pctx` is NULL or valid for writing a `CUcontext`; `params` is only compared with NULL.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    params: *mut CUexecAffinityParam,
    num_params: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    api::call("cuCtxCreate_v3", Init::Required, || {
        api::non_null(pctx, "pctx")?;
        no_affinity(params, num_params)?;
        let h = context::create(flags, dev)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(pctx, h as CUcontext, "pctx") }
    })
}

/// `CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned flags,
/// CUdevice dev)`: as `cuCtxCreate_v2` with NULL parameters (observed on an H100) or parameters
/// without execution affinity and CIG; affinity gives `UNSUPPORTED_EXEC_AFFINITY`, CIG
/// parameters `NOT_SUPPORTED` (neither is modelled).
///
/// # Safety
/// 1. `pctx` is NULL or valid for writing a `CUcontext`; `params` is NULL or valid for reading a
///    `CUctxCreateParams`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    params: *mut CUctxCreateParams,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    api::call("cuCtxCreate_v4", Init::Required, || {
        api::non_null(pctx, "pctx")?;
        if !params.is_null() {
            // SAFETY: non-NULL and valid for reading (caller contract).
            let p = unsafe { params.read() };
            no_affinity(p.execAffinityParams, p.numExecAffinityParams)?;
            if !p.cigParams.is_null() {
                return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED));
            }
        }
        let h = context::create(flags, dev)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(pctx, h as CUcontext, "pctx") }
    })
}

/// `CUresult cuCtxDestroy(CUcontext ctx)` (symbol `_v2`): drains the context's work, then frees
/// its allocations, streams and events and pops it if it is current. A destroyed context gives
/// `CONTEXT_IS_DESTROYED`; a primary context or an unknown handle `INVALID_CONTEXT`; NULL
/// `INVALID_VALUE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    api::call("cuCtxDestroy_v2", Init::Required, || context::destroy(ctx as u64))
}

/// `CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit)`: the current context's limit (the
/// documented defaults until set); the CIG limits give `UNSUPPORTED_LIMIT`, unknown numbers
/// `INVALID_VALUE`.
///
/// # Safety
/// 1. `pvalue` is NULL or valid for writing a `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetLimit(pvalue: *mut usize, limit: u32) -> CUresult {
    api::call("cuCtxGetLimit", Init::Required, || {
        api::non_null(pvalue, "pvalue")?;
        let v = context::limit(limit)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(pvalue, v as usize, "pvalue") }
    })
}

/// `CUresult cuCtxSetLimit(CUlimit limit, size_t value)`: sets a limit of the current context
/// (the persisting L2 size is clamped to the device's maximum).
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetLimit(limit: u32, value: usize) -> CUresult {
    api::call("cuCtxSetLimit", Init::Required, || context::set_limit(limit, value as u64))
}

/// `CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned *version)`: 3020 for every usable
/// context (NULL: the current one); a destroyed context gives `CONTEXT_IS_DESTROYED`, an unknown
/// handle `INVALID_CONTEXT`.
///
/// # Safety
/// 1. `version` is NULL or valid for writing an `unsigned`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetApiVersion(ctx: CUcontext, version: *mut c_uint) -> CUresult {
    api::call("cuCtxGetApiVersion", Init::Required, || {
        api::non_null(version, "version")?;
        let v = context::api_version(ctx as u64)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(version, v, "version") }
    })
}

/// `CUresult cuCtxSynchronize(void)`: waits for all work queued so far in every stream of the
/// current context; then every memory pool of its device releases unused memory above its
/// RELEASE_THRESHOLD.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    api::call("cuCtxSynchronize", Init::Required, context::synchronize)
}

/// Least (0) and greatest (-5) stream priority.
pub use crate::stream::STREAM_PRIORITY_RANGE;

/// `CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest)`: (0, -5); either pointer
/// may be NULL.
///
/// # Safety
/// 1. `least` and `greatest` are NULL or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) -> CUresult {
    api::call("cuCtxGetStreamPriorityRange", Init::Required, || {
        context::require(&SIM.st.lock())?;
        // SAFETY: each pointer is written only if non-NULL, valid per the caller contract.
        unsafe {
            if !least.is_null() {
                least.write(STREAM_PRIORITY_RANGE.0);
            }
            if !greatest.is_null() {
                greatest.write(STREAM_PRIORITY_RANGE.1);
            }
        }
        Ok(())
    })
}
