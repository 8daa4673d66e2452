//! The driver's stream-ordered memory pools (`cuMemPool*`), as a safe typed API.
//!
//! Every device has a default pool, and programs can create more. A pool reserves device memory
//! in large chunks and hands out allocations in stream order: memory freed on a stream is reused at
//! once by later work on that stream, and by other streams only once ordered after the free. The
//! pool keeps up to its release threshold of unused memory across synchronisations and returns the
//! rest to the device. [`NativePoolResource`](crate::NativePoolResource) makes a pool a
//! [`DeviceResource`](cumem_core::DeviceResource) that any buffer can allocate from.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::Device;
//! use cumem_pool::{MemPool, MemPoolOptions, ReusePolicy};
//! let ctx = Device::get(0)?.context()?;
//! let pool = MemPool::create(&ctx, MemPoolOptions { max_size: Some(256 << 20), release_threshold: 64 << 20 })?;
//! assert_eq!(pool.release_threshold()?, 64 << 20);
//! pool.set_reuse_policy(ReusePolicy { allow_opportunistic: false, ..ReusePolicy::default() })?;
//! assert!(!pool.reuse_policy()?.allow_opportunistic);
//! assert_eq!(pool.usage()?.used_current, 0);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;

use cumem_core::sys::{CUmemPool_attribute as Attr, CUmemoryPool};
use cumem_core::{Context, Feature, Result};

use crate::ffi;

/// How a pool may reuse memory freed on one stream for allocations on another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReusePolicy {
    /// Reuse when the allocating stream already depends on the free (an event or stream wait).
    pub follow_event_dependencies: bool,
    /// Reuse memory whose free has already completed, with no dependency.
    pub allow_opportunistic: bool,
    /// Let the driver insert a wait on the freeing stream to reuse its memory.
    pub allow_internal_dependencies: bool,
}

impl Default for ReusePolicy {
    /// The driver's defaults: everything allowed.
    fn default() -> Self {
        ReusePolicy {
            follow_event_dependencies: true,
            allow_opportunistic: true,
            allow_internal_dependencies: true,
        }
    }
}

/// A pool's memory accounting, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolUsage {
    /// Device memory the pool holds now.
    pub reserved_current: u64,
    /// The most it has held since the last reset.
    pub reserved_high: u64,
    /// Memory in live allocations now.
    pub used_current: u64,
    /// The most in live allocations since the last reset.
    pub used_high: u64,
}

/// Options for [`MemPool::create`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemPoolOptions {
    /// Upper bound on the memory the pool may reserve (`None`: the device's memory).
    pub max_size: Option<usize>,
    /// Bytes of unused memory to keep across synchronisations (0 returns everything).
    pub release_threshold: u64,
}

/// A stream-ordered memory pool of one device.
pub struct MemPool {
    ctx: Context,
    raw: RawPool,
    owned: bool,
}

struct RawPool(CUmemoryPool);

// SAFETY: a CUmemoryPool is an opaque handle the driver lets any thread use; it is never dereferenced.
unsafe impl Send for RawPool {}
// SAFETY: as above; the driver synchronises its own use of the handle.
unsafe impl Sync for RawPool {}

impl MemPool {
    fn check_supported(ctx: &Context) -> Result<()> {
        ctx.device().capabilities()?.require(Feature::MemoryPools)
    }

    /// The device's default pool (used by `cuMemAllocAsync` unless another pool is current).
    pub fn default_pool(ctx: &Context) -> Result<MemPool> {
        Self::check_supported(ctx)?;
        let raw = ffi::default_mem_pool(ctx.device().raw())?;
        Ok(MemPool { ctx: ctx.clone(), raw: RawPool(raw), owned: false })
    }

    /// The device's current pool.
    pub fn current(ctx: &Context) -> Result<MemPool> {
        Self::check_supported(ctx)?;
        let raw = ffi::current_mem_pool(ctx.device().raw())?;
        Ok(MemPool { ctx: ctx.clone(), raw: RawPool(raw), owned: false })
    }

    /// A new pool on `ctx`'s device, destroyed when dropped.
    pub fn create(ctx: &Context, options: MemPoolOptions) -> Result<MemPool> {
        Self::check_supported(ctx)?;
        let raw = ffi::mem_pool_create(ctx.device().raw(), options.max_size.unwrap_or(0))?;
        let pool = MemPool { ctx: ctx.clone(), raw: RawPool(raw), owned: true };
        if options.release_threshold != 0 {
            pool.set_release_threshold(options.release_threshold)?;
        }
        Ok(pool)
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUmemoryPool {
        self.raw.0
    }

    /// The context of the pool's device.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Makes this pool the one `cuMemAllocAsync` uses on its device.
    pub fn make_current(&self) -> Result<()> {
        ffi::set_current_mem_pool(self.ctx.device().raw(), self.raw())
    }

    /// Unused bytes the pool keeps across synchronisations.
    pub fn release_threshold(&self) -> Result<u64> {
        // SAFETY: RELEASE_THRESHOLD is a cuuint64_t attribute.
        unsafe { ffi::mem_pool_get::<u64>(self.raw(), Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) }
    }

    /// Sets the release threshold (`u64::MAX` keeps everything).
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        // SAFETY: RELEASE_THRESHOLD is a cuuint64_t attribute.
        unsafe { ffi::mem_pool_set::<u64>(self.raw(), Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, bytes) }
    }

    /// The three reuse flags.
    pub fn reuse_policy(&self) -> Result<ReusePolicy> {
        let flag = |attr| -> Result<bool> {
            // SAFETY: the reuse attributes are `int`s.
            Ok(unsafe { ffi::mem_pool_get::<i32>(self.raw(), attr) }? != 0)
        };
        Ok(ReusePolicy {
            follow_event_dependencies: flag(Attr::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES)?,
            allow_opportunistic: flag(Attr::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC)?,
            allow_internal_dependencies: flag(Attr::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES)?,
        })
    }

    /// Sets the three reuse flags.
    pub fn set_reuse_policy(&self, policy: ReusePolicy) -> Result<()> {
        let set = |attr, on: bool| {
            // SAFETY: the reuse attributes are `int`s.
            unsafe { ffi::mem_pool_set::<i32>(self.raw(), attr, i32::from(on)) }
        };
        set(Attr::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES, policy.follow_event_dependencies)?;
        set(Attr::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, policy.allow_opportunistic)?;
        set(Attr::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, policy.allow_internal_dependencies)
    }

    /// Reserved and used memory, current and high-water marks.
    pub fn usage(&self) -> Result<PoolUsage> {
        let get = |attr| {
            // SAFETY: the accounting attributes are cuuint64_t.
            unsafe { ffi::mem_pool_get::<u64>(self.raw(), attr) }
        };
        Ok(PoolUsage {
            reserved_current: get(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: get(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            used_current: get(Attr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: get(Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        })
    }

    /// Resets both high-water marks to the current values.
    pub fn reset_high_watermarks(&self) -> Result<()> {
        for attr in [Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH] {
            // SAFETY: the high marks are cuuint64_t, and 0 is the only value they accept (a reset).
            unsafe { ffi::mem_pool_set::<u64>(self.raw(), attr, 0)? };
        }
        Ok(())
    }

    /// Releases unused reserved memory until the pool holds less than `keep` bytes (or nothing
    /// more can be released).
    pub fn trim_to(&self, keep: usize) -> Result<()> {
        ffi::mem_pool_trim_to(self.raw(), keep)
    }
}

impl fmt::Debug for MemPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemPool")
            .field("device", &self.ctx.device().ordinal())
            .field("raw", &self.raw())
            .field("owned", &self.owned)
            .finish()
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: this pool was created by `create` and this is its only owner; allocations from it
        // hold an `Arc` of the resource that owns it, so none is outstanding.
        if let Err(e) = unsafe { ffi::mem_pool_destroy(self.raw()) } {
            tracing::warn!(error = %e, "destroying a memory pool failed");
        }
    }
}
