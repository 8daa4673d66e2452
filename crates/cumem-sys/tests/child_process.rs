//! The two-process harness fails a test instead of hanging it: a child that exits before
//! connecting, one that says the wrong thing, and one that fails after its last word are each
//! reported, and a parent that gives up leaves neither the child process nor its socket file
//! behind.

use std::io::Write;
use std::process::Stdio;

use cumem_sys::testing;
use cumem_sys::testing::child_process::{ChildTest, connect_to_parent, expect};

const CHILD_ENV: &str = "CUMEM_SYS_CHILD_PROCESS_TEST";

fn message(panic: Box<dyn std::any::Any + Send>) -> String {
    panic.downcast_ref::<String>().cloned().unwrap_or_default()
}

fn is_parent() -> bool {
    testing::init();
    std::env::var_os(CHILD_ENV).is_none()
}

#[test]
fn a_child_that_says_what_is_expected_and_exits_cleanly_passes() {
    if !is_parent() {
        return;
    }
    let (child, mut sock) = ChildTest::spawn("child_says_ready", CHILD_ENV);
    expect(&mut sock, b"R");
    child.finish();
}

#[test]
fn a_child_that_exits_before_connecting_fails_the_parent_at_once() {
    if !is_parent() {
        return;
    }
    let failed = std::thread::spawn(|| drop(ChildTest::spawn("no_such_test", CHILD_ENV))).join().unwrap_err();
    let said = message(failed);
    assert!(said.contains("no_such_test exited") && said.contains("without connecting"), "{said}");
}

#[test]
fn a_wrong_word_and_a_failed_exit_are_both_reported() {
    if !is_parent() {
        return;
    }
    let (child, mut sock) = ChildTest::spawn_with("child_says_no_then_fails", CHILD_ENV, Stdio::null());
    let wrong = std::thread::spawn(move || {
        expect(&mut sock, b"R");
    })
    .join()
    .unwrap_err();
    assert!(message(wrong).contains("the other process failed"));
    let failed = message(std::thread::spawn(move || child.finish()).join().unwrap_err());
    assert!(failed.contains("child_says_no_then_fails failed"), "{failed}");
}

#[test]
fn a_parent_that_gives_up_kills_its_child_and_removes_the_socket() {
    if !is_parent() {
        return;
    }
    let (child, _sock) = ChildTest::spawn("child_waits_forever", CHILD_ENV);
    let pid = child.id();
    let socket = child.socket().to_path_buf();
    assert!(socket.exists(), "the socket file exists while the child lives");
    drop(child);
    // A reaped child's /proc entry is gone; a killed but unreaped one would linger as a zombie.
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "the child outlived the test");
    assert!(!socket.exists(), "the socket file was left behind");
}

#[test]
fn child_says_ready() {
    let Some(mut sock) = connect_to_parent(CHILD_ENV) else { return };
    sock.write_all(b"R").unwrap();
}

#[test]
fn child_says_no_then_fails() {
    let Some(mut sock) = connect_to_parent(CHILD_ENV) else { return };
    sock.write_all(b"N").unwrap();
    // Fails after its word, on purpose, without a test harness's FAILED line in the parent's log.
    std::process::exit(3);
}

#[test]
fn child_waits_forever() {
    let Some(mut sock) = connect_to_parent(CHILD_ENV) else { return };
    // Until the parent kills it, or its end of the socket closes (a parent that died without
    // killing it), or the read times out: never longer than the harness's watchdog.
    let _ = std::io::Read::read(&mut sock, &mut [0u8; 1]);
}

/// A disarmed watchdog's thread ends at once (a drop that waited out the deadline would hold
/// every guarded wait for two minutes).
#[test]
fn a_dropped_watchdog_stops_its_thread_at_once() {
    if !is_parent() {
        return;
    }
    let t = std::time::Instant::now();
    drop(cumem_sys::testing::child_process::Watchdog::arm("nothing"));
    assert!(t.elapsed() < std::time::Duration::from_secs(60), "the drop waited for the deadline");
}
