//! Managed (unified) memory state: the attachment, and the hints of `cuMemAdvise` and prefetches
//! recorded per 4 KiB page (allocated on first use), so advice on a sub-range reads back exactly
//! for that range and "mixed" answers come out as the driver documents.
//!
//! On a device without CONCURRENT_MANAGED_ACCESS the GPU has exclusive access to managed memory
//! while it works on it: a host access in the meantime faults (SIGSEGV) on the real driver. The
//! simulator does the same. Managed memory is two mappings of one memory file: the host's (the
//! address the program gets) and the engine's. While a queued operation that touches the
//! allocation exists (from the call that queues it until the engine has run it, or it is dropped
//! unrun), the host's mapping is `PROT_NONE` ([`HostView`], [`DeviceUse`]), so a program that
//! reads or writes it meanwhile dies of the same signal as on a GPU. This is more lenient than
//! older GPUs, which keep the host out until it synchronises, never stricter. Which device decides
//! is the allocation's (the one whose context allocated it).

use std::sync::Arc;

use cudarc::driver::sys::CUresult;
use parking_lot::Mutex;

use crate::abi::{LOC_DEVICE, LOC_INVALID};
use crate::memory::{AllocKind, Allocation, Backing};
use crate::state::State;
use crate::stream::StreamKind;

/// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`.
const ATTR_CONCURRENT_MANAGED_ACCESS: u32 = 89;
/// `CU_MEM_ATTACH_HOST`.
const ATTACH_HOST: u32 = 2;
/// `CU_MEM_ATTACH_SINGLE`.
const ATTACH_SINGLE: u32 = 4;

/// The host's mapping of a managed allocation, protected while device work uses the memory.
pub(crate) struct HostView {
    view: Backing,
    /// Queued operations that touch the allocation on a device without concurrent access.
    users: Mutex<usize>,
}

impl std::fmt::Debug for HostView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostView")
            .field("addr", &self.view.as_ptr())
            .field("users", &*self.users.lock())
            .finish()
    }
}

impl HostView {
    /// The host's side of a managed allocation (the engine's is its allocation's backing).
    pub(crate) fn new(view: Backing) -> Arc<Self> {
        Arc::new(HostView { view, users: Mutex::new(0) })
    }

    /// The address the program gets for the allocation.
    pub(crate) fn addr(&self) -> u64 {
        self.view.as_ptr() as u64
    }

    fn protect(&self, prot: libc::c_int) {
        // SAFETY: the range is exactly the mapping `view` owns (page-aligned, its own length), which
        // stays mapped while `self` lives; only its protection changes.
        let rc = unsafe { libc::mprotect(self.view.as_ptr().cast(), self.view.len(), prot) };
        if rc != 0 {
            // Nothing else can be done from here: the program then sees no fault (or a late one).
            eprintln!(
                "cumem-sim: mprotect of managed memory at {:p} failed: {}",
                self.view.as_ptr(),
                std::io::Error::last_os_error()
            );
        }
    }
}

/// A queued operation's use of a managed allocation on a device without concurrent managed access:
/// the host's mapping stays `PROT_NONE` until every such use is dropped.
pub(crate) struct DeviceUse(Arc<HostView>);

impl DeviceUse {
    fn new(view: &Arc<HostView>) -> Self {
        let mut users = view.users.lock();
        if *users == 0 {
            view.protect(libc::PROT_NONE);
        }
        *users += 1;
        DeviceUse(Arc::clone(view))
    }
}

impl Drop for DeviceUse {
    fn drop(&mut self) {
        let mut users = self.0.users.lock();
        *users -= 1;
        if *users == 0 {
            self.0.protect(libc::PROT_READ | libc::PROT_WRITE);
        }
    }
}

/// The device use an operation touching `a` must hold: `Some` for managed memory whose device
/// (the one whose context allocated it) lacks CONCURRENT_MANAGED_ACCESS. Taken by a copy or memset
/// once it has passed every check, when it is queued (see `crate::copy`), so a refused call never
/// keeps the host out.
pub(crate) fn device_use(st: &State, a: &Allocation) -> Option<DeviceUse> {
    if a.kind != AllocKind::Managed || !lacks_concurrent_access(st, usize::try_from(a.device).ok()?) {
        return None;
    }
    Some(DeviceUse::new(&st.managed.get(&a.base)?.host))
}

/// Whether device `dev` exists and lacks CONCURRENT_MANAGED_ACCESS.
fn lacks_concurrent_access(st: &State, dev: usize) -> bool {
    st.devices.get(dev).is_some_and(|d| d.attr(ATTR_CONCURRENT_MANAGED_ACCESS) != Some(1))
}

/// Checks the attachments of the managed allocations `device_side` names: those a copy or memset
/// queued on stream `sid` accesses from the device (a `DtoX`/`XtoD` end of a copy, a memset's
/// destination). Called once per call, after every check of the call has passed and just before
/// its work is queued: a call whose work breaks the attachments of one or more allocations (in
/// however many rows) is one violation, naming the call (code `CUDA_SUCCESS`, what it returns),
/// and a refused call is logged only for its refusal.
///
/// What is checked, on a device without concurrent managed access (both the allocation's and
/// the stream's device lacking it; a device with it may use managed memory from any stream):
///
/// 1. Memory attached to the host (`CU_MEM_ATTACH_HOST`) used from any stream.
///    `cuStreamAttachMemAsync`'s contract: the program promises not to access it from any stream
///    of such a device (the driver brief lists "ATTACH_HOST access from GPU" among what needs
///    concurrent access).
/// 2. Memory attached to one stream (`CU_MEM_ATTACH_SINGLE`, the attached stream's device also
///    lacking concurrent access) used from another stream: the program promises to access it on
///    the device from the attached stream only. The stream is the one the work is queued on:
///    NULL and `CU_STREAM_LEGACY` name the legacy stream, `CU_STREAM_PER_THREAD` the calling
///    thread's per-thread stream, and a synchronous call's work runs on the legacy stream. The
///    legacy stream is never an attached stream (SINGLE on it is refused), so its work on such
///    memory is always flagged, although it is ordered after the attached stream's earlier work
///    (when that stream is blocking): the CUDA Programming Guide ("Memcpy()/Memset() Behavior
///    With Stream-associated Unified Memory") makes a device side coherently accessible in a
///    stream only when the memory is attached globally or to that very stream, and names no
///    exception for the legacy stream. A per-thread stream is the calling thread's own: memory
///    attached to one thread's is another thread's per-thread stream's to leave alone.
///
/// The Programming Guide says such a device side gets an error, while a host side (`HtoX`/`XtoH`
/// end) or a unified (`cuMemcpy`) end is then accessed from the host; which error is not on
/// record, so the call keeps its result and the log names the misuse.
///
/// At the call, not at execution: the attachment that matters is the one in effect when the work
/// runs, and attachments are stream operations themselves, but the engine runs copies without
/// the state's lock. The call can tell that attachment when no attachment of the allocation is
/// still queued: every later one is queued after this call, so the work, whose waits are all
/// queued by now, cannot be ordered after it; the one in effect now is in effect when the work
/// runs (unless the program races its own attachment: one queued later on another stream that
/// does not wait for this work may take effect first; the check assumes the program ordered it).
/// With one still queued, which is in effect then depends on how the streams are ordered,
/// and nothing is recorded for the allocation (never stricter than the driver: a constructor
/// attaching its memory globally and then using it on the same stream is not flagged).
pub(crate) fn check_device_side(st: &State, sid: u64, device_side: &[Arc<Allocation>]) {
    let misuse: Vec<String> = device_side.iter().filter_map(|a| attachment_misuse(st, a, sid)).collect();
    if misuse.is_empty() {
        return;
    }
    let (function, os_tid) = crate::api::caller();
    crate::violation::record(crate::violation::Violation {
        function: function.to_string(),
        code: CUresult::CUDA_SUCCESS as u32,
        code_name: "CUDA_SUCCESS".to_string(),
        message: misuse.join("; "),
        os_tid,
    });
}

/// What device work on `a` queued on stream `sid` breaks of `a`'s attachment (see
/// [`check_device_side`]), in words; `None` when it is allowed or the attachment in effect when
/// the work runs is not known.
fn attachment_misuse(st: &State, a: &Allocation, sid: u64) -> Option<String> {
    if a.kind != AllocKind::Managed {
        return None;
    }
    let m = st.managed.get(&a.base)?;
    let stream = st.streams.get(&sid)?;
    if m.queued_attachments != 0
        || !lacks_concurrent_access(st, usize::try_from(a.device).ok()?)
        || !lacks_concurrent_access(st, stream.device)
    {
        return None;
    }
    let on = match stream.kind {
        StreamKind::Legacy => "the legacy stream".to_string(),
        StreamKind::PerThread => format!("per-thread stream {sid:#x}"),
        StreamKind::User => format!("stream {sid:#x}"),
    };
    match m.attach {
        ATTACH_HOST => Some(format!(
            "device work on managed allocation {:#x}, attached to the host (CU_MEM_ATTACH_HOST), \
             on device {} without concurrent managed access, queued on {on}: no stream may access \
             it (cuStreamAttachMemAsync; the driver documents an error for such a device side)",
            a.base, stream.device
        )),
        ATTACH_SINGLE
            if m.stream != sid && lacks_concurrent_access(st, st.streams.get(&m.stream)?.device) =>
        {
            Some(format!(
                "device work on managed allocation {:#x}, attached to stream {:#x} \
                 (CU_MEM_ATTACH_SINGLE), on device {} without concurrent managed access, queued \
                 on {on}: only the attached stream may access it (cuStreamAttachMemAsync; the \
                 driver documents an error for such a device side)",
                a.base, m.stream, stream.device
            ))
        }
        _ => None,
    }
}

/// Page size of the hint bookkeeping.
pub(crate) const PAGE: u64 = 4096;
/// `CU_DEVICE_CPU`.
pub(crate) const DEVICE_CPU: i32 = -1;
/// `CU_DEVICE_INVALID`.
pub(crate) const DEVICE_INVALID: i32 = -2;

/// A recorded location: `(CUmemLocationType, id)`; HOST ids are stored as 0.
pub(crate) type Loc = (u32, i32);

/// The hints of one page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PageHints {
    pub(crate) read_mostly: bool,
    pub(crate) preferred: Option<Loc>,
    /// Bit `d`: device `d` has ACCESSED_BY advice.
    pub(crate) accessed_by: u64,
    pub(crate) accessed_by_cpu: bool,
    pub(crate) last_prefetch: Option<Loc>,
}

/// The per-allocation state of managed memory.
#[derive(Debug)]
pub(crate) struct Managed {
    /// `CU_MEM_ATTACH_*` of the allocation (what a SINGLE attachment reverts to).
    pub(crate) initial_attach: u32,
    /// `CU_MEM_ATTACH_*` in effect: the allocation's, or that of the latest
    /// `cuStreamAttachMemAsync` to have run in its stream's order (calls still queued do not count).
    pub(crate) attach: u32,
    /// Stream of the attachment in effect (0 = none: the allocation's own, or its stream was
    /// destroyed and has drained).
    pub(crate) stream: u64,
    /// `cuStreamAttachMemAsync` calls queued and not run yet (see [`check_device_side`]). One whose
    /// operation is never run (dropped with its stream's context) keeps the attachment check off
    /// for the allocation: lenient, never stricter.
    pub(crate) queued_attachments: usize,
    pages: u64,
    hints: Vec<PageHints>,
    /// The host's mapping (unmapped once the allocation is forgotten and no operation uses it).
    pub(crate) host: Arc<HostView>,
}

impl Managed {
    /// A fresh allocation of `bytes` attached with `flags`, which the host sees through `host`.
    pub(crate) fn new(flags: u32, bytes: u64, host: Arc<HostView>) -> Self {
        Self {
            initial_attach: flags,
            attach: flags,
            stream: 0,
            queued_attachments: 0,
            pages: bytes.div_ceil(PAGE),
            hints: Vec::new(),
            host,
        }
    }

    /// A `cuStreamAttachMemAsync` of `flags` on `stream` takes effect (in stream order).
    pub(crate) fn attach_to(&mut self, flags: u32, stream: u64) {
        self.attach = flags;
        self.stream = stream;
        self.queued_attachments = self.queued_attachments.saturating_sub(1);
    }

    /// The stream of the latest attachment is destroyed and its work has all completed: a SINGLE
    /// attachment reverts to the allocation's flags, and no stream is named any more.
    pub(crate) fn stream_destroyed(&mut self) {
        if self.attach == ATTACH_SINGLE {
            self.attach = self.initial_attach;
        }
        self.stream = 0;
    }

    /// Applies `f` to the hints of pages `first..=last`.
    pub(crate) fn update(&mut self, first: u64, last: u64, f: impl Fn(&mut PageHints)) {
        if self.hints.is_empty() {
            self.hints = vec![PageHints::default(); self.pages as usize];
        }
        for h in &mut self.hints[first as usize..=last as usize] {
            f(h);
        }
    }

    /// The hints of pages `first..=last`.
    pub(crate) fn range(&self, first: u64, last: u64) -> Vec<PageHints> {
        if self.hints.is_empty() {
            return vec![PageHints::default(); (last - first + 1) as usize];
        }
        self.hints[first as usize..=last as usize].to_vec()
    }
}

/// The v1 (`CUdevice`) form of a location: the ordinal, `CU_DEVICE_CPU` for host locations.
pub(crate) fn v1_of(l: Option<Loc>) -> i32 {
    match l {
        Some((LOC_DEVICE, id)) => id,
        Some(_) => DEVICE_CPU,
        None => DEVICE_INVALID,
    }
}

/// The one value every page agrees on, if they do.
pub(crate) fn common<T: PartialEq + Copy>(pages: &[PageHints], f: impl Fn(&PageHints) -> T) -> Option<T> {
    let first = f(pages.first()?);
    pages.iter().all(|p| f(p) == first).then_some(first)
}

/// The v2 `(type, id)` answer for a possibly mixed or unset location.
pub(crate) fn v2_of(l: Option<Option<Loc>>) -> (u32, i32) {
    match l {
        Some(Some(loc)) => loc,
        _ => (LOC_INVALID, DEVICE_INVALID),
    }
}
