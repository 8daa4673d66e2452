//! Which allocations have `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` set, by buffer id.
//!
//! Buffer ids are never reused, so an id left here after its allocation was freed names nothing
//! and needs no cleanup; the set only grows by the allocations a program marks.

use std::collections::HashSet;

use parking_lot::Mutex;

static MARKED: Mutex<Option<HashSet<u64>>> = Mutex::new(None);

/// Records SYNC_MEMOPS for the allocation with `buffer_id`.
pub(crate) fn set(buffer_id: u64, on: bool) {
    let mut marked = MARKED.lock();
    let set = marked.get_or_insert_with(HashSet::new);
    if on {
        set.insert(buffer_id);
    } else {
        set.remove(&buffer_id);
    }
}

/// Whether SYNC_MEMOPS is set for the allocation with `buffer_id`.
pub(crate) fn is_set(buffer_id: u64) -> bool {
    MARKED.lock().as_ref().is_some_and(|s| s.contains(&buffer_id))
}
