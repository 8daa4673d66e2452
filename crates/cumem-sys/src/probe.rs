//! Probing optional driver entry points before calling them.
//!
//! An entry point may be absent from the loaded driver (for example `cuMemAdvise_v2` on a driver
//! older than 12.2). Calling it through [`crate::api`] gives [`crate::Code::MISSING_ENTRY_POINT`],
//! which [`crate::check`] turns into [`Error::NotSupported`]; asking here first lets code choose
//! another entry point (the older `cuMemAdvise`) or refuse before it has done anything else.
//!
//! ```
//! # cumem_sys::testing::init();
//! cumem_sys::driver::init()?;
//! assert!(cumem_sys::probe::has_symbol("cuMemAlloc_v2"));
//! assert!(!cumem_sys::probe::has_symbol("cuNoSuchEntryPoint"));
//! assert!(cumem_sys::probe::require("cuNoSuchEntryPoint").is_err());
//! # Ok::<(), cumem_sys::Error>(())
//! ```

use crate::error::{Error, Feature, Result};

/// Whether the loaded driver exports `name`. `false` when no driver is loaded.
pub fn has_symbol(name: &str) -> bool {
    crate::driver::library().is_some_and(|lib| {
        // SAFETY: only the symbol's presence is checked; the pointer is never used.
        unsafe { lib.get::<*const ()>(name).is_ok() }
    })
}

/// `Ok(())` if the loaded driver exports `name`, else `NotSupported { feature: Symbol(name) }`;
/// `NotInitialized` (naming `name`) when no driver is loaded (none selected yet, or loading
/// failed), since whether it exports `name` is then unknown.
pub fn require(name: &'static str) -> Result<()> {
    if crate::driver::library().is_none() {
        return Err(Error::NotInitialized { ctx: crate::ErrorContext::op(name) });
    }
    if has_symbol(name) {
        Ok(())
    } else {
        Err(Error::NotSupported { feature: Feature::Symbol(name), device: None })
    }
}

/// The driver's version as `1000 * major + 10 * minor` (e.g. 12080), once a driver is loaded.
pub fn driver_version() -> Result<i32> {
    crate::driver::init()?;
    let mut v = 0;
    // SAFETY: the driver is loaded; `v` is a valid out-pointer.
    let code = unsafe { crate::api::cuDriverGetVersion(&mut v) };
    crate::check(code, crate::ErrorContext::op("cuDriverGetVersion"))?;
    Ok(v)
}

#[cfg(all(test, unix))]
mod tests {
    use crate::Error;
    use crate::testing::child_process::run_child_test;

    const CHILD_ENV: &str = "CUMEM_TEST_REQUIRE_UNLOADED_CHILD";

    /// Before any driver is loaded, whether an entry point exists is unknown: `require` says the
    /// driver is not initialised (it used to say the entry point is not supported). Run alone in a
    /// child process, where nothing has loaded a driver.
    #[test]
    fn require_before_a_driver_is_loaded_says_not_initialized() {
        if std::env::var_os(CHILD_ENV).is_some() {
            assert!(crate::driver::current().is_none());
            assert!(matches!(
                super::require("cuMemAlloc_v2"),
                Err(Error::NotInitialized { ctx }) if ctx.op == "cuMemAlloc_v2"
            ));
            assert!(!super::has_symbol("cuMemAlloc_v2"));
            return;
        }
        let child = run_child_test(
            "probe::tests::require_before_a_driver_is_loaded_says_not_initialized",
            &[(CHILD_ENV, "1")],
            &[],
            std::time::Duration::from_secs(60),
        );
        assert!(child.status.is_some_and(|s| s.success()), "{:?}\n{}", child.status, child.log);
        assert!(child.log.contains("1 passed"), "the child ran the test: {}", child.log);
    }
}
