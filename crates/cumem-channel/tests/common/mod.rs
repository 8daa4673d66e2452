//! The device side of a ring, played with copies queued on a stream of its own (the simulator has
//! no kernels): reads the control block and slots through the channel's device views, writes its
//! own position back. Work on this stream is ordered with the channel's accesses only by cumem's
//! stream orders and host-access tracking, so a missing wait shows up as lost or stale messages.
//!
//! The player goes through device memory, as a kernel does: every copy it queues has one end in a
//! small device buffer of its own (ring view → device → pinned to read, pinned → device → ring view
//! to write). A copy between two host memories (a pinned buffer and a mapped ring) would be
//! synchronous on a GPU (observed on an H100, 2026-11-23): it waits in the call for the stream's
//! earlier work, so on a held stream it would block the test before the statement that opens the
//! gate. Copies with a device end stay queued.
//!
//! [`hold`] holds a stream with a gate that opens by itself after [`HOLD_DEADLINE`], so that a call
//! that waits for the held stream while the test holds it fails the test instead of hanging it.

#![allow(dead_code)]

use std::time::Duration;

use bytemuck::Pod;
use cumem_channel::{ControlBlock, RingChannel, VisibilityReport};
use cumem_copy::StreamCopy;
use cumem_core::{Device, DeviceBuffer, PinnedBuffer, Stream};
use cumem_sys::testing;

pub const HEAD: usize = ControlBlock::HEAD_WORD;
pub const TAIL: usize = ControlBlock::TAIL_WORD;
pub const SEQUENCE: usize = ControlBlock::SEQUENCE_WORD;
pub const FLAGS: usize = ControlBlock::FLAGS_WORD;

/// A native-Linux report for `device`, whatever this machine runs.
pub fn native(device: Device) -> VisibilityReport {
    VisibilityReport::detect_with_os(device, "6.8.0-45-generic").unwrap()
}

pub struct DevicePlayer<T: Pod> {
    pub stream: Stream,
    control: PinnedBuffer<u64>,
    slots: PinnedBuffer<T>,
    word: PinnedBuffer<u64>,
    /// The device memory every copy goes through (see the module docs).
    on_device_control: DeviceBuffer<u64>,
    on_device_slots: DeviceBuffer<T>,
    on_device_word: DeviceBuffer<u64>,
}

impl<T: Pod> DevicePlayer<T> {
    pub fn new(stream: &Stream, capacity: usize) -> Self {
        let ctx = stream.context();
        DevicePlayer {
            stream: stream.clone(),
            control: PinnedBuffer::zeroed(ctx, ControlBlock::WORDS).unwrap(),
            slots: PinnedBuffer::zeroed(ctx, capacity).unwrap(),
            word: PinnedBuffer::zeroed(ctx, 1).unwrap(),
            on_device_control: DeviceBuffer::zeroed(stream, ControlBlock::WORDS).unwrap(),
            on_device_slots: DeviceBuffer::zeroed(stream, capacity).unwrap(),
            on_device_word: DeviceBuffer::zeroed(stream, 1).unwrap(),
        }
    }

    /// The control block as the device sees it now.
    pub fn control(&mut self, ch: &mut RingChannel<T>) -> Vec<u64> {
        let side = ch.device_side();
        self.stream.copy_d2d(&side.control, &mut self.on_device_control).unwrap();
        self.stream.copy_d2h(&self.on_device_control, &mut self.control).unwrap();
        self.control.to_vec().unwrap()
    }

    /// Queues a copy of the player's slot mirror into the ring's slots, through device memory.
    fn publish_mirror(&mut self, ch: &mut RingChannel<T>) {
        self.stream.copy_h2d(&self.slots, &mut self.on_device_slots).unwrap();
        self.stream.copy_d2d(&self.on_device_slots, &mut ch.device_side().slots).unwrap();
    }

    /// Writes control word `index` from the device side (to play a misbehaving device).
    pub fn produce_word(&mut self, ch: &mut RingChannel<T>, index: usize, value: u64) {
        self.write_word(ch, index, value)
    }

    fn write_word(&mut self, ch: &mut RingChannel<T>, index: usize, value: u64) {
        self.word.as_mut_slice().unwrap()[0] = value;
        self.stream.copy_h2d(&self.word, &mut self.on_device_word).unwrap();
        let mut side = ch.device_side();
        let mut target = side.control.slice_mut(index..index + 1).unwrap();
        self.stream.copy_d2d(&self.on_device_word, &mut target).unwrap();
    }

    /// Consumes up to `max` published messages of a host→device channel, in order.
    pub fn consume(&mut self, ch: &mut RingChannel<T>, max: usize) -> Vec<T> {
        let cap = ch.capacity() as u64;
        let words = self.control(ch);
        let (head, tail) = (words[HEAD], words[TAIL]);
        assert!(head <= tail && tail - head <= cap, "the host published a broken tail: {head}..{tail}");
        let n = (tail - head).min(max as u64);
        if n == 0 {
            return Vec::new();
        }
        let side = ch.device_side();
        self.stream.copy_d2d(&side.slots, &mut self.on_device_slots).unwrap();
        self.stream.copy_d2h(&self.on_device_slots, &mut self.slots).unwrap();
        let slots = self.slots.to_vec().unwrap();
        let got = (head..head + n).map(|p| slots[(p % cap) as usize]).collect();
        self.write_word(ch, HEAD, head + n);
        got
    }

    /// Publishes `msgs` after the `tail` the caller says the ring is at, without looking at the
    /// control block first, so that nothing here waits for this player's stream (which a test may
    /// hold). The caller knows they fit.
    pub fn publish_blind(&mut self, ch: &mut RingChannel<T>, tail: u64, msgs: &[T]) {
        let cap = ch.capacity() as u64;
        let mirror = self.slots.as_mut_slice().unwrap();
        for (i, m) in msgs.iter().enumerate() {
            mirror[((tail + i as u64) % cap) as usize] = *m;
        }
        self.publish_mirror(ch);
        self.write_word(ch, TAIL, tail + msgs.len() as u64);
    }

    /// Publishes as many of `msgs` as fit in a device→host channel (slots, then tail); returns how
    /// many.
    pub fn produce(&mut self, ch: &mut RingChannel<T>, msgs: &[T]) -> usize {
        let cap = ch.capacity() as u64;
        let words = self.control(ch);
        let (head, tail) = (words[HEAD], words[TAIL]);
        assert!(head <= tail && tail - head <= cap, "the host gave back a broken head: {head}..{tail}");
        let n = (cap - (tail - head)).min(msgs.len() as u64);
        if n == 0 {
            return 0;
        }
        // Only this side writes the slots, so its mirror holds what every unconsumed slot holds.
        let mirror = self.slots.as_mut_slice().unwrap();
        for (i, m) in msgs[..n as usize].iter().enumerate() {
            mirror[((tail + i as u64) % cap) as usize] = *m;
        }
        self.publish_mirror(ch);
        self.write_word(ch, TAIL, tail + n);
        n as usize
    }
}

/// How long [`hold`] keeps a stream held at most: far longer than any step of these tests takes,
/// so only a call that waits for the held stream while the test still holds it (which would hang
/// without the deadline) gets there; the gate then opens, and its release fails the test.
pub const HOLD_DEADLINE: Duration = Duration::from_secs(30);

/// Holds `stream` until the gate is released, or for [`HOLD_DEADLINE`] at most (see
/// `cumem_sys::testing::Gate`: the calling test must be `#[serial]`, and ends its hold with
/// `release()`, or `release_after` and a join of its handle, which fail if the deadline came first).
pub fn hold(stream: &Stream) -> testing::Gate {
    assert!(serial_test::is_locked_serially(None), "a test that holds a stream must be #[serial]");
    stream.context().bind().unwrap();
    // SAFETY: `stream` is alive (borrowed), and its context was just made current.
    unsafe { testing::hold_for(stream.raw(), HOLD_DEADLINE) }
}
