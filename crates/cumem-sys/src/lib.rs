//! Raw access to the CUDA driver for the cumem crates.
//!
//! This crate is the only door to `libcuda.so`: it declares the entry points cumem calls, each
//! returning its code as an `int` ([`api`]), re-exports cudarc's generated bindings (their types,
//! and entry points for code that wants them) as [`sys`], chooses and loads the driver library without ever panicking ([`driver`]), probes
//! optional entry points so that a call missing from an older driver becomes
//! [`Error::NotSupported`] ([`probe`]), and maps every `CUresult` to a named [`Error`].
//!
//! ```
//! # cumem_sys::testing::init();
//! let kind = cumem_sys::driver::init()?;
//! let mut version = 0;
//! // SAFETY: the driver is loaded and initialised by `init`; `version` is a valid out-pointer.
//! let code = unsafe { cumem_sys::api::cuDriverGetVersion(&mut version) };
//! cumem_sys::check(code, cumem_sys::ErrorContext::op("cuDriverGetVersion"))?;
//! assert!(version >= 12000, "{kind:?} reports {version}");
//! # Ok::<(), cumem_sys::Error>(())
//! ```

pub mod api;
pub mod driver;
mod error;
pub mod probe;
#[cfg(feature = "sim")]
pub mod testing;

pub use api::Code;
pub use error::{Error, ErrorContext, Feature, MemoryReport, Result, check};

/// cudarc's raw driver bindings (CUDA 12.8 ABI): the types every cumem crate uses.
///
/// cumem calls the driver through [`api`], not through these functions. Each of them is `unsafe`
/// and panics inside cudarc if no driver library has been loaded (call [`driver::init`] first),
/// and returns `CUresult`, an enum of the codes of CUDA 12.8: a newer driver's code that the enum
/// lacks (CUDA 13 added some) is undefined behaviour once returned, which [`api`]'s functions
/// avoid by reading an `int` (`docs/safety.md`, *Driver codes newer than the bindings*).
pub use cudarc::driver::sys;

#[cfg(feature = "sim")]
/// The simulator's control client (live report, violations, fault injection), re-exported.
pub use cumem_sim::control as sim_control;
