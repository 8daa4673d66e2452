//! Managed memory: allocation rules, host visibility, attributes, copies and memsets, attachment,
//! advice, prefetch and range attributes.

mod common;

use std::ffi::c_void;

use common::*;
use cudarc::driver::sys::{self as cu, CUdeviceptr, CUmem_advise, CUmem_range_attribute, CUresult};
use serial_test::{parallel, serial};

use CUmem_advise::*;
use CUmem_range_attribute::*;

const GLOBAL: u32 = 1;
const HOST: u32 = 2;
const SINGLE: u32 = 4;
const PAGE: usize = 4096;

fn managed(bytes: usize) -> CUdeviceptr {
    let mut p = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocManaged(&mut p, bytes, GLOBAL) });
    p
}

fn range_i32(attr: CUmem_range_attribute, p: CUdeviceptr, n: usize) -> i32 {
    let mut v = 0x5a5a_5a5ai32;
    // SAFETY: 4 writable bytes.
    ok(unsafe { cu::cuMemRangeGetAttribute((&mut v as *mut i32).cast(), 4, attr, p, n) });
    v
}

fn accessed_by(p: CUdeviceptr, n: usize) -> [i32; 4] {
    let mut v = [0x11i32; 4];
    // SAFETY: 16 writable bytes.
    ok(unsafe {
        cu::cuMemRangeGetAttribute(v.as_mut_ptr().cast(), 16, CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY, p, n)
    });
    v
}

fn advise(p: CUdeviceptr, n: usize, a: CUmem_advise, dev: i32) -> CUresult {
    // SAFETY: plain FFI call.
    unsafe { cu::cuMemAdvise(p, n, a, dev) }
}

fn loc(kind: cu::CUmemLocationType, id: i32) -> cu::CUmemLocation {
    cu::CUmemLocation { type_: kind, id }
}

/// The live report's attachment of the managed allocation at `p`: `(flags, stream)`.
fn attachment(ctl: &cumem_sim::control::Control, p: CUdeviceptr) -> (Option<u32>, Option<u64>) {
    let a = ctl.live_report().allocations.into_iter().find(|a| a.ptr == p).expect("listed");
    (a.attach, a.attach_stream)
}

fn attach(s: cu::CUstream, p: CUdeviceptr, flags: u32) -> CUresult {
    // SAFETY: plain FFI call; the simulator checks the stream and the pointer.
    unsafe { cu::cuStreamAttachMemAsync(s, p, 0, flags) }
}

fn sync(s: cu::CUstream) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
}

/// Attaches `p` to `s` with `flags` and waits for the stream: the live report names both.
#[track_caller]
fn attach_synced(ctl: &cumem_sim::control::Control, s: cu::CUstream, p: CUdeviceptr, flags: u32) {
    ok(attach(s, p, flags));
    sync(s);
    assert_eq!(attachment(ctl, p), (Some(flags), Some(s as u64)));
}

/// The live report's attachment of `p` is `want` after the engine has had time to run what it
/// could (work held by a gate stays queued).
#[track_caller]
fn assert_settled(
    ctl: &cumem_sim::control::Control,
    p: CUdeviceptr,
    want: (Option<u32>, Option<u64>),
    why: &str,
) {
    settle();
    assert_eq!(attachment(ctl, p), want, "{why}");
}

/// Opens `gate`, waits for the current context's work, and checks that `p` is back to its
/// allocation's flags (GLOBAL, no stream).
#[track_caller]
fn open_drain_and_assert_reverted(ctl: &cumem_sim::control::Control, p: CUdeviceptr, gate: Gate, why: &str) {
    gate.open();
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuCtxSynchronize() });
    assert_eq!(attachment(ctl, p), (Some(GLOBAL), None), "{why}");
}

#[test]
#[parallel]
fn allocation_rules() {
    let ctl = bind(0);
    let mut p = 0x99u64;
    // SAFETY: valid out-pointers (or NULL as the misuse).
    unsafe {
        for flags in [0, SINGLE, GLOBAL | HOST, 8] {
            assert_eq!(
                cu::cuMemAllocManaged(&mut p, 64, flags),
                CUresult::CUDA_ERROR_INVALID_VALUE,
                "flags {flags}"
            );
        }
        assert_eq!(cu::cuMemAllocManaged(&mut p, 0, GLOBAL), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            cu::cuMemAllocManaged(std::ptr::null_mut(), 64, GLOBAL),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(p, 0x99);
        ok(cu::cuMemAllocManaged(&mut p, 100, HOST));
        assert_eq!(p % 256, 0);
        let report = ctl.live_report();
        let a = report.allocations.iter().find(|a| a.ptr == p).expect("listed");
        assert_eq!((a.kind.as_str(), a.bytes, a.attach), ("managed", 100, Some(HOST)));
        assert_eq!(cu::cuMemFreeHost(p as *mut c_void), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuMemFree_v2(p + 4), CUresult::CUDA_ERROR_INVALID_VALUE);
        dfree(p);
        assert_eq!(cu::cuMemFree_v2(p), CUresult::CUDA_ERROR_INVALID_VALUE);
        bind(3);
        assert_eq!(cu::cuMemAllocManaged(&mut p, 64, GLOBAL), CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn host_sees_managed_memory_at_the_same_address() {
    bind(0);
    let n = 3 * PAGE;
    let p = managed(n);
    let host = p as *mut u8;
    poke(host, n, 0x21);
    assert!(read_back(p, n).iter().all(|&b| b == 0x21), "device reads what the host wrote");
    // A synchronous memset into managed memory is complete when it returns.
    // SAFETY: plain FFI call on a live allocation.
    ok(unsafe { cu::cuMemsetD8_v2(p + 10, 0x42, 20) });
    let v = peek(host, n);
    assert!(v[10..30].iter().all(|&b| b == 0x42) && v[9] == 0x21 && v[30] == 0x21);
    // Synchronous copies into managed memory are complete when they return.
    let src = [7u8; 100];
    // SAFETY: `src` has 100 bytes.
    ok(unsafe { cu::cuMemcpyHtoD_v2(p + 100, src.as_ptr().cast(), 100) });
    assert!(peek(host, 200)[100..200].iter().all(|&b| b == 7));
    let d = dalloc(n);
    // SAFETY: live allocations of `n` bytes.
    ok(unsafe { cu::cuMemcpyDtoD_v2(d, p, n) });
    // SAFETY: as above.
    ok(unsafe { cu::cuMemcpy(p + PAGE as u64, d, 10) });
    assert_eq!(peek(host, PAGE + 10)[PAGE..], read_back(d, 10)[..]);
    // Async memsets run in stream order.
    let s = stream(0);
    let gate = Gate::block(s);
    // SAFETY: plain FFI call on a live allocation.
    ok(unsafe { cu::cuMemsetD8Async(p, 0x99, 8, s) });
    settle();
    assert_eq!(peek(host, 1)[0], 0x21, "the async memset has not run yet");
    gate.open();
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
    assert!(peek(host, 8).iter().all(|&b| b == 0x99));
    // Bounds are per allocation.
    // SAFETY: plain FFI call; the overrun is the misuse under test.
    assert_eq!(unsafe { cu::cuMemsetD8_v2(p + n as u64 - 1, 0, 2) }, CUresult::CUDA_ERROR_INVALID_VALUE);
    destroy(s);
    dfree(d);
    dfree(p);
}

#[test]
#[parallel]
fn pointer_attributes_of_managed_memory() {
    bind(0);
    let p = managed(1000);
    // SAFETY: valid out-pointers sized per attribute.
    unsafe {
        let mut t = 0u32;
        ok(cu::cuPointerGetAttribute(
            (&mut t as *mut u32).cast(),
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            p + 8,
        ));
        assert_eq!(t, 2, "managed memory reports DEVICE");
        ok(cu::cuPointerGetAttribute(
            (&mut t as *mut u32).cast(),
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            p,
        ));
        assert_eq!(t, 1);
        let mut h = 0u64;
        ok(cu::cuPointerGetAttribute(
            (&mut h as *mut u64).cast(),
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_HOST_POINTER,
            p + 8,
        ));
        assert_eq!(h, p + 8);
        let mut f = 0u32;
        ok(cu::cuMemHostGetFlags(&mut f, (p + 8) as *mut c_void));
        assert_eq!(f, 2);
        let (mut base, mut size) = (0u64, 0usize);
        ok(cu::cuMemGetAddressRange_v2(&mut base, &mut size, p + 999));
        assert_eq!((base, size), (p, 1000));
    }
    dfree(p);
}

#[test]
#[parallel]
fn attach_rules_and_reversion() {
    let ctl = bind(0);
    let p = managed(2 * PAGE);
    let s = stream(0);
    // SAFETY: plain FFI calls.
    unsafe {
        let e = CUresult::CUDA_ERROR_INVALID_VALUE;
        assert_eq!(cu::cuStreamAttachMemAsync(s, p, PAGE, SINGLE), e, "partial length");
        assert_eq!(cu::cuStreamAttachMemAsync(s, p + 8, 0, SINGLE), e, "interior pointer");
        assert_eq!(cu::cuStreamAttachMemAsync(s, p, 0, 0), e);
        assert_eq!(cu::cuStreamAttachMemAsync(s, p, 0, GLOBAL | SINGLE), e);
        assert_eq!(cu::cuStreamAttachMemAsync(std::ptr::null_mut(), p, 0, SINGLE), e);
        let d = dalloc(64);
        assert_eq!(cu::cuStreamAttachMemAsync(s, d, 0, HOST), e, "not managed");
        dfree(d);
        ok(cu::cuStreamAttachMemAsync(s, p, 2 * PAGE, SINGLE));
        sync(s);
        assert_eq!(attachment(ctl, p), (Some(SINGLE), Some(s as u64)));
        ok(cu::cuStreamAttachMemAsync(std::ptr::null_mut(), p, 0, HOST));
        ok(cu::cuStreamAttachMemAsync(s, p, 0, SINGLE));
        sync(s);
    }
    destroy(s);
    assert_eq!(attachment(ctl, p), (Some(GLOBAL), None), "SINGLE reverts when its stream dies");
    dfree(p);
}

/// An attachment is a stream operation (the driver documents that it "will only take effect when
/// previous work in stream has completed"): queued behind held work, it has not taken effect,
/// and it has once the stream has been synchronised. One still queued when its stream is
/// destroyed runs, and reverts once that stream has drained.
#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn an_attachment_takes_effect_in_stream_order() {
    let ctl = bind(0);
    let p = managed(PAGE);
    let s = stream(0);
    let gate = Gate::block(s);
    ok(attach(s, p, HOST));
    assert_settled(ctl, p, (Some(GLOBAL), None), "queued behind the gate: not in effect");
    // Later work of the stream does not overtake it either.
    ok(attach(s, p, SINGLE));
    assert_settled(ctl, p, (Some(GLOBAL), None), "still queued");
    gate.open();
    sync(s);
    assert_eq!(attachment(ctl, p), (Some(SINGLE), Some(s as u64)), "both ran, in order");

    // Queued on a stream destroyed before it runs.
    let t = stream(0);
    let gate = Gate::block(t);
    ok(attach(t, p, HOST));
    ok(attach(t, p, SINGLE));
    destroy(t);
    assert_eq!(attachment(ctl, p), (Some(SINGLE), Some(s as u64)), "the queued attachments have not run");
    open_drain_and_assert_reverted(ctl, p, gate, "SINGLE to a destroyed stream reverts");
    destroy(s);
    dfree(p);
}

/// The live report's attachment of `p` once it differs from `from` (a bounded wait: the engine
/// runs the work a gate let through on its own thread).
fn attachment_change(
    ctl: &cumem_sim::control::Control,
    p: CUdeviceptr,
    from: (Option<u32>, Option<u64>),
) -> (Option<u32>, Option<u64>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let now = attachment(ctl, p);
        if now != from || std::time::Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Stream destruction is asynchronous: the driver documents that a SINGLE attachment's revert to
/// the allocation's default association "won't happen until all work in the stream has
/// completed". A stream destroyed with work still held on it keeps its attachment until the
/// work drains.
#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn a_single_attachment_reverts_once_its_destroyed_stream_drains() {
    let ctl = bind(0);
    let p = managed(PAGE);
    let t = stream(0);
    attach_synced(ctl, t, p, SINGLE);
    let gate = Gate::block(t);
    destroy(t);
    assert_settled(
        ctl,
        p,
        (Some(SINGLE), Some(t as u64)),
        "the destroyed stream's work has not completed: still attached",
    );
    open_drain_and_assert_reverted(ctl, p, gate, "drained: back to the allocation's flags");
    dfree(p);
}

/// An attachment queued on a stream destroyed before it runs takes effect when it runs, and
/// reverts only once the work queued after it has completed too.
#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn a_queued_single_attachment_on_a_destroyed_stream_reverts_after_the_later_work() {
    let ctl = bind(0);
    let p = managed(PAGE);
    // An attachment to another stream first, so that the queued one running is observable
    // whether or not it reverts at once.
    let s = stream(0);
    attach_synced(ctl, s, p, HOST);
    let before = (Some(HOST), Some(s as u64));
    let t = stream(0);
    let first = Gate::block(t);
    ok(attach(t, p, SINGLE));
    let second = Gate::block(t);
    destroy(t);
    assert_settled(ctl, p, before, "queued behind the first gate: not run");
    first.open();
    assert_eq!(
        attachment_change(ctl, p, before),
        (Some(SINGLE), Some(t as u64)),
        "it ran; the work after it has not completed: no revert yet"
    );
    assert_settled(ctl, p, (Some(SINGLE), Some(t as u64)), "still held by the second gate");
    open_drain_and_assert_reverted(ctl, p, second, "drained: back to the allocation's flags");
    destroy(s);
    dfree(p);
}

/// Destroying a context removes its streams, drained, as a drained destroyed stream goes: managed
/// memory of another context on the same device attached to one of them no longer names it, and
/// a SINGLE attachment reverts to the allocation's flags. Its legacy stream too, to which a HOST
/// attachment was made.
#[test]
#[parallel]
fn destroying_a_context_reverts_attachments_to_its_streams() {
    let ctl = bind(0);
    let single = managed(PAGE);
    let host = managed(PAGE);
    let mut c: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the new context on device 0 is pushed onto this thread's stack.
    ok(unsafe { cu::cuCtxCreate_v2(&mut c, 0, 0) });
    let s = stream(0);
    // CU_STREAM_LEGACY: the legacy stream of the current context, the created one.
    let legacy_stream = 1 as cu::CUstream;
    ok(attach(legacy_stream, host, HOST));
    sync(legacy_stream);
    let legacy = attachment(ctl, host).1;
    assert!(legacy.is_some(), "the HOST attachment names the created context's legacy stream");
    let mut popped: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuCtxPopCurrent_v2(&mut popped) });
    assert_eq!(popped, c);
    // Memory of the primary context, attached to a stream of the created one.
    attach_synced(ctl, s, single, SINGLE);
    // SAFETY: a context this test created; not current on this thread.
    ok(unsafe { cu::cuCtxDestroy_v2(c) });
    assert_eq!(attachment(ctl, single), (Some(GLOBAL), None), "the stream went with its context");
    assert_eq!(attachment(ctl, host), (Some(HOST), None), "the legacy stream went with its context");
    dfree(single);
    dfree(host);
}

/// An attachment still queued when its allocation is freed (here by destroying the allocation's
/// context, which waits for that context's work only) does nothing when it runs: the engine
/// carries on, and a new allocation at the same address keeps its own attachment.
#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn an_attachment_queued_for_a_freed_allocation_leaves_its_address_alone() {
    // The new allocation lands at the freed address when nothing else has mapped memory in
    // between, which another thread of the process (the test harness's) can do, rarely: try again.
    let reused = (0..8).any(|_| stale_attach_on_a_new_allocation(bind(0)));
    assert!(reused, "no new managed allocation reused the freed address in 8 tries");
}

/// One try of the test above: whether the new allocation reused the freed address (every
/// assertion holds either way).
fn stale_attach_on_a_new_allocation(ctl: &cumem_sim::control::Control) -> bool {
    let mut c: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; device 2 has no context of the shared setup.
    ok(unsafe { cu::cuCtxCreate_v2(&mut c, 0, 2) });
    let n = 3 * PAGE;
    let p = managed(n);
    let mut popped: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuCtxPopCurrent_v2(&mut popped) });
    assert_eq!(popped, c);
    let s = stream(0);
    let gate = Gate::block(s);
    ok(attach(s, p, SINGLE));
    // SAFETY: a context this function created; nothing of it is current.
    ok(unsafe { cu::cuCtxDestroy_v2(c) });
    assert!(ctl.live_report().allocations.iter().all(|a| a.ptr != p), "freed with its context");
    let mut q = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocManaged(&mut q, n, HOST) });
    gate.open();
    sync(s);
    assert_eq!(attachment(ctl, q), (Some(HOST), None), "the stale attachment left the new allocation alone");
    // The engine still runs the stream's work.
    attach_synced(ctl, s, q, GLOBAL);
    destroy(s);
    dfree(q);
    q == p
}

#[test]
#[parallel]
fn advice_is_recorded_per_range_with_mixed_answers() {
    bind(0);
    let n = 4 * PAGE;
    let p = managed(n);
    let all = |a| range_i32(a, p, n);
    assert_eq!(all(CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY), 0);
    assert_eq!(all(CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION), -2, "unset");
    assert_eq!(all(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION), -2, "never prefetched");
    ok(advise(p + PAGE as u64, PAGE, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, 0));
    ok(advise(p, 1, CU_MEM_ADVISE_SET_READ_MOSTLY, 99)); // device ignored for READ_MOSTLY
    assert_eq!(range_i32(CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION, p + PAGE as u64 + 5, 100), 0);
    assert_eq!(all(CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION), -2, "mixed");
    assert_eq!(range_i32(CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, p + 100, 10), 1);
    assert_eq!(all(CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY), 0, "not on every page");
    ok(advise(p, n, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, -1));
    assert_eq!(all(CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION), -1, "CU_DEVICE_CPU");
    assert_eq!(all(CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE), 2, "HOST");
    ok(advise(p, n, CU_MEM_ADVISE_SET_ACCESSED_BY, -1));
    ok(advise(p, n, CU_MEM_ADVISE_SET_ACCESSED_BY, 0));
    ok(advise(p, PAGE, CU_MEM_ADVISE_SET_ACCESSED_BY, 2));
    assert_eq!(accessed_by(p, n), [0, -1, -2, -2]);
    assert_eq!(accessed_by(p, 10), [0, 2, -1, -2]);
    ok(advise(p, n, CU_MEM_ADVISE_UNSET_ACCESSED_BY, 0));
    assert_eq!(accessed_by(p, n), [-1, -2, -2, -2]);
    ok(advise(p, n, CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION, 77));
    assert_eq!(all(CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION), -2);
    assert_eq!(all(CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE), 0, "INVALID when unset");
    // v2: a device location.
    // SAFETY: plain FFI call.
    ok(unsafe {
        cu::cuMemAdvise_v2(
            p,
            PAGE,
            CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
            loc(cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, 2),
        )
    });
    assert_eq!(range_i32(CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE, p, PAGE), 1);
    assert_eq!(range_i32(CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID, p, PAGE), 2);
    dfree(p);
}

#[test]
#[parallel]
fn advice_validation() {
    let ctl = bind(0);
    let p = managed(PAGE);
    let d = dalloc(PAGE);
    let e = CUresult::CUDA_ERROR_INVALID_VALUE;
    assert_eq!(advise(d, 16, CU_MEM_ADVISE_SET_READ_MOSTLY, 0), e, "device memory");
    assert_eq!(advise(p, 0, CU_MEM_ADVISE_SET_READ_MOSTLY, 0), e, "count 0");
    assert_eq!(advise(p, PAGE + 1, CU_MEM_ADVISE_SET_READ_MOSTLY, 0), e, "past the end");
    assert_eq!(advise(p, 16, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, 64), CUresult::CUDA_ERROR_INVALID_DEVICE);
    assert_eq!(advise(p, 16, CU_MEM_ADVISE_SET_ACCESSED_BY, 9), CUresult::CUDA_ERROR_INVALID_DEVICE);
    // Device 1 has no CONCURRENT_MANAGED_ACCESS.
    assert_eq!(advise(p, 16, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, 1), CUresult::CUDA_ERROR_INVALID_DEVICE);
    // SAFETY: raw advice/attribute numbers and sizes are the misuse under test.
    unsafe {
        let raw_advise: unsafe extern "C" fn(CUdeviceptr, usize, u32, i32) -> CUresult = raw("cuMemAdvise");
        assert_eq!(raw_advise(p, 16, 7, 0), e);
        let mut v = [0i32; 2];
        let get = |size: usize, attr: CUmem_range_attribute, v: &mut [i32; 2]| {
            cu::cuMemRangeGetAttribute(v.as_mut_ptr().cast(), size, attr, p, 16)
        };
        assert_eq!(get(8, CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, &mut v), e);
        assert_eq!(get(6, CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY, &mut v), e);
        assert_eq!(get(0, CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY, &mut v), e);
        assert_eq!(
            cu::cuMemRangeGetAttribute(v.as_mut_ptr().cast(), 4, CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, d, 16),
            e
        );
        // v2 location types.
        let host_numa9 = loc(cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA, 9);
        assert_eq!(cu::cuMemAdvise_v2(p, 16, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, host_numa9), e);
        let invalid = loc(cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID, 0);
        assert_eq!(cu::cuMemAdvise_v2(p, 16, CU_MEM_ADVISE_SET_ACCESSED_BY, invalid), e);
        ok(cu::cuMemAdvise_v2(p, 16, CU_MEM_ADVISE_SET_READ_MOSTLY, invalid));
    }
    dfree(d);
    dfree(p);
    assert!(ctl.violations_on_this_thread().iter().any(|v| v.message.contains("not managed memory")));
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn prefetch_is_a_stream_operation() {
    bind(0);
    let p = managed(2 * PAGE);
    let s = stream(0);
    let gate = Gate::block(s);
    // SAFETY: plain FFI calls.
    unsafe {
        ok(cu::cuMemPrefetchAsync(p, PAGE, 0, s));
        assert_eq!(range_i32(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, p, PAGE), -2, "not run yet");
        gate.open();
        ok(cu::cuStreamSynchronize(s));
        assert_eq!(range_i32(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, p, PAGE), 0);
        assert_eq!(range_i32(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, p, 2 * PAGE), -2, "mixed");
        let host = loc(cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, 0);
        ok(cu::cuMemPrefetchAsync_v2(p, 2 * PAGE, host, 0, s));
        ok(cu::cuStreamSynchronize(s));
        assert_eq!(range_i32(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, p, 2 * PAGE), -1);
        assert_eq!(range_i32(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE, p, 2 * PAGE), 2);
        // Batch form.
        let (mut rm, mut pl) = (9i32, 9i32);
        let mut data = [(&mut rm as *mut i32).cast::<c_void>(), (&mut pl as *mut i32).cast()];
        let mut sizes = [4usize, 4];
        let mut attrs = [CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION];
        ok(cu::cuMemRangeGetAttributes(
            data.as_mut_ptr(),
            sizes.as_mut_ptr(),
            attrs.as_mut_ptr(),
            2,
            p,
            2 * PAGE,
        ));
        assert_eq!((rm, pl), (0, -1));
        // Misuse.
        assert_eq!(cu::cuMemPrefetchAsync_v2(p, 16, host, 1, s), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuMemPrefetchAsync(p, 16, 64, s), CUresult::CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(
            cu::cuMemPrefetchAsync(p, 16, 1, s),
            CUresult::CUDA_ERROR_INVALID_DEVICE,
            "no concurrent access"
        );
        assert_eq!(cu::cuMemPrefetchAsync(p, 3 * PAGE, -1, s), CUresult::CUDA_ERROR_INVALID_VALUE);
        let d = dalloc(64);
        assert_eq!(cu::cuMemPrefetchAsync(d, 16, 0, s), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            cu::cuMemPrefetchAsync(p, 16, 0, 0xbad0 as cu::CUstream),
            CUresult::CUDA_ERROR_INVALID_HANDLE
        );
        dfree(d);
    }
    destroy(s);
    dfree(p);
}

/// A thread's per-thread stream is its own and ends with it (it is not keyed by the OS thread
/// id, which a later thread may be given): once the thread has exited and the stream's queued
/// work has run, the stream is gone, so memory attached SINGLE to it reverts to its allocation's
/// association, as with a destroyed stream. The work still runs after the thread's exit.
#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn a_per_thread_stream_ends_after_its_thread_and_its_work() {
    let ctl = bind(0);
    let p = managed(PAGE);
    let d = dalloc(4);
    let held = stream(0);
    let gate = Gate::block(held);
    let mut opened: cu::CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer; handles from this test.
    unsafe {
        ok(cu::cuEventCreate(&mut opened, 0));
        ok(cu::cuEventRecord(opened, held));
    }
    let opened_addr = opened as usize;
    std::thread::spawn(move || {
        bind(0);
        let per_thread = 0x2 as cu::CUstream; // CU_STREAM_PER_THREAD
        ok(attach(per_thread, p, SINGLE));
        // SAFETY: a live event and a live 4-byte allocation.
        unsafe {
            ok(cu::cuStreamWaitEvent(per_thread, opened_addr as cu::CUevent, 0));
            ok(cu::cuMemsetD32Async(d, 7, 1, per_thread));
        }
    })
    .join()
    .unwrap();
    settle();
    let (flags, stream) = attachment(ctl, p);
    assert_eq!(flags, Some(SINGLE), "the exited thread's stream still has work queued");
    assert!(stream.is_some());
    gate.open();
    // The legacy stream waits for the per-thread stream (a blocking stream), also after its thread.
    sync(std::ptr::null_mut());
    assert_eq!(read_back(d, 4), 7u32.to_le_bytes());
    assert_eq!(attachment(ctl, p), (Some(GLOBAL), None), "the per-thread stream is gone");
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuEventDestroy_v2(opened) });
    destroy(held);
    dfree(d);
    dfree(p);
}
