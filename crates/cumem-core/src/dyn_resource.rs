//! Turning an `Arc` of any resource into an `Arc<dyn DeviceResource>`, in generic code.
//!
//! The `_in` constructors take `&Arc<R>` for any `R: DeviceResource + ?Sized`, so that both a
//! concrete `Arc<CachingResource>` and an `Arc<dyn DeviceResource>` work as they are. A buffer keeps
//! an `Arc<dyn DeviceResource>`, and Rust cannot unsize an `Arc<R>` when `R` may itself be
//! unsized; [`IntoDynResource`], a supertrait of [`DeviceResource`] implemented for every sized
//! resource, does it through the resource's own vtable instead. Nobody implements it by hand.
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DeviceResource, DriverResource, IntoDynResource};
//! let driver = Arc::new(DriverResource::new(&Device::get(0)?.context()?));
//! let as_dyn = driver.clone().into_dyn_resource();
//! assert!(std::ptr::addr_eq(Arc::as_ptr(&as_dyn), Arc::as_ptr(&driver)));
//! // Already dynamic: the same allocation comes back.
//! let again = as_dyn.clone().into_dyn_resource();
//! assert!(Arc::ptr_eq(&again, &as_dyn));
//! assert!((*again).as_any().is::<DriverResource>());
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::any::Any;
use std::sync::Arc;

use crate::DeviceResource;

/// Conversions every [`DeviceResource`] has: into `Arc<dyn DeviceResource>`, and to [`Any`] for
/// downcasting a resource back to its type (e.g. the current resource to the caching pool).
///
/// Implemented for every sized `DeviceResource`; `dyn DeviceResource` has it through its vtable.
pub trait IntoDynResource {
    /// The same resource, as a trait object (the same allocation, only the pointer changes type).
    fn into_dyn_resource<'a>(self: Arc<Self>) -> Arc<dyn DeviceResource + 'a>
    where
        Self: 'a;

    /// The resource as [`Any`], to downcast a `dyn DeviceResource` to its concrete type. Call it as
    /// `(*arc).as_any()`, so that it applies to the resource, not to the `Arc`.
    fn as_any(&self) -> &(dyn Any + Send + Sync)
    where
        Self: 'static;

    /// The `Arc` as `Arc<dyn Any>`, to downcast it to an `Arc` of the concrete type.
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>
    where
        Self: 'static;
}

impl<T: DeviceResource> IntoDynResource for T {
    fn into_dyn_resource<'a>(self: Arc<Self>) -> Arc<dyn DeviceResource + 'a>
    where
        Self: 'a,
    {
        self
    }

    fn as_any(&self) -> &(dyn Any + Send + Sync)
    where
        Self: 'static,
    {
        self
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>
    where
        Self: 'static,
    {
        self
    }
}
