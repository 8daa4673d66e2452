//! Stand-in driver libraries for tests of driver selection: a few `extern "C"` entry points
//! compiled, with the `rustc` that builds the tests, into a directory of their own that a child
//! process gets on `LD_LIBRARY_PATH` (the library path is read at process start).
//!
//! ```no_run
//! let source = "#[no_mangle] pub extern \"C\" fn cuInit(_flags: u32) -> i32 { 100 }";
//! // As a driver install has it: `libcuda.so.1`, and `libcuda.so` linking to it.
//! if let Some(dir) = cumem_sys::testing::stand_in::build("doc", source, "libcuda.so.1", &["libcuda.so"], &[]) {
//!     // run a child with LD_LIBRARY_PATH=dir, then remove dir
//!     let _ = std::fs::remove_dir_all(dir);
//! }
//! ```

use std::path::PathBuf;
use std::process::Command;

/// Builds `source` (Rust, edition 2021) as a `cdylib` named `file_name` into a fresh directory
/// whose name carries `tag` and this process's id (one left by an earlier run is replaced), with a
/// symbolic link to it under each name of `links`, passing each of `link_args` to the linker
/// (`-z,nodelete` makes a library that stays loaded after its last close, as NVIDIA's driver may),
/// and returns the directory. `None` where no `rustc` can be run (the GPU machine, which gets the
/// test binaries without a toolchain): the caller skips.
///
/// A stand-in for the driver is best built as `libcuda.so.1` with a `libcuda.so` link, as a
/// driver install has it: `auto` probes only `libcuda.so.1`, and cudarc opens `libcuda.so` first;
/// a stand-in found only as `libcuda.so` is a CUDA toolkit's stub to `auto`.
///
/// # Panics
/// If the directory cannot be written or `rustc` fails on the source.
pub fn build(
    tag: &str,
    source: &str,
    file_name: &str,
    links: &[&str],
    link_args: &[&str],
) -> Option<PathBuf> {
    let dir = std::env::temp_dir().join(format!("cumem-stand-in-{}-{tag}", std::process::id()));
    // Left by an earlier run that failed before removing it (a process id comes round again):
    // its links would make `symlink` fail.
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("removing the stand-in directory {}: {e}", dir.display()),
    }
    std::fs::create_dir_all(&dir).expect("a directory for the stand-in");
    let src = dir.join("stand_in.rs");
    std::fs::write(&src, source).expect("the stand-in's source");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let mut command = Command::new(rustc);
    command.args(["--edition", "2021", "--crate-type", "cdylib", "--crate-name", "cuda", "-o"]);
    command.arg(dir.join(file_name)).arg(&src);
    for arg in link_args {
        command.arg(format!("-Clink-arg=-Wl,{arg}"));
    }
    let out = match command.output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let _ = std::fs::remove_dir_all(&dir);
            return None;
        }
        Err(e) => panic!("running rustc: {e}"),
    };
    assert!(out.status.success(), "building the stand-in: {}", String::from_utf8_lossy(&out.stderr));
    for link in links {
        std::os::unix::fs::symlink(file_name, dir.join(link)).expect("a link to the stand-in");
    }
    Some(dir)
}

/// Runs the test `child` of this test binary in a child process whose driver is `source` built by
/// [`build`] (as `libcuda.so.1` with a `libcuda.so` link, its directory the whole
/// `LD_LIBRARY_PATH`), with the
/// variable `env` set to `1` and `CUMEM_DRIVER` unset, within two minutes, and asserts that it
/// passed. Where no `rustc` can be run it skips ([`crate::testing::skip`]). The caller's `child`
/// test returns at once unless `env` is set; the caller's own test calls
/// [`crate::testing::init`] afterwards for its leak check.
///
/// # Panics
/// If the child fails, hangs past the deadline, or runs no test.
pub fn run_child_with_driver(tag: &str, source: &str, child: &str, env: &str) {
    let Some(dir) = build(tag, source, "libcuda.so.1", &["libcuda.so"], &[]) else {
        return crate::testing::skip(
            "no rustc to build the stand-in libcuda.so.1 (a machine without a Rust toolchain)",
        );
    };
    let outcome = crate::testing::child_process::run_child_test(
        child,
        &[(env, "1"), ("LD_LIBRARY_PATH", dir.to_str().expect("a UTF-8 temporary directory"))],
        &[crate::driver::DRIVER_ENV],
        std::time::Duration::from_secs(120),
    );
    let _ = std::fs::remove_dir_all(&dir);
    let Some(status) = outcome.status else {
        panic!("the child was still running after its deadline:\n{}", outcome.log);
    };
    assert!(status.success(), "the child failed ({status}):\n{}", outcome.log);
    assert!(outcome.log.contains("1 passed"), "the child ran no test:\n{}", outcome.log);
}
