//! Shareable physical memory (issue 11, item 2): memory created with POSIX_FD exports a
//! descriptor that `PhysicalMemory::import_fd` turns back into memory of the same bytes. Here
//! the round trip stays in one process (a real H100 allows that, `driver-api.md` §17); the
//! two-process version is `crates/cumem-ipc/tests/vmm_descriptor.rs`. Every misuse is refused by
//! variant, before the driver where the library can tell.

mod common;

use std::io::Write;
use std::os::fd::AsFd;

use common::*;
use cumem_copy::StreamCopy;
use cumem_core::{Error, Feature, Stream};
use cumem_vmm::{Access, HandleTypes, PhysicalMemory, VirtualRange};
use serial_test::{parallel, serial};

/// Whether `device` can export POSIX descriptors (the simulator's devices can; a real one may not).
fn shareable(device: cumem_core::Device) -> bool {
    use cumem_core::sys::CUdevice_attribute as A;
    device.attribute(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED).unwrap() != 0
}

/// `PhysicalMemory::import_fd` for a test that orders every access to the memory itself (each
/// writer synchronises before the other mapping is read) or never maps it.
fn import(ctx: &cumem_core::Context, fd: impl AsFd, bytes: usize) -> cumem_core::Result<PhysicalMemory> {
    // SAFETY: every caller orders the accesses of its mappings of the memory (see above).
    unsafe { PhysicalMemory::import_fd(ctx, fd, bytes) }
}

/// How many physical allocations the simulator holds (`None` on a real driver).
fn sim_physical() -> Option<usize> {
    Some(cumem_sys::testing::sim_control()?.live_report().physical.len())
}

#[test]
#[parallel]
fn an_import_maps_the_same_bytes_as_the_exported_memory() {
    let Some(device) = vmm_device().filter(|&d| shareable(d)) else { return };
    let ctx = device.context().unwrap();
    let g = granule(device);
    let exported = PhysicalMemory::with_handle_types(&ctx, 2 * g, HandleTypes::POSIX_FD).unwrap();
    let fd = exported.export_fd().unwrap();
    let imported = import(&ctx, fd.as_fd(), 2 * g).unwrap();
    // The import holds its own reference: the descriptor may go at once.
    drop(fd);
    assert!(imported.is_imported() && !exported.is_imported());
    assert_ne!(imported.raw(), exported.raw(), "an import is a new handle, even in the same process");
    assert_eq!((imported.bytes(), imported.device()), (2 * g, device));
    // Read back from the memory: an H100 reports no handle types for an import (2026-11-23).
    assert_eq!(imported.handle_types(), HandleTypes::NONE, "read back from the memory");
    assert_eq!(exported.handle_types(), HandleTypes::POSIX_FD);
    // An import is not exported again (the driver refuses it, observed on an H100, 2026-11-23),
    // so cumem refuses it first; a second import comes from the exporter.
    without_any_call(&[], || {
        let e = imported.export_fd().unwrap_err();
        assert!(
            matches!(e, Error::InvalidValue { ctx } if ctx.op.contains("cannot be exported again")),
            "{e}"
        );
    });
    let again = import(&ctx, exported.export_fd().unwrap(), 2 * g).unwrap();

    // Both mapped at once, in two places of one range.
    let range = VirtualRange::reserve(&ctx, 4 * g).unwrap();
    let mut a = range.map(0, &exported).unwrap();
    let mut b = range.map(2 * g, &imported).unwrap();
    a.set_access(&[(device, Access::ReadWrite)]).unwrap();
    b.set_access(&[(device, Access::ReadWrite)]).unwrap();
    assert_ne!(a.device_ptr(), b.device_ptr());

    // Written through one, read through the other. Each mapping orders only its own views' work,
    // so the writer synchronises before the reader looks (a copy returns before its work lands).
    let data = pattern(2 * g / 4, 11);
    cumem_copy::copy_h2d(&data, &mut a.as_mut_slice::<u32>().unwrap()).unwrap();
    a.order().synchronize().unwrap();
    assert!(b.as_slice::<u32>().unwrap().to_vec().unwrap() == data, "the import does not see the bytes");

    // And the other way, with queued work on a stream.
    let stream = Stream::non_blocking(&ctx).unwrap();
    stream.fill(&mut b.as_mut_slice::<u32>().unwrap().slice_mut(g / 4..).unwrap(), 0x5EED_F00Du32).unwrap();
    b.order().synchronize().unwrap();
    let back = a.as_slice::<u32>().unwrap().to_vec().unwrap();
    assert!(back[..g / 4] == data[..g / 4], "bytes before the fill changed");
    assert!(back[g / 4..].iter().all(|&v| v == 0x5EED_F00D), "the exporter does not see the import's writes");

    // The exporter's memory and mapping go; the import keeps the bytes alive.
    drop(a);
    drop(exported);
    assert_eq!(b.as_slice::<u32>().unwrap().slice(..g / 4).unwrap().to_vec().unwrap(), data[..g / 4]);

    // The second import maps the bytes too, with the exporter's object gone.
    let mut c = range.map(0, &again).unwrap();
    c.set_access(&[(device, Access::Read)]).unwrap();
    assert_eq!(c.as_slice::<u32>().unwrap().slice(..g / 4).unwrap().to_vec().unwrap(), data[..g / 4]);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

#[test]
#[parallel]
fn exporting_memory_created_without_posix_fd_is_refused_before_the_driver() {
    let Some(device) = vmm_device() else { return };
    let ctx = device.context().unwrap();
    let private = PhysicalMemory::new(&ctx, granule(device)).unwrap();
    without_any_call(&[], || {
        let e = private.export_fd().unwrap_err();
        assert!(matches!(e, Error::InvalidValue { .. }), "{e}");
    });
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

#[test]
#[parallel]
fn bad_imports_are_refused_before_the_driver() {
    let Some(device) = vmm_device().filter(|&d| shareable(d)) else { return };
    let ctx = device.context().unwrap();
    let g = granule(device);
    let exported = PhysicalMemory::with_handle_types(&ctx, g, HandleTypes::POSIX_FD).unwrap();
    let fd = exported.export_fd().unwrap();
    let without_ctx = device_without_vmm().map(|d| d.context().unwrap());
    without_any_call(&[], || {
        let e = import(&ctx, &fd, 0).unwrap_err();
        assert!(matches!(e, Error::ZeroSize { .. }), "{e}");
        let e = import(&ctx, &fd, g / 2).unwrap_err();
        assert!(matches!(e, Error::Misaligned { what: "imported physical allocation size", .. }), "{e}");
        // Descriptor 0 (here stdin, whatever it is): the driver answers INVALID_VALUE for it even
        // when it is exported memory (observed on an H100, 2026-11-23, second run).
        let e = import(&ctx, std::io::stdin().as_fd(), g).unwrap_err();
        assert!(
            matches!(e, Error::InvalidValue { ctx } if ctx.op.starts_with("PhysicalMemory::import_fd")
                && ctx.op.contains("descriptor 0")),
            "{e}"
        );
        if let Some(without_ctx) = &without_ctx {
            let without = without_ctx.device();
            // Zero bytes is refused before the device is even asked about its granularity.
            let e = import(without_ctx, &fd, 0).unwrap_err();
            assert!(matches!(e, Error::ZeroSize { .. }), "{e}");
            let e = import(without_ctx, &fd, g).unwrap_err();
            assert!(
                matches!(e, Error::NotSupported { feature: Feature::VirtualMemory, device: Some(d) } if d == without.raw()),
                "{e}"
            );
        }
    });
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

/// Observed on an H100, 2026-11-23 (second run): importing a descriptor that is not exported
/// memory is the driver's `CUDA_ERROR_UNKNOWN` (a regular file, `/dev/null`, a pipe, a socket, a
/// closed number, −1), which cumem reports as `InvalidValue` naming the import and the driver's
/// code, on a GPU and on the simulator alike.
#[test]
#[parallel]
fn a_descriptor_that_is_not_exported_memory_is_invalid_value() {
    let Some(device) = vmm_device().filter(|&d| shareable(d)) else { return };
    let ctx = device.context().unwrap();
    let g = granule(device);
    let mut file = tempfile();
    file.write_all(&vec![0u8; 2 * g]).unwrap();
    let null = std::fs::File::open("/dev/null").unwrap();
    let (reader, _writer) = std::io::pipe().unwrap();
    let (socket, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    let cases = [
        ("a regular file", file.as_fd()),
        ("/dev/null", null.as_fd()),
        ("a pipe", reader.as_fd()),
        ("a socket", socket.as_fd()),
    ];
    for (what, fd) in cases {
        let e = import(&ctx, fd, g).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidValue { ctx } if ctx.op.starts_with("cuMemImportFromShareableHandle")
                && ctx.op.contains("CUDA_ERROR_UNKNOWN")
                && ctx.op.contains("not exported memory")),
            "{what}: {e}"
        );
    }
    if cumem_sys::testing::sim_control().is_some() {
        let misuse = misuse_here();
        assert!(
            misuse.iter().filter(|m| m.contains("cuMemImportFromShareableHandle")).count() >= cases.len(),
            "{misuse:?}"
        );
    }
}

/// The driver maps only a whole allocation (observed on an H100, 2026-11-23: `NOT_SUPPORTED` for a
/// prefix or more than the memory), and only it knows an import's size: a wrong size given to
/// `import_fd` is refused at the map, reported as `InvalidValue` naming that size.
#[test]
#[parallel]
fn an_import_of_the_wrong_size_is_refused_when_mapped() {
    let Some(device) = vmm_device().filter(|&d| shareable(d)) else { return };
    let ctx = device.context().unwrap();
    let g = granule(device);
    let range = VirtualRange::reserve(&ctx, 2 * g).unwrap();
    let one = PhysicalMemory::with_handle_types(&ctx, g, HandleTypes::POSIX_FD).unwrap();
    let two = PhysicalMemory::with_handle_types(&ctx, 2 * g, HandleTypes::POSIX_FD).unwrap();
    // The descriptor does not carry the size, so the wrong one is only found out by the map.
    let larger = import(&ctx, one.export_fd().unwrap(), 2 * g).unwrap();
    let prefix = import(&ctx, two.export_fd().unwrap(), g).unwrap();
    for (what, imported) in [("larger", &larger), ("a prefix", &prefix)] {
        let e = range.map(0, imported).unwrap_err();
        assert!(
            matches!(e, Error::InvalidValue { ctx } if ctx.op.contains("import_fd") && ctx.bytes == Some(imported.bytes())),
            "{what}: {e}"
        );
        assert_eq!(range.mapped_bytes(), 0, "{what}: a refused map left a claim behind");
        assert!(!imported.is_mapped(), "{what}");
    }
    if cumem_sys::testing::sim_control().is_some() {
        let misuse = misuse_here();
        assert!(misuse.iter().filter(|m| m.contains("cuMemMap")).count() >= 2, "{misuse:?}");
    }
    // Created memory maps whole, the right size of an import too, and the refused ones are unharmed.
    drop(range.map(0, &two).unwrap());
    let right = import(&ctx, one.export_fd().unwrap(), g).unwrap();
    let mut mapping = range.map(g, &right).unwrap();
    mapping.set_access(&[(device, Access::ReadWrite)]).unwrap();
    assert_eq!(mapping.size(), g);
}

#[test]
#[serial] // counts the simulator's physical allocations, which other tests' would move
fn an_import_onto_another_device_is_refused_and_released() {
    let Some(device) = vmm_device().filter(|&d| shareable(d)) else { return };
    let Some(other) = peer_of(device).or_else(|| non_peer_of(device)) else { return };
    if !shareable(other) {
        return;
    }
    let ctx = device.context().unwrap();
    let exported = PhysicalMemory::with_handle_types(&ctx, granule(device), HandleTypes::POSIX_FD).unwrap();
    let fd = exported.export_fd().unwrap();
    let before = sim_physical();
    let e = import(&other.context().unwrap(), &fd, granule(other)).unwrap_err();
    assert!(
        matches!(e, Error::WrongDevice { expected, actual } if expected == other.raw() && actual == device.raw()),
        "{e}"
    );
    assert_eq!(sim_physical(), before, "the refused import's reference was not released");
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

/// An unlinked temporary file (not exported memory).
fn tempfile() -> std::fs::File {
    let path = std::env::temp_dir().join(format!("cumem-vmm-not-exported-{}", std::process::id()));
    let file =
        std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    file
}
