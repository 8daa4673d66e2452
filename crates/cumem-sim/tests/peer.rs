//! Peer access through the raw C API on four devices, 0-1 linked both ways and 2>3 one way: the matrix
//! and P2P attributes as configured, enable/disable and their misuse codes (as measured, §17 and
//! §11 of the driver reference), peer copies (which need no enabled access, as observed) in
//! stream order, and `cuMemSetAccess` for a peer device following the matrix.

mod common;

use std::ffi::c_int;
use std::sync::OnceLock;

use common::{Gate, dalloc, destroy, dfree, load, ok, read_back, settle, stream};
use cudarc::driver::sys::{self as cu, CUcontext, CUdeviceptr, CUresult};
use serial_test::{parallel, serial};

const CONFIG: &str = "leak_check=1,devices=4,memory=1GiB,latency_us=200,peer=0-1,2>3";

static CTX: OnceLock<Vec<usize>> = OnceLock::new();

/// Initialises the simulator with the peer matrix and retains every primary context.
fn contexts() -> &'static [usize] {
    CTX.get_or_init(|| {
        load().configure(CONFIG).expect("valid configuration");
        // SAFETY: plain FFI call into the loaded simulator.
        ok(unsafe { cu::cuInit(0) });
        (0..4)
            .map(|d| {
                let mut ctx: CUcontext = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                ok(unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, d) });
                ctx as usize
            })
            .collect()
    })
}

fn ctx(dev: usize) -> CUcontext {
    contexts()[dev] as CUcontext
}

fn bind(dev: usize) {
    // SAFETY: a retained primary context.
    ok(unsafe { cu::cuCtxSetCurrent(ctx(dev)) });
}

fn enable(peer: CUcontext, flags: u32) -> CUresult {
    // SAFETY: plain FFI call.
    unsafe { cu::cuCtxEnablePeerAccess(peer, flags) }
}

fn disable(peer: CUcontext) -> CUresult {
    // SAFETY: plain FFI call.
    unsafe { cu::cuCtxDisablePeerAccess(peer) }
}

fn p2p(attrib: u32, src: c_int, dst: c_int) -> (CUresult, c_int) {
    // SAFETY: the exported signature, with the attribute as a raw integer.
    let f: unsafe extern "C" fn(*mut c_int, u32, c_int, c_int) -> CUresult =
        unsafe { common::raw("cuDeviceGetP2PAttribute") };
    let mut v = -1;
    // SAFETY: valid out-pointer.
    let r = unsafe { f(&mut v, attrib, src, dst) };
    (r, v)
}

fn on(dev: usize, bytes: &[u8]) -> CUdeviceptr {
    bind(dev);
    let p = dalloc(bytes.len());
    // SAFETY: `bytes` is readable for its length.
    ok(unsafe { cu::cuMemcpyHtoD_v2(p, bytes.as_ptr().cast(), bytes.len()) });
    p
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
#[parallel]
fn the_matrix_and_the_p2p_attributes_read_back_as_configured() {
    contexts();
    for a in 0..4 {
        for b in 0..4 {
            let linked = matches!((a, b), (0, 1) | (1, 0) | (2, 3));
            let mut can = -1;
            // SAFETY: valid out-pointer.
            ok(unsafe { cu::cuDeviceCanAccessPeer(&mut can, a, b) });
            assert_eq!(can, c_int::from(linked), "{a} -> {b}");
            if a == b {
                continue;
            }
            for attrib in [2, 3, 4] {
                assert_eq!(p2p(attrib, a, b), (CUresult::CUDA_SUCCESS, c_int::from(linked)), "{a} -> {b}");
            }
            assert_eq!(p2p(1, a, b), (CUresult::CUDA_SUCCESS, 0));
        }
    }
}

#[test]
#[parallel]
fn p2p_attribute_misuse_gives_the_documented_codes() {
    contexts();
    // SAFETY: NULL output is the checked misuse.
    let r = unsafe {
        cu::cuDeviceGetP2PAttribute(
            std::ptr::null_mut(),
            cu::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED,
            0,
            1,
        )
    };
    assert_eq!(r, CUresult::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(p2p(2, 1, 1).0, CUresult::CUDA_ERROR_INVALID_DEVICE);
    assert_eq!(p2p(2, 0, 4).0, CUresult::CUDA_ERROR_INVALID_DEVICE);
    // Devices are checked before the attribute.
    assert_eq!(p2p(99, 0, 0).0, CUresult::CUDA_ERROR_INVALID_DEVICE);
    assert_eq!(p2p(99, 0, 1).0, CUresult::CUDA_ERROR_INVALID_VALUE);
}

#[test]
#[serial]
fn enabling_and_disabling_give_the_measured_codes() {
    bind(0);
    ok(enable(ctx(1), 0));
    let pairs = load().live_report().peer_access;
    assert_eq!(pairs.len(), 1, "the enabled pair is listed: {pairs:?}");
    assert_eq!(
        (pairs[0].context, pairs[0].device, pairs[0].peer_context, pairs[0].peer_device),
        (ctx(0) as u64, 0, ctx(1) as u64, 1)
    );
    assert!(load().live_report().to_string().contains("peer access enabled from context"));
    assert_eq!(enable(ctx(1), 0), CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
    // One direction only: device 1 has not enabled access to device 0.
    bind(1);
    assert_eq!(disable(ctx(0)), CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
    bind(0);
    ok(disable(ctx(1)));
    assert!(load().live_report().peer_access.is_empty(), "the disabled pair is gone");
    assert_eq!(disable(ctx(1)), CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);

    assert_eq!(enable(ctx(2), 0), CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
    assert_eq!(enable(ctx(0), 0), CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
    assert_eq!(enable(ctx(1), 1), CUresult::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(enable(std::ptr::null_mut(), 0), CUresult::CUDA_ERROR_INVALID_CONTEXT);
    assert_eq!(disable(std::ptr::null_mut()), CUresult::CUDA_ERROR_INVALID_CONTEXT);
    assert_eq!(disable(ctx(0)), CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
    // A refused enable recorded nothing.
    assert_eq!(disable(ctx(2)), CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
    // A one-way link: 2 may access 3, not the reverse.
    bind(3);
    assert_eq!(enable(ctx(2), 0), CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
    bind(0);

    // SAFETY: plain FFI calls; no current context on this thread afterwards.
    ok(unsafe { cu::cuCtxSetCurrent(std::ptr::null_mut()) });
    assert_eq!(enable(ctx(1), 0), CUresult::CUDA_ERROR_INVALID_CONTEXT);
}

#[test]
#[serial]
fn access_is_lost_when_the_peer_context_is_reset() {
    bind(2);
    ok(enable(ctx(3), 0));
    // SAFETY: plain FFI call; device 3's context stays retained (re-initialised on use).
    ok(unsafe { cu::cuDevicePrimaryCtxReset_v2(3) });
    bind(2);
    assert_eq!(disable(ctx(3)), CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
    ok(enable(ctx(3), 0));
    ok(disable(ctx(3)));
}

#[test]
#[parallel]
fn peer_copies_carry_bytes_between_unlinked_devices_without_enabled_access() {
    let n = 4096 + 7;
    let src = on(0, &pattern(n, 3));
    let near = on(1, &vec![0; n]);
    let far = on(2, &vec![0; n]);
    bind(0);
    ok(unsafe_copy_peer(near, 1, src, 0, n));
    ok(unsafe_copy_peer(far, 2, src, 0, n));
    assert_eq!(read_back(near, n), pattern(n, 3));
    assert_eq!(read_back(far, n), pattern(n, 3));
    // Plain cuMemcpy between two devices works too (unified addressing).
    let back = on(3, &vec![0; n]);
    // SAFETY: both are live device allocations of `n` bytes.
    ok(unsafe { cu::cuMemcpy(back, far, n) });
    assert_eq!(read_back(back, n), pattern(n, 3));
    // NULL contexts are accepted, as observed: the driver finds the memory by its address.
    let again = on(1, &vec![0; n]);
    // SAFETY: plain FFI call on live allocations.
    ok(unsafe { cu::cuMemcpyPeer(again, std::ptr::null_mut(), src, std::ptr::null_mut(), n) });
    assert_eq!(read_back(again, n), pattern(n, 3));
    dfree(again);
    // Overrunning the destination is refused before anything is copied.
    // SAFETY: plain FFI call.
    let r = unsafe { cu::cuMemcpyPeer(near + 8, ctx(1), src, ctx(0), n) };
    assert_eq!(r, CUresult::CUDA_ERROR_INVALID_VALUE);
    for p in [src, near, far, back] {
        dfree(p);
    }
}

#[test]
#[parallel]
fn a_peer_copy_naming_the_wrong_contexts_is_carried_out_and_logged() {
    let n = 4096;
    let src = on(0, &pattern(n, 5));
    let dst = on(1, &vec![0; n]);
    let ctl = load();
    bind(0);
    // The driver finds both ends by address (a NULL context is accepted on real hardware), so
    // swapped contexts copy all the same; the simulator logs the caller's mistake.
    ok(unsafe_copy_peer(dst, 0, src, 1, n));
    assert_eq!(read_back(dst, n), pattern(n, 5));
    let mismatches: Vec<_> = ctl
        .violations_on_this_thread()
        .into_iter()
        .filter(|v| v.function == "cuMemcpyPeer" && v.code == 0 && v.message.contains("context"))
        .collect();
    assert_eq!(mismatches.len(), 2, "{mismatches:?}");
    assert!(
        mismatches[0].message.contains("destination context")
            && mismatches[1].message.contains("source context")
    );
    // Each end named with its own context: nothing more is logged.
    ok(unsafe_copy_peer(dst, 1, src, 0, n));
    let after = ctl.violations_on_this_thread().iter().filter(|v| v.message.contains("context")).count();
    assert_eq!(after, 2);
    dfree(src);
    dfree(dst);
}

fn unsafe_copy_peer(
    dst: CUdeviceptr,
    dst_dev: usize,
    src: CUdeviceptr,
    src_dev: usize,
    n: usize,
) -> CUresult {
    // SAFETY: plain FFI call; the pointers are checked by the simulator.
    unsafe { cu::cuMemcpyPeer(dst, ctx(dst_dev), src, ctx(src_dev), n) }
}

#[test]
#[serial] // holds a stream with a gate
fn a_queued_peer_copy_waits_for_its_streams_earlier_work() {
    let n = 1 << 16;
    let src = on(0, &pattern(n, 9));
    let dst = on(2, &vec![0; n]);
    bind(0);
    let s = stream(1);
    let gate = Gate::block(s);
    // SAFETY: plain FFI call on live allocations.
    ok(unsafe { cu::cuMemcpyPeerAsync(dst, ctx(2), src, ctx(0), n, s) });
    settle();
    assert_eq!(read_back(dst, n), vec![0; n], "the copy ran before the gate opened");
    gate.open();
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuStreamSynchronize(s) });
    assert_eq!(read_back(dst, n), pattern(n, 9));
    destroy(s);
    dfree(src);
    dfree(dst);
}

#[test]
#[parallel]
fn a_3d_peer_copy_moves_a_box_between_devices() {
    let (w, h, pitch) = (40usize, 6usize, 64usize);
    let src = on(1, &pattern(pitch * h, 5));
    let dst = on(3, &vec![0; pitch * h]);
    bind(1);
    let dev = cu::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    let mut c = cu::CUDA_MEMCPY3D_PEER {
        srcXInBytes: 0,
        srcY: 0,
        srcZ: 0,
        srcLOD: 0,
        srcMemoryType: dev,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcContext: ctx(1),
        srcPitch: pitch,
        srcHeight: h,
        dstXInBytes: 0,
        dstY: 0,
        dstZ: 0,
        dstLOD: 0,
        dstMemoryType: dev,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstContext: ctx(3),
        dstPitch: pitch,
        dstHeight: h,
        WidthInBytes: w,
        Height: h,
        Depth: 1,
    };
    // SAFETY: a valid descriptor of two live allocations.
    ok(unsafe { cu::cuMemcpy3DPeer(&c) });
    let got = read_back(dst, pitch * h);
    let want = pattern(pitch * h, 5);
    for y in 0..h {
        assert_eq!(got[y * pitch..y * pitch + w], want[y * pitch..y * pitch + w], "row {y}");
        assert!(got[y * pitch + w..(y + 1) * pitch].iter().all(|&b| b == 0), "row {y} padding");
    }
    c.dstContext = std::ptr::null_mut();
    // Unobserved on hardware for the 3D form: refusing a NULL context is the simulator's choice.
    // SAFETY: as above, with a NULL context.
    assert_eq!(unsafe { cu::cuMemcpy3DPeer(&c) }, CUresult::CUDA_ERROR_INVALID_CONTEXT);
    dfree(src);
    dfree(dst);
}

#[test]
#[parallel]
fn a_vmm_mapping_is_accessible_from_a_linked_device_only() {
    contexts();
    bind(0);
    // SAFETY: an all-zero CUmemAllocationProp is valid (every enum has a 0 variant).
    let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 };
    let g = 2 << 20;
    let (mut va, mut h) = (0, 0);
    // SAFETY: valid out-pointers and property.
    unsafe {
        ok(cu::cuMemAddressReserve(&mut va, g, 0, 0, 0));
        ok(cu::cuMemCreate(&mut h, g, &prop, 0));
        ok(cu::cuMemMap(va, g, 0, h, 0));
    }
    let access = |dev: i32| {
        let desc = cu::CUmemAccessDesc {
            location: cu::CUmemLocation {
                type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: dev,
            },
            flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: one valid descriptor.
        unsafe { cu::cuMemSetAccess(va, g, &desc, 1) }
    };
    ok(access(1));
    assert_eq!(access(2), CUresult::CUDA_ERROR_INVALID_DEVICE);
    // SAFETY: tearing down what was made above.
    unsafe {
        ok(cu::cuMemUnmap(va, g));
        ok(cu::cuMemRelease(h));
        ok(cu::cuMemAddressFree(va, g));
    }
}

/// Access to a VMM mapping is the access of the device that runs the work: the device of the
/// stream a memset or copy is queued on, not the device of the calling thread's current context
/// (§9: access is granted per device; work runs on its stream's device).
#[test]
#[parallel]
fn vmm_access_is_checked_against_the_streams_device_not_the_current_contexts() {
    contexts();
    // SAFETY: an all-zero CUmemAllocationProp is valid (every enum has a 0 variant).
    let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 };
    let g = 2 << 20;
    let (mut va, mut h) = (0, 0);
    bind(0);
    // SAFETY: valid out-pointers and property.
    unsafe {
        ok(cu::cuMemAddressReserve(&mut va, g, 0, 0, 0));
        ok(cu::cuMemCreate(&mut h, g, &prop, 0));
        ok(cu::cuMemMap(va, g, 0, h, 0));
    }
    let grant = |dev: i32, flags| {
        let desc = cu::CUmemAccessDesc {
            location: cu::CUmemLocation {
                type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: dev,
            },
            flags,
        };
        // SAFETY: one valid descriptor.
        ok(unsafe { cu::cuMemSetAccess(va, g, &desc, 1) });
    };
    bind(1);
    let s1 = stream(0);
    bind(0);
    let s0 = stream(0);
    let memset_on = |s| {
        // SAFETY: plain FFI call.
        let r = unsafe { cu::cuMemsetD8Async(va, 0x5a, 4096, s) };
        // SAFETY: plain FFI call.
        ok(unsafe { cu::cuStreamSynchronize(s) });
        r
    };

    // Device 0 only: device 0's context is current, but device 1 runs the work.
    grant(0, cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    grant(1, cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE);
    assert_eq!(memset_on(s1), CUresult::CUDA_ERROR_INVALID_VALUE, "device 1 has no access");
    ok(memset_on(s0));

    // Device 1 only: the same call from device 0's context runs on device 1, which may write.
    grant(1, cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    grant(0, cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE);
    ok(memset_on(s1));
    assert_eq!(memset_on(s0), CUresult::CUDA_ERROR_INVALID_VALUE, "device 0 has no access");

    // Read back on device 1's stream, which may read.
    let mut back = vec![0u8; 4096];
    // SAFETY: `back` is writable for its length; the stream is synchronised before it is read.
    unsafe {
        ok(cu::cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), va, 4096, s1));
        ok(cu::cuStreamSynchronize(s1));
    }
    assert!(back.iter().all(|&b| b == 0x5a));
    destroy(s0);
    bind(1);
    destroy(s1);
    bind(0);
    // SAFETY: tearing down what was made above.
    unsafe {
        ok(cu::cuMemUnmap(va, g));
        ok(cu::cuMemRelease(h));
        ok(cu::cuMemAddressFree(va, g));
    }
}
