//! The view vocabulary every owner of device memory offers, written once.
//!
//! An owner (a `DeviceBuffer`, a `GrowableBuffer`, an imported buffer, …) has `as_slice` and
//! `as_mut_slice`; everything else a user does with its memory as a whole (sub-views, splits,
//! chunks, the door for device work, a copy back to the host) is that view's own method. They
//! are generated as inherent methods by [`device_view_methods!`](crate::device_view_methods),
//! not default methods of [`AsDeviceSlice`](crate::AsDeviceSlice): inherent methods need no
//! trait in scope, so every `buf.slice(..)` written against an owner keeps compiling whatever
//! the caller imported.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, DeviceBuffer, Stream};
//! let stream = Stream::new(&Device::get(0)?.context()?)?;
//! let mut buf = DeviceBuffer::from_slice(&stream, &[1u32, 2, 3, 4, 5])?;
//! let (head, _) = buf.split_at_mut(2)?;
//! assert_eq!(head.len(), 2);
//! assert_eq!(buf.slice(3..)?.to_vec()?, [4, 5]);
//! assert_eq!(buf.chunks(2)?.count(), 3);
//! # Ok::<(), cumem_core::Error>(())
//! ```

/// Adds the view vocabulary to an owner of device memory: `on`, `on_mut`, `slice`,
/// `slice_mut`, `split_at`, `split_at_mut`, `chunks`, `chunks_mut` and `to_vec`, each the same
/// method of the owner's whole view. Invoke it inside an `impl<T> Owner<T>` block whose type has
/// `fn as_slice(&self) -> DeviceSlice<'_, T>` and `fn as_mut_slice(&mut self) -> DeviceSliceMut<'_,
/// T>`. For crates that add memory kinds; not part of the stable interface.
#[doc(hidden)]
#[macro_export]
macro_rules! device_view_methods {
    () => {
        /// The whole memory on `stream`, for device work that only reads it and that cumem does
        /// not queue itself; see `DeviceSlice::on`.
        pub fn on<'s>(&'s self, stream: &'s $crate::Stream) -> $crate::Result<$crate::OnStream<'s, T>> {
            self.as_slice().on(stream)
        }

        /// The whole memory on `stream`, for device work that writes it and that cumem does not
        /// queue itself; see `DeviceSliceMut::on`.
        pub fn on_mut<'s>(
            &'s mut self,
            stream: &'s $crate::Stream,
        ) -> $crate::Result<$crate::OnStreamMut<'s, T>> {
            self.as_mut_slice().into_on(stream)
        }

        /// A shared view of `range`.
        pub fn slice(
            &self,
            range: impl ::core::ops::RangeBounds<usize>,
        ) -> $crate::Result<$crate::DeviceSlice<'_, T>> {
            self.as_slice().slice(range)
        }

        /// An exclusive view of `range`.
        pub fn slice_mut(
            &mut self,
            range: impl ::core::ops::RangeBounds<usize>,
        ) -> $crate::Result<$crate::DeviceSliceMut<'_, T>> {
            self.as_mut_slice().into_slice_mut(range)
        }

        /// Shared views of `[0, mid)` and `[mid, len)`.
        pub fn split_at(
            &self,
            mid: usize,
        ) -> $crate::Result<($crate::DeviceSlice<'_, T>, $crate::DeviceSlice<'_, T>)> {
            self.as_slice().split_at(mid)
        }

        /// Exclusive views of `[0, mid)` and `[mid, len)`.
        pub fn split_at_mut(
            &mut self,
            mid: usize,
        ) -> $crate::Result<($crate::DeviceSliceMut<'_, T>, $crate::DeviceSliceMut<'_, T>)> {
            self.as_mut_slice().into_split_at_mut(mid)
        }

        /// Shared views of `chunk` elements each (the last may be shorter).
        pub fn chunks(&self, chunk: usize) -> $crate::Result<$crate::Chunks<'_, T>> {
            self.as_slice().chunks(chunk)
        }

        /// Exclusive views of `chunk` elements each (the last may be shorter).
        pub fn chunks_mut(&mut self, chunk: usize) -> $crate::Result<$crate::ChunksMut<'_, T>> {
            self.as_mut_slice().into_chunks_mut(chunk)
        }

        /// Copies the contents to a new `Vec`, after all work queued on the memory so far.
        pub fn to_vec(&self) -> $crate::Result<::std::vec::Vec<T>>
        where
            T: $crate::__private::AnyBitPattern,
        {
            self.as_slice().to_vec()
        }
    };
}
