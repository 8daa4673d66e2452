//! An adaptor that keeps every live allocation of any resource: its size, stream, time and,
//! optionally, the call site, for a leak report on demand and when the adaptor is dropped.
//!
//! With sites on ([`TrackingResource::with_sites`]) each allocation captures a
//! [`Backtrace`] unresolved (a stack walk, no symbol lookup); symbols are resolved only when a
//! report is written. The report leaves out the frames of the standard library and of cumem's own
//! allocation path, so the first frame shown is the caller's.
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DeviceBuffer, DriverResource, Stream};
//! use cumem_pool::{LimitingResource, TrackingResource};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! // Tracking over a 1 GiB cap over the driver.
//! let capped = Arc::new(LimitingResource::new(Arc::new(DriverResource::new(&ctx)), 1 << 30));
//! let tracker = Arc::new(TrackingResource::with_sites(capped.clone()));
//! let kept = DeviceBuffer::<u64>::zeroed_in(&tracker, &stream, 512)?;
//! drop(DeviceBuffer::<u8>::zeroed_in(&tracker, &stream, 100)?);
//! let report = tracker.report();
//! assert_eq!((report.allocations.len(), report.bytes()), (1, 4096));
//! assert_eq!(report.allocations[0].ptr, kept.device_ptr());
//! assert!(report.to_string().contains("4096 bytes"));
//! assert_eq!(capped.used(), 4096);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::backtrace::Backtrace;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cumem_core::{AllocLayout, Allocation, Context, DeviceResource, Result, Stream};
use parking_lot::Mutex;

/// Frames of a site shown in a report, after the allocation path's own frames are left out.
const SITE_FRAMES: usize = 16;

/// What the adaptor keeps of one live allocation.
#[derive(Debug)]
struct Tracked {
    bytes: usize,
    stream: u64,
    at: Instant,
    site: Option<Arc<Backtrace>>,
}

/// One live allocation, as [`TrackingResource::report`] saw it.
#[derive(Debug, Clone)]
pub struct LiveAllocation {
    /// The device address.
    pub ptr: u64,
    /// Bytes requested.
    pub bytes: usize,
    /// The handle of the stream it was allocated on (0 is the legacy default stream).
    pub stream: u64,
    /// How long before the report it was allocated.
    pub age: Duration,
    /// Where it was allocated, when the adaptor captures sites (unresolved until displayed).
    pub site: Option<Arc<Backtrace>>,
}

impl LiveAllocation {
    /// The call site as text: the frames from the first one outside the standard library and
    /// cumem's allocation path, at most 16; `None` when sites are not captured.
    pub fn site_text(&self) -> Option<String> {
        self.site.as_ref().map(|bt| caller_frames(&bt.to_string()))
    }
}

/// The live allocations of a [`TrackingResource`], oldest first; its `Display` is the leak report.
#[derive(Debug, Clone, Default)]
pub struct LeakReport {
    /// Every allocation live when the report was taken, oldest first.
    pub allocations: Vec<LiveAllocation>,
}

impl LeakReport {
    /// Bytes live in all of them.
    pub fn bytes(&self) -> usize {
        self.allocations.iter().map(|a| a.bytes).sum()
    }
}

impl fmt::Display for LeakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} live allocations, {} bytes", self.allocations.len(), self.bytes())?;
        for a in &self.allocations {
            writeln!(
                f,
                "  {:#x}: {} bytes on stream {:#x}, allocated {:.3} s ago",
                a.ptr,
                a.bytes,
                a.stream,
                a.age.as_secs_f64()
            )?;
            if let Some(site) = a.site_text() {
                for line in site.lines() {
                    writeln!(f, "    {line}")?;
                }
            }
        }
        Ok(())
    }
}

/// Whether a backtrace frame's symbol belongs to the machinery between the caller and the capture.
fn is_allocation_path(symbol: &str) -> bool {
    let symbol = symbol.trim_start_matches('<');
    ["std::", "core::", "alloc::", "cumem_core::", "cumem_pool::tracking_resource::"]
        .iter()
        .any(|prefix| symbol.starts_with(prefix))
        || symbol.contains(" as cumem_core::")
}

/// The frames of a displayed backtrace from the caller's on (a frame is a `N: symbol` line and the
/// `at file:line` lines under it).
fn caller_frames(backtrace: &str) -> String {
    let mut frames: Vec<Vec<&str>> = Vec::new();
    for line in backtrace.lines() {
        let trimmed = line.trim_start();
        let starts_frame = trimmed.split_once(": ").is_some_and(|(n, _)| n.parse::<usize>().is_ok());
        match frames.last_mut() {
            Some(frame) if !starts_frame => frame.push(trimmed),
            _ => frames.push(vec![trimmed]),
        }
    }
    let symbol = |frame: &[&str]| frame[0].split_once(": ").map_or("", |(_, s)| s).to_string();
    let first = frames.iter().position(|f| !is_allocation_path(&symbol(f))).unwrap_or(0);
    let mut text = String::new();
    for frame in frames.iter().skip(first).take(SITE_FRAMES) {
        text.push_str(frame[0]);
        text.push('\n');
        for at in &frame[1..] {
            text.push_str("    ");
            text.push_str(at);
            text.push('\n');
        }
    }
    if text.is_empty() {
        text = backtrace.to_string(); // unsupported platform: whatever the runtime printed
    }
    text
}

/// Keeps every live allocation made through it, then forwards requests to the wrapped resource.
pub struct TrackingResource<R: ?Sized> {
    inner: Arc<R>,
    sites: bool,
    live: Mutex<HashMap<u64, Tracked>>,
}

impl<R: DeviceResource + ?Sized> TrackingResource<R> {
    /// Wraps `inner`, keeping size, stream and time of each live allocation (no call sites).
    pub fn new(inner: Arc<R>) -> Self {
        TrackingResource { inner, sites: false, live: Mutex::new(HashMap::new()) }
    }

    /// Wraps `inner`, also capturing each allocation's call site (a stack walk per allocation).
    pub fn with_sites(inner: Arc<R>) -> Self {
        TrackingResource { inner, sites: true, live: Mutex::new(HashMap::new()) }
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &Arc<R> {
        &self.inner
    }

    /// Allocations live now.
    pub fn live_count(&self) -> usize {
        self.live.lock().len()
    }

    /// Bytes live now.
    pub fn live_bytes(&self) -> usize {
        self.live.lock().values().map(|t| t.bytes).sum()
    }

    /// Every live allocation, oldest first: the leak report when the program thinks it freed
    /// everything.
    pub fn report(&self) -> LeakReport {
        let now = Instant::now();
        let mut allocations: Vec<(Instant, LiveAllocation)> = self
            .live
            .lock()
            .iter()
            .map(|(&ptr, t)| {
                let a = LiveAllocation {
                    ptr,
                    bytes: t.bytes,
                    stream: t.stream,
                    age: now.saturating_duration_since(t.at),
                    site: t.site.clone(),
                };
                (t.at, a)
            })
            .collect();
        allocations.sort_by_key(|&(at, ref a)| (at, a.ptr));
        LeakReport { allocations: allocations.into_iter().map(|(_, a)| a).collect() }
    }
}

impl<R: ?Sized> Drop for TrackingResource<R> {
    fn drop(&mut self) {
        let live = self.live.get_mut();
        if live.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut allocations: Vec<LiveAllocation> = live
            .drain()
            .map(|(ptr, t)| LiveAllocation {
                ptr,
                bytes: t.bytes,
                stream: t.stream,
                age: now.saturating_duration_since(t.at),
                site: t.site,
            })
            .collect();
        allocations.sort_by_key(|a| std::cmp::Reverse(a.age));
        let report = LeakReport { allocations };
        tracing::warn!(
            count = report.allocations.len(),
            bytes = report.bytes(),
            "tracking adaptor dropped with live allocations:\n{report}"
        );
    }
}

impl<R: fmt::Debug + ?Sized> fmt::Debug for TrackingResource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackingResource")
            .field("inner", &self.inner)
            .field("sites", &self.sites)
            .field("live", &self.live.lock().len())
            .finish()
    }
}

// SAFETY: forwards every request unchanged to the wrapped resource, which upholds the contract;
// tracking only records the request and the result.
unsafe impl<R: DeviceResource + ?Sized> DeviceResource for TrackingResource<R> {
    fn context(&self) -> &Context {
        self.inner.context()
    }

    fn usable_on_every_stream_at_once(&self) -> bool {
        self.inner.usable_on_every_stream_at_once()
    }

    fn cache_usage(&self) -> Option<cumem_core::CacheUsage> {
        self.inner.cache_usage()
    }

    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> Result<Allocation> {
        // Captured before the lock: the stack walk is the slow part.
        let site = self.sites.then(|| Arc::new(Backtrace::force_capture()));
        let allocation = self.inner.allocate(layout, stream)?;
        let tracked =
            Tracked { bytes: layout.bytes, stream: stream.raw() as usize as u64, at: Instant::now(), site };
        self.live.lock().insert(allocation.ptr, tracked);
        Ok(allocation)
    }

    unsafe fn deallocate(&self, allocation: Allocation, layout: AllocLayout, stream: &Stream) {
        // Forgotten first: once the memory is back, another thread may be handed the address.
        if self.live.lock().remove(&allocation.ptr).is_none() {
            tracing::warn!(ptr = allocation.ptr, "tracking adaptor: freeing an allocation it never saw");
        }
        // SAFETY: forwarded unchanged from our caller, who upholds the contract.
        unsafe { self.inner.deallocate(allocation, layout, stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_starts_at_the_caller() {
        let bt = "   0: std::backtrace::Backtrace::force_capture\n             at /rustc/x/backtrace.rs:1:2\n   \
                  1: <cumem_pool::tracking_resource::TrackingResource<R> as cumem_core::resource::DeviceResource>::allocate\n   \
                  2: cumem_core::buffer::device::DeviceBuffer<T>::zeroed_in\n             at core.rs:3:4\n   \
                  3: my_app::load_weights\n             at src/main.rs:10:5\n   \
                  4: my_app::main\n";
        let text = caller_frames(bt);
        assert!(text.starts_with("3: my_app::load_weights\n    at src/main.rs:10:5\n"), "{text}");
        assert!(text.contains("4: my_app::main"));
        assert!(!text.contains("zeroed_in"));
    }
}
