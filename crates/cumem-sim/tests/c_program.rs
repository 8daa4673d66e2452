//! A C program, compiled here with the system C compiler against the simulator (linked as
//! `libcuda.so`, prototypes declared by the program itself), must pass all its checks: plain and
//! `_v2` allocation, per-thread default stream copies and memsets, cuGetProcAddress_v2,
//! SYNC_MEMOPS, and an own context destroyed with a live allocation.

use std::path::PathBuf;
use std::process::Command;

/// A fresh directory for the build.
fn work_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cumem-sim-c-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a temporary directory");
    dir
}

#[test]
fn c_client_runs_clean_against_the_simulator() {
    let lib = cumem_sim::library_path().expect("libcumem_sim.so is built beside the tests");
    let dir = work_dir();
    // The simulator's soname is libcuda.so: link it under that name, as a program built for the
    // real driver would be.
    std::os::unix::fs::symlink(&lib, dir.join("libcuda.so")).expect("symlink libcuda.so");
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/c/driver_client.c");
    let exe = dir.join("driver_client");
    let cc = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-fPIE", "-pie", "-o"])
        .arg(&exe)
        .arg(&source)
        .arg(format!("-L{}", dir.display()))
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .arg("-lcuda")
        .output()
        .expect("the system C compiler `cc` runs");
    assert!(cc.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&cc.stderr));
    let run = Command::new(&exe)
        .env("CUMEM_SIM", "devices=1,memory=8GiB,latency_us=50,leak_check=1")
        .output()
        .expect("run the C program");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    eprintln!("{stdout}");
    assert!(run.status.success(), "the C program failed ({}):\n{stdout}\n{stderr}", run.status);
    assert!(stdout.contains("all checks passed"), "{stdout}");
    assert!(stdout.contains("own context: created, used, destroyed with a live allocation"), "{stdout}");
    assert!(stderr.contains("leak check passed"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
