//! Every page-locked host kind through synchronous and queued copies, as tables (rstest): a row
//! per kind (every pinned flag combination, mapped, registered), so that a new kind is tested by
//! adding a row to [`every_host_kind`]. Data round-trips bitwise in every direction, and reads after
//! a queued copy are right only because the kind waited. To show that deterministically, the stream
//! is held by a gate (a host function that blocks until the test opens it) while the copy is
//! queued: a read behind the kind's back then certainly sees the old values; after the gate opens,
//! the kind's own accessor must wait for the copy to see the new ones. (The simulator's streams
//! also start work 20 ms late, so a missing wait in the tests without a gate reads stale data too.)
//!
//! Gated tests are `#[serial]` (see `common`: a gate must never overlap a free in another test), and
//! so is the one that checks freed addresses are no longer live (a parallel test could reuse them);
//! the others are `#[parallel]`.

mod common;

use common::hold;
use cumem_copy::{Copy2D, Copy3D, Pitched, PitchedBuffer, Rect2D, StreamCopy};
use cumem_core::{
    Context, Device, DeviceBuffer, HostMemory, HostRegistered, MappedBuffer, PinnedBuffer, PinnedFlags,
    RegisterFlags, Stream,
};
use cumem_sys::testing;
use rstest::rstest;
use serial_test::{parallel, serial};

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

/// One page-locked host memory kind: a row of the tables below.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Pinned(PinnedFlags),
    Mapped,
    /// Whole pages of a `Vec`, registered through the safe scope.
    Registered(RegisterFlags),
}

const fn pinned(portable: bool, device_mapped: bool, write_combined: bool) -> Kind {
    Kind::Pinned(PinnedFlags { portable, device_mapped, write_combined })
}

const fn registered(portable: bool) -> Kind {
    Kind::Registered(RegisterFlags { portable, device_mapped: false })
}

/// Makes each test inside it an rstest with one case per host kind: the rows of every table in
/// this file. A new kind is a new row here (and an arm in [`with_host`]).
macro_rules! every_host_kind {
    ($($item:item)*) => {$(
        #[rstest]
        #[case::pinned(pinned(false, false, false))]
        #[case::pinned_portable(pinned(true, false, false))]
        #[case::pinned_device_mapped(pinned(false, true, false))]
        #[case::pinned_portable_device_mapped(pinned(true, true, false))]
        #[case::pinned_write_combined(pinned(false, false, true))]
        #[case::pinned_portable_write_combined(pinned(true, false, true))]
        #[case::pinned_device_mapped_write_combined(pinned(false, true, true))]
        #[case::pinned_all_flags(pinned(true, true, true))]
        #[case::mapped(Kind::Mapped)]
        #[case::registered(registered(false))]
        #[case::registered_portable(registered(true))]
        $item
    )*};
}

/// Values per row: whole pages, so that no two registrations (of parallel tests) share a page;
/// drivers pin, and refuse to pin twice, whole pages.
const N: usize = 4096;

/// `n` values of `v` starting at a page boundary (`v` has a page to spare).
fn whole_pages(v: &mut [u64], n: usize) -> &mut [u64] {
    let skip = (4096 - v.as_ptr() as usize % 4096) % 4096 / size_of::<u64>();
    &mut v[skip..skip + n]
}

/// Host access to a kind through its own accessors, which wait for queued device work.
trait Host: HostMemory<u64> {
    fn ptr(&self) -> *const u64;
    fn read(&self) -> Vec<u64>;
    fn slice_mut(&mut self) -> &mut [u64];
}

impl Host for PinnedBuffer<u64> {
    fn ptr(&self) -> *const u64 {
        self.as_ptr()
    }
    fn read(&self) -> Vec<u64> {
        self.as_slice().unwrap().to_vec()
    }
    fn slice_mut(&mut self) -> &mut [u64] {
        self.as_mut_slice().unwrap()
    }
}

impl Host for MappedBuffer<u64> {
    fn ptr(&self) -> *const u64 {
        self.as_ptr()
    }
    fn read(&self) -> Vec<u64> {
        self.to_vec().unwrap()
    }
    fn slice_mut(&mut self) -> &mut [u64] {
        self.as_mut_slice().unwrap()
    }
}

impl Host for HostRegistered<'_, u64> {
    fn ptr(&self) -> *const u64 {
        self.as_ptr()
    }
    fn read(&self) -> Vec<u64> {
        self.as_slice().unwrap().to_vec()
    }
    fn slice_mut(&mut self) -> &mut [u64] {
        self.as_mut_slice().unwrap()
    }
}

/// Calls `f(args.., &mut host)` with a `host` of `kind` holding `init` (a macro, because a
/// closure cannot be generic over the kind's type).
macro_rules! with_host {
    ($kind:expr, $ctx:expr, $init:expr, $f:ident($($arg:expr),*)) => {
        match $kind {
            Kind::Pinned(flags) => {
                let mut host = PinnedBuffer::from_slice_with_flags($ctx, $init, flags).unwrap();
                assert_eq!(host.flags(), flags);
                $f($($arg,)* &mut host)
            }
            Kind::Mapped => $f($($arg,)* &mut MappedBuffer::from_slice($ctx, $init).unwrap()),
            Kind::Registered(flags) => {
                let mut storage = vec![0u64; $init.len() + 512];
                let pages = whole_pages(&mut storage, $init.len());
                pages.copy_from_slice($init);
                HostRegistered::scope_with_flags($ctx, pages, flags, |reg| {
                    assert_eq!(reg.flags(), flags);
                    Ok($f($($arg,)* reg))
                })
                .unwrap()
            }
        }
    };
}

/// A copy direction: a column of the round-trip table.
#[derive(Debug, Clone, Copy)]
enum Direction {
    /// Blocking `copy_h2d` from the kind's host slice.
    Upload,
    /// Blocking `copy_d2h` into the kind's host slice.
    Download,
    /// `StreamCopy::copy_h2d` from the kind.
    QueuedUpload,
    /// `StreamCopy::copy_d2h` into the kind, then a read through the kind's accessor.
    QueuedDownload,
}

/// Copies `host` (holding `data`) in `direction` and checks both ends bitwise.
fn round_trip<H: Host>(stream: &Stream, direction: Direction, data: &[u64], host: &mut H) {
    let other = pattern(N, 99);
    let mut dev = DeviceBuffer::<u64>::zeroed(stream, N).unwrap();
    let expected = match direction {
        Direction::Upload => {
            cumem_copy::copy_h2d(host.slice_mut(), &mut dev).unwrap();
            data
        }
        Direction::QueuedUpload => {
            stream.copy_h2d(&*host, &mut dev).unwrap();
            data
        }
        Direction::Download => {
            cumem_copy::copy_h2d(&other, &mut dev).unwrap();
            cumem_copy::copy_d2h(&dev, host.slice_mut()).unwrap();
            &other[..]
        }
        Direction::QueuedDownload => {
            cumem_copy::copy_h2d(&other, &mut dev).unwrap();
            stream.copy_d2h(&dev, host).unwrap();
            &other[..]
        }
    };
    // Right for the queued download only because the accessor waits: it runs 20 ms late.
    assert_eq!(host.read(), expected);
    assert_eq!(dev.to_vec().unwrap(), expected);
}

every_host_kind! {
    /// Every kind round-trips bitwise in every direction, and host access after a queued copy
    /// sees the copied values.
    #[parallel]
    fn every_kind_round_trips_bitwise_in_every_direction(
        #[case] kind: Kind,
        #[values(Direction::Upload, Direction::Download, Direction::QueuedUpload, Direction::QueuedDownload)]
        direction: Direction,
    ) {
        let (ctx, stream) = setup();
        let data = pattern(N, 1);
        with_host!(kind, &ctx, &data, round_trip(&stream, direction, &data));
    }
}

/// Uploads the kind's values, zeroes it on the host (which waits for the upload to have read
/// them), then downloads them back while a gate holds the stream: the host sees the download only
/// through the kind's own wait.
fn upload_then_gated_download<H: Host>(stream: &Stream, data: &[u64], host: &mut H) {
    let mut dev = DeviceBuffer::<u64>::zeroed(stream, N).unwrap();
    stream.copy_h2d(&*host, &mut dev).unwrap();
    host.slice_mut().fill(0); // waits for the upload to have read `data`
    assert_eq!(dev.to_vec().unwrap(), data);
    let gate = hold(stream); // after `dev`: dropped (opened) first if an assertion fails
    stream.copy_d2h(&dev, host).unwrap();
    assert_eq!(early(host.ptr()), 0, "the download ran while the stream was held");
    gate.release(); // does not wait: `read` has to
    assert_eq!(host.read(), data);
}

every_host_kind! {
    /// Host access after a queued download sees the copied values, and only because it waited.
    #[serial] // holds a gate
    fn every_kind_is_read_only_after_a_queued_download(#[case] kind: Kind) {
        let (ctx, stream) = setup();
        let data = pattern(N, 2);
        with_host!(kind, &ctx, &data, upload_then_gated_download(&stream, &data));
    }
}

/// Writes the host side of `host` (holding 1s) while an upload of it is queued.
fn host_write_after_upload<H: Host>(stream: &Stream, host: &mut H) {
    let mut dev = DeviceBuffer::<u64>::zeroed(stream, N).unwrap();
    stream.copy_h2d(&*host, &mut dev).unwrap();
    host.slice_mut().fill(2); // must not overtake the device's read of the 1s
    assert_eq!(dev.to_vec().unwrap(), vec![1; N]);
    assert_eq!(host.read(), vec![2; N]);
    stream.copy_h2d(&*host, &mut dev).unwrap();
    assert_eq!(dev.to_vec().unwrap(), vec![2; N]);
}

every_host_kind! {
    /// A host write waits for a queued upload to have read the old values.
    #[parallel]
    fn every_kind_waits_for_an_upload_before_a_host_write(#[case] kind: Kind) {
        let (ctx, stream) = setup();
        with_host!(kind, &ctx, &[1u64; N], host_write_after_upload(&stream));
    }
}

every_host_kind! {
    /// Releasing the memory (a drop, or the end of a registration scope) while a download into
    /// it is queued waits for the download: nothing is freed or unregistered under the copy.
    #[serial] // checks that the address is no longer live, which a parallel test could reuse
    fn every_kind_waits_for_a_pending_download_before_it_is_released(#[case] kind: Kind) {
        let (ctx, stream) = setup();
        let dev = DeviceBuffer::from_slice(&stream, &[3u64; N]).unwrap();
        // The freed allocation's id (its address may be handed out again at once), while live.
        let id_of = |ptr: *const u64| testing::sim_control().map(|c| c.live_report().id_of(ptr as u64).expect("live"));
        let released = match kind {
            Kind::Pinned(flags) => {
                let mut host = PinnedBuffer::<u64>::zeroed_with_flags(&ctx, N, flags).unwrap();
                stream.copy_d2h(&dev, &mut host).unwrap();
                let id = id_of(host.as_ptr());
                drop(host); // must not free the memory under the pending copy
                id
            }
            Kind::Mapped => {
                let mut host = MappedBuffer::<u64>::zeroed(&ctx, N).unwrap();
                stream.copy_d2h(&dev, &mut host).unwrap();
                let id = id_of(host.as_ptr());
                drop(host);
                id
            }
            Kind::Registered(flags) => {
                let mut storage = vec![0u64; N + 512];
                let pages = whole_pages(&mut storage, N);
                let base = pages.as_ptr() as u64;
                HostRegistered::scope_with_flags(&ctx, &mut *pages, flags, |reg| stream.copy_d2h(&dev, reg))
                    .unwrap();
                // The scope itself waits: the download queued in it has landed when it returns.
                assert_eq!(pages, vec![3; N]);
                if let Some(ctl) = testing::sim_control() {
                    assert!(!ctl.live_report().contains_registration(base), "unregistered at the scope's end");
                }
                None // a registration, not an allocation: checked just above
            }
        };
        stream.synchronize().unwrap();
        if let Some(ctl) = testing::sim_control() {
            let live = ctl.live_report();
            assert!(released.is_none_or(|id| !live.contains_allocation(id)), "leaked instead of freed:\n{live}");
            let v = ctl.violations();
            assert!(v.iter().all(|v| !v.function.contains("Memcpy")), "{v:?}");
        }
    }
}

#[test]
#[serial] // holds a gate
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

#[test]
#[serial] // holds a gate
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
#[parallel]
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

/// Pinned memory's tracker lets the stream that read it first since its last write read it again
/// without the tracker's lock. A shared wait in between (which waits for that stream) must keep
/// it tracked: otherwise the read queued after the wait goes unnoticed, and a host write overtakes
/// it. The stream is held while the host writes, so a missing wait shows every time.
#[test]
#[serial] // holds a stream
fn a_read_queued_after_a_shared_wait_is_still_waited_for_before_a_host_write() {
    // Through `&self`: waits for the read, forgets nothing it must keep.
    read_again_after(|host| host.wait_idle().unwrap(), 1);
}

/// Reads a pinned buffer holding 1s on a stream, runs `between` (a host wait, or a host write
/// leaving `expected`), then, with the stream held, reads it again and writes 2s from the host:
/// the write must wait for the second read, which sees `expected`.
fn read_again_after(between: impl FnOnce(&mut PinnedBuffer<u64>), expected: u64) {
    let (ctx, stream) = setup();
    let mut host = PinnedBuffer::from_slice(&ctx, &[1u64; N]).unwrap();
    let mut first = DeviceBuffer::<u64>::zeroed(&stream, N).unwrap();
    let mut second = DeviceBuffer::<u64>::zeroed(&stream, N).unwrap();
    stream.copy_h2d(&host, &mut first).unwrap();
    between(&mut host);
    let gate = hold(&stream);
    stream.copy_h2d(&host, &mut second).unwrap();
    let opener = gate.release_after(std::time::Duration::from_millis(200));
    host.as_mut_slice().unwrap().fill(2); // must wait for the read above
    opener.join().unwrap();
    let (first, second) = (first.to_vec().unwrap(), second.to_vec().unwrap());
    assert!(second.iter().all(|&v| v == expected), "the host write overtook the queued read: {}", second[0]);
    assert!(first.iter().all(|&v| v == 1));
}

/// A download into pinned memory (a device write, on another stream) ends the lock-free reads of
/// the stream that read it before: the next upload on that stream waits for the download and
/// reads what it wrote.
#[test]
#[serial] // holds a stream
fn an_upload_after_a_download_on_another_stream_reads_what_the_download_wrote() {
    let (ctx, s) = setup();
    let t = Stream::non_blocking(&ctx).unwrap();
    let mut host = PinnedBuffer::from_slice(&ctx, &[1u64; N]).unwrap();
    let mut before = DeviceBuffer::<u64>::zeroed(&s, N).unwrap();
    let mut after = DeviceBuffer::<u64>::zeroed(&s, N).unwrap();
    let src = DeviceBuffer::from_slice(&t, &[5u64; N]).unwrap();
    s.copy_h2d(&host, &mut before).unwrap(); // `s` reads the memory from now on without the lock
    s.synchronize().unwrap();
    t.synchronize().unwrap();
    let gate = hold(&t);
    t.copy_d2h(&src, &mut host).unwrap(); // held: the 5s are not written yet
    s.copy_h2d(&host, &mut after).unwrap(); // must wait for the download
    let opener = gate.release_after(std::time::Duration::from_millis(200));
    let after = after.to_vec().unwrap();
    assert!(after.iter().all(|&v| v == 5), "the upload did not wait for the download: {}", after[0]);
    opener.join().unwrap();
    assert!(before.to_vec().unwrap().iter().all(|&v| v == 1));
    assert!(host.as_slice().unwrap().iter().all(|&v| v == 5));
}

/// An exclusive wait (a host write) forgets the stream whose reads were tracked without the lock:
/// its next read must be tracked again, so the next host write waits for it.
#[test]
#[serial] // holds a stream
fn a_read_queued_after_a_host_write_is_waited_for_before_the_next_one() {
    // Exclusive: waits for the read, forgets its stream.
    read_again_after(|host| host.as_mut_slice().unwrap().fill(3), 3);
}

/// Four threads copy from one pinned buffer, each on its own stream (the first stream read it
/// first, so its reads take no lock; the others' are tracked under the lock), while another thread
/// waits for the buffer through `&self` again and again. Then the first stream reads it once more,
/// and a host write must wait for that read (the simulator starts each copy 20 ms late, so it is
/// still queued): a shared wait that forgot the stream would let the write overtake it.
#[test]
#[parallel]
fn reads_from_four_threads_during_shared_waits_are_all_waited_for_before_a_host_write() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;
    let (ctx, _) = setup();
    let host = Arc::new(PinnedBuffer::from_slice(&ctx, &[1u64; N]).unwrap());
    let streams: Vec<Stream> = (0..4).map(|_| Stream::non_blocking(&ctx).unwrap()).collect();
    let mut first = DeviceBuffer::<u64>::zeroed(&streams[0], N).unwrap();
    streams[0].copy_h2d(&*host, &mut first).unwrap(); // the first reader
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                host.wait_idle().unwrap();
            }
        });
        let readers: Vec<_> = streams
            .iter()
            .map(|stream| {
                s.spawn(|| {
                    let mut dev = DeviceBuffer::<u64>::zeroed(stream, N).unwrap();
                    for _ in 0..10 {
                        stream.copy_h2d(&*host, &mut dev).unwrap();
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    assert!(dev.to_vec().unwrap().iter().all(|&v| v == 1));
                })
            })
            .collect();
        readers.into_iter().for_each(|r| r.join().unwrap());
        done.store(true, Ordering::Relaxed);
        waiter.join().unwrap();
    });
    streams[0].copy_h2d(&*host, &mut first).unwrap();
    let mut host = Arc::into_inner(host).expect("the threads are done");
    host.as_mut_slice().unwrap().fill(2); // waits for the read just queued
    let seen = first.to_vec().unwrap();
    assert!(seen.iter().all(|&v| v == 1), "a host write overtook a queued read: {}", seen[0]);
}
