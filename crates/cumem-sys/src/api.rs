//! The driver entry points cumem calls, each returning its code as the C `int` it is.
//!
//! cudarc's bindings ([`crate::sys`]) declare every entry point as returning `CUresult`, a Rust enum
//! of the codes CUDA 12.8 knows. A newer driver may return a code the enum lacks (CUDA 13 added
//! several), and an enum holding a value outside its variants is undefined behaviour the moment
//! the call returns. The functions here take the same arguments, call the same symbol of the same
//! library, and return a [`Code`]: a newer code reaches [`check`](crate::check) as a number, which
//! maps it to an [`Error`](crate::Error) (an unknown one to `Error::Cuda` named
//! `CUDA_ERROR_UNKNOWN`, its number kept in `raw`).
//!
//! They never panic either: with no driver loaded they return `CUDA_ERROR_NOT_INITIALIZED`, and
//! for an entry point the loaded driver lacks, [`Code::MISSING_ENTRY_POINT`], which
//! [`check`](crate::check) turns into `NotSupported`. Each symbol the driver has is looked up
//! once; a call afterwards costs what cudarc's binding costs (one atomic load and an indirect
//! call). A missing one is looked up again on each call (callers probe before calling those).
//!
//! ```
//! # cumem_sys::testing::init();
//! cumem_sys::driver::init()?;
//! let mut version = 0;
//! // SAFETY: the driver is loaded; `version` is a valid out-pointer.
//! let code = unsafe { cumem_sys::api::cuDriverGetVersion(&mut version) };
//! cumem_sys::check(code, cumem_sys::ErrorContext::op("cuDriverGetVersion"))?;
//! assert!(version >= 12000);
//! # Ok::<(), cumem_sys::Error>(())
//! ```

// The driver's own names, argument names included, so that each line reads like its C prototype.
#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_uchar, c_uint, c_ulonglong, c_ushort, c_void};
use std::sync::OnceLock;

use crate::sys::{
    CUDA_MEMCPY2D, CUDA_MEMCPY3D, CUDA_MEMCPY3D_PEER, CUcontext, CUdevice, CUdevice_P2PAttribute,
    CUdevice_attribute, CUdeviceptr, CUevent, CUhostFn, CUipcEventHandle, CUipcMemHandle, CUmem_advise,
    CUmem_range_attribute, CUmemAccessDesc, CUmemAllocationGranularity_flags, CUmemAllocationHandleType,
    CUmemAllocationProp, CUmemGenericAllocationHandle, CUmemLocation, CUmemPool_attribute, CUmemPoolProps,
    CUmemPoolPtrExportData, CUmemoryPool, CUpointer_attribute, CUresult, CUstream,
};

/// A driver return code, read as the C `int` it is: any value a driver returns is a valid `Code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct Code(pub i32);

impl Code {
    /// `CUDA_SUCCESS`.
    pub const SUCCESS: Code = Code(0);

    /// Not a driver code: the loaded driver does not export the entry point (an older driver).
    /// [`check`](crate::check) answers `NotSupported { feature: Symbol(op) }` for it.
    pub const MISSING_ENTRY_POINT: Code = Code(-1);

    /// Whether this is `CUDA_SUCCESS`.
    #[inline]
    pub fn is_success(self) -> bool {
        self == Code::SUCCESS
    }

    /// The `CUresult` of cudarc's bindings with this value, if the enum has one.
    pub fn known(self) -> Option<CUresult> {
        crate::error::code_from_raw(self.0)
    }
}

impl From<CUresult> for Code {
    #[inline]
    fn from(code: CUresult) -> Self {
        Code(code as i32)
    }
}

impl PartialEq<CUresult> for Code {
    fn eq(&self, other: &CUresult) -> bool {
        self.0 == *other as i32
    }
}

/// Looks `name` up in the loaded driver and keeps it in `slot`; the code to return instead when
/// there is no driver or no such symbol (nothing is kept then, so a later call looks again).
///
/// # Safety
/// 1. `F` is the C type of the driver's entry point `name`, with an `int` result.
#[cold]
unsafe fn resolve<F: Copy>(slot: &OnceLock<F>, name: &str) -> Result<F, Code> {
    let Some(lib) = crate::driver::library() else {
        return Err(Code::from(CUresult::CUDA_ERROR_NOT_INITIALIZED));
    };
    // SAFETY: `F` is the symbol's type (this function's contract 1); the library stays loaded for
    // the rest of the process (`driver` never unloads a library it chose), so the pointer does too.
    match unsafe { lib.get::<F>(name.as_bytes()) } {
        Ok(symbol) => Ok(*slot.get_or_init(|| *symbol)),
        Err(_) => Err(Code::MISSING_ENTRY_POINT),
    }
}

/// Declares each entry point as an `unsafe fn` with its C prototype (from cudarc's CUDA 12.8
/// bindings) and an `int` result.
macro_rules! entry_points {
    ($( fn $name:ident($($arg:ident: $ty:ty),* $(,)?); )*) => {$(
        #[doc = concat!("`", stringify!($name), "`, with its code as a [`Code`].")]
        ///
        /// # Safety
        /// 1. The arguments meet the driver's contract for this entry point (as for cudarc's
        ///    binding of the same name): handles are live, pointers are valid for what the driver
        ///    reads and writes through them, for as long as it does.
        #[inline]
        pub unsafe fn $name($($arg: $ty),*) -> Code {
            type F = unsafe extern "C" fn($($ty),*) -> c_int;
            static SLOT: OnceLock<F> = OnceLock::new();
            let f = match SLOT.get() {
                Some(f) => *f,
                // SAFETY: `F` is the entry point's C prototype with the `int` result.
                None => match unsafe { resolve(&SLOT, stringify!($name)) } {
                    Ok(f) => f,
                    Err(code) => return code,
                },
            };
            // SAFETY: `f` is the loaded driver's entry point of this name, called with its own
            // prototype; the caller meets its contract (this function's contract 1).
            Code(unsafe { f($($arg),*) })
        }
    )*};
}

#[rustfmt::skip]
entry_points! {
    fn cuCtxDisablePeerAccess(peerContext: CUcontext);
    fn cuCtxEnablePeerAccess(peerContext: CUcontext, Flags: c_uint);
    fn cuCtxGetCurrent(pctx: *mut CUcontext);
    fn cuCtxGetStreamPriorityRange(leastPriority: *mut c_int, greatestPriority: *mut c_int);
    fn cuCtxSetCurrent(ctx: CUcontext);
    fn cuCtxSynchronize();
    fn cuDeviceCanAccessPeer(canAccessPeer: *mut c_int, dev: CUdevice, peerDev: CUdevice);
    fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int);
    fn cuDeviceGetAttribute(pi: *mut c_int, attrib: CUdevice_attribute, dev: CUdevice);
    fn cuDeviceGetCount(count: *mut c_int);
    fn cuDeviceGetDefaultMemPool(pool_out: *mut CUmemoryPool, dev: CUdevice);
    fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice);
    fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice);
    fn cuDeviceGetP2PAttribute(value: *mut c_int, attrib: CUdevice_P2PAttribute, srcDevice: CUdevice, dstDevice: CUdevice);
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice);
    fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice);
    fn cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool);
    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice);
    fn cuDriverGetVersion(driverVersion: *mut c_int);
    fn cuEventCreate(phEvent: *mut CUevent, Flags: c_uint);
    fn cuEventDestroy_v2(hEvent: CUevent);
    fn cuEventElapsedTime(pMilliseconds: *mut f32, hStart: CUevent, hEnd: CUevent);
    fn cuEventQuery(hEvent: CUevent);
    fn cuEventRecord(hEvent: CUevent, hStream: CUstream);
    fn cuEventSynchronize(hEvent: CUevent);
    fn cuIpcCloseMemHandle(dptr: CUdeviceptr);
    fn cuIpcGetEventHandle(pHandle: *mut CUipcEventHandle, event: CUevent);
    fn cuIpcGetMemHandle(pHandle: *mut CUipcMemHandle, dptr: CUdeviceptr);
    fn cuIpcOpenEventHandle(phEvent: *mut CUevent, handle: CUipcEventHandle);
    fn cuIpcOpenMemHandle_v2(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, Flags: c_uint);
    fn cuLaunchHostFunc(hStream: CUstream, fn_: CUhostFn, userData: *mut c_void);
    fn cuMemAddressFree(ptr: CUdeviceptr, size: usize);
    fn cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, alignment: usize, addr: CUdeviceptr, flags: c_ulonglong);
    fn cuMemAdvise(devPtr: CUdeviceptr, count: usize, advice: CUmem_advise, device: CUdevice);
    fn cuMemAdvise_v2(devPtr: CUdeviceptr, count: usize, advice: CUmem_advise, location: CUmemLocation);
    fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, bytesize: usize, pool: CUmemoryPool, hStream: CUstream);
    fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytesize: usize, flags: c_uint);
    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize);
    fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: c_ulonglong);
    fn cuMemExportToShareableHandle(shareableHandle: *mut c_void, handle: CUmemGenericAllocationHandle, handleType: CUmemAllocationHandleType, flags: c_ulonglong);
    fn cuMemFreeAsync(dptr: CUdeviceptr, hStream: CUstream);
    fn cuMemFreeHost(p: *mut c_void);
    fn cuMemFree_v2(dptr: CUdeviceptr);
    fn cuMemGetAccess(flags: *mut c_ulonglong, location: *const CUmemLocation, ptr: CUdeviceptr);
    fn cuMemGetAddressRange_v2(pbase: *mut CUdeviceptr, psize: *mut usize, dptr: CUdeviceptr);
    fn cuMemGetAllocationGranularity(granularity: *mut usize, prop: *const CUmemAllocationProp, option: CUmemAllocationGranularity_flags);
    // Writes enum fields (`type_`, `location.type_`) that a newer driver may give values the 12.8
    // enums lack: read them as the integers they are (see cumem-vmm's `ffi::properties`).
    fn cuMemGetAllocationPropertiesFromHandle(prop: *mut CUmemAllocationProp, handle: CUmemGenericAllocationHandle);
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize);
    fn cuMemHostAlloc(pp: *mut *mut c_void, bytesize: usize, Flags: c_uint);
    fn cuMemHostGetDevicePointer_v2(pdptr: *mut CUdeviceptr, p: *mut c_void, Flags: c_uint);
    fn cuMemHostRegister_v2(p: *mut c_void, bytesize: usize, Flags: c_uint);
    fn cuMemHostUnregister(p: *mut c_void);
    fn cuMemImportFromShareableHandle(handle: *mut CUmemGenericAllocationHandle, osHandle: *mut c_void, shHandleType: CUmemAllocationHandleType);
    fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: c_ulonglong);
    fn cuMemPoolCreate(pool: *mut CUmemoryPool, poolProps: *const CUmemPoolProps);
    fn cuMemPoolDestroy(pool: CUmemoryPool);
    fn cuMemPoolExportPointer(shareData_out: *mut CUmemPoolPtrExportData, ptr: CUdeviceptr);
    fn cuMemPoolExportToShareableHandle(handle_out: *mut c_void, pool: CUmemoryPool, handleType: CUmemAllocationHandleType, flags: c_ulonglong);
    // `flags` is a `CUmemAccess_flags` in C, written by the driver: an `unsigned int` here, so that
    // a value the 12.8 enum lacks is a number, as for the result.
    fn cuMemPoolGetAccess(flags: *mut c_uint, memPool: CUmemoryPool, location: *mut CUmemLocation);
    fn cuMemPoolGetAttribute(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void);
    fn cuMemPoolImportFromShareableHandle(pool_out: *mut CUmemoryPool, handle: *mut c_void, handleType: CUmemAllocationHandleType, flags: c_ulonglong);
    fn cuMemPoolImportPointer(ptr_out: *mut CUdeviceptr, pool: CUmemoryPool, shareData: *mut CUmemPoolPtrExportData);
    fn cuMemPoolSetAttribute(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void);
    fn cuMemPoolTrimTo(pool: CUmemoryPool, minBytesToKeep: usize);
    fn cuMemPrefetchAsync(devPtr: CUdeviceptr, count: usize, dstDevice: CUdevice, hStream: CUstream);
    fn cuMemPrefetchAsync_v2(devPtr: CUdeviceptr, count: usize, location: CUmemLocation, flags: c_uint, hStream: CUstream);
    fn cuMemRangeGetAttribute(data: *mut c_void, dataSize: usize, attribute: CUmem_range_attribute, devPtr: CUdeviceptr, count: usize);
    fn cuMemRelease(handle: CUmemGenericAllocationHandle);
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize);
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize);
    fn cuMemcpy2DAsync_v2(pCopy: *const CUDA_MEMCPY2D, hStream: CUstream);
    fn cuMemcpy2DUnaligned_v2(pCopy: *const CUDA_MEMCPY2D);
    fn cuMemcpy2D_v2(pCopy: *const CUDA_MEMCPY2D);
    fn cuMemcpy3DAsync_v2(pCopy: *const CUDA_MEMCPY3D, hStream: CUstream);
    fn cuMemcpy3DPeerAsync(pCopy: *const CUDA_MEMCPY3D_PEER, hStream: CUstream);
    fn cuMemcpy3D_v2(pCopy: *const CUDA_MEMCPY3D);
    fn cuMemcpyDtoDAsync_v2(dstDevice: CUdeviceptr, srcDevice: CUdeviceptr, ByteCount: usize, hStream: CUstream);
    fn cuMemcpyDtoD_v2(dstDevice: CUdeviceptr, srcDevice: CUdeviceptr, ByteCount: usize);
    fn cuMemcpyDtoHAsync_v2(dstHost: *mut c_void, srcDevice: CUdeviceptr, ByteCount: usize, hStream: CUstream);
    fn cuMemcpyDtoH_v2(dstHost: *mut c_void, srcDevice: CUdeviceptr, ByteCount: usize);
    fn cuMemcpyHtoDAsync_v2(dstDevice: CUdeviceptr, srcHost: *const c_void, ByteCount: usize, hStream: CUstream);
    fn cuMemcpyHtoD_v2(dstDevice: CUdeviceptr, srcHost: *const c_void, ByteCount: usize);
    fn cuMemcpyPeer(dstDevice: CUdeviceptr, dstContext: CUcontext, srcDevice: CUdeviceptr, srcContext: CUcontext, ByteCount: usize);
    fn cuMemcpyPeerAsync(dstDevice: CUdeviceptr, dstContext: CUcontext, srcDevice: CUdeviceptr, srcContext: CUcontext, ByteCount: usize, hStream: CUstream);
    fn cuMemsetD16Async(dstDevice: CUdeviceptr, us: c_ushort, N: usize, hStream: CUstream);
    fn cuMemsetD2D16Async(dstDevice: CUdeviceptr, dstPitch: usize, us: c_ushort, Width: usize, Height: usize, hStream: CUstream);
    fn cuMemsetD2D32Async(dstDevice: CUdeviceptr, dstPitch: usize, ui: c_uint, Width: usize, Height: usize, hStream: CUstream);
    fn cuMemsetD2D8Async(dstDevice: CUdeviceptr, dstPitch: usize, uc: c_uchar, Width: usize, Height: usize, hStream: CUstream);
    fn cuMemsetD32Async(dstDevice: CUdeviceptr, ui: c_uint, N: usize, hStream: CUstream);
    fn cuMemsetD8Async(dstDevice: CUdeviceptr, uc: c_uchar, N: usize, hStream: CUstream);
    fn cuPointerGetAttribute(data: *mut c_void, attribute: CUpointer_attribute, ptr: CUdeviceptr);
    fn cuStreamAttachMemAsync(hStream: CUstream, dptr: CUdeviceptr, length: usize, flags: c_uint);
    fn cuStreamCreateWithPriority(phStream: *mut CUstream, flags: c_uint, priority: c_int);
    fn cuStreamDestroy_v2(hStream: CUstream);
    fn cuStreamQuery(hStream: CUstream);
    fn cuStreamSynchronize(hStream: CUstream);
    fn cuStreamWaitEvent(hStream: CUstream, hEvent: CUevent, Flags: c_uint);
}
