//! Ordering between the host and device work it did not wait for, shown with held streams: a
//! queued flush returns while its copies cannot run (a later flush too: it waits for the previous
//! flush's copies only), and the device side still reads exactly what was published once they do; device work the host has not seen complete is waited for before
//! the host reads the ring, whatever the strategy; a device side that moves a position before its
//! slot work is done (the slots on one stream, the position on another) still cannot make the host
//! read slots it is writing or overwrite slots it is reading; and a persistent kernel occupying the
//! stream the channel was made on never blocks the host's flushes and reads; and dropping a channel
//! while device work on its ring is held waits for that work (or orders the free after it), for
//! every strategy and direction, with no violation in the simulator's log. Every test here holds a stream,
//! so every test is `#[serial]` (see `cumem_sys::testing::Gate`), and every gate opens by itself at
//! a deadline (`common::hold`), so that a call waiting for the held stream fails the test instead
//! of hanging the run.
//!
//! The device's work on a held stream always has one end in device memory: a copy between two
//! host memories (pinned memory and a mapped ring) is synchronous on a GPU (observed on an H100,
//! 2026-11-23) and would wait in the call for the gate that only the next statement opens.

mod common;

use std::time::Duration;

use common::{DevicePlayer, HEAD, SEQUENCE, TAIL, hold, native};
use cumem_channel::{Direction, Poll, RingChannel, SendStatus, TransferStrategy};
use cumem_copy::StreamCopy;
use cumem_core::{Context, Device, DeviceBuffer, PinnedBuffer, Stream};
use cumem_sys::testing;
use serial_test::serial;

const SIM: &str = "devices=2,latency_us=2000";

/// A host-to-device ring of four `[u64; 3]` slots whose flushes queue their copies on `copies`,
/// and a device side reading it on a stream of its own.
struct AsyncRing {
    ctx: Context,
    /// The stream the ring was made on.
    stream: Stream,
    copies: Stream,
    ch: RingChannel<[u64; 3]>,
    dev: DevicePlayer<[u64; 3]>,
}

fn async_ring() -> AsyncRing {
    testing::init_with(SIM);
    let device = Device::get(0).unwrap();
    let ctx = device.context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let copies = Stream::non_blocking(&ctx).unwrap();
    let ch = RingChannel::<[u64; 3]>::new_checked(
        &stream,
        Direction::HostToDevice,
        4,
        TransferStrategy::Async { stream: copies.clone() },
        &native(device),
    )
    .unwrap();
    let dev = DevicePlayer::<[u64; 3]>::new(&Stream::non_blocking(&ctx).unwrap(), 4);
    AsyncRing { ctx, stream, copies, ch, dev }
}

#[test]
#[serial]
fn a_queued_flush_returns_while_its_copies_are_held_and_arrives_whole() {
    let AsyncRing { ctx: _ctx, stream, copies, mut ch, mut dev } = async_ring();
    // The ring's first use on `copies` happens under the gate: order the allocation first.
    stream.synchronize().unwrap();
    let msgs: Vec<[u64; 3]> = (0..4u64).map(|i| [i, i * i, !i]).collect();
    let gate = hold(&copies);
    assert_eq!(ch.send_batch(&msgs).unwrap(), 4);
    // Returns with the slot and tail copies still held on `copies`: a flush does not wait.
    assert_eq!(ch.flush_to_device().unwrap(), 4);
    let opener = gate.release_after(Duration::from_millis(50));
    // The device side's reads on its own stream are ordered after the held copies.
    assert_eq!(dev.consume(&mut ch, 8), msgs);
    opener.join().unwrap();
}

/// How long a flush that must not wait for the held stream gets before the test calls it a wait:
/// far longer than a flush takes (a few driver calls), far shorter than the gate's deadline.
const NO_WAIT: Duration = Duration::from_secs(5);

#[test]
#[serial]
fn a_later_queued_flush_waits_for_the_previous_flush_only_never_its_own_copies() {
    let AsyncRing { ctx: _ctx, stream: _stream, copies, mut ch, mut dev } = async_ring();
    // Bit patterns no arithmetic slip reproduces: the comparisons below are bitwise.
    let first = [0x8000_0000_0000_0001, u64::MAX, 0x7ff8_dead_beef_0001];
    let second = [0x0123_4567_89ab_cdef, 0, !0x0123_4567_89ab_cdef];
    assert_eq!(ch.send(first).unwrap(), SendStatus::Sent);
    assert_eq!(ch.flush_to_device().unwrap(), 1);
    assert_eq!(dev.consume(&mut ch, 8), [first]);
    copies.synchronize().unwrap();
    dev.stream.synchronize().unwrap();
    let mut seen = DeviceBuffer::<[u64; 3]>::zeroed(&dev.stream, 4).unwrap();
    dev.stream.synchronize().unwrap();
    // The copies stream itself cannot be held: the second flush must wait for the first one's
    // copies out of the staging buffers, which synchronises it. Instead the device side reads the
    // slots on a held stream, so the second flush's slot copies (ordered after that read by the
    // slots' stream order) are queued on `copies` behind the gate, and anything that synchronises
    // `copies` after queuing them waits for the gate.
    let gate = hold(&dev.stream);
    dev.stream.copy_d2d(&ch.device_side().slots, &mut seen).unwrap();
    let (in_time, mut ch, n) = flush_on_a_thread(ch, second, NO_WAIT, gate);
    assert!(in_time, "the second flush waited for its own copies");
    assert_eq!(n, 1);
    // Once the gate is open the copies run, and the device side sees both messages whole.
    assert_eq!(dev.consume(&mut ch, 8), [second]);
    let words = dev.control(&mut ch);
    assert_eq!((words[HEAD], words[TAIL], words[SEQUENCE]), (2, 2, 2));
    drop(ch);
    drop(dev);
    drop(seen);
    assert_live_report_is_clean();
}

/// Sends `msg` and flushes it on another thread while `gate` holds a stream: whether the flush
/// returned within `within`, then, with the gate released, the channel and what the flush sent.
fn flush_on_a_thread(
    mut ch: RingChannel<[u64; 3]>,
    msg: [u64; 3],
    within: Duration,
    gate: testing::Gate,
) -> (bool, RingChannel<[u64; 3]>, usize) {
    let (done, flushed) = std::sync::mpsc::channel();
    let flusher = std::thread::spawn(move || {
        assert_eq!(ch.send(msg).unwrap(), SendStatus::Sent);
        let n = ch.flush_to_device().unwrap();
        done.send(()).unwrap();
        (ch, n)
    });
    let returned = flushed.recv_timeout(within).is_ok();
    gate.release();
    let (ch, n) = flusher.join().unwrap();
    (returned, ch, n)
}

/// How long a flush that must wait for the held stream is given to (wrongly) return before the
/// gate opens: a flush that did not wait returns within microseconds.
const MUST_WAIT: Duration = Duration::from_millis(300);

#[test]
#[serial]
fn a_later_queued_flush_waits_for_the_previous_flushs_copies_before_rewriting_their_staging() {
    let AsyncRing { ctx: _ctx, stream, copies, mut ch, mut dev } = async_ring();
    stream.synchronize().unwrap();
    let first = [0x8000_0000_0000_0001, u64::MAX, 0x7ff8_dead_beef_0001];
    let second = [0x0123_4567_89ab_cdef, 0, !0x0123_4567_89ab_cdef];
    let gate = hold(&copies);
    assert_eq!(ch.send(first).unwrap(), SendStatus::Sent);
    // The first flush's copies stay held on `copies`, reading the staging buffers.
    assert_eq!(ch.flush_to_device().unwrap(), 1);
    // Rewriting the staging now would change what the held copies deliver: the flush must wait.
    let (returned_early, mut ch, n) = flush_on_a_thread(ch, second, MUST_WAIT, gate);
    assert!(!returned_early, "the second flush rewrote the staging its predecessor's held copies read");
    assert_eq!(n, 1);
    assert_eq!(dev.consume(&mut ch, 8), [first, second]);
    let words = dev.control(&mut ch);
    assert_eq!((words[HEAD], words[TAIL], words[SEQUENCE]), (2, 2, 2));
    drop(ch);
    drop(dev);
    assert_live_report_is_clean();
}

#[test]
#[serial]
fn the_host_waits_for_device_publishes_it_has_not_seen_complete() {
    testing::init_with(SIM);
    let device = Device::get(0).unwrap();
    let ctx = device.context().unwrap();
    let strategies = [
        TransferStrategy::Sync,
        TransferStrategy::Async { stream: Stream::non_blocking(&ctx).unwrap() },
        TransferStrategy::Unified,
        TransferStrategy::MappedPolling { interval: Duration::from_micros(2) },
    ];
    for strategy in strategies {
        let kind = strategy.kind();
        let stream = Stream::non_blocking(&ctx).unwrap();
        let mut ch =
            RingChannel::<u32>::new_checked(&stream, Direction::DeviceToHost, 4, strategy, &native(device))
                .unwrap();
        let mut dev = DevicePlayer::<u32>::new(&Stream::non_blocking(&ctx).unwrap(), 4);
        stream.synchronize().unwrap();
        let gate = hold(&dev.stream.clone());
        dev.publish_blind(&mut ch, 0, &[5, 6, 7]);
        let opener = gate.release_after(Duration::from_millis(50));
        let mut got = Vec::new();
        // Reading `tail` waits for the device's held writes (through the memory's stream order),
        // so the host sees all three, never an empty ring or stale slots.
        assert_eq!(ch.poll_from_device(&mut got).unwrap(), Poll::Received(3), "{kind}");
        assert_eq!(got, [5, 6, 7], "{kind}");
        opener.join().unwrap();
    }
}

#[test]
#[serial]
fn a_kernel_running_on_the_channels_stream_never_blocks_the_host() {
    testing::init_with(SIM);
    let device = Device::get(0).unwrap();
    let ctx = device.context().unwrap();
    let strategies = [
        TransferStrategy::Async { stream: Stream::non_blocking(&ctx).unwrap() },
        TransferStrategy::Unified,
        TransferStrategy::MappedPolling { interval: Duration::from_micros(2) },
    ];
    for strategy in strategies {
        let kind = strategy.kind();
        let stream = Stream::non_blocking(&ctx).unwrap();
        let mut ch =
            RingChannel::<u64>::new_checked(&stream, Direction::HostToDevice, 4, strategy, &native(device))
                .unwrap();
        let mut dev = DevicePlayer::<u64>::new(&Stream::non_blocking(&ctx).unwrap(), 4);
        // The persistent kernel, launched on `stream` right after the channel was made (nothing
        // synchronised `stream`) and never finishing while the host works. Its gate opens by
        // itself at the deadline only so that a regression fails instead of hanging.
        let kernel = hold(&stream);
        assert_eq!(ch.send_batch(&[1, 2, 3]).unwrap(), 3);
        assert_eq!(ch.flush_to_device().unwrap(), 3);
        assert_eq!(dev.consume(&mut ch, 8), [1, 2, 3], "{kind}");
        ch.refresh().unwrap();
        assert_eq!(ch.send_batch(&[4, 5, 6, 7]).unwrap(), 4, "{kind}: the consumed slots came back");
        assert_eq!(ch.flush_to_device().unwrap(), 4);
        ch.refresh().unwrap();
        // Everything above returned while the kernel still held its stream.
        let in_time = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| kernel.release())).is_ok();
        assert!(in_time, "{kind}: the host waited for the persistent kernel's stream");
    }
}

fn every_strategy(ctx: &Context) -> [TransferStrategy; 4] {
    [
        TransferStrategy::Sync,
        TransferStrategy::Async { stream: Stream::non_blocking(ctx).unwrap() },
        TransferStrategy::Unified,
        TransferStrategy::MappedPolling { interval: Duration::from_micros(2) },
    ]
}

/// Queues a copy of `word` (device memory, as a kernel's register would be; allocated before any
/// stream is held: allocating or freeing may wait for held streams) into control word `index` on
/// `stream`.
fn write_word<T: bytemuck::Pod>(
    ch: &mut RingChannel<T>,
    stream: &Stream,
    index: usize,
    word: &DeviceBuffer<u64>,
) {
    let mut side = ch.device_side();
    stream.copy_d2d(word, &mut side.control.slice_mut(index..index + 1).unwrap()).unwrap();
}

#[test]
#[serial]
fn the_host_never_reads_slots_the_device_is_still_writing() {
    testing::init_with(SIM);
    let device = Device::get(0).unwrap();
    let ctx = device.context().unwrap();
    for strategy in every_strategy(&ctx) {
        let kind = strategy.kind();
        let stream = Stream::non_blocking(&ctx).unwrap();
        let mut ch =
            RingChannel::<u32>::new_checked(&stream, Direction::DeviceToHost, 4, strategy, &native(device))
                .unwrap();
        let (slow, fast) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
        let msgs = DeviceBuffer::from_slice(&slow, &[5u32, 6, 7, 0]).unwrap();
        let tail = DeviceBuffer::from_slice(&fast, &[3u64]).unwrap();
        stream.synchronize().unwrap();
        let gate = hold(&slow);
        // The device writes the slots on a held stream and publishes `tail` on another, which
        // runs at once: the position says three messages while their bytes have not landed.
        slow.copy_d2d(&msgs, &mut ch.device_side().slots).unwrap();
        write_word(&mut ch, &fast, TAIL, &tail);
        let opener = gate.release_after(Duration::from_millis(50));
        let mut got = Vec::new();
        assert_eq!(ch.poll_from_device(&mut got).unwrap(), Poll::Received(3), "{kind}");
        assert_eq!(got, [5, 6, 7], "{kind}: the host read slots before the device's write landed");
        opener.join().unwrap();
    }
}

#[test]
#[serial]
fn the_host_never_overwrites_slots_the_device_is_still_reading() {
    testing::init_with(SIM);
    let device = Device::get(0).unwrap();
    let ctx = device.context().unwrap();
    for strategy in every_strategy(&ctx) {
        let kind = strategy.kind();
        let stream = Stream::non_blocking(&ctx).unwrap();
        let mut ch =
            RingChannel::<u32>::new_checked(&stream, Direction::HostToDevice, 4, strategy, &native(device))
                .unwrap();
        let (slow, fast) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
        let mut seen = DeviceBuffer::<u32>::zeroed(&slow, 4).unwrap();
        let mut seen_host = PinnedBuffer::<u32>::zeroed(&ctx, 4).unwrap();
        let head = DeviceBuffer::from_slice(&fast, &[4u64]).unwrap();
        assert_eq!(ch.send_batch(&[1, 2, 3, 4]).unwrap(), 4);
        assert_eq!(ch.flush_to_device().unwrap(), 4);
        stream.synchronize().unwrap();
        let gate = hold(&slow);
        // The device reads the slots on a held stream but gives them back (`head`) on another,
        // which runs at once: the host sees four free slots while their old bytes are being read.
        slow.copy_d2d(&ch.device_side().slots, &mut seen).unwrap();
        write_word(&mut ch, &fast, HEAD, &head);
        let opener = gate.release_after(Duration::from_millis(50));
        ch.refresh().unwrap();
        assert_eq!(ch.send_batch(&[5, 6, 7, 8]).unwrap(), 4, "{kind}: the device gave every slot back");
        assert_eq!(ch.flush_to_device().unwrap(), 4);
        opener.join().unwrap();
        slow.copy_d2h(&seen, &mut seen_host).unwrap();
        assert_eq!(seen_host.to_vec().unwrap(), [1, 2, 3, 4], "{kind}: the host overwrote slots being read");
    }
}

#[test]
#[serial]
fn dropping_a_channel_waits_for_device_work_on_its_ring() {
    testing::init_with(SIM);
    let device = Device::get(0).unwrap();
    let ctx = device.context().unwrap();
    let ctl = testing::sim_control();
    for dir in [Direction::HostToDevice, Direction::DeviceToHost] {
        for strategy in every_strategy(&ctx) {
            let kind = strategy.kind();
            let stream = Stream::non_blocking(&ctx).unwrap();
            let mut ch = RingChannel::<u32>::new_checked(&stream, dir, 4, strategy, &native(device)).unwrap();
            let slow = Stream::non_blocking(&ctx).unwrap();
            let mut seen = DeviceBuffer::<u32>::zeroed(&slow, 4).unwrap();
            let mut seen_host = PinnedBuffer::<u32>::zeroed(&ctx, 4).unwrap();
            let late = DeviceBuffer::from_slice(&slow, &[9u32; 4]).unwrap();
            if dir == Direction::HostToDevice {
                assert_eq!(ch.send_batch(&[1, 2, 3, 4]).unwrap(), 4);
                assert_eq!(ch.flush_to_device().unwrap(), 4);
            }
            stream.synchronize().unwrap();
            let before = ctl.as_ref().map_or(0, |c| c.violations().len());
            let gate = hold(&slow);
            // Device work on the ring that cannot run yet: a read of the slots (host→device) or
            // a write into them (device→host), queued through the channel's device views.
            if dir == Direction::HostToDevice {
                slow.copy_d2d(&ch.device_side().slots, &mut seen).unwrap();
            } else {
                slow.copy_d2d(&late, &mut ch.device_side().slots).unwrap();
            }
            let opener = gate.release_after(Duration::from_millis(50));
            // The ring's memory may go back only after that work: dropping waits for it, or
            // orders the free after it, never frees under it.
            drop(ch);
            opener.join().unwrap();
            slow.synchronize().unwrap();
            if dir == Direction::HostToDevice {
                slow.copy_d2h(&seen, &mut seen_host).unwrap();
                assert_eq!(
                    seen_host.to_vec().unwrap(),
                    [1, 2, 3, 4],
                    "{kind}: read the ring after it was freed"
                );
            }
            if let Some(ctl) = &ctl {
                let after = ctl.violations();
                assert_eq!(after.len(), before, "{kind} {dir}: {:?}", &after[before..]);
            }
        }
    }
}

/// Nothing a test here made outlives it (the streams and contexts aside, which the simulator keeps
/// for the process).
fn assert_live_report_is_clean() {
    let Some(ctl) = testing::sim_control() else { return };
    let report = ctl.live_report();
    assert!(report.allocations.is_empty(), "leaked: {:?}", report.allocations);
}
