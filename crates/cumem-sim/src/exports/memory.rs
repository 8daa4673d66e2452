//! Allocation, free, memory info, pinned host memory and pointer queries.

use std::ffi::{c_uint, c_void};

use cudarc::driver::sys::{CUdeviceptr, CUresult};

use crate::alloc::{self, HOST_DEVICEMAP};
use crate::api::{self, ApiResult, Fail, Init};
use crate::pointer::{self, AttrValue};

/// All defined `cuMemHostAlloc` flags.
const HOST_ALLOC_FLAGS: u32 = 0x7;

/// `CUresult cuMemGetInfo(size_t *free, size_t *total)` (symbol `_v2`): `total` is the device's
/// capacity, `free` the capacity minus every live allocation's charged size.
///
/// # Safety
/// 1. `free` and `total` are NULL or valid for writing a `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    api::call("cuMemGetInfo_v2", Init::Required, || {
        api::non_null(free, "free")?;
        api::non_null(total, "total")?;
        let (free_bytes, total_bytes) = alloc::mem_info()?;
        // SAFETY: forwarded caller contract (both checked non-NULL).
        unsafe {
            api::out(free, free_bytes as usize, "free")?;
            api::out(total, total_bytes as usize, "total")
        }
    })
}

/// `CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytesize)` (symbol `_v2`): device memory in
/// the simulator's reserved address space, 512-byte aligned (2 MiB from 2 MiB up), not cleared.
/// Size 0 gives `INVALID_VALUE`; exceeding capacity gives `OUT_OF_MEMORY`.
///
/// # Safety
/// 1. `dptr` is NULL or valid for writing a `CUdeviceptr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    api::call("cuMemAlloc_v2", Init::Required, || {
        api::non_null(dptr, "dptr")?;
        let base = alloc::device(bytesize)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(dptr, base, "dptr") }
    })
}

/// `CUresult cuMemAllocPitch(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t
/// Height, unsigned ElementSizeBytes)` (symbol `_v2`): `Height` rows of `WidthInBytes`, each row
/// starting at a multiple of the returned pitch (the width rounded up to 512 bytes). The
/// element size must be 4, 8 or 16; a zero width or height, or a width above MAX_PITCH, gives
/// `INVALID_VALUE`. The allocation is `pitch * Height` bytes (kind `pitched`).
///
/// # Safety
/// 1. `dptr` and `p_pitch` are NULL or valid for writing.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    p_pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: c_uint,
) -> CUresult {
    api::call("cuMemAllocPitch_v2", Init::Required, || {
        api::non_null(dptr, "dptr")?;
        api::non_null(p_pitch, "pPitch")?;
        let (base, pitch) = alloc::pitched(width, height, element_size)?;
        // SAFETY: forwarded caller contract (both checked non-NULL).
        unsafe {
            api::out(p_pitch, pitch, "pPitch")?;
            api::out(dptr, base, "dptr")
        }
    })
}

/// `CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned flags)`: unified
/// memory: real host memory whose device address equals its host address (the host may read and
/// write it directly, except while queued work uses it on a device without concurrent managed
/// access: see `crate::managed`), page aligned, not charged to the device's capacity. `flags` must be
/// exactly `CU_MEM_ATTACH_GLOBAL` or `CU_MEM_ATTACH_HOST`; size 0 gives `INVALID_VALUE`; a device
/// without MANAGED_MEMORY gives `NOT_SUPPORTED`. Free with `cuMemFree`.
///
/// # Safety
/// 1. `dptr` is NULL or valid for writing a `CUdeviceptr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    api::call("cuMemAllocManaged", Init::Required, || {
        api::non_null(dptr, "dptr")?;
        let base = alloc::managed(bytesize, flags)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(dptr, base, "dptr") }
    })
}

/// `CUresult cuMemFree(CUdeviceptr dptr)` (symbol `_v2`): frees `cuMemAlloc`, `cuMemAllocPitch`,
/// `cuMemAllocManaged` and pool memory. Pool memory goes back to its pool at once without
/// synchronising (the driver documents no implicit synchronisation for it); device memory waits
/// for the owning device's queued work first, managed memory for every device's. 0 is a no-op; unknown, interior, pinned,
/// registered or already freed pointers give `INVALID_VALUE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    api::call("cuMemFree_v2", Init::Required, || {
        if dptr == 0 {
            return Ok(());
        }
        alloc::free(dptr, false)
    })
}

/// `CUresult cuMemGetAddressRange(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)` (symbol
/// `_v2`): the allocation containing `dptr`; `NOT_FOUND` for any other address. Both
/// out-pointers are optional.
///
/// # Safety
/// 1. `pbase` and `psize` are NULL or valid for writing.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    pbase: *mut CUdeviceptr,
    psize: *mut usize,
    dptr: CUdeviceptr,
) -> CUresult {
    api::call("cuMemGetAddressRange_v2", Init::Required, || {
        let (base, bytes) = pointer::address_range(dptr)?;
        // SAFETY: each pointer is written only if non-NULL, valid per the caller contract.
        unsafe {
            if !pbase.is_null() {
                pbase.write(base);
            }
            if !psize.is_null() {
                psize.write(bytes as usize);
            }
        }
        Ok(())
    })
}

/// # Safety
/// 1. `pp` is NULL or valid for writing a pointer.
unsafe fn host_alloc(pp: *mut *mut c_void, bytesize: usize, reported_flags: u32) -> ApiResult {
    api::non_null(pp, "pp")?;
    let base = alloc::pinned(bytesize, reported_flags)?;
    // SAFETY: forwarded caller contract.
    unsafe { api::out(pp, base as *mut c_void, "pp") }
}

/// `CUresult cuMemAllocHost(void **pp, size_t bytesize)` (symbol `_v2`): page-locked host
/// memory whose device address equals its host address. Size 0 succeeds (a tracked, empty
/// allocation that must be freed).
///
/// # Safety
/// 1. `pp` is NULL or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemAllocHost_v2", Init::Required, || unsafe { host_alloc(pp, bytesize, HOST_DEVICEMAP) })
}

/// `CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned Flags)`: as `cuMemAllocHost`;
/// `Flags` may combine PORTABLE (1), DEVICEMAP (2), WRITECOMBINED (4); other bits give
/// `INVALID_VALUE`.
///
/// # Safety
/// 1. `pp` is NULL or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, bytesize: usize, flags: c_uint) -> CUresult {
    api::call("cuMemHostAlloc", Init::Required, || {
        if flags & !HOST_ALLOC_FLAGS != 0 {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("unknown cuMemHostAlloc flags {flags:#x}"),
            ));
        }
        // SAFETY: forwarded caller contract.
        unsafe { host_alloc(pp, bytesize, flags | HOST_DEVICEMAP) }
    })
}

/// `CUresult cuMemFreeHost(void *p)`: waits for all queued work, then frees pinned memory. NULL
/// is a no-op; anything but the base of a live pinned allocation gives `INVALID_VALUE`.
///
/// # Safety
/// 1. No further requirement: `p` is only compared, never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    api::call("cuMemFreeHost", Init::Required, || {
        if p.is_null() {
            return Ok(());
        }
        alloc::free(p as u64, true)
    })
}

/// `CUresult cuMemHostGetFlags(unsigned *pFlags, void *p)`: pinned memory reports its allocation
/// flags (always with DEVICEMAP); registered memory DEVICEMAP plus PORTABLE if given; managed
/// memory DEVICEMAP. Interior pointers work; other memory gives `INVALID_VALUE`.
///
/// # Safety
/// 1. `p_flags` is NULL or valid for writing an `unsigned`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetFlags(p_flags: *mut c_uint, p: *mut c_void) -> CUresult {
    api::call("cuMemHostGetFlags", Init::Required, || {
        api::non_null(p_flags, "pFlags")?;
        let flags = pointer::host_flags(p as u64)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(p_flags, flags, "pFlags") }
    })
}

/// `CUresult cuMemHostGetDevicePointer(CUdeviceptr *pdptr, void *p, unsigned Flags)` (symbol
/// `_v2`): for pinned and registered memory the device address equals the host address
/// (interior pointers translate with the same offset). `Flags` must be 0; a current device
/// without CAN_MAP_HOST_MEMORY gives `NOT_SUPPORTED`; other memory gives `INVALID_VALUE`.
///
/// # Safety
/// 1. `pdptr` is NULL or valid for writing a `CUdeviceptr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    pdptr: *mut CUdeviceptr,
    p: *mut c_void,
    flags: c_uint,
) -> CUresult {
    api::call("cuMemHostGetDevicePointer_v2", Init::Required, || {
        api::non_null(pdptr, "pdptr")?;
        pointer::host_device_pointer(p as u64, flags)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(pdptr, p as u64, "pdptr") }
    })
}

/// `CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned Flags)` (symbol `_v2`):
/// page-locks the program's range `[p, p + bytesize)` for the current context. Copies to and from
/// it then follow the pinned-memory rules (stream order); its device address equals `p`. Flags:
/// PORTABLE 1, DEVICEMAP 2, IOMEMORY 4, READ_ONLY 8 (needs READ_ONLY_HOST_REGISTER_SUPPORTED,
/// else `NOT_SUPPORTED`); other bits, NULL, size 0, IOMEMORY (ordinary memory is not I/O
/// memory), or a range overlapping memory CUDA allocated give `INVALID_VALUE`; overlapping an
/// existing registration gives `HOST_MEMORY_ALREADY_REGISTERED`. A device without
/// HOST_REGISTER_SUPPORTED gives `NOT_SUPPORTED`. No alignment is required.
///
/// # Safety
/// 1. `[p, p + bytesize)` is memory of the program that stays valid until it is unregistered.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostRegister_v2(p: *mut c_void, bytesize: usize, flags: c_uint) -> CUresult {
    api::call("cuMemHostRegister_v2", Init::Required, || alloc::register(p as u64, bytesize, flags))
}

/// `CUresult cuMemHostUnregister(void *p)`: `p` must be the exact address a registration
/// started at. Waits for all queued work (which may still use the memory), then unregisters.
/// NULL, interior pointers and CUDA-allocated memory give `INVALID_VALUE`; memory that is not
/// registered (never, or no longer) gives `HOST_MEMORY_NOT_REGISTERED`.
///
/// # Safety
/// 1. No further requirement: `p` is only compared, never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    api::call("cuMemHostUnregister", Init::Required, || alloc::unregister(p as u64))
}

/// Writes `v` through `data`.
///
/// # Safety
/// 1. `data` is non-NULL and valid for writing the attribute's documented size.
unsafe fn write_attr(data: *mut c_void, v: AttrValue) {
    // SAFETY: per this function's contract.
    unsafe {
        match v {
            AttrValue::U32(x) => data.cast::<u32>().write_unaligned(x),
            AttrValue::U64(x) => data.cast::<u64>().write_unaligned(x),
            AttrValue::Untouched => {}
        }
    }
}

/// `CUresult cuPointerGetAttributes(unsigned numAttributes, CUpointer_attribute *attributes,
/// void **data, CUdeviceptr ptr)`: the batch form. Unknown pointers succeed with the driver's
/// defaults (DEVICE_POINTER and HOST_POINTER echo `ptr`, MEMORY_TYPE 0, DEVICE_ORDINAL -1,
/// CONTEXT NULL, RANGE_START_ADDR/RANGE_SIZE untouched, everything else 0); HOST_POINTER of
/// device-only memory is NULL. NULL arrays (with `numAttributes > 0`), a NULL `data[i]`, unknown
/// attribute numbers and P2P_TOKENS give `INVALID_VALUE`, checked before anything is written.
///
/// # Safety
/// 1. `attributes` and `data` are NULL or valid for reading `num` entries; each `data[i]` is NULL
///    or valid for writing the size of `attributes[i]`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttributes(
    num: c_uint,
    attributes: *const u32,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> CUresult {
    api::call("cuPointerGetAttributes", Init::Required, || {
        if num == 0 {
            return Ok(());
        }
        api::non_null(attributes, "attributes")?;
        api::non_null(data, "data")?;
        // SAFETY: non-NULL and valid for `num` entries (caller contract).
        let (attrs, outs) = unsafe {
            (
                std::slice::from_raw_parts(attributes, num as usize),
                std::slice::from_raw_parts(data, num as usize),
            )
        };
        if let Some(i) = outs.iter().position(|o| o.is_null()) {
            return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("data[{i}] is NULL")));
        }
        let values = pointer::attributes(attrs, ptr)?;
        for (v, &out) in values.into_iter().zip(outs) {
            // SAFETY: non-NULL (checked) and valid for the attribute's size (caller contract).
            unsafe { write_attr(out, v) };
        }
        Ok(())
    })
}

/// `CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)`.
/// Writes exactly the driver's size for each attribute; unknown pointers and unknown or
/// unsupported attributes (P2P_TOKENS) give `INVALID_VALUE`; HOST_POINTER of device memory gives
/// `INVALID_VALUE`; DEVICE_POINTER needs a current context.
///
/// # Safety
/// 1. `data` is NULL or valid for writing the attribute's value (4 or 8 bytes, per the driver).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: u32,
    ptr: CUdeviceptr,
) -> CUresult {
    api::call("cuPointerGetAttribute", Init::Required, || {
        api::non_null(data, "data")?;
        if !(1..=21).contains(&attribute) || attribute == 5 {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("unsupported pointer attribute {attribute}"),
            ));
        }
        let v = pointer::attribute(attribute, ptr)?;
        // SAFETY: non-NULL; the caller provides room for this attribute's documented size, which
        // is exactly what is written.
        unsafe { write_attr(data, v) };
        Ok(())
    })
}
