//! Which allocations have `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` set, by buffer id.
//!
//! Buffer ids are never reused, so an id left here after its allocation was freed would name
//! nothing, but the set would grow with every marked allocation a long-running program frees:
//! freeing an allocation (`State::forget`, `cuMemHostUnregister`, `cuMemUnmap`) removes its id.

use std::collections::HashSet;

use parking_lot::Mutex;

static MARKED: Mutex<Option<HashSet<u64>>> = Mutex::new(None);

/// Records SYNC_MEMOPS for the allocation with `buffer_id`. The caller holds the state lock and
/// has found the allocation live under it (a mark set after its free would stay for good).
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

/// Forgets the allocation with `buffer_id`, which has been freed.
pub(crate) fn forget(buffer_id: u64) {
    if let Some(set) = MARKED.lock().as_mut() {
        set.remove(&buffer_id);
    }
}

/// How many allocations have SYNC_MEMOPS set.
#[cfg(test)]
fn marked() -> usize {
    MARKED.lock().as_ref().map_or(0, HashSet::len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_allocation_leaves_the_set() {
        // Ids far from any other test's (unit tests share the static).
        let (a, b) = (u64::MAX - 1, u64::MAX - 2);
        set(a, true);
        set(b, true);
        let before = marked();
        forget(a);
        assert!(!is_set(a) && is_set(b));
        assert_eq!(marked(), before - 1);
        forget(b);
        forget(b);
        assert!(!is_set(b));
    }
}
