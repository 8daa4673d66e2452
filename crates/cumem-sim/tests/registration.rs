//! Host registration: the documented misuse codes, pinned-memory behaviour of registered ranges,
//! read-only registrations, flags/device-pointer/attribute queries and the live report; plus
//! host-mapped pinned memory on a device that cannot map host memory.

mod common;

use std::ffi::c_void;

use common::*;
use cudarc::driver::sys::{self as cu, CUpointer_attribute, CUresult};
use serial_test::{parallel, serial};

const PORTABLE: u32 = 1;
const IOMEMORY: u32 = 4;
const READ_ONLY: u32 = 8;

fn register(p: *mut u8, n: usize, flags: u32) -> CUresult {
    // SAFETY: `p` is the test's own memory, valid for `n` bytes while registered.
    unsafe { cu::cuMemHostRegister_v2(p.cast(), n, flags) }
}

fn unregister(p: *mut u8) -> CUresult {
    // SAFETY: plain FFI call.
    unsafe { cu::cuMemHostUnregister(p.cast()) }
}

#[test]
#[parallel]
fn register_and_unregister_codes() {
    let ctl = bind(0);
    let mut buf = vec![0u8; 8192];
    let h = buf.as_mut_ptr();
    let e = CUresult::CUDA_ERROR_INVALID_VALUE;
    assert_eq!(register(std::ptr::null_mut(), 64, 0), e);
    assert_eq!(register(h, 0, 0), e);
    assert_eq!(register(h, 64, 0x10), e);
    assert_eq!(register(h, 64, IOMEMORY), e);
    ok(register(h.wrapping_add(1), 100, 0)); // no alignment required
    let already = CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    assert_eq!(register(h.wrapping_add(1), 100, 0), already, "same range");
    assert_eq!(register(h.wrapping_add(10), 10, 0), already, "interior");
    assert_eq!(register(h, 50, 0), already, "runs into it");
    assert_eq!(register(h.wrapping_add(50), 1000, 0), already, "starts inside, runs past");
    ok(register(h.wrapping_add(101), 100, PORTABLE)); // adjacent, disjoint
    // Exact bytes for lookups.
    let flags = |p: *mut u8| {
        let mut f = 0u32;
        // SAFETY: valid out-pointer.
        (unsafe { cu::cuMemHostGetFlags(&mut f, p.cast()) }, f)
    };
    assert_eq!(flags(h).0, e);
    assert_eq!(flags(h.wrapping_add(1)), (CUresult::CUDA_SUCCESS, 2));
    assert_eq!(flags(h.wrapping_add(150)), (CUresult::CUDA_SUCCESS, 3));
    assert_eq!(flags(h.wrapping_add(300)).0, e);
    assert_eq!(unregister(std::ptr::null_mut()), e);
    assert_eq!(unregister(h.wrapping_add(2)), e, "interior pointer");
    assert_eq!(unregister(h), CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    let report = ctl.live_report();
    let r = report.registrations.iter().find(|r| r.ptr == h as u64 + 101).expect("listed");
    assert_eq!((r.bytes, r.flags, r.device), (100, PORTABLE, 0));
    assert!(!report.contains_ptr(h as u64 + 1), "registrations are not allocations");
    ok(unregister(h.wrapping_add(1)));
    assert_eq!(
        unregister(h.wrapping_add(1)),
        CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
        "second unregister"
    );
    ok(unregister(h.wrapping_add(101)));
    assert!(!ctl.live_report().contains_registration(h as u64 + 101));
    // CUDA-allocated memory cannot be registered, and pinned memory is not unregistered.
    let pm = pinned(256);
    assert_eq!(register(pm, 64, 0), e);
    assert_eq!(unregister(pm), e);
    pfree(pm);
    let d = dalloc(256);
    assert_eq!(register(d as *mut u8, 64, 0), e);
    dfree(d);
    // A registration cannot be freed as an allocation.
    ok(register(h, 64, 0));
    // SAFETY: plain FFI calls; the wrong-kind frees are the misuse under test.
    unsafe {
        assert_eq!(cu::cuMemFreeHost(h.cast()), e);
        assert_eq!(cu::cuMemFree_v2(h as u64), e);
    }
    ok(unregister(h));
    let v = ctl.violations_on_this_thread();
    assert!(v.iter().any(|v| v.code == 712), "{v:#?}");
    assert!(v.iter().any(|v| v.code == 713), "{v:#?}");
}

#[test]
#[parallel]
fn zero_byte_pinned_allocation_cannot_be_registered() {
    let ctl = bind(0);
    let p = pinned(0);
    let e = CUresult::CUDA_ERROR_INVALID_VALUE;
    assert_eq!(register(p, 100, 0), e, "CUDA's own memory at the same base");
    assert!(!ctl.live_report().contains_registration(p as u64));
    assert!(ctl.live_report().contains_ptr(p as u64), "the pinned allocation stays");
    pfree(p);
    assert!(!ctl.live_report().contains_ptr(p as u64));
}

#[test]
#[parallel]
fn unsupported_devices_and_read_only() {
    bind(3);
    let mut buf = vec![0u8; 256];
    assert_eq!(register(buf.as_mut_ptr(), 64, 0), CUresult::CUDA_ERROR_NOT_SUPPORTED);
    assert_eq!(register(buf.as_mut_ptr(), 64, READ_ONLY), CUresult::CUDA_ERROR_NOT_SUPPORTED);
    // Host-mapped pinned memory: allocation succeeds, the device pointer query does not.
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointers.
    unsafe {
        ok(cu::cuMemHostAlloc(&mut p, 64, 2));
        let mut dp = 0u64;
        assert_eq!(cu::cuMemHostGetDevicePointer_v2(&mut dp, p, 0), CUresult::CUDA_ERROR_NOT_SUPPORTED);
        ok(cu::cuMemFreeHost(p));
    }
}

#[test]
#[serial] // holds a stream with a gate: no other test may free meanwhile (see `Gate`)
fn registered_memory_behaves_as_pinned_memory() {
    bind(0);
    let n = 4096;
    let mut host = vec![1u8; n];
    let h = host.as_mut_ptr();
    ok(register(h, n, 0));
    let d = dalloc(n);
    let s = stream(0);
    let gate = Gate::block(s);
    // SAFETY: `h` is registered for `n` bytes until unregistered below.
    ok(unsafe { cu::cuMemcpyHtoDAsync_v2(d, h.cast(), n, s) });
    poke(h, n, 2); // pinned semantics: read when the copy runs
    gate.open();
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
    assert!(read_back(d, n).iter().all(|&b| b == 2));
    // SAFETY: live allocations.
    ok(unsafe { cu::cuMemsetD8_v2(d, 9, n) });
    let gate = Gate::block(s);
    // SAFETY: `h` is registered for `n` bytes.
    ok(unsafe { cu::cuMemcpyDtoHAsync_v2(h.cast(), d, n, s) });
    settle();
    assert!(peek(h, n).iter().all(|&b| b == 2), "lands only in stream order");
    gate.open();
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
    assert!(peek(h, n).iter().all(|&b| b == 9));
    // Device pointer and attributes.
    // SAFETY: valid out-pointers.
    unsafe {
        let mut dp = 0u64;
        ok(cu::cuMemHostGetDevicePointer_v2(&mut dp, h.wrapping_add(100).cast(), 0));
        assert_eq!(dp, h as u64 + 100);
        let mut t = 0u32;
        ok(cu::cuPointerGetAttribute(
            (&mut t as *mut u32).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            h as u64 + 5,
        ));
        assert_eq!(t, 1);
        let mut size = 0u64;
        ok(cu::cuPointerGetAttribute(
            (&mut size as *mut u64).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            h as u64 + 5,
        ));
        assert_eq!(size, n as u64);
    }
    destroy(s);
    ok(unregister(h));
    dfree(d);
}

#[test]
#[parallel]
fn device_to_host_into_read_only_registration_is_refused() {
    let ctl = bind(0);
    let mut host = vec![5u8; 256];
    let h = host.as_mut_ptr();
    ok(register(h, 256, READ_ONLY));
    let d = dalloc(256);
    // SAFETY: live allocations; the writes into read-only memory are the misuse under test.
    unsafe {
        ok(cu::cuMemsetD8_v2(d, 1, 256));
        assert_eq!(cu::cuMemcpyDtoH_v2(h.cast(), d, 256), CUresult::CUDA_ERROR_INVALID_VALUE);
        ok(cu::cuMemcpyHtoD_v2(d, h.cast(), 256)); // reading it is fine
    }
    assert!(peek(h, 256).iter().all(|&b| b == 5));
    assert!(read_back(d, 256).iter().all(|&b| b == 5));
    ok(unregister(h));
    dfree(d);
    assert!(ctl.violations_on_this_thread().iter().any(|v| v.message.contains("read-only")));
}

#[test]
#[parallel]
fn pointer_get_attributes_batch() {
    bind(0);
    use CUpointer_attribute::*;
    let attrs = [
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
        CU_POINTER_ATTRIBUTE_HOST_POINTER,
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        CU_POINTER_ATTRIBUTE_IS_MANAGED,
        CU_POINTER_ATTRIBUTE_CONTEXT,
    ];
    let query = |p: u64| {
        let (mut t, mut dp, mut hp, mut ord, mut size, mut m, mut ctx) =
            (7u32, 7u64, 7u64, 7i32, 7u64, 7u32, 7u64);
        let mut data: [*mut c_void; 7] = [
            (&mut t as *mut u32).cast(),
            (&mut dp as *mut u64).cast(),
            (&mut hp as *mut u64).cast(),
            (&mut ord as *mut i32).cast(),
            (&mut size as *mut u64).cast(),
            (&mut m as *mut u32).cast(),
            (&mut ctx as *mut u64).cast(),
        ];
        let mut a = attrs;
        // SAFETY: every data pointer has the attribute's size.
        let r = unsafe { cu::cuPointerGetAttributes(7, a.as_mut_ptr(), data.as_mut_ptr(), p) };
        (r, t, dp, hp, ord, size, m, ctx)
    };
    let local = 0u64;
    let hp = &local as *const u64 as u64;
    assert_eq!(query(hp), (CUresult::CUDA_SUCCESS, 0, hp, hp, -1, 7, 0, 0), "unknown pointer defaults");
    let d = dalloc(100);
    let (r, t, dp, host, ord, size, m, ctx) = query(d + 4);
    assert_eq!((r, t, dp, host, ord, size, m), (CUresult::CUDA_SUCCESS, 2, d + 4, 0, 0, 100, 0));
    assert_ne!(ctx, 0);
    // SAFETY: NULL data entries and unknown attributes are the misuse under test.
    unsafe {
        let mut a = [CU_POINTER_ATTRIBUTE_MEMORY_TYPE];
        let mut data: [*mut c_void; 1] = [std::ptr::null_mut()];
        assert_eq!(
            cu::cuPointerGetAttributes(1, a.as_mut_ptr(), data.as_mut_ptr(), d),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        let raw_batch: unsafe extern "C" fn(u32, *const u32, *mut *mut c_void, u64) -> CUresult =
            raw("cuPointerGetAttributes");
        let mut x = 0u64;
        let mut data: [*mut c_void; 1] = [(&mut x as *mut u64).cast()];
        assert_eq!(raw_batch(1, [99u32].as_ptr(), data.as_mut_ptr(), d), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    dfree(d);
}
