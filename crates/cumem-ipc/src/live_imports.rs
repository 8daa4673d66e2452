//! The imports open in this process, so that no memory is opened twice: two
//! [`ImportedBuffer`](crate::ImportedBuffer)s with separate stream orders over the same bytes
//! would give safe code two exclusive views of them.
//!
//! Legacy IPC imports are claimed by the handle's 64 driver bytes and the range of the exported
//! allocation the buffer covers, across all contexts: the driver lets one context per device open
//! a handle, so with a primary context per device a stream on device 0 and one on device 1 could
//! otherwise both open it, as two mappings of the same memory. Only overlapping ranges are
//! refused, so that two buffers of one allocation (blocks of one caching-pool segment) import
//! together: each open is counted by the driver (a second open in the same context returns the
//! live mapping's address and one more reference, driver-api.md §12; the simulator counts the
//! same) and each [`ImportedBuffer`](crate::ImportedBuffer) closes its own. The claim also keeps
//! the address the driver mapped, so that bytes which differ but name the same allocation, opened
//! in the same context, are caught there (the driver returns the live mapping) and the refused
//! open is closed once, leaving the live one mapped. Differing bytes opened in *another* context
//! map elsewhere and cannot be recognised here: safety item 3 of
//! [`IpcMemHandle::open`](crate::IpcMemHandle::open).
//!
//! Pool pointer imports are keyed by the export's bytes, which name the pool and the
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
//! An import claims its address under the addresses' lock, held across its
//! `cuMemPoolImportPointer`, so that no other import or free comes between the driver's answer and
//! the claim. A free does not hold that lock across its `cuMemFree`, which is synchronous (on an
//! H100 a `cuMemFree` of `cuMemAlloc` memory waits while any stream of the context runs a blocked
//! host function, driver-api.md §17; for an imported pool pointer that is not on record): every
//! import and free of the process would wait behind it, in any context.
//! Instead the drop moves its address from the live set to the freeing set (a tombstone) under
//! the lock, frees with no lock of cumem's held, and removes the tombstone under the lock again,
//! waking the imports that wait for it. An import that the driver answers with an address being
//! freed cannot tell which mapping it got: the one about to be unmapped (before the free: the
//! driver returned it uncounted, so it owns nothing) or a fresh one that the driver happened to
//! place at the same address (after the free: it owns that one). So it waits, releasing the lock,
//! until that tombstone is gone, and imports again. By then the old mapping is gone: the driver
//! answers with its fresh mapping if it made one (again uncounted: the two answers are one mapping,
//! so nothing is freed, and freeing the first would unmap the second), or maps anew; either way the
//! import owns exactly one mapping, whose address it checks again like any other. Only an import
//! that gets the address of an import being freed waits for that free; every other import and
//! free goes on. (Should that second import fail, the first answer is not freed either: it may be
//! the mapping that was just unmapped, whose address may since belong to someone else; at worst one
//! mapping leaks, never one freed twice.)
//!
//! Lock order: the addresses' lock and the exports' lock are never held together (each is
//! released before the other is taken); the legacy table's lock is independent of both. A drop
//! releases its export's bytes only after its address's tombstone is gone, so an import of the
//! same bytes is refused (`AlreadyMapped`) until the drop has returned, as before it started.
//!
//! ```
//! # cumem_sys::testing::init();
//! // `IpcMemHandle::open` claims its range of the allocation here; a second open of an
//! // overlapping, non-empty range of the same bytes, in any context, is `Error::AlreadyMapped`
//! // (see `crates/cumem-ipc/tests/two_processes.rs`).
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard};

use cumem_sys::sys::CUdeviceptr;

use crate::ffi::{HANDLE_SIZE, POOL_EXPORT_SIZE};

/// One live legacy import.
struct LegacyClaim {
    /// The driver's handle bytes.
    handle: [u8; HANDLE_SIZE],
    /// The bytes of the exported allocation the buffer covers.
    range: Range<u64>,
    /// Where the driver mapped the allocation here; `None` while the open is in flight.
    base: Option<CUdeviceptr>,
}

struct LegacyTable {
    next: u64,
    claims: BTreeMap<u64, LegacyClaim>,
}

static LEGACY: Mutex<LegacyTable> = Mutex::new(LegacyTable { next: 1, claims: BTreeMap::new() });
static LIVE_POOL_EXPORTS: Mutex<BTreeSet<[u8; POOL_EXPORT_SIZE]>> = Mutex::new(BTreeSet::new());
static POOL_ADDRESSES: Mutex<AddressTable> =
    Mutex::new(AddressTable { live: BTreeSet::new(), freeing: BTreeSet::new() });
/// Notified when a tombstone is removed from `POOL_ADDRESSES`.
static FREED: Condvar = Condvar::new();

/// The addresses of this process's pool pointer imports.
struct AddressTable {
    /// Claimed by a live import, which frees it on drop.
    live: BTreeSet<CUdeviceptr>,
    /// Tombstones: taken off `live` by a drop whose `cuMemFree` may not have returned yet.
    freeing: BTreeSet<CUdeviceptr>,
}

fn legacy() -> std::sync::MutexGuard<'static, LegacyTable> {
    // The table stays consistent through a panic elsewhere (each change is one insert, update or
    // remove).
    LEGACY.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Whether `a` and `b` share a byte (an empty range shares none).
fn overlap(a: &Range<u64>, b: &Range<u64>) -> bool {
    !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
}

/// A live legacy import's claim, released when its [`ImportedBuffer`](crate::ImportedBuffer)
/// closes the import (kept for good when the import is leaked, so it is not opened again).
/// Not `Copy`: released once, by value.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct LegacyTicket(u64);

/// Claims `range` of the allocation `handle` names, before the driver is asked; `None` when a
/// live import of the same bytes (in any context) covers part of it.
pub(crate) fn claim_handle(handle: &[u8; HANDLE_SIZE], range: Range<u64>) -> Option<LegacyTicket> {
    let mut table = legacy();
    if table.claims.values().any(|c| &c.handle == handle && overlap(&c.range, &range)) {
        return None;
    }
    let id = table.next;
    table.next += 1;
    table.claims.insert(id, LegacyClaim { handle: *handle, range, base: None });
    Some(LegacyTicket(id))
}

/// Records that the driver mapped `ticket`'s open at `base`. False, and the claim forgotten, when
/// a live import mapped at `base` through other bytes covers part of its range: the driver
/// answered an open of that import's allocation, in its context, with its mapping.
pub(crate) fn place(ticket: &LegacyTicket, base: CUdeviceptr) -> bool {
    let mut table = legacy();
    let Some(range) = table.claims.get(&ticket.0).map(|c| c.range.clone()) else {
        return false;
    };
    let clash = table
        .claims
        .iter()
        .any(|(&id, c)| id != ticket.0 && c.base == Some(base) && overlap(&c.range, &range));
    if clash {
        table.claims.remove(&ticket.0);
        return false;
    }
    if let Some(claim) = table.claims.get_mut(&ticket.0) {
        claim.base = Some(base);
    }
    true
}

/// Forgets `ticket`'s import, before it is closed: the driver counts opens, so an open racing with
/// the close keeps the mapping alive.
pub(crate) fn release(ticket: LegacyTicket) {
    legacy().claims.remove(&ticket.0);
}

fn live_pool_exports() -> MutexGuard<'static, BTreeSet<[u8; POOL_EXPORT_SIZE]>> {
    // As `legacy`: each change is one insert or remove.
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

fn address_table() -> MutexGuard<'static, AddressTable> {
    // As `legacy`: each change is one insert or remove, or one move between the two sets.
    POOL_ADDRESSES.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What an import's address is in this process (see [`PoolAddresses::claim`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum AddressClaim {
    /// Claimed for the import: no other import of this process is mapped there.
    Claimed,
    /// A live import's address: the driver returned that import's mapping, uncounted. Not to be
    /// freed.
    Live,
    /// The address of an import being freed: wait with [`PoolAddresses::wait_freed`] and import
    /// again. Not to be freed (it may be the mapping about to be unmapped).
    Freeing,
}

/// The addresses' lock, held by an import across `cuMemPoolImportPointer` and the claim of the
/// address it gets (see the module docs).
pub(crate) struct PoolAddresses(MutexGuard<'static, AddressTable>);

/// Takes the addresses' lock. Not to be held while the exports' lock is taken.
pub(crate) fn pool_addresses() -> PoolAddresses {
    PoolAddresses(address_table())
}

impl PoolAddresses {
    /// Claims `base`, which the driver just returned for an import, unless another import has it.
    pub(crate) fn claim(&mut self, base: CUdeviceptr) -> AddressClaim {
        if self.0.freeing.contains(&base) {
            AddressClaim::Freeing
        } else if self.0.live.insert(base) {
            AddressClaim::Claimed
        } else {
            AddressClaim::Live
        }
    }

    /// Waits, the lock released meanwhile, until `base` is no longer being freed.
    pub(crate) fn wait_freed(self, base: CUdeviceptr) -> PoolAddresses {
        #[cfg(test)]
        tests::TOMBSTONE_WAITS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let table = FREED
            .wait_while(self.0, |table| table.freeing.contains(&base))
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        PoolAddresses(table)
    }
}

/// An imported pool pointer's address while its `cuMemFree` runs: a tombstone that imports
/// answered with this address wait for. Dropping it (after the free returned, or on a panic)
/// removes the tombstone and wakes them.
pub(crate) struct FreeingAddress(CUdeviceptr);

/// Moves `base` from the live addresses to the freeing ones, before its `cuMemFree`; the lock is
/// released on return, so the free runs without it.
pub(crate) fn start_free(base: CUdeviceptr) -> FreeingAddress {
    let mut table = address_table();
    table.live.remove(&base);
    table.freeing.insert(base);
    FreeingAddress(base)
}

impl Drop for FreeingAddress {
    fn drop(&mut self) {
        address_table().freeing.remove(&self.0);
        FREED.notify_all();
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::overlap;

    /// How many times an import has started waiting for a tombstone, so that a test can open the
    /// free it waits for only once it does.
    pub(crate) static TOMBSTONE_WAITS: AtomicUsize = AtomicUsize::new(0);

    #[test]
    fn ranges_overlap_only_where_they_share_a_byte() {
        assert!(overlap(&(0..8), &(4..12)));
        assert!(overlap(&(4..5), &(0..8)));
        assert!(!overlap(&(0..4), &(4..8)), "adjacent");
        assert!(!overlap(&(4..4), &(0..8)), "an empty range inside another");
        assert!(!overlap(&(0..8), &(4..4)));
        assert!(!overlap(&(4..4), &(4..4)));
    }
}
