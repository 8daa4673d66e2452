//! `UnifiedBuffer`: round trips, host access that waits for device work, attachment, advice and
//! policies read back through range attributes, prefetch plans, and devices without the capability.

use cumem_copy::StreamCopy;
use cumem_core::sys::CUresult;
use cumem_core::{Context, Device, DeviceBuffer, Error, Feature, Stream};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::testing;
use cumem_sys::testing::Gate;
use cumem_unified::{Advice, Attach, Location, MigrationPolicy, PrefetchPlan, UnifiedBuffer};
use rstest::rstest;
use serial_test::{parallel, serial};

/// Device 1 has no managed memory; device 2 has it without concurrent access (like Windows/WSL or
/// older GPUs). Streams start work 20 ms late, so a missing wait reads stale data; where a test
/// reads behind a buffer's back to show that, a [`Gate`] holds the stream so the read is stale
/// whatever the machine's load. Those tests are `#[serial]` and every other one `#[parallel]`: a
/// gate must never overlap a free in another test (see [`Gate`]).
const SIM: &str = "devices=3,latency_us=20000,dev1.managed_memory=0,dev2.concurrent_managed_access=0";

fn init() {
    testing::init_with(SIM);
}

/// The first device whose capabilities satisfy `pred` (on the simulator: the configured ones).
fn device_where(pred: impl Fn(&cumem_core::Capabilities) -> bool) -> Option<(Device, Context)> {
    init();
    Device::all()
        .unwrap()
        .into_iter()
        .find(|d| pred(&d.capabilities().unwrap()))
        .map(|d| (d, d.context().unwrap()))
}

fn full() -> (Device, Context, Stream) {
    let (d, ctx) =
        device_where(|c| c.managed_memory && c.concurrent_managed_access).expect("a managed-memory device");
    let stream = Stream::non_blocking(&ctx).unwrap();
    (d, ctx, stream)
}

fn pattern(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i + 1).wrapping_mul(2_654_435_761)).collect()
}

/// Reads behind the buffer's back: what a program that forgot to wait would see. Call only while a
/// [`Gate`] holds the stream in front of every write to the memory.
fn early<T: Copy>(ptr: u64) -> T {
    // SAFETY: test only: managed memory is host-accessible (the tested device has concurrent
    // managed access) and every bit pattern of the tested types is valid; the caller holds every
    // device write to it behind a closed gate, so nothing writes concurrently.
    unsafe { std::ptr::read_volatile(ptr as usize as *const T) }
}

/// Holds `stream` here: work queued on it from now on does not start until the gate opens.
/// Declare the gate after the buffers it holds work for: on a panic it is dropped, so opened,
/// before their drops wait for the stream. The calling test must be `#[serial]` (checked): see
/// [`Gate`] for why.
fn hold(stream: &Stream) -> Gate {
    assert!(
        serial_test::is_locked_serially(None),
        "a test that holds a stream must be #[serial] (see cumem_sys::testing::Gate)"
    );
    stream.context().bind().unwrap();
    // SAFETY: `stream` is alive (borrowed), and its context was just made current.
    unsafe { testing::hold(stream.raw()) }
}

#[test]
#[serial] // holds a gate
fn data_round_trips_host_to_unified_to_device_to_host() {
    let (_, _, stream) = full();
    let data = pattern(1 << 14);
    let unified = UnifiedBuffer::from_slice(&stream, &data).unwrap();
    let mut dev = DeviceBuffer::<u32>::zeroed(&stream, 1 << 14).unwrap();
    stream.copy_d2d(&unified, &mut dev).unwrap();
    assert_eq!(dev.to_vec().unwrap(), data);
    let mut back = UnifiedBuffer::<u32>::zeroed(&stream, 1 << 14).unwrap();
    let gate = hold(&stream); // the copy below certainly has not run until the gate opens
    stream.copy_d2d(&dev, &mut back).unwrap();
    assert_eq!(early::<u32>(back.device_ptr()), 0, "the copy ran while the stream was held");
    gate.release(); // does not wait: `as_slice` has to
    assert_eq!(back.as_slice().unwrap(), &data[..]); // waits for the copy
    let ptr = back.device_ptr();
    drop(back);
    if let Some(ctl) = testing::sim_control() {
        assert!(!ctl.live_report().contains_ptr(ptr));
    }
}

#[test]
#[serial] // holds a gate
fn host_writes_wait_for_device_reads_on_another_stream() {
    let (_, ctx, stream) = full();
    let other = Stream::non_blocking(&ctx).unwrap();
    let mut unified = UnifiedBuffer::from_slice(&stream, &[1u64; 4096]).unwrap();
    let mut dev = DeviceBuffer::<u64>::zeroed(&other, 4096).unwrap();
    other.copy_d2d(&unified, &mut dev).unwrap(); // reads the 1s, 20 ms from now
    unified.as_mut_slice().unwrap().fill(2); // must not overtake that read
    assert_eq!(dev.to_vec().unwrap(), vec![1; 4096]);
    // Blocking copies out of the unified buffer see the host's writes.
    let mut out = vec![0u64; 4096];
    cumem_copy::copy_d2h(&unified, &mut out).unwrap();
    assert_eq!(out, vec![2; 4096]);
    // A memset through the exclusive device view: the host read waits for it.
    let gate = hold(&stream);
    stream.memset_d32(&mut unified.as_device_slice_mut(), 0x0303_0303).unwrap();
    assert_eq!(early::<u64>(unified.device_ptr()), 2, "the memset ran while the stream was held");
    gate.release();
    assert_eq!(unified.to_vec().unwrap(), vec![0x0303_0303_0303_0303; 4096]);
}

#[test]
#[parallel]
fn every_advice_reads_back_as_the_location_it_names() {
    let (device, _, stream) = full();
    let buf = UnifiedBuffer::<u8>::zeroed(&stream, 1 << 16).unwrap();
    assert_eq!(buf.attributes().unwrap(), Default::default());
    buf.advise(Advice::ReadMostly).unwrap();
    buf.advise(Advice::PreferredLocation(Location::Host)).unwrap();
    buf.advise(Advice::AccessedBy(Location::Device(device))).unwrap();
    buf.advise(Advice::AccessedBy(Location::Host)).unwrap();
    let a = buf.attributes().unwrap();
    assert!(a.read_mostly);
    assert_eq!(a.preferred_location, Some(Location::Host));
    assert!(
        a.accessed_by.contains(&Location::Device(device)) && a.accessed_by.contains(&Location::Host),
        "{a:?}"
    );
    assert_eq!(a.accessed_by.len(), 2);
    buf.advise(Advice::PreferredLocation(Location::Device(device))).unwrap();
    assert_eq!(buf.attributes().unwrap().preferred_location, Some(Location::Device(device)));
    // Unsetting each hint removes exactly it.
    buf.unadvise(Advice::ReadMostly).unwrap();
    buf.unadvise(Advice::PreferredLocation(Location::Host)).unwrap();
    buf.unadvise(Advice::AccessedBy(Location::Host)).unwrap();
    let a = buf.attributes().unwrap();
    assert!(!a.read_mostly && a.preferred_location.is_none());
    assert_eq!(a.accessed_by, [Location::Device(device)]);
    // Hints on part of the buffer apply to that part only.
    buf.unadvise(Advice::AccessedBy(Location::Device(device))).unwrap();
    buf.advise_range(..4096, Advice::ReadMostly).unwrap();
    assert!(buf.range_attributes(..4096).unwrap().read_mostly);
    assert!(!buf.attributes().unwrap().read_mostly, "mixed ranges are not read-mostly");
    assert!(matches!(buf.advise_range(0..(1 << 16) + 1, Advice::ReadMostly), Err(Error::OutOfRange { .. })));
}

/// Managed allocations below 2 MiB share driver pages on a real GPU (seen on an H100: a neighbour's
/// advice or prefetch showed through a small buffer's range attributes), so the tests that read
/// range attributes back use buffers of a whole 2 MiB granule each and run `#[serial]`.
const GRANULE_U32: usize = (2 << 20) / 4;

#[test]
#[serial]
fn every_migration_policy_reads_back_as_the_location_it_names() {
    let (device, _, stream) = full();
    let buf = UnifiedBuffer::<f32>::zeroed(&stream, GRANULE_U32).unwrap();
    for policy in [
        MigrationPolicy::PreferHost,
        MigrationPolicy::PreferDevice(device),
        MigrationPolicy::ReadMostly,
        MigrationPolicy::OnDemand,
        MigrationPolicy::PreferHost,
    ] {
        buf.set_policy(policy).unwrap();
        let a = buf.attributes().unwrap();
        assert_eq!(a.preferred_location, policy.preferred_location(), "{policy:?}");
        assert_eq!(a.read_mostly, policy.read_mostly(), "{policy:?}");
        assert_eq!(buf.policy(), policy);
    }
    // PreferHost really names the CPU.
    assert_eq!(MigrationPolicy::PreferHost.preferred_location(), Some(Location::Host));
}

#[test]
#[serial]
fn prefetch_plans_run_on_a_stream_and_host_access_waits_for_them() {
    let (device, _, stream) = full();
    let data = pattern(GRANULE_U32);
    let a = UnifiedBuffer::from_slice(&stream, &data).unwrap();
    let b = UnifiedBuffer::<u32>::zeroed(&stream, GRANULE_U32).unwrap();
    let mut plan = PrefetchPlan::new();
    plan.add(&a, Location::Device(device)).add_range(&b, 1024.., Location::Host).unwrap();
    assert_eq!((plan.len(), plan.bytes()), (2, (2 * GRANULE_U32 - 1024) * 4));
    assert!(plan.add_range(&b, ..GRANULE_U32 + 1, Location::Host).is_err());
    plan.execute(&stream).unwrap();
    // The driver records the last prefetch location when the prefetch is requested; the
    // simulator when it runs. Waiting makes the test hold for both.
    stream.synchronize().unwrap();
    assert_eq!(a.attributes().unwrap().last_prefetch_location, Some(Location::Device(device)));
    assert_eq!(b.range_attributes(1024..).unwrap().last_prefetch_location, Some(Location::Host));
    assert_eq!(b.range_attributes(..1024).unwrap().last_prefetch_location, None);
    assert_eq!(a.as_slice().unwrap(), &data[..]);
    a.prefetch(Location::Host, &stream).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(a.attributes().unwrap().last_prefetch_location, Some(Location::Host));
    b.prefetch_range(..1, Location::Device(device), &stream).unwrap();
}

#[test]
#[parallel]
fn attachment_modes_are_honoured() {
    let (_, ctx, stream) = full();
    let mut host_only = UnifiedBuffer::from_slice_attached(&stream, &[5u16; 100], Attach::Host).unwrap();
    assert_eq!(host_only.attachment(), &Attach::Host);
    host_only.attach(&stream, Attach::Single(stream.clone())).unwrap();
    let mut dev = DeviceBuffer::<u16>::zeroed(&stream, 100).unwrap();
    stream.copy_d2d(&host_only, &mut dev).unwrap();
    assert_eq!(dev.to_vec().unwrap(), vec![5; 100]);
    host_only.attach(&stream, Attach::Global).unwrap();
    host_only.as_mut_slice().unwrap()[0] = 6;
    assert_eq!(host_only.as_slice().unwrap()[..2], [6, 5]);
    let other = Stream::non_blocking(&ctx).unwrap();
    assert!(matches!(host_only.attach(&stream, Attach::Single(other)), Err(Error::InvalidValue { .. })));
    assert!(UnifiedBuffer::<u8>::zeroed_attached(&stream, 4, Attach::Single(stream.clone())).is_err());
}

#[test]
#[parallel]
fn devices_without_concurrent_access_keep_the_attach_rules() {
    let Some((device, ctx)) = device_where(|c| c.managed_memory && !c.concurrent_managed_access) else {
        return testing::skip(
            "needs a managed-memory device without concurrent access (the simulator's device 2)",
        );
    };
    let stream = Stream::non_blocking(&ctx).unwrap();
    let data = pattern(2048);
    let mut buf = UnifiedBuffer::<u32>::zeroed(&stream, 2048).unwrap();
    let src = DeviceBuffer::from_slice(&stream, &data).unwrap();
    stream.copy_d2d(&src, &mut buf).unwrap();
    // Attached to the host (after the copy, in stream order), the host reads what the copy wrote.
    buf.attach(&stream, Attach::Host).unwrap();
    buf.with_host_slice(|host| assert_eq!(host, &data[..])).unwrap();
    buf.with_host_slice_mut(|host| host[0] = 1).unwrap();
    buf.attach(&stream, Attach::Single(stream.clone())).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 2048).unwrap();
    stream.copy_d2d(&buf, &mut dst).unwrap();
    assert_eq!(dst.to_vec().unwrap()[..2], [1, data[1]]);
    // Placing pages on, or prefetching to, a device that cannot fault is not supported, before any
    // driver call; hints that name the host are fine.
    let ctl = testing::sim_control();
    let rules = ctl.as_ref().map(|ctl| {
        ["cuMemAdvise", "cuMemAdvise_v2", "cuMemPrefetchAsync", "cuMemPrefetchAsync_v2"].map(|f| {
            ctl.inject_fault(FaultRule {
                function: f.into(),
                nth: 1,
                code: CUresult::CUDA_ERROR_UNKNOWN,
                times: 0,
                this_thread_only: true,
            })
        })
    });
    let here = Some(device.ordinal() as i32);
    let not_supported = |e: Error| matches!(e, Error::NotSupported { feature: Feature::ConcurrentManagedAccess, device: d } if d == here);
    assert!(not_supported(buf.advise(Advice::PreferredLocation(Location::Device(device))).unwrap_err()));
    assert!(not_supported(buf.advise(Advice::AccessedBy(Location::Device(device))).unwrap_err()));
    assert!(not_supported(buf.set_policy(MigrationPolicy::PreferDevice(device)).unwrap_err()));
    assert!(not_supported(buf.prefetch(Location::Device(device), &stream).unwrap_err()));
    assert!(
        not_supported(buf.prefetch(Location::Host, &stream).unwrap_err()),
        "any prefetch needs it on the stream's device"
    );
    assert_eq!(buf.policy(), MigrationPolicy::OnDemand, "a refused policy changes nothing");
    if let (Some(ctl), Some(rules)) = (ctl, rules) {
        rules.into_iter().for_each(|r| ctl.remove_fault(r));
    }
    buf.set_policy(MigrationPolicy::PreferHost).unwrap();
    assert_eq!(buf.attributes().unwrap().preferred_location, Some(Location::Host));
}

/// On a device without concurrent managed access, any device work (for memory attached globally)
/// or any work on the attached stream (attached to one) faults the host's access to the memory,
/// and the buffer sees only its own work: every host access is refused there (`NotSupported {
/// feature: ConcurrentManagedAccess }`, before any wait), scoped or not, while the constructors
/// still write it (through a host attachment). Memory attached to the host lends borrows, since no
/// device work may use it; so does every attachment on a device with concurrent access.
#[test]
#[parallel]
fn without_concurrent_access_only_host_attached_memory_lends_host_borrows() {
    let Some((device, ctx)) = device_where(|c| c.managed_memory && !c.concurrent_managed_access) else {
        return testing::skip(
            "needs a managed-memory device without concurrent access (the simulator's device 2)",
        );
    };
    let stream = Stream::non_blocking(&ctx).unwrap();
    let data = pattern(1024);
    let refused = |e: Error| matches!(e, Error::NotSupported { feature: Feature::ConcurrentManagedAccess, device: Some(d) } if d == device.ordinal() as i32);
    let mut global = UnifiedBuffer::from_slice(&stream, &data).unwrap();
    assert_eq!(global.attachment(), &Attach::Global);
    assert!(refused(global.as_slice().unwrap_err()));
    assert!(refused(global.as_mut_slice().unwrap_err()));
    assert!(refused(global.with_host_slice(<[u32]>::len).unwrap_err()));
    assert!(refused(global.with_host_slice_mut(|host| host[1] = 7).unwrap_err()));
    assert!(refused(global.to_vec().unwrap_err()));
    // The constructor wrote the values; a device copy reads them.
    let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 1024).unwrap();
    stream.copy_d2d(&global.as_device_slice(), &mut dst).unwrap();
    assert_eq!(dst.to_vec().unwrap(), data);
    let zeroed = UnifiedBuffer::<u32>::zeroed(&stream, 1024).unwrap();
    assert_eq!(zeroed.attachment(), &Attach::Global);
    stream.copy_d2d(&zeroed.as_device_slice(), &mut dst).unwrap();
    assert_eq!(dst.to_vec().unwrap(), vec![0; 1024]);
    global.attach(&stream, Attach::Single(stream.clone())).unwrap();
    assert!(refused(global.as_slice().unwrap_err()));
    assert!(refused(global.as_mut_slice().unwrap_err()));
    assert!(refused(global.to_vec().unwrap_err()));
    global.attach(&stream, Attach::Host).unwrap();
    global.with_host_slice_mut(|host| host[1] = 7).unwrap();
    assert_eq!(global.to_vec().unwrap()[..2], [data[0], 7]);
    // The buffer's own device work is refused while a scoped read runs.
    global
        .with_host_slice(|_| {
            let queued = stream.copy_d2d(&global.as_device_slice(), &mut dst);
            assert!(queued.is_err_and(refused), "device work during a scoped host read");
        })
        .unwrap();
    global.as_mut_slice().unwrap()[0] = 9;
    assert_eq!(global.as_slice().unwrap()[..2], [9, 7]);
    // A device with concurrent access lends borrows of globally attached memory.
    let (_, _, concurrent) = full();
    let mut lent = UnifiedBuffer::from_slice(&concurrent, &data).unwrap();
    lent.as_mut_slice().unwrap()[0] = 3;
    assert_eq!(lent.as_slice().unwrap()[..2], [3, data[1]]);
    assert_eq!(lent.with_host_slice(<[u32]>::to_vec).unwrap()[..2], [3, data[1]]);
}

#[test]
#[parallel]
fn devices_without_managed_memory_are_not_supported_before_any_driver_call() {
    let Some((device, ctx)) = device_where(|c| !c.managed_memory) else {
        return testing::skip("needs a device without managed memory (the simulator's device 1)");
    };
    let stream = Stream::new(&ctx).unwrap();
    let ctl = testing::sim_control();
    let rule = ctl.as_ref().map(|ctl| {
        ctl.inject_fault(FaultRule {
            function: "cuMemAllocManaged".into(),
            nth: 1,
            code: CUresult::CUDA_ERROR_UNKNOWN,
            times: 0,
            this_thread_only: true,
        })
    });
    let err = UnifiedBuffer::<u32>::zeroed(&stream, 16).unwrap_err();
    assert!(
        matches!(err, Error::NotSupported { feature: Feature::ManagedMemory, device: Some(d) }
            if d == device.ordinal() as i32),
        "{err}"
    );
    assert!(matches!(UnifiedBuffer::from_slice(&stream, &[1u8]), Err(Error::NotSupported { .. })));
    if let (Some(ctl), Some(rule)) = (ctl, rule) {
        ctl.remove_fault(rule);
    }
}

#[test]
#[parallel]
fn empty_and_oversized_buffers() {
    let (device, _, stream) = full();
    let mut empty = UnifiedBuffer::<u64>::zeroed(&stream, 0).unwrap();
    assert!(empty.is_empty() && empty.as_mut_slice().unwrap().is_empty());
    empty.set_policy(MigrationPolicy::PreferHost).unwrap();
    empty.prefetch(Location::Device(device), &stream).unwrap();
    assert!(matches!(UnifiedBuffer::<u64>::zeroed(&stream, usize::MAX / 2), Err(Error::SizeOverflow { .. })));
}

/// Devices a unified buffer lives on: a row of the table below.
#[derive(Debug, Clone, Copy)]
enum Access {
    /// Managed memory with concurrent access (host access waits for the buffer's own work).
    Concurrent,
    /// Managed memory without concurrent access (the simulator's device 2; skipped where absent).
    NotConcurrent,
}

/// A copy direction: a column of the table below.
#[derive(Debug, Clone, Copy)]
enum Direction {
    /// Blocking `copy_h2d` from a host slice into the buffer.
    Upload,
    /// Blocking `copy_d2h` from the buffer into a host slice.
    Download,
    /// Blocking `copy_d2d` from device memory into the buffer.
    DeviceIn,
    /// Blocking `copy_d2d` from the buffer into device memory.
    DeviceOut,
    /// `StreamCopy::copy_d2d` into the buffer, then a host read (which must wait for it).
    QueuedIn,
    /// `StreamCopy::copy_d2d` out of the buffer, then a host write (which must wait for it).
    QueuedOut,
}

/// Unified memory in every copy direction: data round-trips bitwise, and host access after a
/// queued copy sees what it copied (the simulator's streams run 20 ms late, so a missing wait
/// reads or overwrites stale data). The host kinds' table is in cumem-copy's `host_kinds.rs`.
#[rstest]
#[parallel]
fn unified_buffers_round_trip_bitwise_in_every_direction(
    #[values(Access::Concurrent, Access::NotConcurrent)] access: Access,
    #[values(
        Direction::Upload,
        Direction::Download,
        Direction::DeviceIn,
        Direction::DeviceOut,
        Direction::QueuedIn,
        Direction::QueuedOut
    )]
    direction: Direction,
) {
    const N: usize = 1 << 12;
    let found = match access {
        Access::Concurrent => device_where(|c| c.managed_memory && c.concurrent_managed_access),
        Access::NotConcurrent => device_where(|c| c.managed_memory && !c.concurrent_managed_access),
    };
    let Some((_, ctx)) = found else {
        assert!(matches!(access, Access::NotConcurrent), "a managed-memory device");
        return testing::skip(
            "needs a managed-memory device without concurrent access (the simulator's device 2)",
        );
    };
    let stream = Stream::non_blocking(&ctx).unwrap();
    let data = pattern(N);
    let other: Vec<u32> = data.iter().map(|v| !v).collect();
    let mut unified = UnifiedBuffer::from_slice(&stream, &data).unwrap();
    let mut dev = DeviceBuffer::<u32>::zeroed(&stream, N).unwrap();
    // Without concurrent access the host may touch only memory attached to the host; the attach
    // is queued on the buffer's stream, after the copies that use it.
    let to_host = |unified: &mut UnifiedBuffer<u32>| {
        if matches!(access, Access::NotConcurrent) {
            unified.attach(&stream, Attach::Host).unwrap();
        }
    };
    match direction {
        Direction::Upload => {
            cumem_copy::copy_h2d(&other, &mut unified).unwrap();
            to_host(&mut unified);
            assert_eq!(unified.to_vec().unwrap(), other);
        }
        Direction::Download => {
            let mut out = vec![0u32; N];
            cumem_copy::copy_d2h(&unified, &mut out).unwrap();
            assert_eq!(out, data);
        }
        Direction::DeviceIn => {
            cumem_copy::copy_h2d(&other, &mut dev).unwrap();
            cumem_copy::copy_d2d(&dev, &mut unified).unwrap();
            to_host(&mut unified);
            unified.with_host_slice(|host| assert_eq!(host, &other[..])).unwrap();
        }
        Direction::DeviceOut => {
            cumem_copy::copy_d2d(&unified, &mut dev).unwrap();
            assert_eq!(dev.to_vec().unwrap(), data);
        }
        Direction::QueuedIn => {
            cumem_copy::copy_h2d(&other, &mut dev).unwrap();
            stream.copy_d2d(&dev, &mut unified).unwrap();
            to_host(&mut unified);
            unified.with_host_slice(|host| assert_eq!(host, &other[..])).unwrap(); // waits for the copy
        }
        Direction::QueuedOut => {
            stream.copy_d2d(&unified, &mut dev).unwrap();
            to_host(&mut unified);
            unified.with_host_slice_mut(|host| host.fill(0)).unwrap(); // must not overtake the device's read
            assert_eq!(dev.to_vec().unwrap(), data);
            assert_eq!(unified.to_vec().unwrap(), vec![0; N]);
        }
    }
}

#[test]
#[parallel]
fn a_buffer_dropped_inside_a_closure_is_freed_not_leaked() {
    let (_, _, stream) = full();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("reads the live report: simulator only");
    };
    let unified = UnifiedBuffer::from_slice(&stream, &[5u32; 64]).unwrap();
    let mut dev = DeviceBuffer::<u32>::zeroed(&stream, 64).unwrap();
    stream.copy_d2d(&unified, &mut dev).unwrap(); // pending device work on the unified buffer
    let ptr = unified.device_ptr();
    let other = DeviceBuffer::<u32>::zeroed(&stream, 16).unwrap();
    // The drop waits without the tracker's lock (`&mut`), which a closure would refuse: it frees
    // the memory instead of leaking it. (The copy's result does not show that wait: `cuMemFree`
    // itself waits for the device.)
    other
        .as_slice()
        .queue_on(&stream, |_| {
            drop(unified);
            Ok(())
        })
        .unwrap();
    let live = ctl.live_report();
    assert!(!live.contains_ptr(ptr), "leaked instead of freed:\n{live}");
    assert_eq!(dev.to_vec().unwrap(), [5; 64]);
}
