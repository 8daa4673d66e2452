//! Mappings: physical memory bound into a reservation, unmapped when dropped.
//!
//! [`Mapping<'r>`](Mapping) borrows its [`VirtualRange`], so it cannot outlive it;
//! [`SharedMapping`] holds the range in an `Arc` instead, for owners that keep a range and its
//! mappings side by side (a [`GrowableBuffer`](crate::GrowableBuffer), a pool's expandable
//! segments). Both are [`MappingIn`], generic over how the range is held.
//!
//! A new mapping is inaccessible until [`MappingIn::set_access`] grants a device access. Its typed
//! views ([`MappingIn::as_slice`], [`MappingIn::as_mut_slice`]) are ordinary cumem device views
//! and work with every copy and memset of `cumem-copy`; the work queued through them is tracked by
//! the mapping's stream order, and the mapping waits for it before it unmaps. That order starts on
//! a non-blocking stream of the mapping's own, on which cumem queues no work, so work queued on a
//! non-blocking stream and the unmap after it wait for that work alone, not for the context's
//! blocking streams (as an order started on the legacy stream would make them). A blocking copy
//! through a view is the exception: it runs on the legacy stream, which then stands among the
//! mapping's users, so the next use on another stream, and the unmap, wait for whatever the
//! blocking streams had queued before it.
//!
//! Refused before any driver call, each with its own error: an offset, or an address, that is not
//! a multiple of the granularity (`Misaligned`), memory that does not fit wholly inside the range
//! (`OutOfRange`), a mapping over mapped space or of physical memory that is mapped already
//! (`AlreadyMapped`: a second mapping would be a second view of the same bytes, with its own
//! stream order, and the exclusive views and guards of each would no longer be exclusive), access
//! for a device that cannot reach the memory (`NotSupported { feature: PeerAccess }`).
//!
//! That refusal covers one [`PhysicalMemory`] object. Shareable memory is where it ends: an
//! import ([`PhysicalMemory::import_fd`]) is a second object over the same bytes, here or in
//! another process, and its mapping has a stream order of its own. That is why importing is the
//! `unsafe` step: its caller promises to order the accesses of all the mappings.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::Device;
//! use cumem_vmm::{Access, Granularity, PhysicalMemory, VirtualRange};
//! let ctx = Device::get(0)?.context()?;
//! if ctx.device().capabilities()?.virtual_memory {
//!     let g = Granularity::of(ctx.device())?.minimum;
//!     let range = VirtualRange::reserve(&ctx, 4 * g)?;
//!     let memory = PhysicalMemory::new(&ctx, g)?;
//!     let mut mapping = range.map(g, &memory)?; // the second granule of the range
//!     drop(memory); // the mapping keeps the physical memory alive
//!     mapping.set_access(&[(ctx.device(), Access::ReadWrite)])?;
//!     assert_eq!(mapping.access(ctx.device())?, Access::ReadWrite);
//!     let data: Vec<u32> = (0..1024).collect();
//!     let mut view = mapping.as_mut_slice::<u32>()?;
//!     cumem_copy::copy_h2d(&data, &mut view.slice_mut(..1024)?)?;
//!     assert_eq!(mapping.as_slice::<u32>()?.slice(..1024)?.to_vec()?, data);
//!     assert!(range.map(0, &PhysicalMemory::new(&ctx, 2 * g)?).is_err()); // over the mapping
//! }
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use bytemuck::AnyBitPattern;
use cumem_core::sys::CUdeviceptr;
use cumem_core::{
    Context, Device, DeviceSlice, DeviceSliceMut, Error, ErrorContext, Feature, Result, Stream, StreamOrder,
};

use crate::{Access, HandleTypes, PhysicalMemory, VirtualRange, ffi};

mod sealed {
    pub trait Sealed {}
    impl Sealed for &crate::VirtualRange {}
    impl Sealed for std::sync::Arc<crate::VirtualRange> {}
}

/// How a mapping holds its range: borrowed (`&VirtualRange`) or shared (`Arc<VirtualRange>`).
/// Sealed: a holder must always name the same range.
pub trait RangeHolder: Deref<Target = VirtualRange> + sealed::Sealed {}
impl RangeHolder for &VirtualRange {}
impl RangeHolder for Arc<VirtualRange> {}

/// A mapping that borrows its range and cannot outlive it:
///
/// ```compile_fail,E0597
/// # cumem_sys::testing::init();
/// use cumem_core::Device;
/// use cumem_vmm::{PhysicalMemory, VirtualRange};
/// let ctx = Device::get(0)?.context()?;
/// let memory = PhysicalMemory::new(&ctx, 2 << 20)?;
/// let mapping = {
///     let range = VirtualRange::reserve(&ctx, 2 << 20)?;
///     range.map(0, &memory)?
/// }; // `range` does not live long enough
/// # Ok::<(), cumem_core::Error>(())
/// ```
pub type Mapping<'r> = MappingIn<&'r VirtualRange>;

/// A mapping that keeps its range alive through an `Arc`.
pub type SharedMapping = MappingIn<Arc<VirtualRange>>;

/// Physical memory mapped at an offset of a [`VirtualRange`] (`cuMemMap` / `cuMemUnmap`).
pub struct MappingIn<R: RangeHolder> {
    range: R,
    offset: usize,
    size: usize,
    /// The context of the physical memory's device: its views belong to it.
    ctx: Context,
    handle_types: HandleTypes,
    /// The access of the memory's own device, as last set (views need it).
    own_access: Access,
    /// Device work through the views, started by the first view (or [`MappingIn::order`]) on a
    /// non-blocking stream of the mapping's own: unset while nothing can have used the mapping, so
    /// that a mapping never viewed (a growable buffer's chunk) costs no stream and its unmap
    /// waits for nothing. Not the legacy stream: its marker comes after all the work of the
    /// context's blocking streams, which the first use, and so the unmap, would wait for.
    order: OnceLock<StreamOrder>,
    /// The physical memory's "mapped" flag, cleared once this mapping is gone.
    memory_mapped: Arc<AtomicBool>,
    /// Unmapped by [`MappingIn::unmap`] already: nothing left for `Drop`.
    unmapped: bool,
}

impl<R: RangeHolder> MappingIn<R> {
    /// Maps all of `memory` at `offset` bytes into `range`. Always all of it: the driver maps
    /// only a whole allocation (observed on an H100, 2026-11-23), so there is no way to ask for a
    /// part.
    ///
    /// Refused before any driver call: `offset`, or the address it gives (the range's base plus
    /// `offset`), not a multiple of the minimum granularity of the range's or the memory's device
    /// (`Misaligned`, `what` "mapping offset" or "mapping address"); `[offset, offset +
    /// memory.bytes())` not wholly inside the range (`OutOfRange`); any of it mapped already, or
    /// `memory` mapped already anywhere (`AlreadyMapped`). An import whose
    /// [`import_fd`](PhysicalMemory::import_fd) size is not the exported memory's is refused by
    /// the driver, reported as `InvalidValue` naming that size (and nothing is mapped).
    pub fn new(range: R, offset: usize, memory: &PhysicalMemory) -> Result<Self> {
        let ptr = check_placement(
            [range.granularity().minimum, memory.granularity().minimum],
            range.base(),
            offset,
        )?;
        let size = memory.bytes();
        let Some(memory_mapped) = memory.claim_mapping() else {
            return Err(Error::AlreadyMapped {
                ctx: ErrorContext::op("VirtualRange::map (physical memory mapped already)").bytes(size),
            });
        };
        if let Err(e) = range.claim(offset, size) {
            memory_mapped.store(false, Ordering::Release);
            return Err(e);
        }
        let mapped = range.context().bind().and_then(|()| {
            // SAFETY: the span lies inside the live reservation and nothing is mapped there (both
            // checked by the claim, which every mapping of this range takes first). `memory` is a
            // live allocation, mapped through no other mapping of this object (its flag, just
            // claimed), of `size` bytes when this process created it; an import's size is its
            // caller's word, which the driver checks: it maps only a whole allocation and answers
            // NOT_SUPPORTED to any other size (observed on an H100, 2026-11-23), so a wrong size
            // maps nothing. (An import is another object over the same bytes: see `as_slice` on
            // why the views stay sound.)
            unsafe { ffi::map(ptr, size, memory.raw()) }
        });
        let mapped = mapped.map_err(|e| wrong_import_size(e, memory));
        if let Err(e) = mapped {
            range.unclaim(offset, size);
            memory_mapped.store(false, Ordering::Release);
            return Err(e);
        }
        Ok(MappingIn {
            range,
            offset,
            size,
            ctx: memory.context().clone(),
            handle_types: memory.handle_types(),
            own_access: Access::None,
            order: OnceLock::new(),
            memory_mapped,
            unmapped: false,
        })
    }

    /// The range the memory is mapped into.
    pub fn range(&self) -> &VirtualRange {
        &self.range
    }

    /// Offset of the mapping in its range, in bytes.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The first mapped address.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.range.base() + self.offset as u64
    }

    /// The device the physical memory is on.
    pub fn device(&self) -> Device {
        self.ctx.device()
    }

    /// The context of that device, which the views belong to.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The handle types of the mapped memory.
    pub fn handle_types(&self) -> HandleTypes {
        self.handle_types
    }

    /// The stream order that the views' work goes through, which the unmap and
    /// [`MappingIn::set_access`] wait for. Work may be queued through it directly (`use_on`,
    /// `queue_on` with [`MappingIn::device_ptr`]); it is waited for as the views' work is.
    ///
    /// Its first call (or first view) starts it on a new non-blocking stream of the mapping's own
    /// (a `cuStreamCreate`; the stream lives until the order lets go of it, at the first use on
    /// another stream), on which cumem queues no work: a first use on a stream then waits for
    /// nothing. If that
    /// stream cannot be created here (the driver refuses, which this infallible accessor cannot
    /// report), the order starts on the legacy stream instead, logged with `tracing::warn!`:
    /// still correct, but a first use then waits for the work queued so far on the context's
    /// blocking streams. A view taken first reports that failure instead.
    pub fn order(&self) -> &StreamOrder {
        match self.started_order() {
            Ok(order) => order,
            Err(e) => {
                tracing::warn!(ptr = self.device_ptr(), error = %e, "no stream for the mapping's order; it starts on the legacy stream");
                self.order.get_or_init(|| StreamOrder::new(&Stream::legacy(&self.ctx)))
            }
        }
    }

    /// The order, started on a new non-blocking stream if nothing has used the mapping yet.
    fn started_order(&self) -> Result<&StreamOrder> {
        if let Some(order) = self.order.get() {
            return Ok(order);
        }
        // Two threads viewing the mapping at once may both create one: the loser's is destroyed.
        let idle = Stream::non_blocking(&self.ctx)?;
        Ok(self.order.get_or_init(|| StreamOrder::new(&idle)))
    }

    /// Waits for the device work queued through the views and the order (none if it was never
    /// started). Exclusive, so without the order's lock: see `unmap_in_place`.
    fn wait_for_users(&mut self) -> Result<()> {
        match self.order.get_mut() {
            Some(order) => order.join_mut()?.synchronize(),
            None => Ok(()),
        }
    }

    /// Sets each device's access to the whole mapping (`cuMemSetAccess`), after the device work
    /// queued through its views has completed (access may be taken away).
    ///
    /// Refused before any driver call: an empty list (`ZeroSize`); a device without VMM
    /// (`NotSupported { feature: VirtualMemory }`); a device other than the memory's that cannot
    /// access it (`NotSupported { feature: PeerAccess, device }`).
    pub fn set_access(&mut self, access: &[(Device, Access)]) -> Result<()> {
        if access.is_empty() {
            return Err(Error::ZeroSize { what: "access list" });
        }
        let owner = self.device();
        for &(device, _) in access {
            crate::access::require_reach(device, owner)?;
        }
        self.wait_for_users()?;
        let raw: Vec<_> = access.iter().map(|&(d, a)| (d.raw(), a.flags())).collect();
        self.ctx.bind()?;
        ffi::set_access(self.device_ptr(), self.size, &raw)?;
        if let Some(&(_, a)) = access.iter().rev().find(|(d, _)| *d == owner) {
            self.own_access = a;
        }
        Ok(())
    }

    /// The access `device` has to the mapping, as the driver reports it (`cuMemGetAccess`).
    pub fn access(&self, device: Device) -> Result<Access> {
        self.ctx.bind()?;
        let flags = ffi::get_access(self.device_ptr(), device.raw())?;
        Access::from_flags(flags)
            .ok_or(Error::InvalidValue { ctx: ErrorContext::op("cuMemGetAccess (unknown flags)") })
    }

    /// The whole mapping as `size / size_of::<T>()` values of `T`, for copies that read it.
    ///
    /// Needs read access for the memory's device (`NotPermitted` otherwise, before any copy could
    /// fault) and a sized `T` whose alignment divides the granularity (`ZeroSize`, `Misaligned`).
    /// The first view (or [`MappingIn::order`]) creates the order's stream (`cuStreamCreate`),
    /// whose error it returns; like any stream creation, it may wait while another thread is in
    /// `cuMemFree` (§17 of the driver brief), so take the first view outside another memory's
    /// `queue_on` closure, whose order stays locked while it waits.
    pub fn as_slice<T: AnyBitPattern>(&self) -> Result<DeviceSlice<'_, T>> {
        let len = self.view_len::<T>(self.own_access.can_read())?;
        let order = self.started_order()?;
        // SAFETY: the mapping is `size` bytes of device memory of `ctx`'s device, readable by it
        // (checked), granularity-aligned (so aligned for T, checked), any bytes are a valid T, and
        // it stays mapped while the view borrows `self`; this physical memory object is mapped
        // nowhere else (`new` claimed it), so all device work through it goes through views of
        // this mapping, ordered through `order`, which the unmap waits for; writes need `&mut
        // self`. Shareable memory may also be mapped through an import (here or in another
        // process), whose work this order does not see: the caller of the `unsafe`
        // `PhysicalMemory::import_fd` promised to order every access across the mappings, so
        // none races with this view's (item 1 of its safety list).
        Ok(unsafe { DeviceSlice::from_raw_parts(self.device_ptr(), len, order, &self.ctx) })
    }

    /// The whole mapping as values of `T`, for copies and memsets that write it (needs read-write
    /// access for the memory's device; see [`MappingIn::as_slice`]).
    pub fn as_mut_slice<T: AnyBitPattern>(&mut self) -> Result<DeviceSliceMut<'_, T>> {
        let len = self.view_len::<T>(self.own_access.can_write())?;
        let order = self.started_order()?;
        // SAFETY: as in `as_slice`, with write access checked; the view borrows `self` exclusively.
        Ok(unsafe { DeviceSliceMut::from_raw_parts(self.device_ptr(), len, order, &self.ctx) })
    }

    /// Unmaps now (`cuMemUnmap`), after the device work queued through its views has completed,
    /// reporting what `Drop` can only log. On failure the mapping is handed back, still mapped,
    /// with the error: drop it to try again (and log), or keep it.
    #[expect(clippy::result_large_err, reason = "rare and off the hot path; the mapping itself comes back")]
    pub fn unmap(mut self) -> std::result::Result<(), (Self, Error)> {
        match self.unmap_in_place() {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }

    /// Waits for the views' work, unmaps, and returns the claims on the range and the memory.
    /// On an error nothing was unmapped.
    fn unmap_in_place(&mut self) -> Result<()> {
        // `join_mut` (exclusive, no lock) and a wait on the stream it returns, not
        // `StreamOrder::synchronize`, whose lock is refused inside a `StreamOrder::queue_on`
        // closure: a mapping dropped there is unmapped instead of leaked.
        self.wait_for_users()?;
        let ptr = self.device_ptr();
        self.range.context().bind()?;
        // SAFETY: `[ptr, ptr + size)` is exactly the mapping made in `new`, unmapped only here
        // (`unmapped` is set below and checked by every caller); no view is alive (`&mut self`)
        // and the work of past views has completed (above).
        unsafe { ffi::unmap(ptr, self.size) }?;
        self.unmapped = true;
        self.range.unclaim(self.offset, self.size);
        self.memory_mapped.store(false, Ordering::Release);
        Ok(())
    }

    fn view_len<T>(&self, allowed: bool) -> Result<usize> {
        if size_of::<T>() == 0 {
            return Err(Error::ZeroSize { what: "element size" });
        }
        if !(self.device_ptr()).is_multiple_of(align_of::<T>() as u64) {
            return Err(Error::Misaligned {
                what: "mapping address",
                value: self.device_ptr(),
                align: align_of::<T>() as u64,
            });
        }
        if !allowed {
            return Err(Error::NotPermitted {
                ctx: ErrorContext::op("mapping view (set access for its device first)"),
            });
        }
        Ok(self.size / size_of::<T>())
    }
}

/// The address of a mapping at `offset` of a range based at `base`, refused with `Misaligned`
/// unless the offset, and then the address, are multiples of each of `granularities` (the minimum
/// of the range's device and of the memory's, which may differ). The base is the driver's choice:
/// a driver that honoured an alignment below a granularity, or a device of a coarser granularity
/// than the range's, leaves an aligned offset at a misaligned address.
fn check_placement(granularities: [usize; 2], base: CUdeviceptr, offset: usize) -> Result<CUdeviceptr> {
    let misaligned = |what, value: u64, g: usize| {
        (!value.is_multiple_of(g as u64)).then_some(Error::Misaligned { what, value, align: g as u64 })
    };
    // Wrapping: an offset past the range is refused by the claim, after this; and a sum of
    // multiples of a power of two stays one modulo 2^64.
    let ptr = base.wrapping_add(offset as u64);
    let first = granularities
        .iter()
        .find_map(|&g| misaligned("mapping offset", offset as u64, g))
        .or_else(|| granularities.iter().find_map(|&g| misaligned("mapping address", ptr, g)));
    first.map_or(Ok(ptr), Err)
}

/// The driver's `NOT_SUPPORTED` from `cuMemMap` of an import, as the error it most likely is: the
/// size given to [`PhysicalMemory::import_fd`] is not the exported memory's (the driver maps only
/// a whole allocation, and this process cannot ask the memory's size). Other errors pass through.
fn wrong_import_size(e: Error, memory: &PhysicalMemory) -> Error {
    match e {
        Error::NotSupported { feature: Feature::Driver("cuMemMap"), .. } if memory.is_imported() => {
            Error::InvalidValue {
                ctx: ErrorContext::op(
                    "VirtualRange::map (driver: CUDA_ERROR_NOT_SUPPORTED; cuMemMap maps only a whole \
                     allocation, so most likely the size given to PhysicalMemory::import_fd is not the \
                     exported memory's size)",
                )
                .bytes(memory.bytes())
                .device(memory.device().raw()),
            }
        }
        e => e,
    }
}

impl<R: RangeHolder> fmt::Debug for MappingIn<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mapping")
            .field("ptr", &format_args!("{:#x}", self.device_ptr()))
            .field("size", &self.size)
            .field("device", &self.device().ordinal())
            .field("access", &self.own_access)
            .finish()
    }
}

impl<R: RangeHolder> Drop for MappingIn<R> {
    fn drop(&mut self) {
        if !self.unmapped
            && let Err(e) = self.unmap_in_place()
        {
            // Unmapping under pending work would fault it: keep the mapping (and its range).
            tracing::warn!(ptr = self.device_ptr(), size = self.size, error = %e, "unmapping failed; the mapping is leaked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapping_is_placed_only_at_an_offset_and_an_address_aligned_to_both_granularities() {
        let g = 2 << 20;
        assert_eq!(check_placement([g, g], 8 * g as u64, 3 * g).unwrap(), 11 * g as u64);
        let e = check_placement([g, g], 8 * g as u64, g / 2).unwrap_err();
        assert!(
            matches!(e, Error::Misaligned { what: "mapping offset", value, .. } if value == g as u64 / 2),
            "{e}"
        );
        // Memory of a device with a coarser granularity than the range's: the offset is aligned
        // to both, the address (a base aligned to the range's only) is not.
        let e = check_placement([g, 2 * g], 3 * g as u64, 2 * g).unwrap_err();
        assert!(
            matches!(e, Error::Misaligned { what: "mapping address", value, align } if value == 5 * g as u64 && align == 2 * g as u64),
            "{e}"
        );
        // A base the driver aligned to less than the granularity asked for.
        let e = check_placement([g, g], g as u64 + 4096, 0).unwrap_err();
        assert!(matches!(e, Error::Misaligned { what: "mapping address", .. }), "{e}");
    }
}
