//! The simulated device address space.
//!
//! Each device gets its own range of virtual addresses reserved with `PROT_NONE`, so a device
//! pointer is never a usable host address: dereferencing one on the host faults instead of
//! silently reading some other buffer. Addresses are handed out next-fit with a guard gap after
//! every allocation, which delays address reuse and keeps an off-by-one access from landing in a
//! neighbouring allocation.

use std::collections::BTreeMap;

/// Unmapped space left after every allocation.
const GUARD: u64 = 4096;

/// A `PROT_NONE` reservation of host virtual addresses that stands for one device's memory.
pub(crate) struct AddressSpace {
    base: u64,
    len: u64,
    cursor: u64,
    /// Live ranges: start -> end (exclusive, guard included).
    live: BTreeMap<u64, u64>,
}

fn align_up(v: u64, align: u64) -> Option<u64> {
    v.checked_add(align - 1).map(|x| x & !(align - 1))
}

impl AddressSpace {
    /// Reserves `len` bytes of address space; `None` if the kernel refuses.
    pub(crate) fn reserve(len: u64) -> Option<Self> {
        // SAFETY: an anonymous PROT_NONE mapping with a NULL hint touches no existing memory; the
        // result is checked for MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let base = p as u64;
        Some(Self { base, len, cursor: base, live: BTreeMap::new() })
    }

    /// Whether `addr` lies inside this reservation.
    pub(crate) fn contains(&self, addr: u64) -> bool {
        addr >= self.base && addr - self.base < self.len
    }

    /// The reservation as `(base, len)`.
    pub(crate) fn range(&self) -> (u64, u64) {
        (self.base, self.len)
    }

    /// Picks an address for `size` bytes aligned to `align` (a power of two).
    pub(crate) fn allocate(&mut self, size: u64, align: u64) -> Option<u64> {
        let need = size.checked_add(GUARD)?;
        let end = self.base + self.len;
        let found = self
            .find_gap(self.cursor, end, need, align)
            .or_else(|| self.find_gap(self.base, end, need, align))?;
        self.live.insert(found, found + need);
        self.cursor = found + need;
        Some(found)
    }

    /// Picks an address for `size` bytes aligned to `align` (a power of two) and records exactly
    /// `size` bytes, leaving `gap` bytes unused after it for the next pick: a VMM reservation,
    /// whose end a later reservation may claim exactly (a growable range extended in place).
    pub(crate) fn allocate_spaced(&mut self, size: u64, align: u64, gap: u64) -> Option<u64> {
        let need = size.checked_add(gap)?;
        let end = self.base + self.len;
        let found = self
            .find_gap(self.cursor, end, need, align)
            .or_else(|| self.find_gap(self.base, end, need, align))?;
        self.live.insert(found, found + size);
        self.cursor = found + need;
        Some(found)
    }

    /// Records `[addr, addr + size)` if it lies inside and overlaps nothing live.
    pub(crate) fn claim(&mut self, addr: u64, size: u64) -> bool {
        let Some(end) = addr.checked_add(size) else { return false };
        if addr < self.base || end > self.base + self.len {
            return false;
        }
        let before = self.live.range(..end).next_back();
        if before.is_some_and(|(_, &e)| e > addr) {
            return false;
        }
        self.live.insert(addr, end);
        true
    }

    /// Returns the range starting at `addr` to the free space.
    pub(crate) fn release(&mut self, addr: u64) {
        self.live.remove(&addr);
    }

    fn find_gap(&self, lo: u64, hi: u64, need: u64, align: u64) -> Option<u64> {
        let mut cand = align_up(lo, align)?;
        if let Some((_, &e)) = self.live.range(..=cand).next_back()
            && e > cand
        {
            cand = align_up(e, align)?;
        }
        for (&s, &e) in self.live.range(cand..) {
            if s >= cand.checked_add(need)? {
                break;
            }
            cand = align_up(e.max(cand), align)?;
        }
        (cand.checked_add(need)? <= hi).then_some(cand)
    }
}

impl Drop for AddressSpace {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is exactly the mapping created in `reserve`, owned by `self`.
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len as usize);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_fit_with_guards_and_wraparound() {
        let mut a = AddressSpace::reserve(1 << 20).unwrap();
        let (base, _) = a.range();
        let p = a.allocate(1000, 512).unwrap();
        let q = a.allocate(1000, 512).unwrap();
        assert_eq!(p % 512, 0);
        assert!(q >= p + 1000 + GUARD);
        a.release(p);
        // Next-fit does not hand the freed range back immediately.
        let r = a.allocate(1000, 512).unwrap();
        assert!(r > q);
        // Exhausting the tail wraps around to the freed head.
        while a.allocate(100_000, 512).is_some() {}
        assert!(a.contains(base));
    }
}
