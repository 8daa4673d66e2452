//! The per-thread-default-stream symbols (`_ptds` for synchronous calls, `_ptsz` for calls that
//! take a stream) that `cuda.h` selects when a program is built with
//! `CUDA_API_PER_THREAD_DEFAULT_STREAM` (nvcc `--default-stream per-thread`).
//!
//! They differ from the plain symbols in one thing: the NULL stream means the calling thread's
//! per-thread stream (`CU_STREAM_PER_THREAD`) instead of the legacy stream; an explicit
//! `CU_STREAM_LEGACY` still names the legacy stream. A `_ptsz` function is its plain function with
//! NULL replaced. A `_ptds` function queues its copy or memset on the per-thread stream and then
//! keeps the plain function's return rule: it returns once the operation is complete, except that
//! device-to-device copies and memsets of device memory return at once (as their legacy forms do).

use std::ffi::{c_int, c_uchar, c_uint, c_ushort, c_void};

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdeviceptr, CUevent, CUhostFn, CUmemoryPool, CUresult, CUstream,
};

use crate::abi::{MemLocation, Memcpy2D, Memcpy3D};
use crate::api::{self, ApiResult, Init};
use crate::exports::legacy_names::forward;
use crate::exports::{copy, event, managed, memory, peer, pool, stream};

/// `CU_STREAM_PER_THREAD`.
const PER_THREAD: CUstream = crate::stream::STREAM_PER_THREAD as CUstream;
/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`.
const ATTR_MEMORY_TYPE: u32 = 2;
/// `CU_POINTER_ATTRIBUTE_IS_MANAGED`.
const ATTR_IS_MANAGED: u32 = 8;
/// `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS`.
const ATTR_SYNC_MEMOPS: u32 = 6;
/// `CU_MEMORYTYPE_DEVICE`.
const MEMORYTYPE_DEVICE: u32 = 2;

/// The stream a `_ptsz` call means: NULL is the thread's per-thread stream.
pub(crate) fn per_thread(h_stream: CUstream) -> CUstream {
    if h_stream.is_null() { PER_THREAD } else { h_stream }
}

/// Whether `addr` is device memory the host cannot touch (not pinned, registered, managed or
/// pageable) and without SYNC_MEMOPS, so a synchronous operation on it alone need not wait.
fn device_only(addr: CUdeviceptr) -> bool {
    let (mut ty, mut managed, mut sync) = (0u32, 0u32, 0u32);
    // SAFETY: all three attributes are 4 bytes, written into locals.
    let found = unsafe {
        [
            memory::cuPointerGetAttribute((&raw mut ty).cast(), ATTR_MEMORY_TYPE, addr),
            memory::cuPointerGetAttribute((&raw mut managed).cast(), ATTR_IS_MANAGED, addr),
            memory::cuPointerGetAttribute((&raw mut sync).cast(), ATTR_SYNC_MEMOPS, addr),
        ]
    };
    found.iter().all(|&r| r == CUresult::CUDA_SUCCESS) && ty == MEMORYTYPE_DEVICE && managed == 0 && sync == 0
}

/// Completes a `_ptds` operation queued on the per-thread stream: waits unless `device_only`,
/// inside the simulator (not through the exported `cuStreamSynchronize`, which would count as
/// the program's call, take its injected faults and trim the pools).
fn finish(queued: CUresult, device_only: bool) -> ApiResult {
    forward(queued)?;
    if device_only { Ok(()) } else { crate::stream::wait_queued(PER_THREAD) }
}

/// Declares `_ptsz` symbols: the plain function with a NULL stream replaced.
macro_rules! ptsz {
    ($($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) [$s:ident] => $target:path;)*) => {$(
        $(#[$doc])*
        /// NULL `hStream` is the calling thread's per-thread stream.
        ///
        /// # Safety
        /// 1. The plain function's: pointer arguments are NULL or valid as the driver API
        ///    documents.
        #[unsafe(no_mangle)]
        #[allow(unused_unsafe)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            api::call(stringify!($name), Init::Required, || {
                let $s = per_thread($s);
                // SAFETY: forwarded caller contract.
                forward(unsafe { $target($($arg),*) })
            })
        }
    )*};
}

ptsz! {
    /// `cuMemcpyPeerAsync` on the per-thread default stream.
    fn cuMemcpyPeerAsync_ptsz(dst: CUdeviceptr, dst_ctx: cudarc::driver::sys::CUcontext, src: CUdeviceptr, src_ctx: cudarc::driver::sys::CUcontext, n: usize, h_stream: CUstream) [h_stream] => peer::cuMemcpyPeerAsync;
    /// `cuMemcpy3DPeerAsync` on the per-thread default stream.
    fn cuMemcpy3DPeerAsync_ptsz(p_copy: *const cudarc::driver::sys::CUDA_MEMCPY3D_PEER, h_stream: CUstream) [h_stream] => peer::cuMemcpy3DPeerAsync;
    /// `cuMemcpyAsync` on the per-thread default stream.
    fn cuMemcpyAsync_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, h_stream: CUstream) [h_stream] => copy::cuMemcpyAsync;
    /// `cuMemcpyHtoDAsync_v2` on the per-thread default stream.
    fn cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, h_stream: CUstream) [h_stream] => copy::cuMemcpyHtoDAsync_v2;
    /// `cuMemcpyDtoHAsync_v2` on the per-thread default stream.
    fn cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, h_stream: CUstream) [h_stream] => copy::cuMemcpyDtoHAsync_v2;
    /// `cuMemcpyDtoDAsync_v2` on the per-thread default stream.
    fn cuMemcpyDtoDAsync_v2_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, h_stream: CUstream) [h_stream] => copy::cuMemcpyDtoDAsync_v2;
    /// `cuMemcpy2DAsync_v2` on the per-thread default stream.
    fn cuMemcpy2DAsync_v2_ptsz(p_copy: *const cudarc::driver::sys::CUDA_MEMCPY2D, h_stream: CUstream) [h_stream] => copy::cuMemcpy2DAsync_v2;
    /// `cuMemcpy3DAsync_v2` on the per-thread default stream.
    fn cuMemcpy3DAsync_v2_ptsz(p_copy: *const cudarc::driver::sys::CUDA_MEMCPY3D, h_stream: CUstream) [h_stream] => copy::cuMemcpy3DAsync_v2;
    /// `cuMemsetD8Async` on the per-thread default stream.
    fn cuMemsetD8Async_ptsz(dst: CUdeviceptr, value: c_uchar, n: usize, h_stream: CUstream) [h_stream] => copy::cuMemsetD8Async;
    /// `cuMemsetD16Async` on the per-thread default stream.
    fn cuMemsetD16Async_ptsz(dst: CUdeviceptr, value: c_ushort, n: usize, h_stream: CUstream) [h_stream] => copy::cuMemsetD16Async;
    /// `cuMemsetD32Async` on the per-thread default stream.
    fn cuMemsetD32Async_ptsz(dst: CUdeviceptr, value: c_uint, n: usize, h_stream: CUstream) [h_stream] => copy::cuMemsetD32Async;
    /// `cuMemsetD2D8Async` on the per-thread default stream.
    fn cuMemsetD2D8Async_ptsz(dst: CUdeviceptr, pitch: usize, value: c_uchar, width: usize, height: usize, h_stream: CUstream) [h_stream] => copy::cuMemsetD2D8Async;
    /// `cuMemsetD2D16Async` on the per-thread default stream.
    fn cuMemsetD2D16Async_ptsz(dst: CUdeviceptr, pitch: usize, value: c_ushort, width: usize, height: usize, h_stream: CUstream) [h_stream] => copy::cuMemsetD2D16Async;
    /// `cuMemsetD2D32Async` on the per-thread default stream.
    fn cuMemsetD2D32Async_ptsz(dst: CUdeviceptr, pitch: usize, value: c_uint, width: usize, height: usize, h_stream: CUstream) [h_stream] => copy::cuMemsetD2D32Async;
    /// `cuMemPrefetchAsync` on the per-thread default stream.
    fn cuMemPrefetchAsync_ptsz(ptr: CUdeviceptr, count: usize, dst_device: CUdevice, h_stream: CUstream) [h_stream] => managed::cuMemPrefetchAsync;
    /// `cuMemPrefetchAsync_v2` on the per-thread default stream.
    fn cuMemPrefetchAsync_v2_ptsz(ptr: CUdeviceptr, count: usize, location: MemLocation, flags: c_uint, h_stream: CUstream) [h_stream] => managed::cuMemPrefetchAsync_v2;
    /// `cuStreamAttachMemAsync` on the per-thread default stream.
    fn cuStreamAttachMemAsync_ptsz(h_stream: CUstream, dptr: CUdeviceptr, length: usize, flags: c_uint) [h_stream] => managed::cuStreamAttachMemAsync;
    /// `cuMemAllocAsync` on the per-thread default stream.
    fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, bytesize: usize, h_stream: CUstream) [h_stream] => pool::cuMemAllocAsync;
    /// `cuMemAllocFromPoolAsync` on the per-thread default stream.
    fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, bytesize: usize, mem_pool: CUmemoryPool, h_stream: CUstream) [h_stream] => pool::cuMemAllocFromPoolAsync;
    /// `cuMemFreeAsync` on the per-thread default stream.
    fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, h_stream: CUstream) [h_stream] => pool::cuMemFreeAsync;
    /// `cuStreamQuery` of the per-thread default stream for NULL.
    fn cuStreamQuery_ptsz(h_stream: CUstream) [h_stream] => stream::cuStreamQuery;
    /// `cuStreamSynchronize` of the per-thread default stream for NULL.
    fn cuStreamSynchronize_ptsz(h_stream: CUstream) [h_stream] => stream::cuStreamSynchronize;
    /// `cuStreamWaitEvent` with NULL meaning the per-thread default stream.
    fn cuStreamWaitEvent_ptsz(h_stream: CUstream, h_event: CUevent, flags: c_uint) [h_stream] => stream::cuStreamWaitEvent;
    /// `cuStreamGetPriority` with NULL meaning the per-thread default stream.
    fn cuStreamGetPriority_ptsz(h_stream: CUstream, priority: *mut c_int) [h_stream] => stream::cuStreamGetPriority;
    /// `cuStreamGetFlags` with NULL meaning the per-thread default stream.
    fn cuStreamGetFlags_ptsz(h_stream: CUstream, flags: *mut c_uint) [h_stream] => stream::cuStreamGetFlags;
    /// `cuStreamGetCtx` with NULL meaning the per-thread default stream.
    fn cuStreamGetCtx_ptsz(h_stream: CUstream, pctx: *mut CUcontext) [h_stream] => stream::cuStreamGetCtx;
    /// `cuStreamGetDevice` with NULL meaning the per-thread default stream.
    fn cuStreamGetDevice_ptsz(h_stream: CUstream, device: *mut CUdevice) [h_stream] => stream::cuStreamGetDevice;
    /// `cuLaunchHostFunc` on the per-thread default stream.
    fn cuLaunchHostFunc_ptsz(h_stream: CUstream, f: CUhostFn, user_data: *mut c_void) [h_stream] => stream::cuLaunchHostFunc;
    /// `cuEventRecord` on the per-thread default stream.
    fn cuEventRecord_ptsz(h_event: CUevent, h_stream: CUstream) [h_stream] => event::cuEventRecord;
    /// `cuEventRecordWithFlags` on the per-thread default stream.
    fn cuEventRecordWithFlags_ptsz(h_event: CUevent, h_stream: CUstream, flags: c_uint) [h_stream] => event::cuEventRecordWithFlags;
}

/// `CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)`: `cuMemcpy` on
/// the per-thread default stream (device-only copies return at once).
///
/// # Safety
/// 1. As `cuMemcpy`: host addresses are valid for `n` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    api::call("cuMemcpy_ptds", Init::Required, || {
        let device = device_only(dst) && device_only(src);
        // SAFETY: forwarded caller contract.
        finish(unsafe { copy::cuMemcpyAsync(dst, src, n, PER_THREAD) }, device)
    })
}

/// `cuMemcpyHtoD_v2` on the per-thread default stream: returns once the bytes have arrived.
///
/// # Safety
/// 1. `src` is valid for reading `n` bytes when it is not CUDA memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
    api::call("cuMemcpyHtoD_v2_ptds", Init::Required, || {
        // SAFETY: forwarded caller contract.
        finish(unsafe { copy::cuMemcpyHtoDAsync_v2(dst, src, n, PER_THREAD) }, false)
    })
}

/// `cuMemcpyDtoH_v2` on the per-thread default stream: returns once the bytes have arrived.
///
/// # Safety
/// 1. `dst` is valid for writing `n` bytes when it is not CUDA memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    api::call("cuMemcpyDtoH_v2_ptds", Init::Required, || {
        // SAFETY: forwarded caller contract.
        finish(unsafe { copy::cuMemcpyDtoHAsync_v2(dst, src, n, PER_THREAD) }, false)
    })
}

/// `cuMemcpyDtoD_v2` on the per-thread default stream: returns at once, like its legacy form.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    api::call("cuMemcpyDtoD_v2_ptds", Init::Required, || {
        // SAFETY: device addresses only, bounds-checked by the call.
        finish(unsafe { copy::cuMemcpyDtoDAsync_v2(dst, src, n, PER_THREAD) }, true)
    })
}

/// `cuMemcpyPeer` on the per-thread default stream: returns at once, like its legacy form.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyPeer_ptds(
    dst: CUdeviceptr,
    dst_ctx: cudarc::driver::sys::CUcontext,
    src: CUdeviceptr,
    src_ctx: cudarc::driver::sys::CUcontext,
    n: usize,
) -> CUresult {
    api::call("cuMemcpyPeer_ptds", Init::Required, || {
        finish(peer::cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, n, PER_THREAD), true)
    })
}

/// Whether both sides of a 2D/3D copy are device memory (`CU_MEMORYTYPE_DEVICE` naming device
/// memory), so the synchronous form returns at once.
fn device_sides(src_type: u32, src: CUdeviceptr, dst_type: u32, dst: CUdeviceptr) -> bool {
    src_type == MEMORYTYPE_DEVICE && dst_type == MEMORYTYPE_DEVICE && device_only(src) && device_only(dst)
}

/// Declares the `_ptds` 2D/3D copies.
macro_rules! ptds_copy {
    ($($(#[$doc:meta])* fn $name:ident($desc:ty as $abi:ty) => $target:path;)*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        /// 1. `p_copy` is NULL or valid for reading the descriptor; its host pointers are valid
        ///    as the plain function requires.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(p_copy: *const $desc) -> CUresult {
            api::call(stringify!($name), Init::Required, || {
                let device = if p_copy.is_null() {
                    false
                } else {
                    // SAFETY: non-NULL and readable (caller contract); the crate's layout equals
                    // the bindings' (asserted in `abi`).
                    let c = unsafe { p_copy.cast::<$abi>().read_unaligned() };
                    device_sides(c.src_type, c.src_device, c.dst_type, c.dst_device)
                };
                // SAFETY: forwarded caller contract.
                finish(unsafe { $target(p_copy, PER_THREAD) }, device)
            })
        }
    )*};
}

ptds_copy! {
    /// `cuMemcpy2D_v2` on the per-thread default stream.
    fn cuMemcpy2D_v2_ptds(cudarc::driver::sys::CUDA_MEMCPY2D as Memcpy2D) => copy::cuMemcpy2DAsync_v2;
    /// `cuMemcpy2DUnaligned_v2` on the per-thread default stream.
    fn cuMemcpy2DUnaligned_v2_ptds(cudarc::driver::sys::CUDA_MEMCPY2D as Memcpy2D) => copy::cuMemcpy2DAsync_v2;
    /// `cuMemcpy3D_v2` on the per-thread default stream.
    fn cuMemcpy3D_v2_ptds(cudarc::driver::sys::CUDA_MEMCPY3D as Memcpy3D) => copy::cuMemcpy3DAsync_v2;
    /// `cuMemcpy3DPeer` on the per-thread default stream.
    fn cuMemcpy3DPeer_ptds(cudarc::driver::sys::CUDA_MEMCPY3D_PEER as Memcpy3D) => peer::cuMemcpy3DPeerAsync;
}

/// Declares the `_ptds` memsets.
macro_rules! ptds_memset {
    ($($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) => $target:path;)*) => {$(
        $(#[$doc])*
        /// Device memory returns at once; host-accessible memory once written.
        #[unsafe(no_mangle)]
        pub extern "C" fn $name(dst: CUdeviceptr, $($arg: $ty),*) -> CUresult {
            api::call(stringify!($name), Init::Required, || {
                finish($target(dst, $($arg),*, PER_THREAD), device_only(dst))
            })
        }
    )*};
}

ptds_memset! {
    /// `cuMemsetD8_v2` on the per-thread default stream.
    fn cuMemsetD8_v2_ptds(value: c_uchar, n: usize) => copy::cuMemsetD8Async;
    /// `cuMemsetD16_v2` on the per-thread default stream.
    fn cuMemsetD16_v2_ptds(value: c_ushort, n: usize) => copy::cuMemsetD16Async;
    /// `cuMemsetD32_v2` on the per-thread default stream.
    fn cuMemsetD32_v2_ptds(value: c_uint, n: usize) => copy::cuMemsetD32Async;
    /// `cuMemsetD2D8_v2` on the per-thread default stream.
    fn cuMemsetD2D8_v2_ptds(pitch: usize, value: c_uchar, width: usize, height: usize) => copy::cuMemsetD2D8Async;
    /// `cuMemsetD2D16_v2` on the per-thread default stream.
    fn cuMemsetD2D16_v2_ptds(pitch: usize, value: c_ushort, width: usize, height: usize) => copy::cuMemsetD2D16Async;
    /// `cuMemsetD2D32_v2` on the per-thread default stream.
    fn cuMemsetD2D32_v2_ptds(pitch: usize, value: c_uint, width: usize, height: usize) => copy::cuMemsetD2D32Async;
}
