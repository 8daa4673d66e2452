//! The entry points programs reach for beyond cudarc's: plain v1 names, per-thread default
//! stream variants, cuGetProcAddress, cuPointerSetAttribute, PCI bus ids and batched copies.

mod common;
mod symbols;

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};

use common::*;
use cudarc::driver::sys::{self as cu, CUdeviceptr, CUresult, CUstream};
use serial_test::{parallel, serial};
use symbols::exported;

const NOT_SUPPORTED: CUresult = CUresult::CUDA_ERROR_NOT_SUPPORTED;
const INVALID_VALUE: CUresult = CUresult::CUDA_ERROR_INVALID_VALUE;

type MemAllocV1 = unsafe extern "C" fn(*mut c_uint, c_uint) -> CUresult;
type MemGetInfoV1 = unsafe extern "C" fn(*mut c_uint, *mut c_uint) -> CUresult;
type MemAllocHostV1 = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CUresult;
type MemFreeV1 = unsafe extern "C" fn(c_uint) -> CUresult;
type MemsetD8Ptsz = unsafe extern "C" fn(CUdeviceptr, u8, usize, CUstream) -> CUresult;
type MemsetD8Ptds = unsafe extern "C" fn(CUdeviceptr, u8, usize) -> CUresult;
type CopyHtoDPtds = unsafe extern "C" fn(CUdeviceptr, *const c_void, usize) -> CUresult;
type CopyDtoHPtds = unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize) -> CUresult;
type StreamPtsz = unsafe extern "C" fn(CUstream) -> CUresult;
type HostFnPtsz = unsafe extern "C" fn(CUstream, cu::CUhostFn, *mut c_void) -> CUresult;
type GetProc = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut u32) -> CUresult;
type SetAttr = unsafe extern "C" fn(*const c_void, u32, CUdeviceptr) -> CUresult;
type GetAttr = unsafe extern "C" fn(*mut c_void, u32, CUdeviceptr) -> CUresult;
type ByBusId = unsafe extern "C" fn(*mut c_int, *const c_char) -> CUresult;
type Batch = unsafe extern "C" fn(
    *const CUdeviceptr,
    *const CUdeviceptr,
    *const usize,
    usize,
    *const cu::CUmemcpyAttributes,
    *const usize,
    usize,
    *mut usize,
    CUstream,
) -> CUresult;

/// Live allocations of this thread's interest: the report's count by kind.
fn live(kind: &str) -> usize {
    setup().live_report().allocations.iter().filter(|a| a.kind == kind).count()
}

#[test]
#[parallel]
fn v1_allocation_cannot_name_the_simulators_addresses_and_leaves_nothing() {
    bind(0);
    // SAFETY: the v1 prototypes of cuda.h's internal section.
    let (alloc, free): (MemAllocV1, MemFreeV1) = unsafe { (raw("cuMemAlloc"), raw("cuMemFree")) };
    let mut p: c_uint = 0xdead;
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { alloc(&mut p, 0) }, INVALID_VALUE, "argument errors are the _v2 ones");
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { alloc(&mut p, 4096) }, NOT_SUPPORTED);
    assert_eq!(p, 0xdead, "nothing written");
    // A 32-bit address names no simulated allocation.
    // SAFETY: plain call with an integer.
    assert_eq!(unsafe { free(0x1000) }, INVALID_VALUE);
    // SAFETY: plain call.
    ok(unsafe { free(0) });
}

#[test]
#[parallel]
fn v1_counts_saturate_and_host_memory_works() {
    bind(0);
    // SAFETY: the v1 prototypes.
    let (info, alloc_host): (MemGetInfoV1, MemAllocHostV1) =
        unsafe { (raw("cuMemGetInfo"), raw("cuMemAllocHost")) };
    let (mut free, mut total) = (0, 0);
    // SAFETY: valid out-pointers.
    ok(unsafe { info(&mut free, &mut total) });
    assert_eq!(total, c_uint::MAX, "4 GiB does not fit an unsigned int");
    let before = live("pinned_host");
    let mut h: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { alloc_host(&mut h, 4096) });
    assert!(!h.is_null());
    assert_eq!(live("pinned_host"), before + 1);
    poke(h.cast(), 4096, 0x5c);
    let d = dalloc(4096);
    // SAFETY: both 4096 bytes.
    ok(unsafe { cu::cuMemcpyHtoD_v2(d, h, 4096) });
    assert!(read_back(d, 4096).iter().all(|&b| b == 0x5c));
    dfree(d);
    pfree(h.cast());
}

#[test]
#[parallel]
fn plain_names_exist_for_every_v2_the_simulator_exports() {
    let v2s = [
        "cuMemGetInfo",
        "cuMemAlloc",
        "cuMemAllocPitch",
        "cuMemFree",
        "cuMemGetAddressRange",
        "cuMemAllocHost",
        "cuMemHostGetDevicePointer",
        "cuMemHostRegister",
        "cuMemcpyHtoD",
        "cuMemcpyDtoH",
        "cuMemcpyDtoD",
        "cuMemcpyHtoDAsync",
        "cuMemcpyDtoHAsync",
        "cuMemcpyDtoDAsync",
        "cuMemcpy2D",
        "cuMemcpy2DUnaligned",
        "cuMemcpy2DAsync",
        "cuMemcpy3D",
        "cuMemcpy3DAsync",
        "cuMemsetD8",
        "cuMemsetD16",
        "cuMemsetD32",
        "cuMemsetD2D8",
        "cuMemsetD2D16",
        "cuMemsetD2D32",
        "cuDeviceTotalMem",
        "cuCtxPushCurrent",
        "cuCtxPopCurrent",
        "cuStreamDestroy",
        "cuEventDestroy",
        "cuDevicePrimaryCtxRelease",
        "cuDevicePrimaryCtxReset",
        "cuDevicePrimaryCtxSetFlags",
        "cuDeviceGetUuid",
        "cuEventElapsedTime",
        "cuMemAdvise",
        "cuMemPrefetchAsync",
    ];
    for name in v2s {
        assert!(exported(&format!("{name}_v2")), "{name}_v2");
        assert!(exported(name), "{name} (plain) is missing");
    }
}

#[test]
#[serial] // holds a stream with a gate: a free elsewhere (implicit synchronisation) would wait for it
fn ptsz_null_is_the_per_thread_stream() {
    bind(0);
    // SAFETY: the exported prototypes.
    let (memset, query, sync, host_fn): (MemsetD8Ptsz, StreamPtsz, StreamPtsz, HostFnPtsz) = unsafe {
        (
            raw("cuMemsetD8Async_ptsz"),
            raw("cuStreamQuery_ptsz"),
            raw("cuStreamSynchronize_ptsz"),
            raw("cuLaunchHostFunc_ptsz"),
        )
    };
    let h = pinned(256);
    poke(h, 256, 1);
    let gate = Gate::block(2 as CUstream);
    // NULL through the _ptsz symbol queues behind the gate on the per-thread stream.
    // SAFETY: plain calls on live memory.
    ok(unsafe { memset(h as CUdeviceptr, 9, 256, std::ptr::null_mut()) });
    settle();
    assert!(peek(h, 256).iter().all(|&b| b == 1), "ran before the per-thread stream's gate opened");
    // SAFETY: plain call.
    assert_eq!(unsafe { query(std::ptr::null_mut()) }, CUresult::CUDA_ERROR_NOT_READY);
    gate.open();
    // SAFETY: plain call.
    ok(unsafe { sync(std::ptr::null_mut()) });
    assert!(peek(h, 256).iter().all(|&b| b == 9));
    // A host function queued through _ptsz with NULL also runs on that stream.
    let gate = Gate::block(2 as CUstream);
    extern "C" fn noop(_: *mut c_void) {}
    // SAFETY: a valid host function.
    ok(unsafe { host_fn(std::ptr::null_mut(), Some(noop), std::ptr::null_mut()) });
    // SAFETY: plain call.
    assert_eq!(unsafe { query(std::ptr::null_mut()) }, CUresult::CUDA_ERROR_NOT_READY);
    drop(gate);
    // SAFETY: plain call.
    ok(unsafe { sync(std::ptr::null_mut()) });
    pfree(h);
}

#[test]
#[parallel]
fn ptds_copies_round_trip_and_return_when_host_memory_is_written() {
    let ctl = bind(0);
    // SAFETY: the exported prototypes.
    let (htod, dtoh, memset): (CopyHtoDPtds, CopyDtoHPtds, MemsetD8Ptds) =
        unsafe { (raw("cuMemcpyHtoD_v2_ptds"), raw("cuMemcpyDtoH_v2_ptds"), raw("cuMemsetD8_v2_ptds")) };
    let d = dalloc(4096);
    let src: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let mut back = vec![0u8; 4096];
    let syncs = ctl.calls_on_this_thread("cuStreamSynchronize");
    // SAFETY: both buffers have 4096 bytes.
    unsafe {
        ok(htod(d, src.as_ptr().cast(), 4096));
        ok(dtoh(back.as_mut_ptr().cast(), d, 4096));
    }
    assert_eq!(back, src);
    assert_eq!(
        ctl.calls_on_this_thread("cuStreamSynchronize"),
        syncs,
        "the wait is the copy's own, not a cuStreamSynchronize call of the program"
    );
    // SAFETY: live allocation.
    ok(unsafe { memset(d + 100, 0xEE, 50) });
    let got = read_back(d, 4096);
    assert!(got[100..150].iter().all(|&b| b == 0xEE) && got[99] == src[99] && got[150] == src[150]);
    // A memset of pinned memory returns once written: no synchronisation needed to see it.
    let h = pinned(64);
    // SAFETY: live pinned allocation.
    ok(unsafe { memset(h as CUdeviceptr, 0x42, 64) });
    assert!(peek(h, 64).iter().all(|&b| b == 0x42));
    // Bounds are the plain functions': a violation, nothing written.
    // SAFETY: deliberately past the end.
    assert_eq!(unsafe { memset(d + 4000, 0, 200) }, INVALID_VALUE);
    pfree(h);
    dfree(d);
}

fn proc(name: &str, version: c_int, flags: u64) -> (CUresult, *mut c_void, u32) {
    // SAFETY: the exported prototype.
    let get: GetProc = unsafe { raw("cuGetProcAddress_v2") };
    let name = CString::new(name).unwrap();
    let mut f: *mut c_void = std::ptr::dangling_mut();
    let mut status = 99;
    // SAFETY: valid pointers.
    let r = unsafe { get(name.as_ptr(), &mut f, version, flags, &mut status) };
    (r, f, status)
}

fn symbol_address(name: &str) -> *mut c_void {
    // SAFETY: only the address is taken.
    unsafe { raw::<*mut c_void>(name) }
}

#[test]
#[parallel]
fn get_proc_address_returns_the_version_and_stream_variant_asked_for() {
    setup();
    let cases = [
        ("cuMemAlloc", 12080, 0, "cuMemAlloc_v2"),
        ("cuMemAlloc", 3000, 0, "cuMemAlloc"),
        ("cuMemcpyHtoD", 12080, 1, "cuMemcpyHtoD_v2"),
        ("cuMemcpyHtoD", 12080, 2, "cuMemcpyHtoD_v2_ptds"),
        ("cuMemcpyHtoD", 6000, 2, "cuMemcpyHtoD_v2"),
        ("cuMemsetD8Async", 12080, 2, "cuMemsetD8Async_ptsz"),
        ("cuStreamQuery", 12080, 0, "cuStreamQuery"),
        ("cuMemAdvise", 12080, 0, "cuMemAdvise_v2"),
        ("cuMemAdvise", 11000, 0, "cuMemAdvise"),
        ("cuMemcpyBatchAsync", 12080, 2, "cuMemcpyBatchAsync_ptsz"),
        ("cuGetProcAddress", 12080, 0, "cuGetProcAddress_v2"),
        ("cuMemAddressReserve", 12080, 0, "cuMemAddressReserve"),
        ("cuMemRetainAllocationHandle", 12080, 2, "cuMemRetainAllocationHandle"),
    ];
    for (name, version, flags, symbol) in cases {
        let (r, f, status) = proc(name, version, flags);
        assert_eq!((r, status), (CUresult::CUDA_SUCCESS, 0), "{name} {version} {flags}");
        assert_eq!(f, symbol_address(symbol), "{name} {version} {flags} should be {symbol}");
    }
    let (r, f, status) = proc("cuCtxGetCacheConfig", 12080, 0);
    assert_eq!(
        (r, f, status),
        (CUresult::CUDA_ERROR_NOT_FOUND, std::ptr::null_mut(), 1),
        "cache configuration is not modelled"
    );
    let (r, f, status) = proc("cuMemPoolExportToShareableHandle", 12080, 0);
    assert_eq!((r, status), (CUresult::CUDA_SUCCESS, 0), "pool export is modelled");
    assert_eq!(f, symbol_address("cuMemPoolExportToShareableHandle"));
    let (r, f, status) = proc("cuNoSuchFunction", 12080, 0);
    assert_eq!((r, f, status), (CUresult::CUDA_ERROR_NOT_FOUND, std::ptr::null_mut(), 1));
    let (r, f, status) = proc("cuMemAllocAsync", 11010, 0);
    assert_eq!(
        (r, f, status),
        (CUresult::CUDA_ERROR_NOT_FOUND, std::ptr::null_mut(), 2),
        "introduced in 11.2"
    );
    assert_eq!(proc("cuMemAlloc", 12080, 4).0, INVALID_VALUE);
}

#[test]
#[parallel]
fn sync_memops_is_set_per_allocation_and_reads_back() {
    bind(0);
    // SAFETY: the exported prototypes with integer attributes.
    let (set, get): (SetAttr, GetAttr) =
        unsafe { (raw("cuPointerSetAttribute"), raw("cuPointerGetAttribute")) };
    let read = |p: CUdeviceptr| {
        let mut v: c_uint = 7;
        // SAFETY: SYNC_MEMOPS is 4 bytes.
        ok(unsafe { get((&raw mut v).cast(), 6, p) });
        v
    };
    let mut m = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocManaged(&mut m, 4096, 1) });
    let d = dalloc(4096);
    assert_eq!((read(m), read(d)), (0, 0));
    let one: c_uint = 1;
    // SAFETY: `one` is an unsigned int.
    ok(unsafe { set((&raw const one).cast(), 6, m + 100) });
    assert_eq!((read(m), read(m + 4000), read(d)), (1, 1, 0), "per allocation, from any address in it");
    let zero: c_uint = 0;
    // SAFETY: as above.
    ok(unsafe { set((&raw const zero).cast(), 6, m) });
    assert_eq!(read(m), 0);
    let two: c_uint = 2;
    // SAFETY: as above; each call is a misuse under test.
    unsafe {
        assert_eq!(set((&raw const one).cast(), 1, m), INVALID_VALUE, "only SYNC_MEMOPS is settable");
        assert_eq!(set((&raw const two).cast(), 6, m), INVALID_VALUE);
        assert_eq!(set(std::ptr::null(), 6, m), INVALID_VALUE);
        assert_eq!(set((&raw const one).cast(), 6, 0x1000), INVALID_VALUE, "not CUDA memory");
    }
    // A reserved range with nothing mapped names no memory either.
    let (mut va, size) = (0, 2 << 20);
    // SAFETY: valid out-pointer; the reservation is freed below.
    ok(unsafe { cu::cuMemAddressReserve(&mut va, size, 0, 0, 0) });
    // SAFETY: `one` is an unsigned int; a misuse under test.
    assert_eq!(unsafe { set((&raw const one).cast(), 6, va) }, INVALID_VALUE, "reserved, nothing mapped");
    // SAFETY: reserved above, nothing mapped.
    ok(unsafe { cu::cuMemAddressFree(va, size) });
    dfree(d);
    dfree(m);
}

#[test]
#[parallel]
fn pci_bus_ids_round_trip() {
    setup();
    // SAFETY: the exported prototype.
    let by_id: ByBusId = unsafe { raw("cuDeviceGetByPCIBusId") };
    for dev in [0, 1, 3] {
        let mut buf = [0 as c_char; 32];
        // SAFETY: 32 writable bytes.
        ok(unsafe { cu::cuDeviceGetPCIBusId(buf.as_mut_ptr(), 32, dev) });
        let mut found = -1;
        // SAFETY: NUL-terminated by the call.
        ok(unsafe { by_id(&mut found, buf.as_ptr()) });
        // SAFETY: as above.
        let text = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap().to_owned();
        assert_eq!(found, dev, "{text}");
    }
    let mut found = -1;
    // SAFETY: NUL-terminated literals; the misuse is under test.
    unsafe {
        assert_eq!(by_id(&mut found, c"not a bus id".as_ptr()), INVALID_VALUE);
        assert_eq!(by_id(&mut found, c"0000:ff:00.0".as_ptr()), CUresult::CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(by_id(std::ptr::null_mut(), c"0000:18:00.0".as_ptr()), INVALID_VALUE);
    }
    assert_eq!(found, -1);
}

fn attrs(order: u32) -> cu::CUmemcpyAttributes {
    // SAFETY: a plain C struct of integers, for which all-zero is valid.
    let mut a: cu::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    // SAFETY: the enum is a u32; writing the raw value lets invalid orders be tested.
    unsafe { std::ptr::write((&raw mut a.srcAccessOrder).cast::<u32>(), order) };
    a
}

#[test]
#[serial] // holds a stream with a gate: a free elsewhere (implicit synchronisation) would wait for it
fn batched_copies_validate_first_and_honour_the_source_access_order() {
    bind(0);
    // SAFETY: the exported prototype.
    let batch: Batch = unsafe { raw("cuMemcpyBatchAsync") };
    let s = stream(1);
    let d = dalloc(1024);
    // SAFETY: live allocation.
    ok(unsafe { cu::cuMemsetD8_v2(d, 0, 1024) });
    let h = pinned(1024);
    poke(h, 1024, 0xA1);
    // Copy 0 (DURING_API_CALL) and copy 1 (STREAM) both read pinned memory; the stream is held,
    // then the source changes: only copy 1 sees the change.
    let gate = Gate::block(s);
    let dsts = [d, d + 512];
    let srcs = [h as CUdeviceptr, h as CUdeviceptr + 512];
    let sizes = [512usize, 512];
    let at = [attrs(2), attrs(1)];
    let idx = [0usize, 1];
    let mut fail = 77usize;
    // SAFETY: arrays of the given lengths; live memory.
    ok(unsafe {
        batch(dsts.as_ptr(), srcs.as_ptr(), sizes.as_ptr(), 2, at.as_ptr(), idx.as_ptr(), 2, &mut fail, s)
    });
    assert_eq!(fail, 77, "failIdx is written only on failure");
    poke(h, 1024, 0xB2);
    gate.open();
    // SAFETY: plain call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
    let got = read_back(d, 1024);
    assert!(got[..512].iter().all(|&b| b == 0xA1), "DURING_API_CALL read the source at the call");
    assert!(got[512..].iter().all(|&b| b == 0xB2), "STREAM read the source in stream order");
    // Validation happens before anything is queued: copy 2 overruns, copies 0 and 1 do not run.
    let dsts = [d, d, d + 1000];
    let srcs = [h as CUdeviceptr; 3];
    let sizes = [16usize, 16, 100];
    let one = [attrs(3)];
    // SAFETY: as above; the overrun is the misuse under test.
    let r = unsafe {
        batch(
            dsts.as_ptr(),
            srcs.as_ptr(),
            sizes.as_ptr(),
            3,
            one.as_ptr(),
            [0usize].as_ptr(),
            1,
            &mut fail,
            s,
        )
    };
    assert_eq!((r, fail), (INVALID_VALUE, 2));
    // An invalid access order is reported at the first copy it applies to.
    let two = [attrs(1), attrs(0)];
    // SAFETY: as above.
    let r = unsafe {
        batch(
            dsts.as_ptr(),
            srcs.as_ptr(),
            [16usize; 3].as_ptr(),
            3,
            two.as_ptr(),
            [0usize, 1].as_ptr(),
            2,
            &mut fail,
            s,
        )
    };
    assert_eq!((r, fail), (INVALID_VALUE, 1));
    // Not one copy's fault: SIZE_MAX. The legacy stream cannot take a batch.
    // SAFETY: as above.
    let r = unsafe {
        batch(
            dsts.as_ptr(),
            srcs.as_ptr(),
            [16usize; 3].as_ptr(),
            3,
            one.as_ptr(),
            [0usize].as_ptr(),
            1,
            &mut fail,
            std::ptr::null_mut(),
        )
    };
    assert_eq!((r, fail), (INVALID_VALUE, usize::MAX));
    // SAFETY: plain call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
    assert_eq!(read_back(d, 16), vec![0xA1; 16], "no refused batch wrote anything");
    destroy(s);
    pfree(h);
    dfree(d);
}

#[test]
#[parallel]
fn get_proc_address_reaches_every_modelled_entry_point_of_the_compatibility_table() {
    setup();
    let readme = include_str!("../README.md");
    let table = readme.split("## Compatibility table").nth(1).expect("README has a compatibility table");
    let mut checked = 0;
    for line in table.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() != 6 || !cells[1].starts_with("cu") || cells[3] != "modelled" {
            continue;
        }
        // The public name: "cuMemAdvise_v2" is cuMemAdvise at CUDA 12.2+.
        let public = cells[1].trim_end_matches("_v2");
        let symbols: Vec<&str> = cells[2].split(',').map(|s| s.trim().trim_matches('`')).collect();
        let (r, f, _) = proc(public, 12080, 0);
        assert_eq!(r, CUresult::CUDA_SUCCESS, "{public}");
        assert!(symbols.iter().any(|s| symbol_address(s) == f), "{public}: {f:?} is none of {symbols:?}");
        if let Some(pt) = symbols.iter().find(|s| s.ends_with("_ptds") || s.ends_with("_ptsz")) {
            let (r, f, _) = proc(public, 12080, 2);
            assert_eq!((r, f), (CUresult::CUDA_SUCCESS, symbol_address(pt)), "{public} per-thread");
        }
        checked += 1;
    }
    assert!(checked > 50, "only {checked} rows checked");
}

/// `CUDA_MEMCPY2D_v1` as a C caller lays it out (32-bit offsets, pitches and device pointers).
#[repr(C)]
struct Memcpy2DV1 {
    src_x: c_uint,
    src_y: c_uint,
    src_type: c_uint,
    src_host: *const c_void,
    src_device: c_uint,
    src_array: *mut c_void,
    src_pitch: c_uint,
    dst_x: c_uint,
    dst_y: c_uint,
    dst_type: c_uint,
    dst_host: *mut c_void,
    dst_device: c_uint,
    dst_array: *mut c_void,
    dst_pitch: c_uint,
    width: c_uint,
    height: c_uint,
}

#[test]
#[parallel]
fn v1_2d_copies_widen_their_descriptor() {
    bind(0);
    // SAFETY: the v1 prototype.
    let copy: unsafe extern "C" fn(*const Memcpy2DV1) -> CUresult = unsafe { raw("cuMemcpy2D") };
    let src: Vec<u8> = (0..=255u8).collect();
    let mut dst = vec![0u8; 256];
    // Rows 1..4 of a 16-byte pitched source, bytes 2..10 of each, into an 8-byte pitched block
    // at row 1 of the destination.
    let c = Memcpy2DV1 {
        src_x: 2,
        src_y: 1,
        src_type: 1,
        src_host: src.as_ptr().cast(),
        src_device: 0,
        src_array: std::ptr::null_mut(),
        src_pitch: 16,
        dst_x: 0,
        dst_y: 1,
        dst_type: 1,
        dst_host: dst.as_mut_ptr().cast(),
        dst_device: 0,
        dst_array: std::ptr::null_mut(),
        dst_pitch: 8,
        width: 8,
        height: 3,
    };
    // SAFETY: both buffers hold every row the descriptor names.
    ok(unsafe { copy(&c) });
    let mut want = vec![0u8; 256];
    for row in 0..3 {
        for col in 0..8 {
            want[(row + 1) * 8 + col] = src[(row + 1) * 16 + 2 + col];
        }
    }
    assert_eq!(dst, want);
    // A device side names a 32-bit address: no simulated allocation, INVALID_VALUE.
    let c = Memcpy2DV1 { dst_type: 2, dst_device: 0x1000, dst_host: std::ptr::null_mut(), ..c };
    // SAFETY: as above; the device address is the misuse under test.
    assert_eq!(unsafe { copy(&c) }, INVALID_VALUE);
}

/// One batch of `dsts.len()` copies, all under the attributes `order`; `(result, failIdx)`.
fn run_batch(
    dsts: &[CUdeviceptr],
    srcs: &[CUdeviceptr],
    sizes: &[usize],
    order: u32,
    s: CUstream,
) -> (CUresult, usize) {
    // SAFETY: the exported prototype.
    let batch: Batch = unsafe { raw("cuMemcpyBatchAsync") };
    let mut fail = 77usize;
    let at = [attrs(order)];
    // SAFETY: arrays of the given lengths; the caller passes live memory or memory the batch
    // must refuse.
    let r = unsafe {
        batch(
            dsts.as_ptr(),
            srcs.as_ptr(),
            sizes.as_ptr(),
            dsts.len(),
            at.as_ptr(),
            [0usize].as_ptr(),
            1,
            &mut fail,
            s,
        )
    };
    (r, fail)
}

#[test]
#[serial] // holds a stream with a gate: a free elsewhere (implicit synchronisation) would wait for it
fn batched_copies_check_every_copy_as_a_copy_before_queuing_and_read_only_host_memory() {
    bind(1); // no concurrent managed access: queued work keeps the host out of managed memory
    let s = stream(1);
    let d = dalloc(1024);
    // SAFETY: live allocation.
    ok(unsafe { cu::cuMemsetD8_v2(d, 0, 1024) });
    let h = pinned(256);
    poke(h, 256, 0x5A);
    let freed = dalloc(256);
    dfree(freed);
    // A freed device source: refused at validation for every access order (DURING_API_CALL
    // must not read it), and the valid copy before it is not queued.
    for order in [1, 2, 3] {
        let r = run_batch(&[d, d + 256], &[h as CUdeviceptr, freed], &[256, 256], order, s);
        assert_eq!(r, (INVALID_VALUE, 1), "order {order}");
    }
    // SAFETY: plain call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
    assert_eq!(read_back(d, 512), vec![0; 512], "no refused batch wrote anything");
    // A managed source that queued work keeps the program out of: read DURING_API_CALL all
    // the same (the driver reads it, the program does not).
    let mut m = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocManaged(&mut m, 8192, 1) });
    poke(m as usize as *mut u8, 256, 0xC3);
    let gate = Gate::block(s);
    // SAFETY: `h` holds 256 bytes and stays allocated until after the synchronisation below.
    ok(unsafe { cu::cuMemcpyHtoDAsync_v2(m + 4096, h.cast(), 256, s) });
    assert_eq!(run_batch(&[d + 512], &[m], &[256], 2, s), (CUresult::CUDA_SUCCESS, 77));
    gate.open();
    // SAFETY: plain call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
    assert_eq!(read_back(d + 512, 256), vec![0xC3; 256]);
    destroy(s);
    dfree(m);
    pfree(h);
    dfree(d);
}

#[test]
#[parallel]
fn a_ptsz_batch_on_the_null_stream_uses_the_per_thread_stream() {
    bind(0);
    // SAFETY: the exported prototype.
    let batch: Batch = unsafe { raw("cuMemcpyBatchAsync_ptsz") };
    let d = dalloc(256);
    let src = vec![0x3Cu8; 256];
    let mut fail = 5usize;
    let at = [attrs(3)];
    // SAFETY: arrays of length 1; the pageable source is staged at the call.
    ok(unsafe {
        batch(
            [d].as_ptr(),
            [src.as_ptr() as CUdeviceptr].as_ptr(),
            [256usize].as_ptr(),
            1,
            at.as_ptr(),
            [0usize].as_ptr(),
            1,
            &mut fail,
            std::ptr::null_mut(),
        )
    });
    // SAFETY: plain call on the per-thread stream.
    ok(unsafe { cu::cuStreamSynchronize(2 as CUstream) });
    assert_eq!(read_back(d, 256), src);
    assert_eq!(fail, 5);
    dfree(d);
}

#[test]
#[serial] // holds a stream with a gate: a free elsewhere (implicit synchronisation) would wait for it
fn sync_memops_makes_a_device_memset_return_only_when_done() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    bind(0);
    // SAFETY: the exported prototype with an integer attribute.
    let set: SetAttr = unsafe { raw("cuPointerSetAttribute") };
    let d = dalloc(4096);
    let one: c_uint = 1;
    // SAFETY: `one` is an unsigned int.
    ok(unsafe { set((&raw const one).cast(), 6, d) });
    // Work queued earlier on a blocking stream holds the legacy stream, where cuMemsetD8 runs.
    let s = stream(0);
    let gate = Arc::new(Gate::block(s));
    let opened = Arc::new(AtomicBool::new(false));
    let opener = {
        let (gate, opened) = (Arc::clone(&gate), Arc::clone(&opened));
        std::thread::spawn(move || {
            settle();
            opened.store(true, Ordering::SeqCst);
            gate.open();
        })
    };
    // SAFETY: live allocation.
    ok(unsafe { cu::cuMemsetD8_v2(d, 0x6B, 4096) });
    assert!(opened.load(Ordering::SeqCst), "returned before the memset could run");
    opener.join().unwrap();
    assert!(read_back(d, 4096).iter().all(|&b| b == 0x6B));
    // SAFETY: plain call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
    destroy(s);
    dfree(d);
}
