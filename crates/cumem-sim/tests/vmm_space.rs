//! The size of a device's VMM address space: `dev0.vmm_space` forces a small one, which refuses a
//! reservation past its end with `OUT_OF_MEMORY` (quietly, as the driver answers exhausted
//! virtual addresses) and takes it once space is freed; a size the kernel refuses (more than the
//! host's whole user address space) falls back to a smaller space instead of failing every
//! reservation.

mod common;

use std::sync::OnceLock;

use common::*;
use cudarc::driver::sys::{self as cu, CUcontext, CUdeviceptr, CUresult};
use serial_test::serial;

const SPEC: &str = "leak_check=1,devices=2,memory=4GiB,latency_us=50,dev0.vmm_space=64GiB,\
                    dev1.vmm_space=1024TiB";
const GIB: usize = 1 << 30;

/// Initialises the simulator with [`SPEC`] (once) and binds device `dev`'s primary context.
fn bind_dev(dev: i32) -> &'static cumem_sim::control::Control {
    static CTX: OnceLock<Vec<usize>> = OnceLock::new();
    let ctl = load();
    let ctxs = CTX.get_or_init(|| {
        ctl.configure(SPEC).expect("valid configuration");
        // SAFETY: plain FFI call into the loaded simulator.
        ok(unsafe { cu::cuInit(0) });
        (0..2)
            .map(|d| {
                let mut ctx: CUcontext = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                ok(unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, d) });
                ctx as usize
            })
            .collect()
    });
    // SAFETY: a handle returned by cuDevicePrimaryCtxRetain.
    ok(unsafe { cu::cuCtxSetCurrent(ctxs[dev as usize] as CUcontext) });
    ctl
}

fn try_reserve(size: usize) -> (CUresult, CUdeviceptr) {
    let mut va = 0;
    // SAFETY: valid out-pointer.
    let r = unsafe { cu::cuMemAddressReserve(&mut va, size, 0, 0, 0) };
    (r, va)
}

fn free_va(va: CUdeviceptr, size: usize) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuMemAddressFree(va, size) });
}

#[test]
#[serial]
fn a_forced_small_space_refuses_reservations_past_its_end() {
    let ctl = bind_dev(0);
    let (r, a) = try_reserve(48 * GIB);
    ok(r);
    assert_eq!(try_reserve(32 * GIB).0, CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    // Still refused: the space stays as sized, it is not made again.
    assert_eq!(try_reserve(32 * GIB).0, CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let (r, b) = try_reserve(8 * GIB);
    ok(r);
    free_va(a, 48 * GIB);
    let (r, c) = try_reserve(32 * GIB);
    ok(r);
    free_va(b, 8 * GIB);
    free_va(c, 32 * GIB);
    assert!(ctl.violations_on_this_thread().is_empty(), "{:?}", ctl.violations_on_this_thread());
    assert!(ctl.live_report().reservations.is_empty(), "{}", ctl.live_report());
}

#[test]
#[serial]
fn a_space_the_kernel_refuses_falls_back_to_a_smaller_one() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid out-pointer.
    let r = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) };
    if r == 0 && limit.rlim_cur != libc::RLIM_INFINITY && limit.rlim_cur < 1 << 40 {
        eprintln!("skipped: ulimit -v allows {} bytes, maybe not even the smallest space", limit.rlim_cur);
        return;
    }
    let ctl = bind_dev(1);
    // 1024 TiB (twice that in host addresses) exceeds any host's user address space.
    let (r, a) = try_reserve(32 * GIB);
    ok(r);
    free_va(a, 32 * GIB);
    assert!(ctl.violations_on_this_thread().is_empty(), "{:?}", ctl.violations_on_this_thread());
    assert!(ctl.live_report().reservations.is_empty(), "{}", ctl.live_report());
}
