//! Device work on managed memory that its attachment keeps out (audit finding): on a device
//! without concurrent managed access the driver lets no stream use memory attached to the host,
//! and only the attached stream use memory attached to one stream. Every door of a unified
//! buffer's device views (copies, memsets, `on`, peer copies) refuses such work with
//! `NotSupported { feature: ConcurrentManagedAccess }` before anything is queued, so the
//! simulator, which logs such work as misuse, sees none; the attachments that allow the work
//! still round-trip the data bitwise.

use cumem_copy::StreamCopy;
use cumem_core::{Context, Device, DeviceBuffer, Error, Feature, Stream};
use cumem_peer::PeerStreamCopy;
use cumem_sys::testing;
use cumem_unified::{Attach, UnifiedBuffer};

/// Device 1 has managed memory without concurrent access (like Windows/WSL or pre-Pascal GPUs);
/// device 0 has it.
const SIM: &str = "devices=2,latency_us=2000,dev1.concurrent_managed_access=0";

/// The managed-memory device without concurrent managed access, its context and a stream.
fn not_concurrent() -> Option<(Device, Context, Stream)> {
    testing::init_with(SIM);
    let Some(d) = Device::all().unwrap().into_iter().find(|d| {
        let c = d.capabilities().unwrap();
        c.managed_memory && !c.concurrent_managed_access
    }) else {
        testing::skip("needs a managed-memory device without concurrent access");
        return None;
    };
    let ctx = d.context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    Some((d, ctx, stream))
}

fn pattern(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i ^ 0x5a5a).wrapping_mul(2_654_435_761)).collect()
}

/// What the simulator logged as misuse on this thread (nothing on a real driver).
fn misuse_here() -> Vec<String> {
    testing::sim_control().map_or_else(Vec::new, |ctl| {
        ctl.violations_on_this_thread().into_iter().map(|v| v.to_string()).collect()
    })
}

#[track_caller]
fn assert_refused<R: std::fmt::Debug>(result: cumem_core::Result<R>, device: Device) {
    assert!(
        matches!(&result, Err(Error::NotSupported { feature: Feature::ConcurrentManagedAccess, device: Some(d) }) if *d == device.ordinal() as i32),
        "expected NotSupported(ConcurrentManagedAccess) on device {}, got {result:?}",
        device.ordinal()
    );
}

/// Drops `buf` and checks that the simulator freed its allocation (nothing leaked by a refusal).
fn freed(buf: UnifiedBuffer<u32>) {
    let id = testing::sim_control().and_then(|ctl| ctl.live_report().id_of(buf.device_ptr()));
    drop(buf);
    if let (Some(ctl), Some(id)) = (testing::sim_control(), id) {
        let live = ctl.live_report();
        assert!(!live.contains_allocation(id), "leaked instead of freed:\n{live}");
    }
}

#[test]
fn host_attached_memory_takes_no_device_work() {
    let Some((device, ctx, stream)) = not_concurrent() else { return };
    let data = pattern(4096);
    let mut buf = UnifiedBuffer::from_slice_attached(&stream, &data, Attach::Host).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 4096).unwrap();
    // Every door, on the stream that made it and on others.
    assert_refused(stream.copy_d2d(&buf, &mut dst), device);
    assert_refused(Stream::legacy(&ctx).copy_d2d(&buf, &mut dst), device);
    assert_refused(cumem_copy::copy_d2d(&buf, &mut dst), device);
    assert_refused(stream.copy_d2d(&dst, &mut buf), device);
    assert_refused(stream.memset_d32(&mut buf, 9), device);
    assert_refused(buf.as_device_slice().on(&stream).map(drop), device);
    assert_refused(buf.as_device_slice_mut().on(&stream).map(drop), device);
    assert_refused(buf.as_device_slice().order().queue_on(&stream, || Ok(())), device);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    // The refusals changed nothing: the host reads the values, and once attached globally the
    // device does too.
    assert_eq!(buf.to_vec().unwrap(), data);
    buf.attach(&stream, Attach::Global).unwrap();
    stream.copy_d2d(&buf, &mut dst).unwrap();
    assert_eq!(dst.to_vec().unwrap(), data);
    let mut other = UnifiedBuffer::<u32>::zeroed(&stream, 4096).unwrap();
    Stream::non_blocking(&ctx).unwrap().copy_d2d(&dst, &mut other).unwrap();
    assert_eq!(other.to_vec().unwrap(), data);
    // And attached to the host again, it refuses again.
    buf.attach(&stream, Attach::Host).unwrap();
    assert_refused(stream.copy_d2d(&buf, &mut dst), device);
    assert_eq!(buf.as_slice().unwrap(), &data[..]);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    freed(buf);
    freed(other);
}

#[test]
fn single_attached_memory_takes_only_its_streams_work() {
    let Some((device, ctx, s)) = not_concurrent() else { return };
    let t = Stream::non_blocking(&ctx).unwrap();
    let data = pattern(4096);
    let mut buf = UnifiedBuffer::from_slice(&s, &data).unwrap();
    buf.attach(&s, Attach::Single(s.clone())).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&t, 4096).unwrap();
    assert_refused(t.copy_d2d(&buf, &mut dst), device);
    assert_refused(Stream::legacy(&ctx).copy_d2d(&buf, &mut dst), device);
    assert_refused(cumem_copy::copy_d2d(&buf, &mut dst), device);
    assert_refused(t.copy_d2d(&dst, &mut buf), device);
    assert_refused(t.memset_d32(&mut buf, 9), device);
    assert_refused(buf.as_device_slice().on(&t).map(drop), device);
    assert_refused(buf.as_device_slice_mut().on(&t).map(drop), device);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    // The attached stream's work goes on, in both directions.
    s.copy_d2d(&buf, &mut dst).unwrap();
    assert_eq!(dst.to_vec().unwrap(), data);
    s.memset_d32(&mut buf, 0).unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![0; 4096]);
    s.copy_d2d(&dst, &mut buf).unwrap();
    assert_eq!(buf.to_vec().unwrap(), data);
    // Attached globally, every stream's work goes on.
    buf.attach(&t, Attach::Global).unwrap();
    t.memset_d32(&mut buf, 0xdead_beef).unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![0xdead_beef; 4096]);
    t.copy_d2d(&dst, &mut buf).unwrap();
    assert_eq!(buf.to_vec().unwrap(), data);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    freed(buf);
}

#[test]
fn peer_copies_of_memory_attached_elsewhere_are_refused() {
    let Some((device, _, s1)) = not_concurrent() else { return };
    let Some(other) = Device::all().unwrap().into_iter().find(|d| *d != device) else {
        return testing::skip("needs a second device");
    };
    let s0 = Stream::non_blocking(&other.context().unwrap()).unwrap();
    let data = pattern(4096);
    let mut on_dev0 = DeviceBuffer::<u32>::zeroed(&s0, 4096).unwrap();
    // A copy on device 0's stream orders this side on device 1's legacy stream: neither memory
    // attached to the host nor memory attached to s1 admits it.
    let mut buf = UnifiedBuffer::from_slice_attached(&s1, &data, Attach::Host).unwrap();
    assert_refused(s0.copy_peer(&buf, &mut on_dev0), device);
    assert_refused(s0.copy_peer(&on_dev0, &mut buf), device);
    assert_refused(cumem_peer::copy_peer(&buf, &mut on_dev0), device);
    assert_refused(s1.copy_peer(&buf, &mut on_dev0), device);
    buf.attach(&s1, Attach::Single(s1.clone())).unwrap();
    assert_refused(s0.copy_peer(&buf, &mut on_dev0), device);
    assert_refused(s0.copy_peer(&on_dev0, &mut buf), device);
    assert_refused(cumem_peer::copy_peer(&buf, &mut on_dev0), device);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    assert_eq!(on_dev0.to_vec().unwrap(), vec![0; 4096], "a refused copy wrote nothing");
    // On the attached stream itself, this side is ordered there: the copy goes on.
    let copy = s1.copy_peer(&buf, &mut on_dev0).unwrap();
    s1.synchronize().unwrap();
    drop(copy);
    assert_eq!(on_dev0.to_vec().unwrap(), data);
    // Attached globally, any stream's copy goes on.
    buf.attach(&s1, Attach::Global).unwrap();
    s0.memset_d32(&mut on_dev0, 0).unwrap();
    let copy = s0.copy_peer(&buf, &mut on_dev0).unwrap();
    s0.synchronize().unwrap();
    drop(copy);
    assert_eq!(on_dev0.to_vec().unwrap(), data);
    let mut back = UnifiedBuffer::<u32>::zeroed(&s1, 4096).unwrap();
    let copy = s0.copy_peer(&on_dev0, &mut back).unwrap();
    s0.synchronize().unwrap();
    drop(copy);
    assert_eq!(back.to_vec().unwrap(), data);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    assert_eq!(buf.as_device_slice().len(), 4096);
    freed(buf);
    freed(back);
}

/// Devices with concurrent managed access are unchanged: memory attached to the host, or to one
/// stream, takes any stream's work there.
#[test]
fn devices_with_concurrent_access_admit_every_stream() {
    testing::init_with(SIM);
    let Some(device) = Device::all()
        .unwrap()
        .into_iter()
        .find(|d| d.capabilities().is_ok_and(|c| c.managed_memory && c.concurrent_managed_access))
    else {
        return testing::skip("needs a device with concurrent managed access");
    };
    let ctx = device.context().unwrap();
    let (s, t) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let data = pattern(4096);
    let mut buf = UnifiedBuffer::from_slice_attached(&s, &data, Attach::Host).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&t, 4096).unwrap();
    t.copy_d2d(&buf, &mut dst).unwrap();
    assert_eq!(dst.to_vec().unwrap(), data);
    buf.attach(&s, Attach::Single(s.clone())).unwrap();
    t.memset_d32(&mut dst, 7).unwrap();
    t.copy_d2d(&dst, &mut buf).unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![7; 4096]);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    freed(buf);
}
