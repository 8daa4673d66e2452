//! Cache-line layout: aligned wrappers and the ring's [`ControlBlock`], laid out exactly like the
//! C struct `cumem_control_block` in `include/cumem_channel.h` that a CUDA C++ kernel includes.
//!
//! A producer and a consumer that write the same cache line make it bounce between host and device
//! (or between SMs) on every message. Every field of the control block that one side writes sits
//! alone on its own [`CONTROL_LINE`]-byte line (128 bytes: a GPU L2 line, two CPU lines). Sizes and
//! offsets are checked at compile time here, and the crate's tests compile the C header as C11 and
//! as C++17 and compare.
//!
//! ```
//! use cumem_channel::{CacheLineAligned, CacheLineAligned128, ControlBlock, CONTROL_OFFSETS};
//! assert_eq!(std::mem::align_of::<CacheLineAligned<u8>>(), 64);
//! assert_eq!(std::mem::size_of::<CacheLineAligned128<[u8; 130]>>(), 256);
//! assert_eq!(std::mem::size_of::<ControlBlock>(), 512);
//! assert_eq!(CONTROL_OFFSETS.iter().find(|(name, _)| *name == "tail"), Some(&("tail", 128)));
//! let block = ControlBlock::new(64, 16, 1_000, 0);
//! assert_eq!((block.capacity, block.message_size, block.head, block.tail), (64, 16, 0, 0));
//! ```

use std::mem::{align_of, offset_of, size_of};
use std::ops::{Deref, DerefMut};

use bytemuck::{Pod, Zeroable};

/// The line size the control block separates its fields by: a GPU L2 line, two CPU lines.
pub const CONTROL_LINE: usize = 128;

/// `flags` bit: the host closed the channel; the device side should drain and stop.
pub const FLAG_CLOSED: u64 = 1;
/// `flags` bit: the device produces and the host consumes.
pub const FLAG_DEVICE_TO_HOST: u64 = 2;

/// A value alone on a 64-byte (CPU) cache line: no other value shares its line, so writes to it
/// never invalidate a neighbour's.
///
/// Not [`Pod`]: the padding after a value smaller than the line is uninitialised. Use it for host
/// state (counters, positions a thread spins on); shared layouts spell their padding out like
/// [`ControlBlock`].
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct CacheLineAligned<T>(pub T);

/// A value alone on a 128-byte line (a GPU L2 line, or an adjacent-line-prefetch pair on x86).
/// Not [`Pod`], as [`CacheLineAligned`].
#[repr(C, align(128))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct CacheLineAligned128<T>(pub T);

macro_rules! aligned_wrapper {
    ($name:ident) => {
        impl<T> $name<T> {
            /// Wraps `value`.
            pub const fn new(value: T) -> Self {
                $name(value)
            }

            /// The wrapped value.
            pub fn into_inner(self) -> T {
                self.0
            }
        }

        impl<T> Deref for $name<T> {
            type Target = T;
            fn deref(&self) -> &T {
                &self.0
            }
        }

        impl<T> DerefMut for $name<T> {
            fn deref_mut(&mut self) -> &mut T {
                &mut self.0
            }
        }

        impl<T> From<T> for $name<T> {
            fn from(value: T) -> Self {
                $name(value)
            }
        }

        // SAFETY: all-zero bytes are a valid `T` (bound), and the padding may hold any bytes.
        unsafe impl<T: Zeroable> Zeroable for $name<T> {}
    };
}

aligned_wrapper!(CacheLineAligned);
aligned_wrapper!(CacheLineAligned128);

/// The ring's shared state, `#[repr(C)]` and [`Pod`], identical to `struct cumem_control_block`.
///
/// Positions are monotonic message counts (they never wrap in practice: 2^64 messages), so the slot
/// of position `p` is `p % capacity`, the ring is empty when `head == tail` and full when
/// `tail - head == capacity`, with no slot wasted and no ambiguity.
///
/// | offset | field              | written by                               |
/// |-------:|--------------------|------------------------------------------|
/// | 0      | `head`             | the consumer                             |
/// | 128    | `tail`             | the producer, after the slots it covers  |
/// | 256    | `sequence`         | the producer, once per publish           |
/// | 384    | `capacity`         | the host, at creation                    |
/// | 392    | `message_size`     | the host, at creation                    |
/// | 400    | `poll_interval_ns` | the host, at creation                    |
/// | 408    | `flags`            | the host ([`FLAG_CLOSED`], [`FLAG_DEVICE_TO_HOST`]) |
///
/// ```c
/// // CUMEM_CHANNEL_ALIGNAS is `alignas` in C++ (CUDA C++) and `_Alignas` in C11.
/// struct cumem_control_block {
///     CUMEM_CHANNEL_ALIGNAS(128) uint64_t head; uint8_t pad_head[120];
///     uint64_t tail;                uint8_t pad_tail[120];
///     uint64_t sequence;            uint8_t pad_sequence[120];
///     uint64_t capacity;
///     uint64_t message_size;
///     uint64_t poll_interval_ns;
///     uint64_t flags;               uint8_t pad_config[96];
/// };
/// ```
#[repr(C, align(128))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct ControlBlock {
    /// Messages consumed so far.
    pub head: u64,
    _pad_head: [u8; 120],
    /// Messages published so far.
    pub tail: u64,
    _pad_tail: [u8; 120],
    /// Publishes so far (flushes or device batches).
    pub sequence: u64,
    _pad_sequence: [u8; 120],
    /// Slots in the ring.
    pub capacity: u64,
    /// Bytes per slot.
    pub message_size: u64,
    /// How long a polling side waits between looks at the other side's field, in nanoseconds.
    pub poll_interval_ns: u64,
    /// [`FLAG_CLOSED`] | [`FLAG_DEVICE_TO_HOST`].
    pub flags: u64,
    _pad_config: [u8; 96],
}

impl ControlBlock {
    /// Index of `head` in the block seen as 64-bit words (how device views address it).
    pub const HEAD_WORD: usize = offset_of!(ControlBlock, head) / 8;
    /// Index of `tail` in the block seen as 64-bit words.
    pub const TAIL_WORD: usize = offset_of!(ControlBlock, tail) / 8;
    /// Index of `sequence` in the block seen as 64-bit words.
    pub const SEQUENCE_WORD: usize = offset_of!(ControlBlock, sequence) / 8;
    /// Index of `flags` in the block seen as 64-bit words.
    pub const FLAGS_WORD: usize = offset_of!(ControlBlock, flags) / 8;
    /// The block's size in 64-bit words.
    pub const WORDS: usize = size_of::<ControlBlock>() / 8;

    /// A block for an empty ring.
    pub fn new(capacity: u64, message_size: u64, poll_interval_ns: u64, flags: u64) -> Self {
        ControlBlock { capacity, message_size, poll_interval_ns, flags, ..Zeroable::zeroed() }
    }
}

/// Every field of [`ControlBlock`] with its byte offset, in C declaration order: the table the
/// C layout test compares with `offsetof` in `cumem_channel.h`.
pub const CONTROL_OFFSETS: [(&str, usize); 7] = [
    ("head", offset_of!(ControlBlock, head)),
    ("tail", offset_of!(ControlBlock, tail)),
    ("sequence", offset_of!(ControlBlock, sequence)),
    ("capacity", offset_of!(ControlBlock, capacity)),
    ("message_size", offset_of!(ControlBlock, message_size)),
    ("poll_interval_ns", offset_of!(ControlBlock, poll_interval_ns)),
    ("flags", offset_of!(ControlBlock, flags)),
];

/// The control block as 64-bit words (how the channel reads and writes single fields).
pub(crate) const CONTROL_WORDS: usize = ControlBlock::WORDS;
pub(crate) const HEAD_WORD: usize = ControlBlock::HEAD_WORD;
pub(crate) const TAIL_WORD: usize = ControlBlock::TAIL_WORD;
pub(crate) const SEQUENCE_WORD: usize = ControlBlock::SEQUENCE_WORD;
pub(crate) const FLAGS_WORD: usize = ControlBlock::FLAGS_WORD;

const _: () = {
    assert!(size_of::<ControlBlock>() == 4 * CONTROL_LINE);
    assert!(align_of::<ControlBlock>() == CONTROL_LINE);
    assert!(offset_of!(ControlBlock, head) == 0);
    assert!(offset_of!(ControlBlock, tail) == CONTROL_LINE);
    assert!(offset_of!(ControlBlock, sequence) == 2 * CONTROL_LINE);
    assert!(offset_of!(ControlBlock, capacity) == 3 * CONTROL_LINE);
    assert!(offset_of!(ControlBlock, message_size) == 3 * CONTROL_LINE + 8);
    assert!(offset_of!(ControlBlock, poll_interval_ns) == 3 * CONTROL_LINE + 16);
    assert!(offset_of!(ControlBlock, flags) == 3 * CONTROL_LINE + 24);
    assert!(size_of::<CacheLineAligned<u8>>() == 64 && align_of::<CacheLineAligned<u64>>() == 64);
    assert!(size_of::<CacheLineAligned128<u8>>() == 128 && align_of::<CacheLineAligned128<u64>>() == 128);
    assert!(size_of::<RingArgs>() == 32);
    assert!(
        ControlBlock::HEAD_WORD == 0 && ControlBlock::TAIL_WORD == 16 && ControlBlock::SEQUENCE_WORD == 32
    );
    assert!(ControlBlock::FLAGS_WORD == 51 && ControlBlock::WORDS == 64);
};

/// What a kernel receives for one channel, identical to `struct cumem_ring_args`: the device
/// addresses of the control block and the slots, and the ring's geometry.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct RingArgs {
    /// Device address of the [`ControlBlock`].
    pub control: u64,
    /// Device address of slot 0.
    pub slots: u64,
    /// Slots in the ring.
    pub capacity: u64,
    /// Bytes per slot.
    pub message_size: u64,
}

/// Every field of [`RingArgs`] with its byte offset, as in `cumem_channel.h`.
pub const RING_ARGS_OFFSETS: [(&str, usize); 4] = [
    ("control", offset_of!(RingArgs, control)),
    ("slots", offset_of!(RingArgs, slots)),
    ("capacity", offset_of!(RingArgs, capacity)),
    ("message_size", offset_of!(RingArgs, message_size)),
];
