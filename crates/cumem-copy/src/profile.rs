//! Opt-in transfer profiling: which copies ran, how many bytes, how long on the device, and the
//! throughput per kind and size class.
//!
//! A [`Profiler`] observes copies once it is attached to a stream ([`Profiler::observe`]) or to
//! every stream ([`Profiler::observe_all`]); the returned [`Observing`] guard detaches it when
//! dropped. Each observed copy (every copy and memset of this crate, blocking ones on the legacy
//! stream, and each chunk of a [`StagingRing`](crate::StagingRing)) is bracketed by two timed
//! events taken from the profiler's pool, which grows to the number of copies in flight and is
//! then reused: no event is created per copy once the pool is warm. [`Profiler::report`] waits
//! for the observed copies (without blocking copies observed meanwhile), returns their events to
//! the pool and sums them up. Between reports, once more than 1024 copies are pending, recording a
//! copy also folds in every completed one, so that a long run keeps the events of copies still in
//! flight, not of every copy since the last report.
//!
//! Profiling never fails a copy: a copy whose events cannot be made or recorded is not counted,
//! and a `warn` event says so, logged once the copy has let go of its locks (as is a failure to
//! read completed copies' events, which then stay pending).
//!
//! When no profiler is attached anywhere, a copy pays one relaxed atomic load for this module.
//! While one is attached, a copy on a stream that nothing observes also pays an acquire load, a
//! thread-local read and a scan of the attached targets: no lock and no allocation (the first copy
//! on each thread after a profiler is attached or detached takes a global lock once, to refresh the
//! thread's view). An observed copy takes that lock and each observing profiler's own.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, DeviceBuffer, PinnedBuffer, Stream};
//! use cumem_copy::{CopyKind, Profiler, StreamCopy};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::non_blocking(&ctx)?;
//! let host = PinnedBuffer::from_slice(&ctx, &[1u8; 1024])?;
//! let mut dev = DeviceBuffer::<u8>::zeroed(&stream, 1024)?;
//! let profiler = Profiler::new();
//! {
//!     let _on = profiler.observe(&stream);
//!     stream.copy_h2d(&host, &mut dev)?;
//!     stream.memset_d8(&mut dev, 0)?;
//! }
//! stream.copy_h2d(&host, &mut dev)?; // not observed: the guard is gone
//! let report = profiler.report()?;
//! assert_eq!(report.total(CopyKind::HostToDevice).count, 1);
//! assert_eq!(report.total(CopyKind::Memset).bytes, 1024);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use cumem_core::{Context, Event, Result, Stream};

/// What a copy moved, as the profiler counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CopyKind {
    /// Host to device (1D).
    HostToDevice,
    /// Device to host (1D).
    DeviceToHost,
    /// Device to device (1D).
    DeviceToDevice,
    /// A memset, 1D or 2D (bytes set).
    Memset,
    /// A 2D copy, any direction (bytes of the rectangle).
    Copy2D,
    /// A 3D copy, any direction (bytes of the box).
    Copy3D,
}

impl CopyKind {
    /// Every kind, in report order.
    pub const ALL: [CopyKind; 6] = [
        CopyKind::HostToDevice,
        CopyKind::DeviceToHost,
        CopyKind::DeviceToDevice,
        CopyKind::Memset,
        CopyKind::Copy2D,
        CopyKind::Copy3D,
    ];

    /// A short lower-case name (`h2d`, `d2h`, `d2d`, `memset`, `2d`, `3d`), as in traces.
    pub fn name(self) -> &'static str {
        match self {
            CopyKind::HostToDevice => "h2d",
            CopyKind::DeviceToHost => "d2h",
            CopyKind::DeviceToDevice => "d2d",
            CopyKind::Memset => "memset",
            CopyKind::Copy2D => "2d",
            CopyKind::Copy3D => "3d",
        }
    }
}

/// A range of copy sizes, for throughput that depends on size (fixed costs dominate small copies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SizeClass {
    /// Up to 4 KiB.
    UpTo4KiB,
    /// Over 4 KiB, up to 64 KiB.
    UpTo64KiB,
    /// Over 64 KiB, up to 1 MiB.
    UpTo1MiB,
    /// Over 1 MiB, up to 16 MiB.
    UpTo16MiB,
    /// Over 16 MiB.
    Over16MiB,
}

impl SizeClass {
    /// The class of a copy of `bytes` bytes.
    pub fn of(bytes: usize) -> SizeClass {
        match bytes {
            0..=4096 => SizeClass::UpTo4KiB,
            4097..=65_536 => SizeClass::UpTo64KiB,
            65_537..=1_048_576 => SizeClass::UpTo1MiB,
            1_048_577..=16_777_216 => SizeClass::UpTo16MiB,
            _ => SizeClass::Over16MiB,
        }
    }

    /// A label such as `≤ 64 KiB`.
    pub fn label(self) -> &'static str {
        match self {
            SizeClass::UpTo4KiB => "≤ 4 KiB",
            SizeClass::UpTo64KiB => "≤ 64 KiB",
            SizeClass::UpTo1MiB => "≤ 1 MiB",
            SizeClass::UpTo16MiB => "≤ 16 MiB",
            SizeClass::Over16MiB => "> 16 MiB",
        }
    }
}

/// Sums over observed copies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Copies observed.
    pub count: u64,
    /// Bytes they moved (or set).
    pub bytes: u64,
    /// Device time between each copy's start and end events, summed.
    pub device_time: Duration,
}

impl Totals {
    /// Bytes per second of device time (0 when no time was measured).
    pub fn throughput(&self) -> f64 {
        let secs = self.device_time.as_secs_f64();
        if secs > 0.0 { self.bytes as f64 / secs } else { 0.0 }
    }

    fn add(&mut self, other: &Totals) {
        self.count += other.count;
        self.bytes += other.bytes;
        self.device_time += other.device_time;
    }
}

/// What a [`Profiler`] observed: totals per copy kind and size class.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProfileReport {
    rows: BTreeMap<(CopyKind, SizeClass), Totals>,
}

impl ProfileReport {
    /// Every (kind, size class) that saw at least one copy, in kind then size order.
    pub fn rows(&self) -> impl Iterator<Item = (CopyKind, SizeClass, &Totals)> {
        self.rows.iter().map(|(&(k, s), t)| (k, s, t))
    }

    /// Totals of one kind and size class (zero if none was observed).
    pub fn get(&self, kind: CopyKind, size: SizeClass) -> Totals {
        self.rows.get(&(kind, size)).copied().unwrap_or_default()
    }

    /// Totals of one kind over every size class.
    pub fn total(&self, kind: CopyKind) -> Totals {
        let mut t = Totals::default();
        self.rows
            .range((kind, SizeClass::UpTo4KiB)..=(kind, SizeClass::Over16MiB))
            .for_each(|(_, r)| t.add(r));
        t
    }
}

impl fmt::Display for ProfileReport {
    /// A markdown table: kind, size class, copies, bytes, device time, GB/s.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "| kind | size | copies | bytes | device time | GB/s |")?;
        writeln!(f, "|---|---|---:|---:|---:|---:|")?;
        for (kind, size, t) in self.rows() {
            writeln!(
                f,
                "| {} | {} | {} | {} | {:?} | {:.3} |",
                kind.name(),
                size.label(),
                t.count,
                t.bytes,
                t.device_time,
                t.throughput() / 1e9
            )?;
        }
        Ok(())
    }
}

/// A copy whose end event has not been read yet.
struct Pending {
    kind: CopyKind,
    bytes: usize,
    start: Event,
    end: Event,
}

struct State {
    pending: VecDeque<Pending>,
    /// Timed event pairs ready for reuse, any context (matched on take).
    pool: Vec<(Event, Event)>,
    report: ProfileReport,
    /// Pending copies beyond which recording a copy also folds in every one already complete
    /// (at least [`FOLD_AT`], and twice what the last fold left pending, so that many copies
    /// genuinely in flight are not all queried on every copy).
    fold_at: usize,
}

impl Default for State {
    fn default() -> Self {
        State {
            pending: VecDeque::new(),
            pool: Vec::new(),
            report: ProfileReport::default(),
            fold_at: FOLD_AT,
        }
    }
}

/// Pending copies beyond which recording also folds in the ones already complete, so that a long
/// run without [`Profiler::report`] keeps only the events of copies still in flight.
const FOLD_AT: usize = 1024;

/// An observer of copies (see the [module docs](self)). Clones share the same records.
#[derive(Clone, Default)]
pub struct Profiler {
    state: Arc<Mutex<State>>,
    /// Held by a report for its whole wait, so that a second report waits for the copies the first
    /// took out of `state` instead of missing them.
    reporting: Arc<Mutex<()>>,
}

/// Keeps a [`Profiler`] attached until dropped.
#[must_use = "the profiler observes copies only while this guard lives"]
pub struct Observing {
    id: u64,
}

/// Whom a profiler observes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    All,
    Stream(StreamKey),
}

/// What names one stream: its [`Stream::id`] alone does not, since every context's legacy stream
/// has id 0.
#[derive(Clone, Copy, PartialEq, Eq)]
struct StreamKey {
    /// The context's driver handle (compared only, never used): unique among live contexts.
    ctx: usize,
    id: u64,
}

impl Target {
    fn matches(self, key: StreamKey) -> bool {
        self == Target::All || self == Target::Stream(key)
    }
}

/// Whether any attached profiler observes the stream `key` names, from this thread's view of the
/// registry (refreshed under the lock only when an observer came or went since it was taken).
fn watched(key: StreamKey) -> bool {
    let generation = GENERATION.load(Ordering::Acquire);
    let seen = SEEN.try_with(|seen| {
        let mut seen = seen.borrow_mut();
        if seen.0 != generation {
            let r = registry();
            // Read under the lock, which every change holds while it bumps the generation.
            *seen = (GENERATION.load(Ordering::Relaxed), r.targets.clone());
        }
        seen.1.as_deref().is_some_and(|targets| targets.iter().any(|t| t.matches(key)))
    });
    // While this thread's locals are being destroyed: ask the registry itself.
    seen.unwrap_or_else(|_| registry().observers.iter().any(|(_, t, _)| t.matches(key)))
}

impl StreamKey {
    fn of(stream: &Stream) -> StreamKey {
        StreamKey { ctx: stream.context().raw() as usize, id: stream.id() }
    }
}

struct Registry {
    next: u64,
    observers: Vec<(u64, Target, Profiler)>,
    /// The observers' targets as of `GENERATION`, shared with the threads' [`SEEN`] views.
    targets: Option<Arc<[Target]>>,
}

impl Registry {
    /// Publishes the observers' targets after a change (with the registry locked).
    fn changed(&mut self) {
        self.targets = Some(self.observers.iter().map(|(_, t, _)| *t).collect());
        GENERATION.fetch_add(1, Ordering::Release);
    }
}

/// The number of attached observers: the only thing a copy reads when profiling is off.
static ATTACHED: AtomicUsize = AtomicUsize::new(0);
/// Bumped (under the registry lock) whenever an observer is attached or detached.
static GENERATION: AtomicU64 = AtomicU64::new(0);
static REGISTRY: Mutex<Registry> = Mutex::new(Registry { next: 0, observers: Vec::new(), targets: None });

thread_local! {
    /// This thread's copy of the registry's targets and the generation it was taken at: a copy
    /// checks whether anyone observes its stream here, without the registry lock or an
    /// allocation, and refreshes it (taking the lock once) only after an attach or detach.
    static SEEN: RefCell<(u64, Option<Arc<[Target]>>)> = const { RefCell::new((u64::MAX, None)) };
}

fn registry() -> MutexGuard<'static, Registry> {
    // A panic while holding the lock leaves a consistent list (every change is one push or remove).
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether any profiler is attached now (one relaxed atomic load).
#[inline]
pub fn active() -> bool {
    ATTACHED.load(Ordering::Relaxed) != 0
}

/// Whether an attached profiler observes copies on `stream` now: the check each copy makes while
/// any profiler is attached (lock-free and allocation-free once this thread has seen the latest
/// attach or detach).
pub fn observes(stream: &Stream) -> bool {
    active() && watched(StreamKey::of(stream))
}

impl Profiler {
    /// A profiler that observes nothing until attached.
    pub fn new() -> Profiler {
        Profiler::default()
    }

    /// Observes every copy on `stream` (by identity: other handles of the same stream count, a new
    /// stream reusing its driver handle does not, nor does another context's legacy stream) until
    /// the guard is dropped.
    pub fn observe(&self, stream: &Stream) -> Observing {
        self.attach(Target::Stream(StreamKey::of(stream)))
    }

    /// Observes every copy on every stream, blocking copies included, until the guard is dropped.
    pub fn observe_all(&self) -> Observing {
        self.attach(Target::All)
    }

    fn attach(&self, target: Target) -> Observing {
        let mut r = registry();
        let id = r.next;
        r.next += 1;
        r.observers.push((id, target, self.clone()));
        r.changed();
        ATTACHED.fetch_add(1, Ordering::Relaxed);
        Observing { id }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every change to the state is made whole before the lock is released.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for every observed copy, then returns the totals so far (they keep accumulating; see
    /// [`Profiler::reset`]).
    pub fn report(&self) -> Result<ProfileReport> {
        let _one_at_a_time = self.reporting.lock().unwrap_or_else(PoisonError::into_inner);
        // Wait without the state's lock, which every observed copy takes to record its events.
        let taken = std::mem::take(&mut self.state().pending);
        let waited = taken.iter().try_for_each(|p| p.end.synchronize());
        let mut state = self.state();
        let newer = std::mem::replace(&mut state.pending, taken);
        state.pending.extend(newer);
        waited?;
        fold(&mut state)?;
        // The threshold a backlog raised is for that backlog: after the report's fold, back to
        // what the copies still pending call for.
        state.fold_at = FOLD_AT.max(2 * state.pending.len());
        Ok(state.report.clone())
    }

    /// Observed copies whose events have not been read yet: those still in flight, and those
    /// complete since the last report or fold (bounded: see the module docs).
    pub fn pending_copies(&self) -> usize {
        self.state().pending.len()
    }

    /// Pairs of timed events kept for reuse now: the pool grows to the number of observed copies
    /// in flight at once and is then reused (a report returns every pair).
    pub fn pooled_pairs(&self) -> usize {
        self.state().pool.len()
    }

    /// Forgets the totals (copies still pending are counted in the next report).
    pub fn reset(&self) {
        self.state().report = ProfileReport::default();
    }

    /// Records `start` for this copy on `stream` with a pair from the pool. A failure comes with
    /// the event made before a new pair's second one failed, if any, for the caller to drop once
    /// the copy has let go of its locks (destroying it may log).
    fn start(&self, stream: &Stream) -> Started {
        let ctx = stream.context();
        let pair = {
            let mut state = self.state();
            let i = state.pool.iter().rposition(|(s, _)| s.context() == ctx);
            i.map(|i| state.pool.swap_remove(i))
        };
        let (mut start, end) = match pair {
            Some(p) => p,
            None => new_pair(ctx)?,
        };
        if let Err(e) = start.record(stream) {
            self.state().pool.push((start, end));
            return Err((e, None));
        }
        Ok((start, end))
    }

    /// Records `end` for this copy and keeps the pair pending (back to the pool when the copy
    /// failed); returns what it could not do (record the end event, or fold completed copies),
    /// for the caller to log once the copy has let go of its locks, this profiler's included (a
    /// subscriber may read the profiler).
    fn finish(
        &self,
        stream: &Stream,
        kind: CopyKind,
        bytes: usize,
        (start, mut end): (Event, Event),
        ok: bool,
    ) -> Option<Missed> {
        let recorded = if ok { end.record(stream).map(|()| true) } else { Ok(false) };
        let mut state = self.state();
        match recorded {
            Ok(true) => {
                state.pending.push_back(Pending { kind, bytes, start, end });
                if state.pending.len() > state.fold_at {
                    let folded = fold(&mut state);
                    state.fold_at = FOLD_AT.max(2 * state.pending.len());
                    folded.err().map(Missed::Fold)
                } else {
                    None
                }
            }
            // The copy failed (the caller hears of it), or it ran but cannot be timed: not
            // counted, and said so, as when the start event cannot be recorded. The start event
            // may still be pending on the stream: recording it again later is fine, a pair is
            // only read after its end event was recorded after it.
            not_counted => {
                state.pool.push((start, end));
                not_counted.err().map(Missed::End)
            }
        }
    }
}

/// A pair of timed events ready for a copy, or why not, with the event of a pair made halfway.
type Started = std::result::Result<(Event, Event), (cumem_core::Error, Option<Event>)>;

/// A new pair of timed events; when the second cannot be made, the error and the first, which
/// the caller drops once the copy has let go of its locks (a failed destroy logs).
fn new_pair(ctx: &Context) -> Started {
    let start = Event::timed(ctx).map_err(|e| (e, None))?;
    match Event::timed(ctx) {
        Ok(end) => Ok((start, end)),
        Err(e) => Err((e, Some(start))),
    }
}

/// Moves every complete copy into the report and its events back into the pool, wherever it is in
/// the pending list: one copy held up on a stream keeps only itself pending, not every copy
/// recorded after it. A copy whose events cannot be read stays pending; the first such error is
/// returned once the rest are folded.
fn fold(state: &mut State) -> Result<()> {
    let mut first_error = None;
    for _ in 0..state.pending.len() {
        let Some(p) = state.pending.pop_front() else { break };
        let time = p.end.query().and_then(|done| done.then(|| p.end.elapsed_since(&p.start)).transpose());
        match time {
            Ok(Some(time)) => {
                let t = state.report.rows.entry((p.kind, SizeClass::of(p.bytes))).or_default();
                t.add(&Totals { count: 1, bytes: p.bytes as u64, device_time: time });
                state.pool.push((p.start, p.end));
            }
            Ok(None) => state.pending.push_back(p),
            Err(e) => {
                first_error.get_or_insert(e);
                state.pending.push_back(p);
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

impl fmt::Debug for Profiler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("Profiler")
            .field("pending", &state.pending.len())
            .field("pooled_pairs", &state.pool.len())
            .finish()
    }
}

impl fmt::Debug for Observing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Observing").field("id", &self.id).finish()
    }
}

impl Drop for Observing {
    fn drop(&mut self) {
        let removed = {
            let mut r = registry();
            let i = r.observers.iter().position(|(id, _, _)| *id == self.id);
            let removed = i.map(|i| r.observers.swap_remove(i));
            r.changed();
            removed
        };
        if removed.is_some() {
            ATTACHED.fetch_sub(1, Ordering::Relaxed);
        }
        // `removed` (a profiler clone, maybe the last) drops here, outside the registry lock.
    }
}

/// One copy's tracing and profiling. [`begin`] creates and enters its `trace` span `copy` before
/// the copy takes any cumem lock (a buffer's stream order, a host kind's tracker), and the
/// profiler's failures are kept until it is dropped, after those locks are let go: a subscriber
/// runs arbitrary code (it may hand the record to a thread that copies to or from the same buffer
/// and wait for that thread), so none of it may run while the copy holds a lock. For the same
/// reason the span is entered before the copy binds its context: a subscriber that binds another
/// one on enter cannot make the driver call run there.
#[must_use = "the copy's span lasts only while this lives"]
pub(crate) struct CopyTrace {
    kind: CopyKind,
    bytes: usize,
    /// What an observed copy leaves for the drop; `None`, one word to check, for every copy no
    /// profiler observes (the hot path).
    observed: Option<Box<Observed>>,
    /// Left when the trace is dropped, after `Drop::drop` has logged the misses inside it.
    _span: tracing::span::EnteredSpan,
}

/// What a copy that profilers observed leaves for its trace's drop, after the copy's locks.
#[derive(Default)]
struct Observed {
    /// What profiling this copy could not do, logged on drop.
    missed: Vec<Missed>,
    /// The profilers that observed the copy, kept so that the last handle of one let go meanwhile
    /// by another thread is dropped here (a profiler's drop destroys its events, which may log).
    profilers: Vec<Profiler>,
    /// Events of a pair that could not be made whole, dropped here for the same reason.
    spare: Vec<Event>,
}

/// A profiling failure, kept to be logged once the copy has let go of its locks.
enum Missed {
    /// A profiler could not record the copy's start: the copy is not counted.
    Start(cumem_core::Error),
    /// The copy ran, but a profiler could not record its end: the copy is not counted.
    End(cumem_core::Error),
    /// Folding completed copies into a report failed (they stay pending).
    Fold(cumem_core::Error),
}

/// Starts tracing a copy of `bytes` bytes of `kind` on `stream`: call it before taking any lock
/// and before binding the context, and keep the result until those locks are let go.
#[inline]
pub(crate) fn begin(stream: &Stream, kind: CopyKind, bytes: usize) -> CopyTrace {
    // A span, not an event, so that whatever the copy logs (a driver error, the profiler's
    // warning) carries its fields; the fields are computed only when the span is enabled.
    let span = tracing::trace_span!(
        "copy",
        device = stream.context().device().ordinal(),
        stream = stream.id(),
        bytes,
        kind = kind.name(),
    )
    .entered();
    CopyTrace { kind, bytes, observed: None, _span: span }
}

impl CopyTrace {
    /// Runs `copy`, which queues this copy on `stream` (or runs it there), bracketed by timed
    /// events when a profiler observes `stream`. Logs nothing: it may run under cumem's locks.
    #[inline]
    pub(crate) fn around<R>(&mut self, stream: &Stream, copy: impl FnOnce() -> Result<R>) -> Result<R> {
        if !active() {
            return copy();
        }
        observed(stream, self.kind, self.bytes, &mut self.observed, copy)
    }
}

impl Drop for CopyTrace {
    #[inline]
    fn drop(&mut self) {
        if let Some(observed) = self.observed.take() {
            log_missed(*observed);
        }
    }
}

/// Logs what an observed copy missed, then lets go of its profilers and of the events of a pair
/// that could not be made whole (inside the copy's span).
#[cold]
#[inline(never)]
fn log_missed(observed: Observed) {
    for missed in observed.missed {
        match missed {
            Missed::Start(e) => {
                tracing::warn!(error = %e, event = "start", "profiling a copy failed; it is not counted")
            }
            Missed::End(e) => {
                tracing::warn!(error = %e, event = "end", "profiling a copy failed; it is not counted")
            }
            Missed::Fold(e) => tracing::warn!(error = %e, "reading a profiled copy's events failed"),
        }
    }
}

#[cold]
#[inline(never)]
fn observed<R>(
    stream: &Stream,
    kind: CopyKind,
    bytes: usize,
    kept: &mut Option<Box<Observed>>,
    copy: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let key = StreamKey::of(stream);
    if !watched(key) {
        return copy();
    }
    // Each profiler once, however many of its attachments match (`observe(&s)` and `observe_all`,
    // or a clone attached again): it counts each copy once.
    let mut profilers: Vec<Profiler> = Vec::new();
    for (_, _, p) in registry().observers.iter().filter(|(_, t, _)| t.matches(key)) {
        if !profilers.iter().any(|q| Arc::ptr_eq(&q.state, &p.state)) {
            profilers.push(p.clone());
        }
    }
    let mut missed = Vec::new();
    let mut spare = Vec::new();
    let mut started = Vec::with_capacity(profilers.len());
    for p in &profilers {
        // Profiling must never fail a copy: a profiler that cannot record misses this one.
        match p.start(stream) {
            Ok(pair) => started.push((p, pair)),
            Err((e, half)) => {
                missed.push(Missed::Start(e));
                spare.extend(half);
            }
        }
    }
    let out = copy();
    for (p, pair) in started {
        missed.extend(p.finish(stream, kind, bytes, pair, out.is_ok()));
    }
    // Dropped with the trace, after the locks: see `Observed::profilers`.
    let observed = kept.get_or_insert_with(Box::default);
    observed.missed.extend(missed);
    observed.profilers.extend(profilers);
    observed.spare.extend(spare);
    out
}
