//! The engine: the thread that executes every stream's queue, and the thread host functions run on.
//!
//! One engine thread picks, among the streams whose head operation may start (its stream idle,
//! its dependencies complete, its latency elapsed), the operation enqueued first (with
//! `schedule=reversed`, the one enqueued last: see `crate::config::Schedule`), and moves its
//! bytes with the state lock released, so long copies do not stall API calls. Operations that only
//! move bytes run in batches: after picking one, the engine keeps picking as if the picked ones
//! were complete, while the next pick also only moves bytes (up to a bound), then runs the batch
//! in that order with one release of the lock and one wake-up of the waiters, where one pick per
//! look made every small copy pay for two lock round trips. The latency is a
//! delay, not a throughput limit, so queued operations pipeline. Host functions are handed to a
//! separate callback thread, one for all streams (as on an H100, §17 of the driver reference),
//! which keeps their stream busy until they return while other streams carry on. A stream wait
//! for another process's recording of an interprocess event is a dependency only that process can
//! complete: while one is pending the engine looks at the event's shared page every
//! `crate::ipc::event::POLL`, waiting with the lock released in between. Such a wait may never end
//! (that process may have exited with the recording queued): after a few seconds it says so once on
//! stderr (`crate::ipc::event::Stall`).

use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Sender, channel};
use std::time::Instant;

use parking_lot::MutexGuard;

use crate::copy::{self, Work};
use crate::memory::{AllocKind, Allocation, Freed};
use crate::state::{InFlight, SIM, State};
use crate::stream::{ENGINE_BUSY, ENGINE_IDLE, ENGINE_WAKE, done_through, wake_value};
use crate::violation::{self, Violation};

struct HostJob {
    sid: u64,
    f: unsafe extern "C" fn(*mut c_void),
    data: usize,
}

static HOST_JOBS: OnceLock<Sender<HostJob>> = OnceLock::new();

/// Starts the engine and the host-callback thread (once per process).
pub(crate) fn start() -> Result<(), String> {
    if HOST_JOBS.get().is_some() {
        return Ok(());
    }
    let (tx, rx) = channel::<HostJob>();
    std::thread::Builder::new()
        .name("cumem-sim-hostfn".into())
        .spawn(move || {
            while let Ok(job) = rx.recv() {
                crate::api::set_in_host_fn(true);
                let f = job.f;
                // SAFETY: the program passed `f` and `data` to cuLaunchHostFunc, promising that
                // calling `f(data)` once, in stream order, is valid.
                let _ = std::panic::catch_unwind(|| unsafe { f(job.data as *mut c_void) });
                crate::api::set_in_host_fn(false);
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
    mark_idle(st, sid);
    SIM.changed.notify_all();
}

/// Marks `sid` as running nothing; a destroyed stream whose queue is empty goes away (see
/// [`crate::stream::remove_drained`]).
fn mark_idle(st: &mut State, sid: u64) {
    let remove = match st.streams.get_mut(&sid) {
        Some(s) => {
            s.running = None;
            s.destroyed && s.queue.is_empty()
        }
        None => false,
    };
    if remove {
        crate::stream::remove_drained(st, sid);
    }
}

/// The violation for an operation enqueued by `api` on thread `tid` that touched `a` after its free
/// (`how`) had taken effect. The enqueueing call itself returned `CUDA_SUCCESS`, which is the code
/// recorded: the misuse is detected only when the operation runs.
fn use_after_free(api: &'static str, tid: u64, a: &Allocation, how: &Freed) -> Violation {
    let what = match a.kind {
        AllocKind::Pool => "device memory (pool allocation)",
        AllocKind::Device | AllocKind::Pitched => "device memory",
        AllocKind::Vmm => "device memory (VMM mapping)",
        AllocKind::IpcImport => "device memory (IPC import)",
        AllocKind::PoolImport => "device memory (imported pool allocation)",
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
        Freed::AtCall { api: by } if a.kind == AllocKind::Vmm => format!(
            "{what} [{base:#x}, +{bytes}) used after its free: {by} unmapped it while this operation \
             was still queued (a GPU faults); no bytes were moved"
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

/// The violation for an operation enqueued by `api` on thread `tid` that runs on from a live
/// mapping into VMM addresses unmapped while it was queued (an operation that touches an unmapped
/// mapping itself is a use after free: [`use_after_free`]). Its bytes are not moved.
fn use_after_unmap(api: &'static str, tid: u64, work: &Work) -> Violation {
    let spans: Vec<String> = work.spans().iter().map(|(addr, len)| format!("[{addr:#x}, +{len})")).collect();
    let ok = cudarc::driver::sys::CUresult::CUDA_SUCCESS;
    Violation {
        function: api.to_string(),
        code: ok as u32,
        code_name: crate::errors::name_str(ok).to_string(),
        message: format!(
            "device memory (VMM mapping) {} used after cuMemUnmap: part of it was unmapped while \
             this operation was still queued (a GPU faults); no bytes were moved",
            spans.join(", ")
        ),
        os_tid: tid,
    }
}

/// What one look at the queues found: the operation to run next (its sequence number and
/// stream), when to look again if nothing is ready, and stall notes to print once the state lock
/// is released (see `crate::ipc::event::say`).
struct Pick {
    best: Option<(u64, u64)>,
    wake: Option<Instant>,
    notes: Vec<String>,
}

/// Among the streams whose head operation may start at `now`, the one enqueued first, or last
/// under `schedule=reversed`. Either way each stream's own queue stays FIFO and every dependency
/// is honoured: only the order among independent streams' ready heads changes, which a GPU does
/// not promise.
fn pick(st: &State, now: Instant) -> Pick {
    let newest = SIM.reversed.load(Ordering::Relaxed);
    let mut best: Option<(u64, u64)> = None;
    let mut wake: Option<Instant> = None;
    let mut notes = Vec::new();
    for (&sid, s) in &st.streams {
        if s.running.is_some() {
            continue;
        }
        let Some(op) = s.queue.front() else { continue };
        if !op.deps.iter().all(|&(d, q)| done_through(&st.streams, d, q)) {
            continue;
        }
        if let Some(r) = &op.remote
            && !r.page.is_done(r.ticket)
        {
            // A process that exited with that recording queued never publishes it: the wait
            // is unbounded, and says so once when it has lasted long (see `Stall`).
            let mut stall = r.stall.get().unwrap_or_else(crate::ipc::event::Stall::new);
            notes.extend(stall.check(|| {
                format!(
                    "stream {sid:#x} has waited {} s for recording {} of interprocess event {:#x}, \
                     made in another process; if that process exited with it queued, nothing \
                     completes it and the stream's later work waits forever",
                    crate::ipc::event::STALL_NOTE.as_secs(),
                    r.ticket,
                    r.event
                )
            }));
            r.stall.set(Some(stall));
            // No call in this process will say when the other process publishes: look again
            // soon, with the lock released meanwhile like any other wait.
            let poll = now + crate::ipc::event::POLL;
            wake = Some(wake.map_or(poll, |w| w.min(poll)));
            continue;
        }
        if op.ready_at <= now {
            if best.is_none_or(|(seq, _)| if newest { op.seq > seq } else { op.seq < seq }) {
                best = Some((op.seq, sid));
            }
        } else {
            wake = Some(wake.map_or(op.ready_at, |w| w.min(op.ready_at)));
        }
    }
    Pick { best, wake, notes }
}

/// The bytes `work` moves, or `None` if it does more than move bytes (what the engine runs with
/// the state lock released is only byte moves).
fn bytes_moved(work: &Work) -> Option<usize> {
    match work {
        Work::Copy { len, .. } => Some(*len),
        Work::Fill { width, count, .. } => Some(width * count),
        Work::Rows { rows, len, .. } => Some(rows.len() * len),
        Work::FillRows { rows, width, count, .. } => Some(rows.len() * width * count),
        Work::Marker { .. }
        | Work::Nop
        | Work::Free { .. }
        | Work::Prefetch { .. }
        | Work::Attach { .. }
        | Work::HostFn { .. } => None,
    }
}

/// A batch ends before it would exceed either bound: past them, the first operations'
/// completion would wait too long for the last ones' bytes, and the lock is held while a batch is
/// picked (one look at the queues per operation), so the count also bounds how long an API call
/// waits for it. 32 already spreads the lock round trips over enough operations that they no
/// longer show in a profile of small queued copies.
const BATCH_OPS: usize = 32;
const BATCH_BYTES: usize = 1 << 20;

/// One byte-moving operation taken for a batch.
struct Taken {
    sid: u64,
    seq: u64,
    api: &'static str,
    tid: u64,
    work: Work,
    /// It reaches unmapped (or unmapping) VMM memory, so it moves no bytes
    /// (`crate::vmm::reaches_unmapped`).
    unmapped: bool,
}

/// Takes the operation at the head of stream `sid` (picked, and only moving bytes) and then,
/// while the next operation the engine would pick at `now` were the taken ones complete also only
/// moves bytes, that one too: the operations one pick per look would run, in the same order, for
/// one release of the lock. Each taken stream is left running from its first taken operation, so
/// that every taken operation reads as incomplete until [`finish_batch`].
/// Also returns the stall notes its looks produced, to print with the lock released.
fn take_batch(st: &mut State, now: Instant, sid: u64) -> (Vec<Taken>, Vec<String>) {
    let mut batch: Vec<Taken> = Vec::new();
    let mut notes = Vec::new();
    let mut bytes = 0usize;
    let mut next = Some(sid);
    // The lock is held throughout, so nobody sees the streams in between: a taken operation is
    // off its queue and its stream not yet marked running, which reads as complete, so that what
    // follows or depends on it can be picked next.
    while let Some(sid) = next {
        let s = st.streams.get_mut(&sid).expect("picked stream exists");
        let op = s.queue.pop_front().expect("picked stream has a head");
        s.slots -= usize::from(crate::hold::takes_slot(&op.work));
        bytes += bytes_moved(&op.work).unwrap_or(0);
        // Decided now, with the lock held: an unmap of bytes this operation moves, called before
        // the batch is done, waits for it (`crate::vmm::unmap`), so the answer holds throughout.
        let unmapped = crate::vmm::reaches_unmapped(st, &op.work);
        st.in_flight.push(InFlight { sid, api: op.api, spans: op.work.spans(), moves: !unmapped });
        batch.push(Taken { sid, seq: op.seq, api: op.api, tid: op.tid, work: op.work, unmapped });
        if batch.len() >= BATCH_OPS {
            break;
        }
        let look = pick(st, now);
        notes.extend(look.notes);
        next = look.best.map(|(_, sid)| sid).filter(|sid| {
            st.streams[sid]
                .queue
                .front()
                .and_then(|op| bytes_moved(&op.work))
                .is_some_and(|b| bytes.saturating_add(b) <= BATCH_BYTES)
        });
    }
    for t in &batch {
        let s = st.streams.get_mut(&t.sid).expect("a stream with a running operation stays");
        if s.running.is_none() {
            s.running = Some(t.seq);
        }
    }
    (batch, notes)
}

/// Moves the bytes of a batch's operations, in order, with the state lock released (printing
/// `notes` meanwhile), then marks their streams idle.
///
/// An operation that reaches unmapped VMM memory (queued before the unmap), or memory an unmap in
/// progress is unmapping, moves nothing: the host view has no pages there any more, or soon will
/// not. Decided in [`take_batch`], with the lock held; an unmap of anything the batch moves bytes
/// in waits for the batch (`crate::vmm::unmap`), so the answer holds while the bytes move.
fn run_batch(g: &mut MutexGuard<'_, State>, batch: Vec<Taken>, notes: Vec<String>) {
    let mut done: Vec<u64> = batch.iter().map(|t| t.sid).collect();
    done.sort_unstable();
    done.dedup();
    MutexGuard::unlocked(g, || {
        notes.iter().for_each(crate::ipc::event::say);
        for Taken { api, tid, work, unmapped, .. } in batch {
            if unmapped {
                // The frees as they stand now, looked at once: an unmap in progress may mark its
                // allocation freed meanwhile, and the operation is reported once either way.
                let frees: Vec<_> =
                    work.touched().into_iter().filter_map(|a| a.freed.get().map(|how| (a, how))).collect();
                // An unmapped mapping it touches is reported as a use after free.
                if !frees.iter().any(|(a, _)| a.kind == AllocKind::Vmm) {
                    violation::record(use_after_unmap(api, tid, &work));
                }
                for (a, how) in frees {
                    violation::record(use_after_free(api, tid, a, how));
                }
                continue;
            }
            // A panic here would kill the engine and hang every waiter; contain it.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| copy::execute(&work)));
            // The bytes have moved. A free that took effect before this point was not ordered
            // after the operation: report the use after free.
            for a in work.touched() {
                if let Some(how) = a.freed.get() {
                    violation::record(use_after_free(api, tid, a, how));
                }
            }
            drop(work);
        }
    });
    finish_batch(g, &done);
}

/// Marks a batch's streams idle (see [`finish`]) and wakes everyone once.
fn finish_batch(st: &mut State, sids: &[u64]) {
    st.in_flight.clear();
    for &sid in sids {
        mark_idle(st, sid);
    }
    SIM.changed.notify_all();
}

fn engine_loop() {
    let mut g = SIM.st.lock();
    loop {
        let now = Instant::now();
        let Pick { best, wake, notes } = pick(&g, now);
        if !notes.is_empty() {
            // Printed unlocked; the queues may change meanwhile, so look again afterwards.
            MutexGuard::unlocked(&mut g, || notes.iter().for_each(crate::ipc::event::say));
            continue;
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
        if g.streams[&sid].queue.front().is_some_and(|op| bytes_moved(&op.work).is_some()) {
            let (batch, notes) = take_batch(&mut g, now, sid);
            run_batch(&mut g, batch, notes);
            continue;
        }
        let op = {
            let s = g.streams.get_mut(&sid).expect("picked stream exists");
            let op = s.queue.pop_front().expect("picked stream has a head");
            s.slots -= usize::from(crate::hold::takes_slot(&op.work));
            s.running = Some(op.seq);
            op
        };
        match op.work {
            Work::HostFn { f, data } => {
                let sent = HOST_JOBS.get().is_some_and(|tx| tx.send(HostJob { sid, f, data }).is_ok());
                if sent {
                    // Off the queue, it no longer takes a slot: wake calls waiting for room.
                    SIM.changed.notify_all();
                } else {
                    finish(&mut g, sid);
                }
            }
            Work::Marker { event, shared } => {
                if let Some(e) = g.events.get_mut(&event)
                    && e.record == Some((sid, op.seq))
                {
                    e.done_at = Some(Instant::now());
                }
                if let Some((page, ticket)) = shared {
                    page.publish(ticket);
                }
                finish(&mut g, sid);
            }
            Work::Nop => finish(&mut g, sid),
            Work::Free { alloc } => {
                // The stream-ordered free takes effect now; anything still queued elsewhere that
                // touches this memory runs after its free.
                alloc.mark_freed(Freed::StreamOrdered { stream: sid });
                if alloc.kind == AllocKind::PoolImport {
                    crate::pool::shared::forget_import(&mut g, &alloc);
                }
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
            Work::Attach { base, buffer_id, flags } => {
                // The allocation may have been freed (and its address reused) while this waited
                // in the queue: then the attachment has nothing left to apply to. On a destroyed
                // stream it still takes effect; the revert waits for the stream to drain.
                if g.allocs.get(&base).is_some_and(|a| a.buffer_id == buffer_id)
                    && let Some(m) = g.managed.get_mut(&base)
                {
                    m.attach_to(flags, sid);
                }
                finish(&mut g, sid);
            }
            // Byte-moving work: taken in a batch above, never here.
            Work::Copy { .. } | Work::Fill { .. } | Work::Rows { .. } | Work::FillRows { .. } => {
                unreachable!("byte-moving work is taken in a batch")
            }
        }
    }
}
