//! One process imports buffers of its own [`ShareablePool`]: a second import of an export while
//! the first lives is refused with [`Error::AlreadyMapped`] (through the same or another
//! [`ImportedPool`] of the pool, which shares the first's driver handle, each destroyed once), and
//! allowed again once the first is dropped; an `ImportedPool` dropped while buffers imported
//! through another of the same handle live does not leak the handle; a second import that the
//! driver maps at the live import's address is refused without disturbing the first, also from
//! another device's context; an export whose buffer the exporter already freed imports (as on an
//! H100) and the simulator reports it; the pool imported for a device without access to it is
//! [`Error::WrongDevice`]; an import leaked by its drop keeps its imported pool (also when a
//! subscriber panics on the drop's warning); a failed destroy's warning is logged with the
//! imported-pools lock let go (a subscriber may import); an import dropped
//! inside a `queue_on` closure is freed, not leaked; a pointer exports before the pool was ever
//! exported (by hand), also from two threads at once; an import at an address misaligned for its
//! type is refused and freed; a refused import does not wait for the caller's stream; a direct `DeviceResource::allocate` with a stream of another
//! device is `WrongDevice`; a block last used on another device's legacy stream is freed after its
//! work, not on this device's legacy stream; a size cap of 0 bytes is `ZeroSize`, not a pool without a cap. The process ends with a clean live report.

use std::sync::Arc;

use cumem_core::{AllocLayout, Context, Device, DeviceBuffer, DeviceResource, Error, Stream};
use cumem_ipc::{ImportedPool, PoolPointerExport, ShareablePool};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::sys::{self, CUresult};
use cumem_sys::testing;
use cumem_sys::testing::within_watchdog;
use serial_test::serial;

/// Two devices, for the import on a device without access to the pool.
const SIM_CONFIG: &str = "devices=2";

fn assert_clean_report() {
    if let Some(ctl) = testing::sim_control() {
        let report = ctl.live_report();
        assert!(report.is_clean(), "live report not clean:\n{report}");
    }
}

/// On the simulator: no refused destroy of an imported pool (one destroyed under its imports),
/// no refused or doubled free of an imported pointer, no exporter's free under a live import.
fn assert_no_refused_destroys_or_frees() {
    if let Some(ctl) = testing::sim_control() {
        let wrong: Vec<_> = ctl
            .violations()
            .into_iter()
            .filter(|v| {
                v.message.contains("freed by its exporter")
                    || ["cuMemPoolDestroy", "cuMemFree_v2"].contains(&v.function.as_str())
            })
            .collect();
        assert!(wrong.is_empty(), "{wrong:#?}");
    }
}

/// Gives `device` read-write access to the (imported) pool `pool`; false on a real driver that
/// refuses it (no peer access between the devices).
fn grant_read_write(pool: sys::CUmemoryPool, device: i32) -> bool {
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: one valid descriptor for the call; `pool` is a live pool handle.
    let code = unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) };
    if testing::sim_control().is_some() {
        assert_eq!(code, CUresult::CUDA_SUCCESS);
    }
    code == CUresult::CUDA_SUCCESS
}

/// The exporting side of most tests: device 0's context and a stream on it, a fresh
/// [`ShareablePool`], a buffer of it holding `data` (its fill completed), and the buffer's export.
struct Exported {
    device: Device,
    ctx: Context,
    stream: Stream,
    pool: Arc<ShareablePool>,
    buf: DeviceBuffer<u32>,
    export: PoolPointerExport,
}

fn exported(data: &[u32]) -> Exported {
    let device = Device::get(0).unwrap();
    let ctx = device.context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let pool = Arc::new(ShareablePool::new(&ctx).unwrap());
    let buf = DeviceBuffer::from_slice_in(&pool, &stream, data).unwrap();
    buf.order().synchronize().unwrap();
    let export = pool.export_pointer(&buf).unwrap();
    Exported { device, ctx, stream, pool, buf, export }
}

/// Imports `pool` for `device` through a descriptor that is closed again at once.
fn import_pool(device: &Device, pool: &ShareablePool) -> ImportedPool {
    let fd = pool.export_fd().unwrap();
    ImportedPool::from_fd(device, &fd).unwrap()
}

/// Starts the simulator (or the driver) with an empty violation log.
fn init_with_no_violations() {
    testing::init_with(SIM_CONFIG);
    if let Some(ctl) = testing::sim_control() {
        ctl.clear_violations();
    }
}

#[test]
#[serial]
fn a_second_import_of_a_live_import_is_refused() {
    testing::init_with(SIM_CONFIG);
    {
        let data: Vec<u32> = (0..4096).map(|i| i ^ 0x5A5A).collect();
        let Exported { device, ctx: _ctx, stream, pool, buf, export } = exported(&data);
        let fd = pool.export_fd().unwrap();
        let imported = ImportedPool::from_fd(&device, &fd).unwrap();
        let other = ImportedPool::from_fd(&device, &fd).unwrap();
        drop(fd);
        // The driver gives a live import's handle again and counts the imports (an H100,
        // 2026-11-23): each `ImportedPool` destroys it once, below.
        assert_eq!(other.raw(), imported.raw());
        assert_ne!(imported.raw(), pool.raw());
        // SAFETY: `buf` outlives every import (dropped after them) and nothing writes it while
        // they live; its fill completed above.
        let first = unsafe { imported.import_pointer::<u32>(&export, &stream) }.unwrap();
        // SAFETY: as above.
        let second = unsafe { imported.import_pointer::<u32>(&export, &stream) };
        assert!(matches!(second, Err(Error::AlreadyMapped { .. })), "{second:?}");
        // SAFETY: as above.
        let through_other = unsafe { other.import_pointer::<u32>(&export, &stream) };
        assert!(matches!(through_other, Err(Error::AlreadyMapped { .. })), "{through_other:?}");
        assert_eq!(first.as_slice().to_vec().unwrap(), data);
        // An import offers a device buffer's view vocabulary.
        assert_eq!(first.slice(4000..).unwrap().to_vec().unwrap(), data[4000..]);
        let (head, tail) = first.split_at(96).unwrap();
        assert_eq!((head.len(), tail.len()), (96, 4000));
        assert!(matches!(first.chunks(0), Err(Error::ZeroSize { .. })), "a chunk of no values");
        drop(first);
        // SAFETY: as above.
        let again = unsafe { other.import_pointer::<u32>(&export, &stream) }.unwrap();
        assert_eq!(again.as_slice().to_vec().unwrap(), data);
        drop(again);
        drop(buf);
        drop(imported);
        // Still imported once: `other` imports through it.
        let buf = DeviceBuffer::from_slice_in(&pool, &stream, &data).unwrap();
        buf.order().synchronize().unwrap();
        let export = pool.export_pointer(&buf).unwrap();
        // SAFETY: as above.
        let through_other = unsafe { other.import_pointer::<u32>(&export, &stream) }.unwrap();
        assert_eq!(through_other.as_slice().to_vec().unwrap(), data);
        drop(through_other);
        drop(other);
        drop(buf);
        assert_no_refused_destroys_or_frees();
    }
    assert_clean_report();
}

/// Two `ImportedPool`s of one driver handle; the second is dropped while a buffer imported
/// through the first lives. The driver refuses to destroy an imported pool while pointers
/// imported through it live, and does not count that refusal (an H100, 2026-11-23, second run):
/// a destroy at that drop would leave the handle imported once too often, forever. The handle is
/// destroyed once per import when the last buffer and `ImportedPool` are gone.
#[test]
#[serial]
fn an_imported_pool_dropped_while_anothers_imports_live_is_not_leaked() {
    init_with_no_violations();
    {
        let data: Vec<u32> = (0..1024).map(|i| i * 3 + 1).collect();
        let Exported { device, ctx: _ctx, stream, pool, buf, export } = exported(&data);
        let fd = pool.export_fd().unwrap();
        let imported = ImportedPool::from_fd(&device, &fd).unwrap();
        let other = ImportedPool::from_fd(&device, &fd).unwrap();
        drop(fd);
        assert_eq!(other.raw(), imported.raw());
        let raw_pool = imported.raw() as u64;
        // SAFETY: `buf` outlives the import (dropped after it); its fill completed above and
        // nothing writes it while the import lives.
        let import = unsafe { imported.import_pointer::<u32>(&export, &stream) }.unwrap();
        drop(other);
        drop(imported);
        assert_eq!(import.as_slice().to_vec().unwrap(), data, "the pool is still imported");
        if let Some(ctl) = testing::sim_control() {
            assert!(
                ctl.live_report().pools.iter().any(|p| p.handle == raw_pool),
                "destroyed under its import"
            );
        }
        drop(import);
        if let Some(ctl) = testing::sim_control() {
            let report = ctl.live_report();
            assert!(
                !report.pools.iter().any(|p| p.handle == raw_pool),
                "the imported pool leaked:\n{report}"
            );
        }
        drop(buf);
        assert_no_refused_destroys_or_frees();
    }
    assert_clean_report();
}

/// A second import that the driver maps at a live import's address (export bytes that differ but
/// name the same allocation: the last of the driver's 64 bytes flipped, which an H100 imported with
/// SUCCESS at the live import's address, 2026-11-23, second run; the simulator does not read that
/// byte) is refused with `AlreadyMapped` and not freed: the driver does not count imports of one
/// address (an H100, 2026-11-23), so a free would unmap the first import under its
/// `ImportedBuffer`. The first import's bytes still round-trip, its drop frees it once, and
/// nothing leaks.
#[test]
#[serial]
fn an_import_at_a_live_imports_address_leaves_it_alone() {
    init_with_no_violations();
    {
        let data: Vec<u32> = (0..2048).map(|i| i * 31 + 9).collect();
        let Exported { device, ctx: _ctx, stream, pool, buf, export } = exported(&data);
        let wire = export.to_bytes();
        let imported = import_pool(&device, &pool);
        // The last byte of the driver's 64 (after the 8-byte tag).
        let mut other_wire = wire;
        other_wire[8 + 63] ^= 0xFF;
        let export = PoolPointerExport::from_bytes(&wire).unwrap();
        let same_allocation = PoolPointerExport::from_bytes(&other_wire).unwrap();
        assert_ne!(export, same_allocation);
        // SAFETY: `buf` outlives both imports (dropped after them) and nothing writes it while
        // they live; its fill completed above.
        let mut first = unsafe { imported.import_pointer::<u32>(&export, &stream) }.unwrap();
        // SAFETY: as above.
        let second = unsafe { imported.import_pointer::<u32>(&same_allocation, &stream) };
        assert!(matches!(second, Err(Error::AlreadyMapped { .. })), "{second:?}");
        assert_eq!(first.as_slice().to_vec().unwrap(), data, "the first import is still mapped");
        let ones = vec![1u32; 2048];
        cumem_copy::copy_h2d(&ones, &mut first.as_mut_slice()).unwrap();
        assert_eq!(first.as_slice().to_vec().unwrap(), ones);
        drop(first);
        assert_eq!(buf.to_vec().unwrap(), ones, "the import wrote the exporter's bytes");
        // The refusal left no claim behind: the other bytes import now.
        // SAFETY: as above.
        let again = unsafe { imported.import_pointer::<u32>(&same_allocation, &stream) }.unwrap();
        drop(again);
        drop(buf);
        if let Some(ctl) = testing::sim_control() {
            let frees: Vec<_> =
                ctl.violations().into_iter().filter(|v| v.function.starts_with("cuMemFree")).collect();
            assert!(frees.is_empty(), "every import was freed once: {frees:#?}");
        }
    }
    assert_clean_report();
}

/// As above, from another device's context: device 1, given read-write access to the imported
/// pool, imports the pool again (the driver gives the live import's handle, counted, as an H100
/// did in a second context, 2026-11-23, second run) and then the flipped bytes. The driver maps
/// them at the live import's address (the H100 did so in a second context): the address is
/// claimed in the process, not per context, so this is refused too. The claim is released only
/// after the first import's free, so the bytes import in the other context once it is dropped.
/// The first `ImportedPool` is dropped while that import lives: the handle is destroyed twice,
/// once per context, after it.
#[test]
#[serial]
fn an_import_at_a_live_imports_address_in_another_context_is_refused() {
    testing::init_with(SIM_CONFIG);
    if Device::count().unwrap() < 2 {
        return testing::skip("needs a second device");
    }
    if let Some(ctl) = testing::sim_control() {
        ctl.clear_violations();
    }
    {
        let data: Vec<u32> = (0..2048).map(|i| i * 17 + 5).collect();
        let Exported { device, ctx: _ctx, stream, pool, buf, export } = exported(&data);
        let wire = export.to_bytes();
        let fd = pool.export_fd().unwrap();
        let imported = ImportedPool::from_fd(&device, &fd).unwrap();
        // Granted on the imported handle: the simulator keeps access per pool handle (whether an
        // exporter's grant reaches its importers is not on record).
        if !grant_read_write(imported.raw(), 1) {
            return testing::skip("device 1 cannot be given access to device 0's pool");
        }
        let there = ImportedPool::from_fd(&Device::get(1).unwrap(), &fd).unwrap();
        drop(fd);
        assert_eq!(there.raw(), imported.raw(), "the live import's handle");
        assert_ne!(there.context(), imported.context());
        let there_stream = Stream::new(there.context()).unwrap();
        let mut other_wire = wire;
        other_wire[8 + 63] ^= 0xFF;
        let export = PoolPointerExport::from_bytes(&wire).unwrap();
        let same_allocation = PoolPointerExport::from_bytes(&other_wire).unwrap();
        // SAFETY: `buf` outlives every import (dropped after them) and nothing writes it while
        // they live; its fill completed above.
        let first = unsafe { imported.import_pointer::<u32>(&export, &stream) }.unwrap();
        // SAFETY: as above.
        let second = unsafe { there.import_pointer::<u32>(&same_allocation, &there_stream) };
        assert!(matches!(second, Err(Error::AlreadyMapped { .. })), "{second:?}");
        assert_eq!(first.as_slice().to_vec().unwrap(), data, "the first import is still mapped");
        drop(first);
        // SAFETY: as above.
        let again = unsafe { there.import_pointer::<u32>(&same_allocation, &there_stream) }.unwrap();
        drop(imported);
        assert_eq!(again.as_slice().to_vec().unwrap(), data);
        drop(again);
        drop(there);
        drop(buf);
        assert_no_refused_destroys_or_frees();
    }
    assert_clean_report();
}

/// A pointer exported before anything else (no `export_fd` ever, then from two threads at once
/// on another fresh pool) exports: a GPU driver refuses pointers of a pool never exported (an
/// H100, 2026-11-23), so `export_pointer` exports the pool itself first. The export imports and
/// reads the exporter's bytes.
#[test]
#[serial]
fn a_pointer_exports_before_the_pool_does() {
    testing::init_with(SIM_CONFIG);
    {
        let data: Vec<u32> = (0..1000).map(|i| i * 7 + 3).collect();
        let Exported { device, ctx, stream, pool, buf, export } = exported(&data);
        assert_eq!(export.bytes(), 4000);
        // Exported again, and the pool afterwards, as before.
        assert_eq!(pool.export_pointer(&buf).unwrap(), export);
        let imported = import_pool(&device, &pool);
        // SAFETY: `buf` outlives the import (dropped after it); its fill completed above and
        // nothing writes it while the import lives.
        let import = unsafe { imported.import_pointer::<u32>(&export, &stream) }.unwrap();
        assert_eq!(import.as_slice().to_vec().unwrap(), data);
        drop(import);
        drop(buf);

        // Two threads export the first pointers of a fresh pool at once.
        let fresh = Arc::new(ShareablePool::new(&ctx).unwrap());
        let bufs: Vec<_> =
            (0..2).map(|_| DeviceBuffer::<u32>::zeroed_in(&fresh, &stream, 256).unwrap()).collect();
        let barrier = std::sync::Barrier::new(2);
        std::thread::scope(|scope| {
            let exports: Vec<_> = bufs
                .iter()
                .map(|b| {
                    let (fresh, barrier) = (&fresh, &barrier);
                    scope.spawn(move || {
                        barrier.wait();
                        fresh.export_pointer(b)
                    })
                })
                .collect();
            for e in exports {
                let e = e.join().unwrap();
                assert!(matches!(&e, Ok(e) if e.bytes() == 1024), "{e:?}");
            }
        });
        drop(bufs);
        if let Some(ctl) = testing::sim_control() {
            let refused: Vec<_> =
                ctl.violations().into_iter().filter(|v| v.function == "cuMemPoolExportPointer").collect();
            assert!(refused.is_empty(), "{refused:#?}");
        }
    }
    assert_clean_report();
}

/// An export whose buffer the exporter already freed imports: an H100 answered SUCCESS in the
/// exporting process (2026-11-23), so `import_pointer` cannot refuse it, which is why keeping the
/// buffer is the caller's safety promise. The simulator records the broken promise.
#[test]
#[serial]
fn an_export_of_a_freed_buffer_imports_and_is_reported() {
    testing::init_with(SIM_CONFIG);
    // What a GPU's address range of such an import is (which `import_pointer` checks) is not on
    // record.
    let Some(ctl) = testing::sim_control() else { return };
    {
        let Exported { device, ctx: _ctx, stream, pool, buf, export } = exported(&[0; 1024]);
        let imported = import_pool(&device, &pool);
        drop(buf);
        ctl.clear_violations();
        // SAFETY: deliberately broken (item 1: the buffer is gone); nothing reads or writes the
        // import, which is dropped at once.
        let stale = unsafe { imported.import_pointer::<u32>(&export, &stream) }.unwrap();
        assert_eq!(stale.len(), 1024);
        drop(stale);
        let reported: Vec<_> =
            ctl.violations().into_iter().filter(|v| v.message.contains("already freed")).collect();
        assert_eq!(reported.len(), 1, "{reported:#?}");
        ctl.clear_violations();
    }
    assert_clean_report();
}

#[test]
#[serial]
fn a_pool_imported_for_a_device_without_access_is_wrong_device() {
    testing::init_with(SIM_CONFIG);
    if Device::count().unwrap() < 2 {
        return;
    }
    {
        let device = Device::get(0).unwrap();
        let pool = ShareablePool::new(&device.context().unwrap()).unwrap();
        let fd = pool.export_fd().unwrap();
        let elsewhere = Device::get(1).unwrap();
        let refused = ImportedPool::from_fd(&elsewhere, &fd);
        assert!(matches!(refused, Err(Error::WrongDevice { expected: 0, actual: 1 })), "{refused:?}");
        let here = ImportedPool::from_fd(&device, &fd);
        assert!(here.is_ok(), "{here:?}");
    }
    assert_clean_report();
}

/// Fails the next `cuStreamSynchronize` on this thread once, with `CUDA_ERROR_LAUNCH_FAILED`: the
/// wait of an import's drop.
fn fail_the_next_sync(ctl: &cumem_sys::sim_control::Control) -> cumem_sys::sim_control::FaultId {
    ctl.inject_fault(FaultRule {
        function: "cuStreamSynchronize".into(),
        nth: 1,
        code: CUresult::CUDA_ERROR_LAUNCH_FAILED,
        times: 1,
        this_thread_only: true,
    })
}

/// The import at `ptr` is leaked, and its imported pool `raw_pool` is still live (`why` not).
#[track_caller]
fn assert_leaked_with_its_pool(
    ctl: &cumem_sys::sim_control::Control,
    ptr: u64,
    raw_pool: sys::CUmemoryPool,
    why: &str,
) {
    let report = ctl.live_report();
    assert!(report.contains_ptr(ptr), "the import is leaked:\n{report}");
    assert!(report.pools.iter().any(|p| p.handle == raw_pool as u64 && p.imported), "{why}:\n{report}");
}

/// Frees by hand, in `ctx`, the leaked import at `ptr` and then its imported pool `raw_pool`: what
/// the process would leak until exit, ended so that the report ends clean.
fn free_the_leaked(ctx: &Context, ptr: u64, raw_pool: sys::CUmemoryPool) {
    ctx.bind().unwrap();
    // SAFETY: the leaked import's address, freed once; nothing uses it any more.
    assert_eq!(unsafe { sys::cuMemFree_v2(ptr) }, CUresult::CUDA_SUCCESS);
    // SAFETY: the leaked pool handle, destroyed once, after its only import.
    assert_eq!(unsafe { sys::cuMemPoolDestroy(raw_pool) }, CUresult::CUDA_SUCCESS);
}

/// An import whose drop cannot wait for its work is leaked, and its imported pool with it: the
/// pool is not destroyed under the live import.
#[test]
#[serial]
fn a_leaked_import_keeps_its_imported_pool() {
    testing::init_with(SIM_CONFIG);
    let Some(ctl) = testing::sim_control() else { return };
    {
        let Exported { device, ctx, stream, pool, buf, export } = exported(&[0; 1024]);
        let imported = import_pool(&device, &pool);
        let raw_pool = imported.raw();
        // SAFETY: `buf` outlives the import (freed by hand below before `buf` drops); nothing
        // writes it meanwhile.
        let import = unsafe { imported.import_pointer::<u32>(&export, &stream) }.unwrap();
        let ptr = import.device_ptr();
        assert_eq!(import.as_slice().to_vec().unwrap(), vec![0; 1024]);
        drop(imported);
        let rule = fail_the_next_sync(&ctl);
        drop(import);
        ctl.remove_fault(rule);
        assert_leaked_with_its_pool(&ctl, ptr, raw_pool, "its imported pool is not destroyed");
        free_the_leaked(&ctx, ptr, raw_pool);
        drop(buf);
    }
    assert_clean_report();
}

/// A tracing layer that panics on every warning.
struct PanicOnWarn;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for PanicOnWarn {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::WARN {
            panic!("a subscriber panics on a warning");
        }
    }
}

/// As above, under a subscriber that panics on the drop's warning: the import is leaked before
/// the warning, so the panic drops nothing that would destroy its imported pool under it.
#[test]
#[serial]
fn a_leaked_import_keeps_its_imported_pool_under_a_subscriber_that_panics() {
    use tracing_subscriber::layer::SubscriberExt;
    init_with_no_violations();
    let Some(ctl) = testing::sim_control() else { return };
    {
        let Exported { device, ctx, stream, pool, buf, export } = exported(&[0; 1024]);
        let imported = import_pool(&device, &pool);
        let raw_pool = imported.raw();
        // SAFETY: `buf` outlives the import (freed by hand below before `buf` drops); nothing
        // writes it meanwhile.
        let import = unsafe { imported.import_pointer::<u32>(&export, &stream) }.unwrap();
        let ptr = import.device_ptr();
        drop(imported);
        let rule = fail_the_next_sync(&ctl);
        let subscriber = tracing_subscriber::registry().with(PanicOnWarn);
        let dropped = cumem_sys::testing::with_subscriber(subscriber, || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(import)))
        });
        ctl.remove_fault(rule);
        assert!(dropped.is_err(), "the subscriber was to panic on the drop's warning");
        assert_leaked_with_its_pool(&ctl, ptr, raw_pool, "its imported pool was destroyed under it");
        assert_no_refused_destroys_or_frees();
        free_the_leaked(&ctx, ptr, raw_pool);
        drop(buf);
    }
    assert_clean_report();
}

/// An imported pool whose destroy fails warns with the imported-pools lock let go: a subscriber
/// that imports a pool on the warning (which takes that lock) must not deadlock. Under a bound,
/// since a deadlock hangs rather than fails.
#[test]
#[serial]
fn a_subscriber_that_imports_on_a_failed_destroys_warning_does_not_deadlock() {
    use tracing_subscriber::layer::SubscriberExt;
    init_with_no_violations();
    if testing::sim_control().is_none() {
        return testing::skip("injects faults: simulator only");
    }
    {
        let Exported { device, ctx, stream: _stream, pool, buf, export: _export } = exported(&[0; 1024]);
        let (tx, rx) = std::sync::mpsc::channel();
        let dropping = {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let ctl = testing::sim_control().unwrap();
                let imported = import_pool(&device, &pool);
                let raw_pool = imported.raw() as usize;
                let reimported = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let flag = reimported.clone();
                let subscriber = tracing_subscriber::registry().with(OnWarn(move || {
                    drop(import_pool(&device, &pool));
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                }));
                let rule = ctl.inject_fault(FaultRule {
                    function: "cuMemPoolDestroy".into(),
                    nth: 1,
                    code: CUresult::CUDA_ERROR_INVALID_VALUE,
                    times: 1,
                    this_thread_only: true,
                });
                cumem_sys::testing::with_subscriber(subscriber, || drop(imported));
                ctl.remove_fault(rule);
                tx.send((raw_pool, reimported.load(std::sync::atomic::Ordering::SeqCst))).unwrap();
            })
        };
        let (raw_pool, reimported) = match rx.recv_timeout(std::time::Duration::from_secs(20)) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                panic!("deadlocked: the warning was logged with the imported-pools lock held")
            }
            Err(e) => panic!("the dropping thread panicked (see above): {e}"),
        };
        dropping.join().unwrap();
        assert!(reimported, "the failed destroy did not warn");
        // The destroy that failed leaves the handle, ended by hand so the report ends clean.
        ctx.bind().unwrap();
        // SAFETY: the imported pool whose destroy failed, destroyed once; nothing imported
        // through it lives.
        assert_eq!(unsafe { sys::cuMemPoolDestroy(raw_pool as sys::CUmemoryPool) }, CUresult::CUDA_SUCCESS);
        drop(buf);
    }
    assert_clean_report();
}

/// A tracing layer that calls its function on every warning.
struct OnWarn<F>(F);

impl<S: tracing::Subscriber, F: Fn() + Send + Sync + 'static> tracing_subscriber::Layer<S> for OnWarn<F> {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::WARN {
            (self.0)()
        }
    }
}

#[test]
#[serial]
fn an_import_dropped_inside_a_closure_is_freed_with_its_pool() {
    testing::init_with(SIM_CONFIG);
    if testing::sim_control().is_none() {
        return testing::skip("reads the live report: simulator only");
    }
    within_watchdog("an import dropped inside a closure", || {
        let Some(ctl) = testing::sim_control() else { return };
        let Exported { device, ctx: _ctx, stream, pool, buf, export } = exported(&[0; 1024]);
        let imported = import_pool(&device, &pool);
        let raw_pool = imported.raw() as u64;
        // SAFETY: `buf` outlives the import (dropped after it, inside the closure below); nothing
        // writes it meanwhile.
        let import = unsafe { imported.import_pointer::<u32>(&export, &stream) }.unwrap();
        // By id: once freed, its address may be another test's allocation.
        let id = ctl.live_report().id_of(import.device_ptr()).expect("live");
        assert_eq!(import.as_slice().to_vec().unwrap(), vec![0; 1024]);
        // The imported pool now goes with the import.
        drop(imported);
        // The drop has exclusive access to its order, so it needs no lock, which a closure refuses.
        buf.as_slice()
            .queue_on(&stream, |_| {
                drop(import);
                Ok(())
            })
            .unwrap();
        let report = ctl.live_report();
        assert!(!report.contains_allocation(id), "the import leaked instead of being freed:\n{report}");
        assert!(!report.pools.iter().any(|p| p.handle == raw_pool), "its imported pool leaked:\n{report}");
    });
    assert_clean_report();
}

/// A `T` aligned more than the 32 MiB the simulator (and an H100) aligns a pointer import to.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(67108864))]
struct Aligned64MiB([u8; 64 << 20]);

/// An aligned offset does not make an aligned address. The simulator places a 64 MiB import at
/// the next 32 MiB boundary after the previous one and its guard gap, 96 MiB on: of two
/// imports in a row, one lies at an odd multiple of 32 MiB, which must be refused with
/// `Error::Misaligned` and freed, not handed out misaligned.
#[test]
#[serial]
fn an_import_at_an_address_misaligned_for_t_is_refused_and_freed() {
    init_with_no_violations();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("relies on the simulator's address placement");
    };
    {
        let device = Device::get(0).unwrap();
        let stream = Stream::new(&device.context().unwrap()).unwrap();
        let pool = Arc::new(ShareablePool::new(stream.context()).unwrap());
        let buf = DeviceBuffer::<Aligned64MiB>::zeroed_in(&pool, &stream, 1).unwrap();
        buf.order().synchronize().unwrap();
        let export = pool.export_pointer(&buf).unwrap();
        let imported = import_pool(&device, &pool);
        let mut refused = false;
        for _ in 0..2 {
            // SAFETY: `buf` outlives the imports (dropped after them) and nothing writes it.
            match unsafe { imported.import_pointer::<Aligned64MiB>(&export, &stream) } {
                Ok(import) => {
                    assert_eq!(import.device_ptr() % (64 << 20), 0, "an import misaligned for its type")
                }
                Err(Error::Misaligned { what: "imported address", value, .. }) => {
                    assert_eq!(value % (64 << 20), 32 << 20);
                    let report = ctl.live_report();
                    assert!(
                        !report.allocations.iter().any(|a| a.kind == "pool_import"),
                        "left imported:\n{report}"
                    );
                    refused = true;
                }
                Err(e) => panic!("{e:?}"),
            }
        }
        assert!(refused, "no import landed at an odd multiple of 32 MiB");
        drop(imported);
        drop(buf);
        assert_no_refused_destroys_or_frees();
    }
    assert_clean_report();
}

/// An export whose size runs past the exported allocation (its bytes are untrusted) is refused
/// after the driver's import, which the refusal frees at once, without synchronising the
/// caller's stream: work there may wait for this thread (or for another process waiting for it).
/// Here the stream is held by a gate that only the test opens, after the call. (On the simulator,
/// whose `cuMemFree` of an imported pool pointer does not wait for host functions; what a GPU's
/// does is not on record.)
#[test]
#[serial]
fn a_refused_import_does_not_wait_for_the_callers_stream() {
    init_with_no_violations();
    {
        let data: Vec<u32> = (0..1024).collect();
        let Exported { device, ctx, stream: _stream, pool, buf, export } = exported(&data);
        let imported = import_pool(&device, &pool);
        let mut bytes = export.to_bytes().to_vec();
        let at = PoolPointerExport::ENCODED_LEN - 8;
        bytes[at..].copy_from_slice(&((data.len() * 4) as u64 + 4096).to_le_bytes());
        let outside = PoolPointerExport::from_bytes(&bytes).unwrap();
        let held = Stream::non_blocking(&ctx).unwrap();
        ctx.bind().unwrap();
        // SAFETY: `held` is alive (owned here), and its context was just made current.
        let gate = unsafe { testing::hold(held.raw()) };
        // SAFETY: the import is refused, so nothing is accessed; `buf` outlives the call.
        let refused = unsafe { imported.import_pointer::<u32>(&outside, &held) };
        assert!(matches!(refused, Err(Error::InvalidValue { .. })), "{refused:?}");
        assert!(!held.query().unwrap(), "the refusal waited for the held stream");
        // Panics if the gate's deadline opened it meanwhile (a refusal that waited for it).
        gate.release();
        held.synchronize().unwrap();
        if let Some(ctl) = testing::sim_control() {
            let report = ctl.live_report();
            assert!(!report.allocations.iter().any(|a| a.kind == "pool_import"), "left imported:\n{report}");
        }
        // The refusal released its claim: the genuine export imports.
        // SAFETY: `buf` outlives the import (dropped after it) and nothing writes it meanwhile.
        let import = unsafe { imported.import_pointer::<u32>(&export, &held) }.unwrap();
        assert_eq!(import.to_vec().unwrap(), data);
        drop(import);
        drop(imported);
        drop(buf);
        assert_no_refused_destroys_or_frees();
    }
    assert_clean_report();
}

/// `DeviceBuffer`'s constructors check the stream's context against the resource's; a direct call
/// through the trait must check it too, rather than queue the pool's memory on another device's
/// stream.
#[test]
#[serial]
fn a_direct_allocation_on_another_devices_stream_is_wrong_device() {
    init_with_no_violations();
    if !testing::needs_devices(2) {
        return;
    }
    {
        let pool = ShareablePool::new(&Device::get(0).unwrap().context().unwrap()).unwrap();
        let other = Stream::new(&Device::get(1).unwrap().context().unwrap()).unwrap();
        let layout = AllocLayout::new(4096, 256).unwrap();
        let answered = pool.allocate(layout, &other);
        assert!(matches!(answered, Err(Error::WrongDevice { expected: 0, actual: 1 })), "{answered:?}");
    }
    assert_clean_report();
}

/// The driver reads a maxSize of 0 as no cap: a pool asked to hold at most 0 bytes must be refused,
/// not created without a limit.
#[test]
#[serial]
fn a_size_cap_of_zero_is_zero_size() {
    init_with_no_violations();
    {
        let ctx = Device::get(0).unwrap().context().unwrap();
        let answered = ShareablePool::with_max_size(&ctx, Some(0));
        assert!(matches!(answered, Err(Error::ZeroSize { .. })), "{answered:?}");
        // A cap that is not zero still makes a pool.
        ShareablePool::with_max_size(&ctx, Some(32 << 20)).unwrap();
    }
    assert_clean_report();
}

/// A block zeroed on a non-blocking device-0 stream held by a gate, then last used on device 1's
/// legacy stream and dropped; device 0's legacy stream then takes memory from the pool and writes
/// it. The free must follow the gated memset: freed with device 0's context current on the NULL
/// handle (device 0's legacy stream, which does not wait for a non-blocking stream), the block
/// would serve the next allocation at once and the gated zeros land on the new owner's data.
#[test]
#[serial]
fn a_block_last_used_on_another_devices_legacy_stream_is_freed_after_its_work() {
    init_with_no_violations();
    if !testing::needs_devices(2) {
        return;
    }
    {
        let (ctx0, ctx1) =
            (Device::get(0).unwrap().context().unwrap(), Device::get(1).unwrap().context().unwrap());
        let pool = Arc::new(ShareablePool::new(&ctx0).unwrap());
        let (s0, legacy0, legacy1) =
            (Stream::non_blocking(&ctx0).unwrap(), Stream::legacy(&ctx0), Stream::legacy(&ctx1));
        ctx0.bind().unwrap();
        // SAFETY: `s0` is alive (owned here), and its context was just made current.
        let gate = unsafe { testing::hold(s0.raw()) };
        let x = DeviceBuffer::<u32>::zeroed_in(&pool, &s0, 4096).unwrap();
        drop(x.order().use_on(&legacy1).unwrap()); // device 1's legacy stream follows every use
        drop(x);
        let data: Vec<u32> = (0..4096).map(|i| i * 3 + 1).collect();
        let y = DeviceBuffer::from_slice_in(&pool, &legacy0, &data).unwrap();
        let opener = gate.release_after(std::time::Duration::from_millis(150));
        legacy0.synchronize().unwrap();
        opener.join().unwrap();
        s0.synchronize().unwrap();
        assert_eq!(y.to_vec().unwrap(), data, "the gated memset of the freed block landed on the next owner");
        if let Some(ctl) = testing::sim_control() {
            let violations = ctl.violations();
            assert!(violations.is_empty(), "the block was freed under the gated work: {violations:?}");
        }
        drop(y);
    }
    assert_clean_report();
}
