//! The driver's stream-ordered memory pools (`cuMemPool*`), as a safe typed API.
//!
//! Every device has a default pool, and programs can create more. A pool reserves device memory
//! in large chunks and hands out allocations in stream order: memory freed on a stream is reused at
//! once by later work on that stream, and by other streams only once ordered after the free. The
//! pool keeps up to its release threshold of unused memory across synchronisations and returns the
//! rest to the device. [`NativePoolResource`](crate::NativePoolResource) makes a pool a
//! [`DeviceResource`](cumem_core::DeviceResource) that any buffer can allocate from.
//!
//! A [`MemPool`] is a shared handle: clones name the same pool, and a pool created here is
//! destroyed when its last handle is dropped. The device's *current* pool (the one
//! `cuMemAllocAsync` uses) is process-wide state, so a pool that cumem made current is also held
//! by cumem until another pool is made current on its device, and [`MemPool::current`] returns
//! an owning handle: no handle ever names a destroyed pool.
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

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use cumem_core::sys::{CUdevice, CUmemPool_attribute as Attr, CUmemoryPool};
use cumem_core::{Context, Error, ErrorContext, Feature, Result};
use parking_lot::Mutex;

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
    /// Upper bound on the memory the pool may reserve (`None`: the device's memory), rounded up
    /// by the driver to a multiple of 32 MiB: the pool reserves device memory in 32 MiB chunks,
    /// so a 4 MiB limit still holds 3 + 3 MiB (or one 20 MiB buffer) in one 32 MiB chunk, and a
    /// 40 MiB limit holds 30 + 30 MiB in 64 MiB (observed on an H100, 2026-11-23; the simulator
    /// rounds the same way, but does not pack an allocation across chunks as the H100 does, so a
    /// limited pool may run out earlier there). To cap a pool at an exact size, use a multiple of
    /// 32 MiB. `Some(0)` is refused ([`Error::ZeroSize`]): the driver reads a zero limit as "no
    /// limit", which is what `None` says.
    pub max_size: Option<usize>,
    /// Bytes of unused memory to keep across synchronisations (0 returns everything).
    pub release_threshold: u64,
}

/// A stream-ordered memory pool of one device: a shared handle.
///
/// Clones name the same pool. A pool from [`create`](Self::create) is destroyed when its last
/// handle is dropped, and not before: while it is the device's current pool by
/// [`make_current`](Self::make_current), cumem holds a handle too. The device's default pool is
/// never destroyed.
#[derive(Clone)]
pub struct MemPool {
    inner: Arc<PoolHandle>,
}

/// The pool itself; destroyed (if created by cumem) when the last [`MemPool`] lets go of it.
struct PoolHandle {
    ctx: Context,
    raw: RawPool,
    /// Created by [`MemPool::create`] (destroyed on drop); `false` for the device's default pool.
    owned: bool,
}

struct RawPool(CUmemoryPool);

// SAFETY: a CUmemoryPool is an opaque handle the driver lets any thread use; it is never dereferenced.
unsafe impl Send for RawPool {}
// SAFETY: as above; the driver synchronises its own use of the handle.
unsafe impl Sync for RawPool {}

/// The pools cumem made current, by device: each is kept alive while it is current, so that the
/// handle [`MemPool::current`] returns for it owns a live pool. An entry is replaced (and the pool
/// it held released) by the next [`MemPool::make_current`] on that device; the device's default
/// pool is never destroyed and needs no entry. The lock also orders `cuDeviceSetMemPool` against
/// `cuDeviceGetMemPool` in [`MemPool::current`], so the two agree on which pool is current.
static MADE_CURRENT: Mutex<BTreeMap<CUdevice, MemPool>> = Mutex::new(BTreeMap::new());

impl MemPool {
    fn check_supported(ctx: &Context) -> Result<()> {
        ctx.device().capabilities()?.require(Feature::MemoryPools)
    }

    fn from_raw(ctx: &Context, raw: CUmemoryPool, owned: bool) -> MemPool {
        MemPool { inner: Arc::new(PoolHandle { ctx: ctx.clone(), raw: RawPool(raw), owned }) }
    }

    /// The device's default pool (used by `cuMemAllocAsync` unless another pool is current).
    pub fn default_pool(ctx: &Context) -> Result<MemPool> {
        Self::check_supported(ctx)?;
        let raw = ffi::default_mem_pool(ctx.device().raw())?;
        Ok(Self::from_raw(ctx, raw, false))
    }

    /// The device's current pool, as a handle that keeps it alive.
    ///
    /// That is the default pool, or the pool last made current with
    /// [`make_current`](Self::make_current). A pool made current by code outside cumem (a direct
    /// `cuDeviceSetMemPool`) could be destroyed behind cumem's back, so it is not handed out:
    /// that gives [`Error::NotFound`].
    pub fn current(ctx: &Context) -> Result<MemPool> {
        Self::check_supported(ctx)?;
        let dev = ctx.device().raw();
        {
            let made_current = MADE_CURRENT.lock();
            let raw = ffi::current_mem_pool(dev)?;
            if let Some(pool) = made_current.get(&dev).filter(|p| p.raw() == raw) {
                return Ok(pool.clone());
            }
            // The default pool is never destroyed, so a plain handle to it stays valid.
            let default = ffi::default_mem_pool(dev)?;
            if raw == default {
                return Ok(Self::from_raw(ctx, default, false));
            }
        }
        Err(Error::NotFound {
            ctx: ErrorContext::op("MemPool::current (a pool made current outside cumem)").device(dev),
        })
    }

    /// A new pool on `ctx`'s device, destroyed when its last handle is dropped.
    ///
    /// # Errors
    /// [`Error::ZeroSize`] for `max_size: Some(0)`; [`Error::NotSupported`] on a device without
    /// memory pools; the driver's error when it cannot create the pool.
    pub fn create(ctx: &Context, options: MemPoolOptions) -> Result<MemPool> {
        if options.max_size == Some(0) {
            return Err(Error::ZeroSize { what: "memory pool size limit (max_size)" });
        }
        Self::check_supported(ctx)?;
        let raw = ffi::mem_pool_create(ctx.device().raw(), options.max_size.unwrap_or(0))?;
        let pool = Self::from_raw(ctx, raw, true);
        if options.release_threshold != 0 {
            pool.set_release_threshold(options.release_threshold)?;
        }
        Ok(pool)
    }

    /// The driver's handle; valid while this handle (or a clone) lives.
    pub fn raw(&self) -> CUmemoryPool {
        self.inner.raw.0
    }

    /// The context of the pool's device.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Makes this pool the one `cuMemAllocAsync` uses on its device.
    ///
    /// cumem holds the pool until another pool is made current on the device, so it stays alive
    /// while it is current even if every other handle is dropped; making the default pool current
    /// (`MemPool::default_pool(ctx)?.make_current()`) lets go of it. The pool this replaces as
    /// current is destroyed if nothing else holds it. A pool still current at process exit is
    /// never destroyed (the simulator's leak check reports it), so programs that make a pool
    /// current make the default pool current again when done.
    pub fn make_current(&self) -> Result<()> {
        let dev = self.context().device().raw();
        let mut made_current = MADE_CURRENT.lock();
        ffi::set_current_mem_pool(dev, self.raw())?;
        let replaced =
            if self.inner.owned { made_current.insert(dev, self.clone()) } else { made_current.remove(&dev) };
        drop(made_current);
        // Destroyed here, if this was its last handle, outside the lock.
        drop(replaced);
        Ok(())
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
            .field("device", &self.context().device().ordinal())
            .field("raw", &self.raw())
            .field("owned", &self.inner.owned)
            .finish()
    }
}

impl Drop for PoolHandle {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: this pool was created by `MemPool::create` and this is the last handle to it, so
        // no cumem value names it afterwards: not a `MemPool` (all dropped), not the registry of
        // current pools (which holds a handle while cumem keeps it current). Allocations from it
        // hold an `Arc` of the resource that owns a handle, so none is outstanding through cumem;
        // if foreign code made it current, the driver makes the default pool current again.
        if let Err(e) = unsafe { ffi::mem_pool_destroy(self.raw.0) } {
            tracing::warn!(error = %e, "destroying a memory pool failed");
        }
    }
}
