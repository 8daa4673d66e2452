//! A VMM allocation's POSIX descriptor crosses processes with `fd_passing` (`SCM_RIGHTS`): the
//! parent creates physical memory with POSIX_FD, maps and fills it, exports the descriptor and
//! sends it to a child (this binary again, running only `child_side`); the child imports and maps
//! it, checks the bytes and writes new ones; the parent sees them. The VMM calls are raw here (the
//! typed wrappers belong to cumem-vmm); what is under test is the descriptor's trip. Both
//! processes end with a clean live report (and the leak check at exit).

use std::ffi::c_void;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;

use cumem_core::Device;
use cumem_ipc::fd_passing::{recv_fds, send_fds};
use cumem_sys::sys::{self as cu, CUdeviceptr, CUresult};
use cumem_sys::testing;
use serial_test::serial;

const CHILD_ENV: &str = "CUMEM_IPC_VMM_CHILD";
const G: usize = 2 << 20;

fn ok(r: CUresult) {
    assert_eq!(r, CUresult::CUDA_SUCCESS);
}

fn prop() -> cu::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is a valid value (every enum has a 0 variant).
    let mut p: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 };
    p.requestedHandleTypes = cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p
}

/// Reserves, maps and opens `h` read-write on device 0.
fn map_rw(h: u64) -> CUdeviceptr {
    let mut va = 0;
    let desc = cu::CUmemAccessDesc {
        location: cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 },
        flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: valid out-pointer and descriptor; the calls act on the reservation just made.
    unsafe {
        ok(cu::cuMemAddressReserve(&mut va, G, 0, 0, 0));
        ok(cu::cuMemMap(va, G, 0, h, 0));
        ok(cu::cuMemSetAccess(va, G, &desc, 1));
    }
    va
}

fn unmap_release(va: CUdeviceptr, h: u64) {
    // SAFETY: a mapping made by `map_rw` and its handle, each released once.
    unsafe {
        ok(cu::cuMemUnmap(va, G));
        ok(cu::cuMemAddressFree(va, G));
        ok(cu::cuMemRelease(h));
    }
}

fn write(va: CUdeviceptr, data: &[u8]) {
    // SAFETY: `data` is readable for its length; the mapping is read-write.
    ok(unsafe { cu::cuMemcpyHtoD_v2(va, data.as_ptr().cast(), data.len()) });
}

fn read(va: CUdeviceptr) -> Vec<u8> {
    let mut v = vec![0u8; G];
    // SAFETY: `v` is writable for G bytes.
    ok(unsafe { cu::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), va, G) });
    v
}

fn assert_clean() {
    if let Some(ctl) = testing::sim_control() {
        let report = ctl.live_report();
        assert!(report.is_clean(), "live report not clean:\n{report}");
    }
}

#[test]
#[serial]
fn a_vmm_descriptor_sent_over_a_socket_maps_the_same_memory_in_a_child() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    testing::init();
    // The process id and the time: runs in other containers sharing /tmp have their own ids.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let path = std::env::temp_dir().join(format!("cumem-ipc-vmm-{}-{nanos}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["child_side", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, &path)
        .spawn()
        .unwrap();
    let ctx = Device::get(0).unwrap().context().unwrap();
    ctx.bind().unwrap();
    let mut h = 0;
    // SAFETY: valid pointers.
    ok(unsafe { cu::cuMemCreate(&mut h, G, &prop(), 0) });
    let va = map_rw(h);
    write(va, &(0..G).map(|i| (i % 251) as u8).collect::<Vec<_>>());
    // A pageable copy may return before its DMA lands (§6): the child reads as soon as it has the
    // descriptor.
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuCtxSynchronize() });
    let mut fd: i32 = -1;
    // SAFETY: POSIX_FD writes an int into `fd`.
    ok(unsafe {
        cu::cuMemExportToShareableHandle(
            (&raw mut fd).cast(),
            h,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    });
    // SAFETY: the export returned a descriptor that this process owns until the close below.
    let exported = unsafe { BorrowedFd::borrow_raw(fd) };
    let (sock, _) = listener.accept().unwrap();
    send_fds(&sock, b"vmm", &[exported.as_fd()]).unwrap();
    let mut note = [0u8; 1];
    (&sock).read_exact(&mut note).unwrap();
    assert_eq!(&note, b"W", "the child failed");
    assert_eq!(read(va), vec![0x3C; G], "the parent does not see the child's write");
    let status = child.wait().unwrap();
    assert!(status.success(), "child failed: {status}");
    unmap_release(va, h);
    // SAFETY: `fd` is ours and closed once.
    unsafe { libc::close(fd) };
    let _ = std::fs::remove_file(&path);
    drop(ctx);
    assert_clean();
}

/// The child's half; a no-op unless the parent started this process.
#[test]
#[serial]
fn child_side() {
    let Some(path) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    testing::init();
    let sock = UnixStream::connect(path).unwrap();
    let mut buf = [0u8; 8];
    let (n, fds) = recv_fds(&sock, &mut buf, 1).unwrap();
    assert_eq!((&buf[..n], fds.len()), (&b"vmm"[..], 1));
    let ctx = Device::get(0).unwrap().context().unwrap();
    ctx.bind().unwrap();
    let mut h = 0;
    // SAFETY: valid out-pointer; POSIX_FD takes the descriptor by value.
    ok(unsafe {
        cu::cuMemImportFromShareableHandle(
            &mut h,
            fds[0].as_raw_fd() as isize as *mut c_void,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    });
    drop(fds);
    let va = map_rw(h);
    assert_eq!(
        read(va),
        (0..G).map(|i| (i % 251) as u8).collect::<Vec<_>>(),
        "the child does not read the parent's bytes"
    );
    write(va, &vec![0x3C; G]);
    // A pageable copy may return before its DMA lands (§6): finish it before the parent looks.
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuCtxSynchronize() });
    unmap_release(va, h);
    std::io::Write::write_all(&mut &sock, b"W").unwrap();
    drop(ctx);
    assert_clean();
}
