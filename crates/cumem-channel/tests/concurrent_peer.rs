//! A persistent kernel's view of rings in memory both sides address (`Unified`, `MappedPolling`):
//! a thread plays the kernel, spinning on the control words with `Acquire` loads and publishing
//! with `Release` stores through the rings' device addresses (which are host addresses too, as
//! under UVA), while the host sends and polls at the same time. Every message comes back whole and
//! in order through rings of four slots, so both sides wrap and wait on each other many times.
//!
//! The host side touches the ring memory only through atomics and raw-pointer copies; with
//! references over memory the peer writes concurrently (as before), this exchange is a data race
//! in Rust's memory model, whatever x86 makes of it.

mod common;

use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{FLAGS, HEAD, TAIL, native};
use cumem_channel::{Direction, FLAG_CLOSED, RingArgs, RingChannel, SendStatus, TransferStrategy};
use cumem_core::{Device, Stream};
use cumem_sys::testing;
use serial_test::serial;

type Msg = [u64; 3];

const MESSAGES: u64 = 2000;

fn message(i: u64) -> Msg {
    [i, i.wrapping_mul(0x9e37_79b9_7f4a_7c15), !i]
}

fn reply(m: Msg) -> Msg {
    [m[0] + 1, m[1] ^ 0xffff, m[2].rotate_left(7)]
}

/// Control word `index` of the block at device (= host) address `control`.
fn word(control: u64, index: usize) -> &'static AtomicU64 {
    let base: *mut u64 = ptr::with_exposed_provenance_mut(control as usize);
    // SAFETY: the block is a live host-accessible allocation of 64 aligned words that outlives the
    // peer thread (joined before the channels drop), and both sides access its words atomically.
    unsafe { AtomicU64::from_ptr(base.add(index)) }
}

/// The kernel (the loop of the skeleton in `docs/channels.md`): consumes requests from `rx`,
/// answers each on `tx`, returns when `rx` is closed and drained. `at_empty` runs each time it
/// found the ring empty, before it reads `flags`.
fn peer(rx: RingArgs, tx: RingArgs, mut at_empty: impl FnMut()) {
    let requests: *const Msg = ptr::with_exposed_provenance(rx.slots as usize);
    let replies: *mut Msg = ptr::with_exposed_provenance_mut(tx.slots as usize);
    let (mut head, mut out_tail) = (0u64, 0u64);
    loop {
        let tail = word(rx.control, TAIL).load(Ordering::Acquire);
        if head == tail {
            at_empty();
            if word(rx.control, FLAGS).load(Ordering::Acquire) & FLAG_CLOSED != 0 {
                // The host's last publish may have landed after the `tail` read above: drain it.
                if word(rx.control, TAIL).load(Ordering::Acquire) == head {
                    return;
                }
                continue;
            }
            std::thread::yield_now();
            continue;
        }
        while head != tail {
            // SAFETY: slot `head` lies below the `tail` acquired above, so the host wrote it before
            // publishing and does not write it again until `head` moves past it.
            let request = unsafe { ptr::read(requests.add((head % rx.capacity) as usize)) };
            while out_tail - word(tx.control, HEAD).load(Ordering::Acquire) == tx.capacity {
                std::thread::yield_now();
            }
            // SAFETY: the host gave slot `out_tail` back (acquired `head` above) and reads it only
            // after the `tail` released below.
            unsafe { ptr::write(replies.add((out_tail % tx.capacity) as usize), reply(request)) };
            out_tail += 1;
            head += 1;
            word(tx.control, TAIL).store(out_tail, Ordering::Release);
            word(rx.control, HEAD).store(head, Ordering::Release);
        }
    }
}

#[test]
#[serial] // each test ends with an empty live report
fn a_spinning_peer_and_the_host_exchange_every_message_whole() {
    testing::init_with("devices=1");
    let device = Device::get(0).unwrap();
    let ctx = device.context().unwrap();
    let strategies =
        [TransferStrategy::Unified, TransferStrategy::MappedPolling { interval: Duration::ZERO }];
    for strategy in strategies {
        let kind = strategy.kind();
        let stream = Stream::non_blocking(&ctx).unwrap();
        let report = native(device);
        let mut to =
            RingChannel::<Msg>::new_checked(&stream, Direction::HostToDevice, 4, strategy.clone(), &report)
                .unwrap();
        let mut from =
            RingChannel::<Msg>::new_checked(&stream, Direction::DeviceToHost, 4, strategy, &report).unwrap();
        stream.synchronize().unwrap();
        let (rx, tx) = (to.ring_args(), from.ring_args());
        let kernel = std::thread::spawn(move || peer(rx, tx, || ()));
        let (mut next, mut got) = (0u64, Vec::new());
        // A lost message would leave this loop waiting for ever: fail instead (not a timing check).
        let give_up = Instant::now() + Duration::from_secs(60);
        while (got.len() as u64) < MESSAGES {
            assert!(Instant::now() < give_up, "{kind}: {} of {MESSAGES} replies, then none", got.len());
            while next < MESSAGES {
                match to.send(message(next)).unwrap() {
                    SendStatus::Sent => next += 1,
                    SendStatus::Full => break,
                }
            }
            to.flush_to_device().unwrap();
            from.poll_from_device(&mut got).unwrap();
            std::thread::yield_now();
        }
        to.close().unwrap();
        kernel.join().unwrap();
        let expected: Vec<Msg> = (0..MESSAGES).map(|i| reply(message(i))).collect();
        assert!(got == expected, "{kind}: replies lost, torn or out of order");
        assert_eq!(to.stats().messages_sent, MESSAGES, "{kind}");
        assert_eq!(from.stats().messages_received, MESSAGES, "{kind}");
    }
    drop(ctx);
    assert_live_report_is_clean();
}

/// Messages published right before `close` (by an explicit flush, or by `close` itself) reach a
/// kernel that had just found the ring empty and reads `flags` only after the close: it drains
/// them before it returns.
#[test]
#[serial]
fn messages_sent_right_before_close_are_drained() {
    testing::init_with("devices=1");
    let device = Device::get(0).unwrap();
    let ctx = device.context().unwrap();
    let strategies =
        [TransferStrategy::Unified, TransferStrategy::MappedPolling { interval: Duration::ZERO }];
    for strategy in strategies {
        for flush_first in [true, false] {
            let kind = strategy.kind();
            let stream = Stream::non_blocking(&ctx).unwrap();
            let report = native(device);
            let mut to = RingChannel::<Msg>::new_checked(
                &stream,
                Direction::HostToDevice,
                4,
                strategy.clone(),
                &report,
            )
            .unwrap();
            let mut from = RingChannel::<Msg>::new_checked(
                &stream,
                Direction::DeviceToHost,
                4,
                strategy.clone(),
                &report,
            )
            .unwrap();
            stream.synchronize().unwrap();
            let (rx, tx) = (to.ring_args(), from.ring_args());
            let (found_empty, wait_for_it) = mpsc::channel::<()>();
            let (go, held) = mpsc::channel::<()>();
            let mut first = true;
            // The kernel finds the ring empty once, then waits there for the host's close.
            let kernel = std::thread::spawn(move || {
                peer(rx, tx, move || {
                    if std::mem::take(&mut first) {
                        found_empty.send(()).unwrap();
                        held.recv().unwrap();
                    }
                })
            });
            wait_for_it.recv().unwrap();
            let msgs: Vec<Msg> = (0..3).map(message).collect();
            assert_eq!(to.send_batch(&msgs).unwrap(), 3);
            if flush_first {
                assert_eq!(to.flush_to_device().unwrap(), 3);
            }
            to.close().unwrap();
            assert_eq!(to.staged(), 0, "{kind}: close left messages staged");
            go.send(()).unwrap();
            kernel.join().unwrap();
            let mut got = Vec::new();
            from.poll_from_device(&mut got).unwrap();
            let expected: Vec<Msg> = msgs.into_iter().map(reply).collect();
            assert_eq!(got, expected, "{kind} (flushed first: {flush_first}): the kernel stopped early");
        }
    }
    drop(ctx);
    assert_live_report_is_clean();
}

fn assert_live_report_is_clean() {
    let Some(ctl) = testing::sim_control() else { return };
    let report = ctl.live_report();
    assert!(report.allocations.is_empty(), "leaked: {:?}", report.allocations);
}
