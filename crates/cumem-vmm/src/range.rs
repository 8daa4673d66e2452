//! `VirtualRange`: a reservation of device address space, freed when dropped.
//!
//! A reservation holds no memory: it is a stretch of the process's unified address space that
//! nothing else will be placed in, so that physical memory mapped into it later lands at
//! addresses chosen now. That is what lets a [`GrowableBuffer`](crate::GrowableBuffer) grow
//! without moving. The range remembers which parts are mapped, so that mapping over mapped space
//! is refused before the driver is called, and mappings borrow it (or hold it in an `Arc`), so it
//! cannot be freed under them.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::Device;
//! use cumem_vmm::{Granularity, VirtualRange};
//! let ctx = Device::get(0)?.context()?;
//! if ctx.device().capabilities()?.virtual_memory {
//!     let g = Granularity::of(ctx.device())?.minimum;
//!     let range = VirtualRange::reserve(&ctx, 8 * g)?;
//!     assert_eq!(range.size(), 8 * g);
//!     assert_eq!(range.base() % g as u64, 0);
//!     assert_eq!(range.mapped_bytes(), 0);
//!     assert!(VirtualRange::reserve(&ctx, g / 2).is_err()); // not a multiple of the granularity
//! }
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::sync::Arc;

use cumem_core::sys::CUdeviceptr;
use cumem_core::{Context, Error, ErrorContext, Result};
use parking_lot::Mutex;

use crate::intervals::Intervals;
use crate::mapping::{Mapping, MappingIn};
use crate::{Granularity, PhysicalMemory, SharedMapping, ffi};

/// How to place a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReserveOptions {
    /// Alignment of the base address: 0 for the driver's default (the granularity), else a power
    /// of two. One below the minimum granularity is asked for as the granularity: every mapping
    /// lands at a multiple of it from the base, so a base aligned to less would misalign them all,
    /// and a driver may honour a smaller alignment where the simulator does not.
    pub alignment: usize,
    /// An address to place the range at, a multiple of the granularity. Only a hint: the driver
    /// may place the range elsewhere if that address is taken; read [`VirtualRange::base`].
    pub address: Option<CUdeviceptr>,
}

impl ReserveOptions {
    /// Asks for a base aligned to `alignment` (a power of two; at least the granularity is asked
    /// for, see [`ReserveOptions::alignment`](ReserveOptions#structfield.alignment)).
    pub fn alignment(mut self, alignment: usize) -> Self {
        self.alignment = alignment;
        self
    }

    /// Asks for the range to start at `address` (a hint).
    pub fn address(mut self, address: CUdeviceptr) -> Self {
        self.address = Some(address);
        self
    }
}

/// Reserved device address space (`cuMemAddressReserve` / `cuMemAddressFree`).
pub struct VirtualRange {
    ctx: Context,
    base: CUdeviceptr,
    size: usize,
    granularity: Granularity,
    /// Offsets of the mapped parts.
    mapped: Mutex<Intervals>,
    /// Set by [`VirtualRange::free`], which made the one free already (or leaked the range): the
    /// drop does nothing.
    freed: bool,
}

impl VirtualRange {
    /// Reserves `size` bytes (a non-zero multiple of the minimum granularity of `ctx`'s device)
    /// wherever the driver chooses.
    pub fn reserve(ctx: &Context, size: usize) -> Result<VirtualRange> {
        VirtualRange::reserve_with(ctx, size, ReserveOptions::default())
    }

    /// Reserves `size` bytes placed as `options` ask.
    ///
    /// Refused before any driver call but the device's granularity query (made once per device
    /// and process): a device without VMM (`NotSupported { feature:
    /// VirtualMemory }`), a zero size (`ZeroSize`), a size or address hint that is not a multiple
    /// of the minimum granularity (`Misaligned`), an alignment that is not a power of two
    /// (`InvalidValue`, naming it in bytes). A non-zero alignment below the granularity is raised
    /// to the granularity, so the base is a multiple of it whatever the driver does with small
    /// alignments.
    pub fn reserve_with(ctx: &Context, size: usize, options: ReserveOptions) -> Result<VirtualRange> {
        let granularity = Granularity::of(ctx.device())?;
        if size == 0 {
            return Err(Error::ZeroSize { what: "reservation size" });
        }
        granularity.check("reservation size", size as u64)?;
        let alignment = alignment_to_ask(options.alignment, granularity.minimum)?;
        let hint = options.address.unwrap_or(0);
        granularity.check("reservation address", hint)?;
        if hint.checked_add(size as u64).is_none() {
            return Err(Error::OutOfRange { start: hint as usize, end: usize::MAX, len: size });
        }
        ctx.bind()?;
        let base = ffi::address_reserve(size, alignment, hint)?;
        Ok(VirtualRange {
            ctx: ctx.clone(),
            base,
            size,
            granularity,
            mapped: Mutex::new(Intervals::default()),
            freed: false,
        })
    }

    /// The first address of the range.
    pub fn base(&self) -> CUdeviceptr {
        self.base
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The context the range was reserved in (bound to free it).
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The granularity of the reserving context's device.
    pub fn granularity(&self) -> Granularity {
        self.granularity
    }

    /// Bytes of the range that are mapped now.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped.lock().bytes()
    }

    /// Maps all of `memory` at `offset` bytes into the range; the mapping cannot outlive the range.
    /// See [`MappingIn::new`] for what is refused before the driver is called.
    pub fn map<'r>(&'r self, offset: usize, memory: &PhysicalMemory) -> Result<Mapping<'r>> {
        MappingIn::new(self, offset, memory)
    }

    /// Maps all of `memory` at `offset` bytes into the range, keeping the range alive through its
    /// `Arc`: for owners that hold a range and its mappings side by side.
    pub fn map_shared(self: &Arc<Self>, offset: usize, memory: &PhysicalMemory) -> Result<SharedMapping> {
        MappingIn::new(Arc::clone(self), offset, memory)
    }

    /// Frees the reservation now (`cuMemAddressFree`), as the drop does, but returns the driver's
    /// error instead of logging it: for an owner that must not log where it calls this (under its
    /// own locks, say) and notes the failure to log it later. Mappings borrow the range or hold
    /// its `Arc` (take it back with [`Arc::into_inner`]), so none of them is alive here.
    ///
    /// # Errors
    /// `InvalidValue` naming `VirtualRange::free`, before any driver call, if part of the range is
    /// still mapped: a mapping that was leaked (`mem::forget`) or failed to unmap is still in the
    /// driver, and freeing its addresses would let a later reservation land on live memory. The
    /// driver's error binding the context or freeing. The reservation is then leaked (the free is
    /// not tried again).
    ///
    /// ```
    /// # cumem_sys::testing::init();
    /// use cumem_core::Device;
    /// use cumem_vmm::{Granularity, PhysicalMemory, VirtualRange};
    /// use std::sync::Arc;
    /// let ctx = Device::get(0)?.context()?;
    /// if ctx.device().capabilities()?.virtual_memory {
    ///     let g = Granularity::of(ctx.device())?.minimum;
    ///     let range = Arc::new(VirtualRange::reserve(&ctx, 2 * g)?);
    ///     let memory = PhysicalMemory::new(&ctx, g)?;
    ///     let mapping = range.map_shared(g, &memory)?; // holds the range too
    ///     drop((mapping, memory)); // unmapped, then released
    ///     let range = Arc::into_inner(range).expect("the mapping's hold went with it");
    ///     assert_eq!(range.mapped_bytes(), 0);
    ///     range.free()?;
    /// }
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn free(mut self) -> Result<()> {
        // Set first: whatever happens here, the drop that follows neither frees nor warns.
        self.freed = true;
        if !self.mapped.get_mut().is_empty() {
            return Err(Error::InvalidValue {
                ctx: ErrorContext::op(
                    "VirtualRange::free (part of the range is still mapped; the reservation is leaked)",
                )
                .bytes(self.size),
            });
        }
        self.address_free()
    }

    /// The one `cuMemAddressFree` of the reservation (by [`VirtualRange::free`] or the drop,
    /// whichever comes first: the other sees `freed`), once nothing is mapped in it.
    fn address_free(&mut self) -> Result<()> {
        debug_assert!(self.mapped.get_mut().is_empty(), "checked by both callers");
        self.ctx.bind().and_then(|()| {
            // SAFETY: `base`/`size` are exactly the reservation made in `reserve_with`, freed only
            // here, once (`free` sets `freed` first, so the drop after it frees nothing), and
            // nothing is mapped in it (checked by both callers: every mapping claims its span
            // before mapping and returns it only once unmapped).
            unsafe { ffi::address_free(self.base, self.size) }
        })
    }

    /// Claims `[offset, offset + size)` for a mapping about to be made, after checking that it lies
    /// inside the range and overlaps no mapping.
    pub(crate) fn claim(&self, offset: usize, size: usize) -> Result<()> {
        let end = offset.checked_add(size).filter(|&end| end <= self.size);
        let Some(end) = end else {
            return Err(Error::OutOfRange {
                start: offset,
                end: offset.saturating_add(size),
                len: self.size,
            });
        };
        self.mapped.lock().claim(offset, end).map_err(|_| Error::AlreadyMapped {
            ctx: ErrorContext::op("VirtualRange::map (over mapped space)").bytes(size),
        })
    }

    /// Returns a claim once its mapping is gone (or was never made).
    pub(crate) fn unclaim(&self, offset: usize, size: usize) {
        let released = self.mapped.lock().release(offset, offset + size);
        debug_assert!(released, "a mapping's claim is returned once");
    }
}

/// The alignment to pass to `cuMemAddressReserve` for `alignment` asked for on a device of
/// minimum granularity `granularity` (a power of two): 0 (the driver's default, the granularity)
/// stays, one below the granularity is raised to it, a power of two above it stays; anything else
/// is `InvalidValue` naming it.
fn alignment_to_ask(alignment: usize, granularity: usize) -> Result<usize> {
    if alignment == 0 {
        return Ok(0);
    }
    if !alignment.is_power_of_two() {
        return Err(Error::InvalidValue {
            ctx: ErrorContext::op("VirtualRange::reserve_with (the alignment is not a power of two)")
                .bytes(alignment),
        });
    }
    Ok(alignment.max(granularity))
}

impl fmt::Debug for VirtualRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VirtualRange")
            .field("base", &format_args!("{:#x}", self.base))
            .field("size", &self.size)
            .field("mapped_bytes", &self.mapped_bytes())
            .finish()
    }
}

impl Drop for VirtualRange {
    fn drop(&mut self) {
        if self.freed {
            return;
        }
        if !self.mapped.get_mut().is_empty() {
            // A mapping that was leaked (mem::forget) or failed to unmap is still in the driver;
            // freeing its addresses would let a later reservation land on live memory.
            tracing::warn!(base = self.base, size = self.size, "a reservation with live mappings is leaked");
            return;
        }
        if let Err(e) = self.address_free() {
            tracing::warn!(base = self.base, size = self.size, error = %e, "cuMemAddressFree failed; the reservation is leaked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_alignment_below_the_granularity_is_asked_for_as_the_granularity() {
        let g = 2 << 20;
        assert_eq!(alignment_to_ask(0, g).unwrap(), 0, "the driver's default");
        for small in [1, 4096, g / 2] {
            assert_eq!(alignment_to_ask(small, g).unwrap(), g, "{small}");
        }
        assert_eq!(alignment_to_ask(g, g).unwrap(), g);
        assert_eq!(alignment_to_ask(32 * g, g).unwrap(), 32 * g);
    }

    #[test]
    fn an_alignment_that_is_not_a_power_of_two_is_an_invalid_value_naming_it() {
        let e = alignment_to_ask(3 << 21, 2 << 20).unwrap_err();
        assert!(matches!(e, Error::InvalidValue { ctx } if ctx.bytes == Some(3 << 21)), "{e}");
        assert!(e.to_string().contains("not a power of two"), "{e}");
    }
}
