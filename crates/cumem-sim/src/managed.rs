//! Managed (unified) memory state: the attachment, and the hints of `cuMemAdvise` and prefetches
//! recorded per 4 KiB page (allocated on first use), so advice on a sub-range reads back exactly
//! for that range and "mixed" answers come out as the driver documents.

use crate::abi::{LOC_DEVICE, LOC_INVALID};

/// Page size of the hint bookkeeping.
pub(crate) const PAGE: u64 = 4096;
/// `CU_DEVICE_CPU`.
pub(crate) const DEVICE_CPU: i32 = -1;
/// `CU_DEVICE_INVALID`.
pub(crate) const DEVICE_INVALID: i32 = -2;

/// A recorded location: `(CUmemLocationType, id)`; HOST ids are stored as 0.
pub(crate) type Loc = (u32, i32);

/// The hints of one page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PageHints {
    pub(crate) read_mostly: bool,
    pub(crate) preferred: Option<Loc>,
    /// Bit `d`: device `d` has ACCESSED_BY advice.
    pub(crate) accessed_by: u64,
    pub(crate) accessed_by_cpu: bool,
    pub(crate) last_prefetch: Option<Loc>,
}

/// The per-allocation state of managed memory.
#[derive(Debug)]
pub(crate) struct Managed {
    /// `CU_MEM_ATTACH_*` of the allocation (what a SINGLE attachment reverts to).
    pub(crate) initial_attach: u32,
    /// `CU_MEM_ATTACH_*` of the latest attachment.
    pub(crate) attach: u32,
    /// Stream of the latest `cuStreamAttachMemAsync` (0 = none).
    pub(crate) stream: u64,
    pages: u64,
    hints: Vec<PageHints>,
}

impl Managed {
    /// A fresh allocation of `bytes` attached with `flags`.
    pub(crate) fn new(flags: u32, bytes: u64) -> Self {
        Self {
            initial_attach: flags,
            attach: flags,
            stream: 0,
            pages: bytes.div_ceil(PAGE),
            hints: Vec::new(),
        }
    }

    /// Applies `f` to the hints of pages `first..=last`.
    pub(crate) fn update(&mut self, first: u64, last: u64, f: impl Fn(&mut PageHints)) {
        if self.hints.is_empty() {
            self.hints = vec![PageHints::default(); self.pages as usize];
        }
        for h in &mut self.hints[first as usize..=last as usize] {
            f(h);
        }
    }

    /// The hints of pages `first..=last`.
    pub(crate) fn range(&self, first: u64, last: u64) -> Vec<PageHints> {
        if self.hints.is_empty() {
            return vec![PageHints::default(); (last - first + 1) as usize];
        }
        self.hints[first as usize..=last as usize].to_vec()
    }
}

/// The v1 (`CUdevice`) form of a location: the ordinal, `CU_DEVICE_CPU` for host locations.
pub(crate) fn v1_of(l: Option<Loc>) -> i32 {
    match l {
        Some((LOC_DEVICE, id)) => id,
        Some(_) => DEVICE_CPU,
        None => DEVICE_INVALID,
    }
}

/// The one value every page agrees on, if they do.
pub(crate) fn common<T: PartialEq + Copy>(pages: &[PageHints], f: impl Fn(&PageHints) -> T) -> Option<T> {
    let first = f(pages.first()?);
    pages.iter().all(|p| f(p) == first).then_some(first)
}

/// The v2 `(type, id)` answer for a possibly mixed or unset location.
pub(crate) fn v2_of(l: Option<Option<Loc>>) -> (u32, i32) {
    match l {
        Some(Some(loc)) => loc,
        _ => (LOC_INVALID, DEVICE_INVALID),
    }
}
