//! The memory-pressure monitor on a simulated device of known size: crossings of the free-memory
//! and reserved-bytes thresholds are seen by value, once per crossing, and trimming answers them.
//! Several pools are watched at once, each against its own threshold.
//! Each test owns one device, so the free-memory readings are its own.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cumem_core::{Context, Device, DeviceBuffer, DriverResource, Stream};
use cumem_pool::{
    CachingResource, MemPool, MemPoolOptions, MemoryPressureMonitor, MonitorHandle, NativePoolResource,
    PoolConfig, Pressure, PressureEvent, TrimmablePool,
};
use cumem_sys::testing;
use parking_lot::Mutex;
use serial_test::parallel;

const SIM: &str = "devices=5,memory=64MiB";
const MIB: usize = 1 << 20;

/// Device `device`'s context; `None` (said on stderr) on a machine with fewer devices, where the
/// test would share a device with another and its free-memory readings would not be its own.
fn ctx(device: usize) -> Option<Context> {
    testing::init_with(SIM);
    if !testing::needs_devices(device + 1) {
        return None;
    }
    Some(Device::get(device).unwrap().context().unwrap())
}

#[test]
#[parallel]
fn low_free_memory_is_reported_once_per_crossing() {
    let Some(ctx) = ctx(0) else { return };
    let s = Stream::new(&ctx).unwrap();
    let info = ctx.mem_info().unwrap();
    let threshold = info.free - 16 * MIB;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let monitor = MemoryPressureMonitor::new(&ctx)
        .min_free_bytes(threshold)
        .on_pressure(move |e| record.lock().push(*e));
    assert!(monitor.check().unwrap().is_empty());
    let driver = Arc::new(DriverResource::new(&ctx));
    let a = DeviceBuffer::<u8>::zeroed_in(&driver, &s, 20 * MIB).unwrap();
    let events = monitor.check().unwrap();
    let expected = PressureEvent {
        pressure: Pressure::LowFreeMemory { free: info.free - 20 * MIB, total: info.total, threshold },
        released_bytes: 0,
    };
    if testing::sim_control().is_some() {
        assert_eq!(events, [expected], "the simulator charges exactly 20 MiB");
    } else {
        assert_eq!(events.len(), 1);
    }
    assert_eq!(*seen.lock(), events, "the callback saw the same event");
    assert!(monitor.check().unwrap().is_empty(), "still under: not reported again");
    drop(a);
    assert!(monitor.check().unwrap().is_empty(), "back above: re-armed");
    let _b = DeviceBuffer::<u8>::zeroed_in(&driver, &s, 20 * MIB).unwrap();
    assert_eq!(monitor.check().unwrap().len(), 1, "crossed again");
    assert_eq!(seen.lock().len(), 2);
}

#[test]
#[parallel]
fn a_caching_pool_over_its_threshold_is_trimmed() {
    let Some(ctx) = ctx(1) else { return };
    let s = Stream::non_blocking(&ctx).unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let monitor =
        MemoryPressureMonitor::new(&ctx).watch_pool(pool.clone(), 8 * MIB as u64).trim_on_pressure();
    assert!(monitor.check().unwrap().is_empty(), "an empty pool is under any threshold");
    let free_before = ctx.mem_info().unwrap().free;
    let kept = DeviceBuffer::<u8>::zeroed_in(&pool, &s, MIB).unwrap();
    let bufs: Vec<_> = (0..4).map(|_| DeviceBuffer::<u8>::zeroed_in(&pool, &s, 3 * MIB).unwrap()).collect();
    drop(bufs); // cached: the pool still holds them
    let reserved = pool.stats().reserved_bytes;
    assert!(reserved > 8 * MIB as u64, "reserved {reserved}");
    let events = monitor.check().unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].pressure, Pressure::PoolReserved { pool: 0, reserved, threshold: 8 * MIB as u64 });
    let after = pool.stats().reserved_bytes;
    assert_eq!(events[0].released_bytes, reserved - after, "what the pool released");
    assert!(after <= 8 * MIB as u64, "the kept buffer's segment stays: {after}");
    if testing::sim_control().is_some() {
        assert_eq!(free_before - ctx.mem_info().unwrap().free, after as usize, "the device got it back");
    }
    assert_eq!(kept.to_vec().unwrap(), vec![0; MIB]);
    assert!(monitor.check().unwrap().is_empty(), "back under: nothing new");
}

#[test]
#[parallel]
fn a_native_pool_over_its_threshold_is_trimmed() {
    let Some(ctx) = ctx(2) else { return };
    let s = Stream::new(&ctx).unwrap();
    // Keeps what is freed across synchronisations, as a pool tuned for reuse does.
    let options = MemPoolOptions { release_threshold: u64::MAX, ..MemPoolOptions::default() };
    let pool = Arc::new(NativePoolResource::new(MemPool::create(&ctx, options).unwrap()));
    drop(DeviceBuffer::<u8>::zeroed_in(&pool, &s, 10 * MIB).unwrap());
    s.synchronize().unwrap(); // the free has run: the memory is unused
    let reserved = pool.pool().usage().unwrap().reserved_current;
    assert!(reserved >= 10 * MIB as u64);
    let monitor =
        MemoryPressureMonitor::new(&ctx).watch_pool(pool.clone(), 4 * MIB as u64).trim_on_pressure();
    let events = monitor.check().unwrap();
    assert_eq!(
        events,
        [PressureEvent {
            pressure: Pressure::PoolReserved { pool: 0, reserved, threshold: 4 * MIB as u64 },
            released_bytes: reserved,
        }]
    );
    assert_eq!(pool.pool().usage().unwrap().reserved_current, 0);
}

#[test]
#[parallel]
fn a_background_monitor_reports_a_crossing() {
    let Some(ctx) = ctx(3) else { return };
    let s = Stream::new(&ctx).unwrap();
    let threshold = ctx.mem_info().unwrap().free - 8 * MIB;
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let monitor =
        Arc::new(MemoryPressureMonitor::new(&ctx).min_free_bytes(threshold).on_pressure(move |e| {
            let _ = tx.lock().send(*e);
        }));
    let handle = monitor.spawn(Duration::from_millis(1)).unwrap();
    let a = DeviceBuffer::<u8>::zeroed_in(&Arc::new(DriverResource::new(&ctx)), &s, 10 * MIB).unwrap();
    // Generous: only a broken monitor takes this long; nothing here measures speed.
    let event = rx.recv_timeout(Duration::from_secs(60)).expect("the monitor saw the crossing");
    assert!(matches!(event.pressure, Pressure::LowFreeMemory { free, .. } if free < threshold));
    drop(handle); // stops and joins the thread
    drop(a);
    assert!(rx.try_recv().is_err(), "one crossing, one event");
}

#[test]
#[parallel]
fn each_watched_pool_has_its_own_threshold_and_low_free_memory_trims_them_all() {
    let Some(ctx) = ctx(4) else { return };
    let s = Stream::non_blocking(&ctx).unwrap();
    let (first, second) = (
        Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default())),
        Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default())),
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    drop(DeviceBuffer::<u8>::zeroed_in(&first, &s, 12 * MIB).unwrap());
    drop(DeviceBuffer::<u8>::zeroed_in(&second, &s, 3 * MIB).unwrap());
    let (first_reserved, second_reserved) = (first.stats().reserved_bytes, second.stats().reserved_bytes);
    assert!(first_reserved > 0 && second_reserved > 0, "both pools cache what was freed");
    // The first pool is one byte over its threshold, the second exactly at its own.
    let monitor = MemoryPressureMonitor::new(&ctx)
        .watch_pool(first.clone(), first_reserved - 1)
        .watch_pool(second.clone(), second_reserved)
        .trim_on_pressure()
        .on_pressure(move |e| record.lock().push(*e));
    let events = monitor.check().unwrap();
    assert_eq!(
        events,
        [PressureEvent {
            pressure: Pressure::PoolReserved {
                pool: 0,
                reserved: first_reserved,
                threshold: first_reserved - 1
            },
            released_bytes: first_reserved,
        }]
    );
    assert_eq!(*seen.lock(), events);
    assert_eq!(first.stats().reserved_bytes, 0, "the pool over its threshold was trimmed");
    assert_eq!(second.stats().reserved_bytes, second_reserved, "the pool at its threshold was not");

    // Low free memory trims every watched pool, once each, for the one crossing.
    drop(DeviceBuffer::<u8>::zeroed_in(&first, &s, 12 * MIB).unwrap());
    let first_reserved = first.stats().reserved_bytes;
    let free = ctx.mem_info().unwrap().free;
    let low = MemoryPressureMonitor::new(&ctx)
        .min_free_bytes(free + 1)
        .watch_pool(first.clone(), 0)
        .watch_pool(second.clone(), 0)
        .trim_on_pressure();
    let events = low.check().unwrap();
    assert_eq!(events.len(), 3, "low free memory, then each pool over 0: {events:?}");
    assert!(matches!(events[0].pressure, Pressure::LowFreeMemory { threshold, .. } if threshold == free + 1));
    assert_eq!(events[0].released_bytes, first_reserved + second_reserved, "both pools gave back all");
    assert!(
        matches!(events[1].pressure, Pressure::PoolReserved { pool: 0, .. })
            && matches!(events[2].pressure, Pressure::PoolReserved { pool: 1, .. })
    );
    assert_eq!((events[1].released_bytes, events[2].released_bytes), (0, 0), "already trimmed");
    assert_eq!((first.stats().reserved_bytes, second.stats().reserved_bytes), (0, 0));
}

/// A pool whose readings the test scripts: each reading takes the next value (0 once the script
/// is used up), so a background monitor sees a given sequence of crossings whatever its timing.
#[derive(Debug, Default)]
struct Scripted(Mutex<std::collections::VecDeque<u64>>);

impl TrimmablePool for Scripted {
    fn reserved_bytes(&self) -> cumem_core::Result<u64> {
        Ok(self.0.lock().pop_front().unwrap_or(0))
    }
    fn release_unused(&self) -> cumem_core::Result<u64> {
        Ok(0)
    }
}

/// A callback that panics is logged and the background monitor goes on: the next crossing is
/// still reported (the thread used to die with the panic, and every later crossing went unseen).
#[test]
#[parallel]
fn a_background_monitor_outlives_a_callback_that_panics() {
    let Some(ctx) = ctx(0) else { return };
    let pool = Arc::new(Scripted(Mutex::new([200, 0, 300].into())));
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let calls = Mutex::new(0);
    let monitor = Arc::new(MemoryPressureMonitor::new(&ctx).watch_pool(pool, 100).on_pressure(move |e| {
        let mut calls = calls.lock();
        *calls += 1;
        if *calls == 1 {
            panic!("the pressure callback panicked (on purpose)");
        }
        let _ = tx.lock().send(*e);
    }));
    let handle = monitor.spawn(Duration::from_millis(1)).unwrap();
    // Generous: only a dead monitor takes this long; nothing here measures speed.
    let event = rx.recv_timeout(Duration::from_secs(60)).expect("the second crossing is reported");
    assert!(matches!(event.pressure, Pressure::PoolReserved { pool: 0, reserved: 300, threshold: 100 }));
    drop(handle);
}

/// The callback may drop the monitor's own handle (a program that stops monitoring once told):
/// the drop returns instead of joining its own thread, which panicked.
#[test]
#[parallel]
fn a_callback_may_drop_its_own_monitors_handle() {
    let Some(ctx) = ctx(0) else { return };
    let pool = Arc::new(Scripted(Mutex::new([200].into())));
    let handle_slot: Arc<Mutex<Option<MonitorHandle>>> = Arc::default();
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let slot = handle_slot.clone();
    let monitor = Arc::new(MemoryPressureMonitor::new(&ctx).watch_pool(pool, 100).on_pressure(move |_| {
        // Taken out of the lock first: the handle's drop must not run under the test's lock.
        let handle = slot.lock().take();
        drop(handle);
        let _ = tx.lock().send(());
    }));
    // Held under the lock until stored, so the callback cannot look before the handle is there.
    let mut guard = handle_slot.lock();
    *guard = Some(monitor.spawn(Duration::from_millis(1)).unwrap());
    drop(guard);
    rx.recv_timeout(Duration::from_secs(60)).expect("the callback dropped the handle and went on");
    assert!(handle_slot.lock().is_none());
}
