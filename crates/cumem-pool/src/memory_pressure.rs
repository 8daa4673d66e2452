//! A memory-pressure monitor: watches a device's free memory and the reserved bytes of any number
//! of pools against thresholds and, when one is crossed, calls back and/or trims pools.
//!
//! A threshold is *crossed* when a reading goes past it after one that did not (the first reading
//! counts as coming from the safe side), so a program under lasting pressure is told once, not on
//! every reading; it is told again after the reading came back. Each watched pool has its own
//! threshold; with trimming on, a pool over its threshold is trimmed, and low free memory trims every
//! watched pool (each pool at most once per reading). [`check`](MemoryPressureMonitor::check)
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
//! assert!(matches!(events[0].pressure, Pressure::PoolReserved { pool: 0, threshold, .. } if threshold == 4 << 20));
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
    /// A watched pool's reserved bytes rose above `threshold`.
    PoolReserved {
        /// Which pool: its position among the [`watch_pool`](MemoryPressureMonitor::watch_pool)
        /// calls, from 0.
        pool: usize,
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
    /// Bytes the pools trimmed for this crossing released (0 without
    /// [`trim_on_pressure`](MemoryPressureMonitor::trim_on_pressure), and for a crossing whose pools
    /// an earlier crossing of the same reading already trimmed).
    pub released_bytes: u64,
}

/// The callback of [`MemoryPressureMonitor::on_pressure`].
type Callback = dyn Fn(&PressureEvent) + Send + Sync;

/// Watches free device memory and pools' reserved bytes; see the [module docs](self).
pub struct MemoryPressureMonitor {
    ctx: Context,
    min_free: Option<usize>,
    /// The watched pools with their thresholds, in the order they were added.
    pools: Vec<(Arc<dyn TrimmablePool>, u64)>,
    trim: bool,
    callback: Option<Box<Callback>>,
    /// Whether free memory, then each pool, was past its threshold at the last reading.
    past: Mutex<Past>,
}

/// What the last reading found past its threshold.
#[derive(Debug, Default)]
struct Past {
    free: bool,
    pools: Vec<bool>,
}

impl MemoryPressureMonitor {
    /// A monitor of `ctx`'s device with no threshold yet.
    pub fn new(ctx: &Context) -> Self {
        MemoryPressureMonitor {
            ctx: ctx.clone(),
            min_free: None,
            pools: Vec::new(),
            trim: false,
            callback: None,
            past: Mutex::new(Past::default()),
        }
    }

    /// Reports when the device's free memory falls below `bytes`.
    pub fn min_free_bytes(mut self, bytes: usize) -> Self {
        self.min_free = Some(bytes);
        self
    }

    /// Also watches `pool`, reporting when it holds more than `max_reserved` bytes. Call it once per
    /// pool; each is named in its events by its position among these calls
    /// ([`Pressure::PoolReserved::pool`]).
    pub fn watch_pool(mut self, pool: Arc<dyn TrimmablePool>, max_reserved: u64) -> Self {
        self.pools.push((pool, max_reserved));
        self.past.get_mut().pools.push(false);
        self
    }

    /// On a crossing, returns unused memory to the device: a pool over its threshold trims itself,
    /// low free memory trims every watched pool.
    ///
    /// Trimming a caching pool waits for every stream the pool has served (as PyTorch's
    /// `empty_cache` does), on the thread that checks, with no lock of the pool held: allocations
    /// go on meanwhile, but the check itself does not return until that work has completed, so do
    /// not combine it with a pool whose streams run work that never ends (a persistent kernel).
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
    /// Reading the device's memory or the pool failed; nothing is remembered from such a reading.
    /// A failed trim is logged (`tracing::warn`) and reported as an event that released nothing.
    pub fn check(&self) -> Result<Vec<PressureEvent>> {
        // Read everything before remembering anything: a failed reading must not swallow a
        // crossing that this reading would otherwise have reported.
        let free =
            self.min_free.map(|threshold| self.ctx.mem_info().map(|info| (info, threshold))).transpose()?;
        let reserved = self
            .pools
            .iter()
            .map(|(pool, threshold)| Ok((pool.reserved_bytes()?, *threshold)))
            .collect::<Result<Vec<_>>>()?;
        let mut found = Vec::new();
        let mut past = self.past.lock();
        if let Some((info, threshold)) = free {
            let now = info.free < threshold;
            if now && !past.free {
                found.push(Pressure::LowFreeMemory { free: info.free, total: info.total, threshold });
            }
            past.free = now;
        }
        for (pool, ((reserved, threshold), was)) in reserved.into_iter().zip(&mut past.pools).enumerate() {
            let now = reserved > threshold;
            if now && !*was {
                found.push(Pressure::PoolReserved { pool, reserved, threshold });
            }
            *was = now;
        }
        drop(past);
        let device = self.ctx.device().ordinal();
        let mut trimmed = vec![false; self.pools.len()];
        let mut events = Vec::with_capacity(found.len());
        for pressure in found {
            tracing::debug!(device, ?pressure, "memory pressure");
            // Each pool is trimmed at most once per reading, for the first crossing that calls for
            // it. A failed trim still reports the crossing (with nothing released): it has been
            // remembered and would not come again.
            let mut released_bytes = 0;
            if self.trim {
                for (index, (pool, _)) in self.pools.iter().enumerate() {
                    let wanted = match pressure {
                        Pressure::LowFreeMemory { .. } => true,
                        Pressure::PoolReserved { pool, .. } => pool == index,
                    };
                    if !wanted || std::mem::replace(&mut trimmed[index], true) {
                        continue;
                    }
                    let _span = tracing::debug_span!("pressure_trim", device, pool = index).entered();
                    released_bytes += pool.release_unused().unwrap_or_else(|e| {
                        tracing::warn!(device, pool = index, error = %e, "memory pressure: trimming a pool failed");
                        0
                    });
                }
            }
            let event = PressureEvent { pressure, released_bytes };
            if let Some(callback) = &self.callback {
                callback(&event);
            }
            events.push(event);
        }
        Ok(events)
    }

    /// Checks every `interval` on a background thread until the handle is dropped. A failed
    /// reading is logged (`tracing::warn`, once per run of failures) and the thread carries on;
    /// so does a reading whose callback panicked (logged with `tracing::warn` each time; that
    /// reading's later crossings are not reported). The callback may drop the handle itself: the
    /// thread then ends after the callback returns, without being waited for.
    ///
    /// # Errors
    /// The thread could not be started.
    pub fn spawn(self: Arc<Self>, interval: Duration) -> std::io::Result<MonitorHandle> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new().name("cumem-pressure".into()).spawn(move || {
            let mut failing = false;
            loop {
                // A callback that panics must not end the monitoring for the rest of the run:
                // what a reading remembers is complete before any callback runs, so the next
                // reading starts from a consistent state.
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.check())) {
                    Ok(Ok(_)) => failing = false,
                    Ok(Err(e)) if !failing => {
                        failing = true;
                        tracing::warn!(error = %e, "memory pressure monitor: a reading failed");
                    }
                    Ok(Err(_)) => {}
                    Err(_) => {
                        tracing::warn!("memory pressure monitor: a callback panicked; monitoring goes on")
                    }
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
            .field("pools", &self.pools)
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
        let Some(thread) = self.thread.take() else { return };
        if thread.thread().id() == std::thread::current().id() {
            // Dropped by a callback on the monitor's own thread: joining it here would join
            // itself (a panic). The stop channel is closed, so the thread ends once the callback
            // returns.
            return;
        }
        if thread.join().is_err() {
            tracing::warn!("the memory pressure monitor thread panicked");
        }
    }
}
