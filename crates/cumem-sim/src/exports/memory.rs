//! Allocation, free, memory info, pinned host memory and pointer queries.

use std::ffi::{c_uint, c_void};
use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CUresult};

use crate::api::{self, ApiResult, Fail, Init};
use crate::context;
use crate::copy::sync_device;
use crate::memory::{AllocKind, Allocation, Backing};
use crate::state::{SIM, State, ctx_handle};

/// `CU_MEMHOSTALLOC_DEVICEMAP`: every pinned allocation reports it (UVA).
const HOST_DEVICEMAP: u32 = 0x2;
/// All defined `cuMemHostAlloc` flags.
const HOST_ALLOC_FLAGS: u32 = 0x7;
/// `CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY`.
const ATTR_CAN_MAP_HOST_MEMORY: u32 = 19;

/// Alignment and capacity granule of a device allocation of `bytes`.
fn granule(bytes: u64) -> u64 {
    if bytes >= 2 << 20 { 2 << 20 } else { 512 }
}

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
        let st = SIM.st.lock();
        let d = context::require(&st)?;
        let dev = &st.devices[d];
        // SAFETY: forwarded caller contract (both checked non-NULL).
        unsafe {
            api::out(free, (dev.total - dev.used) as usize, "free")?;
            api::out(total, dev.total as usize, "total")
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
        let mut st = SIM.st.lock();
        let d = context::require(&st)?;
        if bytesize == 0 {
            return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, "cuMemAlloc of 0 bytes"));
        }
        let bytes = bytesize as u64;
        let g = granule(bytes);
        let charged =
            bytes.checked_next_multiple_of(g).ok_or(Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY))?;
        let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        let dev = &mut st.devices[d];
        if charged > dev.total - dev.used {
            return Err(oom());
        }
        let base = dev.va.allocate(charged, g).ok_or_else(oom)?;
        let Some(backing) = Backing::new(bytesize) else {
            dev.va.release(base);
            return Err(oom());
        };
        dev.used += charged;
        let buffer_id = st.next_buffer_id;
        st.next_buffer_id += 1;
        let alloc = Allocation {
            kind: AllocKind::Device,
            base,
            bytes,
            charged,
            device: d as i32,
            ctx: ctx_handle(d),
            buffer_id,
            host_flags: 0,
            backing,
        };
        st.allocs.insert(base, Arc::new(alloc));
        // SAFETY: forwarded caller contract.
        unsafe { api::out(dptr, base, "dptr") }
    })
}

/// Why `addr` is not the base of a live allocation of `kind`.
fn bad_free(st: &State, addr: u64, kind: AllocKind) -> Fail {
    let msg = match st.find_alloc(addr) {
        Some(a) if a.base != addr => {
            format!("{addr:#x} is an interior pointer of the allocation at {:#x}", a.base)
        }
        Some(a) if a.kind != kind => match a.kind {
            AllocKind::PinnedHost => format!("{addr:#x} is pinned host memory (free it with cuMemFreeHost)"),
            AllocKind::Device => format!("{addr:#x} is device memory (free it with cuMemFree)"),
        },
        _ => format!("{addr:#x} is not a live allocation (double free or never allocated)"),
    };
    Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, msg)
}

/// Frees the allocation at `addr` after draining `drain` devices' queued work.
fn free(addr: u64, kind: AllocKind, drain: impl Fn(&State, &Allocation) -> Vec<usize>) -> ApiResult {
    let mut st = SIM.st.lock();
    context::require(&st)?;
    let Some(a) = st.allocs.get(&addr).filter(|a| a.kind == kind).cloned() else {
        return Err(bad_free(&st, addr, kind));
    };
    for d in drain(&st, &a) {
        sync_device(&mut st, d);
    }
    // Another thread may have freed it while we waited.
    match st.allocs.get(&addr) {
        Some(now) if Arc::ptr_eq(now, &a) => {}
        _ => return Err(bad_free(&st, addr, kind)),
    }
    st.allocs.remove(&addr);
    if kind == AllocKind::Device {
        let dev = &mut st.devices[a.device as usize];
        dev.used -= a.charged;
        dev.va.release(a.base);
    }
    Ok(())
}

/// `CUresult cuMemFree(CUdeviceptr dptr)` (symbol `_v2`): waits for the owning device's queued
/// work, then frees. 0 is a no-op; unknown, interior, pinned or already freed pointers give
/// `INVALID_VALUE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    api::call("cuMemFree_v2", Init::Required, || {
        if dptr == 0 {
            return Ok(());
        }
        free(dptr, AllocKind::Device, |_, a| vec![a.device as usize])
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
        let st = SIM.st.lock();
        context::require(&st)?;
        let a = st.find_alloc(dptr).ok_or(Fail::quiet(CUresult::CUDA_ERROR_NOT_FOUND))?;
        // SAFETY: each pointer is written only if non-NULL, valid per the caller contract.
        unsafe {
            if !pbase.is_null() {
                pbase.write(a.base);
            }
            if !psize.is_null() {
                psize.write(a.bytes as usize);
            }
        }
        Ok(())
    })
}

/// # Safety
/// 1. `pp` is NULL or valid for writing a pointer.
unsafe fn host_alloc(pp: *mut *mut c_void, bytesize: usize, reported_flags: u32) -> ApiResult {
    api::non_null(pp, "pp")?;
    let mut st = SIM.st.lock();
    let d = context::require(&st)?;
    let backing = Backing::new(bytesize).ok_or(Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY))?;
    let base = backing.as_ptr() as u64;
    let buffer_id = st.next_buffer_id;
    st.next_buffer_id += 1;
    let alloc = Allocation {
        kind: AllocKind::PinnedHost,
        base,
        bytes: bytesize as u64,
        charged: 0,
        device: d as i32,
        ctx: ctx_handle(d),
        buffer_id,
        host_flags: reported_flags,
        backing,
    };
    st.allocs.insert(base, Arc::new(alloc));
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
        free(p as u64, AllocKind::PinnedHost, |st, _| (0..st.devices.len()).collect())
    })
}

/// The pinned allocation containing `p`, or `INVALID_VALUE` (a probe answer, not recorded).
fn pinned_at(st: &State, p: u64) -> Result<&Arc<Allocation>, Fail> {
    st.find_alloc(p)
        .filter(|a| a.kind == AllocKind::PinnedHost)
        .ok_or(Fail::quiet(CUresult::CUDA_ERROR_INVALID_VALUE))
}

/// `CUresult cuMemHostGetFlags(unsigned *pFlags, void *p)`: the allocation's flags (always with
/// DEVICEMAP); interior pointers work; non-pinned memory gives `INVALID_VALUE`.
///
/// # Safety
/// 1. `p_flags` is NULL or valid for writing an `unsigned`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetFlags(p_flags: *mut c_uint, p: *mut c_void) -> CUresult {
    api::call("cuMemHostGetFlags", Init::Required, || {
        api::non_null(p_flags, "pFlags")?;
        let st = SIM.st.lock();
        context::require(&st)?;
        let flags = pinned_at(&st, p as u64)?.host_flags;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(p_flags, flags, "pFlags") }
    })
}

/// `CUresult cuMemHostGetDevicePointer(CUdeviceptr *pdptr, void *p, unsigned Flags)` (symbol
/// `_v2`): for pinned memory the device address equals the host address. `Flags` must be 0;
/// a device without CAN_MAP_HOST_MEMORY gives `NOT_SUPPORTED`.
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
        let st = SIM.st.lock();
        let d = context::require(&st)?;
        if flags != 0 {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("Flags {flags:#x} must be 0"),
            ));
        }
        if st.devices[d].attr(ATTR_CAN_MAP_HOST_MEMORY) == Some(0) {
            return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED));
        }
        if st.find_alloc(p as u64).is_none_or(|a| a.kind != AllocKind::PinnedHost) {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("{:#x} is not pinned host memory", p as u64),
            ));
        }
        // SAFETY: forwarded caller contract.
        unsafe { api::out(pdptr, p as u64, "pdptr") }
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
        let st = SIM.st.lock();
        if attribute == 3 {
            context::require(&st)?;
        }
        let a = st.find_alloc(ptr).ok_or(Fail::quiet(CUresult::CUDA_ERROR_INVALID_VALUE))?;
        let device = a.kind == AllocKind::Device;
        enum V {
            U32(u32),
            U64(u64),
        }
        let v = match attribute {
            1 => V::U64(a.ctx),
            2 => V::U32(if device { 2 } else { 1 }),
            3 => V::U64(ptr),
            4 if device => return Err(Fail::quiet(CUresult::CUDA_ERROR_INVALID_VALUE)),
            4 => V::U64(ptr),
            6 | 8 | 14 | 21 => V::U32(0),
            7 | 20 => V::U64(a.buffer_id),
            9 => V::U32(a.device as u32),
            10 | 15 => V::U32(u32::from(device)),
            11 | 19 => V::U64(a.base),
            12 | 18 => V::U64(a.bytes),
            13 => V::U32(1),
            16 => V::U32(3),
            _ => V::U64(0), // 17: MEMPOOL_HANDLE, NULL outside pools.
        };
        // SAFETY: non-NULL; the caller provides room for this attribute's documented size, which
        // is exactly what is written.
        unsafe {
            match v {
                V::U32(x) => data.cast::<u32>().write_unaligned(x),
                V::U64(x) => data.cast::<u64>().write_unaligned(x),
            }
        }
        Ok(())
    })
}
