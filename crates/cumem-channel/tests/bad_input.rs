//! Bad input is a typed error, never a panic or an abort, and a ring refused for its size takes no
//! memory first: capacities past what one allocation or the host can hold (every strategy, both
//! directions) or, for `Async`, past the device's MAX_PITCH; slot pools of empty or unallocatable
//! slots; and the edges that are not errors
//! (a batch larger than the ring, a poll of at most 0, poll intervals of 0 and of `Duration::MAX`)
//! behave as documented.

mod common;

use std::time::Duration;

use common::{DevicePlayer, native};
use cumem_channel::{
    ChannelError, ControlBlock, Direction, Poll, RingChannel, SendStatus, SlotPool, StrategyKind,
    TransferStrategy,
};
use cumem_core::{Context, Device, Stream};
use cumem_sys::testing;
use serial_test::{parallel, serial};

fn setup() -> (Device, Context, Stream) {
    testing::init_with("devices=1");
    let d = Device::get(0).unwrap();
    let ctx = d.context().unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    (d, ctx, s)
}

fn every_strategy(ctx: &Context) -> [TransferStrategy; 4] {
    [
        TransferStrategy::Sync,
        TransferStrategy::Async { stream: Stream::non_blocking(ctx).unwrap() },
        TransferStrategy::Unified,
        TransferStrategy::MappedPolling { interval: Duration::from_micros(1) },
    ]
}

/// Live allocations the simulator reports (0 on a GPU, where this is not checked).
fn live_allocations() -> usize {
    testing::sim_control().map_or(0, |ctl| ctl.live_report().allocations.len())
}

#[test]
#[serial] // compares live allocations
fn a_capacity_past_memory_is_refused_before_anything_is_allocated() {
    let (d, ctx, s) = setup();
    // More bytes than one allocation may hold (u64 messages), then the byte count overflowing.
    let past_isize = (isize::MAX as usize) / 8 + 1;
    // Fits an allocation's limit, but no host can reserve 4 EiB to stage it.
    let unreservable = 1usize << 59;
    for strategy in every_strategy(&ctx) {
        let kind = strategy.kind();
        for (dir, capacity) in [
            (Direction::HostToDevice, past_isize),
            (Direction::DeviceToHost, past_isize),
            (Direction::HostToDevice, usize::MAX),
            (Direction::DeviceToHost, usize::MAX),
            (Direction::HostToDevice, unreservable),
        ] {
            let before = live_allocations();
            let err =
                RingChannel::<u64>::new_checked(&s, dir, capacity, strategy.clone(), &native(d)).unwrap_err();
            assert!(
                matches!(err, ChannelError::CapacityTooLarge { capacity: c, message_size: 8 } if c == capacity),
                "{kind} {dir} {capacity}: {err}"
            );
            assert_eq!(live_allocations(), before, "{kind} {dir} {capacity}: allocated before refusing");
        }
        // Nothing to stage device→host: the device memory is asked for, and refused as such
        // (`Async` refuses it first, for the device's MAX_PITCH).
        let err =
            RingChannel::<u64>::new_checked(&s, Direction::DeviceToHost, unreservable, strategy, &native(d))
                .unwrap_err();
        if kind == StrategyKind::Async {
            assert!(matches!(err, ChannelError::CapacityTooLarge { .. }), "{kind}: {err}");
        } else {
            assert!(matches!(err, ChannelError::Cuda(_)), "{kind}: {err}");
        }
    }
}

/// An `Async` ring copies part of its slots as one row of a pitched copy whose pitch is the whole
/// ring: one byte past the device's MAX_PITCH (2 GiB here and on GPUs) could never move a message,
/// so it is refused, before anything is allocated, in both directions.
#[test]
#[serial] // compares live allocations
fn an_async_ring_past_the_devices_max_pitch_is_refused_before_anything_is_allocated() {
    let (d, ctx, s) = setup();
    let capacity = d.max_pitch().unwrap() / 8 + 1;
    for dir in [Direction::HostToDevice, Direction::DeviceToHost] {
        let before = live_allocations();
        let strategy = TransferStrategy::Async { stream: Stream::non_blocking(&ctx).unwrap() };
        let err = RingChannel::<u64>::new_checked(&s, dir, capacity, strategy, &native(d)).unwrap_err();
        assert!(
            matches!(err, ChannelError::CapacityTooLarge { capacity: c, message_size: 8 } if c == capacity),
            "{dir}: {err}"
        );
        assert_eq!(live_allocations(), before, "{dir}: allocated before refusing");
    }
}

#[test]
#[parallel]
fn slot_pools_of_empty_or_unallocatable_slots_are_refused() {
    assert!(matches!(SlotPool::<u64>::new(0, 2), Err(ChannelError::EmptySlots)));
    assert!(matches!(SlotPool::<u64>::new(0, 0), Err(ChannelError::EmptySlots)));
    // 4 EiB a slot: within an allocation's limit, beyond any host.
    for max_idle in [1, 0] {
        let err = SlotPool::<u64>::new(1 << 59, max_idle).unwrap_err();
        assert!(
            matches!(err, ChannelError::SlotTooLarge { slot_len, max_idle: m } if slot_len == 1 << 59 && m == max_idle),
            "{max_idle}: {err}"
        );
    }
    // Zero-sized values take no memory however many: a pool of them works.
    let pool = SlotPool::<()>::new(1 << 20, 2).unwrap();
    assert_eq!(pool.acquire().len(), 1 << 20);
}

#[test]
#[parallel]
fn a_batch_larger_than_the_ring_takes_what_fits() {
    let (d, ctx, s) = setup();
    for strategy in every_strategy(&ctx) {
        let kind = strategy.kind();
        let mut ch =
            RingChannel::<u32>::new_checked(&s, Direction::HostToDevice, 3, strategy, &native(d)).unwrap();
        let mut dev = DevicePlayer::<u32>::new(&Stream::non_blocking(&ctx).unwrap(), 3);
        let batch: Vec<u32> = (0..10).collect();
        assert_eq!(ch.send_batch(&batch).unwrap(), 3, "{kind}");
        assert_eq!(ch.try_send(10).unwrap(), SendStatus::Full);
        assert_eq!(ch.flush_to_device().unwrap(), 3);
        assert_eq!(dev.consume(&mut ch, 10), [0, 1, 2], "{kind}");
        assert_eq!(ch.stats().full, 7 + 1, "{kind}");
    }
}

#[test]
#[parallel]
fn a_poll_of_at_most_zero_leaves_the_messages_for_the_next() {
    let (d, ctx, s) = setup();
    let mut ch =
        RingChannel::<u32>::new_checked(&s, Direction::DeviceToHost, 4, TransferStrategy::Sync, &native(d))
            .unwrap();
    let mut dev = DevicePlayer::<u32>::new(&Stream::non_blocking(&ctx).unwrap(), 4);
    assert_eq!(dev.produce(&mut ch, &[1, 2]), 2);
    let mut got = Vec::new();
    assert_eq!(ch.poll_at_most(&mut got, 0).unwrap(), Poll::Empty);
    assert_eq!(ch.poll_at_most(&mut got, 1).unwrap(), Poll::Received(1));
    assert_eq!(ch.poll_from_device(&mut got).unwrap(), Poll::Received(1));
    assert_eq!(got, [1, 2]);
}

#[test]
#[parallel]
fn poll_intervals_of_zero_and_past_u64_nanoseconds_are_stored_as_documented() {
    let (d, ctx, s) = setup();
    for (interval, stored) in [(Duration::ZERO, 0), (Duration::MAX, u64::MAX), (Duration::from_nanos(7), 7)] {
        let strategy = TransferStrategy::MappedPolling { interval };
        let mut ch =
            RingChannel::<u32>::new_checked(&s, Direction::HostToDevice, 2, strategy, &native(d)).unwrap();
        let mut dev = DevicePlayer::<u32>::new(&Stream::non_blocking(&ctx).unwrap(), 2);
        let words = dev.control(&mut ch);
        let block: ControlBlock = bytemuck::pod_read_unaligned(bytemuck::cast_slice::<u64, u8>(&words));
        assert_eq!(block.poll_interval_ns, stored, "{interval:?}");
    }
}
