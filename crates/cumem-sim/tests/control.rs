//! The control interface: live report, configuration rules, violation records, exported symbols.

mod common;

use common::*;
use cudarc::driver::sys::{self as cu, CUresult};
use cumem_sim::control::{Control, ControlError};

#[test]
fn live_report_lists_and_then_drops_resources() {
    let ctl = bind(0);
    let d = dalloc(3000);
    let h = pinned(10);
    let s = stream(0);
    let mut e: cu::CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuEventCreate(&mut e, 0) });
    let r = ctl.live_report();
    let a = r.allocations.iter().find(|a| a.ptr == d).expect("device allocation listed");
    assert_eq!((a.kind.as_str(), a.bytes, a.device), ("device", 3000, 0));
    let p = r.allocations.iter().find(|a| a.ptr == h as u64).expect("pinned allocation listed");
    assert_eq!((p.kind.as_str(), p.bytes), ("pinned_host", 10));
    assert!(r.contains_stream(s as u64) && r.contains_event(e as u64));
    assert!(r.contexts.iter().any(|c| c.device == 0 && c.retain_count >= 1));
    assert!(!r.is_clean());
    assert!(r.to_string().contains("pinned_host"));
    // SAFETY: handles from this test.
    ok(unsafe { cu::cuEventDestroy_v2(e) });
    destroy(s);
    pfree(h);
    dfree(d);
    let r = ctl.live_report();
    assert!(!r.contains_ptr(d) && !r.contains_ptr(h as u64));
    assert!(!r.contains_stream(s as u64) && !r.contains_event(e as u64));
}

#[test]
fn configuration_after_init_accepts_only_runtime_keys() {
    let ctl = setup();
    assert_eq!(ctl.configure("devices=8"), Err(ControlError::Rejected(CUresult::CUDA_ERROR_INVALID_VALUE)));
    assert_eq!(
        ctl.configure("dev0.memory=1GiB"),
        Err(ControlError::Rejected(CUresult::CUDA_ERROR_INVALID_VALUE))
    );
    assert_eq!(
        ctl.configure("latency_us=abc"),
        Err(ControlError::Rejected(CUresult::CUDA_ERROR_INVALID_VALUE))
    );
    assert_eq!(ctl.configure("nonsense"), Err(ControlError::Rejected(CUresult::CUDA_ERROR_INVALID_VALUE)));
    assert_eq!(ctl.configure("a\0b"), Err(ControlError::NulInSpec));
    ctl.configure("latency_us=200,leak_check=1").unwrap();
    let mut n = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuDeviceGetCount(&mut n) });
    assert_eq!(n, 4);
}

#[test]
fn violations_carry_function_code_message_and_thread() {
    let ctl = bind(0);
    let x = 0u32;
    // SAFETY: the simulator rejects the freed/unknown address before touching anything.
    let r = unsafe { cu::cuMemcpyHtoD_v2(0x10, (&x as *const u32).cast(), 4) };
    assert_eq!(r, CUresult::CUDA_ERROR_INVALID_VALUE);
    let v = ctl.violations_on_this_thread();
    let last = v.last().expect("recorded");
    assert_eq!(last.function, "cuMemcpyHtoD_v2");
    assert_eq!(last.code, 1);
    assert_eq!(last.code_name, "CUDA_ERROR_INVALID_VALUE");
    assert!(!last.message.is_empty());
    assert_eq!(last.os_tid, cumem_sim::control::current_os_tid());
    assert!(last.to_string().contains("cuMemcpyHtoD_v2"));
}

#[test]
fn attach_finds_the_loaded_simulator() {
    setup();
    assert!(Control::attach().is_some());
    assert!(cumem_sim::library_path().unwrap().ends_with(cumem_sim::LIBRARY_FILE_NAME));
}

/// Every entry point of the v1 contract, by exported name.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetUuid",
    "cuDeviceGetUuid_v2",
    "cuDeviceGetPCIBusId",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuDevicePrimaryCtxGetState",
    "cuDevicePrimaryCtxSetFlags_v2",
    "cuDevicePrimaryCtxReset_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxGetDevice",
    "cuCtxGetFlags",
    "cuCtxSynchronize",
    "cuCtxGetStreamPriorityRange",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetAddressRange_v2",
    "cuMemAllocHost_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostGetFlags",
    "cuMemHostGetDevicePointer_v2",
    "cuPointerGetAttribute",
    "cuMemcpy",
    "cuMemcpyAsync",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyDtoD_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8_v2",
    "cuMemsetD16_v2",
    "cuMemsetD32_v2",
    "cuMemsetD8Async",
    "cuMemsetD16Async",
    "cuMemsetD32Async",
    "cuStreamCreate",
    "cuStreamCreateWithPriority",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuStreamGetPriority",
    "cuStreamGetFlags",
    "cuStreamGetCtx",
    "cuStreamGetDevice",
    "cuLaunchHostFunc",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventRecordWithFlags",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventElapsedTime",
    "cuEventElapsedTime_v2",
    "cuEventDestroy_v2",
    "cuGetErrorName",
    "cuGetErrorString",
    "cumemSimVersion",
    "cumemSimConfigure",
    "cumemSimLiveReport",
    "cumemSimViolations",
    "cumemSimClearViolations",
    "cumemSimInjectFault",
    "cumemSimClearFaults",
    "cumemSimRemoveFault",
    "cumemSimCallCount",
];

#[test]
fn every_required_symbol_is_exported() {
    load();
    let path = cumem_sim::library_path().unwrap();
    // SAFETY: the library is already loaded; this only takes another reference.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();
    let missing: Vec<_> = SYMBOLS
        .iter()
        // SAFETY: the symbol is only looked up, never called.
        .filter(|name| unsafe { lib.get::<*const ()>(format!("{name}\0").as_bytes()) }.is_err())
        .collect();
    assert!(missing.is_empty(), "missing exports: {missing:?}");
    // And cudarc, which opens "libcuda.so", gets this very library (the soname).
    let mut v = 0;
    // SAFETY: plain FFI call through cudarc's loader.
    ok(unsafe { cu::cuDriverGetVersion(&mut v) });
    assert_eq!(v, 12080);
}
