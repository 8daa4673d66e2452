//! The driver documents `cuIpcGetMemHandle` of an allocation's base; an H100 also took an interior
//! pointer (driver-api.md §17), but which address an open of such a handle returns is not on
//! record. So `IpcMemHandle::export` asks for the handle of the base (with the buffer's offset
//! beside it), and `IpcMemHandle::open` requires the address the driver returned to be the start
//! of the mapping the driver reports for it, and the view to lie inside that mapping. The
//! simulator takes interior pointers and always opens at the base, so neither is visible there:
//! this is shown with a stand-in driver, chosen as the real driver in a child process (the driver
//! is chosen once per process, and the library path is read at process start). Its one
//! allocation is at an address aligned to 256 bytes only, so a buffer aligned to 4096 lies inside
//! it, and its export must name the base. Its `cuIpcOpenMemHandle_v2` first returns an address
//! 4 KiB into the 8 KiB mapping, which is refused; then the mapping's start, where a view that
//! fits opens and one that reaches past the end is refused. Each refused open is closed again at
//! once, without a stream synchronisation (the stand-in counts both).

use std::sync::Arc;

use cumem_core::{Device, DeviceBuffer, DriverResource, Error, Stream};
use cumem_ipc::IpcMemHandle;
use cumem_sys::driver::{self, DriverChoice};
use cumem_sys::testing;
use cumem_sys::testing::stand_in;

/// Set in the child process.
const CHILD_ENV: &str = "CUMEM_IPC_TEST_OPEN_IN_THE_MAPPING";

/// Where the stand-in's one mapping (8 KiB) starts.
const MAPPING: u64 = 0x7000_0100;

/// The stand-in: one device with a primary context, streams that are always idle, one allocation
/// at `MAPPING` (every `cuMemAlloc` returns it), and one IPC mapping of the same range whose open
/// returns an address 4 KiB into it until `standin_open_at_the_base` makes it return `MAPPING`. `standin_opens`
/// answers how many opens are not closed, `standin_exported` the address the last
/// `cuIpcGetMemHandle` was given, `standin_syncs` how many stream synchronisations were asked.
const STAND_IN: &str = r#"
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static OPEN: AtomicI64 = AtomicI64::new(0);
static EXPORTED: AtomicU64 = AtomicU64::new(0);
static SYNCS: AtomicU64 = AtomicU64::new(0);
const MAPPING: u64 = 0x7000_0100;
const MAPPING_SIZE: usize = 8192;
static OPEN_AT: AtomicU64 = AtomicU64::new(MAPPING + 4096);
#[repr(C)]
pub struct IpcMemHandle { reserved: [i8; 64] }
#[no_mangle]
pub extern "C" fn cuInit(_flags: u32) -> i32 { 0 }
#[no_mangle]
pub extern "C" fn cuDriverGetVersion(v: *mut i32) -> i32 { unsafe { *v = 12080 }; 0 }
#[no_mangle]
pub extern "C" fn cuDeviceGetCount(n: *mut i32) -> i32 { unsafe { *n = 1 }; 0 }
#[no_mangle]
pub extern "C" fn cuDeviceGet(d: *mut i32, ordinal: i32) -> i32 {
    if ordinal != 0 { return 101; }
    unsafe { *d = 0 };
    0
}
#[no_mangle]
pub extern "C" fn cuDeviceGetAttribute(v: *mut i32, _attr: i32, _dev: i32) -> i32 { unsafe { *v = 1 }; 0 }
#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRetain(c: *mut usize, _dev: i32) -> i32 { unsafe { *c = 0x1000 }; 0 }
#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(_dev: i32) -> i32 { 0 }
#[no_mangle]
pub extern "C" fn cuCtxGetCurrent(c: *mut usize) -> i32 { unsafe { *c = CURRENT.load(Ordering::SeqCst) }; 0 }
#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(c: usize) -> i32 { CURRENT.store(c, Ordering::SeqCst); 0 }
#[no_mangle]
pub extern "C" fn cuCtxGetDevice(d: *mut i32) -> i32 { unsafe { *d = 0 }; 0 }
#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> i32 { 0 }
#[no_mangle]
pub extern "C" fn cuCtxGetStreamPriorityRange(least: *mut i32, greatest: *mut i32) -> i32 {
    unsafe { *least = 0; *greatest = 0 };
    0
}
#[no_mangle]
pub extern "C" fn cuStreamCreate(s: *mut usize, _flags: u32) -> i32 { unsafe { *s = 0x2000 }; 0 }
#[no_mangle]
pub extern "C" fn cuStreamCreateWithPriority(s: *mut usize, _flags: u32, _priority: i32) -> i32 {
    unsafe { *s = 0x2000 };
    0
}
#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(_s: usize) -> i32 { 0 }
#[no_mangle]
pub extern "C" fn cuStreamSynchronize(_s: usize) -> i32 { SYNCS.fetch_add(1, Ordering::SeqCst); 0 }
#[no_mangle]
pub extern "C" fn cuStreamQuery(_s: usize) -> i32 { 0 }
#[no_mangle]
pub extern "C" fn cuIpcOpenMemHandle_v2(p: *mut u64, _h: IpcMemHandle, _flags: u32) -> i32 {
    OPEN.fetch_add(1, Ordering::SeqCst);
    unsafe { *p = OPEN_AT.load(Ordering::SeqCst) };
    0
}
#[no_mangle]
pub extern "C" fn cuIpcCloseMemHandle(p: u64) -> i32 {
    if p != OPEN_AT.load(Ordering::SeqCst) { return 1; }
    OPEN.fetch_sub(1, Ordering::SeqCst);
    0
}
#[no_mangle]
pub extern "C" fn cuMemGetAddressRange_v2(base: *mut u64, size: *mut usize, p: u64) -> i32 {
    if p < MAPPING || p >= MAPPING + MAPPING_SIZE as u64 { return 1; }
    unsafe { *base = MAPPING; *size = MAPPING_SIZE };
    0
}
#[no_mangle]
pub extern "C" fn cuMemAlloc_v2(p: *mut u64, bytes: usize) -> i32 {
    if bytes > MAPPING_SIZE { return 2; }
    unsafe { *p = MAPPING };
    0
}
#[no_mangle]
pub extern "C" fn cuMemFree_v2(_p: u64) -> i32 { 0 }
#[no_mangle]
pub extern "C" fn cuMemsetD8Async(_p: u64, _value: u8, _n: usize, _s: usize) -> i32 { 0 }
#[no_mangle]
pub extern "C" fn cuIpcGetMemHandle(h: *mut IpcMemHandle, p: u64) -> i32 {
    EXPORTED.store(p, Ordering::SeqCst);
    unsafe { (*h).reserved = [0; 64] };
    0
}
#[no_mangle]
pub extern "C" fn standin_opens() -> i64 { OPEN.load(Ordering::SeqCst) }
#[no_mangle]
pub extern "C" fn standin_exported() -> u64 { EXPORTED.load(Ordering::SeqCst) }
#[no_mangle]
pub extern "C" fn standin_syncs() -> u64 { SYNCS.load(Ordering::SeqCst) }
#[no_mangle]
pub extern "C" fn standin_open_at_the_base() -> u64 { OPEN_AT.store(MAPPING, Ordering::SeqCst); 0 }
"#;

#[test]
fn an_open_inside_the_mapping_or_a_view_past_its_end_is_refused_and_closed_at_once() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    stand_in::run_child_with_driver("ipc-open-in-the-mapping", STAND_IN, "child", CHILD_ENV);
    testing::init();
}

/// A handle of the stand-in's mapping (its driver bytes are not read) for `bytes` at `offset`.
fn handle(offset: u64, bytes: u64) -> IpcMemHandle {
    let mut encoded = [0u8; IpcMemHandle::ENCODED_LEN];
    let at = IpcMemHandle::ENCODED_LEN - 16;
    encoded[at..at + 8].copy_from_slice(&offset.to_le_bytes());
    encoded[at + 8..].copy_from_slice(&bytes.to_le_bytes());
    IpcMemHandle::from_bytes(&encoded).unwrap()
}

/// Asks the loaded stand-in's `name`.
fn ask_stand_in(name: &std::ffi::CStr) -> u64 {
    // SAFETY: the name is NUL-terminated; RTLD_NOLOAD only looks the loaded library up.
    let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    assert!(!lib.is_null(), "the stand-in is not loaded");
    // SAFETY: `lib` is a live handle and the name NUL-terminated.
    let sym = unsafe { libc::dlsym(lib, name.as_ptr()) };
    assert!(!sym.is_null(), "the loaded driver is not the stand-in");
    // SAFETY: the stand-in defines its answers with this signature (an `i64` count is read as its
    // bits).
    let answer: extern "C" fn() -> u64 = unsafe { std::mem::transmute(sym) };
    let n = answer();
    // SAFETY: `lib` came from the dlopen above; the library stays loaded (the driver holds it).
    unsafe { libc::dlclose(lib) };
    n
}

#[test]
fn child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    driver::select(DriverChoice::Real).expect("the stand-in initialises");
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let opens = || ask_stand_in(c"standin_opens") as i64;

    // A buffer aligned beyond the allocation's base lies inside it: its export names the base.
    let driver = Arc::new(DriverResource::new(&ctx));
    let buf = DeviceBuffer::<u8>::zeroed_aligned_in(&driver, &stream, 256, 4096).unwrap();
    assert_ne!(buf.device_ptr(), MAPPING, "the buffer does not lie inside its allocation");
    let exported = IpcMemHandle::export(&buf).unwrap();
    assert_eq!(ask_stand_in(c"standin_exported"), MAPPING, "the export did not name the base");
    let offset = &exported.to_bytes()[IpcMemHandle::ENCODED_LEN - 16..IpcMemHandle::ENCODED_LEN - 8];
    assert_eq!(u64::from_le_bytes(offset.try_into().unwrap()), buf.device_ptr() - MAPPING);
    drop(buf);

    let syncs = || ask_stand_in(c"standin_syncs");

    // The driver opens the allocation 4 KiB into its mapping: not the base the handle names.
    let before = syncs();
    // SAFETY: the stand-in's memory is never touched (no copy is made), and nothing else opens it.
    let inside = unsafe { handle(0, 4096).open::<u32>(&stream) };
    assert!(matches!(inside, Err(Error::InvalidValue { .. })), "{inside:?}");
    assert_eq!(opens(), 0, "the refused import was not closed");
    assert_eq!(syncs(), before, "a refused open waited for the caller's stream");

    // At the base: a view that fits lies at the base plus its offset.
    ask_stand_in(c"standin_open_at_the_base");
    // SAFETY: as above.
    let import = unsafe { handle(4096, 4096).open::<u32>(&stream) }.unwrap();
    assert_eq!(import.device_ptr(), MAPPING + 4096);
    assert_eq!(opens(), 1);
    drop(import);
    assert_eq!(opens(), 0, "the import was not closed");

    // One that reaches past the mapping's end is refused, and closed at once.
    let before = syncs();
    // SAFETY: as above; the open is refused, so nothing is accessed.
    let past = unsafe { handle(4096, 8192).open::<u32>(&stream) };
    assert!(matches!(past, Err(Error::InvalidValue { .. })), "{past:?}");
    assert_eq!(opens(), 0, "the refused import was not closed");
    assert_eq!(syncs(), before, "a refused open waited for the caller's stream");
}
