//! Owning buffer types and views.

pub(crate) mod device;
pub(crate) mod host_span;
pub(crate) mod mapped;
pub(crate) mod owner_views;
pub(crate) mod pinned;
pub(crate) mod registered;
pub(crate) mod view;
