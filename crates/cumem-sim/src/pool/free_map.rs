//! The block map of one memory pool, indexed so that every allocation and free costs O(log n) in
//! the number of blocks.
//!
//! Every chunk is tiled by blocks, each used or free. A free block has a *class*: free for every
//! stream (`Free(None)`, "settled"), or freed in stream order on stream S and not settled yet
//! (`Free(Some((S, seq)))`, "pending"). Neighbouring free blocks of one class are always merged
//! (two pending frees of one stream under the later one's `seq`), so two free blocks that touch are
//! of different classes; their boundary is a *seam*. Settled blocks are indexed by `(size,
//! address)`; pending ones per stream by `(size, address)` and by `seq` (a stream completes its
//! frees in `seq` order, so settling pops the front of one ordered set). An allocation that needs
//! blocks of several classes together can only span a seam, so only seams are searched for one.
//!
//! ```text
//! chunk: | used | free (any) | freed on S, seq 9 | used | free (any) ............ |
//!                            ^ seam
//! ```

use std::collections::{BTreeMap, BTreeSet};

/// The state of one block of a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Block {
    /// A live allocation.
    Used,
    /// Free; `Some((stream, seq))` while only stream-ordered reuse is allowed (the free is the
    /// operation `seq` of `stream`), `None` when every stream may use it.
    Free(Option<(u64, u64)>),
}

/// The pending blocks of one stream.
#[derive(Debug, Default)]
struct Pending {
    /// `(seq, address)`.
    by_seq: BTreeSet<(u64, u64)>,
    /// `(size, address)`.
    by_size: BTreeSet<(u64, u64)>,
}

/// All blocks of one pool, with the indexes described in the module documentation.
#[derive(Debug, Default)]
pub(crate) struct FreeMap {
    /// Block start -> (size, state).
    blocks: BTreeMap<u64, (u64, Block)>,
    /// Chunk base -> (size, number of used blocks in it).
    chunks: BTreeMap<u64, (u64, u64)>,
    /// Settled free blocks: `(size, address)`.
    settled: BTreeSet<(u64, u64)>,
    /// Freeing stream -> its pending blocks (absent when it has none).
    pending: BTreeMap<u64, Pending>,
    /// Starts of free blocks that follow another free block in the same chunk.
    seams: BTreeSet<u64>,
}

/// The block two touching free blocks merge into, if they are of one class.
fn join(a: Block, b: Block) -> Option<Block> {
    match (a, b) {
        (Block::Free(None), Block::Free(None)) => Some(Block::Free(None)),
        (Block::Free(Some((s1, q1))), Block::Free(Some((s2, q2)))) if s1 == s2 => {
            Some(Block::Free(Some((s1, q1.max(q2)))))
        }
        _ => None,
    }
}

impl FreeMap {
    /// Adds a chunk of `size` bytes at `base`, entirely free for every stream.
    pub(crate) fn add_chunk(&mut self, base: u64, size: u64) {
        self.chunks.insert(base, (size, 0));
        self.put(base, size, Block::Free(None));
    }

    /// Forgets the chunk at `base` and every block in it.
    pub(crate) fn remove_chunk(&mut self, base: u64) {
        let Some((size, _)) = self.chunks.remove(&base) else { return };
        let starts: Vec<u64> = self.blocks.range(base..base + size).map(|(&a, _)| a).collect();
        for a in starts {
            self.take(a);
            self.seams.remove(&a);
        }
    }

    /// The chunks: `(base, size)`.
    pub(crate) fn chunks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.chunks.iter().map(|(&b, &(s, _))| (b, s))
    }

    /// Whether the chunk at `base` holds no live allocation and every free in it satisfies `done`.
    pub(crate) fn chunk_releasable(&self, base: u64, done: impl Fn(u64, u64) -> bool) -> bool {
        let Some(&(size, used)) = self.chunks.get(&base) else { return false };
        used == 0
            && self.blocks.range(base..base + size).all(|(_, &(_, b))| match b {
                Block::Used => false,
                Block::Free(None) => true,
                Block::Free(Some((s, q))) => done(s, q),
            })
    }

    /// Whether every pending free satisfies `done`.
    pub(crate) fn all_done(&self, done: impl Fn(u64, u64) -> bool) -> bool {
        self.pending.iter().all(|(&s, p)| p.by_seq.last().is_none_or(|&(q, _)| done(s, q)))
    }

    fn index(&mut self, addr: u64, size: u64, b: Block) {
        match b {
            Block::Used => {}
            Block::Free(None) => {
                self.settled.insert((size, addr));
            }
            Block::Free(Some((s, q))) => {
                let p = self.pending.entry(s).or_default();
                p.by_seq.insert((q, addr));
                p.by_size.insert((size, addr));
            }
        }
    }

    fn unindex(&mut self, addr: u64, size: u64, b: Block) {
        match b {
            Block::Used => {}
            Block::Free(None) => {
                self.settled.remove(&(size, addr));
            }
            Block::Free(Some((s, q))) => {
                if let Some(p) = self.pending.get_mut(&s) {
                    p.by_seq.remove(&(q, addr));
                    p.by_size.remove(&(size, addr));
                    if p.by_seq.is_empty() {
                        self.pending.remove(&s);
                    }
                }
            }
        }
    }

    fn put(&mut self, addr: u64, size: u64, b: Block) {
        self.blocks.insert(addr, (size, b));
        self.index(addr, size, b);
    }

    fn take(&mut self, addr: u64) -> Option<(u64, Block)> {
        let (size, b) = self.blocks.remove(&addr)?;
        self.unindex(addr, size, b);
        Some((size, b))
    }

    fn count_used(&mut self, addr: u64, delta: i64) {
        if let Some((_, (_, used))) = self.chunks.range_mut(..=addr).next_back() {
            *used = used.saturating_add_signed(delta);
        }
    }

    /// The free block that ends at `addr` in the same chunk: `(start, size, state)`.
    fn free_before(&self, addr: u64) -> Option<(u64, u64, Block)> {
        if self.chunks.contains_key(&addr) {
            return None;
        }
        let (&a, &(s, b)) = self.blocks.range(..addr).next_back()?;
        (a + s == addr && b != Block::Used).then_some((a, s, b))
    }

    /// The free block that starts at `addr`, unless `addr` begins another chunk.
    fn free_at(&self, addr: u64) -> Option<(u64, u64, Block)> {
        if self.chunks.contains_key(&addr) {
            return None;
        }
        let &(s, b) = self.blocks.get(&addr)?;
        (b != Block::Used).then_some((addr, s, b))
    }

    fn refresh_seam(&mut self, addr: u64) {
        if self.free_at(addr).is_some() && self.free_before(addr).is_some() {
            self.seams.insert(addr);
        } else {
            self.seams.remove(&addr);
        }
    }

    /// Adds a free block (none is indexed at `addr`), merged with neighbours of its class.
    fn insert_free(&mut self, mut addr: u64, mut size: u64, mut b: Block) {
        if let Some((pa, ps, pb)) = self.free_before(addr)
            && let Some(j) = join(pb, b)
        {
            self.take(pa);
            (addr, size, b) = (pa, ps + size, j);
        }
        let end = addr + size;
        if let Some((_, ns, nb)) = self.free_at(end)
            && let Some(j) = join(b, nb)
        {
            self.take(end);
            (size, b) = (size + ns, j);
        }
        self.put(addr, size, b);
        let inner: Vec<u64> = self.seams.range(addr + 1..addr + size).copied().collect();
        for s in inner {
            self.seams.remove(&s);
        }
        self.refresh_seam(addr);
        self.refresh_seam(addr + size);
    }

    /// Frees the used block at `addr` with class `tag`; its size, or `None` if no used block
    /// starts there.
    pub(crate) fn release(&mut self, addr: u64, tag: Option<(u64, u64)>) -> Option<u64> {
        let &(size, b) = self.blocks.get(&addr)?;
        if b != Block::Used {
            return None;
        }
        self.blocks.remove(&addr);
        self.count_used(addr, -1);
        self.insert_free(addr, size, Block::Free(tag));
        Some(size)
    }

    /// Settles pending blocks whose free satisfies `done(stream, seq)`, oldest first per stream.
    pub(crate) fn settle(&mut self, done: impl Fn(u64, u64) -> bool) {
        let streams: Vec<u64> = self.pending.keys().copied().collect();
        for s in streams {
            while let Some(&(q, addr)) = self.pending.get(&s).and_then(|p| p.by_seq.first())
                && done(s, q)
            {
                let (size, _) = self.take(addr).expect("indexed blocks exist");
                self.insert_free(addr, size, Block::Free(None));
            }
        }
    }

    /// The streams with pending blocks.
    pub(crate) fn pending_streams(&self) -> impl Iterator<Item = u64> + '_ {
        self.pending.keys().copied()
    }

    /// The smallest settled block of at least `need` bytes: `(size, address)`.
    pub(crate) fn smallest_settled(&self, need: u64) -> Option<(u64, u64)> {
        self.settled.range((need, 0)..).next().copied()
    }

    /// The smallest block of at least `need` bytes freed on `stream` by an operation with
    /// `seq <= through`: `(size, address, seq)`.
    pub(crate) fn smallest_pending(&self, stream: u64, need: u64, through: u64) -> Option<(u64, u64, u64)> {
        let p = self.pending.get(&stream)?;
        let seq_of = |addr: u64| match self.blocks.get(&addr) {
            Some(&(_, Block::Free(Some((_, q))))) => q,
            _ => unreachable!("a pending index names a pending block"),
        };
        if p.by_seq.last().is_some_and(|&(q, _)| q <= through) {
            let &(size, addr) = p.by_size.range((need, 0)..).next()?;
            return Some((size, addr, seq_of(addr)));
        }
        // Only part of the stream's frees qualifies: look at those (frees that complete leave
        // the set, so it holds the frees of the last few latencies).
        p.by_seq
            .range(..=(through, u64::MAX))
            .filter_map(|&(q, addr)| {
                let size = self.blocks.get(&addr).map_or(0, |&(s, _)| s);
                (size >= need).then_some((size, addr, q))
            })
            .min()
    }

    /// The start of the run of neighbouring free blocks for which `usable` holds that ends with
    /// the block at `addr`.
    pub(crate) fn run_start(&self, addr: u64, usable: impl Fn(Block) -> bool) -> u64 {
        let mut a = addr;
        while let Some((pa, _, pb)) = self.free_before(a)
            && usable(pb)
        {
            a = pa;
        }
        a
    }

    /// The start of the first run (by address) of at least `need` bytes of neighbouring free
    /// blocks of several classes, all of which `usable` accepts.
    pub(crate) fn run_across_seams(&self, need: u64, usable: impl Fn(Block) -> bool) -> Option<u64> {
        let mut covered = 0;
        for &seam in &self.seams {
            if seam < covered {
                continue;
            }
            let (Some((_, _, here)), Some((_, _, before))) = (self.free_at(seam), self.free_before(seam))
            else {
                continue;
            };
            if !usable(here) || !usable(before) {
                continue;
            }
            let start = self.run_start(seam, &usable);
            let mut end = seam;
            while let Some((a, s, b)) = self.free_at(end)
                && usable(b)
            {
                end = a + s;
            }
            covered = end;
            if end - start >= need {
                return Some(start);
            }
        }
        None
    }

    /// Makes `[addr, addr + need)`, which free blocks cover, one used block; the rest of the last
    /// of those blocks stays free in its class.
    pub(crate) fn carve(&mut self, addr: u64, need: u64) {
        let end = addr + need;
        let mut at = addr;
        while at < end {
            let (size, b) = self.take(at).expect("a placement names free blocks");
            debug_assert_ne!(b, Block::Used, "a placement names free blocks");
            if at + size > end {
                self.put(end, at + size - end, b);
            }
            at += size;
        }
        self.put(addr, need, Block::Used);
        self.count_used(addr, 1);
        let touched: Vec<u64> = self.seams.range(addr..=end).copied().collect();
        for s in touched {
            self.seams.remove(&s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANY: Block = Block::Free(None);

    fn blocks(m: &FreeMap) -> Vec<(u64, u64, Block)> {
        m.blocks.iter().map(|(&a, &(s, b))| (a, s, b)).collect()
    }

    #[test]
    fn frees_of_one_class_merge_and_others_meet_at_seams() {
        let mut m = FreeMap::default();
        m.add_chunk(0, 4096);
        m.carve(0, 1024);
        m.carve(1024, 1024);
        m.carve(2048, 1024);
        assert_eq!(blocks(&m).len(), 4);
        m.release(0, Some((7, 1)));
        m.release(1024, Some((7, 2)));
        assert_eq!(blocks(&m)[0], (0, 2048, Block::Free(Some((7, 2)))), "one stream's frees merge");
        m.release(2048, None);
        assert_eq!(blocks(&m)[1], (2048, 2048, ANY), "settled frees merge with the free tail");
        assert_eq!(m.seams.iter().copied().collect::<Vec<_>>(), [2048]);
        assert_eq!(m.run_across_seams(4096, |_| true), Some(0));
        assert_eq!(m.run_across_seams(4096, |b| b == ANY), None);
        m.settle(|s, q| s == 7 && q <= 2);
        assert_eq!(blocks(&m), [(0, 4096, ANY)]);
        assert!(m.seams.is_empty() && m.pending.is_empty());
        assert!(m.chunk_releasable(0, |_, _| false));
    }

    #[test]
    fn settling_follows_each_streams_order_and_stops_at_the_first_pending_free() {
        let mut m = FreeMap::default();
        m.add_chunk(0, 8192);
        for a in [0, 1024, 2048, 3072] {
            m.carve(a, 1024);
        }
        m.release(0, Some((1, 5)));
        m.release(2048, Some((1, 9)));
        m.settle(|_, q| q <= 5);
        assert_eq!(m.smallest_settled(1024), Some((1024, 0)));
        assert_eq!(m.smallest_pending(1, 1024, u64::MAX), Some((1024, 2048, 9)));
        assert_eq!(m.smallest_pending(1, 1024, 8), None, "seq 9 is past what the caller waits for");
        assert!(!m.all_done(|_, q| q <= 5));
        assert!(m.all_done(|_, q| q <= 9));
    }

    #[test]
    fn chunks_never_merge_across_their_boundary() {
        let mut m = FreeMap::default();
        m.add_chunk(0, 1024);
        m.add_chunk(1024, 1024);
        assert_eq!(blocks(&m), [(0, 1024, ANY), (1024, 1024, ANY)]);
        assert!(m.seams.is_empty());
        assert_eq!(m.smallest_settled(2048), None);
        m.remove_chunk(0);
        assert_eq!(blocks(&m), [(1024, 1024, ANY)]);
        assert_eq!(m.chunks().collect::<Vec<_>>(), [(1024, 1024)]);
    }

    /// Checks every invariant the indexes rely on against the block map itself.
    fn check(m: &FreeMap) {
        let mut settled = BTreeSet::new();
        let mut by_seq: BTreeMap<u64, BTreeSet<(u64, u64)>> = BTreeMap::new();
        let mut by_size: BTreeMap<u64, BTreeSet<(u64, u64)>> = BTreeMap::new();
        let mut seams = BTreeSet::new();
        for (&base, &(size, used)) in &m.chunks {
            let mut at = base;
            let mut used_blocks = 0;
            let mut prev: Option<Block> = None;
            for (&a, &(s, b)) in m.blocks.range(base..base + size) {
                assert_eq!(a, at, "blocks tile the chunk at {base:#x}");
                at += s;
                match b {
                    Block::Used => used_blocks += 1,
                    Block::Free(None) => {
                        settled.insert((s, a));
                    }
                    Block::Free(Some((st, q))) => {
                        by_seq.entry(st).or_default().insert((q, a));
                        by_size.entry(st).or_default().insert((s, a));
                    }
                }
                if let Some(p) = prev
                    && p != Block::Used
                    && b != Block::Used
                {
                    assert!(join(p, b).is_none(), "touching free blocks of one class at {a:#x}");
                    seams.insert(a);
                }
                prev = Some(b);
            }
            assert_eq!(at, base + size, "blocks tile the chunk at {base:#x}");
            assert_eq!(used, used_blocks, "used-block count of the chunk at {base:#x}");
        }
        assert_eq!(
            m.blocks.len(),
            m.chunks.iter().map(|(&b, &(s, _))| m.blocks.range(b..b + s).count()).sum::<usize>()
        );
        assert_eq!(m.settled, settled);
        assert_eq!(m.seams, seams);
        assert_eq!(m.pending.keys().copied().collect::<Vec<_>>(), by_seq.keys().copied().collect::<Vec<_>>());
        for (st, p) in &m.pending {
            assert_eq!(p.by_seq, by_seq[st]);
            assert_eq!(p.by_size, by_size[st]);
        }
    }

    /// One step of a random workload: `(kind, a, b)`, interpreted by [`apply`].
    type Step = (u8, u16, u16);

    fn apply(m: &mut FreeMap, done: &mut [u64; 3], seq: &mut u64, (kind, a, b): Step) {
        let free: Vec<(u64, u64, Block)> =
            m.blocks.iter().filter(|(_, (_, b))| *b != Block::Used).map(|(&a, &(s, b))| (a, s, b)).collect();
        let used: Vec<u64> =
            m.blocks.iter().filter(|(_, (_, b))| *b == Block::Used).map(|(&a, _)| a).collect();
        match kind % 4 {
            0 if !free.is_empty() => {
                let (addr, size, _) = free[usize::from(a) % free.len()];
                let need = (u64::from(b % 8) + 1) * 512;
                m.carve(addr, need.min(size));
            }
            1 => {
                let need = (u64::from(b % 16) + 1) * 512;
                if let Some(addr) = m.run_across_seams(need, |_| true) {
                    m.carve(addr, need);
                }
            }
            2 if !used.is_empty() => {
                let addr = used[usize::from(a) % used.len()];
                *seq += 1;
                let tag = (b % 4 != 3).then_some((u64::from(b % 3), *seq));
                m.release(addr, tag);
            }
            3 => {
                let s = usize::from(a % 3);
                done[s] = done[s].max(*seq - u64::from(b % 4).min(*seq));
                let done = *done;
                m.settle(|s, q| q <= done[s as usize]);
            }
            _ => {}
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

        /// Any sequence of carves, frees (settled or pending on one of three streams) and settling
        /// keeps the indexes equal to what the block map says, and the queries agree with a scan.
        #[test]
        fn the_indexes_always_agree_with_the_block_map(
            steps in proptest::collection::vec((0u8..4, 0u16..1000, 0u16..1000), 1..200),
        ) {
            let mut m = FreeMap::default();
            // Two chunks that touch: blocks must never merge across them.
            m.add_chunk(1 << 20, 32 << 10);
            m.add_chunk((1 << 20) + (32 << 10), 16 << 10);
            let (mut done, mut seq) = ([0u64; 3], 0u64);
            for step in steps {
                apply(&mut m, &mut done, &mut seq, step);
                check(&m);
                for need in [512, 4096] {
                    let scan = m.settled.iter().filter(|&&(s, _)| s >= need).min().copied();
                    assert_eq!(m.smallest_settled(need), scan);
                    for st in 0..3 {
                        for through in [seq / 2, u64::MAX] {
                            let scan = m
                                .blocks
                                .iter()
                                .filter_map(|(&a, &(s, b))| match b {
                                    Block::Free(Some((x, q))) if x == st && q <= through && s >= need => Some((s, a, q)),
                                    _ => None,
                                })
                                .min();
                            assert_eq!(m.smallest_pending(st, need, through), scan);
                        }
                    }
                }
            }
        }
    }
}
