//! Typed parameters of 2D/3D copies and memsets ([`Copy2D`], [`Copy3D`], [`Rect2D`]), and the
//! checks that reject impossible ones (listed on [`Copy2D`]).

use cumem_core::{Error, Result};

/// A 2D copy: `width` elements of `height` rows, from `(src_x, src_y)` to `(dst_x, dst_y)`.
///
/// Extents and offsets are in elements (x) and rows (y), and for [`Copy3D`] slices (z), never
/// bytes. Each side is a [`Pitched`](crate::Pitched) view (or a
/// [`PitchedBuffer`](crate::PitchedBuffer)'s): rows `pitch` elements apart, of which the first
/// `width` are usable, and for 3D copies slices of `height` rows.
///
/// # Errors
///
/// Before any driver call, the copy (or a [`Rect2D`] memset) is checked against each side's
/// memory:
/// - a row segment reaching beyond the pitch (or the row width, when the side limits it, as a
///   [`PitchedBuffer`](crate::PitchedBuffer) does), rows beyond the rows per slice or the
///   memory, and slices beyond the memory are `OutOfRange { start, end, len }`, in the unit of
///   the offending axis;
/// - an offset plus extent that overflows `usize` (`x + width`, `y + height`, `z + depth`) is
///   `OutOfRange` too, with `end: usize::MAX`;
/// - a side whose pitch is 0 is `ZeroSize { what: "pitch" }`, and a side of a 3D copy without
///   rows per slice (or with 0) is `ZeroSize { what: "rows per slice" }`;
/// - a byte count that overflows (elements × element size) is `SizeOverflow`.
///
/// An empty extent (a zero width, height or depth) copies nothing and is `Ok` without these
/// checks, a zero pitch included; the devices are still checked (`WrongDevice`). The copy
/// functions list what else they refuse ([`copy_2d`](crate::copy_2d),
/// [`StreamCopy::copy_2d`](crate::StreamCopy::copy_2d)).
///
/// ```
/// use cumem_copy::{Copy2D, Copy3D, Rect2D};
/// let c = Copy2D::new(4, 3).src_at(1, 2).dst_at(0, 5);
/// assert_eq!((c.width, c.height, c.src_x, c.src_y, c.dst_x, c.dst_y), (4, 3, 1, 2, 0, 5));
/// let v = Copy3D::new(4, 3, 2).src_at(0, 0, 1);
/// assert_eq!((v.depth, v.src_z), (2, 1));
/// let r = Rect2D::new(8, 2).at(3, 1);
/// assert_eq!((r.x, r.y, r.width, r.height), (3, 1, 8, 2));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copy2D {
    /// Elements per row.
    pub width: usize,
    /// Rows.
    pub height: usize,
    /// First element of each source row.
    pub src_x: usize,
    /// First source row.
    pub src_y: usize,
    /// First element of each destination row.
    pub dst_x: usize,
    /// First destination row.
    pub dst_y: usize,
}

impl Copy2D {
    /// `width` elements of `height` rows, at the origin of both sides.
    pub fn new(width: usize, height: usize) -> Self {
        Copy2D { width, height, ..Default::default() }
    }

    /// Starts reading at element `x` of source row `y`.
    pub fn src_at(self, x: usize, y: usize) -> Self {
        Copy2D { src_x: x, src_y: y, ..self }
    }

    /// Starts writing at element `x` of destination row `y`.
    pub fn dst_at(self, x: usize, y: usize) -> Self {
        Copy2D { dst_x: x, dst_y: y, ..self }
    }

    pub(crate) fn as_3d(&self) -> Copy3D {
        Copy3D {
            width: self.width,
            height: self.height,
            depth: 1,
            src_x: self.src_x,
            src_y: self.src_y,
            src_z: 0,
            dst_x: self.dst_x,
            dst_y: self.dst_y,
            dst_z: 0,
        }
    }
}

/// A 3D copy: a box of `width` elements × `height` rows × `depth` slices, from
/// `(src_x, src_y, src_z)` to `(dst_x, dst_y, dst_z)`.
///
/// # Errors
///
/// Checked against each side as [`Copy2D`] lists; both sides need their rows per slice
/// ([`Pitched::with_height`](crate::Pitched::with_height)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copy3D {
    /// Elements per row.
    pub width: usize,
    /// Rows per slice.
    pub height: usize,
    /// Slices.
    pub depth: usize,
    /// First element of each source row.
    pub src_x: usize,
    /// First source row of each slice.
    pub src_y: usize,
    /// First source slice.
    pub src_z: usize,
    /// First element of each destination row.
    pub dst_x: usize,
    /// First destination row of each slice.
    pub dst_y: usize,
    /// First destination slice.
    pub dst_z: usize,
}

impl Copy3D {
    /// A `width` × `height` × `depth` box at the origin of both sides.
    pub fn new(width: usize, height: usize, depth: usize) -> Self {
        Copy3D { width, height, depth, ..Default::default() }
    }

    /// Starts reading at element `x` of row `y` of source slice `z`.
    pub fn src_at(self, x: usize, y: usize, z: usize) -> Self {
        Copy3D { src_x: x, src_y: y, src_z: z, ..self }
    }

    /// Starts writing at element `x` of row `y` of destination slice `z`.
    pub fn dst_at(self, x: usize, y: usize, z: usize) -> Self {
        Copy3D { dst_x: x, dst_y: y, dst_z: z, ..self }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.width == 0 || self.height == 0 || self.depth == 0
    }
}

/// A rectangle of a 2D memset: `width` elements of `height` rows, starting at element `x` of row `y`.
///
/// Checked against the memory as [`Copy2D`] lists (see
/// [`StreamCopy::fill_2d`](crate::StreamCopy::fill_2d)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rect2D {
    /// First element of each row.
    pub x: usize,
    /// First row.
    pub y: usize,
    /// Elements per row.
    pub width: usize,
    /// Rows.
    pub height: usize,
}

impl Rect2D {
    /// `width` × `height` at the origin.
    pub fn new(width: usize, height: usize) -> Self {
        Rect2D { x: 0, y: 0, width, height }
    }

    /// Moves the rectangle to start at element `x` of row `y`.
    pub fn at(self, x: usize, y: usize) -> Self {
        Rect2D { x, y, ..self }
    }
}

/// The shape of one side's memory, in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Elements of memory from the base.
    pub len: usize,
    /// Elements from one row to the next.
    pub pitch: usize,
    /// Usable elements at the start of each row (at most the pitch).
    pub width: usize,
    /// Rows from one slice to the next (3D only).
    pub height: Option<usize>,
}

/// Where a copy starts on one side, in elements, rows and slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    pub x: usize,
    pub y: usize,
    pub z: usize,
}

fn end(start: usize, count: usize, len: usize) -> Result<usize> {
    start.checked_add(count).ok_or(Error::OutOfRange { start, end: usize::MAX, len })
}

/// Checks that a `width` × `height` × `depth` box at `at` lies inside memory shaped `g`.
/// `three_d` requires a slice height; 2D boxes (`depth == 1`, `at.z == 0`) ignore it.
pub(crate) fn check_side(g: Geometry, at: Origin, b: &Copy3D, three_d: bool) -> Result<()> {
    if g.pitch == 0 {
        return Err(Error::ZeroSize { what: "pitch" });
    }
    let row_end = end(at.x, b.width, g.width)?;
    if row_end > g.width {
        return Err(Error::OutOfRange { start: at.x, end: row_end, len: g.width });
    }
    let rows_end = end(at.y, b.height, usize::MAX)?;
    // Rows whose segment [x, x + width) lies inside the memory: row r qualifies while
    // r * pitch + row_end <= len.
    let rows_in_memory = if g.len < row_end { 0 } else { (g.len - row_end) / g.pitch + 1 };
    if !three_d {
        if rows_end > rows_in_memory {
            return Err(Error::OutOfRange { start: at.y, end: rows_end, len: rows_in_memory });
        }
        return Ok(());
    }
    let height = match g.height {
        Some(h) if h > 0 => h,
        _ => return Err(Error::ZeroSize { what: "rows per slice" }),
    };
    if rows_end > height {
        return Err(Error::OutOfRange { start: at.y, end: rows_end, len: height });
    }
    let slices_end = end(at.z, b.depth, usize::MAX)?;
    // Slice s qualifies while its last touched row, s * height + rows_end - 1, is in memory.
    let slices_in_memory = match rows_in_memory.checked_sub(rows_end) {
        Some(spare) => spare / height + 1,
        None => 0,
    };
    if slices_end > slices_in_memory {
        return Err(Error::OutOfRange { start: at.z, end: slices_end, len: slices_in_memory });
    }
    Ok(())
}

/// `count * size`, or `SizeOverflow`.
pub(crate) fn bytes(count: usize, size: usize) -> Result<usize> {
    count.checked_mul(size).ok_or(Error::SizeOverflow { count, elem_size: size })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(len: usize, pitch: usize, height: Option<usize>) -> Geometry {
        Geometry { len, pitch, width: pitch, height }
    }
    const O: Origin = Origin { x: 0, y: 0, z: 0 };

    #[test]
    fn rows_must_fit_the_pitch_and_the_memory() {
        let b = Copy2D::new(4, 3).as_3d();
        assert!(check_side(g(12, 4, None), O, &b, false).is_ok());
        // A tight last row is enough: 2 full rows of pitch 8 and one of 4 elements.
        assert!(check_side(g(20, 8, None), O, &b, false).is_ok());
        assert!(matches!(
            check_side(g(19, 8, None), O, &b, false),
            Err(Error::OutOfRange { start: 0, end: 3, len: 2 })
        ));
        assert!(matches!(
            check_side(g(100, 8, None), Origin { x: 5, y: 0, z: 0 }, &b, false),
            Err(Error::OutOfRange { start: 5, end: 9, len: 8 })
        ));
        assert!(matches!(check_side(g(100, 0, None), O, &b, false), Err(Error::ZeroSize { what: "pitch" })));
        let narrow = Geometry { width: 6, ..g(100, 8, None) };
        assert!(matches!(
            check_side(narrow, Origin { x: 3, y: 0, z: 0 }, &b, false),
            Err(Error::OutOfRange { start: 3, end: 7, len: 6 })
        ));
        assert!(matches!(
            check_side(g(100, 8, None), Origin { x: usize::MAX, y: 0, z: 0 }, &b, false),
            Err(Error::OutOfRange { .. })
        ));
    }

    #[test]
    fn slices_must_fit_the_slice_height_and_the_memory() {
        let b = Copy3D::new(2, 2, 2);
        // pitch 4, 3 rows per slice: slice 1's rows 0..2 end at element (3 + 1) * 4 + 2 = 18.
        assert!(check_side(g(18, 4, Some(3)), O, &b, true).is_ok());
        assert!(matches!(
            check_side(g(17, 4, Some(3)), O, &b, true),
            Err(Error::OutOfRange { start: 0, end: 2, len: 1 })
        ));
        assert!(matches!(
            check_side(g(100, 4, Some(3)), Origin { x: 0, y: 2, z: 0 }, &b, true),
            Err(Error::OutOfRange { start: 2, end: 4, len: 3 })
        ));
        assert!(matches!(
            check_side(g(100, 4, None), O, &b, true),
            Err(Error::ZeroSize { what: "rows per slice" })
        ));
    }
}
