//! The violation log: every misuse the simulator detected (bad pointers, out-of-range copies,
//! double frees, calls without a context, stale handles…), kept in call order.
//!
//! Tests read it through [`crate::control::Control::violations`]; because test binaries run tests
//! on parallel threads, each entry carries the OS thread id of the offending call.
//!
//! Most entries are recorded when a call fails. A use after free is detected only when the queued
//! operation runs: its entry names the call that enqueued the operation and that call's thread,
//! with code `CUDA_SUCCESS` (what the call returned).

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// One detected misuse of the driver API.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// The exported function that was called (e.g. `cuMemcpyHtoD_v2`); for a use after free, the
    /// one that enqueued the offending operation.
    pub function: String,
    /// The `CUresult` the call returned, as an integer (0 for a use after free detected later).
    pub code: u32,
    /// The `CUresult` enumerator name (e.g. `CUDA_ERROR_INVALID_VALUE`).
    pub code_name: String,
    /// What was wrong, in words.
    pub message: String,
    /// The OS thread id (`gettid`) of the calling thread.
    pub os_tid: u64,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} -> {} ({}) on tid {}: {}",
            self.function, self.code_name, self.code, self.os_tid, self.message
        )
    }
}

/// The log itself; bounded so a runaway loop cannot exhaust memory.
pub(crate) static LOG: Mutex<Vec<Violation>> = Mutex::new(Vec::new());

const MAX_ENTRIES: usize = 100_000;

/// Appends one entry (dropping it once the log is full).
pub(crate) fn record(v: Violation) {
    let mut log = LOG.lock();
    if log.len() < MAX_ENTRIES {
        log.push(v);
    }
}

/// The log as a JSON array.
pub(crate) fn to_json() -> String {
    serde_json::to_string(&*LOG.lock()).unwrap_or_else(|_| "[]".to_string())
}

/// Empties the log.
pub(crate) fn clear() {
    LOG.lock().clear();
}
