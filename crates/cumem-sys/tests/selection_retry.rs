//! A selection that fails before its library's `cuInit` is not remembered: the simulator given a
//! configuration it refuses is not in use, and the same process then selects it with a good one.
//! One test, in a binary of its own: the driver is chosen once per process.

use cumem_sys::driver::{self, DRIVER_ENV, DriverChoice, DriverKind};
use cumem_sys::{Error, testing};

#[test]
fn a_refused_simulator_configuration_leaves_the_choice_open() {
    // Under `real` the simulator is not to be used; under `auto` (or unset, or `sim`) it runs: it
    // selects the simulator explicitly, whether or not the machine has a GPU.
    if std::env::var(DRIVER_ENV).is_ok_and(|v| v.parse::<DriverChoice>().ok() == Some(DriverChoice::Real)) {
        testing::init();
        return testing::skip("selects the simulator itself: not under CUMEM_DRIVER=real");
    }
    let refused = driver::select_with_sim_config(DriverChoice::Simulator, Some("no_such_key=1"));
    assert!(
        matches!(refused, Err(Error::InvalidValue { ref ctx }) if ctx.op == "cumemSimConfigure"),
        "{refused:?}"
    );
    assert_eq!(driver::current(), None, "a refused selection put nothing in use");
    assert_eq!(driver::description(), None);

    let good = driver::select_with_sim_config(DriverChoice::Simulator, Some(testing::DEFAULT_SIM_CONFIG));
    assert_eq!(good.unwrap(), DriverKind::Simulator, "the failure was remembered");
    assert_eq!(testing::init(), DriverKind::Simulator);
    assert_eq!(driver::init().unwrap(), DriverKind::Simulator);
    assert!(testing::sim_control().is_some());
}
