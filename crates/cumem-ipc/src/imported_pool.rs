//! [`ImportedPool`]: another process's [`ShareablePool`](crate::ShareablePool), imported here to
//! import pointers from it.
//!
//! The importing side of a pool export: the descriptor arrives over a Unix socket
//! ([`fd_passing::recv_fds`](crate::fd_passing::recv_fds)), the pointer bytes over any channel.
//! The complete two-process example is the test `crates/cumem-ipc/tests/pool_two_processes.rs`;
//! in one process it looks like this (an H100 imports a pool and its pointers in the exporting
//! process, 2026-11-23, as the simulator does; a second import of the same export while the first
//! lives is refused with [`Error::AlreadyMapped`](cumem_core::Error::AlreadyMapped)):
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DeviceBuffer, Stream};
//! use cumem_ipc::{ImportedPool, PoolPointerExport, ShareablePool};
//! let device = Device::get(0)?;
//! let ctx = device.context()?;
//! let stream = Stream::new(&ctx)?;
//! let pool = Arc::new(ShareablePool::new(&ctx)?);
//! let data: Vec<u32> = (0..256).collect();
//! let buf = DeviceBuffer::from_slice_in(&pool, &stream, &data)?;
//! buf.order().synchronize()?; // the importer may read at once
//! let wire = pool.export_pointer(&buf)?.to_bytes();
//! let fd = pool.export_fd()?;
//! // The importing side:
//! let imported = ImportedPool::from_fd(&device, &fd)?;
//! let export = PoolPointerExport::from_bytes(&wire)?;
//! // SAFETY: `buf` outlives the import (dropped first below), and the exporter's own uses of it
//! // (the fill, synchronised above) are complete before the import is used.
//! let view = unsafe { imported.import_pointer::<u32>(&export, &stream)? };
//! assert_eq!(view.as_slice().to_vec()?, data);
//! drop(view); // every importer frees before the exporter frees
//! drop(buf);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use bytemuck::Pod;
use cumem_core::sys::CUmemoryPool;
use cumem_core::{Context, Device, Error, ErrorContext, Feature, Result, Stream};

use crate::imported::Source;
use crate::live_imports::AddressClaim;
use crate::{ImportedBuffer, PoolPointerExport, ffi, live_imports};

/// The imported pool itself: one per driver handle, shared by every [`ImportedPool`] the driver
/// gave that handle, destroyed once per import when they and every buffer imported through them
/// are gone.
pub(crate) struct PoolHandle {
    raw: CUmemoryPool,
    /// The context of each `ImportedPool::from_fd` that returned this handle: the driver counts
    /// pool imports, so the handle is destroyed once for each.
    opens: Mutex<Vec<Context>>,
}

// SAFETY: a CUmemoryPool is an opaque handle the driver lets any thread use; it is never
// dereferenced.
unsafe impl Send for PoolHandle {}
// SAFETY: as above; the driver synchronises its own use of the handle.
unsafe impl Sync for PoolHandle {}

/// The imported pools of this process, by raw handle. The driver answers an import of a pool
/// that has a live import here with the same handle (an H100, 2026-11-23, also in a second
/// context), and refuses `cuMemPoolDestroy` while pointers imported through it live, without
/// counting that destroy (same H100, second run): so the imports share one [`PoolHandle`], whose
/// destroys wait for the last imported buffer. Its lock is held across the driver's import and
/// the lookup, and across the destroys, so that an import and the destroys never interleave. An
/// import can still come between the last `Arc` of a handle going and that handle's `Drop`
/// taking the lock: it gets the same driver handle (counted once more), cannot upgrade the dying
/// entry, and so makes a new one, through which pointers may be imported before the old `Drop`
/// runs. That `Drop` then hands its imports to the new entry instead of destroying them (the
/// driver would refuse, uncounted, under the new entry's imported pointers): one driver object,
/// one count, destroyed by whichever entry goes last. Whether `cuMemPoolImportFromShareableHandle`
/// or `cuMemPoolDestroy` of an imported handle waits behind a `cuMemFree` of its context is not on
/// record (on an H100 neither an import in the exporting process nor the destroy of a pool the
/// process created did: docs/observed-on-gpu.md, 2026-11-24): if one does, every `from_fd` and
/// every destroying drop of the process, in any context, waits behind that free (docs/ipc.md says
/// so; the lock is kept since the interleaving above is what it prevents).
static IMPORTED_POOLS: Mutex<BTreeMap<usize, Weak<PoolHandle>>> = Mutex::new(BTreeMap::new());

fn imported_pools() -> MutexGuard<'static, BTreeMap<usize, Weak<PoolHandle>>> {
    // The table stays consistent through a panic elsewhere (each change is one insert or remove).
    IMPORTED_POOLS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Drop for PoolHandle {
    fn drop(&mut self) {
        #[cfg(test)]
        tests::before_table_lock();
        let key = self.raw as usize;
        let mut table = imported_pools();
        let opens = std::mem::take(self.opens.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()));
        let heir = match table.get(&key) {
            Some(entry) if std::ptr::eq(entry.as_ptr(), self) => {
                table.remove(&key);
                None
            }
            // An import came between the last `Arc` going and this lock: the driver gave it this
            // handle (counting it) and it made a new entry, which may already have imported
            // pointers. A destroy now would be refused and not counted, leaking this handle's
            // imports for good; the new entry, being the same driver object, takes them over.
            // (An entry that no longer upgrades is dropping too and waits for this lock; no
            // pointer imported through it lives, so destroying here is sound.)
            Some(entry) => entry.upgrade(),
            None => None,
        };
        if let Some(heir) = heir {
            heir.opens.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).extend(opens);
            // The heir may be dropped here if its last user went meanwhile: its `Drop` takes the
            // table's lock, so release it first.
            drop(table);
            drop(heir);
            return;
        }
        // Logged once the table's lock is let go: a subscriber may import or drop a pool, which
        // takes it.
        let mut bind_errors = Vec::new();
        let mut destroy_errors = Vec::new();
        for ctx in opens {
            if let Err(e) = ctx.bind() {
                bind_errors.push(e);
                continue;
            }
            // SAFETY: imported (once per entry of `opens`, including those a dropped entry of the
            // same handle handed to this one) in `ImportedPool::from_fd`, destroyed only here,
            // once no entry of the handle lives, so after the last imported buffer (each holds
            // its entry) was freed; the table's lock keeps a new import from coming between the
            // check above and these destroys.
            if let Err(e) = unsafe { ffi::pool_destroy(self.raw) } {
                destroy_errors.push(e);
            }
        }
        drop(table);
        for e in bind_errors {
            tracing::warn!(error = %e, "cumem-ipc: cannot bind an imported pool's context; one import leaks");
        }
        for e in destroy_errors {
            tracing::warn!(error = %e, "cumem-ipc: destroying an imported pool failed");
        }
    }
}

/// Another process's shareable pool, imported in this process. It serves no allocations (the
/// driver refuses them); it turns [`PoolPointerExport`]s into [`ImportedBuffer`]s. Dropping it
/// while imported buffers live is fine: the pool goes with the last of them.
pub struct ImportedPool {
    inner: Arc<PoolHandle>,
    /// The context this import was made in (another `ImportedPool` of the same handle may have
    /// another).
    ctx: Context,
}

impl ImportedPool {
    /// Imports the pool whose descriptor `fd` is (from [`ShareablePool::export_fd`](crate::ShareablePool::export_fd),
    /// received over a Unix socket) for use on `device`, in its primary context. The caller keeps
    /// `fd` (close it once imported). A descriptor that is not an exported pool gives the driver's
    /// error unchanged: [`Error::InvalidValue`] on the simulator, which is not measured on a GPU
    /// (importing such a descriptor as VMM memory answered `CUDA_ERROR_UNKNOWN` on an H100, which
    /// `cumem-vmm` reads as `InvalidValue`; a pool import may answer the same, as
    /// [`Error::Cuda`]). A device without memory pools gives [`Error::NotSupported`].
    ///
    /// Importing a pool that this process already imported (and whose [`ImportedPool`] or
    /// imported buffers still live) gives a second `ImportedPool` with the same
    /// [`raw`](Self::raw) handle: the driver returns the live import's handle and counts the
    /// imports (an H100, 2026-11-23, also for an import in another context). The driver refuses
    /// to destroy an imported pool while pointers imported through it live (and does not count
    /// the refused destroy), so the handle is destroyed once per import only when every
    /// `ImportedPool` of it and every buffer imported through them are gone.
    ///
    /// An imported pool lives on the device the exporter created it on; `device` must be that
    /// device, or one given read-write access to the imported pool with `cuMemPoolSetAccess`
    /// (this crate does not call it: the program does, on the [`raw`](Self::raw) handle of an
    /// earlier import of the pool on its own device; whether the exporter's grant on its
    /// [`ShareablePool::raw`](crate::ShareablePool::raw) reaches importers is not on record, and
    /// the simulator keeps access per pool handle, so it does not). Any other device gives
    /// [`Error::WrongDevice`] (`expected`: the first device with read-write access, -1 if none is
    /// found), since its streams could not use the imported memory.
    pub fn from_fd(device: &Device, fd: impl AsFd) -> Result<ImportedPool> {
        device.capabilities()?.require(Feature::MemoryPools)?;
        let ctx = device.context()?;
        ctx.bind()?;
        let inner = {
            let mut table = imported_pools();
            let raw = ffi::pool_import_fd(fd.as_fd())?;
            match table.get(&(raw as usize)).and_then(Weak::upgrade) {
                Some(inner) => {
                    inner.opens.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(ctx.clone());
                    inner
                }
                None => {
                    let inner = Arc::new(PoolHandle { raw, opens: Mutex::new(vec![ctx.clone()]) });
                    table.insert(raw as usize, Arc::downgrade(&inner));
                    inner
                }
            }
            // The table's lock is released here: dropping the last `Arc` below takes it.
        };
        let raw = inner.raw;
        // Counts this import for destruction on every error path below (with the handle's last
        // user).
        let pool = ImportedPool { inner, ctx };
        if !ffi::pool_device_can_read_write(raw, device.raw())? {
            let expected = (0..Device::count()?)
                .find(|&d| {
                    Device::get(d)
                        .is_ok_and(|dev| ffi::pool_device_can_read_write(raw, dev.raw()).unwrap_or(false))
                })
                .map_or(-1, |d| d as i32);
            return Err(Error::WrongDevice { expected, actual: device.ordinal() as i32 });
        }
        Ok(pool)
    }

    /// The driver's handle of the imported pool; valid while `self` lives.
    pub fn raw(&self) -> CUmemoryPool {
        self.inner.raw
    }

    /// The context the pool was imported in.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Imports the exported buffer as `bytes() / size_of::<T>()` elements whose first use is on
    /// `stream` (a stream of the pool's context, else [`Error::WrongDevice`]). The returned
    /// buffer frees the import when dropped, after waiting for this process's work on it.
    ///
    /// Bytes exported from another pool give the driver's [`Error::InvalidValue`]; a size that is
    /// not a whole number of `T`s or an offset not aligned for `T`, [`Error::Misaligned`]; a
    /// buffer outside the allocation the driver maps, [`Error::InvalidValue`]; an imported address
    /// not aligned for `T`, [`Error::Misaligned`]. Each of these refusals after the driver's
    /// import frees the mapping the call made, without synchronising `stream`. Memory the
    /// exporter already freed is *not* refused: the driver maps it (an H100 answered SUCCESS in
    /// the exporting process, 2026-11-23), which is why safety item 1 below is the caller's.
    /// Importing an export that is already imported in this process (through any
    /// [`ImportedPool`], in any context) while that [`ImportedBuffer`] lives, or the driver
    /// returning the address of a live [`ImportedBuffer`], gives [`Error::AlreadyMapped`] and
    /// leaves the live import as it was: two imports of the same memory would give safe code two
    /// exclusive views of it. The driver does return that address, without counting the import,
    /// for a second import of the same allocation: with the same bytes (exporting a pointer twice
    /// gives the same bytes), with bytes that differ (the last byte flipped), and from a second
    /// context (an H100, 2026-11-23, second run).
    ///
    /// # Safety
    ///
    /// Neither the memory's lifetime nor the other processes' accesses to it can be checked from
    /// here, so the caller promises:
    ///
    /// 1. The exporter keeps the buffer alive, and does not free it (its pool would reuse the
    ///    memory for its next allocation), until the returned [`ImportedBuffer`] is dropped: every
    ///    importer frees an imported pointer before the exporter frees it, as the driver
    ///    requires. Using an import of freed memory is undefined behaviour on a GPU.
    /// 2. Other processes' accesses to the memory are ordered with this process's, through an
    ///    [`IpcEvent`](crate::IpcEvent) or the program's own protocol: no other process writes
    ///    it while this one reads or writes it, nor reads it while this one writes it.
    /// 3. When this process is the exporter (it imports its own buffer), its own uses of the
    ///    exported buffer are ordered with the import's the same way: while the returned
    ///    [`ImportedBuffer`] lives, the exporting [`DeviceBuffer`](cumem_core::DeviceBuffer) is
    ///    not written while the import is read or written, nor read while the import is written
    ///    (synchronise its [`order`](cumem_core::DeviceBuffer::order) before using the import,
    ///    and the import's before using it again). Its stream order and the import's are
    ///    separate: nothing orders them for you.
    ///
    /// Safe code cannot import a pointer:
    ///
    /// ```compile_fail,E0133
    /// fn import_it(pool: &cumem_ipc::ImportedPool, e: &cumem_ipc::PoolPointerExport, s: &cumem_core::Stream) {
    ///     let _ = pool.import_pointer::<u32>(e, s);
    /// }
    /// ```
    pub unsafe fn import_pointer<T: Pod>(
        &self,
        export: &PoolPointerExport,
        stream: &Stream,
    ) -> Result<ImportedBuffer<T>> {
        let ctx = &self.ctx;
        if stream.context() != ctx {
            return Err(Error::WrongDevice {
                expected: ctx.device().ordinal() as i32,
                actual: stream.context().device().ordinal() as i32,
            });
        }
        // The offset and size are untrusted bytes: check what needs no driver first, so that a
        // forged export neither overflows nor leaves an import behind.
        let (offset, bytes) = (export.offset(), export.bytes() as u64);
        let size = std::mem::size_of::<T>().max(1);
        if !bytes.is_multiple_of(size as u64) {
            return Err(Error::Misaligned { what: "exported size", value: bytes, align: size as u64 });
        }
        let align = std::mem::align_of::<T>() as u64;
        if !offset.is_multiple_of(align) {
            return Err(Error::Misaligned { what: "exported offset", value: offset, align });
        }
        let Some(end) = offset.checked_add(bytes) else {
            return Err(Error::InvalidValue {
                ctx: ErrorContext::op("ImportedPool::import_pointer (offset + size overflows)")
                    .bytes(export.bytes()),
            });
        };
        ctx.bind()?;
        let raw = export.raw();
        let already = || {
            Error::AlreadyMapped {
            ctx: ErrorContext::op(
                "ImportedPool::import_pointer (already imported in this process; drop the other ImportedBuffer first)",
            )
            .bytes(export.bytes()),
        }
        };
        // Released when dropped: on every error path below, or by the import's drop (after its
        // address's tombstone is gone).
        let Some(claim) = live_imports::claim_pool_export(&raw) else {
            return Err(already());
        };
        // No lock of cumem's across the driver's import, which may wait behind a `cuMemFree` of
        // the context (driver-api.md §17: there a free holds up the context's allocations; this
        // call did not wait on an H100, docs/observed-on-gpu.md, but nothing promises it): a
        // window records the frees that return meanwhile,
        // and an answer whose address one of them freed is not trusted (see `live_imports`).
        let base = loop {
            let window = live_imports::open_import_window();
            let base = match ffi::pool_import_pointer(self.inner.raw, raw) {
                Ok(base) => base,
                Err(e) => {
                    drop(window);
                    drop(claim);
                    return Err(e);
                }
            };
            #[cfg(test)]
            crate::imported::tests::after_import_answer();
            match window.claim(base) {
                AddressClaim::Claimed => break base,
                AddressClaim::Live => {
                    // The driver returned a live import's address (export bytes that differ from
                    // that import's but name the same allocation: the same bytes were refused
                    // above). It does not count imports of one address (an H100, 2026-11-23):
                    // this is that import's mapping, and a cuMemFree here would unmap it under its
                    // `ImportedBuffer`. Nothing to free.
                    drop(claim);
                    return Err(already());
                }
                // A free of this address overlapped the driver's answer: the answer is either the
                // mapping that free unmapped (uncounted, owning nothing) or a fresh one the driver
                // placed there after it. Once the free has returned, a second import owns exactly
                // one mapping either way (the fresh one, answered again uncounted, or a new one),
                // so the first answer is not freed: it is gone, or it is the second.
                AddressClaim::Again => {}
            }
        };
        // Until the import exists, a refusal frees the mapping itself: nothing was queued on the
        // memory, so unlike dropping an `ImportedBuffer` it does not synchronise the caller's
        // stream (which might wait for this thread, or for another process waiting for this one)
        // and cannot fail that wait and leak the import. (The driver's `cuMemFree` of a pool
        // pointer imported in the exporting process did not wait for a held stream on an H100,
        // docs/observed-on-gpu.md, unlike a `cuMemFree` of ordinary memory; the simulator does
        // not make it wait.) As the
        // drop does: the address becomes a tombstone across the free, and the export's claim goes
        // after it; the warning of a failed free comes after both, as no import then waits for it.
        let refuse = |claim, e: Error| {
            let freeing = live_imports::start_free(base);
            // SAFETY: `base` came from `pool_import_pointer` just above, is claimed by this call
            // alone, and no view of it was made.
            let freed = unsafe { ffi::mem_free(base) };
            drop(freeing);
            drop(claim);
            if let Err(free) = freed {
                tracing::warn!(error = %free, "cumem-ipc: freeing a refused pool pointer import failed");
            }
            Err(e)
        };
        // The buffer must lie inside the allocation the driver reports for the address it answered
        // (on an H100 that range starts at the address itself; measured from the range's own
        // start, the check holds whatever a driver answers).
        let (range_base, mapped) = match ffi::address_range(base) {
            Ok(range) => range,
            Err(e) => return refuse(claim, e),
        };
        let inside = base.checked_sub(range_base).and_then(|lead| lead.checked_add(end));
        if inside.is_none_or(|reach| reach > mapped as u64) {
            let op = "ImportedPool::import_pointer (buffer outside the exported allocation)";
            return refuse(claim, Error::InvalidValue { ctx: ErrorContext::op(op).bytes(export.bytes()) });
        }
        // In range: `base + offset` does not overflow, as `range_base + mapped` does not. The
        // offset is aligned, but the driver's address need not be for a `T` aligned beyond what
        // it guarantees (imports are 32 MiB aligned on an H100; a type may ask for more).
        let ptr = base + offset;
        if !ptr.is_multiple_of(align) {
            return refuse(claim, Error::Misaligned { what: "imported address", value: ptr, align });
        }
        Ok(ImportedBuffer::new(
            base,
            ptr,
            export.bytes() / size,
            stream,
            Source::Pool { pool: Arc::clone(&self.inner), export: claim },
        ))
    }
}

impl std::fmt::Debug for ImportedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedPool")
            .field("device", &self.ctx.device().ordinal())
            .field("raw", &self.inner.raw)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    //! The window between a handle's last `Arc` going and its `Drop` taking the table's lock,
    //! made to happen deterministically: a hook runs at the start of `Drop`, on the dropping
    //! thread, where another thread's import would otherwise have to land by chance.

    use std::cell::RefCell;
    use std::rc::Rc;
    use std::sync::Arc;

    use cumem_core::{Device, DeviceBuffer, Stream};
    use cumem_sys::testing;

    use super::ImportedPool;
    use crate::{ImportedBuffer, ShareablePool};

    thread_local! {
        static HOOK: RefCell<Option<Box<dyn FnOnce()>>> = const { RefCell::new(None) };
    }

    /// Runs (once) the hook set on this thread, before `PoolHandle::drop` takes the table's lock.
    /// A drop during the thread's teardown, once the hook's slot is gone, runs none (`try_with`:
    /// `with` would panic in that drop).
    pub(super) fn before_table_lock() {
        if let Some(hook) = HOOK.try_with(|h| h.borrow_mut().take()).ok().flatten() {
            hook();
        }
    }

    /// The last `ImportedPool` of a handle is dropped; before its `Drop` takes the table's lock,
    /// the same pool is imported again (the driver gives the same handle, counted) and a pointer
    /// imported through the new entry. The old entry's imports must not be destroyed under that
    /// pointer (refused and uncounted: a leak): when the new entry and its pointer go, the handle
    /// is gone, and no destroy was refused.
    #[test]
    #[serial_test::serial]
    fn an_import_between_the_last_drop_and_its_destroys_does_not_leak_the_handle() {
        testing::init();
        if let Some(ctl) = testing::sim_control() {
            ctl.clear_violations();
        }
        {
            let device = Device::get(0).unwrap();
            let ctx = device.context().unwrap();
            let stream = Stream::new(&ctx).unwrap();
            let pool = Arc::new(ShareablePool::new(&ctx).unwrap());
            let data: Vec<u32> = (0..1024).map(|i| i * 5 + 2).collect();
            let buf = DeviceBuffer::from_slice_in(&pool, &stream, &data).unwrap();
            buf.order().synchronize().unwrap();
            let export = pool.export_pointer(&buf).unwrap();
            let fd = pool.export_fd().unwrap();
            let first = ImportedPool::from_fd(&device, &fd).unwrap();
            let raw_pool = first.raw();

            type Late = (ImportedPool, ImportedBuffer<u32>);
            let late: Rc<RefCell<Option<Late>>> = Rc::default();
            let (late_in, stream_in) = (Rc::clone(&late), stream.clone());
            let fd_in = fd.try_clone().unwrap();
            HOOK.with(|h| {
                *h.borrow_mut() = Some(Box::new(move || {
                    let again = ImportedPool::from_fd(&device, &fd_in).unwrap();
                    assert_eq!(again.raw(), raw_pool, "the driver gives the live import's handle");
                    // SAFETY: `buf` outlives the import (dropped after it below); its fill
                    // completed above and nothing writes it while the import lives.
                    let import = unsafe { again.import_pointer::<u32>(&export, &stream_in) }.unwrap();
                    *late_in.borrow_mut() = Some((again, import));
                }))
            });
            drop(first);
            let (again, import) = late.borrow_mut().take().expect("the hook ran");
            drop(fd);
            assert_eq!(import.as_slice().to_vec().unwrap(), data, "the pool is still imported");
            drop(again);
            drop(import);
            if let Some(ctl) = testing::sim_control() {
                let report = ctl.live_report();
                assert!(
                    !report.pools.iter().any(|p| p.handle == raw_pool as u64),
                    "the imported pool leaked:\n{report}"
                );
                let refused: Vec<_> =
                    ctl.violations().into_iter().filter(|v| v.function == "cuMemPoolDestroy").collect();
                assert!(refused.is_empty(), "{refused:#?}");
            }
            drop(buf);
        }
        if let Some(ctl) = testing::sim_control() {
            let report = ctl.live_report();
            assert!(report.is_clean(), "live report not clean:\n{report}");
        }
    }
}
