//! The simulated device's attribute profile.
//!
//! Every `CUdevice_attribute` value the cuda-12080 bindings know is answered from an H100-like
//! profile; configuration keys use the lower-case attribute name without the
//! `CU_DEVICE_ATTRIBUTE_` prefix, so a test can describe a device lacking a capability.
//!
//! A capability is advertised only when every entry point behind it is exported and modelled
//! (`tests/capabilities.rs` checks this against the built library): VMM is (1, as on the H100),
//! and pool handle types are POSIX_FD only (1; the H100 reports 9, POSIX_FD and FABRIC, but
//! fabric pools are not modelled); IPC events are 1, as on the H100 (`cuIpcGetEventHandle` and
//! `cuIpcOpenEventHandle` are modelled across processes). The H100 also reports RDMA, multicast,
//! stream memory operations, CUDA arrays, cooperative and cluster launches, texture gather,
//! access policy windows, memory synchronisation domains and unified function pointers, but the
//! simulator exports none of their calls (no stream attributes, textures, modules or launches),
//! so they are 0 here until the calls exist.

/// One past the largest attribute number (`CU_DEVICE_ATTRIBUTE_MAX` in CUDA 12.8).
pub(crate) const ATTRIBUTE_LIMIT: usize = 144;

/// `(number, configuration key, H100-like default)` for every attribute of CUDA 12.8.
pub(crate) const ATTRIBUTES: &[(u32, &str, i32)] = &[
    (1, "max_threads_per_block", 1024),
    (2, "max_block_dim_x", 1024),
    (3, "max_block_dim_y", 1024),
    (4, "max_block_dim_z", 64),
    (5, "max_grid_dim_x", 2147483647),
    (6, "max_grid_dim_y", 65535),
    (7, "max_grid_dim_z", 65535),
    (8, "max_shared_memory_per_block", 49152),
    (9, "total_constant_memory", 65536),
    (10, "warp_size", 32),
    (11, "max_pitch", 2147483647),
    (12, "max_registers_per_block", 65536),
    (13, "clock_rate", 1980000),
    (14, "texture_alignment", 512),
    (15, "gpu_overlap", 1),
    (16, "multiprocessor_count", 132),
    (17, "kernel_exec_timeout", 0),
    (18, "integrated", 0),
    (19, "can_map_host_memory", 1),
    (20, "compute_mode", 0),
    (21, "maximum_texture1d_width", 131072),
    (22, "maximum_texture2d_width", 131072),
    (23, "maximum_texture2d_height", 65536),
    (24, "maximum_texture3d_width", 16384),
    (25, "maximum_texture3d_height", 16384),
    (26, "maximum_texture3d_depth", 16384),
    (27, "maximum_texture2d_layered_width", 32768),
    (28, "maximum_texture2d_layered_height", 32768),
    (29, "maximum_texture2d_layered_layers", 2048),
    (30, "surface_alignment", 512),
    (31, "concurrent_kernels", 1),
    (32, "ecc_enabled", 1),
    (33, "pci_bus_id", 0),
    (34, "pci_device_id", 0),
    (35, "tcc_driver", 0),
    (36, "memory_clock_rate", 2619000),
    (37, "global_memory_bus_width", 5120),
    (38, "l2_cache_size", 52428800),
    (39, "max_threads_per_multiprocessor", 2048),
    (40, "async_engine_count", 3),
    (41, "unified_addressing", 1),
    (42, "maximum_texture1d_layered_width", 32768),
    (43, "maximum_texture1d_layered_layers", 2048),
    // No texture objects or references are exported (cuTexObjectCreate): not advertised.
    (44, "can_tex2d_gather", 0),
    (45, "maximum_texture2d_gather_width", 32768),
    (46, "maximum_texture2d_gather_height", 32768),
    (47, "maximum_texture3d_width_alternate", 8192),
    (48, "maximum_texture3d_height_alternate", 8192),
    (49, "maximum_texture3d_depth_alternate", 32768),
    (50, "pci_domain_id", 0),
    (51, "texture_pitch_alignment", 32),
    (52, "maximum_texturecubemap_width", 32768),
    (53, "maximum_texturecubemap_layered_width", 32768),
    (54, "maximum_texturecubemap_layered_layers", 2046),
    (55, "maximum_surface1d_width", 32768),
    (56, "maximum_surface2d_width", 131072),
    (57, "maximum_surface2d_height", 65536),
    (58, "maximum_surface3d_width", 16384),
    (59, "maximum_surface3d_height", 16384),
    (60, "maximum_surface3d_depth", 16384),
    (61, "maximum_surface1d_layered_width", 32768),
    (62, "maximum_surface1d_layered_layers", 2048),
    (63, "maximum_surface2d_layered_width", 32768),
    (64, "maximum_surface2d_layered_height", 32768),
    (65, "maximum_surface2d_layered_layers", 2048),
    (66, "maximum_surfacecubemap_width", 32768),
    (67, "maximum_surfacecubemap_layered_width", 32768),
    (68, "maximum_surfacecubemap_layered_layers", 2046),
    (69, "maximum_texture1d_linear_width", 268435456),
    (70, "maximum_texture2d_linear_width", 131072),
    (71, "maximum_texture2d_linear_height", 65000),
    (72, "maximum_texture2d_linear_pitch", 2097120),
    (73, "maximum_texture2d_mipmapped_width", 32768),
    (74, "maximum_texture2d_mipmapped_height", 32768),
    (75, "compute_capability_major", 9),
    (76, "compute_capability_minor", 0),
    (77, "maximum_texture1d_mipmapped_width", 32768),
    (78, "stream_priorities_supported", 1),
    (79, "global_l1_cache_supported", 1),
    (80, "local_l1_cache_supported", 1),
    (81, "max_shared_memory_per_multiprocessor", 233472),
    (82, "max_registers_per_multiprocessor", 65536),
    (83, "managed_memory", 1),
    (84, "multi_gpu_board", 0),
    (85, "multi_gpu_board_group_id", 0),
    (86, "host_native_atomic_supported", 0),
    (87, "single_to_double_precision_perf_ratio", 2),
    (88, "pageable_memory_access", 0),
    (89, "concurrent_managed_access", 1),
    (90, "compute_preemption_supported", 1),
    (91, "can_use_host_pointer_for_registered_mem", 1),
    (92, "can_use_stream_mem_ops_v1", 0),
    (93, "can_use_64_bit_stream_mem_ops_v1", 0),
    (94, "can_use_stream_wait_value_nor_v1", 0),
    (95, "cooperative_launch", 0),
    (96, "cooperative_multi_device_launch", 0),
    (97, "max_shared_memory_per_block_optin", 232448),
    (98, "can_flush_remote_writes", 0),
    (99, "host_register_supported", 1),
    (100, "pageable_memory_access_uses_host_page_tables", 0),
    (101, "direct_managed_mem_access_from_host", 0),
    (102, "virtual_address_management_supported", 1),
    (103, "handle_type_posix_file_descriptor_supported", 1),
    (104, "handle_type_win32_handle_supported", 0),
    (105, "handle_type_win32_kmt_handle_supported", 0),
    (106, "max_blocks_per_multiprocessor", 32),
    (107, "generic_compression_supported", 0),
    (108, "max_persisting_l2_cache_size", 51380224),
    // Access policy windows are set through cuStreamSetAttribute / cuLaunchKernelEx, neither of
    // which is exported: not advertised (the H100 reports 134213632).
    (109, "max_access_policy_window_size", 0),
    (110, "gpu_direct_rdma_with_cuda_vmm_supported", 0),
    (111, "reserved_shared_memory_per_block", 1024),
    (112, "sparse_cuda_array_supported", 0),
    (113, "read_only_host_register_supported", 1),
    (114, "timeline_semaphore_interop_supported", 0),
    (115, "memory_pools_supported", 1),
    (116, "gpu_direct_rdma_supported", 0),
    (117, "gpu_direct_rdma_flush_writes_options", 0),
    (118, "gpu_direct_rdma_writes_ordering", 0),
    (119, "mempool_supported_handle_types", 1),
    (120, "cluster_launch", 0),
    (121, "deferred_mapping_cuda_array_supported", 0),
    (122, "can_use_64_bit_stream_mem_ops", 0),
    (123, "can_use_stream_wait_value_nor", 0),
    (124, "dma_buf_supported", 0),
    (125, "ipc_event_supported", 1),
    // Memory synchronisation domains are chosen through launch or stream attributes
    // (cuLaunchKernelEx, cuStreamSetAttribute), neither exported: not advertised (the H100: 4).
    (126, "mem_sync_domain_count", 0),
    (127, "tensor_map_access_supported", 0),
    (128, "handle_type_fabric_supported", 0),
    // A property of kernel code; no module or launch call is exported: not advertised.
    (129, "unified_function_pointers", 0),
    (130, "numa_config", 0),
    (131, "numa_id", -1),
    (132, "multicast_supported", 0),
    (133, "mps_enabled", 0),
    (134, "host_numa_id", -1),
    (135, "d3d12_cig_supported", 0),
    (136, "mem_decompress_algorithm_mask", 0),
    (137, "mem_decompress_maximum_length", 0),
    (139, "gpu_pci_device_id", 9008),
    (140, "gpu_pci_subsystem_id", 5825),
    (143, "host_numa_multinode_ipc_supported", 0),
];

/// Numbers of the attributes whose default depends on the device ordinal.
pub(crate) const PCI_BUS_ID: u32 = 33;
/// Board group id: each simulated device is its own board.
pub(crate) const MULTI_GPU_BOARD_GROUP_ID: u32 = 85;
/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
pub(crate) const VMM: u32 = 102;

/// Looks an attribute up by its configuration key (accepting the bindings' alias name).
pub(crate) fn by_name(key: &str) -> Option<u32> {
    // `vmm=0` describes a device without virtual memory management.
    if key == "virtual_memory_management_supported" || key == "vmm" {
        return Some(102);
    }
    ATTRIBUTES.iter().find(|(_, name, _)| *name == key).map(|(n, _, _)| *n)
}

/// The default profile as a dense table indexed by attribute number; `None` marks numbers the
/// bindings do not define (those answer `CUDA_ERROR_INVALID_VALUE`).
pub(crate) fn default_table(ordinal: usize) -> Vec<Option<i32>> {
    let mut table = vec![None; ATTRIBUTE_LIMIT];
    for &(n, _, v) in ATTRIBUTES {
        table[n as usize] = Some(v);
    }
    table[PCI_BUS_ID as usize] = Some(0x18 + ordinal as i32);
    table[MULTI_GPU_BOARD_GROUP_ID as usize] = Some(ordinal as i32);
    table
}
