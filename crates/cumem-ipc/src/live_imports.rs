//! The imports open in this process, keyed by (context, base), so that one import is never opened
//! twice: the driver answers a second open of a live import in the same context with the same
//! address, and two [`ImportedBuffer`](crate::ImportedBuffer)s with separate stream orders over
//! it would give safe code two exclusive views of the same memory.
//!
//! ```
//! # cumem_sys::testing::init();
//! // `IpcMemHandle::open` claims the import here; a second open of it is `Error::AlreadyMapped`
//! // (see `crates/cumem-ipc/tests/two_processes.rs`).
//! ```

use std::collections::BTreeSet;
use std::sync::Mutex;

use cumem_sys::sys::{CUcontext, CUdeviceptr};

static LIVE: Mutex<BTreeSet<(usize, CUdeviceptr)>> = Mutex::new(BTreeSet::new());

fn live() -> std::sync::MutexGuard<'static, BTreeSet<(usize, CUdeviceptr)>> {
    // The set stays consistent through a panic elsewhere (each change is one insert or remove).
    LIVE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Records the import at `base` in `ctx`; false when it is already live (opened by another
/// [`ImportedBuffer`](crate::ImportedBuffer) that has not been dropped).
pub(crate) fn claim(ctx: CUcontext, base: CUdeviceptr) -> bool {
    live().insert((ctx as usize, base))
}

/// Forgets the import at `base` in `ctx`, before it is closed: the driver counts opens, so an
/// open racing with the close keeps the mapping alive.
pub(crate) fn release(ctx: CUcontext, base: CUdeviceptr) {
    live().remove(&(ctx as usize, base));
}
