//! Expandable segments: instead of taking new segments from its upstream, the pool grows one segment
//! per stream (and segment kind) by mapping chunks of physical memory into a reservation of address
//! space (PyTorch's `expandable_segments`).
//!
//! With [`PoolConfig::expandable_segments`](crate::PoolConfig::expandable_segments) on and an
//! upstream that has [`ExpandableUpstream`] operations, a stream's first allocation of a kind
//! reserves [`PoolConfig::expandable_reservation_bytes`](crate::PoolConfig::expandable_reservation_bytes)
//! of address space (by default the upstream's [`reservation_bytes`](ExpandableUpstream::reservation_bytes):
//! for a device, its memory size) and maps just the chunks the block needs. When nothing cached
//! fits, the pool maps the unmapped space where the fewest new chunks serve the request: the end of
//! the mapped part, where new memory joins the segment's free tail, or a hole that `trim` left,
//! where it joins the free ranges on either side. A request only needs `size - free neighbours`
//! new bytes, rounded up to a chunk: memory that a pool of fixed segments would strand in the unused
//! ends of too-small segments serves it instead. When no segment of the stream has room, the pool
//! reserves another one (live blocks never move); only when the upstream refuses that reservation
//! too, after the out-of-memory ladder, does allocation fail, with
//! [`PoolError::AddressSpaceExhausted`], which names the reservation size.
//!
//! `trim`, the release threshold and the out-of-memory ladder unmap *every* whole free chunk, at the
//! end of a segment or in a hole between live blocks, from the highest address down, one chunk at
//! a time: a chunk whose unmap fails stays mapped, counted and cached. A reservation with nothing
//! mapped goes back. Unmapping happens only after `ordering.synchronize()` returned following every
//! free in the chunk, and with no lock of the pool held, as segments go back: the driver brief
//! (§9) lists `cuMemUnmap` as synchronous (an H100's waits for no unrelated stream, observed on
//! 2026-11-24, but nothing bounds how long it takes), and an upstream's `unmap` may take long or
//! use the pool itself. Under the locks the chunks are taken out of the free sets (and out
//! of `reserved_bytes`, into `returning_bytes`) but stay mapped in the books, so that growth never
//! maps over them; once they are unmapped the locks are taken again to record the gaps (a chunk
//! whose unmap failed goes back to the cache) and take the reservations left empty out of the
//! books, which are released after the locks are let go again.
//!
//! Invariants: a segment's mapped part is a set of runs of whole chunks, and
//! every cached range lies inside one run (a free range is split where a chunk in it is unmapped,
//! and the pieces never coalesce across the gap), outside the chunks being unmapped;
//! `reserved_bytes` counts mapped bytes but those being unmapped. Free memory
//! is still per stream and moves between streams only behind `ordering.wait` (a segment's ranges
//! may sit in any stream's arena); new chunks are fresh memory, usable by the growing stream at
//! once. Growth maps while holding the growing stream's arena lock and the segment registry (lock
//! order: arenas, then the registry), so its driver calls delay other growth and that stream's own
//! allocations, not the fast path of other streams.
//!
//! ```
//! use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig};
//!
//! let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
//! let pool = CachingPool::new(HostUpstream::new(1 << 30), HostOrdering::new(), config);
//! let a = pool.allocate(3 << 20, 512, 0).unwrap(); // maps 2 chunks of 2 MiB
//! let b = pool.allocate(5 << 20, 512, 0).unwrap(); // the 1 MiB free tail + 2 more chunks
//! let c = pool.allocate(2 << 20, 512, 0).unwrap(); // 1 more chunk: [8, 10) MiB
//! assert_eq!((b.addr(), c.addr()), (a.addr() + (3 << 20), a.addr() + (8 << 20)));
//! assert_eq!(pool.stats().reserved_bytes, 10 << 20);
//! // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! unsafe { pool.deallocate(b, 0) }.unwrap();
//! // The hole [3, 8) MiB holds two whole chunks, [4, 8): unmapped, while a and c stay put.
//! let report = pool.trim().unwrap();
//! assert_eq!((report.released_bytes, pool.stats().reserved_bytes), (4 << 20, 6 << 20));
//! // A 4 MiB request maps the hole again: the 1 MiB free below it + 2 chunks.
//! let d = pool.allocate(4 << 20, 512, 0).unwrap();
//! assert_eq!((d.addr(), pool.stats().reserved_bytes), (a.addr() + (3 << 20), 10 << 20));
//! for blk in [a, c, d] {
//!     // SAFETY: a block of the host model: no memory behind it, no work uses it.
//!     unsafe { pool.deallocate(blk, 0) }.unwrap();
//! }
//! pool.trim().unwrap(); // everything: the reservation goes too
//! assert!(pool.upstream().reservations().is_empty());
//! ```

use std::collections::{BTreeMap, HashMap};
use std::ops::{Deref, DerefMut};

use crate::arena::ArenaInner;
use crate::block::Request;
use crate::free_set::{FreeSet, Seg};
use crate::segment::Segments;
use crate::size_class::{Kind, align_up_u64};
use crate::{ExpandableUpstream, PoolError, TrimReport, UpstreamError};

/// One expandable segment: a reservation and which chunks of it are mapped.
#[derive(Debug, Clone)]
pub(crate) struct Expandable {
    /// Bytes reserved: the segment's [`Seg::len`], so every block names the whole reservation.
    pub len: u64,
    /// The mapped runs, start -> end, coalesced: whole chunks, never empty outside a growth.
    pub runs: BTreeMap<u64, u64>,
    /// Bytes mapped: the sum of the runs.
    pub mapped: u64,
    /// Stretches of whole chunks, start -> end, inside the runs, taken out of the free sets to be
    /// unmapped with no lock held (see [`take_chunks`]): mapped still, but neither cached nor in
    /// `reserved_bytes`.
    leaving: BTreeMap<u64, u64>,
    /// The kind of the blocks it serves.
    pub kind: Kind,
    /// The arena (by position) and kind that grows it.
    owner: (usize, Kind),
}

impl Expandable {
    /// Records `[lo, hi)`, unmapped until now, as mapped.
    fn mark(&mut self, lo: u64, hi: u64) {
        let (mut start, mut end) = (lo, hi);
        if let Some((&s, &e)) = self.runs.range(..lo).next_back()
            && e == lo
        {
            start = s;
        }
        if let Some(e) = self.runs.remove(&hi) {
            end = e;
        }
        self.runs.insert(start, end);
        self.mapped += hi - lo;
    }

    /// Records `[lo, hi)`, which lies inside one run, as unmapped; false (nothing recorded) when
    /// it does not.
    fn unmark(&mut self, lo: u64, hi: u64) -> bool {
        let Some((&s, &e)) = self.runs.range(..=lo).next_back().filter(|r| hi <= *r.1) else {
            return false;
        };
        self.runs.remove(&s);
        if s < lo {
            self.runs.insert(s, lo);
        }
        if hi < e {
            self.runs.insert(hi, e);
        }
        self.mapped -= hi - lo;
        true
    }

    /// Whether `[lo, hi)` lies inside one mapped run.
    fn is_mapped(&self, lo: u64, hi: u64) -> bool {
        self.runs.range(..=lo).next_back().is_some_and(|(_, &e)| hi <= e)
    }

    /// The unmapped stretches of the segment at `base`, in address order.
    fn gaps(&self, base: u64) -> Vec<(u64, u64)> {
        let mut out = vec![];
        let mut at = base;
        for (&s, &e) in &self.runs {
            if s > at {
                out.push((at, s));
            }
            at = e;
        }
        if at < base + self.len {
            out.push((at, base + self.len));
        }
        out
    }
}

/// The expandable segments of a pool, kept with its other segments.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    /// Segments by base address.
    pub segs: BTreeMap<u64, Expandable>,
    /// The segments each arena grows, per kind, oldest first: a second one is reserved only when
    /// the first has no room. An arena vacated and reused for another stream goes on growing the
    /// same segments: new chunks are fresh memory, safe for whichever stream maps them, and the
    /// segments' cached ranges went wherever the old stream's memory went.
    owned: HashMap<(usize, Kind), Vec<u64>>,
}

impl Registry {
    /// Bytes mapped in all segments and counted in `reserved_bytes`: those being unmapped (taken out
    /// of the books) left it.
    pub fn mapped(&self) -> u64 {
        self.segs.values().map(|e| e.mapped - e.leaving.iter().map(|(s, e)| e - s).sum::<u64>()).sum()
    }

    /// Every mapped run of every segment as `(start, len)`, in address order.
    pub fn mapped_runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.segs.values().flat_map(|e| e.runs.iter().map(|(&s, &end)| (s, end - s)))
    }

    /// Forgets a segment whose reservation was released.
    fn remove(&mut self, base: u64) {
        if let Some(e) = self.segs.remove(&base)
            && let Some(bases) = self.owned.get_mut(&e.owner)
        {
            bases.retain(|&b| b != base);
            if bases.is_empty() {
                self.owned.remove(&e.owner);
            }
        }
    }

    /// Checks that a cached range lies in a mapped run of an expandable segment of its kind.
    pub fn check(&self, addr: u64, len: u64, seg: Seg, kind: Kind) -> Result<(), String> {
        match self.segs.get(&seg.base) {
            Some(e) if e.len == seg.len && e.kind == kind => {
                if !e.is_mapped(addr, addr + len) {
                    return Err(format!("cached block {addr:#x}+{len} is not inside one mapped run"));
                }
                if e.leaving.range(..addr + len).next_back().is_some_and(|(_, &end)| end > addr) {
                    return Err(format!("cached block {addr:#x}+{len} overlaps chunks being unmapped"));
                }
                Ok(())
            }
            _ => Err(format!("cached block {addr:#x}+{len} names unknown segment {seg:?} ({kind:?})")),
        }
    }
}

/// An event of the expandable segments, kept until the pool's locks are let go.
#[derive(Debug)]
enum Note {
    /// Every segment the growing arena owns of a kind was full: another range was reserved.
    Reserving { base: u64, len: u64 },
    /// Unmapping the free chunk at `addr` failed: it stays mapped, counted and cached.
    UnmapFailed { addr: u64, error: UpstreamError },
    /// The books disagree: `[lo, hi)` was to be unmarked but is not inside one mapped run.
    NotMapped { lo: u64, hi: u64 },
}

/// The events that [`grow`], [`unmap_chunks`] and [`settle`] emit, collected while they run (under
/// the pool's locks, but for the unmaps) and emitted by [`log`](Self::log) once those are let go,
/// in the order they happened: a subscriber may read the pool's stats, which take the same locks
/// (under them it deadlocked), and one that panics must not cut short an update of the books.
#[derive(Debug, Default)]
pub(crate) struct Notes(Vec<Note>);

impl Notes {
    /// Emits the events, in the order they happened. Call with no lock of the pool held.
    pub fn log(self) {
        for note in self.0 {
            match note {
                Note::Reserving { base, len } => {
                    tracing::debug!(base, len, "expandable segments full: reserving another")
                }
                Note::UnmapFailed { addr, error } => {
                    tracing::warn!(addr, %error, "unmapping a free chunk failed; kept cached")
                }
                Note::NotMapped { lo, hi } => {
                    tracing::warn!(lo, hi, "expandable segment: unmarking space that is not mapped")
                }
            }
        }
    }
}

/// What [`grow`] made of a request.
#[derive(Debug)]
pub(crate) enum Grown {
    /// The block, at this address in this segment.
    Block(u64, Seg),
    /// The upstream has no physical memory for the chunks the block needs.
    OutOfMemory,
    /// No segment of the arena has room and the upstream refused another reservation of this
    /// many bytes.
    OutOfAddressSpace {
        /// The size of the refused reservation.
        reservation: u64,
    },
}

/// Where a block fits in unmapped space: map `[map_lo, map_hi)`, then take the block from the
/// free range starting at `start`.
#[derive(Debug, Clone, Copy)]
struct Fit {
    base: u64,
    map_lo: u64,
    map_hi: u64,
    start: u64,
}

/// Where `req` fits in the gap `[lo, hi)` of segment `seg`, with the free ranges of `set` on either
/// side of it.
fn fit_in_gap(set: &FreeSet, seg: Seg, (lo, hi): (u64, u64), req: &Request, chunk: u64) -> Option<Fit> {
    let start = match set.range_ending_at(lo) {
        Some((addr, _, s)) if s == seg => addr,
        _ => lo,
    };
    let avail = match set.range_starting_at(hi) {
        Some((len, s)) if s == seg => hi + len,
        _ => hi,
    };
    let block_end = align_up_u64(start, req.align)?.checked_add(req.size)?;
    if block_end > avail {
        return None;
    }
    // The reservation is whole chunks from a chunk-aligned base, so this stays inside it.
    let map_hi = block_end.next_multiple_of(chunk).clamp(lo, hi);
    Some(Fit { base: seg.base, map_lo: lo, map_hi, start })
}

/// Serves `req` by growing one of arena `arena`'s expandable segments of the request's kind: maps
/// the unmapped chunks where the fewest serve it together with the free ranges of `set` (the arena's
/// free set of that kind) around them, among equals the oldest reservation first and the lowest gap
/// in it, and takes the block there.
/// When no segment has room, reserves another one of `reservation` bytes (at least the block).
///
/// The caller holds the arena's lock (`set`) and the segment registry (`segs`), and logs `notes`
/// once it has let them go (whatever the result).
pub(crate) fn grow(
    up: &dyn ExpandableUpstream,
    segs: &mut Segments,
    set: &mut FreeSet,
    arena: usize,
    req: &Request,
    reservation: Option<usize>,
    notes: &mut Notes,
) -> Result<Grown, PoolError> {
    let chunk = up.chunk_bytes() as u64;
    let owner = (arena, req.kind);
    let mut best: Option<Fit> = None;
    for base in segs.expandable.owned.get(&owner).into_iter().flatten() {
        let Some(e) = segs.expandable.segs.get(base) else { continue };
        let seg = Seg { base: *base, len: e.len };
        for gap in e.gaps(*base) {
            if let Some(fit) = fit_in_gap(set, seg, gap, req, chunk)
                && best.is_none_or(|b| fit.map_hi - fit.map_lo < b.map_hi - b.map_lo)
            {
                best = Some(fit);
            }
        }
    }
    let fit = match best {
        Some(fit) => fit,
        None => {
            let wanted = reservation.unwrap_or_else(|| up.reservation_bytes()) as u64;
            // A block larger than the configured reservation gets a reservation of its own size.
            // `need` covers the block at any chunk-aligned base (alignment padding included).
            let Some(len) = req.need.max(wanted).checked_next_multiple_of(chunk).map(|l| l.max(chunk)) else {
                if req.need.checked_next_multiple_of(chunk).is_none() {
                    return Err(PoolError::SizeOverflow { requested: req.requested });
                }
                // The configured size rounds past the end of the address space: no upstream can
                // reserve it, so it is reported as the size refused.
                return Ok(Grown::OutOfAddressSpace { reservation: wanted });
            };
            let base = match up.reserve(len as usize) {
                Ok(base) => base,
                Err(e) if e.is_out_of_memory() => return Ok(Grown::OutOfAddressSpace { reservation: len }),
                Err(e) => return Err(PoolError::Upstream(e)),
            };
            if !base.is_multiple_of(chunk) || base.checked_add(len).is_none() {
                // SAFETY: the reservation `reserve(len)` just returned, given back once, before
                // anything was mapped in it or its addresses were recorded anywhere.
                unsafe { up.release(base, len as usize) };
                return Err(PoolError::MisalignedSegment { addr: base });
            }
            if segs.expandable.owned.contains_key(&owner) {
                notes.0.push(Note::Reserving { base, len });
            }
            let kind = req.kind;
            let e =
                Expandable { len, runs: BTreeMap::new(), mapped: 0, leaving: BTreeMap::new(), kind, owner };
            segs.expandable.segs.insert(base, e);
            segs.expandable.owned.entry(owner).or_default().push(base);
            let seg = Seg { base, len };
            match fit_in_gap(set, seg, (base, base + len), req, chunk) {
                Some(fit) => fit,
                None => {
                    release_if_unmapped(up, segs, base);
                    return Ok(Grown::OutOfAddressSpace { reservation: len });
                }
            }
        }
    };
    let Some(len) = segs.expandable.segs.get(&fit.base).map(|e| e.len) else { return Ok(Grown::OutOfMemory) };
    let seg = Seg { base: fit.base, len };
    if fit.map_hi > fit.map_lo {
        let bytes = fit.map_hi - fit.map_lo;
        if let Err(err) = up.map(fit.map_lo, bytes as usize) {
            release_if_unmapped(up, segs, fit.base);
            return if err.is_out_of_memory() {
                Ok(Grown::OutOfMemory)
            } else {
                Err(PoolError::Upstream(err))
            };
        }
        if let Some(e) = segs.expandable.segs.get_mut(&fit.base) {
            e.mark(fit.map_lo, fit.map_hi);
        }
        segs.reserved += bytes;
        segs.peak_reserved = segs.peak_reserved.max(segs.reserved);
        segs.upstream_allocations += 1;
        // Fresh memory, on which nothing was queued: no thread comparing insert counters needs
        // to wait for it (a counted insert would make another thread's growth a race for every
        // trim and ladder synchronising meanwhile).
        set.insert_uncounted(fit.map_lo, bytes, seg);
    }
    Ok(match set.take_at(fit.start, req.size, req.align) {
        Some((addr, seg)) => Grown::Block(addr, seg),
        None => Grown::OutOfMemory,
    })
}

/// A segment reserved (or grown) in vain: nothing mapped, so the reservation goes back at once.
fn release_if_unmapped(up: &dyn ExpandableUpstream, segs: &mut Segments, base: u64) {
    if let Some(e) = segs.expandable.segs.get(&base)
        && e.mapped == 0
    {
        // SAFETY: a segment of the books is a reservation `reserve(e.len)` returned, not released
        // (released ones leave the books, as this one does now); with nothing mapped it holds no
        // block and no cached range (those lie in mapped runs), so nobody uses its addresses.
        unsafe { up.release(base, e.len as usize) };
        segs.expandable.remove(base);
    }
}

/// Moves every cached range of the segments that arena `arena` grows for `kind` into that arena's
/// free set, so that growth maps only what the request needs beyond the free ranges around a gap:
/// after a consolidation they may sit in any arena's set. The caller holds every arena lock and has
/// synchronised after every free (the out-of-memory ladder), so the ranges are safe for the growing
/// stream without a wait.
pub(crate) fn gather<S, G: DerefMut<Target = ArenaInner<S>>>(
    segs: &Segments,
    guards: &mut [G],
    arena: usize,
    kind: Kind,
) {
    let Some(bases) = segs.expandable.owned.get(&(arena, kind)) else { return };
    for i in (0..guards.len()).filter(|&i| i != arena) {
        let moved: Vec<(u64, u64, Seg)> =
            guards[i].set_ref(kind).ranges().filter(|r| bases.contains(&r.2.base)).collect();
        for (addr, len, seg) in moved {
            guards[i].set(kind).remove(addr);
            // Safe for every stream (see above): not counted as an insert.
            guards[arena].set(kind).insert_uncounted(addr, len, seg);
        }
    }
}

/// The cached ranges of expandable segments in every arena, as `(addr, len, segment, arena,
/// kind)`, in address order.
fn cached_ranges<S, G: Deref<Target = ArenaInner<S>>>(
    segs: &Segments,
    guards: &[G],
) -> Vec<(u64, u64, Seg, usize, Kind)> {
    let mut out = vec![];
    for (i, g) in guards.iter().enumerate() {
        for kind in Kind::ALL {
            out.extend(
                g.set_ref(kind)
                    .ranges()
                    .filter(|r| segs.expandable.segs.contains_key(&r.2.base))
                    .map(|(a, l, s)| (a, l, s, i, kind)),
            );
        }
    }
    out.sort_unstable_by_key(|r| r.0);
    out
}

/// Whether some expandable segment has at least one whole free chunk, possibly cached in pieces
/// by several arenas. The caller holds every arena lock, bins flushed.
pub(crate) fn releasable<S, G: Deref<Target = ArenaInner<S>>>(
    chunk: u64,
    segs: &Segments,
    guards: &[G],
) -> bool {
    let mut run: Option<(u64, u64, Seg)> = None;
    for (addr, len, seg, ..) in cached_ranges(segs, guards) {
        run = match run {
            Some((a, end, s)) if s == seg && end == addr => Some((a, addr + len, s)),
            _ => Some((addr, addr + len, seg)),
        };
        if let Some((a, end, _)) = run
            && a.next_multiple_of(chunk) + chunk <= end
        {
            return true;
        }
    }
    false
}

/// Whole free chunks that [`take_chunks`] took out of the free sets, under the pool's locks, for
/// [`unmap_chunks`] to unmap with no lock held and [`settle`] to record: `[lo, hi)` of segment
/// `seg`, cached as `kind` in arena `arena`. Until settled they are in no free set, out of
/// `reserved_bytes` (in the pool's returning bytes instead), and still mapped in the books (in the
/// segment's runs and its `leaving`), so that growth never maps over them.
#[derive(Debug)]
pub(crate) struct Stretch {
    seg: Seg,
    kind: Kind,
    arena: usize,
    lo: u64,
    hi: u64,
    /// Unmapped from the top down to here: `[bottom, hi)` is gone, `[lo, bottom)` still mapped.
    bottom: u64,
    /// The pool's ticket for these bytes in flight.
    pub ticket: u64,
}

impl Stretch {
    /// The base of the segment (its reservation) the stretch lies in.
    pub fn seg_base(&self) -> u64 {
        self.seg.base
    }
    /// Whether some chunk of it was unmapped.
    pub fn unmapped_any(&self) -> bool {
        self.bottom < self.hi
    }
}

/// Takes whole free chunks of every expandable segment, wherever they are, from the highest address
/// down, out of the free sets while more than `keep` bytes are cached (`cached` is updated), and
/// pushes them onto `out` for [`unmap_chunks`], each with the ticket `start` gives for its bytes
/// (pushed at once: whoever holds `out` settles it). The bytes leave `reserved_bytes` now, as a
/// released segment does. The caller holds every arena lock, has consolidated the cached memory
/// (so a free stretch is one range) and synchronised after every free in it.
pub(crate) fn take_chunks<S, G: DerefMut<Target = ArenaInner<S>>>(
    chunk: u64,
    segs: &mut Segments,
    guards: &mut [G],
    cached: &mut u64,
    keep: u64,
    mut start: impl FnMut(u64) -> u64,
    out: &mut Vec<Stretch>,
) {
    for (addr, len, seg, i, kind) in cached_ranges(segs, guards).into_iter().rev() {
        if *cached <= keep {
            break;
        }
        let end = addr + len;
        let (lo, hi) = (addr.next_multiple_of(chunk), end / chunk * chunk);
        if lo >= hi {
            continue;
        }
        let target = hi - (hi - lo).min((*cached - keep).next_multiple_of(chunk));
        guards[i].set(kind).remove(addr);
        // The pieces around the stretch go to the arena that grows the segment, so that mapping
        // the gap again joins them: after the synchronisation they are safe for every stream. A
        // vacated arena (its stream retired by a sweep) keeps them out of reach of migration, which
        // never takes from one: they stay where they were then.
        let owner = owner_arena(segs, guards, seg.base, i);
        // Cached memory moved under every lock after the caller's synchronisation: idle, not
        // counted (as consolidation's moves), or another trim or ladder waiting meanwhile would
        // take it for a free racing its wait.
        let set = guards[owner].set(kind);
        if addr < target {
            set.insert_uncounted(addr, target - addr, seg);
        }
        if hi < end {
            set.insert_uncounted(hi, end - hi, seg);
        }
        if let Some(e) = segs.expandable.segs.get_mut(&seg.base) {
            e.leaving.insert(target, hi);
        }
        let bytes = hi - target;
        segs.reserved -= bytes;
        *cached = cached.saturating_sub(bytes);
        // Room first: a ticket not in `out` would never be settled.
        out.reserve(1);
        let ticket = start(bytes);
        out.push(Stretch { seg, kind, arena: owner, lo: target, hi, bottom: hi, ticket });
    }
}

/// Where pieces of segment `base` cached in arena `i` go: the arena that grows it, unless that one
/// is vacated (see [`take_chunks`]).
fn owner_arena<S, G: Deref<Target = ArenaInner<S>>>(
    segs: &Segments,
    guards: &[G],
    base: u64,
    i: usize,
) -> usize {
    segs.expandable
        .segs
        .get(&base)
        .map(|e| e.owner.0)
        .filter(|&o| guards.get(o).is_some_and(|g| g.stream.is_some()))
        .unwrap_or(i)
}

/// Unmaps the stretches [`take_chunks`] took, each from the top down, one chunk at a time, so that
/// a failed unmap leaves a known part mapped: that chunk and those below it in the stretch are
/// still memory, which [`settle`] puts back, mapped, counted and cached. Call with no lock of the
/// pool held: the driver brief lists `cuMemUnmap` as synchronous (an H100's waits for no
/// unrelated stream, observed on 2026-11-24, but an upstream's `unmap` may take long), and the
/// upstream's `unmap` may use the pool.
pub(crate) fn unmap_chunks(up: &dyn ExpandableUpstream, stretches: &mut [Stretch], notes: &mut Notes) {
    let chunk = up.chunk_bytes() as u64;
    for s in stretches {
        while s.bottom > s.lo {
            // SAFETY: a whole chunk of a stretch `take_chunks` took out of the free sets (and the
            // books' runs still mark it mapped, as `leaving`), from the top down, none twice. It
            // was cached, hence free, the caller synchronised after every free in it, and no block
            // can be cut from it any more: nothing uses it afterwards unless it is mapped again.
            let unmapped = unsafe { up.unmap(s.bottom - chunk, chunk as usize) };
            if let Err(error) = unmapped {
                notes.0.push(Note::UnmapFailed { addr: s.bottom - chunk, error });
                break;
            }
            s.bottom -= chunk;
        }
    }
}

/// Records what [`unmap_chunks`] did: the unmapped chunks leave the segment's runs (the gap growth
/// may map again) and count in `upstream_frees` and the report; what stayed mapped goes back into a
/// free set, counted in `reserved_bytes` again. Then takes the reservations left with nothing
/// mapped out of the books and returns them as `(base, len)`, for the caller to release once it
/// has let the locks go. The caller holds every arena lock and the segment registry (`segs`).
pub(crate) fn settle<S, G: DerefMut<Target = ArenaInner<S>>>(
    chunk: u64,
    segs: &mut Segments,
    guards: &mut [G],
    stretches: &[Stretch],
    report: &mut TrimReport,
    notes: &mut Notes,
) -> Vec<(u64, u64)> {
    for s in stretches {
        if let Some(e) = segs.expandable.segs.get_mut(&s.seg.base) {
            e.leaving.remove(&s.lo);
            if s.unmapped_any() && !e.unmark(s.bottom, s.hi) {
                notes.0.push(Note::NotMapped { lo: s.bottom, hi: s.hi });
            }
        }
        let unmapped = s.hi - s.bottom;
        segs.upstream_frees += unmapped / chunk;
        report.released_bytes += unmapped;
        if s.lo < s.bottom {
            // Still memory, idle since the synchronisation (it was in no free set): cached again,
            // uncounted, where the pieces around it went.
            let owner = owner_arena(segs, guards, s.seg.base, s.arena.min(guards.len().saturating_sub(1)));
            if let Some(g) = guards.get_mut(owner) {
                g.set(s.kind).insert_uncounted(s.lo, s.bottom - s.lo, s.seg);
            }
            segs.reserved += s.bottom - s.lo;
            // The bytes left `reserved_bytes` for the unlocked window, in which the peak may have
            // been reset or the pool grown: back in, they may make a new peak.
            segs.peak_reserved = segs.peak_reserved.max(segs.reserved);
        }
    }
    take_empty(segs)
}

/// Takes the reservations with nothing mapped (nor being unmapped) out of the books, as
/// `(base, len)`, for the caller to release with no lock of the pool held.
pub(crate) fn take_empty(segs: &mut Segments) -> Vec<(u64, u64)> {
    let empty: Vec<(u64, u64)> =
        segs.expandable.segs.iter().filter(|(_, e)| e.mapped == 0).map(|(&b, e)| (b, e.len)).collect();
    for &(base, _) in &empty {
        segs.expandable.remove(base);
    }
    empty
}

/// Unmaps and releases every expandable segment: the pool is being dropped, after a synchronisation.
pub(crate) fn teardown(up: &dyn ExpandableUpstream, registry: Registry) {
    'segs: for (base, e) in registry.segs {
        for (&start, &end) in &e.runs {
            // SAFETY: a mapped run of the reservation (whole chunks the pool mapped and has not
            // unmapped). The pool is being dropped after a successful synchronisation: no work
            // uses it, and no block of the pool can be used any more.
            let unmapped = unsafe { up.unmap(start, (end - start) as usize) };
            if let Err(error) = unmapped {
                // Releasing a reservation with chunks mapped is refused; both stay, leaked.
                tracing::warn!(base, start, end, %error, "unmapping a segment at teardown failed; leaking it");
                continue 'segs;
            }
        }
        // SAFETY: the reservation as `reserve(e.len)` returned it, the registry taken out of the
        // pool, so released once; every run was unmapped just above, and nothing uses it.
        unsafe { up.release(base, e.len as usize) };
    }
}
