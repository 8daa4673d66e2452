//! Typed transfers: blocking and stream-ordered copies and memsets, and what makes them sound.
//! What every host memory kind does under copies (round trips, waits, drops with copies pending)
//! is a table in `host_kinds.rs`.

use cumem_copy::{StreamCopy, copy_d2d, copy_d2h, copy_h2d};
use cumem_core::{Context, Device, DeviceBuffer, Error, PinnedBuffer, Stream};
use cumem_sys::testing;

/// A long device latency makes any missing wait show up as stale data.
const SIM: &str = "devices=2,latency_us=20000";

fn ctx() -> Context {
    testing::init_with(SIM);
    Device::get(0).unwrap().context().unwrap()
}

#[test]
fn blocking_copies_round_trip_bitwise() {
    let ctx = ctx();
    let s = Stream::new(&ctx).unwrap();
    let data: Vec<u32> = (0..5000).map(|i| i * 7919).collect();
    let mut a = DeviceBuffer::<u32>::zeroed(&s, 5000).unwrap();
    let mut b = DeviceBuffer::<u32>::zeroed(&s, 5000).unwrap();
    copy_h2d(&data, &mut a).unwrap();
    copy_d2d(&a, &mut b).unwrap();
    let mut out = vec![0u32; 5000];
    copy_d2h(&b, &mut out).unwrap();
    assert_eq!(out, data);
    // Views work the same, and partial copies land where they should.
    copy_h2d(&[1, 2, 3], &mut b.slice_mut(10..13).unwrap()).unwrap();
    let mut three = [0u32; 3];
    copy_d2h(&b.slice(9..12).unwrap(), &mut three).unwrap();
    assert_eq!(three, [data[9], 1, 2]);
    // Empty copies are fine.
    copy_h2d::<u32>(&[], &mut a.slice_mut(0..0).unwrap()).unwrap();
}

#[test]
fn length_mismatches_are_errors_and_write_nothing() {
    let ctx = ctx();
    let s = Stream::new(&ctx).unwrap();
    let mut a = DeviceBuffer::from_slice(&s, &[7u8; 8]).unwrap();
    let b = DeviceBuffer::<u8>::zeroed(&s, 4).unwrap();
    assert!(matches!(copy_h2d(&[1u8; 9], &mut a), Err(Error::LengthMismatch { expected: 8, actual: 9 })));
    assert!(matches!(copy_d2h(&a, &mut [0u8; 3]), Err(Error::LengthMismatch { expected: 3, actual: 8 })));
    assert!(matches!(copy_d2d(&b, &mut a), Err(Error::LengthMismatch { expected: 8, actual: 4 })));
    let pinned = PinnedBuffer::<u8>::zeroed(&ctx, 5).unwrap();
    assert!(matches!(s.copy_h2d(&pinned, &mut a), Err(Error::LengthMismatch { .. })));
    assert_eq!(a.to_vec().unwrap(), [7; 8]);
}

#[test]
fn copies_across_devices_are_wrong_device() {
    let ctx = ctx();
    if !testing::needs_devices(2) {
        return;
    }
    let other = Device::get(1).unwrap().context().unwrap();
    let (s0, s1) = (Stream::new(&ctx).unwrap(), Stream::new(&other).unwrap());
    let a = DeviceBuffer::<u8>::zeroed(&s0, 4).unwrap();
    let mut b = DeviceBuffer::<u8>::zeroed(&s1, 4).unwrap();
    assert!(matches!(copy_d2d(&a, &mut b), Err(Error::WrongDevice { expected: 1, actual: 0 })));
    assert!(matches!(s0.copy_d2d(&a, &mut b), Err(Error::WrongDevice { .. })));
    assert!(matches!(s0.fill(&mut b, 1u8), Err(Error::WrongDevice { .. })));
}

#[test]
fn a_buffer_used_on_a_second_stream_is_ordered_after_the_first() {
    let ctx = ctx();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let mut buf = DeviceBuffer::<u32>::zeroed(&a, 1024).unwrap();
    a.fill(&mut buf, 5u32).unwrap(); // queued on a, runs 20 ms later in the simulator
    let mut host = PinnedBuffer::<u32>::zeroed(&ctx, 1024).unwrap();
    b.copy_d2h(&buf, &mut host).unwrap(); // on b: must wait for a's fill
    assert_eq!(host.as_slice().unwrap(), &[5; 1024][..]);
    a.fill(&mut buf, 6u32).unwrap(); // back on a: after b's read
    assert_eq!(host.as_slice().unwrap(), &[5; 1024][..]);
    assert_eq!(buf.to_vec().unwrap(), vec![6; 1024]);
}

#[test]
fn stream_ordered_device_copies_follow_both_buffers() {
    let ctx = ctx();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let mut src = DeviceBuffer::<u16>::zeroed(&a, 300).unwrap();
    a.fill(&mut src, 0x1234u16).unwrap();
    let mut dst = DeviceBuffer::<u16>::zeroed(&b, 300).unwrap();
    b.copy_d2d(&src, &mut dst).unwrap();
    assert_eq!(dst.to_vec().unwrap(), vec![0x1234; 300]);
}

#[test]
fn memsets_fill_every_width() {
    let ctx = ctx();
    let s = Stream::new(&ctx).unwrap();
    let mut bytes = DeviceBuffer::<u8>::zeroed(&s, 10).unwrap();
    s.memset_d8(&mut bytes, 0x5A).unwrap();
    assert_eq!(bytes.to_vec().unwrap(), [0x5A; 10]);
    let mut halves = DeviceBuffer::<u16>::zeroed(&s, 10).unwrap();
    s.memset_d16(&mut halves, 0xBEEF).unwrap();
    assert_eq!(halves.to_vec().unwrap(), [0xBEEF; 10]);
    let mut words = DeviceBuffer::<u32>::zeroed(&s, 10).unwrap();
    s.memset_d32(&mut words.slice_mut(2..8).unwrap(), 0xDEAD_BEEF).unwrap();
    assert_eq!(
        words.to_vec().unwrap(),
        [0, 0, 0xDEAD_BEEF, 0xDEAD_BEEF, 0xDEAD_BEEF, 0xDEAD_BEEF, 0xDEAD_BEEF, 0xDEAD_BEEF, 0, 0]
    );
    let mut floats = DeviceBuffer::<f32>::zeroed(&s, 7).unwrap();
    s.fill(&mut floats, 1.25f32).unwrap();
    assert_eq!(floats.to_vec().unwrap(), [1.25; 7]);
    s.fill(&mut halves, 7u16).unwrap();
    s.fill(&mut bytes, 9u8).unwrap();
    assert_eq!((halves.to_vec().unwrap()[9], bytes.to_vec().unwrap()[9]), (7, 9));
}

#[test]
fn memsets_check_width_and_alignment() {
    let ctx = ctx();
    let s = Stream::new(&ctx).unwrap();
    let mut bytes = DeviceBuffer::<u8>::zeroed(&s, 10).unwrap();
    assert!(matches!(
        s.memset_d32(&mut bytes.slice_mut(0..6).unwrap(), 1),
        Err(Error::Misaligned { what: "memset length in bytes", .. })
    ));
    assert!(matches!(
        s.memset_d16(&mut bytes.slice_mut(1..5).unwrap(), 1),
        Err(Error::Misaligned { what: "memset address", .. })
    ));
    let mut wide = DeviceBuffer::<u64>::zeroed(&s, 2).unwrap();
    assert!(matches!(s.fill(&mut wide, 1u64), Err(Error::InvalidValue { .. })));
    assert_eq!(bytes.to_vec().unwrap(), [0; 10]);
}
