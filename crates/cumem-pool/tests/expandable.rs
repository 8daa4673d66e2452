//! Expandable segments on the host model: the mapped part of a stream's segment grows and shrinks
//! in whole chunks, trim gives back exactly the whole free chunks (in holes between live blocks
//! too), a hole is mapped again where growth needs the fewest chunks, a full segment is followed by
//! a second reservation and a refused one is an address-space error, each stream grows its own
//! segment, memory still moves between streams only behind a wait, the out-of-memory ladder unmaps
//! other streams' free tails and grows from its segment's free tail wherever it is cached, the
//! pieces around a hole in a retired stream's segment stay reachable, and an upstream without
//! mapping falls back to segments.
//! (The model tests in `model.rs` and `faults.rs` run every invariant with expandable segments too.)

mod common;

use std::sync::Arc;

use common::Free;
use cumem_pool::{
    CachingPool, HostOrdering, HostUpstream, Ordering, PoolConfig, PoolError, TrimReport, Upstream,
    UpstreamError,
};

const MIB: usize = 1 << 20;
const CHUNK: u64 = 2 << 20;

fn expandable() -> PoolConfig {
    PoolConfig { expandable_segments: true, ..PoolConfig::default() }
}

fn pool(capacity: usize) -> CachingPool<Arc<HostUpstream>, Arc<HostOrdering>> {
    CachingPool::new(Arc::new(HostUpstream::new(capacity)), Arc::new(HostOrdering::new()), expandable())
}

/// The one reservation's mapped bytes, checked against the upstream and the statistics.
fn mapped(p: &CachingPool<Arc<HostUpstream>, Arc<HostOrdering>>) -> u64 {
    let r = p.upstream().reservations();
    assert_eq!(r.len(), 1, "one stream, one kind: one reservation ({r:x?})");
    let (base, _, mapped) = r[0];
    assert_eq!(p.segments(), vec![(base, mapped)]);
    assert_eq!((p.stats().reserved_bytes, p.upstream().live_bytes()), (mapped, mapped));
    assert_eq!(mapped % CHUNK, 0);
    p.validate().unwrap();
    mapped
}

#[test]
fn the_free_tail_grows_and_shrinks_in_whole_chunks() {
    let p = pool(1 << 30);
    // Large sizes that are exact size classes, so the rounded sizes are the sizes.
    let sizes = [3 * MIB, 5 * MIB, (3 * MIB) / 2, 7 * MIB, 2 * MIB, 9 * MIB];
    let mut blocks = vec![];
    let mut end = 0u64;
    for &size in &sizes {
        let b = p.allocate(size, 512, 0).unwrap();
        if let Some(first) = blocks.first().map(|b: &cumem_pool::Block| b.addr()) {
            assert_eq!(b.addr(), first + end, "each block follows the previous one");
        }
        end += size as u64;
        assert_eq!(mapped(&p), end.next_multiple_of(CHUNK), "after a {size} B block");
        blocks.push(b);
    }
    // Free from the top: each trim unmaps exactly the whole free chunks above the highest live block.
    while let Some(b) = blocks.pop() {
        let before = mapped(&p);
        end -= b.rounded_size() as u64;
        p.free(b, 0).unwrap();
        let report = p.trim().unwrap();
        if blocks.is_empty() {
            assert!(p.upstream().reservations().is_empty(), "the reservation goes with the last chunk");
            assert_eq!(report, TrimReport { released_segments: 1, released_bytes: before });
        } else {
            assert_eq!(mapped(&p), end.next_multiple_of(CHUNK));
            assert_eq!(report, TrimReport { released_segments: 0, released_bytes: before - mapped(&p) });
        }
    }
    assert_eq!((p.upstream().live_bytes(), p.stats().segments), (0, 0));
    assert!(p.upstream().violations().is_empty(), "{:?}", p.upstream().violations());
}

#[test]
fn trim_unmaps_every_whole_free_chunk_holes_included() {
    let p = pool(1 << 30);
    let a = p.allocate(3 * MIB, 512, 0).unwrap();
    let b = p.allocate(3 * MIB, 512, 0).unwrap();
    let c = p.allocate(3 * MIB / 2, 512, 0).unwrap(); // ends at 7.5 MiB: 8 MiB mapped
    let (base, c_addr) = (a.addr(), c.addr());
    assert_eq!(mapped(&p), 8 << 20);
    p.free(b, 0).unwrap();
    // The hole [3, 6) MiB holds one whole chunk, [4, 6): unmapped, with a and c where they were.
    assert_eq!(p.trim().unwrap(), TrimReport { released_segments: 0, released_bytes: 2 << 20 });
    let runs = vec![(base, 4 << 20), (base + (6 << 20), 2 << 20)];
    assert_eq!(p.segments(), runs);
    let upstream_runs: Vec<(u64, u64)> =
        p.upstream().live().into_iter().map(|(a, l)| (a, l as u64)).collect();
    assert_eq!(upstream_runs, runs, "the upstream's mappings are the pool's runs");
    assert_eq!((p.stats().reserved_bytes, p.upstream().live_bytes()), (6 << 20, 6 << 20));
    assert_eq!(p.cached_ranges(), vec![(base + (3 << 20), 1 << 20), (base + (15 << 19), 1 << 19)]);
    p.validate().unwrap();
    assert_eq!(c.addr(), c_addr);
    p.free(c, 0).unwrap();
    // Free from 3 to 4 MiB and from 6 MiB up: the chunk [6, 8) is whole and free.
    let live_before = p.upstream().live_bytes();
    let report = p.trim().unwrap();
    assert_eq!(report.released_bytes, 2 << 20);
    assert_eq!(live_before - p.upstream().live_bytes(), report.released_bytes);
    assert_eq!(mapped(&p), 4 << 20);
    // What is left of the tail still serves requests, and growth joins it again.
    let d = p.allocate(5 * MIB, 512, 0).unwrap();
    assert_eq!(d.addr(), a.addr() + (3 << 20));
    assert_eq!(mapped(&p), 8 << 20);
    // trim_to keeps what it is asked to keep, in whole chunks.
    p.free(d, 0).unwrap();
    let report = p.trim_to(2 << 20).unwrap();
    assert_eq!((report.released_bytes, p.stats().cached_bytes), (4 << 20, 1 << 20));
    p.free(a, 0).unwrap();
    p.trim().unwrap();
    assert_eq!((p.upstream().live_bytes(), p.upstream().reservations().len()), (0, 0));
    assert!(p.upstream().violations().is_empty(), "{:?}", p.upstream().violations());
}

/// A request maps the hole where it needs the fewest new chunks, with the free memory around it;
/// when no segment has room, a second reservation serves it and no block moves.
#[test]
fn holes_are_mapped_again_and_a_full_segment_gets_a_second_reservation() {
    let config = PoolConfig { expandable_reservation_bytes: Some(16 << 20), ..expandable() };
    let p = CachingPool::new(Arc::new(HostUpstream::new(1 << 30)), Arc::new(HostOrdering::new()), config);
    // [0, 3) [3, 9) [9, 12) [12, 16) MiB: the 16 MiB reservation is full.
    let blocks: Vec<_> = [3, 6, 3, 4].iter().map(|&m| p.allocate(m * MIB, 512, 0).unwrap()).collect();
    let addrs: Vec<u64> = blocks.iter().map(|b| b.addr()).collect();
    let base = addrs[0];
    assert_eq!(addrs, vec![base, base + (3 << 20), base + (9 << 20), base + (12 << 20)]);
    let mut blocks = blocks.into_iter();
    let (a, b, c, d) =
        (blocks.next().unwrap(), blocks.next().unwrap(), blocks.next().unwrap(), blocks.next().unwrap());
    p.free(b, 0).unwrap();
    // [4, 8) unmapped; [3, 4) and [8, 9) stay cached around the hole.
    assert_eq!(p.trim().unwrap().released_bytes, 4 << 20);
    assert_eq!(p.segments(), vec![(base, 4 << 20), (base + (8 << 20), 8 << 20)]);
    // 3 MiB: the 1 MiB below the hole and one chunk of it; the hole's top chunk stays unmapped.
    let e = p.allocate(3 * MIB, 512, 0).unwrap();
    assert_eq!(e.addr(), base + (3 << 20));
    assert_eq!(p.segments(), vec![(base, 6 << 20), (base + (8 << 20), 8 << 20)]);
    // 8 MiB fits nowhere in the first reservation (one unmapped chunk, 1 MiB free above it): a
    // second one, and every earlier block stays where it was.
    let f = p.allocate(8 * MIB, 512, 0).unwrap();
    let r = p.upstream().reservations();
    assert_eq!(r.len(), 2, "{r:x?}");
    assert_eq!((r[1].0, r[1].2), (f.addr(), 8 << 20));
    assert_eq!(p.stats().segments, 2);
    assert_eq!([a.addr(), c.addr(), d.addr()], [addrs[0], addrs[2], addrs[3]]);
    p.validate().unwrap();
    for blk in [a, c, d, e, f] {
        p.free(blk, 0).unwrap();
    }
    assert_eq!(p.trim().unwrap().released_segments, 2);
    assert_eq!((p.upstream().live_bytes(), p.upstream().reservations().len()), (0, 0));
    assert!(p.upstream().violations().is_empty(), "{:?}", p.upstream().violations());
}

#[test]
fn each_stream_and_kind_grows_its_own_segment() {
    let p = pool(1 << 30);
    let blocks: Vec<_> = [(0u32, MIB), (0, 4 * MIB), (1, MIB), (1, 4 * MIB), (1, MIB)]
        .into_iter()
        .map(|(s, size)| (s, p.allocate(size, 512, s).unwrap()))
        .collect();
    let r = p.upstream().reservations();
    // Stream 0 small + large; stream 1's first small block is migrated from stream 0's free tail
    // (after a wait), its large block and its second small block grow segments of its own.
    assert_eq!(r.len(), 4, "{r:x?}");
    assert_eq!(r.iter().map(|x| x.2).collect::<Vec<_>>(), vec![CHUNK, 2 * CHUNK, 2 * CHUNK, CHUNK]);
    let owner = |addr: u64| r.iter().position(|&(b, l, _)| addr >= b && addr < b + l).unwrap();
    let homes: Vec<usize> = blocks.iter().map(|(_, b)| owner(b.addr())).collect();
    assert_eq!(homes, vec![0, 1, 0, 2, 3]);
    assert_eq!((blocks[2].1.addr(), p.ordering().waits()), (blocks[0].1.addr() + MIB as u64, 1));
    for (s, b) in blocks {
        p.free(b, s).unwrap();
    }
    p.validate().unwrap();
    assert_eq!(p.trim().unwrap(), TrimReport { released_segments: 4, released_bytes: 6 * CHUNK });
    assert!(p.upstream().reservations().is_empty());
}

#[test]
fn memory_moves_between_streams_only_behind_a_wait() {
    let p = pool(1 << 30);
    let a = p.allocate(8 * MIB, 512, 1).unwrap();
    let addr = a.addr();
    p.free(a, 1).unwrap();
    assert_eq!(p.ordering().waits(), 0);
    let allocations = p.stats().upstream_allocations;
    // Stream 2 has no segment yet and stream 1's free memory fits: migrated, after a wait.
    let b = p.allocate(8 * MIB, 512, 2).unwrap();
    assert_eq!((b.addr(), p.ordering().waits(), p.stats().upstream_allocations), (addr, 1, allocations));
    // A block of stream 1's segment freed on stream 2 stays with stream 2.
    p.free(b, 2).unwrap();
    let c = p.allocate(8 * MIB, 512, 2).unwrap();
    assert_eq!((c.addr(), p.ordering().waits()), (addr, 1));
    p.free(c, 2).unwrap();
    // Trim synchronises before it unmaps anything.
    let syncs = p.ordering().synchronizations();
    assert_eq!(p.trim().unwrap().released_bytes, 8 << 20);
    assert_eq!(p.ordering().synchronizations(), syncs + 1);
}

#[test]
fn the_ladder_unmaps_other_streams_free_tails() {
    let p = pool(16 << 20);
    let a = p.allocate(10 * MIB, 512, 0).unwrap();
    p.free(a, 0).unwrap();
    // 11 MiB does not fit stream 0's free 10 MiB, and stream 1's segment cannot map 12 MiB beside
    // stream 0's 10: the ladder unmaps stream 0's chunks and stream 1 grows.
    let b = p.allocate(11 * MIB, 512, 1).unwrap();
    let s = p.stats();
    assert_eq!((s.oom_ladders, s.oom_errors, s.reserved_bytes), (1, 0, 12 << 20));
    assert_eq!(p.upstream().reservations().len(), 1);
    // Beyond the capacity: a typed error with the pool's report.
    match p.allocate(6 * MIB, 512, 1) {
        Err(PoolError::OutOfMemory { requested, allocated, reserved, .. }) => {
            assert_eq!((requested, allocated, reserved), (6 * MIB, 11 << 20, 12 << 20));
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    p.free(b, 1).unwrap();
    p.trim().unwrap();
    assert_eq!(p.upstream().live_bytes(), 0);
}

#[test]
fn the_ladder_grows_from_a_free_tail_cached_by_another_stream() {
    // Three chunks: two mapped by stream 0, one left.
    let p = pool(6 * MIB);
    let a = p.allocate(5 * MIB / 2, 512, 0).unwrap();
    let b = p.allocate(3 * MIB / 2, 512, 0).unwrap();
    assert_eq!((b.addr(), mapped(&p)), (a.addr() + 5 * MIB as u64 / 2, 2 * CHUNK), "b is the whole tail");
    // Freed on stream 1, the tail is stream 1's.
    p.free(b, 1).unwrap();
    // 3 MiB from stream 0: the 1.5 MiB tail plus the last chunk fit, mapping from the end alone
    // does not. The ladder hands stream 0 its segment's tail (after synchronising) and grows it.
    let c = p.allocate(3 * MIB, 512, 0).unwrap();
    assert_eq!(c.addr(), a.addr() + 5 * MIB as u64 / 2);
    assert_eq!(mapped(&p), 3 * CHUNK);
    let s = p.stats();
    assert_eq!((s.oom_ladders, s.oom_errors), (1, 0));
    p.free(c, 0).unwrap();
    p.free(a, 0).unwrap();
    assert_eq!(p.trim().unwrap(), TrimReport { released_segments: 1, released_bytes: 3 * CHUNK });
    assert!(p.upstream().violations().is_empty(), "{:?}", p.upstream().violations());
}

#[test]
fn stack_like_use_reserves_no_more_than_its_peak() {
    // A training-like loop: activations allocated forward, freed backward, the batch size varying.
    let p = pool(1 << 34);
    let layers = [3usize, 7, 5, 12, 9, 4, 6];
    for batch in [8usize, 16, 12, 32, 24, 4, 28] {
        let blocks: Vec<_> =
            layers.iter().map(|&l| p.allocate(l * batch * (MIB / 8), 512, 0).unwrap()).collect();
        for b in blocks.into_iter().rev() {
            p.free(b, 0).unwrap();
        }
    }
    let s = p.stats();
    assert_eq!(s.peak_reserved_bytes, s.peak_bytes.next_multiple_of(CHUNK));
    let classic = CachingPool::new(HostUpstream::new(1 << 34), HostOrdering::new(), PoolConfig::default());
    for batch in [8usize, 16, 12, 32, 24, 4, 28] {
        let blocks: Vec<_> =
            layers.iter().map(|&l| classic.allocate(l * batch * (MIB / 8), 512, 0).unwrap()).collect();
        for b in blocks.into_iter().rev() {
            classic.free(b, 0).unwrap();
        }
    }
    let c = classic.stats();
    assert_eq!(c.peak_bytes, s.peak_bytes);
    assert!(c.peak_reserved_bytes > s.peak_reserved_bytes, "{c:?} vs {s:?}");
}

#[test]
fn aligned_requests_map_only_what_they_need() {
    let p = pool(1 << 30);
    let a = p.allocate(512 << 10, 512, 0).unwrap(); // small: its own segment
    let b = p.allocate(3 * MIB, 512, 0).unwrap(); // large: 2 chunks
    let c = p.allocate(MIB + 512, 2 << 20, 0).unwrap(); // at 4 MiB, aligned: ends below 6 MiB
    assert_eq!(c.addr() % (2 << 20), 0);
    assert_eq!(c.addr(), b.addr() + (4 << 20));
    let r = p.upstream().reservations();
    assert_eq!(r.iter().map(|x| x.2).sum::<u64>(), CHUNK + 3 * CHUNK);
    for blk in [a, b, c] {
        p.free(blk, 0).unwrap();
    }
    p.validate().unwrap();
    p.trim().unwrap();
    assert!(p.upstream().reservations().is_empty());
}

/// An upstream with segments only.
struct SegmentsOnly(HostUpstream);

impl Upstream for SegmentsOnly {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        self.0.allocate(bytes)
    }
    unsafe fn deallocate(&self, addr: u64, bytes: usize) {
        // SAFETY: forwarded from this method's caller, who keeps its contract.
        unsafe { self.0.deallocate(addr, bytes) }
    }
}

// SAFETY: hands out its `HostUpstream`'s addresses only.
unsafe impl common::HostModel for SegmentsOnly {}

#[test]
fn an_upstream_that_cannot_map_falls_back_to_segments() {
    let p = CachingPool::new(SegmentsOnly(HostUpstream::new(1 << 30)), HostOrdering::new(), expandable());
    assert!(p.expandable().is_none());
    let b = p.allocate(3 * MIB, 512, 0).unwrap();
    assert_eq!(p.segments()[0].1, 20 << 20, "a segment of the default large size");
    assert!(p.upstream().0.reservations().is_empty());
    p.free(b, 0).unwrap();
    p.trim().unwrap();
    assert_eq!(p.upstream().0.live_bytes(), 0);
}

#[test]
fn dropping_the_pool_unmaps_and_releases_everything() {
    let up = Arc::new(HostUpstream::new(1 << 30));
    let p = CachingPool::new(up.clone(), HostOrdering::new(), expandable());
    let a = p.allocate(5 * MIB, 512, 0).unwrap();
    let _kept = p.allocate(1000, 512, 3).unwrap();
    p.free(a, 0).unwrap();
    drop(p);
    assert_eq!((up.live_bytes(), up.reservations().len()), (0, 0));
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

/// No segment has room and the upstream refuses another reservation: the error says so (not out
/// of memory) and names the reservation size; once a block is freed, the pool serves the request.
#[test]
fn a_refused_reservation_is_reported_as_address_space_exhaustion() {
    let up = Arc::new(HostUpstream::new(1 << 30));
    up.limit_address_space(8 << 20);
    let config = PoolConfig { expandable_reservation_bytes: Some(4 << 20), ..expandable() };
    let p = CachingPool::new(up.clone(), Arc::new(HostOrdering::new()), config);
    let a = p.allocate(3 * MIB, 512, 0).unwrap();
    let b = p.allocate(3 * MIB, 512, 0).unwrap(); // the first segment is full: a second one
    assert_eq!(up.reservations().len(), 2);
    let err = p.allocate(3 * MIB, 512, 0).unwrap_err();
    assert_eq!(
        err,
        PoolError::AddressSpaceExhausted {
            requested: 3 * MIB,
            reservation_bytes: 4 << 20,
            segments: 2,
            reserved_address_space: 8 << 20,
            mapped: 8 << 20,
        }
    );
    let text = err.to_string();
    assert!(text.starts_with("out of address space") && text.contains("4.00 MiB"), "{text}");
    assert!(text.contains("PoolConfig::expandable_reservation_bytes"), "{text}");
    assert_eq!(p.stats().oom_errors, 1);
    p.free(a, 0).unwrap();
    let c = p.allocate(3 * MIB, 512, 0).unwrap();
    p.validate().unwrap();
    for blk in [b, c] {
        p.free(blk, 0).unwrap();
    }
    p.trim().unwrap();
    assert_eq!((up.live_bytes(), up.reservations().len()), (0, 0));
    assert!(up.violations().is_empty(), "{:?}", up.violations());
}

/// An ordering that retires the streams a test marks as dropped, under the name [`RETIRED`].
#[derive(Debug, Default)]
struct Retiring {
    dropped: parking_lot::Mutex<Vec<u32>>,
    waits: parking_lot::Mutex<Vec<(u32, u32)>>,
}

const RETIRED: u32 = u32::MAX;

impl Ordering for Retiring {
    type Stream = u32;
    fn wait(&self, waiter: u32, on: u32) -> Result<(), UpstreamError> {
        self.waits.lock().push((waiter, on));
        Ok(())
    }
    fn synchronize(&self) -> Result<(), UpstreamError> {
        Ok(())
    }
    fn retired_stream(&self) -> Option<u32> {
        Some(RETIRED)
    }
    fn orphans(&self) -> Vec<u32> {
        self.dropped.lock().clone()
    }
    fn retire(&self, stream: u32) -> Result<(), UpstreamError> {
        self.dropped.lock().retain(|&s| s != stream);
        Ok(())
    }
}

/// Trim retires a dropped stream (its arena is vacated, its free memory goes under the retired
/// name) and then unmaps a hole in the segment that stream grew: the free pieces on either side
/// stay reachable, so another stream takes one (behind a wait) instead of mapping more.
#[test]
fn pieces_around_a_hole_of_a_retired_streams_segment_stay_reachable() {
    let config = PoolConfig { expandable_reservation_bytes: Some(16 << 20), ..expandable() };
    let ordering = Arc::new(Retiring::default());
    let p = CachingPool::new(Arc::new(HostUpstream::new(1 << 30)), ordering.clone(), config);
    // Stream 1 grows [0, 2.5) [2.5, 11) [11, 15) MiB of its segment (1 MiB free above); stream 3
    // holds 2 whole chunks of its own.
    let (a, b, c) = (
        p.allocate(5 * MIB / 2, 512, 1).unwrap(),
        p.allocate(17 * MIB / 2, 512, 1).unwrap(),
        p.allocate(4 * MIB, 512, 1).unwrap(),
    );
    let base = a.addr();
    let x = p.allocate(4 * MIB, 512, 3).unwrap();
    p.free(b, 1).unwrap();
    ordering.dropped.lock().push(1);
    // [4, 10) is unmapped; [2.5, 4) and [10, 11) stay cached, under the retired name.
    assert_eq!(p.trim().unwrap().released_bytes, 6 << 20);
    assert!(ordering.dropped.lock().is_empty(), "stream 1 was not retired");
    let reserved = p.stats().reserved_bytes;
    let waits = ordering.waits.lock().len();
    // 1.5 MiB on stream 3 (a large block, like the pieces): the piece below the hole, behind a wait.
    let y = p.allocate(3 * MIB / 2, 512, 3).unwrap();
    assert_eq!(y.addr(), base + (5 << 19), "a piece next to the hole was out of reach");
    assert_eq!(p.stats().reserved_bytes, reserved);
    assert_eq!(ordering.waits.lock()[waits..], [(3, RETIRED)]);
    p.validate().unwrap();
    for blk in [a, c, x, y] {
        p.free(blk, 3).unwrap();
    }
    p.trim().unwrap();
    assert_eq!((p.upstream().live_bytes(), p.upstream().reservations().len()), (0, 0));
    assert!(p.upstream().violations().is_empty(), "{:?}", p.upstream().violations());
}

/// A configured reservation that rounds past the end of the address space is reported as that
/// size refused (not as an overflowed number), and the pool still serves nothing it cannot map.
#[test]
fn a_reservation_too_large_for_the_address_space_names_its_size() {
    let config = PoolConfig { expandable_reservation_bytes: Some(usize::MAX - 1), ..expandable() };
    let p = CachingPool::new(Arc::new(HostUpstream::new(1 << 30)), Arc::new(HostOrdering::new()), config);
    match p.allocate(MIB, 512, 0).unwrap_err() {
        PoolError::AddressSpaceExhausted { reservation_bytes, segments: 0, mapped: 0, .. } => {
            assert_eq!(reservation_bytes, (usize::MAX - 1) as u64)
        }
        other => panic!("expected an address-space error, got {other:?}"),
    }
    assert!(p.upstream().reservations().is_empty());
}
