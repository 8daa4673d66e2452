//! Two processes share a buffer of a driver pool: the parent (this test) creates a
//! [`ShareablePool`], allocates and fills a buffer from it, and sends the pool's descriptor
//! (`SCM_RIGHTS`, through `cumem_ipc::fd_passing`) with the buffer's pointer export and an
//! interprocess event to a child (this test binary again, running only `child_side`). The child
//! imports the pool and the pointer, checks the bytes bitwise, queues a write of new ones behind a
//! gate on its stream, records the event and says so; the gate opens a while later. The parent
//! waits on the event and must then read the child's bytes (a parent that did not wait would read
//! its own: the write is still held). The child frees its import and says so before the parent
//! frees the buffer. Misuse on both sides gives typed errors. Both processes end with a clean live
//! report (the leak check at exit enforces it too).

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::{Device, DeviceBuffer, DriverResource, Error, Feature, PinnedBuffer, Stream};
use cumem_ipc::fd_passing::{anonymous_file, recv_fds, send_fds};
use cumem_ipc::{ImportedPool, IpcEvent, IpcEventHandle, IpcMemHandle, PoolPointerExport, ShareablePool};
use cumem_sys::testing::child_process::{ChildTest, Watchdog, connect_to_parent, expect};
use cumem_sys::{sys, testing};
use serial_test::serial;

/// Set (to the socket path) in the child process.
const CHILD_ENV: &str = "CUMEM_IPC_POOL_CHILD";
const LEN: usize = 300_000;
/// Every process of this test starts the simulator this way: device 1 lacks POSIX-FD pool handles.
const SIM_CONFIG: &str = "devices=2,dev1.mempool_supported_handle_types=0";
/// What the parent sends with the pool's descriptor: the pointer export, then the event handle.
const HEADER: usize = PoolPointerExport::ENCODED_LEN + IpcEventHandle::ENCODED_LEN;

fn parent_pattern(i: usize) -> u32 {
    (i as u32).wrapping_mul(2_246_822_519) ^ 0xC0FFEE
}

fn child_pattern(i: usize) -> u32 {
    (i as u32).rotate_right(11) ^ 0x0BAD_F00D
}

fn assert_clean_report() {
    if let Some(ctl) = testing::sim_control() {
        let report = ctl.live_report();
        assert!(report.is_clean(), "live report not clean:\n{report}");
    }
}

#[test]
#[serial]
fn a_child_imports_a_pool_pointer_reads_the_parents_bytes_and_the_parent_sees_the_childs_write() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    testing::init_with(SIM_CONFIG);
    let (child, mut sock) = ChildTest::spawn("child_side", CHILD_ENV);
    {
        let ctx = Device::get(0).unwrap().context().unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let pool = Arc::new(ShareablePool::new(&ctx).unwrap());
        // A first buffer, so that the shared one does not sit at the start of the pool.
        let _first = DeviceBuffer::<u8>::zeroed_in(&pool, &stream, 1000).unwrap();
        let data: Vec<u32> = (0..LEN).map(parent_pattern).collect();
        let buf = DeviceBuffer::from_slice_in(&pool, &stream, &data).unwrap();
        let export = pool.export_pointer(&buf).unwrap();
        assert_eq!(export.bytes(), LEN * 4);
        misuse_on_the_exporting_side(&pool, &ctx, &stream);
        let fd = pool.export_fd().unwrap();
        let event = IpcEvent::new(&ctx).unwrap();
        // The child reads at once: the fill must be complete before the export leaves.
        buf.order().synchronize().unwrap();
        let mut header = Vec::with_capacity(HEADER);
        header.extend_from_slice(&export.to_bytes());
        header.extend_from_slice(&event.handle().unwrap().to_bytes());
        send_fds(&sock, &header, &[fd.as_fd()]).unwrap();
        // The child holds its own descriptor of the pool now.
        drop(fd);
        expect(&mut sock, b"R");
        {
            // The event completes only when the child's recording does: no deadline of its own.
            let _dog = Watchdog::arm("waiting on the child's interprocess event");
            event.synchronize().unwrap();
        }
        let seen = buf.to_vec().unwrap();
        let expected: Vec<u32> = (0..LEN).map(child_pattern).collect();
        assert!(seen == expected, "the parent does not see the child's bytes after the event");
        // Every importer frees before the exporter frees.
        expect(&mut sock, b"F");
        drop(buf);
        child.finish();
        if let Some(ctl) = testing::sim_control() {
            let early: Vec<_> = ctl
                .violations()
                .into_iter()
                .filter(|v| v.message.contains("freed by its exporter"))
                .collect();
            assert!(early.is_empty(), "the parent freed the buffer while the child held it: {early:#?}");
        }
    }
    assert_clean_report();
}

/// Exporting a buffer of another resource, or of another shareable pool, is refused; a device
/// without POSIX-FD pool handles has no shareable pool.
fn misuse_on_the_exporting_side(pool: &ShareablePool, ctx: &cumem_core::Context, stream: &Stream) {
    if testing::sim_control().is_some() {
        let without = Device::get(1).unwrap().context().unwrap();
        let refused = ShareablePool::new(&without);
        assert!(
            matches!(
                refused,
                Err(Error::NotSupported { feature: Feature::ShareableHandle(_), device: Some(1) })
            ),
            "{refused:?}"
        );
    }
    let driver = Arc::new(DriverResource::new(ctx));
    let plain = DeviceBuffer::<u32>::zeroed_in(&driver, stream, 16).unwrap();
    assert!(matches!(pool.export_pointer(&plain), Err(Error::InvalidValue { .. })));
    let other = Arc::new(ShareablePool::new(ctx).unwrap());
    let theirs = DeviceBuffer::<u32>::zeroed_in(&other, stream, 16).unwrap();
    assert!(matches!(pool.export_pointer(&theirs), Err(Error::InvalidValue { .. })));
    assert!(other.export_pointer(&theirs).is_ok());
}

/// The child's half; a no-op unless the parent started this process.
#[test]
#[serial]
fn child_side() {
    let Some(mut sock) = connect_to_parent(CHILD_ENV) else {
        return;
    };
    testing::init_with(SIM_CONFIG);
    let mut header = [0u8; HEADER];
    let (n, fds) = recv_fds(&sock, &mut header, 1).unwrap();
    // A stream socket may split the header; the descriptor came with its first byte.
    sock.read_exact(&mut header[n..]).unwrap();
    let pool_fd = fds.into_iter().next().expect("the pool's descriptor");
    let (export_bytes, event_bytes) = header.split_at(PoolPointerExport::ENCODED_LEN);
    {
        let device = Device::get(0).unwrap();
        let ctx = device.context().unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let pool = ImportedPool::from_fd(&device, &pool_fd).unwrap();
        drop(pool_fd);
        let export = PoolPointerExport::from_bytes(export_bytes).unwrap();
        misuse_on_the_importing_side(&device, &pool, export_bytes, event_bytes, &stream);
        // SAFETY: the parent keeps the buffer until this process says it freed the import, and
        // touches it again only after waiting on the event recorded after this process's write.
        let mut import = unsafe { pool.import_pointer::<u32>(&export, &stream) }.unwrap();
        assert_eq!(import.len(), LEN);
        // SAFETY: the parent drops its event only after this process has exited (`child.finish`),
        // so after this import and its work; the bytes are its `IpcEvent::handle`, unaltered.
        let event = unsafe { IpcEventHandle::from_bytes(event_bytes).unwrap().open(&ctx) }.unwrap();
        let got = import.as_slice().to_vec().unwrap();
        let expected: Vec<u32> = (0..LEN).map(parent_pattern).collect();
        assert!(got == expected, "the child does not read the parent's bytes");
        if let Some(ctl) = testing::sim_control() {
            let report = ctl.live_report();
            assert!(report.pools.iter().any(|p| p.imported), "the imported pool is listed:\n{report}");
            assert!(report.allocations.iter().any(|a| a.kind == "pool_import"), "{report}");
        }
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
        // Dropping the import waits for the write, then frees the import; the pool goes after.
        drop(import);
        drop(pool);
        drop(event);
        drop(host);
        opener.join().unwrap();
        if let Some(ctl) = testing::sim_control() {
            let report = ctl.live_report();
            assert!(report.allocations.is_empty() && report.user_pools().next().is_none(), "{report}");
        }
        sock.write_all(b"F").unwrap();
    }
    assert_clean_report();
}

/// Bytes of the wrong kind, a descriptor that is not a pool, forged offsets and sizes: typed
/// errors, and no import left behind.
fn misuse_on_the_importing_side(
    device: &Device,
    pool: &ImportedPool,
    export_bytes: &[u8],
    event_bytes: &[u8],
    stream: &Stream,
) {
    assert!(matches!(PoolPointerExport::from_bytes(event_bytes), Err(Error::LengthMismatch { .. })));
    assert!(matches!(IpcMemHandle::from_bytes(export_bytes), Err(Error::LengthMismatch { .. })));
    let mut untagged = export_bytes.to_vec();
    untagged[0] ^= 0x20;
    assert!(matches!(PoolPointerExport::from_bytes(&untagged), Err(Error::InvalidValue { .. })));
    // A regular file that is not a pool: an H100 answered CUDA_ERROR_UNKNOWN (2026-11-24,
    // docs/observed-on-gpu.md), and so does the simulator; from_fd passes it on.
    let not_a_pool = anonymous_file("not a pool").unwrap();
    let refused = ImportedPool::from_fd(device, &not_a_pool);
    assert!(
        matches!(refused, Err(Error::Cuda { code: sys::CUresult::CUDA_ERROR_UNKNOWN, .. })),
        "{refused:?}"
    );
    let forged = |offset: u64, bytes: u64| {
        let mut b = export_bytes.to_vec();
        let at = PoolPointerExport::ENCODED_LEN - 16;
        b[at..at + 8].copy_from_slice(&offset.to_le_bytes());
        b[at + 8..].copy_from_slice(&bytes.to_le_bytes());
        PoolPointerExport::from_bytes(&b).unwrap()
    };
    // SAFETY: no forged import succeeds, so nothing is accessed; the parent keeps the buffer.
    let overflowing = unsafe { pool.import_pointer::<u32>(&forged(u64::MAX - 3, 4), stream) };
    assert!(matches!(overflowing, Err(Error::InvalidValue { .. })), "{overflowing:?}");
    // SAFETY: as above.
    let misaligned = unsafe { pool.import_pointer::<u32>(&forged(2, 4), stream) };
    assert!(matches!(misaligned, Err(Error::Misaligned { .. })), "{misaligned:?}");
    // SAFETY: as above.
    let outside = unsafe { pool.import_pointer::<u32>(&forged(4, (LEN * 4) as u64), stream) };
    assert!(matches!(outside, Err(Error::InvalidValue { .. })), "{outside:?}");
    if let Some(ctl) = testing::sim_control() {
        let report = ctl.live_report();
        assert!(report.allocations.iter().all(|a| a.kind != "pool_import"), "an import was left:\n{report}");
    }
}
