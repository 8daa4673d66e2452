//! Finding the simulator's shared library from a test binary, doctest or example.

use std::path::PathBuf;

/// The file name of the simulator's cdylib.
pub const LIBRARY_FILE_NAME: &str = "libcumem_sim.so";

/// Locates `libcumem_sim.so`.
///
/// Order: the `CUMEM_SIM_LIB` environment variable if set; else beside the running executable
/// (its directory and `deps/`; and, for an executable in a cargo `deps/` or `examples/` folder, the
/// parent and the parent's `deps/` — covering test binaries and examples); else the cargo profile
/// directory this crate was built for and its `deps/` (covering doctests, whose binaries live in a
/// temporary directory). The first existing file
/// wins; `None` if there is none.
pub fn library_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CUMEM_SIM_LIB") {
        return Some(PathBuf::from(p));
    }
    let mut candidates = Vec::new();
    if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(PathBuf::from)) {
        candidates.push(dir.join(LIBRARY_FILE_NAME));
        candidates.push(dir.join("deps").join(LIBRARY_FILE_NAME));
        // Only inside a cargo profile layout: a doctest runs from a temporary folder whose parent
        // (`/tmp`) may hold any stale copy of the library.
        let in_profile_subfolder = dir.file_name().is_some_and(|name| name == "deps" || name == "examples");
        if let Some(parent) = dir.parent().filter(|_| in_profile_subfolder) {
            candidates.push(parent.join(LIBRARY_FILE_NAME));
            candidates.push(parent.join("deps").join(LIBRARY_FILE_NAME));
        }
    }
    let profile = PathBuf::from(env!("CUMEM_SIM_PROFILE_DIR"));
    candidates.push(profile.join("deps").join(LIBRARY_FILE_NAME));
    candidates.push(profile.join(LIBRARY_FILE_NAME));
    candidates.into_iter().find(|p| p.is_file())
}
