//! Streams: handles, queues, ordering rules, and the calls that create, wait for and destroy
//! them. The engine that executes the queues is in `engine.rs`.
//!
//! Every stream is a FIFO of operations. An operation may start once its stream has finished
//! everything before it, its dependencies (other streams' work it must wait for) are complete,
//! and its latency has elapsed (`enqueue time + latency_us`).
//!
//! Legacy default stream semantics: work enqueued on the legacy stream depends on all prior work
//! of the context's blocking streams, and work enqueued on a blocking stream depends on all prior
//! legacy-stream work; `CU_STREAM_NON_BLOCKING` streams take part in neither.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUevent, CUhostFn, CUresult, CUstream};
use parking_lot::MutexGuard;

use crate::api::Fail;
use crate::context;
use crate::copy::Work;
use crate::ipc::event::RemoteWait;
use crate::state::{SIM, State, latency_us};

/// `CU_STREAM_NON_BLOCKING`.
pub(crate) const NON_BLOCKING: u32 = 1;
/// `CU_STREAM_LEGACY`.
pub(crate) const STREAM_LEGACY: u64 = 0x1;
/// `CU_STREAM_PER_THREAD`.
pub(crate) const STREAM_PER_THREAD: u64 = 0x2;
/// Least (0) and greatest (-5) stream priority.
pub const STREAM_PRIORITY_RANGE: (i32, i32) = (0, -5);

/// What a stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamKind {
    /// The legacy default stream of a context (`NULL` / `CU_STREAM_LEGACY`).
    Legacy,
    /// `CU_STREAM_PER_THREAD` for one thread: blocking, so it waits for, and is waited for by, the
    /// legacy stream (driver brief §7.1); no other stream synchronises with it implicitly.
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
    /// A recording of an interprocess event, made by another process, that must have completed
    /// (its ticket); only the shared page tells, so the engine polls it.
    pub(crate) remote: Option<RemoteWait>,
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
    /// How many operations in `queue` take a slot of the stream's depth (`hold::takes_slot`):
    /// kept as they are queued and taken, so that a full stream's check does not count a long
    /// queue of records again on every call.
    pub(crate) slots: usize,
    /// Sequence number of the operation currently executing.
    pub(crate) running: Option<u64>,
    /// Sequence number of the last operation enqueued, or of a later pool allocation made on the
    /// stream, which takes one without queueing an operation (0 = none yet).
    pub(crate) last_seq: u64,
    /// Destroyed by the program; kept until its queue drains.
    pub(crate) destroyed: bool,
    /// Other stream -> highest sequence number of it that this stream's later work waits for
    /// (recorded dependencies: event waits, allocator waits, and the legacy-stream synchronisation,
    /// also with work that had completed). Only through [`record_wait`]; a removed stream's
    /// entries go with it (see [`remove_drained`]).
    pub(crate) waits: BTreeMap<u64, u64>,
    /// The streams whose `waits` name this one: kept in step with them, so that removing this
    /// stream finds the entries naming it without looking at every stream.
    pub(crate) waited_by: BTreeSet<u64>,
}

/// A stream removed while other streams' `waits` must still name it: a pool allocation the host
/// has not observed, placed before the removal, may still be asked about through those entries
/// (`crate::order`: an allocation made on it, or a chain of waits through it), or a pool still
/// holds a free made on it whose reuse follows the waits for it (`crate::pool::ordered_through`).
/// Once neither holds, the entries go (see [`sweep_retired`]).
pub(crate) struct Retired {
    /// `State::next_seq` at the removal: pending allocations with a sequence number up to this
    /// were placed before it.
    since: u64,
    /// The live streams whose `waits` name it.
    waited_by: BTreeSet<u64>,
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
            slots: 0,
            running: None,
            last_seq: 0,
            destroyed: false,
            waits: BTreeMap::new(),
            waited_by: BTreeSet::new(),
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

/// The internal stream id a `CUstream` names. NULL and `CU_STREAM_LEGACY` are the current
/// context's legacy stream, `CU_STREAM_PER_THREAD` the thread's per-thread stream (both need a
/// current context); other values must be live streams (`INVALID_HANDLE` otherwise).
pub(crate) fn resolve(st: &mut State, h: CUstream) -> Result<u64, Fail> {
    let v = h as u64;
    match v {
        0 | STREAM_LEGACY => {
            let (ctx, d) = context::current_ctx(st)?;
            Ok(st.legacy_stream(ctx, d))
        }
        STREAM_PER_THREAD => {
            let (ctx, d) = context::current_ctx(st)?;
            let key = (ctx, thread_key());
            if let Some(&id) = st.per_thread.get(&key) {
                return Ok(id);
            }
            let id = st.new_stream_handle();
            st.streams.insert(id, Stream::new(d, key.0, StreamKind::PerThread, 0, 0));
            st.per_thread.insert(key, id);
            Ok(id)
        }
        _ => match st.streams.get(&v) {
            Some(s) if s.kind == StreamKind::User && !s.destroyed => Ok(v),
            _ => Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_HANDLE,
                format!("stream {v:#x} is not a live stream"),
            )),
        },
    }
}

/// The next [`thread_key`] handed out (0 means "none yet").
static NEXT_THREAD_KEY: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's key for its per-thread streams (0 until its first use). Not the OS thread
    /// id: the kernel hands a dead thread's id to a later thread, which would then inherit the
    /// dead thread's stream, with its queue and recorded waits.
    static THREAD_KEY: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Retires the thread's per-thread streams when the thread exits (see [`Retire`]).
    static RETIRE: Retire = const { Retire };
}

/// Dropped at thread exit: the thread's per-thread streams are destroyed like a user stream
/// (they go away once their queued work has run), so `State::streams` does not grow with every
/// thread that ever used one. Locking the state here cannot deadlock: a thread's locals are
/// destroyed after everything it ran has returned, so it holds no lock, and no holder of the
/// state lock waits for a thread to exit.
struct Retire;

impl Drop for Retire {
    fn drop(&mut self) {
        let key = THREAD_KEY.with(|k| k.replace(0));
        if key == 0 {
            return;
        }
        // Bounded, as the exit's leak check is: a process forked while another thread held the
        // lock has it held for good, and its exit must not hang here (the streams then stay,
        // as in the case below of a first use after this ran).
        let Some(mut st) = SIM.st.try_lock_for(std::time::Duration::from_secs(2)) else {
            return;
        };
        let mut ids = Vec::new();
        st.per_thread.retain(|&(_, k), &mut id| {
            if k == key {
                ids.push(id);
            }
            k != key
        });
        for id in ids {
            let Some(s) = st.streams.get_mut(&id) else { continue };
            s.destroyed = true;
            if s.pending() == 0 {
                remove_drained(&mut st, id);
            }
        }
    }
}

/// The calling thread's key in `State::per_thread`: unique in the process, never reused.
fn thread_key() -> u64 {
    THREAD_KEY.with(|k| {
        if k.get() == 0 {
            k.set(NEXT_THREAD_KEY.fetch_add(1, Ordering::Relaxed));
            // Touching it arms its destructor. A driver call made from another thread-local's
            // destructor after this one ran finds it gone: that thread's new stream then stays
            // until its context is destroyed.
            let _ = RETIRE.try_with(|_| ());
        }
        k.get()
    })
}

/// `cuStreamCreate*`: a user stream of the current context (`flags`: 0 or NON_BLOCKING; the
/// priority is clamped to the range).
pub(crate) fn create(flags: u32, priority: i32) -> Result<u64, Fail> {
    let mut st = SIM.st.lock();
    let (ctx, d) = crate::hold::current_gated(&mut st)?;
    if flags & !NON_BLOCKING != 0 {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("unknown stream flags {flags:#x}"),
        ));
    }
    let (least, greatest) = STREAM_PRIORITY_RANGE;
    let priority = priority.clamp(greatest, least);
    let h = st.new_stream_handle();
    st.streams.insert(h, Stream::new(d, ctx, StreamKind::User, flags, priority));
    Ok(h)
}

/// `cuStreamDestroy`: the handle dies now; queued work still runs, and the stream goes away
/// (its SINGLE attachments reverting) when it has drained.
pub(crate) fn destroy(h_stream: CUstream) -> Result<(), Fail> {
    let v = h_stream as u64;
    if matches!(v, 0 | STREAM_LEGACY | STREAM_PER_THREAD) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_HANDLE,
            "the default stream cannot be destroyed",
        ));
    }
    let mut st = SIM.st.lock();
    // Gated (observed on an H100 for an idle stream, see `crate::hold`).
    let id = crate::hold::resolve_gated(&mut st, h_stream)?;
    let s = st.streams.get_mut(&id).expect("resolved stream exists");
    s.destroyed = true;
    if s.pending() == 0 {
        remove_drained(&mut st, id);
    }
    Ok(())
}

/// Removes destroyed stream `id`, whose work has all completed. Only now do attachments to it
/// revert to the allocation's default association: the driver documents that destruction is
/// asynchronous and the revert "won't happen until all work in the stream has completed".
///
/// Its work has completed, so every wait on it is satisfied and nothing decides readiness from
/// the entries other streams' `waits` have for it (the engine follows each operation's own
/// `deps`, and [`done_through`] takes a missing stream as complete): they go now, unless
/// something may still ask about them ([`Retired`]), so that a program churning threads or
/// streams does not grow the `waits` of the streams that waited for them (the legacy stream
/// waits for every per-thread stream).
pub(crate) fn remove_drained(st: &mut State, id: u64) {
    crate::order::stream_gone(st, id);
    let removed = st.streams.remove(&id);
    for m in st.managed.values_mut().filter(|m| m.stream == id) {
        m.stream_destroyed();
    }
    let Some(s) = removed else { return };
    // It waits for nothing any more.
    for d in s.waits.keys() {
        if let Some(o) = st.streams.get_mut(d) {
            o.waited_by.remove(&id);
        } else if let Some(r) = st.retired.get_mut(d) {
            r.waited_by.remove(&id);
        }
    }
    let since = st.next_seq;
    // Every pending allocation was placed before now.
    if !st.pool_order.is_empty() || frees_pending(st, id) {
        st.retired.insert(id, Retired { since, waited_by: s.waited_by });
    } else {
        forget_waits_on(st, id, &s.waited_by);
    }
    sweep_retired(st);
}

/// Whether something may still ask what streams waited for of stream `id`, removed when
/// `State::next_seq` was `since` (see [`Retired`]); `oldest`: [`crate::order::oldest_pending`].
fn still_asked(st: &State, id: u64, since: u64, oldest: Option<u64>) -> bool {
    oldest.is_some_and(|seq| seq <= since) || frees_pending(st, id)
}

/// Whether a pool holds a free made on stream `id` that only stream-ordered reuse may take.
fn frees_pending(st: &State, id: u64) -> bool {
    st.pools.values().any(|p| p.free.pending_streams().any(|s| s == id))
}

/// Drops the entries for removed stream `id` from the `waits` of `waiters`.
fn forget_waits_on(st: &mut State, id: u64, waiters: &BTreeSet<u64>) {
    for w in waiters {
        if let Some(ws) = st.streams.get_mut(w) {
            ws.waits.remove(&id);
        }
    }
}

/// Lets the retired streams go that nothing can ask about any more. Nothing to do (and nothing
/// spent) while none is retired, which is the case unless pool allocations stay unobserved.
fn sweep_retired(st: &mut State) {
    if st.retired.is_empty() {
        return;
    }
    let oldest = crate::order::oldest_pending(st);
    let done: Vec<u64> = st
        .retired
        .iter()
        .filter(|&(&id, r)| !still_asked(st, id, r.since, oldest))
        .map(|(&id, _)| id)
        .collect();
    for id in done {
        let r = st.retired.remove(&id).expect("listed above");
        forget_waits_on(st, id, &r.waited_by);
    }
}

/// Records that later work of stream `sid` waits for stream `d` through its operation `q`. A
/// stream's own earlier work needs no entry (its queue is FIFO, and nothing reads one). A stream
/// removed and not [`Retired`] gets none: its work has completed and nothing asks about it.
fn record_wait(st: &mut State, sid: u64, d: u64, q: u64) {
    if d == sid {
        return;
    }
    if let Some(o) = st.streams.get_mut(&d) {
        o.waited_by.insert(sid);
    } else if let Some(r) = st.retired.get_mut(&d) {
        r.waited_by.insert(sid);
    } else {
        return;
    }
    let s = st.streams.get_mut(&sid).expect("a wait recorded for a live stream");
    let w = s.waits.entry(d).or_insert(0);
    *w = (*w).max(q);
}

/// `cuStreamSynchronize`: waits for everything queued so far, then lets the device's pools
/// release memory above their thresholds.
pub(crate) fn synchronize(h_stream: CUstream) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    let id = resolve(&mut st, h_stream)?;
    let targets = sync_targets(&st, id);
    wait_for(&mut st, &targets);
    let device = st.streams.get(&id).map(|s| s.device);
    if let Some(d) = device {
        crate::pool::on_synchronize(&mut st, d);
    }
    Ok(())
}

/// Waits for everything queued so far on stream `h_stream` itself (not the legacy stream's
/// implicit dependencies, no pool trimming): how a `_ptds` synchronous operation, queued on the
/// per-thread stream, returns once complete, as its plain form waits for its own operation.
pub(crate) fn wait_queued(h_stream: CUstream) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    let id = resolve(&mut st, h_stream)?;
    let target = st.streams.get(&id).map(|s| (id, s.last_seq));
    wait_for(&mut st, &Vec::from_iter(target));
    Ok(())
}

/// `cuStreamQuery`: `NOT_READY` (quietly) while anything queued so far is incomplete.
pub(crate) fn query(h_stream: CUstream) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    let id = resolve(&mut st, h_stream)?;
    let targets = sync_targets(&st, id);
    if !targets_done(&st, &targets) {
        return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_READY));
    }
    crate::order::observed(&mut st, &targets);
    Ok(())
}

/// `cuStreamWaitEvent`: later work of the stream waits for the event's captured work (the
/// latest recording at the call, made in this process or, for an interprocess event, another).
pub(crate) fn wait_event(h_stream: CUstream, h_event: CUevent, flags: u32) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    // Not gated: observed returning on an H100 while another thread held the device (see
    // `crate::hold`).
    let id = resolve(&mut st, h_stream)?;
    let (record, remote) = {
        let e = crate::event::lookup(&st, h_event)?;
        (e.record, e.remote_ticket())
    };
    if flags != 0 {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("cuStreamWaitEvent flags {flags:#x} must be 0"),
        ));
    }
    if let Some(remote) = remote {
        // Another process's recording: the wait is queued like any other, and the engine
        // releases it when the shared page says that recording completed.
        let (page, ticket) = remote;
        let wait = RemoteWait { page, ticket, event: h_event as u64, stall: std::cell::Cell::new(None) };
        enqueue_after(&mut st, id, Work::Nop, Vec::new(), Some(wait));
        return Ok(());
    }
    if let Some(dep) = record {
        enqueue(&mut st, id, Work::Nop, vec![dep]);
    }
    Ok(())
}

/// `cuLaunchHostFunc`: queues `f(data)` for the callback thread, in stream order.
pub(crate) fn launch_host_fn(h_stream: CUstream, f: CUhostFn, data: usize) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    // A host function takes a slot of the stream's queue: on a full stream the call waits for
    // room (observed), and the handle is resolved again afterwards.
    let (id, f) = loop {
        let id = crate::hold::resolve_gated(&mut st, h_stream)?;
        let Some(f) = f else {
            return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, "NULL host function"));
        };
        if !crate::hold::wait_room(&mut st, id, crate::hold::Full::HostFn) {
            break (id, f);
        }
    };
    enqueue(&mut st, id, Work::HostFn { f, data }, Vec::new());
    Ok(())
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
pub(crate) static ENGINE_WAKE: AtomicU64 = AtomicU64::new(ENGINE_BUSY);
pub(crate) const ENGINE_BUSY: u64 = 0;
pub(crate) const ENGINE_IDLE: u64 = u64::MAX;

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// `t` as an [`ENGINE_WAKE`] deadline.
pub(crate) fn wake_value(t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(epoch()).as_nanos())
        .unwrap_or(ENGINE_IDLE - 1)
        .saturating_add(1)
}

/// Appends `work` to stream `sid` (which must exist) and returns its sequence number.
pub(crate) fn enqueue(st: &mut State, sid: u64, work: Work, deps: Vec<(u64, u64)>) -> u64 {
    enqueue_after(st, sid, work, deps, None)
}

/// [`enqueue`], also waiting for another process's recording of an interprocess event.
fn enqueue_after(
    st: &mut State,
    sid: u64,
    work: Work,
    mut deps: Vec<(u64, u64)>,
    remote: Option<RemoteWait>,
) -> u64 {
    crate::order::check(st, sid, &work);
    st.next_seq += 1;
    let seq = st.next_seq;
    let (ctx, device, kind, blocking) = {
        let s = &st.streams[&sid];
        (s.ctx, s.device, s.kind, s.blocking())
    };
    // The legacy stream's implicit synchronisation, edge by edge. Each is recorded in `waits`
    // even when that work has completed (the pool-ordering check follows these edges: work
    // already done is still ordered before this operation), but only unfinished work becomes an
    // engine dependency.
    let mut implicit = Vec::new();
    match kind {
        StreamKind::Legacy => {
            for (&id, other) in &st.streams {
                if id != sid
                    && other.ctx == ctx
                    && other.kind != StreamKind::Legacy
                    && other.blocking()
                    && other.last_seq > 0
                {
                    implicit.push((id, other.last_seq));
                }
            }
        }
        _ if blocking => {
            let legacy = st.legacy_stream(ctx, device);
            if let Some(l) = st.streams.get(&legacy)
                && l.last_seq > 0
            {
                implicit.push((legacy, l.last_seq));
            }
        }
        _ => {}
    }
    deps.extend(implicit.iter().copied().filter(|&(id, q)| !done_through(&st.streams, id, q)));
    let ready_at = Instant::now() + Duration::from_micros(latency_us());
    for &(d, q) in deps.iter().chain(&implicit) {
        record_wait(st, sid, d, q);
    }
    let s = st.streams.get_mut(&sid).expect("enqueue on a live stream");
    let (api, tid) = crate::api::caller();
    s.slots += usize::from(crate::hold::takes_slot(&work));
    s.queue.push_back(Op { seq, ready_at, api, tid, deps, remote, work });
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

/// Every stream of device `device` (of all its contexts) up to its last operation: what the
/// driver's device-wide drains wait for (implicit synchronisation, see [`crate::hold`]).
pub(crate) fn all_targets(st: &State, device: usize) -> Vec<(u64, u64)> {
    st.streams.iter().filter(|(_, s)| s.device == device).map(|(&id, s)| (id, s.last_seq)).collect()
}

/// Every stream of context `ctx` up to its last operation (`cuCtxSynchronize`).
pub(crate) fn ctx_targets(st: &State, ctx: u64) -> Vec<(u64, u64)> {
    st.streams.iter().filter(|(_, s)| s.ctx == ctx).map(|(&id, s)| (id, s.last_seq)).collect()
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
    crate::order::observed(g, targets);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{ctx_handle, legacy_id};

    /// A state with device 0's legacy stream and nothing else (no engine runs it).
    fn with_legacy() -> (State, u64) {
        let mut st = State::empty();
        let legacy = legacy_id(0);
        st.streams.insert(legacy, Stream::new(0, ctx_handle(0), StreamKind::Legacy, 0, 0));
        (st, legacy)
    }

    /// A thread's per-thread stream with one operation, then an operation on the legacy stream,
    /// which waits for it; both complete (as the engine would) and the thread exits.
    fn one_thread(st: &mut State, legacy: u64) -> u64 {
        let p = st.new_stream_handle();
        st.streams.insert(p, Stream::new(0, ctx_handle(0), StreamKind::PerThread, 0, 0));
        enqueue(st, p, Work::Nop, Vec::new());
        enqueue(st, legacy, Work::Nop, Vec::new());
        for id in [p, legacy] {
            let s = st.streams.get_mut(&id).unwrap();
            s.queue.clear();
            s.slots = 0;
        }
        st.streams.get_mut(&p).unwrap().destroyed = true;
        remove_drained(st, p);
        p
    }

    /// Every thread's per-thread stream gets a wait from the legacy stream's implicit
    /// synchronisation; once the stream is removed the legacy stream no longer names it, however
    /// many threads come and go.
    #[test]
    fn removed_streams_leave_no_waits_behind() {
        let (mut st, legacy) = with_legacy();
        for _ in 0..100 {
            one_thread(&mut st, legacy);
        }
        let l = &st.streams[&legacy];
        assert!(l.waits.is_empty(), "the legacy stream still names {} removed streams", l.waits.len());
        assert!(l.waited_by.is_empty() && st.retired.is_empty());
    }

    /// While a pool allocation placed before the removal is unobserved, the entries stay (the
    /// order check may still follow them); the first removal after it is observed drops them.
    #[test]
    fn entries_stay_while_an_earlier_allocation_is_unobserved() {
        let (mut st, legacy) = with_legacy();
        let other = st.new_stream_handle();
        st.streams.insert(other, Stream::new(0, ctx_handle(0), StreamKind::User, NON_BLOCKING, 0));
        crate::order::placed(&mut st, 7, 0x1000, other);
        let kept = one_thread(&mut st, legacy);
        assert!(st.streams[&legacy].waits.contains_key(&kept));
        assert!(st.retired.contains_key(&kept));
        crate::order::forget(&mut st, 7);
        one_thread(&mut st, legacy);
        assert!(st.streams[&legacy].waits.is_empty() && st.retired.is_empty());
    }

    /// Keys are never reused: a thread started after another one exited (which the OS may give the
    /// same thread id) gets a key of its own, so it cannot inherit the first thread's per-thread
    /// stream.
    #[test]
    fn threads_one_after_another_get_different_keys() {
        let first = std::thread::spawn(thread_key).join().unwrap();
        let second = std::thread::spawn(thread_key).join().unwrap();
        assert_ne!(first, 0);
        assert_ne!(first, second);
        assert_ne!(thread_key(), first);
    }
}
