//! Fault injection: for a fixed sequence, make the k-th upstream allocation (and, separately, the
//! k-th stream wait) fail, for every k in turn. The pool must return the error (or recover: from an
//! out-of-memory through its ladder, from a failed migration wait by growing), stay consistent
//! after every step, and leak nothing.

mod common;

use common::{Harness, Op};
use cumem_pool::{Growth, PoolConfig, PoolError, UpstreamError};

const CAPACITY: usize = 256 << 20;

fn config(expandable_segments: bool) -> PoolConfig {
    PoolConfig {
        small_segment_bytes: 2 << 20,
        large_segment_bytes: 2 << 20,
        growth: Growth::Doubling { max: 8 << 20 },
        // Every `Sync` releases what it can, so later steps grow the pool again.
        release_threshold: 0,
        expandable_segments,
        ..PoolConfig::default()
    }
}

/// Small, medium and large blocks over three streams, cross-stream frees, trims and syncs.
fn sequence() -> Vec<Op> {
    let mut ops = vec![];
    let sizes = [700usize, 5000, 300_000, 1 << 20, 3 << 20, 9 << 20, 64, (1 << 20) + 1];
    for round in 0..6u8 {
        for (i, &size) in sizes.iter().enumerate() {
            let stream = (i as u8 + round) % 3;
            let align = if i % 3 == 0 { 4096 } else { 1 };
            ops.push(Op::Alloc { size, align, stream });
        }
        ops.push(Op::Free { idx: 1, stream: Some((round + 1) % 3) });
        ops.push(Op::Free { idx: 4, stream: None });
        ops.push(Op::Free { idx: 2, stream: Some(2) });
        ops.push(Op::Alloc { size: 5000, align: 1, stream: round % 3 });
        ops.push(Op::Alloc { size: 3 << 20, align: 2 << 20, stream: (round + 2) % 3 });
        if round % 3 == 1 {
            ops.push(Op::Trim);
        } else {
            ops.push(Op::Sync);
        }
        for idx in 0..4 {
            ops.push(Op::Free { idx: idx * 3, stream: Some(idx as u8 % 3) });
        }
    }
    ops
}

fn run(expandable: bool, fault: impl FnOnce(&Harness)) -> Harness {
    let mut h = Harness::new(CAPACITY, config(expandable));
    h.allow_errors = true;
    fault(&h);
    for op in sequence() {
        h.apply(&op);
    }
    h
}

/// With expandable segments, the upstream calls that can fail are the chunk mappings.
#[rstest::rstest]
fn upstream_allocation_fails_at_every_call_in_turn(#[values(false, true)] expandable: bool) {
    let run = |fault: &dyn Fn(&Harness)| run(expandable, fault);
    let clean = run(&|_| {});
    let calls = clean.host().allocate_calls();
    assert_eq!(clean.errors, 0);
    assert!(calls >= 8, "the sequence must grow the pool several times ({calls} calls)");
    clean.finish();

    for k in 0..calls {
        // A hard error is returned by the operation that hit it, and by no other.
        let h = run(&|h| h.host().fail_call(k, UpstreamError::Other(42)));
        assert_eq!(h.errors, 1, "Other(42) at call {k}");
        h.finish();

        // An out-of-memory is absorbed: the next upstream call (smaller segment or the ladder's
        // retry) succeeds.
        let h = run(&|h| h.host().fail_call(k, UpstreamError::OutOfMemory));
        assert_eq!(h.errors, 0, "OutOfMemory at call {k}");
        h.finish();
    }
}

#[rstest::rstest]
fn stream_wait_fails_at_every_call_in_turn(#[values(false, true)] expandable: bool) {
    let run = |fault: &dyn Fn(&Harness)| run(expandable, fault);
    let clean = run(&|_| {});
    let waits = clean.clock().wait_calls;
    assert!(waits >= 2, "the sequence must migrate memory between streams ({waits} waits)");
    clean.finish();
    // Every wait here is a migration's (no stream shares an arena), and the upstream has room: a
    // failed one gives way to growth, and the allocation succeeds.
    for k in 0..waits {
        let h = run(&|h| h.clock().fail_wait_call = Some(k));
        assert_eq!(h.errors, 0, "wait failure at call {k}");
        h.finish();
    }
}

#[rstest::rstest]
fn persistent_exhaustion_reports_and_recovers(#[values(false, true)] expandable: bool) {
    let mut h = Harness::new(8 << 20, config(expandable));
    for i in 0..3 {
        h.apply(&Op::Alloc { size: 2 << 20, align: 1, stream: i });
    }
    // 6 MiB live in 4 MiB + 2 x 2 MiB... whatever the layout, a 4 MiB request cannot fit now.
    match h.pool.allocate(4 << 20, 1, 0) {
        Err(e @ PoolError::OutOfMemory { .. }) => {
            let text = e.to_string();
            assert!(text.starts_with("out of memory: requested 4.00 MiB;"), "{text}");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(h.pool.stats().oom_errors, 1);
    h.check();
    // Freeing makes room again: the ladder releases cached segments for the new request.
    h.apply(&Op::Free { idx: 0, stream: None });
    h.apply(&Op::Free { idx: 0, stream: Some(2) });
    h.apply(&Op::Alloc { size: 4 << 20, align: 1, stream: 1 });
    assert_eq!(h.errors, 0);
    h.finish();
}
