//! Bringing the simulator up: the configuration merged from its sources, the device table built
//! at `cuInit`, the engine started, the exit leak check registered.
//!
//! Configuration comes from the defaults, then `CUMEM_SIM`, then every `cumemSimConfigure` call
//! made before `cuInit`; after `cuInit` only the runtime keys (`latency_us`, `leak_check`,
//! `schedule`) change.

use std::sync::atomic::Ordering;

use cudarc::driver::sys::CUresult;

use crate::api::Fail;
use crate::config::{Config, Schedule};
use crate::state::{ConfigSlot, SIM};
use crate::{engine, leak};

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

/// `cuInit`: builds the device table from the merged configuration and starts the engine; once
/// it has succeeded, later calls do nothing.
pub(crate) fn initialize() -> Result<(), Fail> {
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
    engine::start().map_err(|e| Fail::misuse(CUresult::CUDA_ERROR_UNKNOWN, e))?;
    SIM.latency_us.store(cfg.latency_us, Ordering::Relaxed);
    SIM.leak_check.store(cfg.leak_check, Ordering::Release);
    SIM.reversed.store(cfg.schedule == Schedule::Reversed, Ordering::Relaxed);
    if cfg.leak_check {
        leak::register();
    }
    *slot = ConfigSlot::Active(Box::new(cfg));
    SIM.initialized.store(true, Ordering::Release);
    Ok(())
}

/// Applies one specification (`cumemSimConfigure`): before `cuInit` it joins the pending list
/// (checked by merging everything so far); afterwards it must name runtime keys only.
pub(crate) fn configure(spec: &str) -> Result<(), String> {
    let mut slot = SIM.config.lock();
    let cfg = match &mut *slot {
        ConfigSlot::Pending(pending) => {
            let cfg = merged_config(pending, Some(spec))?;
            pending.push(spec.to_string());
            cfg
        }
        ConfigSlot::Active(cfg) => {
            cfg.apply(spec, true)?;
            (**cfg).clone()
        }
    };
    SIM.latency_us.store(cfg.latency_us, Ordering::Relaxed);
    SIM.leak_check.store(cfg.leak_check, Ordering::Release);
    SIM.reversed.store(cfg.schedule == Schedule::Reversed, Ordering::Relaxed);
    if cfg.leak_check {
        leak::register();
    }
    Ok(())
}
