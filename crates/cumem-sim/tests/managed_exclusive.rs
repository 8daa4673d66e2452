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
