//! Every driver call cumem-copy makes, each a thin checked wrapper around one `unsafe` FFI call.
//!
//! Callers bind the right context and uphold each function's `# Safety` list; the typed modules
//! above are the only callers.

use std::ffi::c_void;

use cumem_sys::sys::{self, CUdeviceptr, CUstream};
use cumem_sys::{ErrorContext as Ctx, Result, check};

/// # Safety
/// 1. `src` is valid for reads of `bytes` bytes; `[dst, dst + bytes)` is device memory.
pub(crate) unsafe fn htod(dst: CUdeviceptr, src: *const c_void, bytes: usize) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { sys::cuMemcpyHtoD_v2(dst, src, bytes) }, Ctx::op("cuMemcpyHtoD_v2").bytes(bytes))
}

/// # Safety
/// 1. `dst` is valid for writes of `bytes` bytes, and any bytes are valid for its type.
/// 2. `[src, src + bytes)` is device memory.
pub(crate) unsafe fn dtoh(dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { sys::cuMemcpyDtoH_v2(dst, src, bytes) }, Ctx::op("cuMemcpyDtoH_v2").bytes(bytes))
}

/// # Safety
/// 1. Both ranges are device memory of `bytes` bytes.
pub(crate) unsafe fn dtod(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { sys::cuMemcpyDtoD_v2(dst, src, bytes) }, Ctx::op("cuMemcpyDtoD_v2").bytes(bytes))
}

/// # Safety
/// 1. `src` is page-locked and stays valid and unwritten until the copy completes on `stream`.
/// 2. `[dst, dst + bytes)` is device memory usable by work on `stream`.
pub(crate) unsafe fn htod_async(
    dst: CUdeviceptr,
    src: *const c_void,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    let code = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src, bytes, stream) };
    check(code, Ctx::op("cuMemcpyHtoDAsync_v2").bytes(bytes))
}

/// # Safety
/// 1. `dst` is page-locked, valid for writes of `bytes` bytes, and not accessed by the host until
///    the copy completes on `stream`; any bytes are valid for its type.
/// 2. `[src, src + bytes)` is device memory usable by work on `stream`.
pub(crate) unsafe fn dtoh_async(
    dst: *mut c_void,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    let code = unsafe { sys::cuMemcpyDtoHAsync_v2(dst, src, bytes, stream) };
    check(code, Ctx::op("cuMemcpyDtoHAsync_v2").bytes(bytes))
}

/// # Safety
/// 1. Both ranges are device memory of `bytes` bytes usable by work on `stream`.
pub(crate) unsafe fn dtod_async(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    let code = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream) };
    check(code, Ctx::op("cuMemcpyDtoDAsync_v2").bytes(bytes))
}

/// The width of a memset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Width {
    W8(u8),
    W16(u16),
    W32(u32),
}

/// # Safety
/// 1. `[dst, dst + n * width)` is device memory usable by work on `stream`, aligned to the width.
pub(crate) unsafe fn memset_async(dst: CUdeviceptr, value: Width, n: usize, stream: CUstream) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    unsafe {
        match value {
            Width::W8(v) => {
                check(sys::cuMemsetD8Async(dst, v, n, stream), Ctx::op("cuMemsetD8Async").bytes(n))
            }
            Width::W16(v) => {
                check(sys::cuMemsetD16Async(dst, v, n, stream), Ctx::op("cuMemsetD16Async").bytes(n * 2))
            }
            Width::W32(v) => {
                check(sys::cuMemsetD32Async(dst, v, n, stream), Ctx::op("cuMemsetD32Async").bytes(n * 4))
            }
        }
    }
}
