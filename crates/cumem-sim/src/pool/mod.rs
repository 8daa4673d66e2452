//! Stream-ordered memory pools (`cuMemAllocAsync`, `cuMemPool*`).
//!
//! A pool reserves *chunks* of device address space, charged against the device's capacity (so
//! `cuMemGetInfo` sees reservations as used): 32 MiB, or the request rounded up to a multiple of
//! 32 MiB if that is larger, each aligned to 32 MiB; only when the device's free capacity cannot
//! hold that, the request rounded up to 2 MiB (not measured). `maxSize` is rounded up to a multiple
//! of 32 MiB (an H100, 2026-11-23: a 4 MiB `maxSize` held 3+3 MiB in one 32 MiB reservation, a
//! 40 MiB one 30+30 MiB in 64 MiB). A chunk is partitioned into blocks; allocations are rounded up
//! to 512 bytes. `MAPPING_BASE_ADDR`/`MAPPING_SIZE` of a pool address are the 32 MiB-aligned
//! 32 MiB piece of its chunk holding it (see [`mapping`]); the H100 packs a large allocation
//! across neighbouring 32 MiB chunks, the simulator gives it a chunk of its own.
//!
//! ```text
//! cuMemAllocAsync(p, 4096, S)  ->  allocate: place() picks a free block S may use, the free map
//!                                  carves 4096 bytes from it, an Allocation views those bytes
//! cuMemFreeAsync(p, S)         ->  free_async: Work::Free queued on S as operation `seq`; the
//!                                  block becomes Free(Some((S, seq))) in the free map
//! ... the engine runs S's queue ... the next call on the pool settles it: Free(None)
//! ```
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
//! Placement, in order of preference: the smallest block T itself freed that fits (rule 1); the
//! smallest block T may use now that fits (rules 1–3), the allocation starting at the lowest
//! address of the run of usable free blocks that block ends (so a region freed in two steps is
//! reused whole whether or not the engine has run the first free yet); a run of usable blocks of
//! different classes that only fits together; a new chunk; rule 4. The [`free_map`] answers each
//! of these in O(log n).
//!
//! At `cuStreamSynchronize` / `cuEventSynchronize` / `cuCtxSynchronize` every pool of the
//! device releases chunks that are entirely free (all frees complete) while the reservation stays
//! at or above its RELEASE_THRESHOLD; `cuMemPoolTrimTo` does the same with `minBytesToKeep`.

mod admin;
pub(crate) mod free_map;
pub(crate) mod shared;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUresult;

pub(crate) use self::admin::*;
use self::free_map::{Block, FreeMap};
use crate::api::Fail;
use crate::copy::Work;
use crate::memory::{AllocKind, Allocation, Backing};
use crate::state::State;
use crate::stream::{StreamKind, done_through, enqueue};

/// Allocation granule inside a pool.
pub(crate) const GRANULE: u64 = 512;
/// The driver's reservation granule: chunk sizes and `maxSize` are multiples of it, chunks and
/// imported pointers are aligned to it, and it is the `MAPPING_SIZE` of a pool address.
pub(crate) const CHUNK: u64 = 32 << 20;
/// Granule of the smaller chunk taken when the device cannot hold a whole one.
pub(crate) const SMALL_CHUNK_GRANULE: u64 = 2 << 20;

/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub(crate) const PROT_READWRITE: u32 = 3;

/// One reservation of a pool.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub(crate) size: u64,
    /// Where the chunk lies in its exportable pool's memory file (0 for other pools).
    pub(crate) file_offset: u64,
    /// The chunk's memory; every allocation in the chunk is a view of it (queued work that holds
    /// such a view keeps it mapped after the chunk is released).
    pub(crate) backing: Arc<Backing>,
}

/// A memory pool.
#[derive(Debug)]
pub(crate) struct Pool {
    pub(crate) device: usize,
    pub(crate) is_default: bool,
    /// Destroyed by the program while allocations were outstanding: the handle is dead, the
    /// memory goes away when the last allocation has been freed.
    pub(crate) destroyed: bool,
    /// 0 = no limit but the device's capacity; else the `maxSize` asked for rounded up to a
    /// multiple of [`CHUNK`].
    pub(crate) max_size: u64,
    pub(crate) follow_event_deps: bool,
    pub(crate) opportunistic: bool,
    pub(crate) internal_deps: bool,
    pub(crate) release_threshold: u64,
    pub(crate) reserved: u64,
    pub(crate) reserved_high: u64,
    pub(crate) used: u64,
    pub(crate) used_high: u64,
    /// Chunk base -> chunk.
    pub(crate) chunks: BTreeMap<u64, Chunk>,
    /// Every block of every chunk.
    pub(crate) free: FreeMap,
    /// Access flags of devices other than the owner (absent = PROT_NONE).
    pub(crate) access: BTreeMap<usize, u32>,
    /// The memory file of a pool created with POSIX_FD handle types, or imported from one
    /// (`None` for every other pool: their chunks stay anonymous memory).
    pub(crate) shared: Option<Box<shared::SharedPool>>,
}

impl Pool {
    /// A pool with the driver's default attributes, reserving at most `max_size` (0: no limit)
    /// rounded up to a multiple of [`CHUNK`].
    pub(crate) fn new(device: usize, is_default: bool, max_size: u64) -> Self {
        Self {
            device,
            is_default,
            destroyed: false,
            max_size: max_size.checked_next_multiple_of(CHUNK).unwrap_or(u64::MAX),
            follow_event_deps: true,
            opportunistic: true,
            internal_deps: true,
            release_threshold: 0,
            reserved: 0,
            reserved_high: 0,
            used: 0,
            used_high: 0,
            chunks: BTreeMap::new(),
            free: FreeMap::default(),
            access: BTreeMap::new(),
            shared: None,
        }
    }

    /// The access flags `device` has on the pool's memory.
    pub(crate) fn access_of(&self, device: usize) -> u32 {
        if device == self.device { PROT_READWRITE } else { self.access.get(&device).copied().unwrap_or(0) }
    }
}

/// The highest operation of stream `f` that work enqueued on stream `t` from now on is ordered
/// after (`u64::MAX`: all of them, by being the same stream or through the legacy stream's
/// implicit synchronisation; 0: none). A destroyed, drained `f` orders what `t` recorded
/// waiting for.
pub(crate) fn ordered_through(st: &State, t: u64, f: u64) -> u64 {
    if t == f {
        return u64::MAX;
    }
    let Some(ts) = st.streams.get(&t) else { return 0 };
    let Some(fs) = st.streams.get(&f) else {
        return ts.waits.get(&f).copied().unwrap_or(0);
    };
    let implicit = ts.ctx == fs.ctx
        && ((ts.kind == StreamKind::Legacy && fs.kind != StreamKind::Legacy && fs.blocking())
            || (fs.kind == StreamKind::Legacy && ts.kind != StreamKind::Legacy && ts.blocking()));
    if implicit { u64::MAX } else { ts.waits.get(&f).copied().unwrap_or(0) }
}

/// Whether work enqueued on stream `t` from now on is ordered after operation `seq` of stream
/// `f` (same stream, a recorded dependency, or the legacy stream's implicit synchronisation).
pub(crate) fn ordered_after(st: &State, t: u64, f: u64, seq: u64) -> bool {
    ordered_through(st, t, f) >= seq
}

/// Drops the tags of completed frees when the pool reuses opportunistically (each stream's
/// completed frees, oldest first: no rescan of the pool), and lets a destroyed pool go once
/// nothing of it is in use any more.
pub(crate) fn settle(st: &mut State, handle: u64) {
    let Some(pool) = st.pools.get_mut(&handle) else { return };
    let streams = &st.streams;
    if pool.opportunistic {
        pool.free.settle(|s, q| done_through(streams, s, q));
    }
    if pool.destroyed
        && pool.used == 0
        && !shared::has_imports(pool)
        && pool.free.all_done(|s, q| done_through(streams, s, q))
    {
        let mut pool = st.pools.remove(&handle).expect("looked up above");
        let bases: Vec<u64> = pool.chunks.keys().copied().collect();
        for base in bases {
            release_chunk(st, &mut pool, base);
        }
    }
}

fn release_chunk(st: &mut State, pool: &mut Pool, base: u64) {
    if let Some(chunk) = pool.chunks.remove(&base) {
        if let Some(shared) = &pool.shared {
            shared.release(chunk.file_offset, chunk.size);
        }
        pool.free.remove_chunk(base);
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
    let mut candidates: Vec<(u64, u64)> = pool
        .free
        .chunks()
        .filter(|&(b, _)| pool.free.chunk_releasable(b, |s, q| done_through(&st.streams, s, q)))
        .map(|(b, size)| (size, b))
        .collect();
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

/// Where a new allocation goes.
enum Placement {
    /// At `addr`, in free blocks; `wait`: the stream must first wait for this free.
    Blocks { addr: u64, wait: Option<(u64, u64)> },
    /// In a new chunk of this size.
    Grow(u64),
}

/// Where `need` bytes go for stream `sid`, in the order of preference the module documentation
/// gives.
fn place(st: &State, pool: &Pool, need: u64, sid: u64) -> Result<Placement, Fail> {
    let free = &pool.free;
    if let Some((_, addr, _)) = free.smallest_pending(sid, need, u64::MAX) {
        return Ok(Placement::Blocks { addr, wait: None });
    }
    // After `settle`, a pending block is one whose free has not completed (or the pool does not
    // reuse opportunistically): only a dependency makes it usable.
    let usable = |b: Block| match b {
        Block::Used => false,
        Block::Free(None) => true,
        Block::Free(Some((s, q))) => pool.follow_event_deps && ordered_after(st, sid, s, q),
    };
    let mut best = free.smallest_settled(need);
    if pool.follow_event_deps {
        for s in free.pending_streams() {
            let through = ordered_through(st, sid, s);
            if through > 0
                && let Some((size, addr, _)) = free.smallest_pending(s, need, through)
                && best.is_none_or(|b| (size, addr) < b)
            {
                best = Some((size, addr));
            }
        }
    }
    let found = match best {
        Some((_, addr)) => Some(free.run_start(addr, usable)),
        None => free.run_across_seams(need, usable),
    };
    if let Some(addr) = found {
        return Ok(Placement::Blocks { addr, wait: None });
    }
    let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let whole = need.checked_next_multiple_of(CHUNK).ok_or_else(oom)?;
    let small = need.checked_next_multiple_of(SMALL_CHUNK_GRANULE).ok_or_else(oom)?;
    let dev = &st.devices[pool.device];
    let room_dev = dev.total - dev.used;
    let room_pool = if pool.max_size == 0 { u64::MAX } else { pool.max_size.saturating_sub(pool.reserved) };
    if whole <= room_dev.min(room_pool) {
        return Ok(Placement::Grow(whole));
    }
    // Only the device's capacity may shrink a chunk: `maxSize` counts whole chunks.
    if whole <= room_pool && small <= room_dev {
        return Ok(Placement::Grow(small));
    }
    if pool.internal_deps {
        let mut best: Option<(u64, u64, u64, u64)> = None;
        for s in free.pending_streams() {
            if let Some((size, addr, q)) = free.smallest_pending(s, need, u64::MAX)
                && best.is_none_or(|b| (size, addr) < (b.0, b.1))
            {
                best = Some((size, addr, s, q));
            }
        }
        if let Some((_, addr, s, q)) = best {
            return Ok(Placement::Blocks { addr, wait: (s != sid).then_some((s, q)) });
        }
    }
    Err(oom())
}

/// `(base, size)` of the chunk of its pool that holds pool allocation `a`, if the pool still
/// has it.
fn chunk_of(st: &State, a: &Allocation) -> Option<(u64, u64)> {
    let pool = st.pools.get(&a.pool)?;
    let (&base, chunk) = pool.chunks.range(..=a.base).next_back()?;
    (a.base < base + chunk.size).then_some((base, chunk.size))
}

/// `MAPPING_BASE_ADDR` / `MAPPING_SIZE` of address `ptr` in pool allocation or imported pool
/// pointer `a`: the 32 MiB-aligned 32 MiB piece holding `ptr`, whatever the allocation's size, as
/// an H100 answered for every pool (with or without handle types or `maxSize`) and for an
/// imported pointer (whose address was 32 MiB aligned), 2026-11-23, asked at allocation starts
/// only (interior addresses follow the same rule here, unmeasured). A smaller chunk (the device
/// had no room for 32 MiB) is its own mapping (unmeasured).
pub(crate) fn mapping(st: &State, a: &Allocation, ptr: u64) -> (u64, u64) {
    let window = ptr & !(CHUNK - 1);
    let (lo, hi) = match a.kind {
        AllocKind::Pool => chunk_of(st, a).map_or((a.base, a.base + a.bytes), |(b, s)| (b, b + s)),
        // An import reserves whole 32 MiB pieces from its 32 MiB-aligned base.
        _ => (a.base, a.base + a.bytes.next_multiple_of(CHUNK)),
    };
    let base = window.max(lo);
    (base, (window + CHUNK).min(hi) - base)
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
    let (addr, wait) = match place(st, pool, need, sid)? {
        Placement::Blocks { addr, wait } => (addr, wait),
        Placement::Grow(size) => {
            let len = usize::try_from(size).map_err(|_| oom())?;
            let (backing, file_offset) = match &mut pool.shared {
                None => (Backing::new(len), 0),
                Some(shared) => shared.grow(size).map_or((None, 0), |(b, off)| (Some(b), off)),
            };
            let backing = Arc::new(backing.ok_or_else(oom)?);
            let dev = &mut st.devices[pool.device];
            let base = dev.va.allocate(size, CHUNK).ok_or_else(oom)?;
            dev.used += size;
            pool.reserved += size;
            pool.reserved_high = pool.reserved_high.max(pool.reserved);
            pool.chunks.insert(base, Chunk { size, file_offset, backing });
            pool.free.add_chunk(base, size);
            (base, None)
        }
    };
    let (&chunk_base, chunk) = pool.chunks.range(..=addr).next_back().expect("placement lies in a chunk");
    // The allocation's bytes are the chunk's bytes at its address: no fresh memory, no zeroing.
    let backing = Backing::view(&chunk.backing, (addr - chunk_base) as usize, bytes as usize)
        .expect("a block lies inside its chunk");
    pool.free.carve(addr, need);
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
    crate::order::placed(st, buffer_id, addr, sid);
    Ok(addr)
}

/// Returns the block of pool allocation `a` (already removed from the allocation table) to its
/// pool; `tag`: the stream-ordered free that releases it (`None`: usable by every stream now).
pub(crate) fn release_block(st: &mut State, a: &Allocation, tag: Option<(u64, u64)>) {
    let Some(pool) = st.pools.get_mut(&a.pool) else { return };
    if pool.shared.is_some() {
        shared::report_live_imports(pool, a.base);
    }
    if let Some(size) = pool.free.release(a.base, tag) {
        pool.used -= size;
    }
    settle(st, a.pool);
}

/// `cuMemAllocAsync` (`pool: None`: the current pool of the stream's device) and
/// `cuMemAllocFromPoolAsync` for the resolved stream `sid`: the address (0 for 0 bytes).
pub(crate) fn allocate_async(st: &mut State, pool: Option<u64>, bytes: u64, sid: u64) -> Result<u64, Fail> {
    let handle = match pool {
        Some(p) => lookup(st, p)?,
        None => {
            let d = st.streams[&sid].device;
            supported(st, d)?;
            st.devices[d].current_pool
        }
    };
    let p = &st.pools[&handle];
    supported(st, p.device)?;
    if p.shared.as_ref().is_some_and(|s| s.imported) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("pool {handle:#x} was imported from another process: import pointers, do not allocate"),
        ));
    }
    if bytes == 0 { Ok(0) } else { allocate(st, handle, bytes, sid) }
}

/// `cuMemFreeAsync(dptr, sid)` for a non-zero `dptr` and the resolved stream `sid`.
pub(crate) fn free_async(st: &mut State, dptr: u64, sid: u64) -> Result<(), Fail> {
    let a = match st.find_alloc(dptr) {
        Some(a) if a.base == dptr && matches!(a.kind, AllocKind::Pool | AllocKind::PoolImport) => a.clone(),
        Some(a) if a.base != dptr => {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("{dptr:#x} is an interior pointer of the allocation at {:#x}", a.base),
            ));
        }
        Some(a) => {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!(
                    "{dptr:#x} is {} memory, not a stream-ordered (pool) allocation",
                    a.kind.report_name()
                ),
            ));
        }
        None => {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("{dptr:#x} is not a live allocation (double free or never allocated)"),
            ));
        }
    };
    let seq = enqueue(st, sid, Work::Free { alloc: a.clone() }, Vec::new());
    st.allocs.remove(&dptr);
    st.forget(&a, Some((sid, seq)));
    Ok(())
}
