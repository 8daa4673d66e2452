//! The imports open in this process, so that one import is never opened twice: two
//! [`ImportedBuffer`](crate::ImportedBuffer)s with separate stream orders over the same memory
//! would give safe code two exclusive views of it. Legacy IPC imports are keyed by (context,
//! base): the driver answers a second open of a live import in the same context with the same
//! address. Pool pointer imports are keyed by the export's bytes, which name the pool and the
//! allocation, so that a second import of them is refused before the driver is asked; and by
//! their address too (in any context: an address names one mapping in the process), because the
//! driver answers a second `cuMemPoolImportPointer` of a live import with the same address and
//! does not count it: the first `cuMemFree` unmaps it, the next gives INVALID_VALUE (an H100,
//! 2026-11-23; the simulator does the same). So an import whose address is already claimed here
//! (export bytes that differ but name the same allocation) is refused and never freed: freeing it
//! would unmap the live one, and not freeing it leaks nothing, since it is the same mapping.
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

fn live_pool_addresses() -> std::sync::MutexGuard<'static, BTreeSet<CUdeviceptr>> {
    // As `live`: each change is one insert or remove.
    LIVE_POOL_ADDRESSES.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Records the imported pool pointer at `base`; false when a live import here already has that
/// address (the driver's answer to a second import of the same allocation: the same mapping).
pub(crate) fn claim_pool_address(base: CUdeviceptr) -> bool {
    live_pool_addresses().insert(base)
}

/// Forgets the imported pool pointer at `base`, once it is freed: not before, since imports are
/// not counted and a second import claimed meanwhile would be unmapped by that free.
pub(crate) fn release_pool_address(base: CUdeviceptr) {
    live_pool_addresses().remove(&base);
}
