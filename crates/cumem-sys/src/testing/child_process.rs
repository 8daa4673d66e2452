//! A second process for tests that share memory, pools or events across processes.
//!
//! The parent test spawns its own test binary again, running only the child's half (a test that
//! returns at once unless the variable named by `env` is set), and the two talk over a Unix
//! socket. Nothing here may hang CI: the parent polls for the connection while checking that the
//! child is alive, every read on either side times out after [`WATCHDOG`], the child's exit is
//! awaited with the same deadline, and a parent that fails kills and reaps the child and removes
//! the socket file.
//!
//! This file uses only `std`: the simulator's own tests (which cannot depend on `cumem-sys`)
//! include it by path.
//!
//! ```no_run
//! use cumem_sys::testing::child_process::{connect_to_parent, expect, ChildTest};
//! use std::io::Write;
//!
//! const CHILD_ENV: &str = "MY_TEST_CHILD";
//!
//! // In a test binary both are `#[test]` functions: the parent's half returns at once in the
//! // child, the child's half in the parent.
//! fn parent() {
//!     if std::env::var_os(CHILD_ENV).is_some() {
//!         return;
//!     }
//!     let (child, mut sock) = ChildTest::spawn("child", CHILD_ENV);
//!     expect(&mut sock, b"R");
//!     child.finish();
//! }
//!
//! fn child() {
//!     let Some(mut sock) = connect_to_parent(CHILD_ENV) else { return };
//!     sock.write_all(b"R").unwrap();
//! }
//! # parent();
//! # child();
//! ```

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long either process waits for the other (to connect, to say something, to exit) before the
/// test fails: long enough for a loaded CI machine, short enough that a stuck process is reported
/// instead of hanging the run.
pub const WATCHDOG: Duration = Duration::from_secs(120);

/// How often the parent looks for the child's connection or exit.
const LOOK: Duration = Duration::from_millis(10);

/// The child process of a two-process test: killed and reaped, and its socket file removed, if the
/// parent fails before [`finish`](Self::finish).
pub struct ChildTest {
    child: Option<Child>,
    socket: PathBuf,
    name: String,
}

impl ChildTest {
    /// Spawns the test `name` of this test binary with `env` set to a fresh socket path, and
    /// returns it with its connection (reads time out after [`WATCHDOG`]).
    ///
    /// # Panics
    /// If the socket cannot be made, the child cannot start, exits before connecting, or does not
    /// connect within [`WATCHDOG`].
    pub fn spawn(name: &str, env: &str) -> (ChildTest, UnixStream) {
        Self::spawn_with(name, env, Stdio::inherit())
    }

    /// [`spawn`](Self::spawn), with the child's stderr sent where `stderr` says.
    ///
    /// # Panics
    /// As [`spawn`](Self::spawn).
    pub fn spawn_with(name: &str, env: &str, stderr: Stdio) -> (ChildTest, UnixStream) {
        // The process id, the time and a count: runs in other containers that share /tmp have
        // their own process ids, and one test binary may spawn several children at once. Short,
        // since a socket's path must fit in 108 bytes whatever TMPDIR is.
        static SPAWNED: AtomicU32 = AtomicU32::new(0);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let n = SPAWNED.fetch_add(1, Ordering::Relaxed);
        let socket = std::env::temp_dir().join(format!("cumem-{}-{nanos:x}-{n}.sock", std::process::id()));
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).expect("bind the test's socket");
        // Removes the socket file however the rest ends, before a `ChildTest` owns it too.
        let mut test = ChildTest { child: None, socket, name: name.to_string() };
        listener.set_nonblocking(true).expect("a non-blocking listener");
        let exe = std::env::current_exe().expect("the test binary's path");
        let child = Command::new(exe)
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(env, &test.socket)
            .stderr(stderr)
            .spawn()
            .expect("start the child process");
        test.child = Some(child);
        let deadline = Instant::now() + WATCHDOG;
        let sock = loop {
            match listener.accept() {
                Ok((sock, _)) => break sock,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => panic!("accepting {name}'s connection: {e}"),
            }
            if let Some(status) = test.exited() {
                // It may have connected (and said its piece) between the two looks.
                match listener.accept() {
                    Ok((sock, _)) => break sock,
                    Err(_) => panic!("{name} exited ({status}) without connecting"),
                }
            }
            assert!(Instant::now() < deadline, "{name} did not connect within {WATCHDOG:?}");
            std::thread::sleep(LOOK);
        };
        sock.set_nonblocking(false).expect("a blocking connection");
        sock.set_read_timeout(Some(WATCHDOG)).expect("a read timeout");
        (test, sock)
    }

    /// The child's process id.
    ///
    /// # Panics
    /// If the child was already waited for.
    pub fn id(&self) -> u32 {
        self.child.as_ref().expect("waited for already").id()
    }

    /// The socket file the child connected through (removed when this is dropped).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The child's exit status, if it has exited.
    ///
    /// # Panics
    /// If the child was already waited for, or its status cannot be read.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().expect("waited for already").try_wait().expect("the child's status")
    }

    /// The child's stderr, once, when it was spawned with [`Stdio::piped`].
    ///
    /// # Panics
    /// If the child was already waited for.
    pub fn take_stderr(&mut self) -> Option<ChildStderr> {
        self.child.as_mut().expect("waited for already").stderr.take()
    }

    /// Waits for the child to exit, within [`WATCHDOG`] (a child stuck after its last word is
    /// killed when this fails).
    ///
    /// # Panics
    /// If the child fails or does not exit in time.
    pub fn finish(mut self) {
        let deadline = Instant::now() + WATCHDOG;
        loop {
            if let Some(status) = self.exited() {
                self.child = None;
                assert!(status.success(), "{} failed: {status}", self.name);
                return;
            }
            assert!(Instant::now() < deadline, "{} did not exit within {WATCHDOG:?}", self.name);
            std::thread::sleep(LOOK);
        }
    }
}

impl Drop for ChildTest {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Aborts the whole test process if it is still alive after [`WATCHDOG`]: for a wait that has no
/// deadline of its own (a driver call that waits on the other process's work), where a stuck wait
/// would otherwise hang CI. Dropping it disarms it.
pub struct Watchdog {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    /// Arms a watchdog for `what` (said on stderr if it fires).
    ///
    /// # Panics
    /// If the watchdog's thread cannot be started.
    pub fn arm(what: &str) -> Watchdog {
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (seen, what) = (done.clone(), what.to_string());
        let thread = std::thread::Builder::new()
            .name("cumem-test-watchdog".into())
            .spawn(move || {
                let deadline = Instant::now() + WATCHDOG;
                while !seen.load(Ordering::Acquire) {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        // Straight to the stream: the test harness captures `eprintln!`, and an
                        // abort never shows what it captured.
                        let _ = writeln!(
                            std::io::stderr(),
                            "{what}: still waiting after {WATCHDOG:?}; aborting the test process"
                        );
                        std::process::abort();
                    }
                    std::thread::park_timeout(left);
                }
            })
            .expect("start the watchdog");
        Watchdog { done, thread: Some(thread) }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// In the child: the connection to the parent (reads time out after [`WATCHDOG`]), or `None` when
/// this process is not a child (the variable `env` is not set), in which case the child's test
/// returns at once.
///
/// # Panics
/// If the parent's socket cannot be reached.
pub fn connect_to_parent(env: &str) -> Option<UnixStream> {
    let path = std::env::var_os(env)?;
    let sock = UnixStream::connect(path).expect("connect to the parent's socket");
    sock.set_read_timeout(Some(WATCHDOG)).expect("a read timeout");
    Some(sock)
}

/// Reads one byte from the other process and checks that it is `what` (anything else, or nothing
/// within the socket's timeout, means the other process failed or is stuck).
///
/// # Panics
/// If the byte differs or does not come.
pub fn expect(sock: &mut impl Read, what: &[u8; 1]) {
    let mut got = [0u8; 1];
    if let Err(e) = sock.read_exact(&mut got) {
        panic!(
            "no {:?} from the other process within {WATCHDOG:?} (it failed, or is stuck in a call): {e}",
            what[0] as char
        );
    }
    assert_eq!(&got, what, "the other process failed (it said {:?})", got[0] as char);
}

/// How a child test run by [`run_child_test`] ended.
#[derive(Debug)]
pub struct ChildOutcome {
    /// Its exit status; `None` when it was still running at the deadline and was killed (a hang).
    pub status: Option<ExitStatus>,
    /// Everything it wrote to stdout and stderr.
    pub log: String,
}

/// Runs the test `name` of this test binary alone (`--exact`, one thread, output shown) in a child
/// process with the variables `set` set and those in `unset` removed, and waits for it, killing it
/// once `deadline` has passed: for tests whose failure is a hang of the whole process (a deadlock
/// in a once-per-process initialiser, an exit that never comes). Its output goes to a file, not a
/// pipe, which a chatty child could fill and then block on, looking hung.
///
/// # Panics
/// If the output file cannot be made or read, or the child cannot be started or reaped.
pub fn run_child_test(name: &str, set: &[(&str, &str)], unset: &[&str], deadline: Duration) -> ChildOutcome {
    static RUNS: AtomicU32 = AtomicU32::new(0);
    let path = std::env::temp_dir().join(format!(
        "cumem-child-{}-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed),
        name
    ));
    let out = std::fs::File::create(&path).expect("a file for the child's output");
    let mut command = Command::new(std::env::current_exe().expect("this test binary"));
    command.args(["--exact", name, "--test-threads=1", "--nocapture"]);
    for (key, value) in set {
        command.env(key, value);
    }
    for key in unset {
        command.env_remove(key);
    }
    let mut child = command
        .stdout(out.try_clone().expect("the output file, again"))
        .stderr(out)
        .spawn()
        .expect("the child test starts");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("the child's state") {
            break Some(status);
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(LOOK);
    };
    child.wait().expect("the child is reaped");
    let log = String::from_utf8_lossy(&std::fs::read(&path).expect("the child's output")).into_owned();
    let _ = std::fs::remove_file(&path);
    ChildOutcome { status, log }
}
