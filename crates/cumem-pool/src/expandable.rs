//! Expandable segments: instead of taking new segments from its upstream, the pool grows one segment
//! per stream (and segment kind) by mapping chunks of physical memory at its end (PyTorch's
//! `expandable_segments`).
//!
//! With [`PoolConfig::expandable_segments`](crate::PoolConfig::expandable_segments) on and an
//! upstream that has [`ExpandableUpstream`] operations, a stream's first allocation of a kind
//! reserves [`reservation_bytes`](ExpandableUpstream::reservation_bytes) of address space (for a
//! device, its memory size) and maps just the chunks the block needs. When nothing cached fits, the
//! pool maps more chunks *at the end of the mapped part*, so the new memory joins the segment's free
//! tail and a request only needs `size - free tail` new bytes, rounded up to a chunk: memory that a
//! pool of fixed segments would strand in the unused ends of too-small segments serves it instead.
//! `trim`, the release threshold and the out-of-memory ladder unmap the whole free chunks at the end
//! of every segment (and release a reservation once nothing is mapped), one chunk at a time from
//! the top: a chunk whose unmap fails stays mapped, counted and cached, so later growth maps above it.
//!
//! Invariants: the mapped part of a segment is always a prefix `[base, base + mapped)` of its
//! reservation, so no block or cached range ever straddles unmapped space; `mapped` is a whole number
//! of chunks; `reserved_bytes` counts mapped bytes. Free memory is still per stream and moves between
//! streams only behind `ordering.wait` (a segment's ranges may sit in any stream's arena); new chunks
//! are fresh memory, usable by the growing stream at once; chunks are unmapped only after
//! `ordering.synchronize`. Growth maps while holding the growing stream's arena lock and the
//! segment registry (lock order: arenas, then the registry), so its driver calls delay other growth
//! and that stream's own allocations, not the fast path of other streams.
//!
//! ```
//! use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig};
//!
//! let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
//! let pool = CachingPool::new(HostUpstream::new(1 << 30), HostOrdering::new(), config);
//! let a = pool.allocate(3 << 20, 512, 0).unwrap(); // maps 2 chunks of 2 MiB
//! let b = pool.allocate(5 << 20, 512, 0).unwrap(); // the 1 MiB free tail + 2 more chunks
//! assert_eq!(b.addr(), a.addr() + (3 << 20));
//! assert_eq!(pool.stats().reserved_bytes, 8 << 20);
//! pool.deallocate(b, 0).unwrap();
//! let report = pool.trim().unwrap(); // whole free chunks at the end: 3 MiB free, 2 chunks
//! assert_eq!((report.released_bytes, pool.stats().reserved_bytes), (4 << 20, 4 << 20));
//! pool.deallocate(a, 0).unwrap();
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
use crate::{ExpandableUpstream, PoolError, TrimReport};

/// One expandable segment: a reservation and how much of it is mapped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expandable {
    /// Bytes reserved: the segment's [`Seg::len`], so every block names the whole reservation.
    pub len: u64,
    /// Bytes mapped from the base: a multiple of the chunk size, never 0 outside a growth.
    pub mapped: u64,
    /// The kind of the blocks it serves.
    pub kind: Kind,
    /// The arena (by position) and kind that grows it.
    owner: (usize, Kind),
}

/// The expandable segments of a pool, kept with its other segments.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    /// Segments by base address.
    pub segs: BTreeMap<u64, Expandable>,
    /// The segment each arena grows, per kind. An arena vacated and reused for another stream goes
    /// on growing the same segment: new chunks are fresh memory, safe for whichever stream maps
    /// them, and the segment's cached ranges went wherever the old stream's memory went.
    owned: HashMap<(usize, Kind), u64>,
}

impl Registry {
    /// Bytes mapped in all segments.
    pub fn mapped(&self) -> u64 {
        self.segs.values().map(|e| e.mapped).sum()
    }

    /// Forgets a segment whose reservation was released.
    fn remove(&mut self, base: u64) {
        if let Some(e) = self.segs.remove(&base) {
            self.owned.remove(&e.owner);
        }
    }

    /// Checks that a cached range lies in the mapped part of an expandable segment of its kind.
    pub fn check(&self, addr: u64, len: u64, seg: Seg, kind: Kind) -> Result<(), String> {
        match self.segs.get(&seg.base) {
            Some(e) if e.len == seg.len && e.kind == kind => {
                if addr + len > seg.base + e.mapped {
                    return Err(format!("cached block {addr:#x}+{len} reaches past the mapped {}", e.mapped));
                }
                Ok(())
            }
            _ => Err(format!("cached block {addr:#x}+{len} names unknown segment {seg:?} ({kind:?})")),
        }
    }
}

/// Serves `req` by growing arena `arena`'s expandable segment of the request's kind (reserving it
/// first if the arena has none): maps the chunks the block needs beyond the segment's free tail in
/// `set` (the arena's free set of that kind), joins them to the tail and takes the block from it.
/// `Ok(None)` when the upstream is out of memory or the reservation is full.
///
/// The caller holds the arena's lock (`set`) and the segment registry (`segs`).
pub(crate) fn grow(
    up: &dyn ExpandableUpstream,
    segs: &mut Segments,
    set: &mut FreeSet,
    arena: usize,
    req: &Request,
) -> Result<Option<(u64, Seg)>, PoolError> {
    let chunk = up.chunk_bytes() as u64;
    let owner = (arena, req.kind);
    let base = match segs.expandable.owned.get(&owner) {
        Some(&base) => base,
        None => {
            let len = (up.reservation_bytes() as u64).next_multiple_of(chunk).max(chunk);
            let base = match up.reserve(len as usize) {
                Ok(base) => base,
                Err(e) if e.is_out_of_memory() => return Ok(None),
                Err(e) => return Err(PoolError::Upstream(e)),
            };
            if !base.is_multiple_of(chunk) || base.checked_add(len).is_none() {
                up.release(base, len as usize);
                return Err(PoolError::MisalignedSegment { addr: base });
            }
            segs.expandable.segs.insert(base, Expandable { len, mapped: 0, kind: req.kind, owner });
            segs.expandable.owned.insert(owner, base);
            base
        }
    };
    let e = segs.expandable.segs[&base];
    let seg = Seg { base, len: e.len };
    let end = base + e.mapped;
    // The block goes at the start of the free tail (or at the end when the tail is not free here).
    let start = match set.range_ending_at(end) {
        Some((addr, _, s)) if s == seg => addr,
        _ => end,
    };
    let block_end =
        align_up_u64(start, req.align).and_then(|s| s.checked_add(req.size)).filter(|&e| e <= seg.end());
    let Some(block_end) = block_end else {
        release_if_unmapped(up, segs, base);
        return Ok(None);
    };
    // The reservation is whole chunks from a chunk-aligned base, so this stays inside it.
    let new_end = block_end.next_multiple_of(chunk);
    if new_end > end {
        let bytes = new_end - end;
        if let Err(err) = up.map(end, bytes as usize) {
            release_if_unmapped(up, segs, base);
            return if err.is_out_of_memory() { Ok(None) } else { Err(PoolError::Upstream(err)) };
        }
        if let Some(e) = segs.expandable.segs.get_mut(&base) {
            e.mapped += bytes;
        }
        segs.reserved += bytes;
        segs.peak_reserved = segs.peak_reserved.max(segs.reserved);
        segs.upstream_allocations += 1;
        set.insert(end, bytes, seg);
    }
    Ok(set.take_at(start, req.size, req.align))
}

/// A segment reserved (or grown) in vain: nothing mapped, so the reservation goes back at once.
fn release_if_unmapped(up: &dyn ExpandableUpstream, segs: &mut Segments, base: u64) {
    if let Some(e) = segs.expandable.segs.get(&base)
        && e.mapped == 0
    {
        up.release(base, e.len as usize);
        segs.expandable.remove(base);
    }
}

/// The free set of `kind` in an arena, read-only.
fn set_of<S>(g: &ArenaInner<S>, kind: Kind) -> &FreeSet {
    match kind {
        Kind::Small => &g.small,
        Kind::Large => &g.large,
    }
}

/// Where the free tail of segment `base` is cached: `(arena position, tail start)`.
fn tail<S, G: Deref<Target = ArenaInner<S>>>(
    guards: &[G],
    base: u64,
    e: &Expandable,
) -> Option<(usize, u64)> {
    let seg = Seg { base, len: e.len };
    guards.iter().enumerate().find_map(|(i, g)| {
        set_of(g, e.kind).range_ending_at(base + e.mapped).filter(|r| r.2 == seg).map(|r| (i, r.0))
    })
}

/// Moves the free tail of the segment that arena `arena` grows for `kind` into that arena's free
/// set, so that growth maps only what the request needs beyond it: after a consolidation the tail
/// may sit in any arena's set. The caller holds every arena lock and has synchronised after every
/// free (the out-of-memory ladder), so the range is safe for the growing stream without a wait.
pub(crate) fn gather_tail<S, G: DerefMut<Target = ArenaInner<S>>>(
    segs: &Segments,
    guards: &mut [G],
    arena: usize,
    kind: Kind,
) {
    let Some(&base) = segs.expandable.owned.get(&(arena, kind)) else { return };
    let e = segs.expandable.segs[&base];
    let Some((i, start)) = tail(guards, base, &e) else { return };
    if i != arena {
        let end = base + e.mapped;
        guards[i].set(kind).remove(start);
        guards[arena].set(kind).insert(start, end - start, Seg { base, len: e.len });
    }
}

/// Whether some expandable segment ends in at least one whole free chunk, possibly cached in pieces
/// by several arenas. The caller holds every arena lock, bins flushed.
pub(crate) fn releasable<S, G: Deref<Target = ArenaInner<S>>>(
    chunk: u64,
    segs: &Segments,
    guards: &[G],
) -> bool {
    segs.expandable.segs.iter().any(|(&base, e)| {
        let seg = Seg { base, len: e.len };
        let (end, mut start) = (base + e.mapped, base + e.mapped);
        while let Some(r) =
            guards.iter().find_map(|g| set_of(g, e.kind).range_ending_at(start).filter(|r| r.2 == seg))
        {
            start = r.0;
            if start.next_multiple_of(chunk) < end {
                return true;
            }
        }
        false
    })
}

/// Unmaps the whole free chunks at the end of every expandable segment while more than `keep` bytes
/// are cached (`cached` is updated), releasing reservations left with nothing mapped. The caller
/// holds every arena lock, has consolidated the cached memory (so a segment's free tail is one
/// range) and synchronised after every free in it.
pub(crate) fn shrink<S, G: DerefMut<Target = ArenaInner<S>>>(
    up: &dyn ExpandableUpstream,
    segs: &mut Segments,
    guards: &mut [G],
    cached: &mut u64,
    keep: u64,
) -> TrimReport {
    let chunk = up.chunk_bytes() as u64;
    let mut report = TrimReport::default();
    let bases: Vec<u64> = segs.expandable.segs.keys().copied().collect();
    for base in bases {
        if *cached <= keep {
            break;
        }
        let e = segs.expandable.segs[&base];
        let end = base + e.mapped;
        let Some((i, start)) = tail(guards, base, &e) else { continue };
        let lowest = start.next_multiple_of(chunk);
        if lowest >= end {
            continue;
        }
        let target = end - (end - lowest).min((*cached - keep).next_multiple_of(chunk));
        // One chunk at a time from the top, so that a failed unmap leaves a known prefix mapped:
        // that chunk is still memory, so it stays in `mapped` and in the free set, and growth
        // never maps over it.
        let mut new_end = end;
        while new_end > target {
            if let Err(error) = up.unmap(new_end - chunk, chunk as usize) {
                tracing::warn!(addr = new_end - chunk, %error, "unmapping a free chunk failed; kept cached");
                break;
            }
            new_end -= chunk;
            segs.upstream_frees += 1;
        }
        let bytes = end - new_end;
        if bytes == 0 {
            continue;
        }
        let seg = Seg { base, len: e.len };
        let set = guards[i].set(e.kind);
        set.remove(start);
        if start < new_end {
            set.insert(start, new_end - start, seg);
        }
        segs.reserved -= bytes;
        *cached = cached.saturating_sub(bytes);
        report.released_bytes += bytes;
        let mapped = e.mapped - bytes;
        if let Some(e) = segs.expandable.segs.get_mut(&base) {
            e.mapped = mapped;
        }
        if mapped == 0 {
            up.release(base, e.len as usize);
            segs.expandable.remove(base);
            report.released_segments += 1;
        }
    }
    report
}

/// Unmaps and releases every expandable segment: the pool is being dropped, after a synchronisation.
pub(crate) fn teardown(up: &dyn ExpandableUpstream, registry: Registry) {
    for (base, e) in registry.segs {
        if e.mapped > 0
            && let Err(error) = up.unmap(base, e.mapped as usize)
        {
            // Releasing a reservation with chunks mapped is refused; both stay, leaked.
            tracing::warn!(base, mapped = e.mapped, %error, "unmapping a segment at teardown failed; leaking it");
            continue;
        }
        up.release(base, e.len as usize);
    }
}
