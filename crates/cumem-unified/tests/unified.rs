//! `UnifiedBuffer`: round trips, host access that waits for device work, attachment, advice and
//! policies read back through range attributes, prefetch plans, and devices without the capability.

use cumem_copy::StreamCopy;
use cumem_core::sys::CUresult;
use cumem_core::{Context, Device, DeviceBuffer, Error, Feature, Stream};
use cumem_sys::sim_control::{Control, FaultRule};
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
    // By id: another test's allocation may take the freed address.
    let id = testing::sim_control().map(|ctl| ctl.live_report().id_of(back.device_ptr()).expect("live"));
    drop(back);
    if let (Some(ctl), Some(id)) = (testing::sim_control(), id) {
        let live = ctl.live_report();
        assert!(!live.contains_allocation(id), "leaked instead of freed:\n{live}");
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

/// A policy change whose last hint fails to be set (an injected failure of the third advise call:
/// after both hints were removed) returns the error and puts the previous policy's hints back:
/// `policy()` and the hints read back both still name the previous policy.
#[test]
#[serial]
fn a_policy_change_that_fails_keeps_the_previous_policy() {
    let (_, _, stream) = full();
    let Some(ctl) = testing::sim_control() else { return testing::skip(INJECTS) };
    let buf = UnifiedBuffer::<f32>::zeroed(&stream, GRANULE_U32).unwrap();
    buf.set_policy(MigrationPolicy::PreferHost).unwrap();
    // Remove the old hints (two calls), set read-mostly (the third, failed).
    let rules = ["cuMemAdvise", "cuMemAdvise_v2"].map(|f| fail_once(&ctl, f, 3));
    let result = buf.set_policy(MigrationPolicy::ReadMostly);
    rules.into_iter().for_each(|r| ctl.remove_fault(r));
    assert!(result.is_err_and(|e| is_unknown(&e)), "the driver's error");
    assert_eq!(buf.policy(), MigrationPolicy::PreferHost);
    let a = buf.attributes().unwrap();
    assert_eq!((a.preferred_location, a.read_mostly), (Some(Location::Host), false), "{a:?}");
    buf.set_policy(MigrationPolicy::ReadMostly).unwrap();
    let a = buf.attributes().unwrap();
    assert_eq!((a.preferred_location, a.read_mostly), (None, true), "{a:?}");
}

#[test]
#[serial]
fn a_policy_change_whose_restore_fails_too_falls_back_to_on_demand_and_says_so() {
    use std::sync::{Arc, Mutex};
    let (_, _, stream) = full();
    let Some(ctl) = testing::sim_control() else { return testing::skip(INJECTS) };
    let buf = UnifiedBuffer::<f32>::zeroed(&stream, GRANULE_U32).unwrap();
    buf.set_policy(MigrationPolicy::PreferHost).unwrap();
    let warnings = Arc::new(Mutex::new(Vec::new()));
    let seen = warnings.clone();
    let subscriber = testing::OnEvent(move |event: &tracing::Event<'_>| {
        if *event.metadata().level() == tracing::Level::WARN {
            seen.lock().unwrap().push(testing::event_message(event));
        }
    });
    // Read-mostly's third call fails; the restore of PreferHost (calls 4-6) fails at its
    // advise (the sixth); clearing both hints (calls 7 and 8) works.
    let rules: Vec<_> = ["cuMemAdvise", "cuMemAdvise_v2"]
        .into_iter()
        .flat_map(|f| [fail_once(&ctl, f, 3), fail_once(&ctl, f, 6)])
        .collect();
    let result =
        cumem_sys::testing::with_subscriber(subscriber, || buf.set_policy(MigrationPolicy::ReadMostly));
    rules.into_iter().for_each(|r| ctl.remove_fault(r));
    assert!(result.is_err_and(|e| is_unknown(&e)), "the first error is returned");
    assert_eq!(buf.policy(), MigrationPolicy::OnDemand);
    let a = buf.attributes().unwrap();
    assert_eq!((a.preferred_location, a.read_mostly), (None, false), "{a:?}");
    let warnings = warnings.lock().unwrap();
    assert!(
        warnings.len() == 1 && warnings[0].contains("now OnDemand"),
        "one warning names the fallback: {warnings:?}"
    );
}

#[test]
#[serial]
fn prefetch_plans_run_on_a_stream() {
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

/// Opens `gate` from another thread after 100 ms, having set the returned flag first: a call that
/// returns with the flag set waited for the held stream (a call that did not wait returns at once).
fn open_later(gate: Gate) -> (std::sync::Arc<std::sync::atomic::AtomicBool>, std::thread::JoinHandle<()>) {
    let opened = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = std::sync::Arc::clone(&opened);
    let opener = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(100));
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        gate.release();
    });
    (opened, opener)
}

/// A prefetch changes no data, so on a device with concurrent managed access shared host reads
/// (`as_slice`, `to_vec`, `with_host_slice`) do not wait for it (a wait would hold until the
/// gate's deadline, which fails `release`), while exclusive host access (`as_mut_slice`) and
/// `wait_idle` do: they return only after the gate in front of the prefetch has opened.
#[test]
#[serial] // holds a gate
fn shared_reads_do_not_wait_for_a_prefetch_exclusive_access_and_wait_idle_do() {
    use std::sync::atomic::Ordering;
    let (device, _, stream) = full();
    let data = pattern(4096);
    let mut buf = UnifiedBuffer::from_slice(&stream, &data).unwrap();
    stream.context().bind().unwrap();
    // SAFETY: `stream` is alive (borrowed), its context was just made current; the test is
    // #[serial].
    let gate = unsafe { testing::hold_for(stream.raw(), std::time::Duration::from_secs(10)) };
    buf.prefetch(Location::Device(device), &stream).unwrap();
    assert_eq!(buf.as_slice().unwrap(), &data[..]);
    assert_eq!(buf.to_vec().unwrap(), data);
    buf.with_host_slice(|host| assert_eq!(host, &data[..])).unwrap();
    let (opened, opener) = open_later(gate);
    buf.wait_idle().unwrap();
    assert!(opened.load(Ordering::SeqCst), "wait_idle returned before the prefetch ran");
    opener.join().unwrap();
    let gate = hold(&stream);
    buf.prefetch(Location::Host, &stream).unwrap();
    let (opened, opener) = open_later(gate);
    let host = buf.as_mut_slice().unwrap();
    assert!(opened.load(Ordering::SeqCst), "as_mut_slice returned before the prefetch ran");
    host[0] = 7;
    opener.join().unwrap();
    assert_eq!(buf.to_vec().unwrap()[..2], [7, data[1]]);
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
    assert!(
        not_supported(buf.unadvise(Advice::AccessedBy(Location::Device(device))).unwrap_err()),
        "removing a hint that could not have been set is refused alike"
    );
    assert!(not_supported(buf.set_policy(MigrationPolicy::PreferDevice(device)).unwrap_err()));
    assert!(not_supported(buf.prefetch(Location::Device(device), &stream).unwrap_err()));
    assert!(
        not_supported(buf.prefetch(Location::Host, &stream).unwrap_err()),
        "any prefetch needs it on the stream's device"
    );
    assert!(
        not_supported(buf.prefetch_range(..0, Location::Host, &stream).unwrap_err()),
        "an empty prefetch too: the answer does not depend on the length"
    );
    assert!(not_supported(PrefetchPlan::new().execute(&stream).unwrap_err()), "an empty plan too");
    assert_eq!(buf.policy(), MigrationPolicy::OnDemand, "a refused policy changes nothing");
    if let (Some(ctl), Some(rules)) = (ctl, rules) {
        rules.into_iter().for_each(|r| ctl.remove_fault(r));
    }
    buf.set_policy(MigrationPolicy::PreferHost).unwrap();
    assert_eq!(buf.attributes().unwrap().preferred_location, Some(Location::Host));
}

/// On a device without concurrent managed access, any device work (for memory attached globally)
/// or any work on the attached stream (attached to one) faults the host's access to the memory,
/// and the buffer sees only its own work: borrows whose end it cannot see are refused there
/// (`NotSupported { feature: ConcurrentManagedAccess }`, before any wait), while the scoped
/// accessors attach the memory to the host for their duration (the tests below) and the
/// constructors write it through a host attachment. Memory attached to the host lends borrows,
/// since no device work may use it; so does every attachment on a device with concurrent access.
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
    let id = ctl.live_report().id_of(unified.device_ptr()).expect("live");
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
    assert!(!live.contains_allocation(id), "leaked instead of freed:\n{live}");
    assert_eq!(dev.to_vec().unwrap(), [5; 64]);
}

/// `CU_MEM_ATTACH_GLOBAL`, `CU_MEM_ATTACH_HOST`, `CU_MEM_ATTACH_SINGLE`.
const GLOBAL: u32 = 1;
const HOST: u32 = 2;
const SINGLE: u32 = 4;

const NEEDS_NOT_CONCURRENT: &str =
    "needs a managed-memory device without concurrent access (the simulator's device 2)";

/// A managed-memory device without concurrent access (the simulator's device 2), and a stream on it;
/// `None` (the test skipped) where there is none.
fn not_concurrent() -> Option<(Device, Stream)> {
    let Some((device, ctx)) = device_where(|c| c.managed_memory && !c.concurrent_managed_access) else {
        testing::skip(NEEDS_NOT_CONCURRENT);
        return None;
    };
    Some((device, Stream::non_blocking(&ctx).unwrap()))
}

/// [`not_concurrent`] and the simulator's control, for the tests that read the simulator's records
/// or inject faults; `None` (the test skipped, saying `why` it needs the simulator) where either is
/// missing.
fn not_concurrent_on_sim(why: &str) -> Option<(Device, Stream, Control)> {
    let (device, stream) = not_concurrent()?;
    let Some(ctl) = testing::sim_control() else {
        testing::skip(why);
        return None;
    };
    Some((device, stream, ctl))
}

/// What most tests of a device without concurrent managed access start from.
struct Setup {
    device: Device,
    stream: Stream,
    ctl: Control,
    /// What `buf` holds.
    data: Vec<u32>,
    /// 1024 values attached globally, or (`single`) to `stream`.
    buf: UnifiedBuffer<u32>,
    /// `buf`'s address.
    ptr: u64,
    /// `buf`'s `CU_MEM_ATTACH_*` flags.
    original: u32,
    /// Where device work copies `buf` to.
    dst: DeviceBuffer<u32>,
}

/// The [`Setup`] of a test that needs the simulator (`why`); `None` where the test is skipped.
fn setup(single: bool, why: &str) -> Option<Setup> {
    let (device, stream, ctl) = not_concurrent_on_sim(why)?;
    let data = pattern(1024);
    let buf = attached(&stream, &data, single);
    let (ptr, original) = (buf.device_ptr(), flags_of(buf.attachment()));
    let dst = DeviceBuffer::<u32>::zeroed(&stream, 1024).unwrap();
    Some(Setup { device, stream, ctl, data, buf, ptr, original, dst })
}

const INJECTS: &str = "injects driver failures: simulator only";

/// Device work that reads `buf` on `stream` (into `dst`) is refused on `device`.
#[track_caller]
fn assert_device_reads_refused(
    device: Device,
    stream: &Stream,
    buf: &UnifiedBuffer<u32>,
    dst: &mut DeviceBuffer<u32>,
    why: &str,
) {
    let queued = stream.copy_d2d(&buf.as_device_slice(), dst);
    assert!(queued.is_err_and(refused_on(device)), "{why}");
}

/// Device work that reads `buf` on `stream` goes on: `dst` receives `data`.
#[track_caller]
fn assert_device_reads_go_on(
    stream: &Stream,
    buf: &UnifiedBuffer<u32>,
    dst: &mut DeviceBuffer<u32>,
    data: &[u32],
    why: &str,
) {
    stream.copy_d2d(&buf.as_device_slice(), dst).unwrap();
    assert_eq!(dst.to_vec().unwrap(), data, "{why}");
}

/// A buffer of `data` attached globally, or (`single`) to `stream`.
fn attached(stream: &Stream, data: &[u32], single: bool) -> UnifiedBuffer<u32> {
    let mut buf = UnifiedBuffer::from_slice(stream, data).unwrap();
    if single {
        buf.attach(stream, Attach::Single(stream.clone())).unwrap();
    }
    buf
}

/// The `CU_MEM_ATTACH_*` flags of `attach`.
fn flags_of(attach: &Attach) -> u32 {
    match attach {
        Attach::Global => GLOBAL,
        Attach::Host => HOST,
        Attach::Single(_) => SINGLE,
    }
}

/// The simulator's record of the managed allocation at `ptr`: the `CU_MEM_ATTACH_*` flags and the
/// stream of the attachment in effect, which a `cuStreamAttachMemAsync` changes only once it has
/// run in its stream's order (so a caller that queued one waits for its stream first). (The real
/// driver reports no attachment: no pointer or range attribute names it.)
fn attachment_in_sim(ctl: &Control, ptr: u64) -> (u32, Option<u64>) {
    let live = ctl.live_report();
    let alloc = live.allocations.iter().find(|a| a.ptr == ptr).expect("a live managed allocation");
    (alloc.attach.expect("managed allocations report their attachment"), alloc.attach_stream)
}

/// The refusal of device work and host borrows that must not overlap on `device`.
fn refused_on(device: Device) -> impl Fn(Error) -> bool {
    move |e| matches!(e, Error::NotSupported { feature: Feature::ConcurrentManagedAccess, device: Some(d) } if d == device.ordinal() as i32)
}

/// Waits until `count` reaches `n` (5 s at most, then panics: a rendezvous that never comes).
fn meet(count: &std::sync::atomic::AtomicUsize, n: usize) {
    use std::sync::atomic::Ordering;
    count.fetch_add(1, Ordering::SeqCst);
    let start = std::time::Instant::now();
    while count.load(Ordering::SeqCst) < n {
        assert!(start.elapsed() < std::time::Duration::from_secs(5), "the other reader never came");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// On a device without concurrent managed access, the scoped accessors of memory attached globally
/// or to a stream attach it to the host while they run (after the buffer's device work: the
/// stream runs 20 ms late, so a missing wait reads stale data), and restore the attachment after:
/// the data round-trips, the attachment afterwards is the one asked for (`attachment()` and the
/// simulator's record agree), device work goes on, and the unscoped borrows stay refused.
#[rstest]
#[parallel]
fn scoped_host_access_attaches_to_the_host_and_back(#[values(false, true)] single: bool) {
    let Some((device, stream)) = not_concurrent() else { return };
    let sim = testing::sim_control();
    let data = pattern(4096);
    let other: Vec<u32> = data.iter().map(|v| !v).collect();
    let mut buf = attached(&stream, &data, single);
    let original = buf.attachment().clone();
    let ptr = buf.device_ptr();
    let src = DeviceBuffer::from_slice(&stream, &other).unwrap();
    stream.copy_d2d(&src, &mut buf).unwrap();
    assert_eq!(buf.to_vec().unwrap(), other, "to_vec waits for the queued copy");
    buf.with_host_slice(|host| {
        assert_eq!(host, &other[..]);
        if let Some(ctl) = &sim {
            assert_eq!(attachment_in_sim(ctl, ptr).0, HOST, "read while attached to the host");
        }
    })
    .unwrap();
    buf.with_host_slice_mut(|host| {
        host[0] = 7;
        host[4095] = 9;
        if let Some(ctl) = &sim {
            assert_eq!(attachment_in_sim(ctl, ptr).0, HOST, "written while attached to the host");
        }
    })
    .unwrap();
    let mut expected = other.clone();
    expected[0] = 7;
    expected[4095] = 9;
    assert_eq!(buf.to_vec().unwrap(), expected);
    assert_eq!(buf.attachment(), &original);
    if let Some(ctl) = &sim {
        let (flags, on) = attachment_in_sim(ctl, ptr);
        assert_eq!(flags, flags_of(&original), "the attachment is restored");
        if single {
            assert_eq!(on, Some(stream.raw() as u64), "attached to its stream again");
        }
    }
    let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 4096).unwrap();
    stream.copy_d2d(&buf, &mut dst).unwrap();
    assert_eq!(dst.to_vec().unwrap(), expected, "device work goes on after the scoped accesses");
    let refused = refused_on(device);
    assert!(refused(buf.as_slice().unwrap_err()));
    assert!(refused(buf.as_mut_slice().unwrap_err()));
}

/// Concurrent scoped readers on two threads share one temporary host attachment: the first in
/// attaches, the last out restores (two `cuStreamAttachMemAsync` calls in all), every reader sees
/// the memory attached to the host, and the buffer's device work stays refused until the last
/// reader has left, which the first one to leave must not cut short.
#[rstest]
#[parallel]
fn concurrent_scoped_readers_attach_once_and_restore_once(#[values(false, true)] single: bool) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let Some((device, stream, ctl)) = not_concurrent_on_sim("counts driver calls: simulator only") else {
        return;
    };
    let data = pattern(2048);
    let buf = attached(&stream, &data, single);
    let ptr = buf.device_ptr();
    let attaches = || {
        ctl.calls_on_this_thread("cuStreamAttachMemAsync")
            + ctl.calls_on_this_thread("cuStreamAttachMemAsync_ptsz")
    };
    let (inside, first_left) = (AtomicUsize::new(0), AtomicBool::new(false));
    let refused = refused_on(device);
    let total: u64 = std::thread::scope(|s| {
        let readers: Vec<_> = (0..2)
            .map(|i| {
                let (buf, data, inside, first_left, refused) = (&buf, &data, &inside, &first_left, &refused);
                let (ctl, attaches, stream) = (&ctl, &attaches, &stream);
                s.spawn(move || {
                    let mut dst = DeviceBuffer::<u32>::zeroed(stream, 2048).unwrap();
                    let before = attaches();
                    buf.with_host_slice(|host| {
                        meet(inside, 2); // both readers are inside at once
                        assert_eq!(host, &data[..]);
                        assert_eq!(attachment_in_sim(ctl, ptr).0, HOST);
                        if i == 1 {
                            // Reader 0 has left; this one still reads.
                            let start = std::time::Instant::now();
                            while !first_left.load(Ordering::SeqCst) {
                                assert!(start.elapsed().as_secs() < 5, "reader 0 never left");
                                std::thread::sleep(std::time::Duration::from_millis(1));
                            }
                            assert_eq!(attachment_in_sim(ctl, ptr).0, HOST, "restored under a reader");
                            assert_eq!(host, &data[..]);
                            let queued = stream.copy_d2d(&buf.as_device_slice(), &mut dst);
                            assert!(queued.is_err_and(refused), "device work while a reader is inside");
                        }
                    })
                    .unwrap();
                    if i == 0 {
                        first_left.store(true, Ordering::SeqCst);
                    }
                    attaches() - before
                })
            })
            .collect();
        readers.into_iter().map(|r| r.join().unwrap()).sum()
    });
    assert_eq!(total, 2, "one attach to the host and one restore, for both readers");
    assert_eq!(attachment_in_sim(&ctl, ptr).0, flags_of(buf.attachment()));
    let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 2048).unwrap();
    stream.copy_d2d(&buf, &mut dst).unwrap();
    assert_eq!(dst.to_vec().unwrap(), data, "device work goes on once both have left");
}

/// A scoped access whose closure panics restores the attachment while unwinding: the buffer's
/// device work goes on, and the next scoped access attaches to the host again.
#[rstest]
#[parallel]
fn a_panicking_scoped_access_restores_the_attachment(#[values(false, true)] single: bool) {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let why = "reads the simulator's record of the attachment: simulator only";
    let Some(Setup { stream, ctl, data, mut buf, ptr, original, mut dst, .. }) = setup(single, why) else {
        return;
    };
    let read = catch_unwind(AssertUnwindSafe(|| buf.with_host_slice(|_| panic!("a reader panics"))));
    assert!(read.is_err());
    assert_eq!(attachment_in_sim(&ctl, ptr).0, original, "restored by the unwinding reader");
    stream.copy_d2d(&buf, &mut dst).unwrap();
    assert_eq!(dst.to_vec().unwrap(), data);
    let write = catch_unwind(AssertUnwindSafe(|| {
        buf.with_host_slice_mut(|host| {
            host[0] = 1;
            panic!("a writer panics")
        })
    }));
    assert!(write.is_err());
    assert_eq!(attachment_in_sim(&ctl, ptr).0, original, "restored by the unwinding writer");
    buf.with_host_slice(|host| {
        assert_eq!(attachment_in_sim(&ctl, ptr).0, HOST, "attached again by the next reader");
        assert_eq!((host[0], host[1]), (1, data[1]));
    })
    .unwrap();
    assert_eq!(attachment_in_sim(&ctl, ptr).0, original);
}

/// Runs `access`, counting the `cuStreamAttachMemAsync` and `cuStreamSynchronize` calls it makes
/// on this thread: `(its value, attaches, syncs)`.
fn counted<R>(ctl: &Control, access: impl FnOnce() -> R) -> (R, u64, u64) {
    let attaches = || {
        ctl.calls_on_this_thread("cuStreamAttachMemAsync")
            + ctl.calls_on_this_thread("cuStreamAttachMemAsync_ptsz")
    };
    let syncs = || {
        ctl.calls_on_this_thread("cuStreamSynchronize") + ctl.calls_on_this_thread("cuStreamSynchronize_ptsz")
    };
    let before = (attaches(), syncs());
    let value = access();
    (value, attaches() - before.0, syncs() - before.1)
}

/// Fails the `nth` next call of `function` on this thread once, with `CUDA_ERROR_UNKNOWN`.
fn fail_once(ctl: &Control, function: &str, nth: u64) -> cumem_sys::sim_control::FaultId {
    fail(ctl, function, nth, 1)
}

/// Fails the `nth` next call of `function` on this thread, and every later one until the rule is
/// removed, with `CUDA_ERROR_UNKNOWN`.
fn fail_from(ctl: &Control, function: &str, nth: u64) -> cumem_sys::sim_control::FaultId {
    fail(ctl, function, nth, 0)
}

/// Fails the `nth` next call of `function` on this thread with `CUDA_ERROR_UNKNOWN`, `times` times
/// (0: until the rule is removed).
fn fail(ctl: &Control, function: &str, nth: u64, times: u64) -> cumem_sys::sim_control::FaultId {
    let code = CUresult::CUDA_ERROR_UNKNOWN;
    ctl.inject_fault(FaultRule { function: function.into(), nth, code, times, this_thread_only: true })
}

fn is_unknown(e: &Error) -> bool {
    matches!(e, Error::Cuda { code: CUresult::CUDA_ERROR_UNKNOWN, .. })
}

/// A failed attach to the host (an injected `cuStreamAttachMemAsync` failure), or a failed wait
/// for it (an injected failure of the first `cuStreamSynchronize` after it), returns the driver's
/// error without running the closure, and leaves the attachment as it was (the failed wait's
/// access queues the restore: two attach calls in all): device work and later accesses go on. The
/// wait for the attachment is the first sync after the waits an access makes before attaching,
/// which an access whose attach call fails counts; a missing wait moves the failure to the
/// restore's wait, after the closure ran.
#[rstest]
#[parallel]
fn a_failed_host_attachment_runs_nothing_and_keeps_the_attachment(#[values(false, true)] single: bool) {
    let Some(Setup { stream, ctl, data, buf, ptr, original, mut dst, .. }) = setup(single, INJECTS) else {
        return;
    };
    let mut goes_on = || {
        assert_eq!(attachment_in_sim(&ctl, ptr).0, original, "the attachment is as it was");
        stream.copy_d2d(&buf, &mut dst).unwrap();
        assert_eq!(dst.to_vec().unwrap(), data, "device work goes on");
        assert_eq!(buf.to_vec().unwrap(), data);
    };
    // A scoped read with the `nth` next call of `function` failed: `(ran, attaches, syncs)`.
    let failed_read = |function: &str, nth: u64| {
        let mut ran = false;
        let rule = fail_once(&ctl, function, nth);
        let (result, attaches, syncs) = counted(&ctl, || buf.with_host_slice(|_| ran = true));
        ctl.remove_fault(rule);
        assert!(result.is_err_and(|e| is_unknown(&e)));
        (ran, attaches, syncs)
    };
    let (ran, attaches, syncs_before_attach) = failed_read("cuStreamAttachMemAsync", 1);
    assert!(!ran, "the closure must not run without the host attachment");
    assert_eq!(attaches, 1, "a failed attach queues nothing to restore");
    goes_on();
    let (ran, attaches, _) = failed_read("cuStreamSynchronize", syncs_before_attach + 1);
    assert!(!ran, "the closure must not run before the host attachment took effect");
    assert_eq!(attaches, 2, "the attach to the host and the restore");
    goes_on();
}

/// A scoped access of `buf` whose restore's wait (its last `cuStreamSynchronize`, counted in a
/// whole access first) fails: the error is returned after the closure ran, and the buffer is
/// stranded. Returns what the closure read.
fn strand_by_failed_restore_wait(ctl: &Control, buf: &UnifiedBuffer<u32>) -> Vec<u32> {
    let (read, attaches, syncs) = counted(ctl, || buf.to_vec().unwrap());
    assert_eq!(attaches, 2, "the attach to the host and the restore");
    let rule = fail_once(ctl, "cuStreamSynchronize", syncs);
    let mut ran = Vec::new();
    let (result, attaches, _) = counted(ctl, || buf.with_host_slice(|host| ran = host.to_vec()));
    ctl.remove_fault(rule);
    assert!(result.is_err_and(|e| is_unknown(&e)));
    assert_eq!(ran, read, "the closure ran before the restore");
    assert_eq!(attaches, 2, "the attach to the host and the restore");
    ran
}

/// A failed wait for the restore (an injected failure of the last `cuStreamSynchronize` of a
/// scoped access) returns the error after the closure ran and strands the buffer: its device work
/// is refused until a later access restores the attachment (`end_host_reads` queues it again,
/// one attach call), after which device work goes on. A missing wait moves the failure to the
/// attach's wait, before the closure.
#[rstest]
#[parallel]
fn a_failed_wait_for_the_restore_strands_the_buffer(#[values(false, true)] single: bool) {
    let Some(Setup { device, stream, ctl, data, mut buf, ptr, original, mut dst }) = setup(single, INJECTS)
    else {
        return;
    };
    assert_eq!(strand_by_failed_restore_wait(&ctl, &buf), data);
    assert_device_reads_refused(device, &stream, &buf, &mut dst, "device work of a stranded buffer");
    let ((), attaches, _) = counted(&ctl, || buf.end_host_reads());
    assert_eq!(attaches, 1, "the exclusive access restores the attachment");
    assert_eq!(attachment_in_sim(&ctl, ptr).0, original);
    assert_device_reads_go_on(&stream, &buf, &mut dst, &data, "device work goes on once restored");
    let ((), attaches, _) = counted(&ctl, || buf.end_host_reads());
    assert_eq!(attaches, 0, "restored once");
}

/// A failed restore (an injected failure of the second `cuStreamAttachMemAsync` of a scoped
/// access) returns the error after the closure ran and leaves the memory attached to the host:
/// the buffer's device work is refused from then on, through shared and exclusive views alike,
/// until an exclusive access restores the attachment (`end_host_reads` tries again).
#[rstest]
#[parallel]
fn a_failed_restore_refuses_device_work_until_the_attachment_is_restored(
    #[values(false, true)] single: bool,
) {
    let Some(Setup { device, stream, ctl, data, mut buf, ptr, original, mut dst }) = setup(single, INJECTS)
    else {
        return;
    };
    let refused = refused_on(device);
    let src = DeviceBuffer::from_slice(&stream, &data).unwrap();
    // From the second call on (the restore), every attach fails until the rule is removed.
    let rule = fail_from(&ctl, "cuStreamAttachMemAsync", 2);
    let mut read = Vec::new();
    let err = buf.with_host_slice(|host| read = host.to_vec()).unwrap_err();
    assert!(matches!(err, Error::Cuda { code: CUresult::CUDA_ERROR_UNKNOWN, .. }), "{err:?}");
    assert_eq!(read, data, "the closure ran");
    assert_eq!(attachment_in_sim(&ctl, ptr).0, HOST, "stranded on the host");
    assert_eq!(buf.attachment(), &if single { Attach::Single(stream.clone()) } else { Attach::Global });
    assert_device_reads_refused(
        device,
        &stream,
        &buf,
        &mut dst,
        "device reads of memory stranded on the host",
    );
    buf.end_host_reads(); // the restore fails again
    let queued = stream.copy_d2d(&src, &mut buf);
    assert!(queued.is_err_and(&refused), "device writes of memory stranded on the host");
    assert_eq!(attachment_in_sim(&ctl, ptr).0, HOST);
    ctl.remove_fault(rule);
    buf.end_host_reads(); // restores the attachment, then lets device work through
    assert_eq!(attachment_in_sim(&ctl, ptr).0, original, "restored");
    assert_device_reads_go_on(&stream, &buf, &mut dst, &data, "device work goes on once restored");
    assert_eq!(buf.to_vec().unwrap(), data);
}

/// A later shared scoped access that succeeds restores a stranded attachment as it ends (two
/// attach calls, and an exclusive access has none left to make), but the buffer's device work
/// stays refused until an exclusive access.
#[rstest]
#[parallel]
fn a_later_reader_restores_a_stranded_attachment(#[values(false, true)] single: bool) {
    let Some(Setup { device, stream, ctl, data, mut buf, ptr, original, mut dst }) = setup(single, INJECTS)
    else {
        return;
    };
    strand_by_failed_restore_wait(&ctl, &buf);
    let (read, attaches, _) = counted(&ctl, || buf.to_vec().unwrap());
    assert_eq!(read, data);
    assert_eq!(attaches, 2, "the attach to the host and the restore");
    assert_eq!(attachment_in_sim(&ctl, ptr).0, original);
    assert_device_reads_refused(device, &stream, &buf, &mut dst, "refused until an exclusive access");
    let ((), attaches, _) = counted(&ctl, || buf.end_host_reads());
    assert_eq!(attaches, 0, "the reader restored the attachment");
    assert_device_reads_go_on(&stream, &buf, &mut dst, &data, "device work goes on once restored");
}

/// A scoped access whose wait for the host attachment fails (an injected failure of that
/// `cuStreamSynchronize`) and whose restore fails too (every attach from the second on) logs the
/// failed restore with the buffer's `visits` lock let go: a subscriber that reads the buffer from
/// inside the warning (which locks it again, on the same thread) gets an answer instead of hanging
/// the thread. Under a watchdog, since the bug hangs rather than fails.
#[rstest]
#[parallel]
fn a_failed_restore_is_logged_to_a_subscriber_that_reads_the_buffer(#[values(false, true)] single: bool) {
    use std::sync::{Arc, Mutex};
    testing::within_watchdog(
        "a scoped read whose restore fails, with a subscriber reading the buffer",
        move || {
            let Some(Setup { ctl, data, buf, .. }) = setup(single, INJECTS) else { return };
            let buf = Arc::new(buf);
            // The wait for the host attachment: the one before the restore's, the last of an access.
            let ((), _, syncs) = counted(&ctl, || assert_eq!(buf.to_vec().unwrap(), data));
            let inner: Arc<Mutex<Vec<(String, bool)>>> = Arc::default();
            let subscriber = {
                let (buf, inner) = (Arc::clone(&buf), Arc::clone(&inner));
                testing::OnEvent(move |event: &tracing::Event<'_>| {
                    let message = testing::event_message(event);
                    if message.contains("restoring") {
                        // Every attach fails on this thread: the read is refused, not hung.
                        let read = buf.to_vec();
                        inner.lock().unwrap().push((message, read.is_err_and(|e| is_unknown(&e))));
                    }
                })
            };
            let waits = fail_once(&ctl, "cuStreamSynchronize", syncs - 1);
            let attaches = fail_from(&ctl, "cuStreamAttachMemAsync", 2);
            let mut ran = false;
            let result =
                cumem_sys::testing::with_subscriber(subscriber, || buf.with_host_slice(|_| ran = true));
            ctl.remove_fault(attaches);
            ctl.remove_fault(waits);
            assert!(result.is_err_and(|e| is_unknown(&e)), "the wait's error");
            assert!(!ran, "the closure must not run without the host attachment");
            let inner = inner.lock().unwrap().clone();
            assert_eq!(inner.len(), 1, "one failed restore logged: {inner:?}");
            assert!(inner[0].1, "the read inside the event failed to attach: {inner:?}");
            // Stranded, and a later reader restores the attachment.
            assert_eq!(buf.to_vec().unwrap(), data);
        },
    );
}

/// Memory attached globally is attached to the host and back on a private non-blocking stream: a
/// scoped access waits for the buffer's own work (last on another stream), but not for unrelated
/// work held on the stream the buffer was allocated on, nor on the legacy stream (held here with a
/// gate, whose deadline fails the test if the access waited).
#[rstest]
#[serial] // holds a gate
fn a_scoped_access_of_globally_attached_memory_waits_for_no_unrelated_work(
    #[values(false, true)] legacy: bool,
) {
    let Some((_, stream)) = not_concurrent() else { return };
    let data = pattern(1024);
    let mut buf = attached(&stream, &data, false);
    let other = Stream::non_blocking(stream.context()).unwrap();
    let src = DeviceBuffer::from_slice(&other, &data).unwrap();
    other.copy_d2d(&src, &mut buf).unwrap();
    assert_eq!(buf.to_vec().unwrap(), data, "the buffer's own work has completed");
    stream.context().bind().unwrap();
    let held = if legacy { std::ptr::null_mut() } else { stream.raw() };
    // SAFETY: `stream` is alive (or null: the legacy stream), its context was just made current;
    // the test is #[serial].
    let gate = unsafe { testing::hold_for(held, std::time::Duration::from_secs(5)) };
    assert_eq!(buf.to_vec().unwrap(), data);
    gate.release();
}

/// A stranded buffer's drop waits for the attachments a failed restore may have left queued on
/// the visit stream (one more `cuStreamSynchronize` than the drop of a twin that is not stranded)
/// before it frees the memory: nothing is leaked.
#[rstest]
#[parallel]
fn a_stranded_buffer_is_freed_after_its_queued_attachments(#[values(false, true)] single: bool) {
    let Some((_, stream, ctl)) = not_concurrent_on_sim(INJECTS) else { return };
    let data = pattern(1024);
    let (stranded, twin) = (attached(&stream, &data, single), attached(&stream, &data, single));
    // By id: another test's managed allocation may take a freed address at once.
    let before = ctl.live_report();
    let ids = [stranded.device_ptr(), twin.device_ptr()].map(|ptr| before.id_of(ptr).expect("live"));
    strand_by_failed_restore_wait(&ctl, &stranded);
    assert_eq!(twin.to_vec().unwrap(), data);
    let ((), _, twin_syncs) = counted(&ctl, || drop(twin));
    let ((), _, syncs) = counted(&ctl, || drop(stranded));
    assert_eq!(syncs, twin_syncs + 1, "the drop waits for the visit stream");
    let live = ctl.live_report();
    for id in ids {
        assert!(!live.contains_allocation(id), "leaked instead of freed:\n{live}");
    }
}

/// When the drop's wait for a stranded buffer's visit stream fails (an injected failure of its
/// last `cuStreamSynchronize`), the memory is leaked rather than freed under the attachments that
/// may still be queued: it stays in the simulator's live report (and is freed by hand here).
#[rstest]
#[parallel]
fn a_stranded_buffer_whose_wait_fails_is_leaked_not_freed(#[values(false, true)] single: bool) {
    let Some((_, stream, ctl)) = not_concurrent_on_sim(INJECTS) else { return };
    let data = pattern(1024);
    let (stranded, twin) = (attached(&stream, &data, single), attached(&stream, &data, single));
    let control = attached(&stream, &data, single);
    let (ptr, control_ptr) = (stranded.device_ptr(), control.device_ptr());
    let before = ctl.live_report();
    let (id, control_id) = (before.id_of(ptr).expect("live"), before.id_of(control_ptr).expect("live"));
    strand_by_failed_restore_wait(&ctl, &stranded);
    strand_by_failed_restore_wait(&ctl, &control);
    assert_eq!(twin.to_vec().unwrap(), data);
    let ((), _, twin_syncs) = counted(&ctl, || drop(twin));
    // The stranded drop makes one more wait than its twin's, the last: the visit stream's (so
    // that the failure injected below hits that wait, as a fault-free stranded drop shows).
    let ((), _, control_syncs) = counted(&ctl, || drop(control));
    assert_eq!(control_syncs, twin_syncs + 1, "a stranded drop waits once more, for the visit stream");
    let live = ctl.live_report();
    assert!(!live.contains_allocation(control_id), "a fault-free stranded drop leaked:\n{live}");
    let rule = fail_once(&ctl, "cuStreamSynchronize", twin_syncs + 1);
    drop(stranded);
    ctl.remove_fault(rule);
    let live = ctl.live_report();
    assert!(
        live.contains_allocation(id),
        "freed although its queued attachments were not waited for:\n{live}"
    );
    stream.context().bind().unwrap();
    stream.synchronize().unwrap();
    // SAFETY: `ptr` is the managed allocation the dropped buffer leaked; nothing else uses or
    // frees it, and its stream work has completed (synchronised just above).
    assert_eq!(unsafe { cumem_core::sys::cuMemFree_v2(ptr) }, CUresult::CUDA_SUCCESS);
}

/// `attach` on a stranded buffer restores the stranded attachment first (two attach calls: the
/// restore, then the one asked for); while the restore fails it returns the error and attaches
/// nothing, and device work stays refused.
#[rstest]
#[parallel]
fn attach_restores_a_stranded_attachment_first(#[values(false, true)] single: bool) {
    let Some(Setup { device, stream, ctl, data, mut buf, ptr, mut dst, .. }) = setup(single, INJECTS) else {
        return;
    };
    let original = buf.attachment().clone();
    let target = if single { Attach::Global } else { Attach::Single(stream.clone()) };
    strand_by_failed_restore_wait(&ctl, &buf);
    let rule = fail_from(&ctl, "cuStreamAttachMemAsync", 1);
    let (result, attaches, _) = counted(&ctl, || buf.attach(&stream, target.clone()));
    ctl.remove_fault(rule);
    assert!(result.is_err_and(|e| is_unknown(&e)));
    assert_eq!(attaches, 1, "the failed restore only");
    assert_eq!(buf.attachment(), &original);
    assert_device_reads_refused(device, &stream, &buf, &mut dst, "still stranded");
    let (result, attaches, _) = counted(&ctl, || buf.attach(&stream, target.clone()));
    result.unwrap();
    assert_eq!(attaches, 2, "the restore, then the attachment asked for");
    assert_eq!(buf.attachment(), &target);
    // `attach` queues the attachment (in stream order, like the driver call) without waiting.
    stream.synchronize().unwrap();
    assert_eq!(attachment_in_sim(&ctl, ptr).0, flags_of(&target));
    assert_device_reads_go_on(&stream, &buf, &mut dst, &data, "device work goes on once restored");
    assert_eq!(buf.to_vec().unwrap(), data);
}
