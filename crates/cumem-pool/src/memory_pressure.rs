//! A memory-pressure monitor: watches a device's free memory and a pool's reserved bytes against
//! thresholds and, when one is crossed, calls back and/or trims the pool.
//!
//! A threshold is *crossed* when a reading goes past it after one that did not (the first reading
//! counts as coming from the safe side), so a program under lasting pressure is told once, not on
//! every reading; it is told again after the reading came back. [`check`](MemoryPressureMonitor::check)
//! takes one reading on the calling thread; [`spawn`](MemoryPressureMonitor::spawn) takes one per
//! interval on a background thread until its handle is dropped. Trimming a [`CachingResource`]
//! waits for the streams that used its cached memory; a [`NativePoolResource`] releases what its
//! streams have finished with.
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DeviceBuffer, Stream};
//! use cumem_pool::{CachingResource, MemoryPressureMonitor, PoolConfig, Pressure, StatisticsResource};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::non_blocking(&ctx)?;
//! let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
//! let stats = Arc::new(StatisticsResource::new(pool.clone()));
//! let monitor = MemoryPressureMonitor::new(&ctx).watch_pool(pool.clone(), 4 << 20).trim_on_pressure();
//! drop(DeviceBuffer::<u8>::zeroed_in(&stats, &stream, 6 << 20)?); // cached by the pool
//! let events = monitor.check()?;
//! assert_eq!(events.len(), 1);
//! assert!(matches!(events[0].pressure, Pressure::PoolReserved { threshold, .. } if threshold == 4 << 20));
//! assert!(events[0].released_bytes >= 6 << 20);
//! assert_eq!(pool.stats().reserved_bytes, 0);
//! assert_eq!(stats.counters().total_bytes, 6 << 20);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use cumem_core::{Context, Result};
use parking_lot::Mutex;

use crate::{CachingResource, NativePoolResource};

/// A pool the monitor can read and trim.
pub trait TrimmablePool: Send + Sync + fmt::Debug {
    /// Device memory the pool holds now, in bytes.
    ///
    /// # Errors
    /// Reading the pool's accounting failed.
    fn reserved_bytes(&self) -> Result<u64>;

    /// Returns the pool's unused memory to the device; the bytes it released.
    ///
    /// # Errors
    /// Waiting for the pool's streams or releasing failed.
    fn release_unused(&self) -> Result<u64>;
}

impl TrimmablePool for CachingResource {
    fn reserved_bytes(&self) -> Result<u64> {
        Ok(self.stats().reserved_bytes)
    }

    fn release_unused(&self) -> Result<u64> {
        Ok(self.trim()?.released_bytes)
    }
}

impl TrimmablePool for NativePoolResource {
    fn reserved_bytes(&self) -> Result<u64> {
        Ok(self.pool().usage()?.reserved_current)
    }

    fn release_unused(&self) -> Result<u64> {
        let before = self.reserved_bytes()?;
        self.pool().trim_to(0)?;
        Ok(before.saturating_sub(self.reserved_bytes()?))
    }
}

/// Which threshold was crossed, with the reading that crossed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pressure {
    /// The device's free memory fell below `threshold`.
    LowFreeMemory {
        /// Free bytes read (`cuMemGetInfo`).
        free: usize,
        /// The device's total bytes.
        total: usize,
        /// The threshold it fell below.
        threshold: usize,
    },
    /// The watched pool's reserved bytes rose above `threshold`.
    PoolReserved {
        /// Reserved bytes read.
        reserved: u64,
        /// The threshold it rose above.
        threshold: u64,
    },
}

/// A threshold crossing and what the monitor did about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PressureEvent {
    /// What was crossed.
    pub pressure: Pressure,
    /// Bytes the watched pool released in response (0 without [`trim_on_pressure`](MemoryPressureMonitor::trim_on_pressure)).
    pub released_bytes: u64,
}

/// The callback of [`MemoryPressureMonitor::on_pressure`].
type Callback = dyn Fn(&PressureEvent) + Send + Sync;

/// Watches free device memory and a pool's reserved bytes; see the [module docs](self).
pub struct MemoryPressureMonitor {
    ctx: Context,
    min_free: Option<usize>,
    pool: Option<(Arc<dyn TrimmablePool>, u64)>,
    trim: bool,
    callback: Option<Box<Callback>>,
    /// Whether each threshold (free, reserved) was past at the last reading.
    past: Mutex<[bool; 2]>,
}

impl MemoryPressureMonitor {
    /// A monitor of `ctx`'s device with no threshold yet.
    pub fn new(ctx: &Context) -> Self {
        MemoryPressureMonitor {
            ctx: ctx.clone(),
            min_free: None,
            pool: None,
            trim: false,
            callback: None,
            past: Mutex::new([false; 2]),
        }
    }

    /// Reports when the device's free memory falls below `bytes`.
    pub fn min_free_bytes(mut self, bytes: usize) -> Self {
        self.min_free = Some(bytes);
        self
    }

    /// Watches `pool`, reporting when it holds more than `max_reserved` bytes.
    pub fn watch_pool(mut self, pool: Arc<dyn TrimmablePool>, max_reserved: u64) -> Self {
        self.pool = Some((pool, max_reserved));
        self
    }

    /// On any crossing, returns the watched pool's unused memory to the device.
    pub fn trim_on_pressure(mut self) -> Self {
        self.trim = true;
        self
    }

    /// Calls `callback` for each crossing (after trimming, when that is on).
    pub fn on_pressure(mut self, callback: impl Fn(&PressureEvent) + Send + Sync + 'static) -> Self {
        self.callback = Some(Box::new(callback));
        self
    }

    /// Takes one reading; returns the thresholds it crossed, after acting on them.
    ///
    /// # Errors
    /// Reading the device's memory or the pool failed, or trimming the pool failed.
    pub fn check(&self) -> Result<Vec<PressureEvent>> {
        let mut found = Vec::new();
        let mut past = self.past.lock();
        if let Some(threshold) = self.min_free {
            let info = self.ctx.mem_info()?;
            let now = info.free < threshold;
            if now && !past[0] {
                found.push(Pressure::LowFreeMemory { free: info.free, total: info.total, threshold });
            }
            past[0] = now;
        }
        if let Some((pool, threshold)) = &self.pool {
            let reserved = pool.reserved_bytes()?;
            let now = reserved > *threshold;
            if now && !past[1] {
                found.push(Pressure::PoolReserved { reserved, threshold: *threshold });
            }
            past[1] = now;
        }
        drop(past);
        let mut events = Vec::with_capacity(found.len());
        for (i, pressure) in found.into_iter().enumerate() {
            let device = self.ctx.device().ordinal();
            tracing::debug!(device, ?pressure, "memory pressure");
            // One trim answers every crossing of this reading.
            let released_bytes = match (&self.pool, self.trim && i == 0) {
                (Some((pool, _)), true) => {
                    let _span = tracing::debug_span!("pressure_trim", device).entered();
                    pool.release_unused()?
                }
                _ => 0,
            };
            let event = PressureEvent { pressure, released_bytes };
            if let Some(callback) = &self.callback {
                callback(&event);
            }
            events.push(event);
        }
        Ok(events)
    }

    /// Checks every `interval` on a background thread until the handle is dropped. A failed
    /// reading is logged (`tracing::warn`, once per run of failures) and the thread carries on.
    ///
    /// # Errors
    /// The thread could not be started.
    pub fn spawn(self: Arc<Self>, interval: Duration) -> std::io::Result<MonitorHandle> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new().name("cumem-pressure".into()).spawn(move || {
            let mut failing = false;
            loop {
                match self.check() {
                    Ok(_) => failing = false,
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(error = %e, "memory pressure monitor: a reading failed");
                    }
                    Err(_) => {}
                }
                if !matches!(stopped.recv_timeout(interval), Err(mpsc::RecvTimeoutError::Timeout)) {
                    return;
                }
            }
        })?;
        Ok(MonitorHandle { stop: Some(stop), thread: Some(thread) })
    }
}

impl fmt::Debug for MemoryPressureMonitor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPressureMonitor")
            .field("device", &self.ctx.device().ordinal())
            .field("min_free", &self.min_free)
            .field("pool", &self.pool)
            .field("trim", &self.trim)
            .finish_non_exhaustive()
    }
}

/// A monitor running on its own thread; dropping the handle stops it and waits for it.
#[derive(Debug)]
pub struct MonitorHandle {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for MonitorHandle {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::warn!("the memory pressure monitor thread panicked");
        }
    }
}
