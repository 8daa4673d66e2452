//! Blocks handed out by the pool, and how a request becomes one.
//!
//! A [`Block`] is neither `Clone` nor `Copy` and can only be made by the pool, so a double free cannot
//! be written and a block of another pool is recognised (and handed back as
//! [`ForeignBlock`](crate::ForeignBlock)). It carries what the free path needs to be O(1): its
//! rounded size, its segment and its kind.
//!
//! ```
//! use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig, PoolError};
//!
//! let pool = CachingPool::new(HostUpstream::new(1 << 30), HostOrdering::new(), PoolConfig::default());
//! let b = pool.allocate(1000, 4096, 0).unwrap();
//! assert_eq!((b.size(), b.rounded_size(), b.addr() % 4096), (1000, 1024, 0));
//! assert_eq!(pool.allocate(1000, 3, 0).unwrap_err(), PoolError::InvalidAlignment { align: 3 });
//! // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! unsafe { pool.deallocate(b, 0) }.unwrap();
//! ```

use crate::free_set::Seg;
use crate::size_class::{Kind, QUANTUM, SMALL_LIMIT, SizeClass};
use crate::{MAX_ALIGN, PoolError};

/// A live allocation of a [`CachingPool`](crate::CachingPool). Give it back with
/// [`deallocate`](crate::CachingPool::deallocate); a block that is dropped instead stays allocated
/// (counted as live) until the pool is dropped.
#[must_use = "a dropped Block stays allocated until its pool is dropped; deallocate it"]
#[derive(Debug, PartialEq, Eq)]
pub struct Block {
    pub(crate) addr: u64,
    pub(crate) requested: usize,
    pub(crate) size: u64,
    pub(crate) seg: Seg,
    pub(crate) kind: Kind,
    pub(crate) pool: u32,
}

impl Block {
    /// Device address of the block.
    #[inline]
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The size that was requested.
    #[inline]
    pub fn size(&self) -> usize {
        self.requested
    }

    /// The size-class rounded size: the block may use this many bytes.
    #[inline]
    pub fn rounded_size(&self) -> usize {
        self.size as usize
    }

    /// The upstream segment containing the block.
    #[inline]
    pub fn segment(&self) -> Seg {
        self.seg
    }

    /// Which kind of segment the block lives in.
    #[inline]
    pub fn kind(&self) -> Kind {
        self.kind
    }
}

impl Block {
    /// Two words naming the block's segment and kind, for [`Block::from_token`]: what a resource
    /// keeps in its allocation's token so its free needs no table (the address and requested size
    /// travel separately).
    #[inline]
    pub(crate) fn token(&self) -> [u64; 2] {
        // Segment lengths are multiples of QUANTUM, so the two low bits are free for the kind.
        let kind = match self.kind {
            Kind::Small => 0,
            Kind::Large => 1,
            Kind::Dedicated => 2,
        };
        [self.seg.base, self.seg.len | kind]
    }

    /// The block that [`token`](Self::token) described, for pool `pool`. The caller vouches that
    /// `addr`, `requested` and `token` are those of one live block of that pool (the resource's
    /// safety contract); `None` for a token no block can have.
    #[inline]
    pub(crate) fn from_token(addr: u64, requested: usize, token: [u64; 2], pool: u32) -> Option<Block> {
        let kind = match token[1] & 3 {
            0 => Kind::Small,
            1 => Kind::Large,
            2 => Kind::Dedicated,
            _ => return None,
        };
        let size = SizeClass::of(requested).ok()?.bytes as u64;
        let seg = Seg { base: token[0], len: token[1] & !3 };
        Some(Block { addr, requested, size, seg, kind, pool })
    }
}

/// A validated allocation request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request {
    pub requested: usize,
    /// Rounded size.
    pub size: u64,
    /// Effective alignment (at least `QUANTUM`).
    pub align: u64,
    /// Length of a free range that surely fits the block after alignment.
    pub need: u64,
    pub kind: Kind,
    /// Front-cache bin, or 0 when the request cannot be served from a bin.
    pub bin: usize,
}

impl Request {
    /// The request as a pool whose dedicated segments serve within `split_limit` takes it: a large
    /// request above the limit is [`Kind::Dedicated`]. `None`: the pool makes no dedicated
    /// segments (it grows expandable ones).
    #[inline]
    pub(crate) fn split_above(mut self, split_limit: Option<u64>) -> Request {
        if self.kind == Kind::Large
            && let Some(limit) = split_limit
            && self.size > limit
        {
            self.kind = Kind::Dedicated;
        }
        self
    }

    #[inline]
    pub(crate) fn new(bytes: usize, align: usize) -> Result<Request, PoolError> {
        if !align.is_power_of_two() {
            return Err(PoolError::InvalidAlignment { align });
        }
        if align > MAX_ALIGN {
            return Err(PoolError::AlignmentTooLarge { align, max: MAX_ALIGN });
        }
        let class = SizeClass::of(bytes)?;
        let align = align.max(QUANTUM);
        let need =
            class.bytes.checked_add(align - QUANTUM).ok_or(PoolError::SizeOverflow { requested: bytes })?;
        let kind = if need <= SMALL_LIMIT { Kind::Small } else { Kind::Large };
        let bin = match class.bin {
            Some(bin) if align == QUANTUM => bin,
            _ => 0,
        };
        Ok(Request {
            requested: bytes,
            size: class.bytes as u64,
            align: align as u64,
            need: need as u64,
            kind,
            bin,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_validate_and_classify() {
        let r = Request::new(100, 1).unwrap();
        assert_eq!((r.size, r.align, r.need, r.kind, r.bin), (512, 512, 512, Kind::Small, 1));
        let r = Request::new(100, 4096).unwrap();
        assert_eq!((r.size, r.align, r.need, r.kind, r.bin), (512, 4096, 4096, Kind::Small, 0));
        let r = Request::new(SMALL_LIMIT, 1024).unwrap();
        assert_eq!((r.kind, r.bin), (Kind::Large, 0));
        assert_eq!(Request::new(1, 0).unwrap_err(), PoolError::InvalidAlignment { align: 0 });
        assert_eq!(Request::new(1, 48).unwrap_err(), PoolError::InvalidAlignment { align: 48 });
        assert_eq!(
            Request::new(1, MAX_ALIGN * 2).unwrap_err(),
            PoolError::AlignmentTooLarge { align: MAX_ALIGN * 2, max: MAX_ALIGN }
        );
        assert_eq!(Request::new(0, 1).unwrap_err(), PoolError::ZeroSize);
        let top = usize::MAX - (usize::MAX >> 5);
        let r = Request::new(top, MAX_ALIGN).unwrap();
        assert_eq!((r.size, r.need, r.kind), (top as u64, (top + MAX_ALIGN - QUANTUM) as u64, Kind::Large));
        assert_eq!(Request::new(top + 1, 1).unwrap_err(), PoolError::SizeOverflow { requested: top + 1 });
    }

    #[test]
    fn requests_above_the_split_limit_are_dedicated_unless_the_pool_makes_none() {
        let mib = 1 << 20;
        let r = Request::new(10 * mib, 1).unwrap();
        assert_eq!(r.split_above(Some(10 << 20)).kind, Kind::Large, "at the limit: shared");
        let r = Request::new(10 * mib + 1, 1).unwrap();
        assert_eq!(r.split_above(Some(10 << 20)).kind, Kind::Dedicated);
        assert_eq!(r.split_above(None).kind, Kind::Large, "expandable segments: none");
        assert_eq!(Request::new(mib, 1).unwrap().split_above(Some(0)).kind, Kind::Small);
    }

    #[test]
    fn a_token_names_the_segment_and_its_kind() {
        let seg = Seg { base: 0x7f00_0000_0000, len: 34 << 20 };
        for kind in Kind::ALL {
            let block =
                Block { addr: seg.base + 4096, requested: 30 << 20, size: 30 << 20, seg, kind, pool: 3 };
            let back = Block::from_token(block.addr, block.requested, block.token(), 3).unwrap();
            assert_eq!((back.seg, back.kind, back.size, back.addr), (seg, kind, 30 << 20, block.addr));
        }
        assert!(Block::from_token(0, 512, [0, (2 << 20) | 3], 3).is_none(), "no kind has the tag 3");
    }
}
