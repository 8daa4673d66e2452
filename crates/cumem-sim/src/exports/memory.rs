//! Allocation, free, memory info, pinned host memory and pointer queries.

use std::ffi::{c_uint, c_void};
use std::sync::{Arc, OnceLock};

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
/// `CU_DEVICE_ATTRIBUTE_MAX_PITCH`.
const ATTR_MAX_PITCH: u32 = 11;
/// `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED`.
const ATTR_HOST_REGISTER_SUPPORTED: u32 = 99;
/// `CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED`.
const ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED: u32 = 113;
/// All defined `CU_MEMHOSTREGISTER_*` flags.
const REGISTER_FLAGS: u32 = 0xF;
/// `CU_MEMHOSTREGISTER_IOMEMORY`.
const REGISTER_IOMEMORY: u32 = 0x4;
/// `CU_MEMHOSTREGISTER_READ_ONLY`.
pub(crate) const REGISTER_READ_ONLY: u32 = 0x8;

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

/// Reserves `bytes` (> 0) of device memory on device `d` for the current context.
fn device_alloc(st: &mut State, d: usize, bytes: u64, kind: AllocKind) -> Result<u64, Fail> {
    let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let g = granule(bytes);
    let charged = bytes.checked_next_multiple_of(g).ok_or_else(oom)?;
    let dev = &mut st.devices[d];
    if charged > dev.total - dev.used {
        return Err(oom());
    }
    let base = dev.va.allocate(charged, g).ok_or_else(oom)?;
    let Some(backing) = usize::try_from(bytes).ok().and_then(Backing::new) else {
        dev.va.release(base);
        return Err(oom());
    };
    dev.used += charged;
    let buffer_id = st.next_buffer_id;
    st.next_buffer_id += 1;
    let alloc = Allocation {
        kind,
        base,
        bytes,
        charged,
        device: d as i32,
        ctx: ctx_handle(d),
        buffer_id,
        host_flags: 0,
        pool: 0,
        backing,
        freed: OnceLock::new(),
    };
    st.allocs.insert(base, Arc::new(alloc));
    Ok(base)
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
        let base = device_alloc(&mut st, d, bytesize as u64, AllocKind::Device)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(dptr, base, "dptr") }
    })
}

/// Row alignment of pitched allocations.
const PITCH_ALIGN: u64 = 512;

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
        let mut st = SIM.st.lock();
        let d = context::require(&st)?;
        let bad = |m: String| Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, m));
        if !matches!(element_size, 4 | 8 | 16) {
            return bad(format!("ElementSizeBytes {element_size} must be 4, 8 or 16"));
        }
        if width == 0 || height == 0 {
            return bad(format!("cuMemAllocPitch of {width} x {height} bytes"));
        }
        let max_pitch = st.devices[d].attr(ATTR_MAX_PITCH).unwrap_or(i32::MAX) as u64;
        if width as u64 > max_pitch {
            return bad(format!("WidthInBytes {width} exceeds MAX_PITCH {max_pitch}"));
        }
        let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        let pitch = (width as u64).next_multiple_of(PITCH_ALIGN);
        let bytes = pitch.checked_mul(height as u64).ok_or_else(oom)?;
        let base = device_alloc(&mut st, d, bytes, AllocKind::Pitched)?;
        // SAFETY: forwarded caller contract (both checked non-NULL).
        unsafe {
            api::out(p_pitch, pitch as usize, "pPitch")?;
            api::out(dptr, base, "dptr")
        }
    })
}

/// `CU_MEM_ATTACH_GLOBAL`.
pub(crate) const ATTACH_GLOBAL: u32 = 1;
/// `CU_MEM_ATTACH_HOST`.
pub(crate) const ATTACH_HOST: u32 = 2;
/// `CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY`.
const ATTR_MANAGED_MEMORY: u32 = 83;

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
        let mut st = SIM.st.lock();
        let d = context::require(&st)?;
        if st.devices[d].attr(ATTR_MANAGED_MEMORY) != Some(1) {
            return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED));
        }
        if flags != ATTACH_GLOBAL && flags != ATTACH_HOST {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!(
                    "cuMemAllocManaged flags {flags:#x} must be CU_MEM_ATTACH_GLOBAL or CU_MEM_ATTACH_HOST"
                ),
            ));
        }
        if bytesize == 0 {
            return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, "cuMemAllocManaged of 0 bytes"));
        }
        // The engine moves bytes through `backing`; the program gets the host view's address,
        // which is protected while device work uses the memory (see `crate::managed`).
        let (backing, view) =
            Backing::shared_pair(bytesize).ok_or(Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY))?;
        let host = crate::managed::HostView::new(view);
        let base = host.addr();
        let buffer_id = st.next_buffer_id;
        st.next_buffer_id += 1;
        let alloc = Allocation {
            kind: AllocKind::Managed,
            base,
            bytes: bytesize as u64,
            charged: 0,
            device: d as i32,
            ctx: ctx_handle(d),
            buffer_id,
            host_flags: flags,
            pool: 0,
            backing,
            freed: OnceLock::new(),
        };
        st.allocs.insert(base, Arc::new(alloc));
        st.managed.insert(base, crate::managed::Managed::new(flags, bytesize as u64, host));
        // SAFETY: forwarded caller contract.
        unsafe { api::out(dptr, base, "dptr") }
    })
}

/// Why `addr` is not the base of a live allocation the free function accepts (`host_free`:
/// `cuMemFreeHost`, else `cuMemFree`).
fn bad_free(st: &State, addr: u64, host_free: bool) -> Fail {
    let msg = match st.find_alloc(addr) {
        Some(a) if a.base != addr => {
            format!("{addr:#x} is an interior pointer of the allocation at {:#x}", a.base)
        }
        Some(a) if a.kind == AllocKind::Registered => {
            format!("{addr:#x} is registered host memory (unregister it with cuMemHostUnregister)")
        }
        Some(a) if a.kind == AllocKind::PinnedHost && !host_free => {
            format!("{addr:#x} is pinned host memory (free it with cuMemFreeHost)")
        }
        Some(a) if host_free && a.kind != AllocKind::PinnedHost => {
            format!("{addr:#x} is {} memory (free it with cuMemFree)", a.kind.report_name())
        }
        _ => format!("{addr:#x} is not a live allocation (double free or never allocated)"),
    };
    Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, msg)
}

/// Frees the allocation at `addr` (`host_free`: `cuMemFreeHost`, else `cuMemFree`). Pool
/// allocations are returned to their pool at once, without synchronising; everything else first
/// waits for the queued work of the owning device (all devices for pinned and managed memory).
fn free(addr: u64, host_free: bool) -> ApiResult {
    let mut st = SIM.st.lock();
    context::require(&st)?;
    let accepts = |k: AllocKind| {
        if host_free {
            k == AllocKind::PinnedHost
        } else {
            matches!(k, AllocKind::Device | AllocKind::Pitched | AllocKind::Pool | AllocKind::Managed)
        }
    };
    let Some(a) = st.allocs.get(&addr).filter(|a| accepts(a.kind)).cloned() else {
        return Err(bad_free(&st, addr, host_free));
    };
    if a.kind != AllocKind::Pool {
        let drain: Vec<usize> = if host_free || a.kind == AllocKind::Managed {
            (0..st.devices.len()).collect()
        } else {
            vec![a.device as usize]
        };
        for d in drain {
            sync_device(&mut st, d);
        }
        // Another thread may have freed it while we waited.
        match st.allocs.get(&addr) {
            Some(now) if Arc::ptr_eq(now, &a) => {}
            _ => return Err(bad_free(&st, addr, host_free)),
        }
    }
    st.allocs.remove(&addr);
    st.forget(&a, None);
    Ok(())
}

/// `CUresult cuMemFree(CUdeviceptr dptr)` (symbol `_v2`): frees `cuMemAlloc`, `cuMemAllocPitch`,
/// `cuMemAllocManaged` and pool memory. Pool memory goes back to its pool at once without
/// synchronising (the driver documents no implicit synchronisation for it); anything else waits
/// for the owning device's queued work first. 0 is a no-op; unknown, interior, pinned,
/// registered or already freed pointers give `INVALID_VALUE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    api::call("cuMemFree_v2", Init::Required, || {
        if dptr == 0 {
            return Ok(());
        }
        free(dptr, false)
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
        pool: 0,
        backing,
        freed: OnceLock::new(),
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
        free(p as u64, true)
    })
}

/// The `cuMemHostGetFlags` answer for the memory containing `p` (pinned, registered or managed),
/// or `INVALID_VALUE` (a probe answer, not recorded).
fn host_flags_at(st: &State, p: u64) -> Result<u32, Fail> {
    match st.find_alloc(p) {
        Some(a) if a.kind == AllocKind::PinnedHost => Ok(a.host_flags),
        // IOMEMORY and READ_ONLY are not reported; DEVICEMAP always is (UVA).
        Some(a) if a.kind == AllocKind::Registered => Ok((a.host_flags & 0x3) | HOST_DEVICEMAP),
        Some(a) if a.kind == AllocKind::Managed => Ok(HOST_DEVICEMAP),
        _ => Err(Fail::quiet(CUresult::CUDA_ERROR_INVALID_VALUE)),
    }
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
        let st = SIM.st.lock();
        context::require(&st)?;
        let flags = host_flags_at(&st, p as u64)?;
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
        if st.find_alloc(p as u64).is_none_or(|a| !a.kind.pinned()) {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("{:#x} is neither pinned nor registered host memory", p as u64),
            ));
        }
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
    api::call("cuMemHostRegister_v2", Init::Required, || {
        let mut st = SIM.st.lock();
        let d = context::require(&st)?;
        let bad = |m: String| Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, m));
        if flags & !REGISTER_FLAGS != 0 {
            return bad(format!("unknown cuMemHostRegister flags {flags:#x}"));
        }
        if p.is_null() || bytesize == 0 {
            return bad(format!("cuMemHostRegister({:#x}, {bytesize})", p as u64));
        }
        if st.devices[d].attr(ATTR_HOST_REGISTER_SUPPORTED) != Some(1) {
            return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED));
        }
        if flags & REGISTER_READ_ONLY != 0
            && st.devices[d].attr(ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED) != Some(1)
        {
            return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED));
        }
        if flags & REGISTER_IOMEMORY != 0 {
            return bad("CU_MEMHOSTREGISTER_IOMEMORY on ordinary host memory".into());
        }
        let start = p as u64;
        let Some(end) = start.checked_add(bytesize as u64) else {
            return bad(format!("range {start:#x} + {bytesize} overflows"));
        };
        if st.in_device_space(start) || st.in_device_space(end - 1) {
            return bad(format!("{start:#x} is device memory, not host memory"));
        }
        if let Some((_, a)) = st.allocs.range(..end).next_back()
            && a.base + a.bytes > start
        {
            if a.kind == AllocKind::Registered {
                return Err(Fail::misuse(
                    CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                    format!(
                        "[{start:#x}, +{bytesize}) overlaps the registration [{:#x}, +{})",
                        a.base, a.bytes
                    ),
                ));
            }
            return bad(format!(
                "[{start:#x}, +{bytesize}) overlaps {} memory allocated by CUDA at {:#x}",
                a.kind.report_name(),
                a.base
            ));
        }
        let backing = Backing::borrowed(p.cast(), bytesize).expect("checked non-NULL");
        let buffer_id = st.next_buffer_id;
        st.next_buffer_id += 1;
        let alloc = Allocation {
            kind: AllocKind::Registered,
            base: start,
            bytes: bytesize as u64,
            charged: 0,
            device: d as i32,
            ctx: ctx_handle(d),
            buffer_id,
            host_flags: flags,
            pool: 0,
            backing,
            freed: OnceLock::new(),
        };
        st.allocs.insert(start, Arc::new(alloc));
        Ok(())
    })
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
    api::call("cuMemHostUnregister", Init::Required, || {
        let mut st = SIM.st.lock();
        context::require(&st)?;
        let addr = p as u64;
        if p.is_null() {
            return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, "cuMemHostUnregister(NULL)"));
        }
        let a = match st.find_alloc(addr) {
            Some(a) if a.kind == AllocKind::Registered && a.base == addr => a.clone(),
            Some(a) if a.kind == AllocKind::Registered => {
                return Err(Fail::misuse(
                    CUresult::CUDA_ERROR_INVALID_VALUE,
                    format!("{addr:#x} is an interior pointer of the registration at {:#x}", a.base),
                ));
            }
            Some(a) => {
                return Err(Fail::misuse(
                    CUresult::CUDA_ERROR_INVALID_VALUE,
                    format!(
                        "{addr:#x} is {} memory allocated by CUDA, not a registration",
                        a.kind.report_name()
                    ),
                ));
            }
            None => {
                return Err(Fail::misuse(
                    CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
                    format!("{addr:#x} is not registered (never, or already unregistered)"),
                ));
            }
        };
        for d in 0..st.devices.len() {
            sync_device(&mut st, d);
        }
        match st.allocs.get(&addr) {
            Some(now) if Arc::ptr_eq(now, &a) => {
                st.allocs.remove(&addr);
                Ok(())
            }
            _ => Err(Fail::misuse(
                CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
                format!("{addr:#x} was unregistered concurrently"),
            )),
        }
    })
}

/// One pointer attribute value, with the driver's size.
enum AttrValue {
    U32(u32),
    U64(u64),
    /// The batch form leaves the caller's buffer untouched.
    Untouched,
}

/// Whether `attribute` is a number the bindings define (P2P_TOKENS included).
fn known_pointer_attribute(attribute: u32) -> bool {
    (1..=21).contains(&attribute)
}

/// The value of `attribute` for `ptr`; `a` is the allocation containing it. Single form
/// (`batch == false`): HOST_POINTER of device-only memory is `INVALID_VALUE`; batch form: NULL.
fn pointer_attribute(
    st: &State,
    a: &Allocation,
    attribute: u32,
    ptr: u64,
    batch: bool,
) -> Result<AttrValue, Fail> {
    use AttrValue::{U32, U64};
    let device_only = a.kind.device_only();
    let offset = ptr - a.base;
    Ok(match attribute {
        1 => U64(a.ctx),
        2 => U32(if device_only || a.kind == AllocKind::Managed { 2 } else { 1 }),
        3 => U64(ptr),
        4 if device_only && batch => U64(0),
        4 if device_only => return Err(Fail::quiet(CUresult::CUDA_ERROR_INVALID_VALUE)),
        4 => U64(a.base + offset),
        5 => {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                "CU_POINTER_ATTRIBUTE_P2P_TOKENS is not supported",
            ));
        }
        8 => U32(u32::from(a.kind == AllocKind::Managed)),
        6 => U32(u32::from(crate::sync_memops::is_set(a.buffer_id))),
        14 | 21 => U32(0),
        7 | 20 => U64(a.buffer_id),
        9 => U32(a.device as u32),
        10 => U32(u32::from(matches!(a.kind, AllocKind::Device | AllocKind::Pitched))),
        15 => U32(u32::from(device_only)),
        11 | 19 => U64(a.base),
        12 | 18 => U64(a.bytes),
        13 => U32(1),
        16 => U32(match (a.kind, st.pools.get(&a.pool)) {
            (AllocKind::Pool, Some(p)) => context::current()
                .and_then(|c| st.ctx_device(c))
                .map_or(crate::pool::PROT_READWRITE, |d| p.access_of(d)),
            _ => 3,
        }),
        _ => U64(a.pool), // 17: MEMPOOL_HANDLE, NULL outside pools.
    })
}

/// The batch form's answer for memory CUDA does not know.
fn unknown_pointer_attribute(attribute: u32, ptr: u64) -> AttrValue {
    match attribute {
        3 | 4 => AttrValue::U64(ptr),
        9 => AttrValue::U32(u32::MAX), // -1
        11 | 12 => AttrValue::Untouched,
        1 | 7 | 17 | 18 | 19 | 20 => AttrValue::U64(0),
        _ => AttrValue::U32(0),
    }
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
        let st = SIM.st.lock();
        let a = st.find_alloc(ptr);
        let mut values = Vec::with_capacity(attrs.len());
        for (i, (&attr, &out)) in attrs.iter().zip(outs).enumerate() {
            if !known_pointer_attribute(attr) {
                return Err(Fail::misuse(
                    CUresult::CUDA_ERROR_INVALID_VALUE,
                    format!("unknown pointer attribute {attr} at index {i}"),
                ));
            }
            if out.is_null() {
                return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("data[{i}] is NULL")));
            }
            values.push(match a {
                Some(a) => pointer_attribute(&st, a, attr, ptr, true)?,
                None if attr == 5 => pointer_attribute_p2p()?,
                None => unknown_pointer_attribute(attr, ptr),
            });
        }
        for (v, &out) in values.into_iter().zip(outs) {
            // SAFETY: non-NULL (checked) and valid for the attribute's size (caller contract).
            unsafe { write_attr(out, v) };
        }
        Ok(())
    })
}

fn pointer_attribute_p2p() -> Result<AttrValue, Fail> {
    Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, "CU_POINTER_ATTRIBUTE_P2P_TOKENS is not supported"))
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
        let v = pointer_attribute(&st, a, attribute, ptr, false)?;
        // SAFETY: non-NULL; the caller provides room for this attribute's documented size, which
        // is exactly what is written.
        unsafe { write_attr(data, v) };
        Ok(())
    })
}
