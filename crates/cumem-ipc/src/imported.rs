//! [`ImportedBuffer`]: another process's allocation, opened here (a legacy IPC handle, or a
//! pointer exported from a shareable pool).

use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;
use cumem_core::{Context, DeviceSlice, DeviceSliceMut, Stream, StreamOrder};
use cumem_sys::sys::CUdeviceptr;

use crate::imported_pool::PoolHandle;
use crate::live_imports::{LegacyTicket, PoolExportClaim};
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
        /// The claim of the export's bytes in `live_imports` (the address is claimed there too),
        /// released once the import is freed; forgotten (kept for good) when the import is leaked.
        export: PoolExportClaim,
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
/// Dropping an import of a pool pointer frees it with `cuMemFree`, which is synchronous: on an H100
/// (driver-api.md §17) `cuMemFree` waits for every stream of the context while one of them runs a
/// blocked host function, even for an idle allocation (measured for `cuMemAlloc` memory; the
/// `cuMemFree` of a pointer imported in the exporting process returned at once there,
/// docs/observed-on-gpu.md, 2026-11-24; one imported from another process was not tried). So
/// such a drop may wait on unrelated work of its context (a held stream, a `queue_on` closure
/// blocked on something). While it waits, other
/// threads' calls in its context C may wait too: on that H100 a waiting free held up the context's
/// allocations and queued work, another pool pointer drop in C waits in its own `cuMemFree` for
/// the same work, while an import's `cuMemPoolImportPointer` in C did not wait behind such a free
/// on the H100 (2026-11-24). The drop holds
/// no lock of cumem's while it frees, nor does an import across its driver call, so pool pointer
/// imports and drops in other contexts go on, with one exception: an import (in any context) that
/// the driver answers with the address of an import being freed (an import of the same allocation
/// through export bytes that differ, while the first import's drop frees it) waits for that free
/// to return and imports again (see `live_imports`). So a thread that a host function of context C
/// waits for must not drop a pool pointer import of C (its free waits for the host function), and,
/// while another thread may be dropping one, must not import a pointer in C (the driver's import
/// may wait for that free) nor import one of the allocation being freed, in any context (it waits
/// for that free). An import of the same export's bytes as the one being dropped does not wait: it
/// is refused with `AlreadyMapped` until that drop returns. (A legacy import's last
/// `cuIpcCloseMemHandle` may wait for the device's work too, and holds no lock of cumem's either.
/// A drop that ends an imported pool's last user destroys the pool under the process's lock of
/// imported pools, which [`ImportedPool::from_fd`](crate::ImportedPool::from_fd) holds across its
/// import too: should either driver call wait behind a free of its context, which is not on
/// record, every such drop and `from_fd` waits behind it.)
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
            // Leak the import instead (it stays claimed, so it is not opened again here). Leaked
            // before logging, here and below: a subscriber that panics on the warning would
            // otherwise drop the source normally (releasing the claim, destroying an imported pool
            // under the mapping).
            self.leak_source();
            tracing::warn!(error = %e, bytes = self.len * std::mem::size_of::<T>(), "cumem-ipc: waiting for an import's work failed; leaking the import");
            return;
        }
        if let Err(e) = self.ctx.bind() {
            self.leak_source();
            tracing::warn!(error = %e, "cumem-ipc: cannot bind the import's context; the import stays open");
            return;
        }
        match std::mem::replace(&mut self.source, Source::Leaked) {
            Source::Leaked => {}
            Source::IpcHandle(ticket) => {
                // Released before the close, with no tombstone: the driver counts opens, so an
                // open of the allocation that races with the close keeps its own reference
                // (see `live_imports::release`).
                live_imports::release(ticket);
                // SAFETY: `base` came from `mem_open`, is closed only here, and no view outlives
                // `self`.
                if let Err(e) = unsafe { ffi::mem_close(self.base) } {
                    tracing::warn!(error = %e, "cumem-ipc: cuIpcCloseMemHandle failed");
                }
            }
            Source::Pool { export, .. } => {
                // A tombstone rather than the addresses' lock across the free, which may wait on
                // unrelated work of the context (driver-api.md §17): an import the driver answers
                // with this address meanwhile waits for the tombstone and imports again, since it
                // cannot tell this mapping from a fresh one at the same address (see
                // `live_imports`). Every other import and free goes on, as far as cumem's locks go.
                let freeing = live_imports::start_free(self.base);
                #[cfg(test)]
                tests::while_freeing();
                // SAFETY: `base` came from `pool_import_pointer`, is freed only here, no view
                // outlives `self`, and the work that used it has completed (synchronised above).
                let freed = unsafe { ffi::mem_free(self.base) };
                drop(freeing);
                // After the tombstone: until the drop returns, an import of the same bytes is
                // refused, as while the buffer lived. (On a panic in between, `freeing`, declared
                // later, is dropped first too.)
                drop(export);
                // Warned once no import waits for the tombstone (a subscriber may wait for one).
                if let Err(e) = freed {
                    tracing::warn!(error = %e, "cumem-ipc: freeing an imported pool pointer failed");
                }
            }
        }
    }
}

impl<T> ImportedBuffer<T> {
    /// For a leaked import: keeps its imported pool alive for the rest of the process (destroying
    /// it would end the import under work that may still use it).
    fn leak_source(&mut self) {
        if let Source::Pool { pool, export } = std::mem::replace(&mut self.source, Source::Leaked) {
            std::mem::forget(pool);
            // The address stays claimed too: the import is still mapped.
            std::mem::forget(export);
        }
    }
}

impl<T> std::fmt::Debug for ImportedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedBuffer").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! A pool pointer import's drop whose `cuMemFree` waits. On an H100 a `cuMemFree` waits while
    //! a stream of the context runs a blocked host function (driver-api.md §17); the simulator
    //! does not make a free of pool memory wait (the brief: `cuMemFree` of pool memory does not
    //! synchronise, [H:8617]; an H100 returned at once for a pointer imported in the exporting
    //! process, docs/observed-on-gpu.md; from another process it was not tried). So
    //! a hook holds the drop where it calls `cuMemFree`, on the dropping thread only, for as long
    //! as the test says: the rest of the process sees what it would see of a free that waits.
    //! Another holds an import between the driver's answer and the claim of its address, where an
    //! import whose `cuMemPoolImportPointer` waits (behind a free of its context, say) would be,
    //! and where a free may return between the two.

    use std::cell::RefCell;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
    use std::time::{Duration, Instant};

    use cumem_core::{Device, DeviceBuffer, Stream};
    use cumem_sys::testing;
    use serial_test::serial;

    use crate::live_imports::tests::{FREED_IN_WINDOW, TOMBSTONE_WAITS};
    use crate::{ImportedPool, PoolPointerExport, ShareablePool};

    thread_local! {
        static WHILE_FREEING: RefCell<Option<Box<dyn FnOnce()>>> = const { RefCell::new(None) };
        static AFTER_ANSWER: RefCell<Option<Box<dyn FnOnce()>>> = const { RefCell::new(None) };
    }

    /// How long a step another thread waits for may take at most before the test gives up on it.
    const PATIENCE: Duration = Duration::from_secs(60);
    /// How long a hold lasts when the test never opens it: longer than the test waits for any
    /// answer, so that an answer that came while the hold held shows that it did not wait for it.
    const HOLD_LIMIT: Duration = Duration::from_secs(2 * PATIENCE.as_secs());

    /// Runs (once) the hook set on this thread, where a pool pointer import's drop calls
    /// `cuMemFree`. A drop during the thread's teardown, once the hook's slot is gone, runs none
    /// (`try_with`: `with` would panic in that drop).
    pub(super) fn while_freeing() {
        if let Some(hook) = WHILE_FREEING.try_with(|h| h.borrow_mut().take()).ok().flatten() {
            hook();
        }
    }

    /// Runs (once) the hook set on this thread, where a pool pointer import has the driver's
    /// answer and has not claimed its address yet.
    pub(crate) fn after_import_answer() {
        if let Some(hook) = AFTER_ANSWER.try_with(|h| h.borrow_mut().take()).ok().flatten() {
            hook();
        }
    }

    /// The test's side of a hold of another thread's step: `arrived` answers once the thread
    /// reaches it; dropping the hold lets the thread go on.
    struct Hold {
        arrived: Receiver<()>,
        /// Dropped with the hold, which opens it.
        _open: Sender<()>,
        /// Set once the held thread goes on (opened, or after [`HOLD_LIMIT`]).
        released: Arc<AtomicBool>,
    }

    /// The held thread's side of a [`Hold`], made into a hook by [`hold_next_free`] or
    /// [`hold_next_answer`].
    struct Held {
        arrived: Sender<()>,
        open: Receiver<()>,
        released: Arc<AtomicBool>,
    }

    fn hold() -> (Hold, Held) {
        let ((arrived_tx, arrived), (open, open_rx)) = (channel(), channel());
        let released = Arc::new(AtomicBool::new(false));
        (
            Hold { arrived, _open: open, released: Arc::clone(&released) },
            Held { arrived: arrived_tx, open: open_rx, released },
        )
    }

    impl Held {
        /// A hook that says it runs on `arrived`, then waits until the test opens the hold (or
        /// [`HOLD_LIMIT`] passes, so that nothing hangs) and says it went on.
        fn into_hook(self) -> Box<dyn FnOnce()> {
            Box::new(move || {
                let _ = self.arrived.send(());
                let _ = self.open.recv_timeout(HOLD_LIMIT);
                self.released.store(true, Ordering::SeqCst);
            })
        }
    }

    /// Waits up to [`PATIENCE`] for another thread's answer while `hold` holds, without opening
    /// it: an answer that comes while the held step has not gone on shows that the thread did not
    /// wait for that step, however long it took. `Err` says why not (the caller opens the hold
    /// before failing, so that nothing waits for [`HOLD_LIMIT`]).
    fn answer_while_held<A>(done: &Receiver<A>, hold: &Hold) -> Result<A, String> {
        let answer = done.recv_timeout(PATIENCE);
        let released = hold.released.load(Ordering::SeqCst);
        match answer {
            Ok(answer) if !released => Ok(answer),
            Ok(_) => Err("answered only once the held step had gone on: it waited".into()),
            Err(RecvTimeoutError::Timeout) => {
                Err(format!("did not answer within {PATIENCE:?} while the step was held: it waits"))
            }
            Err(RecvTimeoutError::Disconnected) => Err("panicked (see above)".into()),
        }
    }

    /// Holds the next pool pointer free of the calling thread (see [`Held::into_hook`]).
    fn hold_next_free(held: Held) {
        WHILE_FREEING.with(|h| *h.borrow_mut() = Some(held.into_hook()));
    }

    /// Holds the next pool pointer import of the calling thread once the driver has answered,
    /// before the claim of its address (see [`Held::into_hook`]).
    fn hold_next_answer(held: Held) {
        AFTER_ANSWER.with(|h| *h.borrow_mut() = Some(held.into_hook()));
    }

    /// A buffer of a fresh shareable pool on `ordinal`, holding `data` (its fill completed), its
    /// export, and the pool imported for the same device.
    struct Exported {
        stream: Stream,
        buf: DeviceBuffer<u32>,
        export: PoolPointerExport,
        imported: ImportedPool,
    }

    fn exported(ordinal: usize, data: &[u32]) -> Exported {
        let device = Device::get(ordinal).unwrap();
        let stream = Stream::new(&device.context().unwrap()).unwrap();
        let pool = Arc::new(ShareablePool::new(stream.context()).unwrap());
        let buf = DeviceBuffer::from_slice_in(&pool, &stream, data).unwrap();
        buf.order().synchronize().unwrap();
        let export = pool.export_pointer(&buf).unwrap();
        let fd = pool.export_fd().unwrap();
        let imported = ImportedPool::from_fd(&device, &fd).unwrap();
        Exported { stream, buf, export, imported }
    }

    /// Exports of `held_data` on device 0 and of `other_data` from another pool (on device 1 when
    /// there is one; a test holds the import or free of `held`'s pointer, which device 0 would
    /// show the same).
    fn held_and_other(held_data: &[u32], other_data: &[u32]) -> (Exported, Exported) {
        (exported(0, held_data), exported(if Device::count().unwrap() > 1 { 1 } else { 0 }, other_data))
    }

    /// Imports, reads and drops `other`'s pointer on a thread of `scope` while `hold` holds
    /// another thread, then opens `hold` (in every case, so that a waiting import finishes and
    /// the scope ends): the read, or why it did not come while held.
    fn other_import_while_held<'scope>(
        scope: &'scope std::thread::Scope<'scope, '_>,
        other: &'scope Exported,
        hold: Hold,
    ) -> Result<cumem_core::Result<Vec<u32>>, String> {
        let (done_tx, done) = channel();
        scope.spawn(move || {
            // SAFETY: `other.buf` outlives the import (dropped at once); its fill completed above
            // and nothing writes it.
            let import = unsafe { other.imported.import_pointer::<u32>(&other.export, &other.stream) };
            let read = import.and_then(|import| import.as_slice().to_vec());
            let _ = done_tx.send(read);
        });
        let answered = answer_while_held(&done, &hold);
        drop(hold);
        answered
    }

    /// Bytes that name `export`'s allocation but differ from it (the last of the driver's 64 bytes
    /// flipped: an H100 mapped them at the live import's address, 2026-11-23; the simulator does
    /// too).
    fn same_allocation_as(export: &PoolPointerExport) -> PoolPointerExport {
        let mut wire = export.to_bytes();
        wire[8 + 63] ^= 0xFF;
        PoolPointerExport::from_bytes(&wire).unwrap()
    }

    /// `import` is a mapping of its own of the exporter's `buf`, which holds `data`: it reads
    /// `data`, and what it writes (then drops it) the exporter reads.
    #[track_caller]
    fn assert_reads_and_writes_the_exporters_bytes(
        mut import: crate::ImportedBuffer<u32>,
        buf: &DeviceBuffer<u32>,
        data: &[u32],
    ) {
        assert_eq!(import.as_slice().to_vec().unwrap(), data, "a mapping of its own");
        let ones = vec![1u32; data.len()];
        cumem_copy::copy_h2d(&ones, &mut import.as_mut_slice()).unwrap();
        drop(import);
        assert_eq!(buf.to_vec().unwrap(), ones, "the import wrote the exporter's bytes");
    }

    /// Runs `test` with the simulator's violation log cleared, then checks that every import it
    /// made was freed once and that the live report is clean.
    fn checked(test: impl FnOnce()) {
        init_with_no_violations();
        test();
        assert_every_import_freed_once();
        assert_clean_report();
    }

    fn init_with_no_violations() {
        testing::init();
        if let Some(ctl) = testing::sim_control() {
            ctl.clear_violations();
        }
    }

    /// On the simulator: every imported pointer was freed once, none under its exporter's free.
    fn assert_every_import_freed_once() {
        if let Some(ctl) = testing::sim_control() {
            let wrong: Vec<_> = ctl
                .violations()
                .into_iter()
                .filter(|v| {
                    v.function.starts_with("cuMemFree") || v.message.contains("freed by its exporter")
                })
                .collect();
            assert!(wrong.is_empty(), "{wrong:#?}");
        }
    }

    fn assert_clean_report() {
        if let Some(ctl) = testing::sim_control() {
            let report = ctl.live_report();
            assert!(report.is_clean(), "live report not clean:\n{report}");
        }
    }

    /// Thread A drops an import of device 0's pool pointer, whose free is held. Meanwhile another
    /// thread imports a pointer of another pool (on device 1 when there is one; the held free is
    /// the hook's, so device 0 would show the same), reads it and drops it: neither waits for A's
    /// free, which used to run under the process's lock of imported pool addresses.
    #[test]
    #[serial]
    fn a_held_pool_pointer_free_does_not_hold_up_other_imports_and_drops() {
        checked(|| {
            let held_data: Vec<u32> = (0..1024).map(|i| i * 3 + 1).collect();
            let other_data: Vec<u32> = (0..2048).map(|i| i ^ 0x3C3C).collect();
            let (held, other) = held_and_other(&held_data, &other_data);
            // SAFETY: `held.buf` outlives the import (dropped after it below); its fill completed
            // above and nothing writes it while the import lives.
            let import = unsafe { held.imported.import_pointer::<u32>(&held.export, &held.stream) }.unwrap();
            assert_eq!(import.as_slice().to_vec().unwrap(), held_data);
            let (hold, step) = hold();
            let answered = std::thread::scope(|scope| {
                scope.spawn(move || {
                    hold_next_free(step);
                    drop(import);
                });
                hold.arrived.recv_timeout(PATIENCE).expect("the drop reached its free");
                other_import_while_held(scope, &other, hold)
            });
            let read = answered
                .unwrap_or_else(|why| panic!("another pool's import and drop, with a free held: {why}"));
            assert_eq!(read.unwrap(), other_data);
            drop(other);
            drop(held);
        });
    }

    /// While thread A's drop of an import holds its free, another thread imports bytes that name
    /// the same allocation (the last of the driver's 64 bytes flipped: an H100 mapped them at the
    /// live import's address, 2026-11-23; the simulator does too). The driver answers with the
    /// address being freed, so the import waits for that free and imports again, getting a
    /// mapping of its own: it reads and writes the exporter's bytes, and its drop frees it once.
    /// Meanwhile an import of the same bytes as the one being dropped is refused at once
    /// (`AlreadyMapped`): the drop releases them only after its free. (The other order, the free
    /// returning before the import and the driver placing a fresh mapping at the freed address, is
    /// not driven here: the simulator places each import at a new address.)
    #[test]
    #[serial]
    fn an_import_answered_with_an_address_being_freed_imports_again() {
        checked(|| {
            let data: Vec<u32> = (0..4096).map(|i| i * 7 + 5).collect();
            let Exported { stream, buf, export, imported } = exported(0, &data);
            let imported = Arc::new(imported);
            let same_allocation = same_allocation_as(&export);
            // SAFETY: `buf` outlives every import (dropped after them); its fill completed above,
            // and it is read only after the second import's write has completed (`to_vec` waits).
            let first = unsafe { imported.import_pointer::<u32>(&export, &stream) }.unwrap();
            let freed_at = first.device_ptr();
            let (hold, step) = hold();
            let waits_before = TOMBSTONE_WAITS.load(Ordering::SeqCst);
            let (same_bytes, waited, second) = std::thread::scope(|scope| {
                scope.spawn(move || {
                    hold_next_free(step);
                    drop(first);
                });
                hold.arrived.recv_timeout(PATIENCE).expect("the drop reached its free");
                let (done_tx, done) = channel();
                let (imported_ref, stream_ref, export_ref) = (&*imported, &stream, &export);
                scope.spawn(move || {
                    // SAFETY: as above; an import made here is dropped at once.
                    let import = unsafe { imported_ref.import_pointer::<u32>(export_ref, stream_ref) };
                    let _ = done_tx.send(import.map(drop));
                });
                let same_bytes = match answer_while_held(&done, &hold) {
                    Ok(answer) => answer,
                    Err(why) => {
                        // Opened, so that the waiting import and the scope finish.
                        drop(hold);
                        panic!("an import of the bytes being dropped, while its free is held: {why}");
                    }
                };
                // Not scoped: should the import never wake, the test fails after PATIENCE instead
                // of waiting for it at the end of the scope.
                let (imported, stream) = (Arc::clone(&imported), stream.clone());
                let second = std::thread::spawn(move || {
                    // SAFETY: as above.
                    unsafe { imported.import_pointer::<u32>(&same_allocation, &stream) }
                });
                let start = Instant::now();
                while TOMBSTONE_WAITS.load(Ordering::SeqCst) == waits_before
                    && !second.is_finished()
                    && start.elapsed() < PATIENCE
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let waited = TOMBSTONE_WAITS.load(Ordering::SeqCst) > waits_before;
                drop(hold);
                (same_bytes, waited, second)
            });
            assert!(
                matches!(same_bytes, Err(cumem_core::Error::AlreadyMapped { .. })),
                "an import of the bytes being dropped: {same_bytes:?}"
            );
            assert!(waited, "the import did not wait for the free of {freed_at:#x}");
            let start = Instant::now();
            while !second.is_finished() {
                assert!(
                    start.elapsed() < PATIENCE,
                    "the import waited {PATIENCE:?} after the free of {freed_at:#x} returned"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_reads_and_writes_the_exporters_bytes(second.join().unwrap().unwrap(), &buf, &data);
            drop(imported);
            drop(buf);
        });
    }

    /// Another thread's import of bytes that name a live import's allocation (the last byte
    /// flipped) is answered with the live import's address and held before it claims it;
    /// meanwhile the live import is dropped and its free returns. The answer may be the mapping
    /// that free unmapped, so the import imports again and gets a mapping of its own: it reads and
    /// writes the exporter's bytes, and its drop frees it once. (An import that claimed the answer
    /// would hold an unmapped address: on the simulator it fails, `NotFound`, and frees that
    /// address a second time.)
    #[test]
    #[serial]
    fn an_import_answered_before_a_free_returns_imports_again() {
        checked(|| {
            let data: Vec<u32> = (0..4096).map(|i| i * 11 + 3).collect();
            let Exported { stream, buf, export, imported } = exported(0, &data);
            let same_allocation = same_allocation_as(&export);
            // SAFETY: `buf` outlives both imports (dropped after them); its fill completed above,
            // and it is read only after the second import's write has completed (`to_vec` waits).
            let first = unsafe { imported.import_pointer::<u32>(&export, &stream) }.unwrap();
            let freed_at = first.device_ptr();
            let (hold, step) = hold();
            let again_before = FREED_IN_WINDOW.load(Ordering::SeqCst);
            let second = std::thread::scope(|scope| {
                let (imported, stream, same_allocation) = (&imported, &stream, &same_allocation);
                let second = scope.spawn(move || {
                    hold_next_answer(step);
                    // SAFETY: as above.
                    unsafe { imported.import_pointer::<u32>(same_allocation, stream) }
                });
                let reached = hold.arrived.recv_timeout(PATIENCE);
                drop(first);
                drop(hold);
                reached.expect("the import reached its claim");
                second.join().unwrap()
            });
            assert_reads_and_writes_the_exporters_bytes(second.unwrap(), &buf, &data);
            drop(imported);
            drop(buf);
            assert!(
                FREED_IN_WINDOW.load(Ordering::SeqCst) > again_before,
                "the import claimed the address {freed_at:#x} freed under its answer"
            );
        });
    }

    /// An import held between the driver's answer and its claim (where one whose
    /// `cuMemPoolImportPointer` waits behind a free of its context would be) holds up no other
    /// thread's import, read and drop of another pool's pointer; it then completes.
    #[test]
    #[serial]
    fn an_import_in_flight_does_not_hold_up_other_imports_and_drops() {
        checked(|| {
            let held_data: Vec<u32> = (0..1024).map(|i| i * 13 + 1).collect();
            let other_data: Vec<u32> = (0..2048).map(|i| i ^ 0x5A5A).collect();
            let (held, other) = held_and_other(&held_data, &other_data);
            let (hold, step) = hold();
            let (answered, slow) = std::thread::scope(|scope| {
                let held = &held;
                let slow = scope.spawn(move || {
                    hold_next_answer(step);
                    // SAFETY: `held.buf` outlives the import (dropped at once); its fill completed
                    // above and nothing writes it.
                    let import = unsafe { held.imported.import_pointer::<u32>(&held.export, &held.stream) };
                    import.and_then(|import| import.as_slice().to_vec())
                });
                let reached = hold.arrived.recv_timeout(PATIENCE);
                let answered = other_import_while_held(scope, &other, hold);
                reached.expect("the import reached its claim");
                (answered, slow.join().unwrap())
            });
            let read = answered
                .unwrap_or_else(|why| panic!("another pool's import and drop, with an import held: {why}"));
            assert_eq!(read.unwrap(), other_data);
            assert_eq!(slow.unwrap(), held_data, "the held import completed");
            drop(other);
            drop(held);
        });
    }

    /// An import that panics after claiming the export's bytes (here in a hook, once the driver
    /// has answered) releases them while unwinding: the same bytes import afterwards, and that
    /// import reads the exporter's data. (The panicked import's answer stays mapped, unclaimed;
    /// the driver answers the next import with that mapping, uncounted, and its drop frees it.)
    #[test]
    #[serial]
    fn a_panicking_import_releases_the_export_bytes() {
        checked(|| {
            let data: Vec<u32> = (0..1024).map(|i| i * 17 + 9).collect();
            let Exported { stream, buf, export, imported } = exported(0, &data);
            AFTER_ANSWER
                .with(|h| *h.borrow_mut() = Some(Box::new(|| panic!("an import panics after the answer"))));
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: `buf` outlives the import (dropped after it below); its fill completed
                // above and nothing writes it while the import lives.
                unsafe { imported.import_pointer::<u32>(&export, &stream) }.map(drop)
            }));
            assert!(panicked.is_err(), "the hook panicked");
            // SAFETY: as above.
            let again = unsafe { imported.import_pointer::<u32>(&export, &stream) }
                .expect("the export's bytes were released by the panicking import");
            assert_eq!(again.as_slice().to_vec().unwrap(), data);
            drop(again);
            drop(imported);
            drop(buf);
        });
    }
}
