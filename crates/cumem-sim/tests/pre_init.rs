//! Before `cuInit`, every call except `cuDriverGetVersion` and `cuGetError*` fails with
//! `NOT_INITIALIZED` and leaves its out-parameters untouched. A separate binary: nothing in this
//! process may call `cuInit`.

mod common;

use std::ffi::{c_char, c_void};

use common::load;
use cudarc::driver::sys::{self as cu, CUresult};
use cumem_sim::control::ControlError;

#[test]
fn everything_but_version_and_error_strings_needs_cu_init() {
    let ctl = load();
    // Attributes whose other value the simulator does not implement are refused, not answered.
    for spec in [
        "unified_addressing=0",
        "dev1.unified_addressing=0",
        "can_use_host_pointer_for_registered_mem=0",
        "dev0.can_use_host_pointer_for_registered_mem=0",
        "pageable_memory_access=1",
        "dev1.cooperative_launch=1",
        "multicast_supported=1",
        "dma_buf_supported=1",
    ] {
        assert_eq!(
            ctl.configure(spec),
            Err(ControlError::Rejected(CUresult::CUDA_ERROR_INVALID_VALUE)),
            "{spec}"
        );
    }
    ctl.configure("leak_check=1,devices=2,unified_addressing=1,can_use_host_pointer_for_registered_mem=1")
        .unwrap();
    let ni = CUresult::CUDA_ERROR_NOT_INITIALIZED;
    // SAFETY: valid out-pointers throughout; the simulator must not write them.
    unsafe {
        let mut ctx = 0x1234 as cu::CUcontext;
        assert_eq!(cu::cuCtxGetCurrent(&mut ctx), ni);
        assert_eq!(ctx as usize, 0x1234);
        let mut n = -7;
        assert_eq!(cu::cuDeviceGetCount(&mut n), ni);
        assert_eq!(n, -7);
        let mut dev = -7;
        assert_eq!(cu::cuDeviceGet(&mut dev, 0), ni);
        assert_eq!(cu::cuCtxGetDevice(&mut dev), ni);
        assert_eq!(dev, -7);
        assert_eq!(cu::cuCtxSetCurrent(std::ptr::null_mut()), ni);
        assert_eq!(cu::cuCtxPushCurrent_v2(std::ptr::null_mut()), ni);
        assert_eq!(cu::cuCtxPopCurrent_v2(&mut ctx), ni);
        assert_eq!(cu::cuDevicePrimaryCtxRetain(&mut ctx, 0), ni);
        assert_eq!(ctx as usize, 0x1234);
        let mut p = 0x55u64;
        assert_eq!(cu::cuMemAlloc_v2(&mut p, 16), ni);
        assert_eq!(p, 0x55);
        assert_eq!(cu::cuMemFree_v2(0), ni);
        let mut h = 0x66 as *mut c_void;
        assert_eq!(cu::cuMemAllocHost_v2(&mut h, 16), ni);
        assert_eq!(h as usize, 0x66);
        let mut s = 0x77 as cu::CUstream;
        assert_eq!(cu::cuStreamCreate(&mut s, 0), ni);
        assert_eq!(s as usize, 0x77);
        assert_eq!(cu::cuCtxSynchronize(), ni);
        assert_eq!(cu::cuMemsetD8_v2(0, 0, 0), ni);

        let mut v = 0;
        assert_eq!(cu::cuDriverGetVersion(&mut v), CUresult::CUDA_SUCCESS);
        assert_eq!(v, 12080);
        let mut name: *const c_char = std::ptr::null();
        assert_eq!(cu::cuGetErrorName(ni, &mut name), CUresult::CUDA_SUCCESS);
        assert!(!name.is_null());
    }
    assert!(ctl.live_report().is_clean());
    // Misuse before cuInit is recorded too.
    assert!(ctl.violations_on_this_thread().iter().all(|v| v.code_name == "CUDA_ERROR_NOT_INITIALIZED"));
}
