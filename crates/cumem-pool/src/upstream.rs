//! What the caching pool draws on: an [`Upstream`] that hands out segments and an [`Ordering`] that
//! orders work between streams, plus host models of both for tests and benchmarks.
//!
//! The pool calls [`Upstream::allocate`] only when its cache cannot serve a request and
//! [`Upstream::deallocate`] only for a whole segment it got from `allocate`, and only after
//! [`Ordering::synchronize`] returned `Ok` following the last free of any block in that segment, so an
//! upstream may release memory at once (it need not be stream-ordered itself).
//!
//! ```
//! use cumem_pool::{HostUpstream, Upstream, UpstreamError};
//!
//! let up = HostUpstream::new(4 << 20);
//! let a = up.allocate(2 << 20).unwrap();
//! assert_eq!(a % cumem_pool::SEGMENT_ALIGN as u64, 0);
//! up.fail_call(1, UpstreamError::OutOfMemory); // the next call (index 1) fails
//! assert_eq!(up.allocate(512), Err(UpstreamError::OutOfMemory));
//! assert_eq!(up.allocate(4 << 20), Err(UpstreamError::OutOfMemory)); // over capacity
//! // SAFETY: `a` is the model's allocation of 2 MiB, given back once; nothing uses it.
//! unsafe { up.deallocate(a, 2 << 20) };
//! assert_eq!(up.live_bytes(), 0);
//! assert!(up.violations().is_empty());
//! ```

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

use parking_lot::Mutex;

use crate::{SEGMENT_ALIGN, UpstreamError};

/// Where segments come from: later any cumem memory resource on a device, in tests a host model.
///
/// Contract the pool relies on:
/// 1. `allocate` returns an address aligned to at least [`SEGMENT_ALIGN`] (512 B; `cuMemAlloc` gives
///    more), valid for `bytes` bytes, and distinct from every live allocation, on which no work of
///    any stream is queued or running (the pool hands it to any stream, and lets threads that
///    compare insert counters take it without a wait). A misaligned address is given back and
///    reported as [`PoolError::MisalignedSegment`](crate::PoolError::MisalignedSegment).
/// 2. `allocate` reports exhaustion as [`UpstreamError::OutOfMemory`] (or the driver's out-of-memory
///    error inside [`UpstreamError::Driver`]); the pool then runs its
///    out-of-memory ladder. Any other error is returned to the caller as is.
/// 3. `deallocate(addr, bytes)` receives exactly an `(addr, bytes)` pair `allocate` returned. The pool
///    calls it only after [`Ordering::synchronize`] succeeded after every free in the segment, so no
///    stream still uses the memory.
///
/// [`deallocate`](Self::deallocate) is `unsafe`: a device upstream frees the memory at once, and
/// only its caller can know that nothing uses it any more (the pool reaches its upstream through
/// [`CachingPool::upstream`](crate::CachingPool::upstream), so a safe one would free the pool's
/// live segments from safe code):
///
/// ```compile_fail,E0133
/// # cumem_sys::testing::init();
/// use std::sync::Arc;
/// use cumem_core::{Device, DeviceBuffer, Stream};
/// use cumem_pool::{CachingResource, PoolConfig, Upstream};
/// let ctx = Device::get(0)?.context()?;
/// let stream = Stream::non_blocking(&ctx)?;
/// let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
/// let buf = DeviceBuffer::<u32>::from_slice_in(&pool, &stream, &[7; 1024])?;
/// let (base, len) = pool.pool().segments()[0];
/// pool.pool().upstream().deallocate(base, len as usize); // the live buffer's segment
/// # Ok::<(), cumem_core::Error>(())
/// ```
pub trait Upstream: Send + Sync {
    /// Allocates `bytes` bytes and returns the address.
    ///
    /// # Errors
    /// [`UpstreamError::OutOfMemory`] when exhausted, [`UpstreamError::Other`] otherwise.
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError>;
    /// Releases an allocation returned by [`allocate`](Self::allocate). It may free the memory at
    /// once: it does not wait for work queued on it.
    ///
    /// # Safety
    /// 1. `(addr, bytes)` is exactly a pair this upstream's [`allocate`](Self::allocate) returned
    ///    (`addr` for a request of `bytes`), not deallocated since: each allocation is given back
    ///    once, whole, with its own size.
    /// 2. No work of any stream that uses the memory is queued or running (for the pool: an
    ///    [`Ordering::synchronize`] succeeded after the last free of every block in it).
    /// 3. Nothing uses the memory afterwards: no buffer, block or view over it is left, since the
    ///    upstream may hand the same addresses out again.
    unsafe fn deallocate(&self, addr: u64, bytes: usize);
    /// The ordinal of the device the segments live on, which the pool's tracing spans name
    /// (`None`, the default, for host models).
    fn device(&self) -> Option<u64> {
        None
    }
    /// The virtual-memory operations of this upstream, when it has them: what the pool's
    /// [expandable segments](crate::expandable) grow by. `None` (the default): segments only.
    fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        None
    }
}

/// An upstream that reserves address space and maps physical memory into it chunk by chunk (CUDA's
/// virtual memory management): what the pool's [expandable segments](crate::expandable) are made of.
///
/// Contract the pool relies on:
/// 1. [`chunk_bytes`](Self::chunk_bytes) is a power of two, a multiple of [`SEGMENT_ALIGN`], and
///    never changes; every address and length below is a multiple of it.
/// 2. `reserve(bytes)` returns the base of `bytes` bytes of address space, aligned to a chunk, with
///    nothing mapped and distinct from every live reservation and allocation.
/// 3. `map(addr, bytes)` backs unmapped space inside one reservation with new physical memory that
///    every stream of the device may read and write at once (nothing queued uses it). Exhaustion is
///    [`UpstreamError::OutOfMemory`] (or the driver's out-of-memory error); on any error nothing of
///    the range stays mapped.
/// 4. `unmap(addr, bytes)` receives mapped chunks and frees their physical memory. The pool calls it
///    only after [`Ordering::synchronize`] succeeded after every free in the range. On an error the
///    chunks it did not unmap stay mapped (and usable); the pool passes one chunk at a time where it
///    must know which, and keeps a chunk that failed mapped and cached.
/// 5. `release(base, bytes)` receives exactly a reservation `reserve` returned, with nothing mapped.
/// 6. No method but `unmap`, nor the owning [`Upstream::expandable`], calls into the pool it
///    serves (allocates from it, frees into it, trims it, reads its statistics): the pool calls
///    them while holding its arena locks and its segment registry (`release` too, for a
///    reservation it could not use), so such a call would deadlock. `unmap`, synchronous in the
///    driver, runs with no lock of the pool held and may use the pool (an allocation from there
///    does not wait for the unmaps in flight, its caller's among them).
///
/// [`unmap`](Self::unmap) and [`release`](Self::release) are `unsafe`: the first frees physical
/// memory (nothing promises that work still queued on it finishes first), the second gives address space back
/// for `reserve` to hand out again, and only the caller can know that nothing uses either (the
/// pool's upstream is reachable through [`CachingPool::expandable`](crate::CachingPool::expandable)):
///
/// ```compile_fail,E0133
/// # cumem_sys::testing::init();
/// use std::sync::Arc;
/// use cumem_core::{Device, DeviceBuffer, Stream};
/// use cumem_pool::{CachingResource, PoolConfig};
/// let ctx = Device::get(0)?.context()?;
/// let stream = Stream::non_blocking(&ctx)?;
/// let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
/// let pool = Arc::new(CachingResource::with_driver(&ctx, config));
/// let buf = DeviceBuffer::<u32>::from_slice_in(&pool, &stream, &[7; 1024])?;
/// let up = pool.pool().expandable().unwrap();
/// up.unmap(buf.device_ptr(), up.chunk_bytes()); // the live buffer's chunk
/// # Ok::<(), cumem_core::Error>(())
/// ```
///
/// [`map`](Self::map) stays safe: it only adds memory to unmapped space of a reservation, which
/// nobody uses, and frees nothing. A call behind the pool's back makes a later `map` of the pool
/// over that space fail (mapping over mapped space is refused), an error the pool returns; the pool
/// hands out only memory it mapped itself, and unmaps only that (`DeviceExpandable` keeps a chunk
/// mapped behind its back until it is dropped).
pub trait ExpandableUpstream: Send + Sync {
    /// The mapping granularity in bytes: physical memory is mapped and unmapped in whole chunks.
    fn chunk_bytes(&self) -> usize;
    /// Bytes of address space each expandable segment reserves unless
    /// [`PoolConfig::expandable_reservation_bytes`](crate::PoolConfig::expandable_reservation_bytes)
    /// says otherwise: the most one segment can grow to (for a device, its memory size, as PyTorch does).
    fn reservation_bytes(&self) -> usize;
    /// Reserves `bytes` of address space and returns its base.
    ///
    /// # Errors
    /// [`UpstreamError::OutOfMemory`] when no address space is left, any other error as is.
    fn reserve(&self, bytes: usize) -> Result<u64, UpstreamError>;
    /// Maps new physical memory at `[addr, addr + bytes)`.
    ///
    /// # Errors
    /// [`UpstreamError::OutOfMemory`] when the memory is exhausted, any other error as is.
    fn map(&self, addr: u64, bytes: usize) -> Result<(), UpstreamError>;
    /// Unmaps `[addr, addr + bytes)` and frees its physical memory. Nothing promises that work
    /// still queued on it finishes first (the driver brief lists `cuMemUnmap` as synchronous, but
    /// it is not documented to wait for that work; an H100's waits for no unrelated stream, and the
    /// simulator reports work still queued over the chunks as a misuse).
    ///
    /// # Errors
    /// The driver's error when a chunk could not be unmapped: it stays mapped.
    ///
    /// # Safety
    /// 1. `[addr, addr + bytes)` is whole chunks inside one reservation of this upstream, each
    ///    mapped by its [`map`](Self::map) and not unmapped since.
    /// 2. No work of any stream that uses the range is queued or running (for the pool: an
    ///    [`Ordering::synchronize`] succeeded after the last free of every block in it).
    /// 3. Nothing uses the range afterwards (no block, buffer or view over it), unless it is
    ///    mapped again first; on an error, the chunks left mapped may be used again.
    unsafe fn unmap(&self, addr: u64, bytes: usize) -> Result<(), UpstreamError>;
    /// Frees a reservation with nothing mapped in it.
    ///
    /// # Safety
    /// 1. `(base, bytes)` is exactly a reservation this upstream's [`reserve`](Self::reserve)
    ///    returned, not released since.
    /// 2. Nothing is mapped in it (every chunk [`map`](Self::map) mapped there was unmapped).
    /// 3. Nobody uses its addresses afterwards (maps into it, or keeps a block there):
    ///    `reserve` may hand them out again.
    unsafe fn release(&self, base: u64, bytes: usize);
    /// Logs what the upstream noted during calls the pool made under its locks: the pool calls it
    /// with none of its locks held after each operation that may have called `reserve`, `map`,
    /// `unmap` or `release` (a tracing subscriber may read the pool's stats, which take those
    /// locks). An upstream may keep its warnings for this call instead of logging them inside
    /// those (`DeviceExpandable` does, in one list: another thread's call may log them). One that
    /// logs nothing needs nothing here (the default).
    fn log_deferred(&self) {}
    /// Gives up every chunk and reservation still held, neither unmapping nor freeing them: the
    /// pool calls it when it is dropped without a successful [`Ordering::synchronize`], so work
    /// may still be queued on that memory, and unmapping it (which the driver brief lists as
    /// synchronous, but which the pool never relies on to wait for that work) could fault it. The default holds nothing and does nothing.
    fn abandon(&self) {}
}

/// Stream-ordering operations the pool needs: later CUDA streams and events, in tests a model that
/// records which orderings were established.
///
/// An ordering may also *retire* streams, above all those the program dropped (no new work can be
/// queued on them; the ordering holds no stream alive to know it): the pool then moves their cached
/// memory under [`retired_stream`](Self::retired_stream), a stream name that stands for "after the
/// work of every retired stream", and forgets them. The defaults retire nothing (host models).
pub trait Ordering: Send + Sync {
    /// A stream handle. A key must never be reused for another stream, not even after the
    /// stream was dropped and retired: thread caches and arenas file freed blocks by key, and a
    /// thread cache may still hold blocks under a retired key, which a reused key would hand to
    /// the new stream without ordering it after the old one's work ([`StreamKey`](crate::stream_ordering::StreamKey)
    /// uses the driver-independent, never-reused stream id). `'static` because each thread
    /// keeps its caches of every pool in one list.
    type Stream: Copy + Eq + Hash + Send + Sync + Debug + 'static;
    /// Makes all work enqueued on `waiter` from now on wait for all work enqueued on `on` so far
    /// (event record on `on` + stream wait on `waiter`).
    ///
    /// The pool calls it with no lock of its own held, so `on` may have been
    /// [retired](Self::retire) since the pool read it: the wait must then still cover `on`'s work
    /// up to its retirement (as `wait(waiter, retired_stream)` does).
    ///
    /// # Errors
    /// Any failure of the underlying event or stream operation.
    fn wait(&self, waiter: Self::Stream, on: Self::Stream) -> Result<(), UpstreamError>;
    /// Blocks until all work enqueued so far on every stream the ordering knows (and every retired
    /// stream) is complete. Afterwards any cached memory is safe for any stream and for release.
    ///
    /// # Errors
    /// Any failure of the underlying synchronisation.
    fn synchronize(&self) -> Result<(), UpstreamError>;
    /// The name under which memory of retired streams is cached: `wait(t, retired)` orders `t`
    /// after all work of every stream retired so far. `None` (the default): this ordering never
    /// retires streams. Must not change over the ordering's life.
    fn retired_stream(&self) -> Option<Self::Stream> {
        None
    }
    /// Streams the program has dropped, which the ordering is willing to retire.
    fn orphans(&self) -> Vec<Self::Stream> {
        Vec::new()
    }
    /// Retires `stream` (one of [`orphans`](Self::orphans), or a live stream whose free the pool
    /// has no arena for): from now on `wait(t, retired_stream)` and
    /// [`synchronize`](Self::synchronize) also cover the work queued on `stream` so far. The
    /// ordering may then forget a dropped `stream`; a live one must stay usable, as the waiter or
    /// the waited-for stream of later calls ([`StreamOrdering`](crate::StreamOrdering) forgets a
    /// dropped stream and keeps a live one's tail). The pool calls it for orphans with every arena
    /// lock held, before it moves the stream's cached memory under the retired name: what it lets
    /// go of whose drop calls the driver or logs waits for [`drop_deferred`](Self::drop_deferred).
    ///
    /// # Errors
    /// Any failure of the underlying event operation; the stream is then kept.
    fn retire(&self, stream: Self::Stream) -> Result<(), UpstreamError> {
        let _ = stream;
        Ok(())
    }
    /// Drops what [`retire`](Self::retire) let go of but kept, since it runs under the pool's
    /// locks (for [`StreamOrdering`](crate::StreamOrdering): retired events known complete, whose
    /// destruction makes driver calls and may log, and the tails of forgotten streams). The pool
    /// calls it with no lock held after each sweep and after each `retire` of its own. Default:
    /// nothing.
    fn drop_deferred(&self) {}
}

impl<U: Upstream + ?Sized> Upstream for std::sync::Arc<U> {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        (**self).allocate(bytes)
    }
    unsafe fn deallocate(&self, addr: u64, bytes: usize) {
        // SAFETY: the caller keeps `deallocate`'s contract, which is the inner upstream's own.
        unsafe { (**self).deallocate(addr, bytes) }
    }
    fn device(&self) -> Option<u64> {
        (**self).device()
    }
    fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        (**self).expandable()
    }
}

impl<O: Ordering + ?Sized> Ordering for std::sync::Arc<O> {
    type Stream = O::Stream;
    fn wait(&self, waiter: Self::Stream, on: Self::Stream) -> Result<(), UpstreamError> {
        (**self).wait(waiter, on)
    }
    fn synchronize(&self) -> Result<(), UpstreamError> {
        (**self).synchronize()
    }
    fn retired_stream(&self) -> Option<Self::Stream> {
        (**self).retired_stream()
    }
    fn orphans(&self) -> Vec<Self::Stream> {
        (**self).orphans()
    }
    fn drop_deferred(&self) {
        (**self).drop_deferred()
    }
    fn retire(&self, stream: Self::Stream) -> Result<(), UpstreamError> {
        (**self).retire(stream)
    }
}

/// First address [`HostUpstream`] hands out (never 0, clearly not a host pointer).
pub const HOST_BASE: u64 = 0x7e00_0000_0000;

/// The chunk size of [`HostUpstream::new`]'s mappings: 2 MiB, an H100's granularity.
pub const HOST_CHUNK: usize = 2 << 20;

/// A host model of a device memory resource: a fake address space with a capacity.
///
/// Addresses are handed out by bumping a pointer (aligned to [`SEGMENT_ALIGN`], never reused), so
/// segments are often adjacent, which tests that the pool never coalesces across segments. Live bytes,
/// peaks and call counts are recorded; [`fail_call`](Self::fail_call) injects a failure into one call,
/// [`fail_unmap`](Self::fail_unmap) into one unmap;
/// a `deallocate` of anything that is not a live allocation is recorded as a violation.
///
/// It is also an [`ExpandableUpstream`]: reservations take address space only, mapped chunks count
/// against the capacity like allocations (in [`live_bytes`](Self::live_bytes), and as `(addr, len)`
/// runs in [`live`](Self::live)), a map is an allocation call (it can be made to fail) and an unmap
/// a deallocation. Mapping mapped or unreserved space, unmapping unmapped space and releasing a
/// reservation that still has mappings are violations (the driver refuses them too).
#[derive(Debug)]
pub struct HostUpstream {
    state: Mutex<HostState>,
}

#[derive(Debug)]
struct HostState {
    capacity: u64,
    next: u64,
    live: BTreeMap<u64, usize>,
    live_bytes: u64,
    peak_live_bytes: u64,
    calls: u64,
    allocations: u64,
    deallocations: u64,
    fail: Option<(u64, UpstreamError)>,
    unmaps: u64,
    fail_unmap: Option<(u64, UpstreamError)>,
    violations: Vec<String>,
    chunk: u64,
    /// Reservations by base: their length and the addresses of their mapped chunks.
    reservations: BTreeMap<u64, (u64, std::collections::BTreeSet<u64>)>,
    /// Bytes of address space that live reservations may take in all.
    address_space: u64,
}

impl HostUpstream {
    /// A model with `capacity` bytes.
    pub fn new(capacity: usize) -> HostUpstream {
        HostUpstream {
            state: Mutex::new(HostState {
                capacity: capacity as u64,
                next: HOST_BASE,
                live: BTreeMap::new(),
                live_bytes: 0,
                peak_live_bytes: 0,
                calls: 0,
                allocations: 0,
                deallocations: 0,
                fail: None,
                unmaps: 0,
                fail_unmap: None,
                violations: Vec::new(),
                chunk: HOST_CHUNK as u64,
                reservations: BTreeMap::new(),
                address_space: u64::MAX,
            }),
        }
    }

    /// A model with `capacity` bytes that maps memory in chunks of `chunk` bytes (a power of two, at
    /// least [`SEGMENT_ALIGN`]; [`new`](Self::new) uses [`HOST_CHUNK`]).
    pub fn with_chunk_bytes(capacity: usize, chunk: usize) -> HostUpstream {
        let up = HostUpstream::new(capacity);
        up.state.lock().chunk = chunk.max(SEGMENT_ALIGN).next_power_of_two() as u64;
        up
    }

    /// Makes `reserve` fail with [`UpstreamError::OutOfMemory`] (as the driver does when virtual
    /// addresses run out) where live reservations would take more than `bytes` in all.
    pub fn limit_address_space(&self, bytes: u64) {
        self.state.lock().address_space = bytes;
    }

    /// Live reservations as `(base, len, mapped bytes)`, in address order.
    pub fn reservations(&self) -> Vec<(u64, u64, u64)> {
        let s = self.state.lock();
        s.reservations.iter().map(|(&b, (l, m))| (b, *l, m.len() as u64 * s.chunk)).collect()
    }

    /// Makes the `allocate` call with index `call` (0-based, counting every call since creation) fail
    /// with `error`. Replaces any earlier injection.
    pub fn fail_call(&self, call: u64, error: UpstreamError) {
        self.state.lock().fail = Some((call, error));
    }

    /// Makes the `unmap` call with index `call` (0-based, counting every unmap since creation) fail
    /// with `error`, unmapping nothing. Replaces any earlier unmap injection.
    pub fn fail_unmap(&self, call: u64, error: UpstreamError) {
        self.state.lock().fail_unmap = Some((call, error));
    }

    /// Number of `unmap` calls so far, failed ones included.
    pub fn unmap_calls(&self) -> u64 {
        self.state.lock().unmaps
    }

    /// Number of `allocate` and `map` calls so far, failed ones included.
    pub fn allocate_calls(&self) -> u64 {
        self.state.lock().calls
    }

    /// Number of successful `allocate` and `map` calls.
    pub fn allocations(&self) -> u64 {
        self.state.lock().allocations
    }

    /// Number of `deallocate` calls that released a live allocation, and of valid `unmap` calls.
    pub fn deallocations(&self) -> u64 {
        self.state.lock().deallocations
    }

    /// Bytes currently allocated or mapped.
    pub fn live_bytes(&self) -> u64 {
        self.state.lock().live_bytes
    }

    /// The largest value [`live_bytes`](Self::live_bytes) has had.
    pub fn peak_live_bytes(&self) -> u64 {
        self.state.lock().peak_live_bytes
    }

    /// Sets [`peak_live_bytes`](Self::peak_live_bytes) to the current live bytes.
    pub fn reset_peak(&self) {
        let mut s = self.state.lock();
        s.peak_live_bytes = s.live_bytes;
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.state.lock().capacity
    }

    /// Current allocations and runs of contiguous mapped chunks of one reservation as
    /// `(addr, bytes)`, in address order.
    pub fn live(&self) -> Vec<(u64, usize)> {
        let s = self.state.lock();
        let mut out: Vec<(u64, usize)> = s.live.iter().map(|(&a, &l)| (a, l)).collect();
        for (_, chunks) in s.reservations.values() {
            let mut run: Option<(u64, u64)> = None;
            for &c in chunks {
                run = match run {
                    Some((a, l)) if a + l == c => Some((a, l + s.chunk)),
                    Some((a, l)) => {
                        out.push((a, l as usize));
                        Some((c, s.chunk))
                    }
                    None => Some((c, s.chunk)),
                };
            }
            out.extend(run.map(|(a, l)| (a, l as usize)));
        }
        out.sort_unstable();
        out
    }

    /// Invalid `deallocate`, `map`, `unmap` and `release` calls seen so far.
    pub fn violations(&self) -> Vec<String> {
        self.state.lock().violations.clone()
    }
}

impl Upstream for HostUpstream {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        let mut s = self.state.lock();
        s.call()?;
        let bytes = bytes as u64;
        if bytes == 0 || s.live_bytes.checked_add(bytes).is_none_or(|b| b > s.capacity) {
            return Err(UpstreamError::OutOfMemory);
        }
        let addr = s.next;
        let Some(next) =
            addr.checked_add(bytes).and_then(|e| e.checked_next_multiple_of(SEGMENT_ALIGN as u64))
        else {
            return Err(UpstreamError::OutOfMemory);
        };
        s.next = next;
        s.live.insert(addr, bytes as usize);
        s.live_bytes += bytes;
        s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes);
        s.allocations += 1;
        Ok(addr)
    }

    unsafe fn deallocate(&self, addr: u64, bytes: usize) {
        // A model: a call that breaks the contract is recorded as a violation, nothing is freed.
        let mut s = self.state.lock();
        match s.live.get(&addr) {
            Some(&len) if len == bytes => {
                s.live.remove(&addr);
                s.live_bytes -= bytes as u64;
                s.deallocations += 1;
            }
            Some(&len) => s.violations.push(format!("deallocate({addr:#x}, {bytes}): allocated {len} bytes")),
            None => s.violations.push(format!("deallocate({addr:#x}, {bytes}): not allocated")),
        }
    }

    fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        Some(self)
    }
}

impl HostState {
    /// Counts a call that may fail by injection (`allocate` and `map`); the injected error if so.
    fn call(&mut self) -> Result<(), UpstreamError> {
        let call = self.calls;
        self.calls += 1;
        match &self.fail {
            Some((n, e)) if *n == call => Err(e.clone()),
            _ => Ok(()),
        }
    }

    /// The reservation holding `[addr, addr + bytes)`, when the range is whole chunks inside one.
    fn reservation_of(&mut self, addr: u64, bytes: u64) -> Option<&mut std::collections::BTreeSet<u64>> {
        let chunk = self.chunk;
        if bytes == 0 || !addr.is_multiple_of(chunk) || !bytes.is_multiple_of(chunk) {
            return None;
        }
        let (&base, (len, chunks)) = self.reservations.range_mut(..=addr).next_back()?;
        (addr.checked_add(bytes)? <= base + *len).then_some(chunks)
    }
}

impl ExpandableUpstream for HostUpstream {
    fn chunk_bytes(&self) -> usize {
        self.state.lock().chunk as usize
    }

    fn reservation_bytes(&self) -> usize {
        let s = self.state.lock();
        s.capacity.next_multiple_of(s.chunk).max(s.chunk) as usize
    }

    fn reserve(&self, bytes: usize) -> Result<u64, UpstreamError> {
        let mut s = self.state.lock();
        let chunk = s.chunk;
        let bytes = bytes as u64;
        let reserved: u64 = s.reservations.values().map(|r| r.0).sum();
        if reserved.checked_add(bytes).is_none_or(|r| r > s.address_space) {
            return Err(UpstreamError::OutOfMemory);
        }
        let Some(base) = s.next.checked_next_multiple_of(chunk) else {
            return Err(UpstreamError::OutOfMemory);
        };
        let Some(next) = base.checked_add(bytes).filter(|_| bytes > 0 && bytes.is_multiple_of(chunk)) else {
            return Err(UpstreamError::OutOfMemory);
        };
        s.next = next;
        s.reservations.insert(base, (bytes, Default::default()));
        Ok(base)
    }

    fn map(&self, addr: u64, bytes: usize) -> Result<(), UpstreamError> {
        let mut s = self.state.lock();
        s.call()?;
        let (bytes, chunk) = (bytes as u64, s.chunk);
        if s.live_bytes.checked_add(bytes).is_none_or(|b| b > s.capacity) {
            return Err(UpstreamError::OutOfMemory);
        }
        let Some(chunks) = s.reservation_of(addr, bytes) else {
            s.violations.push(format!("map({addr:#x}, {bytes}): not whole chunks of one reservation"));
            return Err(UpstreamError::Other(1));
        };
        if chunks.range(addr..addr + bytes).next().is_some() {
            s.violations.push(format!("map({addr:#x}, {bytes}): over mapped space"));
            return Err(UpstreamError::Other(1));
        }
        chunks.extend((addr..addr + bytes).step_by(chunk as usize));
        s.live_bytes += bytes;
        s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes);
        s.allocations += 1;
        Ok(())
    }

    unsafe fn unmap(&self, addr: u64, bytes: usize) -> Result<(), UpstreamError> {
        // A model: a call that breaks the contract is recorded as a violation, nothing is freed.
        let mut s = self.state.lock();
        let call = s.unmaps;
        s.unmaps += 1;
        if let Some((n, e)) = &s.fail_unmap
            && *n == call
        {
            return Err(e.clone());
        }
        let (bytes, chunk) = (bytes as u64, s.chunk);
        let valid = s.reservation_of(addr, bytes).is_some_and(|chunks| {
            let all = (addr..addr + bytes).step_by(chunk as usize).all(|c| chunks.contains(&c));
            if all {
                chunks.retain(|&c| c < addr || c >= addr + bytes);
            }
            all
        });
        if valid {
            s.live_bytes -= bytes;
            s.deallocations += 1;
        } else {
            s.violations.push(format!("unmap({addr:#x}, {bytes}): not mapped chunks of one reservation"));
        }
        Ok(())
    }

    unsafe fn release(&self, base: u64, bytes: usize) {
        // A model: a call that breaks the contract is recorded as a violation, nothing is freed.
        let mut s = self.state.lock();
        match s.reservations.get(&base) {
            Some((len, chunks)) if *len == bytes as u64 && chunks.is_empty() => {
                s.reservations.remove(&base);
            }
            Some((len, chunks)) => {
                let v =
                    format!("release({base:#x}, {bytes}): reserved {len}, {} chunks mapped", chunks.len());
                s.violations.push(v);
            }
            None => s.violations.push(format!("release({base:#x}, {bytes}): not reserved")),
        }
    }
}

/// A host model of stream ordering: streams are `u32`s and operations only count themselves.
#[derive(Debug, Default)]
pub struct HostOrdering {
    waits: AtomicU64,
    syncs: AtomicU64,
}

impl HostOrdering {
    /// A new model with zero counts.
    pub fn new() -> HostOrdering {
        HostOrdering::default()
    }
    /// Number of `wait` calls so far.
    pub fn waits(&self) -> u64 {
        self.waits.load(AtomicOrdering::Relaxed)
    }
    /// Number of `synchronize` calls so far.
    pub fn synchronizations(&self) -> u64 {
        self.syncs.load(AtomicOrdering::Relaxed)
    }
}

impl Ordering for HostOrdering {
    type Stream = u32;
    fn wait(&self, _waiter: u32, _on: u32) -> Result<(), UpstreamError> {
        self.waits.fetch_add(1, AtomicOrdering::Relaxed);
        Ok(())
    }
    fn synchronize(&self) -> Result<(), UpstreamError> {
        self.syncs.fetch_add(1, AtomicOrdering::Relaxed);
        Ok(())
    }
}
