//! Streams and the engine that runs them.
//!
//! Every stream is a FIFO of operations. One engine thread executes them: an operation may start
//! once its stream has finished everything before it, its dependencies (other streams' work it
//! must wait for) are complete, and its latency has elapsed (`enqueue time + latency_us`). The
//! latency is a delay, not a throughput limit, so queued operations pipeline. Host functions are
//! handed to a separate callback thread, which keeps their stream busy until they return while
//! other streams carry on.
//!
//! Legacy default stream semantics: work enqueued on the legacy stream depends on all prior work
//! of the context's blocking streams, and work enqueued on a blocking stream depends on all prior
//! legacy-stream work; `CU_STREAM_NON_BLOCKING` streams take part in neither.

use std::collections::{BTreeMap, VecDeque};
use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::time::{Duration, Instant};

use parking_lot::MutexGuard;

use crate::copy::{self, Work};
use crate::memory::{AllocKind, Allocation, Freed};
use crate::state::{SIM, State, latency_us, legacy_id};
use crate::violation::{self, Violation};

/// `CU_STREAM_NON_BLOCKING`.
pub(crate) const NON_BLOCKING: u32 = 1;

/// What a stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamKind {
    /// The legacy default stream of a context (`NULL` / `CU_STREAM_LEGACY`).
    Legacy,
    /// `CU_STREAM_PER_THREAD` for one thread: blocking, but never waited on by other streams.
    PerThread,
    /// Created by `cuStreamCreate*`.
    User,
}

/// One queued operation.
pub(crate) struct Op {
    pub(crate) seq: u64,
    /// The exported function that enqueued it and the OS thread that called it (named in
    /// violations detected when the operation runs).
    pub(crate) api: &'static str,
    pub(crate) tid: u64,
    pub(crate) ready_at: Instant,
    /// `(stream, seq)`: that stream must have completed everything up to `seq`.
    pub(crate) deps: Vec<(u64, u64)>,
    pub(crate) work: Work,
}

/// A stream and its queue.
pub(crate) struct Stream {
    pub(crate) device: usize,
    pub(crate) ctx: u64,
    pub(crate) kind: StreamKind,
    pub(crate) flags: u32,
    pub(crate) priority: i32,
    pub(crate) queue: VecDeque<Op>,
    /// Sequence number of the operation currently executing.
    pub(crate) running: Option<u64>,
    /// Sequence number of the last operation enqueued (0 = none yet).
    pub(crate) last_seq: u64,
    /// Destroyed by the program; kept until its queue drains.
    pub(crate) destroyed: bool,
    /// Other stream -> highest sequence number of it that this stream's later work waits for
    /// (recorded dependencies: event waits, legacy-stream synchronisation, allocator waits).
    pub(crate) waits: BTreeMap<u64, u64>,
}

impl Stream {
    /// A stream with an empty queue.
    pub(crate) fn new(device: usize, ctx: u64, kind: StreamKind, flags: u32, priority: i32) -> Self {
        Self {
            device,
            ctx,
            kind,
            flags,
            priority,
            queue: VecDeque::new(),
            running: None,
            last_seq: 0,
            destroyed: false,
            waits: BTreeMap::new(),
        }
    }

    /// Whether the legacy stream synchronises with this one.
    pub(crate) fn blocking(&self) -> bool {
        self.flags & NON_BLOCKING == 0
    }

    /// Operations not yet completed.
    pub(crate) fn pending(&self) -> u64 {
        self.queue.len() as u64 + u64::from(self.running.is_some())
    }
}

/// Whether stream `sid` has completed every operation with a sequence number `<= seq` (a stream
/// that no longer exists has).
pub(crate) fn done_through(streams: &BTreeMap<u64, Stream>, sid: u64, seq: u64) -> bool {
    streams
        .get(&sid)
        .is_none_or(|s| s.running.is_none_or(|r| r > seq) && s.queue.front().is_none_or(|op| op.seq > seq))
}

/// When the engine next looks at the queues by itself: [`ENGINE_BUSY`] while it is not waiting
/// (it rescans before it waits again), [`ENGINE_IDLE`] while it waits to be notified, else the
/// deadline it waits for, in nanoseconds after [`epoch`] plus one. Written by the engine and read
/// by [`enqueue`], both holding the state lock.
static ENGINE_WAKE: AtomicU64 = AtomicU64::new(ENGINE_BUSY);
const ENGINE_BUSY: u64 = 0;
const ENGINE_IDLE: u64 = u64::MAX;

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// `t` as an [`ENGINE_WAKE`] deadline.
fn wake_value(t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(epoch()).as_nanos())
        .unwrap_or(ENGINE_IDLE - 1)
        .saturating_add(1)
}

/// Appends `work` to stream `sid` (which must exist) and returns its sequence number.
pub(crate) fn enqueue(st: &mut State, sid: u64, work: Work, mut deps: Vec<(u64, u64)>) -> u64 {
    st.next_seq += 1;
    let seq = st.next_seq;
    let (ctx, device, kind, blocking) = {
        let s = &st.streams[&sid];
        (s.ctx, s.device, s.kind, s.blocking())
    };
    match kind {
        StreamKind::Legacy => {
            for (&id, other) in &st.streams {
                if id != sid
                    && other.ctx == ctx
                    && other.kind != StreamKind::Legacy
                    && other.blocking()
                    && other.last_seq > 0
                    && !done_through(&st.streams, id, other.last_seq)
                {
                    deps.push((id, other.last_seq));
                }
            }
        }
        _ if blocking => {
            let legacy = legacy_id(device);
            if let Some(l) = st.streams.get(&legacy)
                && l.last_seq > 0
                && !done_through(&st.streams, legacy, l.last_seq)
            {
                deps.push((legacy, l.last_seq));
            }
        }
        _ => {}
    }
    let ready_at = Instant::now() + Duration::from_micros(latency_us());
    let s = st.streams.get_mut(&sid).expect("enqueue on a live stream");
    for &(d, q) in &deps {
        let w = s.waits.entry(d).or_insert(0);
        *w = (*w).max(q);
    }
    let (api, tid) = crate::api::caller();
    s.queue.push_back(Op { seq, ready_at, api, tid, deps, work });
    s.last_seq = seq;
    // Only the engine waits for enqueues, and it need only be woken if this operation may be due
    // before it looks again (waking it for every operation made every queued call pay for a
    // context switch and a fight for the lock).
    let wake = ENGINE_WAKE.load(Ordering::Relaxed);
    if wake != ENGINE_BUSY && wake_value(ready_at) < wake {
        SIM.changed.notify_all();
    }
    seq
}

/// What "everything enqueued so far" means for one stream: for the legacy stream, also all prior
/// work of the context's blocking streams.
pub(crate) fn sync_targets(st: &State, sid: u64) -> Vec<(u64, u64)> {
    let Some(s) = st.streams.get(&sid) else {
        return Vec::new();
    };
    let mut targets = vec![(sid, s.last_seq)];
    if s.kind == StreamKind::Legacy {
        targets.extend(
            st.streams
                .iter()
                .filter(|(id, o)| **id != sid && o.ctx == s.ctx && o.blocking())
                .map(|(&id, o)| (id, o.last_seq)),
        );
    }
    targets
}

/// Every stream of a context (or of a device, with `ctx == None`) up to its last operation.
pub(crate) fn all_targets(st: &State, device: usize) -> Vec<(u64, u64)> {
    st.streams.iter().filter(|(_, s)| s.device == device).map(|(&id, s)| (id, s.last_seq)).collect()
}

/// Whether all targets are complete.
pub(crate) fn targets_done(st: &State, targets: &[(u64, u64)]) -> bool {
    targets.iter().all(|&(s, q)| done_through(&st.streams, s, q))
}

/// Blocks (releasing the lock while waiting) until all targets are complete.
pub(crate) fn wait_for(g: &mut MutexGuard<'_, State>, targets: &[(u64, u64)]) {
    while !targets_done(g, targets) {
        SIM.changed.wait(g);
    }
}

struct HostJob {
    sid: u64,
    f: unsafe extern "C" fn(*mut c_void),
    data: usize,
}

static HOST_JOBS: OnceLock<Sender<HostJob>> = OnceLock::new();

/// Starts the engine and the host-callback thread (once per process).
pub(crate) fn start_engine() -> Result<(), String> {
    if HOST_JOBS.get().is_some() {
        return Ok(());
    }
    let (tx, rx) = channel::<HostJob>();
    std::thread::Builder::new()
        .name("cumem-sim-hostfn".into())
        .spawn(move || {
            while let Ok(job) = rx.recv() {
                crate::context::IN_HOST_FN.with(|f| f.set(true));
                let f = job.f;
                // SAFETY: the program passed `f` and `data` to cuLaunchHostFunc, promising that
                // calling `f(data)` once, in stream order, is valid.
                let _ = std::panic::catch_unwind(|| unsafe { f(job.data as *mut c_void) });
                crate::context::IN_HOST_FN.with(|f| f.set(false));
                let mut g = SIM.st.lock();
                finish(&mut g, job.sid);
            }
        })
        .map_err(|e| e.to_string())?;
    let _ = HOST_JOBS.set(tx);
    std::thread::Builder::new()
        .name("cumem-sim-engine".into())
        .spawn(engine_loop)
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Marks the running operation of `sid` complete and wakes everyone.
fn finish(st: &mut State, sid: u64) {
    let remove = match st.streams.get_mut(&sid) {
        Some(s) => {
            s.running = None;
            s.destroyed && s.queue.is_empty()
        }
        None => false,
    };
    if remove {
        st.streams.remove(&sid);
    }
    SIM.changed.notify_all();
}

/// The violation for an operation enqueued by `api` on thread `tid` that touched `a` after its free
/// (`how`) had taken effect. The enqueueing call itself returned `CUDA_SUCCESS`, which is the code
/// recorded: the misuse is detected only when the operation runs.
fn use_after_free(api: &'static str, tid: u64, a: &Allocation, how: &Freed) -> Violation {
    let what = match a.kind {
        AllocKind::Pool => "device memory (pool allocation)",
        AllocKind::Device | AllocKind::Pitched => "device memory",
        AllocKind::Managed => "managed memory",
        AllocKind::PinnedHost | AllocKind::Registered => "pinned host memory",
    };
    let (base, bytes) = (a.base, a.bytes);
    let message = match how {
        Freed::StreamOrdered { stream } => format!(
            "{what} [{base:#x}, +{bytes}) used after its stream-ordered free: cuMemFreeAsync on stream \
             {stream:#x} ran before this operation (queued earlier on another stream, with no \
             dependency making the free wait for it) completed; the bytes may already belong to a \
             new allocation"
        ),
        Freed::AtCall { api: by } => format!(
            "{what} [{base:#x}, +{bytes}) used after its free: {by} released it while this operation \
             was still queued; the bytes may already belong to a new allocation"
        ),
    };
    Violation {
        function: api.to_string(),
        code: cudarc::driver::sys::CUresult::CUDA_SUCCESS as u32,
        code_name: crate::errors::name_str(cudarc::driver::sys::CUresult::CUDA_SUCCESS).to_string(),
        message,
        os_tid: tid,
    }
}

fn engine_loop() {
    let mut g = SIM.st.lock();
    loop {
        let now = Instant::now();
        let mut best: Option<(u64, u64)> = None;
        let mut wake: Option<Instant> = None;
        for (&sid, s) in &g.streams {
            if s.running.is_some() {
                continue;
            }
            let Some(op) = s.queue.front() else { continue };
            if !op.deps.iter().all(|&(d, q)| done_through(&g.streams, d, q)) {
                continue;
            }
            if op.ready_at <= now {
                if best.is_none_or(|(seq, _)| op.seq < seq) {
                    best = Some((op.seq, sid));
                }
            } else {
                wake = Some(wake.map_or(op.ready_at, |w| w.min(op.ready_at)));
            }
        }
        let Some((_, sid)) = best else {
            match wake {
                Some(t) => {
                    ENGINE_WAKE.store(wake_value(t), Ordering::Relaxed);
                    SIM.changed.wait_until(&mut g, t);
                }
                None => {
                    ENGINE_WAKE.store(ENGINE_IDLE, Ordering::Relaxed);
                    SIM.changed.wait(&mut g);
                }
            }
            ENGINE_WAKE.store(ENGINE_BUSY, Ordering::Relaxed);
            continue;
        };
        let op = {
            let s = g.streams.get_mut(&sid).expect("picked stream exists");
            let op = s.queue.pop_front().expect("picked stream has a head");
            s.running = Some(op.seq);
            op
        };
        match op.work {
            Work::HostFn { f, data } => {
                let sent = HOST_JOBS.get().is_some_and(|tx| tx.send(HostJob { sid, f, data }).is_ok());
                if !sent {
                    finish(&mut g, sid);
                }
            }
            Work::Marker { event } => {
                if let Some(e) = g.events.get_mut(&event)
                    && e.record == Some((sid, op.seq))
                {
                    e.done_at = Some(Instant::now());
                }
                finish(&mut g, sid);
            }
            Work::Nop => finish(&mut g, sid),
            Work::Free { alloc } => {
                // The stream-ordered free takes effect now; anything still queued elsewhere that
                // touches this memory runs after its free.
                alloc.mark_freed(Freed::StreamOrdered { stream: sid });
                finish(&mut g, sid);
            }
            Work::Prefetch { base, buffer_id, first, last, loc } => {
                if g.allocs.get(&base).is_some_and(|a| a.buffer_id == buffer_id)
                    && let Some(m) = g.managed.get_mut(&base)
                {
                    m.update(first, last, |h| h.last_prefetch = Some(loc));
                }
                finish(&mut g, sid);
            }
            work => {
                let (api, tid) = (op.api, op.tid);
                MutexGuard::unlocked(&mut g, || {
                    // A panic here would kill the engine and hang every waiter; contain it.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| copy::execute(&work)));
                    // The bytes have moved. A free that took effect before this point was not
                    // ordered after the operation: report the use after free.
                    for a in work.touched() {
                        if let Some(how) = a.freed.get() {
                            violation::record(use_after_free(api, tid, a, how));
                        }
                    }
                    drop(work);
                });
                finish(&mut g, sid);
            }
        }
    }
}
