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
    assert_ne!(a.id, p.id, "each allocation has its own id");
    let (d_id, h_id) = (a.id, p.id);
    // SAFETY: handles from this test.
    ok(unsafe { cu::cuEventDestroy_v2(e) });
    destroy(s);
    pfree(h);
    dfree(d);
    let r = ctl.live_report();
    // By id: another test's allocation may already have a freed address.
    assert!(!r.contains_allocation(d_id) && !r.contains_allocation(h_id), "{r}");
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

/// Every kind of allocation draws its id from one count: device, pitched, pool, managed and
/// pinned host allocations made side by side all have different ids (imports: ipc.rs and
/// pool_export.rs), each found again by its address while live.
#[test]
fn every_kind_of_allocation_has_its_own_id() {
    let ctl = bind(0);
    let d = dalloc(4096);
    let (mut pitched, mut pitch) = (0, 0);
    let mut managed = 0;
    let mut pool = 0;
    let s = stream(0);
    // SAFETY: valid out-pointers; `s` is a live stream of the current context.
    unsafe {
        ok(cu::cuMemAllocPitch_v2(&mut pitched, &mut pitch, 100, 4, 4));
        ok(cu::cuMemAllocManaged(&mut managed, 4096, 1));
        ok(cu::cuMemAllocAsync(&mut pool, 4096, s));
    }
    let h = pinned(4096) as u64;
    let r = ctl.live_report();
    let kinds =
        [(d, "device"), (pitched, "pitched"), (pool, "pool"), (managed, "managed"), (h, "pinned_host")];
    let ids: Vec<u64> = kinds
        .iter()
        .map(|&(ptr, kind)| {
            let a = r.allocation_at(ptr).unwrap_or_else(|| panic!("{kind} {ptr:#x} not listed:\n{r}"));
            assert_eq!(a.kind, kind);
            assert_eq!(r.id_of(ptr), Some(a.id));
            assert!(r.contains_allocation(a.id));
            a.id
        })
        .collect();
    let mut distinct = ids.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), ids.len(), "ids {ids:?}:\n{r}");
    assert!(!ids.contains(&0), "0 means a report without ids: {ids:?}");
    // SAFETY: allocations made above, unused.
    unsafe {
        ok(cu::cuMemFreeAsync(pool, s));
        ok(cu::cuStreamSynchronize(s));
        ok(cu::cuMemFree_v2(managed));
        ok(cu::cuMemFree_v2(pitched));
    }
    pfree(h as *mut u8);
    dfree(d);
    destroy(s);
    let r = ctl.live_report();
    assert!(ids.iter().all(|&id| !r.contains_allocation(id)), "{r}");
}

/// A freed allocation's address is soon handed out again (managed memory is a host mapping, so
/// the kernel usually returns the same address for the same size at once): the new allocation
/// there has another id, and the old id is no longer live although its address is.
#[test]
fn an_allocation_at_a_reused_address_has_a_new_id() {
    let ctl = bind(0);
    const BYTES: usize = 1 << 16;
    let managed = || {
        let mut p = 0;
        // SAFETY: valid out-pointer.
        ok(unsafe { cu::cuMemAllocManaged(&mut p, BYTES, 1) });
        p
    };
    // Another test's mapping may take the freed address first: try again a bounded number of times.
    for _ in 0..100 {
        let old = managed();
        let old_id = ctl.live_report().id_of(old).expect("listed");
        dfree(old);
        let new = managed();
        if new != old {
            dfree(new);
            continue;
        }
        let r = ctl.live_report();
        let new_id = r.id_of(new).expect("listed");
        assert_ne!(new_id, old_id, "the same id for two allocations:\n{r}");
        assert!(r.contains_ptr(old), "the new allocation is at the old address");
        assert!(!r.contains_allocation(old_id), "the freed allocation still counts as live:\n{r}");
        assert!(r.contains_allocation(new_id));
        dfree(new);
        return;
    }
    panic!("no managed allocation was handed a freed address in 100 tries");
}
