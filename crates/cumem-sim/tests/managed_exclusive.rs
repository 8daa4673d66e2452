//! Managed memory on a device without CONCURRENT_MANAGED_ACCESS: the GPU has it to itself while
//! queued work uses it, and a host access meanwhile faults, as on the real driver (SIGSEGV). The
//! fault is shown in a child process (this test binary, filtered to one test); the rest checks that
//! the host gets the memory back once the work is done, and that devices with concurrent access
//! (or work that was refused) never keep the host out.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use common::*;
use cudarc::driver::sys::{self as cu, CUdeviceptr, CUresult};
use serial_test::serial;

const GLOBAL: u32 = 1;
/// Device without concurrent managed access in the shared configuration.
const EXCLUSIVE: usize = 1;
/// Device with it.
const CONCURRENT: usize = 0;
const CHILD: &str = "CUMEM_SIM_MANAGED_EXCLUSIVE_CHILD";

fn managed(bytes: usize) -> CUdeviceptr {
    let mut p = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocManaged(&mut p, bytes, GLOBAL) });
    p
}

/// Queues a copy of `n` bytes from fresh pinned memory (filled with `v`) into `dst` on `s`; returns
/// the pinned memory, to free once the copy is done.
fn queue_fill(dst: CUdeviceptr, n: usize, v: u8, s: cu::CUstream) -> *mut u8 {
    let src = pinned(n);
    poke(src, n, v);
    // SAFETY: `src` holds `n` bytes and stays allocated until the caller has synchronised.
    ok(unsafe { cu::cuMemcpyHtoDAsync_v2(dst, src.cast(), n, s) });
    src
}

fn sync(s: cu::CUstream) {
    // SAFETY: plain FFI call on a live stream.
    ok(unsafe { cu::cuStreamSynchronize(s) });
}

/// A host read of managed memory, as a program would do it.
fn host_read(p: CUdeviceptr, n: usize) -> Vec<u8> {
    // SAFETY: `p` is a live managed allocation of at least `n` bytes, host-accessible by address
    // (the test expects a fault where the driver's rules forbid the access).
    (0..n).map(|i| unsafe { (p as usize as *const u8).add(i).read_volatile() }).collect()
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn a_host_read_while_queued_work_uses_the_memory_faults() {
    if std::env::var(CHILD).is_ok() {
        bind(EXCLUSIVE);
        let p = managed(8192);
        let s = stream(1);
        let gate = Gate::block(s);
        let _src = queue_fill(p, 8192, 3, s);
        // The copy is queued behind the gate: the GPU owns the memory now.
        let _ = host_read(p, 1);
        drop(gate);
        panic!("the host read managed memory in use by queued work and did not fault");
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["a_host_read_while_queued_work_uses_the_memory_faults", "--exact", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGSEGV),
        "expected the child to die of SIGSEGV, got {}:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn the_host_gets_the_memory_back_when_the_work_is_done() {
    let ctl = bind(EXCLUSIVE);
    let p = managed(3 * 4096 + 100);
    let s = stream(1);
    let gate = Gate::block(s);
    let a = queue_fill(p, 4096, 1, s);
    let b = queue_fill(p + 4096, 4096, 2, s);
    gate.open();
    sync(s);
    // The engine wrote through its own mapping while the host's was protected.
    let seen = host_read(p, 8192);
    assert!(seen[..4096].iter().all(|&x| x == 1) && seen[4096..].iter().all(|&x| x == 2));
    // A copy the driver refuses queues nothing, and leaves the host in.
    // SAFETY: plain FFI call; the range overruns the allocation, so nothing is copied.
    let r = unsafe { cu::cuMemcpyHtoDAsync_v2(p, a.cast(), 1 << 20, s) };
    assert_eq!(r, CUresult::CUDA_ERROR_INVALID_VALUE);
    ctl.clear_violations();
    // SAFETY: `p` is a live managed allocation; no work uses it.
    unsafe { (p as usize as *mut u8).write_volatile(9) };
    assert_eq!(read_back(p, 2), [9, 1]);
    pfree(a);
    pfree(b);
    destroy(s);
    dfree(p);
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn devices_with_concurrent_access_never_keep_the_host_out() {
    bind(CONCURRENT);
    let p = managed(4096);
    let s = stream(1);
    let gate = Gate::block(s);
    let src = queue_fill(p, 4096, 5, s);
    // Queued work and host reads may overlap here (the copy has not run: whatever was there).
    let _ = host_read(p, 4);
    drop(gate);
    sync(s);
    assert_eq!(host_read(p, 4), [5; 4]);
    pfree(src);
    destroy(s);
    dfree(p);
}

/// Violations on this thread about device work on memory attached to the host.
fn host_attached_uses(ctl: &cumem_sim::control::Control) -> usize {
    ctl.violations_on_this_thread().iter().filter(|v| v.message.contains("attached to the host")).count()
}

fn attach(s: cu::CUstream, p: CUdeviceptr, flags: u32) {
    // SAFETY: plain FFI call on a live stream and a managed allocation's base.
    ok(unsafe { cu::cuStreamAttachMemAsync(s, p, 0, flags) });
}

const HOST: u32 = 2;

#[test]
#[serial] // frees memory: see `Gate`
fn device_work_on_host_attached_memory_is_misuse_without_concurrent_access() {
    let ctl = bind(EXCLUSIVE);
    let before = host_attached_uses(ctl);
    let mut p = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocManaged(&mut p, 4096, HOST) });
    let s = stream(1);
    // The driver queues the copy (CUDA_SUCCESS), and the GPU may not touch the memory.
    let a = queue_fill(p, 4096, 1, s);
    sync(s);
    assert_eq!(host_attached_uses(ctl), before + 1, "{:?}", ctl.violations_on_this_thread());
    // Attached globally (queued, then run): allowed, also while the attachment is still queued.
    attach(s, p, GLOBAL);
    let b = queue_fill(p, 4096, 2, s);
    sync(s);
    // SAFETY: plain FFI call; `p` holds 4096 bytes.
    ok(unsafe { cu::cuMemsetD8Async(p, 3, 4096, s) });
    sync(s);
    assert_eq!(host_attached_uses(ctl), before + 1, "{:?}", ctl.violations_on_this_thread());
    // Attached to the host again once the attachment has run: a memset is misuse too.
    attach(s, p, HOST);
    sync(s);
    // SAFETY: as above.
    ok(unsafe { cu::cuMemsetD8Async(p, 4, 4096, s) });
    sync(s);
    assert_eq!(host_attached_uses(ctl), before + 2, "{:?}", ctl.violations_on_this_thread());
    // As a copy's host side, memory attached to the host is read by the host: no misuse.
    let mut d = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAlloc_v2(&mut d, 4096) });
    // SAFETY: plain FFI call; `p` and `d` hold 4096 bytes each.
    ok(unsafe { cu::cuMemcpyHtoDAsync_v2(d, p as *const std::ffi::c_void, 4096, s) });
    sync(s);
    assert_eq!(host_attached_uses(ctl), before + 2, "{:?}", ctl.violations_on_this_thread());
    dfree(d);
    pfree(a);
    pfree(b);
    destroy(s);
    dfree(p);
    // A device with concurrent managed access may use memory attached to the host.
    bind(CONCURRENT);
    let mut q = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocManaged(&mut q, 4096, HOST) });
    let s = stream(1);
    let c = queue_fill(q, 4096, 5, s);
    sync(s);
    assert_eq!(host_attached_uses(ctl), before + 2, "{:?}", ctl.violations_on_this_thread());
    assert_eq!(read_back(q, 2), [5, 5]);
    pfree(c);
    destroy(s);
    dfree(q);
}

const SINGLE: u32 = 4;

/// Violations on this thread about device work on memory attached to another stream.
fn other_stream_uses(ctl: &cumem_sim::control::Control) -> usize {
    ctl.violations_on_this_thread().iter().filter(|v| v.message.contains("attached to stream")).count()
}

/// A managed allocation of `bytes` attached with `flags` (GLOBAL or HOST) on the current device.
fn managed_with(bytes: usize, flags: u32) -> CUdeviceptr {
    let mut p = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocManaged(&mut p, bytes, flags) });
    p
}

#[test]
#[serial] // frees memory: see `Gate`
fn a_call_on_host_attached_memory_is_one_misuse_however_many_rows_it_has() {
    let ctl = bind(EXCLUSIVE);
    let p = managed_with(8192, HOST);
    let d = dalloc(8192);
    let s = stream(1);
    let before = host_attached_uses(ctl);
    // 16 rows of 64 bytes, 256 apart: one call, one misuse.
    // SAFETY: plain FFI calls; every row lies inside `p`.
    ok(unsafe { cu::cuMemsetD2D8Async(p, 256, 7, 64, 16, s) });
    sync(s);
    assert_eq!(host_attached_uses(ctl), before + 1, "{:?}", ctl.violations_on_this_thread());
    // SAFETY: as above (the synchronous form, on the legacy stream).
    ok(unsafe { cu::cuMemsetD2D8_v2(p, 256, 8, 64, 16) });
    assert_eq!(host_attached_uses(ctl), before + 2, "{:?}", ctl.violations_on_this_thread());
    // A 2D copy of 16 rows out of it, and one back into it (both device-typed ends).
    let into = device_2d(p, 256, d, 256, 64, 16);
    let out_of = device_2d(d, 256, p, 256, 64, 16);
    // SAFETY: the descriptors name rows inside live allocations.
    unsafe {
        ok(cu::cuMemcpy2DAsync_v2(&out_of, s));
        ok(cu::cuMemcpy2DAsync_v2(&into, s));
    }
    sync(s);
    assert_eq!(host_attached_uses(ctl), before + 4, "{:?}", ctl.violations_on_this_thread());
    // Both ends in it: still one call, one misuse.
    let within = device_2d(p + 4096, 256, p, 256, 64, 16);
    // SAFETY: as above.
    ok(unsafe { cu::cuMemcpy2DAsync_v2(&within, s) });
    sync(s);
    assert_eq!(host_attached_uses(ctl), before + 5, "{:?}", ctl.violations_on_this_thread());
    assert_eq!(read_back(d, 1), [8]);
    destroy(s);
    dfree(d);
    dfree(p);
}

#[test]
#[serial] // frees memory: see `Gate`
fn a_refused_call_on_host_attached_memory_logs_only_its_refusal() {
    let ctl = bind(EXCLUSIVE);
    let p = managed_with(8192, HOST);
    let d = dalloc(8192);
    let s = stream(1);
    let before = host_attached_uses(ctl);
    let all_before = ctl.violations_on_this_thread().len();
    let e = CUresult::CUDA_ERROR_INVALID_VALUE;
    // The destination (host-attached, device side) resolves, then the source, a device pointer
    // where host memory is required, is refused.
    // SAFETY: refused before any access.
    assert_eq!(unsafe { cu::cuMemcpyHtoDAsync_v2(p, d as usize as *const std::ffi::c_void, 64, s) }, e);
    // A 2D copy whose source rows (host-attached) resolve, then whose destination pitch is
    // refused.
    let bad_pitch = device_2d(d, 32, p, 256, 64, 16);
    // SAFETY: refused before any access.
    assert_eq!(unsafe { cu::cuMemcpy2DAsync_v2(&bad_pitch, s) }, e);
    sync(s);
    assert_eq!(host_attached_uses(ctl), before, "{:?}", ctl.violations_on_this_thread());
    // Each refusal is logged once, with its error.
    let refusals: Vec<_> = ctl.violations_on_this_thread()[all_before..]
        .iter()
        .filter(|v| v.code == e as u32)
        .cloned()
        .collect();
    assert_eq!(refusals.len(), 2, "{refusals:?}");
    destroy(s);
    dfree(d);
    dfree(p);
}

#[test]
#[serial] // frees memory: see `Gate`
fn device_work_on_memory_attached_to_another_stream_is_misuse_without_concurrent_access() {
    let ctl = bind(EXCLUSIVE);
    let p = managed_with(4096, GLOBAL);
    let (a, b) = (stream(1), stream(1));
    let before = other_stream_uses(ctl);
    attach(a, p, SINGLE);
    // Still queued on `a`: which attachment is in effect when `b`'s work runs is not known.
    // SAFETY: plain FFI calls; `p` holds 4096 bytes.
    ok(unsafe { cu::cuMemsetD8Async(p, 1, 4096, b) });
    sync(b);
    sync(a);
    assert_eq!(other_stream_uses(ctl), before, "{:?}", ctl.violations_on_this_thread());
    // Attached to `a` (run): `b` may not use it, `a` may.
    // SAFETY: as above.
    ok(unsafe { cu::cuMemsetD8Async(p, 2, 4096, b) });
    sync(b);
    assert_eq!(other_stream_uses(ctl), before + 1, "{:?}", ctl.violations_on_this_thread());
    // SAFETY: as above.
    ok(unsafe { cu::cuMemsetD8Async(p, 3, 4096, a) });
    sync(a);
    assert_eq!(other_stream_uses(ctl), before + 1, "{:?}", ctl.violations_on_this_thread());
    // Nor may the legacy stream (never the attached one), named or through a synchronous call;
    // a 2D memset of 16 rows is one misuse.
    // SAFETY: as above.
    ok(unsafe { cu::cuMemsetD2D8Async(p, 256, 4, 64, 16, std::ptr::null_mut()) });
    // SAFETY: as above.
    ok(unsafe { cu::cuMemsetD8_v2(p, 5, 4096) });
    assert_eq!(other_stream_uses(ctl), before + 3, "{:?}", ctl.violations_on_this_thread());
    // As a copy's host side, or a unified (`cuMemcpy`) end, the host reads it: no misuse.
    let d = dalloc(4096);
    // SAFETY: plain FFI calls; both hold 4096 bytes.
    unsafe {
        ok(cu::cuMemcpyHtoDAsync_v2(d, p as usize as *const std::ffi::c_void, 4096, b));
        ok(cu::cuMemcpyAsync(d, p, 4096, b));
    }
    sync(b);
    assert_eq!(other_stream_uses(ctl), before + 3, "{:?}", ctl.violations_on_this_thread());
    assert_eq!(read_back(d, 2), [5, 5]);
    // Attached globally again (run): every stream may use it.
    attach(a, p, GLOBAL);
    sync(a);
    // SAFETY: as above.
    ok(unsafe { cu::cuMemsetD8Async(p, 6, 4096, b) });
    sync(b);
    assert_eq!(other_stream_uses(ctl), before + 3, "{:?}", ctl.violations_on_this_thread());
    // Attached to the calling thread's per-thread stream: that stream may use it, the legacy
    // stream may not.
    let per_thread = 0x2 as cu::CUstream;
    attach(per_thread, p, SINGLE);
    sync(per_thread);
    // SAFETY: as above.
    ok(unsafe { cu::cuMemsetD8Async(p, 7, 4096, per_thread) });
    sync(per_thread);
    assert_eq!(other_stream_uses(ctl), before + 3, "{:?}", ctl.violations_on_this_thread());
    // SAFETY: as above.
    ok(unsafe { cu::cuMemsetD8Async(p, 8, 4096, 0x1 as cu::CUstream) });
    sync(0x1 as cu::CUstream);
    assert_eq!(other_stream_uses(ctl), before + 4, "{:?}", ctl.violations_on_this_thread());
    attach(per_thread, p, GLOBAL);
    sync(per_thread);
    dfree(d);
    destroy(a);
    destroy(b);
    dfree(p);
}
