//! Project automation. `cargo xtask <task>`:
//!
//! - `ci`: format check, clippy `-D warnings`, build, docs with warnings denied, every test and
//!   doctest on the simulator with the simulator's leak check at the end of each test binary (a
//!   test that would skip fails there: `cumem_sys::testing::skip` refuses the simulator, which has
//!   every device the tests configure), the caching pool's thread-cache tests again in fence mode,
//!   and the quickstart example and the demo on the simulator (what CI runs);
//! - `test`: the tests only, on the simulator;
//! - `gpu-test`: on the real driver, fails saying "no GPU" where there is none. Builds the test
//!   binaries once (`cargo test --no-run`), leaving out the packages whose tests are not for a GPU
//!   (the simulator's own tests, xtask, the benches, the CLI); runs each binary with the default
//!   number of test threads and a time limit (`CUMEM_GPU_TEST_TIMEOUT`, seconds, default 600; a
//!   binary that exceeds it is killed and reported as hung); then, where compute-sanitizer is
//!   installed (`PATH`, `$CUDA_HOME/bin`, `/usr/local/cuda/bin`), runs memcheck with a full leak
//!   check on each binary, with API error reports off (the tests provoke driver errors on
//!   purpose); a binary that makes no CUDA call is skipped, saying so. Tests that skip on this
//!   machine (fewer devices than they need, a simulator-only check) say so through
//!   `cumem_sys::testing::skip`, which appends to the file named by `CUMEM_TEST_SKIP_LOG`; the
//!   summary lists every skipped test and why (on the simulator a skip fails the test instead);
//! - `bench [pool | transfer]`: the allocator table (ns per alloc+free and the ratios between
//!   allocators) or the transfer table (copies, memsets and allocation paths against the same raw
//!   driver calls, then the message-channel table: messages/s and latency per strategy for 64 B
//!   and 4 KiB messages), each measured side by side in one run, in release mode, on the real
//!   driver if present;
//! - `bench sim-pool`: the simulator's own per-call costs through its C entry points (the
//!   stream-ordered pool with 0, 1,000 and 10,000 live blocks; event, stream-wait and copy calls);
//! - `traces`: regenerates the allocation traces in `traces/` from fixed seeds (see [`traces`]).

mod traces;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let task = args.first().map(String::as_str).unwrap_or("help");
    let result = match task {
        "ci" => ci(),
        "test" => test_on_simulator(EVERY_TEST, &["--workspace"], "leak_check=1"),
        "gpu-test" => gpu_test(),
        "bench" => bench(args.get(1).map(String::as_str).unwrap_or("pool")),
        "traces" => traces::generate(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces")),
        _ => {
            eprintln!(
                "usage: cargo xtask <ci | test | gpu-test | bench [pool | transfer | sim-pool] | traces>"
            );
            return if task == "help" { ExitCode::SUCCESS } else { ExitCode::FAILURE };
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask {task}: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

type Result<T = ()> = std::result::Result<T, String>;

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn run(step: &str, cmd: &mut Command) -> Result {
    let started = Instant::now();
    eprintln!("==> {step}");
    let status = cmd.status().map_err(|e| format!("{step}: could not start: {e}"))?;
    eprintln!("    {step}: {} in {:.0?}", if status.success() { "ok" } else { "failed" }, started.elapsed());
    if status.success() { Ok(()) } else { Err(format!("{step} failed ({status})")) }
}

fn ci() -> Result {
    let started = Instant::now();
    run("cargo fmt --check", cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(
        "cargo clippy -D warnings",
        cargo().args(["clippy", "--workspace", "--all-targets", "--locked", "--", "-D", "warnings"]),
    )?;
    run("cargo build", cargo().args(["build", "--workspace", "--all-targets", "--locked"]))?;
    // Docs on every public item, and no broken links. (The CLI's binary is named like the facade
    // crate, which rustdoc cannot document side by side.)
    run(
        "cargo doc -D warnings",
        cargo()
            .args(["doc", "--workspace", "--no-deps", "--locked", "--exclude", "cumem-cli"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    test_on_simulator(EVERY_TEST, &["--workspace"], "leak_check=1")?;
    // The library's tests once more with the simulator starting, among streams that do not wait
    // for each other, the work queued last first: by default it starts them in the order they were
    // queued, which a GPU does not promise, so a missing wait between streams would go unseen.
    // The simulator's own tests (which set the schedule each checks), cumem-sys's (driver
    // selection) and the CLI's are left out; doctests too.
    test_on_simulator(
        "cargo test (library crates, simulator starting independent streams' newest work first)",
        &[
            "--tests",
            "-p",
            "cumem",
            "-p",
            "cumem-core",
            "-p",
            "cumem-copy",
            "-p",
            "cumem-unified",
            "-p",
            "cumem-vmm",
            "-p",
            "cumem-peer",
            "-p",
            "cumem-ipc",
            "-p",
            "cumem-pool",
            "-p",
            "cumem-channel",
        ],
        "leak_check=1,schedule=reversed",
    )?;
    // The caching pool's thread caches once more with fences on both sides, the mode of systems
    // without `membarrier` (chosen once per process, so a run of its own).
    run(
        "thread caches in fence mode",
        cargo()
            .args(["test", "--locked", "-q", "-p", "cumem-pool", "--lib", "--test", "thread_cache"])
            .env("CUMEM_DRIVER", "sim")
            .env("CUMEM_POOL_THREAD_CACHE_FENCES", "1"),
    )?;
    run(
        "example quickstart (simulator)",
        cargo()
            .args(["run", "--locked", "-q", "-p", "cumem", "--example", "quickstart"])
            .env("CUMEM_DRIVER", "sim"),
    )?;
    run(
        "cumem demo (simulator)",
        cargo().args(["run", "--locked", "-q", "-p", "cumem-cli", "--", "--driver", "sim", "demo"]),
    )?;
    eprintln!("==> ci passed in {:.0?}", started.elapsed());
    Ok(())
}

/// What `cargo xtask test` and the first test run of `ci` run.
const EVERY_TEST: &str = "cargo test (simulator, leak check at exit of every test binary)";

/// Runs `cargo test` with `selection` (which packages and targets) on the simulator, configured by
/// `sim` (`CUMEM_SIM`, which includes its leak check); a test binary that ends with live
/// allocations, streams or events exits non-zero, and this says which.
fn test_on_simulator(what: &str, selection: &[&str], sim: &str) -> Result {
    let started = Instant::now();
    eprintln!("==> {what}");
    let mut child = cargo()
        .args(["test", "--locked"])
        .args(selection)
        .env("CUMEM_DRIVER", "sim")
        .env("CUMEM_SIM", sim)
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cargo test: could not start: {e}"))?;
    // Each line is shown as it comes (which binary runs now, so that a hang shows where) and kept
    // for the leak check's count below.
    let mut stderr = String::new();
    let mut pipe = std::io::BufReader::new(child.stderr.take().expect("stderr is piped"));
    let mut line = Vec::new();
    loop {
        line.clear();
        match std::io::BufRead::read_until(&mut pipe, b'\n', &mut line) {
            Ok(0) => break,
            Ok(_) => {
                let text = String::from_utf8_lossy(&line);
                eprint!("{text}");
                stderr.push_str(&text);
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("cargo test: reading its output: {e}"));
            }
        }
    }
    let status = child.wait().map_err(|e| format!("cargo test: waiting for it: {e}"))?;
    let passed = stderr.lines().filter(|l| l.starts_with("cumem-sim: leak check passed")).count();
    let leaks: Vec<&str> = stderr.lines().filter(|l| l.starts_with("cumem-sim: LEAK")).collect();
    eprintln!(
        "    leak check: {passed} process(es) on the simulator ended with an empty live report, {} leaked",
        leaks.len()
    );
    if !leaks.is_empty() {
        // A test that panics frees nothing, so its binary also ends with a leak report (exit 86
        // replaces the harness's 101): look for a failed test first.
        return Err(format!(
            "the simulator's live report was not empty at exit (if a test failed above, these are \
             probably its resources: a panicking test frees nothing):\n{}",
            leaks.join("\n")
        ));
    }
    if !status.success() {
        return Err(format!("cargo test failed ({status})"));
    }
    if passed == 0 {
        return Err("no test process reported the simulator's leak check".into());
    }
    eprintln!("    tests: ok in {:.0?}", started.elapsed());
    Ok(())
}

fn bench(which: &str) -> Result {
    match which {
        "pool" => run(
            "pool benchmark table",
            cargo().args(["run", "--release", "--locked", "-p", "cumem-benches", "--bin", "pool-table"]),
        ),
        "transfer" => run(
            "transfer benchmark table",
            cargo().args(["run", "--release", "--locked", "-p", "cumem-benches", "--bin", "transfer-table"]),
        ),
        "sim-pool" => run(
            "simulator per-call table",
            cargo().args(["run", "--release", "--locked", "-p", "cumem-benches", "--bin", "sim-pool-table"]),
        ),
        other => Err(format!("unknown benchmark {other:?} (available: pool, transfer, sim-pool)")),
    }
}

/// Packages (by manifest directory, as `../shared/gpu/pack-tests` names them) whose tests are not
/// for the real driver: the simulator tests itself, xtask and the benches hold no GPU tests, and
/// the CLI's tests drive the simulator.
const NOT_GPU_TESTS: [&str; 4] = ["cumem-sim", "xtask", "benches", "cumem-cli"];

/// compute-sanitizer's verdict on a target that exited without ever initialising CUDA
/// (compute-sanitizer 2025.3 then exits with 255, whatever the target's own status was).
const NOT_INSTRUMENTED: &str = "Target application terminated before first instrumented API call";

/// The exit status compute-sanitizer is told to use when it found errors: distinct from a test
/// binary's own failure (101), the simulator's leak exit (86) and the uninstrumented case (255).
const SANITIZER_ERROR_EXIT: i32 = 97;

fn gpu_test() -> Result {
    eprintln!("==> probing for a GPU");
    let probe = cargo()
        .args(["run", "--quiet", "-p", "cumem-cli", "--", "--driver", "real", "info"])
        .output()
        .map_err(|e| format!("could not run the probe: {e}"))?;
    if !probe.status.success() {
        let why = String::from_utf8_lossy(&probe.stderr);
        return Err(format!("no GPU: the real CUDA driver is not usable here ({})", why.trim()));
    }
    print!("{}", String::from_utf8_lossy(&probe.stdout));
    let limit = match std::env::var("CUMEM_GPU_TEST_TIMEOUT") {
        Ok(v) => Duration::from_secs(
            v.parse().map_err(|_| format!("CUMEM_GPU_TEST_TIMEOUT={v:?} is not a number of seconds"))?,
        ),
        Err(_) => Duration::from_secs(600),
    };
    let binaries = gpu_test_binaries()?;
    eprintln!(
        "==> {} test binaries on the real driver (default test threads, {limit:?} each)",
        binaries.len()
    );
    let mut failed = Vec::new();
    let mut skipped = Vec::new();
    let skip_log = std::env::temp_dir().join(format!("xtask-gpu-test-skips-{}.log", std::process::id()));
    for b in &binaries {
        let started = Instant::now();
        let _ = std::fs::remove_file(&skip_log);
        let mut cmd = Command::new(&b.path);
        cmd.env("CUMEM_DRIVER", "real").env(SKIP_LOG_ENV, &skip_log);
        let outcome = run_limited(&mut cmd, limit, false)?;
        let skips = read_skips(&skip_log, &b.name);
        let _ = std::fs::remove_file(&skip_log);
        let skip_note =
            if skips.is_empty() { String::new() } else { format!(", {} test(s) skipped", skips.len()) };
        skipped.extend(skips);
        let verdict = match outcome {
            Outcome::Exited(status, _) if status.success() => "ok".to_string(),
            Outcome::Exited(status, _) => {
                failed.push(format!("{} ({status})", b.name));
                format!("FAILED ({status})")
            }
            Outcome::Hung => {
                failed.push(format!("{} (hung)", b.name));
                format!("HUNG: killed after {limit:?}")
            }
        };
        eprintln!("    {}: {verdict} in {:.1?}{skip_note}", b.name, started.elapsed());
    }
    if skipped.is_empty() {
        eprintln!("==> no test skipped");
    } else {
        eprintln!(
            "==> {} test(s) skipped on this machine (they pass without running their checks):",
            skipped.len()
        );
        for s in &skipped {
            eprintln!("    skipped: {s}");
        }
    }
    match find_sanitizer() {
        Some(sanitizer) => {
            eprintln!("==> compute-sanitizer memcheck ({})", sanitizer.display());
            for b in &binaries {
                let mut cmd = Command::new(&sanitizer);
                cmd.args(["--tool", "memcheck", "--leak-check", "full", "--report-api-errors", "no"])
                    .args(["--error-exitcode", &SANITIZER_ERROR_EXIT.to_string()])
                    .arg(&b.path)
                    .env("CUMEM_DRIVER", "real");
                let verdict = match run_limited(&mut cmd, limit, true)? {
                    Outcome::Exited(status, output) => match memcheck_verdict(status, &output) {
                        Memcheck::Clean => "clean".to_string(),
                        Memcheck::NoCudaCall => "skipped: it makes no CUDA call".to_string(),
                        Memcheck::Failed(why) => {
                            eprint!("{output}");
                            failed.push(format!("memcheck {} ({why})", b.name));
                            format!("FAILED: {why}")
                        }
                    },
                    Outcome::Hung => {
                        failed.push(format!("memcheck {} (hung)", b.name));
                        format!("HUNG: killed after {limit:?}")
                    }
                };
                eprintln!("    memcheck {}: {verdict}", b.name);
            }
        }
        None => eprintln!("    compute-sanitizer not found; skipped memcheck"),
    }
    if failed.is_empty() { Ok(()) } else { Err(format!("on the real driver: {}", failed.join(", "))) }
}

/// The variable naming the file to which `cumem_sys::testing::skip` appends `<test>\t<why>`
/// (`cumem_sys::testing::SKIP_LOG_ENV`; xtask does not depend on cumem-sys).
const SKIP_LOG_ENV: &str = "CUMEM_TEST_SKIP_LOG";

/// The skips `binary` logged to `path`, as `binary: test: why` (none when it logged nothing).
fn read_skips(path: &Path, binary: &str) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter(|l| !l.is_empty())
        .map(|l| match l.split_once('\t') {
            Some((test, why)) => format!("{binary}: {test}: {why}"),
            None => format!("{binary}: {l}"),
        })
        .collect()
}

/// One test executable built by `cargo test --no-run`.
struct TestBinary {
    /// `package/target`, e.g. `cumem-core/device_buffer` (a library's unit tests: its crate name).
    name: String,
    path: PathBuf,
}

/// Builds the workspace's test binaries once and returns those meant for the real driver.
fn gpu_test_binaries() -> Result<Vec<TestBinary>> {
    eprintln!("==> cargo test --no-run (building the test binaries)");
    let output = cargo()
        .args(["test", "--workspace", "--locked", "--no-run", "--message-format=json"])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo test --no-run: could not start: {e}"))?;
    if !output.status.success() {
        return Err(format!("cargo test --no-run failed ({})", output.status));
    }
    Ok(test_binaries(&String::from_utf8_lossy(&output.stdout)))
}

/// The test executables in cargo's JSON messages, less the packages of [`NOT_GPU_TESTS`].
fn test_binaries(messages: &str) -> Vec<TestBinary> {
    let mut out = Vec::new();
    for line in messages.lines() {
        let Ok(m) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if m["reason"] != "compiler-artifact" || m["profile"]["test"] != true {
            continue;
        }
        let (Some(exe), Some(manifest), Some(target)) =
            (m["executable"].as_str(), m["manifest_path"].as_str(), m["target"]["name"].as_str())
        else {
            continue;
        };
        let package = Path::new(manifest)
            .parent()
            .and_then(Path::file_name)
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if NOT_GPU_TESTS.contains(&package.as_str()) {
            continue;
        }
        out.push(TestBinary { name: format!("{package}/{target}"), path: PathBuf::from(exe) });
    }
    out
}

/// How a time-limited command ended.
enum Outcome {
    /// It exited; with its stdout and stderr when they were captured.
    Exited(ExitStatus, String),
    /// It ran past its limit and was killed (with everything it started).
    Hung,
}

/// Runs `cmd` for at most `limit`, capturing its output (interleaved as it came) when `capture`,
/// else letting it print. Past the limit it is killed with its descendants: compute-sanitizer runs
/// its target as a child, which must not outlive it. (Not a process group of its own: Ctrl-C in
/// the terminal must still reach the tests.)
fn run_limited(cmd: &mut Command, limit: Duration, capture: bool) -> Result<Outcome> {
    let log = if capture {
        let path = std::env::temp_dir().join(format!("xtask-gpu-test-{}.log", std::process::id()));
        let file = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let err = file.try_clone().map_err(|e| format!("{}: {e}", path.display()))?;
        cmd.stdout(file).stderr(err);
        Some(path)
    } else {
        None
    };
    let mut child: Child = cmd.spawn().map_err(|e| format!("{cmd:?}: could not start: {e}"))?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("{cmd:?}: {e}"))? {
            break Some(status);
        }
        if started.elapsed() > limit {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = match &log {
        Some(path) => {
            let text =
                std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
            let _ = std::fs::remove_file(path);
            text
        }
        None => String::new(),
    };
    match status {
        Some(status) => Ok(Outcome::Exited(status, output)),
        None => {
            // Descendants first: once their parent dies they are reparented and out of reach.
            let mut tree = vec![child.id()];
            let mut i = 0;
            while let Some(&pid) = tree.get(i) {
                tree.extend(children(pid));
                i += 1;
            }
            for pid in tree.iter().rev() {
                let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).stderr(Stdio::null()).status();
            }
            let _ = child.wait();
            Ok(Outcome::Hung)
        }
    }
}

/// The pids of the direct children of `pid` (Linux: `/proc/<pid>/task/<tid>/children`).
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|list| list.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>())
        .collect()
}

/// What one memcheck run found.
#[derive(Debug, PartialEq, Eq)]
enum Memcheck {
    /// The binary ran instrumented and memcheck reported no error.
    Clean,
    /// The binary never initialised CUDA (e.g. unit tests of pure logic): nothing to check.
    NoCudaCall,
    /// Errors found, or the binary failed under the sanitizer: why.
    Failed(String),
}

/// Reads compute-sanitizer's exit status and output. Its own verdict on an uninstrumented run
/// wins over the status; an instrumented run always ends with an "ERROR SUMMARY" line, so a
/// successful run without one instrumented nothing either.
fn memcheck_verdict(status: ExitStatus, output: &str) -> Memcheck {
    let summary = output.lines().rev().find(|l| l.contains("ERROR SUMMARY"));
    if output.contains(NOT_INSTRUMENTED) || (status.success() && summary.is_none()) {
        return Memcheck::NoCudaCall;
    }
    let summary = summary.map(|l| l.trim_start_matches(['=', ' ']).to_string());
    match (status.code(), summary) {
        (Some(0), _) => Memcheck::Clean,
        (Some(SANITIZER_ERROR_EXIT), Some(s)) => Memcheck::Failed(s),
        (_, Some(s)) => Memcheck::Failed(format!("the tests failed under the sanitizer ({status}; {s})")),
        (_, None) => Memcheck::Failed(format!("the sanitizer ended without a summary ({status})")),
    }
}

/// compute-sanitizer on `PATH`, else in the CUDA toolkit (`$CUDA_HOME`, `/usr/local/cuda`), where
/// installers put it without adding it to `PATH`.
fn find_sanitizer() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("compute-sanitizer"));
    let toolkit = std::env::var_os("CUDA_HOME")
        .map(PathBuf::from)
        .into_iter()
        .chain([PathBuf::from("/usr/local/cuda")])
        .map(|d| d.join("bin").join("compute-sanitizer"));
    on_path.chain(toolkit).find(|p| {
        Command::new(p)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    fn exit(code: i32) -> ExitStatus {
        ExitStatus::from_raw(code << 8)
    }

    #[test]
    fn skips_are_listed_per_binary_with_their_test_and_reason() {
        let path = std::env::temp_dir().join(format!("xtask-skips-test-{}.log", std::process::id()));
        assert!(read_skips(&path, "cumem-peer/peer").is_empty(), "no file: nothing skipped");
        std::fs::write(&path, "two_devices\tneeds 2 devices, the real driver has 1\n\nodd line\n").unwrap();
        let skips = read_skips(&path, "cumem-peer/peer");
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            skips,
            [
                "cumem-peer/peer: two_devices: needs 2 devices, the real driver has 1",
                "cumem-peer/peer: odd line"
            ]
        );
    }

    #[test]
    fn test_binaries_are_the_test_executables_outside_the_simulator_xtask_benches_and_cli() {
        let messages = [
            r#"{"reason":"compiler-artifact","manifest_path":"/w/crates/cumem-core/Cargo.toml","target":{"name":"device_buffer"},"profile":{"test":true},"executable":"/w/target/debug/deps/device_buffer-1"}"#,
            r#"{"reason":"compiler-artifact","manifest_path":"/w/crates/cumem-core/Cargo.toml","target":{"name":"cumem_core"},"profile":{"test":false},"executable":null}"#,
            r#"{"reason":"compiler-artifact","manifest_path":"/w/crates/cumem-sim/Cargo.toml","target":{"name":"streams"},"profile":{"test":true},"executable":"/w/target/debug/deps/streams-2"}"#,
            r#"{"reason":"compiler-artifact","manifest_path":"/w/benches/Cargo.toml","target":{"name":"pool-table"},"profile":{"test":true},"executable":"/w/target/debug/deps/pool_table-3"}"#,
            r#"{"reason":"compiler-artifact","manifest_path":"/w/xtask/Cargo.toml","target":{"name":"xtask"},"profile":{"test":true},"executable":"/w/target/debug/deps/xtask-4"}"#,
            r#"{"reason":"compiler-artifact","manifest_path":"/w/crates/cumem-cli/Cargo.toml","target":{"name":"cumem"},"profile":{"test":true},"executable":"/w/target/debug/deps/cumem-5"}"#,
            r#"{"reason":"compiler-artifact","manifest_path":"/w/crates/cumem-pool/Cargo.toml","target":{"name":"cumem_pool"},"profile":{"test":true},"executable":"/w/target/debug/deps/cumem_pool-6"}"#,
            r#"{"reason":"build-finished","success":true}"#,
            "Compiling is not JSON",
        ]
        .join("\n");
        let found: Vec<(String, PathBuf)> =
            test_binaries(&messages).into_iter().map(|b| (b.name, b.path)).collect();
        assert_eq!(
            found,
            [
                (
                    "cumem-core/device_buffer".to_string(),
                    PathBuf::from("/w/target/debug/deps/device_buffer-1")
                ),
                ("cumem-pool/cumem_pool".to_string(), PathBuf::from("/w/target/debug/deps/cumem_pool-6")),
            ]
        );
    }

    #[test]
    fn memcheck_skips_a_binary_without_cuda_calls_and_fails_on_errors_or_test_failures() {
        // What compute-sanitizer 2025.3 printed for a target that never called CUDA.
        let none = "========= COMPUTE-SANITIZER\n========= Error: Target application terminated before first instrumented API call\n";
        assert_eq!(memcheck_verdict(exit(255), none), Memcheck::NoCudaCall);
        assert_eq!(memcheck_verdict(exit(0), "running 3 tests\ntest result: ok\n"), Memcheck::NoCudaCall);
        let clean = "========= COMPUTE-SANITIZER\ntest result: ok\n========= LEAK SUMMARY: 0 bytes leaked in 0 allocations\n========= ERROR SUMMARY: 0 errors\n";
        assert_eq!(memcheck_verdict(exit(0), clean), Memcheck::Clean);
        let leak = "========= Leaked 64 bytes at 0x7f0000000000\n========= ERROR SUMMARY: 1 error\n";
        assert_eq!(
            memcheck_verdict(exit(SANITIZER_ERROR_EXIT), leak),
            Memcheck::Failed("ERROR SUMMARY: 1 error".into())
        );
        let failing = "test result: FAILED. 2 passed; 1 failed\n========= ERROR SUMMARY: 0 errors\n";
        assert!(
            matches!(memcheck_verdict(exit(101), failing), Memcheck::Failed(w) if w.contains("tests failed"))
        );
        assert!(
            matches!(memcheck_verdict(exit(9), "Killed\n"), Memcheck::Failed(w) if w.contains("without a summary"))
        );
    }

    #[test]
    fn a_command_past_its_limit_is_killed_with_its_children_and_reported_as_hung() {
        let pid_file = std::env::temp_dir().join(format!("xtask-hung-child-{}", std::process::id()));
        let started = Instant::now();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", &format!("sleep 30 & echo $! > {}; wait", pid_file.display())]);
        assert!(matches!(run_limited(&mut cmd, Duration::from_millis(500), true), Ok(Outcome::Hung)));
        assert!(started.elapsed() < Duration::from_secs(10));
        // The grandchild died with it (gone, or a zombie waiting for its new parent to reap it).
        let pid = std::fs::read_to_string(&pid_file).expect("the shell wrote its child's pid");
        let _ = std::fs::remove_file(&pid_file);
        std::thread::sleep(Duration::from_millis(100));
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
        assert!(stat.is_empty() || stat.contains(") Z "), "the grandchild still runs: {stat}");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo out; echo err >&2; exit 3"]);
        match run_limited(&mut cmd, Duration::from_secs(30), true) {
            Ok(Outcome::Exited(status, output)) => {
                assert_eq!(status.code(), Some(3));
                assert!(output.contains("out") && output.contains("err"), "{output}");
            }
            _ => panic!("the command should have exited"),
        }
    }
}
