//! Call counting: how many times each exported driver function was entered, per OS thread, so a
//! test can prove that a misuse was caught before any driver call (`Control::calls`).
//!
//! Every call is counted on entry to the call wrapper, before fault injection and `cuInit`
//! checks: a call that fails, or is faulted, still reached the driver.

use std::collections::HashMap;

use parking_lot::Mutex;

/// `(exported symbol, OS thread id) -> calls`.
static COUNTS: Mutex<Option<HashMap<(&'static str, u64), u64>>> = Mutex::new(None);

/// Counts one call of `function` on thread `os_tid`.
pub(crate) fn count(function: &'static str, os_tid: u64) {
    *COUNTS.lock().get_or_insert_with(HashMap::new).entry((function, os_tid)).or_insert(0) += 1;
}

/// Calls of `function` so far: on thread `os_tid`, or on every thread for 0.
pub(crate) fn total(function: &str, os_tid: u64) -> u64 {
    COUNTS.lock().as_ref().map_or(0, |m| {
        m.iter().filter(|((f, t), _)| *f == function && (os_tid == 0 || *t == os_tid)).map(|(_, n)| n).sum()
    })
}
