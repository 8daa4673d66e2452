//! Legacy IPC through the raw C API, across two processes (this binary re-executed, running only
//! `importer`): the importer reads the exporter's bytes and the exporter reads the importer's
//! write; an import survives the exporter's free with its bytes; opening twice counts twice;
//! each misuse gives the H100's code (§17 of the driver reference: opening in the exporting
//! process → INVALID_CONTEXT) or `INVALID_VALUE`; both live reports end clean.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;

use common::*;
use cudarc::driver::sys::{self as cu, CUdeviceptr, CUevent, CUipcEventHandle, CUipcMemHandle, CUresult};
use serial_test::serial;

const CHILD_ENV: &str = "CUMEM_SIM_IPC_CHILD";
const BYTES: usize = 1 << 20;

fn pattern() -> Vec<u8> {
    (0..BYTES).map(|i| (i * 7 + i / 251) as u8).collect()
}

fn write(p: CUdeviceptr, data: &[u8]) {
    // SAFETY: `data` is readable for its length; the simulator checks `p`.
    ok(unsafe { cu::cuMemcpyHtoD_v2(p, data.as_ptr().cast(), data.len()) });
}

fn try_open(h: &CUipcMemHandle, flags: u32) -> (CUresult, CUdeviceptr) {
    let mut p = 0;
    // SAFETY: valid out-pointer; the handle is passed by value.
    let r = unsafe { cu::cuIpcOpenMemHandle_v2(&mut p, CUipcMemHandle { reserved: h.reserved }, flags) };
    (r, p)
}

fn close(p: CUdeviceptr) -> CUresult {
    // SAFETY: plain FFI call.
    unsafe { cu::cuIpcCloseMemHandle(p) }
}

fn note(sock: &mut UnixStream, what: &[u8; 1]) {
    sock.write_all(what).unwrap();
}

fn expect(sock: &mut UnixStream, what: &[u8; 1]) {
    let mut got = [0u8; 1];
    sock.read_exact(&mut got).unwrap();
    assert_eq!(&got, what, "the other process failed");
}

fn bytes_of(reserved: &[std::ffi::c_char; 64]) -> [u8; 64] {
    reserved.map(|c| c as u8)
}

#[test]
#[serial]
fn exporter() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let ctl = bind(0);
    // The process id and the time: runs in other containers sharing /tmp have their own ids.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let path = std::env::temp_dir().join(format!("cumem-sim-ipc-{}-{nanos}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["importer", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, &path)
        .spawn()
        .unwrap();

    let a = dalloc(BYTES);
    write(a, &pattern());
    let mut h = CUipcMemHandle { reserved: [0; 64] };
    // An interior pointer names its allocation (§17).
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuIpcGetMemHandle(&mut h, a + 4096) });
    assert_eq!(read_back(a, BYTES), pattern(), "the first export moved the bytes");
    assert_eq!(try_open(&h, 1).0, CUresult::CUDA_ERROR_INVALID_CONTEXT);
    // Pool memory is not legacy-IPC capable.
    let mut pool_ptr = 0;
    // SAFETY: valid out-pointer; legacy stream.
    ok(unsafe { cu::cuMemAllocAsync(&mut pool_ptr, 4096, std::ptr::null_mut()) });
    let mut h2 = CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { cu::cuIpcGetMemHandle(&mut h2, pool_ptr) }, CUresult::CUDA_ERROR_INVALID_VALUE);
    // SAFETY: plain FFI calls.
    ok(unsafe { cu::cuMemFreeAsync(pool_ptr, std::ptr::null_mut()) });
    // Only INTERPROCESS events export.
    let mut plain: CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuEventCreate(&mut plain, 2) });
    let mut eh = CUipcEventHandle { reserved: [0; 64] };
    // SAFETY: valid out-pointer and live event.
    assert_eq!(unsafe { cu::cuIpcGetEventHandle(&mut eh, plain) }, CUresult::CUDA_ERROR_INVALID_VALUE);
    // SAFETY: live event, destroyed once.
    ok(unsafe { cu::cuEventDestroy_v2(plain) });

    let (mut sock, _) = listener.accept().unwrap();
    sock.write_all(&bytes_of(&h.reserved)).unwrap();
    expect(&mut sock, b"W");
    assert_eq!(read_back(a, BYTES), vec![0xAB; BYTES], "the exporter does not see the importer's write");
    dfree(a);
    note(&mut sock, b"F");
    expect(&mut sock, b"D");
    let status = child.wait().unwrap();
    assert!(status.success(), "importer failed: {status}");
    let _ = std::fs::remove_file(&path);
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuCtxSynchronize() });
    assert!(ctl.live_report().allocations.is_empty(), "{}", ctl.live_report());
}

#[test]
#[serial]
fn importer() {
    let Some(path) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let ctl = bind(0);
    let mut sock = UnixStream::connect(path).unwrap();
    let mut raw = [0u8; 64];
    sock.read_exact(&mut raw).unwrap();
    let h = CUipcMemHandle { reserved: raw.map(|b| b as std::ffi::c_char) };

    assert_eq!(try_open(&h, 2).0, CUresult::CUDA_ERROR_INVALID_VALUE, "undefined flags");
    let mut garbage = h;
    garbage.reserved[0] ^= 1;
    assert_eq!(try_open(&garbage, 1).0, CUresult::CUDA_ERROR_INVALID_VALUE, "bytes no simulator wrote");
    // The size is bytes the sender could forge: mapping more than the exported file holds would
    // fault on the first copy past its end.
    let mut oversized = h;
    let claimed = (BYTES as u64 + (1 << 20)).to_le_bytes().map(|b| b as std::ffi::c_char);
    oversized.reserved[32..40].copy_from_slice(&claimed);
    assert_eq!(
        try_open(&oversized, 1).0,
        CUresult::CUDA_ERROR_INVALID_VALUE,
        "a size the file does not hold"
    );
    let (r, p) = try_open(&h, 1);
    ok(r);
    let (r, again) = try_open(&h, 1);
    ok(r);
    assert_eq!(again, p, "a second open in the same context returns the same address");
    // One context per device per process (§12): another context of device 0 may not open it
    // (the code is not on record: ALREADY_MAPPED is the simulator's guess), one of device 1 may.
    let mut other: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the new context becomes current.
    ok(unsafe { cu::cuCtxCreate_v2(&mut other, 0, 0) });
    assert_eq!(try_open(&h, 1).0, CUresult::CUDA_ERROR_ALREADY_MAPPED, "a second context of device 0");
    // SAFETY: the context created above, destroyed once (it held nothing).
    ok(unsafe { cu::cuCtxDestroy_v2(other) });
    bind(1);
    let (r, on_1) = try_open(&h, 1);
    ok(r);
    assert_ne!(on_1, p);
    assert_eq!(read_back(on_1, 16), pattern()[..16].to_vec(), "device 1's import reads the bytes");
    ok(close(on_1));
    bind(0);
    let report = ctl.live_report();
    let imports: Vec<_> = report.allocations.iter().filter(|a| a.kind == "ipc_import").collect();
    assert_eq!(imports.len(), 1, "{report}");
    assert_eq!((imports[0].ptr, imports[0].bytes), (p, BYTES as u64));
    let id = imports[0].id;
    assert!(id != 0 && report.allocations.iter().filter(|a| a.id == id).count() == 1, "{report}");
    assert_eq!(read_back(p, BYTES), pattern(), "the importer does not read the exporter's bytes");
    // SAFETY: plain FFI call on the imported range.
    ok(unsafe { cu::cuMemsetD8_v2(p, 0xAB, BYTES) });
    // A device memset returns before it runs (§6): the exporter may only look once it is done.
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuCtxSynchronize() });
    note(&mut sock, b"W");
    expect(&mut sock, b"F");
    // The exporter freed its allocation; the import keeps the memory until it is closed.
    assert_eq!(read_back(p, BYTES), vec![0xAB; BYTES]);
    ok(close(p));
    let live = ctl.live_report();
    assert!(live.contains_allocation(id), "one open is left:\n{live}");
    ok(close(p));
    assert_eq!(close(p), CUresult::CUDA_ERROR_INVALID_VALUE, "closing more often than opening");
    let live = ctl.live_report();
    assert!(!live.contains_allocation(id), "closed as often as opened:\n{live}");
    assert_eq!(try_open(&h, 1).0, CUresult::CUDA_ERROR_INVALID_VALUE, "the exported memory is gone");
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuCtxSynchronize() });
    assert!(ctl.live_report().allocations.is_empty(), "{}", ctl.live_report());
    note(&mut sock, b"D");
}
