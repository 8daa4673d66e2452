//! Platform and device detection, and each strategy's refusal on a device that cannot run it.
//! Device 1 is WSL2-like (no concurrent managed access, as the simulator's
//! `concurrent_managed_access=0` configures it); device 2 can neither map host memory nor manage
//! memory (only explicit copies reach it); device 3 has managed memory but cannot map host memory.

use std::time::Duration;

use cumem_channel::{
    ChannelError, Direction, MemoryVisibility, Platform, Refusal, RingChannel, StrategyKind,
    TransferStrategy, VisibilityReport,
};
use cumem_core::{Device, Stream};
use cumem_sys::testing;

const SIM: &str = "devices=4,latency_us=300,dev3.can_map_host_memory=0,dev1.concurrent_managed_access=0,\
                   dev2.can_map_host_memory=0,dev2.managed_memory=0,dev2.concurrent_managed_access=0,\
                   dev0.host_native_atomic_supported=1";

const NATIVE: &str = "6.8.0-45-generic";
const WSL2: &str = "5.15.153.1-microsoft-standard-WSL2";

fn device(ordinal: usize) -> Device {
    testing::init_with(SIM);
    Device::get(ordinal).unwrap()
}

/// Whether the simulator, with the devices [`SIM`] describes, is the driver (a skip otherwise).
fn sim_only() -> bool {
    testing::init_with(SIM);
    let simulated = testing::sim_control().is_some();
    if !simulated {
        testing::skip("checks the simulator's configured devices: simulator only");
    }
    simulated
}

#[test]
fn os_strings_name_the_platform() {
    assert_eq!(Platform::from_os_string(WSL2), Platform::Wsl2);
    assert_eq!(
        Platform::from_os_string("Linux version 5.15.90.1-microsoft-standard-WSL2 (gcc)"),
        Platform::Wsl2
    );
    assert_eq!(Platform::from_os_string("4.4.0-19041-Microsoft"), Platform::Wsl2);
    assert_eq!(Platform::from_os_string(NATIVE), Platform::NativeLinux);
    assert_eq!(Platform::from_os_string(""), Platform::Unknown);
    // Not a Linux kernel's release or version: the cautious choice.
    assert_eq!(Platform::from_os_string("Darwin Kernel Version 23.1.0"), Platform::Unknown);
    assert_eq!(Platform::from_os_string("FreeBSD 14.0-RELEASE"), Platform::Unknown);
}

#[test]
fn native_linux_with_concurrent_access_is_system_scope() {
    if !sim_only() {
        return;
    }
    let r = VisibilityReport::detect_with_os(device(0), NATIVE).unwrap();
    assert_eq!(r.visibility, MemoryVisibility::SystemScope);
    assert!(r.concurrent_managed_access && r.host_mapping && r.managed_memory);
    assert!(r.host_native_atomics, "dev0.host_native_atomic_supported=1 is read");
    assert!(!r.pageable_memory_access);
    assert!(matches!(TransferStrategy::detect_from(&r).unwrap(), TransferStrategy::MappedPolling { .. }));
    // The same device under WSL2 is device scope only: mapped polling is refused, copies chosen.
    let w = VisibilityReport::detect_with_os(device(0), WSL2).unwrap();
    assert_eq!((w.platform, w.visibility), (Platform::Wsl2, MemoryVisibility::DeviceScope));
    assert_eq!(TransferStrategy::detect_from(&w).unwrap().kind(), StrategyKind::Async);
}

#[test]
fn a_wsl2_like_device_is_device_scope_whatever_the_os_says() {
    if !sim_only() {
        return;
    }
    let r = VisibilityReport::detect_with_os(device(1), NATIVE).unwrap();
    assert!(!r.concurrent_managed_access);
    assert_eq!(r.visibility, MemoryVisibility::DeviceScope);
    assert_eq!(TransferStrategy::detect_from(&r).unwrap().kind(), StrategyKind::Async);
    let d = VisibilityReport::detect_with_os(device(2), NATIVE).unwrap();
    assert_eq!(d.visibility, MemoryVisibility::DmaOnly);
    assert_eq!(TransferStrategy::detect_from(&d).unwrap().kind(), StrategyKind::Async);
    // Managed memory without mapped memory is still explicit DMA for a running kernel.
    let m = VisibilityReport::detect_with_os(device(3), NATIVE).unwrap();
    assert!(m.managed_memory && m.concurrent_managed_access && !m.host_mapping);
    assert_eq!(m.visibility, MemoryVisibility::DmaOnly);
    assert_eq!(TransferStrategy::detect_from(&m).unwrap().kind(), StrategyKind::Async);
}

fn refusal(ordinal: usize, os: &str, strategy: TransferStrategy) -> Option<Refusal> {
    let d = device(ordinal);
    let stream = Stream::non_blocking(&d.context().unwrap()).unwrap();
    let report = VisibilityReport::detect_with_os(d, os).unwrap();
    let kind = strategy.kind();
    let on_device = || {
        let report = testing::sim_control().unwrap().live_report();
        report.allocations.iter().filter(|a| a.device == ordinal as i32).count()
    };
    let before = on_device();
    match RingChannel::<u64>::new_checked(&stream, Direction::HostToDevice, 8, strategy, &report) {
        Ok(_) => None,
        Err(ChannelError::Unsupported { strategy, device, reason }) => {
            assert_eq!((strategy, device), (kind, ordinal));
            assert_eq!(on_device(), before, "a refused strategy allocated nothing");
            Some(reason)
        }
        Err(e) => panic!("unexpected error {e}"),
    }
}

#[test]
fn each_strategy_refuses_an_incapable_device() {
    if !sim_only() {
        return;
    }
    let mapped = || TransferStrategy::MappedPolling { interval: Duration::from_micros(1) };
    // Unified: no concurrent managed access (WSL2-like), or no managed memory at all.
    assert_eq!(refusal(1, NATIVE, TransferStrategy::Unified), Some(Refusal::NoConcurrentManagedAccess));
    assert_eq!(refusal(2, NATIVE, TransferStrategy::Unified), Some(Refusal::NoManagedMemory));
    // Mapped polling: no host mapping, or mapped memory not coherent at system scope.
    assert_eq!(refusal(2, NATIVE, mapped()), Some(Refusal::NoHostMapping));
    assert_eq!(refusal(3, NATIVE, mapped()), Some(Refusal::NoHostMapping));
    assert_eq!(refusal(3, NATIVE, TransferStrategy::Unified), None);
    assert_eq!(refusal(1, NATIVE, mapped()), Some(Refusal::NotSystemCoherent(MemoryVisibility::DeviceScope)));
    assert_eq!(refusal(0, WSL2, mapped()), Some(Refusal::NotSystemCoherent(MemoryVisibility::DeviceScope)));
    // Sync and async copies run anywhere.
    for d in 0..3 {
        assert_eq!(refusal(d, WSL2, TransferStrategy::Sync), None);
        let ctx = device(d).context().unwrap();
        assert_eq!(
            refusal(d, WSL2, TransferStrategy::Async { stream: Stream::non_blocking(&ctx).unwrap() }),
            None
        );
    }
    assert_eq!(refusal(0, NATIVE, TransferStrategy::Unified), None);
    assert_eq!(refusal(0, NATIVE, mapped()), None);
    // The message says what is missing.
    let e = ChannelError::Unsupported {
        strategy: StrategyKind::Unified,
        device: 1,
        reason: Refusal::NoConcurrentManagedAccess,
    };
    assert!(e.to_string().contains("concurrent managed access"), "{e}");
}

#[test]
fn async_copies_on_another_devices_stream_are_refused() {
    let d0 = device(0);
    if !testing::needs_devices(2) {
        return;
    }
    let s0 = Stream::non_blocking(&d0.context().unwrap()).unwrap();
    let s1 = Stream::non_blocking(&device(1).context().unwrap()).unwrap();
    let err =
        RingChannel::<u64>::new(&s0, Direction::DeviceToHost, 4, TransferStrategy::Async { stream: s1 })
            .unwrap_err();
    assert!(matches!(err, ChannelError::WrongDevice { stream: 1, channel: 0 }), "{err}");
}

#[test]
fn bad_geometry_is_an_error() {
    let d = device(0);
    let s = Stream::non_blocking(&d.context().unwrap()).unwrap();
    assert!(matches!(
        RingChannel::<u64>::new(&s, Direction::HostToDevice, 0, TransferStrategy::Sync),
        Err(ChannelError::ZeroCapacity)
    ));
    assert!(matches!(
        RingChannel::<()>::new(&s, Direction::HostToDevice, 4, TransferStrategy::Sync),
        Err(ChannelError::ZeroSizedMessage)
    ));
}

#[test]
fn a_report_about_another_device_is_refused() {
    if !sim_only() {
        return;
    }
    // Device 0 may share managed memory with a running kernel, device 1 (WSL2-like) may not: a
    // report of device 0 must not let a unified ring onto device 1.
    let s1 = Stream::non_blocking(&device(1).context().unwrap()).unwrap();
    let report0 = VisibilityReport::detect_with_os(device(0), NATIVE).unwrap();
    let err =
        RingChannel::<u64>::new_checked(&s1, Direction::HostToDevice, 4, TransferStrategy::Unified, &report0)
            .unwrap_err();
    assert!(matches!(err, ChannelError::ReportForOtherDevice { report: 0, channel: 1 }), "{err}");
}

#[test]
fn a_report_edited_to_allow_more_is_checked_against_the_device() {
    if !sim_only() {
        return;
    }
    let d1 = device(1);
    let s1 = Stream::non_blocking(&d1.context().unwrap()).unwrap();
    let mut loose = VisibilityReport::detect_with_os(d1, NATIVE).unwrap();
    loose.concurrent_managed_access = true;
    loose.visibility = MemoryVisibility::SystemScope;
    assert!(TransferStrategy::Unified.check_against(&loose).is_ok(), "the edited report alone allows it");
    for strategy in [TransferStrategy::Unified, TransferStrategy::MappedPolling { interval: Duration::ZERO }]
    {
        let kind = strategy.kind();
        let err =
            RingChannel::<u64>::new_checked(&s1, Direction::DeviceToHost, 4, strategy, &loose).unwrap_err();
        assert!(matches!(err, ChannelError::Unsupported { device: 1, .. }), "{kind}: {err}");
    }
    // A stricter report is honoured: device 0 maps host memory, the report says it does not.
    let s0 = Stream::non_blocking(&device(0).context().unwrap()).unwrap();
    let mut strict = VisibilityReport::detect_with_os(device(0), NATIVE).unwrap();
    strict.host_mapping = false;
    let err = RingChannel::<u64>::new_checked(
        &s0,
        Direction::HostToDevice,
        4,
        TransferStrategy::MappedPolling { interval: Duration::ZERO },
        &strict,
    )
    .unwrap_err();
    assert!(matches!(err, ChannelError::Unsupported { reason: Refusal::NoHostMapping, .. }), "{err}");
}

#[test]
fn detection_reads_this_machines_kernel_string() {
    let d = device(0);
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .or_else(|_| std::fs::read_to_string("/proc/version"))
        .unwrap_or_default();
    let platform = Platform::from_os_string(&release);
    assert_eq!(Platform::detect(), platform);
    let report = VisibilityReport::detect(d).unwrap();
    assert_eq!(report, VisibilityReport::detect_with_os(d, &release).unwrap());
    assert_eq!(MemoryVisibility::detect(d).unwrap(), report.visibility);
}
