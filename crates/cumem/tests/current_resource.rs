//! The default resource of a program that depends only on `cumem` (issue 8, item 1): the caching
//! pool, installed by `cumem-pool` before `main` without the program naming it; `trim_current`
//! returns its memory; `CUMEM_ALLOCATOR` picks each kind (read once per process, so each kind runs
//! in a child process of this test binary, whose own exit leak check must pass too).
//!
//! The current resource is process-wide, so every test here is `#[serial]`.

use std::process::Command;
use std::sync::Arc;

use cumem::pool::{CachingResource, NativePoolResource};
use cumem::{ALLOCATOR_ENV, AllocatorKind, Device, DeviceBuffer, DriverResource, Stream};
use cumem_sys::testing;
use serial_test::serial;

/// Set in a child process: the kind its current resource must be.
const EXPECT_ENV: &str = "CUMEM_TEST_EXPECT_ALLOCATOR";

fn device() -> Device {
    testing::init();
    Device::get(0).unwrap()
}

fn live_allocations() -> Option<usize> {
    Some(testing::sim_control()?.live_report().allocations.len())
}

#[test]
#[serial]
fn the_default_is_the_caching_pool_and_trim_current_returns_its_memory() {
    let device = device();
    if std::env::var_os(ALLOCATOR_ENV).is_some() {
        return; // a run with a chosen allocator; the children below cover every choice
    }
    assert_eq!(cumem::default_allocator(), AllocatorKind::Caching);
    let pool = cumem::pool::current_caching(&device).unwrap().expect("the default is a caching pool");
    let current = cumem::current_resource(&device).unwrap();
    assert!(std::ptr::addr_eq(Arc::as_ptr(&current), Arc::as_ptr(&pool)));

    cumem::pool::trim_current(&device).unwrap().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    let driver_before = live_allocations();
    let before = pool.stats().upstream_allocations;

    let stream = Stream::non_blocking(&device.context().unwrap()).unwrap();
    let a = DeviceBuffer::<u8>::zeroed(&stream, 4096).unwrap();
    let first = a.device_ptr();
    assert!(Arc::ptr_eq(a.resource(), &current));
    drop(a);
    let b = DeviceBuffer::<u8>::from_slice(&stream, &[5; 4096]).unwrap();
    assert_eq!(b.device_ptr(), first, "the second allocation reuses the cached block");
    assert_eq!(b.to_vec().unwrap(), vec![5; 4096]);
    assert_eq!(pool.stats().upstream_allocations - before, 1, "one cuMemAlloc for both");
    if let (Some(before), Some(now)) = (driver_before, live_allocations()) {
        assert_eq!(now, before + 1, "the simulator sees one driver allocation");
    }

    drop(b);
    assert_eq!(pool.stats().reserved_bytes, 2 << 20, "the freed block stays cached");
    let report = cumem::pool::trim_current(&device).unwrap().unwrap();
    assert_eq!((report.released_segments, report.released_bytes), (1, 2 << 20));
    assert_eq!(pool.stats().reserved_bytes, 0);
    assert_eq!(live_allocations(), driver_before);
}

#[test]
#[serial]
fn trim_current_does_nothing_when_the_current_resource_is_not_a_caching_pool() {
    let device = device();
    let driver = Arc::new(DriverResource::new(&device.context().unwrap()));
    let _scope = cumem::scoped_current_resource(&device, driver).unwrap();
    assert!(cumem::pool::current_caching(&device).unwrap().is_none());
    assert!(cumem::pool::trim_current(&device).unwrap().is_none());
}

/// Runs [`child_checks_its_current_resource`] in a child process with `CUMEM_ALLOCATOR=value`.
fn run_child(value: &str, expect: &str) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_checks_its_current_resource", "--nocapture", "--test-threads=1"])
        .env(ALLOCATOR_ENV, value)
        .env(EXPECT_ENV, expect)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "CUMEM_ALLOCATOR={value}: {}\n{stdout}\n{stderr}", out.status);
    assert!(stdout.contains("1 passed"), "the child ran its checks:\n{stdout}");
    if testing::sim_control().is_some() {
        assert!(stderr.contains("leak check passed"), "the child's exit leak check:\n{stderr}");
    }
}

#[test]
#[serial]
fn cumem_allocator_picks_each_kind_and_an_unknown_value_is_the_default() {
    testing::init();
    for (value, expect) in [
        ("caching", "caching"),
        ("native", "native"),
        ("driver", "driver"),
        ("DRIVER", "driver"),
        ("no-such-allocator", "caching"),
    ] {
        run_child(value, expect);
    }
}

/// The child's half of the test above; does nothing unless the parent asked for a kind.
#[test]
#[serial]
fn child_checks_its_current_resource() {
    let Ok(expect) = std::env::var(EXPECT_ENV) else { return };
    let device = device();
    let expect: AllocatorKind = expect.parse().unwrap();
    assert_eq!(cumem::default_allocator(), expect);
    let current = cumem::current_resource(&device).unwrap();
    let any = (*current).as_any();
    let pools = device.capabilities().unwrap().memory_pools;
    match expect {
        AllocatorKind::Caching => assert!(any.is::<CachingResource>(), "{current:?}"),
        AllocatorKind::Native if pools => assert!(any.is::<NativePoolResource>(), "{current:?}"),
        AllocatorKind::Native | AllocatorKind::Driver => assert!(any.is::<DriverResource>(), "{current:?}"),
    }
    let stream = Stream::non_blocking(&device.context().unwrap()).unwrap();
    let data: Vec<u32> = (0..10_000).collect();
    let buf = DeviceBuffer::from_slice(&stream, &data).unwrap();
    assert!(Arc::ptr_eq(buf.resource(), &current));
    assert_eq!(buf.to_vec().unwrap(), data);
    drop(buf);
    // The current resource keeps whatever it caches until the exit, which must still leave nothing.
}
