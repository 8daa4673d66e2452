//! Replaying an allocation trace against any resource, to compare allocators on a real workload.
//!
//! [`replay`] takes the rows of a trace in RMM's CSV format ([`trace_format`](crate::trace_format))
//! and makes the same allocations and frees, of the same sizes, on streams standing for the logged
//! ones, against the resource given. Rows are replayed in the order of the log on the calling thread, so each
//! logged thread's events keep their order and every free comes after the allocation it frees. The
//! [`ReplayReport`] says how much memory the workload had live, how much the device had to
//! provide for it, how that evolved, and how long each call took.
//!
//! Logged streams keep their kind, since it decides which streams wait for which ([`ReplayedOn`],
//! listed in [`ReplayReport::stream_mapping`]): 0 (`cudaStreamLegacy`'s NULL, RMM's default stream)
//! and 1 (`cudaStreamLegacy`) are replayed on the context's legacy stream; 2
//! (`cudaStreamPerThread`) on one blocking stream per logged thread, created for the replay (a
//! per-thread default stream is an ordinary blocking stream of its thread: it waits for the legacy
//! stream and the legacy stream for it, and cumem-core has no handle on the driver's own); every
//! other value on a non-blocking [`Stream`] of its own, created for the replay.
//!
//! Reserved bytes are the device's used memory as `cuMemGetInfo` reports it (total − free),
//! relative to the start of the replay, so they mean the same for every strategy: a pool's cached
//! segments, the driver's rounding and its stream-ordered pools all count. On a shared GPU other
//! processes' allocations during the replay count too.
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DriverResource};
//! use cumem_pool::replay::replay;
//! use cumem_pool::trace_format::parse_trace;
//!
//! let log = "Thread,Time,Action,Pointer,Size,Stream\n\
//!            1,0.001,allocate,0x7f0000000000,1000,0x0\n\
//!            1,0.002,allocate,0x7f0000000400,3000,0x0\n\
//!            1,0.003,free,0x7f0000000000,1000,0x0\n\
//!            1,0.004,free,0x7f00deadbeef,64,0x0\n";
//! let trace = parse_trace(log.as_bytes()).unwrap();
//! let ctx = Device::get(0)?.context()?;
//! let report = replay(&Arc::new(DriverResource::new(&ctx)), &trace)?;
//! assert_eq!(report.allocation_sizes, vec![1000, 3000]);
//! assert_eq!(report.peak_live_bytes, 4000);
//! assert_eq!(report.skipped_unknown_frees, 1); // the log never allocated 0x7f00deadbeef
//! assert_eq!(report.freed_at_end, 1);
//! assert!(report.peak_reserved_bytes >= 4000);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cumem_core::{AllocLayout, Allocation, Context, DeviceResource, Result, Stream};

use crate::trace_format::{TraceAction, TraceRecord};

/// Seconds in a day, for logs whose time is the time of day.
const DAY: f64 = 86_400.0;

/// The alignment every replayed allocation asks for: RMM's default, which its logs were made with.
pub const REPLAY_ALIGNMENT: usize = 256;

/// The stream a logged stream value is replayed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplayedOn {
    /// The context's legacy default stream (logged 0 or 1).
    Legacy,
    /// A blocking stream per logged thread, standing for its per-thread default stream (logged 2).
    PerThread,
    /// A non-blocking stream of its own (any other logged value: a stream the program created).
    NonBlocking,
}

impl ReplayedOn {
    /// What a logged stream value is replayed on.
    pub fn of(logged: u64) -> ReplayedOn {
        match logged {
            0 | 1 => ReplayedOn::Legacy,
            2 => ReplayedOn::PerThread,
            _ => ReplayedOn::NonBlocking,
        }
    }
}

/// Which replayed stream a row goes to: per-thread default streams differ between logged threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct StreamKey {
    stream: u64,
    thread: Option<u64>,
}

impl StreamKey {
    fn of(row: &TraceRecord) -> StreamKey {
        let thread = (ReplayedOn::of(row.stream) == ReplayedOn::PerThread).then_some(row.thread);
        StreamKey { stream: row.stream, thread }
    }
}

/// How a replay samples and reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayOptions {
    /// At most this many [`Sample`]s of live and reserved bytes, evenly spread over the rows (the
    /// last row is always sampled; 0 counts as 1).
    pub max_samples: usize,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions { max_samples: 1000 }
    }
}

/// Live and reserved bytes after one row of the trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// The row's index in the trace (0 is the first row after the header).
    pub row: usize,
    /// The row's logged time, in seconds since the trace's first row (a time of day that starts
    /// again after midnight counts on from the day before).
    pub time: f64,
    /// Bytes of the replay's live allocations (as requested).
    pub live_bytes: usize,
    /// The device's used memory above what it was when the replay started.
    pub reserved_bytes: usize,
}

impl Sample {
    /// The share of reserved memory not holding live allocations (0 when nothing is reserved).
    pub fn fragmentation(&self) -> f64 {
        if self.reserved_bytes == 0 {
            0.0
        } else {
            1.0 - (self.live_bytes.min(self.reserved_bytes) as f64 / self.reserved_bytes as f64)
        }
    }
}

/// How long one kind of call took, over every call of the replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Latency {
    /// Calls measured.
    pub count: usize,
    /// The median, in nanoseconds (0 when no call was made).
    pub p50_ns: u64,
    /// The 99th percentile, in nanoseconds (0 when no call was made).
    pub p99_ns: u64,
    /// The slowest call, in nanoseconds.
    pub max_ns: u64,
}

impl Latency {
    fn of(mut nanos: Vec<u64>) -> Self {
        nanos.sort_unstable();
        // Nearest rank: the smallest value with at least p % of the calls at or below it.
        let rank = |p: usize| nanos[(nanos.len() * p).div_ceil(100).max(1) - 1];
        match nanos.last() {
            None => Latency::default(),
            Some(&max_ns) => Latency { count: nanos.len(), p50_ns: rank(50), p99_ns: rank(99), max_ns },
        }
    }
}

/// What a replay observed.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayReport {
    /// The size of every allocation the replay made, in order.
    pub allocation_sizes: Vec<usize>,
    /// Frees replayed.
    pub frees: usize,
    /// The most bytes live at once (as requested, without any rounding).
    pub peak_live_bytes: usize,
    /// The most device memory in use at once above the start, measured after every allocation and
    /// at every sample.
    pub peak_reserved_bytes: usize,
    /// Live and reserved bytes over the trace.
    pub samples: Vec<Sample>,
    /// Time spent in `allocate`.
    pub allocate: Latency,
    /// Time spent in `deallocate`.
    pub free: Latency,
    /// Distinct logged threads.
    pub threads: usize,
    /// Distinct logged streams.
    pub streams: usize,
    /// Each distinct logged stream value, in increasing order, with what it was replayed on.
    pub stream_mapping: Vec<(u64, ReplayedOn)>,
    /// Frees of pointers the replay had not allocated (the log started while they were live, or
    /// their allocation failed here), skipped.
    pub skipped_unknown_frees: usize,
    /// Rows recording a failed allocation, skipped.
    pub skipped_failed_rows: usize,
    /// Allocations of zero bytes (RMM logs them; no resource can make one), skipped.
    pub skipped_zero_sizes: usize,
    /// Allocations of a pointer the log still had live (an inconsistent log), skipped.
    pub skipped_duplicate_pointers: usize,
    /// Allocations the resource refused during the replay (out of memory, typically).
    pub failed_allocations: usize,
    /// Allocations still live when the trace ended, freed by the replay afterwards.
    pub freed_at_end: usize,
}

impl ReplayReport {
    /// Peak reserved bytes per peak live byte (0 when nothing was live).
    pub fn reserved_per_live(&self) -> f64 {
        if self.peak_live_bytes == 0 {
            0.0
        } else {
            self.peak_reserved_bytes as f64 / self.peak_live_bytes as f64
        }
    }
}

/// Replays `trace` against `resource` with the default [`ReplayOptions`].
///
/// # Errors
/// Creating a stream, reading the device's memory use, or synchronising at the end failed.
/// Allocations the resource refuses are counted in [`ReplayReport::failed_allocations`], not
/// returned.
pub fn replay<R>(resource: &Arc<R>, trace: &[TraceRecord]) -> Result<ReplayReport>
where
    R: DeviceResource + ?Sized,
{
    replay_with(resource, trace, &ReplayOptions::default(), &mut |_| {})
}

/// Replays `trace` against `resource`, calling `progress` with the number of rows done from time to
/// time (every 1 % of the trace at most, and always after the last row).
///
/// # Errors
/// As [`replay`].
pub fn replay_with<R>(
    resource: &Arc<R>,
    trace: &[TraceRecord],
    options: &ReplayOptions,
    progress: &mut dyn FnMut(usize),
) -> Result<ReplayReport>
where
    R: DeviceResource + ?Sized,
{
    let ctx = resource.context().clone();
    let mut streams: HashMap<StreamKey, Stream> = HashMap::new();
    for row in trace {
        if let std::collections::hash_map::Entry::Vacant(slot) = streams.entry(StreamKey::of(row)) {
            slot.insert(match ReplayedOn::of(row.stream) {
                ReplayedOn::Legacy => Stream::legacy(&ctx),
                ReplayedOn::PerThread => Stream::new(&ctx)?,
                ReplayedOn::NonBlocking => Stream::non_blocking(&ctx)?,
            });
        }
    }
    let mut stream_mapping: Vec<(u64, ReplayedOn)> =
        trace.iter().map(|r| (r.stream, ReplayedOn::of(r.stream))).collect();
    stream_mapping.sort_unstable_by_key(|&(logged, _)| logged);
    stream_mapping.dedup();
    let mut replayer = Replayer {
        resource: &**resource,
        baseline: used_bytes(&ctx)?,
        ctx,
        live: HashMap::new(),
        live_bytes: 0,
        alloc_nanos: Vec::new(),
        free_nanos: Vec::new(),
        report: ReplayReport {
            allocation_sizes: Vec::new(),
            frees: 0,
            peak_live_bytes: 0,
            peak_reserved_bytes: 0,
            samples: Vec::new(),
            allocate: Latency::default(),
            free: Latency::default(),
            threads: trace.iter().map(|r| r.thread).collect::<std::collections::HashSet<_>>().len(),
            streams: stream_mapping.len(),
            stream_mapping,
            skipped_unknown_frees: 0,
            skipped_failed_rows: 0,
            skipped_zero_sizes: 0,
            skipped_duplicate_pointers: 0,
            failed_allocations: 0,
            freed_at_end: 0,
        },
    };
    let outcome = replayer.run(trace, &streams, options, progress);
    // Free what the trace left live even when measuring failed, so nothing leaks.
    let leftover: Vec<_> = replayer.live.drain().collect();
    replayer.report.freed_at_end = leftover.len();
    for (_, live) in leftover {
        let stream = &streams[&live.stream];
        // SAFETY: `live.allocation` came from `resource.allocate` with `live.layout` and is freed
        // once (it was just removed from the live table); the replay queued no work on the memory,
        // and no Rust value refers to it.
        unsafe { replayer.resource.deallocate(live.allocation, live.layout, stream) };
    }
    let mut synced = Ok(());
    for stream in streams.values() {
        synced = synced.and(stream.synchronize());
    }
    outcome?;
    synced?;
    let Replayer { mut report, alloc_nanos, free_nanos, .. } = replayer;
    report.allocate = Latency::of(alloc_nanos);
    report.free = Latency::of(free_nanos);
    Ok(report)
}

struct Live {
    allocation: Allocation,
    layout: AllocLayout,
    size: usize,
    stream: StreamKey,
}

struct Replayer<'r, R: DeviceResource + ?Sized> {
    resource: &'r R,
    ctx: Context,
    baseline: usize,
    live: HashMap<u64, Live>,
    live_bytes: usize,
    alloc_nanos: Vec<u64>,
    free_nanos: Vec<u64>,
    report: ReplayReport,
}

impl<R: DeviceResource + ?Sized> Replayer<'_, R> {
    fn run(
        &mut self,
        trace: &[TraceRecord],
        streams: &HashMap<StreamKey, Stream>,
        options: &ReplayOptions,
        progress: &mut dyn FnMut(usize),
    ) -> Result<()> {
        let stride = trace.len().div_ceil(options.max_samples.max(1)).max(1);
        let tick = (trace.len() / 100).max(1);
        let start_time = trace.first().map_or(0.0, |r| r.time);
        // RMM's adaptor logs the time of day: a log that runs past midnight starts again from 0.
        let (mut previous, mut days) = (start_time, 0.0);
        for (index, row) in trace.iter().enumerate() {
            if row.time + days < previous - DAY / 2.0 {
                days += DAY;
            }
            previous = row.time + days;
            let stream = &streams[&StreamKey::of(row)];
            match row.action {
                TraceAction::AllocateFailure => self.report.skipped_failed_rows += 1,
                TraceAction::Allocate => self.allocate(row, stream)?,
                TraceAction::Free => self.free(row, stream, streams),
            }
            if index % stride == stride - 1 || index + 1 == trace.len() {
                let reserved = self.reserved()?;
                self.report.samples.push(Sample {
                    row: index,
                    time: row.time + days - start_time,
                    live_bytes: self.live_bytes,
                    reserved_bytes: reserved,
                });
            }
            if index % tick == tick - 1 || index + 1 == trace.len() {
                progress(index + 1);
            }
        }
        Ok(())
    }

    fn allocate(&mut self, row: &TraceRecord, stream: &Stream) -> Result<()> {
        if row.size == 0 {
            self.report.skipped_zero_sizes += 1;
            return Ok(());
        }
        if self.live.contains_key(&row.pointer) {
            self.report.skipped_duplicate_pointers += 1;
            return Ok(());
        }
        let layout = match AllocLayout::new(row.size, REPLAY_ALIGNMENT) {
            Ok(layout) => layout,
            Err(e) => {
                // A row no resource could make is the resource refusing it, not the replay failing.
                tracing::debug!(size = row.size, error = %e, "a replayed allocation has no layout");
                self.report.failed_allocations += 1;
                return Ok(());
            }
        };
        let started = Instant::now();
        let result = self.resource.allocate(layout, stream);
        self.alloc_nanos.push(started.elapsed().as_nanos() as u64);
        match result {
            Ok(allocation) => {
                self.live.insert(
                    row.pointer,
                    Live { allocation, layout, size: row.size, stream: StreamKey::of(row) },
                );
                self.report.allocation_sizes.push(row.size);
                self.live_bytes += row.size;
                self.report.peak_live_bytes = self.report.peak_live_bytes.max(self.live_bytes);
                self.reserved()?;
            }
            Err(e) => {
                tracing::debug!(size = row.size, error = %e, "a replayed allocation failed");
                self.report.failed_allocations += 1;
            }
        }
        Ok(())
    }

    fn free(&mut self, row: &TraceRecord, stream: &Stream, streams: &HashMap<StreamKey, Stream>) {
        let Some(live) = self.live.remove(&row.pointer) else {
            self.report.skipped_unknown_frees += 1;
            return;
        };
        // The allocation itself is placed in its stream's order (a stream-ordered pool's memory is
        // usable only after it there): a free logged on another stream is ordered after it, as the
        // logged program must have ordered it. Should that fail, the free goes to the allocating
        // stream, which follows its own allocation.
        let allocated_on = &streams[&live.stream];
        let stream = match stream.wait_for(allocated_on) {
            Ok(()) => stream,
            Err(e) => {
                tracing::debug!(error = %e, "ordering a replayed free after its allocation failed");
                allocated_on
            }
        };
        let started = Instant::now();
        // SAFETY: `live.allocation` came from `resource.allocate` with `live.layout` and is freed
        // once (it was just removed from the live table); the replay queued no work on the memory,
        // and `stream` is (or waits for) the stream it was allocated on, so it follows every use
        // of it, and no Rust value refers to it.
        unsafe { self.resource.deallocate(live.allocation, live.layout, stream) };
        self.free_nanos.push(started.elapsed().as_nanos() as u64);
        self.live_bytes -= live.size;
        self.report.frees += 1;
    }

    /// The device's used memory above the baseline, folded into the peak.
    fn reserved(&mut self) -> Result<usize> {
        let reserved = used_bytes(&self.ctx)?.saturating_sub(self.baseline);
        self.report.peak_reserved_bytes = self.report.peak_reserved_bytes.max(reserved);
        Ok(reserved)
    }
}

fn used_bytes(ctx: &Context) -> Result<usize> {
    let info = ctx.mem_info()?;
    Ok(info.total.saturating_sub(info.free))
}

#[cfg(test)]
mod tests {
    use super::Latency;

    #[test]
    fn percentiles_are_nearest_rank() {
        assert_eq!(Latency::of(vec![]), Latency::default());
        let l = Latency::of((1..=100).rev().collect());
        assert_eq!((l.count, l.p50_ns, l.p99_ns, l.max_ns), (100, 50, 99, 100));
        let one = Latency::of(vec![7]);
        assert_eq!((one.p50_ns, one.p99_ns), (7, 7));
    }
}
