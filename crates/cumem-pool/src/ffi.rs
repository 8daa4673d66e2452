//! Every driver call cumem-pool makes, each a thin checked wrapper around one `unsafe` FFI call.
//!
//! Callers bind the right context first and uphold each function's `# Safety` list.

use std::ffi::c_void;

use cumem_core::sys::{
    CUdevice, CUdeviceptr, CUmemAllocationHandleType, CUmemAllocationType, CUmemLocation, CUmemLocationType,
    CUmemPool_attribute, CUmemPoolProps, CUmemoryPool, CUstream,
};
use cumem_core::{ErrorContext as Ctx, Result};
use cumem_sys::{api, check};

pub(crate) fn default_mem_pool(dev: CUdevice) -> Result<CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer.
    let code = unsafe { api::cuDeviceGetDefaultMemPool(&mut pool, dev) };
    check(code, Ctx::op("cuDeviceGetDefaultMemPool").device(dev))?;
    Ok(pool)
}

pub(crate) fn current_mem_pool(dev: CUdevice) -> Result<CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer.
    let code = unsafe { api::cuDeviceGetMemPool(&mut pool, dev) };
    check(code, Ctx::op("cuDeviceGetMemPool").device(dev))?;
    Ok(pool)
}

pub(crate) fn set_current_mem_pool(dev: CUdevice, pool: CUmemoryPool) -> Result<()> {
    // SAFETY: `pool` is a live pool handle of `dev`.
    let code = unsafe { api::cuDeviceSetMemPool(dev, pool) };
    check(code, Ctx::op("cuDeviceSetMemPool").device(dev))
}

pub(crate) fn mem_pool_create(dev: CUdevice, max_size: usize) -> Result<CUmemoryPool> {
    // SAFETY: CUmemPoolProps is plain old data; all-zero is its documented "unset" state.
    let mut props: CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location = CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev };
    props.maxSize = max_size;
    let mut pool = std::ptr::null_mut();
    // SAFETY: `props` is fully initialised and outlives the call; `pool` is a valid out-pointer.
    let code = unsafe { api::cuMemPoolCreate(&mut pool, &props) };
    check(code, Ctx::op("cuMemPoolCreate").device(dev))?;
    Ok(pool)
}

/// # Safety
/// 1. `pool` was created by `mem_pool_create`, is destroyed once and not used afterwards.
pub(crate) unsafe fn mem_pool_destroy(pool: CUmemoryPool) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    let code = unsafe { api::cuMemPoolDestroy(pool) };
    check(code, Ctx::op("cuMemPoolDestroy"))
}

pub(crate) fn mem_pool_trim_to(pool: CUmemoryPool, keep: usize) -> Result<()> {
    // SAFETY: `pool` is a live pool handle.
    let code = unsafe { api::cuMemPoolTrimTo(pool, keep) };
    check(code, Ctx::op("cuMemPoolTrimTo"))
}

/// Reads an attribute whose value type is `T` (`i32` for the reuse flags, `u64` for sizes).
///
/// # Safety
/// 1. `T` is the value type the driver documents for `attr`.
pub(crate) unsafe fn mem_pool_get<T: Default>(pool: CUmemoryPool, attr: CUmemPool_attribute) -> Result<T> {
    let mut value = T::default();
    // SAFETY: `value` is a valid out-pointer of the attribute's type (caller's item 1).
    let code = unsafe { api::cuMemPoolGetAttribute(pool, attr, (&raw mut value).cast::<c_void>()) };
    check(code, Ctx::op("cuMemPoolGetAttribute"))?;
    Ok(value)
}

/// Writes an attribute whose value type is `T`.
///
/// # Safety
/// 1. `T` is the value type the driver documents for `attr`.
pub(crate) unsafe fn mem_pool_set<T>(
    pool: CUmemoryPool,
    attr: CUmemPool_attribute,
    mut value: T,
) -> Result<()> {
    // SAFETY: `value` is a valid pointer to the attribute's type (caller's item 1).
    let code = unsafe { api::cuMemPoolSetAttribute(pool, attr, (&raw mut value).cast::<c_void>()) };
    check(code, Ctx::op("cuMemPoolSetAttribute"))
}

pub(crate) fn mem_alloc_from_pool_async(
    bytes: usize,
    pool: CUmemoryPool,
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
/// 1. `ptr` came from a stream-ordered allocation and is freed once.
/// 2. Every use of it was queued on `stream` or ordered before work queued on it next.
pub(crate) unsafe fn mem_free_async(ptr: CUdeviceptr, stream: CUstream) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    let code = unsafe { api::cuMemFreeAsync(ptr, stream) };
    check(code, Ctx::op("cuMemFreeAsync"))
}
