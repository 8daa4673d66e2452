//! Allocating and freeing: device, pitched, managed and pinned memory, host registrations.
//!
//! Device memory is carved from the device's reserved address range and charged against its
//! capacity in granules (512 bytes, 2 MiB from 2 MiB up); pinned, managed and registered memory
//! are host memory whose device address equals the host address (UVA). Freeing anything but a
//! pool block first waits for the queued work that may still use it, as the driver's implicit
//! synchronisation does.

use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUresult;

use crate::api::{ApiResult, Fail};
use crate::context;
use crate::memory::{AllocKind, Allocation, Backing, REGISTER_READ_ONLY};
use crate::state::{SIM, State};

/// `CU_MEMHOSTALLOC_DEVICEMAP`: every pinned allocation reports it (UVA).
pub(crate) const HOST_DEVICEMAP: u32 = 0x2;

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

/// Row alignment of pitched allocations.
const PITCH_ALIGN: u64 = 512;

/// `CU_MEM_ATTACH_GLOBAL`.
pub(crate) const ATTACH_GLOBAL: u32 = 1;

/// `CU_MEM_ATTACH_HOST`.
pub(crate) const ATTACH_HOST: u32 = 2;

/// `CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY`.
const ATTR_MANAGED_MEMORY: u32 = 83;

/// Alignment and capacity granule of a device allocation of `bytes`.
fn granule(bytes: u64) -> u64 {
    if bytes >= 2 << 20 { 2 << 20 } else { 512 }
}

/// Reserves `bytes` (> 0) of device memory on device `d` for context `ctx`.
fn device_alloc(st: &mut State, ctx: u64, d: usize, bytes: u64, kind: AllocKind) -> Result<u64, Fail> {
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
        ctx,
        buffer_id,
        host_flags: 0,
        pool: 0,
        backing,
        freed: OnceLock::new(),
    };
    st.allocs.insert(base, Arc::new(alloc));
    Ok(base)
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
/// allocations are returned to their pool at once, without synchronising (imported pool blocks
/// are unmapped here); everything else first
/// waits for the queued work of the owning device (all devices for pinned and managed memory).
pub(crate) fn free(addr: u64, host_free: bool) -> ApiResult {
    let mut st = SIM.st.lock();
    context::require(&st)?;
    let accepts = |k: AllocKind| {
        if host_free {
            k == AllocKind::PinnedHost
        } else {
            matches!(
                k,
                AllocKind::Device
                    | AllocKind::Pitched
                    | AllocKind::Pool
                    | AllocKind::PoolImport
                    | AllocKind::Managed
            )
        }
    };
    let Some(a) = st.allocs.get(&addr).filter(|a| accepts(a.kind)).cloned() else {
        return Err(bad_free(&st, addr, host_free));
    };
    // Pool memory (an imported block too) is not synchronised: queued work holds its mapping.
    if !matches!(a.kind, AllocKind::Pool | AllocKind::PoolImport) {
        let drain: Vec<usize> = if host_free || a.kind == AllocKind::Managed {
            (0..st.devices.len()).collect()
        } else {
            vec![a.device as usize]
        };
        crate::hold::drain_devices(&mut st, &drain);
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

/// `cuMemGetInfo`: `(free, total)` of the current context's device; `free` is the capacity minus
/// every live allocation's charged size.
pub(crate) fn mem_info() -> Result<(u64, u64), Fail> {
    let st = SIM.st.lock();
    let d = context::require(&st)?;
    let dev = &st.devices[d];
    Ok((dev.total - dev.used, dev.total))
}

/// `cuMemAlloc`: `bytesize` (> 0) bytes of device memory for the current context.
pub(crate) fn device(bytesize: usize) -> Result<u64, Fail> {
    let mut st = SIM.st.lock();
    // Also waits while another thread waits for room on a full stream (observed).
    let (ctx, d) = crate::hold::current_gated_full(&mut st)?;
    if bytesize == 0 {
        return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, "cuMemAlloc of 0 bytes"));
    }
    let base = device_alloc(&mut st, ctx, d, bytesize as u64, AllocKind::Device)?;
    Ok(base)
}

/// `cuMemAllocPitch`: `(base, pitch)` of `height` rows of `width` bytes.
pub(crate) fn pitched(width: usize, height: usize, element_size: u32) -> Result<(u64, usize), Fail> {
    let mut st = SIM.st.lock();
    let (ctx, d) = crate::hold::current_gated(&mut st)?;
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
    let base = device_alloc(&mut st, ctx, d, bytes, AllocKind::Pitched)?;
    Ok((base, pitch as usize))
}

/// `cuMemAllocManaged`: unified memory whose device address is its host view's address.
pub(crate) fn managed(bytesize: usize, flags: u32) -> Result<u64, Fail> {
    let mut st = SIM.st.lock();
    let (ctx, d) = crate::hold::current_gated(&mut st)?;
    if st.devices[d].attr(ATTR_MANAGED_MEMORY) != Some(1) {
        return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED));
    }
    if flags != ATTACH_GLOBAL && flags != ATTACH_HOST {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("cuMemAllocManaged flags {flags:#x} must be CU_MEM_ATTACH_GLOBAL or CU_MEM_ATTACH_HOST"),
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
        ctx,
        buffer_id,
        host_flags: flags,
        pool: 0,
        backing,
        freed: OnceLock::new(),
    };
    st.allocs.insert(base, Arc::new(alloc));
    st.managed.insert(base, crate::managed::Managed::new(flags, bytesize as u64, host));
    Ok(base)
}

/// `cuMemAllocHost` / `cuMemHostAlloc`: page-locked host memory whose device address is its host
/// address; `reported_flags` is what `cuMemHostGetFlags` will answer.
pub(crate) fn pinned(bytesize: usize, reported_flags: u32) -> Result<u64, Fail> {
    let mut st = SIM.st.lock();
    let (ctx, d) = crate::hold::current_gated(&mut st)?;
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
        ctx,
        buffer_id,
        host_flags: reported_flags,
        pool: 0,
        backing,
        freed: OnceLock::new(),
    };
    st.allocs.insert(base, Arc::new(alloc));
    Ok(base)
}

/// `cuMemHostRegister`: page-locks the program's range `[p, p + bytesize)` for the current
/// context.
pub(crate) fn register(p: u64, bytesize: usize, flags: u32) -> ApiResult {
    let mut st = SIM.st.lock();
    // Gated by another thread's implicit synchronisation: observed blocking on an H100
    // (2026-11-24, see `crate::hold`).
    let (ctx, d) = crate::hold::current_gated(&mut st)?;
    let bad = |m: String| Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, m));
    if flags & !REGISTER_FLAGS != 0 {
        return bad(format!("unknown cuMemHostRegister flags {flags:#x}"));
    }
    if p == 0 || bytesize == 0 {
        return bad(format!("cuMemHostRegister({p:#x}, {bytesize})"));
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
    let start = p;
    let Some(end) = start.checked_add(bytesize as u64) else {
        return bad(format!("range {start:#x} + {bytesize} overflows"));
    };
    if st.in_device_space(start) || st.in_device_space(end - 1) {
        return bad(format!("{start:#x} is device memory, not host memory"));
    }
    // A zero-byte allocation still owns its base (a page is mapped behind it): `max(1)`.
    if let Some((_, a)) = st.allocs.range(..end).next_back()
        && a.base + a.bytes.max(1) > start
    {
        if a.kind == AllocKind::Registered {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                format!("[{start:#x}, +{bytesize}) overlaps the registration [{:#x}, +{})", a.base, a.bytes),
            ));
        }
        return bad(format!(
            "[{start:#x}, +{bytesize}) overlaps {} memory allocated by CUDA at {:#x}",
            a.kind.report_name(),
            a.base
        ));
    }
    let backing = Backing::borrowed(p as *mut u8, bytesize).expect("checked non-NULL");
    let buffer_id = st.next_buffer_id;
    st.next_buffer_id += 1;
    let alloc = Allocation {
        kind: AllocKind::Registered,
        base: start,
        bytes: bytesize as u64,
        charged: 0,
        device: d as i32,
        ctx,
        buffer_id,
        host_flags: flags,
        pool: 0,
        backing,
        freed: OnceLock::new(),
    };
    // Never replace a live entry: its backing would be dropped (unmapping CUDA's memory).
    match st.allocs.entry(start) {
        std::collections::btree_map::Entry::Vacant(v) => {
            v.insert(Arc::new(alloc));
            Ok(())
        }
        std::collections::btree_map::Entry::Occupied(o) => {
            bad(format!("{start:#x} is already {} memory", o.get().kind.report_name()))
        }
    }
}

/// `cuMemHostUnregister`: waits for all queued work (which may still use the memory), then
/// forgets the registration starting at `p`.
pub(crate) fn unregister(p: u64) -> ApiResult {
    let mut st = SIM.st.lock();
    context::require(&st)?;
    let addr = p;
    if p == 0 {
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
                format!("{addr:#x} is {} memory allocated by CUDA, not a registration", a.kind.report_name()),
            ));
        }
        None => {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
                format!("{addr:#x} is not registered (never, or already unregistered)"),
            ));
        }
    };
    let all: Vec<usize> = (0..st.devices.len()).collect();
    crate::hold::drain_devices(&mut st, &all);
    match st.allocs.get(&addr) {
        Some(now) if Arc::ptr_eq(now, &a) => {
            st.allocs.remove(&addr);
            crate::sync_memops::forget(a.buffer_id);
            Ok(())
        }
        _ => Err(Fail::misuse(
            CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
            format!("{addr:#x} was unregistered concurrently"),
        )),
    }
}
