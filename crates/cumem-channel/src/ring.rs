//! [`RingChannel`]: a bounded ring of messages between the host and a (persistent) kernel, in the
//! memory its [`TransferStrategy`] calls for, with the [`ControlBlock`] beside it.
//!
//! The producer owns `tail` and `sequence`, the consumer owns `head`; positions only grow, so the
//! ring is full when `tail - head == capacity` and a batch that straddles the end is two contiguous
//! pieces. A host→device channel stages messages on the host (`send`, `try_send`, `send_batch`)
//! and publishes them with [`RingChannel::flush_to_device`]: slots first, then `tail`, so a consumer
//! that sees the new `tail` sees the slots. A device→host channel is drained with
//! [`RingChannel::poll_from_device`], which reads `tail`, then the slots, then gives them back by
//! writing `head`. A full ring is [`SendStatus::Full`] and an empty one [`Poll::Empty`]: values,
//! not errors; nothing is dropped.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_channel::{Direction, RingChannel, SendStatus, TransferStrategy};
//! use cumem_core::{Device, Stream};
//! let stream = Stream::non_blocking(&Device::get(0)?.context()?)?;
//! let mut ch = RingChannel::<[u32; 4]>::new(&stream, Direction::HostToDevice, 2, TransferStrategy::Sync)?;
//! assert_eq!(ch.try_send([1; 4])?, SendStatus::Sent);
//! assert_eq!(ch.send_batch(&[[2; 4], [3; 4]])?, 1); // one slot left: back-pressure, nothing lost
//! assert_eq!(ch.try_send([3; 4])?, SendStatus::Full);
//! assert_eq!(ch.flush_to_device()?, 2);
//! let stats = ch.stats();
//! assert_eq!((stats.messages_sent, stats.bytes_sent, stats.full), (2, 32, 2));
//! # Ok::<(), cumem_channel::ChannelError>(())
//! ```

use std::fmt;

use bytemuck::Pod;
use cumem_core::{DeviceSliceMut, Stream};

use crate::layout::{FLAG_CLOSED, FLAG_DEVICE_TO_HOST, FLAGS_WORD, HEAD_WORD, SEQUENCE_WORD, TAIL_WORD};
use crate::storage::Storage;
use crate::{
    ChannelError, ControlBlock, RingArgs, Slot, SlotPool, StrategyKind, TransferStrategy, VisibilityReport,
};

/// Which way messages flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The host produces, the device consumes.
    HostToDevice,
    /// The device produces, the host consumes.
    DeviceToHost,
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Direction::HostToDevice => "host-to-device",
            Direction::DeviceToHost => "device-to-host",
        })
    }
}

/// The outcome of a send: a full ring is a value, not an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a full ring did not take the message"]
pub enum SendStatus {
    /// Staged; published by the next [`RingChannel::flush_to_device`].
    Sent,
    /// Every slot is in flight: flush and let the device consume first. The message was not taken.
    Full,
}

/// The outcome of a poll: an empty ring is a value, not an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poll {
    /// This many messages were received (and their slots given back to the device).
    Received(usize),
    /// The device has published nothing new.
    Empty,
}

/// Counters of one channel, by value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChannelStats {
    /// Messages published host→device.
    pub messages_sent: u64,
    /// Bytes published host→device.
    pub bytes_sent: u64,
    /// Messages received device→host.
    pub messages_received: u64,
    /// Bytes received device→host.
    pub bytes_received: u64,
    /// Flushes that published at least one message.
    pub flushes: u64,
    /// Polls that returned, empty or not (a poll that failed received nothing and is not counted).
    pub polls: u64,
    /// Polls that found nothing.
    pub empty_polls: u64,
    /// Messages refused because the ring was full.
    pub full: u64,
}

/// A bounded ring of `T` messages between host and device, in the memory its strategy calls for.
///
/// Host→device: [`send`](Self::send) / [`try_send`](Self::try_send) /
/// [`send_batch`](Self::send_batch) stage messages, [`flush_to_device`](Self::flush_to_device)
/// publishes them (slots, then `tail`). Device→host: [`poll_from_device`](Self::poll_from_device)
/// and [`poll_batch`](Self::poll_batch) receive what the device published and give the slots back
/// (`head`). [`device_side`](Self::device_side) and [`ring_args`](Self::ring_args) are what the
/// device side uses.
pub struct RingChannel<T: Pod> {
    direction: Direction,
    kind: StrategyKind,
    capacity: u64,
    storage: Storage<T>,
    /// Host→device: accepted by a send, not yet published (at most `capacity - in flight`).
    staged: Vec<T>,
    /// Host→device: the `tail` the device has been given. Device→host: the `head` given back.
    position: u64,
    /// Host→device: the consumer's `head` as last read.
    known_head: u64,
    sequence: u64,
    /// A flush published its messages but failed to write `sequence`: the next flush, or
    /// `close`, writes it even with nothing staged.
    sequence_unpublished: bool,
    /// `close` has set `FLAG_CLOSED`: the consumer stops once drained, so nothing more is sent.
    closed: bool,
    stats: ChannelStats,
}

impl<T: Pod> fmt::Debug for RingChannel<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingChannel")
            .field("direction", &self.direction)
            .field("strategy", &self.kind)
            .field("capacity", &self.capacity)
            .field("staged", &self.staged.len())
            .field("position", &self.position)
            .field("known_head", &self.known_head)
            .field("closed", &self.closed)
            .finish()
    }
}

/// The device's view of a channel: what a kernel (or a test playing the device) reads and writes.
#[derive(Debug)]
pub struct DeviceSide<'a, T> {
    /// The `capacity` slots.
    pub slots: DeviceSliceMut<'a, T>,
    /// The [`ControlBlock`] as 64-bit words ([`ControlBlock::HEAD_WORD`], [`ControlBlock::TAIL_WORD`],
    /// …).
    pub control: DeviceSliceMut<'a, u64>,
}

impl<T: Pod> RingChannel<T> {
    /// A channel of `capacity` messages on `stream`'s device, its memory allocated as `strategy`
    /// calls for, after checking that the device and platform can run it (`Unsupported` otherwise,
    /// before any allocation). A capacity of 0 (`ZeroCapacity`), a zero-sized `T`
    /// (`ZeroSizedMessage`) and a ring larger than one allocation may be, than the host can
    /// stage, or (`Async`) than the device's `MAX_PITCH` (`CapacityTooLarge`) are refused before
    /// any allocation too.
    ///
    /// `Async` and `Unified` rings do their work on streams of their own (the strategy's copies
    /// stream, a prefetch stream), never after `stream`: a persistent kernel may be launched on
    /// `stream` (non-blocking) right away. `Sync` rings are made on `stream`.
    pub fn new(
        stream: &Stream,
        direction: Direction,
        capacity: usize,
        strategy: TransferStrategy,
    ) -> Result<Self, ChannelError> {
        let report = VisibilityReport::detect(stream.context().device())?;
        Self::build(stream, direction, capacity, strategy, &report)
    }

    /// [`RingChannel::new`] with the platform taken from `report` (read for another kernel string,
    /// for instance) instead of `/proc`.
    ///
    /// The strategy must pass both `report` and the device's own attributes read again under
    /// `report`'s platform. The platform is trusted as given (choosing it is what this function is
    /// for), so it is the one thing a report may loosen: a native-Linux report on a WSL2 host
    /// admits `MappedPolling` where [`new`](Self::new) refuses it, if the device reports host
    /// mapping and concurrent managed access (WSL2 devices report no concurrent managed access);
    /// the caller vouches that the platform is right. The report's device fields can only make
    /// the check stricter (they are public, and a strategy the device cannot run would have the
    /// host touch memory the device does not share). `report` must be about `stream`'s device
    /// (`ReportForOtherDevice`).
    pub fn new_checked(
        stream: &Stream,
        direction: Direction,
        capacity: usize,
        strategy: TransferStrategy,
        report: &VisibilityReport,
    ) -> Result<Self, ChannelError> {
        let device = stream.context().device();
        if report.device != device {
            return Err(ChannelError::ReportForOtherDevice {
                report: report.device.ordinal(),
                channel: device.ordinal(),
            });
        }
        strategy.check_against(report)?;
        let own = VisibilityReport::decide(device, report.platform)?;
        Self::build(stream, direction, capacity, strategy, &own)
    }

    fn build(
        stream: &Stream,
        direction: Direction,
        capacity: usize,
        strategy: TransferStrategy,
        report: &VisibilityReport,
    ) -> Result<Self, ChannelError> {
        if capacity == 0 {
            return Err(ChannelError::ZeroCapacity);
        }
        if size_of::<T>() == 0 {
            return Err(ChannelError::ZeroSizedMessage);
        }
        strategy.check_against(report)?;
        // Both checks come before any allocation: a ring the host cannot stage must be an error,
        // not an abort after its device memory was taken.
        let message_size = size_of::<T>();
        let too_large = || ChannelError::CapacityTooLarge { capacity, message_size };
        let Some(bytes) = capacity.checked_mul(message_size).filter(|&b| b <= isize::MAX as usize) else {
            return Err(too_large());
        };
        // `Async` copies part of the ring as one row of a pitched copy whose pitch is the whole
        // ring, which the driver refuses above the device's MAX_PITCH: every flush would fail.
        if let TransferStrategy::Async { stream: copies } = &strategy
            && bytes > copies.context().device().max_pitch()?
        {
            return Err(too_large());
        }
        // Only a host→device channel stages messages; it never grows past `capacity`, so sends
        // never allocate.
        let mut staged = Vec::new();
        if direction == Direction::HostToDevice {
            staged.try_reserve_exact(capacity).map_err(|_| too_large())?;
        }
        let interval_ns = match &strategy {
            TransferStrategy::MappedPolling { interval } => {
                u64::try_from(interval.as_nanos()).unwrap_or(u64::MAX)
            }
            _ => 0,
        };
        let flags = if direction == Direction::DeviceToHost { FLAG_DEVICE_TO_HOST } else { 0 };
        let block = ControlBlock::new(capacity as u64, size_of::<T>() as u64, interval_ns, flags);
        let storage = match &strategy {
            TransferStrategy::Sync => Storage::sync(stream, capacity, &block)?,
            TransferStrategy::Async { stream: copies } => Storage::queued(copies, capacity, &block)?,
            TransferStrategy::Unified => Storage::unified(stream.context(), capacity, &block)?,
            TransferStrategy::MappedPolling { .. } => Storage::mapped(stream.context(), capacity, &block)?,
        };
        Ok(RingChannel {
            direction,
            kind: strategy.kind(),
            capacity: capacity as u64,
            storage,
            staged,
            position: 0,
            known_head: 0,
            sequence: 0,
            sequence_unpublished: false,
            closed: false,
            stats: ChannelStats::default(),
        })
    }

    /// Which way messages flow.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// The strategy the channel was made with.
    pub fn strategy(&self) -> StrategyKind {
        self.kind
    }

    /// Slots in the ring.
    pub fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// The counters now.
    pub fn stats(&self) -> ChannelStats {
        self.stats
    }

    /// Messages accepted by sends and not yet flushed.
    pub fn staged(&self) -> usize {
        self.staged.len()
    }

    /// As `require` for the host→device sends, which a closed channel refuses: its consumer
    /// stops once it has drained, so a message sent now would never be read.
    fn require_open(&self, operation: &'static str) -> Result<(), ChannelError> {
        self.require(Direction::HostToDevice, operation)?;
        if self.closed {
            return Err(ChannelError::Closed { operation });
        }
        Ok(())
    }

    fn require(&self, direction: Direction, operation: &'static str) -> Result<(), ChannelError> {
        if self.direction == direction {
            Ok(())
        } else {
            Err(ChannelError::WrongDirection { direction: self.direction, operation })
        }
    }

    /// Slots free as far as the host knows (published and staged messages hold the others).
    fn free(&self) -> u64 {
        self.capacity - (self.position - self.known_head) - self.staged.len() as u64
    }

    fn protocol(&self, head: u64, tail: u64) -> ChannelError {
        ChannelError::Protocol { head, tail, capacity: self.capacity }
    }

    /// Reads the consumer's `head` from the device, so slots it has consumed can be reused.
    pub fn refresh(&mut self) -> Result<(), ChannelError> {
        self.require(Direction::HostToDevice, "refresh")?;
        let head = self.storage.read_word(HEAD_WORD)?;
        if head < self.known_head || head > self.position {
            return Err(self.protocol(head, self.position));
        }
        self.known_head = head;
        Ok(())
    }

    /// Stages `msg` if a slot is free as far as the host last knew (no driver call), else `Full`.
    pub fn try_send(&mut self, msg: T) -> Result<SendStatus, ChannelError> {
        self.require_open("try_send")?;
        if self.free() == 0 {
            self.stats.full += 1;
            return Ok(SendStatus::Full);
        }
        self.staged.push(msg);
        Ok(SendStatus::Sent)
    }

    /// Stages `msg`; when the ring looks full, first reads how far the device has consumed (one
    /// read of `head`) and answers `Full` only if it is still full.
    pub fn send(&mut self, msg: T) -> Result<SendStatus, ChannelError> {
        self.require_open("send")?;
        if self.free() == 0 {
            self.refresh()?;
        }
        self.try_send(msg)
    }

    /// Stages as many of `msgs` as fit (reading `head` once if they do not all fit at first) and
    /// returns how many; the rest were refused and are counted as full.
    pub fn send_batch(&mut self, msgs: &[T]) -> Result<usize, ChannelError> {
        self.require_open("send_batch")?;
        if self.free() < msgs.len() as u64 {
            self.refresh()?;
        }
        let taken = (self.free() as usize).min(msgs.len());
        self.staged.extend_from_slice(&msgs[..taken]);
        self.stats.full += (msgs.len() - taken) as u64;
        Ok(taken)
    }

    /// Publishes every staged message: writes their slots (wrapping at the end), then `tail`, then
    /// `sequence`. Returns how many were published.
    ///
    /// On an error before `tail` is written nothing is published: every message stays staged and
    /// the next flush writes them again. An error writing `sequence` comes after they were
    /// published: they are counted as sent and no longer staged ([`staged`](Self::staged) is 0),
    /// and the next flush (or [`close`](Self::close)) writes `sequence`, with nothing staged too.
    pub fn flush_to_device(&mut self) -> Result<usize, ChannelError> {
        self.require(Direction::HostToDevice, "flush_to_device")?;
        let n = self.staged.len();
        if n == 0 {
            if self.sequence_unpublished {
                // The staged copy of the word (`Async`) still holds this value: only a flush
                // stages it, and the failed one staged exactly this.
                self.storage.publish_word(SEQUENCE_WORD, self.sequence)?;
                self.sequence_unpublished = false;
            }
            return Ok(0);
        }
        let start = (self.position % self.capacity) as usize;
        let tail = self.position + n as u64;
        let sequence = self.sequence + 1;
        // Every host write first, every copy after: with queued copies a host write waits for the
        // copies stream, which must then hold the previous flush's copies only, not this one's
        // (see `storage::STAGED_WORDS`). Staging publishes nothing.
        self.storage.stage_word(TAIL_WORD, tail)?;
        self.storage.stage_word(SEQUENCE_WORD, sequence)?;
        // Rewriting these slots after a failure is harmless: no consumer reads past `tail`.
        self.storage.write_slots(start, &self.staged)?;
        self.storage.publish_word(TAIL_WORD, tail)?;
        // Published: the device may consume them now, so the host's state must say so before
        // anything else can fail (else a later `head` past `position` reads as a protocol breach,
        // and the next flush rewrites slots the device may be reading).
        self.position = tail;
        self.sequence = sequence;
        self.staged.clear();
        self.stats.messages_sent += n as u64;
        self.stats.bytes_sent += (n * size_of::<T>()) as u64;
        self.stats.flushes += 1;
        // After a failure here, the next flush writes the full count again.
        self.sequence_unpublished = true;
        self.storage.publish_word(SEQUENCE_WORD, sequence)?;
        self.sequence_unpublished = false;
        Ok(n)
    }

    /// Messages the device has published and the host not yet received (one read of `tail`).
    fn available(&mut self) -> Result<u64, ChannelError> {
        let tail = self.storage.read_word(TAIL_WORD)?;
        if tail < self.position || tail - self.position > self.capacity {
            return Err(self.protocol(self.position, tail));
        }
        Ok(tail - self.position)
    }

    fn receive(&mut self, out: &mut [T]) -> Result<(), ChannelError> {
        let start = (self.position % self.capacity) as usize;
        self.storage.read_slots(start, out)?;
        let head = self.position + out.len() as u64;
        // Gives the slots back only after they were read.
        self.storage.write_word(HEAD_WORD, head)?;
        self.position = head;
        self.stats.polls += 1;
        self.stats.messages_received += out.len() as u64;
        self.stats.bytes_received += std::mem::size_of_val(out) as u64;
        Ok(())
    }

    /// Appends every message the device has published to `out`, in order, and gives their slots
    /// back; `Empty` if there was none.
    pub fn poll_from_device(&mut self, out: &mut Vec<T>) -> Result<Poll, ChannelError> {
        self.poll_at_most(out, usize::MAX)
    }

    /// As [`RingChannel::poll_from_device`], receiving at most `max` messages (`Empty` when `max`
    /// is 0).
    ///
    /// `HostMemory` if `out` cannot grow by the messages available; on any error nothing is
    /// received: `out` keeps what it held and the messages stay in the ring for the next poll.
    pub fn poll_at_most(&mut self, out: &mut Vec<T>, max: usize) -> Result<Poll, ChannelError> {
        self.require(Direction::DeviceToHost, "poll_from_device")?;
        let n = (self.available()? as usize).min(max);
        if n == 0 {
            self.stats.polls += 1;
            self.stats.empty_polls += 1;
            return Ok(Poll::Empty);
        }
        let from = out.len();
        out.try_reserve(n)
            .map_err(|_| ChannelError::HostMemory { bytes: n.saturating_mul(size_of::<T>()) })?;
        out.resize(from + n, T::zeroed());
        if let Err(e) = self.receive(&mut out[from..]) {
            // Nothing was received: `out` keeps only what it held.
            out.truncate(from);
            return Err(e);
        }
        Ok(Poll::Received(n))
    }

    /// Receives up to one slot's worth of messages into a slot of `pool` (no allocation once the
    /// pool is warm); `None` if the device published nothing.
    pub fn poll_batch(&mut self, pool: &SlotPool<T>) -> Result<Option<Slot<T>>, ChannelError> {
        self.require(Direction::DeviceToHost, "poll_batch")?;
        let n = (self.available()? as usize).min(pool.slot_len());
        if n == 0 {
            self.stats.polls += 1;
            self.stats.empty_polls += 1;
            return Ok(None);
        }
        let mut slot = pool.acquire();
        slot.truncate(n);
        self.receive(&mut slot)?;
        Ok(Some(slot))
    }

    /// Tells the device side to stop: sets [`FLAG_CLOSED`](crate::FLAG_CLOSED) in `flags`, after
    /// everything published. A host→device channel first publishes what is staged
    /// ([`flush_to_device`](Self::flush_to_device)), so nothing a send accepted is lost.
    ///
    /// A consumer that sees `FLAG_CLOSED` must read `tail` once more and drain up to it before it
    /// stops: the last publish may have landed between its previous read of `tail` and its read
    /// of `flags` (the kernel skeleton in `docs/channels.md` does). Sends after a close are
    /// refused (`Closed`); a device→host channel may still be polled, to drain it.
    pub fn close(&mut self) -> Result<(), ChannelError> {
        if self.direction == Direction::HostToDevice {
            self.flush_to_device()?;
        }
        let flags = if self.direction == Direction::DeviceToHost { FLAG_DEVICE_TO_HOST } else { 0 };
        self.storage.write_word(FLAGS_WORD, flags | FLAG_CLOSED)?;
        self.closed = true;
        Ok(())
    }

    /// The kernel's arguments for this channel (device addresses and geometry).
    ///
    /// A kernel launched with them is outside cumem's tracking (its launch is `unsafe`): it must
    /// follow the ring protocol (`docs/channels.md`, "Soundness") and have returned before the
    /// channel drops, since dropping frees the ring's memory. Close the channel
    /// ([`close`](Self::close)) and wait for the kernel's stream first.
    pub fn ring_args(&self) -> RingArgs {
        let (slots, control) = self.storage.device_ptrs();
        RingArgs { control, slots, capacity: self.capacity, message_size: size_of::<T>() as u64 }
    }

    /// Device views of the slots and the control block, for device work queued through cumem (a
    /// kernel launched through `view.on(&stream)`, or copies playing the device): work queued on
    /// them is ordered with the channel's own accesses by the memory's stream order and host-access
    /// tracking, as for any cumem buffer.
    pub fn device_side(&mut self) -> DeviceSide<'_, T> {
        let (slots, control) = self.storage.device_views();
        DeviceSide { slots, control }
    }
}

// A channel moves to the thread that drives it (a runtime's I/O thread); `&mut self` methods
// keep one driver at a time.
const _: fn() = || {
    fn movable<C: Send>() {}
    movable::<RingChannel<u64>>();
    movable::<DeviceSide<'static, u64>>();
};
