//! The imports open in this process, so that one import is never opened twice: two
//! [`ImportedBuffer`](crate::ImportedBuffer)s with separate stream orders over the same memory
//! would give safe code two exclusive views of it. Legacy IPC imports are keyed by (context,
//! base): the driver answers a second open of a live import in the same context with the same
//! address. Pool pointer imports are keyed by the export's bytes, which name the pool and the
//! allocation, so that a second import of them is refused before the driver is asked; and by
//! their address too (in any context: an address names one mapping in the process), because the
//! driver answers a second `cuMemPoolImportPointer` of a live import with the same address and
//! does not count it: the first `cuMemFree` unmaps it, the next gives INVALID_VALUE (an H100,
//! 2026-11-23; the simulator does the same). On the same H100 (2026-11-23, second run), exporting
//! one pointer twice gave identical bytes; an import in a second context while the first lived
//! gave the same address; and export bytes with their last byte flipped imported with SUCCESS at
//! the live import's address: bytes that differ can name the same allocation. So an import whose
//! address is already claimed here is refused and never freed: freeing it would unmap the live
//! one, and not freeing it leaks nothing, since it is the same mapping.
//!
//! ```
//! # cumem_sys::testing::init();
//! // `IpcMemHandle::open` claims the import here; a second open of it is `Error::AlreadyMapped`
//! // (see `crates/cumem-ipc/tests/two_processes.rs`).
//! ```

use std::collections::BTreeSet;
use std::sync::Mutex;

use cumem_sys::sys::{CUcontext, CUdeviceptr};

use crate::ffi::POOL_EXPORT_SIZE;

static LIVE: Mutex<BTreeSet<(usize, CUdeviceptr)>> = Mutex::new(BTreeSet::new());
static LIVE_POOL_EXPORTS: Mutex<BTreeSet<[u8; POOL_EXPORT_SIZE]>> = Mutex::new(BTreeSet::new());
static LIVE_POOL_ADDRESSES: Mutex<BTreeSet<CUdeviceptr>> = Mutex::new(BTreeSet::new());

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

fn live_pool_exports() -> std::sync::MutexGuard<'static, BTreeSet<[u8; POOL_EXPORT_SIZE]>> {
    // As `live`: each change is one insert or remove.
    LIVE_POOL_EXPORTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Records an import of the pool pointer export `raw` (the driver's bytes); false when one is
/// already live in this process (any context, any handle of the imported pool).
pub(crate) fn claim_pool_export(raw: &[u8; POOL_EXPORT_SIZE]) -> bool {
    live_pool_exports().insert(*raw)
}

/// Forgets the import of `raw`, once it is freed (or was never made).
pub(crate) fn release_pool_export(raw: &[u8; POOL_EXPORT_SIZE]) {
    live_pool_exports().remove(raw);
}

/// The addresses of the live pool pointer imports in this process. An import claims its address
/// and a free releases it under this guard, held across the driver's `cuMemPoolImportPointer` and
/// `cuMemFree`: otherwise an import could get an address between another import's free and its
/// release (and be refused, leaving a new mapping behind), or between another's import and its
/// claim (and wrap that mapping as its own). Taken before the exports' lock, never after it.
pub(crate) fn pool_addresses() -> std::sync::MutexGuard<'static, BTreeSet<CUdeviceptr>> {
    // As `live`: each change is one insert or remove.
    LIVE_POOL_ADDRESSES.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
