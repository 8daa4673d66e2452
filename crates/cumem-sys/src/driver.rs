//! Choosing, loading and initialising the driver library, without ever panicking.
//!
//! cudarc resolves every entry point through `dlopen("libcuda.so")` on first use and panics when no
//! library opens. cumem therefore picks the library first: the real driver, or `cumem-sim` loaded
//! by path (its soname is `libcuda.so`, so cudarc's later `dlopen` finds the object already
//! loaded). The choice is made once per process, by [`select`] or from the environment by [`init`]:
//!
//! | `CUMEM_DRIVER` | meaning |
//! |---|---|
//! | `auto` (default) | the real driver when `libcuda.so.1` loads and sees a device, else the simulator (with a warning naming the error where `libcuda.so.1` is there but its `cuInit` fails or it sees no device); the simulator too, with a warning, where the `libcuda.so` cudarc would call is another file (a stub) found before `cuInit` (already loaded, or first on `LD_LIBRARY_PATH`); one found only after it (`RPATH`, `$ORIGIN`) is a final [`Error::DriverSelection`] |
//! | `real` | the real driver, or [`Error::DriverNotFound`] |
//! | `sim` | the simulator, from `CUMEM_SIM_LIB` or found beside the program |
//!
//! The real driver is never replaced silently: once a library is chosen, asking for the other kind
//! is an [`Error::DriverSelection`]; and `real` when `libcuda.so` resolves to cumem-sim (already
//! loaded, or first on the library path) is [`Error::DriverNotFound`], not the simulator. cudarc
//! keeps the first library it opened for the process, so a library that cudarc does not call
//! through (another crate made it open a driver before cumem chose) is refused too, as an
//! [`Error::DriverSelection`]. `auto` looks for the real driver only as `libcuda.so.1`, which every
//! driver install has: a `libcuda.so` alone (a CUDA toolkit's `stubs` directory on a machine with
//! no driver) counts as no driver, though `real` opens it. And it compares before it initialises
//! anything: where the driver it found is not the file cudarc would open as `libcuda.so` (a CUDA
//! toolkit's `stubs` directory first on `LD_LIBRARY_PATH`), the driver's `cuInit` is not run,
//! a warning names the file cudarc would call, and the simulator is used as where no driver is
//! found. A selection that fails before any driver's `cuInit` ran is not remembered; once one has
//! run, the outcome is final (see [`select`]), and that library is never unloaded.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_sys::driver::{self, DriverKind};
//! let kind = driver::init()?;
//! assert_eq!(driver::current(), Some(kind));
//! println!("running on {}", driver::description().unwrap_or_default());
//! # Ok::<(), cumem_sys::Error>(())
//! ```

use std::fmt;
use std::str::FromStr;
use std::sync::{Mutex, OnceLock};

use libloading::Library;

use crate::api::Code;
use crate::error::{Error, ErrorContext, Result, check};
use crate::sys;

/// Which driver library to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverChoice {
    /// The real driver when it is present as `libcuda.so.1` and sees a device, else the simulator
    /// (with a warning naming the error where the driver is present but its `cuInit` fails or it
    /// sees no device, and [`description`] saying so); the simulator too, with a warning, where
    /// the `libcuda.so` cudarc would call is not that driver (a CUDA toolkit's stub) and that is
    /// seen before `cuInit` (a library already loaded under that name, or the first on
    /// `LD_LIBRARY_PATH`); seen only after it (an `RPATH`, a `$ORIGIN`), the selection is a final
    /// [`Error::DriverSelection`] instead.
    Auto,
    /// The real driver only.
    Real,
    /// The simulated driver, `cumem-sim`.
    Simulator,
}

impl FromStr for DriverChoice {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(DriverChoice::Auto),
            "real" | "cuda" => Ok(DriverChoice::Real),
            "sim" | "simulator" => Ok(DriverChoice::Simulator),
            other => Err(Error::DriverSelection {
                reason: format!("unknown driver {other:?} (expected auto, real or sim)"),
            }),
        }
    }
}

/// Which driver library is in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverKind {
    /// NVIDIA's `libcuda.so`.
    Real,
    /// The simulated driver, `cumem-sim`.
    Simulator,
}

impl fmt::Display for DriverKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DriverKind::Real => "the CUDA driver",
            DriverKind::Simulator => "the simulated CUDA driver (cumem-sim)",
        })
    }
}

/// Name of the environment variable that selects the driver.
pub const DRIVER_ENV: &str = "CUMEM_DRIVER";
/// Name of the environment variable that gives the simulator library's path.
pub const SIM_LIB_ENV: &str = "CUMEM_SIM_LIB";
/// The symbol by which a library identifies itself as cumem-sim.
const SIM_MARKER: &str = "cumemSimVersion";

struct Loaded {
    kind: DriverKind,
    description: String,
    // Keeps the chosen library mapped for the life of the process; cudarc holds its own handle too.
    lib: Library,
}

static LOADED: OnceLock<Result<Loaded>> = OnceLock::new();
static SELECTING: Mutex<()> = Mutex::new(());

/// Loads and initialises the driver chosen by `CUMEM_DRIVER` (default `auto`) unless one was
/// already selected, and returns which one is in use. Cheap after the first call.
pub fn init() -> Result<DriverKind> {
    if let Some(done) = LOADED.get() {
        return done.as_ref().map(|l| l.kind).map_err(Clone::clone);
    }
    select(choice_from_env(std::env::var(DRIVER_ENV), DriverChoice::Auto)?)
}

/// The choice `CUMEM_DRIVER`'s value (`var`, as [`std::env::var`] read it) names; `unset` when it
/// is not set. A value that is not UTF-8 is an [`Error::DriverSelection`], as an unknown name is:
/// ignoring it would pick a driver the user did not ask for without a word.
pub(crate) fn choice_from_env(
    var: std::result::Result<String, std::env::VarError>,
    unset: DriverChoice,
) -> Result<DriverChoice> {
    match var {
        Ok(v) => v.parse(),
        Err(std::env::VarError::NotPresent) => Ok(unset),
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::DriverSelection {
            reason: format!("{DRIVER_ENV} is not UTF-8 ({v:?}; expected auto, real or sim)"),
        }),
    }
}

/// Selects, loads and initialises a driver. Succeeds again for a compatible choice; a request for
/// a different kind than the one already in use is an [`Error::DriverSelection`].
///
/// A selection that fails before any driver's `cuInit` ran (no library found, a library that is
/// not the kind asked for, a bad simulator configuration) leaves no driver in use: a later call may
/// choose again, for example the simulator after `Real` found no driver. A refused simulator
/// configuration is found before cudarc is asked for its library, so cudarc opens nothing for it.
/// But a library such a selection loaded may stay mapped, and cumem-sim always does (it is
/// linked never to unload): after any `Simulator` selection that loaded it and failed,
/// `libcuda.so` resolves to cumem-sim for the rest of the process, so a later `Real` is
/// [`Error::DriverNotFound`] (it resolves to cumem-sim) and `Auto` chooses the simulator. Once a
/// `cuInit` has run, the outcome is final for the process, failure included: every later call
/// returns it. That counts `Auto`'s probe of the real driver: when the real driver's `cuInit` ran
/// there and it then had no device, or failed, and the simulator cannot be loaded after it, that
/// failure is final too; so is a driver that initialised but turned out not to be the library
/// cudarc calls (the simulator is then not tried).
pub fn select(choice: DriverChoice) -> Result<DriverKind> {
    select_with_sim_config(choice, None)
}

/// Like [`select`], and if the simulator is chosen and not yet initialised, passes `sim_config`
/// (the `CUMEM_SIM` syntax, e.g. `"devices=2,memory=1GiB"`) to it before `cuInit`.
pub fn select_with_sim_config(choice: DriverChoice, sim_config: Option<&str>) -> Result<DriverKind> {
    let mut notes = Vec::new();
    let kind = {
        let _guard = SELECTING.lock().unwrap_or_else(|p| p.into_inner());
        select_locked(choice, sim_config, &mut notes)
    };
    // Logged with the lock let go: a subscriber may call `init()`, which takes it.
    for note in notes {
        note.emit();
    }
    kind
}

/// What a selection logs, kept until [`SELECTING`] is let go.
enum Note {
    /// `Auto` found no real driver (no `libcuda.so.1`, or not a driver) and tries the simulator.
    NoRealDriver(Error),
    /// `Auto` found the real driver, ran its `cuInit`, and it failed or saw no device (a driver
    /// and kernel module of different versions, `CUDA_VISIBLE_DEVICES=""`): it tries the
    /// simulator, which must not happen unseen on a machine that has a driver.
    UnusableRealDriver(Error),
    /// `Auto` found a real driver but cudarc would call another file: the driver is not used.
    Shadowed(String),
    /// The chosen driver's `cuInit` succeeded.
    Initialised(String),
    /// The chosen driver's `cuInit` failed: the failure is final for the process.
    InitFailed { driver: String, err: Error },
    /// `Auto` ran the real driver's `cuInit`, which failed or found no device, and then could not
    /// load the simulator: final too.
    SimulatorAfterProbeFailed(Error),
    /// `Auto` initialised the real driver, and then found that cudarc calls another library: the
    /// simulator is not tried, and that is final too.
    ProbedDriverRefused(Error),
}

impl Note {
    fn emit(self) {
        match self {
            // A stub's `cuInit` (the toolkit's `stubs` folder first on the library path, perhaps
            // with a `libcuda.so.1` link added) would otherwise hide a GPU machine's driver with
            // nothing but a debug line.
            Note::UnusableRealDriver(real_err)
                if real_err.code() == Some(sys::CUresult::CUDA_ERROR_STUB_LIBRARY) =>
            {
                tracing::warn!(
                    %real_err,
                    "the libcuda.so.1 found is the CUDA toolkit's stub, not a driver (take its folder off \
                     LD_LIBRARY_PATH to use a GPU); trying the simulator"
                )
            }
            Note::UnusableRealDriver(real_err) => {
                // The error in the message, not only as a field: a formatter that drops fields
                // would otherwise say only that the GPU is not used.
                tracing::warn!(
                    %real_err,
                    "the CUDA driver ({PROBE_NAME}) was found but is not usable ({real_err}); trying the simulator"
                )
            }
            Note::NoRealDriver(real_err) => {
                tracing::debug!(%real_err, "no usable CUDA driver; trying the simulator")
            }
            Note::Shadowed(reason) => {
                tracing::warn!(
                    %reason,
                    "the CUDA driver is not used (not initialised), since cudarc would call another libcuda.so; trying the simulator"
                )
            }
            Note::Initialised(driver) => tracing::info!(%driver, "CUDA driver initialised"),
            Note::InitFailed { driver, err } => {
                tracing::warn!(%driver, %err, "CUDA driver initialisation failed; final for this process")
            }
            Note::SimulatorAfterProbeFailed(err) => {
                tracing::warn!(%err, "no usable CUDA driver nor simulator; final for this process")
            }
            Note::ProbedDriverRefused(err) => {
                tracing::warn!(%err, "the CUDA driver was initialised, but cudarc calls another library; final for this process")
            }
        }
    }
}

/// [`select_with_sim_config`] with [`SELECTING`] held.
fn select_locked(
    choice: DriverChoice,
    sim_config: Option<&str>,
    notes: &mut Vec<Note>,
) -> Result<DriverKind> {
    if let Some(done) = LOADED.get() {
        let kind = done.as_ref().map(|l| l.kind).map_err(Clone::clone)?;
        return match (choice, kind) {
            (DriverChoice::Auto, _)
            | (DriverChoice::Real, DriverKind::Real)
            | (DriverChoice::Simulator, DriverKind::Simulator) => Ok(kind),
            _ => Err(Error::DriverSelection {
                reason: format!("{kind} is already in use; the driver is chosen once per process"),
            }),
        };
    }
    let loaded = match load(choice, sim_config, notes) {
        Ok(loaded) => loaded,
        // Not remembered: no library was initialised, so nothing is in use yet.
        Err(Failed { err, after_init: false }) => return Err(err),
        // Remembered: retrying would load the real driver and run its `cuInit` again on every
        // call, only to fail the same way.
        Err(Failed { err, after_init: true }) => {
            let _ = LOADED.set(Err(err.clone()));
            return Err(err);
        }
    };
    // Through the loaded library and as the C `int` it returns (see `InitFn`), not cudarc's
    // `sys::cuInit`, whose `CUresult` cannot hold a code newer than the bindings; `load` checked
    // that cudarc calls this same library, so cudarc's later calls see it initialised.
    // SAFETY: `cuInit` has this C signature in every driver and in cumem-sim.
    let init = match unsafe { loaded.lib.get::<InitFn>("cuInit") } {
        Ok(init) => *init,
        // Not reached (the check of cudarc's handle compares `cuInit`), and nothing ran yet.
        Err(_) => {
            return Err(Error::DriverSelection { reason: format!("{} has no cuInit", loaded.description) });
        }
    };
    // SAFETY: resolved from the loaded library, which stays mapped while `init` runs; no pointers.
    let outcome = match check(Code(unsafe { init(0) }), ErrorContext::op("cuInit")) {
        Ok(()) => {
            notes.push(Note::Initialised(loaded.description.clone()));
            Ok(loaded)
        }
        Err(err) => {
            notes.push(Note::InitFailed { driver: loaded.description.clone(), err: err.clone() });
            keep_mapped(loaded.lib);
            Err(err)
        }
    };
    let kind = outcome.as_ref().map(|l| l.kind).map_err(Clone::clone);
    // Remembered either way: the library has initialised (or failed to), and choosing another
    // one now could leave two drivers live in the process.
    let _ = LOADED.set(outcome);
    kind
}

/// The driver in use, if one was selected successfully.
pub fn current() -> Option<DriverKind> {
    LOADED.get()?.as_ref().ok().map(|l| l.kind)
}

/// A one-line description of the driver library in use (its kind and path). Where `auto` found
/// the real driver but runs on the simulator (its `cuInit` failed or it saw no device, or cudarc
/// would call another `libcuda.so`), the line goes on to say so and why.
pub fn description() -> Option<String> {
    LOADED.get()?.as_ref().ok().map(|l| l.description.clone())
}

/// The loaded driver library, for probing optional symbols.
pub(crate) fn library() -> Option<&'static Library> {
    LOADED.get()?.as_ref().ok().map(|l| &l.lib)
}

/// Why [`load`] found no library to initialise, and whether a `cuInit` ran on the way (`Auto`'s
/// probe of the real driver), which makes the failure final.
struct Failed {
    err: Error,
    after_init: bool,
}

impl From<Error> for Failed {
    fn from(err: Error) -> Self {
        Failed { err, after_init: false }
    }
}

fn load(
    choice: DriverChoice,
    sim_config: Option<&str>,
    notes: &mut Vec<Note>,
) -> std::result::Result<Loaded, Failed> {
    match choice {
        DriverChoice::Real => {
            let real = load_real()?;
            check_cudarc_calls(&real)?;
            Ok(real)
        }
        DriverChoice::Simulator => Ok(load_simulator(sim_config)?),
        DriverChoice::Auto => match probe_real(notes) {
            // The probe ran the driver's `cuInit` (after comparing with what cudarc would open, so
            // a refusal here means the loader answered `libcuda.so` otherwise than foreseen): a
            // refusal now is final, and the initialised driver stays mapped.
            Ok(real) => match check_cudarc_calls(&real) {
                Ok(()) => Ok(real),
                Err(err) => {
                    keep_mapped(real.lib);
                    notes.push(Note::ProbedDriverRefused(err.clone()));
                    Err(Failed { err, after_init: true })
                }
            },
            Err(Failed { err: real_err, after_init }) => {
                // A driver was found and not used: its `cuInit` ran and failed or saw no device,
                // or cudarc would call another file (the only `DriverSelection` of the probe).
                let passed_over = after_init || matches!(real_err, Error::DriverSelection { .. });
                notes.push(if after_init {
                    Note::UnusableRealDriver(real_err.clone())
                } else {
                    Note::NoRealDriver(real_err.clone())
                });
                let simulator = load_simulator(sim_config).map(|mut sim| {
                    // So that a program showing `description()` says why it is not on the GPU,
                    // whatever its log level lets through.
                    if passed_over {
                        sim.description = format!(
                            "{}; the CUDA driver ({PROBE_NAME}) was found but not used: {real_err}",
                            sim.description
                        );
                    }
                    sim
                });
                simulator.map_err(|sim_err| {
                    let err = match sim_err {
                        Error::DriverNotFound { searched } => {
                            Error::DriverNotFound { searched: format!("{searched}; real driver: {real_err}") }
                        }
                        other => other,
                    };
                    if after_init {
                        notes.push(Note::SimulatorAfterProbeFailed(err.clone()));
                    }
                    Failed { err, after_init }
                })
            }
        },
    }
}

fn real_candidates() -> Vec<String> {
    cudarc::get_lib_name_candidates("cuda")
}

fn has_symbol(lib: &Library, name: &str) -> bool {
    // SAFETY: only the symbol's presence is checked; the pointer is never called or dereferenced.
    unsafe { lib.get::<*const ()>(name).is_ok() }
}

fn open_first(names: &[String]) -> Option<(Library, String)> {
    names.iter().find_map(|name| {
        // SAFETY: opening a library runs its initialisers, whatever file the name resolves to on
        // this machine's library path (which the user controls, as for the program's own
        // dependencies): the CUDA driver's and cumem-sim's require nothing of the caller; the
        // file is checked to be a driver only after they ran.
        unsafe { Library::new(name.as_str()) }.ok().map(|lib| (lib, name.clone()))
    })
}

fn describe(lib: &Library, name: &str) -> (DriverKind, String) {
    if has_symbol(lib, SIM_MARKER) {
        (DriverKind::Simulator, format!("cumem-sim ({name})"))
    } else {
        (DriverKind::Real, format!("CUDA driver ({name})"))
    }
}

/// The real driver by cudarc's names, in cudarc's order: the library cudarc opens too.
fn load_real() -> Result<Loaded> {
    open_real(&real_candidates())
}

/// The first of `names` that opens, refused if it is cumem-sim.
fn open_real(names: &[String]) -> Result<Loaded> {
    let (lib, name) =
        open_first(names).ok_or_else(|| Error::DriverNotFound { searched: names.join(", ") })?;
    let (kind, description) = describe(&lib, &name);
    if kind == DriverKind::Simulator {
        // cumem-sim under the driver's name: the real driver is not to be had by this name.
        return Err(Error::DriverNotFound {
            searched: format!("{name} (it resolves to cumem-sim, not the CUDA driver)"),
        });
    }
    Ok(Loaded { kind, description, lib })
}

/// The name `Auto`'s probe opens the real driver by: `libcuda.so.1`, the soname, which every
/// NVIDIA driver install has. A file found only as `libcuda.so` is taken for no driver (a CUDA
/// toolkit's `stubs` directory has only that name; `Real` still opens it).
///
/// A probe that ran the driver's `cuInit` and found no device leaves the driver loaded (see
/// [`keep_mapped`]; a driver may also never unload on its last close). Had it been opened as
/// `libcuda.so`, the loader would keep answering that name with it: cudarc's `dlopen("libcuda.so")`
/// would then find it, not cumem-sim (glibc answers a name with the first loaded object that was
/// opened by it or has it as its soname; cumem-sim, opened by path after the probe, has it only as
/// its soname), and the simulator could never be selected. Opened as `libcuda.so.1`, it holds no
/// other name.
const PROBE_NAME: &str = "libcuda.so.1";

/// `cuInit` as every driver and cumem-sim export it. The result is read as the C `int` it is: a
/// driver newer than cudarc's bindings may return a code that `sys::CUresult` has no variant for,
/// which read as that enum would be undefined behaviour.
type InitFn = unsafe extern "C" fn(u32) -> i32;

/// Leaves a library whose `cuInit` ran mapped for the rest of the process. NVIDIA's driver starts
/// threads in `cuInit`; unloading it under them could crash the process.
fn keep_mapped(lib: Library) {
    std::mem::forget(lib);
}

/// What cudarc's first name, `libcuda.so`, will open, found without loading a file by that name:
/// a driver loaded (and never unloaded) under that name would keep answering it after a probe that
/// found no device, and cumem-sim could then never be cudarc's library.
enum CudarcTarget {
    /// A library already loaded answers the name (cudarc's own handle, or one the program loaded).
    Loaded(Library),
    /// Nothing loaded answers it, and this file is the first by that name in a directory of
    /// `LD_LIBRARY_PATH`, which the loader searches before its cache and the system directories.
    OnLibraryPath(std::path::PathBuf),
    /// Neither: the loader's cache or the system directories answer, where a driver install puts
    /// `libcuda.so` beside `libcuda.so.1`. (A program built with an `RPATH`, searched before
    /// `LD_LIBRARY_PATH`, or a directory of it named through `$ORIGIN` or another token that glibc
    /// expands, is not foreseen: the check of cudarc's handle after `cuInit` catches it.)
    Unforeseen,
}

fn cudarc_target() -> CudarcTarget {
    let Some(first) = real_candidates().into_iter().next() else {
        return CudarcTarget::Unforeseen;
    };
    #[cfg(unix)]
    {
        // SAFETY: `RTLD_NOLOAD` maps nothing and runs no initialiser. glibc may still search the
        // library path and open a file of that name to compare it with the loaded libraries; one
        // that is the same file gets the name added, and is answered. That name stays: where a
        // driver was already loaded as `libcuda.so.1` (by libcudart, or a program linked with
        // `-lcuda`) and the `libcuda.so` found links to it, `libcuda.so` means that driver from
        // now on, so a simulator loaded after a probe that found no device is refused, where
        // cudarc's own open would have found the simulator (by its soname) first. It never maps
        // the file.
        let lib = unsafe {
            libloading::os::unix::Library::open(Some(first.as_str()), libc::RTLD_LAZY | libc::RTLD_NOLOAD)
        };
        if let Ok(lib) = lib {
            return CudarcTarget::Loaded(Library::from(lib));
        }
    }
    first_on_library_path(std::env::var_os("LD_LIBRARY_PATH").as_deref(), &first)
        .map_or(CudarcTarget::Unforeseen, CudarcTarget::OnLibraryPath)
}

/// The first file called `name` in a directory of `library_path` (the value of `LD_LIBRARY_PATH`),
/// as glibc searches it: unset or empty, the variable is ignored; within a value, directories are
/// separated by `:` or `;`, and an empty one is the working directory. A value that is not UTF-8
/// is not read (`None`, as where nothing is found).
fn first_on_library_path(library_path: Option<&std::ffi::OsStr>, name: &str) -> Option<std::path::PathBuf> {
    let dirs = library_path.filter(|v| !v.is_empty())?.to_str()?;
    dirs.split([':', ';'])
        .map(|dir| std::path::Path::new(if dir.is_empty() { "." } else { dir }).join(name))
        .find(|path| path.is_file())
}

/// The file a loaded library was mapped from (as the loader found it), found by its `cuInit`.
fn file_of(lib: &Library) -> Option<std::path::PathBuf> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        // SAFETY: only the symbol's address is taken; it is not called or dereferenced.
        let addr = unsafe { lib.get::<*const ()>("cuInit") }.ok().map(|s| *s)?;
        let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
        // SAFETY: `addr` lies in a library that `lib` keeps mapped; `dladdr` only reads the
        // loader's tables and writes `info`, valid for writes.
        if unsafe { libc::dladdr(addr.cast(), info.as_mut_ptr()) } == 0 {
            return None;
        }
        // SAFETY: `dladdr` succeeded, so it filled `info`.
        let info = unsafe { info.assume_init() };
        if info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: `dli_fname` is the loader's NUL-terminated name of the object, alive while `lib`
        // keeps it mapped; it is copied at once.
        let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
        Some(std::ffi::OsStr::from_bytes(name.to_bytes()).into())
    }
    #[cfg(not(unix))]
    {
        let _ = lib;
        None
    }
}

/// Whether two paths are one file, by device and inode after following links, as the dynamic
/// loader tells a file it already loaded. `None` where either cannot be read.
fn same_file(a: &std::path::Path, b: &std::path::Path) -> Option<bool> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let (a, b) = (std::fs::metadata(a).ok()?, std::fs::metadata(b).ok()?);
        Some(a.dev() == b.dev() && a.ino() == b.ino())
    }
    #[cfg(not(unix))]
    {
        let _ = (a, b);
        None
    }
}

/// Why cudarc would not call `probe`, the real driver found as [`PROBE_NAME`], if `target`
/// says so; `None` where it would, or where that cannot be told before `cuInit`.
fn shadowed(target: &CudarcTarget, probe: &Loaded) -> Option<String> {
    match target {
        CudarcTarget::Loaded(theirs) if same_library(theirs, &probe.lib) => None,
        CudarcTarget::Loaded(theirs) => {
            let file = file_of(theirs).map_or_else(|| "a library".into(), |f| f.display().to_string());
            Some(format!("cudarc would call {file}, already loaded as libcuda.so, not {}", probe.description))
        }
        CudarcTarget::OnLibraryPath(file) => {
            let ours = file_of(&probe.lib)?;
            (same_file(file, &ours) == Some(false)).then(|| {
                format!(
                    "cudarc would call {}, the first libcuda.so in a directory of LD_LIBRARY_PATH, not \
                     {} at {}: take that directory (a CUDA toolkit's stubs?) off LD_LIBRARY_PATH to \
                     use the GPU",
                    file.display(),
                    probe.description,
                    ours.display()
                )
            })
        }
        CudarcTarget::Unforeseen => None,
    }
}

/// Loads the real driver only if it initialises and sees at least one device; a failure says
/// whether the driver's `cuInit` ran. Its `cuInit` runs only once the driver is known to be the
/// library cudarc will call (as far as that can be told first, see [`CudarcTarget`]).
fn probe_real(notes: &mut Vec<Note>) -> std::result::Result<Loaded, Failed> {
    let target = cudarc_target();
    if let CudarcTarget::Loaded(theirs) = &target
        && has_symbol(theirs, SIM_MARKER)
    {
        // cudarc calls the simulator (a program loaded it): probing the real driver could only
        // end in a refusal.
        return Err(Error::DriverNotFound {
            searched: "libcuda.so (it resolves to cumem-sim, already loaded)".into(),
        }
        .into());
    }
    let loaded = open_real(&[PROBE_NAME.to_string()])?;
    if let Some(reason) = shadowed(&target, &loaded) {
        notes.push(Note::Shadowed(reason.clone()));
        // Dropped uninitialised: nothing of it ran but its initialisers.
        return Err(Error::DriverSelection { reason }.into());
    }
    drop(target);
    type CountFn = unsafe extern "C" fn(*mut i32) -> i32;
    // SAFETY: `cuInit` and `cuDeviceGetCount` have these C signatures in every driver since CUDA 2.0.
    let (init, count) = unsafe {
        let init = loaded.lib.get::<InitFn>("cuInit").map(|s| *s);
        let count = loaded.lib.get::<CountFn>("cuDeviceGetCount").map(|s| *s);
        (init, count)
    };
    let (Ok(init), Ok(count)) = (init, count) else {
        return Err(Error::DriverNotFound {
            searched: format!("{} (not a CUDA driver)", loaded.description),
        }
        .into());
    };
    let mut n = 0;
    // SAFETY: resolved from the loaded library with its documented signature; no pointers.
    let initialised = check(Code(unsafe { init(0) }), ErrorContext::op("cuInit"))
        // SAFETY: as above; `n` is a valid out-pointer.
        .and_then(|()| check(Code(unsafe { count(&mut n) }), ErrorContext::op("cuDeviceGetCount")))
        .and_then(|()| match n {
            1.. => Ok(()),
            _ => Err(Error::NoDevice { ctx: ErrorContext::op("cuDeviceGetCount") }),
        });
    match initialised {
        Ok(()) => Ok(loaded),
        Err(err) => {
            keep_mapped(loaded.lib);
            Err(Failed { err, after_init: true })
        }
    }
}

fn simulator_path() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os(SIM_LIB_ENV) {
        return Some(p.into());
    }
    #[cfg(feature = "sim")]
    {
        cumem_sim::library_path()
    }
    #[cfg(not(feature = "sim"))]
    {
        None
    }
}

/// What [`load_simulator`] looked for when it found no simulator library, and the way out that
/// applies to this build.
fn simulator_not_found() -> String {
    if cfg!(feature = "sim") {
        // Built with the simulator, but its library is not where a cargo build puts it (an
        // installed binary, a copied program).
        format!(
            "cumem-sim: no libcumem_sim.so beside the program or in its build directory \
             (set {SIM_LIB_ENV} to the library's path)"
        )
    } else {
        format!("cumem-sim (set {SIM_LIB_ENV} to the library's path, or build with cumem's `sim` feature)")
    }
}

fn load_simulator(sim_config: Option<&str>) -> Result<Loaded> {
    let path = simulator_path().ok_or_else(|| Error::DriverNotFound { searched: simulator_not_found() })?;
    let shown = path.display().to_string();
    // SAFETY: opening the file runs its initialisers before the marker check below can refuse it:
    // the path is cumem-sim's own build or the one the user named in `CUMEM_SIM_LIB`, trusted as
    // any library the program loads; cumem-sim's initialisers only set up its own state.
    let lib = unsafe { Library::new(&path) }
        .map_err(|e| Error::DriverNotFound { searched: format!("{shown}: {e}") })?;
    if !has_symbol(&lib, SIM_MARKER) {
        return Err(Error::DriverSelection { reason: format!("{shown} is not cumem-sim") });
    }
    // Before cudarc is asked for its library (which it then keeps): a refused configuration
    // leaves cudarc as it was.
    if let Some(config) = sim_config {
        configure_simulator(&lib, config)?;
    }
    let loaded = Loaded { kind: DriverKind::Simulator, description: format!("cumem-sim ({shown})"), lib };
    // So that the real driver is never called behind the simulator's back.
    check_cudarc_calls(&loaded)?;
    Ok(loaded)
}

/// Checks that the library cudarc calls through is `loaded`'s: cudarc opens its own handle by
/// name (`libcuda.so` first) on first use and keeps it for the process (`sys::culib`), whatever
/// cumem loaded since. Once another crate has made cudarc open the real driver, selecting the
/// simulator must fail rather than report the simulator while every call goes to the GPU (and
/// the other way round).
fn check_cudarc_calls(loaded: &Loaded) -> Result<()> {
    // SAFETY: opens and closes cudarc's candidate names in cudarc's order. A name that matches a
    // library already loaded only takes another reference to it; one that does not loads a file
    // from the library path and runs its initialisers, as `open_first` may, and as cudarc's own
    // first call would.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::DriverSelection {
            reason: format!(
                "{} was loaded, but cudarc finds no driver library by name (libcuda.so)",
                loaded.description
            ),
        });
    }
    // SAFETY: one of cudarc's candidate names opens (checked just above), so `culib` finds a
    // library rather than panicking; if it opened one before, it returns that handle.
    let theirs = unsafe { sys::culib() };
    if same_library(theirs, &loaded.lib) {
        return Ok(());
    }
    let (kind, _) = describe(theirs, "");
    let what = match kind {
        DriverKind::Simulator => "cumem-sim",
        DriverKind::Real => "another libcuda.so",
    };
    let file = file_of(theirs).map_or_else(String::new, |f| format!(" ({})", f.display()));
    Err(Error::DriverSelection {
        reason: format!(
            "{} was loaded, but cudarc already calls {what}{file}: select the driver before any \
             other CUDA use in the process, with no other libcuda.so first on the library path",
            loaded.description
        ),
    })
}

/// Whether two handles are the same library: both resolve `cuInit` to the same address (the
/// dynamic loader gives one object one handle, however it was named).
fn same_library(a: &Library, b: &Library) -> bool {
    // SAFETY: only the symbols' addresses are compared; neither is called or dereferenced.
    unsafe {
        match (a.get::<*const ()>("cuInit"), b.get::<*const ()>("cuInit")) {
            (Ok(x), Ok(y)) => *x == *y,
            _ => false,
        }
    }
}

fn configure_simulator(lib: &Library, config: &str) -> Result<()> {
    // An `int`, as in `probe_real`.
    type ConfigureFn = unsafe extern "C" fn(*const std::ffi::c_char) -> i32;
    let spec = std::ffi::CString::new(config)
        .map_err(|_| Error::InvalidValue { ctx: ErrorContext::op("cumemSimConfigure") })?;
    // SAFETY: `cumemSimConfigure` is part of cumem-sim's control ABI with this signature; `spec` is a
    // NUL-terminated string that outlives the call.
    unsafe {
        let f = lib.get::<ConfigureFn>("cumemSimConfigure").map_err(|_| Error::NotSupported {
            feature: crate::Feature::Symbol("cumemSimConfigure"),
            device: None,
        })?;
        check(Code(f(spec.as_ptr())), ErrorContext::op("cumemSimConfigure"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse_from_the_environment_syntax() {
        assert_eq!("auto".parse::<DriverChoice>().unwrap(), DriverChoice::Auto);
        assert_eq!("".parse::<DriverChoice>().unwrap(), DriverChoice::Auto);
        assert_eq!("REAL".parse::<DriverChoice>().unwrap(), DriverChoice::Real);
        assert_eq!("sim".parse::<DriverChoice>().unwrap(), DriverChoice::Simulator);
        assert!(matches!("gpu9".parse::<DriverChoice>(), Err(Error::DriverSelection { .. })));
    }

    #[test]
    fn an_unset_variable_gives_the_default_and_one_not_utf8_is_refused() {
        use std::env::VarError;
        use std::os::unix::ffi::OsStringExt;
        let unset = choice_from_env(Err(VarError::NotPresent), DriverChoice::Simulator);
        assert_eq!(unset.unwrap(), DriverChoice::Simulator);
        assert_eq!(choice_from_env(Ok("real".into()), DriverChoice::Auto).unwrap(), DriverChoice::Real);
        let garbled = VarError::NotUnicode(std::ffi::OsString::from_vec(b"s\xffm".to_vec()));
        let e = choice_from_env(Err(garbled), DriverChoice::Auto).unwrap_err();
        assert!(matches!(&e, Error::DriverSelection { reason } if reason.contains("not UTF-8")), "{e}");
    }

    #[test]
    fn a_missing_simulator_is_explained_for_the_build_at_hand() {
        let said = simulator_not_found();
        assert!(said.contains(SIM_LIB_ENV), "{said}");
        // This crate's tests are built with `sim`: the feature is there, the file is not.
        const { assert!(cfg!(feature = "sim")) };
        assert!(said.contains("no libcumem_sim.so beside the program"), "{said}");
        assert!(!said.contains("feature"), "the `sim` feature is enabled, yet asked for: {said}");
    }

    #[test]
    fn an_unset_or_empty_library_path_is_not_searched() {
        // glibc finds a file of the current directory through an empty directory of a set
        // `LD_LIBRARY_PATH`, never through an unset or empty variable. Any file there will do:
        // cargo runs tests in the crate's directory, a packed test binary wherever it is run.
        let file = std::fs::read_dir(".").ok().and_then(|entries| {
            entries.flatten().filter(|e| e.path().is_file()).find_map(|e| e.file_name().into_string().ok())
        });
        let Some(name) = file else {
            crate::testing::skip("the current directory holds no file with a UTF-8 name to look for");
            return;
        };
        let name = name.as_str();
        assert_eq!(first_on_library_path(None, name), None);
        assert_eq!(first_on_library_path(Some("".as_ref()), name), None);
        assert_eq!(first_on_library_path(Some("/nonexistent".as_ref()), name), None);
        let found = first_on_library_path(Some("/nonexistent::".as_ref()), name);
        assert_eq!(found, Some(std::path::Path::new(".").join(name)));
    }
}
