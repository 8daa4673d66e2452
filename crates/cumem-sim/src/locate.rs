//! Finding the simulator's shared library from a test binary, doctest or example.

use std::path::{Path, PathBuf};

/// The file name of the simulator's cdylib.
pub const LIBRARY_FILE_NAME: &str = "libcumem_sim.so";

/// Locates `libcumem_sim.so`.
///
/// Order: the `CUMEM_SIM_LIB` environment variable if set; else beside the running executable
/// (its directory and `deps/`; and, for an executable in a cargo `deps/` or `examples/` folder, the
/// parent and the parent's `deps/` — covering test binaries and examples); else the cargo profile
/// directory this crate was built for and its `deps/` (covering doctests, whose binaries live in a
/// temporary directory). The first existing file wins. Where none exists under that name, the
/// newest `libcumem_sim-<hash>.so` in those `deps/` folders: cargo names a dependency's cdylib
/// with its hash unless the dependency is a path (or workspace) dependency, as for a git or
/// registry `cumem-sim`. `None` if there is none.
pub fn library_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CUMEM_SIM_LIB") {
        return Some(PathBuf::from(p));
    }
    let exe_dir = std::env::current_exe().ok().and_then(|e| e.parent().map(PathBuf::from));
    find_in(exe_dir.as_deref(), Path::new(env!("CUMEM_SIM_PROFILE_DIR")))
}

/// [`library_path`]'s search without the environment: `exe_dir` is the running executable's
/// folder, `profile` the cargo profile directory the crate was built for.
fn find_in(exe_dir: Option<&Path>, profile: &Path) -> Option<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(dir) = exe_dir {
        dirs.push(dir.to_path_buf());
        dirs.push(dir.join("deps"));
        // Only inside a cargo profile layout: a doctest runs from a temporary folder whose parent
        // (`/tmp`) may hold any stale copy of the library.
        let in_profile_subfolder = dir.file_name().is_some_and(|name| name == "deps" || name == "examples");
        if let Some(parent) = dir.parent().filter(|_| in_profile_subfolder) {
            dirs.push(parent.to_path_buf());
            dirs.push(parent.join("deps"));
        }
    }
    dirs.push(profile.join("deps"));
    dirs.push(profile.to_path_buf());
    if let Some(exact) = dirs.iter().map(|d| d.join(LIBRARY_FILE_NAME)).find(|p| p.is_file()) {
        return Some(exact);
    }
    // Cargo only puts hashed names in `deps/`; the newest is the one built last (a stale one of
    // an older build may sit beside it). Nothing here tells which one this rlib was built with:
    // going back to an older build that is up to date picks the later one (documented).
    dirs.iter()
        .filter(|d| d.file_name().is_some_and(|n| n == "deps"))
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let name = entry.file_name();
            let name = name.to_str()?;
            let hash = name.strip_prefix("libcumem_sim-")?.strip_suffix(".so")?;
            if hash.is_empty() || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            let meta = entry.metadata().ok().filter(|m| m.is_file())?;
            Some((meta.modified().ok()?, entry.path()))
        })
        .max()
        .map(|(_, path)| path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    /// A scratch cargo layout under the system's temporary folder, removed on drop.
    struct Tree(PathBuf);

    impl Tree {
        fn new(name: &str) -> Self {
            let root = std::env::temp_dir().join(format!("cumem-locate-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(root.join("debug/deps")).unwrap();
            Tree(root)
        }
        fn file(&self, rel: &str, age_s: u64) -> PathBuf {
            let p = self.0.join(rel);
            let f = std::fs::File::create(&p).unwrap();
            f.set_modified(SystemTime::now() - Duration::from_secs(age_s)).unwrap();
            p
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_hashed_library_of_a_git_or_registry_dependency_is_found_newest_first() {
        let t = Tree::new("hashed");
        let deps = t.0.join("debug/deps");
        t.file("debug/deps/libcumem_sim-0123456789abcdef.so", 100);
        let newest = t.file("debug/deps/libcumem_sim-fedcba9876543210.so", 1);
        t.file("debug/deps/libcumem_sim-notahash.so", 0);
        t.file("debug/deps/libcumem_sim-0123456789abcdef.rlib", 0);
        let elsewhere = t.0.join("profile-without-library");
        assert_eq!(find_in(Some(&deps), &elsewhere), Some(newest.clone()));
        // A doctest: its binary sits in a temporary folder; the profile dir leads to `deps/`.
        assert_eq!(find_in(Some(&std::env::temp_dir()), &t.0.join("debug")), Some(newest));
    }

    #[test]
    fn the_unhashed_name_wins_over_hashed_ones() {
        let t = Tree::new("exact");
        let deps = t.0.join("debug/deps");
        t.file("debug/deps/libcumem_sim-0123456789abcdef.so", 0);
        let exact = t.file("debug/deps/libcumem_sim.so", 100);
        assert_eq!(find_in(Some(&deps), &t.0.join("nowhere")), Some(exact));
    }

    #[test]
    fn nothing_is_found_in_an_empty_layout() {
        let t = Tree::new("empty");
        assert_eq!(find_in(Some(&t.0.join("debug/deps")), &t.0.join("debug")), None);
    }
}
