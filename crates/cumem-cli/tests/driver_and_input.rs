//! The `cumem` binary's driver choice and input checks as a user meets them: with no `--driver`,
//! the automatic choice runs (on the simulator where there is no GPU) and line one of stdout says
//! which driver is in use; a driver that cannot be found is reported with what was searched, and
//! the simulator is suggested only when it was not the one asked for; a `demo --elements` too large
//! for the demo is an input error before anything is allocated. Each run has the simulator's leak
//! check on, so a leaking command exits non-zero.

use std::process::{Command, Output};

/// Runs `cumem` with `args` only: no `--driver`, no `CUMEM_DRIVER`, plus `env`.
fn cumem(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cumem"))
        .args(args)
        .env_remove("CUMEM_DRIVER")
        .env_remove("CUMEM_LOG")
        .env("CUMEM_SIM", "leak_check=1")
        .envs(env.iter().copied())
        .output()
        .expect("the cumem binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Line one of a successful run's stdout: the banner naming the driver in use.
fn banner_of(out: &Output) -> String {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "cumem failed ({}):\n{stderr}", out.status);
    stdout.lines().next().unwrap_or_default().to_owned()
}

/// The automatic choice: the simulator where there is no GPU (its banner names cumem-sim), the
/// GPU driver where there is one (its banner names the CUDA driver). Either way line one says so.
fn assert_names_the_driver(banner: &str) {
    let simulated = banner.starts_with("cumem: running on the simulator, not a GPU (cumem-sim (");
    let real = banner.starts_with("cumem: running on the GPU driver (CUDA driver (");
    assert!(simulated || real, "line one is not a banner naming the driver in use: {banner:?}");
}

#[test]
fn without_driver_the_automatic_choice_runs_and_line_one_names_it() {
    let demo = cumem(&["demo", "--elements", "1000"], &[]);
    let banner = banner_of(&demo);
    assert_names_the_driver(&banner);
    let stdout = text(&demo.stdout);
    assert!(stdout.contains("verify   all 1000 elements match"), "{stdout}");

    let info = cumem(&["info"], &[]);
    assert_eq!(banner_of(&info), banner, "info and demo chose the same driver");
    assert!(text(&info.stdout).contains("device 0: "), "{}", text(&info.stdout));
}

#[test]
fn a_missing_driver_is_reported_with_what_was_searched() {
    let missing = "/nonexistent/libcumem_sim.so";
    let out = cumem(&["--driver", "sim", "info"], &[("CUMEM_SIM_LIB", missing)]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("no CUDA driver found") && stderr.contains(missing), "{stderr}");
    assert!(!stderr.contains("--driver sim"), "the simulator was what failed, yet it is suggested: {stderr}");
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));

    // Where the real driver is missing too (no GPU here), the simulator is the way out. A driver
    // that is present but sees no device (`CUDA_VISIBLE_DEVICES=""`) fails at `cuInit` instead.
    let out = cumem(&["--driver", "real", "info"], &[]);
    if !out.status.success() {
        let stderr = text(&out.stderr);
        if stderr.contains("cumem: error: no CUDA driver found") {
            assert!(stderr.contains("no CUDA driver found (looked for libcuda.so"), "{stderr}");
            assert!(stderr.contains("use --driver sim"), "{stderr}");
        } else {
            assert_clean_failure(&out);
        }
    }
}

/// A failure as a user should meet it: exit code 1, a line `cumem: error: …`, no panic, nothing
/// on stdout.
fn assert_clean_failure(out: &Output) {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cumem: error: ") && !stderr.contains("panicked"), "{stderr}");
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
}

/// A stand-in driver whose `cuInit` says `CUDA_ERROR_NO_DEVICE`, as the real driver does where no
/// device is visible; built (with the `rustc` that builds the tests) into a directory of its own as
/// a driver install has it (`libcuda.so.1`, and `libcuda.so` linking to it: `auto` probes only
/// `libcuda.so.1`, and must find the stand-in, not this machine's own driver), which is
/// returned for `LD_LIBRARY_PATH`; `None` where no `rustc` can be run (the GPU machine, which gets
/// the test binaries without a toolchain).
fn driver_without_devices(name: &str) -> Option<std::path::PathBuf> {
    stand_in(name, &[])
}

/// The stand-in of [`driver_without_devices`]: every call says `CUDA_ERROR_NO_DEVICE`.
const NO_DEVICE: &str = "#[no_mangle] pub extern \"C\" fn cuInit(_flags: u32) -> i32 { 100 }\n\
                         #[no_mangle] pub extern \"C\" fn cuDeviceGetCount(_n: *mut i32) -> i32 { 100 }\n";

/// [`driver_without_devices`], with `link_args` passed to the linker.
fn stand_in(name: &str, link_args: &[&str]) -> Option<std::path::PathBuf> {
    build(name, NO_DEVICE, "libcuda.so.1", &["libcuda.so"], link_args)
}

/// `source` built as `file` into a directory of its own (one left by an earlier run is replaced),
/// with a link to it under each of `links` and `link_args` passed to the linker; `None` where no
/// `rustc` can be run.
fn build(
    name: &str,
    source: &str,
    file: &str,
    links: &[&str],
    link_args: &[&str],
) -> Option<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("cumem-cli-no-device-{}-{name}", std::process::id()));
    // Left by an earlier run that failed before removing it (a process id comes round again): its
    // links would make `symlink` fail.
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("removing the stand-in directory {}: {e}", dir.display()),
    }
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("stand_in.rs");
    std::fs::write(&src, source).unwrap();
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let out = match Command::new(rustc)
        .args(["--edition", "2021", "--crate-type", "cdylib", "--crate-name", "cuda", "-o"])
        .arg(dir.join(file))
        .arg(&src)
        .args(link_args.iter().map(|arg| format!("-Clink-arg=-Wl,{arg}")))
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let _ = std::fs::remove_dir_all(&dir);
            return None;
        }
        Err(e) => panic!("running rustc: {e}"),
    };
    assert!(out.status.success(), "building the stand-in: {}", text(&out.stderr));
    for link in links {
        std::os::unix::fs::symlink(file, dir.join(link)).unwrap();
    }
    Some(dir)
}

#[test]
fn a_driver_without_devices_fails_cleanly_and_the_hint_fits_the_choice() {
    let Some(dir) = driver_without_devices("hint") else {
        // The skip line of `cumem_sys::testing::skip` (which this crate's tests do not link),
        // straight to the stream: `eprintln!` is captured by the harness and shown only on failure.
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"skipped: a_driver_without_devices_fails_cleanly_and_the_hint_fits_the_choice: no rustc \
              to build the stand-in libcuda.so.1 (a machine without a Rust toolchain)\n",
        );
        return;
    };
    let path = dir.to_str().unwrap();

    // `real`: the driver is found, and its `cuInit` fails; not a missing driver.
    let out = cumem(&["--driver", "real", "info"], &[("LD_LIBRARY_PATH", path)]);
    assert_clean_failure(&out);
    let stderr = text(&out.stderr);
    assert!(stderr.contains("cumem: error: no CUDA device in cuInit"), "{stderr}");

    // `auto`: the simulator was tried after the real driver and not found, so `--driver sim` is no
    // way out; where to point it is.
    let missing = "/nonexistent/libcumem_sim.so";
    let out = cumem(&["info"], &[("LD_LIBRARY_PATH", path), ("CUMEM_SIM_LIB", missing)]);
    assert_clean_failure(&out);
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("no CUDA driver found")
            && stderr.contains(missing)
            && stderr.contains("no CUDA device"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("--driver sim"),
        "auto already tried the simulator, yet it is suggested: {stderr}"
    );
    assert!(stderr.contains("set CUMEM_SIM_LIB to the path of its library"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn auto_runs_on_the_simulator_after_a_driver_without_devices_that_stays_loaded() {
    // As a driver install has it: `libcuda.so.1`, and `libcuda.so` linking to it. The stand-in is
    // built not to unload on its last close (as the real driver may not), so a probe that opened
    // it as `libcuda.so` would leave that name meaning it, and the simulator could not be chosen.
    let Some(dir) = stand_in("stays-loaded", &["-z,nodelete"]) else {
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"skipped: auto_runs_on_the_simulator_after_a_driver_without_devices_that_stays_loaded: no \
              rustc to build the stand-in libcuda.so.1 (a machine without a Rust toolchain)\n",
        );
        return;
    };
    // No CUMEM_SIM_LIB: the simulator is found beside the program, as a user's build has it.
    let out = cumem(&["info"], &[("LD_LIBRARY_PATH", dir.to_str().unwrap())]);
    let _ = std::fs::remove_dir_all(&dir);
    let banner = banner_of(&out);
    assert!(banner.starts_with("cumem: running on the simulator, not a GPU (cumem-sim ("), "{banner}");
    assert!(text(&out.stdout).contains("device 0: "), "{}", text(&out.stdout));
}

#[test]
fn auto_warns_of_a_stub_libcuda_first_on_the_library_path_and_runs_on_the_simulator() {
    // A GPU machine with a CUDA toolkit's `stubs` directory before the driver's on the library
    // path: the driver is found as `libcuda.so.1`, but cudarc would open the stub as `libcuda.so`.
    let stub = "#[no_mangle] pub extern \"C\" fn cuInit(_flags: u32) -> i32 { 34 }\n";
    let driver = "#[no_mangle] pub extern \"C\" fn cuInit(_flags: u32) -> i32 { 0 }\n\
                  #[no_mangle] pub extern \"C\" fn cuDeviceGetCount(n: *mut i32) -> i32 { unsafe { *n = 1 }; 0 }\n";
    let (Some(stubs), Some(drivers)) =
        (build("stubs", stub, "libcuda.so", &[], &[]), build("driver", driver, "libcuda.so.1", &[], &[]))
    else {
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"skipped: auto_warns_of_a_stub_libcuda_first_on_the_library_path_and_runs_on_the_simulator: \
              no rustc to build the stand-ins (a machine without a Rust toolchain)\n",
        );
        return;
    };
    let path = format!("{}:{}", stubs.display(), drivers.display());
    // No CUMEM_LOG: the CLI shows warnings unless told otherwise (it used to show only errors, so
    // this warning was hidden).
    let out = cumem(&["info"], &[("LD_LIBRARY_PATH", &path)]);
    let stub_file = stubs.join("libcuda.so");
    let _ = std::fs::remove_dir_all(&stubs);
    let _ = std::fs::remove_dir_all(&drivers);
    let banner = banner_of(&out);
    assert!(banner.starts_with("cumem: running on the simulator, not a GPU (cumem-sim ("), "{banner}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("the CUDA driver is not used")
            && stderr.contains(&format!("cudarc would call {}", stub_file.display()))
            && stderr.contains("off LD_LIBRARY_PATH"),
        "{stderr}"
    );
}

#[test]
fn auto_takes_a_stub_libcuda_alone_on_the_library_path_for_no_driver() {
    // A build machine with no driver and a CUDA toolkit's `stubs` directory on the library path:
    // the stub has only the name `libcuda.so`, and every call says `CUDA_ERROR_STUB_LIBRARY`. It is
    // no driver: `auto` neither initialises it nor keeps it loaded under the name cudarc opens.
    let stub = "#[no_mangle] pub extern \"C\" fn cuInit(_flags: u32) -> i32 { 34 }\n\
                #[no_mangle] pub extern \"C\" fn cuDeviceGetCount(_n: *mut i32) -> i32 { 34 }\n";
    let Some(stubs) = build("stub-alone", stub, "libcuda.so", &[], &[]) else {
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"skipped: auto_takes_a_stub_libcuda_alone_on_the_library_path_for_no_driver: no rustc to \
              build the stand-in (a machine without a Rust toolchain)\n",
        );
        return;
    };
    // No CUMEM_SIM_LIB: the simulator is found beside the program, as a user's build has it.
    let out = cumem(&["info"], &[("LD_LIBRARY_PATH", stubs.to_str().unwrap())]);
    let _ = std::fs::remove_dir_all(&stubs);
    let banner = banner_of(&out);
    assert!(banner.starts_with("cumem: running on the simulator, not a GPU (cumem-sim ("), "{banner}");
    // No driver was passed over, so nothing warns (and warnings are shown by default).
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("WARN"), "{stderr}");
    assert!(text(&out.stdout).contains("device 0: "), "{}", text(&out.stdout));
}

#[test]
fn a_stand_in_directory_left_by_an_earlier_run_is_replaced() {
    let Some(left) = build("left", NO_DEVICE, "libcuda.so.1", &["libcuda.so"], &[]) else {
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"skipped: a_stand_in_directory_left_by_an_earlier_run_is_replaced: no rustc to build the \
              stand-in (a machine without a Rust toolchain)\n",
        );
        return;
    };
    std::fs::write(left.join("stale"), b"from an earlier run").unwrap();
    let dir = build("left", NO_DEVICE, "libcuda.so.1", &["libcuda.so"], &[]).expect("rustc ran before");
    assert_eq!(dir, left);
    assert!(dir.join("libcuda.so").is_file(), "the link to the new stand-in is missing");
    assert!(!dir.join("stale").exists(), "the earlier run's directory was kept");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn demo_elements_too_many_for_the_demo_are_an_input_error() {
    // u32::MAX values are the most the demo numbers; 2^62 elements of 4 bytes overflow usize.
    for elements in ["4611686018427387904", "4294967296"] {
        let out = cumem(&["--driver", "sim", "demo", "--elements", elements], &[]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{elements}: {stderr}");
        assert!(!stderr.contains("panicked"), "{elements}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "cumem: error: --elements {elements} is more than the demo's 4294967295 values"
            )),
            "{elements}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "nothing ran: {}", text(&out.stdout));
    }
}

/// A demo whose two device buffers cannot fit the device's memory is refused before anything is
/// built: its host data alone (16 GB for 4e9 elements) used to be allocated first, and a host that
/// could not give it aborted the process.
#[test]
fn a_demo_larger_than_the_device_is_an_input_error_before_any_allocation() {
    // The simulator's default device has 16 GiB: two buffers of 16 GB do not fit, nor do two of
    // 800 MB on a device of 1 GiB.
    for (elements, sim) in [("4000000000", "leak_check=1"), ("200000000", "leak_check=1,memory=1GiB")] {
        let out = cumem(&["--driver", "sim", "demo", "--elements", elements], &[("CUMEM_SIM", sim)]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{elements}: exit 1, not a signal: {stderr}");
        assert!(!stderr.contains("panicked"), "{elements}: {stderr}");
        assert!(
            stderr.contains(&format!("cumem: error: --elements {elements}: the demo's two device buffers"))
                && stderr.contains("do not fit device 0's"),
            "{elements}: {stderr}"
        );
        let stdout = text(&out.stdout);
        assert_eq!(stdout.lines().count(), 1, "only the banner, nothing allocated: {stdout}");
    }
}

#[test]
fn driver_names_are_read_as_the_library_reads_cumem_driver() {
    // The library takes any case and the aliases `simulator` and `cuda`: so does `--driver`, and
    // `CUMEM_DRIVER` read by the binary.
    for name in ["sim", "Sim", "SIMULATOR", "simulator"] {
        let by_flag = cumem(&["--driver", name, "info"], &[]);
        assert!(banner_of(&by_flag).starts_with("cumem: running on the simulator"), "--driver {name}");
        let by_env = cumem(&["info"], &[("CUMEM_DRIVER", name)]);
        assert!(banner_of(&by_env).starts_with("cumem: running on the simulator"), "CUMEM_DRIVER={name}");
    }
    // The real driver by another spelling is the real driver: found and used, or reported missing
    // (exit 1), never a usage error (exit 2).
    for name in ["Real", "cuda", "CUDA"] {
        let out = cumem(&["--driver", name, "info"], &[]);
        if !out.status.success() {
            assert_clean_failure(&out);
        }
    }
    let out = cumem(&["--driver", "gpu9", "info"], &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("unknown driver \"gpu9\" (expected auto, real or sim)"), "{stderr}");
}
