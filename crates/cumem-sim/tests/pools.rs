//! The stream-ordered allocator and memory pools: misuse codes, attributes, stream-ordered
//! reuse, release at synchronisation, trimming, limits, and destruction.

mod common;

use std::ffi::c_void;
use std::time::{Duration, Instant};

use common::*;
use cudarc::driver::sys::{
    self as cu, CUdeviceptr, CUevent, CUmemPool_attribute, CUmemoryPool, CUpointer_attribute, CUresult,
    CUstream,
};
use serial_test::{parallel, serial};

use CUmemPool_attribute::*;

const MIB: u64 = 1 << 20;

fn props(dev: i32, max_size: usize) -> cu::CUmemPoolProps {
    // SAFETY: an all-zero CUmemPoolProps is a valid value (every enum has a 0 variant).
    let mut p: cu::CUmemPoolProps = unsafe { std::mem::zeroed() };
    p.allocType = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev };
    p.maxSize = max_size;
    p
}

fn create(p: &cu::CUmemPoolProps) -> CUmemoryPool {
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { cu::cuMemPoolCreate(&mut pool, p) });
    pool
}

/// A user pool on `dev` that never releases at synchronisation (threshold = max).
fn keeping_pool(dev: i32, max_size: usize) -> CUmemoryPool {
    let pool = create(&props(dev, max_size));
    set_u64(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX);
    pool
}

fn destroy_pool(pool: CUmemoryPool) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuMemPoolDestroy(pool) });
}

fn get_u64(pool: CUmemoryPool, a: CUmemPool_attribute) -> u64 {
    let mut v = 0u64;
    // SAFETY: a u64 out-value for a cuuint64_t attribute.
    ok(unsafe { cu::cuMemPoolGetAttribute(pool, a, (&mut v as *mut u64).cast()) });
    v
}

fn set_u64(pool: CUmemoryPool, a: CUmemPool_attribute, v: u64) -> CUresult {
    let mut v = v;
    // SAFETY: a u64 value for a cuuint64_t attribute.
    unsafe { cu::cuMemPoolSetAttribute(pool, a, (&mut v as *mut u64).cast()) }
}

fn get_int(pool: CUmemoryPool, a: CUmemPool_attribute) -> i32 {
    let mut v = -1i32;
    // SAFETY: an int out-value for an int attribute.
    ok(unsafe { cu::cuMemPoolGetAttribute(pool, a, (&mut v as *mut i32).cast()) });
    v
}

fn set_int(pool: CUmemoryPool, a: CUmemPool_attribute, v: i32) {
    let mut v = v;
    // SAFETY: an int value for an int attribute.
    ok(unsafe { cu::cuMemPoolSetAttribute(pool, a, (&mut v as *mut i32).cast()) });
}

fn alloc_from(pool: CUmemoryPool, bytes: usize, s: CUstream) -> CUdeviceptr {
    let mut p = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocFromPoolAsync(&mut p, bytes, pool, s) });
    p
}

fn try_alloc_from(pool: CUmemoryPool, bytes: usize, s: CUstream) -> Result<CUdeviceptr, CUresult> {
    let mut p = 0;
    // SAFETY: valid out-pointer.
    match unsafe { cu::cuMemAllocFromPoolAsync(&mut p, bytes, pool, s) } {
        CUresult::CUDA_SUCCESS => Ok(p),
        e => Err(e),
    }
}

fn free_async(p: CUdeviceptr, s: CUstream) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuMemFreeAsync(p, s) });
}

fn sync(s: CUstream) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
}

fn event() -> CUevent {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuEventCreate(&mut e, 0) });
    e
}

fn default_pool(dev: i32) -> (CUresult, CUmemoryPool) {
    let mut p: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    let r = unsafe { cu::cuDeviceGetDefaultMemPool(&mut p, dev) };
    (r, p)
}

#[test]
#[parallel]
fn alloc_and_free_misuse_codes() {
    let ctl = bind(0);
    let s = stream(0);
    // SAFETY: plain FFI calls; pointers are valid or deliberately NULL/bogus.
    unsafe {
        assert_eq!(cu::cuMemAllocAsync(std::ptr::null_mut(), 16, s), CUresult::CUDA_ERROR_INVALID_VALUE);
        let mut p: u64 = 0x55;
        ok(cu::cuMemAllocAsync(&mut p, 0, s));
        assert_eq!(p, 0, "a zero-byte stream-ordered allocation is NULL");
        p = 0x55;
        assert_eq!(cu::cuMemAllocAsync(&mut p, 16, 0xdead0 as CUstream), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(p, 0x55);
        assert_eq!(
            cu::cuMemAllocFromPoolAsync(&mut p, 16, 0x1234 as CUmemoryPool, s),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        ok(cu::cuMemFreeAsync(0, s));
        let d = dalloc(256);
        assert_eq!(cu::cuMemFreeAsync(d, s), CUresult::CUDA_ERROR_INVALID_VALUE);
        dfree(d);
        ok(cu::cuMemAllocAsync(&mut p, 4096, s));
        assert_eq!(cu::cuMemFreeAsync(p + 512, s), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuMemFree_v2(p + 512), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuMemFreeHost(p as *mut c_void), CUresult::CUDA_ERROR_INVALID_VALUE);
        free_async(p, s);
        assert_eq!(cu::cuMemFreeAsync(p, s), CUresult::CUDA_ERROR_INVALID_VALUE);
        // Stream-ordered calls on the NULL stream need a context; explicit streams do not.
        let s_addr = s as usize;
        let codes = std::thread::spawn(move || {
            let s = s_addr as CUstream;
            let mut q = 0u64;
            let a = cu::cuMemAllocAsync(&mut q, 64, std::ptr::null_mut());
            let b = cu::cuMemAllocAsync(&mut q, 64, s);
            let c = cu::cuMemFreeAsync(q, s);
            (a, b, c)
        })
        .join()
        .unwrap();
        assert_eq!(
            codes,
            (CUresult::CUDA_ERROR_INVALID_CONTEXT, CUresult::CUDA_SUCCESS, CUresult::CUDA_SUCCESS)
        );
    }
    sync(s);
    destroy(s);
    let v = ctl.violations_on_this_thread();
    assert!(v.iter().any(|v| v.function == "cuMemFreeAsync" && v.message.contains("not a stream-ordered")));
    assert!(v.iter().any(|v| v.function == "cuMemFreeAsync" && v.message.contains("double free")));
    assert!(v.iter().any(|v| v.function == "cuMemFreeAsync" && v.message.contains("interior")));
    assert!(
        v.iter().any(|v| v.function == "cuMemAllocFromPoolAsync" && v.message.contains("not a memory pool"))
    );
}

#[test]
#[parallel]
fn default_and_current_pools() {
    bind(0);
    let (r0, p0) = default_pool(0);
    ok(r0);
    assert_eq!(default_pool(0).1, p0, "the default pool handle is stable");
    let (_, p1) = default_pool(1);
    assert_ne!(p0, p1);
    assert_eq!(default_pool(3).0, CUresult::CUDA_ERROR_NOT_SUPPORTED);
    assert_eq!(default_pool(99).0, CUresult::CUDA_ERROR_INVALID_DEVICE);
    // SAFETY: plain FFI calls with valid out-pointers.
    unsafe {
        assert_eq!(
            cu::cuDeviceGetDefaultMemPool(std::ptr::null_mut(), 0),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(cu::cuMemPoolDestroy(p0), CUresult::CUDA_ERROR_INVALID_VALUE);
        let mut cur: CUmemoryPool = std::ptr::null_mut();
        ok(cu::cuDeviceGetMemPool(&mut cur, 1));
        assert_eq!(cur, p1);
        assert_eq!(cu::cuDeviceSetMemPool(1, p0), CUresult::CUDA_ERROR_INVALID_VALUE);
        let mine = create(&props(1, 0));
        ok(cu::cuDeviceSetMemPool(1, mine));
        ok(cu::cuDeviceGetMemPool(&mut cur, 1));
        assert_eq!(cur, mine);
        // Destroying the current pool makes the default pool current again.
        destroy_pool(mine);
        ok(cu::cuDeviceGetMemPool(&mut cur, 1));
        assert_eq!(cur, p1);
        assert_eq!(cu::cuDeviceSetMemPool(1, mine), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuMemPoolDestroy(mine), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuMemPoolTrimTo(mine, 0), CUresult::CUDA_ERROR_INVALID_VALUE);
        // cuMemAllocAsync on a device without pool support.
        bind(3);
        let mut q = 0x66u64;
        assert_eq!(cu::cuMemAllocAsync(&mut q, 64, std::ptr::null_mut()), CUresult::CUDA_ERROR_NOT_SUPPORTED);
        assert_eq!(q, 0x66);
    }
}

#[test]
#[parallel]
fn pool_create_validation() {
    let ctl = bind(0);
    let bad = |p: &cu::CUmemPoolProps| {
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid pointers.
        unsafe { cu::cuMemPoolCreate(&mut pool, p) }
    };
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: NULL arguments are the misuse under test.
    unsafe {
        assert_eq!(cu::cuMemPoolCreate(&mut pool, std::ptr::null()), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            cu::cuMemPoolCreate(std::ptr::null_mut(), &props(0, 0)),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
    }
    let mut p = props(0, 0);
    p.allocType = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_INVALID;
    assert_eq!(bad(&p), CUresult::CUDA_ERROR_INVALID_VALUE);
    let mut p = props(9, 0);
    assert_eq!(
        bad(&p),
        CUresult::CUDA_ERROR_INVALID_VALUE,
        "bad ordinal is INVALID_VALUE, not INVALID_DEVICE"
    );
    p.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST;
    p.location.id = 0;
    assert_eq!(bad(&p), CUresult::CUDA_ERROR_INVALID_VALUE);
    // MEMPOOL_SUPPORTED_HANDLE_TYPES is 1: POSIX_FD only (tests/pool_export.rs exports such pools).
    for handle_type in [
        cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
        cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_WIN32,
    ] {
        let mut p = props(0, 0);
        p.handleTypes = handle_type;
        assert_eq!(bad(&p), CUresult::CUDA_ERROR_INVALID_VALUE, "{handle_type:?} is not supported");
    }
    let mut p = props(0, 0);
    p.handleTypes = cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    destroy_pool(create(&p));
    let mut p = props(0, 0);
    p.reserved[3] = 1;
    assert_eq!(bad(&p), CUresult::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(bad(&props(3, 0)), CUresult::CUDA_ERROR_NOT_SUPPORTED);
    let pool = create(&props(0, 0));
    let report = ctl.live_report();
    let live = report.pools.iter().find(|lp| lp.handle == pool as u64).expect("listed");
    assert!(!live.default && live.device == 0 && live.reserved == 0 && live.used == 0);
    assert!(report.pools.iter().any(|lp| lp.default && lp.device == 0), "default pools are listed");
    destroy_pool(pool);
    assert!(!ctl.live_report().contains_pool(pool as u64));
}

#[test]
#[parallel]
fn attribute_types_defaults_and_rules() {
    let ctl = bind(0);
    let pool = create(&props(0, 0));
    assert_eq!(get_int(pool, CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES), 1);
    assert_eq!(get_int(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC), 1);
    assert_eq!(get_int(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES), 1);
    assert_eq!(get_u64(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD), 0);
    // An int attribute writes exactly 4 bytes.
    let mut buf = [0xAAu8; 8];
    // SAFETY: `buf` has room for 8 bytes.
    ok(unsafe {
        cu::cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, buf.as_mut_ptr().cast())
    });
    assert_eq!(buf, [1, 0, 0, 0, 0xAA, 0xAA, 0xAA, 0xAA]);
    set_int(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, 0);
    assert_eq!(get_int(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC), 0);
    ok(set_u64(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, 123 * MIB));
    assert_eq!(get_u64(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD), 123 * MIB);
    let e = CUresult::CUDA_ERROR_INVALID_VALUE;
    assert_eq!(set_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, 0), e);
    assert_eq!(set_u64(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, 0), e);
    assert_eq!(set_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 5), e);
    assert_eq!(set_u64(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH, 5), e);
    // SAFETY: the symbol has this C signature; raw integers stand for unknown enumerators.
    let get: unsafe extern "C" fn(CUmemoryPool, u32, *mut c_void) -> CUresult =
        unsafe { raw("cuMemPoolGetAttribute") };
    // SAFETY: as above.
    let set: unsafe extern "C" fn(CUmemoryPool, u32, *mut c_void) -> CUresult =
        unsafe { raw("cuMemPoolSetAttribute") };
    let mut v = 0u64;
    // SAFETY: valid value pointer; unknown attribute numbers and a NULL value are the misuse.
    unsafe {
        assert_eq!(get(pool, 0, (&mut v as *mut u64).cast()), e);
        assert_eq!(get(pool, 9, (&mut v as *mut u64).cast()), e);
        assert_eq!(set(pool, 42, (&mut v as *mut u64).cast()), e);
        assert_eq!(get(pool, 5, std::ptr::null_mut()), e);
    }
    // High-water marks: reset only to 0, then equal the current value.
    let s = stream(0);
    let a = alloc_from(pool, 3 * MIB as usize, s);
    let b = alloc_from(pool, 12, s);
    assert_eq!(get_u64(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 3 * MIB + 512, "rounded to 512 B");
    assert!(get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) >= 3 * MIB + 512);
    free_async(a, s);
    assert_eq!(get_u64(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 512);
    assert_eq!(get_u64(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH), 3 * MIB + 512);
    ok(set_u64(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0));
    assert_eq!(get_u64(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH), 512);
    let reserved = get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    ok(set_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0));
    assert_eq!(get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH), reserved);
    free_async(b, s);
    sync(s);
    destroy(s);
    destroy_pool(pool);
    let v = ctl.violations_on_this_thread();
    assert!(v.iter().any(|v| v.message.contains("read-only")));
    assert!(v.iter().any(|v| v.message.contains("can only be reset to 0")));
    assert!(v.iter().any(|v| v.message.contains("unknown memory pool attribute")));
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn same_stream_reuse_is_immediate_even_before_the_free_runs() {
    bind(0);
    let pool = keeping_pool(0, 0);
    let s = stream(0);
    let gate = Gate::block(s);
    let a = alloc_from(pool, 4096, s);
    free_async(a, s);
    let b = alloc_from(pool, 4096, s);
    assert_eq!(a, b, "memory freed on S is reusable at once by S");
    gate.open();
    free_async(b, s);
    sync(s);
    destroy(s);
    destroy_pool(pool);
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn cross_stream_reuse_needs_a_dependency_or_completion() {
    bind(0);
    let pool = keeping_pool(0, 0);
    let (s, t) = (stream(1), stream(1));
    let gate = Gate::block(s);
    let a = alloc_from(pool, 4096, s);
    free_async(a, s);
    // T has no dependency on S and the free has not run: fresh memory.
    let b = alloc_from(pool, 4096, t);
    assert_ne!(b, a);
    assert!(b >= a + 4096 || b + 4096 <= a, "no overlap with the pending block");
    // An event recorded after the free and waited on by T is a dependency.
    let e = event();
    // SAFETY: plain FFI calls on live handles.
    unsafe {
        ok(cu::cuEventRecord(e, s));
        ok(cu::cuStreamWaitEvent(t, e, 0));
    }
    let c = alloc_from(pool, 4096, t);
    assert_eq!(c, a, "FOLLOW_EVENT_DEPENDENCIES lets T reuse S's free");
    gate.open();
    free_async(b, t);
    free_async(c, t);
    sync(t);
    sync(s);
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuEventDestroy_v2(e) });
    destroy(s);
    destroy(t);
    destroy_pool(pool);
}

#[test]
#[parallel]
fn opportunistic_reuse_after_completion_and_its_switch() {
    bind(0);
    for opportunistic in [1, 0] {
        let pool = keeping_pool(0, 0);
        set_int(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, opportunistic);
        let (s, t) = (stream(1), stream(1));
        let a = alloc_from(pool, 8192, s);
        free_async(a, s);
        sync(s); // the free has completed (and the threshold keeps the memory reserved)
        let b = alloc_from(pool, 8192, t);
        if opportunistic == 1 {
            assert_eq!(b, a, "a completed free is reusable by any stream");
        } else {
            assert_ne!(b, a, "without OPPORTUNISTIC, completion alone is not enough");
        }
        free_async(b, t);
        sync(t);
        destroy(s);
        destroy(t);
        destroy_pool(pool);
    }
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn internal_dependencies_make_the_allocating_stream_wait() {
    bind(0);
    // Room for one chunk only, so the pool cannot grow for the second allocation.
    let pool = keeping_pool(0, 32 << 20);
    let (s, t) = (stream(1), stream(1));
    let gate = Gate::block(s);
    let a = alloc_from(pool, 20 << 20, s);
    free_async(a, s);
    set_int(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, 0);
    assert_eq!(try_alloc_from(pool, 20 << 20, t), Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    set_int(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, 1);
    let b = alloc_from(pool, 20 << 20, t);
    assert_eq!(b, a, "the allocator reuses S's pending free by making T wait for it");
    settle();
    // SAFETY: plain FFI call.
    assert_eq!(unsafe { cu::cuStreamQuery(t) }, CUresult::CUDA_ERROR_NOT_READY, "T now waits for S");
    gate.open();
    sync(t);
    free_async(b, t);
    sync(t);
    destroy(s);
    destroy(t);
    destroy_pool(pool);
}

#[test]
#[parallel]
fn all_reuse_policies_off_means_same_stream_only() {
    bind(0);
    let pool = keeping_pool(0, 0);
    for a in [
        CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
        CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
        CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
    ] {
        set_int(pool, a, 0);
    }
    let (s, t) = (stream(1), stream(1));
    let a = alloc_from(pool, 4096, s);
    free_async(a, s);
    let e = event();
    // SAFETY: plain FFI calls on live handles.
    unsafe {
        ok(cu::cuEventRecord(e, s));
        ok(cu::cuStreamWaitEvent(t, e, 0));
    }
    sync(s);
    let b = alloc_from(pool, 4096, t);
    assert_ne!(b, a);
    let c = alloc_from(pool, 4096, s);
    assert_eq!(c, a);
    free_async(b, t);
    free_async(c, s);
    sync(s);
    sync(t);
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuEventDestroy_v2(e) });
    destroy(s);
    destroy(t);
    destroy_pool(pool);
}

/// Device 2 is used by this test only, so its free memory is not disturbed by other tests.
#[test]
#[parallel]
fn release_threshold_is_honoured_at_synchronisation() {
    setup();
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the retained context is not a leak.
    unsafe {
        ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, 2));
        ok(cu::cuCtxSetCurrent(ctx));
    }
    let free_mem = || {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        ok(unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) });
        free as u64
    };
    let (r, pool) = default_pool(2);
    ok(r);
    let reserved = || get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    let s = stream(0);
    let before = free_mem();
    let mut p = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocAsync(&mut p, MIB as usize, s) });
    assert!(reserved() >= MIB);
    assert!(free_mem() <= before - reserved(), "reservations count as used memory");
    free_async(p, s);
    assert!(reserved() >= MIB, "nothing is released before a synchronisation");
    sync(s);
    assert_eq!(reserved(), 0, "threshold 0: released at cuStreamSynchronize");
    assert_eq!(free_mem(), before);
    // A high threshold keeps the memory across synchronisations.
    ok(set_u64(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX));
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocAsync(&mut p, MIB as usize, s) });
    free_async(p, s);
    sync(s);
    let kept = reserved();
    assert!(kept >= MIB);
    assert!(free_mem() <= before - kept);
    // Lowering the threshold takes effect at the next synchronisation (here the context's).
    ok(set_u64(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, 0));
    assert_eq!(reserved(), kept);
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuCtxSynchronize() });
    assert_eq!(reserved(), 0);
    // cuEventSynchronize releases as well.
    let e = event();
    // SAFETY: valid out-pointer, live handles.
    unsafe {
        ok(cu::cuMemAllocAsync(&mut p, MIB as usize, s));
        free_async(p, s);
        ok(cu::cuEventRecord(e, s));
        ok(cu::cuEventSynchronize(e));
        ok(cu::cuEventDestroy_v2(e));
    }
    assert_eq!(reserved(), 0);
    assert_eq!(free_mem(), before);
    destroy(s);
    // SAFETY: plain FFI calls.
    unsafe {
        ok(cu::cuCtxSetCurrent(std::ptr::null_mut()));
    }
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn trim_releases_free_chunks_down_to_the_minimum() {
    bind(0);
    let pool = keeping_pool(0, 0);
    let s = stream(0);
    // Each 40 MiB request gets its own chunk of two 32 MiB pieces.
    let a = alloc_from(pool, 40 << 20, s);
    let b = alloc_from(pool, 40 << 20, s);
    let c = alloc_from(pool, 1024, s);
    assert!(get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) >= 80 * MIB + 1024);
    let gate = Gate::block(s);
    free_async(a, s);
    free_async(b, s);
    let total = get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    // SAFETY: plain FFI calls.
    unsafe {
        ok(cu::cuMemPoolTrimTo(pool, 0));
        assert_eq!(
            get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
            total,
            "frees not yet complete cannot be released"
        );
        gate.open();
        sync(s);
        ok(cu::cuMemPoolTrimTo(pool, (total - 10 * MIB) as usize));
        let kept = get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
        assert!(kept >= total - 10 * MIB, "at least minBytesToKeep stay reserved");
        ok(cu::cuMemPoolTrimTo(pool, 0));
        let left = get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
        assert!((1024..80 * MIB).contains(&left), "the chunk holding a live allocation stays: {left}");
    }
    free_async(c, s);
    sync(s);
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuMemPoolTrimTo(pool, 0) });
    assert_eq!(get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 0);
    destroy(s);
    destroy_pool(pool);
}

#[test]
#[parallel]
fn max_size_caps_the_pool() {
    let ctl = bind(0);
    let pool = keeping_pool(0, 64 << 20);
    let s = stream(0);
    let a = alloc_from(pool, 40 << 20, s);
    assert_eq!(try_alloc_from(pool, 40 << 20, s), Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    let b = alloc_from(pool, 20 << 20, s);
    assert!(get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) <= 64 << 20);
    assert!(!ctl.violations_on_this_thread().iter().any(|v| v.code_name == "CUDA_ERROR_OUT_OF_MEMORY"));
    free_async(a, s);
    free_async(b, s);
    sync(s);
    destroy(s);
    destroy_pool(pool);
}

fn mapping(p: CUdeviceptr) -> (u64, u64) {
    use CUpointer_attribute::*;
    let (mut base, mut size) = (0u64, 0u64);
    // SAFETY: u64 out-values for two 8-byte attributes.
    unsafe {
        ok(cu::cuPointerGetAttribute((&raw mut base).cast(), CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, p));
        ok(cu::cuPointerGetAttribute((&raw mut size).cast(), CU_POINTER_ATTRIBUTE_MAPPING_SIZE, p));
    }
    (base, size)
}

fn address_range(p: CUdeviceptr) -> (u64, usize) {
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: valid out-pointers.
    ok(unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut size, p) });
    (base, size)
}

/// `maxSize` is a whole number of 32 MiB chunks, rounded up (an H100, 2026-11-23): a 4 MiB
/// pool holds 8 MiB, and 3+3 MiB in one 32 MiB reservation, but not 20+20 MiB nor 40 MiB; a
/// 40 MiB pool holds 30+30 MiB in 64 MiB; a 64 MiB pool refuses a third 30 MiB.
#[test]
#[parallel]
fn max_size_is_rounded_up_to_whole_32_mib_chunks() {
    let ctl = bind(0);
    let s = stream(1);
    let cases: [(usize, &[usize], usize, u64); 6] = [
        (4, &[8], 1, 32),
        (4, &[3, 3], 2, 32),
        (4, &[20, 20], 1, 32),
        (4, &[40], 0, 0),
        (40, &[30, 30], 2, 64),
        (64, &[30, 30, 30], 2, 64),
    ];
    for (max, sizes, fit, reserved) in cases {
        let pool = keeping_pool(0, max << 20);
        let mut live = Vec::new();
        for (i, &mib) in sizes.iter().enumerate() {
            let r = try_alloc_from(pool, mib << 20, s);
            if i < fit {
                live.push(r.unwrap_or_else(|e| panic!("maxSize {max} MiB: {sizes:?} MiB, #{i}: {e:?}")));
            } else {
                assert_eq!(
                    r,
                    Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
                    "maxSize {max} MiB: {sizes:?} MiB, #{i}"
                );
            }
        }
        let got = get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
        assert_eq!(got, reserved * MIB, "maxSize {max} MiB: {sizes:?} MiB");
        for p in live {
            free_async(p, s);
        }
        sync(s);
        destroy_pool(pool);
    }
    assert!(!ctl.violations_on_this_thread().iter().any(|v| v.code_name == "CUDA_ERROR_OUT_OF_MEMORY"));
    destroy(s);
}

/// MAPPING_BASE_ADDR / MAPPING_SIZE of a pool address are the 32 MiB-aligned 32 MiB piece holding
/// it, for small and large allocations and pools with a small `maxSize` alike; RANGE_* and
/// `cuMemGetAddressRange` are the allocation (an H100, 2026-11-23).
#[test]
#[parallel]
fn the_mapping_of_a_pool_address_is_the_32_mib_piece_holding_it() {
    use CUpointer_attribute::*;
    bind(0);
    let s = stream(1);
    let chunk = 32 * MIB;
    for (max, sizes) in [(0, &[1000, 40 << 20, 100 << 20][..]), (4 << 20, &[1000, 8 << 20][..])] {
        let pool = keeping_pool(0, max);
        let ptrs: Vec<CUdeviceptr> = sizes.iter().map(|&b| alloc_from(pool, b, s)).collect();
        for (&p, &bytes) in ptrs.iter().zip(sizes) {
            assert_eq!(address_range(p + 100), (p, bytes), "the allocation");
            let mut start = 0u64;
            // SAFETY: a u64 out-value for an 8-byte attribute.
            ok(unsafe {
                cu::cuPointerGetAttribute((&raw mut start).cast(), CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p)
            });
            assert_eq!(start, p);
            for inside in [p, p + bytes as u64 / 2, p + bytes as u64 - 1] {
                assert_eq!(
                    mapping(inside),
                    (inside & !(chunk - 1), chunk),
                    "{bytes} B at {p:#x}, at {inside:#x}"
                );
            }
        }
        for p in ptrs {
            free_async(p, s);
        }
        sync(s);
        destroy_pool(pool);
    }
    destroy(s);
}

#[test]
#[parallel]
fn destroy_with_outstanding_allocations_defers_the_release() {
    let ctl = bind(0);
    let pool = create(&props(0, 0));
    let s = stream(0);
    let p = alloc_from(pool, 1000, s);
    destroy_pool(pool);
    let mut v = 0u64;
    assert_eq!(
        // SAFETY: valid value pointer.
        unsafe {
            cu::cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, (&mut v as *mut u64).cast())
        },
        CUresult::CUDA_ERROR_INVALID_VALUE,
        "the handle is dead at once"
    );
    // The allocation still works.
    // SAFETY: plain FFI call on a live allocation.
    ok(unsafe { cu::cuMemsetD8Async(p, 9, 1000, s) });
    sync(s);
    assert!(read_back(p, 1000).iter().all(|&b| b == 9));
    let report = ctl.live_report();
    assert!(!report.contains_pool(pool as u64));
    let a = report.allocations.iter().find(|a| a.ptr == p).expect("still live");
    assert_eq!((a.kind.as_str(), a.pool), ("pool", Some(pool as u64)));
    let id = a.id;
    free_async(p, s);
    sync(s);
    let live = ctl.live_report();
    assert!(!live.contains_allocation(id), "{live}");
    destroy(s);
}

#[test]
#[parallel]
fn copies_are_bounds_checked_per_pool_allocation() {
    let ctl = bind(0);
    let s = stream(0);
    let mut p = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocAsync(&mut p, 1000, s) });
    let src = vec![7u8; 2048];
    // SAFETY: `src` has 2048 bytes.
    unsafe {
        ok(cu::cuMemcpyHtoDAsync_v2(p, src.as_ptr().cast(), 1000, s));
        assert_eq!(
            cu::cuMemcpyHtoDAsync_v2(p, src.as_ptr().cast(), 1001, s),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "the chunk has more bytes, the allocation does not"
        );
        assert_eq!(cu::cuMemsetD8_v2(p + 1000, 1, 1), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    sync(s);
    assert!(read_back(p, 1000).iter().all(|&b| b == 7));
    let report = ctl.live_report();
    let a = report.allocations.iter().find(|a| a.ptr == p).expect("listed");
    assert_eq!(a.kind, "pool");
    let (_, dp) = default_pool(0);
    assert_eq!(a.pool, Some(dp as u64));
    // SAFETY: valid out-pointers.
    unsafe {
        let mut h = 0u64;
        ok(cu::cuPointerGetAttribute(
            (&mut h as *mut u64).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            p,
        ));
        assert_eq!(h, dp as u64);
        let mut t = 0u32;
        ok(cu::cuPointerGetAttribute(
            (&mut t as *mut u32).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            p,
        ));
        assert_eq!(t, 2);
        let (mut base, mut size) = (0u64, 0usize);
        ok(cu::cuMemGetAddressRange_v2(&mut base, &mut size, p + 10));
        assert_eq!((base, size), (p, 1000));
    }
    free_async(p, s);
    // SAFETY: plain FFI call on a freed pointer: the misuse under test.
    assert_eq!(unsafe { cu::cuMemsetD8Async(p, 1, 1, s) }, CUresult::CUDA_ERROR_INVALID_VALUE);
    sync(s);
    destroy(s);
    let v = ctl.violations_on_this_thread();
    assert!(v.iter().any(|v| v.function == "cuMemcpyHtoDAsync_v2" && v.message.contains("overruns")));
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn mem_free_on_pool_memory_does_not_synchronise() {
    bind(0);
    let s = stream(0);
    let gate = std::sync::Arc::new(Gate::block(s));
    let mut p = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocAsync(&mut p, 256, s) });
    let opener = {
        let gate = std::sync::Arc::clone(&gate);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(2));
            gate.open();
        })
    };
    let t0 = Instant::now();
    dfree(p);
    assert!(t0.elapsed() < Duration::from_secs(1), "cuMemFree on pool memory waited for the stream");
    gate.open();
    opener.join().unwrap();
    sync(s);
    destroy(s);
}

#[test]
#[parallel]
fn injected_faults_apply_to_pool_entry_points() {
    let ctl = bind(0);
    let id = ctl.inject_fault(cumem_sim::FaultRule {
        function: "cuMemAllocAsync".into(),
        nth: 1,
        code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        times: 1,
        this_thread_only: true,
    });
    let s = stream(0);
    let mut p = 0x42u64;
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { cu::cuMemAllocAsync(&mut p, 64, s) }, CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(p, 0x42, "a faulted call writes nothing");
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocAsync(&mut p, 64, s) });
    ctl.remove_fault(id);
    free_async(p, s);
    sync(s);
    destroy(s);
}

#[test]
#[parallel]
fn pool_access_descriptors() {
    let ctl = bind(0);
    let pool = create(&props(0, 0));
    let desc = |dev: i32, flags: cu::CUmemAccess_flags| cu::CUmemAccessDesc {
        location: cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev },
        flags,
    };
    let get = |dev: i32| {
        let mut f = cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_MAX;
        let mut loc =
            cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev };
        // SAFETY: valid pointers.
        let r = unsafe { cu::cuMemPoolGetAccess(&mut f, pool, &mut loc) };
        (r, f)
    };
    use cu::CUmemAccess_flags::*;
    let s = CUresult::CUDA_SUCCESS;
    assert_eq!(get(0), (s, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    assert_eq!(get(1), (s, CU_MEM_ACCESS_FLAGS_PROT_NONE));
    assert_eq!(get(9).0, CUresult::CUDA_ERROR_INVALID_VALUE);
    // SAFETY: valid descriptor arrays of the given lengths (or NULL as the misuse).
    unsafe {
        ok(cu::cuMemPoolSetAccess(pool, std::ptr::null(), 0));
        assert_eq!(cu::cuMemPoolSetAccess(pool, std::ptr::null(), 1), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            cu::cuMemPoolSetAccess(pool, &desc(0, CU_MEM_ACCESS_FLAGS_PROT_NONE), 1),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "the owner keeps read-write access"
        );
        let both = [desc(1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE), desc(7, CU_MEM_ACCESS_FLAGS_PROT_READ)];
        assert_eq!(cu::cuMemPoolSetAccess(pool, both.as_ptr(), 2), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(get(1).1, CU_MEM_ACCESS_FLAGS_PROT_NONE, "nothing applied from a refused batch");
        ok(cu::cuMemPoolSetAccess(pool, both.as_ptr(), 1));
        assert_eq!(get(1).1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
        // SAFETY: raw flags 2 are not a CUmemAccess_flags value.
        let set: unsafe extern "C" fn(CUmemoryPool, *const [u32; 3], usize) -> CUresult =
            raw("cuMemPoolSetAccess");
        assert_eq!(set(pool, &[1, 1, 2], 1), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    destroy_pool(pool);
    assert!(ctl.violations_on_this_thread().iter().any(|v| v.message.contains("read-write access")));
}

fn memset32_async(p: CUdeviceptr, v: u32, n: usize, s: CUstream) {
    // SAFETY: plain FFI call; `p` is a live allocation of at least `4 n` bytes.
    ok(unsafe { cu::cuMemsetD32Async(p, v, n, s) });
}

/// Violations on this thread that report a use after free (in the order they were recorded).
fn uses_after_free(ctl: &cumem_sim::Control) -> Vec<cumem_sim::Violation> {
    ctl.violations_on_this_thread().into_iter().filter(|v| v.message.contains(" used after its ")).collect()
}

/// A region freed in two steps on one stream fits that stream's next allocation whether or not
/// the engine has run the first free yet. (A completed free is no longer tagged with its stream,
/// so the two neighbours do not merge; both are still usable by the stream. Placement once
/// depended on the engine's progress: under load the test below failed with `c == a + 8192`.)
#[test]
#[parallel]
fn a_stream_reuses_neighbouring_blocks_freed_at_different_times() {
    bind(0);
    let pool = keeping_pool(0, 0);
    let s = stream(1);
    let a = alloc_from(pool, 4096, s);
    let b = alloc_from(pool, 4096, s);
    assert_eq!(b, a + 4096);
    free_async(a, s);
    sync(s); // a's free has run: its block is free for every stream
    free_async(b, s); // b's is still queued: its block is free for s only
    let c = alloc_from(pool, 8192, s);
    assert_eq!(c, a, "both blocks are usable by s: one allocation spans them");
    free_async(c, s);
    sync(s);
    destroy(s);
    destroy_pool(pool);
}

/// Pool allocations are views of their chunk's memory: an allocation that reuses addresses sees
/// the bytes its predecessors left there (nothing is zeroed, nothing is fresh), as on a GPU.
#[test]
#[parallel]
fn allocations_that_reuse_an_address_share_its_bytes() {
    let ctl = bind(0);
    let pool = keeping_pool(0, 0);
    let (s, t) = (stream(1), stream(1));
    let a = alloc_from(pool, 4096, s);
    let b = alloc_from(pool, 4096, s);
    assert_eq!(b, a + 4096, "first fit: adjacent blocks of one chunk");
    memset32_async(a, 0x1111_1111, 1024, s);
    memset32_async(b, 0x2222_2222, 1024, s);
    free_async(a, s);
    free_async(b, s);
    // Same-stream reuse of the two (coalesced) blocks: one allocation spanning both.
    let c = alloc_from(pool, 8192, s);
    assert_eq!(c, a);
    sync(s);
    let seen = read_back(c, 8192);
    assert!(seen[..4096].iter().all(|&x| x == 0x11), "c does not see a's bytes: {:#x}", seen[0]);
    assert!(seen[4096..].iter().all(|&x| x == 0x22), "c does not see b's bytes: {:#x}", seen[4096]);
    // Writes through the new owner land in the same bytes the next owner (on another stream,
    // after the free completed: opportunistic reuse) sees, at an interior address.
    memset32_async(c + 4096, 0x3333_3333, 1024, s);
    free_async(c, s);
    sync(s);
    let d = alloc_from(pool, 8192, t);
    assert_eq!(d, c, "a completed free is reusable by any stream");
    sync(t);
    let seen = read_back(d, 8192);
    assert!(seen[..4096].iter().all(|&x| x == 0x11) && seen[4096..].iter().all(|&x| x == 0x33));
    free_async(d, t);
    sync(t);
    destroy(s);
    destroy(t);
    destroy_pool(pool);
    // All of this was legal: work before a free on its own stream runs before the free.
    assert!(uses_after_free(ctl).is_empty(), "{:#?}", uses_after_free(ctl));
}

/// How the block freed while stream A's read of it is pending reaches its next owner.
#[derive(Clone, Copy, Debug)]
enum HandOff {
    /// `cuMemFreeAsync(p, B)` then an allocation on B: same-stream reuse, immediate.
    FreeOnBReuseOnB,
    /// `cuMemFreeAsync(p, B)`, B synchronised (the free has run), then an allocation on C:
    /// REUSE_ALLOW_OPPORTUNISTIC.
    FreeOnBReuseOnC,
    /// `cuMemFree_v2(p)` (legal for pool memory, no synchronisation), then an allocation on B.
    MemFreeReuseOnB,
}

/// Runs one hand-off: A fills the block with 0xAA, then (held back by a gate) copies it to pinned
/// memory; meanwhile the block is freed and reused by the next owner, which fills it with 0xBB.
/// `ordered`: B waits for an event recorded on A after the copy before freeing (only with
/// `FreeOnBReuseOnB`). Returns what A's copy read and the block's address.
fn hand_off_while_a_reads(how: HandOff, ordered: bool) -> (Vec<u8>, CUdeviceptr) {
    const N: usize = 64 << 10;
    let pool = keeping_pool(0, 0);
    let (a_s, b_s, c_s) = (stream(1), stream(1), stream(1));
    let p = alloc_from(pool, N, a_s);
    memset32_async(p, 0xAAAA_AAAA, N / 4, a_s);
    sync(a_s); // A's write is done: only its read (below) is pending when the block moves on
    let host = pinned(N);
    let gate = Gate::block(a_s);
    // SAFETY: `host` is pinned memory of N bytes and `p` a live pool allocation of N bytes.
    ok(unsafe { cu::cuMemcpyDtoHAsync_v2(host.cast(), p, N, a_s) }); // pending behind the gate
    let e = event();
    if ordered {
        // SAFETY: plain FFI calls on live handles.
        unsafe {
            ok(cu::cuEventRecord(e, a_s));
            ok(cu::cuStreamWaitEvent(b_s, e, 0));
        }
    }
    let next = match how {
        HandOff::FreeOnBReuseOnB => {
            free_async(p, b_s);
            b_s
        }
        HandOff::FreeOnBReuseOnC => {
            free_async(p, b_s);
            sync(b_s);
            c_s
        }
        HandOff::MemFreeReuseOnB => {
            dfree(p);
            b_s
        }
    };
    let q = alloc_from(pool, N, next);
    assert_eq!(q, p, "{how:?}: the next owner did not get A's block, the test would prove nothing");
    memset32_async(q, 0xBBBB_BBBB, N / 4, next);
    if ordered {
        settle();
        // SAFETY: plain FFI call.
        assert_eq!(unsafe { cu::cuStreamQuery(next) }, CUresult::CUDA_ERROR_NOT_READY, "B waits for A");
    } else {
        sync(next); // nothing holds the next owner back: its write lands before A's read
    }
    gate.open();
    sync(a_s);
    sync(next);
    let seen = peek(host, N);
    free_async(q, next);
    sync(next);
    pfree(host);
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuEventDestroy_v2(e) });
    for s in [a_s, b_s, c_s] {
        destroy(s);
    }
    destroy_pool(pool);
    (seen, p)
}

/// A block handed to another user while stream A's earlier work on it is still pending — with no
/// dependency between them — really is shared: A reads the new owner's data (corruption a GPU
/// would show), and the simulator reports A's operation as a use after free.
#[test]
#[serial] // holds a stream with a gate (in `hand_off_while_a_reads`): see `Gate`
fn a_block_reused_before_pending_work_on_it_ran_is_corrupted_and_reported() {
    let ctl = bind(0);
    for how in [HandOff::FreeOnBReuseOnB, HandOff::FreeOnBReuseOnC, HandOff::MemFreeReuseOnB] {
        let before = uses_after_free(ctl).len();
        let (seen, p) = hand_off_while_a_reads(how, false);
        assert!(
            seen.iter().all(|&x| x == 0xBB),
            "{how:?}: A should have read the new owner's bytes, read {:#x}",
            seen[0]
        );
        let v = uses_after_free(ctl).split_off(before);
        assert_eq!(v.len(), 1, "{how:?}: exactly A's copy is reported: {v:#?}");
        assert!(v[0].message.contains(&format!("[{p:#x}, +{}", 64 << 10)), "{}", v[0].message);
        assert_eq!(v[0].function, "cuMemcpyDtoHAsync_v2", "the operation's API is named");
        assert_eq!(v[0].code_name, "CUDA_SUCCESS", "the enqueueing call itself succeeded");
        let expected = match how {
            HandOff::MemFreeReuseOnB => "used after its free: cuMemFree_v2",
            _ => "used after its stream-ordered free: cuMemFreeAsync",
        };
        assert!(v[0].message.contains(expected), "{how:?}: {}", v[0].message);
    }
}

/// The same hand-off with an event dependency (B waits for A's copy before freeing): A reads its
/// own data and nothing is reported.
#[test]
#[serial] // holds a stream with a gate (in `hand_off_while_a_reads`): see `Gate`
fn a_block_handed_on_through_an_event_dependency_is_intact() {
    let ctl = bind(0);
    let (seen, _) = hand_off_while_a_reads(HandOff::FreeOnBReuseOnB, true);
    assert!(seen.iter().all(|&x| x == 0xAA), "A read {:#x} instead of its own data", seen[0]);
    assert!(uses_after_free(ctl).is_empty(), "{:#?}", uses_after_free(ctl));
}

/// A pool allocation may be used by work ordered after it in stream order or after the host
/// synchronised with it (§8.1). The driver returns no error for a use on another stream that is
/// neither; the simulator logs it (code SUCCESS), once per allocation, naming the call.
#[test]
#[serial] // counts its violations: a parallel test draining the device would observe its allocations
fn a_pool_allocation_used_on_another_stream_before_it_is_ordered_is_logged() {
    let ctl = bind(0);
    let (a, b) = (stream(1), stream(1)); // non-blocking: no implicit ordering between them
    // (call, address) of each logged use (addresses are reused: they are checked step by step).
    let unordered = || -> Vec<(String, String)> {
        ctl.violations_on_this_thread()
            .into_iter()
            .filter(|v| {
                v.code_name == "CUDA_SUCCESS" && v.message.contains("before its allocation is ordered")
            })
            .map(|v| (v.function, v.message.split(' ').nth(2).unwrap_or_default().to_string()))
            .collect()
    };
    let alloc_on = |s: CUstream| {
        let mut p = 0;
        // SAFETY: valid out-pointer and live stream.
        ok(unsafe { cu::cuMemAllocAsync(&mut p, 4096, s) });
        p
    };
    let memset_on = |p: CUdeviceptr, s: CUstream| {
        // SAFETY: plain FFI call on a live allocation and stream.
        ok(unsafe { cu::cuMemsetD8Async(p, 1, 4096, s) })
    };
    let free_on = |p: CUdeviceptr, s: CUstream| {
        // SAFETY: plain FFI call on a live pool allocation and stream.
        ok(unsafe { cu::cuMemFreeAsync(p, s) })
    };
    let sync = |s: CUstream| {
        // SAFETY: plain FFI call on a live stream.
        ok(unsafe { cu::cuStreamSynchronize(s) })
    };

    // Unordered: allocated on `a`, used on `b` at once; logged once.
    let p = alloc_on(a);
    memset_on(p, b);
    memset_on(p, b);
    free_on(p, b);
    let memset = ("cuMemsetD8Async".to_string(), format!("{p:#x}"));
    assert_eq!(unordered(), vec![memset.clone()]);
    sync(b);

    // Ordered by an event recorded after the allocation.
    let q = alloc_on(a);
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer; live event and streams.
    unsafe {
        ok(cu::cuEventCreate(&mut e, 2));
        ok(cu::cuEventRecord(e, a));
        ok(cu::cuStreamWaitEvent(b, e, 0));
    }
    memset_on(q, b);
    free_on(q, b);
    sync(b);
    // Observed by the host: the allocating stream was synchronised.
    let r = alloc_on(a);
    sync(a);
    memset_on(r, b);
    free_on(r, b);
    sync(b);
    // Same stream: always ordered.
    let s = alloc_on(a);
    memset_on(s, a);
    free_on(s, a);
    sync(a);
    assert_eq!(unordered(), vec![memset.clone()], "ordered uses are not logged");
    // A free on another stream is a use too.
    let t = alloc_on(a);
    free_on(t, b);
    assert_eq!(unordered(), vec![memset, ("cuMemFreeAsync".to_string(), format!("{t:#x}"))]);
    sync(a);
    sync(b);
    // SAFETY: a live event, destroyed once.
    ok(unsafe { cu::cuEventDestroy_v2(e) });
    destroy(a);
    destroy(b);
}

/// The violations "used before its allocation is ordered" logged on this thread.
fn unordered_uses(ctl: &cumem_sim::Control) -> Vec<cumem_sim::Violation> {
    ctl.violations_on_this_thread()
        .into_iter()
        .filter(|v| v.code_name == "CUDA_SUCCESS" && v.message.contains("before its allocation is ordered"))
        .collect()
}

fn alloc_async(s: CUstream) -> CUdeviceptr {
    let mut p = 0;
    // SAFETY: valid out-pointer and live stream.
    ok(unsafe { cu::cuMemAllocAsync(&mut p, 4096, s) });
    p
}

fn memset_async(p: CUdeviceptr, s: CUstream) {
    // SAFETY: plain FFI call on a live allocation and stream.
    ok(unsafe { cu::cuMemsetD8Async(p, 7, 4096, s) });
}

fn record(e: CUevent, s: CUstream) {
    // SAFETY: plain FFI call on a live event and stream.
    ok(unsafe { cu::cuEventRecord(e, s) });
}

fn wait_event(s: CUstream, e: CUevent) {
    // SAFETY: plain FFI call on a live stream and event.
    ok(unsafe { cu::cuStreamWaitEvent(s, e, 0) });
}

fn destroy_event(e: CUevent) {
    // SAFETY: a live event, destroyed once.
    ok(unsafe { cu::cuEventDestroy_v2(e) });
}

/// Work on the legacy stream is ordered after the blocking streams' work so far, even when that
/// work (here only the allocation itself) has already completed; a blocking stream's later work is
/// ordered after it in turn.
#[test]
#[serial] // a parallel test's device drain would observe its allocation: the check would not be exercised
fn a_pool_allocation_ordered_through_the_legacy_stream_is_not_logged() {
    let ctl = bind(0);
    let (a, b) = (stream(0), stream(0));
    let p = alloc_async(a);
    settle();
    memset_async(p, std::ptr::null_mut());
    memset_async(p, b);
    free_async(p, b);
    sync(b);
    assert!(unordered_uses(ctl).is_empty(), "{:?}", unordered_uses(ctl));
    destroy(a);
    destroy(b);
}

/// A synchronous copy waits for the legacy stream, which waited for the blocking allocating
/// stream: the host has observed the allocation, any stream may use it.
#[test]
#[serial] // a parallel test's device drain would observe its allocation: the check would not be exercised
fn a_pool_allocation_observed_through_a_synchronous_copy_is_not_logged() {
    let ctl = bind(0);
    let (a, b) = (stream(0), stream(1));
    let p = alloc_async(a);
    settle();
    assert_eq!(read_back(p, 16).len(), 16);
    memset_async(p, b);
    free_async(p, b);
    sync(b);
    assert!(unordered_uses(ctl).is_empty(), "{:?}", unordered_uses(ctl));
    destroy(a);
    destroy(b);
}

/// An event recorded on the legacy stream after the allocation on a blocking stream orders the
/// streams that wait for it.
#[test]
#[serial] // a parallel test's device drain would observe its allocation: the check would not be exercised
fn a_pool_allocation_ordered_by_an_event_on_the_legacy_stream_is_not_logged() {
    let ctl = bind(0);
    let (a, b) = (stream(0), stream(1));
    let e = event();
    let p = alloc_async(a);
    settle();
    record(e, std::ptr::null_mut());
    wait_event(b, e);
    memset_async(p, b);
    free_async(p, b);
    sync(b);
    assert!(unordered_uses(ctl).is_empty(), "{:?}", unordered_uses(ctl));
    destroy_event(e);
    destroy(a);
    destroy(b);
}

/// The chain allocation → E1 → stream C → E2 → host holds after C was destroyed and drained.
#[test]
#[serial] // a parallel test's device drain would observe its allocation: the check would not be exercised
fn a_pool_allocation_ordered_through_a_destroyed_stream_is_not_logged() {
    let ctl = bind(0);
    let (a, b, c) = (stream(1), stream(1), stream(1));
    let (e1, e2) = (event(), event());
    let p = alloc_async(a);
    record(e1, a);
    wait_event(c, e1);
    record(e2, c);
    destroy(c);
    // SAFETY: a live event.
    ok(unsafe { cu::cuEventSynchronize(e2) });
    memset_async(p, b);
    free_async(p, b);
    sync(b);
    assert!(unordered_uses(ctl).is_empty(), "{:?}", unordered_uses(ctl));
    destroy_event(e1);
    destroy_event(e2);
    destroy(a);
    destroy(b);
}

/// A stream that waits for an event recorded after the allocation is ordered after it, also once
/// the allocating stream was destroyed and has drained.
#[test]
#[serial] // a parallel test's device drain would observe its allocation: the check would not be exercised
fn a_pool_allocation_of_a_destroyed_stream_ordered_by_its_event_is_not_logged() {
    let ctl = bind(0);
    let (a, b) = (stream(1), stream(1));
    let e = event();
    let p = alloc_async(a);
    record(e, a);
    destroy(a);
    settle();
    wait_event(b, e);
    memset_async(p, b);
    free_async(p, b);
    sync(b);
    assert!(unordered_uses(ctl).is_empty(), "{:?}", unordered_uses(ctl));
    destroy_event(e);
    destroy(b);
}

/// A stream that waited for another's free keeps that dependency once the freeing stream was
/// destroyed and has drained: with OPPORTUNISTIC off, only FOLLOW_EVENT_DEPENDENCIES allows the
/// reuse, and it takes the freed block instead of growing the pool.
#[test]
#[serial] // no other test's allocation may be pending when A goes, or A's waits would stay for it
fn reuse_follows_an_event_dependency_on_a_destroyed_freeing_stream() {
    bind(0);
    let pool = keeping_pool(0, 0);
    set_int(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, 0);
    set_int(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, 0);
    assert_eq!(get_int(pool, CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES), 1);
    // A whole chunk: an allocation that may not take the freed block needs a new one.
    let size = 32 << 20;
    let (a, b) = (stream(1), stream(1));
    let e = event();
    let p = alloc_from(pool, size, a);
    free_async(p, a);
    record(e, a);
    wait_event(b, e);
    // The host observes A's work (not a dependency of B) and A goes at once, drained.
    sync(a);
    destroy(a);
    let reserved = get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    let q = alloc_from(pool, size, b);
    assert_eq!(q, p, "B waited for A's free: FOLLOW_EVENT_DEPENDENCIES lets B reuse the block");
    assert_eq!(get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), reserved, "the pool did not grow");
    free_async(q, b);
    sync(b);
    destroy_event(e);
    destroy(b);
    destroy_pool(pool);
}

/// An event recorded before the allocation does not order it, neither for a stream that waits
/// for it nor for the host that synchronises with it.
#[test]
#[serial] // counts its violations: a parallel test draining the device would observe its allocations
fn an_event_recorded_before_a_pool_allocation_does_not_order_it() {
    let ctl = bind(0);
    let (a, b) = (stream(1), stream(1));
    let e = event();
    let before = alloc_async(a);
    memset_async(before, a);
    record(e, a);
    let p = alloc_async(a);
    wait_event(b, e);
    memset_async(p, b);
    let logged = unordered_uses(ctl);
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert!(logged[0].message.contains(&format!("{p:#x}")), "{logged:?}");
    sync(b);

    let q = alloc_async(a);
    // SAFETY: a live event.
    ok(unsafe { cu::cuEventSynchronize(e) });
    memset_async(q, b);
    let logged = unordered_uses(ctl);
    assert_eq!(logged.len(), 2, "{logged:?}");
    assert!(logged[1].message.contains(&format!("{q:#x}")), "{logged:?}");
    sync(b);
    sync(a);
    free_async(before, a);
    free_async(p, a);
    free_async(q, a);
    sync(a);
    destroy_event(e);
    destroy(a);
    destroy(b);
}
