//! The stream-ordered allocator and memory pools: C-ABI shims that check and translate pointers
//! and call the crate's `pool` model (chunks, reuse rules, release at synchronisation).

use std::ffi::{c_int, c_void};

use cudarc::driver::sys::{CUdevice, CUdeviceptr, CUmemoryPool, CUresult, CUstream};

use crate::abi::{AccessDesc, MemLocation, PoolProps};
use crate::api::{self, ApiResult, Init};
use crate::pool::{self, Width};
use crate::state::SIM;
use crate::stream::resolve;

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
    let addr = pool::allocate_async(&mut st, pool.map(|p| p as u64), bytesize as u64, sid)?;
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
        pool::free_async(&mut st, dptr, sid)
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
        let h = pool::create(&mut SIM.st.lock(), &p)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(pool, h as CUmemoryPool, "pool") }
    })
}

/// `CUresult cuMemPoolDestroy(CUmemoryPool pool)`: the handle dies at once; with allocations
/// outstanding the memory is released when they have been freed (the driver's documented
/// behaviour). A device's current pool reverts to its default pool. Default pools, dead handles
/// and imported pools with live imported pointers (as on an H100; the imports are not counted
/// down) give `INVALID_VALUE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    api::call("cuMemPoolDestroy", Init::Required, || pool::destroy(&mut SIM.st.lock(), pool as u64))
}

/// `CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)`: releases chunks that are
/// entirely free (every free completed) as long as at least `minBytesToKeep` stay reserved.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolTrimTo(pool: CUmemoryPool, min_bytes_to_keep: usize) -> CUresult {
    api::call("cuMemPoolTrimTo", Init::Required, || {
        pool::trim_to(&mut SIM.st.lock(), pool as u64, min_bytes_to_keep as u64)
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
        let h = pool as u64;
        let width = pool::attribute_width(&st, h, attr, true)?;
        api::non_null(value, "value")?;
        // SAFETY: non-NULL and valid for reading the attribute's documented type (caller
        // contract).
        let v = unsafe {
            match width {
                Width::Int => value.cast::<c_int>().read_unaligned() as u64,
                Width::U64 => value.cast::<u64>().read_unaligned(),
            }
        };
        pool::set_attribute(&mut st, h, attr, v)
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
        let h = pool as u64;
        let width = pool::attribute_width(&st, h, attr, false)?;
        api::non_null(value, "value")?;
        let v = pool::get_attribute(&mut st, h, attr);
        // SAFETY: non-NULL and valid for writing the attribute's documented type.
        unsafe {
            match width {
                Width::Int => value.cast::<c_int>().write_unaligned(c_int::from(v != 0)),
                Width::U64 => value.cast::<u64>().write_unaligned(v),
            }
        }
        Ok(())
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
        let h = pool::lookup(&st, pool as u64)?;
        if count == 0 {
            return Ok(());
        }
        api::non_null(map, "map")?;
        // SAFETY: non-NULL and valid for `count` descriptors (caller contract), read as raw
        // integers.
        let descs = unsafe { std::slice::from_raw_parts(map.cast::<AccessDesc>(), count) }.to_vec();
        pool::set_access(&mut st, h, &descs)
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
        // SAFETY: non-NULL and valid for reading a `CUmemLocation` (caller contract).
        let loc = unsafe { location.cast::<MemLocation>().read() };
        let f = pool::get_access(&SIM.st.lock(), pool as u64, loc)?;
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
        let h = pool::device_pool(&st, st.ordinal(dev)?, current)?;
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
        pool::set_device_pool(&mut st, d, pool as u64)
    })
}

/// `CUresult cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool,
/// CUmemAllocationHandleType handleType, unsigned long long flags)`: for POSIX_FD, writes a new
/// descriptor (an `int`, the caller's to close) of the pool's memory; another process imports it
/// with `cuMemPoolImportFromShareableHandle`. Only pools created with POSIX_FD among their
/// `handleTypes` export (default pools never do: `INVALID_VALUE`, as observed); NULL
/// `handle_out`, flags ≠ 0, another type or a dead pool give `INVALID_VALUE`.
///
/// # Safety
/// 1. `handle_out` is NULL or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolExportToShareableHandle(
    handle_out: *mut c_void,
    pool: CUmemoryPool,
    handle_type: std::ffi::c_uint,
    flags: std::ffi::c_ulonglong,
) -> CUresult {
    api::call("cuMemPoolExportToShareableHandle", Init::Required, || {
        api::non_null(handle_out, "handle_out")?;
        let fd = pool::shared::export_fd(pool as u64, handle_type, flags)?;
        // SAFETY: forwarded caller contract (checked non-NULL; POSIX_FD writes an int).
        unsafe { api::out(handle_out.cast::<c_int>(), fd, "handle_out") }
    })
}

/// `CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *pool_out, void *handle,
/// CUmemAllocationHandleType handleType, unsigned long long flags)`: for POSIX_FD, `handle` is
/// the descriptor itself (cast to a pointer), which the caller keeps. The pool handle (a new one,
/// or that of a live import of the same pool in this process, whose imports are then counted:
/// each is destroyed once, as on an H100) is for `cuMemPoolImportPointer` only (allocating from
/// it or making it a device's pool gives `INVALID_VALUE`); destroy it with `cuMemPoolDestroy`,
/// once its imported pointers are freed (before that → `INVALID_VALUE`, as on an H100). Another
/// type → `NOT_SUPPORTED`; NULL `pool_out`, flags ≠ 0 or a descriptor that is not an exported pool
/// → `INVALID_VALUE`; a negative descriptor → `UNKNOWN`.
///
/// # Safety
/// 1. `pool_out` is NULL or valid for writing a `CUmemoryPool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolImportFromShareableHandle(
    pool_out: *mut CUmemoryPool,
    handle: *mut c_void,
    handle_type: std::ffi::c_uint,
    flags: std::ffi::c_ulonglong,
) -> CUresult {
    api::call("cuMemPoolImportFromShareableHandle", Init::Required, || {
        api::non_null(pool_out, "pool_out")?;
        let h = pool::shared::import_fd(handle as usize as i32, handle_type, flags)?;
        // SAFETY: forwarded caller contract (checked non-NULL).
        unsafe { api::out(pool_out, h as CUmemoryPool, "pool_out") }
    })
}

/// `CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *shareData_out, CUdeviceptr ptr)`:
/// the 64 bytes another process passes to `cuMemPoolImportPointer`. `ptr` must be the base of a
/// live allocation of a pool created with POSIX_FD handle types; anything else (other memory,
/// an interior pointer, NULL `shareData_out`) gives `INVALID_VALUE`.
///
/// # Safety
/// 1. `share_data_out` is NULL or valid for writing a `CUmemPoolPtrExportData`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolExportPointer(
    share_data_out: *mut cudarc::driver::sys::CUmemPoolPtrExportData,
    ptr: CUdeviceptr,
) -> CUresult {
    api::call("cuMemPoolExportPointer", Init::Required, || {
        api::non_null(share_data_out, "shareData_out")?;
        let bytes = pool::shared::export_pointer(ptr)?;
        // SAFETY: forwarded caller contract (checked non-NULL).
        unsafe {
            api::out(
                share_data_out,
                cudarc::driver::sys::CUmemPoolPtrExportData { reserved: bytes },
                "shareData_out",
            )
        }
    })
}

/// `CUresult cuMemPoolImportPointer(CUdeviceptr *ptr_out, CUmemoryPool pool,
/// CUmemPoolPtrExportData *shareData)`: maps the exported allocation, through `pool` (this
/// process's import of the exporting pool), at a new 32 MiB-aligned address of this process
/// (listed as a `pool_import` in the live report until freed with `cuMemFree`/`cuMemFreeAsync`,
/// which every importer must do before the exporter frees it). A block with a live import here
/// gives that import's address, not counted (one free ends it), as on an H100; a block the
/// exporter already freed is mapped too (SUCCESS, as on an H100) and recorded as a violation, as
/// is a block never exported or a forged offset inside the pool file (a GPU's answer unknown).
/// No current context → `INVALID_CONTEXT`; NULL pointers, a pool that was not imported, bytes no
/// `cuMemPoolExportPointer` wrote, or a pointer of another pool → `INVALID_VALUE`.
///
/// # Safety
/// 1. `ptr_out` is NULL or valid for writing a `CUdeviceptr`; `share_data` is NULL or valid for
///    reading a `CUmemPoolPtrExportData`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolImportPointer(
    ptr_out: *mut CUdeviceptr,
    pool: CUmemoryPool,
    share_data: *mut cudarc::driver::sys::CUmemPoolPtrExportData,
) -> CUresult {
    api::call("cuMemPoolImportPointer", Init::Required, || {
        api::non_null(ptr_out, "ptr_out")?;
        api::non_null(share_data, "shareData")?;
        // SAFETY: non-NULL and valid for reading 64 bytes (caller contract).
        let bytes = unsafe { (*share_data).reserved };
        let base = pool::shared::import_pointer(pool as u64, &bytes)?;
        // SAFETY: forwarded caller contract (checked non-NULL).
        unsafe { api::out(ptr_out, base, "ptr_out") }
    })
}
