//! Peer access held by a guard: [`PeerAccess::enable`] lets one context access another's memory
//! (one direction) for as long as a guard lives.
//!
//! Guards for the same (context, peer context) pair share one enablement, counted in a
//! process-wide registry: the first guard enables, the last one to drop disables, and enabling a
//! pair that is already enabled is not an error. A pair that was already enabled outside cumem
//! (the driver answers `PEER_ACCESS_ALREADY_ENABLED`) is adopted and never disabled by cumem; its
//! outside owner stays free to disable it, even while guards live, so a guard for an adopted pair
//! does not promise the access lasts (and [`PeerAccess::is_enabled`] may then be stale). When
//! the last guard's disable fails, the pair stays registered as cumem's, and the next guard's
//! last drop tries again; when it fails because the pair is not enabled (someone disabled it
//! outside cumem while guards lived), the pair is forgotten, and the next guard enables it again.
//! A pair the driver cannot link is refused before anything is enabled: the devices are asked
//! first (`cuDeviceCanAccessPeer`), and a pair with no link is `NotSupported { feature:
//! PeerAccess, device }`, as `cumem-vmm` answers for memory a device cannot reach; two contexts
//! of one device are `PeerAccessUnsupported`, the driver's own answer (measured, driver-api.md
//! §11), given without calling it.
//!
//! The adoption (`debug`), a failed disable and a pair found disabled outside cumem (`warn`) are
//! logged with the registry's lock let go, so a tracing subscriber may call [`PeerAccess::is_enabled`] on them.
//!
//! Peer copies do not need enabled access (the driver copies between devices either way); it is
//! what lets device code on one device dereference another device's pointers. The last guard's
//! drop disables access at once, without waiting for kernels already queued: keep a guard alive
//! until every kernel that dereferences peer pointers has completed (synchronise its stream
//! first), or such a kernel faults. Launching it is `unsafe` for that reason among others.
//!
//! ```
//! # cumem_sys::testing::init_with("devices=2");
//! use cumem_core::Device;
//! use cumem_peer::PeerAccess;
//! let (a, b) = (Device::get(0)?.context()?, Device::get(1)?.context()?);
//! let first = PeerAccess::enable(&a, &b)?;
//! let second = PeerAccess::enable(&a, &b)?; // already enabled: fine
//! assert!(PeerAccess::is_enabled(&a, &b));
//! drop((first, second));
//! assert!(!PeerAccess::is_enabled(&a, &b));
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::collections::HashMap;
use std::fmt;

use cumem_core::{Context, Error, ErrorContext, Feature, Result};
use parking_lot::Mutex;

use crate::ffi;

/// One enabled pair: how many guards hold it, and whether cumem enabled it (and so disables it).
struct Held {
    guards: usize,
    owned: bool,
    /// The pair's contexts, kept while the entry lives (past the last guard when its disable
    /// failed): the key is their handles, which must not be released and reused by another
    /// context meanwhile, or a guard for that one would join this stale entry without enabling.
    /// (`Device::context` keeps primary contexts retained anyway; this does not rely on it.)
    _contexts: (Context, Context),
}

/// Enabled pairs by (accessing context, peer context) handle.
static REGISTRY: Mutex<Option<HashMap<(usize, usize), Held>>> = Mutex::new(None);

fn key(from: &Context, to: &Context) -> (usize, usize) {
    (from.raw() as usize, to.raw() as usize)
}

/// Access from one context to another's memory, enabled while the guard lives.
#[must_use = "peer access is disabled again when the guard is dropped"]
pub struct PeerAccess {
    from: Context,
    to: Context,
}

impl PeerAccess {
    /// Lets `from` access `to`'s memory (`cuCtxEnablePeerAccess` from `from`), or joins the
    /// enablement another guard already holds.
    ///
    /// Refused before anything is enabled: `NotSupported { feature: PeerAccess, device: from's }`
    /// when `from`'s device cannot access `to`'s (`cuDeviceCanAccessPeer`), and
    /// `PeerAccessUnsupported` when both contexts are of one device (what the driver answers).
    pub fn enable(from: &Context, to: &Context) -> Result<PeerAccess> {
        let (dev, peer) = (from.device(), to.device());
        if dev == peer {
            // The driver's answer (measured: driver-api.md §11, §17), for the context itself and
            // another context of its device alike; decided here, so nothing is called to learn it.
            return Err(Error::PeerAccessUnsupported {
                ctx: ErrorContext::op("cuCtxEnablePeerAccess").device(dev.raw()),
            });
        }
        if !dev.can_access_peer(peer)? {
            return Err(Error::NotSupported { feature: Feature::PeerAccess, device: Some(dev.raw()) });
        }
        let adopted = {
            // The driver call stays under the lock: it is what keeps two threads enabling one
            // pair from both calling the driver (the second would see "already enabled" and adopt
            // cumem's own enablement, never to disable it). Nothing is logged under it: a
            // subscriber may call back into the registry (`is_enabled`), which would deadlock.
            // Unmeasured: whether the driver call can wait for other streams' host functions, as
            // `cuMemFree` does (driver-api.md §17). If it can, a held stream holds up every guard's
            // enable, drop and `is_enabled` in the process while it waits, and a host function
            // that touches the registry deadlocks (docs/multi-gpu.md, "To verify on a GPU").
            let mut registry = REGISTRY.lock();
            let pairs = registry.get_or_insert_with(HashMap::new);
            if let Some(held) = pairs.get_mut(&key(from, to)) {
                held.guards += 1;
                false
            } else {
                from.bind()?;
                let owned = match ffi::enable_peer_access(to.raw()) {
                    Ok(()) => true,
                    Err(Error::PeerAccessAlreadyEnabled { .. }) => false,
                    Err(e) => return Err(e),
                };
                pairs.insert(key(from, to), Held { guards: 1, owned, _contexts: (from.clone(), to.clone()) });
                !owned
            }
        };
        // Built before the event: a subscriber that panics on it drops the guard, whose `Drop`
        // takes back the registry entry counted above instead of leaving it counted forever.
        let guard = PeerAccess { from: from.clone(), to: to.clone() };
        if adopted {
            tracing::debug!(
                from = from.device().ordinal(),
                to = to.device().ordinal(),
                "peer access was already enabled outside cumem; adopted, never disabled by cumem"
            );
        }
        Ok(guard)
    }

    /// Whether cumem holds access from `from` to `to` enabled: a guard lives, or the last guard's
    /// disable failed and the pair is still enabled (the next guard's last drop retries).
    ///
    /// For a pair adopted from outside cumem this is cumem's view only: its outside owner may
    /// disable it while guards live, and then this still says `true`.
    pub fn is_enabled(from: &Context, to: &Context) -> bool {
        REGISTRY.lock().as_ref().is_some_and(|pairs| pairs.contains_key(&key(from, to)))
    }

    /// The context that may access the other's memory.
    pub fn from(&self) -> &Context {
        &self.from
    }

    /// The context whose memory is accessed.
    pub fn to(&self) -> &Context {
        &self.to
    }
}

impl Drop for PeerAccess {
    fn drop(&mut self) {
        // Decided under the lock, logged and dropped after it: a subscriber may call back into the
        // registry, and the removed entry's contexts may call the driver (and log) as they go.
        let (removed, failed, gone_already) = {
            let mut registry = REGISTRY.lock();
            let Some(pairs) = registry.as_mut() else { return };
            let k = key(&self.from, &self.to);
            let Some(held) = pairs.get_mut(&k) else { return };
            held.guards -= 1;
            if held.guards > 0 {
                return;
            }
            if !held.owned {
                (pairs.remove(&k), None, false)
            } else {
                // The disable stays under the lock, so that a guard enabling the pair meanwhile
                // either joins this entry before it or enables afresh after it, never racing it.
                // The entry goes only once the driver has disabled the pair: a pair whose disable
                // failed is still enabled, and still cumem's, so the next guard joins it (rather
                // than adopting it as enabled elsewhere, never to disable it) and its last drop
                // tries again. A pair the driver says is not enabled was disabled outside cumem (a
                // raw `cuCtxDisablePeerAccess`): that is the state this drop wants, so the entry
                // goes too, or it would say `is_enabled` forever and no later guard would enable
                // again. Whether the disable can wait for host functions is unmeasured, as for the
                // enable in `PeerAccess::enable`.
                match self.from.bind().and_then(|()| ffi::disable_peer_access(self.to.raw())) {
                    Ok(()) => (pairs.remove(&k), None, false),
                    Err(Error::PeerAccessNotEnabled { .. }) => (pairs.remove(&k), None, true),
                    Err(e) => (None, Some(e), false),
                }
            }
        };
        if gone_already {
            tracing::warn!(
                from = self.from.device().ordinal(),
                to = self.to.device().ordinal(),
                "peer access held by cumem was disabled outside cumem while guards lived; forgotten"
            );
        }
        if let Some(e) = failed {
            tracing::warn!(
                from = self.from.device().ordinal(),
                to = self.to.device().ordinal(),
                error = %e,
                "disabling peer access failed; the pair stays enabled, and the next guard's last drop retries"
            );
        }
        drop(removed);
    }
}

impl fmt::Debug for PeerAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerAccess")
            .field("from", &self.from.device().ordinal())
            .field("to", &self.to.device().ordinal())
            .finish()
    }
}
