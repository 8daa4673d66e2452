//! Which free block a stream-ordered allocation reuses: the smallest that fits, a free only as far
//! as the allocating stream is ordered after it, frees settled one by one as their stream reaches
//! them, and neighbouring blocks of different kinds taken together rather than growing the pool.
//! Addresses, bytes and the pool's counters are checked by value.

mod common;

use common::*;
use cudarc::driver::sys::{self as cu, CUdeviceptr, CUevent, CUmemPool_attribute, CUmemoryPool, CUstream};
use serial_test::{parallel, serial};

use CUmemPool_attribute::*;

const MIB: u64 = 1 << 20;
const CHUNK: u64 = 32 * MIB;

/// A fresh pool on device 0 that keeps its memory at synchronisation.
fn keeping_pool() -> CUmemoryPool {
    // SAFETY: an all-zero CUmemPoolProps is a valid value (every enum has a 0 variant).
    let mut p: cu::CUmemPoolProps = unsafe { std::mem::zeroed() };
    p.allocType = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 };
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    let mut keep = u64::MAX;
    // SAFETY: valid pointers; a u64 value for RELEASE_THRESHOLD.
    unsafe {
        ok(cu::cuMemPoolCreate(&mut pool, &p));
        ok(cu::cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, (&raw mut keep).cast()));
    }
    pool
}

fn destroy_pool(pool: CUmemoryPool) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuMemPoolDestroy(pool) });
}

fn get_u64(pool: CUmemoryPool, a: CUmemPool_attribute) -> u64 {
    let mut v = 0u64;
    // SAFETY: a u64 out-value for a cuuint64_t attribute.
    ok(unsafe { cu::cuMemPoolGetAttribute(pool, a, (&raw mut v).cast()) });
    v
}

fn used(pool: CUmemoryPool) -> u64 {
    get_u64(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
}

fn reserved(pool: CUmemoryPool) -> u64 {
    get_u64(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
}

fn alloc_from(pool: CUmemoryPool, bytes: u64, s: CUstream) -> CUdeviceptr {
    let mut p = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocFromPoolAsync(&mut p, bytes as usize, pool, s) });
    p
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

fn record_and_wait(e: CUevent, on: CUstream, waiter: CUstream) {
    // SAFETY: plain FFI calls on live handles.
    unsafe {
        ok(cu::cuEventRecord(e, on));
        ok(cu::cuStreamWaitEvent(waiter, e, 0));
    }
}

fn memset8(p: CUdeviceptr, v: u8, n: u64, s: CUstream) {
    // SAFETY: `p` is a live allocation of at least `n` bytes.
    ok(unsafe { cu::cuMemsetD8Async(p, v, n as usize, s) });
}

#[test]
#[parallel]
fn the_smallest_free_block_that_fits_is_reused_and_the_counters_follow() {
    bind(0);
    let pool = keeping_pool();
    let s = stream(1);
    // [big 64 KiB][used][small 8 KiB][used][rest of the chunk]
    let big = alloc_from(pool, 64 << 10, s);
    let sep1 = alloc_from(pool, 512, s);
    let small = alloc_from(pool, 8 << 10, s);
    let sep2 = alloc_from(pool, 512, s);
    assert_eq!((sep1, small, sep2), (big + (64 << 10), big + (64 << 10) + 512, big + (72 << 10) + 512));
    assert_eq!(used(pool), (64 << 10) + (8 << 10) + 1024);
    assert_eq!(reserved(pool), CHUNK);
    free_async(big, s);
    free_async(small, s);
    sync(s); // both frees have completed: free for every stream
    assert_eq!(used(pool), 1024);
    // 100 bytes are charged as 512 and go to the smallest hole, not the first one.
    let t = stream(1);
    let a = alloc_from(pool, 100, t);
    assert_eq!(a, small);
    assert_eq!(used(pool), 1024 + 512);
    // 40 KiB fits only the big hole; the small hole's remainder stays free.
    let b = alloc_from(pool, 40 << 10, t);
    assert_eq!(b, big);
    assert_eq!(used(pool), 1024 + 512 + (40 << 10));
    assert_eq!(reserved(pool), CHUNK, "nothing grew");
    for p in [a, b, sep1, sep2] {
        free_async(p, t);
    }
    sync(t);
    assert_eq!(used(pool), 0);
    assert_eq!(reserved(pool), CHUNK);
    destroy(s);
    destroy(t);
    destroy_pool(pool);
}

#[test]
#[serial] // holds a stream with a gate: a free elsewhere (implicit synchronisation) would wait for it
fn an_event_makes_reusable_only_the_frees_recorded_before_it() {
    bind(0);
    let pool = keeping_pool();
    let (s, t) = (stream(1), stream(1));
    let gate = Gate::block(s);
    let x = alloc_from(pool, 4096, s);
    let sep = alloc_from(pool, 4096, s);
    let y = alloc_from(pool, 4096, s);
    free_async(x, s);
    let e = event();
    record_and_wait(e, s, t); // T is ordered after x's free ...
    free_async(y, s); // ... but not after y's
    // Neither free has run (the gate holds S): only the dependency makes x reusable.
    assert_eq!(alloc_from(pool, 4096, t), x);
    let fresh = alloc_from(pool, 4096, t);
    assert_ne!(fresh, y, "y's free is after the event T waits for");
    assert!(fresh >= y + 4096, "nor does T overlap y: {fresh:#x}");
    assert_eq!(used(pool), 3 * 4096);
    gate.open();
    sync(s);
    for p in [x, fresh] {
        free_async(p, t);
    }
    free_async(sep, s);
    sync(t);
    sync(s);
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuEventDestroy_v2(e) });
    destroy(s);
    destroy(t);
    destroy_pool(pool);
}

#[test]
#[serial] // holds a stream with a gate: a free elsewhere (implicit synchronisation) would wait for it
fn completed_frees_become_reusable_one_by_one_in_their_streams_order() {
    bind(0);
    let pool = keeping_pool();
    let (s, t) = (stream(1), stream(1));
    let x = alloc_from(pool, 8192, s);
    let sep = alloc_from(pool, 512, s);
    let y = alloc_from(pool, 8192, s);
    let sep2 = alloc_from(pool, 512, s);
    free_async(x, s);
    let e = event();
    // SAFETY: plain FFI call on live handles.
    ok(unsafe { cu::cuEventRecord(e, s) });
    let gate = Gate::block(s);
    free_async(y, s);
    // SAFETY: plain FFI call on a live handle.
    ok(unsafe { cu::cuEventSynchronize(e) }); // x's free has run, y's is held behind the gate
    // T has no dependency on S: the completed free is reusable (opportunistic), the pending one
    // is not.
    assert_eq!(alloc_from(pool, 8192, t), x);
    let fresh = alloc_from(pool, 8192, t);
    assert_ne!(fresh, y);
    gate.open();
    sync(s);
    // Now y's free has completed too.
    assert_eq!(alloc_from(pool, 8192, t), y);
    for p in [x, fresh, y] {
        free_async(p, t);
    }
    free_async(sep, s);
    free_async(sep2, s);
    sync(t);
    sync(s);
    assert_eq!(used(pool), 0);
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuEventDestroy_v2(e) });
    destroy(s);
    destroy(t);
    destroy_pool(pool);
}

/// A completed free next to a pending one of the same stream: neither fits alone, together they
/// do, and the pool reuses them (with their bytes) rather than growing.
#[test]
#[serial] // holds a stream with a gate: a free elsewhere (implicit synchronisation) would wait for it
fn neighbouring_frees_of_different_kinds_are_reused_together_before_the_pool_grows() {
    bind(0);
    let pool = keeping_pool();
    let s = stream(1);
    let a = alloc_from(pool, 4096, s);
    let b = alloc_from(pool, 4096, s);
    let rest = alloc_from(pool, CHUNK - 8192, s); // the chunk is full
    assert_eq!((b, rest), (a + 4096, a + 8192));
    assert_eq!(reserved(pool), CHUNK);
    memset8(a, 0xA1, 4096, s);
    memset8(b, 0xB2, 4096, s);
    free_async(a, s);
    sync(s); // a's free has run: free for every stream
    let gate = Gate::block(s);
    free_async(b, s); // b's is pending: free for S only
    let c = alloc_from(pool, 8192, s);
    assert_eq!(c, a, "one allocation spans a and b");
    assert_eq!(reserved(pool), CHUNK, "the pool did not grow");
    assert_eq!(used(pool), CHUNK);
    gate.open();
    sync(s);
    let seen = read_back(c, 8192);
    assert!(seen[..4096].iter().all(|&x| x == 0xA1), "c sees a's bytes");
    assert!(seen[4096..].iter().all(|&x| x == 0xB2), "c sees b's bytes");
    free_async(c, s);
    free_async(rest, s);
    sync(s);
    assert_eq!(used(pool), 0);
    destroy(s);
    destroy_pool(pool);
}
