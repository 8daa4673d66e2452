//! Host ↔ device message channels for persistent-kernel ("ring kernel") runtimes.
//!
//! A persistent kernel stays resident and exchanges fixed-size messages with the host through
//! rings. This crate provides the pieces such a runtime's memory layer needs: cache-line layout
//! types and a [`ControlBlock`] that a CUDA C++ kernel reads with the same layout
//! (`include/cumem_channel.h`); four [`TransferStrategy`]s (blocking copies, queued copies, unified
//! memory with prefetch, polled mapped memory), chosen explicitly or by
//! [`TransferStrategy::detect`]; [`RingChannel`], a bounded ring in either direction with
//! back-pressure as values; [`MemoryVisibility`], what the platform (native Linux or WSL2) and the
//! device let each side see; and [`SlotPool`], fixed-size buffers for batches. See
//! `docs/channels.md` for a host loop and the matching kernel.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_channel::{Direction, Poll, RingChannel, TransferStrategy};
//! use cumem_core::{Device, Stream};
//! let stream = Stream::non_blocking(&Device::get(0)?.context()?)?;
//! let strategy = TransferStrategy::detect(&stream.context().device())?;
//! let mut to_device = RingChannel::<u64>::new(&stream, Direction::HostToDevice, 1024, strategy.clone())?;
//! let mut from_device = RingChannel::<u64>::new(&stream, Direction::DeviceToHost, 1024, strategy)?;
//! to_device.send_batch(&[1, 2, 3])?;
//! assert_eq!(to_device.flush_to_device()?, 3);
//! let mut got = Vec::new();
//! assert_eq!(from_device.poll_from_device(&mut got)?, Poll::Empty); // no kernel produced anything
//! # Ok::<(), cumem_channel::ChannelError>(())
//! ```

mod error;
mod ffi;
mod layout;
mod ring;
mod slot_pool;
mod storage;
mod strategy;
mod visibility;

pub use error::{ChannelError, Refusal};
pub use layout::{
    CONTROL_LINE, CONTROL_OFFSETS, CacheLineAligned, CacheLineAligned128, ControlBlock, FLAG_CLOSED,
    FLAG_DEVICE_TO_HOST, RING_ARGS_OFFSETS, RingArgs,
};
pub use ring::{ChannelStats, DeviceSide, Direction, Poll, RingChannel, SendStatus};
pub use slot_pool::{Slot, SlotPool, SlotPoolStats};
pub use strategy::{DEFAULT_POLL_INTERVAL, StrategyKind, TransferStrategy};
pub use visibility::{MemoryVisibility, Platform, VisibilityReport};

/// The C header with [`ControlBlock`] and [`RingArgs`] as C structs, for kernels to include.
pub const C_HEADER: &str = include_str!("../include/cumem_channel.h");

// The guide's examples run as doctests, so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/channels.md")]
struct GuideExamples;
