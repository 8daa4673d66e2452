//! Pool handles and their settings: creation and destruction, the current pool of a device,
//! attributes and access. The exported `cuMemPool*` and `cuDevice*MemPool` functions are shims
//! over these.
//!
//! ```text
//! cuMemPoolCreate(&p, &props)          -> create(st, &props)       -> handle, a Pool in st.pools
//! cuMemPoolSetAttribute(p, 4, &v)      -> set_attribute(st, h, 4, read v as u64)
//! cuMemPoolDestroy(p)                  -> destroy(st, h): dead at once, memory when all is freed
//! ```

use cudarc::driver::sys::CUresult;

use super::{PROT_READWRITE, Pool, settle, trim};
use crate::abi::{AccessDesc, LOC_DEVICE, LOC_HOST_NUMA, MemLocation, PoolProps};
use crate::api::{ApiResult, Fail};
use crate::state::State;

/// `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`.
const ATTR_MEMORY_POOLS_SUPPORTED: u32 = 115;
/// `CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES`.
const ATTR_MEMPOOL_SUPPORTED_HANDLE_TYPES: u32 = 119;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
const ALLOCATION_TYPE_PINNED: u32 = 1;
/// Every defined `CUmemAllocationHandleType` bit.
const HANDLE_TYPES_ALL: u32 = 0xF;
/// `CU_MEM_POOL_CREATE_USAGE_HW_DECOMPRESS`.
const USAGE_HW_DECOMPRESS: u16 = 0x2;

/// How a pool attribute's value is passed: `int` or `cuuint64_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Width {
    /// `int` (the REUSE_* switches).
    Int,
    /// `cuuint64_t` (the threshold and the counters).
    U64,
}

/// `NOT_SUPPORTED` unless device `d` reports MEMORY_POOLS_SUPPORTED.
pub(crate) fn supported(st: &State, d: usize) -> ApiResult {
    if st.devices[d].attr(ATTR_MEMORY_POOLS_SUPPORTED) == Some(1) {
        Ok(())
    } else {
        Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED))
    }
}

/// The live pool `h` names, or `INVALID_VALUE` (never created, or destroyed).
pub(crate) fn lookup(st: &State, h: u64) -> Result<u64, Fail> {
    match st.pools.get(&h) {
        Some(p) if !p.destroyed => Ok(h),
        Some(_) => Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("memory pool {h:#x} has been destroyed"),
        )),
        None => Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("{h:#x} is not a memory pool"))),
    }
}

/// `cuMemPoolCreate` with the caller's properties: the new handle.
pub(crate) fn create(st: &mut State, p: &PoolProps) -> Result<u64, Fail> {
    let bad = |m: String| Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, m));
    if p.alloc_type != ALLOCATION_TYPE_PINNED {
        return bad(format!("allocType {} must be CU_MEM_ALLOCATION_TYPE_PINNED", p.alloc_type));
    }
    let d = match p.location.kind {
        LOC_DEVICE => match usize::try_from(p.location.id).ok().filter(|&d| d < st.devices.len()) {
            Some(d) => d,
            None => return bad(format!("location: device {} does not exist", p.location.id)),
        },
        LOC_HOST_NUMA => return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED)),
        k => return bad(format!("location type {k} is not valid for a memory pool")),
    };
    supported(st, d)?;
    let dev_types = st.devices[d].attr(ATTR_MEMPOOL_SUPPORTED_HANDLE_TYPES).unwrap_or(0) as u32;
    if p.handle_types & !HANDLE_TYPES_ALL != 0 || p.handle_types & !dev_types != 0 {
        return bad(format!(
            "handleTypes {:#x} not supported by device {d} (supports {dev_types:#x})",
            p.handle_types
        ));
    }
    if p.usage == USAGE_HW_DECOMPRESS {
        return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED));
    }
    if p.usage != 0 {
        return bad(format!("unknown usage {:#x}", p.usage));
    }
    if p.reserved.iter().any(|&b| b != 0) {
        return bad("reserved bytes of CUmemPoolProps must be zero".into());
    }
    let mut pool = Pool::new(d, false, p.max_size as u64);
    if p.handle_types & super::shared::POSIX_FD != 0 {
        let shared =
            super::shared::SharedPool::create(d).ok_or(Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY))?;
        pool.shared = Some(Box::new(shared));
    }
    let h = st.new_pool_handle();
    st.pools.insert(h, pool);
    Ok(h)
}

/// `cuMemPoolDestroy`: the handle dies at once, the memory when the last allocation is freed; a
/// device whose current pool it was goes back to its default pool. An imported pool's handle
/// dies with the destroy of its last import in this process (imports of one pool share it).
/// An imported pool with live imported pointers is not destroyed: `INVALID_VALUE`, and its imports
/// are not counted down (an H100, 2026-11-23, second run, with one import or two; after the
/// `cuMemFree` of the pointer the destroys succeed). An import whose `cuMemFreeAsync` has not
/// executed yet counts as live here (unmeasured).
pub(crate) fn destroy(st: &mut State, h: u64) -> ApiResult {
    let h = lookup(st, h)?;
    let p = st.pools.get_mut(&h).expect("looked up");
    if p.shared.as_ref().is_some_and(|s| s.imported) && super::shared::has_imports(p) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("imported pool {h:#x} still has imported pointers: free them (cuMemFree) first"),
        ));
    }
    if let Some(shared) = p.shared.as_mut().filter(|s| s.imported && s.opens > 1) {
        shared.opens -= 1;
        return Ok(());
    }
    if p.is_default {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("{h:#x} is device {}'s default pool, which cannot be destroyed", p.device),
        ));
    }
    p.destroyed = true;
    let dev = &mut st.devices[p.device];
    if dev.current_pool == h {
        dev.current_pool = dev.default_pool;
    }
    settle(st, h);
    Ok(())
}

/// `cuMemPoolTrimTo`.
pub(crate) fn trim_to(st: &mut State, h: u64, keep: u64) -> ApiResult {
    let h = lookup(st, h)?;
    trim(st, h, keep);
    Ok(())
}

/// The width of attribute `attr` after the checks `cuMemPool{Get,Set}Attribute` make before
/// touching the value (`set`: whether it is to be written).
pub(crate) fn attribute_width(st: &State, h: u64, attr: u32, set: bool) -> Result<Width, Fail> {
    lookup(st, h)?;
    if !(1..=8).contains(&attr) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("unknown memory pool attribute {attr}"),
        ));
    }
    if set && matches!(attr, 5 | 7) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("memory pool attribute {attr} is read-only"),
        ));
    }
    Ok(if attr <= 3 { Width::Int } else { Width::U64 })
}

/// `cuMemPoolSetAttribute` once [`attribute_width`] accepted it; `v`: the value read (an `int`
/// widened for 1–3).
pub(crate) fn set_attribute(st: &mut State, h: u64, attr: u32, v: u64) -> ApiResult {
    let p = st.pools.get_mut(&h).expect("checked by attribute_width");
    match attr {
        1 => p.follow_event_deps = v != 0,
        2 => p.opportunistic = v != 0,
        3 => p.internal_deps = v != 0,
        4 => p.release_threshold = v,
        _ if v != 0 => {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("high-water mark attribute {attr} can only be reset to 0, not {v}"),
            ));
        }
        6 => p.reserved_high = p.reserved,
        _ => p.used_high = p.used,
    }
    Ok(())
}

/// `cuMemPoolGetAttribute` once [`attribute_width`] accepted it (0/1 for the switches).
pub(crate) fn get_attribute(st: &mut State, h: u64, attr: u32) -> u64 {
    settle(st, h);
    let p = &st.pools[&h];
    match attr {
        1 => u64::from(p.follow_event_deps),
        2 => u64::from(p.opportunistic),
        3 => u64::from(p.internal_deps),
        4 => p.release_threshold,
        5 => p.reserved,
        6 => p.reserved_high,
        7 => p.used,
        _ => p.used_high,
    }
}

/// The device a `CUmemLocation` names for pool access, or `INVALID_VALUE`.
fn access_device(st: &State, loc: MemLocation) -> Result<usize, Fail> {
    if loc.kind != LOC_DEVICE {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("location type {} is not a device", loc.kind),
        ));
    }
    usize::try_from(loc.id).ok().filter(|&d| d < st.devices.len()).ok_or_else(|| {
        Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("device {} does not exist", loc.id))
    })
}

/// `cuMemPoolSetAccess` with the caller's descriptors (at least one), all validated before any
/// is applied.
pub(crate) fn set_access(st: &mut State, h: u64, descs: &[AccessDesc]) -> ApiResult {
    let owner = st.pools[&h].device;
    let mut updates = Vec::with_capacity(descs.len());
    for desc in descs {
        let d = access_device(st, desc.location)?;
        if !matches!(desc.flags, 0 | 1 | 3) {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("access flags {} are not a CUmemAccess_flags value", desc.flags),
            ));
        }
        if d == owner {
            if desc.flags != PROT_READWRITE {
                return Err(Fail::misuse(
                    CUresult::CUDA_ERROR_INVALID_VALUE,
                    format!("the owning device {d} cannot lose read-write access to its pool"),
                ));
            }
            continue;
        }
        if desc.flags != 0 && !st.peer[d][owner] {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_DEVICE,
                format!("device {d} cannot access device {owner}'s memory (no peer capability)"),
            ));
        }
        updates.push((d, desc.flags));
    }
    let p = st.pools.get_mut(&h).expect("looked up by the caller");
    for (d, flags) in updates {
        p.access.insert(d, flags);
    }
    Ok(())
}

/// `cuMemPoolGetAccess`: the flags the device `loc` names has on pool `h`.
pub(crate) fn get_access(st: &State, h: u64, loc: MemLocation) -> Result<u32, Fail> {
    let h = lookup(st, h)?;
    let d = access_device(st, loc)?;
    Ok(st.pools[&h].access_of(d))
}

/// `cuDeviceGetDefaultMemPool` (`current == false`) / `cuDeviceGetMemPool` for device `d`.
pub(crate) fn device_pool(st: &State, d: usize, current: bool) -> Result<u64, Fail> {
    supported(st, d)?;
    Ok(if current { st.devices[d].current_pool } else { st.devices[d].default_pool })
}

/// `cuDeviceSetMemPool` for device `d`: the pool must be live and belong to `d`.
pub(crate) fn set_device_pool(st: &mut State, d: usize, h: u64) -> ApiResult {
    supported(st, d)?;
    let h = lookup(st, h)?;
    if st.pools[&h].device != d {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("pool {h:#x} belongs to device {}, not device {d}", st.pools[&h].device),
        ));
    }
    if st.pools[&h].shared.as_ref().is_some_and(|s| s.imported) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("pool {h:#x} was imported from another process and cannot be a device's pool"),
        ));
    }
    st.devices[d].current_pool = h;
    Ok(())
}
