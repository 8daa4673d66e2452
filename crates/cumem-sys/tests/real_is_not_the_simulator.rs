//! `Real` never takes the simulator for the CUDA driver: when `libcuda.so` resolves to cumem-sim
//! (here, loaded by path beforehand, as a program that opened it would have), selecting the real
//! driver is `DriverNotFound`, naming cumem-sim; and that failure, made before any `cuInit`, is not
//! remembered: the same process then selects the simulator. One test, in a binary of its own: the
//! driver is chosen once per process.

use cumem_sys::driver::{self, DRIVER_ENV, DriverChoice, DriverKind};
use cumem_sys::{Error, testing};

#[test]
fn real_refuses_a_libcuda_that_is_the_simulator_and_the_simulator_can_still_be_chosen() {
    // Under `real` the simulator is not to be used; under `auto` (or unset, or `sim`) it runs: it
    // selects the simulator explicitly, whether or not the machine has a GPU.
    if std::env::var(DRIVER_ENV).is_ok_and(|v| v.parse::<DriverChoice>().ok() == Some(DriverChoice::Real)) {
        testing::init();
        return testing::skip("selects the simulator itself: not under CUMEM_DRIVER=real");
    }
    let path = cumem_sim::library_path().expect("the simulator library is built beside the tests");
    // SAFETY: cumem-sim's initialisers only set up its own state; nothing is called through it.
    let sim = unsafe { libloading::Library::new(&path) }.unwrap();

    let real = driver::select(DriverChoice::Real);
    assert!(
        matches!(&real, Err(Error::DriverNotFound { searched }) if searched.contains("cumem-sim")),
        "{real:?}"
    );
    assert_eq!(driver::current(), None, "nothing is in use after a refused selection");

    let chosen = driver::select_with_sim_config(DriverChoice::Simulator, Some(testing::DEFAULT_SIM_CONFIG));
    assert_eq!(chosen.unwrap(), DriverKind::Simulator, "the refusal was remembered");
    assert_eq!(testing::init(), DriverKind::Simulator);
    assert!(driver::description().unwrap().contains("cumem-sim"));
    assert!(matches!(driver::select(DriverChoice::Real), Err(Error::DriverSelection { .. })));
    drop(sim);
}
