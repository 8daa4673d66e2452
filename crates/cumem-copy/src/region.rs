//! The sides of a 2D/3D copy: any memory cumem knows, seen as rows `pitch` elements apart (and, in
//! 3D, slices of `height` rows).
//!
//! Their rules are on [`Pitched`].

use std::ffi::c_void;

use cumem_core::{AsDeviceSlice, Context, DeviceSlice, DeviceSliceMut, HostMemory, Result, Stream};
use cumem_sys::sys::CUdeviceptr;

use crate::extent::Geometry;

/// Memory seen as rows `pitch` elements apart and, for 3D copies, slices `height` rows apart.
///
/// [`Pitched`] wraps the memory: pageable slices (`&[T]`, `&mut [T]`, blocking copies only),
/// page-locked host kinds (`&PinnedBuffer`, `&mut MappedBuffer`, `&mut HostRegistered`, … through
/// [`HostMemory`]), and device views ([`DeviceSlice`], [`DeviceSliceMut`], which also cover mapped
/// and managed memory). [`PitchedBuffer`](crate::PitchedBuffer) hands out its own. Each side orders
/// the copy like a 1D copy of the same memory would: device views through their stream order,
/// host kinds through their pending-work tracker. A queued copy
/// ([`StreamCopy::copy_2d`](crate::StreamCopy::copy_2d)) takes only sides that implement
/// [`QueuedSrc`]/[`QueuedDst`]: not pageable slices. The extents a side is checked against, and
/// what is refused, are listed on [`Copy2D`](crate::Copy2D).
///
/// ```
/// # cumem_sys::testing::init();
/// use cumem_copy::{copy_2d, Copy2D, Pitched};
/// use cumem_core::{DeviceBuffer, Device, Stream};
/// let stream = Stream::new(&Device::get(0)?.context()?)?;
/// let image: Vec<u16> = (0..6 * 4).collect();            // 4 rows of 6
/// let mut dev = DeviceBuffer::<u16>::zeroed(&stream, 4 * 8)?; // 4 rows of pitch 8
/// copy_2d(&Pitched::new(&image[..], 6), &mut Pitched::new(dev.as_mut_slice(), 8), Copy2D::new(6, 4))?;
/// assert_eq!(dev.to_vec()?[8..16], [6, 7, 8, 9, 10, 11, 0, 0]);
/// # Ok::<(), cumem_core::Error>(())
/// ```
#[derive(Debug)]
pub struct Pitched<M> {
    mem: M,
    pitch: usize,
    width: Option<usize>,
    height: Option<usize>,
}

impl<M> Pitched<M> {
    /// `mem` as rows of `pitch` elements (the row stride; at least the width of any row copied).
    /// A zero pitch is refused by a non-empty copy (`ZeroSize { what: "pitch" }`), not here.
    pub fn new(mem: M, pitch: usize) -> Self {
        Pitched { mem, pitch, width: None, height: None }
    }

    /// Limits rows to their first `width` elements (the rest of the pitch is padding that copies
    /// must not touch); by default a row is the whole pitch.
    pub fn with_width(self, width: usize) -> Self {
        Pitched { width: Some(width), ..self }
    }

    /// Sets the rows per slice, for 3D copies.
    pub fn with_height(self, height: usize) -> Self {
        Pitched { height: Some(height), ..self }
    }

    /// The row pitch in elements.
    pub fn pitch(&self) -> usize {
        self.pitch
    }

    /// The usable elements of each row, when limited.
    pub fn width(&self) -> Option<usize> {
        self.width
    }

    /// The rows per slice, when set.
    pub fn height(&self) -> Option<usize> {
        self.height
    }

    /// The wrapped memory.
    pub fn into_inner(self) -> M {
        self.mem
    }
}

/// Where one side of a copy is, for the driver.
#[derive(Debug, Clone, Copy)]
pub enum Mem {
    /// A host address (pageable or page-locked).
    Host(*mut c_void),
    /// A device (or mapped or managed) address.
    Device(CUdeviceptr),
}

pub(crate) mod sealed {
    use super::*;

    /// What the copy engine needs from a side it reads.
    pub trait Src<T> {
        /// The memory's shape.
        fn geometry(&self) -> Geometry;
        /// The context of device memory (`None` for host memory).
        fn device_context(&self) -> Option<&Context>;
        /// Orders a read of the memory on `stream` and runs `f`, which queues it.
        ///
        /// # Safety
        /// 1. `f` queues work on `stream` only, reading only inside the geometry.
        /// 2. Host memory (`Mem::Host`) of pageable sides may only be used by blocking copies
        ///    (the queued entry points take only sides that implement the sealed [`Queued`]).
        unsafe fn with_read<R>(&self, stream: &Stream, f: impl FnOnce(Mem) -> Result<R>) -> Result<R>;
    }

    /// What the copy engine needs from a side it writes.
    pub trait Dst<T> {
        /// The memory's shape.
        fn geometry(&self) -> Geometry;
        /// The context of device memory (`None` for host memory).
        fn device_context(&self) -> Option<&Context>;
        /// Orders a write of the memory on `stream` and runs `f`, which queues it.
        ///
        /// # Safety
        /// 1. `f` queues work on `stream` only, writing only valid values of `T` inside the geometry.
        /// 2. As item 2 of [`Src::with_read`].
        unsafe fn with_write<R>(&mut self, stream: &Stream, f: impl FnOnce(Mem) -> Result<R>) -> Result<R>;
    }

    /// The seal of [`QueuedSrc`](super::QueuedSrc) and [`QueuedDst`](super::QueuedDst): a side
    /// whose memory stays valid and ordered while a queued copy uses it. Only this crate can
    /// implement it, so that no other crate can let pageable memory (`&[T]`, `&mut [T]`, which
    /// may be managed memory the queued copy would race with) into a queued copy.
    pub trait Queued<T> {}
}

/// A side a 2D/3D copy can read: a [`Pitched`] wrapper of a slice, a host kind or a device view.
pub trait CopySrc<T>: sealed::Src<T> {}

/// A side a 2D/3D copy can write.
pub trait CopyDst<T>: sealed::Dst<T> {}

/// A readable side that stays valid while a queued copy uses it (not pageable memory).
///
/// Sealed: implemented by this crate for [`Pitched`] host kinds and device views only. A queued
/// copy skips the waits a blocking copy makes for pageable (possibly managed) memory, so another
/// crate may not add a side, not even for its own element type:
///
/// ```compile_fail,E0277
/// use cumem_copy::{CopySrc, Pitched, QueuedSrc};
/// struct Px(u32);
/// impl<'a> QueuedSrc<Px> for Pitched<&'a [Px]> {} // refused: `sealed::Queued` is private
/// ```
pub trait QueuedSrc<T>: CopySrc<T> + sealed::Queued<T> {}

/// A writable side that stays valid while a queued copy uses it (not pageable memory).
///
/// Sealed, as [`QueuedSrc`]:
///
/// ```compile_fail,E0277
/// use cumem_copy::{CopyDst, Pitched, QueuedDst};
/// struct Px(u32);
/// impl<'a> QueuedDst<Px> for Pitched<&'a mut [Px]> {} // refused: `sealed::Queued` is private
/// ```
pub trait QueuedDst<T>: CopyDst<T> + sealed::Queued<T> {}

fn geometry<M>(p: &Pitched<M>, len: usize) -> Geometry {
    Geometry { len, pitch: p.pitch, width: p.width.map_or(p.pitch, |w| w.min(p.pitch)), height: p.height }
}

// Pageable host slices: blocking copies only (the driver finishes with them before returning).

impl<T> sealed::Src<T> for Pitched<&[T]> {
    fn geometry(&self) -> Geometry {
        geometry(self, self.mem.len())
    }
    fn device_context(&self) -> Option<&Context> {
        None
    }
    unsafe fn with_read<R>(&self, _stream: &Stream, f: impl FnOnce(Mem) -> Result<R>) -> Result<R> {
        f(Mem::Host(self.mem.as_ptr().cast_mut().cast()))
    }
}
impl<T> CopySrc<T> for Pitched<&[T]> {}

impl<T> sealed::Src<T> for Pitched<&mut [T]> {
    fn geometry(&self) -> Geometry {
        geometry(self, self.mem.len())
    }
    fn device_context(&self) -> Option<&Context> {
        None
    }
    unsafe fn with_read<R>(&self, _stream: &Stream, f: impl FnOnce(Mem) -> Result<R>) -> Result<R> {
        f(Mem::Host(self.mem.as_ptr().cast_mut().cast()))
    }
}
impl<T> CopySrc<T> for Pitched<&mut [T]> {}

impl<T> sealed::Dst<T> for Pitched<&mut [T]> {
    fn geometry(&self) -> Geometry {
        geometry(self, self.mem.len())
    }
    fn device_context(&self) -> Option<&Context> {
        None
    }
    unsafe fn with_write<R>(&mut self, _stream: &Stream, f: impl FnOnce(Mem) -> Result<R>) -> Result<R> {
        f(Mem::Host(self.mem.as_mut_ptr().cast()))
    }
}
impl<T> CopyDst<T> for Pitched<&mut [T]> {}

// Page-locked host kinds: their trackers make host access wait for the queued copy.

impl<T, H: HostMemory<T>> sealed::Src<T> for Pitched<&H> {
    fn geometry(&self) -> Geometry {
        geometry(self, self.mem.len())
    }
    fn device_context(&self) -> Option<&Context> {
        None
    }
    unsafe fn with_read<R>(&self, stream: &Stream, f: impl FnOnce(Mem) -> Result<R>) -> Result<R> {
        // SAFETY: the caller's item 1: `f` queues work on `stream` reading inside the geometry,
        // which lies inside the `len` values the pointer names.
        unsafe { self.mem.device_read(stream, |p, _| f(Mem::Host(p.cast_mut().cast()))) }
    }
}
impl<T, H: HostMemory<T>> CopySrc<T> for Pitched<&H> {}
impl<T, H: HostMemory<T>> sealed::Queued<T> for Pitched<&H> {}
impl<T, H: HostMemory<T>> QueuedSrc<T> for Pitched<&H> {}

impl<T, H: HostMemory<T>> sealed::Src<T> for Pitched<&mut H> {
    fn geometry(&self) -> Geometry {
        geometry(self, self.mem.len())
    }
    fn device_context(&self) -> Option<&Context> {
        None
    }
    unsafe fn with_read<R>(&self, stream: &Stream, f: impl FnOnce(Mem) -> Result<R>) -> Result<R> {
        // SAFETY: as for `Pitched<&H>`.
        unsafe { self.mem.device_read(stream, |p, _| f(Mem::Host(p.cast_mut().cast()))) }
    }
}
impl<T, H: HostMemory<T>> CopySrc<T> for Pitched<&mut H> {}
impl<T, H: HostMemory<T>> sealed::Queued<T> for Pitched<&mut H> {}
impl<T, H: HostMemory<T>> QueuedSrc<T> for Pitched<&mut H> {}

impl<T, H: HostMemory<T>> sealed::Dst<T> for Pitched<&mut H> {
    fn geometry(&self) -> Geometry {
        geometry(self, self.mem.len())
    }
    fn device_context(&self) -> Option<&Context> {
        None
    }
    unsafe fn with_write<R>(&mut self, stream: &Stream, f: impl FnOnce(Mem) -> Result<R>) -> Result<R> {
        // SAFETY: the caller's item 1: `f` queues work on `stream` writing valid `T`s inside the
        // geometry, which lies inside the `len` values the pointer names.
        unsafe { self.mem.device_write(stream, |p, _| f(Mem::Host(p.cast()))) }
    }
}
impl<T, H: HostMemory<T>> CopyDst<T> for Pitched<&mut H> {}
impl<T, H: HostMemory<T>> QueuedDst<T> for Pitched<&mut H> {}

// Device views: ordered through the owning memory's stream order.

/// Both device views are sources in the same way.
macro_rules! device_source {
    ($view:ident) => {
        impl<T> sealed::Src<T> for Pitched<$view<'_, T>> {
            fn geometry(&self) -> Geometry {
                geometry(self, self.mem.len())
            }
            fn device_context(&self) -> Option<&Context> {
                Some(self.mem.context())
            }
            unsafe fn with_read<R>(&self, stream: &Stream, f: impl FnOnce(Mem) -> Result<R>) -> Result<R> {
                let on = self.mem.as_device_slice().on(stream)?;
                f(Mem::Device(on.device_ptr()))
            }
        }
        impl<T> CopySrc<T> for Pitched<$view<'_, T>> {}
        impl<T> sealed::Queued<T> for Pitched<$view<'_, T>> {}
        impl<T> QueuedSrc<T> for Pitched<$view<'_, T>> {}
    };
}

device_source!(DeviceSlice);
device_source!(DeviceSliceMut);

impl<T> sealed::Dst<T> for Pitched<DeviceSliceMut<'_, T>> {
    fn geometry(&self) -> Geometry {
        geometry(self, self.mem.len())
    }
    fn device_context(&self) -> Option<&Context> {
        Some(self.mem.context())
    }
    unsafe fn with_write<R>(&mut self, stream: &Stream, f: impl FnOnce(Mem) -> Result<R>) -> Result<R> {
        let on = self.mem.on(stream)?;
        f(Mem::Device(on.device_ptr()))
    }
}
impl<T> CopyDst<T> for Pitched<DeviceSliceMut<'_, T>> {}
impl<T> QueuedDst<T> for Pitched<DeviceSliceMut<'_, T>> {}

impl<T> Pitched<DeviceSliceMut<'_, T>> {
    /// The device view, for memsets.
    pub(crate) fn view_mut(&mut self) -> DeviceSliceMut<'_, T> {
        self.mem.reborrow()
    }
}
