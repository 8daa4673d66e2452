//! Misuse codes, memory accounting and pointer/attribute queries of the simulated driver.

mod common;

use std::ffi::{CStr, c_char, c_void};

use common::*;
use cudarc::driver::sys::{self as cu, CUdevice_attribute, CUpointer_attribute, CUresult};

#[test]
fn zero_size_alloc_is_invalid_value_and_leaves_the_out_param() {
    let ctl = bind(0);
    let mut p: u64 = 0x1234;
    assert_eq!(
        // SAFETY: valid out-pointer.
        unsafe { cu::cuMemAlloc_v2(&mut p, 0) },
        CUresult::CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(p, 0x1234);
    assert_eq!(
        // SAFETY: NULL out-pointer is the misuse under test.
        unsafe { cu::cuMemAlloc_v2(std::ptr::null_mut(), 16) },
        CUresult::CUDA_ERROR_INVALID_VALUE
    );
    let v = ctl.violations_on_this_thread();
    assert!(
        v.iter().any(|v| v.function == "cuMemAlloc_v2"
            && v.code == 1
            && v.code_name == "CUDA_ERROR_INVALID_VALUE")
    );
}

#[test]
fn copy_past_the_end_fails_writes_nothing_and_is_recorded() {
    let ctl = bind(0);
    let p = dalloc(1024);
    // SAFETY: plain FFI call on a live allocation.
    ok(unsafe { cu::cuMemsetD8_v2(p, 0xAB, 1024) });
    let src = vec![0x11u8; 2048];
    // SAFETY: `src` has 2048 bytes.
    unsafe {
        assert_eq!(cu::cuMemcpyHtoD_v2(p, src.as_ptr().cast(), 1025), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            cu::cuMemcpyHtoD_v2(p + 1000, src.as_ptr().cast(), 100),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(cu::cuMemsetD8_v2(p + 1, 0x22, 1024), CUresult::CUDA_ERROR_INVALID_VALUE);
        let s = stream(0);
        assert_eq!(
            cu::cuMemcpyHtoDAsync_v2(p, src.as_ptr().cast(), 1025, s),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        let mut dst = vec![0u8; 2048];
        assert_eq!(cu::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), p, 2048), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert!(dst.iter().all(|&b| b == 0), "a failed device-to-host copy wrote the destination");
        destroy(s);
    }
    assert!(read_back(p, 1024).iter().all(|&b| b == 0xAB), "a failed call wrote device memory");
    let v = ctl.violations_on_this_thread();
    let overruns: Vec<_> = v.iter().filter(|v| v.message.contains("overruns")).collect();
    assert!(overruns.len() >= 5, "{v:#?}");
    assert!(overruns.iter().any(|v| v.function == "cuMemcpyHtoD_v2" && v.code == 1));
    assert!(overruns.iter().any(|v| v.function == "cuMemsetD8_v2"));
    assert!(overruns.iter().all(|v| v.os_tid == cumem_sim::control::current_os_tid()));
    dfree(p);
}

#[test]
fn freed_and_unknown_device_addresses_are_rejected_by_copies() {
    let ctl = bind(0);
    let p = dalloc(256);
    dfree(p);
    let x = [0u8; 4];
    assert_eq!(
        // SAFETY: `x` has 4 bytes.
        unsafe { cu::cuMemcpyHtoD_v2(p, x.as_ptr().cast(), 4) },
        CUresult::CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(
        // SAFETY: plain FFI call.
        unsafe { cu::cuMemsetD32_v2(p, 1, 1) },
        CUresult::CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(
        // SAFETY: a NULL device pointer with a non-zero size is the misuse under test.
        unsafe { cu::cuMemcpyHtoD_v2(0, x.as_ptr().cast(), 4) },
        CUresult::CUDA_ERROR_INVALID_VALUE
    );
    // A plain host address where device memory is required.
    assert_eq!(
        // SAFETY: the simulator rejects the address before touching it.
        unsafe { cu::cuMemcpyHtoD_v2(x.as_ptr() as u64, x.as_ptr().cast(), 4) },
        CUresult::CUDA_ERROR_INVALID_VALUE
    );
    let v = ctl.violations_on_this_thread();
    assert!(v.iter().any(|v| v.message.contains("not inside a live allocation")), "{v:#?}");
}

#[test]
fn free_of_unknown_interior_pinned_and_double_free() {
    let ctl = bind(0);
    // SAFETY: plain FFI calls; every pointer is only looked up.
    unsafe {
        assert_eq!(cu::cuMemFree_v2(0), CUresult::CUDA_SUCCESS);
        assert_eq!(cu::cuMemFreeHost(std::ptr::null_mut()), CUresult::CUDA_SUCCESS);
        assert_eq!(cu::cuMemFree_v2(0xdead_beef), CUresult::CUDA_ERROR_INVALID_VALUE);
        let p = dalloc(4096);
        assert_eq!(cu::cuMemFree_v2(p + 512), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuMemFreeHost(p as *mut c_void), CUresult::CUDA_ERROR_INVALID_VALUE);
        dfree(p);
        assert_eq!(cu::cuMemFree_v2(p), CUresult::CUDA_ERROR_INVALID_VALUE);
        let h = pinned(64);
        assert_eq!(cu::cuMemFree_v2(h as u64), CUresult::CUDA_ERROR_INVALID_VALUE);
        pfree(h);
        assert_eq!(cu::cuMemFreeHost(h.cast()), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let v = ctl.violations_on_this_thread();
    assert!(v.iter().any(|v| v.function == "cuMemFree_v2" && v.message.contains("double free")), "{v:#?}");
    assert!(v.iter().any(|v| v.message.contains("interior pointer")), "{v:#?}");
    assert!(v.iter().any(|v| v.function == "cuMemFreeHost" && v.message.contains("double free")), "{v:#?}");
}

#[test]
fn calls_without_a_current_context_fail_on_a_fresh_thread() {
    setup();
    bind(0); // this thread has one; the new thread must not inherit it
    let (violations, tid) = std::thread::spawn(|| {
        let x = 7u32;
        let mut p = 0u64;
        let mut cur: cu::CUcontext = 0x99 as cu::CUcontext;
        // SAFETY: valid pointers throughout.
        unsafe {
            assert_eq!(cu::cuCtxGetCurrent(&mut cur), CUresult::CUDA_SUCCESS);
            assert!(cur.is_null());
            assert_eq!(cu::cuMemAlloc_v2(&mut p, 16), CUresult::CUDA_ERROR_INVALID_CONTEXT);
            assert_eq!(p, 0);
            // Context is checked before pointer validity.
            assert_eq!(cu::cuMemsetD8_v2(0, 0, 1), CUresult::CUDA_ERROR_INVALID_CONTEXT);
            assert_eq!(
                cu::cuMemcpyHtoD_v2(0, (&x as *const u32).cast(), 4),
                CUresult::CUDA_ERROR_INVALID_CONTEXT
            );
            assert_eq!(cu::cuStreamSynchronize(std::ptr::null_mut()), CUresult::CUDA_ERROR_INVALID_CONTEXT);
            assert_eq!(cu::cuCtxSynchronize(), CUresult::CUDA_ERROR_INVALID_CONTEXT);
            let mut free = 0usize;
            let mut total = 0usize;
            assert_eq!(cu::cuMemGetInfo_v2(&mut free, &mut total), CUresult::CUDA_ERROR_INVALID_CONTEXT);
            assert_eq!(cu::cuCtxPopCurrent_v2(std::ptr::null_mut()), CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        (setup().violations_on_this_thread(), cumem_sim::control::current_os_tid())
    })
    .join()
    .unwrap();
    assert!(violations.len() >= 6);
    assert!(violations.iter().all(|v| v.os_tid == tid && v.code_name == "CUDA_ERROR_INVALID_CONTEXT"));
}

#[test]
fn out_of_memory_and_mem_info_accounting() {
    let ctl = bind(1); // 64 MiB device, used by this test only
    let info = || {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        ok(unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) });
        (free, total)
    };
    let (free0, total) = info();
    assert_eq!(total, 64 << 20);
    assert_eq!(free0, total);
    let a = dalloc(16 << 20);
    let (free1, _) = info();
    assert!(free1 <= free0 - (16 << 20));
    let b = dalloc(1000);
    assert!(info().0 <= free1 - 1000);
    let mut p = 0x77u64;
    assert_eq!(
        // SAFETY: valid out-pointer.
        unsafe { cu::cuMemAlloc_v2(&mut p, 64 << 20) },
        CUresult::CUDA_ERROR_OUT_OF_MEMORY
    );
    assert_eq!(p, 0x77);
    let mut held = Vec::new();
    loop {
        let mut q = 0u64;
        // SAFETY: valid out-pointer.
        match unsafe { cu::cuMemAlloc_v2(&mut q, 4 << 20) } {
            CUresult::CUDA_SUCCESS => held.push(q),
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(held.len() >= 11 && held.len() <= 12, "{} chunks of 4 MiB fit", held.len());
    assert!(info().0 < 4 << 20);
    for q in held {
        dfree(q);
    }
    dfree(a);
    dfree(b);
    assert_eq!(info(), (total, total));
    assert!(!ctl.violations_on_this_thread().iter().any(|v| v.code_name == "CUDA_ERROR_OUT_OF_MEMORY"));
    // Capacity is per device: device 0 still has room.
    bind(0);
    let big = dalloc(1 << 30);
    dfree(big);
}

fn maps_entry_for(addr: u64) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .find(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (lo, hi) = range.split_once('-').unwrap();
            let (lo, hi) = (u64::from_str_radix(lo, 16).unwrap(), u64::from_str_radix(hi, 16).unwrap());
            addr >= lo && addr < hi
        })
        .map(str::to_string)
}

#[test]
fn device_pointers_are_not_host_memory_but_pinned_pointers_are() {
    bind(0);
    let p = dalloc(1 << 20);
    assert_ne!(p, 0);
    assert_eq!(p % 512, 0);
    let entry = maps_entry_for(p).expect("device pointers lie in the simulator's reservation");
    let perms = entry.split_whitespace().nth(1).unwrap();
    assert_eq!(perms, "---p", "device address space must not be accessible from the host: {entry}");
    let h = pinned(4096);
    let entry = maps_entry_for(h as u64).unwrap();
    assert!(entry.split_whitespace().nth(1).unwrap().starts_with("rw"), "{entry}");
    let mut dptr = 0u64;
    // SAFETY: valid out-pointer; `h` is pinned.
    ok(unsafe { cu::cuMemHostGetDevicePointer_v2(&mut dptr, h.add(100).cast(), 0) });
    assert_eq!(dptr, h as u64 + 100);
    pfree(h);
    dfree(p);
}

#[test]
fn memset_alignment_and_values() {
    bind(0);
    let p = dalloc(64);
    // SAFETY: plain FFI calls on a live allocation.
    unsafe {
        assert_eq!(cu::cuMemsetD16_v2(p + 1, 0xBEEF, 4), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuMemsetD32_v2(p + 2, 0xDEAD_BEEF, 4), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            cu::cuMemsetD32Async(p + 6, 1, 1, std::ptr::null_mut()),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        ok(cu::cuMemsetD8_v2(p, 0, 64));
        ok(cu::cuMemsetD16_v2(p + 2, 0xBEEF, 3));
        ok(cu::cuMemsetD32_v2(p + 16, 0x0403_0201, 2));
    }
    let v = read_back(p, 32);
    assert_eq!(&v[..10], &[0, 0, 0xEF, 0xBE, 0xEF, 0xBE, 0xEF, 0xBE, 0, 0]);
    assert_eq!(&v[16..24], &[1, 2, 3, 4, 1, 2, 3, 4]);
    dfree(p);
}

#[test]
fn zero_length_copies_and_memsets_with_null_succeed() {
    bind(0);
    let null = std::ptr::null_mut::<c_void>();
    // SAFETY: zero-length operations touch nothing.
    unsafe {
        ok(cu::cuMemcpyHtoD_v2(0, null, 0));
        ok(cu::cuMemcpyDtoH_v2(null, 0, 0));
        ok(cu::cuMemcpyDtoD_v2(0, 0, 0));
        ok(cu::cuMemcpy(0, 0, 0));
        ok(cu::cuMemcpyAsync(0, 0, 0, std::ptr::null_mut()));
        ok(cu::cuMemcpyHtoDAsync_v2(0, null, 0, std::ptr::null_mut()));
        ok(cu::cuMemsetD8_v2(0, 1, 0));
        ok(cu::cuMemsetD16_v2(0, 1, 0));
        ok(cu::cuMemsetD32Async(0, 1, 0, std::ptr::null_mut()));
    }
}

#[test]
fn round_trips_through_every_copy_kind() {
    bind(0);
    let n = 4096;
    let src: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    let a = dalloc(n);
    let b = dalloc(n);
    let h = pinned(n);
    // SAFETY: all buffers have `n` bytes.
    unsafe {
        ok(cu::cuMemcpyHtoD_v2(a, src.as_ptr().cast(), n));
        ok(cu::cuMemcpyDtoD_v2(b, a, n));
        ok(cu::cuMemcpy(h as u64, b, n)); // UVA: device -> pinned
        assert_eq!(peek(h, n), src);
        let mut out = vec![0u8; n];
        ok(cu::cuMemcpy(out.as_mut_ptr() as u64, h as u64, n)); // pinned -> pageable
        assert_eq!(out, src);
        // Overlapping device-to-device within one allocation behaves like memmove.
        ok(cu::cuMemcpyDtoD_v2(a + 1, a, 100));
    }
    let moved = read_back(a, 101);
    assert_eq!(&moved[1..101], &src[..100]);
    pfree(h);
    dfree(a);
    dfree(b);
}

#[test]
fn pinned_memory_flags_and_pointer_attributes() {
    bind(0);
    let h = pinned(100);
    let mut h7: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid pointers throughout.
    unsafe {
        ok(cu::cuMemHostAlloc(&mut h7, 10, 7));
        let mut flags = 0u32;
        ok(cu::cuMemHostGetFlags(&mut flags, h.add(5).cast()));
        assert_eq!(flags, 2);
        ok(cu::cuMemHostGetFlags(&mut flags, h7));
        assert_eq!(flags, 7);
        let mut bad: *mut c_void = std::ptr::null_mut();
        assert_eq!(cu::cuMemHostAlloc(&mut bad, 10, 8), CUresult::CUDA_ERROR_INVALID_VALUE);
        let mut dptr = 0u64;
        assert_eq!(
            cu::cuMemHostGetDevicePointer_v2(&mut dptr, h.cast(), 1),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );

        let d = dalloc(1000);
        let attr_u32 = |a: CUpointer_attribute, p: u64| {
            let mut v = 0xFFFF_FFFFu32;
            let r = cu::cuPointerGetAttribute((&mut v as *mut u32).cast(), a, p);
            (r, v)
        };
        let attr_u64 = |a: CUpointer_attribute, p: u64| {
            let mut v = u64::MAX;
            let r = cu::cuPointerGetAttribute((&mut v as *mut u64).cast(), a, p);
            (r, v)
        };
        use CUpointer_attribute::*;
        assert_eq!(attr_u32(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d + 10), (CUresult::CUDA_SUCCESS, 2));
        assert_eq!(attr_u32(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, h as u64), (CUresult::CUDA_SUCCESS, 1));
        assert_eq!(attr_u32(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, d), (CUresult::CUDA_SUCCESS, 0));
        assert_eq!(attr_u32(CU_POINTER_ATTRIBUTE_IS_MANAGED, d), (CUresult::CUDA_SUCCESS, 0));
        // GPU_DIRECT_RDMA_SUPPORTED (116) is 0 on the simulated devices, so no memory is RDMA-capable.
        assert_eq!(attr_u32(CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, d), (CUresult::CUDA_SUCCESS, 0));
        assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, d + 999), (CUresult::CUDA_SUCCESS, d));
        assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_RANGE_SIZE, d + 1), (CUresult::CUDA_SUCCESS, 1000));
        assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_DEVICE_POINTER, d + 8), (CUresult::CUDA_SUCCESS, d + 8));
        assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_HOST_POINTER, h as u64), (CUresult::CUDA_SUCCESS, h as u64));
        assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_HOST_POINTER, d).0, CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            attr_u32(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d + 1000).0,
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        let mut ctx: cu::CUcontext = std::ptr::null_mut();
        ok(cu::cuPointerGetAttribute(
            (&mut ctx as *mut cu::CUcontext).cast(),
            CU_POINTER_ATTRIBUTE_CONTEXT,
            d,
        ));
        let mut cur: cu::CUcontext = std::ptr::null_mut();
        ok(cu::cuCtxGetCurrent(&mut cur));
        assert_eq!(ctx, cur);
        let (_, id1) = attr_u64(CU_POINTER_ATTRIBUTE_BUFFER_ID, d);
        let (_, id2) = attr_u64(CU_POINTER_ATTRIBUTE_BUFFER_ID, h as u64);
        assert_ne!(id1, id2);
        // Unknown pointer attribute values are refused.
        let mut v = 0u64;
        let bogus: u32 = 99;
        let f: unsafe extern "C" fn(*mut c_void, u32, u64) -> CUresult = raw("cuPointerGetAttribute");
        assert_eq!(f((&mut v as *mut u64).cast(), bogus, d), CUresult::CUDA_ERROR_INVALID_VALUE);

        let (mut base, mut size) = (0u64, 0usize);
        ok(cu::cuMemGetAddressRange_v2(&mut base, &mut size, d + 500));
        assert_eq!((base, size), (d, 1000));
        assert_eq!(
            cu::cuMemGetAddressRange_v2(&mut base, &mut size, d + 1000),
            CUresult::CUDA_ERROR_NOT_FOUND
        );
        dfree(d);
        ok(cu::cuMemFreeHost(h7));
    }
    pfree(h);
}

#[test]
fn device_queries_attributes_and_overrides() {
    setup();
    let attr = |a: CUdevice_attribute, d: i32| {
        let mut v = -99;
        // SAFETY: valid out-pointer.
        let r = unsafe { cu::cuDeviceGetAttribute(&mut v, a, d) };
        (r, v)
    };
    use CUdevice_attribute::*;
    let s = CUresult::CUDA_SUCCESS;
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0), (s, 9));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0), (s, 0));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0), (s, 132));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_WARP_SIZE, 0), (s, 32));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT, 0), (s, 512));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 0), (s, 1));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, 0), (s, 1));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, 3), (s, 0));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, 3), (s, 0));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_MAX_PITCH, 3), (s, 2147483647));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_WARP_SIZE, 4).0, CUresult::CUDA_ERROR_INVALID_DEVICE);
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_MAX, 0).0, CUresult::CUDA_ERROR_INVALID_VALUE);
    // SAFETY: valid out-pointers throughout.
    unsafe {
        let mut n = 0;
        ok(cu::cuDeviceGetCount(&mut n));
        assert_eq!(n, 4);
        let mut d = -1;
        assert_eq!(cu::cuDeviceGet(&mut d, 4), CUresult::CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(cu::cuDeviceGet(&mut d, -1), CUresult::CUDA_ERROR_INVALID_DEVICE);
        ok(cu::cuDeviceGet(&mut d, 3));
        assert_eq!(d, 3);
        let mut name = [0 as c_char; 64];
        ok(cu::cuDeviceGetName(name.as_mut_ptr(), 64, 3));
        assert_eq!(CStr::from_ptr(name.as_ptr()).to_str().unwrap(), "no-frills");
        let mut bytes = 0usize;
        ok(cu::cuDeviceTotalMem_v2(&mut bytes, 1));
        assert_eq!(bytes, 64 << 20);
        let mut v = 0;
        ok(cu::cuDriverGetVersion(&mut v));
        assert_eq!(v, 12080);
        let mut peer = -1;
        ok(cu::cuDeviceCanAccessPeer(&mut peer, 0, 0));
        assert_eq!(peer, 0);
        ok(cu::cuDeviceCanAccessPeer(&mut peer, 0, 1));
        assert_eq!(peer, 1);
        let (mut u0, mut u1) = (std::mem::zeroed::<cu::CUuuid>(), std::mem::zeroed::<cu::CUuuid>());
        ok(cu::cuDeviceGetUuid_v2(&mut u0, 0));
        ok(cu::cuDeviceGetUuid(&mut u1, 1));
        assert_ne!(u0.bytes, u1.bytes);
        let mut s: *const c_char = std::ptr::null();
        ok(cu::cuGetErrorName(CUresult::CUDA_ERROR_INVALID_VALUE, &mut s));
        assert_eq!(CStr::from_ptr(s).to_str().unwrap(), "CUDA_ERROR_INVALID_VALUE");
        ok(cu::cuGetErrorString(CUresult::CUDA_ERROR_OUT_OF_MEMORY, &mut s));
        assert_eq!(CStr::from_ptr(s).to_str().unwrap(), "out of memory");
        let (mut least, mut greatest) = (1, 1);
        bind(0);
        ok(cu::cuCtxGetStreamPriorityRange(&mut least, &mut greatest));
        assert_eq!((least, greatest), (0, -5));
        let mut dev = -1;
        ok(cu::cuCtxGetDevice(&mut dev));
        assert_eq!(dev, 0);
    }
}

#[test]
fn unknown_error_codes_yield_invalid_value_and_null() {
    setup();
    // SAFETY: the exported signatures take enum arguments as 32-bit integers.
    unsafe {
        let name: unsafe extern "C" fn(u32, *mut *const c_char) -> CUresult = raw("cuGetErrorName");
        let mut s: *const c_char = c"sentinel".as_ptr();
        assert_eq!(name(12345, &mut s), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert!(s.is_null());
        let attr: unsafe extern "C" fn(*mut i32, u32, i32) -> CUresult = raw("cuDeviceGetAttribute");
        let mut v = 0;
        assert_eq!(attr(&mut v, 0, 0), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(attr(&mut v, 138, 0), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(attr(&mut v, 5000, 0), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
}

#[test]
fn primary_context_release_to_zero_frees_everything_it_owns() {
    let ctl = setup();
    // Device 2 is used by this test only.
    // SAFETY: valid pointers throughout.
    unsafe {
        let mut ctx: cu::CUcontext = std::ptr::null_mut();
        ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, 2));
        let (mut flags, mut active) = (9u32, 9i32);
        ok(cu::cuDevicePrimaryCtxGetState(2, &mut flags, &mut active));
        assert_eq!(active, 1);
        ok(cu::cuCtxSetCurrent(ctx));
        let p = dalloc(1 << 20);
        let h = pinned(64);
        let s = stream(0);
        let mut e: cu::CUevent = std::ptr::null_mut();
        ok(cu::cuEventCreate(&mut e, 0));
        ok(cu::cuMemsetD8Async(p, 1, 1 << 20, s));
        let report = ctl.live_report();
        let (p_id, h_id) = (report.id_of(p).expect("listed"), report.id_of(h as u64).expect("listed"));
        assert!(report.contains_stream(s as u64) && report.contains_event(e as u64));
        assert!(report.contexts.iter().any(|c| c.device == 2 && c.retain_count == 1));

        ok(cu::cuDevicePrimaryCtxRelease_v2(2));
        // Another test's pinned allocation, made now, is typically handed h's freed host address
        // (mmap reuses it): the report is checked by owner, not by address.
        let neighbour = std::thread::spawn(|| {
            bind(0);
            pinned(64) as usize
        })
        .join()
        .unwrap();
        let report = ctl.live_report();
        assert!(!report.allocations.iter().any(|a| a.device == 2), "device 2 still owns memory:\n{report}");
        assert!(!report.contains_allocation(p_id) && !report.contains_allocation(h_id), "{report}");
        assert!(!report.contains_stream(s as u64) && !report.contains_event(e as u64));
        assert!(!report.contexts.iter().any(|c| c.device == 2));
        ok(cu::cuDevicePrimaryCtxGetState(2, &mut flags, &mut active));
        assert_eq!(active, 0);
        // The released context is still current on this thread: it is destroyed.
        let mut q = 0u64;
        assert_eq!(cu::cuMemAlloc_v2(&mut q, 16), CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED);
        assert_eq!(cu::cuStreamQuery(s), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(cu::cuDevicePrimaryCtxRelease_v2(2), CUresult::CUDA_ERROR_INVALID_CONTEXT);
        ok(cu::cuCtxSetCurrent(std::ptr::null_mut()));
        bind(0);
        pfree(neighbour as *mut u8);
        assert_eq!(cu::cuMemFree_v2(p), CUresult::CUDA_ERROR_INVALID_VALUE);
        let (mut free, mut total) = (0usize, 0usize);
        ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, 2));
        ok(cu::cuCtxSetCurrent(ctx));
        ok(cu::cuMemGetInfo_v2(&mut free, &mut total));
        assert_eq!(free, total, "device 2's memory was returned");
        ok(cu::cuDevicePrimaryCtxSetFlags_v2(2, 4));
        assert_eq!(cu::cuDevicePrimaryCtxSetFlags_v2(2, 8), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu::cuDevicePrimaryCtxSetFlags_v2(2, 3), CUresult::CUDA_ERROR_INVALID_VALUE);
        ok(cu::cuDevicePrimaryCtxRelease_v2(2));
        ok(cu::cuCtxSetCurrent(std::ptr::null_mut()));
    }
}
