//! Copies and memsets (synchronous and asynchronous). The rules for when each returns live in
//! the crate's `copy` module (and the README).

use std::ffi::{c_uchar, c_uint, c_ushort, c_void};

use cudarc::driver::sys::{CUdeviceptr, CUresult, CUstream};

use crate::abi::{Memcpy2D, Memcpy3D};
use crate::api::{self, ApiResult, Init};
use crate::copy::{Copy3D, Role, Side, memcpy, memcpy_3d, memset, memset_2d};

/// `CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)`. Direction is inferred from the addresses (UVA); plain host addresses are pageable memory.
/// Every address is bounds-checked against its allocation before anything is queued.
///
/// # Safety
/// 1. Host (non-CUDA) addresses are valid for `byte_count` bytes of reading (source) or writing
///    (destination), and a pageable destination stays valid until the call returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, byte_count: usize) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpy", Init::Required, || unsafe {
        memcpy(dst, Role::Unified, src, Role::Unified, byte_count, None)
    })
}

/// `CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)`. Direction is inferred from the addresses (UVA).
/// Every address is bounds-checked against its allocation before anything is queued.
/// Between two host memories (pinned, mapped, registered, pageable) it returns only after the
/// stream's earlier work and the copy, as on an H100 (`copy::async_waits`).
///
/// # Safety
/// 1. Host (non-CUDA) addresses are valid for `byte_count` bytes of reading (source) or writing
///    (destination), and a pageable destination stays valid until the call returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyAsync(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    byte_count: usize,
    h_stream: CUstream,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpyAsync", Init::Required, || unsafe {
        memcpy(dst, Role::Unified, src, Role::Unified, byte_count, Some(h_stream))
    })
}

/// `CUresult cuMemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)` (symbol `cuMemcpyHtoD_v2`). Returns once the bytes have arrived.
/// Every address is bounds-checked against its allocation before anything is queued.
///
/// # Safety
/// 1. Host (non-CUDA) addresses are valid for `byte_count` bytes of reading (source) or writing
///    (destination), and a pageable destination stays valid until the call returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst_device: CUdeviceptr,
    src_host: *const c_void,
    byte_count: usize,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpyHtoD_v2", Init::Required, || unsafe {
        memcpy(dst_device, Role::Device, src_host as u64, Role::Host, byte_count, None)
    })
}

/// `CUresult cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)` (symbol `cuMemcpyDtoH_v2`). Returns once the bytes have arrived.
/// Every address is bounds-checked against its allocation before anything is queued.
///
/// # Safety
/// 1. Host (non-CUDA) addresses are valid for `byte_count` bytes of reading (source) or writing
///    (destination), and a pageable destination stays valid until the call returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    dst_host: *mut c_void,
    src_device: CUdeviceptr,
    byte_count: usize,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpyDtoH_v2", Init::Required, || unsafe {
        memcpy(dst_host as u64, Role::Host, src_device, Role::Device, byte_count, None)
    })
}

/// `CUresult cuMemcpyDtoD(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)` (symbol `cuMemcpyDtoD_v2`). Queued on the legacy stream; returns immediately (device to device).
/// Every address is bounds-checked against its allocation before anything is queued.
///
/// # Safety
/// 1. Host (non-CUDA) addresses are valid for `byte_count` bytes of reading (source) or writing
///    (destination), and a pageable destination stays valid until the call returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(
    dst_device: CUdeviceptr,
    src_device: CUdeviceptr,
    byte_count: usize,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpyDtoD_v2", Init::Required, || unsafe {
        memcpy(dst_device, Role::Device, src_device, Role::Device, byte_count, None)
    })
}

/// `CUresult cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream)` (symbol `cuMemcpyHtoDAsync_v2`). Pinned sources are read when the copy runs; pageable sources are staged before returning.
/// Every address is bounds-checked against its allocation before anything is queued.
/// Between two host memories (pinned, mapped, registered, pageable) it returns only after the
/// stream's earlier work and the copy, as on an H100 (`copy::async_waits`).
///
/// # Safety
/// 1. Host (non-CUDA) addresses are valid for `byte_count` bytes of reading (source) or writing
///    (destination), and a pageable destination stays valid until the call returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst_device: CUdeviceptr,
    src_host: *const c_void,
    byte_count: usize,
    h_stream: CUstream,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpyHtoDAsync_v2", Init::Required, || unsafe {
        memcpy(dst_device, Role::Device, src_host as u64, Role::Host, byte_count, Some(h_stream))
    })
}

/// `CUresult cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)` (symbol `cuMemcpyDtoHAsync_v2`). Pinned destinations are written when the copy runs; pageable destinations before returning.
/// Every address is bounds-checked against its allocation before anything is queued.
/// Between two host memories (pinned, mapped, registered, pageable) it returns only after the
/// stream's earlier work and the copy, as on an H100 (`copy::async_waits`).
///
/// # Safety
/// 1. Host (non-CUDA) addresses are valid for `byte_count` bytes of reading (source) or writing
///    (destination), and a pageable destination stays valid until the call returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst_host: *mut c_void,
    src_device: CUdeviceptr,
    byte_count: usize,
    h_stream: CUstream,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpyDtoHAsync_v2", Init::Required, || unsafe {
        memcpy(dst_host as u64, Role::Host, src_device, Role::Device, byte_count, Some(h_stream))
    })
}

/// `CUresult cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)` (symbol `cuMemcpyDtoDAsync_v2`). Runs in stream order.
/// Every address is bounds-checked against its allocation before anything is queued.
/// Between two host memories (pinned, mapped, registered, pageable) it returns only after the
/// stream's earlier work and the copy, as on an H100 (`copy::async_waits`).
///
/// # Safety
/// 1. Host (non-CUDA) addresses are valid for `byte_count` bytes of reading (source) or writing
///    (destination), and a pageable destination stays valid until the call returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dst_device: CUdeviceptr,
    src_device: CUdeviceptr,
    byte_count: usize,
    h_stream: CUstream,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpyDtoDAsync_v2", Init::Required, || unsafe {
        memcpy(dst_device, Role::Device, src_device, Role::Device, byte_count, Some(h_stream))
    })
}

/// `CUresult cuMemsetD8(CUdeviceptr dstDevice, unsigned char value, size_t N)`: sets
/// `N` 8-bit elements. Device targets are queued on the legacy stream (returns immediately); pinned targets complete before returning.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8_v2(dst_device: CUdeviceptr, value: c_uchar, n: usize) -> CUresult {
    api::call("cuMemsetD8_v2", Init::Required, || memset(dst_device, u32::from(value), 1, n, None))
}

/// `CUresult cuMemsetD16(CUdeviceptr dstDevice, unsigned short value, size_t N)`: sets
/// `N` 16-bit elements. Device targets are queued on the legacy stream (returns immediately); pinned targets complete before returning. `dstDevice` must be 2-byte aligned.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD16_v2(dst_device: CUdeviceptr, value: c_ushort, n: usize) -> CUresult {
    api::call("cuMemsetD16_v2", Init::Required, || memset(dst_device, u32::from(value), 2, n, None))
}

/// `CUresult cuMemsetD32(CUdeviceptr dstDevice, unsigned int value, size_t N)`: sets
/// `N` 32-bit elements. Device targets are queued on the legacy stream (returns immediately); pinned targets complete before returning. `dstDevice` must be 4-byte aligned.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD32_v2(dst_device: CUdeviceptr, value: c_uint, n: usize) -> CUresult {
    api::call("cuMemsetD32_v2", Init::Required, || memset(dst_device, value, 4, n, None))
}

/// `CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char value, size_t N, CUstream hStream)`: sets
/// `N` 8-bit elements. Runs in stream order.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8Async(
    dst_device: CUdeviceptr,
    value: c_uchar,
    n: usize,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemsetD8Async", Init::Required, || {
        memset(dst_device, u32::from(value), 1, n, Some(h_stream))
    })
}

/// `CUresult cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short value, size_t N, CUstream hStream)`: sets
/// `N` 16-bit elements. Runs in stream order. `dstDevice` must be 2-byte aligned.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD16Async(
    dst_device: CUdeviceptr,
    value: c_ushort,
    n: usize,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemsetD16Async", Init::Required, || {
        memset(dst_device, u32::from(value), 2, n, Some(h_stream))
    })
}

/// `CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int value, size_t N, CUstream hStream)`: sets
/// `N` 32-bit elements. Runs in stream order. `dstDevice` must be 4-byte aligned.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD32Async(
    dst_device: CUdeviceptr,
    value: c_uint,
    n: usize,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemsetD32Async", Init::Required, || memset(dst_device, value, 4, n, Some(h_stream)))
}

/// Decodes a `CUDA_MEMCPY2D` (`_v2` layout).
///
/// # Safety
/// 1. `p` is NULL or valid for reading a `CUDA_MEMCPY2D`.
unsafe fn decode_2d(p: *const cudarc::driver::sys::CUDA_MEMCPY2D) -> Result<Copy3D, api::Fail> {
    api::non_null(p, "pCopy")?;
    // SAFETY: non-NULL and valid (caller contract); read with raw integer enumerators.
    let c = unsafe { p.cast::<Memcpy2D>().read() };
    let side = |t, h: u64, d, a: u64, x, y, pitch| Side {
        mem_type: t,
        host: h,
        device: d,
        array: a,
        x,
        y,
        z: 0,
        lod: 0,
        pitch,
        height: 0,
    };
    Ok(Copy3D {
        src: side(
            c.src_type,
            c.src_host as u64,
            c.src_device,
            c.src_array as u64,
            c.src_x,
            c.src_y,
            c.src_pitch,
        ),
        dst: side(
            c.dst_type,
            c.dst_host as u64,
            c.dst_device,
            c.dst_array as u64,
            c.dst_x,
            c.dst_y,
            c.dst_pitch,
        ),
        width: c.width,
        height: c.height,
        depth: 1,
        reserved_set: false,
        three_d: false,
    })
}

/// Decodes a `CUDA_MEMCPY3D` (`_v2` layout).
///
/// # Safety
/// 1. `p` is NULL or valid for reading a `CUDA_MEMCPY3D`.
pub(crate) unsafe fn decode_3d(p: *const cudarc::driver::sys::CUDA_MEMCPY3D) -> Result<Copy3D, api::Fail> {
    api::non_null(p, "pCopy")?;
    // SAFETY: non-NULL and valid (caller contract); read with raw integer enumerators.
    let c = unsafe { p.cast::<Memcpy3D>().read() };
    Ok(Copy3D {
        src: Side {
            mem_type: c.src_type,
            host: c.src_host as u64,
            device: c.src_device,
            array: c.src_array as u64,
            x: c.src_x,
            y: c.src_y,
            z: c.src_z,
            lod: c.src_lod,
            pitch: c.src_pitch,
            height: c.src_height,
        },
        dst: Side {
            mem_type: c.dst_type,
            host: c.dst_host as u64,
            device: c.dst_device,
            array: c.dst_array as u64,
            x: c.dst_x,
            y: c.dst_y,
            z: c.dst_z,
            lod: c.dst_lod,
            pitch: c.dst_pitch,
            height: c.dst_height,
        },
        width: c.width,
        height: c.height,
        depth: c.depth,
        reserved_set: !c.reserved0.is_null() || !c.reserved1.is_null(),
        three_d: true,
    })
}

/// # Safety
/// 1. `p` is NULL or valid for reading a `CUDA_MEMCPY2D` whose host rows are valid.
unsafe fn copy_2d(p: *const cudarc::driver::sys::CUDA_MEMCPY2D, stream: Option<CUstream>) -> ApiResult {
    // SAFETY: forwarded caller contract.
    unsafe { memcpy_3d(decode_2d(p)?, stream) }
}

/// `CUresult cuMemcpy2D(const CUDA_MEMCPY2D *pCopy)` (symbol `_v2`): a 2D copy between HOST,
/// DEVICE and UNIFIED memory (ARRAY gives `INVALID_VALUE`: no CUDA array exists in the
/// simulator). Height or width 0 succeeds untouched; pitches must hold `x + WidthInBytes` when
/// `Height > 1`; every row is bounds-checked before anything is written. Returns like the 1-D
/// synchronous copies (immediately for device-to-device, after completion otherwise). Any pitch
/// is accepted (as for `cuMemcpy2DUnaligned`).
///
/// # Safety
/// 1. `p_copy` is NULL or valid for reading; its host rows are valid for the copy.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy2D_v2(p_copy: *const cudarc::driver::sys::CUDA_MEMCPY2D) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpy2D_v2", Init::Required, || unsafe { copy_2d(p_copy, None) })
}

/// `CUresult cuMemcpy2DUnaligned(const CUDA_MEMCPY2D *pCopy)` (symbol `_v2`): same as
/// `cuMemcpy2D`.
///
/// # Safety
/// 1. `p_copy` is NULL or valid for reading; its host rows are valid for the copy.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy2DUnaligned_v2(
    p_copy: *const cudarc::driver::sys::CUDA_MEMCPY2D,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpy2DUnaligned_v2", Init::Required, || unsafe { copy_2d(p_copy, None) })
}

/// `CUresult cuMemcpy2DAsync(const CUDA_MEMCPY2D *pCopy, CUstream hStream)` (symbol `_v2`): as
/// `cuMemcpy2D`, in stream order, with the 1-D asynchronous rules for pageable memory (pageable
/// source rows staged at the call, a pageable destination written before returning).
///
/// # Safety
/// 1. `p_copy` is NULL or valid for reading; its host rows are valid for the copy.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy2DAsync_v2(
    p_copy: *const cudarc::driver::sys::CUDA_MEMCPY2D,
    h_stream: CUstream,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpy2DAsync_v2", Init::Required, || unsafe { copy_2d(p_copy, Some(h_stream)) })
}

/// `CUresult cuMemcpy3D(const CUDA_MEMCPY3D *pCopy)` (symbol `_v2`): as `cuMemcpy2D` over
/// `Depth` slices of `srcHeight`/`dstHeight` rows (which must hold `y + Height` when
/// `Depth > 1`); LODs must be 0 and the reserved pointers NULL; Depth 0 succeeds untouched.
///
/// # Safety
/// 1. `p_copy` is NULL or valid for reading; its host rows are valid for the copy.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy3D_v2(p_copy: *const cudarc::driver::sys::CUDA_MEMCPY3D) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpy3D_v2", Init::Required, || unsafe { memcpy_3d(decode_3d(p_copy)?, None) })
}

/// `CUresult cuMemcpy3DAsync(const CUDA_MEMCPY3D *pCopy, CUstream hStream)` (symbol `_v2`): as
/// `cuMemcpy3D`, in stream order (1-D asynchronous rules for pageable memory).
///
/// # Safety
/// 1. `p_copy` is NULL or valid for reading; its host rows are valid for the copy.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy3DAsync_v2(
    p_copy: *const cudarc::driver::sys::CUDA_MEMCPY3D,
    h_stream: CUstream,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpy3DAsync_v2", Init::Required, || unsafe {
        memcpy_3d(decode_3d(p_copy)?, Some(h_stream))
    })
}

/// `CUresult cuMemsetD2D8(CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t
/// Width, size_t Height)` (symbol `_v2`): `Height` rows of `Width` bytes. Width or Height 0
/// succeeds; with `Height > 1` the pitch must hold a row; every row is bounds-checked first.
/// Returns like `cuMemsetD8`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD2D8_v2(
    dst: CUdeviceptr,
    pitch: usize,
    value: c_uchar,
    width: usize,
    height: usize,
) -> CUresult {
    api::call("cuMemsetD2D8_v2", Init::Required, || {
        memset_2d(dst, pitch, u32::from(value), 1, width, height, None)
    })
}

/// `CUresult cuMemsetD2D16(CUdeviceptr dstDevice, size_t dstPitch, unsigned short us, size_t
/// Width, size_t Height)` (symbol `_v2`): as `cuMemsetD2D8` with 16-bit elements; `dstDevice`
/// must be 2-byte aligned and (with `Height > 1`) the pitch a multiple of 2.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD2D16_v2(
    dst: CUdeviceptr,
    pitch: usize,
    value: c_ushort,
    width: usize,
    height: usize,
) -> CUresult {
    api::call("cuMemsetD2D16_v2", Init::Required, || {
        memset_2d(dst, pitch, u32::from(value), 2, width, height, None)
    })
}

/// `CUresult cuMemsetD2D32(CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t
/// Width, size_t Height)` (symbol `_v2`): as `cuMemsetD2D8` with 32-bit elements; 4-byte
/// alignment and pitch multiple.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD2D32_v2(
    dst: CUdeviceptr,
    pitch: usize,
    value: c_uint,
    width: usize,
    height: usize,
) -> CUresult {
    api::call("cuMemsetD2D32_v2", Init::Required, || memset_2d(dst, pitch, value, 4, width, height, None))
}

/// `CUresult cuMemsetD2D8Async(CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t
/// Width, size_t Height, CUstream hStream)`: as `cuMemsetD2D8`, in stream order.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD2D8Async(
    dst: CUdeviceptr,
    pitch: usize,
    value: c_uchar,
    width: usize,
    height: usize,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemsetD2D8Async", Init::Required, || {
        memset_2d(dst, pitch, u32::from(value), 1, width, height, Some(h_stream))
    })
}

/// `CUresult cuMemsetD2D16Async(CUdeviceptr dstDevice, size_t dstPitch, unsigned short us,
/// size_t Width, size_t Height, CUstream hStream)`: as `cuMemsetD2D16`, in stream order.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD2D16Async(
    dst: CUdeviceptr,
    pitch: usize,
    value: c_ushort,
    width: usize,
    height: usize,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemsetD2D16Async", Init::Required, || {
        memset_2d(dst, pitch, u32::from(value), 2, width, height, Some(h_stream))
    })
}

/// `CUresult cuMemsetD2D32Async(CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t
/// Width, size_t Height, CUstream hStream)`: as `cuMemsetD2D32`, in stream order.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD2D32Async(
    dst: CUdeviceptr,
    pitch: usize,
    value: c_uint,
    width: usize,
    height: usize,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemsetD2D32Async", Init::Required, || {
        memset_2d(dst, pitch, value, 4, width, height, Some(h_stream))
    })
}
