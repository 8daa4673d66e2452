//! Gives the cdylib the soname `libcuda.so`, so that once it is loaded by path, cudarc's
//! `dlopen("libcuda.so")` resolves to it; and records the target directory so that the rlib can
//! find its own cdylib from test binaries, doctests and examples.
use std::path::PathBuf;

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so");
    // The simulator runs threads and an atexit handler from its own code: it must never be
    // unmapped by a dlclose while those exist.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    // OUT_DIR = <target>/<profile>/build/cumem-sim-<hash>/out
    if let Some(profile_dir) = out.ancestors().nth(3) {
        println!("cargo:rustc-env=CUMEM_SIM_PROFILE_DIR={}", profile_dir.display());
    }
    println!("cargo:rerun-if-changed=build.rs");
}
