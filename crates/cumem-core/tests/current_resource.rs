//! The current resource of a device, in a program that links only `cumem-core` (issue 8, item 1):
//! the default is the driver, `set_current_resource` and the scoped override change what
//! constructors without `_in` use, and buffers keep the resource they came from.
//!
//! The current resource is process-wide, so every test here is `#[serial]`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cumem_core::{
    AllocLayout, AllocatorKind, Context, Device, DeviceBuffer, DeviceResource, DriverResource, Error, Stream,
};
use cumem_sys::testing;
use serial_test::serial;

fn device() -> Device {
    testing::init();
    Device::get(0).unwrap()
}

/// Counts live allocations, to see which resource a buffer allocated from and returned to.
#[derive(Debug)]
struct Counting {
    inner: DriverResource,
    live: AtomicUsize,
    total: AtomicUsize,
}

impl Counting {
    fn new(ctx: &Context) -> Arc<Counting> {
        Arc::new(Counting {
            inner: DriverResource::new(ctx),
            live: AtomicUsize::new(0),
            total: AtomicUsize::new(0),
        })
    }
    fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }
    fn total(&self) -> usize {
        self.total.load(Ordering::SeqCst)
    }
}

// SAFETY: forwards to the driver resource, which upholds the contract.
unsafe impl DeviceResource for Counting {
    fn context(&self) -> &Context {
        self.inner.context()
    }
    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> cumem_core::Result<cumem_core::Allocation> {
        let p = self.inner.allocate(layout, stream)?;
        self.live.fetch_add(1, Ordering::SeqCst);
        self.total.fetch_add(1, Ordering::SeqCst);
        Ok(p)
    }
    unsafe fn deallocate(&self, allocation: cumem_core::Allocation, layout: AllocLayout, stream: &Stream) {
        self.live.fetch_sub(1, Ordering::SeqCst);
        // SAFETY: forwarded unchanged from our caller.
        unsafe { self.inner.deallocate(allocation, layout, stream) }
    }
}

fn is_current(device: &Device, resource: &Arc<Counting>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(&cumem_core::current_resource(device).unwrap()), Arc::as_ptr(resource))
}

#[test]
#[serial]
fn without_the_pools_the_default_is_the_driver() {
    let device = device();
    if std::env::var_os(cumem_core::ALLOCATOR_ENV).is_none() {
        assert_eq!(cumem_core::default_allocator(), AllocatorKind::Driver);
    }
    let current = cumem_core::current_resource(&device).unwrap();
    assert!((*current).as_any().is::<DriverResource>(), "{current:?}");
    assert_eq!(current.context(), &device.context().unwrap());
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    let buf = DeviceBuffer::from_slice(&stream, &[7u32; 100]).unwrap();
    assert!(Arc::ptr_eq(buf.resource(), &current));
    assert_eq!(buf.to_vec().unwrap(), [7; 100]);
}

#[test]
#[serial]
fn set_current_resource_changes_what_new_buffers_use_and_old_ones_keep_theirs() {
    let device = device();
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    let first = Counting::new(stream.context());
    let second = Counting::new(stream.context());
    let before = cumem_core::set_current_resource(&device, first.clone()).unwrap();
    assert!(is_current(&device, &first));

    let a = DeviceBuffer::<u64>::from_slice(&stream, &[1, 2, 3]).unwrap();
    let b = DeviceBuffer::<u8>::zeroed_aligned(&stream, 1000, 4096).unwrap();
    assert_eq!((first.live(), b.device_ptr() % 4096), (2, 0));

    let previous = cumem_core::set_current_resource(&device, second.clone()).unwrap().unwrap();
    assert!(std::ptr::addr_eq(Arc::as_ptr(&previous), Arc::as_ptr(&first)));
    let c = DeviceBuffer::<u64>::new(&stream, 10).unwrap();
    assert_eq!((first.live(), second.live()), (2, 1));

    // The replaced resource is no longer current, but its buffers still work and return to it.
    assert_eq!(a.to_vec().unwrap(), [1, 2, 3]);
    assert_eq!(b.to_vec().unwrap(), vec![0; 1000]);
    drop(previous);
    drop((a, b));
    assert_eq!((first.live(), first.total()), (0, 2));
    drop(c);
    assert_eq!((second.live(), second.total()), (0, 1));

    match before {
        Some(before) => drop(cumem_core::set_current_resource(&device, before).unwrap()),
        None => drop(cumem_core::reset_current_resources()),
    }
    assert!(!is_current(&device, &second));
}

#[test]
#[serial]
fn a_change_made_on_another_thread_is_seen_at_once_and_no_lookup_keeps_the_replaced_resource() {
    let device = device();
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    let first = Counting::new(stream.context());
    let second = Counting::new(stream.context());
    let before = cumem_core::set_current_resource(&device, first.clone()).unwrap();
    // This thread looks `first` up (and may remember the lookup).
    drop(DeviceBuffer::<u8>::zeroed(&stream, 16).unwrap());
    assert_eq!(first.total(), 1);
    std::thread::scope(|s| {
        s.spawn(|| drop(cumem_core::set_current_resource(&device, second.clone()).unwrap()));
    });
    drop(DeviceBuffer::<u8>::zeroed(&stream, 16).unwrap());
    assert_eq!((first.total(), second.total()), (1, 1), "the change was not seen");
    assert_eq!(Arc::strong_count(&first), 1, "something still holds the replaced resource");
    match before {
        Some(before) => drop(cumem_core::set_current_resource(&device, before).unwrap()),
        None => drop(cumem_core::reset_current_resources()),
    }
    assert_eq!(Arc::strong_count(&second), 1, "something still holds the released resource");
}

#[test]
#[serial]
fn a_scoped_override_is_undone_when_its_guard_drops_even_in_a_panic() {
    let device = device();
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    let outer = cumem_core::current_resource(&device).unwrap();
    let scoped = Counting::new(stream.context());
    {
        let _guard = cumem_core::scoped_current_resource(&device, scoped.clone()).unwrap();
        assert!(is_current(&device, &scoped));
        drop(DeviceBuffer::<u8>::zeroed(&stream, 64).unwrap());
        assert_eq!((scoped.total(), scoped.live()), (1, 0));
    }
    assert!(Arc::ptr_eq(&cumem_core::current_resource(&device).unwrap(), &outer));

    let panicked = std::panic::catch_unwind(|| {
        let _guard = cumem_core::scoped_current_resource(&device, scoped.clone()).unwrap();
        assert!(is_current(&device, &scoped));
        panic!("a failing test");
    });
    assert!(panicked.is_err());
    assert!(Arc::ptr_eq(&cumem_core::current_resource(&device).unwrap(), &outer));
    assert_eq!(Arc::strong_count(&scoped), 1, "the registry let go of the scoped resource");
}

#[test]
#[serial]
fn scoped_overrides_dropped_out_of_order_restore_what_was_current_before_both() {
    let device = device();
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    let outer = cumem_core::current_resource(&device).unwrap();
    let (a, b) = (Counting::new(stream.context()), Counting::new(stream.context()));
    let first = cumem_core::scoped_current_resource(&device, a.clone()).unwrap();
    let second = cumem_core::scoped_current_resource(&device, b.clone()).unwrap();
    // The inner override stays current while it lives, whichever scope ends first.
    drop(first);
    assert!(is_current(&device, &b));
    drop(second);
    assert!(Arc::ptr_eq(&cumem_core::current_resource(&device).unwrap(), &outer));
    assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (1, 1), "the registry let go of both");
}

/// Override A, `set_current_resource(X)`, override B: X stands whichever guard drops first (the
/// reviewer's first example; dropping A first used to hand B what was current before A).
#[test]
#[serial]
fn a_change_between_two_overrides_stands_whichever_guard_drops_first() {
    let device = device();
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    let outer = cumem_core::current_resource(&device).unwrap();
    for a_first in [false, true] {
        let (a, x, b) = (
            Counting::new(stream.context()),
            Counting::new(stream.context()),
            Counting::new(stream.context()),
        );
        let guard_a = cumem_core::scoped_current_resource(&device, a.clone()).unwrap();
        drop(cumem_core::set_current_resource(&device, x.clone()).unwrap());
        let guard_b = cumem_core::scoped_current_resource(&device, b.clone()).unwrap();
        if a_first {
            drop(guard_a);
            assert!(is_current(&device, &b));
            drop(guard_b);
        } else {
            drop(guard_b);
            assert!(is_current(&device, &x));
            drop(guard_a);
        }
        assert!(is_current(&device, &x), "a_first = {a_first}: the change between the overrides was undone");
        drop(cumem_core::set_current_resource(&device, outer.clone()).unwrap());
        assert_eq!((Arc::strong_count(&a), Arc::strong_count(&x), Arc::strong_count(&b)), (1, 1, 1));
    }
}

/// Override A of R, `set_current_resource(X)`, `set_current_resource(R)`, override B: B was made
/// after a change, not on top of A, though A's resource is current again. Dropping A then B leaves
/// R current, as `set_current_resource` made it (B used to restore what was current before A).
#[test]
#[serial]
fn an_override_made_after_a_change_back_to_an_earlier_overrides_resource_restores_that_change() {
    let device = device();
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    let outer = cumem_core::current_resource(&device).unwrap();
    let (r, x, s) =
        (Counting::new(stream.context()), Counting::new(stream.context()), Counting::new(stream.context()));
    let guard_a = cumem_core::scoped_current_resource(&device, r.clone()).unwrap();
    drop(cumem_core::set_current_resource(&device, x.clone()).unwrap());
    drop(cumem_core::set_current_resource(&device, r.clone()).unwrap());
    let guard_b = cumem_core::scoped_current_resource(&device, s.clone()).unwrap();
    drop(guard_a);
    assert!(is_current(&device, &s));
    drop(guard_b);
    assert!(is_current(&device, &r), "the change back to R was undone");
    drop(cumem_core::set_current_resource(&device, outer.clone()).unwrap());
    assert_eq!((Arc::strong_count(&r), Arc::strong_count(&x), Arc::strong_count(&s)), (1, 1, 1));
}

/// Override A of R, then `set_current_resource(R)` again (directly, or by way of X): with no later
/// override alive, dropping A leaves R current, as `set_current_resource` made it; the guard used
/// to find its own resource current and restore what was current before it.
#[test]
#[serial]
fn a_guard_does_not_undo_a_change_back_to_its_own_resource() {
    let device = device();
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    let outer = cumem_core::current_resource(&device).unwrap();
    for through_x in [false, true] {
        let (r, x) = (Counting::new(stream.context()), Counting::new(stream.context()));
        let guard = cumem_core::scoped_current_resource(&device, r.clone()).unwrap();
        if through_x {
            drop(cumem_core::set_current_resource(&device, x.clone()).unwrap());
        }
        drop(cumem_core::set_current_resource(&device, r.clone()).unwrap());
        drop(guard);
        assert!(is_current(&device, &r), "through_x = {through_x}: the change back to R was undone");
        drop(cumem_core::set_current_resource(&device, outer.clone()).unwrap());
        assert_eq!((Arc::strong_count(&r), Arc::strong_count(&x)), (1, 1));
    }
}

/// Overrides A and B, `reset_current_resources()`, override C: after all three guards drop, in
/// either of two orders, no resource is current (the reviewer's second example; dropping B, C, A
/// used to bring back what was current before A).
#[test]
#[serial]
fn a_reset_between_overrides_stands_whichever_guards_drop_first() {
    let device = device();
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    let outer = cumem_core::current_resource(&device).unwrap();
    for b_first in [true, false] {
        let counting = || Counting::new(stream.context());
        let (a, b, c) = (counting(), counting(), counting());
        let guard_a = cumem_core::scoped_current_resource(&device, a.clone()).unwrap();
        let guard_b = cumem_core::scoped_current_resource(&device, b.clone()).unwrap();
        cumem_core::reset_current_resources();
        let guard_c = cumem_core::scoped_current_resource(&device, c.clone()).unwrap();
        if b_first {
            drop(guard_b);
            drop(guard_c);
            drop(guard_a);
        } else {
            drop(guard_a);
            drop(guard_c);
            drop(guard_b);
        }
        assert_eq!(Arc::strong_count(&outer), 1, "b_first = {b_first}: the resource from before A came back");
        assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b), Arc::strong_count(&c)), (1, 1, 1));
        let fresh = cumem_core::current_resource(&device).unwrap();
        assert!((*fresh).as_any().is::<DriverResource>(), "{fresh:?}");
        assert!(!Arc::ptr_eq(&fresh, &outer));
        drop(cumem_core::set_current_resource(&device, outer.clone()).unwrap());
    }
}

#[test]
#[serial]
fn a_scoped_override_replaced_meanwhile_leaves_the_replacement_current() {
    let device = device();
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    let before = cumem_core::current_resource(&device).unwrap();
    let (scoped, set) = (Counting::new(stream.context()), Counting::new(stream.context()));
    let guard = cumem_core::scoped_current_resource(&device, scoped.clone()).unwrap();
    drop(cumem_core::set_current_resource(&device, set.clone()).unwrap());
    drop(guard);
    assert!(is_current(&device, &set), "the guard undid a change it did not make");
    drop(cumem_core::set_current_resource(&device, before).unwrap());
    assert_eq!((Arc::strong_count(&scoped), Arc::strong_count(&set)), (1, 1));
}

#[test]
#[serial]
fn a_resource_of_another_device_is_wrong_device_and_changes_nothing() {
    let device = device();
    if !testing::needs_devices(2) {
        return;
    }
    let before = cumem_core::current_resource(&device).unwrap();
    let other = Counting::new(&Device::get(1).unwrap().context().unwrap());
    assert!(matches!(
        cumem_core::set_current_resource(&device, other.clone()),
        Err(Error::WrongDevice { expected: 0, actual: 1 })
    ));
    assert!(matches!(
        cumem_core::scoped_current_resource(&device, other.clone()).map(drop),
        Err(Error::WrongDevice { expected: 0, actual: 1 })
    ));
    assert!(Arc::ptr_eq(&cumem_core::current_resource(&device).unwrap(), &before));
    // Through `_in`, with the concrete `Arc` as it is.
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    assert!(matches!(
        DeviceBuffer::<u8>::zeroed_in(&other, &stream, 8),
        Err(Error::WrongDevice { expected: 1, actual: 0 })
    ));
    assert_eq!(other.total(), 0);
}

#[test]
#[serial]
fn reset_lets_go_of_every_current_resource_and_the_next_use_makes_a_fresh_one() {
    let device = device();
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    let counting = Counting::new(stream.context());
    drop(cumem_core::set_current_resource(&device, counting.clone()).unwrap());
    let buf = DeviceBuffer::<u32>::zeroed(&stream, 16).unwrap();
    assert!(cumem_core::reset_current_resources() >= 1);
    assert_eq!(Arc::strong_count(&counting), 2, "only the test and the live buffer hold it");
    let fresh = cumem_core::current_resource(&device).unwrap();
    assert!(
        (*fresh).as_any().is::<DriverResource>() || std::env::var_os(cumem_core::ALLOCATOR_ENV).is_some()
    );
    drop(buf);
    assert_eq!((counting.live(), Arc::strong_count(&counting)), (0, 1));
}

/// Holds a block of device memory for as long as it lives, as a caching pool holds its cache: the
/// simulator's exit leak check reports the block if the resource is never released.
#[derive(Debug)]
struct Holding {
    inner: DriverResource,
    _held: DeviceBuffer<u8>,
}

impl Holding {
    fn new(ctx: &Context) -> cumem_core::Result<Arc<Holding>> {
        let inner = DriverResource::new(ctx);
        let stream = Stream::new(ctx)?;
        let held = DeviceBuffer::<u8>::zeroed_in(&Arc::new(inner.clone()), &stream, 4096)?;
        stream.synchronize()?;
        Ok(Arc::new(Holding { inner, _held: held }))
    }
}

// SAFETY: forwards to the driver resource, which upholds the contract.
unsafe impl DeviceResource for Holding {
    fn context(&self) -> &Context {
        self.inner.context()
    }
    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> cumem_core::Result<cumem_core::Allocation> {
        self.inner.allocate(layout, stream)
    }
    unsafe fn deallocate(&self, allocation: cumem_core::Allocation, layout: AllocLayout, stream: &Stream) {
        // SAFETY: forwarded unchanged from our caller.
        unsafe { self.inner.deallocate(allocation, layout, stream) }
    }
}

const EXIT_CHILD: &str = "CUMEM_TEST_CURRENT_EXIT_CHILD";

/// Runs the child test `name` and checks that its exit passed the simulator's leak check.
fn run_exit_child(name: &str) {
    testing::init();
    if testing::sim_control().is_none() {
        return testing::skip("reads the simulator's exit leak check");
    }
    let child = testing::child_process::run_child_test(
        name,
        &[(EXIT_CHILD, "1")],
        &[cumem_core::ALLOCATOR_ENV],
        std::time::Duration::from_secs(60),
    );
    let log = child.log;
    let status = child.status.unwrap_or_else(|| panic!("the child hung:\n{log}"));
    assert!(status.success(), "the child's exit failed ({status}):\n{log}");
    assert!(log.contains("leak check passed"), "the child's exit was not leak checked:\n{log}");
}

/// The child's half: exits the process inside a scoped override made over a resource holding
/// memory; only the scope holds that resource then.
#[test]
fn exit_inside_a_scope_child() {
    if std::env::var_os(EXIT_CHILD).is_none() {
        return;
    }
    let device = device();
    let ctx = device.context().unwrap();
    drop(cumem_core::set_current_resource(&device, Holding::new(&ctx).unwrap()).unwrap());
    let _guard = cumem_core::scoped_current_resource(&device, Arc::new(DriverResource::new(&ctx))).unwrap();
    std::process::exit(0);
}

#[test]
#[serial]
fn an_exit_inside_a_scoped_override_releases_what_the_scope_would_restore() {
    if std::env::var_os(EXIT_CHILD).is_none() {
        run_exit_child("exit_inside_a_scope_child");
    }
}

/// Every device's default resource in the child below: one that holds memory.
fn holding_factory(_: AllocatorKind, ctx: &Context) -> cumem_core::Result<Arc<dyn DeviceResource>> {
    Ok(Holding::new(ctx)?)
}

/// Allocates through device 0's default resource, on a thread of its own (the exiting thread's
/// thread-locals are gone by the time exit handlers run).
extern "C" fn allocate_at_exit() {
    let worker = std::thread::spawn(|| {
        let ctx = Device::get(0).unwrap().context().unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let buf = DeviceBuffer::<u32>::zeroed(&stream, 16).unwrap();
        assert_eq!(buf.to_vec().unwrap(), [0; 16]);
    });
    if worker.join().is_err() {
        std::process::abort();
    }
}

unsafe extern "C" {
    /// The C library's `atexit`.
    fn atexit(f: extern "C" fn()) -> std::ffi::c_int;
}

/// The child's half: a default resource that holds memory, and an exit handler that allocates
/// through it after the registry's own exit handler ran (registered before the registry's, so it
/// runs after it; the simulator's leak check, registered at `cuInit`, runs last).
#[test]
fn allocate_after_exit_child() {
    if std::env::var_os(EXIT_CHILD).is_none() {
        return;
    }
    let device = device();
    // SAFETY: `allocate_at_exit` is a plain function of this program, which it outlives; it
    // catches its worker's panic rather than unwind.
    assert_eq!(unsafe { atexit(allocate_at_exit) }, 0);
    assert!(cumem_core::install_default_factory(holding_factory));
    assert_eq!(cumem_core::default_allocator(), AllocatorKind::Caching);
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    drop(DeviceBuffer::<u32>::zeroed(&stream, 16).unwrap()); // registers the registry's handler
}

#[test]
#[serial]
fn an_allocation_after_the_exit_handler_keeps_no_resource() {
    if std::env::var_os(EXIT_CHILD).is_none() {
        run_exit_child("allocate_after_exit_child");
    }
}
