//! Peer copies and peer access when a driver call fails part-way (simulator only: faults are
//! injected): what was queued before the failure still completes before its memory can be
//! reused, and a failed disable leaves the pair cumem's to disable.

use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::{Context, Device, DeviceBuffer, Error, Stream};
use cumem_peer::{PeerAccess, PeerStreamCopy};
use cumem_sys::sim_control::{Control, FaultRule};
use cumem_sys::sys::{self, CUresult};
use cumem_sys::testing::{self, Gate};
use serial_test::serial;

/// Two linked devices; a long latency makes a copy that outlives its memory show.
const SIM: &str = "devices=2,peer=0-1,latency_us=2000";

/// The primary contexts of devices 0 and 1 and the simulator's control, or `None` on a real
/// driver (faults cannot be injected there).
fn setup() -> Option<(Vec<Context>, Control)> {
    testing::init_with(SIM);
    let Some(ctl) = testing::sim_control() else {
        testing::skip("injects driver faults: simulator only");
        return None;
    };
    Some(((0..2).map(|d| Device::get(d).unwrap().context().unwrap()).collect(), ctl))
}

/// Holds `stream` until the gate opens (the caller is `#[serial]`, see `testing::Gate`).
fn hold(stream: &Stream) -> Gate {
    assert!(serial_test::is_locked_serially(None), "a test that holds a stream must be #[serial]");
    stream.context().bind().unwrap();
    // SAFETY: `stream` is alive (borrowed), and its context was just made current.
    unsafe { testing::hold(stream.raw()) }
}

/// A thread-scoped fault: the `nth` next call of `function` on this thread fails once.
fn fail_nth(ctl: &Control, function: &str, nth: u64) -> cumem_sys::sim_control::FaultId {
    ctl.inject_fault(FaultRule {
        function: function.into(),
        nth,
        code: CUresult::CUDA_ERROR_LAUNCH_FAILED,
        times: 1,
        this_thread_only: true,
    })
}

/// Completes all work on every stream, so that a copy queued next makes the same calls each time.
fn idle(ctx: &[Context], s: &[Stream]) {
    for (c, s) in ctx.iter().zip(s) {
        s.synchronize().unwrap();
        Stream::legacy(c).synchronize().unwrap();
    }
}

#[test]
#[serial] // holds a stream with a gate
fn a_direct_copy_whose_final_ordering_fails_still_completes_before_the_destination_is_freed() {
    let Some((ctx, ctl)) = setup() else { return };
    let s: Vec<Stream> = ctx.iter().map(|c| Stream::non_blocking(c).unwrap()).collect();
    let n = 1 << 16;
    let src = DeviceBuffer::from_slice(&s[0], &vec![5u32; n]).unwrap();
    // A clean run counts the waits the copy queues: the last one orders the destination's side
    // after the copy, and is the one made to fail below.
    let mut probe = DeviceBuffer::<u32>::zeroed(&s[1], n).unwrap();
    idle(&ctx, &s);
    // (The first copy from `src` also waits for its upload: count the second.)
    drop(s[0].copy_peer(&src, &mut probe).unwrap());
    let mut probe = DeviceBuffer::<u32>::zeroed(&s[1], n).unwrap();
    idle(&ctx, &s);
    let before = ctl.calls_on_this_thread("cuStreamWaitEvent");
    drop(s[0].copy_peer(&src, &mut probe).unwrap());
    let waits = ctl.calls_on_this_thread("cuStreamWaitEvent") - before;
    assert!(waits >= 1, "the copy queued no cross-stream wait");
    drop(probe);

    let mut dst = DeviceBuffer::<u32>::zeroed(&s[1], n).unwrap();
    idle(&ctx, &s);
    let gate = hold(&s[0]);
    // The copy sits queued behind the gate when the failure comes; the gate opens later, from
    // another thread, so a copy that rightly waits for its stream before returning can.
    let opener = gate.release_after(Duration::from_millis(500));
    let rule = fail_nth(&ctl, "cuStreamWaitEvent", waits);
    let queued = s[0].copy_peer(&src, &mut dst);
    ctl.remove_fault(rule);
    assert!(
        matches!(queued, Err(Error::Cuda { code: CUresult::CUDA_ERROR_LAUNCH_FAILED, .. })),
        "{queued:?}"
    );
    // Free the destination and reuse its memory at once: a copy still pending would land over
    // the new buffer's contents.
    drop(dst);
    let mut reused = DeviceBuffer::<u32>::zeroed(&s[1], n).unwrap();
    s[1].fill(&mut reused, 9u32).unwrap();
    s[1].synchronize().unwrap();
    opener.join().unwrap();
    s[0].synchronize().unwrap();
    let got = reused.to_vec().unwrap();
    let overwritten = got.iter().filter(|&&v| v != 9).count();
    assert_eq!(overwritten, 0, "the failed copy wrote into memory freed and reused after it returned");
    let violations = ctl.violations_on_this_thread();
    assert!(violations.is_empty(), "{violations:?}");
}

#[test]
#[serial] // enables and disables peer access between devices 0 and 1
fn a_pair_whose_disable_failed_stays_cumems_and_is_disabled_by_the_next_last_guard() {
    let Some((ctx, ctl)) = setup() else { return };
    let first = PeerAccess::enable(&ctx[0], &ctx[1]).unwrap();
    let rule = fail_nth(&ctl, "cuCtxDisablePeerAccess", 1);
    drop(first); // the disable fails: logged, the pair stays enabled
    ctl.remove_fault(rule);
    assert!(PeerAccess::is_enabled(&ctx[0], &ctx[1]), "the pair is still enabled in the driver");
    // The next guard joins cumem's enablement instead of adopting it as enabled elsewhere, so
    // its drop disables the pair.
    drop(PeerAccess::enable(&ctx[0], &ctx[1]).unwrap());
    assert!(!PeerAccess::is_enabled(&ctx[0], &ctx[1]));
    ctx[0].bind().unwrap();
    // SAFETY: plain FFI call with a live context current.
    let disabled = unsafe { sys::cuCtxDisablePeerAccess(ctx[1].raw()) };
    assert_eq!(disabled, CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "cumem left the pair enabled");
}
