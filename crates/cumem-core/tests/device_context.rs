//! Devices, capabilities, contexts and memory info, as a user sees them.

use cumem_core::{Device, Error, Feature, sys::CUdevice_attribute as A};
use cumem_sys::testing;

/// Device 1 lacks managed memory and pools, and reaches no peer (device 0 reaches it: `peer=0>1`).
const SIM: &str = "devices=2,dev1.managed_memory=0,dev1.memory_pools_supported=0,dev1.memory=1GiB,peer=0>1";

fn init() {
    testing::init_with(SIM);
}

#[test]
#[serial_test::parallel]
fn devices_are_enumerated_in_order() {
    init();
    let n = Device::count().unwrap();
    assert!(n >= 1);
    let all = Device::all().unwrap();
    assert_eq!(all.len(), n);
    for (i, d) in all.iter().enumerate() {
        assert_eq!(d.ordinal(), i);
        assert_eq!(Device::get(i).unwrap(), *d);
        assert_eq!(d.raw() as usize, i);
        assert_eq!(d.to_string(), format!("device {i}"));
    }
}

#[test]
#[serial_test::parallel]
fn a_missing_device_is_invalid_device() {
    init();
    let n = Device::count().unwrap();
    assert!(matches!(Device::get(n), Err(Error::InvalidDevice { .. })));
    assert!(matches!(Device::get(usize::MAX), Err(Error::InvalidDevice { .. })));
}

#[test]
#[serial_test::parallel]
fn names_attributes_and_memory_are_readable() {
    init();
    let d = Device::get(0).unwrap();
    assert!(!d.name().unwrap().is_empty());
    let (major, minor) = d.compute_capability().unwrap();
    assert!(major >= 1 && minor >= 0);
    assert_eq!(d.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).unwrap(), major);
    assert!(d.total_memory().unwrap() > 0);
}

#[test]
#[serial_test::parallel]
fn capabilities_come_from_attributes() {
    init();
    let d = Device::get(0).unwrap();
    let caps = d.capabilities().unwrap();
    assert_eq!(caps.device, d);
    assert_eq!(caps.managed_memory, d.attribute(A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY).unwrap() != 0);
    assert_eq!(caps.memory_pools, d.attribute(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED).unwrap() != 0);
    assert!(caps.texture_pitch_alignment >= 1);
    // A missing capability is refused by name, for its device (on the simulator device 1 lacks
    // three of these, so the refusals are seen).
    let mut refused = Vec::new();
    for ordinal in 0..Device::count().unwrap() {
        let caps = Device::get(ordinal).unwrap().capabilities().unwrap();
        for f in [Feature::ManagedMemory, Feature::MemoryPools, Feature::HostMapping, Feature::PeerAccess] {
            match caps.require(f) {
                Ok(()) => assert!(caps.supports(f), "{f:?}"),
                Err(Error::NotSupported { feature, device }) => {
                    assert!(!caps.supports(f));
                    assert_eq!((feature, device), (f, Some(ordinal as i32)), "{f:?}");
                    refused.push((ordinal, f));
                }
                Err(e) => panic!("{f:?}: {e:?}"),
            }
        }
    }
    if testing::sim_control().is_some() {
        assert_eq!(
            refused,
            [(1, Feature::ManagedMemory), (1, Feature::MemoryPools), (1, Feature::PeerAccess)]
        );
    }
    if Device::count().unwrap() == 1 {
        assert!(!caps.peer_access, "the only device has no peer to reach");
    }
}

#[test]
#[serial_test::parallel]
fn peer_access_is_supported_only_by_a_device_that_reaches_another() {
    init();
    if testing::sim_control().is_none() {
        testing::skip("needs the simulator's devices 0 and 1, linked one way only (0 reaches 1)");
        return;
    }
    let reaches = Device::get(0).unwrap().capabilities().unwrap();
    assert!(reaches.peer_access);
    assert!(reaches.require(Feature::PeerAccess).is_ok());
    let reaches_none = Device::get(1).unwrap().capabilities().unwrap();
    assert!(!reaches_none.peer_access);
    assert!(matches!(
        reaches_none.require(Feature::PeerAccess),
        Err(Error::NotSupported { feature: Feature::PeerAccess, device: Some(1) })
    ));
}

#[test]
#[serial_test::parallel]
fn a_device_without_a_capability_says_not_supported() {
    init();
    if testing::sim_control().is_none() {
        testing::skip("needs the simulator's device 1, configured without managed memory and pools");
        return;
    }
    let caps = Device::get(1).unwrap().capabilities().unwrap();
    assert!(!caps.managed_memory && !caps.memory_pools);
    assert!(matches!(
        caps.require(Feature::ManagedMemory),
        Err(Error::NotSupported { feature: Feature::ManagedMemory, device: Some(1) })
    ));
    assert!(matches!(
        caps.require(Feature::MemoryPools),
        Err(Error::NotSupported { feature: Feature::MemoryPools, .. })
    ));
    assert_eq!(Device::get(1).unwrap().total_memory().unwrap(), 1 << 30);
}

#[test]
#[serial_test::parallel]
fn contexts_bind_synchronize_and_report_memory() {
    init();
    let d = Device::get(0).unwrap();
    let ctx = d.context().unwrap();
    assert_eq!(ctx.device(), d);
    assert!(!ctx.raw().is_null());
    assert_eq!(ctx.clone(), ctx);
    assert_eq!(d.context().unwrap(), ctx, "the primary context is one context");
    ctx.bind().unwrap();
    ctx.synchronize().unwrap();
    let info = ctx.mem_info().unwrap();
    assert!(info.free <= info.total && info.total == d.total_memory().unwrap());
    let (least, greatest) = ctx.stream_priority_range().unwrap();
    assert!(greatest <= least);
    assert!(ctx.default_stream().is_legacy());
    assert!(format!("{ctx:?}").contains("device"));
}

#[test]
#[serial_test::serial] // exact accounting: on a one-GPU machine the other tests share its device
fn mem_info_goes_down_by_an_allocation_and_back() {
    init();
    // The last device: on the simulator no other test of this binary uses it.
    let device = Device::get(Device::count().unwrap() - 1).unwrap();
    let ctx = device.context().unwrap();
    let stream = ctx.default_stream();
    let before = ctx.mem_info().unwrap().free;
    let buf = cumem_core::DeviceBuffer::<u8>::zeroed(&stream, 64 << 20).unwrap();
    let during = ctx.mem_info().unwrap().free;
    assert!(before - during >= 64 << 20, "free memory went from {before} to {during}");
    // By id: once freed, its address may be another test's allocation.
    let id = testing::sim_control().map(|ctl| ctl.live_report().id_of(buf.device_ptr()).expect("live"));
    drop(buf);
    assert_eq!(ctx.mem_info().unwrap().free, before);
    if let (Some(ctl), Some(id)) = (testing::sim_control(), id) {
        let live = ctl.live_report();
        assert!(!live.contains_allocation(id), "leaked instead of freed:\n{live}");
    }
}
