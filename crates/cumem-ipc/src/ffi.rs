//! Every driver call cumem-ipc makes, each a thin checked wrapper around one `unsafe` FFI call.
//! None of these bind a context; callers do that first.

use std::ffi::{c_char, c_void};

use cumem_sys::sys::{self, CUdeviceptr, CUevent, CUipcEventHandle, CUipcMemHandle, CUstream};
use cumem_sys::{ErrorContext as Ctx, Result, api, check};

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
    check(unsafe { api::cuIpcGetMemHandle(&mut h, dptr) }, Ctx::op("cuIpcGetMemHandle"))?;
    Ok(to_bytes(h.reserved))
}

pub(crate) fn mem_open(bytes: [u8; HANDLE_SIZE]) -> Result<CUdeviceptr> {
    let mut dptr = 0;
    let h = CUipcMemHandle { reserved: to_reserved(bytes) };
    // SAFETY: `dptr` is a valid out-pointer; the handle is passed by value.
    let code = unsafe { api::cuIpcOpenMemHandle_v2(&mut dptr, h, LAZY_ENABLE_PEER_ACCESS) };
    check(code, Ctx::op("cuIpcOpenMemHandle_v2"))?;
    Ok(dptr)
}

/// # Safety
/// 1. `dptr` was returned by [`mem_open`], is closed once, and nothing uses it afterwards.
pub(crate) unsafe fn mem_close(dptr: CUdeviceptr) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuIpcCloseMemHandle(dptr) }, Ctx::op("cuIpcCloseMemHandle"))
}

pub(crate) fn event_create() -> Result<CUevent> {
    let mut e = std::ptr::null_mut();
    // SAFETY: `e` is a valid out-pointer.
    check(unsafe { api::cuEventCreate(&mut e, INTERPROCESS_EVENT) }, Ctx::op("cuEventCreate"))?;
    Ok(e)
}

pub(crate) fn event_handle(e: CUevent) -> Result<[u8; HANDLE_SIZE]> {
    let mut h = CUipcEventHandle { reserved: [0; HANDLE_SIZE] };
    // SAFETY: `h` is a valid out-pointer; `e` is a live event owned by the caller.
    check(unsafe { api::cuIpcGetEventHandle(&mut h, e) }, Ctx::op("cuIpcGetEventHandle"))?;
    Ok(to_bytes(h.reserved))
}

pub(crate) fn event_open(bytes: [u8; HANDLE_SIZE]) -> Result<CUevent> {
    let mut e = std::ptr::null_mut();
    let h = CUipcEventHandle { reserved: to_reserved(bytes) };
    // SAFETY: `e` is a valid out-pointer; the handle is passed by value.
    check(unsafe { api::cuIpcOpenEventHandle(&mut e, h) }, Ctx::op("cuIpcOpenEventHandle"))?;
    Ok(e)
}

/// # Safety
/// 1. `e` is a live event and `s` a live stream of the same context.
pub(crate) unsafe fn event_record(e: CUevent, s: CUstream) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuEventRecord(e, s) }, Ctx::op("cuEventRecord"))
}

/// # Safety
/// 1. `e` is a live event.
pub(crate) unsafe fn event_synchronize(e: CUevent) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuEventSynchronize(e) }, Ctx::op("cuEventSynchronize"))
}

/// # Safety
/// 1. `e` is a live event.
pub(crate) unsafe fn event_query(e: CUevent) -> Result<bool> {
    // SAFETY: guaranteed by the caller.
    let code = unsafe { api::cuEventQuery(e) };
    if code == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check(code, Ctx::op("cuEventQuery")).map(|()| true)
}

/// # Safety
/// 1. `s` is a live stream and `e` a live event.
pub(crate) unsafe fn stream_wait_event(s: CUstream, e: CUevent) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuStreamWaitEvent(s, e, 0) }, Ctx::op("cuStreamWaitEvent"))
}

/// # Safety
/// 1. `e` is a live event, destroyed once and not used afterwards.
pub(crate) unsafe fn event_destroy(e: CUevent) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuEventDestroy_v2(e) }, Ctx::op("cuEventDestroy_v2"))
}

/// The allocation containing `dptr`: `(base, size)`.
pub(crate) fn address_range(dptr: CUdeviceptr) -> Result<(CUdeviceptr, usize)> {
    let (mut base, mut size) = (0, 0);
    // SAFETY: both out-pointers are valid; the driver checks `dptr` itself.
    let code = unsafe { api::cuMemGetAddressRange_v2(&mut base, &mut size, dptr) };
    check(code, Ctx::op("cuMemGetAddressRange_v2"))?;
    Ok((base, size))
}

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// Bytes of `CUmemPoolPtrExportData`.
pub(crate) const POOL_EXPORT_SIZE: usize = 64;

/// `cuMemPoolCreate` on device `dev` with POSIX-descriptor handle types (`max_size` 0: no cap).
pub(crate) fn pool_create_shareable(dev: sys::CUdevice, max_size: usize) -> Result<sys::CUmemoryPool> {
    // SAFETY: CUmemPoolProps is plain old data; all-zero is its documented "unset" state.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = POSIX_FD;
    props.location =
        sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev };
    props.maxSize = max_size;
    let mut pool = std::ptr::null_mut();
    // SAFETY: `props` is fully initialised and outlives the call; `pool` is a valid out-pointer.
    let code = unsafe { api::cuMemPoolCreate(&mut pool, &props) };
    check(code, Ctx::op("cuMemPoolCreate (POSIX_FD handle types)").device(dev))?;
    Ok(pool)
}

/// # Safety
/// 1. `pool` was created by `pool_create_shareable` or imported by `pool_import_fd`, is destroyed
///    once and not used afterwards.
pub(crate) unsafe fn pool_destroy(pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemPoolDestroy(pool) }, Ctx::op("cuMemPoolDestroy"))
}

/// `cuMemPoolExportToShareableHandle` as a POSIX descriptor, owned by the caller.
pub(crate) fn pool_export_fd(pool: sys::CUmemoryPool) -> Result<std::os::fd::OwnedFd> {
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: `fd` is a valid out-pointer for the `int` POSIX_FD writes; `pool` is a live handle.
    let code = unsafe { api::cuMemPoolExportToShareableHandle((&raw mut fd).cast(), pool, POSIX_FD, 0) };
    check(code, Ctx::op("cuMemPoolExportToShareableHandle"))?;
    if fd < 0 {
        // A driver that reported success without a descriptor: nothing to own or close, and an
        // `OwnedFd` of -1 is undefined behaviour.
        return Err(cumem_sys::Error::InvalidHandle {
            ctx: Ctx::op("cuMemPoolExportToShareableHandle (no descriptor)"),
        });
    }
    // SAFETY: on success the driver wrote a new descriptor (checked above) that nothing else owns.
    Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// `cuMemPoolImportFromShareableHandle` of a POSIX descriptor (the caller keeps `fd`).
pub(crate) fn pool_import_fd(fd: std::os::fd::BorrowedFd<'_>) -> Result<sys::CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    // SAFETY: `pool` is a valid out-pointer; the descriptor travels by value, cast to a pointer,
    // as the driver documents for POSIX_FD, and stays open for the call.
    let code = unsafe {
        api::cuMemPoolImportFromShareableHandle(&mut pool, raw as isize as *mut c_void, POSIX_FD, 0)
    };
    check(code, Ctx::op("cuMemPoolImportFromShareableHandle"))?;
    Ok(pool)
}

/// `cuMemPoolExportPointer` of the allocation starting at `dptr`.
pub(crate) fn pool_export_pointer(dptr: CUdeviceptr) -> Result<[u8; POOL_EXPORT_SIZE]> {
    let mut data = sys::CUmemPoolPtrExportData { reserved: [0; POOL_EXPORT_SIZE] };
    // SAFETY: `data` is a valid out-pointer; the driver checks `dptr` itself.
    check(unsafe { api::cuMemPoolExportPointer(&mut data, dptr) }, Ctx::op("cuMemPoolExportPointer"))?;
    Ok(data.reserved)
}

/// `cuMemPoolImportPointer` through the imported `pool`: the address here.
pub(crate) fn pool_import_pointer(
    pool: sys::CUmemoryPool,
    bytes: [u8; POOL_EXPORT_SIZE],
) -> Result<CUdeviceptr> {
    let mut data = sys::CUmemPoolPtrExportData { reserved: bytes };
    let mut dptr = 0;
    // SAFETY: both pointers are valid for the call; `pool` is a live handle.
    let code = unsafe { api::cuMemPoolImportPointer(&mut dptr, pool, &mut data) };
    check(code, Ctx::op("cuMemPoolImportPointer"))?;
    Ok(dptr)
}

pub(crate) fn mem_alloc_from_pool_async(
    bytes: usize,
    pool: sys::CUmemoryPool,
    stream: CUstream,
    device: i32,
) -> Result<CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: `ptr` is a valid out-pointer; pool and stream are live handles.
    let code = unsafe { api::cuMemAllocFromPoolAsync(&mut ptr, bytes, pool, stream) };
    check(code, Ctx::op("cuMemAllocFromPoolAsync").bytes(bytes).device(device))?;
    Ok(ptr)
}

/// # Safety
/// 1. `ptr` came from a stream-ordered allocation or a pool import, and is freed once.
/// 2. Every use of it was queued on `stream` or ordered before work queued on it next.
pub(crate) unsafe fn mem_free_async(ptr: CUdeviceptr, stream: CUstream) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemFreeAsync(ptr, stream) }, Ctx::op("cuMemFreeAsync"))
}

/// # Safety
/// 1. `ptr` was returned by [`pool_import_pointer`], is freed once, and no work uses it any more.
pub(crate) unsafe fn mem_free(ptr: CUdeviceptr) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemFree_v2(ptr) }, Ctx::op("cuMemFree_v2"))
}

/// The pool the allocation containing `dptr` came from (`CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`;
/// NULL outside pools).
pub(crate) fn pointer_pool(dptr: CUdeviceptr) -> Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer of the attribute's type; the driver checks `dptr`.
    let code = unsafe {
        api::cuPointerGetAttribute(
            (&raw mut pool).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            dptr,
        )
    };
    check(code, Ctx::op("cuPointerGetAttribute(MEMPOOL_HANDLE)"))?;
    Ok(pool)
}

/// Whether device `dev` has read-write access to `pool` (`cuMemPoolGetAccess`): true on the
/// pool's resident device, and on others `cuMemPoolSetAccess` gave it.
pub(crate) fn pool_device_can_read_write(pool: sys::CUmemoryPool, dev: sys::CUdevice) -> Result<bool> {
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE as u32;
    let mut location =
        sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev };
    // SAFETY: `flags` is a valid out-pointer, `location` valid for the call; `pool` is live.
    let code = unsafe { api::cuMemPoolGetAccess(&mut flags, pool, &mut location) };
    check(code, Ctx::op("cuMemPoolGetAccess").device(dev))?;
    Ok(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u32)
}
