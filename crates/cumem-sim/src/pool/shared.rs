//! Pools shared with other processes: `cuMemPoolExportToShareableHandle`,
//! `cuMemPoolImportFromShareableHandle`, `cuMemPoolExportPointer`, `cuMemPoolImportPointer`.
//!
//! A pool created with `handleTypes = POSIX_FD` keeps all its chunks in one memory file: a
//! header page, then each chunk at its own page-aligned offset (the file grows as chunks are
//! reserved; it is sparse, so untouched bytes cost nothing). Its exported descriptor is a
//! duplicate of that file, so an importer can map any part of it; the 64 bytes of a pointer
//! export name the file (its inode), the block's offset in it and its size.
//!
//! ```text
//! exporter                                   importer
//! cuMemPoolCreate(POSIX_FD)   -> file
//! cuMemPoolExportToShareableHandle -> dup(fd) ==SCM_RIGHTS==> cuMemPoolImportFromShareableHandle
//! cuMemAllocFromPoolAsync     -> block at (chunk offset + delta)
//! cuMemPoolExportPointer      -> 64 bytes   ==any channel==>  cuMemPoolImportPointer: maps the
//!                                                             block's pages, a `pool_import`
//! ```
//!
//! As on an H100 (observed 2026-11-23), a pool's pointers export only once the pool itself was
//! exported (`cuMemPoolExportToShareableHandle`, at least once, before or after the allocation):
//! until then `cuMemPoolExportPointer` gives `INVALID_VALUE`.
//!
//! Within one importing process, as on an H100 (2026-11-23): importing a pool that already has a
//! live import here gives that import's handle again, and destroys are counted (the handle lives
//! until each import was destroyed); importing a pointer that already has a live import here gives
//! the same address, and pointer imports are not counted (the first `cuMemFree` unmaps it, a
//! second gives `INVALID_VALUE`). An imported pointer sits at a 32 MiB-aligned address of its own,
//! and its `MAPPING_SIZE` is 32 MiB.
//!
//! Pools created without handle types never touch any of this: their chunks stay anonymous
//! memory and their allocation path has no extra syscall or lock.
//!
//! The driver's contract puts the burden on the program: every importer frees an imported
//! pointer before the exporter frees it. The header page keeps a slot per exported block: one
//! word packing the block's offset, whether the exporter still holds it (set by
//! `cuMemPoolExportPointer`, cleared by the exporter's free) and its live imports, updated with
//! compare-and-swap by every process that maps the file, and emptied when the block is neither
//! held nor imported. So an import of a block the exporter already freed, and the exporter's free
//! of a block that is still imported somewhere, are recorded as violations; both calls succeed
//! (an H100 imported a freed block with SUCCESS in the exporting process, 2026-11-23; another
//! process is assumed to get the same answer, not measured), and the pool may hand the same bytes
//! to a new allocation while the importer maps them (as on a GPU). A chunk released back to the
//! device has its pages punched out of the file: an importer that still maps them reads zeros from
//! then on, never a fault. More than 504 exported blocks held or imported at once overflow the slots: the
//! simulator says so once on stderr, from then on the pool's untracked blocks are neither checked
//! at import nor counted (an imported pool still refuses to be destroyed while they live).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUresult;

use super::{Pool, lookup, supported};
use crate::api::Fail;
use crate::memory::{AllocKind, Allocation, Backing};
use crate::state::{SIM, State};
use crate::violation::{self, Violation};

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
pub(crate) const POSIX_FD: u32 = 0x1;
/// Bytes of `CUmemPoolPtrExportData`.
pub(crate) const EXPORT_SIZE: usize = 64;
const PAGE: u64 = 4096;
const FILE_MAGIC: &[u8; 8] = b"cumempl\0";
const PTR_MAGIC: &[u8; 8] = b"cumemptr";

fn invalid(message: String) -> Fail {
    Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, message)
}

/// The memory file of an exportable pool (or of an imported one).
#[derive(Debug)]
pub(crate) struct SharedPool {
    file: OwnedFd,
    /// The file's inode: the pool's identity across processes.
    ino: u64,
    /// Where the next chunk goes in the file (offsets are never reused: a released chunk's pages
    /// are punched out, so the sparse file costs only what is reserved).
    next_offset: u64,
    /// Imported from another process: pointers are imported through it, never allocated.
    pub(crate) imported: bool,
    /// Of an imported pool: its imports in this process not yet destroyed (each import of the
    /// same pool while one lives gives the same handle; `cuMemPoolDestroy` counts them down).
    pub(crate) opens: u32,
    /// Exported once with `cuMemPoolExportToShareableHandle`: only then are its pointers
    /// exported (observed on an H100, 2026-11-23; the descriptor need not stay open).
    exported: bool,
    /// The file's header page, mapped: its slots count the live imports of each block, across
    /// every process that imported the pool.
    header: Arc<Backing>,
    /// In an imported pool: the pointers imported through it, by their allocation's buffer id
    /// (an address may be reused before a stream-ordered free of the import executes), each with
    /// its count in the header (`None`: not tracked, the slots were full). An imported pool is not
    /// destroyed while any of them lives (`cuMemPoolDestroy` gives `INVALID_VALUE`).
    imports: BTreeMap<u64, Option<ImportTicket>>,
    /// In an imported pool: `(file offset, bytes)` of each block imported here -> `(address,
    /// buffer id)` of its import, which a second import of the block returns while it lives.
    mapped: BTreeMap<(u64, u64), (u64, u64)>,
}

/// Byte of the header page holding the overflow flag: non-zero once a block could not get a
/// slot (its imports are then not checked nor counted).
const OVERFLOW_AT: usize = 16;
/// First byte of the block slots in the header page.
const SLOTS_AT: usize = 64;
/// Block slots, one `u64` each: `KEY` bits (the block's offset / `KEY_GRANULE`; 0: an empty slot,
/// no block starts at offset 0, the header page does), `HELD` (the exporter has not freed it),
/// `COUNT` bits (live imports, in every process).
const SLOTS: usize = (PAGE as usize - SLOTS_AT) / 8;
const COUNT: u64 = (1 << 23) - 1;
const HELD: u64 = 1 << 23;
const KEY_SHIFT: u32 = 24;
/// Pool blocks start at multiples of this in the file (chunks are page aligned, blocks 512).
const KEY_GRANULE: u64 = super::GRANULE;

/// The key bits of the block at `offset`, or `None` when it does not fit a slot word.
fn key_of(offset: u64) -> Option<u64> {
    let k = offset / KEY_GRANULE;
    (offset.is_multiple_of(KEY_GRANULE) && k != 0 && k < 1 << (64 - KEY_SHIFT)).then_some(k << KEY_SHIFT)
}

fn word(header: &Backing, at: usize) -> &AtomicU64 {
    debug_assert!(at.is_multiple_of(8) && at + 8 <= PAGE as usize);
    // SAFETY: the header page is PAGE bytes, page aligned and mapped for as long as `header`;
    // `at` lies inside it, 8-byte aligned; every process touches these words only atomically.
    unsafe { AtomicU64::from_ptr(header.as_ptr().add(at).cast::<u64>()) }
}

fn slot(header: &Backing, i: usize) -> &AtomicU64 {
    debug_assert!(i < SLOTS);
    word(header, SLOTS_AT + 8 * i)
}

/// The slot holding `key`, if any.
fn find(header: &Backing, key: u64) -> Option<usize> {
    (0..SLOTS).find(|&i| slot(header, i).load(Ordering::SeqCst) & !(HELD | COUNT) == key)
}

/// Applies `f` to the word of slot `i` while it still holds `key`, atomically: `Some(old)`, or
/// `None` when the slot was emptied (or reused) meanwhile. `f` returns `None` to leave it as is.
fn update(header: &Backing, i: usize, key: u64, f: impl Fn(u64) -> Option<u64>) -> Option<u64> {
    let w = slot(header, i);
    let mut old = w.load(Ordering::SeqCst);
    loop {
        if old & !(HELD | COUNT) != key {
            return None;
        }
        let Some(new) = f(old) else { return Some(old) };
        match w.compare_exchange(old, new, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => return Some(old),
            Err(now) => old = now,
        }
    }
}

/// A word with neither `HELD` nor a count is an empty slot.
fn settled(w: u64) -> u64 {
    if w & (HELD | COUNT) == 0 { 0 } else { w }
}

/// Records that a block could not be tracked, and says so once per process (the pool's checks
/// are weaker from then on; a program exporting this many blocks at once is not misusing
/// anything).
fn overflow(header: &Backing) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    word(header, OVERFLOW_AT).store(1, Ordering::SeqCst);
    if !SAID.swap(true, Ordering::SeqCst) {
        eprintln!(
            "cumem-sim: more than {SLOTS} exported pool blocks are held or imported at once; the \
             imports of the blocks beyond that are not checked against the exporter's frees"
        );
    }
}

/// Marks the block at `offset` as held by the exporter (called by `cuMemPoolExportPointer`, in
/// the exporting process only, under the simulator's lock: so no two slots get the same key).
fn mark_held(header: &Backing, offset: u64) {
    let Some(key) = key_of(offset) else { return overflow(header) };
    loop {
        if let Some(i) = find(header, key) {
            if update(header, i, key, |w| Some(w | HELD)).is_some() {
                return;
            }
            // Emptied by an importer's last free meanwhile: claim a slot afresh.
            continue;
        }
        let claimed = (0..SLOTS).any(|i| {
            slot(header, i).compare_exchange(0, key | HELD, Ordering::SeqCst, Ordering::SeqCst).is_ok()
        });
        if !claimed {
            overflow(header);
        }
        return;
    }
}

/// Clears the exporter's hold of the block at `offset` (its free); the imports still live.
fn release_hold(header: &Backing, offset: u64) -> u64 {
    let Some(key) = key_of(offset) else { return 0 };
    let Some(i) = find(header, key) else { return 0 };
    update(header, i, key, |w| Some(settled(w & !HELD))).map_or(0, |old| old & COUNT)
}

/// One live import of a block, counted in the pool file's header until dropped.
#[derive(Debug)]
struct ImportTicket {
    header: Arc<Backing>,
    slot: usize,
    key: u64,
}

/// What an import of a block finds in the header.
enum Take {
    Counted(ImportTicket),
    /// The slots overflowed: the import is allowed but not counted.
    Untracked,
    /// The exporter freed the block (or never exported it).
    Dead,
}

impl ImportTicket {
    /// Counts an import of the block at `offset` if the exporter still holds it.
    fn take(header: &Arc<Backing>, offset: u64) -> Take {
        let untracked = || {
            if word(header, OVERFLOW_AT).load(Ordering::SeqCst) != 0 {
                overflow(header);
                Take::Untracked
            } else {
                Take::Dead
            }
        };
        let Some(key) = key_of(offset) else { return untracked() };
        let Some(i) = find(header, key) else { return untracked() };
        let held = |w: u64| (w & HELD != 0 && w & COUNT < COUNT).then_some(w + 1);
        match update(header, i, key, held) {
            Some(old) if old & HELD != 0 && old & COUNT < COUNT => {
                Take::Counted(Self { header: Arc::clone(header), slot: i, key })
            }
            Some(old) if old & HELD != 0 => {
                overflow(header);
                Take::Untracked
            }
            // Freed by the exporter (its slot may still count others' imports), or emptied.
            _ => Take::Dead,
        }
    }
}

impl Drop for ImportTicket {
    fn drop(&mut self) {
        update(&self.header, self.slot, self.key, |w| Some(settled(w - 1)));
    }
}

/// `(inode, size)` of an open file.
fn stat(fd: BorrowedFd<'_>) -> Option<(u64, u64)> {
    // SAFETY: `stat` is plain data, fully written by a successful fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open and `st` a valid out-pointer.
    (unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0).then_some((st.st_ino, st.st_size as u64))
}

/// A close-on-exec duplicate of `fd`, or `None`.
fn dup(fd: BorrowedFd<'_>) -> Option<OwnedFd> {
    // SAFETY: `fd` is open; F_DUPFD_CLOEXEC returns a new descriptor or -1.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    // SAFETY: `n` was just created and is owned by nothing else.
    (n >= 0).then(|| unsafe { OwnedFd::from_raw_fd(n) })
}

impl SharedPool {
    /// A new memory file for a pool of device `device`: the header page only.
    pub(crate) fn create(device: usize) -> Option<Self> {
        // SAFETY: a NUL-terminated name; the result is checked before use.
        let fd = unsafe { libc::memfd_create(c"cumem-sim-pool".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut header = [0u8; 16];
        header[..8].copy_from_slice(FILE_MAGIC);
        header[8..12].copy_from_slice(&u32::try_from(device).ok()?.to_le_bytes());
        // SAFETY: `header` is readable for its length; `file` is open.
        let n = unsafe { libc::pwrite(file.as_raw_fd(), header.as_ptr().cast(), header.len(), 0) };
        if n != header.len() as isize {
            return None;
        }
        // SAFETY: `file` is open; a page-long memory file reads as zeros past what was written.
        if unsafe { libc::ftruncate(file.as_raw_fd(), PAGE as libc::off_t) } != 0 {
            return None;
        }
        Self::open(file, false)
    }

    /// The pool of memory file `file` (already holding its header page).
    fn open(file: OwnedFd, imported: bool) -> Option<Self> {
        let (ino, _) = stat(file.as_fd())?;
        let header = Arc::new(Backing::from_file_at(&file, 0, PAGE as usize)?);
        Some(Self {
            file,
            ino,
            next_offset: PAGE,
            imported,
            opens: 1,
            exported: false,
            header,
            imports: BTreeMap::new(),
            mapped: BTreeMap::new(),
        })
    }

    /// A new chunk of `size` bytes at the end of the file: its mapping and file offset.
    pub(crate) fn grow(&mut self, size: u64) -> Option<(Backing, u64)> {
        let offset = self.next_offset;
        let end = offset.checked_add(size)?;
        // SAFETY: `file` is open; growing a memory file allocates nothing until touched.
        if unsafe { libc::ftruncate(self.file.as_raw_fd(), libc::off_t::try_from(end).ok()?) } != 0 {
            return None;
        }
        let backing = Backing::from_file_at(&self.file, offset, usize::try_from(size).ok()?)?;
        self.next_offset = end;
        Some((backing, offset))
    }

    /// Gives the pages of a released chunk back to the kernel.
    pub(crate) fn release(&self, offset: u64, size: u64) {
        // SAFETY: `file` is open; punching a hole only discards the file's pages in the range
        // (mappings of it read zeros afterwards). A refusal only keeps the pages until the pool
        // file is closed: nothing to report.
        unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                size as libc::off_t,
            );
        }
    }
}

/// The exportable (created, not imported) pool `h`, or `INVALID_VALUE`.
fn exportable(pool: &Pool, h: u64) -> Result<&SharedPool, Fail> {
    match &pool.shared {
        Some(s) if !s.imported => Ok(s),
        Some(_) => Err(invalid(format!("pool {h:#x} was imported; only its creator exports it"))),
        None => Err(invalid(format!(
            "pool {h:#x} was not created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (default \
             pools never are)"
        ))),
    }
}

/// `cuMemPoolExportToShareableHandle` for POSIX descriptors: a new close-on-exec descriptor of
/// the pool's memory file per call. A dead handle, non-zero flags, a type other than POSIX_FD,
/// or a pool created without it (a default pool, say) give `INVALID_VALUE`.
pub(crate) fn export_fd(h: u64, handle_type: u32, flags: u64) -> Result<i32, Fail> {
    let mut st = SIM.st.lock();
    let h = lookup(&st, h)?;
    if flags != 0 {
        return Err(invalid(format!("cuMemPoolExportToShareableHandle flags {flags:#x} must be 0")));
    }
    if handle_type != POSIX_FD {
        return Err(invalid(format!("handle type {handle_type:#x}: only POSIX_FD (1) is exported")));
    }
    let shared = exportable(&st.pools[&h], h)?;
    let file = dup(shared.file.as_fd()).ok_or(Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY))?;
    if let Some(shared) = st.pools.get_mut(&h).and_then(|p| p.shared.as_mut()) {
        shared.exported = true;
    }
    // The caller owns the new descriptor from here on.
    Ok(std::os::fd::IntoRawFd::into_raw_fd(file))
}

/// Whether `fd` names a regular file (as `fstat` tells; procfs files are regular too).
fn is_regular_file(fd: BorrowedFd<'_>) -> bool {
    // SAFETY: `stat` is plain data, fully written by a successful fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is a descriptor number (a closed one makes fstat fail) and `st` a valid
    // out-pointer.
    (unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0) && st.st_mode & libc::S_IFMT == libc::S_IFREG
}

/// `cuMemPoolImportFromShareableHandle` for POSIX descriptors: a pool handle of this process
/// over the pool file `fd` names (the caller keeps `fd`), for importing pointers only: a new one,
/// or the live import's of the same pool (counted: each import is destroyed once). Another
/// handle type → `NOT_SUPPORTED` (as observed); flags ≠ 0 → `INVALID_VALUE`; a negative
/// descriptor → `UNKNOWN` (what the H100 answered for `cuMemImportFromShareableHandle(-1)`, the
/// same descriptor path); a regular file that is not an exported pool → `UNKNOWN` and any other
/// descriptor that is not one → `INVALID_VALUE` (both observed on an H100, 2026-11-24: a regular
/// file's descriptor, and descriptor 0); a device
/// this process does not have → `INVALID_DEVICE`.
pub(crate) fn import_fd(fd: i32, handle_type: u32, flags: u64) -> Result<u64, Fail> {
    if handle_type != POSIX_FD {
        return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED));
    }
    if flags != 0 {
        return Err(invalid(format!("cuMemPoolImportFromShareableHandle flags {flags:#x} must be 0")));
    }
    if fd < 0 {
        return Err(Fail::misuse(CUresult::CUDA_ERROR_UNKNOWN, format!("file descriptor {fd}")));
    }
    // SAFETY: the caller's descriptor is only borrowed for this call; a closed number makes the
    // reads below fail.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let mut header = [0u8; 16];
    // SAFETY: `header` is writable for its length; a bad descriptor makes pread fail.
    let n = unsafe { libc::pread(fd, header.as_mut_ptr().cast(), header.len(), 0) };
    let not_pool = || {
        invalid(format!("file descriptor {fd} is not a pool exported by cuMemPoolExportToShareableHandle"))
    };
    if n != header.len() as isize || &header[..8] != FILE_MAGIC {
        if is_regular_file(borrowed) {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_UNKNOWN,
                format!(
                    "file descriptor {fd} is a regular file, not a pool exported by cuMemPoolExportToShareableHandle"
                ),
            ));
        }
        return Err(not_pool());
    }
    let (ino, _) = stat(borrowed).ok_or_else(not_pool)?;
    let device = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")) as usize;
    let mut st = SIM.st.lock();
    if device >= st.devices.len() {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_DEVICE,
            format!("the exported pool is on device {device}, which this process does not have"),
        ));
    }
    supported(&st, device)?;
    let live = st.pools.iter_mut().find_map(|(&h, p)| {
        let s = p.shared.as_mut().filter(|s| !p.destroyed && s.imported && s.ino == ino)?;
        Some((h, s))
    });
    if let Some((h, shared)) = live {
        shared.opens += 1;
        return Ok(h);
    }
    let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let file = dup(borrowed).ok_or_else(oom)?;
    let mut pool = Pool::new(device, false, 0);
    pool.shared = Some(Box::new(SharedPool::open(file, true).ok_or_else(oom)?));
    let h = st.new_pool_handle();
    st.pools.insert(h, pool);
    Ok(h)
}

/// A decoded `CUmemPoolPtrExportData`.
struct PtrExport {
    pid: u32,
    ino: u64,
    offset: u64,
    bytes: u64,
}

impl PtrExport {
    fn encode(&self) -> [u8; EXPORT_SIZE] {
        let mut b = [0u8; EXPORT_SIZE];
        b[..8].copy_from_slice(PTR_MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[16..24].copy_from_slice(&self.ino.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.bytes.to_le_bytes());
        b
    }

    fn decode(b: &[u8; EXPORT_SIZE]) -> Result<Self, Fail> {
        if &b[..8] != PTR_MAGIC {
            return Err(invalid("not pointer export data made by cuMemPoolExportPointer".into()));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok(Self {
            pid: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            ino: u64_at(16),
            offset: u64_at(24),
            bytes: u64_at(32),
        })
    }
}

/// `cuMemPoolExportPointer`: the 64 bytes naming the allocation that starts at `dptr`, which
/// must be a live allocation of a pool created with POSIX_FD handle types and exported at least
/// once with `cuMemPoolExportToShareableHandle` (before or after the allocation). Anything else
/// (other memory, a pool without handle types, a pool never exported, an imported pointer, an
/// interior pointer) gives `INVALID_VALUE`: the never-exported pool and the interior pointer as
/// observed on an H100, 2026-11-23.
pub(crate) fn export_pointer(dptr: u64) -> Result<[u8; EXPORT_SIZE], Fail> {
    let st = SIM.st.lock();
    let a = match st.find_alloc(dptr) {
        Some(a) if a.kind == AllocKind::Pool && a.base == dptr => a,
        Some(a) if a.kind == AllocKind::Pool => {
            return Err(invalid(format!(
                "{dptr:#x} is an interior pointer of the pool allocation at {:#x}; export its base",
                a.base
            )));
        }
        Some(a) => {
            return Err(invalid(format!(
                "{dptr:#x} is {} memory, not an allocation of an exportable pool",
                a.kind.report_name()
            )));
        }
        None => return Err(invalid(format!("{dptr:#x} is not a live allocation"))),
    };
    let pool = st.pools.get(&a.pool).ok_or_else(|| invalid(format!("{dptr:#x}: its pool is gone")))?;
    let shared = exportable(pool, a.pool)?;
    if !shared.exported {
        return Err(invalid(format!(
            "pool {:#x} was never exported with cuMemPoolExportToShareableHandle: its pointers are \
             exported only after the pool was, once",
            a.pool
        )));
    }
    let (&chunk_base, chunk) = pool.chunks.range(..=dptr).next_back().expect("a pool block lies in a chunk");
    let offset = chunk.file_offset + (dptr - chunk_base);
    mark_held(&shared.header, offset);
    Ok(PtrExport { pid: std::process::id(), ino: shared.ino, offset, bytes: a.bytes }.encode())
}

/// `cuMemPoolImportPointer`: maps the block `data` names through the imported pool `h` into
/// the current context's address space, at a 32 MiB-aligned address; free it with `cuMemFree` or
/// `cuMemFreeAsync`. A block with a live import here gives that import's address (one mapping,
/// freed once). A block the exporter already freed is mapped too, and recorded as a violation
/// (SUCCESS, as on an H100); so is a block never exported, or a forged offset inside the pool file
/// (what a GPU answers for those is not on record). No
/// current context → `INVALID_CONTEXT`; a dead handle, a pool that was not imported, bytes no
/// `cuMemPoolExportPointer` wrote, or a pointer of another pool → `INVALID_VALUE`.
pub(crate) fn import_pointer(h: u64, data: &[u8; EXPORT_SIZE]) -> Result<u64, Fail> {
    let mut st = SIM.st.lock();
    let (ctx, _) = crate::context::current_ctx(&st)?;
    let h = lookup(&st, h)?;
    let pool = &st.pools[&h];
    let Some(shared) = pool.shared.as_ref().filter(|s| s.imported) else {
        return Err(invalid(format!(
            "pool {h:#x} was not imported (cuMemPoolImportFromShareableHandle): pointers are imported \
             through the importing process's handle of the exported pool"
        )));
    };
    let e = PtrExport::decode(data)?;
    if e.ino != shared.ino {
        return Err(invalid(format!(
            "the pointer was exported from another pool (of process {}) than pool {h:#x}",
            e.pid
        )));
    }
    // The offset and size are untrusted bytes: a mapping past the file's end would fault
    // (SIGBUS) on first touch.
    let (_, len) = stat(shared.file.as_fd()).ok_or_else(|| invalid("the pool file is unreadable".into()))?;
    let end = e.offset.checked_add(e.bytes).filter(|&end| e.bytes > 0 && e.offset >= PAGE && end <= len);
    let Some(end) = end else {
        return Err(invalid(format!(
            "the export names [{:#x}, +{}) of a pool file of {len} bytes",
            e.offset, e.bytes
        )));
    };
    if let Some(&(base, id)) = shared.mapped.get(&(e.offset, e.bytes))
        && st.allocs.get(&base).is_some_and(|a| a.buffer_id == id)
    {
        return Ok(base);
    }
    let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let first = e.offset / PAGE * PAGE;
    let map_len = usize::try_from(end.next_multiple_of(PAGE) - first).map_err(|_| oom())?;
    let pages = Arc::new(Backing::from_file_at(&shared.file, first, map_len).ok_or_else(oom)?);
    let backing = Backing::view(&pages, (e.offset - first) as usize, e.bytes as usize).ok_or_else(oom)?;
    let device = pool.device;
    let ticket = match ImportTicket::take(&shared.header, e.offset) {
        Take::Counted(t) => Some(t),
        Take::Untracked => None,
        Take::Dead => {
            import_of_freed_block(&e);
            None
        }
    };
    let reserve = e.bytes.checked_next_multiple_of(super::CHUNK).ok_or_else(oom)?;
    let base = st.devices[device].va.allocate(reserve, super::CHUNK).ok_or_else(oom)?;
    let buffer_id = st.next_buffer_id;
    st.next_buffer_id += 1;
    let shared = st.pools.get_mut(&h).and_then(|p| p.shared.as_mut()).expect("looked up above");
    shared.imports.insert(buffer_id, ticket);
    shared.mapped.insert((e.offset, e.bytes), (base, buffer_id));
    st.allocs.insert(
        base,
        Arc::new(Allocation {
            kind: AllocKind::PoolImport,
            base,
            bytes: e.bytes,
            charged: 0,
            device: device as i32,
            ctx,
            buffer_id,
            host_flags: 0,
            pool: h,
            backing,
            freed: OnceLock::new(),
        }),
    );
    Ok(base)
}

/// Records the import of a block its exporter does not hold (freed, never exported, or a forged
/// offset): the driver maps it, but the pool may hand its bytes to the next allocation under the
/// import.
fn import_of_freed_block(e: &PtrExport) {
    record_answered_with_success(format!(
        "imported the pool block [{:#x}, +{}) that its exporter (process {}) already freed or \
         never exported: it is mapped, but the pool may hand these bytes to its next allocation \
         while they are imported (the exporter must keep a block until every importer has freed \
         it)",
        e.offset, e.bytes, e.pid
    ));
}

/// Ends the count of an imported pointer whose free takes effect (`a`, of kind `PoolImport`: at
/// `cuMemFree`, or when the engine reaches a `cuMemFreeAsync`, since the driver requires the
/// importer's free to be complete before the exporter frees), and lets its imported pool go if
/// it was destroyed and this was its last import.
pub(crate) fn forget_import(st: &mut State, a: &Allocation) {
    if let Some(shared) = st.pools.get_mut(&a.pool).and_then(|p| p.shared.as_mut()) {
        shared.imports.remove(&a.buffer_id);
        shared.mapped.retain(|_, &mut (_, id)| id != a.buffer_id);
    }
    super::settle(st, a.pool);
}

/// Whether an imported pool still has imported pointers (it cannot be destroyed until they are
/// freed).
pub(crate) fn has_imports(pool: &Pool) -> bool {
    pool.shared.as_ref().is_some_and(|s| !s.imports.is_empty())
}

/// Ends the exporter's hold of the allocation at `base` of exportable pool `pool` (later imports
/// of it are still mapped, and recorded as violations), and records a violation when imports of
/// it live in any process (the driver requires every importer to free first; a GPU would hand the
/// memory to the pool's next allocation under the importer).
pub(crate) fn report_live_imports(pool: &Pool, base: u64) {
    let Some(shared) = pool.shared.as_ref().filter(|s| !s.imported) else { return };
    let Some((&chunk_base, chunk)) = pool.chunks.range(..=base).next_back() else { return };
    let offset = chunk.file_offset + (base - chunk_base);
    let live = release_hold(&shared.header, offset);
    if live == 0 {
        return;
    }
    record_answered_with_success(format!(
        "pool allocation {base:#x} freed by its exporter while {live} import(s) of it \
         (cuMemPoolImportPointer) are live: every importer must free it first; the pool may \
         hand these bytes to its next allocation while they are still imported"
    ));
}

/// Records a misuse in the calling API function that the driver answers with SUCCESS (it maps or
/// frees all the same), so that only the violation log tells of it.
fn record_answered_with_success(message: String) {
    let (function, os_tid) = crate::api::caller();
    let ok = CUresult::CUDA_SUCCESS;
    violation::record(Violation {
        function: function.to_string(),
        code: ok as u32,
        code_name: crate::errors::name_str(ok).to_string(),
        message,
        os_tid,
    });
}
