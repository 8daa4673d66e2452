//! Two processes share a device buffer through legacy IPC: the parent (this test) allocates and
//! fills it, exports it and an interprocess event, and sends both handles over a Unix socket to
//! a child (this test binary again, running only `child_side`); the child checks the bytes,
//! queues a write of new ones behind a gate on its stream, records the event and says so; the
//! gate opens a while later. The parent waits on the event and must then read the child's bytes:
//! a parent that did not wait would read its own bytes, since the write is still held. Then the
//! other way round: the parent queues a third pattern behind a gate on its stream and records the
//! event; the child queries it (not complete), makes its stream wait on it and queues a copy of the
//! import, says so, and the parent opens its gate: the child must copy the third pattern (without
//! the wait it would copy its own bytes), and query the event complete afterwards.
//! The child also checks the registry of open imports: a second open is refused in the same
//! context and on another device, disjoint ranges of the allocation open together, forged
//! offsets and sizes and an address misaligned for `T` are refused without leaving an import;
//! a process cannot open memory or an event it exported itself; an event records on and makes
//! wait only streams of its own context.
//! Both processes end with a clean live report (the leak check at exit also enforces it).

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::{Device, DeviceBuffer, DriverResource, Error, PinnedBuffer, Stream};
use cumem_ipc::{IpcEvent, IpcEventHandle, IpcMemHandle};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::sys::CUresult;
use cumem_sys::testing;
use cumem_sys::testing::child_process::{ChildTest, Watchdog, connect_to_parent, expect};
use serial_test::serial;

/// Set (to the socket path) in the child process.
const CHILD_ENV: &str = "CUMEM_IPC_TEST_CHILD";
const LEN: usize = 4096;

fn parent_pattern(i: usize) -> u32 {
    (i as u32).wrapping_mul(2_654_435_761) ^ 0x5EED
}

fn child_pattern(i: usize) -> u32 {
    !(i as u32).rotate_left(7)
}

/// What the parent writes last, for the child's stream that waits on the event: the bytes the
/// child's later checks read.
fn third_pattern(i: usize) -> u32 {
    (i as u32).wrapping_mul(0x9E37_79B9).rotate_right(5)
}

fn assert_clean_report() {
    if let Some(ctl) = testing::sim_control() {
        let report = ctl.live_report();
        assert!(report.is_clean(), "live report not clean:\n{report}");
    }
}

#[test]
#[serial]
fn a_child_process_reads_the_parents_buffer_and_the_parent_sees_the_childs_write() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    testing::init();
    let (child, mut sock) = ChildTest::spawn("child_side", CHILD_ENV);
    {
        let ctx = Device::get(0).unwrap().context().unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let driver = Arc::new(DriverResource::new(&ctx));
        let data: Vec<u32> = (0..LEN).map(parent_pattern).collect();
        let mut buf = DeviceBuffer::from_slice_in(&driver, &stream, &data).unwrap();
        let handle = IpcMemHandle::export(&buf).unwrap();
        let event = IpcEvent::new(&ctx).unwrap();
        // The child reads at once: the fill must be complete before the handle leaves.
        buf.order().synchronize().unwrap();
        sock.write_all(&handle.to_bytes()).unwrap();
        sock.write_all(&event.handle().unwrap().to_bytes()).unwrap();
        expect(&mut sock, b"R");
        {
            // The event completes only when the child's recording does: no deadline of its own.
            let _dog = Watchdog::arm("waiting on the child's interprocess event");
            event.synchronize().unwrap();
        }
        let seen = buf.to_vec().unwrap();
        let expected: Vec<u32> = (0..LEN).map(child_pattern).collect();
        assert!(seen == expected, "the parent does not see the child's bytes after the event");
        // The other way round: the child's stream waits for this process's recording.
        let mut host = PinnedBuffer::<u32>::zeroed(&ctx, LEN).unwrap();
        for (i, v) in host.as_mut_slice().unwrap().iter_mut().enumerate() {
            *v = third_pattern(i);
        }
        stream.context().bind().unwrap();
        // SAFETY: `stream` is alive (owned here), and its context was just made current.
        let gate = unsafe { testing::hold(stream.raw()) };
        stream.copy_h2d(&host, &mut buf).unwrap();
        event.record(&stream).unwrap();
        sock.write_all(b"W").unwrap();
        // The child has queried the event and queued its wait and its copy. The write runs a while
        // later, so that a copy queued without the wait would have run first and read the child's
        // bytes.
        expect(&mut sock, b"Q");
        gate.release_after(Duration::from_millis(300)).join().unwrap();
        // The child closes its import before it exits; only then may the buffer go.
        child.finish();
        drop(host);
    }
    assert_clean_report();
}

/// The child's half; a no-op unless the parent started this process.
#[test]
#[serial]
fn child_side() {
    let Some(mut sock) = connect_to_parent(CHILD_ENV) else {
        return;
    };
    testing::init();
    let mut mem = [0u8; IpcMemHandle::ENCODED_LEN];
    let mut ev = [0u8; IpcEventHandle::ENCODED_LEN];
    sock.read_exact(&mut mem).unwrap();
    sock.read_exact(&mut ev).unwrap();
    {
        let ctx = Device::get(0).unwrap().context().unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let handle = IpcMemHandle::from_bytes(&mem).unwrap();
        assert_eq!(handle.bytes(), LEN * 4);
        // SAFETY: the parent keeps the buffer until this process exits, and touches it again only
        // after waiting on the event this process records after its write.
        let mut import = unsafe { handle.open::<u32>(&stream) }.unwrap();
        // The same memory twice in one context would be two exclusive views of it.
        // SAFETY: as above.
        assert!(matches!(unsafe { handle.open::<u32>(&stream) }, Err(Error::AlreadyMapped { .. })));
        // SAFETY: the parent drops its event only after this process has exited (`child.finish`),
        // so after this import and its work; the bytes are its `IpcEvent::handle`, unaltered.
        let event = unsafe { IpcEventHandle::from_bytes(&ev).unwrap().open(&ctx) }.unwrap();
        let got = import.as_slice().to_vec().unwrap();
        let expected: Vec<u32> = (0..LEN).map(parent_pattern).collect();
        assert!(got == expected, "the child does not read the parent's bytes");
        let mut host = PinnedBuffer::<u32>::zeroed(&ctx, LEN).unwrap();
        for (i, v) in host.as_mut_slice().unwrap().iter_mut().enumerate() {
            *v = child_pattern(i);
        }
        stream.context().bind().unwrap();
        // SAFETY: `stream` is alive (owned here), and its context was just made current.
        let gate = unsafe { testing::hold(stream.raw()) };
        stream.copy_h2d(&host, &mut import.as_mut_slice()).unwrap();
        event.record(&stream).unwrap();
        // Said while the write is still held.
        sock.write_all(b"R").unwrap();
        let opener = gate.release_after(Duration::from_millis(200));
        assert!(matches!(IpcMemHandle::from_bytes(&[0; 3]), Err(Error::LengthMismatch { .. })));
        opener.join().unwrap();
        a_stream_waits_on_the_exporters_recording(&mut sock, &event, &import, &stream);
        drop(event);
        drop(import);
        drop(host);
        handles_made_here_do_not_open_here(&stream);
        an_event_uses_only_streams_of_its_context(&stream);
        forged_handles_are_refused_without_leaving_an_import(&mem, &stream);
        another_device_cannot_open_what_one_device_has_open(&handle, &stream);
        disjoint_ranges_of_one_allocation_open_together(&mem, &stream);
        other_driver_bytes_for_one_allocation_cannot_map_it_twice(&mem, &stream);
        an_import_at_an_address_misaligned_for_t_is_refused_and_closed(&handle, &stream);
        an_import_whose_work_cannot_be_waited_for_is_leaked_not_closed(&handle, &stream);
    }
    assert_clean_report();
}

/// The parent records the event behind a held write of the third pattern and says `W`; this
/// process finds the recording incomplete, makes `stream` wait on it, queues a copy of the import,
/// says `Q`, and must copy the third pattern once the parent opens its gate: without the wait the
/// copy would run at once and read this process's own bytes.
fn a_stream_waits_on_the_exporters_recording(
    sock: &mut std::os::unix::net::UnixStream,
    event: &IpcEvent,
    import: &cumem_ipc::ImportedBuffer<u32>,
    stream: &Stream,
) {
    expect(sock, b"W");
    assert!(!event.query().unwrap(), "the parent's recording is held, yet the event is complete");
    event.wait_on(stream).unwrap();
    let mut host = PinnedBuffer::<u32>::zeroed(stream.context(), LEN).unwrap();
    stream.copy_d2h(&import.as_slice(), &mut host).unwrap();
    sock.write_all(b"Q").unwrap();
    {
        // Completes only when the parent opens its gate: no deadline of its own.
        let _dog = Watchdog::arm("waiting on the parent's interprocess event");
        stream.synchronize().unwrap();
    }
    let expected: Vec<u32> = (0..LEN).map(third_pattern).collect();
    assert!(host.as_slice().unwrap() == &expected[..], "the copy did not wait for the parent's write");
    assert!(event.query().unwrap(), "the parent's recording ran, yet the event is incomplete");
}

/// A process holding another's import may still not open a handle it exported itself: memory
/// (as measured on the H100) and events (the simulator's answer) give `InvalidContext`.
fn handles_made_here_do_not_open_here(stream: &Stream) {
    let ctx = stream.context();
    let driver = Arc::new(DriverResource::new(ctx));
    let own = DeviceBuffer::<u32>::zeroed_in(&driver, stream, 64).unwrap();
    let handle = IpcMemHandle::export(&own).unwrap();
    // SAFETY: `own` outlives the attempt, which is refused, so nothing is accessed.
    let opened = unsafe { handle.open::<u32>(stream) };
    assert!(matches!(opened, Err(Error::InvalidContext { .. })), "{opened:?}");
    assert_eq!(open_imports(), 0, "a refused open left an import");
    let event = IpcEvent::new(ctx).unwrap();
    // SAFETY: `event` outlives the attempt; the bytes are its handle, unaltered.
    let opened = unsafe { event.handle().unwrap().open(ctx) };
    assert!(matches!(opened, Err(Error::InvalidContext { .. })), "{opened:?}");
}

/// Recording an event on, or making wait, a stream of another context would hand the driver a
/// stream and an event of different contexts: refused with `WrongDevice` before any driver call.
fn an_event_uses_only_streams_of_its_context(stream: &Stream) {
    if !testing::needs_devices(2) {
        return;
    }
    let event = IpcEvent::new(stream.context()).unwrap();
    let other = Stream::new(&Device::get(1).unwrap().context().unwrap()).unwrap();
    let recorded = event.record(&other);
    assert!(matches!(recorded, Err(Error::WrongDevice { expected: 0, actual: 1 })), "{recorded:?}");
    let waited = event.wait_on(&other);
    assert!(matches!(waited, Err(Error::WrongDevice { expected: 0, actual: 1 })), "{waited:?}");
    // Nothing was recorded: the event has no recording to wait for.
    assert!(event.query().unwrap());
}

/// `mem` with its offset and size fields replaced, as a forging sender could.
fn forged(mem: &[u8; IpcMemHandle::ENCODED_LEN], offset: u64, bytes: u64) -> IpcMemHandle {
    let mut forged = *mem;
    let at = IpcMemHandle::ENCODED_LEN - 16;
    forged[at..at + 8].copy_from_slice(&offset.to_le_bytes());
    forged[at + 8..].copy_from_slice(&bytes.to_le_bytes());
    IpcMemHandle::from_bytes(&forged).unwrap()
}

/// The offset and size are untrusted bytes: forged ones give typed errors and leave no import open
/// (the child holds no other import by now, so any `ipc_import` in the report would be a leak).
fn forged_handles_are_refused_without_leaving_an_import(
    mem: &[u8; IpcMemHandle::ENCODED_LEN],
    stream: &Stream,
) {
    // SAFETY: the parent keeps the buffer until this process exits and does not touch it any
    // more; no forged open succeeds, so nothing is accessed (the same holds for the opens below).
    let overflowing = unsafe { forged(mem, u64::MAX - 3, 4).open::<u32>(stream) };
    assert!(matches!(overflowing, Err(Error::InvalidValue { .. })), "{overflowing:?}");
    // SAFETY: as above.
    let misaligned = unsafe { forged(mem, 2, 4).open::<u32>(stream) };
    assert!(matches!(misaligned, Err(Error::Misaligned { .. })), "{misaligned:?}");
    // SAFETY: as above.
    let outside = unsafe { forged(mem, 4, (LEN * 4) as u64).open::<u32>(stream) };
    assert!(matches!(outside, Err(Error::InvalidValue { .. })), "{outside:?}");
    if let Some(ctl) = testing::sim_control() {
        let report = ctl.live_report();
        assert!(
            report.allocations.iter().all(|a| a.kind != "ipc_import"),
            "an import was left open:\n{report}"
        );
    }
}

/// `Error::AlreadyMapped` for an `ImportedBuffer` of `handle`, from the open under test.
fn assert_already_mapped(opened: Result<cumem_ipc::ImportedBuffer<u32>, Error>) {
    assert!(matches!(opened, Err(Error::AlreadyMapped { .. })), "{opened:?}");
}

/// The number of legacy imports in the simulator's live report (0 on a real driver).
fn open_imports() -> usize {
    testing::sim_control()
        .map_or(0, |ctl| ctl.live_report().allocations.iter().filter(|a| a.kind == "ipc_import").count())
}

/// The driver lets one context per device open a handle: with a primary context per device, a
/// stream on device 1 could open what a stream on device 0 has open, as a second mapping of the
/// same bytes with its own stream order. The claim covers every context, so that open is refused
/// before the driver is asked.
fn another_device_cannot_open_what_one_device_has_open(handle: &IpcMemHandle, stream: &Stream) {
    if !testing::needs_devices(2) {
        return;
    }
    let other = Stream::new(&Device::get(1).unwrap().context().unwrap()).unwrap();
    // SAFETY: the parent keeps the buffer until this process exits and no longer touches it.
    let import = unsafe { handle.open::<u32>(stream) }.unwrap();
    // SAFETY: as above; the open is refused, so nothing is accessed.
    assert_already_mapped(unsafe { handle.open::<u32>(&other) });
    assert_eq!(open_imports(), usize::from(testing::sim_control().is_some()), "one mapping, device 0's");
    drop(import);
    if testing::sim_control().is_some() {
        // Once the first is closed, device 1 may open it (on a GPU that needs peer access).
        // SAFETY: as above.
        let on_other = unsafe { handle.open::<u32>(&other) }.unwrap();
        let expected: Vec<u32> = (0..LEN).map(third_pattern).collect();
        assert!(on_other.as_slice().to_vec().unwrap() == expected, "device 1 reads other bytes");
    }
    assert_eq!(open_imports(), 0, "an import was left open");
}

/// Two buffers of one allocation (blocks of one caching-pool segment) share the driver's handle
/// and differ in their range: both open together, in one mapping the driver counts twice, and
/// each closes its own open; a range overlapping a live one is refused.
fn disjoint_ranges_of_one_allocation_open_together(mem: &[u8; IpcMemHandle::ENCODED_LEN], stream: &Stream) {
    let half = (LEN * 4 / 2) as u64;
    let expected: Vec<u32> = (0..LEN).map(third_pattern).collect();
    // SAFETY: the parent keeps the buffer until this process exits and no longer touches it; the
    // two imports cover disjoint bytes.
    let low = unsafe { forged(mem, 0, half).open::<u32>(stream) }.unwrap();
    // SAFETY: as above.
    let high = unsafe { forged(mem, half, half).open::<u32>(stream) }.unwrap();
    assert_eq!(high.device_ptr() - low.device_ptr(), half, "one mapping");
    // SAFETY: as above; the open is refused, so nothing is accessed.
    assert_already_mapped(unsafe { forged(mem, half / 2, half).open::<u32>(stream) });
    assert!(high.as_slice().to_vec().unwrap() == expected[LEN / 2..], "the upper half");
    drop(low);
    // The mapping outlives the first close: the driver counted two opens.
    assert!(high.as_slice().to_vec().unwrap() == expected[LEN / 2..], "the upper half after a close");
    drop(high);
    assert_eq!(open_imports(), 0, "an import was left open");
}

/// `mem` with a byte of the driver's handle changed that the simulator does not read (48..64): the
/// same allocation under other bytes, as two exports of it might be on a real driver.
fn other_bytes(mem: &[u8; IpcMemHandle::ENCODED_LEN]) -> [u8; IpcMemHandle::ENCODED_LEN] {
    let mut other = *mem;
    other[63] ^= 0xff;
    other
}

/// The claim by handle bytes cannot see that other bytes name the same allocation; the driver's
/// answer can: it maps the second open in the same context at the live import's address. That
/// open is refused with `AlreadyMapped` and closed once, leaving the live import's mapping (the
/// driver counted two opens); a disjoint range under the other bytes opens beside it.
fn other_driver_bytes_for_one_allocation_cannot_map_it_twice(
    mem: &[u8; IpcMemHandle::ENCODED_LEN],
    stream: &Stream,
) {
    if testing::sim_control().is_none() {
        return testing::skip("relies on the simulator ignoring handle bytes 48..64");
    }
    let whole = (LEN * 4) as u64;
    let half = whole / 2;
    let expected: Vec<u32> = (0..LEN).map(third_pattern).collect();
    let other = other_bytes(mem);
    // SAFETY: the parent keeps the buffer until this process exits and no longer touches it.
    let import = unsafe { forged(mem, 0, whole).open::<u32>(stream) }.unwrap();
    // SAFETY: as above; the open is refused, so nothing is accessed.
    assert_already_mapped(unsafe { forged(&other, half, half).open::<u32>(stream) });
    assert_eq!(open_imports(), 1, "the refused open was not closed, or closed the live import");
    assert!(import.as_slice().to_vec().unwrap() == expected, "the live import after the refusal");
    drop(import);
    assert_eq!(open_imports(), 0, "an import was left open");
    // SAFETY: as above; the two imports cover disjoint bytes.
    let low = unsafe { forged(mem, 0, half).open::<u32>(stream) }.unwrap();
    // SAFETY: as above.
    let high = unsafe { forged(&other, half, half).open::<u32>(stream) }.unwrap();
    assert!(low.as_slice().to_vec().unwrap() == expected[..LEN / 2], "the lower half");
    assert!(high.as_slice().to_vec().unwrap() == expected[LEN / 2..], "the upper half");
    drop(low);
    drop(high);
    assert_eq!(open_imports(), 0, "an import was left open");
}

/// A `T` aligned more than the 512 bytes the simulator aligns an import to.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(1024))]
struct Aligned1024([u8; 1024]);

/// An aligned offset does not make an aligned address: the driver's own alignment may be less
/// than a `T` asks for. The simulator hands out addresses next-fit, so an import of this handle
/// (20 KiB with its guard gap) after a 512-byte allocation (4.5 KiB) lands 512 bytes off the
/// previous import's alignment: within two tries one import is at an odd multiple of 512, which
/// must be refused with `Error::Misaligned` and closed, not handed out misaligned.
fn an_import_at_an_address_misaligned_for_t_is_refused_and_closed(handle: &IpcMemHandle, stream: &Stream) {
    if testing::sim_control().is_none() {
        return testing::skip("relies on the simulator's address placement");
    }
    let driver = Arc::new(DriverResource::new(stream.context()));
    let mut fillers = Vec::new();
    for _ in 0..2 {
        // SAFETY: the parent keeps the buffer until this process exits and no longer touches it.
        match unsafe { handle.open::<Aligned1024>(stream) } {
            Ok(import) => {
                assert_eq!(import.device_ptr() % 1024, 0, "an import misaligned for its type");
                drop(import);
                fillers.push(DeviceBuffer::<u8>::zeroed_in(&driver, stream, 512).unwrap());
            }
            Err(Error::Misaligned { what: "imported address", value, align: 1024 }) => {
                assert_eq!(value % 1024, 512);
                assert_eq!(open_imports(), 0, "the refused import was left open");
                return;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    panic!("no import landed at an odd multiple of 512 bytes");
}

/// Closing an import while its work may still run would unmap memory under that work: when waiting
/// for it fails, drop leaks the import (it stays open) instead.
fn an_import_whose_work_cannot_be_waited_for_is_leaked_not_closed(handle: &IpcMemHandle, stream: &Stream) {
    let Some(ctl) = testing::sim_control() else { return };
    // SAFETY: the parent keeps the buffer until this process exits and no longer touches it.
    let import = unsafe { handle.open::<u32>(stream) }.unwrap();
    import.as_slice().to_vec().unwrap();
    let base = import.device_ptr();
    let closes = ctl.calls_on_this_thread("cuIpcCloseMemHandle");
    let rule = ctl.inject_fault(FaultRule {
        function: "cuStreamSynchronize".into(),
        nth: 1,
        code: CUresult::CUDA_ERROR_LAUNCH_FAILED,
        times: 0,
        this_thread_only: true,
    });
    drop(import);
    ctl.remove_fault(rule);
    assert_eq!(ctl.calls_on_this_thread("cuIpcCloseMemHandle"), closes, "the import was closed");
    assert!(ctl.live_report().allocations.iter().any(|a| a.kind == "ipc_import" && a.ptr == base));
    // The test's own cleanup, so that the exit leak check sees only real leaks.
    // SAFETY: `base` is the leaked import's address (its offset is 0), opened once and unused now.
    let closed = unsafe { cumem_sys::sys::cuIpcCloseMemHandle(base) };
    assert_eq!(closed, CUresult::CUDA_SUCCESS);
}
