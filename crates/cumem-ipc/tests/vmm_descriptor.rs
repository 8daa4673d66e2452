//! A VMM allocation crosses processes as a POSIX descriptor sent with `fd_passing`
//! (`SCM_RIGHTS`): the parent creates shareable physical memory, maps and fills it, exports the
//! descriptor and sends it with the memory's size to a child (this binary again, running only
//! `child_side`) together with an interprocess event; the child imports and maps it, checks the
//! bytes, queues a write of new ones behind a gate, records the event after it and says so; the
//! parent waits on the event and must then see the child's bytes (the gate opens a while later, so
//! a parent that did not wait would read the old ones). Everything goes through cumem-vmm's types (`PhysicalMemory::export_fd` /
//! `import_fd`). Both processes end with a clean live report (and the leak check at exit).
//!
//! Neither side can hang the suite (`cumem_sys::testing::child_process` puts a deadline on every
//! step).

use std::io::Read;
use std::os::fd::AsFd;
use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::{Context, Device, PinnedBuffer, Stream};
use cumem_ipc::fd_passing::{recv_fds, send_fds};
use cumem_ipc::{IpcEvent, IpcEventHandle};
use cumem_sys::testing;
use cumem_sys::testing::child_process::{ChildTest, Watchdog, connect_to_parent, expect};
use cumem_vmm::{Access, Granularity, HandleTypes, PhysicalMemory, VirtualRange};
use serial_test::serial;

const CHILD_ENV: &str = "CUMEM_IPC_VMM_CHILD";
/// The message that carries the descriptor: this tag, the memory's size (u64, little endian), then
/// the interprocess event's handle.
const TAG: &[u8; 4] = b"vmm:";
const HEADER: usize = TAG.len() + 8 + IpcEventHandle::ENCODED_LEN;

fn parent_bytes(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

fn assert_clean() {
    if let Some(ctl) = testing::sim_control() {
        let report = ctl.live_report();
        assert!(report.is_clean(), "live report not clean:\n{report}");
    }
}

/// Device 0's context if it can export VMM memory as POSIX descriptors; otherwise says so.
fn shareable_context() -> Option<Context> {
    use cumem_core::sys::CUdevice_attribute as A;
    let device = Device::get(0).unwrap();
    let posix = device.attribute(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED).unwrap();
    if !device.capabilities().unwrap().virtual_memory || posix == 0 {
        testing::skip("device 0 cannot export VMM memory as POSIX file descriptors");
        return None;
    }
    Some(device.context().unwrap())
}

#[test]
#[serial]
fn a_vmm_descriptor_sent_over_a_socket_maps_the_same_memory_in_a_child() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    testing::init();
    let Some(ctx) = shareable_context() else { return };
    let (child, sock) = ChildTest::spawn("child_side", CHILD_ENV);
    {
        let g = Granularity::with_handle_types(ctx.device(), HandleTypes::POSIX_FD).unwrap().minimum;
        let memory = PhysicalMemory::with_handle_types(&ctx, g, HandleTypes::POSIX_FD).unwrap();
        let range = VirtualRange::reserve(&ctx, g).unwrap();
        let mut mapping = range.map(0, &memory).unwrap();
        mapping.set_access(&[(ctx.device(), Access::ReadWrite)]).unwrap();
        cumem_copy::copy_h2d(&parent_bytes(g), &mut mapping.as_mut_slice::<u8>().unwrap()).unwrap();
        // A copy returns before its work lands (§6): finish it before the child looks.
        mapping.order().synchronize().unwrap();

        let fd = memory.export_fd().unwrap();
        let event = IpcEvent::new(&ctx).unwrap();
        let mut header = TAG.to_vec();
        header.extend_from_slice(&(memory.bytes() as u64).to_le_bytes());
        header.extend_from_slice(&event.handle().unwrap().to_bytes());
        send_fds(&sock, &header, &[fd.as_fd()]).unwrap();
        drop(fd); // the child holds its own copy, and its import its own reference
        expect(&mut &sock, b"R");
        // The child's write is still held behind its gate: only the event orders it before the read.
        {
            // The event completes only when the child's recording does: no deadline of its own.
            let _dog = Watchdog::arm("waiting on the child's interprocess event");
            event.synchronize().unwrap();
        }
        let seen = mapping.as_slice::<u8>().unwrap().to_vec().unwrap();
        assert!(seen.iter().all(|&b| b == 0x3C), "the parent does not see the child's write");
        child.finish();
    }
    drop(ctx);
    assert_clean();
}

/// The child's half; a no-op unless the parent started this process.
#[test]
#[serial]
fn child_side() {
    let Some(sock) = connect_to_parent(CHILD_ENV) else {
        return;
    };
    testing::init();
    let mut header = [0u8; HEADER];
    let (n, fds) = recv_fds(&sock, &mut header, 1).unwrap();
    // A stream socket may split the header; the descriptor came with its first byte.
    (&sock).read_exact(&mut header[n..]).unwrap();
    assert_eq!((&header[..TAG.len()], fds.len()), (&TAG[..], 1));
    let bytes = u64::from_le_bytes(header[TAG.len()..TAG.len() + 8].try_into().unwrap()) as usize;
    let event_bytes: [u8; IpcEventHandle::ENCODED_LEN] = header[TAG.len() + 8..].try_into().unwrap();
    let ctx = Device::get(0).unwrap().context().unwrap();
    {
        // SAFETY: the two processes take turns: the parent finished its write before sending the
        // descriptor and reads again only after waiting on the event this side records after its
        // write.
        let memory = unsafe { PhysicalMemory::import_fd(&ctx, &fds[0], bytes) }.unwrap();
        drop(fds);
        assert!(memory.is_imported());
        let range = VirtualRange::reserve(&ctx, bytes).unwrap();
        let mut mapping = range.map(0, &memory).unwrap();
        mapping.set_access(&[(ctx.device(), Access::ReadWrite)]).unwrap();
        let seen = mapping.as_slice::<u8>().unwrap().to_vec().unwrap();
        assert!(seen == parent_bytes(bytes), "the child does not read the parent's bytes");
        let stream = Stream::new(&ctx).unwrap();
        // SAFETY: the parent drops its event only after this process has exited (`child.finish`),
        // so after this import and its work; the bytes are its `IpcEvent::handle`, unaltered.
        let event = unsafe { IpcEventHandle::from_bytes(&event_bytes).unwrap().open(&ctx) }.unwrap();
        let mut host = PinnedBuffer::<u8>::zeroed(&ctx, bytes).unwrap();
        host.as_mut_slice().unwrap().fill(0x3C);
        ctx.bind().unwrap();
        // SAFETY: `stream` is alive (owned here), and its context was just made current.
        let gate = unsafe { testing::hold(stream.raw()) };
        stream.copy_h2d(&host, &mut mapping.as_mut_slice::<u8>().unwrap()).unwrap();
        event.record(&stream).unwrap();
        // Said while the write is still held: the parent must wait on the event, not on this word.
        std::io::Write::write_all(&mut &sock, b"R").unwrap();
        let opener = gate.release_after(Duration::from_millis(200));
        stream.synchronize().unwrap();
        opener.join().unwrap();
        drop(event);
        drop(host);
    }
    drop(ctx);
    assert_clean();
}
