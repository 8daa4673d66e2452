//! A ring's guarantees one by one, for every strategy: batches that straddle the end land in order,
//! a full ring refuses and then recovers without losing anything, positions in the control block
//! are what the C layout says, a device side that breaks the protocol is an error, and big
//! (4 KiB) messages come back through pooled batches, and unified rings are prefetched to the
//! consumer's side (the driver's `LAST_PREFETCH_LOCATION`).

mod common;

use std::time::Duration;

use common::{DevicePlayer, FLAGS, HEAD, SEQUENCE, TAIL, native};
use cumem_channel::{
    ChannelError, ControlBlock, Direction, FLAG_CLOSED, FLAG_DEVICE_TO_HOST, Poll, RingChannel, SendStatus,
    SlotPool, StrategyKind, TransferStrategy,
};
use cumem_core::{Context, Device, Stream};
use cumem_sys::testing;

const SIM: &str = "devices=2,latency_us=2000";

fn setup() -> (Device, Context, Stream) {
    testing::init_with(SIM);
    let d = Device::get(0).unwrap();
    let ctx = d.context().unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    (d, ctx, s)
}

fn strategies(ctx: &Context) -> Vec<TransferStrategy> {
    vec![
        TransferStrategy::Sync,
        TransferStrategy::Async { stream: Stream::non_blocking(ctx).unwrap() },
        TransferStrategy::Unified,
        TransferStrategy::MappedPolling { interval: Duration::from_micros(3) },
    ]
}

fn channel<T: bytemuck::Pod>(
    dir: Direction,
    cap: usize,
    strategy: TransferStrategy,
) -> (RingChannel<T>, DevicePlayer<T>) {
    let (d, ctx, s) = setup();
    let ch = RingChannel::new_checked(&s, dir, cap, strategy, &native(d)).unwrap();
    (ch, DevicePlayer::new(&Stream::non_blocking(&ctx).unwrap(), cap))
}

#[test]
fn a_batch_straddling_the_end_arrives_in_order() {
    let (_, ctx, _) = setup();
    for strategy in strategies(&ctx) {
        let kind = strategy.kind();
        let (mut ch, mut dev) = channel::<u64>(Direction::HostToDevice, 4, strategy);
        assert_eq!(ch.send_batch(&[1, 2, 3]).unwrap(), 3);
        assert_eq!(ch.flush_to_device().unwrap(), 3);
        assert_eq!(dev.consume(&mut ch, 8), [1, 2, 3], "{kind}");
        // Slots 3, 0, 1, 2: two pieces, one copy (or write) each.
        assert_eq!(ch.send_batch(&[4, 5, 6, 7]).unwrap(), 4, "{kind}: the host must see the head first");
        assert_eq!(ch.flush_to_device().unwrap(), 4);
        let words = dev.control(&mut ch);
        assert_eq!((words[HEAD], words[TAIL], words[SEQUENCE]), (3, 7, 2), "{kind}");
        assert_eq!(dev.consume(&mut ch, 8), [4, 5, 6, 7], "{kind}");
        assert_eq!(dev.control(&mut ch)[HEAD], 7);
        let stats = ch.stats();
        assert_eq!(
            (stats.messages_sent, stats.bytes_sent, stats.flushes, stats.full),
            (7, 56, 2, 0),
            "{kind}"
        );
    }
}

#[test]
fn a_full_ring_refuses_then_recovers_losing_nothing() {
    let (_, ctx, _) = setup();
    for strategy in strategies(&ctx) {
        let kind = strategy.kind();
        let (mut ch, mut dev) = channel::<u32>(Direction::HostToDevice, 2, strategy);
        assert_eq!(ch.try_send(10).unwrap(), SendStatus::Sent);
        assert_eq!(ch.send(11).unwrap(), SendStatus::Sent);
        assert_eq!(ch.try_send(12).unwrap(), SendStatus::Full);
        ch.flush_to_device().unwrap();
        // The device consumed nothing yet: even a fresh look at its head says full.
        assert_eq!(ch.send(12).unwrap(), SendStatus::Full, "{kind}");
        assert_eq!(dev.consume(&mut ch, 1), [10]);
        // `try_send` trusts the head it last read; `send` reads it again.
        assert_eq!(ch.try_send(12).unwrap(), SendStatus::Full, "{kind}");
        assert_eq!(ch.send(12).unwrap(), SendStatus::Sent, "{kind}");
        assert_eq!(ch.send_batch(&[13, 14]).unwrap(), 0);
        ch.flush_to_device().unwrap();
        assert_eq!(dev.consume(&mut ch, 5), [11, 12], "{kind}");
        assert_eq!(ch.send_batch(&[13, 14, 15]).unwrap(), 2);
        ch.flush_to_device().unwrap();
        assert_eq!(dev.consume(&mut ch, 5), [13, 14], "{kind}");
        assert_eq!(ch.stats().full, 2 + 1 + 2 + 1, "{kind}");
    }
}

#[test]
fn the_device_side_fills_the_ring_and_the_host_drains_it() {
    let (_, ctx, _) = setup();
    for strategy in strategies(&ctx) {
        let kind = strategy.kind();
        let (mut ch, mut dev) = channel::<u16>(Direction::DeviceToHost, 3, strategy);
        let mut got = Vec::new();
        assert_eq!(ch.poll_from_device(&mut got).unwrap(), Poll::Empty);
        assert_eq!(dev.produce(&mut ch, &[1, 2, 3, 4]), 3, "{kind}: three slots");
        assert_eq!(dev.produce(&mut ch, &[4]), 0, "{kind}: full until the host polls");
        assert_eq!(ch.poll_at_most(&mut got, 2).unwrap(), Poll::Received(2));
        assert_eq!(dev.produce(&mut ch, &[4, 5, 6]), 2, "{kind}: two slots given back");
        assert_eq!(ch.poll_from_device(&mut got).unwrap(), Poll::Received(3));
        assert_eq!(got, [1, 2, 3, 4, 5], "{kind}");
        let words = dev.control(&mut ch);
        assert_eq!((words[HEAD], words[TAIL]), (5, 5));
        let stats = ch.stats();
        assert_eq!(
            (stats.messages_received, stats.bytes_received, stats.polls, stats.empty_polls),
            (5, 10, 3, 1)
        );
    }
}

#[test]
fn the_control_block_starts_as_the_layout_says_and_close_sets_the_flag() {
    let (_, ctx, _) = setup();
    for strategy in strategies(&ctx) {
        let kind = strategy.kind();
        let (mut ch, mut dev) = channel::<[u8; 24]>(Direction::DeviceToHost, 5, strategy);
        let words = dev.control(&mut ch);
        let block: ControlBlock = bytemuck::pod_read_unaligned(bytemuck::cast_slice::<u64, u8>(&words));
        let interval = if kind == StrategyKind::MappedPolling { 3000 } else { 0 };
        assert_eq!(block, ControlBlock::new(5, 24, interval, FLAG_DEVICE_TO_HOST), "{kind}");
        ch.close().unwrap();
        assert_eq!(dev.control(&mut ch)[FLAGS], FLAG_CLOSED | FLAG_DEVICE_TO_HOST, "{kind}");
        let args = ch.ring_args();
        let side = ch.device_side();
        assert_eq!((args.slots, args.control), (side.slots.device_ptr(), side.control.device_ptr()));
        assert_eq!((args.capacity, args.message_size), (5, 24));
    }
}

#[test]
fn close_publishes_what_is_staged_and_then_takes_nothing_more() {
    let (_, ctx, _) = setup();
    for strategy in strategies(&ctx) {
        let kind = strategy.kind();
        let (mut ch, mut dev) = channel::<u32>(Direction::HostToDevice, 4, strategy);
        assert_eq!(ch.send_batch(&[1, 2]).unwrap(), 2);
        ch.close().unwrap();
        let words = dev.control(&mut ch);
        assert_eq!((words[TAIL], words[FLAGS]), (2, FLAG_CLOSED), "{kind}: closed before publishing");
        for refused in [ch.try_send(3).map(|_| ()), ch.send(3).map(|_| ()), ch.send_batch(&[3]).map(|_| ())] {
            assert!(matches!(refused, Err(ChannelError::Closed { .. })), "{kind}: {refused:?}");
        }
        assert_eq!(ch.flush_to_device().unwrap(), 0);
        assert_eq!(dev.consume(&mut ch, 8), [1, 2], "{kind}");
        let stats = ch.stats();
        assert_eq!((stats.messages_sent, stats.full), (2, 0), "{kind}");
        ch.close().unwrap(); // closing again changes nothing
        assert_eq!(dev.control(&mut ch)[FLAGS], FLAG_CLOSED);
    }
}

#[test]
fn a_device_side_that_breaks_the_protocol_is_an_error() {
    let (d, ctx, s) = setup();
    for strategy in strategies(&ctx) {
        let kind = strategy.kind();
        let mut ch =
            RingChannel::<u32>::new_checked(&s, Direction::HostToDevice, 4, strategy, &native(d)).unwrap();
        let mut dev = DevicePlayer::<u32>::new(&s, 4);
        // A consumer claiming more than was published.
        dev.produce_word(&mut ch, HEAD, 9);
        let err = ch.refresh().unwrap_err();
        assert!(matches!(err, ChannelError::Protocol { head: 9, tail: 0, capacity: 4 }), "{kind}: {err}");
        // Operations of the other direction are refused by name.
        let err = ch.poll_from_device(&mut Vec::new()).unwrap_err();
        assert!(
            matches!(err, ChannelError::WrongDirection { direction: Direction::HostToDevice, .. }),
            "{err}"
        );
    }
    let mut ch = RingChannel::<u32>::new(&s, Direction::DeviceToHost, 4, TransferStrategy::Sync).unwrap();
    let mut dev = DevicePlayer::<u32>::new(&s, 4);
    dev.produce_word(&mut ch, TAIL, 5); // a producer claiming more messages than slots
    assert!(matches!(
        ch.poll_from_device(&mut Vec::new()),
        Err(ChannelError::Protocol { head: 0, tail: 5, .. })
    ));
    assert!(matches!(ch.try_send(1), Err(ChannelError::WrongDirection { operation: "try_send", .. })));
}

#[test]
fn four_kib_messages_come_back_in_pooled_batches() {
    let (_, ctx, _) = setup();
    for strategy in strategies(&ctx) {
        let kind = strategy.kind();
        let (mut ch, mut dev) = channel::<[u64; 512]>(Direction::DeviceToHost, 6, strategy);
        let msgs: Vec<[u64; 512]> = (0..5u64).map(|i| std::array::from_fn(|j| i * 1000 + j as u64)).collect();
        assert_eq!(dev.produce(&mut ch, &msgs), 5);
        let pool = SlotPool::new(2, 2).unwrap();
        let mut got = Vec::new();
        while let Some(batch) = ch.poll_batch(&pool).unwrap() {
            assert!(batch.len() <= 2);
            got.extend_from_slice(&batch);
        }
        assert_eq!(got, msgs, "{kind}");
        let p = pool.stats();
        // Three batches (2, 2, 1), each taking the slot the previous one returned.
        assert_eq!((p.hits, p.misses, p.returns, p.discarded, p.idle), (3, 0, 3, 0, 2), "{kind}");
        assert_eq!(ch.stats().bytes_received, 5 * 4096);
    }
}

/// The managed range's `LAST_PREFETCH_LOCATION` as the driver reports it (a device ordinal, -1 for
/// the host, -2 when never prefetched or mixed).
fn last_prefetch(ctx: &Context, ptr: u64, bytes: usize) -> i32 {
    use cumem_sys::sys;
    ctx.bind().unwrap();
    let mut location = 0i32;
    // SAFETY: `location` is valid for the 4 bytes the driver is told it may write; the range is
    // only looked up.
    let code = unsafe {
        sys::cuMemRangeGetAttribute(
            (&mut location as *mut i32).cast(),
            size_of::<i32>(),
            sys::CUmem_range_attribute::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION,
            ptr,
            bytes,
        )
    };
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    location
}

#[test]
fn unified_rings_are_prefetched_to_the_consumers_side() {
    let (d, ctx, _) = setup();
    let (mut to_device, mut dev) = channel::<u64>(Direction::HostToDevice, 4, TransferStrategy::Unified);
    let slots = to_device.ring_args().slots;
    assert_eq!(to_device.send_batch(&[1, 2, 3]).unwrap(), 3);
    to_device.flush_to_device().unwrap();
    ctx.synchronize().unwrap(); // the prefetch runs on the channel's own stream
    assert_eq!(last_prefetch(&ctx, slots, 4 * 8), d.ordinal() as i32, "published slots go to the device");
    assert_eq!(dev.consume(&mut to_device, 8), [1, 2, 3]);

    let (mut from_device, mut dev) = channel::<u64>(Direction::DeviceToHost, 4, TransferStrategy::Unified);
    let slots = from_device.ring_args().slots;
    assert_eq!(dev.produce(&mut from_device, &[7, 8]), 2);
    let mut got = Vec::new();
    assert_eq!(from_device.poll_from_device(&mut got).unwrap(), Poll::Received(2));
    assert_eq!(got, [7, 8]);
    ctx.synchronize().unwrap();
    assert_eq!(last_prefetch(&ctx, slots, 2 * 8), -1, "slots to be read come to the host first");
}

#[test]
fn a_slot_pool_larger_than_memory_is_an_error() {
    for (slot_len, max_idle) in [(usize::MAX, 1), (usize::MAX / 8, 0), (1 << 40, 1 << 30)] {
        let err = SlotPool::<u64>::new(slot_len, max_idle).unwrap_err();
        assert!(
            matches!(err, ChannelError::SlotTooLarge { slot_len: l, max_idle: m } if (l, m) == (slot_len, max_idle)),
            "{err}"
        );
    }
    let pool = SlotPool::<u64>::new(4, 0).unwrap();
    assert_eq!((pool.acquire().len(), pool.stats().misses), (4, 1));
}
