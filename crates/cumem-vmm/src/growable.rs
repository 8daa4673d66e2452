//! `GrowableBuffer<T>`: a device array that grows in place, so its address never changes.
//!
//! A `Vec` that outgrows its allocation moves to a bigger one, and every pointer into it dies. A
//! `GrowableBuffer` reserves a large stretch of addresses once ([`GrowableConfig::reserve_bytes`],
//! by default twice the device's memory, which costs no memory) and maps physical chunks at its
//! end as it grows; [`GrowableBuffer::shrink_to_fit`] unmaps whole chunks from the end and gives
//! their memory back to the device. Pointers handed to kernels stay valid across growth. Growing
//! past the reservation is an error ([`Error::LimitExceeded`]) and never a silent move.
//!
//! Device work is ordered like a [`DeviceBuffer`](cumem_core::DeviceBuffer)'s: every view shares
//! the buffer's [`StreamOrder`], fills are queued on the stream the buffer was created on without
//! the call waiting for them (one exception, a change of a value of many different words: see
//! [`GrowableBuffer::resize`]), and chunks are unmapped (by `shrink_to_fit` and the drop) only
//! after the work that uses the buffer has completed.
//!
//! Other devices can be given read-write access with [`GrowableConfig::accessible_from`]: every
//! chunk gets it as it is mapped, the first ones and those mapped by later growth alike, so a peer
//! never finds the new end of the buffer inaccessible. A device that cannot reach the buffer's
//! memory is refused when the buffer is created, before anything is reserved or mapped. A peer's
//! own device work (a kernel on its stream) goes through [`GrowableBuffer::on_peer`] /
//! [`GrowableBuffer::on_peer_mut`], so that `shrink_to_fit` and the drop wait for it too.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, PinnedBuffer, Stream};
//! use cumem_vmm::GrowableBuffer;
//! let ctx = Device::get(0)?.context()?;
//! if ctx.device().capabilities()?.virtual_memory {
//!     let stream = Stream::non_blocking(&ctx)?;
//!     let mut buf = GrowableBuffer::<u64>::with_capacity(&stream, 1000)?;
//!     assert!(buf.capacity() >= 1000 && buf.is_empty());
//!     let host = PinnedBuffer::from_slice(&ctx, &[5u64; 1000])?;
//!     buf.extend_from_host(&stream, &host)?;   // queued on `stream`
//!     buf.resize(3000, 9)?;                     // grows; the new values are filled on the device
//!     assert_eq!(buf.slice(998..1002)?.to_vec()?, [5, 5, 9, 9]);
//!     buf.truncate(10);
//!     buf.shrink_to_fit()?;                     // unmaps every chunk past the first
//!     assert_eq!(buf.mapped_bytes(), buf.chunk_bytes());
//! }
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::{NoUninit, Zeroable};
use cumem_core::sys::CUdeviceptr;
use cumem_core::{
    AsDeviceSlice, AsDeviceSliceMut, Context, Device, DeviceSlice, DeviceSliceMut, Error, ErrorContext,
    HostMemory, OnStream, OnStreamMut, PinnedBuffer, Result, Stream, StreamOrder, blocking_host_copy,
};

use crate::ffi::{self, Fill};
use crate::{Access, Granularity, PhysicalMemory, ReserveOptions, SharedMapping, VirtualRange};

/// How much address space a [`GrowableBuffer`] reserves, the size of the chunks it maps, and which
/// other devices may access them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GrowableConfig {
    /// Bytes of address space to reserve (non-zero; rounded up to whole chunks): the most the
    /// buffer can ever hold. `None`: [`GrowableConfig::DEFAULT_RESERVE_MULTIPLE`] times the device's memory.
    pub reserve_bytes: Option<usize>,
    /// Bytes mapped at a time, a multiple of the minimum granularity. `None`: the recommended
    /// granularity (2 MiB on current GPUs).
    pub chunk_bytes: Option<usize>,
    /// Devices besides the buffer's own that get read-write access to every chunk (repeats and
    /// the buffer's own device are ignored). Each must be able to access the buffer's device's
    /// memory (`cuDeviceCanAccessPeer`); VMM memory needs no `cuCtxEnablePeerAccess`.
    pub accessible_from: Vec<Device>,
}

impl GrowableConfig {
    /// The default reservation, in multiples of the device's total memory: room to grow past
    /// anything the device could back, while costing nothing but address space.
    pub const DEFAULT_RESERVE_MULTIPLE: usize = 2;

    /// Reserves `bytes` of address space.
    pub fn reserve_bytes(mut self, bytes: usize) -> Self {
        self.reserve_bytes = Some(bytes);
        self
    }

    /// Maps chunks of `bytes`.
    pub fn chunk_bytes(mut self, bytes: usize) -> Self {
        self.chunk_bytes = Some(bytes);
        self
    }

    /// Gives `devices` read-write access to every chunk, as well as the buffer's own device.
    pub fn accessible_from(mut self, devices: &[Device]) -> Self {
        self.accessible_from.extend_from_slice(devices);
        self
    }
}

/// An owning array of `T` in device memory whose address never changes while it grows.
///
/// Like a [`DeviceBuffer`](cumem_core::DeviceBuffer), it starts ordered on the stream it is made
/// on: dropping it, or [`shrink_to_fit`](GrowableBuffer::shrink_to_fit), synchronises the streams
/// that used it as wholes, that stream included even when nothing used the buffer, so work queued
/// there before the buffer or unrelated to it is waited for too. Make it on a stream whose work
/// does not wait on the dropping thread.
pub struct GrowableBuffer<T> {
    range: Arc<VirtualRange>,
    /// The mapped chunks, in address order from the start of the range.
    chunks: Vec<SharedMapping>,
    chunk_bytes: usize,
    /// The access every chunk gets when it is mapped: the own device first, then the peers.
    access: Vec<(Device, Access)>,
    len: usize,
    ctx: Context,
    /// Where fills are queued: the stream the buffer was created on.
    stream: Stream,
    order: StreamOrder,
    /// Page-locked memory for the bytes of one value, from which a fill of a value of many
    /// different words copies the first (see [`stage`]); allocated by the first such fill. Bytes,
    /// not a `T`: page-locked memory is aligned to a page only, and `T` may be aligned to more.
    /// Its own drop waits for the copies that read it before freeing it; the buffer's drop takes
    /// it first (see `Drop`).
    staging: Option<PinnedBuffer<u8>>,
    _marker: PhantomData<T>,
}

impl<T> GrowableBuffer<T> {
    /// An empty buffer on `stream`'s device, with the default reservation and nothing mapped.
    pub fn new(stream: &Stream) -> Result<Self> {
        GrowableBuffer::with_config(stream, 0, GrowableConfig::default())
    }

    /// An empty buffer with room for at least `capacity` values mapped already.
    pub fn with_capacity(stream: &Stream, capacity: usize) -> Result<Self> {
        GrowableBuffer::with_config(stream, capacity, GrowableConfig::default())
    }

    /// An empty buffer with room for `capacity` values, reserving and mapping as `config` says.
    ///
    /// Refused before any VMM call: a device without VMM (`NotSupported { feature: VirtualMemory
    /// }`), a zero-sized `T` or chunk (`ZeroSize`), a chunk size that is not a multiple of the
    /// granularity (`Misaligned`), a capacity beyond the reservation (`LimitExceeded`), a device
    /// in [`GrowableConfig::accessible_from`] without VMM or that cannot access this device's
    /// memory (`NotSupported { feature: VirtualMemory | PeerAccess, device }`).
    ///
    /// A `T` aligned to more than the granularity gets a reservation whose base is aligned to
    /// `align_of::<T>()` ([`ReserveOptions::alignment`]); a base the driver placed otherwise is
    /// `Misaligned` (and nothing stays reserved).
    pub fn with_config(stream: &Stream, capacity: usize, config: GrowableConfig) -> Result<Self> {
        let ctx = stream.context().clone();
        let granularity = Granularity::of(ctx.device())?;
        let owner = ctx.device();
        let mut access = vec![(owner, Access::ReadWrite)];
        for &device in &config.accessible_from {
            crate::access::require_reach(device, owner)?;
            if access.iter().all(|&(d, _)| d != device) {
                access.push((device, Access::ReadWrite));
            }
        }
        if size_of::<T>() == 0 {
            return Err(Error::ZeroSize { what: "element size" });
        }
        let chunk_bytes = config.chunk_bytes.unwrap_or(granularity.recommended);
        if chunk_bytes == 0 {
            return Err(Error::ZeroSize { what: "chunk size" });
        }
        granularity.check("chunk size", chunk_bytes as u64)?;
        let reserve = match config.reserve_bytes {
            Some(0) => return Err(Error::ZeroSize { what: "reservation size" }),
            Some(bytes) => bytes,
            None => ctx.device().total_memory()?.saturating_mul(GrowableConfig::DEFAULT_RESERVE_MULTIPLE),
        };
        let reserve = reserve
            .max(1)
            .checked_next_multiple_of(chunk_bytes)
            .ok_or(Error::SizeOverflow { count: reserve, elem_size: 1 })?;
        let wanted = bytes_for::<T>(capacity)?;
        if wanted > reserve {
            return Err(beyond_reservation(reserve));
        }
        let range = Arc::new(VirtualRange::reserve_with(&ctx, reserve, reserve_options::<T>(&granularity))?);
        // Every value lies at the base plus whole values, so the views are aligned for T exactly
        // when the base is; the driver's word on the alignment asked for is checked, not trusted.
        let align = align_of::<T>() as u64;
        if !range.base().is_multiple_of(align) {
            return Err(Error::Misaligned {
                what: "GrowableBuffer reservation base",
                value: range.base(),
                align,
            });
        }
        let mut buf = GrowableBuffer {
            range,
            chunks: Vec::new(),
            chunk_bytes,
            access,
            len: 0,
            ctx,
            stream: stream.clone(),
            order: StreamOrder::new(stream),
            staging: None,
            _marker: PhantomData,
        };
        buf.map_up_to(wanted)?;
        Ok(buf)
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size of the values in bytes.
    pub fn bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// How many values fit in the mapped memory.
    pub fn capacity(&self) -> usize {
        self.mapped_bytes() / size_of::<T>()
    }

    /// The most values the buffer can ever hold: its whole reservation mapped.
    pub fn max_capacity(&self) -> usize {
        self.range.size() / size_of::<T>()
    }

    /// Bytes of device memory mapped (whole chunks).
    pub fn mapped_bytes(&self) -> usize {
        self.chunks.len() * self.chunk_bytes
    }

    /// Bytes of each chunk.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// The device address of the first value: the start of the reservation, which never changes.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.range.base()
    }

    /// The reservation the buffer grows in.
    pub fn range(&self) -> &VirtualRange {
        &self.range
    }

    /// The context of the memory.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The stream the buffer was created on, where fills are queued.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The devices that every chunk gives access to, and their access: the buffer's own device
    /// first, then those of [`GrowableConfig::accessible_from`].
    pub fn access(&self) -> &[(Device, Access)] {
        &self.access
    }

    /// The stream-order tracker that every view shares.
    pub fn order(&self) -> &StreamOrder {
        &self.order
    }

    /// Makes room for at least `additional` more values, mapping chunks at the end.
    /// `LimitExceeded` if that would pass the reservation (nothing is mapped then). If a chunk
    /// fails part-way (creating, mapping or granting access to it: the driver's error, such as
    /// `OutOfMemory`, is returned), the chunks mapped before it stay mapped, `len` is unchanged, and
    /// the failed chunk is released (a mapping whose access could not be set is unmapped when it
    /// drops), so a later call can grow again from there.
    pub fn reserve(&mut self, additional: usize) -> Result<()> {
        let wanted = self
            .len
            .checked_add(additional)
            .ok_or(Error::SizeOverflow { count: usize::MAX, elem_size: size_of::<T>() })?;
        self.map_up_to(bytes_for::<T>(wanted)?)
    }

    /// Maps chunks until at least `bytes` are mapped.
    fn map_up_to(&mut self, bytes: usize) -> Result<()> {
        if bytes > self.range.size() {
            return Err(beyond_reservation(self.range.size()));
        }
        while self.mapped_bytes() < bytes {
            let memory = PhysicalMemory::new(&self.ctx, self.chunk_bytes)?;
            let mut mapping = self.range.map_shared(self.mapped_bytes(), &memory)?;
            // The mapping holds the memory from now on; it is freed when the chunk is unmapped.
            drop(memory);
            // Every chunk, including those growth maps later, or a peer faults at the new end. On
            // failure the mapping drops here, unmapped: no chunk stays mapped without access.
            mapping.set_access(&self.access)?;
            self.chunks.push(mapping);
        }
        Ok(())
    }

    /// Shortens the buffer to `len` values (no effect if it is not longer); the memory stays mapped.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Removes every value; the memory stays mapped.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Unmaps every whole chunk past the values and returns its memory to the device, after the
    /// device work that uses the buffer has completed (its streams synchronised as wholes, see
    /// [`GrowableBuffer`]). Should the driver refuse an unmap, the error
    /// is returned and that chunk and those before it stay mapped (and counted in `mapped_bytes`).
    pub fn shrink_to_fit(&mut self) -> Result<()> {
        let keep = self.bytes().div_ceil(self.chunk_bytes);
        if self.chunks.len() <= keep {
            return Ok(());
        }
        // Work queued through any view may still touch the chunks about to go.
        self.order.join_mut()?.synchronize()?;
        while self.chunks.len() > keep {
            let Some(chunk) = self.chunks.pop() else { break };
            // The driver frees the memory with its last mapping.
            if let Err((chunk, e)) = chunk.unmap() {
                // Still mapped: keep it, so that `mapped_bytes` and later unmaps stay true.
                self.chunks.push(chunk);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Resizes to `new_len` values; new ones are set to `value` by work queued on the buffer's
    /// stream after the buffer's earlier work (on whatever stream it was queued).
    ///
    /// A value whose bytes repeat every 1, 2 or 4 bytes (zero, `u8`/`u16`/`u32` values, …) is
    /// one memset. Any other is written once, by a memset per run of equal 4-byte words (2- or
    /// 1-byte for a size that is no multiple of 4), then doubled: each device-to-device copy
    /// duplicates the values set so far, so `n` new values take about `log2(n)` copies and the
    /// host holds none of them. A value that needs more than 16 of those memsets is instead
    /// written by one copy queued from page-locked staging memory that holds its bytes; the
    /// doubling follows as above. The buffer allocates that memory (`size_of::<T>()` bytes, one
    /// `cuMemHostAlloc`) with the first such fill and keeps it, page-locked, until its drop, which
    /// frees it; a type of any alignment is staged alike.
    ///
    /// The call does not wait for the device, with one exception: a fill of such a value that
    /// differs from the one staged rewrites the staging memory, and first waits for the copies
    /// queued from it by synchronising the buffer's stream, that is for all the work queued on
    /// that stream so far and what that work waits for: the buffer's earlier work on other
    /// streams, and through the legacy stream's implicit order, for a buffer on the legacy stream
    /// the earlier work of the context's blocking streams, for one on a blocking stream the
    /// legacy stream's earlier work. Do not change such a value while one of those streams waits
    /// for the calling thread: that deadlocks. No fill queues work on another stream or the
    /// legacy stream, so none waits for other streams' work through stream order; whether the
    /// first such fill's `cuMemHostAlloc`, or the mapping of new chunks (`cuMemCreate`,
    /// `cuMemMap`, `cuMemSetAccess`), waits by itself for a stream that a host function holds is
    /// unmeasured (`docs/vmm.md`, "To verify on a GPU").
    ///
    /// Inside a [`StreamOrder::queue_on`] closure a fill is `NotPermitted`, as device work on cumem
    /// memory is there, whatever the value (the value staged already too); `len` is then unchanged
    /// and the chunks mapped to grow stay mapped.
    pub fn resize(&mut self, new_len: usize, value: T) -> Result<()>
    where
        T: NoUninit,
    {
        if new_len <= self.len {
            self.truncate(new_len);
            return Ok(());
        }
        self.reserve(new_len - self.len)?;
        self.fill_tail(new_len, value)?;
        self.len = new_len;
        Ok(())
    }

    /// Resizes to `new_len` values; new ones are zeroed by a memset queued on the buffer's stream.
    pub fn resize_zeroed(&mut self, new_len: usize) -> Result<()>
    where
        T: NoUninit + Zeroable,
    {
        self.resize(new_len, T::zeroed())
    }

    /// Sets `[len, new_len)` (mapped already) to `value`, queued on the buffer's stream. A value
    /// whose bytes repeat with a width the driver fills (1, 2 or 4 bytes) is one memset. Any other
    /// is written once, then doubled (see [`doubling`]), so the host holds no more than the one
    /// value however many are set. The first value takes a memset per run of equal words, or,
    /// past [`SEED_MEMSETS`] of them, one copy queued from the staging memory (see [`stage`]).
    fn fill_tail(&mut self, new_len: usize, value: T) -> Result<()>
    where
        T: NoUninit,
    {
        let count = new_len - self.len;
        let bytes = bytemuck::bytes_of(&value);
        let whole = memset_for(bytes, count);
        let memsets = if whole.is_some() { None } else { seed_memsets(bytes) };
        let ptr = self.device_ptr() + self.bytes() as u64;
        let stream = self.stream.clone();
        // Staged before the guard is taken: rewriting the staging memory may wait.
        let staged = match (&whole, &memsets) {
            (None, None) => Some(stage(&mut self.staging, &self.ctx, bytes)?),
            _ => None,
        };
        // SAFETY: `[len, new_len)` is mapped, read-write for this device, aligned for T (the base
        // is, checked by `with_config`, plus whole values) and exclusively ours (`&mut self`); the
        // view is ordered through `order`. Its old bytes are not read before the memsets and
        // copies below overwrite them with valid values of T: each copy reads only values that
        // were written before it on the stream.
        let mut tail = unsafe { DeviceSliceMut::<T>::from_raw_parts(ptr, count, &self.order, &self.ctx) };
        let on = tail.on(&stream)?;
        self.ctx.bind()?;
        let to = on.device_ptr();
        if let Some((fill, n)) = whole {
            // SAFETY: the range is the guard's, ordered on `stream`; every byte written is a
            // byte of `value`, at its own offset in each value, so each value becomes `value`.
            return unsafe { ffi::memset_async(to, fill, n, stream.raw()) };
        }
        let size = size_of::<T>();
        if let Some(staging) = staged {
            let enqueue = |from: *const u8, _| {
                // SAFETY: `from` is the staging memory, page-locked and holding the `size` bytes
                // of `value`, which its tracker keeps alive and unwritten until the copy
                // completes; `[to, to + size)` is the first value of the guard's range, ordered
                // on `stream`. The copy moves bytes, so the staging memory's alignment is moot.
                unsafe { ffi::htod_async(to, from.cast(), size, stream.raw()) }
            };
            // SAFETY: `enqueue` queues one copy on `stream` that reads `size` bytes, the staging
            // memory's length.
            unsafe { HostMemory::device_read(staging, &stream, enqueue)? };
        }
        for (offset, fill, n) in memsets.unwrap_or_default() {
            // SAFETY: `[offset, offset + n * width)` lies in the first value of the guard's range,
            // ordered on `stream`. It is aligned to the width: the width divides the value's size,
            // so it divides `offset` and the value's address (the granularity-aligned base plus
            // whole values). Each word written is the value's own at that offset, so the first
            // value becomes `value`.
            unsafe { ffi::memset_async(to + offset as u64, fill, n, stream.raw())? };
        }
        for (n, done) in doubling(count) {
            // SAFETY: source `[0, n)` and destination `[done, done + n)` (in values) lie in the
            // guard's range (`done + n ≤ count`), ordered on `stream`, and do not overlap (`n ≤
            // done`); the source holds `value` in each place, written earlier on `stream` (the
            // first value above, the others by the earlier copies, which covered `[1, done)`).
            // `doubling`'s unit test checks those bounds for many counts.
            unsafe { ffi::dtod_async(to + (done * size) as u64, to, n * size, stream.raw())? };
        }
        Ok(())
    }

    /// Copies `src` into the mapped values right after the last one, blocking until it is done.
    fn copy_into_tail(&mut self, src: &[T]) -> Result<()>
    where
        T: NoUninit,
    {
        let ptr = self.device_ptr() + self.bytes() as u64;
        let legacy = Stream::legacy(&self.ctx);
        // SAFETY: as in `fill_tail`: mapped, accessible, aligned and exclusively ours; the old
        // bytes are only overwritten.
        let mut tail = unsafe { DeviceSliceMut::<T>::from_raw_parts(ptr, src.len(), &self.order, &self.ctx) };
        let on = tail.on(&legacy)?;
        blocking_host_copy(&self.ctx, src.as_ptr().cast(), || {
            // SAFETY: `src` holds `len` initialised values (NoUninit) and outlives the call; the
            // destination is the guard's range of the same size, ordered on the legacy stream.
            unsafe { ffi::htod(on.device_ptr(), src.as_ptr().cast(), on.bytes()) }
        })
    }

    /// Appends a copy of `src`, growing as needed; returns once `src` may be reused.
    ///
    /// `src` is pageable memory, so this is a blocking copy on the legacy stream
    /// (`cuMemcpyHtoD`): it waits for the buffer's earlier work and, as everything on the legacy
    /// stream does, for the work already queued on the context's blocking streams (a blocking
    /// stream held by a host function that waits for this thread deadlocks it). To queue the copy
    /// on a stream instead, copy from page-locked memory with
    /// [`extend_from_host`](Self::extend_from_host).
    pub fn extend_from_slice(&mut self, src: &[T]) -> Result<()>
    where
        T: NoUninit,
    {
        if src.is_empty() {
            return Ok(());
        }
        self.reserve(src.len())?;
        self.copy_into_tail(src)?;
        self.len += src.len();
        Ok(())
    }

    /// Appends a copy of page-locked host memory, growing as needed; the copy is queued on `stream`
    /// (a stream of the buffer's device: `WrongDevice` otherwise), ordered after the buffer's
    /// earlier work, and `src` stays unwritable by the host until it completes.
    pub fn extend_from_host(&mut self, stream: &Stream, src: &impl HostMemory<T>) -> Result<()>
    where
        T: NoUninit,
    {
        if stream.context() != &self.ctx {
            return Err(Error::WrongDevice {
                expected: self.ctx.device().raw(),
                actual: stream.context().device().raw(),
            });
        }
        let count = src.len();
        if count == 0 {
            return Ok(());
        }
        self.reserve(count)?;
        let ptr = self.device_ptr() + self.bytes() as u64;
        // SAFETY: as in `fill_tail`; the copy overwrites the old bytes with valid values of T.
        let mut tail = unsafe { DeviceSliceMut::<T>::from_raw_parts(ptr, count, &self.order, &self.ctx) };
        let on = tail.on(stream)?;
        self.ctx.bind()?;
        let (to, bytes) = (on.device_ptr(), on.bytes());
        let enqueue = |from: *const T, _| {
            // SAFETY: `from` is page-locked memory of `bytes` bytes that the host kind keeps alive
            // and unwritten until the copy completes; `to` is ours, ordered on `stream`.
            unsafe { ffi::htod_async(to, from.cast(), bytes, stream.raw()) }
        };
        // SAFETY: `enqueue` queues one copy on `stream` reading exactly `count` values.
        unsafe { src.device_read(stream, enqueue)? };
        drop(on);
        self.len += count;
        Ok(())
    }

    /// A shared view of the values.
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        // SAFETY: `[base, base + bytes)` is mapped (len ≤ capacity), read-write for the buffer's
        // device, aligned for T (`with_config` checked the base), holds `len` values of T
        // written through fills and copies, and stays mapped while the view borrows `self`
        // (unmapping needs `&mut self`); all device work goes through `order`.
        unsafe { DeviceSlice::from_raw_parts(self.device_ptr(), self.len, &self.order, &self.ctx) }
    }

    /// An exclusive view of the values.
    pub fn as_mut_slice(&mut self) -> DeviceSliceMut<'_, T> {
        // SAFETY: as in `as_slice`; the view borrows `self` exclusively.
        unsafe { DeviceSliceMut::from_raw_parts(self.device_ptr(), self.len, &self.order, &self.ctx) }
    }

    cumem_core::device_view_methods!();

    /// The values on `stream`, a stream of a device in [`GrowableBuffer::access`] (the buffer's own
    /// or a peer of [`GrowableConfig::accessible_from`]), for device work there that only reads
    /// them: the door for a peer's kernel, which [`GrowableBuffer::on`] refuses (`WrongDevice`).
    ///
    /// The bookkeeping is `on`'s: the peer's stream waits (an event wait, legal across devices) for
    /// the buffer's earlier work, and once the guard drops, everything later — other streams, host
    /// reads, [`GrowableBuffer::shrink_to_fit`] and the drop, which unmap — waits for the work
    /// queued on it meanwhile. A stream of a device without access: `NotPermitted`, before any
    /// driver call.
    pub fn on_peer<'s>(&'s self, stream: &'s Stream) -> Result<OnStream<'s, T>> {
        self.check_access(stream)?;
        // SAFETY: as in `as_slice` (mapped, aligned, initialised values, ordered through `order`,
        // unmapped only with `&mut self`), except for the context: the view names `stream`'s,
        // whose device has read-write access to every chunk (`check_access`; `map_up_to` gives
        // every chunk the access of each listed device). The view lives only for `on`, which uses
        // its context to check the stream's device and nothing else; the guard it returns holds
        // the address, the length and the ticket of `order`.
        let view = unsafe {
            DeviceSlice::from_raw_parts(self.device_ptr(), self.len, &self.order, stream.context())
        };
        view.on(stream)
    }

    /// The values on a stream of a device in [`GrowableBuffer::access`], for device work there
    /// that writes them (see [`GrowableBuffer::on_peer`]); exclusive while the guard lives.
    pub fn on_peer_mut<'s>(&'s mut self, stream: &'s Stream) -> Result<OnStreamMut<'s, T>> {
        self.check_access(stream)?;
        // SAFETY: as in `on_peer`; the view borrows `self` exclusively.
        let view = unsafe {
            DeviceSliceMut::from_raw_parts(self.device_ptr(), self.len, &self.order, stream.context())
        };
        view.into_on(stream)
    }

    /// `Ok` if `stream`'s device is given access to every chunk.
    fn check_access(&self, stream: &Stream) -> Result<()> {
        let device = stream.context().device();
        if self.access.iter().any(|&(d, a)| d == device && a == Access::ReadWrite) {
            return Ok(());
        }
        Err(Error::NotPermitted {
            ctx: ErrorContext::op("GrowableBuffer::on_peer (the stream's device is not in accessible_from)")
                .device(device.raw()),
        })
    }
}

/// `count` values of `T` in bytes.
fn bytes_for<T>(count: usize) -> Result<usize> {
    count.checked_mul(size_of::<T>()).ok_or(Error::SizeOverflow { count, elem_size: size_of::<T>() })
}

/// How to reserve for values of `T`: the driver's default base (aligned to the granularity) unless
/// `T` needs more.
fn reserve_options<T>(granularity: &Granularity) -> ReserveOptions {
    let align = align_of::<T>();
    if align > granularity.minimum {
        ReserveOptions::default().alignment(align)
    } else {
        ReserveOptions::default()
    }
}

fn beyond_reservation(reserve: usize) -> Error {
    Error::LimitExceeded {
        what: "bytes in this GrowableBuffer's reservation (reserve a larger one)",
        limit: reserve,
    }
}

/// The most memsets that write the first value of a fill that is not one memset; a value whose
/// words change more often is copied from the staging memory instead (see [`stage`]).
const SEED_MEMSETS: usize = 16;

/// Memsets that write one value whose bytes are `value`, at an address that is a multiple of its
/// size: `(byte offset, fill, words)` per run of equal words of the widest width (4, 2 or 1 bytes)
/// that divides the size. `None` if that takes more than [`SEED_MEMSETS`].
fn seed_memsets(value: &[u8]) -> Option<Vec<(usize, Fill, usize)>> {
    let width = [4, 2].into_iter().find(|&w| value.len().is_multiple_of(w)).unwrap_or(1);
    let mut runs: Vec<(usize, &[u8], usize)> = Vec::new();
    for (i, word) in value.chunks_exact(width).enumerate() {
        let full = runs.len() == SEED_MEMSETS;
        match runs.last_mut() {
            Some((_, last, n)) if *last == word => *n += 1,
            _ if full => return None,
            _ => runs.push((i * width, word, 1)),
        }
    }
    let fill = |word: &[u8]| match *word {
        [a] => Some(Fill::W8(a)),
        [a, b] => Some(Fill::W16(u16::from_ne_bytes([a, b]))),
        [a, b, c, d] => Some(Fill::W32(u32::from_ne_bytes([a, b, c, d]))),
        _ => None,
    };
    runs.into_iter().map(|(offset, word, n)| Some((offset, fill(word)?, n))).collect()
}

/// The device-to-device copies that fill `count` values once the first is written:
/// `(n, done)` copies values `[0, n)` to `[done, done + n)`. Each copy doubles the values written
/// so far (`n = done`) until the last, which takes what is left, so `count` values take about
/// `log2(count)` copies. Every copy has `1 ≤ n ≤ done` (its source, written already, does not
/// overlap its destination) and `done + n ≤ count`, and the destinations follow each other to
/// cover `[1, count)` exactly.
fn doubling(count: usize) -> impl Iterator<Item = (usize, usize)> {
    let first = (count > 1).then_some((1, 1));
    std::iter::successors(first, move |&(n, done)| {
        let done = done + n;
        (done < count).then(|| (done.min(count - done), done))
    })
}

/// The staging memory in `slot`, holding `bytes` (a value's): page-locked memory of
/// `size_of::<T>()` bytes, allocated on first use and kept for the buffer's later fills. Bytes,
/// so that a `T` aligned to more than the page that page-locked memory is aligned to is staged
/// too. Rewriting it goes through its host API, whose tracker first waits for the copies queued
/// from it before (by synchronising the stream they were queued on: the buffer's). A value
/// equal to the one staged is not rewritten, so it waits for nothing.
fn stage<'a>(
    slot: &'a mut Option<PinnedBuffer<u8>>,
    ctx: &Context,
    bytes: &[u8],
) -> Result<&'a PinnedBuffer<u8>> {
    let staging = match slot.take() {
        Some(staging) => staging,
        None => PinnedBuffer::from_slice(ctx, bytes)?,
    };
    let staging = slot.insert(staging);
    // Reading waits only for device writes, and the device only ever reads the staging memory.
    if staging.as_slice()? != bytes {
        staging.as_mut_slice()?.copy_from_slice(bytes);
    }
    Ok(staging)
}

/// The memset that writes `count` copies of the value whose bytes are `value`, and how many
/// words it sets: the narrowest width (1, 2 or 4 bytes) whose repetition gives the value's bytes.
fn memset_for(value: &[u8], count: usize) -> Option<(Fill, usize)> {
    let total = value.len().checked_mul(count)?;
    let repeats = |w: usize| value.len().is_multiple_of(w) && value.chunks(w).all(|c| c == &value[..w]);
    if repeats(1) {
        Some((Fill::W8(value[0]), total))
    } else if repeats(2) {
        Some((Fill::W16(u16::from_ne_bytes([value[0], value[1]])), total / 2))
    } else if repeats(4) {
        Some((Fill::W32(u32::from_ne_bytes([value[0], value[1], value[2], value[3]])), total / 4))
    } else {
        None
    }
}

impl<T> AsDeviceSlice<T> for GrowableBuffer<T> {
    fn as_device_slice(&self) -> DeviceSlice<'_, T> {
        self.as_slice()
    }
}

impl<T> AsDeviceSliceMut<T> for GrowableBuffer<T> {
    fn as_device_slice_mut(&mut self) -> DeviceSliceMut<'_, T> {
        self.as_mut_slice()
    }
}

impl<T> fmt::Debug for GrowableBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrowableBuffer")
            .field("ptr", &format_args!("{:#x}", self.device_ptr()))
            .field("len", &self.len)
            .field("mapped_bytes", &self.mapped_bytes())
            .field("reserved_bytes", &self.range.size())
            .field("device", &self.ctx.device().ordinal())
            .field(
                "accessible_from",
                &self.access.iter().skip(1).map(|(d, _)| d.ordinal()).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl<T> Drop for GrowableBuffer<T> {
    fn drop(&mut self) {
        // Taken first, on every path: its drop waits (without a lock, so inside a
        // `StreamOrder::queue_on` closure too) for the copies that read it, then frees it, or
        // leaks it with a warning should that wait fail; it never panics.
        drop(self.staging.take());
        if self.chunks.is_empty() {
            return;
        }
        // `join_mut` (exclusive, no lock) and a wait on the stream it returns, not
        // `StreamOrder::synchronize`, whose lock is refused inside a `StreamOrder::queue_on`
        // closure: a buffer dropped there returns its memory instead of leaking it.
        if let Err(e) = self.order.join_mut().and_then(Stream::synchronize) {
            // Unmapping under pending work would fault it: leak the chunks and the reservation.
            tracing::warn!(bytes = self.mapped_bytes(), error = %e, "waiting for work on a GrowableBuffer failed; leaking its memory");
            std::mem::forget(std::mem::take(&mut self.chunks));
            return;
        }
        // Newest first, as they were mapped in address order; the range goes after them, when the
        // buffer's own handle on it drops with the fields.
        while self.chunks.pop().is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memset_width_is_the_narrowest_repeating_one() {
        assert!(matches!(memset_for(&[0; 8], 3), Some((Fill::W8(0), 24))));
        assert!(matches!(memset_for(&[7], 5), Some((Fill::W8(7), 5))));
        assert!(matches!(memset_for(&[1, 2, 1, 2], 3), Some((Fill::W16(_), 6))));
        let four = 0x0403_0201u32.to_ne_bytes();
        assert!(matches!(memset_for(&four, 2), Some((Fill::W32(v), 2)) if v == 0x0403_0201));
        let eight = [four, four].concat();
        assert!(matches!(memset_for(&eight, 2), Some((Fill::W32(_), 4))));
        assert!(memset_for(&[1, 2, 3], 4).is_none());
        assert!(memset_for(&1u64.to_ne_bytes(), 4).is_none());
    }

    /// The `(offset, fill, words)` triples of a seed, as comparable numbers.
    fn seed(value: &[u8]) -> Option<Vec<(usize, u32, usize)>> {
        let word = |f: Fill| match f {
            Fill::W8(v) => u32::from(v),
            Fill::W16(v) => u32::from(v),
            Fill::W32(v) => v,
        };
        seed_memsets(value).map(|runs| runs.into_iter().map(|(o, f, n)| (o, word(f), n)).collect())
    }

    #[test]
    fn a_seed_is_one_memset_per_run_of_the_widest_words() {
        let one = 1.0f64.to_ne_bytes();
        let (lo, hi) = (
            u32::from_ne_bytes(one[..4].try_into().unwrap()),
            u32::from_ne_bytes(one[4..].try_into().unwrap()),
        );
        assert_eq!(seed(&one), Some(vec![(0, lo, 1), (4, hi, 1)]));
        assert_eq!(seed(&[1, 2, 3]), Some(vec![(0, 1, 1), (1, 2, 1), (2, 3, 1)]));
        let halves = [1, 2, 1, 2, 5, 6];
        let (a, b) = (u16::from_ne_bytes([1, 2]), u16::from_ne_bytes([5, 6]));
        assert_eq!(seed(&halves), Some(vec![(0, a.into(), 2), (4, b.into(), 1)]));
        let words = |n: u32| (0..n).flat_map(|i| (i + 1).to_ne_bytes()).collect::<Vec<u8>>();
        assert_eq!(seed(&words(SEED_MEMSETS as u32)).map(|s| s.len()), Some(SEED_MEMSETS));
        assert_eq!(seed(&words(SEED_MEMSETS as u32 + 1)), None);
        let mut repeated = words(3);
        repeated.extend([0; 400]); // a long run of zero words is one memset
        assert_eq!(seed(&repeated), Some(vec![(0, 1, 1), (4, 2, 1), (8, 3, 1), (12, 0, 100)]));
    }

    /// Checks every copy of `doubling(count)` against the bounds `fill_tail`'s SAFETY comment
    /// relies on, and that the destinations cover `[1, count)` exactly; returns how many copies.
    fn check_doubling(count: usize) -> usize {
        let mut end = 1; // values `[0, end)` are written
        let mut copies = 0;
        for (n, done) in doubling(count) {
            assert!(n >= 1, "count {count}: an empty copy at {done}");
            assert_eq!(done, end, "count {count}: a copy to {done} leaves a gap or overlaps the last");
            assert!(n <= done, "count {count}: source [0, {n}) overlaps destination [{done}, +{n})");
            assert!(
                done.checked_add(n).is_some_and(|e| e <= count),
                "count {count}: [{done}, +{n}) is out of bounds"
            );
            end = done + n;
            copies += 1;
        }
        assert_eq!(end, count.max(1), "count {count}: the copies stop at {end}");
        copies
    }

    #[test]
    fn doubling_copies_stay_in_bounds_do_not_overlap_and_cover_the_tail() {
        let large = [1 << 20, (1 << 20) + 1, (1 << 32) - 1, 1 << 40, (1 << 40) + 12345, usize::MAX / 3];
        for count in (0..=1000).chain(large).chain([usize::MAX - 1, usize::MAX]) {
            // Doubling: ⌈log2(count)⌉ copies.
            let want = if count <= 1 { 0 } else { (usize::BITS - (count - 1).leading_zeros()) as usize };
            assert_eq!(check_doubling(count), want, "count {count}");
        }
    }
}
