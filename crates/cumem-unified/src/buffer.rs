//! `UnifiedBuffer<T>`: managed memory that the host and devices share at one address.
//!
//! `cuMemAllocManaged` memory migrates between host and devices on demand. The buffer's host
//! accessors first wait for the device work that uses it: every device use goes through the
//! buffer's stream order (copies through its device views, prefetches, attachments), and
//! [`UnifiedBuffer::as_slice`] waits for pending writes, [`UnifiedBuffer::as_mut_slice`] for
//! everything. On devices with concurrent managed access that is all: the rules are those of
//! pinned memory, host reads and device reads may overlap.
//!
//! On a device without concurrent managed access the host must not touch managed memory while
//! device work that may use it runs at all, reads included (the real driver faults the host's
//! access). Which work that is depends on the attachment: for memory attached globally, *any*
//! work of the device (another buffer's copy, a user's kernel), for memory attached to one stream,
//! any work on that stream; memory attached to the host, none. The buffer sees only its own work,
//! so host access there is handed out only while the attachment keeps other work out:
//!
//! - borrows whose end the buffer cannot see ([`UnifiedBuffer::as_slice`],
//!   [`UnifiedBuffer::as_mut_slice`]) give `NotSupported { feature: ConcurrentManagedAccess }` for
//!   memory attached globally or to a stream: attach it to the host first
//!   ([`UnifiedBuffer::attach`]), or use a scoped accessor;
//! - the scoped accessors ([`UnifiedBuffer::with_host_slice`],
//!   [`UnifiedBuffer::with_host_slice_mut`] and [`UnifiedBuffer::to_vec`]) attach such memory to
//!   the host while they run: after waiting for all of the buffer's device work, they queue
//!   `cuStreamAttachMemAsync(CU_MEM_ATTACH_HOST)` on the attached stream (or, for memory attached
//!   globally, on a private non-blocking stream the buffer creates on first use) and wait for
//!   it, run the closure, then queue the attachment asked for again on that stream and wait for
//!   it. Concurrent scoped readers share one host attachment: the first in attaches, the last out
//!   restores (on a panic too). [`UnifiedBuffer::attachment`] always names the attachment asked for.
//!
//! The constructors write such memory while it is attached to the host, then attach it as asked.
//!
//! The attachment also decides which device work the buffer itself may queue there: memory
//! attached to the host takes none, memory attached to one stream only that stream's, memory
//! attached globally any stream's (the driver's contract for `cuStreamAttachMemAsync`; the real
//! driver does not refuse such work at the call, it faults or corrupts). So, on a device without
//! concurrent managed access, work through the device views on a stream the attachment keeps out
//! is refused with `NotSupported { feature: ConcurrentManagedAccess }` before anything is queued,
//! at every door: copies and memsets (the blocking ones run on the legacy stream, which is never
//! the attached stream), a view's `on(&stream)`, its order's `use_on`/`queue_on`, and peer copies
//! (`cumem-peer` orders this side on the legacy stream of the memory's device unless the copy's
//! stream belongs to it). [`UnifiedBuffer::attach`] itself is queued on any stream of the context
//! and changes what is admitted from then on. Devices with concurrent managed access admit every
//! stream, whatever the attachment.
//!
//! For memory attached to the host, [`UnifiedBuffer::as_slice`] waits for every device use of
//! the buffer, and from then on device work through shared views
//! ([`UnifiedBuffer::as_device_slice`]) is refused with `NotSupported { feature:
//! ConcurrentManagedAccess }` until an exclusive access proves the host's borrow is over (any
//! `&mut self` method, e.g. [`UnifiedBuffer::end_host_reads`]); the scoped accessors refuse it only
//! while they run. (Without concurrent managed access, memory attached to the host takes no device
//! work at all, borrowed or not, see above; [`UnifiedBuffer::attach`], which attaches it elsewhere,
//! is an exclusive access.) If restoring an attachment fails, the error is returned and the buffer is
//! *stranded*: the memory may still be attached to the host, so its device work is refused until an
//! exclusive access (which restores the attachment first, and keeps refusing while that fails). A
//! later scoped access that succeeds, a shared one included, restores the attachment too (as it
//! ends), but device work stays refused until an exclusive access.
//!
//! A device without managed memory gives `NotSupported { feature: ManagedMemory }` before any
//! driver call.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, Stream};
//! use cumem_unified::UnifiedBuffer;
//! let stream = Stream::new(&Device::get(0)?.context()?)?;
//! let mut buf = UnifiedBuffer::from_slice(&stream, &[1u32, 2, 3])?;
//! // Device 0 has concurrent managed access; without it, globally attached memory refuses this.
//! buf.as_mut_slice()?[2] = 30;                         // the host writes managed memory directly
//! assert_eq!(buf.as_device_slice().to_vec()?, [1, 2, 30]); // a device-side read of the same bytes
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::ptr::NonNull;
use std::sync::OnceLock;

use bytemuck::Zeroable;
use cumem_core::sys::{CUdeviceptr, CUmem_advise, CUmem_range_attribute, CUmemAttach_flags};
use cumem_core::{
    AsDeviceSlice, AsDeviceSliceMut, Capabilities, Context, Device, DeviceSlice, DeviceSliceMut, Error,
    Feature, HostAccess, Result, Stream, resolve_range,
};
use parking_lot::Mutex;

use crate::ffi;
use crate::{Advice, Location, MigrationPolicy};

/// How a managed allocation is attached, which decides who may touch it on devices without
/// concurrent managed access.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attach {
    /// Accessible from every stream of every device (`CU_MEM_ATTACH_GLOBAL`).
    Global,
    /// Accessible from the host only, until attached otherwise (`CU_MEM_ATTACH_HOST`).
    Host,
    /// Accessible from the host and this one stream (`CU_MEM_ATTACH_SINGLE`).
    Single(Stream),
}

impl Attach {
    fn flags(&self) -> u32 {
        let flag = match self {
            Attach::Global => CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL,
            Attach::Host => CUmemAttach_flags::CU_MEM_ATTACH_HOST,
            Attach::Single(_) => CUmemAttach_flags::CU_MEM_ATTACH_SINGLE,
        };
        flag as u32
    }
}

/// An owning array of `len` values of `T` in managed (unified) memory.
pub struct UnifiedBuffer<T> {
    ptr: CUdeviceptr,
    len: usize,
    ctx: Context,
    caps: Capabilities,
    /// Device work on the memory, ordered through a stream order that the device views share
    /// (exclusive with host reads on devices without concurrent managed access).
    access: HostAccess,
    /// The attachment the user asked for (scoped host accesses restore it when they end).
    attach: Attach,
    /// A private non-blocking stream of the context, created by the first scoped host access that
    /// attaches globally attached memory to the host: where it, and its restore, are queued and
    /// waited for, behind no one else's work (the access has waited for the buffer's own).
    visit_home: OnceLock<Stream>,
    /// Scoped host accesses that attached the memory to the host for their duration.
    visits: Mutex<Visits>,
    policy: Mutex<MigrationPolicy>,
    _marker: PhantomData<T>,
}

/// The scoped host accesses ([`UnifiedBuffer::with_host_slice`] and friends) in progress that
/// attached the memory to the host temporarily (a device without concurrent managed access, memory
/// attached globally or to a stream).
#[derive(Debug, Default)]
struct Visits {
    /// How many are inside: the first attaches the memory to the host, the last restores the
    /// attachment. Changed, and the attachments queued and waited for, under the lock, so a
    /// reader never runs before the host attachment has taken effect, and never after the
    /// restore was queued. Those waits (a whole stream's work, possibly the user's attached
    /// stream) are unbounded and block every other scoped access of the buffer on the lock; see
    /// [`UnifiedBuffer::with_host_slice`] for the deadlock that follows when that stream's work
    /// waits for such an access.
    inside: usize,
    /// A restore failed: the memory may still be attached to the host, or attachments may still be
    /// queued on the visit stream, although `attach` names another attachment. Device work through
    /// the buffer is refused meanwhile (an open-ended exclusion), until a restore succeeds and an
    /// exclusive access lifts the refusal.
    stranded: bool,
}

// SAFETY: the buffer owns its memory like a `Vec<T>`; host access goes through `&self`/`&mut self`
// and waits for device work first.
unsafe impl<T: Send> Send for UnifiedBuffer<T> {}
// SAFETY: shared access only hands out `&[T]` (after waiting for device writes; on devices without
// concurrent managed access after waiting for all device work, and refusing device work while the
// borrow may live) and shared device views (reads), like `&Vec<T>`. The temporary host attachment
// of concurrent scoped readers is counted under a lock (`visits`).
unsafe impl<T: Sync> Sync for UnifiedBuffer<T> {}

/// A byte range of one buffer, with what is needed to queue hints and prefetches on it.
#[derive(Clone, Copy)]
pub(crate) struct Span<'a> {
    pub ptr: CUdeviceptr,
    pub bytes: usize,
    pub ctx: &'a Context,
    pub access: &'a HostAccess,
}

impl<T: Copy> UnifiedBuffer<T> {
    /// `len` zeroed values attached globally, first used on `stream`.
    pub fn zeroed(stream: &Stream, len: usize) -> Result<Self>
    where
        T: Zeroable,
    {
        Self::zeroed_attached(stream, len, Attach::Global)
    }

    /// `len` zeroed values with an initial attachment: [`Attach::Global`] or [`Attach::Host`]
    /// (attach to a single stream afterwards with [`UnifiedBuffer::attach`]).
    pub fn zeroed_attached(stream: &Stream, len: usize, attach: Attach) -> Result<Self>
    where
        T: Zeroable,
    {
        Self::filled_by(stream, len, attach, |values| values.fill(T::zeroed()))
    }

    /// A managed copy of `data`, attached globally.
    pub fn from_slice(stream: &Stream, data: &[T]) -> Result<Self> {
        Self::from_slice_attached(stream, data, Attach::Global)
    }

    /// A managed copy of `data` with an initial attachment (see [`UnifiedBuffer::zeroed_attached`]).
    pub fn from_slice_attached(stream: &Stream, data: &[T], attach: Attach) -> Result<Self> {
        Self::filled_by(stream, data.len(), attach, |values| values.copy_from_slice(data))
    }

    /// Allocates, writes the values with `fill` on the host, then attaches as asked. On a device
    /// without concurrent managed access the memory is allocated attached to the host, where no
    /// device work may fault the host's writes (not even work the buffer cannot see), and
    /// attached as asked on `stream` afterwards.
    fn filled_by(stream: &Stream, len: usize, attach: Attach, fill: impl FnOnce(&mut [T])) -> Result<Self> {
        let host_first = !stream.context().device().capabilities()?.concurrent_managed_access;
        let initial = if host_first && attach == Attach::Global { Attach::Host } else { attach.clone() };
        let mut buf = Self::alloc(stream, len, initial)?;
        buf.with_host_slice_mut(fill)?;
        if buf.attach != attach {
            buf.attach(stream, attach)?;
        }
        Ok(buf)
    }
}

impl<T> UnifiedBuffer<T> {
    fn alloc(stream: &Stream, len: usize, attach: Attach) -> Result<Self> {
        let ctx = stream.context();
        let caps = ctx.device().capabilities()?;
        caps.require(Feature::ManagedMemory)?;
        if let Attach::Single(_) = attach {
            // cuMemAllocManaged takes GLOBAL or HOST only.
            return Err(Error::InvalidValue {
                ctx: cumem_sys::ErrorContext::op("UnifiedBuffer: attach a single stream after allocating"),
            });
        }
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(Error::SizeOverflow { count: len, elem_size: size_of::<T>() })?;
        let ptr = if bytes == 0 {
            0
        } else {
            ctx.bind()?;
            let device = ctx.device().ordinal() as i32;
            let ptr = ffi::mem_alloc_managed(bytes, attach.flags(), device)?;
            if !ptr.is_multiple_of(align_of::<T>() as u64) {
                // SAFETY: `ptr` came from cuMemAllocManaged just now and nothing uses it.
                if let Err(e) = unsafe { ffi::mem_free(ptr) } {
                    tracing::warn!(error = %e, "cumem-unified: freeing a misaligned managed allocation failed; it leaks");
                }
                return Err(Error::Misaligned {
                    what: "managed allocation",
                    value: ptr,
                    align: align_of::<T>() as u64,
                });
            }
            ptr
        };
        let mut buf = UnifiedBuffer {
            ptr,
            len,
            ctx: ctx.clone(),
            caps,
            // Without concurrent managed access the host faults on pages the device may be using,
            // so host reads must exclude device reads too.
            access: if caps.concurrent_managed_access {
                HostAccess::with_order(stream)
            } else {
                HostAccess::with_exclusive_order(stream)
            },
            attach,
            visit_home: OnceLock::new(),
            visits: Mutex::new(Visits::default()),
            policy: Mutex::new(MigrationPolicy::OnDemand),
            _marker: PhantomData,
        };
        let attach = buf.attach.clone();
        buf.confine(attach);
        Ok(buf)
    }

    /// Tells the stream order which streams `attach` lets use the memory, on a device without
    /// concurrent managed access (elsewhere every stream may, whatever the attachment): attached
    /// to the host, none; to one stream, that one; globally, all. Every door of the device views
    /// (copies, memsets, `on`, peer copies, prefetches) orders its work through that order on the
    /// stream the work runs on (a peer copy orders this side on the legacy stream of the memory's
    /// device), so work on a stream the attachment keeps out is refused there with `NotSupported
    /// { feature: ConcurrentManagedAccess }` before anything is queued. The check is part of the
    /// order's exclusion check, which every use makes anyway.
    fn confine(&mut self, attach: Attach) {
        if self.caps.concurrent_managed_access || self.ptr == 0 {
            return;
        }
        let order = self.access.order_mut().expect(ORDERED);
        match attach {
            Attach::Global => order.admit_any(),
            Attach::Host => order.admit_only(None),
            Attach::Single(stream) => order.admit_only(Some(&stream)),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The managed address of the first element, valid on the host and on devices (0 when nothing
    /// is allocated). Work that uses it outside cumem's copies must go through the door instead
    /// (`as_device_slice_mut().on(&stream)`, whose guard hands out the pointer).
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The context it was allocated in.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The capabilities of its device, read when it was allocated.
    pub fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    /// The attachment last asked for (at allocation or with [`UnifiedBuffer::attach`]). On a device
    /// without concurrent managed access the scoped host accessors attach memory attached globally
    /// or to a stream to the host while they run, and restore this attachment before they return,
    /// unless the restore fails (see [`UnifiedBuffer::with_host_slice`]).
    pub fn attachment(&self) -> &Attach {
        &self.attach
    }

    fn host_ptr(&self) -> *mut T {
        if self.ptr == 0 { NonNull::dangling().as_ptr() } else { self.ptr as usize as *mut T }
    }

    /// What the attachment rules add to the wait before host access.
    fn wait_attachment(&self) -> Result<()> {
        if self.caps.concurrent_managed_access || self.ptr == 0 {
            return Ok(());
        }
        match &self.attach {
            // Any work on the device may touch globally attached memory.
            Attach::Global => self.ctx.synchronize(),
            Attach::Single(stream) => stream.synchronize(),
            Attach::Host => Ok(()),
        }
    }

    /// Whether other device work may fault the host's access to the memory: on a device without
    /// concurrent managed access, memory attached globally (any work of the device) or to a stream
    /// (any work on it). Host access there needs the memory attached to the host for its duration.
    fn host_access_needs_host_attachment(&self) -> bool {
        !self.caps.concurrent_managed_access && self.ptr != 0 && self.attach != Attach::Host
    }

    /// Refuses a host borrow whose end the buffer cannot see where other device work may fault
    /// the host's access (see [`Self::host_access_needs_host_attachment`]): the buffer could not
    /// restore the attachment when the borrow ends.
    fn require_unscoped_host_access(&self) -> Result<()> {
        if !self.host_access_needs_host_attachment() {
            return Ok(());
        }
        Err(Error::NotSupported {
            feature: Feature::ConcurrentManagedAccess,
            device: Some(self.ctx.device().raw()),
        })
    }

    /// The stream a scoped host access attaches the memory to the host on, and restores the
    /// attachment on: the attached stream (which alone may use memory attached to it, and whose
    /// work the attachment is ordered after), or, for memory attached globally, a private stream
    /// created on first use (any stream of the context will do once the buffer's own work has
    /// completed; a private one makes the waits for the attachments wait for nothing else).
    fn visit_stream(&self) -> Result<&Stream> {
        if let Some(stream) = self.visit_stream_made() {
            return Ok(stream);
        }
        // Created under the `visits` lock or with `&mut self`: never twice at once.
        let stream = Stream::non_blocking(&self.ctx)?;
        Ok(self.visit_home.get_or_init(|| stream))
    }

    /// The visit stream if there is one yet (the private one is made on the first visit).
    fn visit_stream_made(&self) -> Option<&Stream> {
        match &self.attach {
            Attach::Single(stream) => Some(stream),
            Attach::Global | Attach::Host => self.visit_home.get(),
        }
    }

    /// Queues attaching the memory with `flags` on the visit stream (the whole allocation: the
    /// driver takes length 0 or the full size only).
    fn queue_visit_attach(&self, flags: u32) -> Result<()> {
        let stream = self.visit_stream()?;
        self.ctx.bind()?;
        ffi::stream_attach_mem_async(stream.raw(), self.ptr, flags)
    }

    /// Queues the user's attachment again on the visit stream and waits for it to take effect.
    /// Waited for rather than ordered through the stream order: the visit stream is not recorded
    /// there (recording needs a ticket, which the exclusion of device work refuses), so later
    /// device work on other streams would not wait for the restore otherwise.
    fn restore_attachment(&self) -> Result<()> {
        self.queue_visit_attach(self.attach.flags())?;
        self.visit_stream()?.synchronize()
    }

    /// [`Self::restore_attachment`] at the end of a scoped host access (or after a failed start).
    /// If it fails, the memory is left stranded: device work through the buffer is refused (an
    /// open-ended exclusion, which needs no ticket to be held: the caller's scoped exclusion
    /// keeps them out) until a later restore succeeds and an exclusive access lifts it.
    ///
    /// Called under the `visits` lock, so it logs nothing: a subscriber may use the buffer from
    /// inside the event (a scoped read locks `visits` again, on this thread). The caller logs what
    /// the returned [`Stranded`] holds once the lock is let go.
    fn restore_or_strand(&self, visits: &mut Visits) -> std::result::Result<(), Box<Stranded>> {
        match self.restore_attachment() {
            Ok(()) => {
                visits.stranded = false;
                Ok(())
            }
            Err(error) => {
                visits.stranded = true;
                // The exclusion begins before this wait (and stays if the wait fails).
                let wait = self.access.wait_writes().err();
                Err(Box::new(Stranded { error, wait }))
            }
        }
    }

    /// Restores the attachment that a failed scoped host access left stranded, before an exclusive
    /// access lets device work through again.
    fn settle(&mut self) -> Result<()> {
        if !self.visits.get_mut().stranded {
            return Ok(());
        }
        self.restore_attachment()?;
        self.visits.get_mut().stranded = false;
        Ok(())
    }

    /// Ends the refusal of device work begun by host reads (`&mut self`: no borrow of them is
    /// alive), unless the attachment is stranded and cannot be restored yet.
    fn end_host_reads_settled(&mut self) {
        match self.settle() {
            Ok(()) => self.access.end_host_reads(),
            Err(e) => {
                tracing::warn!(error = %e, "restoring a unified buffer's attachment failed; its device work stays refused");
            }
        }
    }

    /// Runs `access`, a host access that ends when it returns, with the memory attached to the
    /// host (see [`Self::host_access_needs_host_attachment`]).
    ///
    /// `read_scoped` first refuses the buffer's device work and waits for all of it; then the
    /// first of the scoped accesses in progress queues `CU_MEM_ATTACH_HOST` on the visit stream
    /// and waits for it (no device work may use host-attached memory, so none can fault the
    /// host's access from then on), and the last one queues the user's attachment again and
    /// waits for it, before the refusal of device work ends. A failure to attach runs nothing
    /// and returns the error, with the attachment restored (or stranded, see `Visits`); a
    /// failure to restore returns the error after `access` ran (its result is dropped).
    fn with_host_attachment<R>(&self, access: impl FnOnce() -> R) -> Result<R> {
        self.access.read_scoped(|| {
            let visit = Visit::enter(self)?;
            let value = access();
            visit.leave()?;
            Ok(value)
        })?
    }

    /// The values, after the device work that writes them has completed.
    ///
    /// On a device without concurrent managed access: memory attached globally or to a stream
    /// gives `NotSupported { feature: ConcurrentManagedAccess }` (other device work would fault
    /// the host's reads while the borrow lives, and the buffer could not restore the attachment
    /// when it ends: attach the memory to the host first, or use
    /// [`UnifiedBuffer::with_host_slice`], which attaches it for its duration); memory attached to the
    /// host is returned after all device work of the buffer, and device work through shared
    /// views is refused from then on (`NotSupported { feature: ConcurrentManagedAccess }`) until
    /// an exclusive access such as [`UnifiedBuffer::end_host_reads`]: the returned borrow does not
    /// say when it ends.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.require_unscoped_host_access()?;
        self.access.wait_writes()?;
        self.wait_attachment()?;
        // SAFETY: the memory holds `len` initialised values (written at construction) and is
        // host-accessible; no device work writes it any more (waited for above), and new device
        // writes need `&mut self`, which cannot coexist with the returned borrow. Without
        // concurrent managed access the memory is attached to the host (checked above), so no
        // other device work may use it; the buffer's own work has completed, and the tracker
        // refuses new work until `&mut self` proves the borrow over.
        Ok(unsafe { self.host_slice() })
    }

    /// # Safety
    /// 1. No device work writes the values while the returned borrow lives (none uses them at all
    ///    on a device without concurrent managed access).
    unsafe fn host_slice(&self) -> &[T] {
        // SAFETY: the memory holds `len` initialised values (written at construction), aligned and
        // host-accessible (managed), or is dangling with `len == 0` bytes; the caller excludes
        // device writes for the borrow's life.
        unsafe { std::slice::from_raw_parts(self.host_ptr(), self.len) }
    }

    /// The values for writing, after all device work that uses them has completed.
    ///
    /// On a device without concurrent managed access, memory attached globally or to a stream
    /// gives `NotSupported { feature: ConcurrentManagedAccess }`, as for
    /// [`UnifiedBuffer::as_slice`].
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.require_unscoped_host_access()?;
        // SAFETY: the host access is allowed for as long as the borrow may live (checked above).
        unsafe { self.host_slice_mut() }
    }

    /// # Safety
    /// 1. On a device without concurrent managed access, no device work but the buffer's own may
    ///    use the memory while the returned borrow lives (what the attachment allows).
    unsafe fn host_slice_mut(&mut self) -> Result<&mut [T]> {
        self.access.wait_idle_mut()?;
        self.wait_attachment()?;
        // SAFETY: as in `as_slice`; no device work of the buffer uses the values, and new work
        // needs a borrow of `self`, which cannot coexist with the returned one; other device work
        // is the caller's (item 1).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.host_ptr(), self.len) })
    }

    /// Runs `f` on the values, after the device work that writes them (on a device without
    /// concurrent managed access, after all device work of the buffer), and returns what it
    /// returns. The buffer's own device work is refused while `f` runs.
    ///
    /// On a device without concurrent managed access, memory attached globally or to a stream is
    /// attached to the host while `f` runs: work the buffer cannot see (another thread's copy,
    /// work on a clone of the attached stream, the closure's own) would otherwise fault the host's
    /// reads, and no device work may use memory attached to the host. After all of the buffer's
    /// device work has completed, `cuStreamAttachMemAsync(CU_MEM_ATTACH_HOST)` is queued on the
    /// attached stream (memory attached globally: on a private non-blocking stream of the buffer,
    /// created on first use, so the waits wait for nothing else; its creation's error is returned
    /// without running `f`) and waited for; after `f`, the attachment asked for
    /// ([`UnifiedBuffer::attachment`]) is queued again on that stream and waited for (by the last
    /// of concurrent scoped readers, which share one host attachment; on a panic too). Errors:
    ///
    /// - the attach or its wait fails: the error, without running `f`; the attachment is restored
    ///   (or, if that fails too, stranded as below);
    /// - the restore fails: the error after `f` ran (its result is dropped); the buffer is
    ///   stranded: the memory may stay attached to the host, so the buffer's device work is refused
    ///   (`NotSupported { feature: ConcurrentManagedAccess }`) until an exclusive access
    ///   ([`UnifiedBuffer::end_host_reads`], a device view for writing, [`UnifiedBuffer::attach`],
    ///   [`UnifiedBuffer::with_host_slice_mut`]), which restores the attachment first (and keeps
    ///   refusing while that fails). A later scoped access that succeeds, a shared one included,
    ///   restores the attachment too (as it ends), but device work stays refused until an exclusive
    ///   access;
    /// - inside a [`StreamOrder::queue_on`](cumem_core::StreamOrder::queue_on) closure:
    ///   `NotPermitted`, as every use of cumem memory there;
    /// - while device work is being queued through the buffer (a view's guard is held, perhaps by
    ///   the calling thread): `NotSupported { feature: ConcurrentManagedAccess }`, never waited for.
    ///
    /// The waits synchronise whole streams: every stream the buffer's device work used (as on any
    /// device), and for memory attached to a stream that whole stream, twice (other scoped
    /// accesses of the buffer wait meanwhile). Work queued on them that waits on the host for
    /// something the calling thread holds never ends. The first scoped access in and the last one
    /// out do their part holding the buffer's lock of scoped accesses, with no bound on the wait:
    /// the first creates the private visit stream (`cuStreamCreateWithPriority`, on first use), queues the
    /// host attachment and synchronises the visit stream (the attached stream itself, for memory
    /// attached to one: all the work queued on it so far); the last queues the restore and
    /// synchronises that stream again, and after a failed restore waits for the buffer's device
    /// writes. Every other scoped access of this buffer (`with_host_slice`, `to_vec`, from any
    /// thread) blocks on that lock meanwhile. So a host function, callback or thread that the
    /// synchronised stream's work waits for must not make a scoped access of the same buffer: it
    /// waits for the lock, the lock's holder waits for the stream, and neither ends. (Waiting
    /// outside the lock would not help: a later reader must not read before the host attachment
    /// has taken effect, so it waits for the same stream either way.) Dropping a buffer whose restore failed
    /// (stranded) first waits for the buffer's device work (as every drop does), then for the
    /// stream the attachments were queued on (the attached stream; otherwise, for memory attached
    /// globally or to the host, the buffer's private visit stream), and leaks the memory with a warning if either
    /// wait fails.
    pub fn with_host_slice<R>(&self, f: impl FnOnce(&[T]) -> R) -> Result<R> {
        if self.host_access_needs_host_attachment() {
            return self.with_host_attachment(|| {
                // SAFETY: `with_host_attachment` waited for all device work of the buffer and
                // refuses more until this closure returns, and the memory is attached to the host
                // until then, so no other device work may use it either; the borrow ends inside
                // the closure.
                f(unsafe { self.host_slice() })
            });
        }
        self.access.read_scoped(|| {
            // SAFETY: `read_scoped` waited for the device writes (for all device work of the
            // buffer, refused until this closure returns, on a device without concurrent managed
            // access, where the memory is attached to the host (checked above), so no other
            // device work may use it); the borrow ends inside the closure.
            Ok(f(unsafe { self.host_slice() }))
        })?
    }

    /// Runs `f` on the values for writing, after all device work that uses them, and returns what
    /// it returns. On a device without concurrent managed access memory attached globally or to a
    /// stream is attached to the host while `f` runs, with the errors of
    /// [`UnifiedBuffer::with_host_slice`] (an attachment left stranded by a failed restore is
    /// restored first).
    pub fn with_host_slice_mut<R>(&mut self, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        if self.host_access_needs_host_attachment() {
            // `&mut self`: no host borrow from `as_slice` is alive.
            self.settle()?;
            self.access.end_host_reads();
            let (ptr, len) = (self.host_ptr(), self.len);
            return self.with_host_attachment(|| {
                // SAFETY: as in `with_host_slice`; the values are initialised, aligned and
                // host-accessible (attached to the host), and `&mut self` excludes every other
                // Rust reference to them until the borrow ends inside the closure.
                f(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
            });
        }
        // SAFETY: the host access is allowed while `f` runs (the attachment keeps other device
        // work out); the borrow ends when `f` returns.
        Ok(f(unsafe { self.host_slice_mut() }?))
    }

    /// A copy of the values, after the device work that writes them; see
    /// [`UnifiedBuffer::with_host_slice`], which it runs (and which attaches memory attached
    /// globally or to a stream to the host while it copies, on a device without concurrent managed
    /// access).
    pub fn to_vec(&self) -> Result<Vec<T>>
    where
        T: Copy,
    {
        self.with_host_slice(<[T]>::to_vec)
    }

    /// Ends the host reads begun by [`UnifiedBuffer::as_slice`]: `&mut self` proves that no borrow
    /// it returned is alive, so shared device views may queue work again on a device without
    /// concurrent managed access. Every other `&mut self` method does the same; on other devices
    /// this does nothing. If a scoped host access failed to restore the attachment, this restores
    /// it first (queued on its stream and waited for); while that fails, device work stays refused.
    pub fn end_host_reads(&mut self) {
        self.end_host_reads_settled();
    }

    /// Blocks until no device work uses the buffer.
    pub fn wait_idle(&self) -> Result<()> {
        self.access.wait_idle()?;
        self.wait_attachment()
    }

    /// A shared device view of the whole buffer, for copies that read it. On a device without
    /// concurrent managed access its work is refused (`NotSupported { feature:
    /// ConcurrentManagedAccess }`, before anything is queued) on a stream the attachment keeps
    /// out (memory attached to the host: every stream; to one stream: every other stream, the
    /// legacy stream included), and while the host may be reading the buffer (see
    /// [`UnifiedBuffer::as_slice`]), and while a failed restore may have left the memory attached
    /// to the host (see [`UnifiedBuffer::with_host_slice`]).
    pub fn as_device_slice(&self) -> DeviceSlice<'_, T> {
        let order = self.access.view_order(false).expect(ORDERED);
        // SAFETY: the memory is a live managed allocation of `len` initialised values of this
        // context, aligned for T (checked at allocation); the view borrows `self`, so nothing
        // writes the memory except work ordered through `order`, whose use host access waits for.
        unsafe { DeviceSlice::from_raw_parts(self.ptr, self.len, order, &self.ctx) }
    }

    /// An exclusive device view of the whole buffer, for copies and memsets that write it. Its
    /// work is refused on streams the attachment keeps out, as for
    /// [`UnifiedBuffer::as_device_slice`].
    pub fn as_device_slice_mut(&mut self) -> DeviceSliceMut<'_, T> {
        // `&mut self`: no host borrow from `as_slice` is alive.
        self.end_host_reads_settled();
        let order = self.access.view_order(true).expect(ORDERED);
        // SAFETY: as in `as_device_slice`; the view borrows `self` exclusively.
        unsafe { DeviceSliceMut::from_raw_parts(self.ptr, self.len, order, &self.ctx) }
    }

    /// Queues attaching the buffer on `stream` (`cuStreamAttachMemAsync`), in order after the work
    /// that uses it. [`Attach::Single`] names the stream that may use it, which must be `stream`
    /// itself (another stream gives `InvalidValue`) and not the legacy stream (`InvalidValue`);
    /// a `stream` of another context gives `WrongDevice`; all before any driver call. Host access
    /// then waits for that stream on devices without concurrent managed access, and there the
    /// device views' work is admitted on the streams the new attachment allows from now on (see
    /// [`UnifiedBuffer::as_device_slice`]). An attachment that a
    /// scoped host access failed to restore is restored first (its error is returned).
    pub fn attach(&mut self, stream: &Stream, attach: Attach) -> Result<()> {
        if let Attach::Single(s) = &attach {
            if s != stream {
                return Err(Error::InvalidValue {
                    ctx: cumem_sys::ErrorContext::op("UnifiedBuffer::attach (Single names another stream)"),
                });
            }
            if s.is_legacy() {
                // The driver refuses CU_MEM_ATTACH_SINGLE on the NULL stream.
                return Err(Error::InvalidValue {
                    ctx: cumem_sys::ErrorContext::op("UnifiedBuffer::attach (Single on the legacy stream)"),
                });
            }
        }
        if stream.context() != &self.ctx {
            return Err(Error::WrongDevice {
                expected: self.ctx.device().ordinal() as i32,
                actual: stream.context().device().ordinal() as i32,
            });
        }
        // A stranded attachment is restored first: its attachments queued on the visit stream
        // would otherwise race with this one.
        self.settle()?;
        // `&mut self`: no host borrow from `as_slice` is alive.
        self.access.end_host_reads();
        if self.ptr != 0 {
            // The attachment itself may be queued on any stream of the context, whatever the
            // memory is attached to now: its ticket is admitted, then the streams the new
            // attachment allows are (the old ones again if nothing was queued).
            self.confine(Attach::Global);
            let order = self.access.view_order(true).expect(ORDERED);
            let queued = order.use_on(stream).and_then(|_ticket| {
                self.ctx.bind()?;
                ffi::stream_attach_mem_async(stream.raw(), self.ptr, attach.flags())
            });
            let in_effect = if queued.is_ok() { attach.clone() } else { self.attach.clone() };
            self.confine(in_effect);
            queued?;
        }
        self.attach = attach;
        Ok(())
    }

    /// The byte span of `range` (elements), for hints and prefetches.
    pub(crate) fn span(&self, range: impl RangeBounds<usize>) -> Result<Span<'_>> {
        let (start, end) = resolve_range(range, self.len)?;
        Ok(Span {
            ptr: self.ptr + (start * size_of::<T>()) as u64,
            bytes: (end - start) * size_of::<T>(),
            ctx: &self.ctx,
            access: &self.access,
        })
    }

    /// Sets a migration hint on the whole buffer.
    pub fn advise(&self, advice: Advice) -> Result<()> {
        self.advise_range(.., advice)
    }

    /// Removes a migration hint from the whole buffer.
    pub fn unadvise(&self, advice: Advice) -> Result<()> {
        self.unadvise_range(.., advice)
    }

    /// Sets a migration hint on the elements in `range`. Preferring or mapping a device needs
    /// concurrent managed access on it (`NotSupported` otherwise, before any driver call).
    pub fn advise_range(&self, range: impl RangeBounds<usize>, advice: Advice) -> Result<()> {
        let span = self.span(range)?;
        let (code, target) = match advice {
            Advice::ReadMostly => (CUmem_advise::CU_MEM_ADVISE_SET_READ_MOSTLY, None),
            Advice::PreferredLocation(l) => (CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION, Some(l)),
            Advice::AccessedBy(l) => (CUmem_advise::CU_MEM_ADVISE_SET_ACCESSED_BY, Some(l)),
        };
        if let Some(l) = target {
            l.require_concurrent()?;
        }
        advise_span(span, code, target)
    }

    /// Removes a migration hint from the elements in `range`. Removing "accessed by" a device
    /// needs concurrent managed access on it, as setting it does (`NotSupported` otherwise, before
    /// any driver call: the hint cannot have been set there).
    pub fn unadvise_range(&self, range: impl RangeBounds<usize>, advice: Advice) -> Result<()> {
        let span = self.span(range)?;
        let (code, target) = match advice {
            Advice::ReadMostly => (CUmem_advise::CU_MEM_ADVISE_UNSET_READ_MOSTLY, None),
            Advice::PreferredLocation(_) => (CUmem_advise::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION, None),
            Advice::AccessedBy(l) => {
                l.require_concurrent()?;
                (CUmem_advise::CU_MEM_ADVISE_UNSET_ACCESSED_BY, Some(l))
            }
        };
        advise_span(span, code, target)
    }

    /// Applies a migration policy to the whole buffer: removes the read-mostly and preferred-location
    /// hints, then sets the policy's (checked for support before any hint changes).
    ///
    /// If a driver call fails, its error is returned and the hints of the policy in effect before
    /// ([`UnifiedBuffer::policy`], which still names it) are set again (a read-mostly or
    /// preferred-location hint set with [`UnifiedBuffer::advise`] outside a policy stays removed;
    /// accessed-by hints are never touched). Should that fail too, both hints are removed once
    /// more and the policy becomes [`MigrationPolicy::OnDemand`] (no read-mostly or preferred
    /// location); only if even that fails does [`UnifiedBuffer::policy`] name a policy whose hints
    /// may be in effect only in part ([`UnifiedBuffer::attributes`] reads back what is). Either
    /// fallback's failure is logged (`warn`).
    ///
    /// The buffer's policy lock is held across those driver calls (up to 10 `cuMemAdvise`), and
    /// [`UnifiedBuffer::policy`] waits for it: whether `cuMemAdvise` can block behind other work
    /// of the context (as `cuMemFree` waits for queued host functions) is unmeasured, so a host
    /// function that sets or reads this buffer's policy may deadlock with a `set_policy` in
    /// progress.
    pub fn set_policy(&self, policy: MigrationPolicy) -> Result<()> {
        if let Some(l) = policy.preferred_location() {
            l.require_concurrent()?;
        }
        // The hints are applied under the lock: it is what keeps two threads' policies from
        // interleaving their hints, so that `policy()` names the hints in effect. Nothing is logged
        // under it (see below). Up to 10 cuMemAdvise calls run under it (4 for the policy, 4 to
        // restore the previous one, 2 to clear both hints). Unmeasured: whether cuMemAdvise can wait
        // for other threads' work as `cuMemFree` waits for every host function queued in the
        // context (driver-api.md §17). If it can, a held stream holds up every `set_policy` and
        // `policy()` of this buffer while it waits, and a host function that calls either on this
        // buffer deadlocks.
        let mut current = self.policy.lock();
        let Err(e) = self.apply_policy(policy) else {
            *current = policy;
            return Ok(());
        };
        // Back to a state `policy()` names truly; the first error is the one returned, the
        // fallbacks' are logged once the lock is let go (a subscriber may ask for the policy).
        let previous = *current;
        let fallback = self.apply_policy(previous).err().map(|restore| {
            let cleared = self.apply_policy(MigrationPolicy::OnDemand).err();
            if cleared.is_none() {
                *current = MigrationPolicy::OnDemand;
            }
            (restore, cleared)
        });
        drop(current);
        if let Some((restore, cleared)) = fallback {
            match cleared {
                None => tracing::warn!(
                    error = %restore,
                    ?previous,
                    "restoring the previous migration policy's hints failed; the buffer is now OnDemand"
                ),
                Some(cleared) => tracing::warn!(
                    error = %restore,
                    clearing = %cleared,
                    ?previous,
                    "restoring the previous migration policy's hints and clearing them both failed; \
                     the policy reported may be in effect only in part"
                ),
            }
        }
        Err(e)
    }

    /// Removes the read-mostly and preferred-location hints, then sets `policy`'s.
    fn apply_policy(&self, policy: MigrationPolicy) -> Result<()> {
        self.unadvise(Advice::ReadMostly)?;
        self.unadvise(Advice::PreferredLocation(Location::Host))?;
        if policy.read_mostly() {
            self.advise(Advice::ReadMostly)?;
        }
        if let Some(l) = policy.preferred_location() {
            self.advise(Advice::PreferredLocation(l))?;
        }
        Ok(())
    }

    /// The last policy applied with [`UnifiedBuffer::set_policy`] (initially
    /// [`MigrationPolicy::OnDemand`]).
    pub fn policy(&self) -> MigrationPolicy {
        *self.policy.lock()
    }

    /// Queues migrating the whole buffer to `to` on `stream`, in order after the work that uses it.
    /// The stream's device (and a device destination) need concurrent managed access. A prefetch
    /// changes no data: exclusive host access and [`UnifiedBuffer::wait_idle`] wait for it, shared
    /// host reads do not (see [`PrefetchPlan`](crate::PrefetchPlan)).
    pub fn prefetch(&self, to: Location, stream: &Stream) -> Result<()> {
        crate::PrefetchPlan::new().with(self, to).execute(stream)
    }

    /// Queues migrating the elements in `range` to `to` on `stream` (see [`UnifiedBuffer::prefetch`]).
    pub fn prefetch_range(
        &self,
        range: impl RangeBounds<usize>,
        to: Location,
        stream: &Stream,
    ) -> Result<()> {
        let mut plan = crate::PrefetchPlan::new();
        plan.add_range(self, range, to)?;
        plan.execute(stream)
    }

    /// The hints in effect on the elements in `range`, as the driver reports them.
    pub fn range_attributes(&self, range: impl RangeBounds<usize>) -> Result<RangeAttributes> {
        let span = self.span(range)?;
        if span.bytes == 0 {
            return Ok(RangeAttributes::default());
        }
        span.ctx.bind()?;
        let one = |attr| -> Result<i32> {
            let mut v = [0i32];
            ffi::mem_range_get_attribute(&mut v, attr, span.ptr, span.bytes)?;
            Ok(v[0])
        };
        use CUmem_range_attribute as A;
        let read_mostly = one(A::CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY)? != 0;
        let preferred_location = Location::from_id(one(A::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION)?)?;
        let last_prefetch_location =
            Location::from_id(one(A::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION)?)?;
        // One slot per device and one for the host; unused slots come back as CU_DEVICE_INVALID.
        let mut ids = vec![ffi::DEVICE_INVALID; Device::count()? + 1];
        ffi::mem_range_get_attribute(&mut ids, A::CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY, span.ptr, span.bytes)?;
        let mut accessed_by = Vec::new();
        for id in ids {
            if let Some(l) = Location::from_id(id)? {
                accessed_by.push(l);
            }
        }
        Ok(RangeAttributes { read_mostly, preferred_location, accessed_by, last_prefetch_location })
    }

    /// The hints in effect on the whole buffer.
    pub fn attributes(&self) -> Result<RangeAttributes> {
        self.range_attributes(..)
    }
}

/// One scoped host access inside [`UnifiedBuffer::with_host_attachment`]: counted in the buffer's
/// `visits`, and left (the attachment restored by the last one out) when it ends, on a panic too.
struct Visit<'a, T> {
    buf: &'a UnifiedBuffer<T>,
    left: bool,
}

impl<'a, T> Visit<'a, T> {
    /// Counts one scoped access in; the first attaches the memory to the host and waits for that.
    /// The caller has refused the buffer's device work and waited for all of it.
    fn enter(buf: &'a UnifiedBuffer<T>) -> Result<Self> {
        // Held across the waits below: the next access must not read before the attachment has
        // taken effect. A thread inside a `queue_on` closure never gets here (`read_scoped`
        // refuses it first), so no closure's order is locked while this lock is waited for.
        let mut visits = buf.visits.lock();
        if visits.inside == 0 {
            // Nothing queued when this fails: the attachment is as it was.
            buf.queue_visit_attach(CUmemAttach_flags::CU_MEM_ATTACH_HOST as u32)?;
            // The stream exists: the attach above was queued on it.
            if let Err(e) = buf.visit_stream().and_then(Stream::synchronize) {
                // The host attachment is queued and may take effect: queue the user's again.
                let restore = buf.restore_or_strand(&mut visits);
                // Logged without the lock (see `restore_or_strand`).
                drop(visits);
                if let Err(stranded) = restore {
                    stranded.log();
                }
                return Err(e);
            }
        }
        visits.inside += 1;
        Ok(Visit { buf, left: false })
    }

    /// Counts the access out; the last one restores the attachment (see `restore_or_strand`).
    fn leave(mut self) -> Result<()> {
        self.left = true;
        self.buf.leave_visit()
    }
}

impl<T> Drop for Visit<'_, T> {
    fn drop(&mut self) {
        // Only when the access unwound (`leave` sets `left`).
        if !self.left
            && let Err(e) = self.buf.leave_visit()
        {
            tracing::warn!(error = %e, "restoring a unified buffer's attachment failed; its device work is refused");
        }
    }
}

impl<T> UnifiedBuffer<T> {
    /// Counts a scoped access out; the last one restores the attachment. Returns the restore's
    /// error, after logging (with the `visits` lock let go) a failed wait that came with it.
    fn leave_visit(&self) -> Result<()> {
        let restore = {
            let mut visits = self.visits.lock();
            visits.inside -= 1;
            if visits.inside == 0 { self.restore_or_strand(&mut visits) } else { Ok(()) }
        };
        restore.map_err(|stranded| {
            if let Some(wait) = &stranded.wait {
                log_stranded_wait(wait);
            }
            let Stranded { error, .. } = *stranded;
            error
        })
    }
}

/// A failed restore (`UnifiedBuffer::restore_or_strand`): its error, and the error of the wait
/// for the buffer's device work that followed, if that failed too. Logged or returned by the
/// caller once the `visits` lock is let go.
struct Stranded {
    error: Error,
    wait: Option<Error>,
}

impl Stranded {
    /// Logs both errors (a failed start of a scoped access returns its own error instead).
    fn log(self) {
        tracing::warn!(error = %self.error, "restoring a unified buffer's attachment failed; its device work is refused");
        if let Some(wait) = &self.wait {
            log_stranded_wait(wait);
        }
    }
}

fn log_stranded_wait(wait: &Error) {
    tracing::warn!(error = %wait, "waiting for device work on a stranded unified buffer failed");
}

/// Every unified buffer's tracker is created with a stream order (`alloc`), so views always get one.
const ORDERED: &str = "a UnifiedBuffer's tracker always has a stream order";

fn advise_span(span: Span<'_>, code: CUmem_advise, target: Option<Location>) -> Result<()> {
    if span.bytes == 0 {
        return Ok(());
    }
    span.ctx.bind()?;
    // Locations are ignored for the hints that take none; the host is a valid placeholder.
    let target = target.map_or(ffi::Target::Host, Location::target);
    ffi::mem_advise(span.ptr, span.bytes, code, target)
}

/// The migration hints in effect on a range of managed memory (`cuMemRangeGetAttribute`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeAttributes {
    /// Every page of the range is read-mostly.
    pub read_mostly: bool,
    /// The preferred location of every page (`None` if unset or mixed).
    pub preferred_location: Option<Location>,
    /// The processors that have the accessed-by hint on the whole range.
    pub accessed_by: Vec<Location>,
    /// Where the whole range was last prefetched to (`None` if never, or mixed).
    pub last_prefetch_location: Option<Location>,
}

impl<T> AsDeviceSlice<T> for UnifiedBuffer<T> {
    fn as_device_slice(&self) -> DeviceSlice<'_, T> {
        UnifiedBuffer::as_device_slice(self)
    }
}

impl<T> AsDeviceSliceMut<T> for UnifiedBuffer<T> {
    fn as_device_slice_mut(&mut self) -> DeviceSliceMut<'_, T> {
        UnifiedBuffer::as_device_slice_mut(self)
    }
}

impl<T> fmt::Debug for UnifiedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnifiedBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("attach", &self.attach)
            .field("device", &self.ctx.device().ordinal())
            .finish()
    }
}

impl<T> Drop for UnifiedBuffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // Without the tracker's lock (`&mut self`), so that a drop inside a `queue_on` closure frees
        // the buffer instead of being refused and leaking it.
        if let Err(e) = self.access.wait_idle_mut() {
            // Freeing memory that the device may still use would be unsound: leak it instead.
            tracing::warn!(error = %e, bytes = self.bytes(), "waiting for device work on a unified buffer failed; leaking it");
            return;
        }
        if self.visits.get_mut().stranded {
            // A failed restore may have left attachments queued on the visit stream, which the
            // stream order does not record (so the wait above did not cover them): the free must
            // not overtake them.
            if let Some(Err(e)) = self.visit_stream_made().map(Stream::synchronize) {
                tracing::warn!(error = %e, bytes = self.bytes(), "waiting for a stranded unified buffer's attachments failed; leaking it");
                return;
            }
        }
        let result = self.ctx.bind().and_then(|()| {
            // SAFETY: `ptr` came from cuMemAllocManaged, is freed once, and no device work or Rust
            // reference uses it any more (waited for above; `&mut self`), nor any attachment a
            // failed restore left queued (the visit stream, waited for above); cuMemFree also waits.
            unsafe { ffi::mem_free(self.ptr) }
        });
        if let Err(e) = result {
            tracing::warn!(error = %e, "cuMemFree of a unified buffer failed; the memory is leaked");
        }
    }
}
