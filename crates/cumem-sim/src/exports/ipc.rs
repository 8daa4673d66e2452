//! Legacy IPC: memory and event handles shared with another process (see `crate::ipc`).

use std::ffi::{c_char, c_uint};

use cudarc::driver::sys::{CUdeviceptr, CUevent, CUipcEventHandle, CUipcMemHandle, CUresult};

use crate::api::{self, Init};
use crate::ipc::handle::SIZE;

fn to_bytes(reserved: &[c_char; SIZE]) -> [u8; SIZE] {
    reserved.map(|c| c as u8)
}

fn to_reserved(bytes: [u8; SIZE]) -> [c_char; SIZE] {
    bytes.map(|b| b as c_char)
}

/// `CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)`: a handle another
/// process opens with `cuIpcOpenMemHandle` to reach the same bytes. `dptr` lies in a
/// `cuMemAlloc`/`cuMemAllocPitch` allocation (an interior pointer names its allocation); pool,
/// VMM, managed and host memory give `INVALID_VALUE`.
///
/// # Safety
/// 1. `p_handle` is NULL or valid for writing a `CUipcMemHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetMemHandle(p_handle: *mut CUipcMemHandle, dptr: CUdeviceptr) -> CUresult {
    api::call("cuIpcGetMemHandle", Init::Required, || {
        api::non_null(p_handle, "pHandle")?;
        let bytes = crate::ipc::memory::get_handle(dptr)?;
        // SAFETY: forwarded caller contract (checked non-NULL).
        unsafe { api::out(p_handle, CUipcMemHandle { reserved: to_reserved(bytes) }, "pHandle") }
    })
}

/// `CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned Flags)`
/// (symbol `_v2`): maps another process's exported allocation into the current context. The
/// exporting process itself or no current context gives `INVALID_CONTEXT`; a handle whose memory
/// is gone, bytes no simulator wrote, or flags other than 0/LAZY_ENABLE_PEER_ACCESS give
/// `INVALID_VALUE`. Opening again in the same context returns the same address; each open needs
/// its own `cuIpcCloseMemHandle`.
///
/// # Safety
/// 1. `pdptr` is NULL or valid for writing a `CUdeviceptr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    pdptr: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    flags: c_uint,
) -> CUresult {
    api::call("cuIpcOpenMemHandle_v2", Init::Required, || {
        api::non_null(pdptr, "pdptr")?;
        let base = crate::ipc::memory::open(&to_bytes(&handle.reserved), flags)?;
        // SAFETY: forwarded caller contract (checked non-NULL).
        unsafe { api::out(pdptr, base, "pdptr") }
    })
}

/// `CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)`: closes one open of an imported allocation;
/// the last close waits for the device's queued work and unmaps it. No current context gives
/// `INVALID_CONTEXT`; anything but an open import (a second close) gives `INVALID_VALUE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuIpcCloseMemHandle(dptr: CUdeviceptr) -> CUresult {
    api::call("cuIpcCloseMemHandle", Init::Required, || crate::ipc::memory::close(dptr))
}

/// `CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event)`: a handle for an
/// event created with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING` (`INVALID_VALUE` for any
/// other event).
///
/// # Safety
/// 1. `p_handle` is NULL or valid for writing a `CUipcEventHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetEventHandle(p_handle: *mut CUipcEventHandle, event: CUevent) -> CUresult {
    api::call("cuIpcGetEventHandle", Init::Required, || {
        api::non_null(p_handle, "pHandle")?;
        let bytes = crate::ipc::event::get_handle(event)?;
        // SAFETY: forwarded caller contract (checked non-NULL).
        unsafe { api::out(p_handle, CUipcEventHandle { reserved: to_reserved(bytes) }, "pHandle") }
    })
}

/// `CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle)`: an event of the
/// current context sharing the exported event's recordings (destroy it with `cuEventDestroy`).
/// Errors as for `cuIpcOpenMemHandle`.
///
/// # Safety
/// 1. `ph_event` is NULL or valid for writing a `CUevent`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenEventHandle(ph_event: *mut CUevent, handle: CUipcEventHandle) -> CUresult {
    api::call("cuIpcOpenEventHandle", Init::Required, || {
        api::non_null(ph_event, "phEvent")?;
        let h = crate::ipc::event::open(&to_bytes(&handle.reserved))?;
        // SAFETY: forwarded caller contract (checked non-NULL).
        unsafe { api::out(ph_event, h as CUevent, "phEvent") }
    })
}

/// `CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned Flags)`: the
/// pre-11.0 name, with the same ABI (IPC came after 64-bit device pointers); as `_v2`.
///
/// # Safety
/// 1. `pdptr` is NULL or valid for writing a `CUdeviceptr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle(
    pdptr: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    flags: c_uint,
) -> CUresult {
    api::call("cuIpcOpenMemHandle", Init::Required, || {
        api::non_null(pdptr, "pdptr")?;
        let base = crate::ipc::memory::open(&to_bytes(&handle.reserved), flags)?;
        // SAFETY: forwarded caller contract (checked non-NULL).
        unsafe { api::out(pdptr, base, "pdptr") }
    })
}
