//! How messages cross between host and device: four strategies, each refused up front on a device
//! or platform that cannot run it.
//!
//! | strategy          | ring lives in        | host side                                   |
//! |-------------------|----------------------|---------------------------------------------|
//! | `Sync`            | device memory        | blocking copies                             |
//! | `Async { stream }`| device memory        | copies queued on `stream` from pinned memory|
//! | `Unified`         | managed memory       | writes, then prefetch to the consumer       |
//! | `MappedPolling`   | mapped pinned memory | writes in place; the kernel polls           |
//!
//! Whatever the strategy, a kernel reads and writes `head` and `tail` with acquire loads and
//! release stores at system scope (`ld.acquire.sys`, `st.release.sys`) and the slots with plain
//! accesses between them: a plain or `volatile` load of `tail` would not order the slot reads
//! after it (`docs/channels.md` has the skeleton).
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_channel::{StrategyKind, TransferStrategy};
//! use cumem_core::Device;
//! let device = Device::get(0)?;
//! let chosen = TransferStrategy::detect(&device)?;
//! chosen.check(device)?; // what detect picks always runs
//! assert!(matches!(chosen.kind(), StrategyKind::MappedPolling | StrategyKind::Async | StrategyKind::Sync));
//! # Ok::<(), cumem_channel::ChannelError>(())
//! ```

use std::fmt;
use std::time::Duration;

use cumem_core::{Device, Stream};

use crate::{ChannelError, MemoryVisibility, Refusal, VisibilityReport};

/// How long a polling side waits between looks at the other side's position, unless told.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_micros(1);

/// How a channel moves messages between host and device.
#[derive(Debug, Clone)]
pub enum TransferStrategy {
    /// Blocking copies between host memory and a ring in device memory: simplest, slowest. Not
    /// for a running persistent kernel: the blocking copies wait for every blocking stream and for
    /// the stream the ring was made on.
    Sync,
    /// Copies queued on `stream` from page-locked staging into a ring in device memory: the host
    /// does not wait for a flush's copies, only for reads of the device's positions and, in the
    /// next flush, for the previous flush's copies out of the staging it reuses (all of `stream`
    /// queued up to then: a copy queued there by someone else is waited for too, and so is device
    /// work on the ring that those copies were ordered after). The ring is allocated
    /// and initialised on `stream` too, so a persistent kernel may run beside it on any other
    /// non-blocking stream (not on `stream`, whose copies must be able to run).
    Async {
        /// The stream the copies are queued on.
        stream: Stream,
    },
    /// A ring in managed memory, prefetched to the consumer's side after each publish (on a stream
    /// of the channel's own, so a kernel on the caller's stream never delays it). Needs concurrent
    /// managed access.
    Unified,
    /// A ring in mapped page-locked memory that the other side polls every `interval`: no copies at
    /// all. Needs host mapping and system-scope coherence.
    MappedPolling {
        /// How long the polling side waits between looks (stored in the control block as
        /// `poll_interval_ns`). `Duration::ZERO` is valid: the polling side spins without
        /// sleeping. An interval past `u64::MAX` nanoseconds (584 years) is stored as `u64::MAX`.
        interval: Duration,
    },
}

/// A [`TransferStrategy`] without its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StrategyKind {
    /// [`TransferStrategy::Sync`].
    Sync,
    /// [`TransferStrategy::Async`].
    Async,
    /// [`TransferStrategy::Unified`].
    Unified,
    /// [`TransferStrategy::MappedPolling`].
    MappedPolling,
}

impl fmt::Display for StrategyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StrategyKind::Sync => "sync",
            StrategyKind::Async => "async",
            StrategyKind::Unified => "unified",
            StrategyKind::MappedPolling => "mapped-polling",
        })
    }
}

impl TransferStrategy {
    /// The strategy without its parameters.
    pub fn kind(&self) -> StrategyKind {
        match self {
            TransferStrategy::Sync => StrategyKind::Sync,
            TransferStrategy::Async { .. } => StrategyKind::Async,
            TransferStrategy::Unified => StrategyKind::Unified,
            TransferStrategy::MappedPolling { .. } => StrategyKind::MappedPolling,
        }
    }

    /// The best strategy for `device` on this platform: mapped polling where mapped memory is
    /// coherent at system scope, else queued copies on a new non-blocking stream.
    pub fn detect(device: &Device) -> Result<TransferStrategy, ChannelError> {
        Self::detect_from(&VisibilityReport::detect(*device)?)
    }

    /// [`TransferStrategy::detect`] from a report already read (or made for another platform).
    pub fn detect_from(report: &VisibilityReport) -> Result<TransferStrategy, ChannelError> {
        Ok(match report.visibility {
            MemoryVisibility::SystemScope => {
                TransferStrategy::MappedPolling { interval: DEFAULT_POLL_INTERVAL }
            }
            MemoryVisibility::DeviceScope | MemoryVisibility::DmaOnly => {
                TransferStrategy::Async { stream: Stream::non_blocking(&report.device.context()?)? }
            }
        })
    }

    /// `Ok(())` if `device` on this platform can run the strategy, else `Unsupported` with the
    /// reason.
    pub fn check(&self, device: Device) -> Result<(), ChannelError> {
        self.check_against(&VisibilityReport::detect(device)?)
    }

    /// [`TransferStrategy::check`] against a report already read.
    pub fn check_against(&self, report: &VisibilityReport) -> Result<(), ChannelError> {
        let refuse = |reason| {
            Err(ChannelError::Unsupported { strategy: self.kind(), device: report.device.ordinal(), reason })
        };
        match self {
            TransferStrategy::Sync => Ok(()),
            TransferStrategy::Async { stream } => {
                let on = stream.context().device();
                if on != report.device {
                    return Err(ChannelError::WrongDevice {
                        stream: on.ordinal(),
                        channel: report.device.ordinal(),
                    });
                }
                Ok(())
            }
            TransferStrategy::Unified if !report.managed_memory => refuse(Refusal::NoManagedMemory),
            TransferStrategy::Unified if !report.concurrent_managed_access => {
                refuse(Refusal::NoConcurrentManagedAccess)
            }
            TransferStrategy::Unified => Ok(()),
            TransferStrategy::MappedPolling { .. } if !report.host_mapping => refuse(Refusal::NoHostMapping),
            TransferStrategy::MappedPolling { .. } if report.visibility != MemoryVisibility::SystemScope => {
                refuse(Refusal::NotSystemCoherent(report.visibility))
            }
            TransferStrategy::MappedPolling { .. } => Ok(()),
        }
    }
}
