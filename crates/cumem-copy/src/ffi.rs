//! Every driver call cumem-copy makes, each a thin checked wrapper around one `unsafe` FFI call.
//!
//! Callers bind the right context and uphold each function's `# Safety` list; the typed modules
//! above are the only callers.

use std::ffi::c_void;

use cumem_sys::sys::{self, CUdeviceptr, CUstream};
use cumem_sys::{ErrorContext as Ctx, Result, api, check};

/// # Safety
/// 1. `src` is valid for reads of `bytes` bytes; `[dst, dst + bytes)` is device memory.
pub(crate) unsafe fn htod(dst: CUdeviceptr, src: *const c_void, bytes: usize) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemcpyHtoD_v2(dst, src, bytes) }, Ctx::op("cuMemcpyHtoD_v2").bytes(bytes))
}

/// # Safety
/// 1. `dst` is valid for writes of `bytes` bytes, and any bytes are valid for its type.
/// 2. `[src, src + bytes)` is device memory.
pub(crate) unsafe fn dtoh(dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemcpyDtoH_v2(dst, src, bytes) }, Ctx::op("cuMemcpyDtoH_v2").bytes(bytes))
}

/// # Safety
/// 1. Both ranges are device memory of `bytes` bytes.
pub(crate) unsafe fn dtod(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemcpyDtoD_v2(dst, src, bytes) }, Ctx::op("cuMemcpyDtoD_v2").bytes(bytes))
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
    let code = unsafe { api::cuMemcpyHtoDAsync_v2(dst, src, bytes, stream) };
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
    let code = unsafe { api::cuMemcpyDtoHAsync_v2(dst, src, bytes, stream) };
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
    let code = unsafe { api::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream) };
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
                check(api::cuMemsetD8Async(dst, v, n, stream), Ctx::op("cuMemsetD8Async").bytes(n))
            }
            Width::W16(v) => {
                check(api::cuMemsetD16Async(dst, v, n, stream), Ctx::op("cuMemsetD16Async").bytes(n * 2))
            }
            Width::W32(v) => {
                check(api::cuMemsetD32Async(dst, v, n, stream), Ctx::op("cuMemsetD32Async").bytes(n * 4))
            }
        }
    }
}

/// A 2D copy; blocking (legacy stream) when `stream` is `None`.
///
/// A blocking copy between two device sides goes through `cuMemcpy2DUnaligned`: the driver
/// documents that `cuMemcpy2D` may refuse (`INVALID_VALUE`) an intra-device copy whose pitches
/// did not come from `cuMemAllocPitch`, and a device view's pitch is whatever the caller chose;
/// the unaligned form has no such restriction. The queued form has no unaligned twin, so
/// `cuMemcpy2DAsync` keeps that caveat (documented on `StreamCopy::copy_2d`).
///
/// # Safety
/// 1. Every row the parameters name lies inside memory of the named kind that the copy may read
///    (source) or write (destination), with no other access during the copy.
/// 2. For `Some(stream)`: host memory is page-locked and stays valid and untouched by the host until
///    the copy completes on `stream`; device memory is usable by work on `stream`.
pub(crate) unsafe fn memcpy_2d(p: &sys::CUDA_MEMCPY2D, stream: Option<CUstream>) -> Result<()> {
    let bytes = p.WidthInBytes.saturating_mul(p.Height);
    let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    let intra_device = p.srcMemoryType == device && p.dstMemoryType == device;
    // SAFETY: guaranteed by the caller; `p` is a valid parameter block.
    unsafe {
        match stream {
            None if intra_device => {
                check(api::cuMemcpy2DUnaligned_v2(p), Ctx::op("cuMemcpy2DUnaligned_v2").bytes(bytes))
            }
            None => check(api::cuMemcpy2D_v2(p), Ctx::op("cuMemcpy2D_v2").bytes(bytes)),
            Some(s) => check(api::cuMemcpy2DAsync_v2(p, s), Ctx::op("cuMemcpy2DAsync_v2").bytes(bytes)),
        }
    }
}

/// A 3D copy; blocking (legacy stream) when `stream` is `None`.
///
/// # Safety
/// 1. As for [`memcpy_2d`], for every row of every slice the parameters name.
pub(crate) unsafe fn memcpy_3d(p: &sys::CUDA_MEMCPY3D, stream: Option<CUstream>) -> Result<()> {
    let bytes = p.WidthInBytes.saturating_mul(p.Height).saturating_mul(p.Depth);
    // SAFETY: guaranteed by the caller; `p` is a valid parameter block.
    unsafe {
        match stream {
            None => check(api::cuMemcpy3D_v2(p), Ctx::op("cuMemcpy3D_v2").bytes(bytes)),
            Some(s) => check(api::cuMemcpy3DAsync_v2(p, s), Ctx::op("cuMemcpy3DAsync_v2").bytes(bytes)),
        }
    }
}

/// Stream-ordered 2D memset of `width` elements (of the value's width) in each of `height` rows
/// `pitch` bytes apart.
///
/// # Safety
/// 1. Every row lies inside device memory usable by work on `stream`, aligned to the width, with
///    `pitch` a multiple of the width.
pub(crate) unsafe fn memset_2d_async(
    dst: CUdeviceptr,
    pitch: usize,
    value: Width,
    width: usize,
    height: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    unsafe {
        match value {
            Width::W8(v) => check(
                api::cuMemsetD2D8Async(dst, pitch, v, width, height, stream),
                Ctx::op("cuMemsetD2D8Async").bytes(width * height),
            ),
            Width::W16(v) => check(
                api::cuMemsetD2D16Async(dst, pitch, v, width, height, stream),
                Ctx::op("cuMemsetD2D16Async").bytes(width * height * 2),
            ),
            Width::W32(v) => check(
                api::cuMemsetD2D32Async(dst, pitch, v, width, height, stream),
                Ctx::op("cuMemsetD2D32Async").bytes(width * height * 4),
            ),
        }
    }
}

/// Page-locked host memory of `bytes` bytes (`cuMemHostAlloc`, no flags), for the staging ring.
/// The context that should own it must be current.
pub(crate) fn host_alloc(bytes: usize) -> Result<std::ptr::NonNull<u8>> {
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer.
    check(unsafe { api::cuMemHostAlloc(&mut p, bytes, 0) }, Ctx::op("cuMemHostAlloc").bytes(bytes))?;
    std::ptr::NonNull::new(p.cast::<u8>())
        .ok_or(cumem_sys::Error::OutOfMemory { ctx: Ctx::op("cuMemHostAlloc").bytes(bytes), report: None })
}

/// # Safety
/// 1. `p` came from [`host_alloc`] and is freed once.
/// 2. No device work and no Rust reference still uses the memory.
pub(crate) unsafe fn host_free(p: std::ptr::NonNull<u8>) -> Result<()> {
    // SAFETY: guaranteed by the caller (items 1 and 2).
    check(unsafe { api::cuMemFreeHost(p.as_ptr().cast()) }, Ctx::op("cuMemFreeHost"))
}
