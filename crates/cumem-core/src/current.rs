//! The current resource of each device: what every constructor without `_in` allocates from.
//!
//! As RMM's `set_current_device_resource` and PyTorch's and CuPy's caching allocators do, cumem
//! keeps one resource per device that `DeviceBuffer::new`, `zeroed`, `from_slice` and the other
//! constructors without `_in` use. It is chosen on the device's first allocation:
//! - with `cumem-pool` linked (the `cumem` facade links it), the caching pool over `cuMemAlloc`;
//! - with `cumem-core` alone, [`DriverResource`] (`cuMemAlloc`/`cuMemFree`), since the pools
//!   live in a crate above this one;
//! - the environment variable `CUMEM_ALLOCATOR` = `caching`, `native` (the device's default
//!   driver pool) or `driver` overrides that choice; it is read once, on first use.
//!
//! [`set_current_resource`] replaces a device's resource and [`scoped_current_resource`] replaces
//! it until a guard drops (for tests). Buffers allocated earlier keep the resource they came from
//! (each holds its own `Arc`), and return their memory to it when they drop, whatever is current
//! by then.
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DeviceBuffer, DriverResource, Stream};
//! let device = Device::get(0)?;
//! let stream = Stream::new(&device.context()?)?;
//! let before = DeviceBuffer::<u32>::zeroed(&stream, 256)?; // the device's current resource
//! {
//!     let driver = Arc::new(DriverResource::new(&device.context()?));
//!     let _scope = cumem_core::scoped_current_resource(&device, driver.clone())?;
//!     let buf = DeviceBuffer::<u32>::zeroed(&stream, 256)?;
//!     assert!(std::ptr::addr_eq(Arc::as_ptr(buf.resource()), Arc::as_ptr(&driver)));
//! } // the previous resource is current again
//! assert!(Arc::ptr_eq(&cumem_core::current_resource(&device)?, before.resource()));
//! # Ok::<(), cumem_core::Error>(())
//! ```
//!
//! At process exit the registry lets go of the current resources, and of the resources that live
//! scoped overrides would restore (an exit inside a [`scoped_current_resource`] scope, or with a
//! forgotten guard), so that a caching pool nothing else holds returns its cached memory to the
//! driver: leak checkers (the simulator's, compute-sanitizer's) then see only the memory the
//! program itself still holds. The exit waits for that at most 2 seconds in all, the registry's
//! locks included (device work that never finishes must not hang it); past that the memory is left
//! to the driver, and the release goes on beside the rest of the exit. From then on the registry
//! keeps nothing, since nothing would release it: an allocation without `_in` (from a later exit
//! handler, or a thread still running) gets a default resource of its own, released with its
//! buffer, and [`set_current_resource`] and [`scoped_current_resource`] install nothing.

use std::cell::RefCell;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Once, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use crate::{Context, Device, DeviceResource, DriverResource, Error, Result};

/// The environment variable that chooses the default resource: `caching`, `native` or `driver`.
pub const ALLOCATOR_ENV: &str = "CUMEM_ALLOCATOR";

/// The kinds of default resource a device can get.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllocatorKind {
    /// cumem's caching pool over `cuMemAlloc` (`cumem-pool`'s `CachingResource`).
    Caching,
    /// The device's default driver pool, `cuMemAllocFromPoolAsync`/`cuMemFreeAsync`
    /// (`cumem-pool`'s `NativePoolResource`); `cuMemAlloc` on devices without pools.
    Native,
    /// `cuMemAlloc`/`cuMemFree` ([`DriverResource`]).
    Driver,
}

impl AllocatorKind {
    /// The value `CUMEM_ALLOCATOR` takes for this kind.
    pub fn as_str(self) -> &'static str {
        match self {
            AllocatorKind::Caching => "caching",
            AllocatorKind::Native => "native",
            AllocatorKind::Driver => "driver",
        }
    }
}

impl fmt::Display for AllocatorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AllocatorKind {
    type Err = Error;

    /// `caching`, `native` or `driver`, in any case; anything else is `InvalidValue`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "caching" => Ok(AllocatorKind::Caching),
            "native" => Ok(AllocatorKind::Native),
            "driver" => Ok(AllocatorKind::Driver),
            _ => Err(Error::InvalidValue {
                ctx: crate::ErrorContext::op("CUMEM_ALLOCATOR: expected caching, native or driver"),
            }),
        }
    }
}

/// Makes a device's default resource of a kind; `cumem-pool` installs one for `Caching` and
/// `Native` (see [`install_default_factory`]). It must not call back into this registry.
pub type DefaultResourceFactory = fn(AllocatorKind, &Context) -> Result<Arc<dyn DeviceResource>>;

static FACTORY: OnceLock<DefaultResourceFactory> = OnceLock::new();

/// Installs the factory that makes `caching` and `native` default resources. `cumem-pool` calls
/// this before `main`; the first factory installed stays (`false` if one was already there).
/// Without one, every device's default is [`DriverResource`].
pub fn install_default_factory(factory: DefaultResourceFactory) -> bool {
    FACTORY.set(factory).is_ok()
}

/// The kind of resource a device gets on first use: `CUMEM_ALLOCATOR` if set (read once, on the
/// first call), otherwise the caching pool where `cumem-pool` is linked and the driver where not.
/// An unknown value is logged as a warning and the default is used.
pub fn default_allocator() -> AllocatorKind {
    static KIND: OnceLock<AllocatorKind> = OnceLock::new();
    if let Some(kind) = KIND.get() {
        return *kind;
    }
    let fallback = if FACTORY.get().is_some() { AllocatorKind::Caching } else { AllocatorKind::Driver };
    let (kind, bad) = match std::env::var(ALLOCATOR_ENV) {
        Ok(value) => match value.parse() {
            Ok(kind) => (kind, None),
            Err(_) => (fallback, Some(format!("{value:?}"))),
        },
        Err(std::env::VarError::NotPresent) => (fallback, None),
        Err(std::env::VarError::NotUnicode(value)) => (fallback, Some(format!("{value:?}"))),
    };
    let mut first = false;
    let kind = *KIND.get_or_init(|| {
        first = true;
        kind
    });
    // Logged after the kind is stored, not inside `get_or_init`: a subscriber that allocates
    // calls back in here, and a reentrant `get_or_init` would wait for itself.
    if let (true, Some(value)) = (first, bad) {
        tracing::warn!(%value, default = %fallback, "unknown CUMEM_ALLOCATOR (expected caching, native or driver, in UTF-8); using the default");
    }
    kind
}

fn make_default(ctx: &Context) -> Result<Arc<dyn DeviceResource>> {
    let kind = default_allocator();
    if kind == AllocatorKind::Driver {
        return Ok(Arc::new(DriverResource::new(ctx)));
    }
    match FACTORY.get() {
        Some(factory) => factory(kind, ctx),
        None => {
            // Not a `Once`: a subscriber that allocates calls back in here from the warning, and
            // a reentrant `call_once` would wait for itself.
            static WARNED: AtomicBool = AtomicBool::new(false);
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(%kind, "CUMEM_ALLOCATOR names a pool, but cumem-pool is not linked; using cuMemAlloc");
            }
            Ok(Arc::new(DriverResource::new(ctx)))
        }
    }
}

/// Per device ordinal: the current resource, `None` until first use or after a reset.
type Slots = Vec<Option<Arc<dyn DeviceResource>>>;

static CURRENT: RwLock<Slots> = RwLock::new(Vec::new());

/// Set by the exit handler under `CURRENT`'s write lock, once it has let go of the registry's
/// resources: a resource installed after that would be kept for good (no handler runs again), so
/// nothing is installed any more (read under the write lock, so no install slips in after the
/// handler emptied the slots).
static EXITED: AtomicBool = AtomicBool::new(false);

/// Bumped under `CURRENT`'s write lock by every change of a slot, so that a thread's cached
/// lookup ([`LAST`]) knows it may be stale: a lookup needs no lock while nothing changed.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// What a lookup found for one device.
struct LastLookup {
    /// [`GENERATION`] when it was found (read under `CURRENT`'s lock).
    generation: u64,
    /// The device's ordinal (`usize::MAX`: nothing looked up yet).
    device: usize,
    /// The resource, weakly: a thread's cache must not keep a resource alive once it is replaced
    /// or released (its cached memory would stay reserved, and reported as leaked at exit).
    resource: Option<Weak<dyn DeviceResource>>,
}

thread_local! {
    /// The calling thread's last lookup of a current resource: the default path looks the
    /// resource up on every allocation, and a lock's two read-modify-writes cost more than
    /// checking a generation (the weak handle's upgrade is the one read-modify-write left, the
    /// same as cloning the `Arc`).
    static LAST: RefCell<LastLookup> =
        const { RefCell::new(LastLookup { generation: 0, device: usize::MAX, resource: None }) };
}

/// Takes `CURRENT` for a change: every change goes through here, so cached lookups see it.
fn change_slots() -> parking_lot::RwLockWriteGuard<'static, Slots> {
    let slots = CURRENT.write();
    // Bumped before the change is made, under the lock: a lookup that reads the new generation
    // and then the slots (under the read lock) sees the change, and one that read the old
    // generation before it is ordered before the change (it returns the resource current then).
    GENERATION.fetch_add(1, Ordering::Release);
    slots
}

/// The cached lookup of device `i`, if nothing changed since it was made.
fn cached(i: usize) -> Option<Arc<dyn DeviceResource>> {
    let generation = GENERATION.load(Ordering::Acquire);
    LAST.try_with(|last| {
        let last = last.borrow();
        if last.generation == generation && last.device == i {
            last.resource.as_ref().and_then(Weak::upgrade)
        } else {
            None
        }
    })
    .ok()
    .flatten()
}

/// Remembers a lookup of device `i` made under `CURRENT`'s lock (so `GENERATION` is that of
/// `resource`).
fn remember(i: usize, resource: &Arc<dyn DeviceResource>) {
    let generation = GENERATION.load(Ordering::Acquire);
    // A thread whose locals are being destroyed looks up without the cache.
    let _ = LAST.try_with(|last| {
        if let Ok(mut last) = last.try_borrow_mut() {
            *last = LastLookup { generation, device: i, resource: Some(Arc::downgrade(resource)) };
        }
    });
}

/// Puts `resource` in slot `i`, returning what was there. A caller that installs a resource has
/// called [`release_at_exit`] before taking the lock (it may log).
fn replace(
    slots: &mut Slots,
    i: usize,
    resource: Option<Arc<dyn DeviceResource>>,
) -> Option<Arc<dyn DeviceResource>> {
    if slots.len() <= i {
        slots.resize(i + 1, None);
    }
    std::mem::replace(&mut slots[i], resource)
}

/// The current resource of `ctx`'s device, made on first use.
pub(crate) fn current_for(ctx: &Context) -> Result<Arc<dyn DeviceResource>> {
    let i = ctx.device().ordinal();
    if let Some(resource) = cached(i) {
        return Ok(resource);
    }
    {
        let slots = CURRENT.read();
        if let Some(Some(resource)) = slots.get(i) {
            remember(i, resource);
            return Ok(resource.clone());
        }
    }
    // Made before the lock is taken: choosing the kind and making the resource may log (and run
    // the installed factory), and a subscriber that looks a resource up would otherwise wait for
    // the lock its own thread holds. Two threads' first allocations may both make one; the first
    // installed is the one both use, so they still share one pool.
    default_allocator();
    let made = match make_default(ctx) {
        Ok(made) => made,
        // Another thread may have installed one meanwhile (a `set_current_resource`, or a first
        // use whose factory succeeded): that one serves this allocation too.
        Err(e) => return CURRENT.read().get(i).cloned().flatten().ok_or(e),
    };
    release_at_exit();
    let mut slots = change_slots();
    if let Some(Some(installed)) = slots.get(i) {
        let installed = installed.clone();
        drop(slots);
        // Dropped outside the lock: a pool's drop may wait for streams, or log.
        drop(made);
        return Ok(installed);
    }
    if EXITED.load(Ordering::Acquire) {
        // The exit handler has run: kept here, the resource (and a pool's cached memory) would
        // never be released. This allocation's buffer holds it, and releases it when it drops.
        drop(slots);
        return Ok(made);
    }
    replace(&mut slots, i, Some(made.clone()));
    Ok(made)
}

/// The resource that `device`'s constructors without `_in` allocate from (made on first use: see
/// [`default_allocator`]).
pub fn current_resource(device: &Device) -> Result<Arc<dyn DeviceResource>> {
    current_for(&device.context()?)
}

fn check_device<R: DeviceResource + ?Sized>(device: &Device, resource: &R) -> Result<()> {
    let actual = resource.context().device();
    if actual != *device {
        return Err(Error::WrongDevice {
            expected: device.ordinal() as i32,
            actual: actual.ordinal() as i32,
        });
    }
    Ok(())
}

/// Makes `resource` the current resource of `device` and returns the previous one (`None` if the
/// device had not allocated through its default yet). A resource of another device is
/// `WrongDevice`. Buffers already allocated keep their own resource. Once the process is exiting
/// (the registry's exit handler has run: see the module docs), nothing is installed and the
/// answer is `None`.
pub fn set_current_resource<R>(device: &Device, resource: Arc<R>) -> Result<Option<Arc<dyn DeviceResource>>>
where
    R: DeviceResource + ?Sized + 'static,
{
    check_device(device, &*resource)?;
    let resource = resource.into_dyn_resource();
    release_at_exit();
    let mut slots = change_slots();
    if EXITED.load(Ordering::Acquire) {
        drop(slots);
        // Dropped outside the lock: a pool's drop may wait for streams.
        drop(resource);
        return Ok(None);
    }
    *epoch(&mut EPOCHS.lock(), device.ordinal()) += 1;
    let previous = replace(&mut slots, device.ordinal(), Some(resource));
    Ok(previous)
}

/// Makes `resource` current on `device` until the returned guard drops (also when a panic unwinds
/// through it), then restores the previous one. Meant for tests; the resource is process-wide,
/// so tests that override it must not run beside tests that allocate on the same device (mark
/// them `#[serial]`).
///
/// Overrides of one device nest like a stack, whatever order their guards drop in: a guard dropped
/// while a later override of the device is still alive changes nothing current, and when the
/// later override was made directly on top of it, the later one restores what was current before
/// both when it drops. A change made by other means ([`set_current_resource`],
/// [`reset_current_resources`]) stands whichever order the guards drop in, even one that makes an
/// earlier override's own resource current again: a guard restores nothing when its resource is no
/// longer current, and an override made after such a change restores that change, never what an
/// earlier override replaced.
///
/// Once the process is exiting (the registry's exit handler has run), nothing is installed, and
/// the guard restores nothing.
pub fn scoped_current_resource<R>(device: &Device, resource: Arc<R>) -> Result<CurrentResourceGuard>
where
    R: DeviceResource + ?Sized + 'static,
{
    check_device(device, &*resource)?;
    let resource = resource.into_dyn_resource();
    let installed = Arc::downgrade(&resource);
    let id = NEXT_SCOPE.fetch_add(1, Ordering::Relaxed);
    release_at_exit();
    // The scopes' lock first, then the slots' (as the guard's drop takes them).
    let mut scopes = SCOPES.lock();
    let mut slots = change_slots();
    if EXITED.load(Ordering::Acquire) {
        drop((slots, scopes));
        // Dropped outside the locks; the guard's id is in no scope, and its drop does nothing.
        drop(resource);
        return Ok(CurrentResourceGuard { device: *device, id });
    }
    let epoch = *epoch(&mut EPOCHS.lock(), device.ordinal());
    let previous = replace(&mut slots, device.ordinal(), Some(resource));
    scopes.push(Scope { id, device: device.ordinal(), installed, previous, epoch });
    Ok(CurrentResourceGuard { device: *device, id })
}

/// A live scoped override, in the order made.
struct Scope {
    /// The guard's id.
    id: u64,
    device: usize,
    /// The resource the override made current (weak: the slot holds it while it is current).
    installed: Weak<dyn DeviceResource>,
    /// What to make current again when this override ends on top of its device's stack.
    previous: Option<Arc<dyn DeviceResource>>,
    /// The device's [`EPOCHS`] entry when the override was made.
    epoch: u64,
}

/// Every live scoped override, oldest first.
static SCOPES: parking_lot::Mutex<Vec<Scope>> = parking_lot::Mutex::new(Vec::new());

static NEXT_SCOPE: AtomicU64 = AtomicU64::new(0);

/// Per device ordinal: how many changes other than overrides ([`set_current_resource`],
/// [`reset_current_resources`]) it has seen. An override made on top of another one has the same
/// epoch; one made after such a change has not, even when the change made the earlier override's
/// very resource current again. Locked under `CURRENT`'s write lock only.
static EPOCHS: parking_lot::Mutex<Vec<u64>> = parking_lot::Mutex::new(Vec::new());

/// Device `i`'s entry of [`EPOCHS`].
fn epoch(epochs: &mut Vec<u64>, i: usize) -> &mut u64 {
    if epochs.len() <= i {
        epochs.resize(i + 1, 0);
    }
    &mut epochs[i]
}

/// Lets go of every device's current resource: each device makes a fresh default on its next
/// allocation. Buffers still alive keep their resources alive; a pool nothing else holds returns
/// its memory to the driver now. Returns how many resources were let go.
pub fn reset_current_resources() -> usize {
    let mut slots = change_slots();
    // Every device a live override was made on has an entry (made with the override).
    EPOCHS.lock().iter_mut().for_each(|e| *e += 1);
    let taken: Slots = std::mem::take(&mut *slots);
    drop(slots);
    // Dropped outside the lock: a pool's drop may wait for streams.
    taken.into_iter().flatten().count()
}

/// Restores a device's previous current resource when dropped; see [`scoped_current_resource`].
#[must_use = "the previous resource is restored when the guard drops"]
pub struct CurrentResourceGuard {
    device: Device,
    /// Its entry in [`SCOPES`].
    id: u64,
}

impl fmt::Debug for CurrentResourceGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CurrentResourceGuard").field("device", &self.device.ordinal()).finish()
    }
}

impl Drop for CurrentResourceGuard {
    fn drop(&mut self) {
        let mut scopes = SCOPES.lock();
        let Some(at) = scopes.iter().position(|s| s.id == self.id) else {
            // Logged after the lock is let go: a subscriber may look a resource up.
            drop(scopes);
            if EXITED.load(Ordering::Acquire) {
                // Made after the exit handler ran (so never recorded): nothing to undo.
                return;
            }
            tracing::warn!(device = self.device.ordinal(), "a scoped resource override was already undone");
            return;
        };
        let mut ended = scopes.remove(at);
        // Resources are dropped after the locks are let go: a pool's drop may wait for streams.
        let released = match scopes[at..].iter_mut().find(|s| s.device == ended.device) {
            // A later override of the device is still alive. If it was made on top of this one, it
            // restores, when it ends, what was current before this one; if something else replaced
            // this override before the later one was made, that change stands and what this one
            // would have restored is let go. The epoch tells the two apart when the change made
            // this override's own resource current again.
            Some(later) => {
                let on_top = later.epoch == ended.epoch
                    && later
                        .previous
                        .as_ref()
                        .is_some_and(|p| std::ptr::addr_eq(Arc::as_ptr(p), ended.installed.as_ptr()));
                if on_top {
                    std::mem::replace(&mut later.previous, ended.previous.take())
                } else {
                    ended.previous.take()
                }
            }
            // No later override: restore unless something other than an override changed the
            // device meanwhile; the epoch tells when that change made this override's own
            // resource current again (the pointer alone cannot).
            None => {
                let mut slots = change_slots();
                let unchanged = *epoch(&mut EPOCHS.lock(), ended.device) == ended.epoch;
                let current = slots.get(ended.device).and_then(Option::as_ref);
                if unchanged
                    && current.is_some_and(|c| std::ptr::addr_eq(Arc::as_ptr(c), ended.installed.as_ptr()))
                {
                    replace(&mut slots, ended.device, ended.previous.take())
                } else {
                    // Replaced meanwhile by something other than an override: that change stands.
                    ended.previous.take()
                }
            }
        };
        drop(scopes);
        drop(released);
    }
}

/// How long the exit handler waits, in all, for the registry's lock and for the current resources
/// to return their memory.
const EXIT_WAIT: Duration = Duration::from_secs(2);

/// Registers, once, the exit handler that lets go of the current resources.
fn release_at_exit() {
    static REGISTERED: Once = Once::new();
    let mut failed = false;
    REGISTERED.call_once(|| {
        // SAFETY: `at_exit` is a plain `extern "C" fn()` of this crate, which is linked into the
        // program for its whole life; it never unwinds (it catches panics).
        failed = unsafe { libc::atexit(at_exit) } != 0;
    });
    // Logged outside `call_once`: a subscriber that allocates calls back in here, and a
    // reentrant `call_once` would wait for itself.
    if failed {
        tracing::warn!("registering the exit handler failed; cached memory stays reserved until exit");
    }
}

/// Drops the registry's resources at exit, after `main`, before the driver's own teardown (the
/// driver is loaded after `main` starts, so its handlers run after this one): the current ones,
/// and those the live scoped overrides would restore (the overrides stay recorded, restoring
/// nothing). From then on nothing is installed ([`EXITED`]).
///
/// The drops run on a thread of their own: by the time exit handlers run, the exiting thread's
/// thread-locals are gone, and a driver may keep per-thread state (the current context) in them.
/// The exit waits for that thread at most [`EXIT_WAIT`]; after that it goes on and the thread is
/// not stopped: it may still be waiting for the device, or returning memory (`cuMemFree`), while
/// later exit handlers and the driver's own teardown run. Its driver calls then fail (each failure
/// is logged, never a panic) or the process ends under it; either way the driver reclaims the
/// memory at process end, as it does for anything else not returned.
extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(|| {
        // One deadline for the locks and the release, so the exit waits at most EXIT_WAIT in all.
        let deadline = Instant::now() + EXIT_WAIT;
        // The scopes' lock first, then the slots' (the order overrides take them). A thread that
        // exits the process while holding a lock must not hang the exit.
        let mut scopes = SCOPES.try_lock_until(deadline);
        let Some(mut slots) = CURRENT.try_write_until(deadline) else {
            drop(scopes);
            tracing::warn!("the current resources are locked at exit; their cached memory is not returned");
            return;
        };
        GENERATION.fetch_add(1, Ordering::Release);
        EXITED.store(true, Ordering::Release);
        let mut taken = std::mem::take(&mut *slots);
        drop(slots);
        let scopes_locked = scopes.is_some();
        if let Some(scopes) = &mut scopes {
            taken.extend(scopes.iter_mut().map(|scope| scope.previous.take()));
        }
        drop(scopes);
        if !scopes_locked {
            tracing::warn!(
                "the scoped resource overrides are locked at exit; what they would restore is not returned"
            );
        }
        if taken.iter().all(Option::is_none) {
            return;
        }
        // Returning cached memory waits for the streams that used it; work that never finishes (a
        // hung kernel, a host function waiting for a thread that is gone) must not keep the
        // process from exiting, so the wait is bounded and the memory is left to the driver's
        // teardown after it.
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let spawned = std::thread::Builder::new().name("cumem-exit".into()).spawn(move || {
            drop(taken);
            let _ = done_tx.send(());
        });
        match spawned {
            Ok(_) => {
                if done_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_err() {
                    tracing::warn!(
                        wait_s = EXIT_WAIT.as_secs(),
                        "device work still pending at exit; the current resources' cached memory is left to the driver"
                    );
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "no thread to release the current resources at exit; their cached memory is not returned")
            }
        }
    });
}
