//! Random interleavings of send / flush / poll against a `VecDeque` model, for every strategy, on
//! the simulator with stream latency (a missing wait reads stale slots or positions): every message
//! arrives exactly once and in order, and a full ring refuses exactly when the model says, losing
//! nothing it accepted.

mod common;

use std::collections::VecDeque;
use std::time::Duration;

use common::{DevicePlayer, native};
use cumem_channel::{Direction, Poll, RingChannel, SendStatus, SlotPool, TransferStrategy};
use cumem_core::{Device, Stream};
use cumem_sys::testing;
use proptest::prelude::*;

/// Streams start work 300 µs late: queued copies really land after the call that queued them.
const SIM: &str = "devices=2,latency_us=300";

/// 12 bytes: slots are not a power of two wide, so byte offsets of wrapped pieces are exercised.
type Msg = [u32; 3];

fn msg(id: u64) -> Msg {
    [id as u32, (id >> 32) as u32, (id as u32).wrapping_mul(2_654_435_761)]
}

fn strategy(kind: usize, ctx: &cumem_core::Context) -> TransferStrategy {
    match kind {
        0 => TransferStrategy::Sync,
        1 => TransferStrategy::Async { stream: Stream::non_blocking(ctx).unwrap() },
        2 => TransferStrategy::Unified,
        _ => TransferStrategy::MappedPolling { interval: Duration::from_micros(5) },
    }
}

#[derive(Debug, Clone)]
enum HostOp {
    TrySend,
    Send,
    SendBatch(usize),
    Flush,
    DeviceConsume(usize),
}

fn host_ops() -> impl Strategy<Value = Vec<HostOp>> {
    let op = prop_oneof![
        3 => Just(HostOp::TrySend),
        2 => Just(HostOp::Send),
        2 => (0usize..12).prop_map(HostOp::SendBatch),
        2 => Just(HostOp::Flush),
        2 => (0usize..12).prop_map(HostOp::DeviceConsume),
    ];
    prop::collection::vec(op, 1..30)
}

/// Host→device: the model is the device's view (published, consumed) and the host's (staged,
/// cached head), mirrored step by step.
fn host_to_device(kind: usize, capacity: usize, ops: Vec<HostOp>) {
    testing::init_with(SIM);
    let device = Device::get(0).unwrap();
    let ctx = device.context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let mut ch = RingChannel::<Msg>::new_checked(
        &stream,
        Direction::HostToDevice,
        capacity,
        strategy(kind, &ctx),
        &native(device),
    )
    .unwrap();
    let mut dev = DevicePlayer::<Msg>::new(&Stream::non_blocking(&ctx).unwrap(), capacity);

    let cap = capacity as u64;
    let mut in_ring: VecDeque<Msg> = VecDeque::new(); // staged or published, not consumed
    let (mut staged, mut published, mut consumed, mut known_head) = (0u64, 0u64, 0u64, 0u64);
    let (mut next, mut refused, mut delivered) = (0u64, 0u64, Vec::new());
    let mut accepted = Vec::new();
    for op in ops {
        let free = |staged: u64, known_head: u64| cap - (published - known_head) - staged;
        match op {
            HostOp::TrySend | HostOp::Send => {
                if matches!(op, HostOp::Send) && free(staged, known_head) == 0 {
                    known_head = consumed;
                }
                let m = msg(next);
                next += 1;
                let expect = if free(staged, known_head) > 0 { SendStatus::Sent } else { SendStatus::Full };
                let got = if matches!(op, HostOp::Send) { ch.send(m) } else { ch.try_send(m) }.unwrap();
                assert_eq!(got, expect);
                if got == SendStatus::Sent {
                    staged += 1;
                    in_ring.push_back(m);
                    accepted.push(m);
                } else {
                    refused += 1;
                }
            }
            HostOp::SendBatch(k) => {
                if free(staged, known_head) < k as u64 {
                    known_head = consumed;
                }
                let batch: Vec<Msg> = (next..next + k as u64).map(msg).collect();
                next += k as u64;
                let taken = (free(staged, known_head) as usize).min(k);
                assert_eq!(ch.send_batch(&batch).unwrap(), taken);
                staged += taken as u64;
                refused += (k - taken) as u64;
                in_ring.extend(&batch[..taken]);
                accepted.extend(&batch[..taken]);
            }
            HostOp::Flush => {
                assert_eq!(ch.flush_to_device().unwrap(), staged as usize);
                published += staged;
                staged = 0;
            }
            HostOp::DeviceConsume(max) => {
                let got = dev.consume(&mut ch, max);
                let n = (published - consumed).min(max as u64) as usize;
                let expect: Vec<Msg> = in_ring.drain(..n).collect();
                assert_eq!(got, expect, "the device read other messages than were published");
                consumed += n as u64;
                delivered.extend(got);
            }
        }
    }
    // Drain: whatever was accepted arrives, once, in order.
    ch.flush_to_device().unwrap();
    loop {
        let got = dev.consume(&mut ch, capacity);
        if got.is_empty() {
            break;
        }
        delivered.extend(got);
    }
    assert_eq!(delivered, accepted);
    let stats = ch.stats();
    assert_eq!(stats.messages_sent, accepted.len() as u64);
    assert_eq!(stats.bytes_sent, accepted.len() as u64 * 12);
    assert_eq!(stats.full, refused);
}

#[derive(Debug, Clone)]
enum DeviceOp {
    Produce(usize),
    Poll,
    PollAtMost(usize),
    PollBatch,
}

fn device_ops() -> impl Strategy<Value = Vec<DeviceOp>> {
    let op = prop_oneof![
        3 => (0usize..12).prop_map(DeviceOp::Produce),
        2 => Just(DeviceOp::Poll),
        2 => (0usize..6).prop_map(DeviceOp::PollAtMost),
        1 => Just(DeviceOp::PollBatch),
    ];
    prop::collection::vec(op, 1..30)
}

/// Device→host: the device produces what fits (back-pressure on its side), the host polls.
fn device_to_host(kind: usize, capacity: usize, ops: Vec<DeviceOp>) {
    testing::init_with(SIM);
    let device = Device::get(0).unwrap();
    let ctx = device.context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let mut ch = RingChannel::<Msg>::new_checked(
        &stream,
        Direction::DeviceToHost,
        capacity,
        strategy(kind, &ctx),
        &native(device),
    )
    .unwrap();
    let mut dev = DevicePlayer::<Msg>::new(&Stream::non_blocking(&ctx).unwrap(), capacity);
    let pool = SlotPool::<Msg>::new(3, 1).unwrap();

    let mut in_ring: VecDeque<Msg> = VecDeque::new();
    let (mut next, mut produced, mut received, mut empty) =
        (0u64, Vec::<Msg>::new(), Vec::<Msg>::new(), 0u64);
    let mut check_poll = |max: usize, got: Vec<Msg>, in_ring: &mut VecDeque<Msg>, received: &mut Vec<Msg>| {
        let n = in_ring.len().min(max);
        let expect: Vec<Msg> = in_ring.drain(..n).collect();
        assert_eq!(got, expect, "the host received other messages than the device published");
        if n == 0 {
            empty += 1;
        }
        received.extend(got);
    };
    for op in ops {
        match op {
            DeviceOp::Produce(k) => {
                let batch: Vec<Msg> = (next..next + k as u64).map(msg).collect();
                next += k as u64;
                let fit = (capacity - in_ring.len()).min(k);
                assert_eq!(dev.produce(&mut ch, &batch), fit);
                in_ring.extend(&batch[..fit]);
                produced.extend(&batch[..fit]);
            }
            DeviceOp::Poll | DeviceOp::PollAtMost(_) => {
                let max = if let DeviceOp::PollAtMost(m) = op { m } else { usize::MAX };
                let mut got = Vec::new();
                let status = ch.poll_at_most(&mut got, max).unwrap();
                let expect_n = in_ring.len().min(max);
                assert_eq!(status, if expect_n == 0 { Poll::Empty } else { Poll::Received(expect_n) });
                check_poll(max, got, &mut in_ring, &mut received);
            }
            DeviceOp::PollBatch => {
                let got = ch.poll_batch(&pool).unwrap().map(|s| s.to_vec()).unwrap_or_default();
                check_poll(pool.slot_len(), got, &mut in_ring, &mut received);
            }
        }
    }
    let mut rest = Vec::new();
    while ch.poll_from_device(&mut rest).unwrap() != Poll::Empty {}
    received.extend(rest);
    assert_eq!(received, produced);
    let stats = ch.stats();
    assert_eq!(stats.messages_received, produced.len() as u64);
    assert_eq!(stats.bytes_received, produced.len() as u64 * 12);
    assert_eq!(stats.empty_polls, empty + 1);
    let p = pool.stats();
    assert_eq!(p.hits + p.misses, p.returns + p.discarded, "every pooled batch went back");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn sync_host_to_device(capacity in 1usize..7, ops in host_ops()) { host_to_device(0, capacity, ops) }

    #[test]
    fn async_host_to_device(capacity in 1usize..7, ops in host_ops()) { host_to_device(1, capacity, ops) }

    #[test]
    fn unified_host_to_device(capacity in 1usize..7, ops in host_ops()) { host_to_device(2, capacity, ops) }

    #[test]
    fn mapped_host_to_device(capacity in 1usize..7, ops in host_ops()) { host_to_device(3, capacity, ops) }

    #[test]
    fn sync_device_to_host(capacity in 1usize..7, ops in device_ops()) { device_to_host(0, capacity, ops) }

    #[test]
    fn async_device_to_host(capacity in 1usize..7, ops in device_ops()) { device_to_host(1, capacity, ops) }

    #[test]
    fn unified_device_to_host(capacity in 1usize..7, ops in device_ops()) { device_to_host(2, capacity, ops) }

    #[test]
    fn mapped_device_to_host(capacity in 1usize..7, ops in device_ops()) { device_to_host(3, capacity, ops) }
}
