//! Expandable-segment memory is mapped for the pool's device's peers too: a peer copy issued by
//! the other device of a linked pair writes into it, bitwise, and the simulator sees no access by a
//! device the mapping does not grant.

use std::sync::Arc;

use cumem_copy::copy_h2d;
use cumem_core::{Device, DeviceBuffer, Stream};
use cumem_pool::{CachingResource, PoolConfig};
use cumem_sys::testing;
use serial_test::serial;

#[test]
#[serial]
fn a_peer_copy_into_expandable_memory_arrives_bitwise() {
    testing::init_with("devices=2,peer=0-1");
    if !testing::needs_devices(2) {
        return;
    }
    let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
    if !d1.capabilities().unwrap().virtual_memory || !cumem_peer::Topology::probe().unwrap().can_access(0, 1)
    {
        return testing::skip("device 1 has no virtual memory management or no peer link from device 0");
    }
    let (c0, c1) = (d0.context().unwrap(), d1.context().unwrap());
    let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
    let pool = Arc::new(CachingResource::with_driver(&c1, config));
    assert!(pool.pool().expandable().is_some());
    let (s0, s1) = (Stream::non_blocking(&c0).unwrap(), Stream::non_blocking(&c1).unwrap());
    let n = 3 << 18; // 3 MiB of u32: across two chunks
    let data: Vec<u32> = (0..n as u32).map(|k| k.wrapping_mul(2_654_435_761)).collect();
    let plain = Arc::new(CachingResource::with_driver(&c0, PoolConfig::default()));
    let mut src = DeviceBuffer::<u32>::zeroed_in(&plain, &s0, n).unwrap();
    s0.synchronize().unwrap();
    copy_h2d(&data, &mut src).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed_in(&pool, &s1, n).unwrap();
    s1.synchronize().unwrap();
    let copy = cumem_peer::copy_peer(&src, &mut dst).unwrap();
    assert_eq!(copy.path(), cumem_peer::PeerPath::Direct);
    assert_eq!(dst.to_vec().unwrap(), data);
    drop((src, dst));
    pool.trim().unwrap();
    plain.trim().unwrap();
    drop((pool, plain, s0, s1));
    if let Some(ctl) = testing::sim_control() {
        assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
        let report = ctl.live_report();
        assert!(report.is_clean(), "{report}");
    }
}
