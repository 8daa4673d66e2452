//! A program that uses `cumem` but never names anything of `cumem::pool` still gets the caching
//! pool as its default: `cumem-pool` installs it before `main` (a `ctor` constructor, kept by
//! the linker although nothing refers to it), and this binary is the proof.

use cumem::{ALLOCATOR_ENV, AllocatorKind, Device, DeviceBuffer, Stream};
use cumem_sys::testing;

#[test]
fn the_caching_pool_is_the_default_without_being_named() {
    testing::init();
    if std::env::var_os(ALLOCATOR_ENV).is_some() {
        return; // a run with a chosen allocator
    }
    assert_eq!(cumem::default_allocator(), AllocatorKind::Caching);
    let device = Device::get(0).unwrap();
    let current = cumem::current_resource(&device).unwrap();
    assert!(format!("{current:?}").starts_with("CachingResource"), "{current:?}");
    let stream = Stream::new(&device.context().unwrap()).unwrap();
    let a = DeviceBuffer::<u64>::zeroed(&stream, 512).unwrap();
    let first = a.device_ptr();
    drop(a);
    // Freed on `stream` (its last use), so the next allocation on `stream` gets it back.
    let b = DeviceBuffer::<u64>::zeroed(&stream, 512).unwrap();
    assert_eq!(b.device_ptr(), first, "the freed block came back from the cache");
    assert_eq!(b.to_vec().unwrap(), vec![0; 512]);
}
