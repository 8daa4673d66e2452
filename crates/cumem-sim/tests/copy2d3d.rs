//! Pitched allocations, 2D/3D copies and 2D memsets: validation codes, bounds checks before any
//! write, sync behaviour, and a randomized comparison against a CPU reference.

mod common;

use std::ffi::c_void;

use common::*;
use cudarc::driver::sys::{self as cu, CUdeviceptr, CUmemorytype, CUresult};
use proptest::prelude::*;

fn pitched(w: usize, h: usize) -> (CUdeviceptr, usize) {
    let (mut p, mut pitch) = (0, 0);
    // SAFETY: valid out-pointers.
    ok(unsafe { cu::cuMemAllocPitch_v2(&mut p, &mut pitch, w, h, 4) });
    (p, pitch)
}

fn zeroed_2d() -> cu::CUDA_MEMCPY2D {
    let host = CUmemorytype::CU_MEMORYTYPE_HOST;
    cu::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: host,
        srcHost: std::ptr::null(),
        srcDevice: 0,
        srcArray: std::ptr::null_mut(),
        srcPitch: 0,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: host,
        dstHost: std::ptr::null_mut(),
        dstDevice: 0,
        dstArray: std::ptr::null_mut(),
        dstPitch: 0,
        WidthInBytes: 0,
        Height: 0,
    }
}

fn zeroed_3d() -> cu::CUDA_MEMCPY3D {
    let host = CUmemorytype::CU_MEMORYTYPE_HOST;
    cu::CUDA_MEMCPY3D {
        srcXInBytes: 0,
        srcY: 0,
        srcZ: 0,
        srcLOD: 0,
        srcMemoryType: host,
        srcHost: std::ptr::null(),
        srcDevice: 0,
        srcArray: std::ptr::null_mut(),
        reserved0: std::ptr::null_mut(),
        srcPitch: 0,
        srcHeight: 0,
        dstXInBytes: 0,
        dstY: 0,
        dstZ: 0,
        dstLOD: 0,
        dstMemoryType: host,
        dstHost: std::ptr::null_mut(),
        dstDevice: 0,
        dstArray: std::ptr::null_mut(),
        reserved1: std::ptr::null_mut(),
        dstPitch: 0,
        dstHeight: 0,
        WidthInBytes: 0,
        Height: 0,
        Depth: 0,
    }
}

#[test]
fn alloc_pitch_rules() {
    let ctl = bind(0);
    let (mut p, mut pitch) = (0x11u64, 0usize);
    // SAFETY: valid out-pointers.
    unsafe {
        let e = CUresult::CUDA_ERROR_INVALID_VALUE;
        assert_eq!(cu::cuMemAllocPitch_v2(&mut p, &mut pitch, 100, 10, 2), e);
        assert_eq!(cu::cuMemAllocPitch_v2(&mut p, &mut pitch, 0, 10, 4), e);
        assert_eq!(cu::cuMemAllocPitch_v2(&mut p, &mut pitch, 100, 0, 4), e);
        assert_eq!(cu::cuMemAllocPitch_v2(&mut p, &mut pitch, 1 << 31, 1, 4), e, "width above MAX_PITCH");
        assert_eq!(p, 0x11);
        ok(cu::cuMemAllocPitch_v2(&mut p, &mut pitch, 100, 10, 16));
    }
    assert_eq!(pitch, 512);
    let a = ctl.live_report().allocations.into_iter().find(|a| a.ptr == p).unwrap();
    assert_eq!((a.kind.as_str(), a.bytes), ("pitched", 5120));
    let (q, qp) = pitched(513, 3);
    assert_eq!(qp, 1024);
    dfree(q);
    dfree(p);
}

#[test]
fn copy_2d_validation_and_zero_extents() {
    let ctl = bind(0);
    let (d, pitch) = pitched(64, 4);
    // SAFETY: live allocation.
    ok(unsafe { cu::cuMemsetD8_v2(d, 0xEE, pitch * 4) });
    let mut host = vec![1u8; 64 * 4];
    let mut c = zeroed_2d();
    c.srcHost = host.as_ptr().cast();
    c.srcPitch = 64;
    c.dstMemoryType = CUmemorytype::CU_MEMORYTYPE_DEVICE;
    c.dstDevice = d;
    c.dstPitch = pitch;
    c.WidthInBytes = 64;
    c.Height = 0;
    let e = CUresult::CUDA_ERROR_INVALID_VALUE;
    // SAFETY: the descriptors point at live memory (or are rejected before any access).
    unsafe {
        ok(cu::cuMemcpy2D_v2(&c));
        c.Height = 4;
        c.WidthInBytes = 0;
        ok(cu::cuMemcpy2D_v2(&c));
        c.WidthInBytes = 64;
        assert_eq!(cu::cuMemcpy2D_v2(std::ptr::null()), e);
        c.srcPitch = 63;
        assert_eq!(cu::cuMemcpy2D_v2(&c), e, "pitch below width");
        c.srcPitch = 64;
        c.dstXInBytes = pitch - 10;
        assert_eq!(cu::cuMemcpy2D_v2(&c), e, "pitch below x + width");
        c.dstXInBytes = 0;
        c.dstY = 1; // the last row would run past the allocation
        assert_eq!(cu::cuMemcpy2D_v2(&c), e);
        c.dstY = 0;
        c.dstMemoryType = CUmemorytype::CU_MEMORYTYPE_ARRAY;
        assert_eq!(cu::cuMemcpy2D_v2(&c), e);
        let raw_2d: unsafe extern "C" fn(*const [u64; 16]) -> CUresult = raw("cuMemcpy2D_v2");
        let mut words: [u64; 16] = std::mem::transmute(c);
        words[9] = 7; // dstMemoryType
        assert_eq!(raw_2d(&words), e);
        c.dstMemoryType = CUmemorytype::CU_MEMORYTYPE_DEVICE;
        // Two rows refuse a pitch above MAX_PITCH (the documentation's rule); one row ignores it,
        // as it ignores whether the pitch holds a row (observed on an H100, 2026-11-24).
        c.Height = 2;
        c.srcPitch = 1 << 31;
        assert_eq!(cu::cuMemcpy2D_v2(&c), e, "two rows, a pitch above MAX_PITCH");
        c.Height = 1;
        ok(cu::cuMemcpy2D_v2(&c));
        c.srcPitch = 0;
        c.dstPitch = 0;
        ok(cu::cuMemcpy2D_v2(&c));
    }
    let back = read_back(d, pitch * 4);
    assert!(back[..64].iter().all(|&b| b == 1));
    assert!(back[64..].iter().all(|&b| b == 0xEE), "failed copies wrote nothing");
    // Device to pageable host through the async form: written before it returns.
    let s = stream(0);
    let mut c = zeroed_2d();
    c.srcMemoryType = CUmemorytype::CU_MEMORYTYPE_DEVICE;
    c.srcDevice = d;
    c.srcPitch = pitch;
    c.dstHost = host.as_mut_ptr().cast::<c_void>();
    c.dstPitch = 64;
    c.WidthInBytes = 64;
    c.Height = 4;
    // SAFETY: `host` has 4 rows of 64 bytes.
    ok(unsafe { cu::cuMemcpy2DAsync_v2(&c, s) });
    assert!(host[..64].iter().all(|&b| b == 1) && host[64..].iter().all(|&b| b == 0xEE));
    // 3D: LOD and reserved fields, Depth 0, slice heights.
    let mut c3 = zeroed_3d();
    c3.srcMemoryType = CUmemorytype::CU_MEMORYTYPE_DEVICE;
    c3.srcDevice = d;
    c3.srcPitch = pitch;
    c3.srcHeight = 2;
    c3.dstHost = host.as_mut_ptr().cast::<c_void>();
    c3.dstPitch = 64;
    c3.dstHeight = 2;
    c3.WidthInBytes = 64;
    c3.Height = 2;
    c3.Depth = 0;
    // SAFETY: as above.
    unsafe {
        ok(cu::cuMemcpy3D_v2(&c3));
        c3.Depth = 2;
        c3.srcLOD = 1;
        assert_eq!(cu::cuMemcpy3D_v2(&c3), e);
        c3.srcLOD = 0;
        c3.reserved0 = 8 as *mut c_void;
        assert_eq!(cu::cuMemcpy3D_v2(&c3), e);
        c3.reserved0 = std::ptr::null_mut();
        c3.srcY = 1;
        assert_eq!(cu::cuMemcpy3D_v2(&c3), e, "srcHeight < Height + srcY");
        c3.srcY = 0;
        ok(cu::cuMemcpy3DAsync_v2(&c3, s));
        ok(cu::cuStreamSynchronize(s));
    }
    destroy(s);
    dfree(d);
    assert!(ctl.violations_on_this_thread().iter().any(|v| v.message.contains("arrays are not modelled")));
}

#[test]
fn memset_2d_rules() {
    bind(0);
    let (d, pitch) = pitched(64, 4);
    // SAFETY: live allocation; the refused calls are the misuse under test.
    unsafe {
        ok(cu::cuMemsetD8_v2(d, 0, pitch * 4));
        let e = CUresult::CUDA_ERROR_INVALID_VALUE;
        ok(cu::cuMemsetD2D8_v2(0, 0, 1, 0, 5));
        ok(cu::cuMemsetD2D8_v2(0, 0, 1, 5, 0));
        assert_eq!(cu::cuMemsetD2D32_v2(d + 2, pitch, 1, 4, 2), e, "alignment");
        assert_eq!(cu::cuMemsetD2D32_v2(d, 10, 1, 4, 2), e, "pitch below the row");
        assert_eq!(cu::cuMemsetD2D16_v2(d, 33, 1, 4, 2), e, "pitch not a multiple of 2");
        assert_eq!(cu::cuMemsetD2D8_v2(d, pitch, 1, 64, 5), e, "fifth row past the end");
        ok(cu::cuMemsetD2D32_v2(d, 0, 0x0403_0201, 4, 1)); // pitch unchecked for one row
        ok(cu::cuMemsetD2D16_v2(d + pitch as u64, pitch, 0xBBAA, 8, 3));
        let s = stream(0);
        ok(cu::cuMemsetD2D8Async(d + 32, pitch, 0x77, 4, 4, s));
        ok(cu::cuStreamSynchronize(s));
        destroy(s);
    }
    let back = read_back(d, pitch * 4);
    assert_eq!(&back[..4], &[1, 2, 3, 4]);
    assert_eq!(&back[4..16], &[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4]);
    assert!(back[16..32].iter().all(|&b| b == 0));
    for row in 0..4 {
        let r = &back[row * pitch..(row + 1) * pitch];
        assert!(r[32..36].iter().all(|&b| b == 0x77));
        if row > 0 {
            assert_eq!(&r[..16], &[0xAA, 0xBB].repeat(8)[..]);
            assert!(r[16..32].iter().all(|&b| b == 0));
        }
        assert!(r[36..].iter().all(|&b| b == 0));
    }
    dfree(d);
}

#[test]
fn absurd_row_counts_are_refused_before_any_row_is_built() {
    let ctl = bind(0);
    let d = dalloc(1024);
    // SAFETY: live allocation.
    ok(unsafe { cu::cuMemsetD8_v2(d, 0, 1024) });
    let e = CUresult::CUDA_ERROR_INVALID_VALUE;
    let host = [0u8; 16];
    let mut c = zeroed_2d();
    c.srcHost = host.as_ptr().cast();
    c.srcPitch = 1;
    c.dstMemoryType = CUmemorytype::CU_MEMORYTYPE_DEVICE;
    c.dstDevice = d;
    c.dstPitch = 1;
    c.WidthInBytes = 1;
    c.Height = 1 << 40;
    let mut c3 = zeroed_3d();
    c3.srcHost = host.as_ptr().cast();
    c3.srcPitch = 1;
    c3.srcHeight = 1 << 33;
    c3.dstMemoryType = CUmemorytype::CU_MEMORYTYPE_DEVICE;
    c3.dstDevice = d;
    c3.dstPitch = 1;
    c3.dstHeight = 1 << 33;
    c3.WidthInBytes = 1;
    c3.Height = 1 << 33;
    c3.Depth = 1 << 33; // Height * Depth overflows 64 bits
    // SAFETY: every call is refused before touching memory (the source is never read: the
    // destination's last row lies far past its allocation).
    unsafe {
        assert_eq!(cu::cuMemsetD2D8_v2(d, 1024, 0x11, 1, 1 << 44), e, "memset");
        assert_eq!(cu::cuMemcpy2D_v2(&c), e, "2D copy from pageable memory");
        assert_eq!(cu::cuMemcpy3D_v2(&c3), e, "3D copy");
    }
    assert!(read_back(d, 1024).iter().all(|&b| b == 0), "nothing written");
    dfree(d);
    assert!(ctl.violations_on_this_thread().iter().any(|v| v.message.contains("last row")));
}

/// Shapes of a random 3D sub-volume copy between two pitched volumes.
#[derive(Debug, Clone)]
struct Case {
    width: usize,
    height: usize,
    depth: usize,
    src: (usize, usize, usize),
    dst: (usize, usize, usize),
    src_slack: (usize, usize),
    dst_slack: (usize, usize),
    seed: u8,
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..40, 1usize..6, 1usize..4, (0usize..8, 0usize..4, 0usize..3), (0usize..8, 0usize..4, 0usize..3))
        .prop_flat_map(|(width, height, depth, src, dst)| {
            ((0usize..16, 0usize..3), (0usize..16, 0usize..3), any::<u8>()).prop_map(
                move |(src_slack, dst_slack, seed)| Case {
                    width,
                    height,
                    depth,
                    src,
                    dst,
                    src_slack,
                    dst_slack,
                    seed,
                },
            )
        })
}

/// Volume dimensions `(pitch, rows per slice, slices)` that hold the copy at `at`.
fn volume(c: &Case, at: (usize, usize, usize), slack: (usize, usize)) -> (usize, usize, usize) {
    (at.0 + c.width + slack.0, at.1 + c.height + slack.1, at.2 + c.depth)
}

fn reference(c: &Case, src: &[u8], sv: (usize, usize, usize), dst: &mut [u8], dv: (usize, usize, usize)) {
    for z in 0..c.depth {
        for y in 0..c.height {
            let so = ((c.src.2 + z) * sv.1 + c.src.1 + y) * sv.0 + c.src.0;
            let d_o = ((c.dst.2 + z) * dv.1 + c.dst.1 + y) * dv.0 + c.dst.0;
            dst[d_o..d_o + c.width].copy_from_slice(&src[so..so + c.width]);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Host -> device (3D) -> device (3D, DtoD) -> host (2D per slice), against a CPU reference;
    /// bytes outside the copied sub-volume keep their previous values.
    #[test]
    fn random_sub_volume_copies_match_a_cpu_reference(c in case()) {
        bind(0);
        let sv = volume(&c, c.src, c.src_slack);
        let dv = volume(&c, c.dst, c.dst_slack);
        let (sn, dn) = (sv.0 * sv.1 * sv.2, dv.0 * dv.1 * dv.2);
        let src: Vec<u8> = (0..sn).map(|i| (i as u8).wrapping_mul(31).wrapping_add(c.seed)).collect();
        let ds = dalloc(sn);
        let dd = dalloc(dn);
        // SAFETY: live allocations of `sn` / `dn` bytes; the descriptors stay inside them.
        unsafe {
            ok(cu::cuMemcpyHtoD_v2(ds, src.as_ptr().cast(), sn));
            ok(cu::cuMemsetD8_v2(dd, 0xC3, dn));
            let mut k = zeroed_3d();
            k.srcMemoryType = CUmemorytype::CU_MEMORYTYPE_DEVICE;
            k.srcDevice = ds;
            k.srcXInBytes = c.src.0;
            k.srcY = c.src.1;
            k.srcZ = c.src.2;
            k.srcPitch = sv.0;
            k.srcHeight = sv.1;
            k.dstMemoryType = CUmemorytype::CU_MEMORYTYPE_UNIFIED;
            k.dstDevice = dd;
            k.dstXInBytes = c.dst.0;
            k.dstY = c.dst.1;
            k.dstZ = c.dst.2;
            k.dstPitch = dv.0;
            k.dstHeight = dv.1;
            k.WidthInBytes = c.width;
            k.Height = c.height;
            k.Depth = c.depth;
            ok(cu::cuMemcpy3D_v2(&k));
        }
        let mut expect = vec![0xC3u8; dn];
        reference(&c, &src, sv, &mut expect, dv);
        let got = read_back(dd, dn);
        prop_assert_eq!(&got, &expect);
        // The same through 2D copies slice by slice into pageable host memory.
        let mut host = vec![0x5Au8; dn];
        for z in 0..c.depth {
            let mut k = zeroed_2d();
            k.srcMemoryType = CUmemorytype::CU_MEMORYTYPE_DEVICE;
            k.srcDevice = ds + ((c.src.2 + z) * sv.1 * sv.0) as u64;
            k.srcXInBytes = c.src.0;
            k.srcY = c.src.1;
            k.srcPitch = sv.0;
            k.dstHost = host.as_mut_ptr().wrapping_add((c.dst.2 + z) * dv.1 * dv.0).cast();
            k.dstXInBytes = c.dst.0;
            k.dstY = c.dst.1;
            k.dstPitch = dv.0;
            k.WidthInBytes = c.width;
            k.Height = c.height;
            // SAFETY: the destination rows lie inside `host`.
            ok(unsafe { cu::cuMemcpy2DUnaligned_v2(&k) });
        }
        let mut expect_host = vec![0x5Au8; dn];
        reference(&c, &src, sv, &mut expect_host, dv);
        prop_assert_eq!(&host, &expect_host);
        // One row too many on the destination side is refused before anything is written.
        // SAFETY: as above; the overrun is rejected during validation.
        unsafe {
            ok(cu::cuMemsetD8_v2(dd, 0x11, dn));
            let mut k = zeroed_3d();
            k.srcMemoryType = CUmemorytype::CU_MEMORYTYPE_DEVICE;
            k.srcDevice = ds;
            k.srcPitch = sv.0;
            k.srcHeight = sv.1;
            k.dstMemoryType = CUmemorytype::CU_MEMORYTYPE_DEVICE;
            k.dstDevice = dd;
            k.dstZ = dv.2 - 1;
            k.dstY = dv.1 - 1;
            k.dstPitch = dv.0;
            k.dstHeight = dv.1;
            k.WidthInBytes = dv.0;
            k.Height = 2;
            k.dstHeight = dv.1 + 1;
            k.srcHeight = sv.1.max(2);
            k.Depth = 1;
            prop_assert_eq!(cu::cuMemcpy3D_v2(&k), CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        prop_assert!(read_back(dd, dn).iter().all(|&b| b == 0x11));
        dfree(ds);
        dfree(dd);
    }
}
