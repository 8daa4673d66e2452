//! The device side of a ring, played with copies queued on a stream of its own (the simulator has
//! no kernels): reads the control block and slots through the channel's device views, writes its
//! own position back. Work on this stream is ordered with the channel's accesses only by cumem's
//! stream orders and host-access tracking, so a missing wait shows up as lost or stale messages.

#![allow(dead_code)]

use bytemuck::Pod;
use cumem_channel::{ControlBlock, RingChannel, VisibilityReport};
use cumem_copy::StreamCopy;
use cumem_core::{Device, PinnedBuffer, Stream};

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
}

impl<T: Pod> DevicePlayer<T> {
    pub fn new(stream: &Stream, capacity: usize) -> Self {
        let ctx = stream.context();
        DevicePlayer {
            stream: stream.clone(),
            control: PinnedBuffer::zeroed(ctx, ControlBlock::WORDS).unwrap(),
            slots: PinnedBuffer::zeroed(ctx, capacity).unwrap(),
            word: PinnedBuffer::zeroed(ctx, 1).unwrap(),
        }
    }

    /// The control block as the device sees it now.
    pub fn control(&mut self, ch: &mut RingChannel<T>) -> Vec<u64> {
        let side = ch.device_side();
        self.stream.copy_d2h(&side.control, &mut self.control).unwrap();
        self.control.to_vec().unwrap()
    }

    /// Writes control word `index` from the device side (to play a misbehaving device).
    pub fn produce_word(&mut self, ch: &mut RingChannel<T>, index: usize, value: u64) {
        self.write_word(ch, index, value)
    }

    fn write_word(&mut self, ch: &mut RingChannel<T>, index: usize, value: u64) {
        self.word.as_mut_slice().unwrap()[0] = value;
        let mut side = ch.device_side();
        self.stream.copy_h2d(&self.word, &mut side.control.slice_mut(index..index + 1).unwrap()).unwrap();
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
        self.stream.copy_d2h(&side.slots, &mut self.slots).unwrap();
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
        self.stream.copy_h2d(&self.slots, &mut ch.device_side().slots).unwrap();
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
        self.stream.copy_h2d(&self.slots, &mut ch.device_side().slots).unwrap();
        self.write_word(ch, TAIL, tail + n);
        n as usize
    }
}
