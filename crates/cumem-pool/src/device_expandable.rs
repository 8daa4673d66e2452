//! The caching pool's [expandable segments](crate::expandable) on a device, made of cumem-vmm's
//! reservations, physical memory and mappings.
//!
//! Each chunk is its own `cuMemCreate` allocation of the device's recommended granularity (2 MiB
//! on an H100), mapped read-write for the device and for every device that can access it as a peer
//! (`cuCtxEnablePeerAccess` does not cover mapped memory; PyTorch grants the same), so any whole
//! chunk can be unmapped on its own; the physical handle is released right after mapping, so `cuMemUnmap` frees the memory. By default
//! each segment reserves the device's memory size of address space, as PyTorch does. The memory comes
//! from the device directly, not from the resource the pool takes segments from. A failed `map`
//! unmaps what it mapped; a chunk whose unmap fails then is kept and unmapped again before anything
//! is mapped over it, so the driver's mappings and the pool's agree where the pool grows.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, DeviceBuffer, Stream};
//! use cumem_pool::{CachingResource, PoolConfig};
//! use std::sync::Arc;
//! let ctx = Device::get(0)?.context()?;
//! if ctx.device().capabilities()?.virtual_memory {
//!     let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
//!     let pool = Arc::new(CachingResource::with_driver(&ctx, config));
//!     assert!(pool.pool().expandable().is_some());
//!     let stream = Stream::non_blocking(&ctx)?;
//!     let a = DeviceBuffer::<u8>::zeroed_in(&pool, &stream, 5 << 19)?; // 2.5 MiB: maps 2 chunks
//!     let b = DeviceBuffer::<u8>::zeroed_in(&pool, &stream, 5 << 18)?; // 1.25 MiB: the free tail
//!     assert_eq!(b.device_ptr(), a.device_ptr() + (5 << 19));
//!     assert_eq!(pool.stats().reserved_bytes, 4 << 20);
//!     drop((a, b));
//!     assert_eq!(pool.trim()?.released_bytes, 4 << 20);
//! }
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;

use cumem_core::{Context, Device, Result};
use cumem_vmm::{Access, Granularity, PhysicalMemory, ReserveOptions, SharedMapping, VirtualRange};
use parking_lot::Mutex;

use crate::{ExpandableUpstream, SEGMENT_ALIGN, UpstreamError};

/// Expandable-segment operations on one device.
pub struct DeviceExpandable {
    ctx: Context,
    chunk: usize,
    reservation: usize,
    /// The device's memory: the most one `map` can ever get.
    device_bytes: usize,
    /// The device and its peers, read-write: every mapping's access list.
    access: Vec<(Device, Access)>,
    state: Mutex<State>,
    /// What `map`, `unmap` and `release` noted, for [`log_deferred`]: the pool calls them under
    /// its locks, where a warning's subscriber that reads the pool's stats would wait for its own
    /// thread. A leaf lock: held only to push or to take the lot.
    ///
    /// [`log_deferred`]: ExpandableUpstream::log_deferred
    deferred: Mutex<Vec<Deferred>>,
}

/// A warning noted under the pool's locks, logged by `log_deferred` once it has let go of them.
enum Deferred {
    MapOutside { addr: u64, bytes: usize },
    UndoUnmapFailed { at: u64, error: cumem_core::Error },
    UnmapNotAllMapped { addr: u64, bytes: usize, mapped: usize },
    StrayUnmapFailed { base: u64, error: cumem_core::Error },
    ReleaseUnknown { base: u64, bytes: usize },
    ReleaseStillMapped { base: u64, bytes: usize },
    PhysicalReleaseFailed { handle: u64, bytes: usize, error: cumem_core::Error },
    FreeFailed { base: u64, size: usize, error: cumem_core::Error },
}

impl Deferred {
    fn log(self) {
        match self {
            Deferred::MapOutside { addr, bytes } => {
                tracing::warn!(addr, bytes, "mapping outside every reservation of this upstream; refused")
            }
            Deferred::UndoUnmapFailed { at, error } => {
                tracing::warn!(at, error = %error, "undoing a failed map: unmap failed; retried later")
            }
            Deferred::UnmapNotAllMapped { addr, bytes, mapped } => {
                tracing::warn!(addr, bytes, mapped, "unmapping space that is not all mapped")
            }
            Deferred::StrayUnmapFailed { base, error } => tracing::warn!(
                base,
                error = %error,
                "unmapping a stray chunk failed; unmapped when the upstream drops"
            ),
            Deferred::ReleaseUnknown { base, bytes } => {
                tracing::warn!(base, bytes, "releasing a reservation this upstream did not make; ignored")
            }
            Deferred::ReleaseStillMapped { base, bytes } => tracing::warn!(
                base,
                bytes,
                "releasing a reservation with chunks still mapped; freed when they are"
            ),
            // A chunk's physical memory whose release failed (`map_chunk`), a released reservation
            // whose free failed: the messages of `PhysicalMemory`'s and `VirtualRange`'s own drops,
            // whose warnings these are, deferred (the pool holds its locks where they are made).
            Deferred::PhysicalReleaseFailed { handle, bytes, error } => {
                tracing::warn!(handle, bytes, error = %error, "cuMemRelease failed; the memory is leaked")
            }
            Deferred::FreeFailed { base, size, error } => tracing::warn!(
                base,
                size,
                error = %error,
                "cuMemAddressFree failed; the reservation is leaked"
            ),
        }
    }
}

#[derive(Default)]
struct State {
    /// Reservations by base address.
    ranges: BTreeMap<u64, Arc<VirtualRange>>,
    /// Mapped chunks by address; dropping one unmaps it.
    chunks: BTreeMap<u64, SharedMapping>,
    /// Chunks of a failed `map` whose rollback could not unmap them: still mapped in the driver,
    /// unmapped in the pool's books. Unmapped again before anything is mapped over them (mapping
    /// over a mapped chunk is refused) and before their reservation goes; never handed out.
    stray: BTreeMap<u64, SharedMapping>,
}

impl DeviceExpandable {
    /// The operations for `ctx`'s device.
    ///
    /// # Errors
    /// `NotSupported { feature: VirtualMemory }` on a device without virtual memory management;
    /// a driver error reading its granularity or memory size.
    pub fn new(ctx: &Context) -> Result<DeviceExpandable> {
        let granularity = Granularity::of(ctx.device())?;
        // The pool needs 512-byte aligned chunks; every real granularity is far coarser.
        let chunk = granularity.recommended.max(SEGMENT_ALIGN).next_power_of_two();
        let device_bytes = ctx.device().total_memory()?;
        let reservation = device_bytes.next_multiple_of(chunk).max(chunk);
        let own = ctx.device();
        let mut access = vec![(own, Access::ReadWrite)];
        for d in Device::all()? {
            // A device without virtual memory management cannot be granted access to a mapping.
            if d != own && d.capabilities()?.virtual_memory && d.can_access_peer(own)? {
                access.push((d, Access::ReadWrite));
            }
        }
        Ok(DeviceExpandable {
            ctx: ctx.clone(),
            chunk,
            reservation,
            device_bytes,
            access,
            state: Mutex::default(),
            deferred: Mutex::default(),
        })
    }

    fn defer(&self, note: Deferred) {
        self.deferred.lock().push(note);
    }

    /// Maps one chunk of new physical memory at `offset` of `range` and pushes it onto `made`, then
    /// makes it read-write for the device and its peers. A mapping whose access fails stays in
    /// `made`, for the caller to unmap where it sees the result.
    fn map_chunk(
        &self,
        range: &Arc<VirtualRange>,
        offset: usize,
        made: &mut Vec<(u64, SharedMapping)>,
    ) -> Result<()> {
        let memory = PhysicalMemory::new(&self.ctx, self.chunk)?;
        let mapped = range.map_shared(offset, &memory);
        // Released now, mapped or not: a mapping keeps the physical memory until it is unmapped.
        // Explicitly, for a failure to be noted rather than logged under the pool's locks.
        let (handle, bytes) = (memory.raw(), memory.bytes());
        if let Err(error) = memory.release() {
            self.defer(Deferred::PhysicalReleaseFailed { handle, bytes, error });
        }
        made.push((range.base() + offset as u64, mapped?));
        match made.last_mut() {
            Some((_, mapping)) => mapping.set_access(&self.access),
            None => Ok(()),
        }
    }

    /// Unmaps the stray chunks in `[lo, hi)` (see [`State::stray`]); a failure keeps that chunk.
    fn unmap_strays(s: &mut State, lo: u64, hi: u64) -> Result<()> {
        let at: Vec<u64> = s.stray.range(lo..hi).map(|(&a, _)| a).collect();
        for a in at {
            if let Some(mapping) = s.stray.remove(&a)
                && let Err((mapping, e)) = mapping.unmap()
            {
                s.stray.insert(a, mapping);
                return Err(e);
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for DeviceExpandable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("DeviceExpandable")
            .field("device", &self.ctx.device().ordinal())
            .field("chunk", &self.chunk)
            .field("reservations", &s.ranges.len())
            .field("mapped_chunks", &s.chunks.len())
            .field("stray_chunks", &s.stray.len())
            .finish()
    }
}

impl ExpandableUpstream for DeviceExpandable {
    fn chunk_bytes(&self) -> usize {
        self.chunk
    }

    fn reservation_bytes(&self) -> usize {
        self.reservation
    }

    fn reserve(&self, bytes: usize) -> std::result::Result<u64, UpstreamError> {
        let options = ReserveOptions::default().alignment(self.chunk);
        let range = VirtualRange::reserve_with(&self.ctx, bytes, options).map_err(UpstreamError::Driver)?;
        let base = range.base();
        self.state.lock().ranges.insert(base, Arc::new(range));
        Ok(base)
    }

    fn map(&self, addr: u64, bytes: usize) -> std::result::Result<(), UpstreamError> {
        // No more than the device's memory can ever be mapped at once, and finding out chunk by
        // chunk would create (and undo) one physical allocation per chunk of the device first.
        if bytes > self.device_bytes {
            return Err(UpstreamError::OutOfMemory);
        }
        let mut s = self.state.lock();
        // The whole range inside one reservation: `map` is safe, so a range past its end (or
        // past the end of the address space) is an error, not an overflow or a panic.
        let inside = s.ranges.range(..=addr).next_back().and_then(|(&base, range)| {
            let end = addr.checked_add(bytes as u64)?;
            (end <= base.checked_add(range.size() as u64)?).then(|| (base, end, range.clone()))
        });
        let Some((base, end, range)) = inside else {
            drop(s);
            self.defer(Deferred::MapOutside { addr, bytes });
            return Err(UpstreamError::Other(0));
        };
        // Nothing is mapped here in the pool's books; a stray chunk is, in the driver's.
        Self::unmap_strays(&mut s, addr, end).map_err(UpstreamError::Driver)?;
        let mut made = Vec::with_capacity(bytes / self.chunk);
        for offset in (0..bytes).step_by(self.chunk) {
            let at = (addr - base) as usize + offset;
            if let Err(error) = self.map_chunk(&range, at, &mut made) {
                // What this call mapped is unmapped again (contract item 3); a chunk whose
                // unmap fails is kept as a stray rather than dropped, where a second failure
                // would only be logged and the driver would keep a chunk the pool counts as
                // unmapped, refusing the next map there.
                let mut failed = Vec::new();
                while let Some((at, mapping)) = made.pop() {
                    if let Err((mapping, e)) = mapping.unmap() {
                        failed.push(Deferred::UndoUnmapFailed { at, error: e });
                        s.stray.insert(at, mapping);
                    }
                }
                drop(s);
                failed.into_iter().for_each(|note| self.defer(note));
                return Err(UpstreamError::Driver(error));
            }
        }
        s.chunks.extend(made);
        Ok(())
    }

    unsafe fn unmap(&self, addr: u64, bytes: usize) -> std::result::Result<(), UpstreamError> {
        let mut above = {
            let mut s = self.state.lock();
            let mut above = s.chunks.split_off(&addr);
            let mut rest = above.split_off(&(addr + bytes as u64));
            s.chunks.append(&mut rest);
            above
        };
        if above.len() * self.chunk != bytes {
            self.defer(Deferred::UnmapNotAllMapped { addr, bytes, mapped: above.len() * self.chunk });
        }
        // From the top down, so that after a failure what is left mapped is the bottom of the range.
        // The caller vouches that no work uses the range and nothing will (the pool synchronised
        // after every free in it): the mappings' own stream orders know nothing of the pool's
        // blocks, so their unmap waits for nothing that matters here. With the state let go:
        // `cuMemUnmap` is synchronous (driver brief §9), and another thread's growth maps
        // meanwhile; the pool neither maps over these chunks nor releases their reservation until
        // this returns.
        while let Some((at, mapping)) = above.pop_last() {
            if let Err((mapping, e)) = mapping.unmap() {
                // Kept, not dropped: a dropped mapping would try again and only log; the pool keeps
                // this chunk cached and mapped in its books, so it must stay mapped here too.
                above.insert(at, mapping);
                self.state.lock().chunks.append(&mut above);
                return Err(UpstreamError::Driver(e));
            }
        }
        Ok(())
    }

    unsafe fn release(&self, base: u64, bytes: usize) {
        let mut s = self.state.lock();
        // The caller vouches that nothing uses the reservation (the pool synchronised); strays
        // never were handed out.
        if let Err(error) = Self::unmap_strays(&mut s, base, base.saturating_add(bytes as u64)) {
            self.defer(Deferred::StrayUnmapFailed { base, error });
        }
        let Some(range) = s.ranges.remove(&base) else {
            drop(s);
            self.defer(Deferred::ReleaseUnknown { base, bytes });
            return;
        };
        drop(s);
        // Freed now, not deferred: the out-of-memory ladder reserves again right after releasing,
        // under the same locks, and may need these addresses. A failure is noted, not logged:
        // the pool holds its locks here.
        match Arc::into_inner(range) {
            Some(range) => {
                let size = range.size();
                if let Err(error) = range.free() {
                    self.defer(Deferred::FreeFailed { base, size, error });
                }
            }
            // A mapping (a chunk that failed to unmap) holds the range: the last one to go frees it.
            None => self.defer(Deferred::ReleaseStillMapped { base, bytes }),
        }
    }

    fn log_deferred(&self) {
        let notes = std::mem::take(&mut *self.deferred.lock());
        notes.into_iter().for_each(Deferred::log);
    }

    fn abandon(&self) {
        let State { ranges, chunks, stray } = std::mem::take(&mut *self.state.lock());
        if ranges.is_empty() && chunks.is_empty() && stray.is_empty() {
            return;
        }
        tracing::warn!(
            reservations = ranges.len(),
            mapped_bytes = chunks.len() * self.chunk,
            "expandable segments abandoned with work possibly queued on them; leaking them"
        );
        // Forgotten, not dropped: a dropped mapping unmaps at once, under whatever still runs.
        std::mem::forget(chunks);
        std::mem::forget(stray);
        std::mem::forget(ranges);
    }
}
