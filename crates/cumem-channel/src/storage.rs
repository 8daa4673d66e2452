//! Where a ring's slots and control block live for each strategy, and the only ways the host
//! reaches them: contiguous-or-wrapping slot ranges and single control words.
//!
//! Every access goes through cumem's typed copies or its host-access rules (pinned, mapped and
//! managed buffers wait for the device work they know of before the host touches them), so nothing
//! here races with device work that was queued through cumem.

use std::sync::atomic::{Ordering, fence};

use bytemuck::Pod;
use cumem_copy::{Copy2D, Pitched, StreamCopy, copy_d2h, copy_h2d};
use cumem_core::{Context, Device, DeviceBuffer, DeviceSliceMut, MappedBuffer, PinnedBuffer, Result, Stream};
use cumem_unified::{Location, UnifiedBuffer};

use crate::layout::{CONTROL_WORDS, ControlBlock, FLAGS_WORD, HEAD_WORD, SEQUENCE_WORD, TAIL_WORD};

/// The (at most two) contiguous pieces of `len` slots starting at slot `start` of a ring of `cap`.
pub(crate) fn segments(start: usize, len: usize, cap: usize) -> [(usize, usize); 2] {
    let first = len.min(cap - start);
    [(start, first), (0, len - first)]
}

/// The control words the host writes, each with its own page-locked staging word so that queuing
/// one never waits for the copy of another.
const STAGED_WORDS: [usize; 4] = [HEAD_WORD, TAIL_WORD, SEQUENCE_WORD, FLAGS_WORD];

// One per channel, made once and never moved in a loop: boxing the big variant would only add a
// pointer chase to every access.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Storage<T> {
    Sync {
        slots: DeviceBuffer<T>,
        control: DeviceBuffer<u64>,
    },
    Async {
        stream: Stream,
        slots: DeviceBuffer<T>,
        control: DeviceBuffer<u64>,
        stage: PinnedBuffer<T>,
        words_out: Vec<PinnedBuffer<u64>>,
        word_in: PinnedBuffer<u64>,
    },
    Unified {
        stream: Stream,
        device: Device,
        slots: UnifiedBuffer<T>,
        control: UnifiedBuffer<u64>,
    },
    Mapped {
        slots: MappedBuffer<T>,
        control: MappedBuffer<u64>,
    },
}

fn words_of(block: &ControlBlock) -> Vec<u64> {
    bytemuck::cast_slice::<ControlBlock, u64>(std::slice::from_ref(block)).to_vec()
}

impl<T: Pod> Storage<T> {
    pub(crate) fn sync(stream: &Stream, cap: usize, block: &ControlBlock) -> Result<Self> {
        Ok(Storage::Sync {
            slots: DeviceBuffer::zeroed(stream, cap)?,
            control: DeviceBuffer::from_slice(stream, &words_of(block))?,
        })
    }

    pub(crate) fn queued(stream: &Stream, copies: &Stream, cap: usize, block: &ControlBlock) -> Result<Self> {
        let ctx = stream.context();
        Ok(Storage::Async {
            stream: copies.clone(),
            slots: DeviceBuffer::zeroed(stream, cap)?,
            control: DeviceBuffer::from_slice(stream, &words_of(block))?,
            stage: PinnedBuffer::zeroed(ctx, cap)?,
            words_out: STAGED_WORDS.iter().map(|_| PinnedBuffer::zeroed(ctx, 1)).collect::<Result<_>>()?,
            word_in: PinnedBuffer::zeroed(ctx, 1)?,
        })
    }

    pub(crate) fn unified(stream: &Stream, cap: usize, block: &ControlBlock) -> Result<Self> {
        Ok(Storage::Unified {
            stream: stream.clone(),
            device: stream.context().device(),
            slots: UnifiedBuffer::zeroed(stream, cap)?,
            control: UnifiedBuffer::from_slice(stream, &words_of(block))?,
        })
    }

    pub(crate) fn mapped(ctx: &Context, cap: usize, block: &ControlBlock) -> Result<Self> {
        Ok(Storage::Mapped {
            slots: MappedBuffer::zeroed(ctx, cap)?,
            control: MappedBuffer::from_slice(ctx, &words_of(block))?,
        })
    }

    fn capacity(&self) -> usize {
        match self {
            Storage::Sync { slots, .. } | Storage::Async { slots, .. } => slots.len(),
            Storage::Unified { slots, .. } => slots.len(),
            Storage::Mapped { slots, .. } => slots.len(),
        }
    }

    /// Writes `data` into the slots from `start` on, wrapping at the end; visible to the device (for
    /// queued copies: ordered before anything queued later on the stream) when this returns.
    pub(crate) fn write_slots(&mut self, start: usize, data: &[T]) -> Result<()> {
        let cap = self.capacity();
        let pieces = segments(start, data.len(), cap);
        match self {
            Storage::Sync { slots, .. } => {
                let mut from = 0;
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    copy_h2d(&data[from..from + len], &mut slots.slice_mut(at..at + len)?)?;
                    from += len;
                }
            }
            Storage::Async { stream, slots, stage, .. } => {
                // Waits for the copies of the previous flush out of the stage, then fills it.
                let host = stage.as_mut_slice()?;
                let mut from = 0;
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    host[at..at + len].copy_from_slice(&data[from..from + len]);
                    from += len;
                }
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    // One row of the stage seen as a pitched row: the only typed way to copy part of
                    // a page-locked buffer, which the stage's tracker then knows is being read.
                    let extent = Copy2D::new(len, 1).src_at(at, 0).dst_at(at, 0);
                    stream.copy_2d(
                        &Pitched::new(&*stage, cap),
                        &mut Pitched::new(slots.as_mut_slice(), cap),
                        extent,
                    )?;
                }
            }
            Storage::Unified { stream, device, slots, .. } => {
                let host = slots.as_mut_slice()?;
                let mut from = 0;
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    host[at..at + len].copy_from_slice(&data[from..from + len]);
                    from += len;
                }
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    slots.prefetch_range(at..at + len, Location::Device(*device), stream)?;
                }
            }
            Storage::Mapped { slots, .. } => {
                let host = slots.as_mut_slice()?;
                let mut from = 0;
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    host[at..at + len].copy_from_slice(&data[from..from + len]);
                    from += len;
                }
            }
        }
        // The slots must be visible before the position that covers them (written next).
        fence(Ordering::Release);
        Ok(())
    }

    /// Reads `out.len()` slots from `start` on, wrapping at the end.
    pub(crate) fn read_slots(&mut self, start: usize, out: &mut [T]) -> Result<()> {
        let cap = self.capacity();
        let pieces = segments(start, out.len(), cap);
        fence(Ordering::Acquire);
        match self {
            Storage::Sync { slots, .. } => {
                let mut to = 0;
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    copy_d2h(&slots.slice(at..at + len)?, &mut out[to..to + len])?;
                    to += len;
                }
            }
            Storage::Async { stream, slots, stage, .. } => {
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    let extent = Copy2D::new(len, 1).src_at(at, 0).dst_at(at, 0);
                    stream.copy_2d(
                        &Pitched::new(slots.as_slice(), cap),
                        &mut Pitched::new(&mut *stage, cap),
                        extent,
                    )?;
                }
                // Waits for the copies into the stage.
                let host = stage.as_slice()?;
                let mut to = 0;
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    out[to..to + len].copy_from_slice(&host[at..at + len]);
                    to += len;
                }
            }
            Storage::Unified { stream, slots, .. } => {
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    slots.prefetch_range(at..at + len, Location::Host, stream)?;
                }
                let host = slots.as_slice()?;
                let mut to = 0;
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    out[to..to + len].copy_from_slice(&host[at..at + len]);
                    to += len;
                }
            }
            Storage::Mapped { slots, .. } => {
                let host = slots.as_slice()?;
                let mut to = 0;
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    out[to..to + len].copy_from_slice(&host[at..at + len]);
                    to += len;
                }
            }
        }
        Ok(())
    }

    /// Reads control word `index`, as the device last wrote it.
    pub(crate) fn read_word(&mut self, index: usize) -> Result<u64> {
        let value = match self {
            Storage::Sync { control, .. } => {
                let mut v = [0u64];
                copy_d2h(&control.slice(index..index + 1)?, &mut v)?;
                v[0]
            }
            Storage::Async { stream, control, word_in, .. } => {
                stream.copy_d2h(&control.slice(index..index + 1)?, word_in)?;
                word_in.as_slice()?[0]
            }
            Storage::Unified { control, .. } => control.as_slice()?[index],
            Storage::Mapped { control, .. } => control.as_slice()?[index],
        };
        fence(Ordering::Acquire);
        Ok(value)
    }

    /// Writes control word `index` (one of the words the host owns), after everything written before.
    pub(crate) fn write_word(&mut self, index: usize, value: u64) -> Result<()> {
        fence(Ordering::Release);
        match self {
            Storage::Sync { control, .. } => copy_h2d(&[value], &mut control.slice_mut(index..index + 1)?),
            Storage::Async { stream, control, words_out, .. } => {
                let slot = STAGED_WORDS.iter().position(|&w| w == index).unwrap_or(0);
                let staged = &mut words_out[slot];
                staged.as_mut_slice()?[0] = value;
                stream.copy_h2d(&*staged, &mut control.slice_mut(index..index + 1)?)
            }
            Storage::Unified { control, .. } => {
                control.as_mut_slice()?[index] = value;
                Ok(())
            }
            Storage::Mapped { control, .. } => {
                control.as_mut_slice()?[index] = value;
                Ok(())
            }
        }
    }

    /// Device views of the slots and the control words (for a kernel's arguments or a simulated
    /// device side).
    pub(crate) fn device_views(&mut self) -> (DeviceSliceMut<'_, T>, DeviceSliceMut<'_, u64>) {
        match self {
            Storage::Sync { slots, control } | Storage::Async { slots, control, .. } => {
                (slots.as_mut_slice(), control.as_mut_slice())
            }
            Storage::Unified { slots, control, .. } => {
                (slots.as_device_slice_mut(), control.as_device_slice_mut())
            }
            Storage::Mapped { slots, control } => {
                (slots.as_device_slice_mut(), control.as_device_slice_mut())
            }
        }
    }

    /// Device addresses of the slots and the control block.
    pub(crate) fn device_ptrs(&self) -> (u64, u64) {
        match self {
            Storage::Sync { slots, control } | Storage::Async { slots, control, .. } => {
                (slots.device_ptr(), control.device_ptr())
            }
            Storage::Unified { slots, control, .. } => (slots.device_ptr(), control.device_ptr()),
            Storage::Mapped { slots, control } => (slots.device_ptr(), control.device_ptr()),
        }
    }
}

const _: () = assert!(CONTROL_WORDS == 64);
