//! The channel's error type: a driver error, a strategy the platform cannot run, or bad input.

use std::fmt;

use crate::{Direction, MemoryVisibility, StrategyKind};

/// Why a device cannot run a [`TransferStrategy`](crate::TransferStrategy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// `MANAGED_MEMORY` is 0: no unified memory at all.
    NoManagedMemory,
    /// `CONCURRENT_MANAGED_ACCESS` is 0 (WSL2, Windows, pre-Pascal): the host must not touch managed
    /// memory while a kernel runs, so a persistent kernel cannot share a managed ring.
    NoConcurrentManagedAccess,
    /// `CAN_MAP_HOST_MEMORY` is 0: no zero-copy mapped memory.
    NoHostMapping,
    /// Mapped memory exists but is not coherent at system scope (WSL2): a polling kernel might
    /// never see the host's writes.
    NotSystemCoherent(MemoryVisibility),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::NoManagedMemory => f.write_str("the device has no managed memory"),
            Refusal::NoConcurrentManagedAccess => f.write_str(
                "the device has no concurrent managed access (host and kernel cannot share managed memory)",
            ),
            Refusal::NoHostMapping => f.write_str("the device cannot map page-locked host memory"),
            Refusal::NotSystemCoherent(v) => {
                write!(
                    f,
                    "mapped memory is visible at {v} only, so a polling kernel may never see host writes"
                )
            }
        }
    }
}

/// Everything that can go wrong in a channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelError {
    /// A driver or memory error from cumem.
    #[error(transparent)]
    Cuda(#[from] cumem_core::Error),
    /// The strategy cannot run on this device and platform; nothing was allocated.
    #[error("the {strategy} strategy cannot run on device {device}: {reason}")]
    Unsupported {
        /// The refused strategy.
        strategy: StrategyKind,
        /// The device's ordinal.
        device: usize,
        /// What the device or platform lacks.
        reason: Refusal,
    },
    /// A ring needs at least one slot.
    #[error("a ring channel needs a capacity of at least 1 message")]
    ZeroCapacity,
    /// The ring's slots (`capacity` messages of `message_size` bytes) are more bytes than one
    /// allocation may hold, than the host can reserve for staging them, or (`Async`) than the
    /// device's `MAX_PITCH` (its copies move part of the ring as one row of a pitched copy whose
    /// pitch is the ring); nothing was allocated.
    #[error("a ring of {capacity} messages of {message_size} bytes is larger than memory can hold")]
    CapacityTooLarge {
        /// Messages asked for.
        capacity: usize,
        /// Bytes per message.
        message_size: usize,
    },
    /// The host could not reserve memory for the messages received; nothing was received.
    #[error("could not reserve {bytes} bytes of host memory for received messages")]
    HostMemory {
        /// Bytes asked for.
        bytes: usize,
    },
    /// Messages must have a size: a zero-sized `T` carries nothing.
    #[error("a ring channel cannot carry zero-sized messages")]
    ZeroSizedMessage,
    /// The strategy's stream belongs to another device than the channel.
    #[error("the strategy's stream is on device {stream}, the channel on device {channel}")]
    WrongDevice {
        /// The stream's device ordinal.
        stream: usize,
        /// The channel's device ordinal.
        channel: usize,
    },
    /// The [`VisibilityReport`](crate::VisibilityReport) given to
    /// [`RingChannel::new_checked`](crate::RingChannel::new_checked) is about another device than
    /// the channel's stream.
    #[error("the visibility report is about device {report}, the channel is on device {channel}")]
    ReportForOtherDevice {
        /// The report's device ordinal.
        report: usize,
        /// The channel's device ordinal.
        channel: usize,
    },
    /// A [`SlotPool`](crate::SlotPool)'s slots (one, or the prefilled ones together) would exceed
    /// the largest allocation Rust allows, or the host cannot allocate them; nothing was kept.
    #[error("a slot pool of {max_idle} slots of {slot_len} values is larger than memory can hold")]
    SlotTooLarge {
        /// Values per slot asked for.
        slot_len: usize,
        /// Slots to prefill asked for.
        max_idle: usize,
    },
    /// A [`SlotPool`](crate::SlotPool) needs slots of at least one value: a batch read into an
    /// empty slot would receive nothing, for ever.
    #[error("a slot pool needs slots of at least one value")]
    EmptySlots,
    /// The operation belongs to the other direction (sending on a device→host channel, …).
    #[error("`{operation}` is not available on a {direction} channel")]
    WrongDirection {
        /// The channel's direction.
        direction: Direction,
        /// The refused operation.
        operation: &'static str,
    },
    /// The channel was closed ([`RingChannel::close`](crate::RingChannel::close)): its consumer
    /// stops once drained, so it takes no more messages.
    #[error("`{operation}` on a closed channel")]
    Closed {
        /// The refused operation.
        operation: &'static str,
    },
    /// The other side wrote positions that no correct peer writes (a consumer ahead of the
    /// producer, or more messages in flight than slots): the channel refuses to read garbage.
    #[error("the device side broke the ring protocol: head {head}, tail {tail}, capacity {capacity}")]
    Protocol {
        /// The consumer position read or held.
        head: u64,
        /// The producer position read or held.
        tail: u64,
        /// Slots in the ring.
        capacity: u64,
    },
}
