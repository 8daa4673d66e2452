//! Stream order of pool allocations (reference §8.1): memory from `cuMemAllocAsync` /
//! `cuMemAllocFromPoolAsync` may be used by work ordered after the allocation in stream order,
//! or after the host has synchronised with it. The driver checks neither and returns no error,
//! so a use on another stream that is neither is recorded as a violation (code `CUDA_SUCCESS`)
//! when its work is enqueued; each allocation is reported at most once.
//!
//! An allocation is *placed* on its stream with a sequence number of its own, after the stream's
//! operations so far (which include the wait the pool may have inserted to reuse freed memory),
//! with no operation queued for it. Work on stream `t` is ordered after it when `t` waited for an
//! operation of the stream enqueued after the allocation (a recorded dependency,
//! `cuStreamWaitEvent`), when the legacy stream's implicit synchronisation orders the two
//! streams, or transitively through other streams' recorded waits (an over-approximation: a
//! stream's waits are taken as they are now, not as they were at the wait, so a late dependency
//! may hide a violation but never invents one). The host has observed it once a synchronisation
//! or successful query covering it (an operation of the stream enqueued after it, or the stream's
//! whole queue) happened after the allocation (stream, event, context synchronisation, the waits
//! of synchronous calls and of device drains). Observed allocations are forgotten.

use std::collections::BTreeMap;

use cudarc::driver::sys::CUresult;

use crate::copy::Work;
use crate::memory::AllocKind;
use crate::state::State;
use crate::stream::StreamKind;
use crate::violation::{self, Violation};

/// A pool allocation the host has not yet observed.
pub(crate) struct Placed {
    /// The stream it was allocated on.
    stream: u64,
    /// The allocation's own sequence number on that stream.
    seq: u64,
    /// The allocation's address, for the message.
    base: u64,
    /// The recorded waits of streams destroyed and drained since the allocation: a chain of event
    /// waits through such a stream still orders later work (or the host) after the allocation.
    gone: BTreeMap<u64, BTreeMap<u64, u64>>,
}

/// Unobserved pool allocations by BUFFER_ID.
pub(crate) type Pending = BTreeMap<u64, Placed>;

/// Records pool allocation `buffer_id` at `base`, just made on stream `sid`.
///
/// The allocation takes a sequence number of its own on the stream, with no operation queued
/// for it: only what is recorded (or synchronised) after the call orders it. The stream's last
/// operation before it would not do: an event recorded before the allocation and waited for
/// afterwards orders nothing after it (§8.1).
pub(crate) fn placed(st: &mut State, buffer_id: u64, base: u64, sid: u64) {
    st.next_seq += 1;
    let seq = st.next_seq;
    if let Some(s) = st.streams.get_mut(&sid) {
        // `done_through` and `sync_targets` take a sequence number without an operation as
        // complete once everything queued before it is.
        s.last_seq = seq;
    }
    st.pool_order.insert(buffer_id, Placed { stream: sid, seq, base, gone: BTreeMap::new() });
}

/// Keeps the recorded waits of stream `sid`, destroyed and drained, about to be removed, for the
/// allocations still pending (streams are never renamed: a handle is not reused).
pub(crate) fn stream_gone(st: &mut State, sid: u64) {
    let Some(s) = st.streams.get(&sid) else { return };
    if s.waits.is_empty() {
        return;
    }
    for p in st.pool_order.values_mut() {
        p.gone.insert(sid, s.waits.clone());
    }
}

/// The sequence number of the oldest allocation the host has not observed, if any.
pub(crate) fn oldest_pending(st: &State) -> Option<u64> {
    st.pool_order.values().map(|p| p.seq).min()
}

/// Forgets an allocation being freed.
pub(crate) fn forget(st: &mut State, buffer_id: u64) {
    st.pool_order.remove(&buffer_id);
}

/// The host has seen every operation `(stream, seq)` in `targets` complete (and everything each
/// of them was ordered after).
pub(crate) fn observed(st: &mut State, targets: &[(u64, u64)]) {
    if st.pool_order.is_empty() || targets.is_empty() {
        return;
    }
    // One walk per (target stream, allocating stream), not per allocation: a synchronisation
    // with many allocations pending on a few streams stays cheap. Allocations that kept a
    // destroyed stream's waits walk on their own.
    let mut through: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    let seen: Vec<u64> = st
        .pool_order
        .iter()
        .filter(|(_, p)| {
            // A destroyed allocating stream can no longer be named in a synchronisation: any
            // later one is taken to cover it (lenient: never a false report).
            !st.streams.contains_key(&p.stream)
                || targets.iter().any(|&(s, q)| {
                    if s == p.stream {
                        q >= p.seq
                    } else if p.gone.is_empty() {
                        *through
                            .entry((s, p.stream))
                            .or_insert_with(|| reach(st, &p.gone, p.stream, s, false))
                            >= p.seq
                    } else {
                        ordered(st, p, s, false)
                    }
                })
        })
        .map(|(&id, _)| id)
        .collect();
    for id in seen {
        st.pool_order.remove(&id);
    }
}

/// Whether stream `t` is ordered after allocation `p` (see [`reach`]).
fn ordered(st: &State, p: &Placed, t: u64, now: bool) -> bool {
    reach(st, &p.gone, p.stream, t, now) >= p.seq
}

/// The highest operation of stream `f` that stream `t` is ordered after: directly (`now`: work
/// enqueued on `t` from now on, which the legacy stream's implicit synchronisation orders too;
/// otherwise only `t`'s recorded waits count), or through other streams' recorded waits
/// (`gone`: those of streams destroyed since, kept by the allocation).
fn reach(st: &State, gone: &BTreeMap<u64, BTreeMap<u64, u64>>, f: u64, t: u64, now: bool) -> u64 {
    let waits_of = |u: u64| st.streams.get(&u).map(|s| &s.waits).or_else(|| gone.get(&u));
    let waited = |u: u64| waits_of(u).and_then(|w| w.get(&f)).copied().unwrap_or(0);
    let mut best = if now { crate::pool::ordered_through(st, t, f) } else { waited(t) };
    if best == u64::MAX {
        return best;
    }
    let mut next: Vec<u64> = waits_of(t).map(|w| w.keys().copied().collect()).unwrap_or_default();
    if now && let Some(ts) = st.streams.get(&t) {
        // Work enqueued on `t` now waits for what the legacy stream's implicit synchronisation
        // orders before it: the legacy stream's, or the context's blocking streams', work so far.
        if ts.kind == StreamKind::Legacy {
            next.extend(
                st.streams
                    .iter()
                    .filter(|(_, o)| o.ctx == ts.ctx && o.kind != StreamKind::Legacy && o.blocking())
                    .map(|(&id, _)| id),
            );
        } else if ts.blocking() {
            next.push(st.legacy_stream(ts.ctx, ts.device));
        }
    }
    // A set: with many streams (each ever waited for stays a key) a list made the walk quadratic.
    let mut seen: std::collections::HashSet<u64> = [t, f].into_iter().collect();
    next.retain(|&v| seen.insert(v));
    while let Some(u) = next.pop() {
        best = best.max(waited(u));
        let Some(uw) = waits_of(u) else { continue };
        for &v in uw.keys() {
            if seen.insert(v) {
                next.push(v);
            }
        }
    }
    best
}

/// Checks `work`, about to be enqueued on stream `sid`, against the stream order of the pool
/// allocations it touches (or frees), recording a violation for each one not ordered.
pub(crate) fn check(st: &mut State, sid: u64, work: &Work) {
    if st.pool_order.is_empty() {
        return;
    }
    let mut allocs = work.touched();
    if let Work::Free { alloc } = work {
        allocs.push(alloc);
    }
    let mut late = Vec::new();
    for a in allocs.into_iter().filter(|a| a.kind == AllocKind::Pool) {
        let Some(p) = st.pool_order.get(&a.buffer_id) else { continue };
        if p.stream != sid && !ordered(st, p, sid, true) {
            late.push((a.buffer_id, p.base, p.stream));
        }
    }
    if late.is_empty() {
        return;
    }
    let (function, os_tid) = crate::api::caller();
    for (id, base, stream) in late {
        st.pool_order.remove(&id);
        violation::record(Violation {
            function: function.to_string(),
            code: CUresult::CUDA_SUCCESS as u32,
            code_name: "CUDA_SUCCESS".to_string(),
            message: format!(
                "pool allocation {base:#x} (made on stream {stream:#x}) is used on stream {sid:#x} before its \
                 allocation is ordered: no event wait or synchronisation orders it after the allocation \
                 (§8.1; the driver returns no error, the memory may not be valid yet)"
            ),
            os_tid,
        });
    }
}
