//! Pool export and import through the raw C API: a pool created with POSIX_FD handle types
//! exports a descriptor and its allocations export 64 bytes; another process (this binary
//! re-executed, running only `importer`, which gets the descriptor by opening
//! `/proc/<pid>/fd/<n>`, the same file an `SCM_RIGHTS` transfer gives) imports the pool and the
//! pointer, reads the exporter's bytes and writes its own, which the exporter then reads; the
//! exporter's free of a block the importer still holds is reported, its frees after the importer's
//! are not (the counts live in the pool file, so they cross processes). Every
//! misuse gives the observed code (§17: the default pool and pools without handle types do not
//! export, destroying an exported pool succeeds) or the one the simulator documents. Imported pools
//! and pointers are in the importer's live report until released; both reports end clean.

mod common;

use std::ffi::c_void;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;

use common::child_process::{ChildTest, connect_to_parent, expect};
use common::*;
use cudarc::driver::sys::{self as cu, CUdeviceptr, CUmemPoolPtrExportData, CUmemoryPool, CUresult};
use serial_test::serial;

const CHILD_ENV: &str = "CUMEM_SIM_POOL_EXPORT_CHILD";
const BYTES: usize = 3 << 20;
const POSIX_FD: u32 = 1;
const FABRIC: u32 = 8;
fn pattern() -> Vec<u8> {
    (0..BYTES).map(|i| (i * 13 + i / 509) as u8).collect()
}

fn create(types: u32) -> CUmemoryPool {
    // SAFETY: an all-zero CUmemPoolProps is a valid value (every enum has a 0 variant).
    let mut p: cu::CUmemPoolProps = unsafe { std::mem::zeroed() };
    p.allocType = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 };
    p.handleTypes = cu::CUmemAllocationHandleType(types);
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { cu::cuMemPoolCreate(&mut pool, &p) });
    pool
}

fn destroy_pool(pool: CUmemoryPool) {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuMemPoolDestroy(pool) });
}

fn export(pool: CUmemoryPool, ty: u32, flags: u64) -> (CUresult, i32) {
    let mut fd = -7;
    // SAFETY: valid out-pointer for an int.
    let r = unsafe {
        cu::cuMemPoolExportToShareableHandle(
            (&mut fd as *mut i32).cast(),
            pool,
            cu::CUmemAllocationHandleType(ty),
            flags,
        )
    };
    (r, fd)
}

fn import(fd: i32, ty: u32, flags: u64) -> (CUresult, CUmemoryPool) {
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the descriptor is passed by value.
    let r = unsafe {
        cu::cuMemPoolImportFromShareableHandle(
            &mut pool,
            fd as isize as *mut c_void,
            cu::CUmemAllocationHandleType(ty),
            flags,
        )
    };
    (r, pool)
}

fn alloc_from(pool: CUmemoryPool, bytes: usize) -> (CUresult, CUdeviceptr) {
    let mut p = 0;
    // SAFETY: valid out-pointer; legacy stream.
    let r = unsafe { cu::cuMemAllocFromPoolAsync(&mut p, bytes, pool, std::ptr::null_mut()) };
    (r, p)
}

fn export_ptr(p: CUdeviceptr) -> (CUresult, [u8; 64]) {
    let mut data = CUmemPoolPtrExportData { reserved: [0; 64] };
    // SAFETY: valid out-pointer.
    let r = unsafe { cu::cuMemPoolExportPointer(&mut data, p) };
    (r, data.reserved)
}

fn import_ptr(pool: CUmemoryPool, bytes: [u8; 64]) -> (CUresult, CUdeviceptr) {
    let mut data = CUmemPoolPtrExportData { reserved: bytes };
    let mut p = 0;
    // SAFETY: valid pointers.
    let r = unsafe { cu::cuMemPoolImportPointer(&mut p, pool, &mut data) };
    (r, p)
}

fn free_async(p: CUdeviceptr) -> CUresult {
    // SAFETY: plain FFI call; legacy stream.
    unsafe { cu::cuMemFreeAsync(p, std::ptr::null_mut()) }
}

fn sync() {
    // SAFETY: plain FFI call.
    ok(unsafe { cu::cuCtxSynchronize() });
}

fn write(p: CUdeviceptr, data: &[u8]) {
    // SAFETY: `data` is readable for its length; the simulator checks `p`.
    ok(unsafe { cu::cuMemcpyHtoD_v2(p, data.as_ptr().cast(), data.len()) });
}

fn close_fd(fd: i32) {
    // SAFETY: a descriptor this test owns, closed once.
    assert_eq!(unsafe { libc::close(fd) }, 0);
}

fn inode(fd: i32) -> u64 {
    // SAFETY: `stat` is plain data, written by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
    st.st_ino
}

#[test]
#[serial]
fn export_codes_and_an_import_in_the_same_process() {
    let ctl = bind(0);
    let shared = create(POSIX_FD);
    let plain = create(0);
    let mut default: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuDeviceGetDefaultMemPool(&mut default, 0) });

    // Export of the pool: a new descriptor per call; only POSIX_FD pools (§17).
    let (r, fd) = export(shared, POSIX_FD, 0);
    ok(r);
    let (r, fd2) = export(shared, POSIX_FD, 0);
    ok(r);
    assert!(fd >= 0 && fd2 >= 0 && fd != fd2, "a new descriptor per call: {fd} {fd2}");
    assert_eq!(inode(fd), inode(fd2), "both name the pool's memory");
    close_fd(fd2);
    assert_eq!(export(plain, POSIX_FD, 0).0, CUresult::CUDA_ERROR_INVALID_VALUE, "no handle types");
    assert_eq!(export(default, POSIX_FD, 0).0, CUresult::CUDA_ERROR_INVALID_VALUE, "the default pool");
    assert_eq!(export(shared, POSIX_FD, 1).0, CUresult::CUDA_ERROR_INVALID_VALUE, "flags");
    assert_eq!(export(shared, FABRIC, 0).0, CUresult::CUDA_ERROR_INVALID_VALUE, "another type");
    // SAFETY: NULL out-pointer, checked by the callee.
    let r = unsafe {
        cu::cuMemPoolExportToShareableHandle(
            std::ptr::null_mut(),
            shared,
            cu::CUmemAllocationHandleType(POSIX_FD),
            0,
        )
    };
    assert_eq!(r, CUresult::CUDA_ERROR_INVALID_VALUE, "NULL handle_out");

    // Import of a pool descriptor.
    assert_eq!(import(fd, FABRIC, 0).0, CUresult::CUDA_ERROR_NOT_SUPPORTED, "unsupported type");
    assert_eq!(import(fd, POSIX_FD, 1).0, CUresult::CUDA_ERROR_INVALID_VALUE, "flags");
    assert_eq!(import(-1, POSIX_FD, 0).0, CUresult::CUDA_ERROR_UNKNOWN, "fd -1, as the VMM import");
    // A regular file that is not a pool (procfs files are regular): UNKNOWN, as an H100 answered
    // for a regular file on 2026-11-24.
    let not_a_pool = std::fs::File::open("/proc/self/status").unwrap();
    assert_eq!(import(not_a_pool.as_raw_fd(), POSIX_FD, 0).0, CUresult::CUDA_ERROR_UNKNOWN);
    // SAFETY: NULL out-pointer, checked by the callee.
    let r = unsafe {
        cu::cuMemPoolImportFromShareableHandle(
            std::ptr::null_mut(),
            fd as isize as *mut c_void,
            cu::CUmemAllocationHandleType(POSIX_FD),
            0,
        )
    };
    assert_eq!(r, CUresult::CUDA_ERROR_INVALID_VALUE, "NULL pool_out");
    let (r, imported) = import(fd, POSIX_FD, 0);
    ok(r);
    close_fd(fd);
    assert_ne!(imported, shared, "an import is a new pool handle");
    let report = ctl.live_report();
    let listed =
        report.pools.iter().find(|p| p.handle == imported as u64).expect("the imported pool is listed");
    assert!(listed.imported && !listed.default && listed.device == 0, "{report}");
    // An imported pool is for importing pointers only.
    assert_eq!(alloc_from(imported, 512).0, CUresult::CUDA_ERROR_INVALID_VALUE);
    // SAFETY: plain FFI call.
    assert_eq!(unsafe { cu::cuDeviceSetMemPool(0, imported) }, CUresult::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(export(imported, POSIX_FD, 0).0, CUresult::CUDA_ERROR_INVALID_VALUE);

    // Export of pointers: the base of an allocation of a POSIX_FD pool.
    let (r, p) = alloc_from(shared, BYTES);
    ok(r);
    write(p, &pattern());
    let (r, data) = export_ptr(p);
    ok(r);
    assert_eq!(export_ptr(p + 512).0, CUresult::CUDA_ERROR_INVALID_VALUE, "an interior pointer");
    let (r, q) = alloc_from(plain, 4096);
    ok(r);
    assert_eq!(export_ptr(q).0, CUresult::CUDA_ERROR_INVALID_VALUE, "a pool without handle types");
    let d = dalloc(4096);
    assert_eq!(export_ptr(d).0, CUresult::CUDA_ERROR_INVALID_VALUE, "cuMemAlloc memory");
    dfree(d);
    // SAFETY: NULL out-pointer, checked by the callee.
    let r = unsafe { cu::cuMemPoolExportPointer(std::ptr::null_mut(), p) };
    assert_eq!(r, CUresult::CUDA_ERROR_INVALID_VALUE, "NULL shareData_out");

    // Import of pointers: only through an imported pool, of the pool that exported them.
    assert_eq!(import_ptr(shared, data).0, CUresult::CUDA_ERROR_INVALID_VALUE, "not an imported pool");
    let mut garbage = data;
    garbage[0] ^= 1;
    assert_eq!(import_ptr(imported, garbage).0, CUresult::CUDA_ERROR_INVALID_VALUE, "bytes no export wrote");
    let mut forged = data;
    forged[32..40].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert_eq!(
        import_ptr(imported, forged).0,
        CUresult::CUDA_ERROR_INVALID_VALUE,
        "a size the pool file lacks"
    );
    let other = create(POSIX_FD);
    let (r, other_fd) = export(other, POSIX_FD, 0);
    ok(r);
    let (r, other_imported) = import(other_fd, POSIX_FD, 0);
    ok(r);
    close_fd(other_fd);
    assert_eq!(import_ptr(other_imported, data).0, CUresult::CUDA_ERROR_INVALID_VALUE, "another pool");
    destroy_pool(other_imported);
    destroy_pool(other);
    let (r, ip) = import_ptr(imported, data);
    ok(r);
    assert_ne!(ip, p, "an import has its own address");
    assert_eq!(read_back(ip, BYTES), pattern(), "the import maps the exported bytes");
    // SAFETY: plain FFI call on the imported range.
    ok(unsafe { cu::cuMemsetD8_v2(ip + 4096, 0x3C, 512) });
    sync();
    assert_eq!(read_back(p + 4096, 512), vec![0x3C; 512], "and the exporter sees the import's write");
    let report = ctl.live_report();
    let listed = report.allocations.iter().find(|a| a.ptr == ip).expect("the import is listed");
    assert_eq!(
        (listed.kind.as_str(), listed.bytes, listed.pool),
        ("pool_import", BYTES as u64, Some(imported as u64))
    );
    // Its own id, not the exported block's (live in this process too).
    assert!(
        listed.id != 0 && report.allocations.iter().filter(|a| a.id == listed.id).count() == 1,
        "{report}"
    );
    // Freed with cuMemFree; once.
    // SAFETY: plain FFI calls.
    ok(unsafe { cu::cuMemFree_v2(ip) });
    // SAFETY: plain FFI call.
    assert_eq!(unsafe { cu::cuMemFree_v2(ip) }, CUresult::CUDA_ERROR_INVALID_VALUE, "a second free");
    // Or with cuMemFreeAsync.
    let (r, ip) = import_ptr(imported, data);
    ok(r);
    let id = ctl.live_report().id_of(ip).expect("the import is listed");
    ok(free_async(ip));
    sync();
    let live = ctl.live_report();
    assert!(!live.contains_allocation(id), "{live}");

    // The exporter freeing a block while an import of it lives is reported (importers free
    // first); freeing after the importers is not.
    let early = |v: &Vec<cumem_sim::Violation>| {
        v.iter().filter(|v| v.message.contains("freed by its exporter")).count()
    };
    assert_eq!(early(&ctl.violations_on_this_thread()), 0, "{:#?}", ctl.violations_on_this_thread());
    let (r, p2) = alloc_from(shared, 4096);
    ok(r);
    let (r, data2) = export_ptr(p2);
    ok(r);
    let (r, ip2) = import_ptr(imported, data2);
    ok(r);
    ok(free_async(p2));
    assert_eq!(early(&ctl.violations_on_this_thread()), 1, "{:#?}", ctl.violations_on_this_thread());
    ok(free_async(ip2));
    sync();
    // An imported pool with a live imported pointer is not destroyed, and the refused destroy is
    // not counted (as on an H100, 2026-11-23, second run): one destroy after the free ends it.
    let (r, ip3) = import_ptr(imported, data);
    ok(r);
    // SAFETY: plain FFI call on a live handle.
    assert_eq!(unsafe { cu::cuMemPoolDestroy(imported) }, CUresult::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(read_back(ip3, 4096)[..], pattern()[..4096]);
    ok(try_free(ip3));
    destroy_pool(imported);
    assert_eq!(import_ptr(imported, data).0, CUresult::CUDA_ERROR_INVALID_VALUE, "a destroyed pool");
    assert!(!ctl.live_report().contains_pool(imported as u64));
    let imported = {
        let (r, fd) = export(shared, POSIX_FD, 0);
        ok(r);
        let (r, again) = import(fd, POSIX_FD, 0);
        ok(r);
        close_fd(fd);
        again
    };

    // A forgotten imported pool is a leak; destroying it ends it.
    assert!(!ctl.live_report().is_clean());
    destroy_pool(imported);
    // Destroying the exported pool with an allocation out succeeds (§17); the memory goes with the
    // allocation's free.
    destroy_pool(shared);
    assert_eq!(read_back(p, 4096)[..], pattern()[..4096]);
    ok(free_async(p));
    ok(free_async(q));
    destroy_pool(plain);
    sync();
    let report = ctl.live_report();
    assert!(report.allocations.is_empty() && report.user_pools().next().is_none(), "{report}");
}

/// A pool's pointers export only once the pool itself was exported (observed on an H100,
/// 2026-11-23): before, `cuMemPoolExportPointer` gives INVALID_VALUE; after one
/// `cuMemPoolExportToShareableHandle` (its descriptor closed at once), pointers allocated before
/// and after it export, also before the allocating stream was synchronised; an interior pointer
/// still does not.
#[test]
#[serial]
fn pointers_export_only_after_the_pool_was_exported_once() {
    let ctl = bind(0);
    let pool = create(POSIX_FD);
    let (r, before) = alloc_from(pool, 16384);
    ok(r);
    sync();
    assert_eq!(export_ptr(before).0, CUresult::CUDA_ERROR_INVALID_VALUE, "the pool was never exported");
    let (r, fd) = export(pool, POSIX_FD, 0);
    ok(r);
    close_fd(fd);
    ok(export_ptr(before).0);
    // Not synchronised: the allocation is still queued on the legacy stream.
    let (r, after) = alloc_from(pool, 16384);
    ok(r);
    ok(export_ptr(after).0);
    assert_eq!(export_ptr(after + 256).0, CUresult::CUDA_ERROR_INVALID_VALUE, "an interior pointer");
    ok(free_async(before));
    ok(free_async(after));
    destroy_pool(pool);
    sync();
    let report = ctl.live_report();
    assert!(report.allocations.is_empty() && report.user_pools().next().is_none(), "{report}");
}

fn attr_u64(attribute: cu::CUpointer_attribute, p: CUdeviceptr) -> u64 {
    let mut v = u64::MAX;
    // SAFETY: a u64 out-value, the size of every attribute read with it here.
    ok(unsafe { cu::cuPointerGetAttribute((&mut v as *mut u64).cast(), attribute, p) });
    v
}

fn attr_u32(attribute: cu::CUpointer_attribute, p: CUdeviceptr) -> u32 {
    let mut v = u32::MAX;
    // SAFETY: a u32 out-value, the size of every attribute read with it here.
    ok(unsafe { cu::cuPointerGetAttribute((&mut v as *mut u32).cast(), attribute, p) });
    v
}

/// What `cuPointerGetAttribute` says of a pool allocation (observed on an H100, 2026-11-23):
/// RANGE_* are the allocation (the bytes asked for), MAPPING_* the pool's 32 MiB chunk holding
/// it, ALLOWED_HANDLE_TYPES the pool's handle types, MEMPOOL_HANDLE the pool.
#[test]
#[serial]
fn pointer_attributes_of_a_pool_allocation() {
    use cu::CUpointer_attribute::*;
    let ctl = bind(0);
    let shared = create(POSIX_FD);
    let plain = create(0);
    let (r, a) = alloc_from(shared, 16384);
    ok(r);
    let (r, p) = alloc_from(shared, 1000);
    ok(r);
    let (r, q) = alloc_from(plain, 1000);
    ok(r);
    sync();
    for (ptr, pool, types) in [(p, shared, POSIX_FD), (q, plain, 0)] {
        let inside = ptr + 100;
        assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, inside), ptr, "the allocation");
        assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_RANGE_SIZE, inside), 1000, "the bytes asked for");
        let chunk = attr_u64(CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, inside);
        assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_MAPPING_SIZE, inside), 32 << 20, "the pool's chunk");
        assert!(chunk <= ptr && ptr + 1000 <= chunk + (32 << 20), "{chunk:#x} holds {ptr:#x}");
        assert_eq!(attr_u32(CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, inside), types);
        assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, inside), pool as u64);
        assert_eq!(attr_u32(CU_POINTER_ATTRIBUTE_ACCESS_FLAGS, inside), 3);
        assert_eq!(attr_u32(CU_POINTER_ATTRIBUTE_MAPPED, inside), 1);
    }
    assert_eq!(
        attr_u64(CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, a),
        attr_u64(CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, p),
        "both blocks lie in one chunk"
    );
    for ptr in [a, p, q] {
        ok(free_async(ptr));
    }
    destroy_pool(shared);
    destroy_pool(plain);
    sync();
    let report = ctl.live_report();
    assert!(report.allocations.is_empty() && report.user_pools().next().is_none(), "{report}");
}

/// Exports and imports a new POSIX_FD pool in this process: `(pool, imported pool)`.
fn pool_and_import() -> (CUmemoryPool, CUmemoryPool) {
    let pool = create(POSIX_FD);
    let (r, fd) = export(pool, POSIX_FD, 0);
    ok(r);
    let (r, imported) = import(fd, POSIX_FD, 0);
    ok(r);
    close_fd(fd);
    (pool, imported)
}

fn early_frees(ctl: &cumem_sim::Control) -> usize {
    ctl.violations_on_this_thread().iter().filter(|v| v.message.contains("freed by its exporter")).count()
}

fn imports_of_freed_blocks(ctl: &cumem_sim::Control) -> usize {
    ctl.violations_on_this_thread().iter().filter(|v| v.message.contains("already freed")).count()
}

fn try_free(p: CUdeviceptr) -> CUresult {
    // SAFETY: plain FFI call.
    unsafe { cu::cuMemFree_v2(p) }
}

/// An import of a block its exporter already freed succeeds, as on an H100 in the exporting
/// process (2026-11-23), and maps the block: what the pool puts there next is what the import
/// sees. The simulator records it as a violation (the exporter must keep the block until every
/// importer has freed it).
#[test]
#[serial]
fn an_import_of_a_block_its_exporter_freed_is_mapped_and_reported() {
    let ctl = bind(0);
    ctl.clear_violations();
    let (pool, imported) = pool_and_import();
    let (r, p) = alloc_from(pool, 4096);
    ok(r);
    let (r, data) = export_ptr(p);
    ok(r);
    let (r, ip) = import_ptr(imported, data);
    ok(r);
    ok(free_async(ip));
    // The importer's free is complete before the exporter frees.
    sync();
    // Not synchronised after: a release at synchronisation would give the chunk back.
    ok(free_async(p));
    assert_eq!(imports_of_freed_blocks(ctl), 0, "{:#?}", ctl.violations_on_this_thread());
    let (r, stale) = import_ptr(imported, data);
    ok(r);
    assert_eq!(imports_of_freed_blocks(ctl), 1, "{:#?}", ctl.violations_on_this_thread());
    // The pool hands the block on; the stale import maps the new owner's bytes.
    let (r, again) = alloc_from(pool, 4096);
    ok(r);
    assert_eq!(again, p, "the pool reuses the block");
    write(again, &[0xA7; 4096]);
    sync();
    assert_eq!(read_back(stale, 4096), vec![0xA7; 4096]);
    ok(try_free(stale));
    assert_eq!(try_free(stale), CUresult::CUDA_ERROR_INVALID_VALUE, "freed once");
    ok(free_async(again));
    assert_eq!(early_frees(ctl), 0, "{:#?}", ctl.violations_on_this_thread());
    ctl.clear_violations();
    destroy_pool(imported);
    destroy_pool(pool);
    sync();
    let report = ctl.live_report();
    assert!(report.allocations.is_empty() && report.user_pools().next().is_none(), "{report}");
}

fn address_range(p: CUdeviceptr) -> Result<(u64, usize), CUresult> {
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: valid out-pointers.
    match unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut size, p) } {
        CUresult::CUDA_SUCCESS => Ok((base, size)),
        e => Err(e),
    }
}

/// In one process, as on an H100 (2026-11-23): a second import of a pool with a live import gives
/// the same handle (not the exporter's), and each import is destroyed once; a second import of a
/// pointer with a live import gives the same address, and is not counted: the first `cuMemFree`
/// unmaps it, the next gives INVALID_VALUE. The import's address is 32 MiB aligned, its mapping
/// 32 MiB, its range the allocation; it has no handle types and belongs to the imported pool.
#[test]
#[serial]
fn imports_in_one_process_share_the_pool_handle_and_the_address() {
    use cu::CUpointer_attribute::*;
    let ctl = bind(0);
    let (pool, a) = pool_and_import();
    let (r, fd) = export(pool, POSIX_FD, 0);
    ok(r);
    let (r, b) = import(fd, POSIX_FD, 0);
    ok(r);
    close_fd(fd);
    assert_eq!(b, a, "the live import's handle");
    assert_ne!(a, pool);
    let (r, p) = alloc_from(pool, 4000);
    ok(r);
    write(p, &pattern()[..4000]);
    sync();
    let (r, data) = export_ptr(p);
    ok(r);
    let (r, x) = import_ptr(a, data);
    ok(r);
    let (r, y) = import_ptr(b, data);
    ok(r);
    assert_eq!(y, x, "the live import's address");
    assert_ne!(x, p);
    assert_eq!(x % (32 << 20), 0, "{x:#x}");
    assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, x + 100), x);
    assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_MAPPING_SIZE, x + 100), 32 << 20);
    assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, x + 100), x);
    assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_RANGE_SIZE, x + 100), 4000);
    assert_eq!(address_range(x + 100), Ok((x, 4000)));
    assert_eq!(attr_u32(CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, x), 0);
    assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, x), a as u64);
    assert_eq!(attr_u32(CU_POINTER_ATTRIBUTE_ACCESS_FLAGS, x), 3);
    assert_eq!(read_back(y, 4000), pattern()[..4000]);
    let listed = ctl.live_report().allocations.iter().filter(|l| l.kind == "pool_import").count();
    assert_eq!(listed, 1, "one mapping");
    // Not destroyed while a pointer imported through it lives, and not counted down (as on an
    // H100, 2026-11-23, second run): both destroys below are still needed.
    // SAFETY: plain FFI call on a live handle.
    assert_eq!(unsafe { cu::cuMemPoolDestroy(b) }, CUresult::CUDA_ERROR_INVALID_VALUE, "x lives");
    ok(try_free(x));
    assert_eq!(address_range(y), Err(CUresult::CUDA_ERROR_NOT_FOUND), "the first free unmaps it");
    let mut kind = 0u32;
    // SAFETY: a u32 out-value for a 4-byte attribute.
    let r = unsafe { cu::cuPointerGetAttribute((&raw mut kind).cast(), CU_POINTER_ATTRIBUTE_MEMORY_TYPE, y) };
    assert_eq!(r, CUresult::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(try_free(y), CUresult::CUDA_ERROR_INVALID_VALUE, "not counted");
    ok(free_async(p));
    // One destroy leaves the other import usable.
    destroy_pool(a);
    let (r, q) = alloc_from(pool, 4000);
    ok(r);
    let (r, data) = export_ptr(q);
    ok(r);
    let (r, z) = import_ptr(b, data);
    ok(r);
    ok(try_free(z));
    ok(free_async(q));
    destroy_pool(b);
    // SAFETY: plain FFI call on a dead handle.
    assert_eq!(unsafe { cu::cuMemPoolDestroy(b) }, CUresult::CUDA_ERROR_INVALID_VALUE, "each import once");
    // With no live import left, the next import is a new handle.
    let (r, fd) = export(pool, POSIX_FD, 0);
    ok(r);
    let (r, c) = import(fd, POSIX_FD, 0);
    ok(r);
    close_fd(fd);
    assert!(ctl.live_report().pools.iter().any(|l| l.handle == c as u64 && l.imported));
    destroy_pool(c);
    destroy_pool(pool);
    sync();
    let report = ctl.live_report();
    assert!(report.allocations.is_empty() && report.user_pools().next().is_none(), "{report}");
}

/// The header's slots hold the blocks exported or imported at once, not every block ever
/// imported: hundreds of blocks imported one after another are all counted.
#[test]
#[serial]
fn imports_of_many_blocks_one_after_another_are_all_counted() {
    const BLOCKS: usize = 300;
    let ctl = bind(0);
    ctl.clear_violations();
    let (pool, imported) = pool_and_import();
    // Allocated first, so that every block has its own offset in the pool file.
    let blocks: Vec<CUdeviceptr> = (0..BLOCKS)
        .map(|_| {
            let (r, p) = alloc_from(pool, 512);
            ok(r);
            p
        })
        .collect();
    for &p in &blocks {
        let (r, data) = export_ptr(p);
        ok(r);
        let (r, ip) = import_ptr(imported, data);
        ok(r);
        // Freed by the exporter while imported: reported, for the last block as for the first.
        ok(free_async(p));
        ok(free_async(ip));
    }
    assert_eq!(early_frees(ctl), BLOCKS, "every early free is reported");
    ctl.clear_violations();
    destroy_pool(imported);
    destroy_pool(pool);
    sync();
    let report = ctl.live_report();
    assert!(report.allocations.is_empty() && report.user_pools().next().is_none(), "{report}");
}

/// The importer's `cuMemFreeAsync` ends its import when the free executes, not at the call: the
/// exporter freeing the block before then is reported (the driver requires the importer's free
/// to be complete first); once it has executed, it is not.
#[test]
#[serial]
fn a_queued_free_of_an_import_ends_it_when_it_executes() {
    let ctl = bind(0);
    ctl.clear_violations();
    let (pool, imported) = pool_and_import();
    let s = stream(1); // CU_STREAM_NON_BLOCKING
    for complete_first in [false, true] {
        let (r, p) = alloc_from(pool, 4096);
        ok(r);
        let (r, data) = export_ptr(p);
        ok(r);
        let (r, ip) = import_ptr(imported, data);
        ok(r);
        let gate = Gate::block(s);
        // SAFETY: plain FFI call; `s` is live.
        ok(unsafe { cu::cuMemFreeAsync(ip, s) });
        if complete_first {
            gate.open();
            // SAFETY: plain FFI call; `s` is live.
            ok(unsafe { cu::cuStreamSynchronize(s) });
        }
        ok(free_async(p));
        let expected = usize::from(!complete_first);
        assert_eq!(early_frees(ctl), expected, "{:#?}", ctl.violations_on_this_thread());
        drop(gate);
        sync();
        ctl.clear_violations();
    }
    destroy(s);
    destroy_pool(imported);
    destroy_pool(pool);
    sync();
    let report = ctl.live_report();
    assert!(report.allocations.is_empty() && report.user_pools().next().is_none(), "{report}");
}

/// More blocks held at once than the header has slots: the imports beyond are allowed (not
/// counted), and still keep their imported pool from being destroyed.
#[test]
#[serial]
fn an_untracked_import_keeps_its_imported_pool_from_being_destroyed() {
    const BLOCKS: usize = 520;
    let ctl = bind(0);
    let (pool, imported) = pool_and_import();
    let blocks: Vec<(CUdeviceptr, [u8; 64])> = (0..BLOCKS)
        .map(|_| {
            let (r, p) = alloc_from(pool, 512);
            ok(r);
            let (r, data) = export_ptr(p);
            ok(r);
            (p, data)
        })
        .collect();
    let (r, ip) = import_ptr(imported, blocks[BLOCKS - 1].1);
    ok(r);
    // SAFETY: plain FFI call on a live handle.
    assert_eq!(unsafe { cu::cuMemPoolDestroy(imported) }, CUresult::CUDA_ERROR_INVALID_VALUE);
    sync();
    assert_eq!(read_back(ip, 512), read_back(blocks[BLOCKS - 1].0, 512));
    ok(free_async(ip));
    sync();
    destroy_pool(imported);
    assert!(!ctl.live_report().contains_pool(imported as u64));
    for (p, _) in blocks {
        ok(free_async(p));
    }
    destroy_pool(pool);
    sync();
    let report = ctl.live_report();
    assert!(report.allocations.is_empty() && report.user_pools().next().is_none(), "{report}");
}

#[test]
#[serial]
fn another_process_imports_the_pool_and_a_pointer() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let ctl = bind(0);
    let (child, mut sock) = ChildTest::spawn("importer", CHILD_ENV);
    let pool = create(POSIX_FD);
    // A first allocation, so that the exported one does not start at the pool file's first chunk.
    let (r, first) = alloc_from(pool, 4096);
    ok(r);
    let (r, p) = alloc_from(pool, BYTES);
    ok(r);
    write(p, &pattern());
    // A pageable copy may return before its bytes land (§6): the importer looks only after this.
    sync();
    let (r, fd) = export(pool, POSIX_FD, 0);
    ok(r);
    let (r, data) = export_ptr(p);
    ok(r);
    // A block the importer still holds when the exporter frees it.
    let (r, early) = alloc_from(pool, 4096);
    ok(r);
    let (r, early_data) = export_ptr(early);
    ok(r);
    sock.write_all(format!("{} {fd}\n", std::process::id()).as_bytes()).unwrap();
    sock.write_all(&data).unwrap();
    sock.write_all(&early_data).unwrap();
    expect(&mut sock, b"W");
    assert_eq!(read_back(p, BYTES), vec![0x5A; BYTES], "the exporter does not see the importer's write");
    // The importer freed its import of `p` before saying so; it still holds `early`: the
    // exporter's free of `early` is reported, its free of `p` is not.
    let early_frees = || {
        ctl.violations_on_this_thread().iter().filter(|v| v.message.contains("freed by its exporter")).count()
    };
    ok(free_async(p));
    assert_eq!(early_frees(), 0, "{:#?}", ctl.violations_on_this_thread());
    ok(free_async(early));
    assert_eq!(early_frees(), 1, "{:#?}", ctl.violations_on_this_thread());
    sock.write_all(b"X").unwrap();
    child.finish();
    close_fd(fd);
    ok(free_async(first));
    destroy_pool(pool);
    sync();
    let report = ctl.live_report();
    assert!(report.allocations.is_empty() && report.user_pools().next().is_none(), "{report}");
}

#[test]
#[serial]
fn importer() {
    let Some(mut sock) = connect_to_parent(CHILD_ENV) else {
        return;
    };
    let ctl = bind(0);
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while sock.read_exact(&mut byte).is_ok() && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    let line = String::from_utf8(line).unwrap();
    let (pid, fd) = line.split_once(' ').unwrap();
    let mut data = [0u8; 64];
    sock.read_exact(&mut data).unwrap();
    let mut early_data = [0u8; 64];
    sock.read_exact(&mut early_data).unwrap();
    let file =
        std::fs::OpenOptions::new().read(true).write(true).open(format!("/proc/{pid}/fd/{fd}")).unwrap();
    let (r, pool) = import(file.as_raw_fd(), POSIX_FD, 0);
    ok(r);
    drop(file);
    let (r, p) = import_ptr(pool, data);
    ok(r);
    let (r, early) = import_ptr(pool, early_data);
    ok(r);
    let report = ctl.live_report();
    assert!(report.pools.iter().any(|lp| lp.handle == pool as u64 && lp.imported), "{report}");
    assert!(report.allocations.iter().any(|a| a.ptr == p && a.kind == "pool_import"), "{report}");
    assert_eq!(read_back(p, BYTES), pattern(), "the importer does not read the exporter's bytes");
    // SAFETY: plain FFI call on the imported range.
    ok(unsafe { cu::cuMemsetD8_v2(p, 0x5A, BYTES) });
    // A device memset returns before it runs: the exporter may only look once it is done.
    sync();
    ok(free_async(p));
    sync();
    sock.write_all(b"W").unwrap();
    let mut note = [0u8; 1];
    sock.read_exact(&mut note).unwrap();
    assert_eq!(&note, b"X", "the exporter failed");
    ok(free_async(early));
    // The free must have run before the imported pool can be destroyed.
    sync();
    destroy_pool(pool);
    let report = ctl.live_report();
    assert!(report.allocations.is_empty() && report.user_pools().next().is_none(), "{report}");
}
