//! Every page-locked host kind through asynchronous copies: data round-trips bitwise
//! host → kind → device → host, and reads after an asynchronous copy are right only because the
//! kind waited. To show that deterministically, the stream is held by a gate (a host function that
//! blocks until the test opens it) while the copy is queued: a read behind the kind's back then
//! certainly sees the old values; after the gate opens, the kind's own accessor must wait for the
//! copy to see the new ones. (The simulator's streams also start work 20 ms late, so a missing wait
//! in the tests without a gate reads stale data too.)

mod common;

use common::hold;
use cumem_copy::{Copy2D, Copy3D, Pitched, PitchedBuffer, Rect2D, StreamCopy};
use cumem_core::{
    Context, Device, DeviceBuffer, HostMemory, HostRegistered, MappedBuffer, PinnedBuffer, PinnedFlags,
    RegisterFlags, Stream,
};
use cumem_sys::testing;

const SIM: &str = "devices=2,latency_us=20000";

fn setup() -> (Context, Stream) {
    testing::init_with(SIM);
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    (ctx, stream)
}

fn pattern(n: usize, seed: u64) -> Vec<u64> {
    (0..n as u64).map(|i| (i + seed + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed).collect()
}

/// Reads the first value behind the kind's back: what a program that forgot to wait would see.
/// Call only while a gate holds the stream in front of every write to it.
fn early<T: Copy>(ptr: *const T) -> T {
    // SAFETY: test only: the memory is live and every bit pattern of the tested types is valid; the
    // caller holds every device write to it behind a closed gate, so nothing writes concurrently.
    unsafe { std::ptr::read_volatile(ptr) }
}

/// Uploads `host` to a device buffer, downloads it into the zeroed `back`, and checks both legs:
/// the device has the values, and `back` shows them only after its own wait.
fn round_trip<S: HostMemory<u64>, D: HostMemory<u64>>(
    stream: &Stream,
    host: &S,
    back: &mut D,
    back_ptr: *const u64,
    expected: &[u64],
    read_back: impl FnOnce(&D) -> Vec<u64>,
) {
    let mut dev = DeviceBuffer::<u64>::zeroed(stream, expected.len()).unwrap();
    let gate = hold(stream); // after `dev`: dropped (opened) first if an assertion fails
    stream.copy_h2d(host, &mut dev).unwrap();
    stream.copy_d2h(&dev, back).unwrap();
    assert_eq!(early(back_ptr), 0, "the download ran while the stream was held");
    gate.release();
    assert_eq!(read_back(back), expected); // right only because `back` waits for the download
    assert_eq!(dev.to_vec().unwrap(), expected);
}

#[test]
fn pinned_buffers_of_every_flag_combination_round_trip() {
    let (ctx, stream) = setup();
    for bits in 0..8u32 {
        let flags = PinnedFlags {
            portable: bits & 1 != 0,
            device_mapped: bits & 2 != 0,
            write_combined: bits & 4 != 0,
        };
        let data = pattern(2048, u64::from(bits));
        let host = PinnedBuffer::from_slice_with_flags(&ctx, &data, flags).unwrap();
        let mut back = PinnedBuffer::<u64>::zeroed_with_flags(&ctx, 2048, flags).unwrap();
        let ptr = back.as_ptr();
        round_trip(&stream, &host, &mut back, ptr, &data, |b| b.to_vec().unwrap());
    }
}

#[test]
fn mapped_buffers_round_trip_through_their_host_side() {
    let (ctx, stream) = setup();
    let data = pattern(4096, 1);
    let host = MappedBuffer::from_slice(&ctx, &data).unwrap();
    let mut back = MappedBuffer::<u64>::zeroed(&ctx, 4096).unwrap();
    let ptr = back.as_ptr();
    round_trip(&stream, &host, &mut back, ptr, &data, |b| b.to_vec().unwrap());
}

#[test]
fn mapped_buffers_round_trip_through_their_device_address() {
    let (ctx, stream) = setup();
    let data = pattern(4096, 2);
    let mut mapped = MappedBuffer::from_slice(&ctx, &data).unwrap();
    let mut dev = DeviceBuffer::<u64>::zeroed(&stream, 4096).unwrap();
    // Device to device: the mapping is the source, read by the device through its device address.
    stream.copy_d2d(&mapped, &mut dev).unwrap();
    // The host may not write while that copy is pending: this waits for it.
    mapped.as_mut_slice().unwrap().fill(0);
    assert_eq!(dev.to_vec().unwrap(), data);
    // Now the device writes the mapping; the host read waits for it.
    let twice: Vec<u64> = data.iter().map(|v| v.wrapping_mul(2)).collect();
    let src = DeviceBuffer::from_slice(&stream, &twice).unwrap();
    let gate = hold(&stream);
    stream.copy_d2d(&src, &mut mapped).unwrap();
    assert_eq!(early(mapped.as_ptr()), 0, "the device write ran while the stream was held");
    gate.release();
    assert_eq!(mapped.as_slice().unwrap(), &twice[..]); // waits for the device write
    // A memset through the device address, then a drop with work pending: the drop waits.
    stream.memset_d32(&mut mapped.as_device_slice_mut(), 7).unwrap();
    drop(mapped);
    stream.synchronize().unwrap();
    if let Some(ctl) = testing::sim_control() {
        let v = ctl.violations_on_this_thread();
        assert!(v.is_empty(), "{v:?}");
    }
}

/// Two page-aligned, whole-page slices of `v`, `n` values each: drivers may pin (and refuse to pin
/// twice) whole pages, so two live registrations must not share one.
fn two_pages_apart(v: &mut [u64], n: usize) -> (&mut [u64], &mut [u64]) {
    let skip = (4096 - v.as_ptr() as usize % 4096) % 4096 / size_of::<u64>();
    let (a, b) = v[skip..skip + 2 * n].split_at_mut(n);
    (a, b)
}

#[test]
fn registered_slices_round_trip_and_are_released_after_the_scope() {
    let (ctx, stream) = setup();
    let data = pattern(8192, 3);
    let mut storage = vec![0u64; 2 * 8192 + 512];
    let (src, dst) = two_pages_apart(&mut storage, 8192);
    src.copy_from_slice(&data);
    let dst_base = dst.as_ptr() as u64;
    HostRegistered::scope(&ctx, src, |src| {
        HostRegistered::scope_with_flags(
            &ctx,
            dst,
            RegisterFlags { portable: true, ..Default::default() },
            |dst| {
                let ptr = dst.as_ptr();
                round_trip(&stream, &*src, dst, ptr, &data, |b| b.to_vec().unwrap());
                Ok(())
            },
        )
    })
    .unwrap();
    let (_, dst) = two_pages_apart(&mut storage, 8192);
    assert_eq!(dst, data);
    // The scope itself waits: a download still queued when it ends has landed when it returns.
    let dev = DeviceBuffer::from_slice(&stream, &[5u64; 8192]).unwrap();
    HostRegistered::scope(&ctx, &mut *dst, |reg| stream.copy_d2h(&dev, reg)).unwrap();
    assert_eq!(dst, vec![5; 8192]);
    if let Some(ctl) = testing::sim_control() {
        assert!(!ctl.live_report().contains_registration(dst_base));
    }
}

#[test]
fn a_host_write_to_a_registered_slice_waits_for_the_upload_reading_it() {
    let (ctx, stream) = setup();
    let mut data = vec![1u32; 1 << 14];
    let mut dev = DeviceBuffer::<u32>::zeroed(&stream, 1 << 14).unwrap();
    HostRegistered::scope(&ctx, &mut data, |reg| {
        stream.copy_h2d(reg, &mut dev)?;
        reg.as_mut_slice()?.fill(2); // must not overtake the device's read of the 1s
        Ok(())
    })
    .unwrap();
    assert_eq!(dev.to_vec().unwrap(), vec![1; 1 << 14]);
    assert_eq!(data, vec![2; 1 << 14]);
}

#[test]
fn dropping_a_mapped_buffer_with_a_pending_download_waits_for_it() {
    let (ctx, stream) = setup();
    let dev = DeviceBuffer::from_slice(&stream, &[3u8; 1 << 16]).unwrap();
    let mut host = MappedBuffer::<u8>::zeroed(&ctx, 1 << 16).unwrap();
    stream.copy_d2h(&dev, &mut host).unwrap();
    let ptr = host.as_ptr() as u64;
    drop(host);
    stream.synchronize().unwrap();
    if let Some(ctl) = testing::sim_control() {
        assert!(!ctl.live_report().contains_ptr(ptr));
        let v = ctl.violations_on_this_thread();
        assert!(v.iter().all(|v| !v.function.contains("Memcpy")), "{v:?}");
    }
}

#[test]
fn a_queued_2d_download_is_read_only_after_its_wait() {
    let (ctx, stream) = setup();
    let mut img = PitchedBuffer::<u16>::zeroed(&stream, 64, 32).unwrap();
    stream.fill_2d(&mut img.as_pitched_mut(), 0x1234u16, Rect2D::new(64, 32)).unwrap();
    let mut host = PinnedBuffer::<u16>::zeroed(&ctx, 64 * 32).unwrap();
    let gate = hold(&stream);
    stream.copy_2d(&img.as_pitched(), &mut Pitched::new(&mut host, 64), Copy2D::new(64, 32)).unwrap();
    assert_eq!(early(host.as_ptr()), 0, "the copy ran while the stream was held");
    gate.release();
    assert_eq!(host.as_slice().unwrap(), &vec![0x1234u16; 64 * 32][..]); // waits for the copy
}

#[test]
fn a_queued_3d_upload_from_a_registered_slice_reads_it_before_the_host_writes_again() {
    let (ctx, stream) = setup();
    let mut volume: Vec<u32> = (0..6 * 5 * 4).collect();
    let mut vol = PitchedBuffer::<u32>::zeroed_3d(&stream, 6, 5, 4).unwrap();
    HostRegistered::scope(&ctx, &mut volume, |reg| {
        stream.copy_3d(
            &Pitched::new(&*reg, 6).with_height(5),
            &mut vol.as_pitched_mut(),
            Copy3D::new(6, 5, 4),
        )?;
        reg.as_mut_slice()?.fill(0); // waits for the upload to have read the values
        Ok(())
    })
    .unwrap();
    assert_eq!(vol.to_vec().unwrap(), (0..120).collect::<Vec<u32>>());
}
