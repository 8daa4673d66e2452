//! A raw-driver probe of the questions the simulator's docs list under "To verify on a GPU": which
//! calls wait while a stream is held by a blocking host function, which wait behind another
//! thread's `cuMemFree` (an implicit synchronisation that holds the context), how deep a held
//! stream's queue is, and a few error codes.
//!
//! ```text
//! CUMEM_DRIVER=real cargo run --release -p cumem-benches --bin driver-probe [-- PART...]
//! ```
//!
//! PART is any of `held`, `behind-free`, `pools`, `misc`, `depth` (all when none is named). Each
//! line says what one call answered and whether it RETURNed or BLOCKed (did not return within
//! 1.5 s, and returned once the host function ended). It prints and asserts nothing about the
//! answers; the H100's are in docs/observed-on-gpu.md. On the simulator it shows where the
//! simulator and that record differ.

use std::ffi::c_void;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use cumem_sys::sys::{self, CUresult};

/// How long a call may take before it counts as blocked.
const WAIT: Duration = Duration::from_millis(1500);

/// Closed while a host function holds a stream (see [`hold`]).
static GATE: AtomicBool = AtomicBool::new(true);

/// What a case made that must be freed after the host function returned (the free may wait).
static LATER: Mutex<Vec<Later>> = Mutex::new(Vec::new());

enum Later {
    Device(u64),
    Host(usize),
    Event(usize),
    Reservation(u64, usize),
    Handle(u64),
}

/// Makes one raw driver call and names its answer.
macro_rules! c {
    ($call:expr) => {{
        // SAFETY: every raw call in this probe passes handles it created and has not destroyed,
        // valid pointers to out-values, and ranges inside allocations of the sizes given.
        let r = unsafe { $call };
        code(r)
    }};
}

/// Makes one raw driver call that must succeed.
macro_rules! must {
    ($call:expr, $what:literal) => {{
        // SAFETY: as for `c!`.
        let r = unsafe { $call };
        assert_eq!(r, CUresult::CUDA_SUCCESS, $what);
    }};
}

fn code(r: CUresult) -> String {
    format!("{r:?}")
}

/// The host function that holds a stream until the gate opens.
unsafe extern "C" fn hold_fn(_: *mut c_void) {
    while !GATE.load(Ordering::Acquire) {
        thread::sleep(Duration::from_millis(1));
    }
}

/// Holds stream `s` (a raw handle) with a host function until [`release`].
fn hold(s: usize) {
    GATE.store(false, Ordering::Release);
    must!(sys::cuLaunchHostFunc(s as _, Some(hold_fn), std::ptr::null_mut()), "cuLaunchHostFunc");
}

/// Opens the gate and waits for stream `s`.
fn release(s: usize) {
    GATE.store(true, Ordering::Release);
    must!(sys::cuStreamSynchronize(s as _), "cuStreamSynchronize");
}

type Answer = Receiver<(String, Duration)>;

/// Runs `f` on a new thread with context `ctx` current; the receiver gets its answer and time.
fn spawn(ctx: usize, f: impl FnOnce() -> String + Send + 'static) -> (Answer, JoinHandle<()>) {
    let (tx, rx) = channel();
    let h = thread::spawn(move || {
        must!(sys::cuCtxSetCurrent(ctx as _), "cuCtxSetCurrent");
        let t = Instant::now();
        let s = f();
        let _ = tx.send((s, t.elapsed()));
    });
    (rx, h)
}

fn verdict(rx: &Answer) -> String {
    match rx.recv_timeout(WAIT) {
        Ok((s, d)) => format!("RETURN in {:.1} ms: {s}", d.as_secs_f64() * 1e3),
        Err(_) => format!("BLOCK (> {} ms)", WAIT.as_millis()),
    }
}

/// Prints `first` (a verdict), completed by the late answer of a blocked call.
fn finish(name: &str, first: String, rx: Answer, h: JoinHandle<()>) {
    let late = if first.starts_with("BLOCK") {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok((s, d)) => format!(", then {s} ({:.0} ms after the call)", d.as_secs_f64() * 1e3),
            Err(_) => ", still not returned 10 s after the release".into(),
        }
    } else {
        String::new()
    };
    let _ = h.join();
    println!("PROBE {name}: {first}{late}");
}

/// `f` on another thread while stream `held` is held.
fn while_held(ctx: usize, held: usize, name: &str, f: impl FnOnce() -> String + Send + 'static) {
    hold(held);
    let (rx, h) = spawn(ctx, f);
    let v = verdict(&rx);
    release(held);
    finish(name, v, rx, h);
}

/// `f` on a third thread while `held` is held and a second thread waits in `cuMemFree` of an idle
/// allocation.
fn behind_free(ctx: usize, held: usize, name: &str, f: impl FnOnce() -> String + Send + 'static) {
    let victim = alloc(4096);
    hold(held);
    let (frx, fh) = spawn(ctx, move || c!(sys::cuMemFree_v2(victim)));
    let waiting = frx.recv_timeout(Duration::from_millis(300)).is_err();
    let (rx, h) = spawn(ctx, f);
    let v = verdict(&rx);
    release(held);
    let note = if waiting { "" } else { " [cuMemFree had returned at once: nothing was held]" };
    finish(&format!("{name}, behind a waiting cuMemFree{note}"), v, rx, h);
    let _ = fh.join();
}

fn alloc(bytes: usize) -> u64 {
    let mut p = 0;
    must!(sys::cuMemAlloc_v2(&mut p, bytes), "cuMemAlloc");
    p
}

fn stream() -> usize {
    let mut s = std::ptr::null_mut();
    must!(sys::cuStreamCreate(&mut s, 1), "cuStreamCreate");
    s as usize
}

fn event(flags: u32) -> usize {
    let mut e = std::ptr::null_mut();
    must!(sys::cuEventCreate(&mut e, flags), "cuEventCreate");
    e as usize
}

fn later(l: Later) {
    LATER.lock().unwrap_or_else(|e| e.into_inner()).push(l);
}

/// Frees what the cases left (every stream is idle by now).
fn tidy() {
    for l in LATER.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
        let r = match l {
            Later::Device(p) => c!(sys::cuMemFree_v2(p)),
            Later::Host(p) => c!(sys::cuMemFreeHost(p as _)),
            Later::Event(e) => c!(sys::cuEventDestroy_v2(e as _)),
            Later::Reservation(p, n) => c!(sys::cuMemAddressFree(p, n)),
            Later::Handle(h) => c!(sys::cuMemRelease(h)),
        };
        if r != "CUDA_SUCCESS" {
            println!("(tidy: {r})");
        }
    }
}

fn location() -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 }
}

fn prop() -> sys::CUmemAllocationProp {
    // SAFETY: plain old data (integers and a null pointer); all-zero is its "unset" state.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = location();
    p
}

fn access() -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: location(),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

fn granularity() -> usize {
    let mut g = 0;
    let option = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    must!(sys::cuMemGetAllocationGranularity(&mut g, &prop(), option), "granularity");
    g
}

fn create(g: usize) -> u64 {
    let mut h = 0;
    must!(sys::cuMemCreate(&mut h, g, &prop(), 0), "cuMemCreate");
    h
}

/// A new handle of `g` bytes mapped at `at` with read-write access.
fn mapped(at: u64, g: usize) -> u64 {
    let h = create(g);
    must!(sys::cuMemMap(at, g, 0, h, 0), "cuMemMap");
    must!(sys::cuMemSetAccess(at, g, &access(), 1), "cuMemSetAccess");
    h
}

fn main() -> cumem_core::Result<()> {
    let kind = cumem_sys::driver::init()?;
    println!("driver: {kind:?} {}", cumem_sys::driver::description().unwrap_or_default());
    let (mut dev, mut ctx) = (0, std::ptr::null_mut());
    must!(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
    must!(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain");
    must!(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    let ctx = ctx as usize;
    let (a, b) = (stream(), stream());
    let parts: Vec<String> = std::env::args().skip(1).collect();
    let run = |part: &str| parts.is_empty() || parts.iter().any(|p| p == part);
    if run("held") {
        held(ctx, a);
    }
    if run("behind-free") {
        calls_behind_a_free(ctx, a, b);
    }
    if run("pools") {
        pools(ctx, a, b);
    }
    if run("misc") {
        misc(ctx, a, b, dev);
    }
    if run("depth") {
        for what in [Enqueue::Memset, Enqueue::Record, Enqueue::ProfiledMemset] {
            depth(ctx, a, what);
        }
    }
    must!(sys::cuStreamDestroy_v2(a as _), "cuStreamDestroy");
    must!(sys::cuStreamDestroy_v2(b as _), "cuStreamDestroy");
    println!("PROBE done");
    Ok(())
}

/// Calls made while an unrelated stream is held (no free waiting).
fn held(ctx: usize, a: usize) {
    let g = granularity();
    let mut base = 0;
    must!(sys::cuMemAddressReserve(&mut base, 2 * g, 0, 0, 0), "cuMemAddressReserve");
    let h0 = mapped(base, g);
    while_held(ctx, a, "cuMemUnmap of a mapping no work uses, a stream held", move || {
        c!(sys::cuMemUnmap(base, g))
    });
    must!(sys::cuMemRelease(h0), "cuMemRelease");
    let h1 = mapped(base + g as u64, g);
    while_held(ctx, a, "cuMemSetAccess, a stream held", move || {
        c!(sys::cuMemSetAccess(base + g as u64, g, &access(), 1))
    });
    while_held(
        ctx,
        a,
        "cuMemCreate + cuMemMap + cuMemSetAccess + cuMemUnmap + cuMemRelease, a stream held",
        move || {
            let h = create(g);
            let m = c!(sys::cuMemMap(base, g, 0, h, 0));
            let s = c!(sys::cuMemSetAccess(base, g, &access(), 1));
            let (u, r) = (c!(sys::cuMemUnmap(base, g)), c!(sys::cuMemRelease(h)));
            format!("{m} {s} {u} {r}")
        },
    );
    while_held(ctx, a, "cuMemHostAlloc alone, a stream held", || {
        let mut p = std::ptr::null_mut();
        let r = c!(sys::cuMemHostAlloc(&mut p, 1 << 20, 0));
        later(Later::Host(p as usize));
        r
    });
    must!(sys::cuMemUnmap(base + g as u64, g), "cuMemUnmap");
    must!(sys::cuMemRelease(h1), "cuMemRelease");
    must!(sys::cuMemAddressFree(base, 2 * g), "cuMemAddressFree");
    tidy();
}

/// One call per case on a third thread while a second waits in `cuMemFree` for held stream `a`.
fn calls_behind_a_free(ctx: usize, a: usize, b: usize) {
    let g = granularity();
    let d = alloc(1 << 20);
    let host = vec![0u8; 4096];
    let hp = host.as_ptr() as usize;
    let page = std::alloc::Layout::from_size_align(4096, 4096).expect("a page");
    // SAFETY: the layout's size is not zero.
    let (reg, unreg) =
        unsafe { (std::alloc::alloc_zeroed(page) as usize, std::alloc::alloc_zeroed(page) as usize) };
    must!(sys::cuMemHostRegister_v2(unreg as _, 4096, 0), "cuMemHostRegister");
    let mut managed = 0;
    must!(sys::cuMemAllocManaged(&mut managed, 4096, 1), "cuMemAllocManaged");
    let mut pool = std::ptr::null_mut();
    must!(sys::cuDeviceGetDefaultMemPool(&mut pool, 0), "cuDeviceGetDefaultMemPool");
    let pool = pool as usize;
    let (t0, t1, done, never) = (event(0), event(0), event(2), event(2));
    must!(sys::cuEventRecord(t0 as _, b as _), "cuEventRecord");
    must!(sys::cuEventRecord(t1 as _, b as _), "cuEventRecord");
    must!(sys::cuEventRecord(done as _, b as _), "cuEventRecord");
    let mut on_b = 0;
    must!(sys::cuMemAllocAsync(&mut on_b, 256, b as _), "cuMemAllocAsync");
    must!(sys::cuStreamSynchronize(b as _), "cuStreamSynchronize");
    let idle = stream();
    let mut base = 0;
    must!(sys::cuMemAddressReserve(&mut base, g, 0, 0, 0), "cuMemAddressReserve");
    let handle = create(g);
    let pending = event(2);
    type Case = (&'static str, Box<dyn FnOnce() -> String + Send>);
    let cases: Vec<Case> = vec![
        (
            "cuMemAllocAsync + cuMemFreeAsync on another stream (RETURN in §17)",
            Box::new(move || {
                let mut p = 0;
                format!(
                    "{} {}",
                    c!(sys::cuMemAllocAsync(&mut p, 256, b as _)),
                    c!(sys::cuMemFreeAsync(p, b as _))
                )
            }),
        ),
        (
            "cuMemsetD8Async on another stream (BLOCK in §17)",
            Box::new(move || c!(sys::cuMemsetD8Async(d, 1, 64, b as _))),
        ),
        (
            "cuEventCreate (BLOCK in §17)",
            Box::new(|| {
                let mut e = std::ptr::null_mut();
                let r = c!(sys::cuEventCreate(&mut e, 2));
                later(Later::Event(e as usize));
                r
            }),
        ),
        (
            "cuMemCreate",
            Box::new(move || {
                let mut h = 0;
                let r = c!(sys::cuMemCreate(&mut h, g, &prop(), 0));
                later(Later::Handle(h));
                r
            }),
        ),
        (
            "cuMemAddressReserve",
            Box::new(move || {
                let mut p = 0;
                let r = c!(sys::cuMemAddressReserve(&mut p, g, 0, 0, 0));
                later(Later::Reservation(p, g));
                r
            }),
        ),
        ("cuMemMap", Box::new(move || c!(sys::cuMemMap(base, g, 0, handle, 0)))),
        ("cuMemSetAccess", Box::new(move || c!(sys::cuMemSetAccess(base, g, &access(), 1)))),
        ("cuMemUnmap", Box::new(move || c!(sys::cuMemUnmap(base, g)))),
        ("cuMemRelease", Box::new(move || c!(sys::cuMemRelease(handle)))),
        ("cuEventQuery of a completed event", Box::new(move || c!(sys::cuEventQuery(done as _)))),
        ("cuEventSynchronize of a completed event", Box::new(move || c!(sys::cuEventSynchronize(done as _)))),
        (
            "cuEventElapsedTime",
            Box::new(move || {
                let mut ms = 0f32;
                c!(sys::cuEventElapsedTime_v2(&mut ms, t0 as _, t1 as _))
            }),
        ),
        ("cuEventDestroy of a completed event", Box::new(move || c!(sys::cuEventDestroy_v2(done as _)))),
        (
            "cuEventDestroy of a never-recorded event",
            Box::new(move || c!(sys::cuEventDestroy_v2(never as _))),
        ),
        ("cuStreamDestroy of an idle stream", Box::new(move || c!(sys::cuStreamDestroy_v2(idle as _)))),
        (
            "cuStreamWaitEvent on another stream, completed event",
            Box::new(move || c!(sys::cuStreamWaitEvent(b as _, t1 as _, 0))),
        ),
        ("cuStreamQuery of another stream (RETURN in §17)", Box::new(move || c!(sys::cuStreamQuery(b as _)))),
        ("cuStreamSynchronize of an idle stream", Box::new(move || c!(sys::cuStreamSynchronize(b as _)))),
        ("cuMemFreeAsync on another stream", Box::new(move || c!(sys::cuMemFreeAsync(on_b, b as _)))),
        (
            "cuMemcpyHtoD_v2 (blocking, pageable)",
            Box::new(move || c!(sys::cuMemcpyHtoD_v2(d, hp as _, 4096))),
        ),
        ("cuMemsetD8_v2 (blocking)", Box::new(move || c!(sys::cuMemsetD8_v2(d, 3, 4096)))),
        (
            "cuMemcpyHtoDAsync_v2 on another stream, pageable",
            Box::new(move || c!(sys::cuMemcpyHtoDAsync_v2(d, hp as _, 64, b as _))),
        ),
        (
            "cuMemAllocPitch",
            Box::new(|| {
                let (mut p, mut pitch) = (0, 0);
                let r = c!(sys::cuMemAllocPitch_v2(&mut p, &mut pitch, 100, 4, 4));
                later(Later::Device(p));
                r
            }),
        ),
        (
            "cuMemAllocManaged",
            Box::new(|| {
                let mut p = 0;
                let r = c!(sys::cuMemAllocManaged(&mut p, 4096, 1));
                later(Later::Device(p));
                r
            }),
        ),
        (
            "cuMemHostAlloc",
            Box::new(|| {
                let mut p = std::ptr::null_mut();
                let r = c!(sys::cuMemHostAlloc(&mut p, 4096, 0));
                later(Later::Host(p as usize));
                r
            }),
        ),
        ("cuMemHostRegister", Box::new(move || c!(sys::cuMemHostRegister_v2(reg as _, 4096, 0)))),
        ("cuMemHostUnregister", Box::new(move || c!(sys::cuMemHostUnregister(unreg as _)))),
        (
            "cuStreamAttachMemAsync (GLOBAL) on another stream",
            Box::new(move || c!(sys::cuStreamAttachMemAsync(b as _, managed, 0, 1))),
        ),
        ("cuMemPoolTrimTo of the default pool", Box::new(move || c!(sys::cuMemPoolTrimTo(pool as _, 0)))),
        (
            "cuPointerGetAttribute (MEMORY_TYPE)",
            Box::new(move || {
                let mut t = 0u32;
                let attribute = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
                c!(sys::cuPointerGetAttribute((&raw mut t).cast(), attribute, d))
            }),
        ),
        (
            "cuMemGetAddressRange",
            Box::new(move || {
                let (mut lo, mut n) = (0, 0);
                c!(sys::cuMemGetAddressRange_v2(&mut lo, &mut n, d + 8))
            }),
        ),
        (
            "cuIpcGetMemHandle",
            Box::new(move || {
                // SAFETY: plain old data (bytes).
                let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
                c!(sys::cuIpcGetMemHandle(&mut h, d))
            }),
        ),
        (
            "cuCtxGetCurrent + cuCtxSetCurrent",
            Box::new(|| {
                let mut cur = std::ptr::null_mut();
                let r = c!(sys::cuCtxGetCurrent(&mut cur));
                r + " " + &c!(sys::cuCtxSetCurrent(cur))
            }),
        ),
        (
            "cuMemGetInfo (RETURN in §17)",
            Box::new(|| {
                let (mut free, mut total) = (0, 0);
                c!(sys::cuMemGetInfo_v2(&mut free, &mut total))
            }),
        ),
    ];
    for (name, f) in cases {
        behind_free(ctx, a, name, f);
    }
    // An event recorded behind the held host function, queried with no free waiting.
    hold(a);
    must!(sys::cuEventRecord(pending as _, a as _), "cuEventRecord");
    let (rx, h) = spawn(ctx, move || c!(sys::cuEventQuery(pending as _)));
    let v = verdict(&rx);
    release(a);
    finish("cuEventQuery of an event pending behind a held stream", v, rx, h);
    must!(sys::cuStreamSynchronize(b as _), "cuStreamSynchronize");
    for e in [t0, t1, pending] {
        later(Later::Event(e));
    }
    later(Later::Device(d));
    later(Later::Device(managed));
    later(Later::Reservation(base, g));
    tidy();
    must!(sys::cuMemHostUnregister(reg as _), "cuMemHostUnregister");
    // SAFETY: both pages came from `alloc_zeroed(page)` and are no longer registered.
    unsafe {
        std::alloc::dealloc(reg as *mut u8, page);
        std::alloc::dealloc(unreg as *mut u8, page);
    }
    drop(host);
}

/// Pools exported and imported in one process, and imports of what is not a pool.
fn pools(ctx: usize, a: usize, b: usize) {
    // SAFETY: plain old data; all-zero is "unset".
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    props.location = location();
    let fd_type = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    let mut idle = std::ptr::null_mut();
    must!(sys::cuMemPoolCreate(&mut idle, &props), "cuMemPoolCreate");
    let idle = idle as usize;
    behind_free(ctx, a, "cuMemPoolDestroy of an idle pool", move || c!(sys::cuMemPoolDestroy(idle as _)));
    let mut pool = std::ptr::null_mut();
    must!(sys::cuMemPoolCreate(&mut pool, &props), "cuMemPoolCreate");
    let pool = pool as usize;
    let mut fd: i32 = -1;
    must!(sys::cuMemPoolExportToShareableHandle((&raw mut fd).cast(), pool as _, fd_type, 0), "export");
    let import = move || {
        let mut p = std::ptr::null_mut();
        let r = c!(sys::cuMemPoolImportFromShareableHandle(&mut p, fd as usize as _, fd_type, 0));
        (r, p as usize)
    };
    behind_free(ctx, a, "cuMemPoolImportFromShareableHandle in the exporting process", move || {
        let (r, p) = import();
        format!("{r}, handle {p:#x} (the exporter's: {pool:#x})")
    });
    let mut exported = 0;
    must!(sys::cuMemAllocFromPoolAsync(&mut exported, 4096, pool as _, b as _), "cuMemAllocFromPoolAsync");
    must!(sys::cuStreamSynchronize(b as _), "cuStreamSynchronize");
    // SAFETY: plain old data (bytes).
    let mut data: sys::CUmemPoolPtrExportData = unsafe { std::mem::zeroed() };
    must!(sys::cuMemPoolExportPointer(&mut data, exported), "cuMemPoolExportPointer");
    let (r, imported_pool) = import();
    println!("PROBE a second import of the same pool: {r}, handle {imported_pool:#x}");
    let mut q = 0;
    let r = c!(sys::cuMemPoolImportPointer(&mut q, imported_pool as _, &mut data));
    println!(
        "PROBE cuMemPoolImportPointer in the exporting process: {r} at {q:#x} (exported at {exported:#x})"
    );
    if r == "CUDA_SUCCESS" {
        behind_free(ctx, a, "cuMemPoolImportPointer of an imported pointer again", move || {
            let (mut again, mut d) = (0, data);
            let r = c!(sys::cuMemPoolImportPointer(&mut again, imported_pool as _, &mut d));
            format!("{r} at {again:#x}")
        });
        while_held(ctx, a, "cuMemFree of an imported pool pointer, a stream held", move || {
            c!(sys::cuMemFree_v2(q))
        });
    }
    must!(sys::cuMemFreeAsync(exported, b as _), "cuMemFreeAsync");
    must!(sys::cuStreamSynchronize(b as _), "cuStreamSynchronize");
    let file =
        std::fs::File::create(std::env::temp_dir().join("driver-probe-not-a-pool")).expect("a scratch file");
    let file_fd = std::os::fd::AsRawFd::as_raw_fd(&file);
    for (what, f) in [("a regular file", file_fd), ("descriptor 0", 0)] {
        let mut p = std::ptr::null_mut();
        let r = c!(sys::cuMemPoolImportFromShareableHandle(&mut p, f as usize as _, fd_type, 0));
        println!("PROBE cuMemPoolImportFromShareableHandle of {what}: {r}");
    }
    behind_free(ctx, a, "cuMemPoolDestroy of an exported pool", move || c!(sys::cuMemPoolDestroy(pool as _)));
}

/// The legacy stream, 2D copies, registration, IPC handles and managed memory.
fn misc(ctx: usize, a: usize, b: usize, dev: sys::CUdevice) {
    let blocking = {
        let mut s = std::ptr::null_mut();
        must!(sys::cuStreamCreate(&mut s, 0), "cuStreamCreate");
        s as usize
    };
    hold(blocking);
    let (q, legacy) = (c!(sys::cuStreamQuery(std::ptr::null_mut())), c!(sys::cuStreamQuery(1 as _)));
    println!("PROBE cuStreamQuery(NULL) / (CU_STREAM_LEGACY), only a blocking stream held: {q} / {legacy}");
    release(blocking);
    while_held(ctx, blocking, "cuStreamSynchronize(NULL), only a blocking stream held", || {
        c!(sys::cuStreamSynchronize(std::ptr::null_mut()))
    });
    must!(sys::cuStreamDestroy_v2(blocking as _), "cuStreamDestroy");

    let (d1, d2) = (alloc(4096), alloc(4096));
    let mut max_pitch = 0;
    let attribute = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH;
    must!(sys::cuDeviceGetAttribute(&mut max_pitch, attribute, dev), "cuDeviceGetAttribute");
    for pitch in [24usize, 512] {
        let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
        let mut p = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: device,
            srcHost: std::ptr::null(),
            srcDevice: d1,
            srcArray: std::ptr::null_mut(),
            srcPitch: pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: device,
            dstHost: std::ptr::null_mut(),
            dstDevice: d2,
            dstArray: std::ptr::null_mut(),
            dstPitch: pitch,
            WidthInBytes: 24,
            Height: 4,
        };
        let (x, y, z) = (
            c!(sys::cuMemcpy2DAsync_v2(&p, b as _)),
            c!(sys::cuMemcpy2D_v2(&p)),
            c!(sys::cuMemcpy2DUnaligned_v2(&p)),
        );
        println!(
            "PROBE device-to-device 2D copy of 4 rows, pitch {pitch}: async {x}, blocking {y}, unaligned {z}"
        );
        p.srcPitch = max_pitch as usize + 512;
        p.dstPitch = max_pitch as usize + 512;
        p.Height = 1;
        let (x, y) = (c!(sys::cuMemcpy2D_v2(&p)), c!(sys::cuMemcpy2DAsync_v2(&p, b as _)));
        println!("PROBE one-row 2D copy, pitch MAX_PITCH ({max_pitch}) + 512: blocking {x}, async {y}");
    }
    must!(sys::cuStreamSynchronize(b as _), "cuStreamSynchronize");

    let layout = std::alloc::Layout::from_size_align(8192, 4096).expect("two pages");
    // SAFETY: the layout's size is not zero.
    let page = unsafe { std::alloc::alloc_zeroed(layout) } as usize;
    let (r1, r2) = (
        c!(sys::cuMemHostRegister_v2(page as _, 1024, 0)),
        c!(sys::cuMemHostRegister_v2((page + 2048) as _, 1024, 0)),
    );
    println!("PROBE cuMemHostRegister of [0, 1024) then [2048, 3072) of one page: {r1} then {r2}");
    for (r, at) in [(r2, page + 2048), (r1, page)] {
        if r == "CUDA_SUCCESS" {
            must!(sys::cuMemHostUnregister(at as _), "cuMemHostUnregister");
        }
    }
    // SAFETY: allocated above with `layout`, no longer registered.
    unsafe { std::alloc::dealloc(page as *mut u8, layout) };

    let big = alloc(1 << 20);
    // SAFETY: plain old data (bytes).
    let [mut h1, mut h2, mut h3]: [sys::CUipcMemHandle; 3] = unsafe { std::mem::zeroed() };
    let got = [
        c!(sys::cuIpcGetMemHandle(&mut h1, big)),
        c!(sys::cuIpcGetMemHandle(&mut h2, big)),
        c!(sys::cuIpcGetMemHandle(&mut h3, big + 4096)),
    ];
    println!(
        "PROBE cuIpcGetMemHandle of one allocation twice, and of an interior pointer: {got:?}; the same bytes twice: {}; interior gives the base's: {}",
        h1.reserved == h2.reserved,
        h1.reserved == h3.reserved
    );

    let mut m = 0;
    let r = c!(sys::cuMemAllocManaged(&mut m, 4096, 2));
    println!("PROBE cuMemAllocManaged (CU_MEM_ATTACH_HOST): {r}");
    if r == "CUDA_SUCCESS" {
        let (x, y, z) = (
            c!(sys::cuMemsetD8Async(m, 1, 4096, b as _)),
            c!(sys::cuStreamSynchronize(b as _)),
            c!(sys::cuMemsetD8_v2(m, 2, 4096)),
        );
        let mut back = [0u8; 4];
        let w = c!(sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), m, 4));
        println!(
            "PROBE the device side of host-attached managed memory: memset queued {x}, sync {y}, blocking memset {z}, read {w} {back:?}"
        );
        let (r, s) = (c!(sys::cuStreamAttachMemAsync(a as _, m, 0, 4)), c!(sys::cuStreamSynchronize(a as _)));
        let (x, y) = (c!(sys::cuMemsetD8Async(m, 3, 4096, b as _)), c!(sys::cuStreamSynchronize(b as _)));
        println!(
            "PROBE attached SINGLE to one stream, memset on another: attach {r} {s}, memset {x}, sync {y}"
        );
        later(Later::Device(m));
    }
    for p in [d1, d2, big] {
        later(Later::Device(p));
    }
    tidy();
}

/// What a [`depth`] run queues, one at a time, on the held stream.
#[derive(Clone, Copy, Debug)]
enum Enqueue {
    /// `cuMemsetD8Async` of 4 bytes.
    Memset,
    /// `cuEventRecord` of one event, again and again.
    Record,
    /// An event record, a memset, an event record: a copy the profiler times.
    ProfiledMemset,
}

/// How many of `what` queue on held stream `a` before one blocks (none queued for 500 ms), and
/// which other calls go on meanwhile.
fn depth(ctx: usize, a: usize, what: Enqueue) {
    const CAP: usize = 100_000;
    let (d, ev, other, small) = (alloc(64), event(2), stream(), alloc(64));
    let count = std::sync::Arc::new(AtomicUsize::new(0));
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    hold(a);
    let (n, s) = (count.clone(), stop.clone());
    let (_rx, h) = spawn(ctx, move || {
        while !s.load(Ordering::Relaxed) && n.load(Ordering::Relaxed) < CAP {
            let r = match what {
                Enqueue::Memset => c!(sys::cuMemsetD8Async(d, 1, 4, a as _)),
                Enqueue::Record => c!(sys::cuEventRecord(ev as _, a as _)),
                Enqueue::ProfiledMemset => {
                    let _ = c!(sys::cuEventRecord(ev as _, a as _));
                    let r = c!(sys::cuMemsetD8Async(d, 1, 4, a as _));
                    let _ = c!(sys::cuEventRecord(ev as _, a as _));
                    r
                }
            };
            if r != "CUDA_SUCCESS" {
                return r;
            }
            n.fetch_add(1, Ordering::Relaxed);
        }
        String::new()
    });
    let (mut last, t) = (0, Instant::now());
    loop {
        thread::sleep(Duration::from_millis(500));
        let n = count.load(Ordering::Relaxed);
        if n == last || n >= CAP || t.elapsed() > Duration::from_secs(8) {
            break;
        }
        last = n;
    }
    println!(
        "PROBE queue depth of a held stream, {what:?}: {} queued, then none for 500 ms",
        count.load(Ordering::Relaxed)
    );
    let mut others = Vec::new();
    let (rx, h2) = spawn(ctx, move || c!(sys::cuMemsetD8Async(small, 1, 64, other as _)));
    println!("PROBE   meanwhile, a memset on another stream: {}", verdict(&rx));
    others.push(h2);
    let (rx, h3) = spawn(ctx, || {
        let mut e = std::ptr::null_mut();
        let r = c!(sys::cuEventCreate(&mut e, 2));
        later(Later::Event(e as usize));
        r
    });
    println!("PROBE   meanwhile, cuEventCreate: {}", verdict(&rx));
    others.push(h3);
    let (rx, h4) = spawn(ctx, || {
        let mut p = 0;
        let r = c!(sys::cuMemAlloc_v2(&mut p, 64));
        later(Later::Device(p));
        r
    });
    println!("PROBE   meanwhile, cuMemAlloc: {}", verdict(&rx));
    others.push(h4);
    stop.store(true, Ordering::Relaxed);
    release(a);
    let _ = h.join();
    others.into_iter().for_each(|h| {
        let _ = h.join();
    });
    must!(sys::cuStreamSynchronize(other as _), "cuStreamSynchronize");
    must!(sys::cuStreamDestroy_v2(other as _), "cuStreamDestroy");
    for p in [d, small] {
        later(Later::Device(p));
    }
    later(Later::Event(ev));
    tidy();
}
