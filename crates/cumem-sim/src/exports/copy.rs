//! Copies and memsets (synchronous and asynchronous). The rules for when each returns live in
//! the crate's `copy` module (and the README).

use std::ffi::{c_uchar, c_uint, c_ushort, c_void};

use cudarc::driver::sys::{CUdeviceptr, CUresult, CUstream};

use crate::api::{self, Init};
use crate::copy::{Role, memcpy, memset};

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
