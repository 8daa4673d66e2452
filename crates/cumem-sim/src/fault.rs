//! Fault injection: rules that make the Nth subsequent call of an exported function fail with a
//! chosen code, optionally only on one OS thread.
//!
//! A faulted call returns before doing anything, so it has no side effects and writes no
//! out-parameter — exactly what a caller's error path must cope with.

use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys::CUresult;
use parking_lot::Mutex;

struct Rule {
    id: u64,
    function: String,
    nth: u64,
    code: CUresult,
    /// 0 = every matching call from the nth on.
    times: u64,
    /// 0 = any thread.
    os_tid: u64,
    seen: u64,
    fired: u64,
}

struct Table {
    next_id: u64,
    rules: Vec<Rule>,
}

static TABLE: Mutex<Table> = Mutex::new(Table { next_id: 1, rules: Vec::new() });

/// The number of rules in `TABLE`, updated under its lock: every exported call checks it, and
/// with no rules (the usual case) need not take the lock.
static RULES: AtomicUsize = AtomicUsize::new(0);

/// Adds a rule and returns its id (never 0).
pub(crate) fn add(function: String, nth: u64, code: CUresult, times: u64, os_tid: u64) -> u64 {
    let mut t = TABLE.lock();
    let id = t.next_id;
    t.next_id += 1;
    t.rules.push(Rule { id, function, nth: nth.max(1), code, times, os_tid, seen: 0, fired: 0 });
    RULES.store(t.rules.len(), Ordering::Release);
    id
}

/// Removes one rule (unknown ids are ignored).
pub(crate) fn remove(id: u64) {
    let mut t = TABLE.lock();
    t.rules.retain(|r| r.id != id);
    RULES.store(t.rules.len(), Ordering::Release);
}

/// Removes every rule.
pub(crate) fn clear() {
    TABLE.lock().rules.clear();
    RULES.store(0, Ordering::Release);
}

/// Counts this call against every matching rule and returns the code to fail with, if any.
pub(crate) fn check(function: &str, os_tid: u64) -> Option<CUresult> {
    if RULES.load(Ordering::Acquire) == 0 {
        return None;
    }
    let mut t = TABLE.lock();
    if t.rules.is_empty() {
        return None;
    }
    let mut result = None;
    for r in t.rules.iter_mut() {
        if r.function != function || (r.os_tid != 0 && r.os_tid != os_tid) {
            continue;
        }
        r.seen += 1;
        if r.seen >= r.nth && (r.times == 0 || r.fired < r.times) {
            r.fired += 1;
            result.get_or_insert(r.code);
        }
    }
    result
}
