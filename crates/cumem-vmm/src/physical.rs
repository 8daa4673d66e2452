//! `PhysicalMemory`: device memory with no address, released when dropped.
//!
//! `cuMemCreate` allocates physical memory on one device; it becomes usable once mapped into a
//! [`VirtualRange`](crate::VirtualRange) and given access. Dropping it drops the creation's
//! reference (`cuMemRelease`): the driver keeps the memory for as long as a mapping of it
//! remains, so it may be dropped right after mapping, and the memory is freed at the unmap.
//!
//! Memory created with [`HandleTypes::POSIX_FD`] can be shared: [`PhysicalMemory::export_fd`]
//! gives a file descriptor that another process receives (over a Unix socket, `SCM_RIGHTS`) and
//! turns back into physical memory with [`PhysicalMemory::import_fd`], which it maps like its
//! own. The bytes are the same; each side's object holds its own reference, and the memory lives
//! until every reference is released and every mapping unmapped. Importing is `unsafe`: two
//! objects over the same bytes give two mappings with separate stream orders, so the exclusive
//! views that cumem hands out stop being exclusive unless the program orders the two sides.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::Device;
//! use cumem_vmm::{Granularity, HandleTypes, PhysicalMemory};
//! let ctx = Device::get(0)?.context()?;
//! if ctx.device().capabilities()?.virtual_memory {
//!     let g = Granularity::of(ctx.device())?.minimum;
//!     let memory = PhysicalMemory::new(&ctx, 2 * g)?;
//!     assert_eq!((memory.bytes(), memory.device()), (2 * g, ctx.device()));
//!     assert_eq!(memory.handle_types(), HandleTypes::NONE);
//!     assert!(memory.export_fd().is_err()); // not created shareable
//!
//!     // Shareable memory is sized in its own granularity, which may differ from the plain one.
//!     let sg = Granularity::with_handle_types(ctx.device(), HandleTypes::POSIX_FD)?.minimum;
//!     let shared = PhysicalMemory::with_handle_types(&ctx, sg, HandleTypes::POSIX_FD)?;
//!     let fd = shared.export_fd()?; // send it, and `sg`, to another process
//!     // SAFETY: neither object is mapped here, so no two accesses to the bytes can race.
//!     let imported = unsafe { PhysicalMemory::import_fd(&ctx, &fd, sg)? }; // what that process does
//!     assert!(imported.is_imported() && !shared.is_imported());
//!     assert_ne!(imported.raw(), shared.raw()); // a second handle to the same bytes
//!     assert!(imported.export_fd().is_err()); // an import is not exported again
//! }
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cumem_core::sys::{CUmemGenericAllocationHandle, CUresult};
use cumem_core::{Context, Device, Error, ErrorContext, Result};

use crate::{Granularity, HandleTypes, ffi};

/// Physical device memory (`cuMemCreate` / `cuMemRelease`).
pub struct PhysicalMemory {
    handle: CUmemGenericAllocationHandle,
    ctx: Context,
    bytes: usize,
    granularity: Granularity,
    /// Set while a mapping of this memory exists (shared with that mapping, which clears it when it
    /// unmaps): two mappings would be two views with separate stream orders over the same bytes.
    mapped: Arc<AtomicBool>,
    /// Made by `import_fd` (a reference to memory created elsewhere) rather than `cuMemCreate`.
    imported: bool,
    /// Set by [`PhysicalMemory::release`], which made the one release already: the drop makes none.
    released: bool,
}

impl PhysicalMemory {
    /// `bytes` of pinned memory on `ctx`'s device, private to this process.
    pub fn new(ctx: &Context, bytes: usize) -> Result<PhysicalMemory> {
        PhysicalMemory::with_handle_types(ctx, bytes, HandleTypes::NONE)
    }

    /// `bytes` of pinned memory on `ctx`'s device that may later be exported as `handle_types`.
    ///
    /// Refused before any VMM call but the granularity query (made once per device, handle types
    /// and process): a device without VMM (`NotSupported { feature:
    /// VirtualMemory }`), a handle type the device cannot export (`NotSupported { feature:
    /// ShareableHandle(name) }`, from its attributes), zero bytes (`ZeroSize`), a size that is
    /// not a multiple of the minimum granularity for these handle types (`Misaligned`). The
    /// device's capacity is charged now.
    pub fn with_handle_types(
        ctx: &Context,
        bytes: usize,
        handle_types: HandleTypes,
    ) -> Result<PhysicalMemory> {
        let granularity = Granularity::with_handle_types(ctx.device(), handle_types)?;
        if bytes == 0 {
            return Err(Error::ZeroSize { what: "physical allocation" });
        }
        granularity.check("physical allocation size", bytes as u64)?;
        ctx.bind()?;
        let handle = ffi::create(bytes, ctx.device().raw(), handle_types.bits())?;
        Ok(PhysicalMemory {
            handle,
            ctx: ctx.clone(),
            bytes,
            granularity,
            mapped: Arc::default(),
            imported: false,
            released: false,
        })
    }

    /// A new POSIX file descriptor of this memory (`cuMemExportToShareableHandle`), for another
    /// process to [import](PhysicalMemory::import_fd). Each call gives a new descriptor; closing
    /// it (dropping the `OwnedFd`) does not affect the memory or earlier imports.
    ///
    /// Refused with `InvalidValue` (the driver's answer) before any driver call: memory created
    /// without [`HandleTypes::POSIX_FD`] (`driver-api.md` §17), and an import (observed on an
    /// H100, 2026-11-23: an imported handle has no handle types and its export is refused; send
    /// the descriptor you imported from instead).
    pub fn export_fd(&self) -> Result<OwnedFd> {
        if self.imported {
            return Err(Error::InvalidValue {
                ctx: ErrorContext::op(
                    "PhysicalMemory::export_fd (an import has no handle types and cannot be exported again)",
                )
                .bytes(self.bytes)
                .device(self.device().raw()),
            });
        }
        if !self.handle_types().contains(HandleTypes::POSIX_FD) {
            return Err(Error::InvalidValue {
                ctx: ErrorContext::op(
                    "PhysicalMemory::export_fd (memory created without HandleTypes::POSIX_FD)",
                )
                .bytes(self.bytes)
                .device(self.device().raw()),
            });
        }
        self.ctx.bind()?;
        ffi::export_fd(self.handle)
    }

    /// Physical memory from a descriptor that [`PhysicalMemory::export_fd`] made, here or in
    /// another process (`cuMemImportFromShareableHandle`). `fd` is only borrowed: close it when
    /// convenient, the import holds its own reference to the memory.
    ///
    /// A descriptor does not say how large the memory is and the driver has no query for it, so
    /// `bytes` is the exporter's [`PhysicalMemory::bytes`], sent along with the descriptor, and it
    /// must be exactly that. The import itself cannot tell a wrong size: it is found when the
    /// memory is mapped, because the driver maps only a whole allocation (observed on an H100,
    /// 2026-11-23: `cuMemMap` of a prefix, or of more than the memory holds, is `NOT_SUPPORTED`
    /// for created and imported memory alike). [`VirtualRange::map`](crate::VirtualRange::map)
    /// reports that answer for an import as `InvalidValue` naming the size given here, and maps
    /// nothing.
    ///
    /// Refused before any driver call: zero bytes (`ZeroSize`), a device without VMM
    /// (`NotSupported { feature: VirtualMemory }`) or without POSIX descriptor handles
    /// (`NotSupported { feature: ShareableHandle(..) }`), a size that is not a multiple of the
    /// granularity (`Misaligned`), and descriptor 0 (`InvalidValue` naming
    /// `PhysicalMemory::import_fd`): the driver takes a descriptor of 0 for a NULL handle and
    /// answers `INVALID_VALUE` whatever it names, exported memory too (observed on an H100,
    /// 2026-11-23, second run), so memory received as descriptor 0 must be moved to another
    /// number (`dup`) before it is imported.
    ///
    /// A descriptor that is not exported memory (a regular file, `/dev/null`, a pipe, a socket,
    /// a closed number) is `InvalidValue` naming `cuMemImportFromShareableHandle`: the driver
    /// answers `CUDA_ERROR_UNKNOWN` for each (observed on an H100, 2026-11-23, second run), which
    /// a caller could not match on, and that is its most likely cause, so cumem translates it and
    /// says so in the message. The error's [`Error::code`] is therefore `CUDA_ERROR_INVALID_VALUE`
    /// while the driver said `CUDA_ERROR_UNKNOWN`: cumem's [`Error`] carries a driver code other
    /// than its variant's only as [`Error::Cuda`], which would hide the likely cause, so the
    /// message names the driver's code instead.
    ///
    /// Memory on a device other than `ctx`'s is `WrongDevice` (the import is released again). The
    /// device and handle types are read from the memory
    /// (`cuMemGetAllocationPropertiesFromHandle`): an import reports no handle types (observed on
    /// an H100, 2026-11-23), so [`PhysicalMemory::handle_types`] is [`HandleTypes::NONE`] and
    /// [`PhysicalMemory::export_fd`] refuses it.
    ///
    /// # Safety
    /// The import and the exporter's memory are the same bytes behind two objects, and each of
    /// their mappings orders only the work queued through its own views: cumem can no longer
    /// make a `&mut` view or an [`OnStreamMut`](cumem_core::OnStreamMut) guard exclusive. So:
    /// 1. The program orders every access to the memory across all its mappings, in this process
    ///    and in every other one that maps it (synchronising the writer before telling the other
    ///    side to look, or an interprocess event), so that no access through one mapping races
    ///    with an access through another while a view or guard of either is alive: kernels
    ///    reached through a guard rely on its exclusivity as much as cumem's own copies do.
    /// 2. `bytes` is the exporter's [`PhysicalMemory::bytes`]: the process cannot ask the driver the
    ///    memory's size, and a larger `bytes` is kept from mapping past the memory only by the
    ///    driver's refusal of a map that is not the whole allocation (observed on an H100's driver,
    ///    580.159.04, 2026-11-23; reported as `InvalidValue` by
    ///    [`VirtualRange::map`](crate::VirtualRange::map)).
    ///
    /// Freeing is not the caller's concern: each side holds its own reference, so neither side's
    /// drop frees memory that the other still maps.
    pub unsafe fn import_fd(ctx: &Context, fd: impl AsFd, bytes: usize) -> Result<PhysicalMemory> {
        if bytes == 0 {
            return Err(Error::ZeroSize { what: "imported physical allocation" });
        }
        let device = ctx.device();
        let shareable = Granularity::with_handle_types(device, HandleTypes::POSIX_FD)?;
        shareable.check("imported physical allocation size", bytes as u64)?;
        if fd.as_fd().as_raw_fd() == 0 {
            return Err(Error::InvalidValue {
                ctx: ErrorContext::op(
                    "PhysicalMemory::import_fd (descriptor 0: the driver takes it for a NULL handle and \
                     refuses it whatever it names; dup it to another number first)",
                )
                .bytes(bytes)
                .device(device.raw()),
            });
        }
        ctx.bind()?;
        let handle = ffi::import_fd(fd.as_fd()).map_err(|e| not_exported_memory(e, device))?;
        let described = ffi::properties(handle).and_then(|(on, types)| {
            if on != device.raw() {
                return Err(Error::WrongDevice { expected: device.raw(), actual: on });
            }
            let granularity = Granularity::with_handle_types(device, HandleTypes::from_bits(types))?;
            granularity.check("imported physical allocation size", bytes as u64)?;
            Ok(granularity)
        });
        let granularity = match described {
            Ok(g) => g,
            Err(e) => {
                // SAFETY: `handle` is the reference the import just gave, released once here and
                // never used again.
                if let Err(release) = unsafe { ffi::release(handle) } {
                    tracing::warn!(handle, error = %release, "releasing a refused import failed; its reference is leaked");
                }
                return Err(e);
            }
        };
        Ok(PhysicalMemory {
            handle,
            ctx: ctx.clone(),
            bytes,
            granularity,
            mapped: Arc::default(),
            imported: true,
            released: false,
        })
    }

    /// Whether this memory came from [`PhysicalMemory::import_fd`] (it may alias memory that
    /// another object, here or in another process, maps too: the importer orders the two).
    pub fn is_imported(&self) -> bool {
        self.imported
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.ctx.device()
    }

    /// The context of that device.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The handle types it may be exported as (none for an import: the driver reports none).
    pub fn handle_types(&self) -> HandleTypes {
        self.granularity.handle_types
    }

    /// The granularity it was created with.
    pub fn granularity(&self) -> Granularity {
        self.granularity
    }

    /// The driver's handle (valid while `self` lives).
    pub fn raw(&self) -> CUmemGenericAllocationHandle {
        self.handle
    }

    /// Whether a mapping of this memory exists now (it may be mapped again once that one is gone).
    pub fn is_mapped(&self) -> bool {
        self.mapped.load(Ordering::Acquire)
    }

    /// Drops the creation's (or the import's) reference now (`cuMemRelease`), as the drop does, but
    /// returns the driver's error instead of logging it: for an owner that must not log where it
    /// calls this (under its own locks, say) and notes the failure to log it later. As with the
    /// drop, a mapping of the memory keeps it until it is unmapped; the memory is freed once both
    /// are gone.
    ///
    /// # Errors
    /// The driver's error binding the context or releasing: the reference is then leaked (the
    /// release is not tried again).
    ///
    /// ```
    /// # cumem_sys::testing::init();
    /// use cumem_core::Device;
    /// use cumem_vmm::{Granularity, PhysicalMemory, VirtualRange};
    /// let ctx = Device::get(0)?.context()?;
    /// if ctx.device().capabilities()?.virtual_memory {
    ///     let g = Granularity::of(ctx.device())?.minimum;
    ///     let range = VirtualRange::reserve(&ctx, g)?;
    ///     let memory = PhysicalMemory::new(&ctx, g)?;
    ///     let mapping = range.map(0, &memory)?;
    ///     memory.release()?; // the mapping keeps the memory until it is unmapped
    ///     assert_eq!(range.mapped_bytes(), g);
    ///     drop(mapping); // frees the memory
    ///     range.free()?;
    /// }
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn release(mut self) -> Result<()> {
        // Set first: whatever the release answers, the drop that follows makes no second one.
        self.released = true;
        self.release_reference()
    }

    /// The one `cuMemRelease` of this object's reference (by [`PhysicalMemory::release`] or the drop,
    /// whichever comes first: the other sees `released`).
    fn release_reference(&self) -> Result<()> {
        self.ctx.bind().and_then(|()| {
            // SAFETY: `handle` came from cuMemCreate in `with_handle_types` or from the import in
            // `import_fd`, and this is the one release of that reference (`release` sets
            // `released` first, so the drop after it makes none); mappings keep their own hold on
            // the memory in the driver.
            unsafe { ffi::release(self.handle) }
        })
    }

    /// Marks the memory mapped and returns the flag the mapping clears when it unmaps, or `None`
    /// if a mapping of it exists already.
    pub(crate) fn claim_mapping(&self) -> Option<Arc<AtomicBool>> {
        (!self.mapped.swap(true, Ordering::AcqRel)).then(|| Arc::clone(&self.mapped))
    }
}

/// The driver's `CUDA_ERROR_UNKNOWN` from `cuMemImportFromShareableHandle`, as the error it most
/// likely is: the descriptor is not exported memory (the H100 answered `UNKNOWN` for a regular
/// file, `/dev/null`, a pipe, a socket, a closed number and −1 alike, 2026-11-23). Other errors
/// pass through, a code newer than the bindings (also named `CUDA_ERROR_UNKNOWN`, its number in
/// `raw`) among them.
fn not_exported_memory(e: Error, device: Device) -> Error {
    match e {
        Error::Cuda { code: CUresult::CUDA_ERROR_UNKNOWN, raw, .. }
            if raw == CUresult::CUDA_ERROR_UNKNOWN as i32 =>
        {
            Error::InvalidValue {
                ctx: ErrorContext::op(
                    "cuMemImportFromShareableHandle (driver: CUDA_ERROR_UNKNOWN, its answer for a descriptor \
                 that is not exported memory (the likely cause))",
                )
                .device(device.raw()),
            }
        }
        e => e,
    }
}

impl fmt::Debug for PhysicalMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PhysicalMemory")
            .field("handle", &self.handle)
            .field("bytes", &self.bytes)
            .field("device", &self.device().ordinal())
            .field("handle_types", &self.handle_types())
            .field("imported", &self.imported)
            .finish()
    }
}

impl Drop for PhysicalMemory {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        if let Err(e) = self.release_reference() {
            tracing::warn!(handle = self.handle, bytes = self.bytes, error = %e, "cuMemRelease failed; the memory is leaked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the driver's own `CUDA_ERROR_UNKNOWN` (999) is read as "not exported memory"; a code
    /// newer than the bindings (named `CUDA_ERROR_UNKNOWN` too, its number in `raw`) passes
    /// through with that number.
    #[test]
    fn only_the_drivers_unknown_means_not_exported_memory() {
        cumem_sys::testing::init();
        let device = Device::get(0).unwrap();
        let unknown = |raw| Error::Cuda {
            code: CUresult::CUDA_ERROR_UNKNOWN,
            raw,
            ctx: ErrorContext::op("cuMemImportFromShareableHandle"),
        };
        assert!(matches!(not_exported_memory(unknown(999), device), Error::InvalidValue { .. }));
        let newer = not_exported_memory(unknown(36), device);
        assert_eq!(newer.raw_code(), Some(36), "{newer:?}");
        let other = Error::Cuda {
            code: CUresult::CUDA_ERROR_INVALID_VALUE,
            raw: 1,
            ctx: ErrorContext::op("cuMemImportFromShareableHandle"),
        };
        assert_eq!(not_exported_memory(other, device).raw_code(), Some(1));
    }
}
