//! A process whose device work never finishes (a hung kernel, here a held host function) still
//! exits: returning the current caching pool's memory at exit waits for its streams only for a
//! bounded time.

use std::time::Duration;

use cumem_core::{Device, DeviceBuffer, Stream};
use cumem_sys::testing;

const CHILD: &str = "CUMEM_TEST_EXIT_CHILD";

/// The child's half: caches memory of a stream in the default pool, holds that stream forever,
/// and exits.
#[test]
fn exit_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    assert!(cumem_pool::current_caching(&ctx.device()).unwrap().is_some(), "the default is the caching pool");
    let s = Stream::non_blocking(&ctx).unwrap();
    drop(DeviceBuffer::<u8>::zeroed(&s, 4096).unwrap());
    ctx.bind().unwrap();
    // SAFETY: a live stream of the current context.
    let gate = unsafe { testing::hold(s.raw()) };
    std::mem::forget(gate); // the work on `s` never completes
    std::process::exit(0);
}

#[test]
fn a_process_with_hung_device_work_still_exits() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    testing::init();
    if testing::sim_control().is_none() {
        // What a real driver's own teardown does with a host function that never returns is the
        // driver's business (it may wait for it); this test is about cumem's bounded wait.
        testing::skip("a child that exits with a host function that never returns: simulator only");
        return;
    }
    let status = testing::child_process::run_child_test(
        "exit_child",
        &[(CHILD, "1")],
        &["CUMEM_ALLOCATOR"],
        Duration::from_secs(30),
    )
    .status;
    // The exit code itself may be the simulator's leak check (the held stream is live at exit).
    assert!(status.is_some(), "the process never exited: the release at exit waits for the hung stream");
}
