//! The stream-ordered allocator and memory pools. The model (chunks, reuse rules, release at
//! synchronisation) lives in the crate's `pool` module and the README.

use std::ffi::{c_int, c_void};

use cudarc::driver::sys::{CUdevice, CUdeviceptr, CUmemoryPool, CUresult, CUstream};

use crate::abi::{AccessDesc, LOC_DEVICE, LOC_HOST_NUMA, MemLocation, PoolProps};
use crate::api::{self, ApiResult, Fail, Init};
use crate::copy::Work;
use crate::memory::AllocKind;
use crate::pool::{self, Pool};
use crate::state::{SIM, State};
use crate::stream::enqueue;
use crate::stream::resolve;

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

/// `NOT_SUPPORTED` unless device `d` reports MEMORY_POOLS_SUPPORTED.
fn supported(st: &State, d: usize) -> ApiResult {
    if st.devices[d].attr(ATTR_MEMORY_POOLS_SUPPORTED) == Some(1) {
        Ok(())
    } else {
        Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED))
    }
}

/// The live pool `h` names, or `INVALID_VALUE` (never created, or destroyed).
pub(crate) fn lookup(st: &State, h: CUmemoryPool) -> Result<u64, Fail> {
    let v = h as u64;
    match st.pools.get(&v) {
        Some(p) if !p.destroyed => Ok(v),
        Some(_) => Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("memory pool {v:#x} has been destroyed"),
        )),
        None => Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("{v:#x} is not a memory pool"))),
    }
}

/// # Safety
/// 1. `dptr` is NULL or valid for writing a `CUdeviceptr`.
unsafe fn alloc_async(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: Option<CUmemoryPool>,
    h_stream: CUstream,
) -> ApiResult {
    api::non_null(dptr, "dptr")?;
    let mut st = SIM.st.lock();
    let sid = resolve(&mut st, h_stream)?;
    let handle = match pool {
        Some(p) => lookup(&st, p)?,
        None => {
            let d = st.streams[&sid].device;
            supported(&st, d)?;
            st.devices[d].current_pool
        }
    };
    supported(&st, st.pools[&handle].device)?;
    let addr = if bytesize == 0 { 0 } else { pool::allocate(&mut st, handle, bytesize as u64, sid)? };
    // SAFETY: forwarded caller contract.
    unsafe { api::out(dptr, addr, "dptr") }
}

/// `CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)`: allocates
/// from the current pool of the stream's device, usable by work ordered after the call on that
/// stream. Size 0 succeeds with `*dptr = 0`. Reuse follows the pool's REUSE_* attributes (see
/// the README); the pool grows in 32 MiB chunks charged to the device.
///
/// # Safety
/// 1. `dptr` is NULL or valid for writing a `CUdeviceptr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    h_stream: CUstream,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemAllocAsync", Init::Required, || unsafe { alloc_async(dptr, bytesize, None, h_stream) })
}

/// `CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
/// CUstream hStream)`: as `cuMemAllocAsync`, from `pool` (which may belong to another device
/// than the stream). A dead pool handle gives `INVALID_VALUE`; exceeding `maxSize`,
/// `OUT_OF_MEMORY`.
///
/// # Safety
/// 1. `dptr` is NULL or valid for writing a `CUdeviceptr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    h_stream: CUstream,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemAllocFromPoolAsync", Init::Required, || unsafe {
        alloc_async(dptr, bytesize, Some(pool), h_stream)
    })
}

/// `CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)`: frees pool memory in stream
/// order. The pointer is dead for the program at once (later copies on it are refused); the block
/// becomes reusable when the free is reached in the stream (or earlier, for the same stream).
/// Work queued earlier on *other* streams that has not completed when the free is reached uses
/// freed memory (shared with whoever reuses the block): recorded as a violation when it runs.
/// 0 is a no-op; anything but the base of a live pool allocation gives `INVALID_VALUE`
/// (including `cuMemAlloc` memory: use `cuMemFree`).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, h_stream: CUstream) -> CUresult {
    api::call("cuMemFreeAsync", Init::Required, || {
        if dptr == 0 {
            return Ok(());
        }
        let mut st = SIM.st.lock();
        let sid = resolve(&mut st, h_stream)?;
        let a = match st.find_alloc(dptr) {
            Some(a) if a.base == dptr && a.kind == AllocKind::Pool => a.clone(),
            Some(a) if a.base != dptr => {
                return Err(Fail::misuse(
                    CUresult::CUDA_ERROR_INVALID_VALUE,
                    format!("{dptr:#x} is an interior pointer of the allocation at {:#x}", a.base),
                ));
            }
            Some(a) => {
                return Err(Fail::misuse(
                    CUresult::CUDA_ERROR_INVALID_VALUE,
                    format!(
                        "{dptr:#x} is {} memory, not a stream-ordered (pool) allocation",
                        a.kind.report_name()
                    ),
                ));
            }
            None => {
                return Err(Fail::misuse(
                    CUresult::CUDA_ERROR_INVALID_VALUE,
                    format!("{dptr:#x} is not a live allocation (double free or never allocated)"),
                ));
            }
        };
        let seq = enqueue(&mut st, sid, Work::Free { alloc: a.clone() }, Vec::new());
        st.allocs.remove(&dptr);
        st.forget(&a, Some((sid, seq)));
        Ok(())
    })
}

/// `CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)`:
/// `allocType` must be PINNED, `location` a valid DEVICE (HOST/HOST_NUMA_CURRENT/invalid or a bad
/// ordinal → `INVALID_VALUE`; HOST_NUMA → `NOT_SUPPORTED`, not modelled), `handleTypes` a subset
/// of the device's MEMPOOL_SUPPORTED_HANDLE_TYPES, `usage` 0 (HW_DECOMPRESS → `NOT_SUPPORTED`),
/// `reserved` zero. `maxSize` 0 means the device's capacity.
///
/// # Safety
/// 1. `pool` is NULL or valid for writing a `CUmemoryPool`; `props` is NULL or valid for reading
///    a `CUmemPoolProps`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut CUmemoryPool,
    props: *const cudarc::driver::sys::CUmemPoolProps,
) -> CUresult {
    api::call("cuMemPoolCreate", Init::Required, || {
        api::non_null(pool, "pool")?;
        api::non_null(props, "poolProps")?;
        // SAFETY: non-NULL and valid for reading the 88-byte structure (caller contract); read
        // as raw integers so any enumerator value is representable.
        let p = unsafe { props.cast::<PoolProps>().read() };
        let bad = |m: String| Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, m));
        if p.alloc_type != ALLOCATION_TYPE_PINNED {
            return bad(format!("allocType {} must be CU_MEM_ALLOCATION_TYPE_PINNED", p.alloc_type));
        }
        let mut st = SIM.st.lock();
        let d = match p.location.kind {
            LOC_DEVICE => match usize::try_from(p.location.id).ok().filter(|&d| d < st.devices.len()) {
                Some(d) => d,
                None => return bad(format!("location: device {} does not exist", p.location.id)),
            },
            LOC_HOST_NUMA => return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED)),
            k => return bad(format!("location type {k} is not valid for a memory pool")),
        };
        supported(&st, d)?;
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
        let h = st.new_pool_handle();
        st.pools.insert(h, Pool::new(d, false, p.max_size as u64));
        // SAFETY: forwarded caller contract.
        unsafe { api::out(pool, h as CUmemoryPool, "pool") }
    })
}

/// `CUresult cuMemPoolDestroy(CUmemoryPool pool)`: the handle dies at once; with allocations
/// outstanding the memory is released when they have been freed (the driver's documented
/// behaviour). A device's current pool reverts to its default pool. Default pools and dead
/// handles give `INVALID_VALUE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    api::call("cuMemPoolDestroy", Init::Required, || {
        let mut st = SIM.st.lock();
        let h = lookup(&st, pool)?;
        let p = st.pools.get_mut(&h).expect("looked up");
        if p.is_default {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("{h:#x} is device {}'s default pool, which cannot be destroyed", p.device),
            ));
        }
        p.destroyed = true;
        let d = p.device;
        let dev = &mut st.devices[d];
        if dev.current_pool == h {
            dev.current_pool = dev.default_pool;
        }
        pool::settle(&mut st, h);
        Ok(())
    })
}

/// `CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)`: releases chunks that are
/// entirely free (every free completed) as long as at least `minBytesToKeep` stay reserved.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolTrimTo(pool: CUmemoryPool, min_bytes_to_keep: usize) -> CUresult {
    api::call("cuMemPoolTrimTo", Init::Required, || {
        let mut st = SIM.st.lock();
        let h = lookup(&st, pool)?;
        pool::trim(&mut st, h, min_bytes_to_keep as u64);
        Ok(())
    })
}

/// `CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)`:
/// REUSE_* (1–3, `int`), RELEASE_THRESHOLD (4, `cuuint64_t`); RESERVED_MEM_HIGH (6) and
/// USED_MEM_HIGH (8) accept only 0 (reset to the current value); the current counters (5, 7),
/// other values and unknown attributes give `INVALID_VALUE`.
///
/// # Safety
/// 1. `value` is NULL or valid for reading the attribute's type (`int` or `cuuint64_t`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    pool: CUmemoryPool,
    attr: u32,
    value: *mut c_void,
) -> CUresult {
    api::call("cuMemPoolSetAttribute", Init::Required, || {
        let mut st = SIM.st.lock();
        let h = lookup(&st, pool)?;
        if !(1..=8).contains(&attr) {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("unknown memory pool attribute {attr}"),
            ));
        }
        if matches!(attr, 5 | 7) {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("memory pool attribute {attr} is read-only"),
            ));
        }
        api::non_null(value, "value")?;
        let p = st.pools.get_mut(&h).expect("looked up");
        // SAFETY: non-NULL and valid for reading the attribute's documented type (caller
        // contract): `int` for 1–3, `cuuint64_t` for 4–8.
        unsafe {
            match attr {
                1..=3 => {
                    let on = value.cast::<c_int>().read_unaligned() != 0;
                    match attr {
                        1 => p.follow_event_deps = on,
                        2 => p.opportunistic = on,
                        _ => p.internal_deps = on,
                    }
                }
                4 => p.release_threshold = value.cast::<u64>().read_unaligned(),
                _ => {
                    let v = value.cast::<u64>().read_unaligned();
                    if v != 0 {
                        return Err(Fail::misuse(
                            CUresult::CUDA_ERROR_INVALID_VALUE,
                            format!("high-water mark attribute {attr} can only be reset to 0, not {v}"),
                        ));
                    }
                    if attr == 6 {
                        p.reserved_high = p.reserved;
                    } else {
                        p.used_high = p.used;
                    }
                }
            }
        }
        Ok(())
    })
}

/// `CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)`:
/// writes an `int` for 1–3 and a `cuuint64_t` for 4–8; unknown attributes give `INVALID_VALUE`.
///
/// # Safety
/// 1. `value` is NULL or valid for writing the attribute's type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolGetAttribute(
    pool: CUmemoryPool,
    attr: u32,
    value: *mut c_void,
) -> CUresult {
    api::call("cuMemPoolGetAttribute", Init::Required, || {
        let mut st = SIM.st.lock();
        let h = lookup(&st, pool)?;
        if !(1..=8).contains(&attr) {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("unknown memory pool attribute {attr}"),
            ));
        }
        api::non_null(value, "value")?;
        pool::settle(&mut st, h);
        let p = &st.pools[&h];
        let int = |b: bool| c_int::from(b);
        // SAFETY: non-NULL and valid for writing the attribute's documented type.
        unsafe {
            match attr {
                1 => value.cast::<c_int>().write_unaligned(int(p.follow_event_deps)),
                2 => value.cast::<c_int>().write_unaligned(int(p.opportunistic)),
                3 => value.cast::<c_int>().write_unaligned(int(p.internal_deps)),
                4 => value.cast::<u64>().write_unaligned(p.release_threshold),
                5 => value.cast::<u64>().write_unaligned(p.reserved),
                6 => value.cast::<u64>().write_unaligned(p.reserved_high),
                7 => value.cast::<u64>().write_unaligned(p.used),
                _ => value.cast::<u64>().write_unaligned(p.used_high),
            }
        }
        Ok(())
    })
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

/// `CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count)`:
/// access of other devices to the pool's memory (recorded and reported by
/// `cuMemPoolGetAccess`; copies are not checked against it). All descriptors are validated
/// before any is applied: non-device locations, bad ordinals, flags outside {0, 1, 3} and any
/// change of the owner's READWRITE access give `INVALID_VALUE`; a device that cannot access the
/// owner (peer matrix) gives `INVALID_DEVICE`. `count == 0` is a no-op.
///
/// # Safety
/// 1. `map` is NULL or valid for reading `count` `CUmemAccessDesc`s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolSetAccess(
    pool: CUmemoryPool,
    map: *const cudarc::driver::sys::CUmemAccessDesc,
    count: usize,
) -> CUresult {
    api::call("cuMemPoolSetAccess", Init::Required, || {
        let mut st = SIM.st.lock();
        let h = lookup(&st, pool)?;
        if count == 0 {
            return Ok(());
        }
        api::non_null(map, "map")?;
        // SAFETY: non-NULL and valid for `count` descriptors (caller contract), read as raw
        // integers.
        let descs = unsafe { std::slice::from_raw_parts(map.cast::<AccessDesc>(), count) }.to_vec();
        let owner = st.pools[&h].device;
        let mut updates = Vec::with_capacity(count);
        for desc in descs {
            let d = access_device(&st, desc.location)?;
            if !matches!(desc.flags, 0 | 1 | 3) {
                return Err(Fail::misuse(
                    CUresult::CUDA_ERROR_INVALID_VALUE,
                    format!("access flags {} are not a CUmemAccess_flags value", desc.flags),
                ));
            }
            if d == owner {
                if desc.flags != pool::PROT_READWRITE {
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
        let p = st.pools.get_mut(&h).expect("looked up");
        for (d, flags) in updates {
            p.access.insert(d, flags);
        }
        Ok(())
    })
}

/// `CUresult cuMemPoolGetAccess(CUmemAccess_flags *flags, CUmemoryPool memPool, CUmemLocation
/// *location)`: READWRITE for the owner, PROT_NONE for others unless granted.
///
/// # Safety
/// 1. `flags` is NULL or valid for writing a `CUmemAccess_flags`; `location` is NULL or valid
///    for reading a `CUmemLocation`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolGetAccess(
    flags: *mut u32,
    pool: CUmemoryPool,
    location: *mut cudarc::driver::sys::CUmemLocation,
) -> CUresult {
    api::call("cuMemPoolGetAccess", Init::Required, || {
        api::non_null(flags, "flags")?;
        api::non_null(location, "location")?;
        let st = SIM.st.lock();
        let h = lookup(&st, pool)?;
        // SAFETY: non-NULL and valid for reading a `CUmemLocation` (caller contract).
        let loc = unsafe { location.cast::<MemLocation>().read() };
        let d = access_device(&st, loc)?;
        let f = st.pools[&h].access_of(d);
        // SAFETY: forwarded caller contract.
        unsafe { api::out(flags, f, "flags") }
    })
}

/// # Safety
/// 1. `out` is NULL or valid for writing a `CUmemoryPool`.
unsafe fn get_pool(name: &'static str, out: *mut CUmemoryPool, dev: CUdevice, current: bool) -> CUresult {
    api::call(name, Init::Required, || {
        api::non_null(out, "pool")?;
        let st = SIM.st.lock();
        let d = st.ordinal(dev)?;
        supported(&st, d)?;
        let h = if current { st.devices[d].current_pool } else { st.devices[d].default_pool };
        // SAFETY: forwarded caller contract.
        unsafe { api::out(out, h as CUmemoryPool, "pool") }
    })
}

/// `CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)`: the same handle
/// on every call, one per device.
///
/// # Safety
/// 1. `pool_out` is NULL or valid for writing a `CUmemoryPool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(pool_out: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    // SAFETY: forwarded caller contract.
    unsafe { get_pool("cuDeviceGetDefaultMemPool", pool_out, dev, false) }
}

/// `CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)`: the pool `cuMemAllocAsync`
/// uses for streams of `dev`.
///
/// # Safety
/// 1. `pool` is NULL or valid for writing a `CUmemoryPool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    // SAFETY: forwarded caller contract.
    unsafe { get_pool("cuDeviceGetMemPool", pool, dev, true) }
}

/// `CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)`: the pool must belong to
/// `dev` (`INVALID_VALUE` otherwise, or for a dead handle).
#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) -> CUresult {
    api::call("cuDeviceSetMemPool", Init::Required, || {
        let mut st = SIM.st.lock();
        let d = st.ordinal(dev)?;
        supported(&st, d)?;
        let h = lookup(&st, pool)?;
        if st.pools[&h].device != d {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("pool {h:#x} belongs to device {}, not device {d}", st.pools[&h].device),
            ));
        }
        st.devices[d].current_pool = h;
        Ok(())
    })
}
