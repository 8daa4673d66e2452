//! [`ImportedBuffer`]: another process's allocation, opened here (a legacy IPC handle, or a
//! pointer exported from a shareable pool).

use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;
use cumem_core::{Context, DeviceSlice, DeviceSliceMut, Stream, StreamOrder};
use cumem_sys::sys::CUdeviceptr;

use crate::ffi::POOL_EXPORT_SIZE;
use crate::imported_pool::PoolHandle;
use crate::live_imports::LegacyTicket;
use crate::{ffi, live_imports};

/// How an import ends.
pub(crate) enum Source {
    /// `cuIpcOpenMemHandle`: closed with `cuIpcCloseMemHandle`; its claim in `live_imports` is
    /// released first.
    IpcHandle(LegacyTicket),
    /// A leaked import: nothing to end.
    Leaked,
    /// `cuMemPoolImportPointer`: freed with `cuMemFree`; the imported pool is kept alive until then.
    Pool {
        /// The pool must not be destroyed before its imported pointers; forgotten (never
        /// destroyed) when the import is leaked.
        pool: Arc<PoolHandle>,
        /// The export's bytes, claimed in `live_imports` (with the import's address) until the
        /// import is freed.
        export: [u8; POOL_EXPORT_SIZE],
    },
}

/// Another process's device allocation, opened in this process: a device view of `len` elements
/// of `T` whose work is ordered like a [`DeviceBuffer`](cumem_core::DeviceBuffer)'s. Dropping it
/// waits for that work and ends the import (closes a legacy IPC import, frees an imported pool
/// pointer; the memory stays the exporter's); if waiting fails, the import is leaked (and a
/// warning logged) rather than ended under work that may still run. Its views are sound because
/// of what the caller of [`IpcMemHandle::open`](crate::IpcMemHandle::open) or
/// [`ImportedPool::import_pointer`](crate::ImportedPool::import_pointer) promised: the exporter
/// keeps the memory alive and to this buffer until the import is dropped, and other processes'
/// accesses are ordered with this one's.
///
/// Dropping an import of a pool pointer frees it with `cuMemFree`, which is synchronous: on an
/// H100 (driver-api.md §17) it waits for every stream of the context while one of them runs a
/// blocked host function, even for an idle allocation, and it does so while holding this
/// process's lock of imported pool addresses (the free and the release of the address must not be
/// split, see `live_imports`). So such a drop can wait on unrelated work of the context (a held
/// stream, a `queue_on` closure blocked on something), and meanwhile every other pool pointer
/// import and free in the process waits on that lock. That makes a deadlock across threads: a
/// host function of context C waits for thread B; B imports or drops any pool pointer and blocks
/// on the lock; thread A holds the lock inside `cuMemFree` on C, waiting for that host function.
/// So no thread that a host function waits for may import or drop a pool pointer while another
/// thread (or it) could be freeing one in that host function's context. (A legacy import's last
/// `cuIpcCloseMemHandle` may wait for the device's work too, but holds no lock of cumem's.)
pub struct ImportedBuffer<T> {
    /// What the driver mapped (the whole exported allocation), closed on drop.
    base: CUdeviceptr,
    ptr: CUdeviceptr,
    len: usize,
    ctx: Context,
    order: StreamOrder,
    source: Source,
    _marker: PhantomData<T>,
}

impl<T: Pod> ImportedBuffer<T> {
    pub(crate) fn new(
        base: CUdeviceptr,
        ptr: CUdeviceptr,
        len: usize,
        stream: &Stream,
        source: Source,
    ) -> Self {
        ImportedBuffer {
            base,
            ptr,
            len,
            ctx: stream.context().clone(),
            order: StreamOrder::new(stream),
            source,
            _marker: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of the memory in this process (not the exporter's).
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The context it was opened in.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The streams that used it, which drop waits for.
    pub fn order(&self) -> &StreamOrder {
        &self.order
    }

    /// A shared view, for copies and device work. What the other process writes is ordered with
    /// it only through an [`IpcEvent`](crate::IpcEvent) (or the program's own protocol).
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        // SAFETY: the import maps `len` elements of `T` (any bit pattern is a `T`: Pod) until drop,
        // which `&self` outlives; the exporter keeps the memory alive and unused by anything
        // else until then (safety item 1 of `IpcMemHandle::open` / `ImportedPool::import_pointer`);
        // this process's work on it is ordered through `self.order`, other processes' with it by
        // the caller of `open` / `import_pointer` (safety item 2).
        unsafe { DeviceSlice::from_raw_parts(self.ptr, self.len, &self.order, &self.ctx) }
    }

    /// An exclusive view: within this process nothing else uses the memory while it lives.
    pub fn as_mut_slice(&mut self) -> DeviceSliceMut<'_, T> {
        // SAFETY: as `as_slice`; `&mut self` keeps every other view of this import away; no
        // other `ImportedBuffer` of this process covers these bytes: `IpcMemHandle::open` claims
        // the handle's bytes with the range of the allocation this buffer covers, in every
        // context, and the address the driver mapped, refusing an overlapping range of either
        // while this import lives (bytes that differ but name the same allocation, opened in
        // another context, are excluded by its safety item 3); `ImportedPool::import_pointer`
        // claims the export's bytes and the address, process-wide. The exporting process's own
        // uses, when it imports its own pool buffer, are ordered with this one's (safety item 3
        // of `ImportedPool::import_pointer`), as are other processes' (item 2 of both).
        unsafe { DeviceSliceMut::from_raw_parts(self.ptr, self.len, &self.order, &self.ctx) }
    }

    cumem_core::device_view_methods!();
}

impl<T> Drop for ImportedBuffer<T> {
    fn drop(&mut self) {
        // `join_mut` (exclusive, no lock) and a wait on the one stream it returns, not
        // `StreamOrder::synchronize`, whose lock is refused inside a `StreamOrder::queue_on`
        // closure: dropped there, the import is closed instead of leaked.
        if let Err(e) = self.order.join_mut().and_then(Stream::synchronize) {
            // Work on the memory may still be queued: closing would unmap it under that work.
            // Leak the import instead (it stays claimed, so it is not opened again here).
            tracing::warn!(error = %e, bytes = self.len * std::mem::size_of::<T>(), "cumem-ipc: waiting for an import's work failed; leaking the import");
            self.leak_source();
            return;
        }
        if let Err(e) = self.ctx.bind() {
            tracing::warn!(error = %e, "cumem-ipc: cannot bind the import's context; the import stays open");
            self.leak_source();
            return;
        }
        match std::mem::replace(&mut self.source, Source::Leaked) {
            Source::Leaked => {}
            Source::IpcHandle(ticket) => {
                live_imports::release(ticket);
                // SAFETY: `base` came from `mem_open`, is closed only here, and no view outlives
                // `self`.
                if let Err(e) = unsafe { ffi::mem_close(self.base) } {
                    tracing::warn!(error = %e, "cumem-ipc: cuIpcCloseMemHandle failed");
                }
            }
            Source::Pool { export, .. } => {
                // The free and the release of the address under one guard: the driver does not
                // count imports of one address, so an import between them would get this
                // mapping's address back for a new mapping (see `live_imports::pool_addresses`).
                let mut addresses = live_imports::pool_addresses();
                // SAFETY: `base` came from `pool_import_pointer`, is freed only here, no view
                // outlives `self`, and the work that used it has completed (synchronised above).
                if let Err(e) = unsafe { ffi::mem_free(self.base) } {
                    tracing::warn!(error = %e, "cumem-ipc: freeing an imported pool pointer failed");
                }
                addresses.remove(&self.base);
                drop(addresses);
                live_imports::release_pool_export(&export);
            }
        }
    }
}

impl<T> ImportedBuffer<T> {
    /// For a leaked import: keeps its imported pool alive for the rest of the process (destroying
    /// it would end the import under work that may still use it).
    fn leak_source(&mut self) {
        if let Source::Pool { pool, .. } = std::mem::replace(&mut self.source, Source::Leaked) {
            std::mem::forget(pool);
        }
    }
}

impl<T> std::fmt::Debug for ImportedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedBuffer").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}
