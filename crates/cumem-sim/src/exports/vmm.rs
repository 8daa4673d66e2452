//! Virtual memory management: reservations, physical allocations, mappings and access (the
//! rules live in `crate::vmm`). On a device configured with `vmm=0` every call that names it
//! answers `NOT_SUPPORTED`.

use std::ffi::{c_uint, c_ulonglong, c_void};

use cudarc::driver::sys::{
    CUdeviceptr, CUmemAccessDesc, CUmemAllocationProp, CUmemGenericAllocationHandle, CUmemLocation, CUresult,
};

use crate::abi::{AccessDesc, AllocationProp, MemLocation};
use crate::api::{self, Init};
use crate::vmm;

/// Reads a `CUmemAllocationProp` as raw integers, or `INVALID_VALUE` for NULL.
///
/// # Safety
/// 1. `prop` is NULL or valid for reading a `CUmemAllocationProp`.
unsafe fn read_prop(prop: *const CUmemAllocationProp) -> Result<AllocationProp, api::Fail> {
    api::non_null(prop, "prop")?;
    // SAFETY: non-NULL and valid per this function's contract; same size and layout (abi.rs).
    Ok(unsafe { prop.cast::<AllocationProp>().read() })
}

/// `CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
/// CUmemAllocationGranularity_flags option)`: 2 MiB for MINIMUM (0) and RECOMMENDED (1), as
/// observed on an H100. `prop` must be PINNED on an existing device (`INVALID_DEVICE` otherwise
/// for the ordinal, `INVALID_VALUE` for the rest); another option is `INVALID_VALUE`.
///
/// # Safety
/// 1. `granularity` is NULL or valid for writing a `size_t`; `prop` is NULL or valid for reading.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    option: c_uint,
) -> CUresult {
    api::call("cuMemGetAllocationGranularity", Init::Required, || {
        api::non_null(granularity, "granularity")?;
        // SAFETY: forwarded caller contract.
        let prop = unsafe { read_prop(prop) }?;
        let g = vmm::granularity(&prop, option)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(granularity, g as usize, "granularity") }
    })
}

/// `CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr
/// addr, unsigned long long flags)`: device address space only, aligned to the granularity (or
/// the larger power-of-two `alignment`). `size` must be a non-zero multiple of the granularity,
/// `alignment` 0 or a power of two, `flags` 0 (`INVALID_VALUE`). `addr` is a hint, honoured when
/// it is aligned and free.
///
/// # Safety
/// 1. `ptr` is NULL or valid for writing a `CUdeviceptr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    addr: CUdeviceptr,
    flags: c_ulonglong,
) -> CUresult {
    api::call("cuMemAddressReserve", Init::Required, || {
        api::non_null(ptr, "ptr")?;
        let base = vmm::address_reserve(size, alignment, addr, flags)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(ptr, base, "ptr") }
    })
}

/// `CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)`: `ptr` and `size` must be exactly a
/// live reservation without mappings; otherwise `INVALID_VALUE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    api::call("cuMemAddressFree", Init::Required, || vmm::address_free(ptr, size))
}

/// `CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const
/// CUmemAllocationProp *prop, unsigned long long flags)`: physical memory, charged to the device
/// at once. `size` a non-zero multiple of the granularity and `flags` 0 (`INVALID_VALUE`);
/// Win32 handle types `INVALID_VALUE`; POSIX-fd and fabric handle types `NOT_SUPPORTED` while the
/// device's attributes for them are 0; over capacity `OUT_OF_MEMORY`.
///
/// # Safety
/// 1. `handle` is NULL or valid for writing; `prop` is NULL or valid for reading.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: c_ulonglong,
) -> CUresult {
    api::call("cuMemCreate", Init::Required, || {
        api::non_null(handle, "handle")?;
        // SAFETY: forwarded caller contract.
        let prop = unsafe { read_prop(prop) }?;
        let h = vmm::create(size, &prop, flags)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(handle, h, "handle") }
    })
}

/// `CUresult cuMemRelease(CUmemGenericAllocationHandle handle)`: drops one reference; the memory
/// goes once no reference and no mapping remains. A handle with no reference left is
/// `INVALID_VALUE` (observed for a second release).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    api::call("cuMemRelease", Init::Required, || vmm::release(handle))
}

/// `CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle
/// handle, unsigned long long flags)`: maps a whole allocation onto unmapped space of one
/// reservation, with no access until `cuMemSetAccess`. A released handle, flags and size 0 are
/// `INVALID_VALUE`; then anything but the whole allocation at offset 0 is `NOT_SUPPORTED` (as
/// observed, also where the map is misaligned, overlaps or leaves the reservation); then an
/// unaligned address, a range outside one reservation or over a mapping is `INVALID_VALUE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: c_ulonglong,
) -> CUresult {
    api::call("cuMemMap", Init::Required, || vmm::map(ptr, size, offset, handle, flags))
}

/// `CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)`: the range must be made of whole
/// mappings (`INVALID_VALUE` otherwise). Waits for no queued work (reported instead, and moving no
/// bytes when it runs) and holds no device; only for the engine's batch in progress over the
/// range, if any (`crate::vmm::pending`).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    api::call("cuMemUnmap", Init::Required, || vmm::unmap(ptr, size))
}

/// `CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t
/// count)`: the range must be made of whole mappings; each descriptor a device location
/// (`INVALID_DEVICE` for a bad ordinal or a device without a peer link to the memory) with flags
/// 0, 1 or 3. No descriptor is `INVALID_VALUE`.
///
/// # Safety
/// 1. `desc` is NULL or valid for reading `count` `CUmemAccessDesc`s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    api::call("cuMemSetAccess", Init::Required, || {
        let descs = if count == 0 || desc.is_null() {
            Vec::new()
        } else {
            // SAFETY: non-NULL and valid for `count` descriptors (caller contract), read as raw
            // integers (same layout, abi.rs).
            unsafe { std::slice::from_raw_parts(desc.cast::<AccessDesc>(), count) }.to_vec()
        };
        vmm::set_access(ptr, size, &descs)
    })
}

/// `CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr
/// ptr)`: the access `location` has to the mapping containing `ptr` (0 before `cuMemSetAccess`,
/// as observed); an unmapped `ptr` is `INVALID_VALUE`.
///
/// # Safety
/// 1. `flags` is NULL or valid for writing; `location` is NULL or valid for reading.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAccess(
    flags: *mut c_ulonglong,
    location: *const CUmemLocation,
    ptr: CUdeviceptr,
) -> CUresult {
    api::call("cuMemGetAccess", Init::Required, || {
        api::non_null(flags, "flags")?;
        api::non_null(location, "location")?;
        // SAFETY: non-NULL and valid (caller contract); same layout (abi.rs).
        let loc = unsafe { location.cast::<MemLocation>().read() };
        let f = vmm::get_access(&loc, ptr)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(flags, f, "flags") }
    })
}

/// `CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)`: the
/// handle mapped at `addr` (any address inside the mapping), with one more reference that needs
/// its own `cuMemRelease`; an unmapped address is `INVALID_VALUE`.
///
/// # Safety
/// 1. `handle` is NULL or valid for writing.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut CUmemGenericAllocationHandle,
    addr: *mut c_void,
) -> CUresult {
    api::call("cuMemRetainAllocationHandle", Init::Required, || {
        api::non_null(handle, "handle")?;
        let h = vmm::retain(addr as u64)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(handle, h, "handle") }
    })
}

/// `CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
/// CUmemGenericAllocationHandle handle)`: the properties the handle was created with.
///
/// # Safety
/// 1. `prop` is NULL or valid for writing a `CUmemAllocationProp`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationPropertiesFromHandle(
    prop: *mut CUmemAllocationProp,
    handle: CUmemGenericAllocationHandle,
) -> CUresult {
    api::call("cuMemGetAllocationPropertiesFromHandle", Init::Required, || {
        api::non_null(prop, "prop")?;
        let p = vmm::properties(handle)?;
        // SAFETY: forwarded caller contract; same size and layout (abi.rs).
        unsafe { api::out(prop.cast::<AllocationProp>(), p, "prop") }
    })
}

/// `CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle
/// handle, CUmemAllocationHandleType handleType, unsigned long long flags)`: for POSIX_FD, writes
/// a new descriptor (an `int`) of the physical memory, which must have been created with POSIX_FD
/// among its requested handle types (`INVALID_VALUE` otherwise, as on the H100). Another process
/// that receives the descriptor imports the same bytes.
///
/// # Safety
/// 1. `shareable_handle` is NULL or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable_handle: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    handle_type: c_uint,
    flags: c_ulonglong,
) -> CUresult {
    api::call("cuMemExportToShareableHandle", Init::Required, || {
        api::non_null(shareable_handle, "shareableHandle")?;
        let fd = vmm::export_fd(handle, handle_type, flags)?;
        // SAFETY: forwarded caller contract (checked non-NULL; POSIX_FD writes an int).
        unsafe { api::out(shareable_handle.cast::<std::ffi::c_int>(), fd, "shareableHandle") }
    })
}

/// `CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
/// CUmemAllocationHandleType shHandleType)`: for POSIX_FD, `osHandle` is the descriptor itself
/// (cast to a pointer), which the caller keeps. Returns a new handle (one reference, released with
/// `cuMemRelease`), even in the exporting process. As observed: WIN32, WIN32_KMT and FABRIC →
/// `NOT_SUPPORTED`; another type but POSIX_FD → `INVALID_VALUE`; descriptor 0 → `INVALID_VALUE`
/// (a NULL `osHandle`, even where 0 is exported memory); a descriptor that is not exported memory
/// (−1, closed, a regular file, `/dev/null`, a pipe, a socket) → `UNKNOWN`.
///
/// # Safety
/// 1. `handle` is NULL or valid for writing a `CUmemGenericAllocationHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    handle_type: c_uint,
) -> CUresult {
    api::call("cuMemImportFromShareableHandle", Init::Required, || {
        api::non_null(handle, "handle")?;
        let h = vmm::import_fd(os_handle as usize as i32, handle_type)?;
        // SAFETY: forwarded caller contract (checked non-NULL).
        unsafe { api::out(handle, h, "handle") }
    })
}
