//! Skips on the simulator: it has every device a test configures, so a test that would skip
//! fails instead, saying which configuration it lacks; with enough devices nothing is skipped.
//! These tests are about the simulator's rule: on a real driver they skip (with the reason), as
//! a real machine's device count is not theirs to configure.

use cumem_sys::testing;

fn message(panic: Box<dyn std::any::Any + Send>) -> String {
    panic.downcast_ref::<String>().cloned().unwrap_or_default()
}

/// Configures three simulated devices; on a real driver, reports the skip and says no.
fn on_the_simulator() -> bool {
    testing::init_with("devices=3");
    if testing::sim_control().is_none() {
        testing::skip("tests the simulator's skip rule: simulator only");
        return false;
    }
    true
}

#[test]
fn enough_devices_go_on_without_a_skip() {
    if !on_the_simulator() {
        return;
    }
    assert_eq!(testing::device_count(), 3);
    assert!(testing::needs_devices(1) && testing::needs_devices(3));
}

#[test]
fn a_skip_on_the_simulator_fails_the_test_and_says_why() {
    if !on_the_simulator() {
        return;
    }
    let too_many = std::thread::Builder::new()
        .name("needs_four".into())
        .spawn(|| testing::needs_devices(4))
        .unwrap()
        .join()
        .unwrap_err();
    let said = message(too_many);
    assert!(said.contains("needs_four") && said.contains("needs 4 devices, the simulator has 3"), "{said}");
    let other = std::thread::spawn(|| testing::skip("no peer link")).join().unwrap_err();
    assert!(message(other).contains("no peer link"));
}
