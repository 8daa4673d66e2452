//! Which shareable handle types physical memory may later be exported as.
//!
//! The set is fixed when the memory is created (`requestedHandleTypes` of `cuMemCreate`) and can
//! change the granularity the driver asks for, so granularity queries take it too. Most programs
//! want [`HandleTypes::NONE`]: memory that never leaves the process.
//!
//! ```
//! use cumem_vmm::HandleTypes;
//! let types = HandleTypes::POSIX_FD | HandleTypes::FABRIC;
//! assert!(types.contains(HandleTypes::POSIX_FD));
//! assert!(!HandleTypes::NONE.contains(HandleTypes::FABRIC));
//! assert_eq!(types.bits(), 0x9);
//! ```

use std::fmt;
use std::ops::BitOr;

/// A set of `CU_MEM_HANDLE_TYPE_*` bits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct HandleTypes(u32);

impl HandleTypes {
    /// No export: the memory stays private to this process.
    pub const NONE: HandleTypes = HandleTypes(0);
    /// A POSIX file descriptor (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
    pub const POSIX_FD: HandleTypes = HandleTypes(0x1);
    /// A Win32 NT handle (`CU_MEM_HANDLE_TYPE_WIN32`; refused on Linux).
    pub const WIN32: HandleTypes = HandleTypes(0x2);
    /// A Win32 KMT handle (`CU_MEM_HANDLE_TYPE_WIN32_KMT`; refused on Linux).
    pub const WIN32_KMT: HandleTypes = HandleTypes(0x4);
    /// A fabric handle (`CU_MEM_HANDLE_TYPE_FABRIC`; needs an IMEX channel).
    pub const FABRIC: HandleTypes = HandleTypes(0x8);

    /// The set with exactly these bits (passed to the driver as they are).
    pub const fn from_bits(bits: u32) -> HandleTypes {
        HandleTypes(bits)
    }

    /// The bits of the set.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Whether every type in `other` is in `self`.
    pub const fn contains(self, other: HandleTypes) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl BitOr for HandleTypes {
    type Output = HandleTypes;

    fn bitor(self, rhs: HandleTypes) -> HandleTypes {
        HandleTypes(self.0 | rhs.0)
    }
}

impl fmt::Debug for HandleTypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NAMES: [(HandleTypes, &str); 4] = [
            (HandleTypes::POSIX_FD, "POSIX_FD"),
            (HandleTypes::WIN32, "WIN32"),
            (HandleTypes::WIN32_KMT, "WIN32_KMT"),
            (HandleTypes::FABRIC, "FABRIC"),
        ];
        if self.is_empty() {
            return f.write_str("HandleTypes(NONE)");
        }
        let mut names: Vec<String> =
            NAMES.iter().filter(|(t, _)| self.contains(*t)).map(|(_, n)| (*n).to_string()).collect();
        let rest = self.0 & !0xF;
        if rest != 0 {
            names.push(format!("{rest:#x}"));
        }
        write!(f, "HandleTypes({})", names.join(" | "))
    }
}
