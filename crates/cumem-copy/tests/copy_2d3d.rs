//! 2D and 3D copies and 2D memsets: random extents and pitches against a CPU reference (the copied
//! sub-volume equals it, bytes outside are untouched), and errors by variant for impossible
//! extents. (That queued 2D/3D read-backs are right only because host access waits is shown in
//! `host_kinds.rs`, whose simulator delays work long enough to tell.)

use cumem_copy::{Copy2D, Copy3D, Pitched, PitchedBuffer, Rect2D, StreamCopy, copy_2d, copy_3d};
use cumem_core::sys::CUresult;
use cumem_core::{Context, Device, DeviceBuffer, Error, PinnedBuffer, Stream};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::testing;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, RngSeed};

/// A small device latency keeps a few hundred random cases quick while queued work still runs late.
const SIM: &str = "devices=2,latency_us=2000";

fn setup() -> (Context, Stream) {
    testing::init_with(SIM);
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    (ctx, stream)
}

fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: None,
        // Deterministic in CI; set CUMEM_PROPTEST_SEED to explore other sequences.
        rng_seed: RngSeed::Fixed(
            std::env::var("CUMEM_PROPTEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x2D3D),
        ),
        rng_algorithm: RngAlgorithm::XorShift,
        ..Config::default()
    }
}

const SENTINEL: u32 = 0xDEAD_BEEF;

fn pattern(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect()
}

/// One side's layout: pitch, rows per slice and slices, in elements.
#[derive(Debug, Clone, Copy)]
struct Layout {
    pitch: usize,
    height: usize,
    depth: usize,
}

impl Layout {
    fn len(&self) -> usize {
        self.pitch * self.height * self.depth
    }
    fn index(&self, x: usize, y: usize, z: usize) -> usize {
        (z * self.height + y) * self.pitch + x
    }
}

/// What a 3D copy must do, on the CPU.
fn reference(src: &[u32], s: Layout, dst: &mut [u32], d: Layout, c: &Copy3D) {
    for z in 0..c.depth {
        for y in 0..c.height {
            for x in 0..c.width {
                dst[d.index(c.dst_x + x, c.dst_y + y, c.dst_z + z)] =
                    src[s.index(c.src_x + x, c.src_y + y, c.src_z + z)];
            }
        }
    }
}

/// A random copy and two layouts that hold it (with room to spare on every axis).
fn case(three_d: bool) -> impl Strategy<Value = (Copy3D, Layout, Layout)> {
    let depth = if three_d { 1..4usize } else { 1..2 };
    let z = if three_d { 0..3usize } else { 0..1 };
    (
        (1..24usize, 1..9usize, depth),
        (0..6usize, 0..5usize, z.clone(), 0..6usize, 0..5usize, z),
        (0..9usize, 0..3usize, 0..2usize),
        (0..9usize, 0..3usize, 0..2usize),
    )
        .prop_map(|((w, h, d), (sx, sy, sz, dx, dy, dz), (sp, sh, sd), (dp, dh, dd))| {
            let c = Copy3D {
                width: w,
                height: h,
                depth: d,
                src_x: sx,
                src_y: sy,
                src_z: sz,
                dst_x: dx,
                dst_y: dy,
                dst_z: dz,
            };
            let s = Layout { pitch: sx + w + sp, height: sy + h + sh, depth: sz + d + sd };
            let t = Layout { pitch: dx + w + dp, height: dy + h + dh, depth: dz + d + dd };
            (c, s, t)
        })
}

fn as_2d(c: &Copy3D) -> Copy2D {
    Copy2D::new(c.width, c.height).src_at(c.src_x, c.src_y).dst_at(c.dst_x, c.dst_y)
}

/// Host → device → host, blocking, with pageable memory on the host side.
fn blocking_round_trip(stream: &Stream, c: Copy3D, s: Layout, t: Layout, three_d: bool) {
    let src = pattern(s.len(), c.width as u32);
    let mut dev = DeviceBuffer::from_slice(stream, &vec![SENTINEL; t.len()]).unwrap();
    {
        let host = Pitched::new(&src[..], s.pitch).with_height(s.height);
        let mut dst = Pitched::new(dev.as_mut_slice(), t.pitch).with_height(t.height);
        if three_d {
            copy_3d(&host, &mut dst, c).unwrap()
        } else {
            copy_2d(&host, &mut dst, as_2d(&c)).unwrap()
        }
    }
    let mut expected = vec![SENTINEL; t.len()];
    reference(&src, s, &mut expected, t, &c);
    assert_eq!(dev.to_vec().unwrap(), expected, "host to device");

    // And back, into a pageable buffer laid out like the source: the box returns where it came from.
    let mut back = vec![SENTINEL; s.len()];
    let inverse = Copy3D {
        src_x: c.dst_x,
        src_y: c.dst_y,
        src_z: c.dst_z,
        dst_x: c.src_x,
        dst_y: c.src_y,
        dst_z: c.src_z,
        ..c
    };
    {
        let from = Pitched::new(dev.as_slice(), t.pitch).with_height(t.height);
        let mut to = Pitched::new(&mut back[..], s.pitch).with_height(s.height);
        if three_d {
            copy_3d(&from, &mut to, inverse).unwrap()
        } else {
            copy_2d(&from, &mut to, as_2d(&inverse)).unwrap()
        }
    }
    let mut expected_back = vec![SENTINEL; s.len()];
    reference(
        &src,
        s,
        &mut expected_back,
        s,
        &Copy3D { dst_x: c.src_x, dst_y: c.src_y, dst_z: c.src_z, ..c },
    );
    assert_eq!(back, expected_back, "device to host");
}

/// Pinned → pitched buffer → pinned, queued on a stream, read back through the pinned buffer's wait.
fn queued_round_trip(ctx: &Context, stream: &Stream, c: Copy3D, s: Layout, three_d: bool) {
    let src_data = pattern(s.len(), 77);
    let src = PinnedBuffer::from_slice(ctx, &src_data).unwrap();
    let (w, h, d) = (c.dst_x + c.width + 1, c.dst_y + c.height, c.dst_z + c.depth);
    let mut pitched = PitchedBuffer::<u32>::new_3d(stream, w, h, d).unwrap();
    stream
        .fill_2d(&mut pitched.as_pitched_mut().with_height(h * d), SENTINEL, Rect2D::new(w, h * d))
        .unwrap();
    let host = Pitched::new(&src, s.pitch).with_height(s.height);
    if three_d {
        stream.copy_3d(&host, &mut pitched.as_pitched_mut(), c).unwrap();
    } else {
        stream.copy_2d(&host, &mut pitched.as_pitched_mut(), as_2d(&c)).unwrap();
    }
    let dense = Layout { pitch: w, height: h, depth: d };
    let mut back = PinnedBuffer::from_slice(ctx, &vec![0u32; dense.len()]).unwrap();
    let all = Copy3D::new(w, h, d);
    stream.copy_3d(&pitched.as_pitched(), &mut Pitched::new(&mut back, w).with_height(h), all).unwrap();
    let mut expected = vec![SENTINEL; dense.len()];
    reference(&src_data, s, &mut expected, dense, &c);
    assert_eq!(back.as_slice().unwrap(), &expected[..]);
    // The pitched buffer's own dense read agrees.
    assert_eq!(pitched.to_vec().unwrap(), expected);
}

proptest! {
    #![proptest_config(config(40))]

    #[test]
    fn copies_2d_match_the_cpu_reference((c, s, t) in case(false)) {
        let (_ctx, stream) = setup();
        blocking_round_trip(&stream, c, s, t, false);
    }

    #[test]
    fn copies_3d_match_the_cpu_reference((c, s, t) in case(true)) {
        let (_ctx, stream) = setup();
        blocking_round_trip(&stream, c, s, t, true);
    }

    #[test]
    fn queued_copies_2d_into_pitched_memory_match((c, s, _t) in case(false)) {
        let (ctx, stream) = setup();
        queued_round_trip(&ctx, &stream, c, s, false);
    }

    #[test]
    fn queued_copies_3d_into_pitched_memory_match((c, s, _t) in case(true)) {
        let (ctx, stream) = setup();
        queued_round_trip(&ctx, &stream, c, s, true);
    }
}

#[test]
fn pitched_buffers_have_aligned_rows_and_row_views() {
    let (_ctx, stream) = setup();
    let mut img = PitchedBuffer::<f32>::zeroed(&stream, 100, 7).unwrap();
    let pitch_alignment = img.context().device().capabilities().unwrap().texture_pitch_alignment;
    assert!(img.pitch() >= 100 && img.pitch_bytes().is_multiple_of(pitch_alignment));
    assert_eq!((img.width(), img.height(), img.depth(), img.len()), (100, 7, 1, img.pitch() * 7));
    for y in 0..7 {
        let row = img.row(y).unwrap();
        assert_eq!(row.len(), 100);
        assert_eq!(row.device_ptr(), img.device_ptr() + (y * img.pitch_bytes()) as u64);
    }
    cumem_copy::copy_h2d(&[2.5f32; 100], &mut img.row_mut(3).unwrap()).unwrap();
    let all = img.to_vec().unwrap();
    assert!(
        all[300..400].iter().all(|&v| v == 2.5) && all[..300].iter().chain(&all[400..]).all(|&v| v == 0.0)
    );
    assert!(matches!(img.row(7), Err(Error::OutOfRange { start: 7, end: 8, len: 7 })));
    assert!(matches!(img.row_3d(1, 0), Err(Error::OutOfRange { start: 1, end: 2, len: 1 })));
    let vol = PitchedBuffer::<u64>::zeroed_3d(&stream, 5, 4, 3).unwrap();
    assert_eq!(vol.row_3d(2, 3).unwrap().device_ptr(), vol.device_ptr() + (11 * vol.pitch_bytes()) as u64);
    let empty = PitchedBuffer::<u8>::zeroed(&stream, 0, 5).unwrap();
    assert!(empty.is_empty() && empty.to_vec().unwrap().is_empty());
    if let Some(ctl) = testing::sim_control() {
        // By id: another test's allocation may take the freed address.
        let id = ctl.live_report().id_of(img.device_ptr()).expect("live");
        drop(img);
        let live = ctl.live_report();
        assert!(!live.contains_allocation(id), "leaked instead of freed:\n{live}");
    }
}

#[test]
fn a_blocking_device_to_device_2d_copy_takes_pitches_that_alloc_pitch_would_not_choose() {
    let (_ctx, stream) = setup();
    // 3 rows of 4 values, 6 apart in the source and 5 in the destination.
    let src_data = pattern(18, 5);
    let src = DeviceBuffer::from_slice(&stream, &src_data).unwrap();
    let mut dst = DeviceBuffer::from_slice(&stream, &[SENTINEL; 15]).unwrap();
    // The CUDA documentation lets `cuMemcpy2D` refuse such pitches between two device sides; the
    // simulator accepts them, so here it refuses every `cuMemcpy2D` of this thread, as a driver
    // may: the copy must not depend on it.
    let ctl = testing::sim_control();
    let refusal = ctl.as_ref().map(|ctl| {
        ctl.inject_fault(FaultRule {
            function: "cuMemcpy2D_v2".into(),
            nth: 1,
            code: CUresult::CUDA_ERROR_INVALID_VALUE,
            times: 0,
            this_thread_only: true,
        })
    });
    let copied = copy_2d(
        &Pitched::new(src.as_slice(), 6),
        &mut Pitched::new(dst.as_mut_slice(), 5),
        Copy2D::new(4, 3),
    );
    if let (Some(ctl), Some(rule)) = (&ctl, refusal) {
        ctl.remove_fault(rule);
    }
    copied.unwrap();
    let mut expected = [SENTINEL; 15];
    for y in 0..3 {
        expected[y * 5..y * 5 + 4].copy_from_slice(&src_data[y * 6..y * 6 + 4]);
    }
    assert_eq!(dst.to_vec().unwrap(), expected);
}

#[test]
fn memset_2d_touches_only_its_rectangle() {
    let (_ctx, stream) = setup();
    let mut img = PitchedBuffer::<u8>::zeroed(&stream, 40, 6).unwrap();
    stream.fill_2d(&mut img.as_pitched_mut(), 0x11u8, Rect2D::new(8, 3).at(4, 2)).unwrap();
    let all = img.to_vec().unwrap();
    for y in 0..6 {
        for x in 0..40 {
            let inside = (2..5).contains(&y) && (4..12).contains(&x);
            assert_eq!(all[y * 40 + x], if inside { 0x11 } else { 0 }, "({x}, {y})");
        }
    }
    let mut words = PitchedBuffer::<u32>::zeroed(&stream, 10, 4).unwrap();
    stream.fill_2d(&mut words.as_pitched_mut(), 0xCAFE_F00Du32, Rect2D::new(3, 2).at(7, 1)).unwrap();
    let all = words.to_vec().unwrap();
    assert_eq!(all.iter().filter(|&&v| v == 0xCAFE_F00D).count(), 6);
    assert_eq!(&all[17..20], &[0xCAFE_F00D; 3]);
    let mut halves = PitchedBuffer::<u16>::zeroed(&stream, 10, 4).unwrap();
    stream.fill_2d(&mut halves.as_pitched_mut(), 0xABCDu16, Rect2D::new(10, 4)).unwrap();
    assert_eq!(halves.to_vec().unwrap(), vec![0xABCD; 40]);
    let mut wide = PitchedBuffer::<u64>::zeroed(&stream, 4, 4).unwrap();
    assert!(matches!(
        stream.fill_2d(&mut wide.as_pitched_mut(), 1u64, Rect2D::new(1, 1)),
        Err(Error::InvalidValue { .. })
    ));
    assert!(matches!(
        stream.fill_2d(&mut words.as_pitched_mut(), 1u32, Rect2D::new(4, 1).at(7, 0)),
        Err(Error::OutOfRange { .. })
    ));
}

#[test]
fn impossible_extents_are_errors_by_variant_before_any_driver_call() {
    let (ctx, stream) = setup();
    let src = vec![1u32; 64]; // 8 rows of 8
    let mut dev = DeviceBuffer::<u32>::zeroed(&stream, 64).unwrap();
    let host = Pitched::new(&src[..], 8);
    let check = |r: cumem_core::Result<()>| r.unwrap_err();
    // Width beyond the pitch.
    let e = check(copy_2d(&host, &mut Pitched::new(dev.as_mut_slice(), 8), Copy2D::new(9, 1)));
    assert!(matches!(e, Error::OutOfRange { start: 0, end: 9, len: 8 }), "{e}");
    let e = check(copy_2d(&host, &mut Pitched::new(dev.as_mut_slice(), 8), Copy2D::new(4, 1).dst_at(5, 0)));
    assert!(matches!(e, Error::OutOfRange { start: 5, end: 9, len: 8 }), "{e}");
    // Rows beyond the memory.
    let e = check(copy_2d(&host, &mut Pitched::new(dev.as_mut_slice(), 8), Copy2D::new(8, 3).src_at(0, 6)));
    assert!(matches!(e, Error::OutOfRange { start: 6, end: 9, len: 8 }), "{e}");
    // A zero pitch.
    let e = check(copy_2d(
        &Pitched::new(&src[..], 0),
        &mut Pitched::new(dev.as_mut_slice(), 8),
        Copy2D::new(1, 1),
    ));
    assert!(matches!(e, Error::ZeroSize { what: "pitch" }), "{e}");
    // 3D: rows beyond the rows per slice, slices beyond the memory, a missing slice height.
    let vol = Pitched::new(&src[..], 4).with_height(4); // 4 slices of 4 rows of 4
    let e = check(copy_3d(
        &vol,
        &mut Pitched::new(dev.as_mut_slice(), 4).with_height(4),
        Copy3D::new(4, 2, 1).src_at(0, 3, 0),
    ));
    assert!(matches!(e, Error::OutOfRange { start: 3, end: 5, len: 4 }), "{e}");
    let e = check(copy_3d(
        &vol,
        &mut Pitched::new(dev.as_mut_slice(), 4).with_height(4),
        Copy3D::new(4, 4, 2).dst_at(0, 0, 3),
    ));
    assert!(matches!(e, Error::OutOfRange { start: 3, end: 5, len: 4 }), "{e}");
    let e = check(copy_3d(&vol, &mut Pitched::new(dev.as_mut_slice(), 4), Copy3D::new(1, 1, 1)));
    assert!(matches!(e, Error::ZeroSize { what: "rows per slice" }), "{e}");
    // Pitches whose size in bytes overflows.
    let e = check(copy_2d(
        &Pitched::new(&src[..], usize::MAX / 2),
        &mut Pitched::new(dev.as_mut_slice(), 8),
        Copy2D::new(1, 1),
    ));
    assert!(matches!(e, Error::SizeOverflow { .. }), "{e}");
    // Devices must match the stream; blocking host-to-host copies have no device: a bad pair of
    // arguments, the destination untouched.
    let mut other = vec![0u32; 64];
    let e = check(copy_2d(&host, &mut Pitched::new(&mut other[..], 8), Copy2D::new(8, 8)));
    assert!(matches!(e, Error::InvalidValue { .. }), "{e}");
    let mut pinned_dst = PinnedBuffer::<u32>::zeroed(&ctx, 64).unwrap();
    let e = check(copy_3d(
        &host.with_height(8),
        &mut Pitched::new(&mut pinned_dst, 8).with_height(8),
        Copy3D::new(8, 8, 1),
    ));
    assert!(matches!(e, Error::InvalidValue { .. }), "{e}");
    assert_eq!(other, [0; 64]);
    assert_eq!(pinned_dst.as_slice().unwrap(), &[0; 64]);
    let host = Pitched::new(&src[..], 8);
    if testing::needs_devices(2) {
        let s1 = Stream::new(&Device::get(1).unwrap().context().unwrap()).unwrap();
        let pinned = PinnedBuffer::from_slice(&ctx, &src).unwrap();
        let e = check(s1.copy_2d(
            &Pitched::new(&pinned, 8),
            &mut Pitched::new(dev.as_mut_slice(), 8),
            Copy2D::new(8, 8),
        ));
        assert!(matches!(e, Error::WrongDevice { .. }), "{e}");
    }
    // Nothing was written, and an empty extent is fine.
    copy_2d(&host, &mut Pitched::new(dev.as_mut_slice(), 8), Copy2D::new(0, 5)).unwrap();
    assert_eq!(dev.to_vec().unwrap(), vec![0; 64]);
    if let Some(ctl) = testing::sim_control() {
        let v = ctl.violations_on_this_thread();
        assert!(v.is_empty(), "the driver never saw a bad extent: {v:?}");
    }
}

/// An empty 2D/3D copy or 2D memset is refused on another device's stream, as an empty 1D copy
/// is: the devices are checked before nothing is copied. An empty extent is otherwise `Ok`, its
/// sides' pitches unchecked (a zero pitch included).
#[test]
fn empty_copies_and_memsets_still_check_the_streams_device() {
    let (ctx, stream) = setup();
    if !testing::needs_devices(2) {
        return;
    }
    let s1 = Stream::non_blocking(&Device::get(1).unwrap().context().unwrap()).unwrap();
    let mut dev = DeviceBuffer::<u32>::zeroed(&stream, 64).unwrap();
    let pinned = PinnedBuffer::from_slice(&ctx, &[1u32; 64]).unwrap();
    // The 1D reference: an empty range on another device's stream.
    let e = s1.copy_h2d(&PinnedBuffer::<u32>::zeroed(&ctx, 0).unwrap(), &mut dev.slice_mut(0..0).unwrap());
    assert!(matches!(e, Err(Error::WrongDevice { expected: 1, actual: 0 })), "{e:?}");
    let e =
        s1.copy_2d(&Pitched::new(&pinned, 8), &mut Pitched::new(dev.as_mut_slice(), 8), Copy2D::new(8, 0));
    assert!(matches!(e, Err(Error::WrongDevice { expected: 1, actual: 0 })), "{e:?}");
    let e = s1.copy_3d(
        &Pitched::new(&pinned, 8).with_height(8),
        &mut Pitched::new(dev.as_mut_slice(), 8).with_height(8),
        Copy3D::new(8, 8, 0),
    );
    assert!(matches!(e, Err(Error::WrongDevice { expected: 1, actual: 0 })), "{e:?}");
    let mut img = PitchedBuffer::<u32>::zeroed(&stream, 8, 8).unwrap();
    let e = s1.fill_2d(&mut img.as_pitched_mut(), 7u32, Rect2D::new(0, 8));
    assert!(matches!(e, Err(Error::WrongDevice { expected: 1, actual: 0 })), "{e:?}");
    // Blocking: the two device sides on different devices.
    let mut other = DeviceBuffer::<u32>::zeroed(&s1, 64).unwrap();
    let e = copy_2d(
        &Pitched::new(dev.as_slice(), 8),
        &mut Pitched::new(other.as_mut_slice(), 8),
        Copy2D::new(0, 8),
    );
    assert!(matches!(e, Err(Error::WrongDevice { .. })), "{e:?}");
    // On the right stream, an empty extent is fine, a zero pitch included; nothing is written.
    stream
        .copy_2d(&Pitched::new(&pinned, 0), &mut Pitched::new(dev.as_mut_slice(), 0), Copy2D::new(8, 0))
        .unwrap();
    stream.fill_2d(&mut img.as_pitched_mut(), 7u32, Rect2D::new(8, 0)).unwrap();
    assert_eq!(dev.to_vec().unwrap(), vec![0; 64]);
    assert_eq!(img.to_vec().unwrap(), vec![0; 64]);
    assert_eq!(other.to_vec().unwrap(), vec![0; 64]);
}

#[test]
fn row_indices_at_the_end_of_the_address_space_are_out_of_range_not_overflow() {
    let (_ctx, stream) = setup();
    let mut img = PitchedBuffer::<u32>::zeroed_3d(&stream, 8, 4, 2).unwrap();
    let max = usize::MAX;
    let e = img.row(max).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { start: usize::MAX, end: usize::MAX, len: 4 }), "{e}");
    let e = img.row_3d(max, 0).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { start: usize::MAX, end: usize::MAX, len: 2 }), "{e}");
    let e = img.row_3d(1, max).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { start: usize::MAX, end: usize::MAX, len: 4 }), "{e}");
    assert!(matches!(img.row_mut(max), Err(Error::OutOfRange { start: usize::MAX, .. })));
    assert!(matches!(img.row_3d_mut(max, max), Err(Error::OutOfRange { start: usize::MAX, .. })));
    // The last row is still in range.
    assert_eq!(img.row_3d(1, 3).unwrap().len(), 8);
}

#[test]
fn zero_sized_elements_and_overflowing_extents_are_errors_not_panics() {
    let (_ctx, stream) = setup();
    let zst = |r: cumem_core::Result<PitchedBuffer<()>>| {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::ZeroSize { what: "element size" }), "{e}");
    };
    // Zero-sized elements: any extent, including ones whose element count overflows.
    zst(PitchedBuffer::<()>::new(&stream, 4, 4));
    zst(PitchedBuffer::<()>::zeroed(&stream, usize::MAX, 2));
    zst(PitchedBuffer::<()>::new_3d(&stream, usize::MAX, usize::MAX, usize::MAX));
    zst(PitchedBuffer::<()>::zeroed_3d(&stream, 0, 0, 0));
    let e = PitchedBuffer::<[u64; 0]>::zeroed(&stream, 3, 3).unwrap_err();
    assert!(matches!(e, Error::ZeroSize { what: "element size" }), "{e}");
    // Rows per slice times slices, and a row's bytes, that overflow.
    let e = PitchedBuffer::<u8>::zeroed_3d(&stream, 1, usize::MAX, 2).unwrap_err();
    assert!(matches!(e, Error::SizeOverflow { .. }), "{e}");
    let e = PitchedBuffer::<u32>::zeroed(&stream, usize::MAX / 2, 1).unwrap_err();
    assert!(matches!(e, Error::SizeOverflow { .. }), "{e}");
    // An empty array whose width × height alone would overflow: no slices, so no elements, and
    // every size of it is computed without overflowing.
    let huge = 1usize << (usize::BITS / 2 + 1);
    let empty = PitchedBuffer::<u8>::zeroed_3d(&stream, huge, huge, 0).unwrap();
    assert!(empty.is_empty());
    assert_eq!((empty.len(), empty.device_ptr()), (0, 0));
    assert!(empty.to_vec().unwrap().is_empty());
    assert_eq!((empty.as_pitched().pitch(), empty.as_pitched().into_inner().len()), (huge, 0));
}

#[test]
fn a_pitched_buffer_whose_work_cannot_be_waited_for_is_leaked_not_freed() {
    let (_ctx, stream) = setup();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let mut img = PitchedBuffer::<u32>::zeroed(&stream, 16, 4).unwrap();
    stream.fill_2d(&mut img.as_pitched_mut(), 7u32, Rect2D::new(16, 4)).unwrap();
    let ptr = img.device_ptr();
    let id = ctl.live_report().id_of(ptr).expect("live");
    let rule = ctl.inject_fault(FaultRule {
        function: "cuStreamSynchronize".into(),
        nth: 1,
        code: CUresult::CUDA_ERROR_LAUNCH_FAILED,
        times: 0,
        this_thread_only: true,
    });
    drop(img); // cannot know the fill is done: must not free under it
    ctl.remove_fault(rule);
    let live = ctl.live_report();
    assert!(live.contains_allocation(id), "freed although its work was not known to be done:\n{live}");
    // Reclaim the leak, so the simulator's leak check at exit stays quiet.
    stream.synchronize().unwrap();
    stream.context().bind().unwrap();
    // SAFETY: `ptr` is the leaked allocation, from the driver resource (this binary does not link
    // the pools), whose 512-byte request the driver served exactly (its addresses are 512-aligned):
    // nothing refers to it any more and its work has completed (synchronised just above).
    assert_eq!(unsafe { cumem_core::sys::cuMemFree_v2(ptr) }, CUresult::CUDA_SUCCESS);
    let live = ctl.live_report();
    assert!(!live.contains_allocation(id), "still live after cuMemFree:\n{live}");
}
