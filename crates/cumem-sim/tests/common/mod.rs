//! Shared setup for the simulator's integration tests: load the simulator by path before any
//! cudarc call, configure it, `cuInit`, retain primary contexts; plus small helpers.
#![allow(dead_code)]

/// The two-process harness of `cumem_sys::testing`, which this crate cannot depend on (it sits
/// below `cumem-sys`); the file uses only `std`.
#[path = "../../../cumem-sys/src/testing/child_process.rs"]
pub mod child_process;

use std::ffi::c_void;
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use cudarc::driver::sys::{self as cu, CUcontext, CUdeviceptr, CUresult, CUstream};
use cumem_sim::control::Control;

/// Devices: 0 general, 1 small (OOM tests; no concurrent managed access), 2 reserved for the context-reset test (and
/// exclusive uses), 3 without managed memory, host mapping, pools, host registration or VMM.
pub const CONFIG: &str = "leak_check=1,devices=4,memory=4GiB,latency_us=200,dev1.memory=64MiB,\
                          dev1.concurrent_managed_access=0,\
                          dev3.managed_memory=0,dev3.can_map_host_memory=0,dev3.name=no-frills,\
                          dev3.memory_pools_supported=0,dev3.host_register_supported=0,\
                          dev3.read_only_host_register_supported=0,dev3.vmm=0";

static LIB: OnceLock<libloading::Library> = OnceLock::new();
static CTL: OnceLock<Control> = OnceLock::new();
static CTX: OnceLock<Vec<usize>> = OnceLock::new();

/// Loads the simulator (once) and returns its control client, without calling `cuInit`.
pub fn load() -> &'static Control {
    LIB.get_or_init(|| {
        let path = cumem_sim::library_path().expect("libcumem_sim.so is built beside the tests");
        // SAFETY: loading the simulator runs no foreign initialisers beyond Rust's.
        unsafe { libloading::Library::new(path) }.expect("load the simulator")
    });
    CTL.get_or_init(|| Control::attach().expect("the simulator is loaded"))
}

/// Loads, configures and initialises the simulator and retains the primary contexts of devices
/// 0, 1 and 3 (never released: retained contexts are not leaks).
pub fn setup() -> &'static Control {
    let ctl = load();
    CTX.get_or_init(|| {
        ctl.configure(CONFIG).expect("valid configuration");
        // SAFETY: plain FFI call into the loaded simulator.
        ok(unsafe { cu::cuInit(0) });
        [0, 1, 2, 3]
            .iter()
            .map(|&d| {
                if d == 2 {
                    return 0;
                }
                let mut ctx: CUcontext = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                ok(unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, d) });
                ctx as usize
            })
            .collect()
    });
    ctl
}

/// Binds device `dev`'s primary context to the calling thread (not device 2).
pub fn bind(dev: usize) -> &'static Control {
    let ctl = setup();
    let ctx = CTX.get().unwrap()[dev];
    assert_ne!(ctx, 0, "device {dev} is not retained by the shared setup");
    // SAFETY: a handle returned by cuDevicePrimaryCtxRetain.
    ok(unsafe { cu::cuCtxSetCurrent(ctx as CUcontext) });
    ctl
}

/// The schedule the process was configured with: `CUMEM_SIM`'s last `schedule` entry, else the
/// default `enqueued`. The control client cannot read the configuration back; the shared setup
/// sets no schedule, and every test that changes it does so through [`Schedule`], so between
/// tests this is the schedule in force.
pub fn configured_schedule() -> String {
    std::env::var("CUMEM_SIM")
        .ok()
        .and_then(|spec| {
            spec.rsplit(',')
                .filter_map(|item| item.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("schedule"))
                .map(|(_, v)| v.trim().to_ascii_lowercase())
        })
        .unwrap_or_else(|| "enqueued".to_string())
}

/// Holds the simulator on one schedule (process-wide) and puts back [`configured_schedule`] when
/// dropped, also when the test panics, so that a failing assertion does not leave the tests after
/// it on the wrong schedule.
pub struct Schedule(&'static Control);

impl Schedule {
    /// Switches to `schedule` (`enqueued` or `reversed`).
    pub fn set(ctl: &'static Control, schedule: &str) -> Schedule {
        ctl.configure(&format!("schedule={schedule}")).expect("a valid schedule");
        Schedule(ctl)
    }
}

impl Drop for Schedule {
    fn drop(&mut self) {
        let restored = self.0.configure(&format!("schedule={}", configured_schedule()));
        // Panicking while the test already panics would abort the binary.
        if restored.is_err() && !std::thread::panicking() {
            panic!("the configured schedule {} was not restored: {restored:?}", configured_schedule());
        }
    }
}

/// Asserts success.
#[track_caller]
pub fn ok(r: CUresult) {
    assert_eq!(r, CUresult::CUDA_SUCCESS);
}

/// `cuMemAlloc` or panic.
pub fn dalloc(bytes: usize) -> CUdeviceptr {
    let mut p = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAlloc_v2(&mut p, bytes) });
    p
}

/// `cuMemFree` or panic.
pub fn dfree(p: CUdeviceptr) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuMemFree_v2(p) });
}

/// Pinned host memory of `n` bytes.
pub fn pinned(n: usize) -> *mut u8 {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuMemAllocHost_v2(&mut p, n) });
    p.cast()
}

/// Frees pinned host memory.
pub fn pfree(p: *mut u8) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuMemFreeHost(p.cast()) });
}

/// Reads pinned memory (volatile: the simulator's engine thread writes it).
pub fn peek(p: *const u8, n: usize) -> Vec<u8> {
    // SAFETY: `p` is a live pinned allocation of at least `n` bytes.
    (0..n).map(|i| unsafe { p.add(i).read_volatile() }).collect()
}

/// Fills pinned memory.
pub fn poke(p: *mut u8, n: usize, v: u8) {
    for i in 0..n {
        // SAFETY: `p` is a live pinned allocation of at least `n` bytes.
        unsafe { p.add(i).write_volatile(v) };
    }
}

/// Creates a stream.
pub fn stream(flags: u32) -> CUstream {
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuStreamCreate(&mut s, flags) });
    s
}

/// Destroys a stream.
pub fn destroy(s: CUstream) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuStreamDestroy_v2(s) });
}

/// Copies device memory to a fresh Vec (synchronous).
pub fn read_back(p: CUdeviceptr, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    // SAFETY: `v` has `n` bytes.
    ok(unsafe { cu::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), p, n) });
    v
}

/// Whether the gate is open, whether its host function has started, and the wake-up for both.
type GateInner = (Mutex<(bool, bool)>, Condvar);

/// A host function that blocks a stream until opened (or dropped), making "work has not run
/// yet" deterministic instead of relying on the simulated latency.
///
/// While a gate holds a stream, another thread's implicitly synchronising call (`cuMemFree`,
/// `cuMemFreeHost`, …) on the device waits for it and holds the device meanwhile, so the gate's
/// owner cannot queue more work there until the gate opens: a deadlock, as on a GPU (§17 of the
/// driver reference). Tests that use a gate are therefore `#[serial]` and the others of their
/// binary `#[parallel]`.
pub struct Gate(Arc<GateInner>);

extern "C" fn wait_gate(data: *mut c_void) {
    // SAFETY: `data` came from `Arc::into_raw` in `Gate::block`, consumed exactly once here.
    let inner = unsafe { Arc::from_raw(data.cast::<GateInner>()) };
    let mut state = inner.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    state.1 = true;
    inner.1.notify_all();
    while !state.0 {
        state = inner.1.wait(state).unwrap_or_else(std::sync::PoisonError::into_inner);
    }
}

impl Gate {
    /// Enqueues the gate on `s`. The calling test must be `#[serial]` (checked).
    pub fn block(s: CUstream) -> Gate {
        assert!(
            serial_test::is_locked_serially(None),
            "a test that holds a stream must be #[serial] and the others of its binary #[parallel]"
        );
        let inner: Arc<GateInner> = Arc::new((Mutex::new((false, false)), Condvar::new()));
        let raw = Arc::into_raw(Arc::clone(&inner)) as *mut c_void;
        // SAFETY: `wait_gate(raw)` is valid to call once on any thread.
        ok(unsafe { cu::cuLaunchHostFunc(s, Some(wait_gate), raw) });
        Gate(inner)
    }

    /// Returns once the gate's host function runs (it is then no longer queued on the stream,
    /// as on a GPU, where the stream is held by a host function that has started). The
    /// simulator runs host functions one at a time, so a second gate starts only once the first
    /// opens; waiting for it fails after 20 s instead of hanging.
    pub fn wait_started(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let started = {
            let mut state = self.0.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            while let (false, Some(left)) =
                (state.1, deadline.checked_duration_since(std::time::Instant::now()))
            {
                state =
                    self.0.1.wait_timeout(state, left).unwrap_or_else(std::sync::PoisonError::into_inner).0;
            }
            state.1
        };
        // Panics with the lock let go, so that the gate's drop can still open it.
        assert!(started, "the gate's host function starts within 20 s");
    }

    /// Lets the stream continue.
    pub fn open(&self) {
        self.0.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).0 = true;
        self.0.1.notify_all();
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
    }
}

/// Runs `f` on a new thread with device 0's primary context current; its result comes through the
/// channel, so a call that blocks when it should not fails a `recv_timeout` instead of hanging the
/// test.
pub fn on_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Receiver<T> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        bind(0);
        let _ = tx.send(f());
    });
    rx
}

/// A small pause that is far longer than the simulated latency, used only to make "X did not
/// happen while blocked" assertions meaningful (never to make something happen).
pub fn settle() {
    std::thread::sleep(std::time::Duration::from_millis(20));
}

/// Looks an exported symbol up in the loaded simulator with a caller-chosen signature (used to
/// pass raw integers where the bindings take enums).
///
/// # Safety
/// 1. `T` is a function pointer type ABI-compatible with the exported symbol.
pub unsafe fn raw<T: Copy>(name: &str) -> T {
    load();
    let lib = LIB.get().unwrap();
    let sym = format!("{name}\0");
    // SAFETY: per this function's contract.
    unsafe { *lib.get::<T>(sym.as_bytes()).expect("symbol exported") }
}

/// A 2D copy descriptor of `height` rows of `width` bytes between two device-typed addresses.
pub fn device_2d(
    dst: CUdeviceptr,
    dst_pitch: usize,
    src: CUdeviceptr,
    src_pitch: usize,
    width: usize,
    height: usize,
) -> cu::CUDA_MEMCPY2D {
    let device = cu::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    cu::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: device,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: device,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: height,
    }
}

/// Asserts that the simulator's live report is clean: everything the test made is released.
pub fn assert_all_released() {
    let report = setup().live_report();
    assert!(report.is_clean(), "everything the test made is released: {report}");
}

/// Starts `cuMemFree(idle)` on another thread (device 0 current) and returns once it waits there
/// for more than `pause` (for a stream the test holds): the device is then held. On a loaded
/// machine the thread may start late, so it must have entered the call first (the pause then
/// covers the step from entry to holding the device); `limit` bounds that wait.
pub fn free_waiting(
    ctl: &Control,
    idle: CUdeviceptr,
    pause: std::time::Duration,
    limit: std::time::Duration,
) -> Receiver<CUresult> {
    let frees = ctl.calls("cuMemFree_v2");
    // SAFETY: plain FFI call with a live allocation.
    let free = on_thread(move || unsafe { cu::cuMemFree_v2(idle) });
    let entered = std::time::Instant::now();
    while ctl.calls("cuMemFree_v2") == frees {
        assert!(entered.elapsed() < limit, "the thread never called cuMemFree");
        std::thread::yield_now();
    }
    assert!(free.recv_timeout(pause).is_err(), "cuMemFree waits for the stream held by the host function");
    free
}
