//! Every driver call cumem-core makes, each a thin checked wrapper around one `unsafe` FFI call.
//!
//! Keeping them here means the unsafe surface of the crate is one short file to review: callers
//! pass valid handles (owned by the safe types) and the wrappers turn codes into [`Error`]s.
//! None of these bind a context; callers do that first.

use std::ffi::{c_char, c_void};

use cumem_sys::sys::{self, CUcontext, CUdevice, CUdevice_attribute, CUdeviceptr, CUevent, CUstream};
use cumem_sys::{Error, ErrorContext as Ctx, Result, api, check};

pub(crate) fn device_count() -> Result<i32> {
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer.
    check(unsafe { api::cuDeviceGetCount(&mut n) }, Ctx::op("cuDeviceGetCount"))?;
    Ok(n)
}

pub(crate) fn device_get(ordinal: i32) -> Result<CUdevice> {
    let mut dev = 0;
    // SAFETY: `dev` is a valid out-pointer.
    check(unsafe { api::cuDeviceGet(&mut dev, ordinal) }, Ctx::op("cuDeviceGet").device(ordinal))?;
    Ok(dev)
}

pub(crate) fn device_name(dev: CUdevice) -> Result<String> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: the driver writes at most `len` bytes including the NUL into `buf`.
    let code = unsafe { api::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev) };
    check(code, Ctx::op("cuDeviceGetName"))?;
    let bytes: Vec<u8> = buf.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

pub(crate) fn device_attribute(dev: CUdevice, attr: CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer; `attr` is a valid enum value by construction.
    let code = unsafe { api::cuDeviceGetAttribute(&mut v, attr, dev) };
    check(code, Ctx::op("cuDeviceGetAttribute").device(dev))?;
    Ok(v)
}

/// `cuDeviceCanAccessPeer`: whether `dev` can access `peer`'s memory (0 for `dev == peer`).
pub(crate) fn device_can_access_peer(dev: CUdevice, peer: CUdevice) -> Result<bool> {
    let mut can = 0;
    // SAFETY: `can` is a valid out-pointer; the driver checks the ordinals.
    let code = unsafe { api::cuDeviceCanAccessPeer(&mut can, dev, peer) };
    check(code, Ctx::op("cuDeviceCanAccessPeer").device(dev))?;
    Ok(can != 0)
}

pub(crate) fn device_total_mem(dev: CUdevice) -> Result<usize> {
    let mut bytes = 0;
    // SAFETY: `bytes` is a valid out-pointer.
    check(unsafe { api::cuDeviceTotalMem_v2(&mut bytes, dev) }, Ctx::op("cuDeviceTotalMem_v2").device(dev))?;
    Ok(bytes)
}

pub(crate) fn primary_ctx_retain(dev: CUdevice) -> Result<CUcontext> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer.
    let code = unsafe { api::cuDevicePrimaryCtxRetain(&mut ctx, dev) };
    check(code, Ctx::op("cuDevicePrimaryCtxRetain").device(dev))?;
    Ok(ctx)
}

pub(crate) fn primary_ctx_release(dev: CUdevice) -> Result<()> {
    // SAFETY: no pointers; the caller holds one retain of this device's primary context.
    let code = unsafe { api::cuDevicePrimaryCtxRelease_v2(dev) };
    check(code, Ctx::op("cuDevicePrimaryCtxRelease_v2").device(dev))
}

/// The calling thread's current context (NULL when none).
pub(crate) fn ctx_get_current() -> Result<CUcontext> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the driver only writes the handle.
    check(unsafe { api::cuCtxGetCurrent(&mut ctx) }, Ctx::op("cuCtxGetCurrent"))?;
    Ok(ctx)
}

pub(crate) fn ctx_set_current(ctx: CUcontext) -> Result<()> {
    // SAFETY: `ctx` is a live context handle owned by a `Context`.
    check(unsafe { api::cuCtxSetCurrent(ctx) }, Ctx::op("cuCtxSetCurrent"))
}

pub(crate) fn ctx_synchronize() -> Result<()> {
    // SAFETY: no pointers.
    check(unsafe { api::cuCtxSynchronize() }, Ctx::op("cuCtxSynchronize"))
}

pub(crate) fn ctx_stream_priority_range() -> Result<(i32, i32)> {
    let (mut least, mut greatest) = (0, 0);
    // SAFETY: both are valid out-pointers.
    let code = unsafe { api::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) };
    check(code, Ctx::op("cuCtxGetStreamPriorityRange"))?;
    Ok((least, greatest))
}

pub(crate) fn mem_get_info() -> Result<(usize, usize)> {
    let (mut free, mut total) = (0, 0);
    // SAFETY: both are valid out-pointers.
    check(unsafe { api::cuMemGetInfo_v2(&mut free, &mut total) }, Ctx::op("cuMemGetInfo_v2"))?;
    Ok((free, total))
}

pub(crate) fn mem_alloc(bytes: usize, device: i32) -> Result<CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: `ptr` is a valid out-pointer.
    let code = unsafe { api::cuMemAlloc_v2(&mut ptr, bytes) };
    check(code, Ctx::op("cuMemAlloc_v2").bytes(bytes).device(device))?;
    Ok(ptr)
}

/// # Safety
/// 1. `ptr` came from `cuMemAlloc` in the current context and is freed once.
/// 2. No live Rust value refers to the memory any more.
pub(crate) unsafe fn mem_free(ptr: CUdeviceptr) -> Result<()> {
    // SAFETY: guaranteed by the caller (items 1 and 2).
    check(unsafe { api::cuMemFree_v2(ptr) }, Ctx::op("cuMemFree_v2"))
}

pub(crate) fn mem_host_alloc(bytes: usize, flags: u32) -> Result<*mut c_void> {
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer.
    check(unsafe { api::cuMemHostAlloc(&mut p, bytes, flags) }, Ctx::op("cuMemHostAlloc").bytes(bytes))?;
    if p.is_null() && bytes > 0 {
        return Err(Error::OutOfMemory { ctx: Ctx::op("cuMemHostAlloc").bytes(bytes), report: None });
    }
    Ok(p)
}

/// # Safety
/// 1. `p` came from `cuMemHostAlloc` and is freed once.
/// 2. No device work and no Rust reference still uses the memory.
pub(crate) unsafe fn mem_free_host(p: *mut c_void) -> Result<()> {
    // SAFETY: guaranteed by the caller (items 1 and 2).
    check(unsafe { api::cuMemFreeHost(p) }, Ctx::op("cuMemFreeHost"))
}

/// Synchronous host-to-device copy on the legacy stream; the source may be reused on return.
///
/// # Safety
/// 1. `src` is valid for reads of `bytes` bytes.
/// 2. `[dst, dst + bytes)` is device memory that no other Rust value may use concurrently.
pub(crate) unsafe fn memcpy_htod(dst: CUdeviceptr, src: *const c_void, bytes: usize) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemcpyHtoD_v2(dst, src, bytes) }, Ctx::op("cuMemcpyHtoD_v2").bytes(bytes))
}

/// Synchronous device-to-host copy; complete on return.
///
/// # Safety
/// 1. `dst` is valid for writes of `bytes` bytes and any bytes written are valid for its type.
/// 2. `[src, src + bytes)` is device memory.
pub(crate) unsafe fn memcpy_dtoh(dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemcpyDtoH_v2(dst, src, bytes) }, Ctx::op("cuMemcpyDtoH_v2").bytes(bytes))
}

/// Stream-ordered byte memset.
///
/// # Safety
/// 1. `[dst, dst + bytes)` is device memory that work on `stream` may write.
pub(crate) unsafe fn memset_d8_async(
    dst: CUdeviceptr,
    value: u8,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: guaranteed by the caller; `stream` is a live handle.
    check(unsafe { api::cuMemsetD8Async(dst, value, bytes, stream) }, Ctx::op("cuMemsetD8Async").bytes(bytes))
}

pub(crate) fn stream_create(flags: u32, priority: i32) -> Result<CUstream> {
    let mut s = std::ptr::null_mut();
    // SAFETY: `s` is a valid out-pointer.
    let code = unsafe { api::cuStreamCreateWithPriority(&mut s, flags, priority) };
    check(code, Ctx::op("cuStreamCreateWithPriority"))?;
    Ok(s)
}

/// # Safety
/// 1. `s` is a stream created by `stream_create` and destroyed once; it is not used afterwards.
pub(crate) unsafe fn stream_destroy(s: CUstream) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuStreamDestroy_v2(s) }, Ctx::op("cuStreamDestroy_v2"))
}

pub(crate) fn stream_synchronize(s: CUstream) -> Result<()> {
    // SAFETY: `s` is a live stream handle (or the legacy stream, NULL).
    check(unsafe { api::cuStreamSynchronize(s) }, Ctx::op("cuStreamSynchronize"))
}

/// `Ok(true)` when all work is done, `Ok(false)` while some is pending.
pub(crate) fn stream_query(s: CUstream) -> Result<bool> {
    // SAFETY: `s` is a live stream handle.
    match unsafe { api::cuStreamQuery(s) } {
        code if code == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        code => check(code, Ctx::op("cuStreamQuery")).map(|()| true),
    }
}

pub(crate) fn stream_wait_event(s: CUstream, e: CUevent) -> Result<()> {
    // SAFETY: both are live handles.
    check(unsafe { api::cuStreamWaitEvent(s, e, 0) }, Ctx::op("cuStreamWaitEvent"))
}

pub(crate) fn event_create(flags: u32) -> Result<CUevent> {
    let mut e = std::ptr::null_mut();
    // SAFETY: `e` is a valid out-pointer.
    check(unsafe { api::cuEventCreate(&mut e, flags) }, Ctx::op("cuEventCreate"))?;
    Ok(e)
}

/// # Safety
/// 1. `e` was created by `event_create`, is destroyed once and not used afterwards.
pub(crate) unsafe fn event_destroy(e: CUevent) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuEventDestroy_v2(e) }, Ctx::op("cuEventDestroy_v2"))
}

pub(crate) fn event_record(e: CUevent, s: CUstream) -> Result<()> {
    // SAFETY: both are live handles of the same context.
    check(unsafe { api::cuEventRecord(e, s) }, Ctx::op("cuEventRecord"))
}

pub(crate) fn event_query(e: CUevent) -> Result<bool> {
    // SAFETY: `e` is a live event handle.
    match unsafe { api::cuEventQuery(e) } {
        code if code == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        code => check(code, Ctx::op("cuEventQuery")).map(|()| true),
    }
}

pub(crate) fn event_synchronize(e: CUevent) -> Result<()> {
    // SAFETY: `e` is a live event handle.
    check(unsafe { api::cuEventSynchronize(e) }, Ctx::op("cuEventSynchronize"))
}

pub(crate) fn event_elapsed_ms(start: CUevent, end: CUevent) -> Result<f32> {
    let mut ms = 0.0f32;
    // SAFETY: `ms` is a valid out-pointer; both events are live handles.
    check(unsafe { api::cuEventElapsedTime(&mut ms, start, end) }, Ctx::op("cuEventElapsedTime"))?;
    Ok(ms)
}

/// The device address of pinned or registered host memory at `p`.
pub(crate) fn mem_host_get_device_pointer(p: *mut c_void) -> Result<CUdeviceptr> {
    let mut d = 0;
    // SAFETY: `d` is a valid out-pointer; the driver only looks `p` up.
    let code = unsafe { api::cuMemHostGetDevicePointer_v2(&mut d, p, 0) };
    check(code, Ctx::op("cuMemHostGetDevicePointer_v2"))?;
    Ok(d)
}

/// Page-locks `[p, p + bytes)` for the current context (`flags`: `CU_MEMHOSTREGISTER_*`).
///
/// # Safety
/// 1. `[p, p + bytes)` is host memory that stays allocated until `mem_host_unregister(p)`.
pub(crate) unsafe fn mem_host_register(p: *mut c_void, bytes: usize, flags: u32) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    let code = unsafe { api::cuMemHostRegister_v2(p, bytes, flags) };
    check(code, Ctx::op("cuMemHostRegister_v2").bytes(bytes))
}

/// Unpins a range registered at base `p`.
///
/// # Safety
/// 1. `p` is the base of a live registration made by `mem_host_register`, unregistered once.
/// 2. No device work uses the range any more.
pub(crate) unsafe fn mem_host_unregister(p: *mut c_void) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemHostUnregister(p) }, Ctx::op("cuMemHostUnregister"))
}

/// Whether `ptr` is managed memory (`CU_POINTER_ATTRIBUTE_IS_MANAGED`). An address the driver
/// does not know (plain pageable host memory) is not: the driver answers it with
/// `CUDA_ERROR_INVALID_VALUE` (`driver-api.md` §5). Any other error is passed on: it says
/// nothing about the memory, and a managed slice taken for a pageable one would be copied
/// unsoundly.
pub(crate) fn pointer_is_managed(ptr: CUdeviceptr) -> Result<bool> {
    // Wider than the driver's answer and zeroed, so whatever width it writes reads back right.
    let mut v: u64 = 0;
    // SAFETY: `v` is valid for writes of 8 bytes, more than the attribute's size; the driver only
    // looks `ptr` up.
    let code = unsafe {
        api::cuPointerGetAttribute(
            (&raw mut v).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            ptr,
        )
    };
    if code == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(false);
    }
    check(code, Ctx::op("cuPointerGetAttribute(IS_MANAGED)"))?;
    Ok(v != 0)
}

/// The ordinal of the device whose context allocated the memory at `ptr`.
pub(crate) fn pointer_device_ordinal(ptr: CUdeviceptr) -> Result<i32> {
    let mut v: i32 = 0;
    // SAFETY: `v` is valid for writes of the attribute's size (an int); the driver only looks
    // `ptr` up.
    let code = unsafe {
        api::cuPointerGetAttribute(
            (&raw mut v).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    check(code, Ctx::op("cuPointerGetAttribute(DEVICE_ORDINAL)"))?;
    Ok(v)
}
