//! C structures the driver API passes by pointer or value, with the exact layouts of the
//! cuda-12080 bindings. Enumerations are kept as raw `u32` so that any value a C caller passes
//! can be range-checked without undefined behaviour.

use std::ffi::c_void;

/// `CUmemLocation` (8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemLocation {
    /// `CUmemLocationType`: INVALID 0, DEVICE 1, HOST 2, HOST_NUMA 3, HOST_NUMA_CURRENT 4.
    pub kind: u32,
    /// Device ordinal or NUMA id.
    pub id: i32,
}

/// `CU_MEM_LOCATION_TYPE_INVALID`.
pub(crate) const LOC_INVALID: u32 = 0;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub(crate) const LOC_DEVICE: u32 = 1;
/// `CU_MEM_LOCATION_TYPE_HOST`.
pub(crate) const LOC_HOST: u32 = 2;
/// `CU_MEM_LOCATION_TYPE_HOST_NUMA`.
pub(crate) const LOC_HOST_NUMA: u32 = 3;
/// `CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT`.
pub(crate) const LOC_HOST_NUMA_CURRENT: u32 = 4;

/// `CUmemAccessDesc` (12 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct AccessDesc {
    pub(crate) location: MemLocation,
    /// `CUmemAccess_flags`: PROT_NONE 0, PROT_READ 1, PROT_READWRITE 3.
    pub(crate) flags: u32,
}

/// `CUmemAllocationProp` (32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct AllocationProp {
    /// `CUmemAllocationType`: PINNED 1.
    pub(crate) alloc_type: u32,
    /// `CUmemAllocationHandleType` bits: POSIX_FD 1, WIN32 2, WIN32_KMT 4, FABRIC 8.
    pub(crate) handle_types: u32,
    pub(crate) location: MemLocation,
    pub(crate) win32_metadata: *mut c_void,
    pub(crate) compression_type: u8,
    pub(crate) gpu_direct_rdma_capable: u8,
    pub(crate) usage: u16,
    pub(crate) reserved: [u8; 4],
}

// SAFETY: `win32_metadata` is only ever copied back to the caller, never dereferenced.
unsafe impl Send for AllocationProp {}

/// `CUmemPoolProps` (88 bytes, CUDA 12.6+ layout with `usage`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct PoolProps {
    pub(crate) alloc_type: u32,
    pub(crate) handle_types: u32,
    pub(crate) location: MemLocation,
    pub(crate) win32_security_attributes: *mut c_void,
    pub(crate) max_size: usize,
    pub(crate) usage: u16,
    pub(crate) reserved: [u8; 54],
}

/// `CUDA_MEMCPY2D` (`_v2` layout, 128 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Memcpy2D {
    pub(crate) src_x: usize,
    pub(crate) src_y: usize,
    pub(crate) src_type: u32,
    pub(crate) src_host: *const c_void,
    pub(crate) src_device: u64,
    pub(crate) src_array: *mut c_void,
    pub(crate) src_pitch: usize,
    pub(crate) dst_x: usize,
    pub(crate) dst_y: usize,
    pub(crate) dst_type: u32,
    pub(crate) dst_host: *mut c_void,
    pub(crate) dst_device: u64,
    pub(crate) dst_array: *mut c_void,
    pub(crate) dst_pitch: usize,
    pub(crate) width: usize,
    pub(crate) height: usize,
}

/// `CUDA_MEMCPY3D` (`_v2` layout, 200 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Memcpy3D {
    pub(crate) src_x: usize,
    pub(crate) src_y: usize,
    pub(crate) src_z: usize,
    pub(crate) src_lod: usize,
    pub(crate) src_type: u32,
    pub(crate) src_host: *const c_void,
    pub(crate) src_device: u64,
    pub(crate) src_array: *mut c_void,
    pub(crate) reserved0: *mut c_void,
    pub(crate) src_pitch: usize,
    pub(crate) src_height: usize,
    pub(crate) dst_x: usize,
    pub(crate) dst_y: usize,
    pub(crate) dst_z: usize,
    pub(crate) dst_lod: usize,
    pub(crate) dst_type: u32,
    pub(crate) dst_host: *mut c_void,
    pub(crate) dst_device: u64,
    pub(crate) dst_array: *mut c_void,
    pub(crate) reserved1: *mut c_void,
    pub(crate) dst_pitch: usize,
    pub(crate) dst_height: usize,
    pub(crate) width: usize,
    pub(crate) height: usize,
    pub(crate) depth: usize,
}

const _: () = {
    assert!(size_of::<MemLocation>() == 8);
    assert!(size_of::<AccessDesc>() == 12);
    assert!(size_of::<PoolProps>() == 88);
    assert!(size_of::<AllocationProp>() == 32);
    assert!(size_of::<AllocationProp>() == size_of::<cudarc::driver::sys::CUmemAllocationProp>());
    assert!(std::mem::offset_of!(AllocationProp, compression_type) == 24);
    assert!(std::mem::offset_of!(PoolProps, max_size) == 24);
    assert!(std::mem::offset_of!(PoolProps, usage) == 32);
    assert!(size_of::<Memcpy2D>() == 128);
    assert!(std::mem::offset_of!(Memcpy2D, dst_x) == 56);
    assert!(std::mem::offset_of!(Memcpy2D, height) == 120);
    assert!(size_of::<Memcpy3D>() == 200);
    assert!(std::mem::offset_of!(Memcpy3D, dst_x) == 88);
    assert!(std::mem::offset_of!(Memcpy3D, dst_pitch) == 160);
    assert!(std::mem::offset_of!(Memcpy3D, depth) == 192);
    assert!(size_of::<MemLocation>() == size_of::<cudarc::driver::sys::CUmemLocation>());
    assert!(size_of::<PoolProps>() == size_of::<cudarc::driver::sys::CUmemPoolProps>());
    assert!(size_of::<Memcpy2D>() == size_of::<cudarc::driver::sys::CUDA_MEMCPY2D>());
    assert!(size_of::<Memcpy3D>() == size_of::<cudarc::driver::sys::CUDA_MEMCPY3D>());
};
