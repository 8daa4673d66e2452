//! The plain (unversioned) symbols a real libcuda still exports beside their `_v2` successors,
//! with the older ABI where it differs.
//!
//! `cuda.h` maps `cuMemAlloc` to `cuMemAlloc_v2` with a `#define`, so the plain symbols are only
//! reached by binaries built before CUDA 3.2 and by bindings that look symbols up by their public
//! name. Where the v1 ABI is the same (`cuCtxPushCurrent`, `cuStreamDestroy`, …) the plain symbol
//! is the `_v2` function under its old name. Where it differs, the v1 prototypes of `cuda.h`
//! (`__CUDA_API_VERSION_INTERNAL`) take 32-bit device pointers (`CUdeviceptr_v1 = unsigned int`)
//! and 32-bit sizes; each function here widens its arguments and calls the `_v2` export.
//!
//! A 32-bit device pointer cannot name any simulated device memory: the simulator's device
//! addresses are host addresses of a `PROT_NONE` reservation, all above 4 GiB. So:
//! * a v1 call *returning* a device pointer (`cuMemAlloc`, `cuMemAllocPitch`,
//!   `cuMemHostGetDevicePointer`, `cuMemGetAddressRange`) first does the `_v2` call (so its
//!   errors come first, in the `_v2` order); if the address does not fit in 32 bits, an
//!   allocation is freed again (`cuMemFree_v2`, which waits for the device's queued work) and the
//!   call returns `CUDA_ERROR_NOT_SUPPORTED` without writing;
//! * a v1 call *taking* a device pointer passes it on zero-extended, so it names no allocation
//!   and gets the `_v2` answer for an unknown address (`INVALID_VALUE` and a violation);
//! * byte counts above 4 GiB (`cuMemGetInfo`, `cuDeviceTotalMem`) saturate at `UINT_MAX`;
//! * host pointers are full-width in v1 too, so `cuMemAllocHost` and host-to-host copies work.

use std::ffi::{c_uchar, c_uint, c_ushort, c_void};

use cudarc::driver::sys::{CUcontext, CUdevice, CUdeviceptr, CUevent, CUresult, CUstream};

use crate::abi::{Memcpy2D, Memcpy3D};
use crate::api::{self, ApiResult, Fail, Init};
use crate::exports::{context, copy, device, event, memory, stream};

/// `CUdeviceptr_v1`.
type DevPtrV1 = c_uint;

/// Turns the code of a forwarded call into this call's result (the inner call has already
/// recorded any violation).
pub(crate) fn forward(code: CUresult) -> ApiResult {
    if code == CUresult::CUDA_SUCCESS { Ok(()) } else { Err(Fail::quiet(code)) }
}

/// A device address as a v1 pointer, or `NOT_SUPPORTED` when it lies above 4 GiB.
fn narrow(addr: CUdeviceptr) -> Result<DevPtrV1, Fail> {
    DevPtrV1::try_from(addr).map_err(|_| Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED))
}

/// A byte count as the v1 ABI's `unsigned int`, saturated.
fn saturate(bytes: usize) -> c_uint {
    c_uint::try_from(bytes).unwrap_or(c_uint::MAX)
}

/// Writes through a v1 out-pointer the caller passed (non-NULL: the `_v2` call checked it).
///
/// # Safety
/// 1. `ptr` is NULL or valid for writing a `T`.
unsafe fn put<T>(ptr: *mut T, value: T) {
    if !ptr.is_null() {
        // SAFETY: non-NULL and valid per this function's contract.
        unsafe { ptr.write(value) };
    }
}

/// Declares plain symbols whose v1 ABI equals the `_v2` one.
macro_rules! same_abi {
    ($($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) => $target:path;)*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        /// 1. The same as the `_v2` function's: pointer arguments are NULL or valid as the driver
        ///    API documents.
        #[unsafe(no_mangle)]
        #[allow(unused_unsafe)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            // SAFETY: forwarded caller contract (identical ABI and contract).
            api::call(stringify!($name), Init::Required, || forward(unsafe { $target($($arg),*) }))
        }
    )*};
}

same_abi! {
    /// `CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)`: `cuCtxCreate_v2`.
    fn cuCtxCreate(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) => context::cuCtxCreate_v2;
    /// `CUresult cuCtxDestroy(CUcontext ctx)`: `cuCtxDestroy_v2`.
    fn cuCtxDestroy(ctx: CUcontext) => context::cuCtxDestroy_v2;
    /// `CUresult cuCtxPushCurrent(CUcontext ctx)`: `cuCtxPushCurrent_v2`.
    fn cuCtxPushCurrent(ctx: CUcontext) => context::cuCtxPushCurrent_v2;
    /// `CUresult cuCtxPopCurrent(CUcontext *pctx)`: `cuCtxPopCurrent_v2`.
    fn cuCtxPopCurrent(pctx: *mut CUcontext) => context::cuCtxPopCurrent_v2;
    /// `CUresult cuDevicePrimaryCtxRelease(CUdevice dev)`: `cuDevicePrimaryCtxRelease_v2`.
    fn cuDevicePrimaryCtxRelease(dev: CUdevice) => context::cuDevicePrimaryCtxRelease_v2;
    /// `CUresult cuDevicePrimaryCtxReset(CUdevice dev)`: `cuDevicePrimaryCtxReset_v2`.
    fn cuDevicePrimaryCtxReset(dev: CUdevice) => context::cuDevicePrimaryCtxReset_v2;
    /// `CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags)`.
    fn cuDevicePrimaryCtxSetFlags(dev: CUdevice, flags: c_uint) => context::cuDevicePrimaryCtxSetFlags_v2;
    /// `CUresult cuStreamDestroy(CUstream hStream)`: `cuStreamDestroy_v2`.
    fn cuStreamDestroy(h_stream: CUstream) => stream::cuStreamDestroy_v2;
    /// `CUresult cuEventDestroy(CUevent hEvent)`: `cuEventDestroy_v2`.
    fn cuEventDestroy(h_event: CUevent) => event::cuEventDestroy_v2;
    /// `CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags)`.
    fn cuMemHostRegister(p: *mut c_void, bytesize: usize, flags: c_uint) => memory::cuMemHostRegister_v2;
}

/// `CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)` (v1): saturates at `UINT_MAX`.
///
/// # Safety
/// 1. `bytes` is NULL or valid for writing an `unsigned int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) -> CUresult {
    api::call("cuDeviceTotalMem", Init::Required, || {
        let mut total = 0usize;
        let out = if bytes.is_null() { std::ptr::null_mut() } else { &raw mut total };
        // SAFETY: `out` is NULL or a local.
        forward(unsafe { device::cuDeviceTotalMem_v2(out, dev) })?;
        // SAFETY: caller contract.
        unsafe { put(bytes, saturate(total)) };
        Ok(())
    })
}

/// `CUresult cuMemGetInfo(unsigned int *free, unsigned int *total)` (v1): saturates at `UINT_MAX`.
///
/// # Safety
/// 1. `free` and `total` are NULL or valid for writing an `unsigned int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) -> CUresult {
    api::call("cuMemGetInfo", Init::Required, || {
        let (mut f, mut t) = (0usize, 0usize);
        let fp = if free.is_null() { std::ptr::null_mut() } else { &raw mut f };
        let tp = if total.is_null() { std::ptr::null_mut() } else { &raw mut t };
        // SAFETY: NULL or locals.
        forward(unsafe { memory::cuMemGetInfo_v2(fp, tp) })?;
        // SAFETY: caller contract.
        unsafe {
            put(free, saturate(f));
            put(total, saturate(t));
        }
        Ok(())
    })
}

/// Frees a `_v2` allocation that a v1 pointer cannot name and reports `NOT_SUPPORTED`.
fn unreachable_alloc(addr: CUdeviceptr) -> Result<DevPtrV1, Fail> {
    narrow(addr).inspect_err(|_| {
        // The allocation was just made by this call and nothing else knows its address.
        let _ = memory::cuMemFree_v2(addr);
    })
}

/// `CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)` (v1). Every simulated
/// device address lies above 4 GiB, so a successful `_v2` allocation is freed again and the call
/// returns `NOT_SUPPORTED`; argument errors are the `_v2` ones.
///
/// # Safety
/// 1. `dptr` is NULL or valid for writing an `unsigned int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc(dptr: *mut DevPtrV1, bytesize: c_uint) -> CUresult {
    api::call("cuMemAlloc", Init::Required, || {
        let mut p: CUdeviceptr = 0;
        let out = if dptr.is_null() { std::ptr::null_mut() } else { &raw mut p };
        // SAFETY: NULL or a local.
        forward(unsafe { memory::cuMemAlloc_v2(out, bytesize as usize) })?;
        let v1 = unreachable_alloc(p)?;
        // SAFETY: caller contract.
        unsafe { put(dptr, v1) };
        Ok(())
    })
}

/// `CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int
/// WidthInBytes, unsigned int Height, unsigned int ElementSizeBytes)` (v1): as [`cuMemAlloc`].
///
/// # Safety
/// 1. `dptr` and `p_pitch` are NULL or valid for writing an `unsigned int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch(
    dptr: *mut DevPtrV1,
    p_pitch: *mut c_uint,
    width: c_uint,
    height: c_uint,
    element_size: c_uint,
) -> CUresult {
    api::call("cuMemAllocPitch", Init::Required, || {
        let (mut p, mut pitch): (CUdeviceptr, usize) = (0, 0);
        let out = if dptr.is_null() { std::ptr::null_mut() } else { &raw mut p };
        let pitch_out = if p_pitch.is_null() { std::ptr::null_mut() } else { &raw mut pitch };
        // SAFETY: NULL or locals.
        forward(unsafe {
            memory::cuMemAllocPitch_v2(out, pitch_out, width as usize, height as usize, element_size)
        })?;
        let v1 = unreachable_alloc(p)?;
        // SAFETY: caller contract.
        unsafe {
            put(dptr, v1);
            put(p_pitch, saturate(pitch));
        }
        Ok(())
    })
}

/// `CUresult cuMemFree(CUdeviceptr_v1 dptr)` (v1): the zero-extended address to `cuMemFree_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree(dptr: DevPtrV1) -> CUresult {
    api::call("cuMemFree", Init::Required, || forward(memory::cuMemFree_v2(CUdeviceptr::from(dptr))))
}

/// `CUresult cuMemGetAddressRange(CUdeviceptr_v1 *pbase, unsigned int *psize, CUdeviceptr_v1
/// dptr)` (v1).
///
/// # Safety
/// 1. `pbase` and `psize` are NULL or valid for writing an `unsigned int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAddressRange(
    pbase: *mut DevPtrV1,
    psize: *mut c_uint,
    dptr: DevPtrV1,
) -> CUresult {
    api::call("cuMemGetAddressRange", Init::Required, || {
        let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
        let bp = if pbase.is_null() { std::ptr::null_mut() } else { &raw mut base };
        let sp = if psize.is_null() { std::ptr::null_mut() } else { &raw mut size };
        // SAFETY: NULL or locals.
        forward(unsafe { memory::cuMemGetAddressRange_v2(bp, sp, CUdeviceptr::from(dptr)) })?;
        let base = narrow(base)?;
        // SAFETY: caller contract.
        unsafe {
            put(pbase, base);
            put(psize, saturate(size));
        }
        Ok(())
    })
}

/// `CUresult cuMemAllocHost(void **pp, unsigned int bytesize)` (v1): host pointers are
/// full-width, so this works as `cuMemAllocHost_v2`.
///
/// # Safety
/// 1. `pp` is NULL or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocHost(pp: *mut *mut c_void, bytesize: c_uint) -> CUresult {
    api::call("cuMemAllocHost", Init::Required, || {
        // SAFETY: forwarded caller contract.
        forward(unsafe { memory::cuMemAllocHost_v2(pp, bytesize as usize) })
    })
}

/// `CUresult cuMemHostGetDevicePointer(CUdeviceptr_v1 *pdptr, void *p, unsigned int Flags)` (v1):
/// the device alias of pinned memory is its host address, above 4 GiB, so a valid request
/// returns `NOT_SUPPORTED`.
///
/// # Safety
/// 1. `pdptr` is NULL or valid for writing an `unsigned int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetDevicePointer(
    pdptr: *mut DevPtrV1,
    p: *mut c_void,
    flags: c_uint,
) -> CUresult {
    api::call("cuMemHostGetDevicePointer", Init::Required, || {
        let mut d: CUdeviceptr = 0;
        let out = if pdptr.is_null() { std::ptr::null_mut() } else { &raw mut d };
        // SAFETY: NULL or a local; `p` is only looked up.
        forward(unsafe { memory::cuMemHostGetDevicePointer_v2(out, p, flags) })?;
        let v1 = narrow(d)?;
        // SAFETY: caller contract.
        unsafe { put(pdptr, v1) };
        Ok(())
    })
}

/// `CUresult cuMemcpyHtoD(CUdeviceptr_v1 dstDevice, const void *srcHost, unsigned int
/// ByteCount)` (v1).
///
/// # Safety
/// 1. `src_host` is valid for reading `byte_count` bytes when it is not CUDA memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD(
    dst: DevPtrV1,
    src_host: *const c_void,
    byte_count: c_uint,
) -> CUresult {
    api::call("cuMemcpyHtoD", Init::Required, || {
        // SAFETY: forwarded caller contract.
        forward(unsafe { copy::cuMemcpyHtoD_v2(dst.into(), src_host, byte_count as usize) })
    })
}

/// `CUresult cuMemcpyDtoH(void *dstHost, CUdeviceptr_v1 srcDevice, unsigned int ByteCount)` (v1).
///
/// # Safety
/// 1. `dst_host` is valid for writing `byte_count` bytes when it is not CUDA memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH(dst_host: *mut c_void, src: DevPtrV1, byte_count: c_uint) -> CUresult {
    api::call("cuMemcpyDtoH", Init::Required, || {
        // SAFETY: forwarded caller contract.
        forward(unsafe { copy::cuMemcpyDtoH_v2(dst_host, src.into(), byte_count as usize) })
    })
}

/// `CUresult cuMemcpyDtoD(CUdeviceptr_v1 dstDevice, CUdeviceptr_v1 srcDevice, unsigned int
/// ByteCount)` (v1).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD(dst: DevPtrV1, src: DevPtrV1, byte_count: c_uint) -> CUresult {
    api::call("cuMemcpyDtoD", Init::Required, || {
        // SAFETY: both addresses are device addresses, bounds-checked by the `_v2` call.
        forward(unsafe { copy::cuMemcpyDtoD_v2(dst.into(), src.into(), byte_count as usize) })
    })
}

/// `CUresult cuMemcpyHtoDAsync(CUdeviceptr_v1 dstDevice, const void *srcHost, unsigned int
/// ByteCount, CUstream hStream)` (v1).
///
/// # Safety
/// 1. As `cuMemcpyHtoDAsync_v2`: `src_host` is valid for reading `byte_count` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync(
    dst: DevPtrV1,
    src_host: *const c_void,
    byte_count: c_uint,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemcpyHtoDAsync", Init::Required, || {
        // SAFETY: forwarded caller contract.
        forward(unsafe { copy::cuMemcpyHtoDAsync_v2(dst.into(), src_host, byte_count as usize, h_stream) })
    })
}

/// `CUresult cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr_v1 srcDevice, unsigned int ByteCount,
/// CUstream hStream)` (v1).
///
/// # Safety
/// 1. As `cuMemcpyDtoHAsync_v2`: `dst_host` is valid for writing `byte_count` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync(
    dst_host: *mut c_void,
    src: DevPtrV1,
    byte_count: c_uint,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemcpyDtoHAsync", Init::Required, || {
        // SAFETY: forwarded caller contract.
        forward(unsafe { copy::cuMemcpyDtoHAsync_v2(dst_host, src.into(), byte_count as usize, h_stream) })
    })
}

/// `CUresult cuMemcpyDtoDAsync(CUdeviceptr_v1 dstDevice, CUdeviceptr_v1 srcDevice, unsigned int
/// ByteCount, CUstream hStream)` (v1).
///
/// # Safety
/// 1. `h_stream` is NULL, a special stream handle or a stream handle (checked by the `_v2` call).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoDAsync(
    dst: DevPtrV1,
    src: DevPtrV1,
    byte_count: c_uint,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemcpyDtoDAsync", Init::Required, || {
        // SAFETY: both addresses are device addresses, bounds-checked by the `_v2` call.
        forward(unsafe { copy::cuMemcpyDtoDAsync_v2(dst.into(), src.into(), byte_count as usize, h_stream) })
    })
}

/// `CUDA_MEMCPY2D_v1`: the 32-bit layout of `cuda.h`'s internal section.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Memcpy2DV1 {
    src_x: c_uint,
    src_y: c_uint,
    src_type: u32,
    src_host: *const c_void,
    src_device: DevPtrV1,
    src_array: *mut c_void,
    src_pitch: c_uint,
    dst_x: c_uint,
    dst_y: c_uint,
    dst_type: u32,
    dst_host: *mut c_void,
    dst_device: DevPtrV1,
    dst_array: *mut c_void,
    dst_pitch: c_uint,
    width: c_uint,
    height: c_uint,
}

/// `CUDA_MEMCPY3D_v1`: the 32-bit layout of `cuda.h`'s internal section.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Memcpy3DV1 {
    src_x: c_uint,
    src_y: c_uint,
    src_z: c_uint,
    src_lod: c_uint,
    src_type: u32,
    src_host: *const c_void,
    src_device: DevPtrV1,
    src_array: *mut c_void,
    reserved0: *mut c_void,
    src_pitch: c_uint,
    src_height: c_uint,
    dst_x: c_uint,
    dst_y: c_uint,
    dst_z: c_uint,
    dst_lod: c_uint,
    dst_type: u32,
    dst_host: *mut c_void,
    dst_device: DevPtrV1,
    dst_array: *mut c_void,
    reserved1: *mut c_void,
    dst_pitch: c_uint,
    dst_height: c_uint,
    width: c_uint,
    height: c_uint,
    depth: c_uint,
}

const _: () = {
    assert!(size_of::<Memcpy2DV1>() == 96);
    assert!(size_of::<Memcpy3DV1>() == 144);
};

/// The `_v2` form of a v1 2D copy descriptor.
fn widen_2d(c: &Memcpy2DV1) -> Memcpy2D {
    Memcpy2D {
        src_x: c.src_x as usize,
        src_y: c.src_y as usize,
        src_type: c.src_type,
        src_host: c.src_host,
        src_device: c.src_device.into(),
        src_array: c.src_array,
        src_pitch: c.src_pitch as usize,
        dst_x: c.dst_x as usize,
        dst_y: c.dst_y as usize,
        dst_type: c.dst_type,
        dst_host: c.dst_host,
        dst_device: c.dst_device.into(),
        dst_array: c.dst_array,
        dst_pitch: c.dst_pitch as usize,
        width: c.width as usize,
        height: c.height as usize,
    }
}

/// The `_v2` form of a v1 3D copy descriptor.
fn widen_3d(c: &Memcpy3DV1) -> Memcpy3D {
    Memcpy3D {
        src_x: c.src_x as usize,
        src_y: c.src_y as usize,
        src_z: c.src_z as usize,
        src_lod: c.src_lod as usize,
        src_type: c.src_type,
        src_host: c.src_host,
        src_device: c.src_device.into(),
        src_array: c.src_array,
        reserved0: c.reserved0,
        src_pitch: c.src_pitch as usize,
        src_height: c.src_height as usize,
        dst_x: c.dst_x as usize,
        dst_y: c.dst_y as usize,
        dst_z: c.dst_z as usize,
        dst_lod: c.dst_lod as usize,
        dst_type: c.dst_type,
        dst_host: c.dst_host,
        dst_device: c.dst_device.into(),
        dst_array: c.dst_array,
        reserved1: c.reserved1,
        dst_pitch: c.dst_pitch as usize,
        dst_height: c.dst_height as usize,
        width: c.width as usize,
        height: c.height as usize,
        depth: c.depth as usize,
    }
}

/// Reads a v1 descriptor (NULL stays NULL for the `_v2` call to refuse) and calls `f` with a
/// pointer to its `_v2` form.
///
/// # Safety
/// 1. `p` is NULL or valid for reading a `V1`.
unsafe fn with_widened<V1: Copy, V2>(
    p: *const V1,
    widen: fn(&V1) -> V2,
    f: impl FnOnce(*const V2) -> CUresult,
) -> ApiResult {
    if p.is_null() {
        return forward(f(std::ptr::null()));
    }
    // SAFETY: non-NULL and readable per this function's contract; read unaligned because C may
    // pack it anywhere.
    let wide = widen(&unsafe { p.read_unaligned() });
    forward(f(&raw const wide))
}

macro_rules! copy_v1 {
    ($($(#[$doc:meta])* fn $name:ident($v1:ty => $v2:ty, $widen:ident) => $target:path $(, $stream:ident)?;)*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        /// 1. `p_copy` is NULL or valid for reading the descriptor; its host pointers are valid
        ///    as the `_v2` function requires.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(p_copy: *const $v1 $(, $stream: CUstream)?) -> CUresult {
            api::call(stringify!($name), Init::Required, || {
                // SAFETY: forwarded caller contract; the `_v2` layout is the bindings' one.
                unsafe { with_widened(p_copy, $widen, |w| $target(w.cast::<$v2>() $(, $stream)?)) }
            })
        }
    )*};
}

copy_v1! {
    /// `CUresult cuMemcpy2D(const CUDA_MEMCPY2D_v1 *pCopy)`.
    fn cuMemcpy2D(Memcpy2DV1 => cudarc::driver::sys::CUDA_MEMCPY2D, widen_2d) => copy::cuMemcpy2D_v2;
    /// `CUresult cuMemcpy2DUnaligned(const CUDA_MEMCPY2D_v1 *pCopy)`.
    fn cuMemcpy2DUnaligned(Memcpy2DV1 => cudarc::driver::sys::CUDA_MEMCPY2D, widen_2d) => copy::cuMemcpy2DUnaligned_v2;
    /// `CUresult cuMemcpy2DAsync(const CUDA_MEMCPY2D_v1 *pCopy, CUstream hStream)`.
    fn cuMemcpy2DAsync(Memcpy2DV1 => cudarc::driver::sys::CUDA_MEMCPY2D, widen_2d) => copy::cuMemcpy2DAsync_v2, h_stream;
    /// `CUresult cuMemcpy3D(const CUDA_MEMCPY3D_v1 *pCopy)`.
    fn cuMemcpy3D(Memcpy3DV1 => cudarc::driver::sys::CUDA_MEMCPY3D, widen_3d) => copy::cuMemcpy3D_v2;
    /// `CUresult cuMemcpy3DAsync(const CUDA_MEMCPY3D_v1 *pCopy, CUstream hStream)`.
    fn cuMemcpy3DAsync(Memcpy3DV1 => cudarc::driver::sys::CUDA_MEMCPY3D, widen_3d) => copy::cuMemcpy3DAsync_v2, h_stream;
}

/// `CUresult cuMemsetD8(CUdeviceptr_v1 dstDevice, unsigned char uc, unsigned int N)` (v1).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8(dst: DevPtrV1, value: c_uchar, n: c_uint) -> CUresult {
    api::call("cuMemsetD8", Init::Required, || forward(copy::cuMemsetD8_v2(dst.into(), value, n as usize)))
}

/// `CUresult cuMemsetD16(CUdeviceptr_v1 dstDevice, unsigned short us, unsigned int N)` (v1).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD16(dst: DevPtrV1, value: c_ushort, n: c_uint) -> CUresult {
    api::call("cuMemsetD16", Init::Required, || forward(copy::cuMemsetD16_v2(dst.into(), value, n as usize)))
}

/// `CUresult cuMemsetD32(CUdeviceptr_v1 dstDevice, unsigned int ui, unsigned int N)` (v1).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD32(dst: DevPtrV1, value: c_uint, n: c_uint) -> CUresult {
    api::call("cuMemsetD32", Init::Required, || forward(copy::cuMemsetD32_v2(dst.into(), value, n as usize)))
}

/// `CUresult cuMemsetD2D8(CUdeviceptr_v1 dstDevice, unsigned int dstPitch, unsigned char uc,
/// unsigned int Width, unsigned int Height)` (v1).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD2D8(
    dst: DevPtrV1,
    pitch: c_uint,
    value: c_uchar,
    width: c_uint,
    height: c_uint,
) -> CUresult {
    api::call("cuMemsetD2D8", Init::Required, || {
        forward(copy::cuMemsetD2D8_v2(dst.into(), pitch as usize, value, width as usize, height as usize))
    })
}

/// `CUresult cuMemsetD2D16(CUdeviceptr_v1 dstDevice, unsigned int dstPitch, unsigned short us,
/// unsigned int Width, unsigned int Height)` (v1).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD2D16(
    dst: DevPtrV1,
    pitch: c_uint,
    value: c_ushort,
    width: c_uint,
    height: c_uint,
) -> CUresult {
    api::call("cuMemsetD2D16", Init::Required, || {
        forward(copy::cuMemsetD2D16_v2(dst.into(), pitch as usize, value, width as usize, height as usize))
    })
}

/// `CUresult cuMemsetD2D32(CUdeviceptr_v1 dstDevice, unsigned int dstPitch, unsigned int ui,
/// unsigned int Width, unsigned int Height)` (v1).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD2D32(
    dst: DevPtrV1,
    pitch: c_uint,
    value: c_uint,
    width: c_uint,
    height: c_uint,
) -> CUresult {
    api::call("cuMemsetD2D32", Init::Required, || {
        forward(copy::cuMemsetD2D32_v2(dst.into(), pitch as usize, value, width as usize, height as usize))
    })
}
