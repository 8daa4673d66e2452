//! Call counting: how many times each exported driver function was entered, per OS thread, so a
//! test can prove that a misuse was caught before any driver call (`Control::calls`).
//!
//! Every call is counted on entry to the call wrapper, before fault injection and `cuInit`
//! checks: a call that fails, or is faulted, still reached the driver.
//!
//! Counting must not cost more than the thread-local read that a real driver's cheapest calls
//! (`cuCtxGetCurrent`) are: a process-wide lock taken by every call of every thread made each
//! call pay two atomic read-modify-writes and a hash of the name, and made threads that only query
//! their own state contend. So each thread counts in counters only it writes, found by the address
//! of the name (the literal each exported function passes); the process-wide list is locked only
//! the first time a thread calls a function, and by [`total`]. The call wrapper keeps the counters
//! it used last in its own thread-local ([`counter`] hands out `'static` references), so a call
//! of a recently used function skips even this thread's table.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// One thread's calls of one function. Written by that thread only (a load and a store, no
/// read-modify-write), read by anyone. Never freed: [`COUNTERS`] lists every one for the life of
/// the process anyway, and a `'static` reference can be cached without a lifetime to track.
pub(crate) type Counter = &'static AtomicU64;

/// Every counter made: (exported symbol, OS thread id, calls). A thread whose id the OS reuses
/// after another one exited gets counters of its own, so that each has one writer forever;
/// [`total`] adds them up.
static COUNTERS: Mutex<Vec<(&'static str, u64, Counter)>> = Mutex::new(Vec::new());

/// A name by its address and length (a literal that is a prefix of another may share its
/// address).
#[derive(Clone, Copy, PartialEq, Eq)]
struct NameKey(usize, usize);

impl std::hash::Hash for NameKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_usize(self.0 ^ self.1.rotate_left(48));
    }
}

/// Spreads a [`NameKey`]'s one word over all 64 bits: addresses are already distinct keys, so
/// SipHash's work is not needed.
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (self.0.rotate_left(5) ^ n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

thread_local! {
    /// The calling thread's counters by the address and length of the name passed.
    static MINE: RefCell<HashMap<NameKey, Counter, BuildHasherDefault<AddressHasher>>> =
        RefCell::new(HashMap::default());
}

/// A new counter of `function` on `os_tid`, listed for [`total`].
fn register(function: &'static str, os_tid: u64) -> Counter {
    let counter: Counter = Box::leak(Box::default());
    COUNTERS.lock().push((function, os_tid, counter));
    counter
}

/// The calling thread's counter of `function` (`os_tid`: the calling thread's id). Only the
/// calling thread may [`bump`] it.
pub(crate) fn counter(function: &'static str, os_tid: u64) -> Counter {
    let key = NameKey(function.as_ptr() as usize, function.len());
    MINE.try_with(|mine| *mine.borrow_mut().entry(key).or_insert_with(|| register(function, os_tid)))
        // The thread is exiting and its table is gone (a destructor calling the driver): a
        // counter of its own, as a new thread would get.
        .unwrap_or_else(|_| register(function, os_tid))
}

/// Counts one call in a counter of the calling thread's (see [`counter`]): its only writer.
#[inline]
pub(crate) fn bump(counter: Counter) {
    counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
}

/// Counts one call of `function` on thread `os_tid` (the calling thread).
#[cfg(test)]
fn count(function: &'static str, os_tid: u64) {
    bump(counter(function, os_tid));
}

/// Calls of `function` so far: on thread `os_tid`, or on every thread for 0.
pub(crate) fn total(function: &str, os_tid: u64) -> u64 {
    COUNTERS
        .lock()
        .iter()
        .filter(|(f, t, _)| *f == function && (os_tid == 0 || *t == os_tid))
        .map(|(_, _, n)| n.load(Ordering::Relaxed))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_thread_and_in_total() {
        let name: &'static str = "cumemSimTestOnlyCall";
        let me = crate::api::os_tid();
        count(name, me);
        count(name, me);
        let other = std::thread::spawn(move || {
            let tid = crate::api::os_tid();
            count(name, tid);
            tid
        })
        .join()
        .unwrap();
        assert_eq!(total(name, me), 2);
        assert_eq!(total(name, other), 1);
        assert_eq!(total(name, 0), 3);
        assert_eq!(total("cumemSimNeverCalled", 0), 0);
    }

    #[test]
    fn the_same_name_at_another_address_counts_together() {
        // Two literals with the same text may live at two addresses: both count as one function.
        let a: &'static str = "cumemSimTestTwin";
        let b: &'static str = Box::leak(String::from("cumemSimTestTwin").into_boxed_str());
        let me = crate::api::os_tid();
        count(a, me);
        count(b, me);
        assert_eq!(total("cumemSimTestTwin", me), 2);
    }
}
