//! A driver error in the middle of a flush or a poll (injected into the simulator's copies) leaves
//! the channel either as it was (nothing published, nothing received: the same call again
//! delivers everything once) or as published (the device has the messages, and the host's
//! positions and counters say so), never in between: no message is lost or delivered twice, no
//! later call mistakes the device's progress for a protocol breach, and the counters stay true.

mod common;

use common::{DevicePlayer, HEAD, SEQUENCE, TAIL, native};
use cumem_channel::{ChannelError, Direction, Poll, RingChannel, StrategyKind, TransferStrategy};
use cumem_core::{Device, Stream};
use cumem_sys::sim_control::{Control, FaultRule};
use cumem_sys::sys::CUresult;
use cumem_sys::testing;

const SIM: &str = "devices=1,latency_us=300";

/// The copy call each host write of a strategy goes through, on this thread.
fn write_call(kind: StrategyKind) -> &'static str {
    match kind {
        StrategyKind::Sync => "cuMemcpyHtoD_v2",
        _ => "cuMemcpyHtoDAsync_v2",
    }
}

fn control() -> Option<Control> {
    testing::init_with(SIM);
    let ctl = testing::sim_control();
    if ctl.is_none() {
        testing::skip("injects driver faults: simulator only");
    }
    ctl
}

fn channel<T: bytemuck::Pod>(kind: StrategyKind, dir: Direction) -> (RingChannel<T>, DevicePlayer<T>) {
    let device = Device::get(0).unwrap();
    let ctx = device.context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let strategy = match kind {
        StrategyKind::Sync => TransferStrategy::Sync,
        _ => TransferStrategy::Async { stream: Stream::non_blocking(&ctx).unwrap() },
    };
    let ch = RingChannel::new_checked(&stream, dir, 4, strategy, &native(device)).unwrap();
    (ch, DevicePlayer::new(&Stream::non_blocking(&ctx).unwrap(), 4))
}

/// Runs `f` with the `nth` next call of `function` on this thread failing.
fn failing<R>(ctl: &Control, function: &str, nth: u64, f: impl FnOnce() -> R) -> R {
    let rule = ctl.inject_fault(FaultRule {
        function: function.into(),
        nth,
        code: CUresult::CUDA_ERROR_INVALID_VALUE,
        times: 1,
        this_thread_only: true,
    });
    let result = f();
    ctl.remove_fault(rule);
    result
}

/// Whether `e` is the injected failure of `call`.
fn is_injected(e: &ChannelError, call: &str) -> bool {
    matches!(e, ChannelError::Cuda(_)) && e.to_string().contains(call)
}

#[test]
fn a_flush_that_fails_after_publishing_says_it_published() {
    let Some(ctl) = control() else { return };
    for kind in [StrategyKind::Sync, StrategyKind::Async] {
        let (mut ch, mut dev) = channel::<u32>(kind, Direction::HostToDevice);
        let call = write_call(kind);
        // The fault's position relies on a flush writing the tail and then the sequence, one
        // call each, as its last two writes.
        let before = ctl.calls_on_this_thread(call);
        assert_eq!(ch.send_batch(&[1]).unwrap(), 1);
        assert_eq!(ch.flush_to_device().unwrap(), 1);
        assert_eq!(ctl.calls_on_this_thread(call) - before, 2 + u64::from(kind == StrategyKind::Sync));
        assert_eq!(dev.consume(&mut ch, 8), [1], "{kind}");

        assert_eq!(ch.send_batch(&[2, 3, 4]).unwrap(), 3);
        let nth = 2 + u64::from(kind == StrategyKind::Sync); // slots (Sync only), tail, sequence
        let err = failing(&ctl, call, nth, || ch.flush_to_device()).unwrap_err();
        assert!(is_injected(&err, call), "{kind}: {err}");
        // `tail` was written: the device has the three messages, and the host must know it.
        assert_eq!(ch.staged(), 0, "{kind}: published messages are still staged");
        let stats = ch.stats();
        assert_eq!((stats.messages_sent, stats.bytes_sent, stats.flushes), (4, 16, 2), "{kind}");
        assert_eq!(dev.consume(&mut ch, 8), [2, 3, 4], "{kind}");
        // The device's head (4) is not ahead of what the host published.
        ch.refresh().unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert_eq!(ch.send_batch(&[5, 6, 7, 8]).unwrap(), 4, "{kind}");
        assert_eq!(ch.flush_to_device().unwrap(), 4);
        let words = dev.control(&mut ch);
        assert_eq!((words[TAIL], words[SEQUENCE]), (8, 3), "{kind}: the next flush writes the full count");
        assert_eq!(dev.consume(&mut ch, 8), [5, 6, 7, 8], "{kind}: delivered twice or lost");
        assert_eq!(ch.stats().messages_sent, 8);

        // With nothing staged after the failure, the next flush (here `close`'s) writes it too.
        assert_eq!(ch.send_batch(&[9]).unwrap(), 1);
        let err = failing(&ctl, call, nth, || ch.flush_to_device()).unwrap_err();
        assert!(is_injected(&err, call), "{kind}: {err}");
        assert_eq!(dev.control(&mut ch)[SEQUENCE], 3, "{kind}: the failed write");
        ch.close().unwrap();
        let words = dev.control(&mut ch);
        assert_eq!((words[TAIL], words[SEQUENCE]), (9, 4), "{kind}: close publishes the sequence");
    }
}

#[test]
fn a_flush_that_fails_before_publishing_keeps_every_message_staged() {
    let Some(ctl) = control() else { return };
    // Sync: the slot copy (1) or the tail (2) fails; Async: the tail (1; its slots go by 2D copy).
    for (kind, nth) in [(StrategyKind::Sync, 1), (StrategyKind::Sync, 2), (StrategyKind::Async, 1)] {
        let (mut ch, mut dev) = channel::<u32>(kind, Direction::HostToDevice);
        assert_eq!(ch.send_batch(&[1, 2, 3]).unwrap(), 3);
        let err = failing(&ctl, write_call(kind), nth, || ch.flush_to_device()).unwrap_err();
        assert!(is_injected(&err, write_call(kind)), "{kind} {nth}: {err}");
        assert_eq!(ch.staged(), 3, "{kind} {nth}");
        assert_eq!(ch.stats().messages_sent, 0, "{kind} {nth}");
        assert_eq!(dev.control(&mut ch)[TAIL], 0, "{kind} {nth}: published by a failed flush");
        assert_eq!(ch.flush_to_device().unwrap(), 3);
        assert_eq!(dev.consume(&mut ch, 8), [1, 2, 3], "{kind} {nth}");
        assert_eq!(ch.stats().messages_sent, 3);
    }
}

#[test]
fn a_poll_that_fails_receives_nothing_and_loses_nothing() {
    let Some(ctl) = control() else { return };
    for kind in [StrategyKind::Sync, StrategyKind::Async] {
        let (mut ch, mut dev) = channel::<u32>(kind, Direction::DeviceToHost);
        assert_eq!(dev.produce(&mut ch, &[1, 2, 3]), 3);
        // Giving the slots back (the host's only write in a poll) fails after they were read.
        let mut got = vec![99];
        let err = failing(&ctl, write_call(kind), 1, || ch.poll_from_device(&mut got)).unwrap_err();
        assert!(is_injected(&err, write_call(kind)), "{kind}: {err}");
        assert_eq!(got, [99], "{kind}: a failed poll handed out messages");
        assert_eq!(ch.stats().messages_received, 0, "{kind}");
        assert_eq!(dev.control(&mut ch)[HEAD], 0, "{kind}: slots given back by a failed poll");
        assert_eq!(ch.poll_from_device(&mut got).unwrap(), Poll::Received(3));
        assert_eq!(got, [99, 1, 2, 3], "{kind}");
        let stats = ch.stats();
        assert_eq!((stats.messages_received, stats.bytes_received), (3, 12), "{kind}");
        assert_eq!((stats.polls, stats.empty_polls), (1, 0), "{kind}: the failed poll counted");
    }
}
