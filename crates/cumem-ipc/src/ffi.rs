//! Every driver call cumem-ipc makes, each a thin checked wrapper around one `unsafe` FFI call.
//! None of these bind a context; callers do that first.

use std::ffi::c_char;

use cumem_sys::sys::{self, CUdeviceptr, CUevent, CUipcEventHandle, CUipcMemHandle, CUstream};
use cumem_sys::{ErrorContext as Ctx, Result, check};

/// Bytes in a driver IPC handle (`CU_IPC_HANDLE_SIZE`).
pub(crate) const HANDLE_SIZE: usize = 64;

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`.
const LAZY_ENABLE_PEER_ACCESS: u32 = 1;

/// `CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS`, what an exportable event needs.
const INTERPROCESS_EVENT: u32 = 2 | 4;

fn to_bytes(reserved: [c_char; HANDLE_SIZE]) -> [u8; HANDLE_SIZE] {
    reserved.map(|c| c as u8)
}

fn to_reserved(bytes: [u8; HANDLE_SIZE]) -> [c_char; HANDLE_SIZE] {
    bytes.map(|b| b as c_char)
}

pub(crate) fn mem_handle(dptr: CUdeviceptr) -> Result<[u8; HANDLE_SIZE]> {
    let mut h = CUipcMemHandle { reserved: [0; HANDLE_SIZE] };
    // SAFETY: `h` is a valid out-pointer; the driver checks `dptr` itself.
    check(unsafe { sys::cuIpcGetMemHandle(&mut h, dptr) }, Ctx::op("cuIpcGetMemHandle"))?;
    Ok(to_bytes(h.reserved))
}

pub(crate) fn mem_open(bytes: [u8; HANDLE_SIZE]) -> Result<CUdeviceptr> {
    let mut dptr = 0;
    let h = CUipcMemHandle { reserved: to_reserved(bytes) };
    // SAFETY: `dptr` is a valid out-pointer; the handle is passed by value.
    let code = unsafe { sys::cuIpcOpenMemHandle_v2(&mut dptr, h, LAZY_ENABLE_PEER_ACCESS) };
    check(code, Ctx::op("cuIpcOpenMemHandle_v2"))?;
    Ok(dptr)
}

/// # Safety
/// 1. `dptr` was returned by [`mem_open`], is closed once, and nothing uses it afterwards.
pub(crate) unsafe fn mem_close(dptr: CUdeviceptr) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { sys::cuIpcCloseMemHandle(dptr) }, Ctx::op("cuIpcCloseMemHandle"))
}

pub(crate) fn event_create() -> Result<CUevent> {
    let mut e = std::ptr::null_mut();
    // SAFETY: `e` is a valid out-pointer.
    check(unsafe { sys::cuEventCreate(&mut e, INTERPROCESS_EVENT) }, Ctx::op("cuEventCreate"))?;
    Ok(e)
}

pub(crate) fn event_handle(e: CUevent) -> Result<[u8; HANDLE_SIZE]> {
    let mut h = CUipcEventHandle { reserved: [0; HANDLE_SIZE] };
    // SAFETY: `h` is a valid out-pointer; `e` is a live event owned by the caller.
    check(unsafe { sys::cuIpcGetEventHandle(&mut h, e) }, Ctx::op("cuIpcGetEventHandle"))?;
    Ok(to_bytes(h.reserved))
}

pub(crate) fn event_open(bytes: [u8; HANDLE_SIZE]) -> Result<CUevent> {
    let mut e = std::ptr::null_mut();
    let h = CUipcEventHandle { reserved: to_reserved(bytes) };
    // SAFETY: `e` is a valid out-pointer; the handle is passed by value.
    check(unsafe { sys::cuIpcOpenEventHandle(&mut e, h) }, Ctx::op("cuIpcOpenEventHandle"))?;
    Ok(e)
}

/// # Safety
/// 1. `e` is a live event and `s` a live stream of the same context.
pub(crate) unsafe fn event_record(e: CUevent, s: CUstream) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { sys::cuEventRecord(e, s) }, Ctx::op("cuEventRecord"))
}

/// # Safety
/// 1. `e` is a live event.
pub(crate) unsafe fn event_synchronize(e: CUevent) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { sys::cuEventSynchronize(e) }, Ctx::op("cuEventSynchronize"))
}

/// # Safety
/// 1. `e` is a live event.
pub(crate) unsafe fn event_query(e: CUevent) -> Result<bool> {
    // SAFETY: guaranteed by the caller.
    let code = unsafe { sys::cuEventQuery(e) };
    if code == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check(code, Ctx::op("cuEventQuery")).map(|()| true)
}

/// # Safety
/// 1. `s` is a live stream and `e` a live event.
pub(crate) unsafe fn stream_wait_event(s: CUstream, e: CUevent) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { sys::cuStreamWaitEvent(s, e, 0) }, Ctx::op("cuStreamWaitEvent"))
}

/// # Safety
/// 1. `e` is a live event, destroyed once and not used afterwards.
pub(crate) unsafe fn event_destroy(e: CUevent) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { sys::cuEventDestroy_v2(e) }, Ctx::op("cuEventDestroy_v2"))
}

/// The allocation containing `dptr`: `(base, size)`.
pub(crate) fn address_range(dptr: CUdeviceptr) -> Result<(CUdeviceptr, usize)> {
    let (mut base, mut size) = (0, 0);
    // SAFETY: both out-pointers are valid; the driver checks `dptr` itself.
    let code = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, dptr) };
    check(code, Ctx::op("cuMemGetAddressRange_v2"))?;
    Ok((base, size))
}
