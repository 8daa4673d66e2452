//! What the VMM test binaries share: devices picked by capability, the simulator's counters and
//! reports (nothing on a real driver), and the gate.

#![allow(dead_code)] // each test binary uses its own part

use cumem_core::{Device, Stream};
#[allow(unused_imports)] // Not every test binary that includes this module uses it.
pub use cumem_sys::testing::within_watchdog;
use std::time::Duration;

use cumem_sys::testing::{self, Gate};
use cumem_vmm::Granularity;

/// Four devices: 0 and 1 reach each other's memory, 2 reaches nobody's (and nobody its), 3 has
/// no virtual memory management.
pub const SIM: &str = "devices=4,peer=0-1,dev3.virtual_memory_management_supported=0";

/// Initialises the test driver with [`SIM`].
pub fn init() {
    testing::init_with(SIM);
}

/// The first VMM-capable device; `None` on a real machine without one (the test then has nothing
/// to check).
pub fn vmm_device() -> Option<Device> {
    init();
    skipped_unless(
        Device::all().unwrap().into_iter().find(|d| d.capabilities().unwrap().virtual_memory),
        "a device with virtual memory management",
    )
}

/// `found`, reporting a skip (`cumem_sys::testing::skip`) when the machine has no `what`.
fn skipped_unless(found: Option<Device>, what: &str) -> Option<Device> {
    if found.is_none() {
        testing::skip(format_args!("needs {what}"));
    }
    found
}

/// A device without VMM, if the machine has one (the simulator always does).
pub fn device_without_vmm() -> Option<Device> {
    init();
    skipped_unless(
        Device::all().unwrap().into_iter().find(|d| !d.capabilities().unwrap().virtual_memory),
        "a device without virtual memory management (the simulator's device 3)",
    )
}

/// A VMM-capable device other than `owner` that cannot access `owner`'s memory.
pub fn non_peer_of(owner: Device) -> Option<Device> {
    let can = |d: Device| {
        let mut v = 0;
        // SAFETY: `v` is a valid out-pointer; both ordinals name existing devices.
        let code = unsafe { cumem_core::sys::cuDeviceCanAccessPeer(&mut v, d.raw(), owner.raw()) };
        assert_eq!(code, cumem_core::sys::CUresult::CUDA_SUCCESS);
        v != 0
    };
    skipped_unless(
        Device::all()
            .unwrap()
            .into_iter()
            .find(|&d| d != owner && d.capabilities().unwrap().virtual_memory && !can(d)),
        "a second VMM device without peer access (the simulator's device 2)",
    )
}

/// A VMM-capable device other than `owner` that can access `owner`'s memory.
pub fn peer_of(owner: Device) -> Option<Device> {
    let can = |d: Device| {
        let mut v = 0;
        // SAFETY: as in `non_peer_of`.
        let code = unsafe { cumem_core::sys::cuDeviceCanAccessPeer(&mut v, d.raw(), owner.raw()) };
        assert_eq!(code, cumem_core::sys::CUresult::CUDA_SUCCESS);
        v != 0
    };
    skipped_unless(
        Device::all()
            .unwrap()
            .into_iter()
            .find(|&d| d != owner && d.capabilities().unwrap().virtual_memory && can(d)),
        "a second VMM device with peer access (the simulator's device 1)",
    )
}

/// The minimum granularity of `device`.
pub fn granule(device: Device) -> usize {
    Granularity::of(device).unwrap().minimum
}

/// How many times the simulator's entry point `name` has been called so far on this thread
/// (`None` on a real driver).
pub fn calls(name: &str) -> Option<u64> {
    testing::sim_control().map(|ctl| ctl.calls_on_this_thread(name))
}

/// Runs `body` and asserts that it called none of `entry_points` (on the simulator; on a real
/// driver it only runs it).
pub fn without_calls<R>(entry_points: &[&str], body: impl FnOnce() -> R) -> R {
    let before: Vec<Option<u64>> = entry_points.iter().map(|n| calls(n)).collect();
    let out = body();
    for (name, before) in entry_points.iter().zip(before) {
        assert_eq!(calls(name), before, "{name} was called");
    }
    out
}

/// Every entry point the simulator exports, by symbol.
fn every_entry_point() -> impl Iterator<Item = &'static str> {
    cumem_sim::exports::proc_address::VERSIONS.iter().map(|&(_, _, symbol)| symbol)
}

/// Runs `body` and asserts that it made no driver call at all on this thread, except to the
/// queries in `allowed` (on the simulator, whose per-entry-point call counts are compared for every
/// symbol it exports; on a real driver it only runs it). Stricter than [`without_calls`]: a
/// refusal "before any driver call" must not bind a context, allocate or ask the driver to judge.
pub fn without_any_call<R>(allowed: &[&str], body: impl FnOnce() -> R) -> R {
    let before: Vec<(&str, Option<u64>)> = every_entry_point().map(|n| (n, calls(n))).collect();
    let out = body();
    let made: Vec<String> = before
        .into_iter()
        .filter(|(name, _)| !allowed.contains(name))
        .filter_map(|(name, before)| {
            let after = calls(name);
            (after != before).then(|| format!("{name} ×{}", after.unwrap_or(0) - before.unwrap_or(0)))
        })
        .collect();
    assert!(made.is_empty(), "driver calls made: {made:?}");
    out
}

/// Every VMM entry point cumem calls.
pub const VMM_CALLS: &[&str] = &[
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemGetAccess",
];

/// Bytes the simulator has mapped inside `[base, base + size)` (`None` on a real driver).
pub fn sim_mapped_bytes(base: u64, size: usize) -> Option<u64> {
    let report = testing::sim_control()?.live_report();
    Some(
        report.mappings.iter().filter(|m| m.ptr >= base && m.ptr < base + size as u64).map(|m| m.bytes).sum(),
    )
}

/// Whether the simulator still holds a reservation at `base` (`None` on a real driver).
pub fn sim_reserved(base: u64) -> Option<bool> {
    let report = testing::sim_control()?.live_report();
    Some(report.reservations.iter().any(|r| r.ptr == base))
}

/// What the simulator logged as misuse on this thread (nothing on a real driver).
pub fn misuse_here() -> Vec<String> {
    testing::sim_control().map_or_else(Vec::new, |ctl| {
        ctl.violations_on_this_thread().into_iter().map(|v| v.to_string()).collect()
    })
}

/// Holds `stream` here: work queued on it from now on does not start until the gate opens.
/// Declare the gate after the buffers it holds work for. The calling test must be `#[serial]`
/// (checked): see [`Gate`] for why.
pub fn hold(stream: &Stream) -> Gate {
    assert!(
        serial_test::is_locked_serially(None),
        "a test that holds a stream must be #[serial] (see cumem_sys::testing::Gate)"
    );
    stream.context().bind().unwrap();
    // SAFETY: `stream` is alive (borrowed), and its context was just made current.
    unsafe { testing::hold(stream.raw()) }
}

/// Values that differ from each other and from their index, so misplaced or stale data shows.
pub fn pattern(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i ^ seed).wrapping_mul(2_654_435_761).wrapping_add(seed)).collect()
}

/// How long a call that queues its work may take before the test takes it for waiting.
pub const QUEUED_CALL: Duration = Duration::from_secs(10);

/// Runs `call` on a thread of its own while `gate` holds a stream, and returns what it returns
/// with the gate still closed. A call that has not returned within [`QUEUED_CALL`] waits for the
/// held stream: the gate is then opened (so that the call finishes and the thread is joined) and
/// the test fails, naming `what`.
pub fn returns_while_held<R: Send>(gate: Gate, what: &str, call: impl FnOnce() -> R + Send) -> (R, Gate) {
    std::thread::scope(|s| {
        let (done, returned) = std::sync::mpsc::channel();
        let worker = s.spawn(move || {
            let out = call();
            let _ = done.send(());
            out
        });
        // A panic in `call` drops the sender: `Disconnected` at once, and the join passes it on.
        let gate = returned.recv_timeout(QUEUED_CALL).is_ok().then_some(gate);
        let out = worker.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        let Some(gate) = gate else {
            panic!(
                "{what} had not returned after {QUEUED_CALL:?}: it waited for a held stream instead of queueing its work"
            );
        };
        (out, gate)
    })
}
