//! `cuGetProcAddress_v2` (and its v1): the driver entry point by public name, in the ABI version
//! a given CUDA version introduced, with the legacy or per-thread default stream.
//!
//! [`VERSIONS`] lists every ABI version of every function the real driver has in the areas the
//! simulator covers, with the CUDA version that introduced it (the `PFN_<name>_v<version>`
//! suffixes of `cudaTypedefs.h`). A lookup takes the newest version not newer than the request
//! (per-thread variants when asked for and introduced by then) and resolves its symbol in this
//! library with `dlsym`; a symbol the library does not export is not modelled and gives
//! `CUDA_ERROR_NOT_FOUND`. So the answer always matches what the library really exports, and an
//! entry point added later becomes reachable here without touching this file.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys::CUresult;

use crate::api::{self, Fail, Init};
use crate::exports::legacy_names::forward;

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` (DEFAULT is 0, LEGACY_STREAM 1).
const FLAG_PER_THREAD: u64 = 2;
/// `CUdriverProcAddressQueryResult`.
const STATUS_SUCCESS: u32 = 0;
const STATUS_SYMBOL_NOT_FOUND: u32 = 1;
const STATUS_VERSION_NOT_SUFFICIENT: u32 = 2;

/// `(public name, CUDA version that introduced this ABI version, exported symbol)`; symbols
/// ending in `_ptds`/`_ptsz` are the per-thread-default-stream variants.
pub const VERSIONS: &[(&str, i32, &str)] = &[
    ("cuInit", 2000, "cuInit"),
    ("cuDriverGetVersion", 2020, "cuDriverGetVersion"),
    ("cuGetErrorName", 6000, "cuGetErrorName"),
    ("cuGetErrorString", 6000, "cuGetErrorString"),
    ("cuGetProcAddress", 11030, "cuGetProcAddress"),
    ("cuGetProcAddress", 12000, "cuGetProcAddress_v2"),
    // Devices.
    ("cuDeviceGet", 2000, "cuDeviceGet"),
    ("cuDeviceGetCount", 2000, "cuDeviceGetCount"),
    ("cuDeviceGetName", 2000, "cuDeviceGetName"),
    ("cuDeviceGetUuid", 9020, "cuDeviceGetUuid"),
    ("cuDeviceGetUuid", 11040, "cuDeviceGetUuid_v2"),
    ("cuDeviceTotalMem", 2000, "cuDeviceTotalMem"),
    ("cuDeviceTotalMem", 3020, "cuDeviceTotalMem_v2"),
    ("cuDeviceGetAttribute", 2000, "cuDeviceGetAttribute"),
    ("cuDeviceGetPCIBusId", 4010, "cuDeviceGetPCIBusId"),
    ("cuDeviceGetByPCIBusId", 4010, "cuDeviceGetByPCIBusId"),
    ("cuDeviceCanAccessPeer", 4000, "cuDeviceCanAccessPeer"),
    ("cuDeviceGetP2PAttribute", 8000, "cuDeviceGetP2PAttribute"),
    ("cuDeviceGetDefaultMemPool", 11020, "cuDeviceGetDefaultMemPool"),
    ("cuDeviceGetMemPool", 11020, "cuDeviceGetMemPool"),
    ("cuDeviceSetMemPool", 11020, "cuDeviceSetMemPool"),
    // Primary contexts and contexts.
    ("cuDevicePrimaryCtxRetain", 7000, "cuDevicePrimaryCtxRetain"),
    ("cuDevicePrimaryCtxRelease", 7000, "cuDevicePrimaryCtxRelease"),
    ("cuDevicePrimaryCtxRelease", 11000, "cuDevicePrimaryCtxRelease_v2"),
    ("cuDevicePrimaryCtxReset", 7000, "cuDevicePrimaryCtxReset"),
    ("cuDevicePrimaryCtxReset", 11000, "cuDevicePrimaryCtxReset_v2"),
    ("cuDevicePrimaryCtxSetFlags", 7000, "cuDevicePrimaryCtxSetFlags"),
    ("cuDevicePrimaryCtxSetFlags", 11000, "cuDevicePrimaryCtxSetFlags_v2"),
    ("cuDevicePrimaryCtxGetState", 7000, "cuDevicePrimaryCtxGetState"),
    ("cuCtxCreate", 2000, "cuCtxCreate"),
    ("cuCtxCreate", 3020, "cuCtxCreate_v2"),
    ("cuCtxCreate", 11040, "cuCtxCreate_v3"),
    ("cuCtxCreate", 12050, "cuCtxCreate_v4"),
    ("cuCtxDestroy", 2000, "cuCtxDestroy"),
    ("cuCtxDestroy", 4000, "cuCtxDestroy_v2"),
    ("cuCtxPushCurrent", 2000, "cuCtxPushCurrent"),
    ("cuCtxPushCurrent", 4000, "cuCtxPushCurrent_v2"),
    ("cuCtxPopCurrent", 2000, "cuCtxPopCurrent"),
    ("cuCtxPopCurrent", 4000, "cuCtxPopCurrent_v2"),
    ("cuCtxSetCurrent", 4000, "cuCtxSetCurrent"),
    ("cuCtxGetCurrent", 4000, "cuCtxGetCurrent"),
    ("cuCtxGetDevice", 2000, "cuCtxGetDevice"),
    ("cuCtxGetFlags", 7000, "cuCtxGetFlags"),
    ("cuCtxSetFlags", 12010, "cuCtxSetFlags"),
    ("cuCtxGetId", 12000, "cuCtxGetId"),
    ("cuCtxSynchronize", 2000, "cuCtxSynchronize"),
    ("cuCtxSetLimit", 3010, "cuCtxSetLimit"),
    ("cuCtxGetLimit", 3010, "cuCtxGetLimit"),
    ("cuCtxGetCacheConfig", 3020, "cuCtxGetCacheConfig"),
    ("cuCtxSetCacheConfig", 3020, "cuCtxSetCacheConfig"),
    ("cuCtxGetApiVersion", 3020, "cuCtxGetApiVersion"),
    ("cuCtxGetStreamPriorityRange", 5050, "cuCtxGetStreamPriorityRange"),
    ("cuCtxResetPersistingL2Cache", 11000, "cuCtxResetPersistingL2Cache"),
    ("cuCtxEnablePeerAccess", 4000, "cuCtxEnablePeerAccess"),
    ("cuCtxDisablePeerAccess", 4000, "cuCtxDisablePeerAccess"),
    // Memory.
    ("cuMemGetInfo", 2000, "cuMemGetInfo"),
    ("cuMemGetInfo", 3020, "cuMemGetInfo_v2"),
    ("cuMemAlloc", 2000, "cuMemAlloc"),
    ("cuMemAlloc", 3020, "cuMemAlloc_v2"),
    ("cuMemAllocPitch", 2000, "cuMemAllocPitch"),
    ("cuMemAllocPitch", 3020, "cuMemAllocPitch_v2"),
    ("cuMemFree", 2000, "cuMemFree"),
    ("cuMemFree", 3020, "cuMemFree_v2"),
    ("cuMemGetAddressRange", 2000, "cuMemGetAddressRange"),
    ("cuMemGetAddressRange", 3020, "cuMemGetAddressRange_v2"),
    ("cuMemAllocHost", 2000, "cuMemAllocHost"),
    ("cuMemAllocHost", 3020, "cuMemAllocHost_v2"),
    ("cuMemFreeHost", 2000, "cuMemFreeHost"),
    ("cuMemHostAlloc", 2020, "cuMemHostAlloc"),
    ("cuMemHostGetDevicePointer", 2020, "cuMemHostGetDevicePointer"),
    ("cuMemHostGetDevicePointer", 3020, "cuMemHostGetDevicePointer_v2"),
    ("cuMemHostGetFlags", 2030, "cuMemHostGetFlags"),
    ("cuMemHostRegister", 4000, "cuMemHostRegister"),
    ("cuMemHostRegister", 6050, "cuMemHostRegister_v2"),
    ("cuMemHostUnregister", 4000, "cuMemHostUnregister"),
    ("cuMemAllocManaged", 6000, "cuMemAllocManaged"),
    ("cuPointerGetAttribute", 4000, "cuPointerGetAttribute"),
    ("cuPointerGetAttributes", 7000, "cuPointerGetAttributes"),
    ("cuPointerSetAttribute", 6000, "cuPointerSetAttribute"),
    ("cuMemcpy", 4000, "cuMemcpy"),
    ("cuMemcpy", 7000, "cuMemcpy_ptds"),
    ("cuMemcpyAsync", 4000, "cuMemcpyAsync"),
    ("cuMemcpyAsync", 7000, "cuMemcpyAsync_ptsz"),
    ("cuMemcpyHtoD", 2000, "cuMemcpyHtoD"),
    ("cuMemcpyHtoD", 3020, "cuMemcpyHtoD_v2"),
    ("cuMemcpyHtoD", 7000, "cuMemcpyHtoD_v2_ptds"),
    ("cuMemcpyDtoH", 2000, "cuMemcpyDtoH"),
    ("cuMemcpyDtoH", 3020, "cuMemcpyDtoH_v2"),
    ("cuMemcpyDtoH", 7000, "cuMemcpyDtoH_v2_ptds"),
    ("cuMemcpyDtoD", 2000, "cuMemcpyDtoD"),
    ("cuMemcpyDtoD", 3020, "cuMemcpyDtoD_v2"),
    ("cuMemcpyDtoD", 7000, "cuMemcpyDtoD_v2_ptds"),
    ("cuMemcpyHtoDAsync", 2000, "cuMemcpyHtoDAsync"),
    ("cuMemcpyHtoDAsync", 3020, "cuMemcpyHtoDAsync_v2"),
    ("cuMemcpyHtoDAsync", 7000, "cuMemcpyHtoDAsync_v2_ptsz"),
    ("cuMemcpyDtoHAsync", 2000, "cuMemcpyDtoHAsync"),
    ("cuMemcpyDtoHAsync", 3020, "cuMemcpyDtoHAsync_v2"),
    ("cuMemcpyDtoHAsync", 7000, "cuMemcpyDtoHAsync_v2_ptsz"),
    ("cuMemcpyDtoDAsync", 3000, "cuMemcpyDtoDAsync"),
    ("cuMemcpyDtoDAsync", 3020, "cuMemcpyDtoDAsync_v2"),
    ("cuMemcpyDtoDAsync", 7000, "cuMemcpyDtoDAsync_v2_ptsz"),
    ("cuMemcpy2D", 2000, "cuMemcpy2D"),
    ("cuMemcpy2D", 3020, "cuMemcpy2D_v2"),
    ("cuMemcpy2D", 7000, "cuMemcpy2D_v2_ptds"),
    ("cuMemcpy2DUnaligned", 2000, "cuMemcpy2DUnaligned"),
    ("cuMemcpy2DUnaligned", 3020, "cuMemcpy2DUnaligned_v2"),
    ("cuMemcpy2DUnaligned", 7000, "cuMemcpy2DUnaligned_v2_ptds"),
    ("cuMemcpy2DAsync", 2000, "cuMemcpy2DAsync"),
    ("cuMemcpy2DAsync", 3020, "cuMemcpy2DAsync_v2"),
    ("cuMemcpy2DAsync", 7000, "cuMemcpy2DAsync_v2_ptsz"),
    ("cuMemcpy3D", 2000, "cuMemcpy3D"),
    ("cuMemcpy3D", 3020, "cuMemcpy3D_v2"),
    ("cuMemcpy3D", 7000, "cuMemcpy3D_v2_ptds"),
    ("cuMemcpy3DAsync", 2000, "cuMemcpy3DAsync"),
    ("cuMemcpy3DAsync", 3020, "cuMemcpy3DAsync_v2"),
    ("cuMemcpy3DAsync", 7000, "cuMemcpy3DAsync_v2_ptsz"),
    ("cuMemcpyPeer", 4000, "cuMemcpyPeer"),
    ("cuMemcpyPeer", 7000, "cuMemcpyPeer_ptds"),
    ("cuMemcpyPeerAsync", 4000, "cuMemcpyPeerAsync"),
    ("cuMemcpyPeerAsync", 7000, "cuMemcpyPeerAsync_ptsz"),
    ("cuMemcpy3DPeer", 4000, "cuMemcpy3DPeer"),
    ("cuMemcpy3DPeer", 7000, "cuMemcpy3DPeer_ptds"),
    ("cuMemcpy3DPeerAsync", 4000, "cuMemcpy3DPeerAsync"),
    ("cuMemcpy3DPeerAsync", 7000, "cuMemcpy3DPeerAsync_ptsz"),
    ("cuMemcpyBatchAsync", 12080, "cuMemcpyBatchAsync"),
    ("cuMemcpyBatchAsync", 12080, "cuMemcpyBatchAsync_ptsz"),
    ("cuMemsetD8", 2000, "cuMemsetD8"),
    ("cuMemsetD8", 3020, "cuMemsetD8_v2"),
    ("cuMemsetD8", 7000, "cuMemsetD8_v2_ptds"),
    ("cuMemsetD16", 2000, "cuMemsetD16"),
    ("cuMemsetD16", 3020, "cuMemsetD16_v2"),
    ("cuMemsetD16", 7000, "cuMemsetD16_v2_ptds"),
    ("cuMemsetD32", 2000, "cuMemsetD32"),
    ("cuMemsetD32", 3020, "cuMemsetD32_v2"),
    ("cuMemsetD32", 7000, "cuMemsetD32_v2_ptds"),
    ("cuMemsetD2D8", 2000, "cuMemsetD2D8"),
    ("cuMemsetD2D8", 3020, "cuMemsetD2D8_v2"),
    ("cuMemsetD2D8", 7000, "cuMemsetD2D8_v2_ptds"),
    ("cuMemsetD2D16", 2000, "cuMemsetD2D16"),
    ("cuMemsetD2D16", 3020, "cuMemsetD2D16_v2"),
    ("cuMemsetD2D16", 7000, "cuMemsetD2D16_v2_ptds"),
    ("cuMemsetD2D32", 2000, "cuMemsetD2D32"),
    ("cuMemsetD2D32", 3020, "cuMemsetD2D32_v2"),
    ("cuMemsetD2D32", 7000, "cuMemsetD2D32_v2_ptds"),
    ("cuMemsetD8Async", 3020, "cuMemsetD8Async"),
    ("cuMemsetD8Async", 7000, "cuMemsetD8Async_ptsz"),
    ("cuMemsetD16Async", 3020, "cuMemsetD16Async"),
    ("cuMemsetD16Async", 7000, "cuMemsetD16Async_ptsz"),
    ("cuMemsetD32Async", 3020, "cuMemsetD32Async"),
    ("cuMemsetD32Async", 7000, "cuMemsetD32Async_ptsz"),
    ("cuMemsetD2D8Async", 3020, "cuMemsetD2D8Async"),
    ("cuMemsetD2D8Async", 7000, "cuMemsetD2D8Async_ptsz"),
    ("cuMemsetD2D16Async", 3020, "cuMemsetD2D16Async"),
    ("cuMemsetD2D16Async", 7000, "cuMemsetD2D16Async_ptsz"),
    ("cuMemsetD2D32Async", 3020, "cuMemsetD2D32Async"),
    ("cuMemsetD2D32Async", 7000, "cuMemsetD2D32Async_ptsz"),
    // Unified memory.
    ("cuMemAdvise", 8000, "cuMemAdvise"),
    ("cuMemAdvise", 12020, "cuMemAdvise_v2"),
    ("cuMemPrefetchAsync", 8000, "cuMemPrefetchAsync"),
    ("cuMemPrefetchAsync", 8000, "cuMemPrefetchAsync_ptsz"),
    ("cuMemPrefetchAsync", 12020, "cuMemPrefetchAsync_v2"),
    ("cuMemPrefetchAsync", 12020, "cuMemPrefetchAsync_v2_ptsz"),
    ("cuMemRangeGetAttribute", 8000, "cuMemRangeGetAttribute"),
    ("cuMemRangeGetAttributes", 8000, "cuMemRangeGetAttributes"),
    ("cuStreamAttachMemAsync", 6000, "cuStreamAttachMemAsync"),
    ("cuStreamAttachMemAsync", 7000, "cuStreamAttachMemAsync_ptsz"),
    // Streams.
    ("cuStreamCreate", 2000, "cuStreamCreate"),
    ("cuStreamCreateWithPriority", 5050, "cuStreamCreateWithPriority"),
    ("cuStreamDestroy", 2000, "cuStreamDestroy"),
    ("cuStreamDestroy", 4000, "cuStreamDestroy_v2"),
    ("cuStreamSynchronize", 2000, "cuStreamSynchronize"),
    ("cuStreamSynchronize", 7000, "cuStreamSynchronize_ptsz"),
    ("cuStreamQuery", 2000, "cuStreamQuery"),
    ("cuStreamQuery", 7000, "cuStreamQuery_ptsz"),
    ("cuStreamWaitEvent", 3020, "cuStreamWaitEvent"),
    ("cuStreamWaitEvent", 7000, "cuStreamWaitEvent_ptsz"),
    ("cuStreamGetPriority", 5050, "cuStreamGetPriority"),
    ("cuStreamGetPriority", 7000, "cuStreamGetPriority_ptsz"),
    ("cuStreamGetFlags", 5050, "cuStreamGetFlags"),
    ("cuStreamGetFlags", 7000, "cuStreamGetFlags_ptsz"),
    ("cuStreamGetCtx", 9020, "cuStreamGetCtx"),
    ("cuStreamGetCtx", 9020, "cuStreamGetCtx_ptsz"),
    ("cuStreamGetDevice", 12080, "cuStreamGetDevice"),
    ("cuStreamGetDevice", 12080, "cuStreamGetDevice_ptsz"),
    ("cuLaunchHostFunc", 10000, "cuLaunchHostFunc"),
    ("cuLaunchHostFunc", 10000, "cuLaunchHostFunc_ptsz"),
    // Events.
    ("cuEventCreate", 2000, "cuEventCreate"),
    ("cuEventRecord", 2000, "cuEventRecord"),
    ("cuEventRecord", 7000, "cuEventRecord_ptsz"),
    ("cuEventRecordWithFlags", 11010, "cuEventRecordWithFlags"),
    ("cuEventRecordWithFlags", 11010, "cuEventRecordWithFlags_ptsz"),
    ("cuEventQuery", 2000, "cuEventQuery"),
    ("cuEventSynchronize", 2000, "cuEventSynchronize"),
    ("cuEventElapsedTime", 2000, "cuEventElapsedTime"),
    ("cuEventElapsedTime", 12080, "cuEventElapsedTime_v2"),
    ("cuEventDestroy", 2000, "cuEventDestroy"),
    ("cuEventDestroy", 4000, "cuEventDestroy_v2"),
    // Stream-ordered allocator and pools.
    ("cuMemAllocAsync", 11020, "cuMemAllocAsync"),
    ("cuMemAllocAsync", 11020, "cuMemAllocAsync_ptsz"),
    ("cuMemFreeAsync", 11020, "cuMemFreeAsync"),
    ("cuMemFreeAsync", 11020, "cuMemFreeAsync_ptsz"),
    ("cuMemAllocFromPoolAsync", 11020, "cuMemAllocFromPoolAsync"),
    ("cuMemAllocFromPoolAsync", 11020, "cuMemAllocFromPoolAsync_ptsz"),
    ("cuMemPoolCreate", 11020, "cuMemPoolCreate"),
    ("cuMemPoolDestroy", 11020, "cuMemPoolDestroy"),
    ("cuMemPoolTrimTo", 11020, "cuMemPoolTrimTo"),
    ("cuMemPoolSetAttribute", 11020, "cuMemPoolSetAttribute"),
    ("cuMemPoolGetAttribute", 11020, "cuMemPoolGetAttribute"),
    ("cuMemPoolSetAccess", 11020, "cuMemPoolSetAccess"),
    ("cuMemPoolGetAccess", 11020, "cuMemPoolGetAccess"),
    ("cuMemPoolExportToShareableHandle", 11020, "cuMemPoolExportToShareableHandle"),
    ("cuMemPoolImportFromShareableHandle", 11020, "cuMemPoolImportFromShareableHandle"),
    ("cuMemPoolExportPointer", 11020, "cuMemPoolExportPointer"),
    ("cuMemPoolImportPointer", 11020, "cuMemPoolImportPointer"),
    // Virtual memory management.
    ("cuMemAddressReserve", 10020, "cuMemAddressReserve"),
    ("cuMemAddressFree", 10020, "cuMemAddressFree"),
    ("cuMemCreate", 10020, "cuMemCreate"),
    ("cuMemRelease", 10020, "cuMemRelease"),
    ("cuMemMap", 10020, "cuMemMap"),
    ("cuMemUnmap", 10020, "cuMemUnmap"),
    ("cuMemSetAccess", 10020, "cuMemSetAccess"),
    ("cuMemGetAccess", 10020, "cuMemGetAccess"),
    ("cuMemExportToShareableHandle", 10020, "cuMemExportToShareableHandle"),
    ("cuMemImportFromShareableHandle", 10020, "cuMemImportFromShareableHandle"),
    ("cuMemGetAllocationGranularity", 10020, "cuMemGetAllocationGranularity"),
    ("cuMemGetAllocationPropertiesFromHandle", 10020, "cuMemGetAllocationPropertiesFromHandle"),
    ("cuMemRetainAllocationHandle", 11000, "cuMemRetainAllocationHandle"),
    // Legacy IPC.
    ("cuIpcGetMemHandle", 4010, "cuIpcGetMemHandle"),
    ("cuIpcOpenMemHandle", 4010, "cuIpcOpenMemHandle"),
    ("cuIpcOpenMemHandle", 11000, "cuIpcOpenMemHandle_v2"),
    ("cuIpcCloseMemHandle", 4010, "cuIpcCloseMemHandle"),
    ("cuIpcGetEventHandle", 4010, "cuIpcGetEventHandle"),
    ("cuIpcOpenEventHandle", 4010, "cuIpcOpenEventHandle"),
];

/// Whether `symbol` is a per-thread-default-stream variant.
fn is_per_thread(symbol: &str) -> bool {
    symbol.ends_with("_ptds") || symbol.ends_with("_ptsz")
}

/// The `dlopen` handle of the library this code lives in (0 if it cannot be found).
fn own_library() -> usize {
    static HANDLE: OnceLock<usize> = OnceLock::new();
    *HANDLE.get_or_init(|| {
        // SAFETY: Dl_info is plain pointers and integers, for which all-zero is valid.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: dladdr reads no memory through its first argument; `info` is a valid out-param.
        let found = unsafe { libc::dladdr(cuGetProcAddress_v2 as *const c_void, &raw mut info) };
        if found == 0 || info.dli_fname.is_null() {
            return 0;
        }
        // SAFETY: dli_fname is a NUL-terminated path; RTLD_NOLOAD only takes another reference to
        // the already-loaded library (kept for the process lifetime; it is linked nodelete).
        (unsafe { libc::dlopen(info.dli_fname, libc::RTLD_NOW | libc::RTLD_NOLOAD) }) as usize
    })
}

/// The address of `symbol` in this library, if it exports it.
fn resolve(symbol: &str) -> Option<*mut c_void> {
    let handle = own_library();
    let name = CString::new(symbol).ok()?;
    if handle == 0 {
        return None;
    }
    // SAFETY: a live handle from dlopen and a NUL-terminated name.
    let p = unsafe { libc::dlsym(handle as *mut c_void, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// The lookup: `Ok(address)` or `Err(status)`.
fn lookup(name: &str, cuda_version: c_int, per_thread: bool) -> Result<*mut c_void, u32> {
    let known: Vec<_> = VERSIONS.iter().filter(|(n, _, s)| *n == name && resolve(s).is_some()).collect();
    if known.is_empty() {
        return Err(STATUS_SYMBOL_NOT_FOUND);
    }
    let eligible: Vec<_> = known.into_iter().filter(|(_, v, _)| *v <= cuda_version).collect();
    let newest = |pt: bool| {
        eligible
            .iter()
            .filter(|(_, _, s)| is_per_thread(s) == pt)
            .max_by_key(|(_, v, _)| *v)
            .map(|(_, _, s)| *s)
    };
    let symbol = if per_thread { newest(true).or_else(|| newest(false)) } else { newest(false) };
    symbol.and_then(resolve).ok_or(STATUS_VERSION_NOT_SUFFICIENT)
}

/// `CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t
/// flags, CUdriverProcAddressQueryResult *symbolStatus)`: `symbol` is the public name without
/// version suffix (`"cuMemAlloc"`). `flags`: DEFAULT (0, the legacy stream: the driver cannot see
/// how the caller was compiled), LEGACY_STREAM (1) or PER_THREAD_DEFAULT_STREAM (2); others →
/// `INVALID_VALUE`. Not found → `NOT_FOUND`, `*pfn = NULL`, status SYMBOL_NOT_FOUND (not modelled
/// or unknown) or VERSION_NOT_SUFFICIENT (introduced after `cudaVersion`). Works before `cuInit`,
/// as the runtime needs it to find `cuInit`.
///
/// # Safety
/// 1. `symbol` is NULL or NUL-terminated; `pfn` is NULL or valid for writing a pointer;
///    `symbol_status` is NULL or valid for writing a `CUdriverProcAddressQueryResult`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    symbol_status: *mut u32,
) -> CUresult {
    api::call("cuGetProcAddress_v2", Init::NotRequired, || {
        api::non_null(pfn, "pfn")?;
        // SAFETY: checked non-NULL; caller contract.
        unsafe { pfn.write(std::ptr::null_mut()) };
        api::non_null(symbol, "symbol")?;
        if flags > FLAG_PER_THREAD {
            return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("flags {flags:#x}")));
        }
        // SAFETY: non-NULL and NUL-terminated (caller contract).
        let name = unsafe { CStr::from_ptr(symbol) }.to_string_lossy();
        let found = lookup(&name, cuda_version, flags == FLAG_PER_THREAD);
        let status = found.err().unwrap_or(STATUS_SUCCESS);
        if !symbol_status.is_null() {
            // SAFETY: non-NULL and writable (caller contract).
            unsafe { symbol_status.write(status) };
        }
        let f = found.map_err(|_| Fail::quiet(CUresult::CUDA_ERROR_NOT_FOUND))?;
        // SAFETY: checked non-NULL; caller contract.
        unsafe { pfn.write(f) };
        Ok(())
    })
}

/// `CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t
/// flags)` (CUDA 11.3): `cuGetProcAddress_v2` without the status.
///
/// # Safety
/// 1. As [`cuGetProcAddress_v2`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CUresult {
    api::call("cuGetProcAddress", Init::NotRequired, || {
        // SAFETY: forwarded caller contract.
        forward(unsafe { cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, std::ptr::null_mut()) })
    })
}
