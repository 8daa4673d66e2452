//! Project automation. `cargo xtask <task>`:
//!
//! - `ci`: format check, clippy `-D warnings`, build, docs with warnings denied, every test and
//!   doctest on the simulator with the simulator's leak check at the end of each test binary, and
//!   the quickstart example and the demo on the simulator (what CI runs);
//! - `test`: the tests only, on the simulator;
//! - `gpu-test`: the integration tests on the real driver, plus compute-sanitizer when present;
//!   fails, saying so, where there is no GPU;
//! - `bench [pool]`: the allocator table (ns per alloc+free and the ratios between allocators,
//!   measured side by side in one run), in release mode, on the real driver if present.

use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let task = args.first().map(String::as_str).unwrap_or("help");
    let result = match task {
        "ci" => ci(),
        "test" => test_on_simulator(),
        "gpu-test" => gpu_test(),
        "bench" => bench(args.get(1).map(String::as_str).unwrap_or("pool")),
        _ => {
            eprintln!("usage: cargo xtask <ci | test | gpu-test | bench [pool]>");
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
    test_on_simulator()?;
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

/// Runs every test and doctest with the simulator as the driver and its leak check on; a test
/// binary that ends with live allocations, streams or events exits non-zero, and this says which.
fn test_on_simulator() -> Result {
    let started = Instant::now();
    eprintln!("==> cargo test (simulator, leak check at exit of every test binary)");
    let output = cargo()
        .args(["test", "--workspace", "--locked"])
        .env("CUMEM_DRIVER", "sim")
        .env("CUMEM_SIM", "leak_check=1")
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cargo test: could not start: {e}"))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprint!("{stderr}");
    let passed = stderr.lines().filter(|l| l.starts_with("cumem-sim: leak check passed")).count();
    let leaks: Vec<&str> = stderr.lines().filter(|l| l.starts_with("cumem-sim: LEAK")).collect();
    eprintln!(
        "    leak check: {passed} process(es) on the simulator ended with an empty live report, {} leaked",
        leaks.len()
    );
    if !leaks.is_empty() {
        return Err(format!("the simulator's live report was not empty at exit:\n{}", leaks.join("\n")));
    }
    if !output.status.success() {
        return Err(format!("cargo test failed ({})", output.status));
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
        other => Err(format!("unknown benchmark {other:?} (available: pool)")),
    }
}

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
    run(
        "cargo test (real driver)",
        cargo().args(["test", "--workspace", "--locked"]).env("CUMEM_DRIVER", "real"),
    )?;
    let sanitizer = Command::new("compute-sanitizer").arg("--version").output();
    if sanitizer.is_ok_and(|o| o.status.success()) {
        for tool in ["memcheck", "racecheck"] {
            run(
                &format!("compute-sanitizer --tool {tool}"),
                Command::new("compute-sanitizer")
                    .args(["--tool", tool, "--error-exitcode", "1", "--target-processes", "all"])
                    .args(["cargo", "test", "--workspace", "--locked", "--tests"])
                    .env("CUMEM_DRIVER", "real"),
            )?;
        }
    } else {
        eprintln!("    compute-sanitizer not found; skipped memcheck and racecheck");
    }
    Ok(())
}
