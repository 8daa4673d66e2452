//! Owning buffer types and views.

pub(crate) mod device;
pub(crate) mod pinned;
pub(crate) mod view;
