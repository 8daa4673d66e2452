//! Copies between ordinary (pageable) host slices and device memory through a reusable ring of
//! pinned chunks, overlapping the host `memcpy` of one chunk with the DMA of another.
//!
//! A copy from pageable memory cannot be a true DMA: the driver stages it through its own pinned
//! buffer and, for a plain `cuMemcpyHtoD`, does so one piece at a time with little overlap. A
//! [`StagingRing`] does the staging itself, with a few pinned chunks it owns and reuses across calls
//! (keep one per context, next to the stream you copy on). For host→device, chunk *k+1* is filled
//! from the caller's slice while the copy of chunk *k* is still queued or running; for
//! device→host, chunk *k* is copied out to the caller's slice while the copies into the following
//! chunks run. Each chunk carries an event recorded after the last copy that uses it, and the host
//! waits for that event before writing the chunk again (host→device) or reading it
//! (device→host), so a chunk is never overwritten while a copy reads it, nor read while a copy
//! writes it.
//!
//! There is one entry point per direction:
//! - [`StagingRing::copy_h2d`] returns once every byte of the source has been copied into a chunk
//!   and the chunk's copy queued on the stream: the caller's slice is free at once, and the device
//!   memory is ordered on the stream like any queued copy (later work on it waits).
//! - [`StagingRing::copy_d2h`] returns once the destination slice holds the data.
//!
//! Neither touches the caller's slice after it returns. The device side should be device memory:
//! a chunk's copy into or out of the device view of mapped memory is a copy between two host
//! memories, which the driver runs synchronously (see [`StreamCopy`](crate::StreamCopy)), so it
//! gets no overlap; copy into mapped memory from the host directly instead. [`StagingRing::stats`] says how many
//! chunks were copied and how often a chunk was filled (or emptied) while the neighbouring
//! chunk's copy was still in flight, which is the overlap this module exists for.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, DeviceBuffer, Stream};
//! use cumem_copy::{StagingConfig, StagingRing};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::non_blocking(&ctx)?;
//! // Small chunks to show the ring at work; the default (`StagingRing::new`) suits large copies.
//! let mut ring = StagingRing::with_config(&ctx, StagingConfig { chunk_bytes: 4096, chunks: 3 })?;
//! let data: Vec<u32> = (0..10_000).collect();
//! let mut dev = DeviceBuffer::<u32>::zeroed(&stream, data.len())?;
//! ring.copy_h2d(&stream, &data, &mut dev)?; // `data` may be reused at once
//! let mut back = vec![0u32; data.len()];
//! ring.copy_d2h(&stream, &dev, &mut back)?; // `back` is filled on return
//! assert_eq!(back, data);
//! assert_eq!(ring.stats().chunks, 2 * 10); // 40 000 bytes = 10 chunks each way
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::ptr::NonNull;

use bytemuck::{AnyBitPattern, NoUninit};
use cumem_core::{AsDeviceSlice, AsDeviceSliceMut, Context, Error, Event, Result, Stream};

use crate::profile::{self, CopyKind};
use crate::{ffi, validate};

/// The shape of a [`StagingRing`]: how many pinned chunks, of how many bytes each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingConfig {
    /// Bytes per chunk (at least 1). Large enough that one copy's fixed cost is small next to
    /// its transfer time (a few MiB on a GPU).
    pub chunk_bytes: usize,
    /// Number of chunks (at least 2, so that one can be filled while another is copied).
    pub chunks: usize,
}

impl Default for StagingConfig {
    /// Four chunks of 4 MiB: 16 MiB of pinned memory per ring, allocated on first use.
    fn default() -> Self {
        StagingConfig { chunk_bytes: 4 << 20, chunks: 4 }
    }
}

/// What a [`StagingRing`] has done since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StagingStats {
    /// Calls that succeeded and copied at least one byte.
    pub calls: u64,
    /// Chunk copies queued (one per chunk-sized piece of each call), those of failed calls
    /// included.
    pub chunks: u64,
    /// Bytes copied by the calls that succeeded, both directions.
    pub bytes: u64,
    /// Chunks whose host `memcpy` finished while the copy of the neighbouring chunk (the previous
    /// one for host→device, the next one for device→host) was still queued or running: the
    /// overlap of host and device work that staging is for.
    pub overlapped: u64,
    /// Times the host had to wait for a chunk's earlier copy before reusing the chunk.
    pub reuse_waits: u64,
    /// Pinned bytes the ring holds now.
    pub pinned_bytes: usize,
}

/// One pinned chunk and the event recorded after the last copy that used it.
struct Chunk {
    ptr: NonNull<u8>,
    done: Event,
    /// `done` has been recorded since the chunk was allocated (so it may still be pending).
    recorded: bool,
}

/// A reusable ring of pinned chunks for copies between pageable host slices and device memory
/// (see the [module docs](self)). Keep one per context and reuse it: the chunks are allocated on
/// first use and freed when the ring is dropped, after every copy that uses them has completed.
pub struct StagingRing {
    ctx: Context,
    config: StagingConfig,
    chunks: Vec<Chunk>,
    stats: StagingStats,
    /// The stream of a chunk copy that may be queued without its chunk's event recorded after it:
    /// set before each copy is queued and cleared once the event is recorded, so that an error or
    /// a panic in between (a tracing subscriber, a profiler) leaves it set. While set, no chunk is
    /// reused or freed until this stream has been waited out; if that fails, the chunks are leaked
    /// on drop, since the device may still use them.
    unguarded: Option<Stream>,
    /// Host threads that fill or empty one chunk (the calling thread included).
    fill_threads: usize,
}

// SAFETY: the chunk pointers name pinned memory owned by the ring and used only through `&mut
// self` (or by device work that each chunk's event guards); nothing is tied to a thread.
unsafe impl Send for StagingRing {}
// SAFETY: `&self` methods read plain counters only; chunk memory is reached through `&mut self`.
unsafe impl Sync for StagingRing {}

impl StagingRing {
    /// A ring for copies in `ctx`, with the default shape ([`StagingConfig::default`]).
    pub fn new(ctx: &Context) -> Result<StagingRing> {
        StagingRing::with_config(ctx, StagingConfig::default())
    }

    /// A ring for copies in `ctx` with `config`'s shape; `InvalidValue` when it has fewer than two
    /// chunks or empty ones. Allocates nothing until the first copy.
    pub fn with_config(ctx: &Context, config: StagingConfig) -> Result<StagingRing> {
        if config.chunks < 2 || config.chunk_bytes == 0 {
            return Err(Error::InvalidValue {
                ctx: cumem_sys::ErrorContext::op("StagingRing::with_config (needs 2+ chunks of 1+ bytes)"),
            });
        }
        Ok(StagingRing {
            ctx: ctx.clone(),
            config,
            chunks: Vec::new(),
            stats: StagingStats::default(),
            unguarded: None,
            fill_threads: 1,
        })
    }

    /// The ring's shape.
    pub fn config(&self) -> StagingConfig {
        self.config
    }

    /// The context the ring's chunks belong to.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Splits each chunk's host `memcpy` over up to `threads` threads (the calling one included;
    /// 0 counts as 1, the default; more than [`MAX_FILL_THREADS`] count as that many), in parts of
    /// at least 64 KiB. One core's `memcpy` into pinned memory can be slower than the link (an
    /// H100 moves ≈ 53 GB/s from pinned memory over PCIe Gen5), and staging is never faster than
    /// its fills; spare cores close that gap. The threads are scoped to each chunk's fill; if one
    /// cannot be started, the calling thread copies its part.
    pub fn set_fill_threads(&mut self, threads: usize) {
        self.fill_threads = threads.clamp(1, MAX_FILL_THREADS);
    }

    /// Host threads per chunk fill (see [`StagingRing::set_fill_threads`]).
    pub fn fill_threads(&self) -> usize {
        self.fill_threads
    }

    /// What the ring has done so far.
    pub fn stats(&self) -> StagingStats {
        self.stats
    }

    /// Copies `src` into device memory `dst` (same length) on `stream`, through the ring.
    ///
    /// Returns once `src` has been read completely (it may be reused at once); the device copies
    /// may still be running, ordered on `stream` like any queued copy. `stream` and `dst` must
    /// belong to the ring's device (`WrongDevice`). After a failed call whose copies could not be
    /// waited for, the chunks may still be in use: each later call tries that wait again first,
    /// and answers `NotReady` (copying nothing) while it fails.
    pub fn copy_h2d<T: NoUninit>(
        &mut self,
        stream: &Stream,
        src: &[T],
        dst: &mut impl AsDeviceSliceMut<T>,
    ) -> Result<()> {
        let dst = dst.as_device_slice_mut();
        validate::same_len(dst.len(), src.len())?;
        self.check(stream, dst.context())?;
        let src: &[u8] = bytemuck::cast_slice(src);
        if src.is_empty() {
            return Ok(());
        }
        let _span = tracing::debug_span!(
            "staged_copy",
            device = self.ctx.device().ordinal(),
            stream = stream.id(),
            bytes = src.len(),
            kind = "h2d",
        )
        .entered();
        let mut dst = dst;
        let on = dst.on(stream)?;
        self.ctx.bind()?;
        let base = on.device_ptr();
        let result = src.chunks(self.config.chunk_bytes).enumerate().try_for_each(|(k, piece)| {
            let slot = self.slot(k)?;
            let chunk = &self.chunks[slot];
            // SAFETY: the chunk holds `chunk_bytes >= piece.len()` bytes, and no copy reads it
            // any more (`slot` waited for its event); `piece` is initialised (NoUninit) host memory
            // that cannot overlap the ring's own pinned allocation.
            unsafe { split_copy(piece.as_ptr(), chunk.ptr.as_ptr(), piece.len(), self.fill_threads) };
            if k > 0 && !self.chunks[self.slot_of(k - 1)].done.query()? {
                self.stats.overlapped += 1;
            }
            let to = base + (k * self.config.chunk_bytes) as u64;
            let from = self.chunks[slot].ptr.as_ptr();
            self.unguarded = Some(stream.clone());
            let mut trace = profile::begin(stream, CopyKind::HostToDevice, piece.len());
            // Bound again after entering the chunk's span, whose subscriber may bind another
            // context (see `profile::CopyTrace`).
            self.ctx.bind()?;
            trace.around(stream, || {
                // SAFETY: `from` is pinned memory holding `piece.len()` bytes that stay unwritten
                // until the chunk's event (recorded next) completes; `to..to + len` lies inside
                // `dst`, exclusively borrowed and ordered on `stream` by `on`.
                unsafe { ffi::htod_async(to, from.cast(), piece.len(), stream.raw()) }
            })?;
            self.record(slot, stream)
        });
        drop(on);
        self.finish(src.len(), result)
    }

    /// Copies device memory `src` into `dst` (same length) on `stream`, through the ring.
    ///
    /// Queued after the work already ordered on `src`; returns once `dst` holds the data. `stream`
    /// and `src` must belong to the ring's device (`WrongDevice`); `NotReady` as for
    /// [`StagingRing::copy_h2d`].
    pub fn copy_d2h<T: AnyBitPattern>(
        &mut self,
        stream: &Stream,
        src: &impl AsDeviceSlice<T>,
        dst: &mut [T],
    ) -> Result<()> {
        let src = src.as_device_slice();
        validate::same_len(dst.len(), src.len())?;
        self.check(stream, src.context())?;
        let bytes = size_of_val(dst);
        if bytes == 0 {
            return Ok(());
        }
        let _span = tracing::debug_span!(
            "staged_copy",
            device = self.ctx.device().ordinal(),
            stream = stream.id(),
            bytes,
            kind = "d2h",
        )
        .entered();
        let on = src.on(stream)?;
        self.ctx.bind()?;
        let (base, chunk_bytes) = (on.device_ptr(), self.config.chunk_bytes);
        let pieces = bytes.div_ceil(chunk_bytes);
        let len_of = |k: usize| chunk_bytes.min(bytes - k * chunk_bytes);
        let out = dst.as_mut_ptr().cast::<u8>();
        let queue = |ring: &mut StagingRing, k: usize| -> Result<()> {
            let slot = ring.slot(k)?;
            let (to, from, len) = (ring.chunks[slot].ptr, base + (k * chunk_bytes) as u64, len_of(k));
            ring.unguarded = Some(stream.clone());
            let mut trace = profile::begin(stream, CopyKind::DeviceToHost, len);
            // Bound again after entering the chunk's span (see `copy_h2d`).
            ring.ctx.bind()?;
            trace.around(stream, || {
                // SAFETY: `to` is pinned memory of `chunk_bytes >= len` bytes that the host does
                // not touch until the chunk's event (recorded next) completes; `from..from + len`
                // lies inside `src`, ordered on `stream` by `on`.
                unsafe { ffi::dtoh_async(to.as_ptr().cast(), from, len, stream.raw()) }
            })?;
            ring.record(slot, stream)
        };
        let ahead = pieces.min(self.config.chunks);
        let result = (0..ahead).try_for_each(|k| queue(self, k)).and_then(|()| {
            (0..pieces).try_for_each(|k| {
                let slot = self.slot_of(k);
                self.chunks[slot].done.synchronize()?;
                // SAFETY: the chunk's copy of `len_of(k)` bytes has completed (its event, recorded
                // after it, has); the destination range lies inside `dst`, exclusively borrowed,
                // and any bytes are valid for `T` (AnyBitPattern).
                unsafe {
                    split_copy(
                        self.chunks[slot].ptr.as_ptr(),
                        out.add(k * chunk_bytes),
                        len_of(k),
                        self.fill_threads,
                    )
                };
                if k + 1 < pieces && !self.chunks[self.slot_of(k + 1)].done.query()? {
                    self.stats.overlapped += 1;
                }
                if k + ahead < pieces { queue(self, k + ahead) } else { Ok(()) }
            })
        });
        drop(on);
        self.finish(bytes, result)
    }

    fn check(&mut self, stream: &Stream, memory: &Context) -> Result<()> {
        if !self.wait_unguarded() {
            // The chunks may still be read or written by a copy nothing could wait for: the ring
            // is not ready for another call until that wait succeeds (tried again each call).
            return Err(Error::NotReady {
                ctx: cumem_sys::ErrorContext::op("StagingRing (a failed copy may still use its chunks)"),
            });
        }
        validate::same_device(&self.ctx, stream.context())?;
        validate::same_device(&self.ctx, memory)
    }

    fn slot_of(&self, k: usize) -> usize {
        k % self.config.chunks
    }

    /// The chunk for piece `k`, allocated if new, once no earlier copy uses it.
    fn slot(&mut self, k: usize) -> Result<usize> {
        let slot = self.slot_of(k);
        if slot == self.chunks.len() {
            // Bound right before the call: the previous chunk's span has just been left, and a
            // subscriber's code that ran there may have made another context current (or none);
            // the memory belongs to the context current at `cuMemHostAlloc`.
            self.ctx.bind()?;
            let ptr = ffi::host_alloc(self.config.chunk_bytes)?;
            let done = match Event::new(&self.ctx) {
                Ok(e) => e,
                Err(e) => {
                    // SAFETY: `ptr` was just allocated and nothing uses it.
                    let _ = unsafe { ffi::host_free(ptr) };
                    return Err(e);
                }
            };
            self.chunks.push(Chunk { ptr, done, recorded: false });
            self.stats.pinned_bytes += self.config.chunk_bytes;
        }
        let chunk = &self.chunks[slot];
        if chunk.recorded && !chunk.done.query()? {
            self.stats.reuse_waits += 1;
            chunk.done.synchronize()?;
        }
        Ok(slot)
    }

    /// Waits out the stream of a copy that no chunk event covers, if there is one; false when that
    /// wait failed (the chunks may still be in use).
    fn wait_unguarded(&mut self) -> bool {
        match &self.unguarded {
            None => true,
            Some(s) => match s.synchronize() {
                Ok(()) => {
                    self.unguarded = None;
                    true
                }
                Err(e) => {
                    tracing::warn!(error = %e, "waiting for a staged copy its chunk's event does not cover failed");
                    false
                }
            },
        }
    }

    /// Records the chunk's event after the copy just queued on `stream`; only then is the copy
    /// guarded (see `unguarded`).
    fn record(&mut self, slot: usize, stream: &Stream) -> Result<()> {
        self.stats.chunks += 1;
        let chunk = &mut self.chunks[slot];
        chunk.recorded = true;
        // On failure the copy is queued but its event does not cover it: `unguarded` stays set,
        // and `finish` tries to wait the stream out.
        chunk.done.record(stream)?;
        self.unguarded = None;
        Ok(())
    }

    /// Counts a finished call, or after a failure makes sure no queued copy still uses a chunk
    /// without its event saying so.
    fn finish(&mut self, bytes: usize, result: Result<()>) -> Result<()> {
        match result {
            Ok(()) => {
                self.stats.calls += 1;
                self.stats.bytes += bytes as u64;
                tracing::trace!(bytes, chunks = self.stats.chunks, "staged copy queued");
                Ok(())
            }
            Err(e) => {
                // A copy may be queued that no event covers (or the copy failed before that):
                // wait for its stream now, so that the next call finds the chunks free.
                self.wait_unguarded();
                Err(e)
            }
        }
    }
}

/// The smallest part of a chunk worth a thread of its own.
const MIN_PART: usize = 64 << 10;

/// The most threads one chunk's fill is split over: more than a host's memory bandwidth needs, and
/// few enough that starting them stays cheap next to a chunk's copy.
pub const MAX_FILL_THREADS: usize = 64;

/// One part of a split copy, moved to the thread that copies it.
struct Part {
    src: *const u8,
    dst: *mut u8,
    len: usize,
}

// SAFETY: a part names bytes that only the thread holding it reads (`src`) or writes (`dst`)
// until `split_copy`'s scope joins it (see `split_copy`'s contract).
unsafe impl Send for Part {}

impl Part {
    /// # Safety
    /// 1. As for [`split_copy`], for this part's `len` bytes.
    unsafe fn copy(self) {
        // SAFETY: guaranteed by the caller.
        unsafe { std::ptr::copy_nonoverlapping(self.src, self.dst, self.len) }
    }
}

/// The parts of a split copy of `len` bytes over up to `threads` threads, as (offset, length).
///
/// Each part holds at least [`MIN_PART`] bytes (the last one may hold fewer), so there are at most
/// `len / MIN_PART` of them, and never more than `threads` (0 counts as 1) or [`MAX_FILL_THREADS`].
/// An empty copy has no part.
fn partition(len: usize, threads: usize) -> impl ExactSizeIterator<Item = (usize, usize)> {
    let wanted = threads.clamp(1, MAX_FILL_THREADS).min(len / MIN_PART).max(1);
    let size = len.div_ceil(wanted).max(1);
    // Counted from the size, not taken as `wanted`: rounding the size up can leave fewer parts
    // than wanted, and a part index past the last would start beyond the end.
    let parts = len.div_ceil(size);
    (0..parts).map(move |i| (i * size, size.min(len - i * size)))
}

/// Copies `len` bytes from `src` to `dst`, split over up to `threads` scoped threads (the calling
/// one included) as [`partition`] says; returns when every part is copied.
///
/// # Safety
/// 1. `src` is valid for reads and `dst` for writes of `len` bytes, the ranges do not overlap, and
///    nothing else writes `src` or accesses `dst` until this returns.
unsafe fn split_copy(src: *const u8, dst: *mut u8, len: usize, threads: usize) {
    let part = |(offset, len): (usize, usize)| Part {
        // SAFETY: `partition` keeps every offset inside `0..len`, the caller's source range.
        src: unsafe { src.add(offset) },
        // SAFETY: as above, for the destination range.
        dst: unsafe { dst.add(offset) },
        len,
    };
    let mut parts = partition(len, threads);
    if parts.len() <= 1 {
        // SAFETY: the whole range (or nothing), under the caller's contract.
        parts.for_each(|p| unsafe { part(p).copy() });
        return;
    }
    let Some(first) = parts.next() else { return };
    std::thread::scope(|scope| {
        let mut here = vec![first];
        for p in parts {
            let moved = part(p);
            // SAFETY: parts are disjoint pieces of the caller's ranges, and the scope joins this
            // thread before `split_copy` returns.
            let spawned = std::thread::Builder::new().spawn_scoped(scope, move || unsafe { moved.copy() });
            if spawned.is_err() {
                here.push(p);
            }
        }
        for p in here {
            // SAFETY: as above; no thread was started for this part.
            unsafe { part(p).copy() };
        }
    });
}

impl fmt::Debug for StagingRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingRing")
            .field("device", &self.ctx.device().ordinal())
            .field("config", &self.config)
            .field("stats", &self.stats)
            .field("fill_threads", &self.fill_threads)
            .finish()
    }
}

impl Drop for StagingRing {
    fn drop(&mut self) {
        if !self.wait_unguarded() {
            tracing::warn!(
                chunks = self.chunks.len(),
                "staging ring dropped after a copy it could not track: leaking its pinned chunks"
            );
            return;
        }
        for chunk in self.chunks.drain(..) {
            let result = chunk.done.synchronize().and_then(|()| {
                // SAFETY: the chunk came from `host_alloc`, is freed once (drained), and the last
                // copy that used it has completed (its event was waited for just now).
                unsafe { ffi::host_free(chunk.ptr) }
            });
            if let Err(e) = result {
                tracing::warn!(error = %e, "freeing a staging chunk failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{MAX_FILL_THREADS, MIN_PART, partition};

    /// Every part starts inside the copy, parts are contiguous and non-empty, and they cover it.
    fn check(len: usize, threads: usize) {
        let parts: Vec<_> = partition(len, threads).collect();
        let mut next = 0;
        for &(offset, part) in &parts {
            assert_eq!(offset, next, "len {len}, threads {threads}: {parts:?}");
            assert!(offset < len && part > 0, "len {len}, threads {threads}: part ({offset}, {part})");
            next = offset + part;
        }
        assert_eq!(next, len, "len {len}, threads {threads}: the parts do not cover the copy");
        let most = threads.clamp(1, MAX_FILL_THREADS).min((len / MIN_PART).max(1));
        assert!(parts.len() <= most, "len {len}, threads {threads}: {} parts", parts.len());
    }

    #[test]
    fn parts_never_start_past_the_end_when_a_part_is_smaller_than_the_part_count() {
        // ceil(len / parts) = 65 537 < 65 539 parts: a fixed part size puts the last part past
        // the end.
        check(MIN_PART * 65_539 + 1, 65_539);
        check(MIN_PART * 65_539 + 1, usize::MAX);
        check(MIN_PART * 1000 + 999, 1000);
    }

    #[test]
    fn empty_and_small_copies_have_at_most_one_part() {
        assert_eq!(partition(0, 8).filter(|&(_, n)| n > 0).count(), 0);
        assert_eq!(partition(MIN_PART - 1, 8).collect::<Vec<_>>(), [(0, MIN_PART - 1)]);
        assert_eq!(partition(5, 0).collect::<Vec<_>>(), [(0, 5)]);
    }

    proptest! {
        #[test]
        fn parts_cover_any_copy_exactly(
            len in prop_oneof![0usize..(16 * MIN_PART), 1usize..(1 << 40)],
            threads in prop_oneof![0usize..100, any::<usize>()],
        ) {
            check(len, threads);
        }
    }
}
