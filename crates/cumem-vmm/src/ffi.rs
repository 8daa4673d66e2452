//! Every driver call cumem-vmm makes, each a thin checked wrapper around one `unsafe` FFI call.
//!
//! A driver without one of the VMM entry points gives `NotSupported { feature: Symbol(name) }`
//! (`cumem_sys::api` answers a missing symbol, which `check` maps; nothing is probed per call).
//! Callers validate their arguments first and bind the right context.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cumem_sys::sys::{
    self, CUdevice, CUdeviceptr, CUmemAccess_flags, CUmemAccessDesc, CUmemAllocationGranularity_flags,
    CUmemAllocationHandleType, CUmemAllocationProp, CUmemAllocationType, CUmemGenericAllocationHandle,
    CUmemLocation, CUmemLocationType, CUstream,
};
use cumem_sys::{Error, ErrorContext as Ctx, Result, api, check};

fn location(device: CUdevice) -> CUmemLocation {
    CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device }
}

/// Pinned device memory on `device` that may be exported as `handle_types`.
fn props(device: CUdevice, handle_types: u32) -> CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is plain old data (integers and a null pointer); all-zero is its
    // documented "unset" state.
    let mut prop: CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CUmemAllocationHandleType(handle_types);
    prop.location = location(device);
    prop
}

pub(crate) fn allocation_granularity(
    device: CUdevice,
    handle_types: u32,
    recommended: bool,
) -> Result<usize> {
    let prop = props(device, handle_types);
    let option = if recommended {
        CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    } else {
        CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
    };
    let mut granularity = 0usize;
    // SAFETY: `granularity` is a valid out-pointer; `prop` is fully initialised and outlives the call.
    let code = unsafe { api::cuMemGetAllocationGranularity(&mut granularity, &prop, option) };
    check(code, Ctx::op("cuMemGetAllocationGranularity").device(device))?;
    Ok(granularity)
}

/// Reserves `size` bytes of device address space; `addr` is a hint (0 for none).
pub(crate) fn address_reserve(size: usize, alignment: usize, addr: CUdeviceptr) -> Result<CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: `ptr` is a valid out-pointer; the driver only reserves address space.
    let code = unsafe { api::cuMemAddressReserve(&mut ptr, size, alignment, addr, 0) };
    check(code, Ctx::op("cuMemAddressReserve").bytes(size))?;
    Ok(ptr)
}

/// # Safety
/// 1. `[ptr, ptr + size)` is exactly one reservation made by `address_reserve`, freed once.
/// 2. Nothing is mapped in it any more.
pub(crate) unsafe fn address_free(ptr: CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemAddressFree(ptr, size) }, Ctx::op("cuMemAddressFree").bytes(size))
}

pub(crate) fn create(
    size: usize,
    device: CUdevice,
    handle_types: u32,
) -> Result<CUmemGenericAllocationHandle> {
    let prop = props(device, handle_types);
    let mut handle = 0;
    // SAFETY: `handle` is a valid out-pointer; `prop` is fully initialised and outlives the call.
    let code = unsafe { api::cuMemCreate(&mut handle, size, &prop, 0) };
    check(code, Ctx::op("cuMemCreate").bytes(size).device(device))?;
    Ok(handle)
}

/// # Safety
/// 1. `handle` came from `create` or `import_fd` and this drops the one reference it gave; it is
///    not used again.
pub(crate) unsafe fn release(handle: CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemRelease(handle) }, Ctx::op("cuMemRelease"))
}

/// A new POSIX file descriptor of the memory of `handle` (`cuMemExportToShareableHandle`); the
/// caller owns it. The memory must have been created with POSIX_FD among its handle types.
pub(crate) fn export_fd(handle: CUmemGenericAllocationHandle) -> Result<OwnedFd> {
    let mut fd: c_int = -1;
    // SAFETY: for POSIX_FD the driver writes one `int` through the pointer, and `fd` is one; the
    // handle is only read.
    let code = unsafe {
        api::cuMemExportToShareableHandle(
            (&raw mut fd).cast(),
            handle,
            CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    check(code, Ctx::op("cuMemExportToShareableHandle"))?;
    if fd < 0 {
        // A driver that reported success without a descriptor: nothing to own or close.
        return Err(Error::InvalidHandle { ctx: Ctx::op("cuMemExportToShareableHandle (no descriptor)") });
    }
    // SAFETY: the driver just created `fd` for the caller, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A new handle (one reference, released with `release`) of the memory exported as `fd`
/// (`cuMemImportFromShareableHandle`); `fd` stays the caller's. The driver's codes pass through
/// unchanged (`PhysicalMemory::import_fd` says what its `CUDA_ERROR_UNKNOWN` most likely means).
pub(crate) fn import_fd(fd: BorrowedFd<'_>) -> Result<CUmemGenericAllocationHandle> {
    let mut handle = 0;
    // SAFETY: `handle` is a valid out-pointer; for POSIX_FD the driver takes the descriptor by
    // value, cast to a pointer (reference §9), and does not take ownership of it; it is open for
    // the whole call (borrowed).
    let code = unsafe {
        api::cuMemImportFromShareableHandle(
            &mut handle,
            fd.as_raw_fd() as isize as *mut c_void,
            CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    };
    check(code, Ctx::op("cuMemImportFromShareableHandle"))?;
    Ok(handle)
}

/// The device and the handle-type bits `handle` was created with
/// (`cuMemGetAllocationPropertiesFromHandle`).
pub(crate) fn properties(handle: CUmemGenericAllocationHandle) -> Result<(CUdevice, u32)> {
    // The driver writes enum fields, which a newer driver (or the exporting process's) may set to a
    // value the 12.8 enums lack: the struct stays `MaybeUninit` and those fields are read as the
    // integers they are in C, never as the enums.
    let mut prop = std::mem::MaybeUninit::new(props(0, 0));
    // SAFETY: `prop` is a valid out-pointer of the right type (initialised, though the driver
    // overwrites it).
    let code = unsafe { api::cuMemGetAllocationPropertiesFromHandle(prop.as_mut_ptr(), handle) };
    check(code, Ctx::op("cuMemGetAllocationPropertiesFromHandle"))?;
    let p = prop.as_ptr();
    // SAFETY: `p` points to the struct the driver wrote; each field is read through a raw pointer
    // with its C type (`CUmemLocationType` is a C enum, an `unsigned int`; `id` an `int`;
    // `requestedHandleTypes` a bitfield of `unsigned int`), so no enum value is ever produced.
    let (location_type, id, handle_types) = unsafe {
        (
            (&raw const (*p).location.type_).cast::<u32>().read(),
            (&raw const (*p).location.id).read(),
            (&raw const (*p).requestedHandleTypes).cast::<u32>().read(),
        )
    };
    if location_type != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32 {
        // Host (NUMA) memory is not what cumem maps as device memory.
        return Err(Error::InvalidDevice {
            ctx: Ctx::op("cuMemGetAllocationPropertiesFromHandle (memory not on a device)"),
        });
    }
    Ok((id, handle_types))
}

/// # Safety
/// 1. `[ptr, ptr + size)` lies inside one live reservation and nothing is mapped there.
/// 2. `handle` is a live allocation. It should hold exactly `size` bytes; for an import, whose
///    size the importer states, the driver refuses any other `size` (it maps only a whole
///    allocation at offset 0: `NOT_SUPPORTED`, observed on an H100, 2026-11-23), so a wrong size
///    is an error, not a mapping past the memory.
pub(crate) unsafe fn map(ptr: CUdeviceptr, size: usize, handle: CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemMap(ptr, size, 0, handle, 0) }, Ctx::op("cuMemMap").bytes(size))
}

/// # Safety
/// 1. `[ptr, ptr + size)` is exactly one whole mapping made by `map`, unmapped once.
/// 2. No device work that uses it is pending, and no view of it is alive.
pub(crate) unsafe fn unmap(ptr: CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemUnmap(ptr, size) }, Ctx::op("cuMemUnmap").bytes(size))
}

/// Sets the access of each `(device, flags)` pair on the wholly mapped `[ptr, ptr + size)`.
pub(crate) fn set_access(
    ptr: CUdeviceptr,
    size: usize,
    access: &[(CUdevice, CUmemAccess_flags)],
) -> Result<()> {
    let descs: Vec<CUmemAccessDesc> =
        access.iter().map(|&(device, flags)| CUmemAccessDesc { location: location(device), flags }).collect();
    // SAFETY: `descs` holds `descs.len()` initialised descriptors and outlives the call; changing
    // access to mapped memory touches no Rust-visible memory.
    let code = unsafe { api::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len()) };
    check(code, Ctx::op("cuMemSetAccess").bytes(size))
}

/// The access flags `device` has on the mapping that contains `ptr`.
pub(crate) fn get_access(ptr: CUdeviceptr, device: CUdevice) -> Result<u64> {
    let loc = location(device);
    let mut flags = 0u64;
    // SAFETY: `flags` is a valid out-pointer; `loc` is initialised and outlives the call.
    let code = unsafe { api::cuMemGetAccess(&mut flags, &loc, ptr) };
    check(code, Ctx::op("cuMemGetAccess").device(device))?;
    Ok(flags)
}

/// Whether `device` supports exporting memory as the one handle type `bit` (its
/// `HANDLE_TYPE_*_SUPPORTED` attribute), and the type's name; `None` for a bit with no attribute.
pub(crate) fn handle_type_supported(device: CUdevice, bit: u32) -> Option<Result<(bool, &'static str)>> {
    use sys::CUdevice_attribute as A;
    let (attr, name) = match bit {
        0x1 => (
            A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            "POSIX file descriptor handles",
        ),
        0x2 => (A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_WIN32_HANDLE_SUPPORTED, "Win32 handles"),
        0x4 => (A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_WIN32_KMT_HANDLE_SUPPORTED, "Win32 KMT handles"),
        0x8 => (A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, "fabric handles"),
        _ => return None,
    };
    let mut value = 0;
    // SAFETY: `value` is a valid out-pointer.
    let code = unsafe { api::cuDeviceGetAttribute(&mut value, attr, device) };
    Some(check(code, Ctx::op("cuDeviceGetAttribute").device(device)).map(|()| (value != 0, name)))
}

/// A memset value of one of the widths the driver fills with.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Fill {
    W8(u8),
    W16(u16),
    W32(u32),
}

/// Queues setting `n` values of the fill's width at `dst` on `stream`.
///
/// # Safety
/// 1. `[dst, dst + n * width)` is device memory that nothing else uses until the work completes
///    (ordered on `stream`), and the bytes written are valid for the values stored there.
pub(crate) unsafe fn memset_async(dst: CUdeviceptr, value: Fill, n: usize, stream: CUstream) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    unsafe {
        match value {
            Fill::W8(v) => {
                check(api::cuMemsetD8Async(dst, v, n, stream), Ctx::op("cuMemsetD8Async").bytes(n))
            }
            Fill::W16(v) => {
                check(api::cuMemsetD16Async(dst, v, n, stream), Ctx::op("cuMemsetD16Async").bytes(n * 2))
            }
            Fill::W32(v) => {
                check(api::cuMemsetD32Async(dst, v, n, stream), Ctx::op("cuMemsetD32Async").bytes(n * 4))
            }
        }
    }
}

/// Copies `bytes` host bytes into device memory, returning when the source may be reused.
///
/// # Safety
/// 1. `src` is valid for reads of `bytes` initialised bytes.
/// 2. `[dst, dst + bytes)` is device memory ordered on the legacy stream, used by nothing else.
pub(crate) unsafe fn htod(dst: CUdeviceptr, src: *const c_void, bytes: usize) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemcpyHtoD_v2(dst, src, bytes) }, Ctx::op("cuMemcpyHtoD_v2").bytes(bytes))
}

/// Queues a copy of page-locked host memory into device memory on `stream`.
///
/// # Safety
/// 1. `src` is page-locked memory of `bytes` initialised bytes that stays valid and unwritten until
///    the copy completes.
/// 2. `[dst, dst + bytes)` is device memory ordered on `stream`, used by nothing else meanwhile.
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

/// Queues a copy of `bytes` bytes from device memory to device memory on `stream`.
///
/// # Safety
/// 1. `[src, src + bytes)` and `[dst, dst + bytes)` are device memory that do not overlap, both
///    ordered on `stream`: the source's bytes are written before the copy, and nothing else uses
///    the destination until it completes.
/// 2. The bytes copied are valid for the values stored at the destination.
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
