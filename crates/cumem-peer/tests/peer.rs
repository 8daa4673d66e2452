//! Peer topology, access and copies on four simulated devices with pairs 0-1 and 2-3 linked
//! (`peer=0-1,2-3`); on a real machine each test runs with the devices it finds and skips, saying
//! so, when there are fewer than it needs.

use cumem_copy::StreamCopy;
use cumem_core::{Context, Device, DeviceBuffer, Error, Feature, Stream};
use cumem_peer::{PeerAccess, PeerPath, PeerStreamCopy, Topology, copy_peer};
use cumem_sys::sys::{self, CUresult};
use cumem_sys::testing::{self, Gate};
use serial_test::{parallel, serial};

/// A long device latency makes any missing wait show up as stale data.
const SIM: &str = "devices=4,peer=0-1,2-3,latency_us=2000";

/// The primary contexts of the first `n` devices, or `None` (with a message) when there are fewer.
fn contexts(n: usize) -> Option<Vec<Context>> {
    testing::init_with(SIM);
    if !testing::needs_devices(n) {
        return None;
    }
    Some((0..n).map(|d| Device::get(d).unwrap().context().unwrap()).collect())
}

fn simulated() -> bool {
    testing::sim_control().is_some()
}

/// Random-looking words (xorshift), different per seed.
fn random(n: usize, seed: u64) -> Vec<u64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
        .collect()
}

/// A pause far longer than the simulated latency: long enough for work that wrongly does not
/// wait to have run (never used to make something happen).
fn settle() {
    std::thread::sleep(std::time::Duration::from_millis(50));
}

/// Holds `stream` here until the gate opens (the caller is `#[serial]`, see `testing::Gate`).
fn hold(stream: &Stream) -> Gate {
    assert!(serial_test::is_locked_serially(None), "a test that holds a stream must be #[serial]");
    stream.context().bind().unwrap();
    // SAFETY: `stream` is alive (borrowed), and its context was just made current.
    unsafe { testing::hold(stream.raw()) }
}

#[test]
#[parallel]
fn the_matrix_reads_back_as_configured() {
    let Some(_) = contexts(1) else { return };
    let topo = Topology::probe().unwrap();
    assert_eq!(topo.devices(), Device::count().unwrap());
    for a in 0..topo.devices() {
        assert!(!topo.can_access(a, a));
        assert_eq!(topo.link(a, a).unwrap(), cumem_peer::Link::default());
    }
    assert!(matches!(topo.link(0, topo.devices()), Err(Error::InvalidDevice { .. })));
    if !simulated() {
        return;
    }
    for a in 0..4 {
        for b in 0..4 {
            let linked = a != b && a / 2 == b / 2;
            let link = topo.link(a, b).unwrap();
            assert_eq!(link.can_access, linked, "{a} -> {b}");
            assert_eq!(link.access_supported, linked, "{a} -> {b}");
            assert_eq!(link.native_atomics, linked, "{a} -> {b}");
            assert_eq!(topo.linked(a, b), linked);
        }
    }
    let printed = topo.to_string();
    assert!(
        printed.contains("    0   -   A   .   .") && printed.contains("    3   .   .   A   -"),
        "{printed}"
    );
}

#[test]
#[parallel]
fn copies_carry_random_data_bitwise_and_report_their_path() {
    let Some(ctx) = contexts(3) else { return };
    let topo = Topology::probe().unwrap();
    let s: Vec<Stream> = ctx.iter().map(|c| Stream::non_blocking(c).unwrap()).collect();
    let n = 100_003;
    let data = random(n, 1);
    let src = DeviceBuffer::from_slice(&s[0], &data).unwrap();
    for dst_dev in [1, 2] {
        let expected = if topo.linked(0, dst_dev) { PeerPath::Direct } else { PeerPath::Staged };
        if simulated() {
            assert_eq!(expected, if dst_dev == 1 { PeerPath::Direct } else { PeerPath::Staged });
        }
        // Blocking.
        let mut dst = DeviceBuffer::<u64>::zeroed(&s[dst_dev], n).unwrap();
        let done = copy_peer(&src, &mut dst).unwrap();
        assert_eq!(
            (done.path(), done.bytes(), done.staged()),
            (expected, n * 8, expected == PeerPath::Staged)
        );
        assert_eq!(dst.to_vec().unwrap(), data, "blocking copy to device {dst_dev}");
        // Queued on the source's stream, then on the destination's, into a part of the buffer.
        let mut dst = DeviceBuffer::<u64>::zeroed(&s[dst_dev], n).unwrap();
        let done = s[0].copy_peer(&src, &mut dst).unwrap();
        assert_eq!(done.path(), expected);
        drop(done);
        assert_eq!(dst.to_vec().unwrap(), data, "copy queued on device 0 to device {dst_dev}");
        let part = random(1000, 2);
        let piece = DeviceBuffer::from_slice(&s[0], &part).unwrap();
        let done = s[dst_dev].copy_peer(&piece, &mut dst.slice_mut(500..1500).unwrap()).unwrap();
        assert_eq!(done.path(), expected);
        let got = dst.to_vec().unwrap();
        assert_eq!(got[500..1500], part[..]);
        assert_eq!(got[..500], data[..500]);
        assert_eq!(got[1500..], data[1500..]);
    }
}

#[test]
#[parallel]
fn misuse_is_a_typed_error() {
    let Some(ctx) = contexts(3) else { return };
    let s: Vec<Stream> = ctx.iter().map(|c| Stream::non_blocking(c).unwrap()).collect();
    let src = DeviceBuffer::from_slice(&s[0], &[1u32; 8]).unwrap();
    let mut short = DeviceBuffer::<u32>::zeroed(&s[1], 7).unwrap();
    assert!(matches!(copy_peer(&src, &mut short), Err(Error::LengthMismatch { expected: 7, actual: 8 })));
    let mut dst = DeviceBuffer::<u32>::zeroed(&s[1], 8).unwrap();
    // A stream of neither device.
    assert!(matches!(s[2].copy_peer(&src, &mut dst), Err(Error::WrongDevice { .. })));
    assert_eq!(dst.to_vec().unwrap(), [0; 8]);
    // Empty copies are fine.
    let empty = DeviceBuffer::<u32>::zeroed(&s[0], 0).unwrap();
    let mut empty_dst = DeviceBuffer::<u32>::zeroed(&s[2], 0).unwrap();
    assert_eq!(copy_peer(&empty, &mut empty_dst).unwrap().bytes(), 0);
}

#[test]
#[serial] // enables and disables peer access on devices 0 and 1, which other tests only copy between
fn enabling_twice_is_fine_and_the_last_guard_disables() {
    let Some(ctx) = contexts(2) else { return };
    let topo = Topology::probe().unwrap();
    if !topo.can_access(0, 1) {
        testing::skip("devices 0 and 1 have no peer link");
        return;
    }
    let first = PeerAccess::enable(&ctx[0], &ctx[1]).unwrap();
    let second = PeerAccess::enable(&ctx[0], &ctx[1]).unwrap();
    assert!(PeerAccess::is_enabled(&ctx[0], &ctx[1]));
    assert!(!PeerAccess::is_enabled(&ctx[1], &ctx[0]), "access is one direction");
    drop(first);
    // Still enabled in the driver: enabling it behind cumem's back is refused.
    ctx[0].bind().unwrap();
    // SAFETY: plain FFI call with a live context.
    let again = unsafe { sys::cuCtxEnablePeerAccess(ctx[1].raw(), 0) };
    assert_eq!(again, CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
    drop(second);
    assert!(!PeerAccess::is_enabled(&ctx[0], &ctx[1]));
    ctx[0].bind().unwrap();
    // SAFETY: as above; the last guard disabled the pair.
    let disabled = unsafe { sys::cuCtxDisablePeerAccess(ctx[1].raw()) };
    assert_eq!(disabled, CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);

    // Access enabled outside cumem is adopted and left enabled.
    // SAFETY: as above.
    assert_eq!(unsafe { sys::cuCtxEnablePeerAccess(ctx[1].raw(), 0) }, CUresult::CUDA_SUCCESS);
    drop(PeerAccess::enable(&ctx[0], &ctx[1]).unwrap());
    ctx[0].bind().unwrap();
    // SAFETY: as above; still enabled, so this succeeds and cleans up.
    assert_eq!(unsafe { sys::cuCtxDisablePeerAccess(ctx[1].raw()) }, CUresult::CUDA_SUCCESS);

    // Same device: the driver's answer, as a typed error. No link: refused as not supported,
    // before any enable (see `a_pair_without_a_link_is_not_supported_before_any_enable`).
    assert!(matches!(PeerAccess::enable(&ctx[0], &ctx[0]), Err(Error::PeerAccessUnsupported { .. })));
    if let Some(ctx) = contexts(3).filter(|_| !topo.can_access(0, 2)) {
        assert!(matches!(
            PeerAccess::enable(&ctx[0], &ctx[2]),
            Err(Error::NotSupported { feature: Feature::PeerAccess, device: Some(0) })
        ));
        assert!(!PeerAccess::is_enabled(&ctx[0], &ctx[2]));
    }
}

#[test]
#[parallel]
fn a_pair_without_a_link_is_not_supported_before_any_enable() {
    let Some(ctx) = contexts(3) else { return };
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("counts the simulator's driver calls: simulator only");
    };
    // Configured so (`peer=0-1,2-3`): device 0 reaches device 1, not device 2.
    let topo = Topology::probe().unwrap();
    assert!(topo.can_access(0, 1) && !topo.can_access(0, 2));
    let before = ctl.calls_on_this_thread("cuCtxEnablePeerAccess");
    let unlinked = PeerAccess::enable(&ctx[0], &ctx[2]);
    assert!(
        matches!(unlinked, Err(Error::NotSupported { feature: Feature::PeerAccess, device: Some(0) })),
        "{unlinked:?}"
    );
    // The driver's answer for one device, given without asking it.
    let same = PeerAccess::enable(&ctx[0], &ctx[0]);
    assert!(matches!(same, Err(Error::PeerAccessUnsupported { .. })), "{same:?}");
    assert_eq!(
        ctl.calls_on_this_thread("cuCtxEnablePeerAccess"),
        before,
        "the driver was asked to enable a pair known to be refused"
    );
    assert!(!PeerAccess::is_enabled(&ctx[0], &ctx[2]) && !PeerAccess::is_enabled(&ctx[0], &ctx[0]));
    // Device 0 reaches a peer, so it supports peer access; which peer is the pair's question.
    let caps = Device::get(0).unwrap().capabilities().unwrap();
    assert!(caps.peer_access && caps.require(Feature::PeerAccess).is_ok());
}

#[test]
#[serial] // holds a stream with a gate
fn a_queued_peer_copy_waits_for_the_source_buffers_earlier_work() {
    let Some(ctx) = contexts(3) else { return };
    let s: Vec<Stream> = ctx.iter().map(|c| Stream::non_blocking(c).unwrap()).collect();
    let n = 4096;
    for dst_dev in [1, 2] {
        let mut src = DeviceBuffer::<u32>::zeroed(&s[0], n).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(&s[dst_dev], n).unwrap();
        let gate = hold(&s[0]);
        s[0].fill(&mut src, 0xC0FFEE).unwrap();
        // Queued on the destination's stream: only the buffer's order says to wait for s[0].
        let done = s[dst_dev].copy_peer(&src, &mut dst).unwrap();
        settle();
        gate.release();
        s[dst_dev].synchronize().unwrap();
        let got = dst.to_vec().unwrap();
        let stale = got.iter().filter(|&&v| v != 0xC0FFEE).count();
        assert_eq!(stale, 0, "copy to device {dst_dev} ({:?}) did not wait for the fill", done.path());
        drop(done);
    }
}

#[test]
#[serial] // holds a stream with a gate
fn later_users_of_the_destination_wait_for_a_queued_peer_copy() {
    let Some(ctx) = contexts(3) else { return };
    let s: Vec<Stream> = ctx.iter().map(|c| Stream::non_blocking(c).unwrap()).collect();
    let n = 4096;
    for dst_dev in [1, 2] {
        let src = DeviceBuffer::from_slice(&s[0], &vec![5u32; n]).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(&s[dst_dev], n).unwrap();
        let gate = hold(&s[0]);
        // Queued on the (held) source stream; then a fill of the destination on its own stream
        // must come after it, or the copy's bytes would land over the fill.
        let done = s[0].copy_peer(&src, &mut dst).unwrap();
        s[dst_dev].fill(&mut dst.slice_mut(..16).unwrap(), 1u32).unwrap();
        settle();
        gate.release();
        let got = dst.to_vec().unwrap();
        let overwritten = got[..16].iter().filter(|&&v| v != 1).count();
        assert_eq!(overwritten, 0, "copy to device {dst_dev} ({:?}) landed over the later fill", done.path());
        assert!(got[16..].iter().all(|&v| v == 5), "copy to device {dst_dev} lost bytes");
        drop(done);
    }
}

#[test]
#[serial] // holds a stream with a gate
fn freeing_the_source_right_after_a_queued_peer_copy_waits_for_the_copy_to_read_it() {
    let Some(ctx) = contexts(3) else { return };
    let s: Vec<Stream> = ctx.iter().map(|c| Stream::non_blocking(c).unwrap()).collect();
    let n = 1 << 16;
    let data = random(n, 3);
    // Queued on the source's stream and on the destination's, to a linked and an unlinked
    // device: the held stream is the one whose work reads the source.
    for (dst_dev, on) in [(1, 0), (1, 1), (2, 0)] {
        let src = DeviceBuffer::from_slice(&s[0], &data).unwrap();
        let mut dst = DeviceBuffer::<u64>::zeroed(&s[dst_dev], n).unwrap();
        s[0].synchronize().unwrap();
        let gate = hold(&s[on]);
        let done = s[on].copy_peer(&src, &mut dst).unwrap();
        let opener = gate.release_after(std::time::Duration::from_millis(100));
        // Freeing the source must wait for the copy; the memory reused at once must not feed it.
        drop(src);
        let mut reused = DeviceBuffer::<u32>::zeroed(&s[0], 2 * n).unwrap();
        s[0].fill(&mut reused, u32::MAX).unwrap();
        opener.join().unwrap();
        let path = done.path();
        drop(done);
        let got = dst.to_vec().unwrap();
        let wrong = got.iter().zip(&data).filter(|(g, d)| g != d).count();
        assert_eq!(wrong, 0, "copy to device {dst_dev} on device {on} ({path:?}) read freed memory");
        assert!(reused.to_vec().unwrap().iter().all(|&v| v == u32::MAX));
        if let Some(ctl) = testing::sim_control() {
            let violations = ctl.violations_on_this_thread();
            assert!(violations.is_empty(), "{violations:?}");
        }
    }
}

#[test]
#[parallel]
fn direct_copies_name_each_buffer_with_its_own_context() {
    let Some(ctx) = contexts(2) else { return };
    // A real driver finds both ends by address and copies whatever contexts it is given; the
    // simulator logs a context that is not its memory's, which is how swapped arguments show.
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("reads the simulator's log of wrong contexts: simulator only");
    };
    let s: Vec<Stream> = ctx.iter().map(|c| Stream::non_blocking(c).unwrap()).collect();
    let data = random(1000, 4);
    let src = DeviceBuffer::from_slice(&s[0], &data).unwrap();
    let mut dst = DeviceBuffer::<u64>::zeroed(&s[1], data.len()).unwrap();
    assert_eq!(copy_peer(&src, &mut dst).unwrap().path(), PeerPath::Direct);
    drop(s[0].copy_peer(&src, &mut dst).unwrap());
    drop(s[1].copy_peer(&src, &mut dst).unwrap());
    assert_eq!(dst.to_vec().unwrap(), data);
    let mismatched: Vec<_> = ctl
        .violations_on_this_thread()
        .into_iter()
        .filter(|v| v.function.starts_with("cuMemcpyPeer"))
        .collect();
    assert!(mismatched.is_empty(), "{mismatched:?}");
}
