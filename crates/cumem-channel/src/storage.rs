//! Where a ring's slots and control block live for each strategy, and the only ways the host
//! reaches them: contiguous-or-wrapping slot ranges and single control words.
//!
//! Rings in device memory are reached only through cumem's typed copies. Rings in memory both
//! sides address (managed for `Unified`, mapped for `MappedPolling`) may be written by a running
//! persistent kernel while the host works on them, so the host never holds a Rust reference over
//! them: it first waits for the device work cumem knows of (copies through the device views), then
//! goes through raw pointers: control words as atomics (`Release` stores, `Acquire` loads, the
//! counterparts of the kernel's `st.release.sys` / `ld.acquire.sys`), slots as plain copies of the
//! ranges the protocol gives the host (slots before the `Release` of `tail` that publishes them,
//! after the `Acquire` of the `tail` that covers them).

use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};

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
///
/// A host write into a staging buffer synchronises the whole copies stream its last copy was
/// queued on (`PinnedBuffer` tracks streams, not copies), so it waits for everything queued there
/// since, the flush's own slot copies included if they were queued first. A flush therefore writes
/// every staging buffer it uses before it queues any copy ([`Storage::stage_word`], then
/// [`Storage::write_slots`], then [`Storage::publish_word`]): it waits for the previous flush's
/// copies only, never its own.
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
        /// The channel's own stream for prefetches and the memory's first use, so that the
        /// memory's stream order never holds a stream a persistent kernel may occupy.
        prefetches: Stream,
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

    /// A ring in device memory made and filled on `copies`, the stream every later access uses:
    /// the memory's stream order then holds `copies` alone, never the caller's stream, which a
    /// persistent kernel may occupy for good (an access ordered after it would wait forever).
    /// Synchronised before returning, so a kernel on any stream finds the ring initialised.
    pub(crate) fn queued(copies: &Stream, cap: usize, block: &ControlBlock) -> Result<Self> {
        let ctx = copies.context();
        let storage = Storage::Async {
            stream: copies.clone(),
            slots: DeviceBuffer::zeroed(copies, cap)?,
            control: DeviceBuffer::from_slice(copies, &words_of(block))?,
            stage: PinnedBuffer::zeroed(ctx, cap)?,
            words_out: STAGED_WORDS.iter().map(|_| PinnedBuffer::zeroed(ctx, 1)).collect::<Result<_>>()?,
            word_in: PinnedBuffer::zeroed(ctx, 1)?,
        };
        copies.synchronize()?;
        Ok(storage)
    }

    /// A ring in managed memory first used on, and prefetched on, a stream of its own (see
    /// `Storage::Unified::prefetches`).
    pub(crate) fn unified(ctx: &Context, cap: usize, block: &ControlBlock) -> Result<Self> {
        let prefetches = Stream::non_blocking(ctx)?;
        let storage = Storage::Unified {
            device: ctx.device(),
            slots: UnifiedBuffer::zeroed(&prefetches, cap)?,
            control: UnifiedBuffer::from_slice(&prefetches, &words_of(block))?,
            prefetches,
        };
        Ok(storage)
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
                // Waits for the copies of the previous flush out of the stage, then fills it (the
                // caller stages any control word before this queues the slot copies).
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
            Storage::Unified { prefetches, device, slots, .. } => {
                slots.wait_idle()?;
                // SAFETY: the managed allocation holds `cap` slots, aligned for T (checked when it
                // was allocated) and host-accessible, and lives as long as `self`, borrowed here.
                // Device work cumem knows of is done (waited for above); a kernel outside it reads
                // only slots below the `tail` it acquired, and these lie past the published `tail`
                // (which the `Release` store after this call publishes) and before the `head` the
                // host last acquired plus `cap` (their previous messages were consumed).
                unsafe { copy_to_slots(managed_ptr(slots.device_ptr()), start, data, cap) };
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    slots.prefetch_range(at..at + len, Location::Device(*device), prefetches)?;
                }
            }
            Storage::Mapped { slots, .. } => {
                slots.wait_idle()?;
                // SAFETY: as for `Unified`: the mapped allocation holds `cap` aligned slots for as
                // long as `self`, and `as_ptr` carries the allocation's provenance (it is not
                // derived from a reference), so writing through it is allowed.
                unsafe { copy_to_slots(slots.as_ptr().cast_mut(), start, data, cap) };
            }
        }
        Ok(())
    }

    /// Reads `out.len()` slots from `start` on, wrapping at the end.
    pub(crate) fn read_slots(&mut self, start: usize, out: &mut [T]) -> Result<()> {
        let cap = self.capacity();
        let pieces = segments(start, out.len(), cap);
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
            Storage::Unified { prefetches, slots, .. } => {
                for (at, len) in pieces.into_iter().filter(|p| p.1 > 0) {
                    slots.prefetch_range(at..at + len, Location::Host, prefetches)?;
                }
                slots.wait_idle()?;
                // SAFETY: the managed allocation holds `cap` aligned, host-accessible slots for as
                // long as `self`. Device work cumem knows of is done (waited for above); a kernel
                // outside it wrote these slots before the `Release` of the `tail` the caller
                // acquired, and writes them again only after the `head` written after this call.
                unsafe { copy_from_slots(managed_ptr(slots.device_ptr()), start, out, cap) };
            }
            Storage::Mapped { slots, .. } => {
                slots.wait_idle()?;
                // SAFETY: as for `Unified`, with the mapped allocation's host address.
                unsafe { copy_from_slots(slots.as_ptr(), start, out, cap) };
            }
        }
        Ok(())
    }

    /// Reads control word `index`, as the device last wrote it; for rings both sides address, an
    /// `Acquire` load, so the slots the device wrote before publishing the value are visible.
    pub(crate) fn read_word(&mut self, index: usize) -> Result<u64> {
        debug_assert!(index < CONTROL_WORDS);
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
            Storage::Unified { control, .. } => {
                control.wait_idle()?;
                // SAFETY: `index` is one of the block's words (below `CONTROL_WORDS`), so the
                // pointer is inside the managed allocation, 8-byte aligned (u64 elements of an
                // aligned allocation), alive while `self` is borrowed; every concurrent access is
                // atomic (see `load_word`).
                unsafe { load_word(managed_ptr::<u64>(control.device_ptr()).add(index)) }
            }
            Storage::Mapped { control, .. } => {
                control.wait_idle()?;
                // SAFETY: as for `Unified`, in the mapped allocation (whose `as_ptr` carries its
                // provenance).
                unsafe { load_word(control.as_ptr().cast_mut().add(index)) }
            }
        };
        Ok(value)
    }

    /// Writes control word `index` (one of the words the host owns), after everything written
    /// before: for rings both sides address, a `Release` store, so a device that acquires the value
    /// sees the slots written before it.
    pub(crate) fn write_word(&mut self, index: usize, value: u64) -> Result<()> {
        self.stage_word(index, value)?;
        self.publish_word(index, value)
    }

    /// For queued copies, puts `value` into control word `index`'s page-locked staging word, which
    /// waits for the copies queued so far on the copies stream (see [`STAGED_WORDS`]); nothing for
    /// the other strategies. [`Storage::publish_word`] with the same value writes the word.
    pub(crate) fn stage_word(&mut self, index: usize, value: u64) -> Result<()> {
        debug_assert!(index < CONTROL_WORDS);
        if let Storage::Async { words_out, .. } = self {
            words_out[staged_word(index)].as_mut_slice()?[0] = value;
        }
        Ok(())
    }

    /// Writes control word `index` as [`Storage::write_word`] does, for queued copies by queuing
    /// the copy of the staging word that [`Storage::stage_word`] filled with `value` (it does not
    /// touch the staging word, so it waits for nothing).
    pub(crate) fn publish_word(&mut self, index: usize, value: u64) -> Result<()> {
        debug_assert!(index < CONTROL_WORDS);
        match self {
            Storage::Sync { control, .. } => copy_h2d(&[value], &mut control.slice_mut(index..index + 1)?),
            Storage::Async { stream, control, words_out, .. } => {
                stream.copy_h2d(&words_out[staged_word(index)], &mut control.slice_mut(index..index + 1)?)
            }
            Storage::Unified { control, .. } => {
                control.wait_idle()?;
                // SAFETY: as in `read_word`: an aligned word inside the live managed allocation,
                // accessed atomically by every side.
                unsafe { store_word(managed_ptr::<u64>(control.device_ptr()).add(index), value) };
                Ok(())
            }
            Storage::Mapped { control, .. } => {
                control.wait_idle()?;
                // SAFETY: as for `Unified`, in the mapped allocation.
                unsafe { store_word(control.as_ptr().cast_mut().add(index), value) };
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

/// Which of `Storage::Async`'s `words_out` stages control word `index`.
fn staged_word(index: usize) -> usize {
    STAGED_WORDS.iter().position(|&w| w == index).unwrap_or(0)
}

/// The host address of managed memory at device address `addr` (managed memory has one address
/// on every side).
fn managed_ptr<U>(addr: u64) -> *mut U {
    // The allocation came from the driver as an address, not from a Rust allocation: its
    // provenance is the exposed one.
    ptr::with_exposed_provenance_mut(addr as usize)
}

/// Loads the control word at `word` with `Acquire`.
///
/// # Safety
/// 1. `word` is 8-byte aligned and points to a host-accessible control word that stays allocated
///    for the call.
/// 2. Every access to it that may run at the same time is atomic: the host's go through
///    `load_word`/`store_word`, a kernel's are the protocol's `ld.acquire` / `st.release` (a device
///    peer is another thread of the same memory, and the hardware makes its aligned 8-byte
///    accesses single-copy atomic), and cumem-ordered device copies completed before the call.
unsafe fn load_word(word: *mut u64) -> u64 {
    // SAFETY: items 1 and 2: aligned, alive, and only ever accessed atomically while shared.
    unsafe { AtomicU64::from_ptr(word) }.load(Ordering::Acquire)
}

/// Stores `value` into the control word at `word` with `Release`.
///
/// # Safety
/// As for [`load_word`].
unsafe fn store_word(word: *mut u64, value: u64) {
    // SAFETY: as in `load_word`.
    unsafe { AtomicU64::from_ptr(word) }.store(value, Ordering::Release)
}

/// Copies `data` into the slots from `start` on, wrapping at `cap`.
///
/// # Safety
/// 1. `base` points to `cap` host-accessible slots, aligned for T, allocated for the call.
/// 2. Nothing reads or writes the slots written (`data.len() <= cap` of them from `start`) during
///    the call: by the protocol a consumer reads them only after the `tail` published after it,
///    and had finished reading their previous messages before it released the `head` the host
///    acquired past them (the host reuses no slot beyond the `head` it last read).
unsafe fn copy_to_slots<T: Pod>(base: *mut T, start: usize, data: &[T], cap: usize) {
    let mut from = 0;
    for (at, len) in segments(start, data.len(), cap).into_iter().filter(|p| p.1 > 0) {
        // SAFETY: `at + len <= cap` and `from + len <= data.len()` (`segments`); item 1 makes the
        // destination valid and item 2 unaliased; `data` is a separate host slice.
        unsafe { ptr::copy_nonoverlapping(data.as_ptr().add(from), base.add(at), len) };
        from += len;
    }
}

/// Copies `out.len()` slots from `start` on, wrapping at `cap`, into `out`.
///
/// # Safety
/// 1. `base` points to `cap` initialised, host-accessible slots, aligned for T, allocated for the
///    call.
/// 2. Nothing writes the slots read during the call: by the protocol the producer wrote them
///    before the `tail` the caller acquired, and reuses them only after the `head` written after.
unsafe fn copy_from_slots<T: Pod>(base: *const T, start: usize, out: &mut [T], cap: usize) {
    let mut to = 0;
    for (at, len) in segments(start, out.len(), cap).into_iter().filter(|p| p.1 > 0) {
        // SAFETY: as in `copy_to_slots`, reading (any bit pattern is a valid `T: Pod`).
        unsafe { ptr::copy_nonoverlapping(base.add(at), out.as_mut_ptr().add(to), len) };
        to += len;
    }
}

const _: () = assert!(CONTROL_WORDS == 64);
