//! `cuInit` and `cuDriverGetVersion`.

use std::ffi::c_int;
use std::sync::atomic::Ordering;

use cudarc::driver::sys::CUresult;

use crate::api::{self, Fail, Init};
use crate::config::Config;
use crate::state::{ConfigSlot, SIM};
use crate::{leak, stream};

/// The driver version the simulator reports (CUDA 12.8, matching the bindings it serves).
pub const DRIVER_VERSION: c_int = 12080;

/// The merged configuration: defaults, then `CUMEM_SIM`, then pre-init `cumemSimConfigure` calls.
pub(crate) fn merged_config(pending: &[String], extra: Option<&str>) -> Result<Config, String> {
    let mut cfg = Config::default();
    if let Ok(env) = std::env::var("CUMEM_SIM") {
        cfg.apply(&env, false).map_err(|e| format!("CUMEM_SIM: {e}"))?;
    }
    for spec in pending.iter().map(String::as_str).chain(extra) {
        cfg.apply(spec, false)?;
    }
    Ok(cfg)
}

fn initialize() -> Result<(), Fail> {
    let mut slot = SIM.config.lock();
    let pending = match &*slot {
        ConfigSlot::Active(_) => return Ok(()),
        ConfigSlot::Pending(p) => p.clone(),
    };
    let cfg =
        merged_config(&pending, None).map_err(|e| Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, e))?;
    if cfg.devices == 0 {
        return Err(Fail::quiet(CUresult::CUDA_ERROR_NO_DEVICE));
    }
    let specs = cfg.device_specs().map_err(|e| Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, e))?;
    {
        let mut st = SIM.st.lock();
        st.install(specs, cfg.peer_matrix())
            .map_err(|e| Fail::misuse(CUresult::CUDA_ERROR_OUT_OF_MEMORY, e))?;
    }
    stream::start_engine().map_err(|e| Fail::misuse(CUresult::CUDA_ERROR_UNKNOWN, e))?;
    SIM.latency_us.store(cfg.latency_us, Ordering::Relaxed);
    SIM.leak_check.store(cfg.leak_check, Ordering::Release);
    if cfg.leak_check {
        leak::register();
    }
    *slot = ConfigSlot::Active(Box::new(cfg));
    SIM.initialized.store(true, Ordering::Release);
    Ok(())
}

/// `CUresult cuInit(unsigned int Flags)`: reads the configuration and builds the devices.
/// `Flags` must be 0; repeated calls succeed without effect.
#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: u32) -> CUresult {
    api::call("cuInit", Init::NotRequired, || {
        if flags != 0 {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("cuInit flags {flags:#x} must be 0"),
            ));
        }
        initialize()
    })
}

/// `CUresult cuDriverGetVersion(int *driverVersion)`: 12080; works before `cuInit`.
///
/// # Safety
/// 1. `driver_version` is NULL or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(driver_version: *mut c_int) -> CUresult {
    api::call("cuDriverGetVersion", Init::NotRequired, || {
        // SAFETY: forwarded caller contract.
        unsafe { api::out(driver_version, DRIVER_VERSION, "driverVersion") }
    })
}
