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
//! Neither an import nor a free holds a lock of cumem's across its driver call. A `cuMemFree` is
//! synchronous (on an H100 a `cuMemFree` of `cuMemAlloc` memory waits while any stream of the
//! context runs a blocked host function, and meanwhile holds up the context's allocations and
//! queued work, driver-api.md §17; for a pool pointer imported in the exporting process it
//! returned at once on an H100, and `cuMemPoolImportPointer` did not wait behind such a free there,
//! docs/observed-on-gpu.md, 2026-11-24; nothing promises either): under a lock, every import and
//! free of the process would wait behind such a call, in any context, on a driver that waits.
//! Instead a drop moves its address from the live set to the freeing set (a tombstone) under the
//! addresses' lock, frees with no lock held, and removes the tombstone under the lock again,
//! counting the free's return and waking the imports that wait for it. An import opens a *window*
//! under the lock before asking the driver (noting how many frees have returned) and closes it
//! under the lock when it claims its answer's address; a free that returns while a window is open
//! is recorded against its address. A record is kept while a window that opened before that return
//! is open: while one import's `cuMemPoolImportPointer` stalls, the records grow by one per
//! distinct address freed meanwhile, and are pruned when it closes (all but those a window still
//! open needs). So every free of an address that overlapped an import's driver call, or ran between
//! the answer and the claim, is seen at the claim: still running (its tombstone) or returned since
//! the window opened (its record). Such an answer cannot be trusted:
//! it is either the mapping that free unmaps (answered before the free: the driver returned it
//! uncounted, so the import owns nothing) or a fresh one that the driver placed at the same address
//! (after the free: the import owns that one). So the import waits, releasing the lock, until that
//! free has returned (where it has not yet), and imports again in a new window. By then the old
//! mapping is gone: the driver answers with its fresh mapping if it made one (again uncounted: the
//! two answers are one mapping, so nothing is freed, and freeing the first would unmap the second),
//! or maps anew; either way the import owns exactly one mapping, whose address it checks again like
//! any other. (Such an answer is retried even where a live import now has the address: that import
//! may have been mapped there after the free, of another allocation.) An answer that no free
//! overlapped is a mapping that stayed mapped from the answer to the claim: at a live import's
//! address it is that import's mapping (two imports in flight may be answered with one mapping, one
//! of them uncounted: the first to claim it owns it), refused and not freed; elsewhere the import
//! claims it, and it stays mapped until that import's drop frees it (cumem frees no address it has
//! not claimed). Only an import that the driver answers with the address of an import being freed
//! waits for that free; every other import and free goes on, as far as cumem's locks go (the driver
//! may hold up calls of the freeing context, above). (Should that second import fail, the first
//! answer is not freed either: it may be the mapping that was just unmapped, whose address may
//! since belong to someone else. At worst one mapping leaks, never one freed twice; the imported
//! pool's later `cuMemPoolDestroy` is then refused (the driver refuses it while pointers imported
//! through the pool are mapped), so the pool's handle leaks too, and the exporter's eventual free
//! meets an import still mapped here, which the driver asks importers not to leave. That is no
//! memory-safety issue for this process: nothing in it wraps that mapping.)
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
static POOL_ADDRESSES: Mutex<AddressTable> = Mutex::new(AddressTable {
    live: BTreeSet::new(),
    freeing: BTreeSet::new(),
    ends: FreeEnds { count: 0, at: BTreeMap::new(), windows: BTreeMap::new() },
});
/// Notified when a tombstone is removed from `POOL_ADDRESSES`.
static FREED: Condvar = Condvar::new();

/// The addresses of this process's pool pointer imports.
struct AddressTable {
    /// Claimed by a live import, which frees it on drop.
    live: BTreeSet<CUdeviceptr>,
    /// Tombstones: taken off `live` by a drop whose `cuMemFree` may not have returned yet.
    freeing: BTreeSet<CUdeviceptr>,
    /// When frees returned, relative to the imports in flight.
    ends: FreeEnds,
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
///
/// No tombstone is kept while the close runs (unlike a pool pointer's free, see the module docs),
/// and none is needed: an open in the import's context that the driver answers with its mapping,
/// through the same bytes or through differing bytes of the same allocation, before the close,
/// holds one more reference (driver-api.md §12 records the count for opening the same handle
/// again; that differing bytes of one allocation count the same is what the simulator does, not
/// yet checked on a GPU: see docs/ipc.md), so the close only
/// takes back the closing import's and the mapping stays with the new one ([`place`] claims it
/// like any other); one answered after the close gets a mapping of its own. An open in another
/// context maps elsewhere, which the close does not touch. The closing import lends no view any
/// more (its drop has `&mut self`), so the two never overlap in safe code. A tombstone would not
/// protect more: were such opens not counted, the refused open in [`place`]'s caller, closed once,
/// would unmap the live import as well, and waiting for the tombstone would accept an answer
/// that the close had unmapped.
pub(crate) fn release(ticket: LegacyTicket) {
    legacy().claims.remove(&ticket.0);
}

fn live_pool_exports() -> MutexGuard<'static, BTreeSet<[u8; POOL_EXPORT_SIZE]>> {
    // As `legacy`: each change is one insert or remove.
    LIVE_POOL_EXPORTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// An import's claim of a pool pointer export's bytes, from before the driver is asked until the
/// import is freed (or was never made): dropping it releases the bytes, on every path out of an
/// import, a panic included. A leaked import forgets it, keeping the bytes claimed for good.
pub(crate) struct PoolExportClaim([u8; POOL_EXPORT_SIZE]);

/// Claims the pool pointer export `raw` (the driver's bytes) for an import; `None` when an import
/// of them is already live in this process (any context, any handle of the imported pool).
pub(crate) fn claim_pool_export(raw: &[u8; POOL_EXPORT_SIZE]) -> Option<PoolExportClaim> {
    // The lock is released before a claim exists: dropping one takes it.
    let claimed = live_pool_exports().insert(*raw);
    if claimed { Some(PoolExportClaim(*raw)) } else { None }
}

impl Drop for PoolExportClaim {
    fn drop(&mut self) {
        live_pool_exports().remove(&self.0);
    }
}

/// Which frees returned while an import's `cuMemPoolImportPointer` was in flight.
struct FreeEnds {
    /// How many pool pointer frees have returned (tombstones removed), ever.
    count: u64,
    /// For an address freed while a window was open: the `count` its last free's return made.
    /// Grows while a window stays open (a stalled import); `close` prunes it.
    at: BTreeMap<CUdeviceptr, u64>,
    /// The open windows: the `count` each saw when it opened, with how many opened at it.
    windows: BTreeMap<u64, usize>,
}

impl FreeEnds {
    /// Opens a window: returns the `count` it starts at.
    fn open(&mut self) -> u64 {
        let opened_at = self.count;
        *self.windows.entry(opened_at).or_default() += 1;
        opened_at
    }

    /// Counts a free of `base` that returned, recorded against `base` while a window is open.
    fn returned(&mut self, base: CUdeviceptr) {
        self.count += 1;
        if !self.windows.is_empty() {
            self.at.insert(base, self.count);
        }
    }

    /// Whether a free of `base` returned since the window that opened at `opened_at` (still open)
    /// did.
    fn freed_since(&self, base: CUdeviceptr, opened_at: u64) -> bool {
        self.at.get(&base).is_some_and(|&end| end > opened_at)
    }

    fn close(&mut self, opened_at: u64) {
        if let Some(n) = self.windows.get_mut(&opened_at) {
            *n -= 1;
            if *n == 0 {
                self.windows.remove(&opened_at);
            }
        }
        // An end at or before the oldest open window's start is no window's concern, nor that of
        // a window opened later (it sees a `count` at least as large).
        match self.windows.keys().next() {
            None => self.at.clear(),
            Some(&oldest) => self.at.retain(|_, end| *end > oldest),
        }
    }
}

fn address_table() -> MutexGuard<'static, AddressTable> {
    // As `legacy`: each change is one insert or remove, or one move between the two sets, or one
    // count with the entries it orders.
    POOL_ADDRESSES.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What an import's address is in this process (see [`ImportWindow::claim`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum AddressClaim {
    /// Claimed for the import: the driver's answer is a mapping that stays until the import frees
    /// it, and no other import of this process is mapped there.
    Claimed,
    /// A live import's address: the driver returned that import's mapping, uncounted. Not to be
    /// freed.
    Live,
    /// A free of this address overlapped the window (ran during the driver's call, or between its
    /// answer and the claim): the answer may be the mapping that free unmapped. Not to be freed;
    /// import again, in a new window. When the free had not returned yet, `claim` waited for it.
    Again,
}

/// An import's `cuMemPoolImportPointer` in flight, between [`open_import_window`] and
/// [`ImportWindow::claim`]: no lock of cumem's is held meanwhile (see the module docs). Dropped
/// without a claim (the driver refused the import), it closes.
pub(crate) struct ImportWindow {
    /// `FreeEnds::count` when it opened.
    opened_at: u64,
}

/// Opens a window for one `cuMemPoolImportPointer`: every pool pointer free that returns from now
/// on until the claim is recorded against the address it freed.
pub(crate) fn open_import_window() -> ImportWindow {
    ImportWindow { opened_at: address_table().ends.open() }
}

impl ImportWindow {
    /// Claims `base`, which the driver answered in this window, unless another import has it or a
    /// free of it overlapped the window. Returns [`AddressClaim::Again`] only once no free of `base`
    /// is running (waiting, with no lock held, for one that is).
    pub(crate) fn claim(self, base: CUdeviceptr) -> AddressClaim {
        let opened_at = self.opened_at;
        std::mem::forget(self);
        let mut table = address_table();
        // Read before the window closes, which may forget the entry.
        let freed_in_window = table.ends.freed_since(base, opened_at);
        table.ends.close(opened_at);
        if table.freeing.contains(&base) {
            #[cfg(test)]
            tests::TOMBSTONE_WAITS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _table = FREED
                .wait_while(table, |table| table.freeing.contains(&base))
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            return AddressClaim::Again;
        }
        // Checked before `live`: a live import at `base` may have been mapped there after the
        // free, of another allocation, while the answer was the unmapped one.
        if freed_in_window {
            #[cfg(test)]
            tests::FREED_IN_WINDOW.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            return AddressClaim::Again;
        }
        if table.live.insert(base) { AddressClaim::Claimed } else { AddressClaim::Live }
    }
}

impl Drop for ImportWindow {
    fn drop(&mut self) {
        address_table().ends.close(self.opened_at);
    }
}

/// An imported pool pointer's address while its `cuMemFree` runs: a tombstone that imports
/// answered with this address wait for. Dropping it (after the free returned, or on a panic)
/// removes the tombstone, records the return for the imports in flight, and wakes the imports
/// waiting.
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
        let mut table = address_table();
        table.freeing.remove(&self.0);
        table.ends.returned(self.0);
        drop(table);
        FREED.notify_all();
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;
    use std::sync::atomic::AtomicUsize;

    use cumem_sys::sys::CUdeviceptr;

    use super::{FreeEnds, address_table, open_import_window, overlap, start_free};

    /// How many times an import has started waiting for a tombstone, so that a test can open the
    /// free it waits for only once it does.
    pub(crate) static TOMBSTONE_WAITS: AtomicUsize = AtomicUsize::new(0);
    /// How many times an import has been answered with an address whose free returned between
    /// the driver's answer (or the call's start) and the claim.
    pub(crate) static FREED_IN_WINDOW: AtomicUsize = AtomicUsize::new(0);

    #[test]
    fn ranges_overlap_only_where_they_share_a_byte() {
        assert!(overlap(&(0..8), &(4..12)));
        assert!(overlap(&(4..5), &(0..8)));
        assert!(!overlap(&(0..4), &(4..8)), "adjacent");
        assert!(!overlap(&(4..4), &(0..8)), "an empty range inside another");
        assert!(!overlap(&(0..8), &(4..4)));
        assert!(!overlap(&(4..4), &(4..4)));
    }

    fn no_ends() -> FreeEnds {
        FreeEnds { count: 0, at: BTreeMap::new(), windows: BTreeMap::new() }
    }

    /// W1 opens; a free of `a` returns; W2 opens after it and closes. W1 must still see that free
    /// (its answer may be the mapping the free unmapped): closing W2 prunes only what no open
    /// window can see.
    #[test]
    fn a_window_sees_a_free_that_returned_in_it_after_a_later_window_closes() {
        let a: CUdeviceptr = 0x1000;
        let mut ends = no_ends();
        let w1 = ends.open();
        assert_eq!(w1, 0);
        ends.returned(a);
        assert_eq!(ends.at.get(&a), Some(&1), "the return is recorded while W1 is open");
        let w2 = ends.open();
        assert_eq!(w2, 1);
        assert!(!ends.freed_since(a, w2), "the free returned before W2 opened");
        ends.close(w2);
        assert!(ends.freed_since(a, w1), "W1 lost the free of {a:#x} that returned in it");
        ends.close(w1);
        assert!(ends.at.is_empty() && ends.windows.is_empty(), "no window open, nothing kept");
    }

    /// A return that only a closed window could see is forgotten when it closes, while a later
    /// window stays open: `at` does not keep it for as long as some window is open.
    #[test]
    fn a_free_no_open_window_can_see_is_pruned() {
        let (a, b): (CUdeviceptr, CUdeviceptr) = (0x1000, 0x2000);
        let mut ends = no_ends();
        let w1 = ends.open();
        ends.returned(a);
        let w2 = ends.open();
        ends.returned(b);
        ends.close(w1);
        assert_eq!(ends.at.keys().copied().collect::<Vec<_>>(), [b], "only W2's concern is kept");
        assert!(ends.freed_since(b, w2));
        ends.close(w2);
        assert!(ends.at.is_empty() && ends.windows.is_empty());
    }

    /// A window dropped without a claim (the driver refused the import) closes: a free that
    /// returned in it is not kept, nor the window.
    #[test]
    #[serial_test::serial]
    fn a_window_dropped_without_a_claim_leaves_nothing_behind() {
        // No import lives at this address: the imports of this binary's tests are on the
        // simulator, which places them elsewhere, and they are `serial` too.
        let a: CUdeviceptr = 0xdead_0000;
        let window = open_import_window();
        drop(start_free(a));
        assert!(address_table().ends.at.contains_key(&a), "the return is recorded while the window is open");
        drop(window);
        let table = address_table();
        assert!(table.ends.windows.is_empty(), "windows left open: {:?}", table.ends.windows);
        assert!(table.ends.at.is_empty(), "returns kept: {:?}", table.ends.at);
        assert!(!table.freeing.contains(&a) && !table.live.contains(&a));
    }
}
