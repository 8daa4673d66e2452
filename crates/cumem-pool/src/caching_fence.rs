//! An asymmetric fence: nearly free for a thread cache's owner, costly for the rare remote flush.
//!
//! A thread cache is used by its owner on every allocation and free and by another thread only when
//! the pool flushes it (trim, the out-of-memory ladder, a sweep). The two sides agree through
//! Dekker's pattern: the owner stores "busy" and then loads "revoked", the flusher stores "revoked"
//! and then loads "busy"; each side needs a store→load fence between the two so that at least one
//! sees the other. [`light`] is the owner's fence and [`heavy`] the flusher's. Where Linux offers
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (kernel 4.14 and later), [`heavy`] makes every
//! running thread of the process execute a full barrier, so [`light`] only has to stop the compiler
//! from reordering: the owner's fast path then has no atomic read-modify-write and no fence
//! instruction at all. Elsewhere (other systems, a kernel or sandbox without the call) both sides
//! use a sequentially consistent fence, which is correct and costs one fence per operation.
//!
//! The mode is chosen once, by [`init`], which every pool calls when it is created; the fast path
//! only loads a byte that was written before the pool could be shared. Under Miri, and when the
//! environment variable `CUMEM_POOL_THREAD_CACHE_FENCES` is `1` at the first pool's creation, the
//! fence mode is used even where `membarrier` exists (Miri models no system call; the variable lets
//! the tests run the portable mode on Linux).
//!
//! ```text
//! owner (every operation)            flusher (trim, ladder, sweep)
//! busy = true                        revoked = true
//! light()                            heavy()            // false: skip this flush
//! if revoked { busy = false; slow }  while busy { spin }
//! ... use the cache ...              ... drain the cache ...
//! busy = false                       revoked = false
//! ```

use std::sync::Once;
use std::sync::atomic::{AtomicU8, Ordering, compiler_fence, fence};

/// Not decided yet: both sides fence (correct in every mode).
const UNDECIDED: u8 = 0;
/// `membarrier` is registered: the owner needs only a compiler fence.
const MEMBARRIER: u8 = 1;
/// No `membarrier`: both sides use a `SeqCst` fence.
const FENCES: u8 = 2;

/// Set to `1`: fences on both sides even where `membarrier` exists.
const FORCE_FENCES: &str = "CUMEM_POOL_THREAD_CACHE_FENCES";

static MODE: AtomicU8 = AtomicU8::new(UNDECIDED);
static INIT: Once = Once::new();

/// Chooses the mode (once per process). Call it before a thread cache is shared between threads.
pub(crate) fn init() {
    let mut chosen = None;
    INIT.call_once(|| {
        let forced = cfg!(miri) || std::env::var_os(FORCE_FENCES).is_some_and(|v| v == "1");
        let mode = if !forced && register_membarrier() { MEMBARRIER } else { FENCES };
        MODE.store(mode, Ordering::Release);
        chosen = Some(mode);
    });
    // Logged once the `Once` is complete: a subscriber that makes a pool on this event (one that
    // allocates, or looks the current pool up) calls `init` again, which would wait for itself
    // inside `call_once`.
    if let Some(mode) = chosen {
        tracing::debug!(membarrier = mode == MEMBARRIER, "thread-cache fence mode");
    }
}

/// The owner's store→load fence (see the module documentation).
#[inline(always)]
pub(crate) fn light() {
    if MODE.load(Ordering::Relaxed) == MEMBARRIER {
        compiler_fence(Ordering::SeqCst);
    } else {
        fence(Ordering::SeqCst);
    }
}

/// The flusher's store→load fence: orders this thread's earlier stores before its later loads and
/// forces a full barrier on every thread of the process that uses [`light`]. `false` when the
/// barrier could not be made (a registered `membarrier` failed, which the kernel does not do): the
/// flusher must then leave the caches alone, since an owner may be inside unseen, and call
/// [`warn_unfenced`] once it has let go of its locks.
#[must_use]
pub(crate) fn heavy() -> bool {
    fence(Ordering::SeqCst);
    if barrier_failed() {
        return false;
    }
    fence(Ordering::SeqCst);
    true
}

/// Logs a [`heavy`] that failed. Not logged by `heavy` itself: its callers hold the registry's
/// lock, which a subscriber reading the pool's statistics would wait for.
#[cold]
pub(crate) fn warn_unfenced() {
    tracing::warn!("membarrier failed after registration; thread caches not flushed");
}

fn barrier_failed() -> bool {
    #[cfg(test)]
    if tests::BARRIER_FAILS.get() {
        return true;
    }
    MODE.load(Ordering::Acquire) == MEMBARRIER && !expedited_barrier()
}

/// Whether [`init`] chose the `membarrier` mode.
#[cfg(test)]
fn uses_membarrier() -> bool {
    MODE.load(Ordering::Acquire) == MEMBARRIER
}

#[cfg(all(target_os = "linux", not(miri)))]
mod sys {
    /// `MEMBARRIER_CMD_PRIVATE_EXPEDITED` from `linux/membarrier.h`.
    const PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    /// `MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED`.
    const REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;
    /// `MEMBARRIER_CMD_QUERY`.
    const QUERY: libc::c_long = 0;

    fn membarrier(cmd: libc::c_long) -> libc::c_long {
        // SAFETY: `membarrier(cmd, flags = 0)` reads and writes no user memory; an unsupported
        // command (or a sandbox that filters the call) returns -1 with errno set.
        unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_long) }
    }

    pub(super) fn register() -> bool {
        let supported = membarrier(QUERY);
        supported >= 0
            && supported & PRIVATE_EXPEDITED != 0
            && supported & REGISTER_PRIVATE_EXPEDITED != 0
            && membarrier(REGISTER_PRIVATE_EXPEDITED) == 0
    }

    pub(super) fn barrier() -> bool {
        membarrier(PRIVATE_EXPEDITED) == 0
    }
}

#[cfg(all(target_os = "linux", not(miri)))]
fn register_membarrier() -> bool {
    sys::register()
}

#[cfg(all(target_os = "linux", not(miri)))]
fn expedited_barrier() -> bool {
    sys::barrier()
}

#[cfg(any(not(target_os = "linux"), miri))]
fn register_membarrier() -> bool {
    false
}

#[cfg(any(not(target_os = "linux"), miri))]
fn expedited_barrier() -> bool {
    true
}

#[cfg(test)]
pub(crate) mod tests {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicBool, AtomicU64};

    use super::*;

    thread_local! {
        /// Makes this thread's [`heavy`] fail, as a registered `membarrier` that failed would.
        pub(crate) static BARRIER_FAILS: Cell<bool> = const { Cell::new(false) };
    }

    /// Sets the stop flag when dropped, so a side that panics stops the other instead of leaving
    /// it spinning (the scope then re-raises the panic: the test fails rather than hangs).
    struct StopOnDrop<'a>(&'a AtomicBool);

    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }

    /// Dekker's pattern under the asymmetric fence: the owner and the flusher never both enter.
    #[test]
    fn owner_and_flusher_exclude_each_other() {
        init();
        let (busy, revoked) = (AtomicBool::new(false), AtomicBool::new(false));
        let (inside, entered) = (AtomicU64::new(0), AtomicU64::new(0));
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let _stop = StopOnDrop(&stop);
                while !stop.load(Ordering::Relaxed) {
                    busy.store(true, Ordering::Relaxed);
                    light();
                    if !revoked.load(Ordering::Acquire) {
                        assert_eq!(inside.fetch_add(1, Ordering::Relaxed), 0, "owner met the flusher");
                        inside.fetch_sub(1, Ordering::Relaxed);
                        entered.fetch_add(1, Ordering::Relaxed);
                    }
                    busy.store(false, Ordering::Release);
                }
            });
            let _stop = StopOnDrop(&stop);
            // Until both sides went through often (the owner thread may start late), or the owner
            // stopped (it panicked: the scope reports it).
            let mut rounds = 0;
            while (rounds < 2000 || entered.load(Ordering::Relaxed) < 2000) && !stop.load(Ordering::Relaxed) {
                rounds += 1;
                revoked.store(true, Ordering::Relaxed);
                assert!(heavy());
                while busy.load(Ordering::Acquire) && !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
                assert_eq!(inside.fetch_add(1, Ordering::Relaxed), 0, "flusher met the owner");
                inside.fetch_sub(1, Ordering::Relaxed);
                revoked.store(false, Ordering::Release);
            }
        });
        assert!(entered.load(Ordering::Relaxed) >= 2000);
        // The mode the tests asked for is the one in use (the CI runs the caches in both).
        let forced = std::env::var_os(FORCE_FENCES).is_some_and(|v| v == "1");
        if forced || cfg!(miri) {
            assert!(!uses_membarrier());
        }
    }
}
