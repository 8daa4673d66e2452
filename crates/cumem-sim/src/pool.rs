//! Stream-ordered memory pools (`cuMemAllocAsync`, `cuMemPool*`).
//!
//! A pool reserves *chunks* of device address space, charged against the device's capacity (so
//! `cuMemGetInfo` sees reservations as used): 32 MiB, or the request rounded up to 2 MiB if that is
//! larger (or if 32 MiB would exceed the pool's `maxSize` or the device's free capacity). A chunk
//! is partitioned into blocks; allocations are rounded up to 512 bytes and placed first-fit.
//!
//! Each chunk has one host mapping (its [`Backing`], lazily committed). A pool allocation is an
//! ordinary [`Allocation`] of kind `Pool` whose backing is a *view* of its range of that mapping:
//! copies and memsets are bounds-checked per allocation, not per chunk, but two allocations that
//! occupy the same addresses (one after the other) share the same bytes, exactly as on a GPU. So
//! work still pending on the freeing stream, or on any stream the program forgot to order before
//! the free, reads and writes the block's *current* contents — which a new owner may be using.
//! Such work is also reported when it runs (see `Freed` and the engine).
//!
//! A block freed by `cuMemFreeAsync(p, S)` is tagged with the free's position in S's FIFO
//! (`(S, seq)`); it becomes free *in stream order*. An allocation on stream T may take a tagged
//! block when
//! 1. T == S (stream order already guarantees it), or
//! 2. REUSE_FOLLOW_EVENT_DEPENDENCIES and T's future work already depends on S up to `seq`
//!    (through `cuStreamWaitEvent`, or the legacy stream's implicit synchronisation), or
//! 3. REUSE_ALLOW_OPPORTUNISTIC and the free has completed (then the tag is dropped: the block
//!    is usable by every stream), or
//! 4. REUSE_ALLOW_INTERNAL_DEPENDENCIES, only when the pool cannot grow (maxSize or device
//!    capacity): the allocator enqueues a wait of T on S's free and reuses the block.
//!
//! At `cuStreamSynchronize` / `cuEventSynchronize` / `cuCtxSynchronize` every pool of the
//! device releases chunks that are entirely free (all frees complete) while the reservation stays
//! at or above its RELEASE_THRESHOLD; `cuMemPoolTrimTo` does the same with `minBytesToKeep`.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUresult;

use crate::api::Fail;
use crate::copy::Work;
use crate::memory::{AllocKind, Allocation, Backing};
use crate::state::State;
use crate::stream::{StreamKind, done_through, enqueue};

/// Allocation granule inside a pool.
pub(crate) const GRANULE: u64 = 512;
/// Default chunk size.
pub(crate) const CHUNK: u64 = 32 << 20;
/// Chunk size and alignment granule.
pub(crate) const CHUNK_ALIGN: u64 = 2 << 20;

/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub(crate) const PROT_READWRITE: u32 = 3;

/// The state of one block of a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Block {
    /// A live allocation.
    Used,
    /// Free; `Some((stream, seq))` while only stream-ordered reuse is allowed (the free is the
    /// operation `seq` of `stream`), `None` when every stream may use it.
    Free(Option<(u64, u64)>),
}

/// One reservation of a pool.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub(crate) size: u64,
    /// The chunk's memory; every allocation in the chunk is a view of it (queued work that holds
    /// such a view keeps it mapped after the chunk is released).
    pub(crate) backing: Arc<Backing>,
    /// Block start address -> (size, state); the blocks tile the chunk.
    pub(crate) blocks: BTreeMap<u64, (u64, Block)>,
}

/// A memory pool.
#[derive(Debug)]
pub(crate) struct Pool {
    pub(crate) device: usize,
    pub(crate) is_default: bool,
    /// Destroyed by the program while allocations were outstanding: the handle is dead, the
    /// memory goes away when the last allocation has been freed.
    pub(crate) destroyed: bool,
    /// 0 = no limit but the device's capacity.
    pub(crate) max_size: u64,
    pub(crate) follow_event_deps: bool,
    pub(crate) opportunistic: bool,
    pub(crate) internal_deps: bool,
    pub(crate) release_threshold: u64,
    pub(crate) reserved: u64,
    pub(crate) reserved_high: u64,
    pub(crate) used: u64,
    pub(crate) used_high: u64,
    pub(crate) chunks: BTreeMap<u64, Chunk>,
    /// Access flags of devices other than the owner (absent = PROT_NONE).
    pub(crate) access: BTreeMap<usize, u32>,
}

impl Pool {
    /// A pool with the driver's default attributes.
    pub(crate) fn new(device: usize, is_default: bool, max_size: u64) -> Self {
        Self {
            device,
            is_default,
            destroyed: false,
            max_size,
            follow_event_deps: true,
            opportunistic: true,
            internal_deps: true,
            release_threshold: 0,
            reserved: 0,
            reserved_high: 0,
            used: 0,
            used_high: 0,
            chunks: BTreeMap::new(),
            access: BTreeMap::new(),
        }
    }

    /// The access flags `device` has on the pool's memory.
    pub(crate) fn access_of(&self, device: usize) -> u32 {
        if device == self.device { PROT_READWRITE } else { self.access.get(&device).copied().unwrap_or(0) }
    }
}

/// Whether work enqueued on stream `t` from now on is ordered after operation `seq` of stream
/// `f` (same stream, a recorded dependency, or the legacy stream's implicit synchronisation).
pub(crate) fn ordered_after(st: &State, t: u64, f: u64, seq: u64) -> bool {
    if t == f {
        return true;
    }
    let (Some(ts), Some(fs)) = (st.streams.get(&t), st.streams.get(&f)) else {
        return false;
    };
    if ts.waits.get(&f).is_some_and(|&q| q >= seq) {
        return true;
    }
    ts.ctx == fs.ctx
        && ((ts.kind == StreamKind::Legacy && fs.kind != StreamKind::Legacy && fs.blocking())
            || (fs.kind == StreamKind::Legacy && ts.kind != StreamKind::Legacy && ts.blocking()))
}

/// Drops the tags of completed frees when the pool reuses opportunistically, then merges
/// neighbouring free blocks with the same tag.
pub(crate) fn settle(st: &mut State, handle: u64) {
    let Some(mut pool) = st.pools.remove(&handle) else { return };
    for chunk in pool.chunks.values_mut() {
        for (_, (_, b)) in chunk.blocks.iter_mut() {
            if let Block::Free(Some((s, q))) = *b
                && pool.opportunistic
                && done_through(&st.streams, s, q)
            {
                *b = Block::Free(None);
            }
        }
        coalesce(chunk);
    }
    // A destroyed pool disappears once nothing of it is in use any more.
    if pool.destroyed && pool.used == 0 && all_frees_done(st, &pool) {
        let bases: Vec<u64> = pool.chunks.keys().copied().collect();
        for base in bases {
            release_chunk(st, &mut pool, base);
        }
        return;
    }
    st.pools.insert(handle, pool);
}

fn all_frees_done(st: &State, pool: &Pool) -> bool {
    pool.chunks.values().all(|c| chunk_releasable(st, c))
}

fn join(a: Block, b: Block) -> Option<Block> {
    match (a, b) {
        (Block::Free(None), Block::Free(None)) => Some(Block::Free(None)),
        (Block::Free(Some((s1, q1))), Block::Free(Some((s2, q2)))) if s1 == s2 => {
            Some(Block::Free(Some((s1, q1.max(q2)))))
        }
        _ => None,
    }
}

fn coalesce(chunk: &mut Chunk) {
    let mut merged: Vec<(u64, u64, Block)> = Vec::new();
    for (addr, (size, b)) in std::mem::take(&mut chunk.blocks) {
        if let Some(last) = merged.last_mut()
            && last.0 + last.1 == addr
            && let Some(j) = join(last.2, b)
        {
            last.1 += size;
            last.2 = j;
            continue;
        }
        merged.push((addr, size, b));
    }
    chunk.blocks = merged.into_iter().map(|(a, s, b)| (a, (s, b))).collect();
}

/// Whether every block of the chunk is free and every free has completed.
fn chunk_releasable(st: &State, chunk: &Chunk) -> bool {
    chunk.blocks.values().all(|(_, b)| match *b {
        Block::Used => false,
        Block::Free(None) => true,
        Block::Free(Some((s, q))) => done_through(&st.streams, s, q),
    })
}

fn release_chunk(st: &mut State, pool: &mut Pool, base: u64) {
    if let Some(chunk) = pool.chunks.remove(&base) {
        let dev = &mut st.devices[pool.device];
        dev.used -= chunk.size;
        dev.va.release(base);
        pool.reserved -= chunk.size;
    }
}

/// Releases entirely free chunks while the reservation stays at or above `keep`.
pub(crate) fn trim(st: &mut State, handle: u64, keep: u64) {
    settle(st, handle);
    let Some(mut pool) = st.pools.remove(&handle) else { return };
    // Largest chunks first: gives back the most with the fewest releases.
    let mut candidates: Vec<(u64, u64)> =
        pool.chunks.iter().filter(|(_, c)| chunk_releasable(st, c)).map(|(&b, c)| (c.size, b)).collect();
    candidates.sort_unstable_by(|a, b| b.cmp(a));
    for (size, base) in candidates {
        if pool.reserved > keep && pool.reserved - size >= keep {
            release_chunk(st, &mut pool, base);
        }
    }
    st.pools.insert(handle, pool);
}

/// The release-threshold trim every synchronisation call performs for the pools of `device`.
pub(crate) fn on_synchronize(st: &mut State, device: usize) {
    let handles: Vec<u64> = st.pools.iter().filter(|(_, p)| p.device == device).map(|(&h, _)| h).collect();
    for h in handles {
        let threshold = st.pools.get(&h).map_or(0, |p| p.release_threshold);
        trim(st, h, threshold);
    }
}

/// A usable block: `(chunk, block address, free to wait for)`.
type Found = (u64, u64, Option<(u64, u64)>);

/// Where a new allocation goes.
enum Placement {
    /// In an existing free block; `wait`: the stream must first wait for this free.
    Block { chunk: u64, addr: u64, wait: Option<(u64, u64)> },
    /// In a new chunk of this size.
    Grow(u64),
}

/// The first place for `need` bytes on stream `sid` in preference `pass`: 0 blocks freed on `sid`
/// itself, 1 any free bytes `sid` may use now, 2 a block whose free `sid` must first wait for.
/// Pass 1 takes a run of neighbouring blocks together when each is usable: a completed free loses
/// its stream tag (and so no longer merges with a pending free of the same stream), and the
/// placement must not depend on whether the engine has run the first of two frees yet.
fn find_block(st: &State, pool: &Pool, need: u64, sid: u64, pass: u8) -> Option<Found> {
    for (&cbase, chunk) in &pool.chunks {
        // (start, length) of the usable free bytes that end at the current block.
        let mut run: Option<(u64, u64)> = None;
        for (&addr, &(size, b)) in &chunk.blocks {
            let usable = match (pass, b) {
                (_, Block::Used) => false,
                (0, Block::Free(tag)) => tag.is_some_and(|(s, _)| s == sid),
                (1, Block::Free(None)) => true,
                (1, Block::Free(Some((s, q)))) => {
                    (pool.follow_event_deps && ordered_after(st, sid, s, q))
                        || (pool.opportunistic && done_through(&st.streams, s, q))
                }
                (_, Block::Free(Some((s, q)))) => {
                    if size >= need {
                        return Some((cbase, addr, (s != sid).then_some((s, q))));
                    }
                    false
                }
                (_, Block::Free(None)) => false,
            };
            if !usable {
                run = None;
                continue;
            }
            let start = match run {
                Some((s0, len)) if pass == 1 && s0 + len == addr => s0,
                _ => addr,
            };
            let len = addr + size - start;
            if len >= need {
                return Some((cbase, start, None));
            }
            run = Some((start, len));
        }
    }
    None
}

fn place(st: &State, pool: &Pool, need: u64, sid: u64) -> Result<Placement, Fail> {
    for pass in 0..2 {
        if let Some((chunk, addr, wait)) = find_block(st, pool, need, sid, pass) {
            return Ok(Placement::Block { chunk, addr, wait });
        }
    }
    let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let min = need.checked_next_multiple_of(CHUNK_ALIGN).ok_or_else(oom)?;
    let dev = &st.devices[pool.device];
    let room_dev = dev.total - dev.used;
    let room_pool = if pool.max_size == 0 { u64::MAX } else { pool.max_size.saturating_sub(pool.reserved) };
    let room = room_dev.min(room_pool);
    let size = if min.max(CHUNK) <= room { min.max(CHUNK) } else { min };
    if size <= room {
        return Ok(Placement::Grow(size));
    }
    if pool.internal_deps
        && let Some((chunk, addr, wait)) = find_block(st, pool, need, sid, 2)
    {
        return Ok(Placement::Block { chunk, addr, wait });
    }
    Err(oom())
}

/// Allocates `bytes` (> 0) from pool `handle` for stream `sid` (a resolved stream id); returns
/// the address. The allocation belongs to the stream's context.
pub(crate) fn allocate(st: &mut State, handle: u64, bytes: u64, sid: u64) -> Result<u64, Fail> {
    settle(st, handle);
    let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let need = bytes.checked_next_multiple_of(GRANULE).ok_or_else(oom)?;
    let mut pool = st.pools.remove(&handle).expect("caller checked the pool");
    let result = allocate_in(st, &mut pool, handle, bytes, need, sid);
    st.pools.insert(handle, pool);
    result
}

fn allocate_in(
    st: &mut State,
    pool: &mut Pool,
    handle: u64,
    bytes: u64,
    need: u64,
    sid: u64,
) -> Result<u64, Fail> {
    let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let (chunk_base, addr, wait) = match place(st, pool, need, sid)? {
        Placement::Block { chunk, addr, wait } => (chunk, addr, wait),
        Placement::Grow(size) => {
            let backing = Arc::new(usize::try_from(size).ok().and_then(Backing::new).ok_or_else(oom)?);
            let dev = &mut st.devices[pool.device];
            let base = dev.va.allocate(size, CHUNK_ALIGN).ok_or_else(oom)?;
            dev.used += size;
            pool.reserved += size;
            pool.reserved_high = pool.reserved_high.max(pool.reserved);
            let mut blocks = BTreeMap::new();
            blocks.insert(base, (size, Block::Free(None)));
            pool.chunks.insert(base, Chunk { size, backing, blocks });
            (base, base, None)
        }
    };
    let chunk = pool.chunks.get_mut(&chunk_base).expect("placement names a chunk");
    // The allocation's bytes are the chunk's bytes at its address: no fresh memory, no zeroing.
    let backing = Backing::view(&chunk.backing, (addr - chunk_base) as usize, bytes as usize)
        .expect("a block lies inside its chunk");
    // The placement may span neighbouring free blocks; the last one keeps its state for the
    // bytes left over.
    let mut at = addr;
    while at < addr + need {
        let (size, state) = chunk.blocks.remove(&at).expect("placement names free blocks");
        if at + size > addr + need {
            chunk.blocks.insert(addr + need, (at + size - addr - need, state));
        }
        at += size;
    }
    chunk.blocks.insert(addr, (need, Block::Used));
    if let Some(dep) = wait {
        // REUSE_ALLOW_INTERNAL_DEPENDENCIES: later work of this stream waits for the free.
        enqueue(st, sid, Work::Nop, vec![dep]);
    }
    pool.used += need;
    pool.used_high = pool.used_high.max(pool.used);
    let (device, ctx) = (pool.device as i32, st.streams[&sid].ctx);
    let buffer_id = st.next_buffer_id;
    st.next_buffer_id += 1;
    st.allocs.insert(
        addr,
        Arc::new(Allocation {
            kind: AllocKind::Pool,
            base: addr,
            bytes,
            charged: need,
            device,
            ctx,
            buffer_id,
            host_flags: 0,
            pool: handle,
            backing,
            freed: OnceLock::new(),
        }),
    );
    Ok(addr)
}

/// Returns the block of pool allocation `a` (already removed from the allocation table) to its
/// pool; `tag`: the stream-ordered free that releases it (`None`: usable by every stream now).
pub(crate) fn release_block(st: &mut State, a: &Allocation, tag: Option<(u64, u64)>) {
    let Some(pool) = st.pools.get_mut(&a.pool) else { return };
    if let Some(chunk) = pool.chunks.values_mut().find(|c| c.blocks.contains_key(&a.base))
        && let Some(entry) = chunk.blocks.get_mut(&a.base)
    {
        entry.1 = Block::Free(tag);
        pool.used -= entry.0;
        coalesce(chunk);
    }
    let h = a.pool;
    settle(st, h);
}
