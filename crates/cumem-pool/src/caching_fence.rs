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
//! only loads a byte that was written before the pool could be shared.
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

static MODE: AtomicU8 = AtomicU8::new(UNDECIDED);
static INIT: Once = Once::new();

/// Chooses the mode (once per process). Call it before a thread cache is shared between threads.
pub(crate) fn init() {
    INIT.call_once(|| {
        let mode = if register_membarrier() { MEMBARRIER } else { FENCES };
        tracing::debug!(membarrier = mode == MEMBARRIER, "thread-cache fence mode");
        MODE.store(mode, Ordering::Release);
    });
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
/// flusher must then leave the caches alone, since an owner may be inside unseen.
#[must_use]
pub(crate) fn heavy() -> bool {
    fence(Ordering::SeqCst);
    if MODE.load(Ordering::Acquire) == MEMBARRIER && !expedited_barrier() {
        tracing::warn!("membarrier failed after registration; thread caches not flushed");
        return false;
    }
    fence(Ordering::SeqCst);
    true
}

#[cfg(target_os = "linux")]
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

#[cfg(target_os = "linux")]
fn register_membarrier() -> bool {
    sys::register()
}

#[cfg(target_os = "linux")]
fn expedited_barrier() -> bool {
    sys::barrier()
}

#[cfg(not(target_os = "linux"))]
fn register_membarrier() -> bool {
    false
}

#[cfg(not(target_os = "linux"))]
fn expedited_barrier() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU64};

    use super::*;

    /// Dekker's pattern under the asymmetric fence: the owner and the flusher never both enter.
    #[test]
    fn owner_and_flusher_exclude_each_other() {
        init();
        let (busy, revoked) = (AtomicBool::new(false), AtomicBool::new(false));
        let (inside, entered) = (AtomicU64::new(0), AtomicU64::new(0));
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
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
            // Until both sides went through often (the owner thread may start late).
            let mut rounds = 0;
            while rounds < 2000 || entered.load(Ordering::Relaxed) < 2000 {
                rounds += 1;
                revoked.store(true, Ordering::Relaxed);
                assert!(heavy());
                while busy.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
                assert_eq!(inside.fetch_add(1, Ordering::Relaxed), 0, "flusher met the owner");
                inside.fetch_sub(1, Ordering::Relaxed);
                revoked.store(false, Ordering::Release);
            }
            stop.store(true, Ordering::Relaxed);
        });
        assert!(entered.load(Ordering::Relaxed) > 0);
    }
}
