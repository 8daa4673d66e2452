//! Limits of pitched arrays and memsets that must be checked before the driver sees them (issue 7,
//! item 8): element types aligned beyond what pitched rows guarantee, rows wider than the device's
//! MAX_PITCH, empty memsets at addresses no width divides, and 2D memsets whose rows start at
//! addresses the width does not divide.

use bytemuck::{Pod, Zeroable};
use cumem_copy::{Copy2D, Copy3D, Pitched, PitchedBuffer, Rect2D, StreamCopy};
use cumem_core::{Device, DeviceBuffer, DeviceSliceMut, Error, Feature, Stream, StreamOrder};
use cumem_sys::testing;

/// Device 1 has a MAX_PITCH of 4 KiB, so a realistic row can be too wide for it.
const SIM: &str = "devices=2,dev1.max_pitch=4096";

/// A stream of device `device`; `None` where there is no such device (a one-GPU machine).
fn stream_on(device: usize) -> Option<Stream> {
    testing::init_with(SIM);
    (device < Device::count().unwrap())
        .then(|| Stream::non_blocking(&Device::get(device).unwrap().context().unwrap()).unwrap())
}

/// Device 1 as the simulator configures it here, with a 4 KiB MAX_PITCH; `None` on a real machine
/// (whose second GPU has its own, about 2 GiB) or where there is no device 1.
fn narrow_device() -> Option<Stream> {
    stream_on(1).filter(|s| s.context().device().max_pitch().unwrap() == 4096)
}

/// What the simulator logged as misuse on this thread (nothing when running on a real driver).
fn misuse_here() -> Vec<String> {
    testing::sim_control().map_or_else(Vec::new, |ctl| {
        ctl.violations_on_this_thread().into_iter().map(|v| v.to_string()).collect()
    })
}

/// An element type aligned to 1 KiB: more than the 512 bytes pitched rows are aligned to.
#[derive(Clone, Copy, Zeroable, Pod)]
#[repr(C, align(1024))]
struct Wide([u8; 1024]);

#[test]
#[serial_test::parallel]
fn element_types_aligned_beyond_a_pitched_row_are_refused() {
    let stream = stream_on(0).unwrap();
    for (w, h) in [(1, 3), (3, 2), (2, 5)] {
        match PitchedBuffer::<Wide>::zeroed(&stream, w, h) {
            Err(Error::NotSupported { feature: Feature::Alignment(1024), .. }) => {}
            Ok(buf) => {
                let misaligned: Vec<u64> = (0..h)
                    .map(|y| buf.row(y).unwrap().device_ptr())
                    .filter(|p| !p.is_multiple_of(1024))
                    .collect();
                panic!(
                    "a {w}x{h} array of 1 KiB-aligned values was made; rows at {misaligned:#x?} are not aligned"
                );
            }
            Err(e) => panic!("expected NotSupported(Alignment(1024)), got {e:?}"),
        }
    }
    // Types aligned up to what the rows guarantee still work.
    #[derive(Clone, Copy, Zeroable, Pod)]
    #[repr(C, align(256))]
    struct Row256([u8; 256]);
    let buf = PitchedBuffer::<Row256>::zeroed(&stream, 3, 2).unwrap();
    assert!((0..2).all(|y| buf.row(y).unwrap().device_ptr().is_multiple_of(256)));
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

#[test]
#[serial_test::parallel]
fn rows_wider_than_the_max_pitch_are_refused_before_the_driver() {
    let Some(stream) = narrow_device() else {
        // A real machine: device 0's own MAX_PITCH (2 GiB on an H100), a row one element wider is refused
        // before anything is allocated.
        let stream = stream_on(0).unwrap();
        let max = stream.context().device().max_pitch().unwrap();
        let too_wide = max / 4 + 1;
        assert!(matches!(PitchedBuffer::<u32>::new(&stream, too_wide, 2), Err(Error::InvalidValue { .. })));
        return;
    };
    // 2048 u32 = 8 KiB per row, twice device 1's MAX_PITCH.
    match PitchedBuffer::<u32>::new(&stream, 2048, 2) {
        Err(Error::InvalidValue { .. }) => {}
        other => panic!("expected InvalidValue, got {other:?}"),
    }
    assert!(matches!(PitchedBuffer::<u32>::new_3d(&stream, 1025, 1, 1), Err(Error::InvalidValue { .. })));
    assert!(misuse_here().is_empty(), "reached the driver as misuse: {:?}", misuse_here());
    // Exactly the maximum is fine.
    let buf = PitchedBuffer::<u32>::zeroed(&stream, 1024, 2).unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![0; 2048]);
}

#[test]
#[serial_test::parallel]
fn copies_through_a_view_whose_pitch_passes_the_max_pitch_are_refused_before_the_driver() {
    // The driver refuses every 2D or 3D copy naming a pitch above the device's MAX_PITCH, one row
    // included. On every machine: one row of a view whose pitch is one byte past device 0's
    // maximum (the row itself lies inside the memory, so only the pitch is wrong).
    let first = stream_on(0).unwrap();
    let small = DeviceBuffer::from_slice(&first, &[1u8; 64]).unwrap();
    let max = first.context().device().max_pitch().unwrap();
    let mut out = [0u8; 4];
    match cumem_copy::copy_2d(
        &Pitched::new(small.as_slice(), max + 1),
        &mut Pitched::new(&mut out[..], 4),
        Copy2D::new(4, 1),
    ) {
        Err(Error::InvalidValue { .. }) => {}
        other => panic!("pitch {}: expected InvalidValue, got {other:?}", max + 1),
    }
    assert_eq!(out, [0; 4]);
    assert!(misuse_here().is_empty(), "reached the driver as misuse: {:?}", misuse_here());
    // On the simulator's narrow device 1: views laid out with an 8 KiB pitch, twice its maximum.
    let Some(stream) = narrow_device() else { return };
    let dev = DeviceBuffer::from_slice(&stream, &[7u32; 4096]).unwrap();
    let mut host = vec![0u32; 4096];
    for rows in [2, 1] {
        let from = Pitched::new(dev.as_slice(), 2048);
        let mut to = Pitched::new(&mut host[..], 1024);
        match cumem_copy::copy_2d(&from, &mut to, Copy2D::new(1024, rows)) {
            Err(Error::InvalidValue { .. }) => {}
            other => panic!("{rows} row(s): expected InvalidValue, got {other:?}"),
        }
        let from = Pitched::new(dev.as_slice(), 2048).with_height(2);
        let mut to = Pitched::new(&mut host[..], 1024).with_height(2);
        match cumem_copy::copy_3d(&from, &mut to, Copy3D::new(1024, rows, 1)) {
            Err(Error::InvalidValue { .. }) => {}
            other => panic!("{rows} row(s), 3D: expected InvalidValue, got {other:?}"),
        }
    }
    // The host side's pitch counts too (the driver checks "any pitch").
    let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 4096).unwrap();
    let wide_host = vec![3u32; 4096];
    let from = Pitched::new(&wide_host[..], 2048);
    let mut to = Pitched::new(dst.as_mut_slice(), 1024);
    assert!(matches!(
        cumem_copy::copy_2d(&from, &mut to, Copy2D::new(1024, 2)),
        Err(Error::InvalidValue { .. })
    ));
    assert!(misuse_here().is_empty(), "reached the driver as misuse: {:?}", misuse_here());
    assert!(host.iter().all(|&v| v == 0), "nothing was copied");
    assert_eq!(dst.to_vec().unwrap(), vec![0; 4096]);
    // At the maximum, the same copy runs.
    let from = Pitched::new(dev.as_slice(), 1024);
    let mut to = Pitched::new(&mut host[..], 1024);
    cumem_copy::copy_2d(&from, &mut to, Copy2D::new(1024, 2)).unwrap();
    assert_eq!(&host[..2048], &[7; 2048][..]);
}

#[test]
#[serial_test::parallel]
fn a_row_within_the_max_pitch_whose_rounded_pitch_is_not_is_refused_before_the_driver() {
    // Device 0's MAX_PITCH is 2^31 - 1 (an H100's, and the simulator's default): a row of exactly
    // that many bytes fits it, but its pitch, rounded up to the pitch alignment, is 2^31. Such an
    // array could be allocated (4 GiB here) but no 2D copy of it would be accepted.
    let stream = stream_on(0).unwrap();
    let max = stream.context().device().max_pitch().unwrap();
    if max.is_multiple_of(512) {
        return; // a device whose maximum is itself aligned has no such row
    }
    match PitchedBuffer::<u8>::new(&stream, max, 2) {
        Err(Error::InvalidValue { .. }) => {}
        other => panic!("expected InvalidValue, got {other:?}"),
    }
    assert!(misuse_here().is_empty(), "reached the driver as misuse: {:?}", misuse_here());
}

#[test]
#[serial_test::parallel]
fn empty_memsets_are_no_ops_wherever_they_start() {
    let stream = stream_on(0).unwrap();
    let mut buf = DeviceBuffer::from_slice(&stream, &[7u8; 16]).unwrap();
    stream.memset_d16(&mut buf.slice_mut(3..3).unwrap(), 0xABCD).unwrap();
    stream.memset_d32(&mut buf.slice_mut(5..5).unwrap(), 0xABCD_EF01).unwrap();
    stream.memset_d8(&mut buf.slice_mut(16..).unwrap(), 1).unwrap();
    stream.fill(&mut buf.slice_mut(1..1).unwrap(), 0u8).unwrap();
    assert_eq!(buf.to_vec().unwrap(), [7u8; 16]);
    // A non-empty range at the same odd address is still misaligned for 2-byte stores.
    assert!(matches!(
        stream.memset_d16(&mut buf.slice_mut(3..5).unwrap(), 0),
        Err(Error::Misaligned { what: "memset address", .. })
    ));
    let mut words = DeviceBuffer::from_slice(&stream, &[9u16; 8]).unwrap();
    stream.memset_d32(&mut words.slice_mut(1..1).unwrap(), 0).unwrap();
    stream.fill(&mut words.slice_mut(3..3).unwrap(), 1u16).unwrap();
    assert_eq!(words.to_vec().unwrap(), [9u16; 8]);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

#[test]
#[serial_test::parallel]
fn a_2d_memset_starting_where_its_width_does_not_divide_is_refused_before_the_driver() {
    let stream = stream_on(0).unwrap();
    let buf = DeviceBuffer::from_slice(&stream, &[7u8; 64]).unwrap();
    stream.synchronize().unwrap();
    let order = StreamOrder::new(&stream);
    // `[u8; 4]` is aligned to 1, so a view of it may start at any byte; its fill is 4 bytes wide.
    // SAFETY: bytes 1..33 lie inside `buf`, live device memory of the stream's context, which
    // outlives the view and is not otherwise written while it lives (the last line only reads it); its upload completed above, and
    // the view's only work is ordered through `order`.
    let view =
        unsafe { DeviceSliceMut::<[u8; 4]>::from_raw_parts(buf.device_ptr() + 1, 8, &order, buf.context()) };
    let mut rows = Pitched::new(view, 4);
    assert!(matches!(
        stream.fill_2d(&mut rows, [1u8; 4], Rect2D::new(4, 2)),
        Err(Error::Misaligned { what: "memset address", align: 4, .. })
    ));
    assert!(misuse_here().is_empty(), "reached the driver as misuse: {:?}", misuse_here());
    assert_eq!(buf.to_vec().unwrap(), [7u8; 64]);
}
