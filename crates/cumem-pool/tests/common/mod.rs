//! Test support: a vector-clock model of stream ordering, an upstream that checks releases against it,
//! and a harness that drives a pool and a reference model side by side and checks every invariant.
#![allow(dead_code, missing_docs)]

pub mod events;

use std::collections::BTreeMap;
use std::sync::Arc;

use cumem_pool::size_class::SMALL_LIMIT;
use cumem_pool::{
    Block, CachingPool, ExpandableUpstream, ForeignBlock, HostUpstream, Ordering, PoolConfig, PoolError,
    Upstream, UpstreamError,
};
use parking_lot::Mutex;

/// On the simulator: no violation was logged, and nothing is left alive (the live report).
pub fn assert_sim_clean() {
    if let Some(ctl) = cumem_sys::testing::sim_control() {
        assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
        let report = ctl.live_report();
        assert!(report.is_clean(), "{report}");
    }
}

/// An upstream whose memory is [`HostUpstream`]'s model: addresses with no memory behind them.
///
/// # Safety
/// Every address the upstream hands out (segments, mapped chunks) is one of a `HostUpstream`:
/// nothing (no device work, no host access) ever uses it.
pub unsafe trait HostModel: Upstream {}

// SAFETY: the model itself.
unsafe impl HostModel for HostUpstream {}
// SAFETY: the inner upstream's addresses, which are a model's.
unsafe impl<U: HostModel + ?Sized> HostModel for Arc<U> {}
// SAFETY: hands out its `HostUpstream`'s addresses only.
unsafe impl HostModel for CheckedUpstream {}

/// [`CachingPool::deallocate`] for pools over a [`HostModel`], which need no `unsafe` at each call.
pub trait Free<S> {
    /// Gives `block` back on `stream`, as `deallocate` does.
    fn free(&self, block: Block, stream: S) -> Result<(), ForeignBlock>;
}

impl<U: HostModel, O: Ordering> Free<O::Stream> for CachingPool<U, O> {
    fn free(&self, block: Block, stream: O::Stream) -> Result<(), ForeignBlock> {
        // SAFETY: the upstream is a host model (`HostModel`'s contract): no work of any stream
        // uses the block's addresses, now or later (items 1 and 3), so there is nothing for the
        // ordering to order after `stream` (item 2), whichever stream the test names: a test
        // naming one stream or another checks only the pool's bookkeeping and the ordering
        // model's.
        unsafe { self.deallocate(block, stream) }
    }
}

pub const STREAMS: usize = 4;
pub type Stream = u8;

/// Happens-before between streams, as established by `wait` and `synchronize`.
///
/// `pos[s]` counts frees on stream `s`; `vc[t][s]` is the latest free position of `s` that work
/// enqueued on `t` from now on is ordered after. `history` maps freed-and-not-reused memory to the
/// free that last touched it.
#[derive(Debug, Default)]
pub struct Clock {
    pos: [u64; STREAMS],
    vc: [[u64; STREAMS]; STREAMS],
    synced: [u64; STREAMS],
    history: BTreeMap<u64, (u64, Stream, u64)>,
    pub waits: u64,
    pub syncs: u64,
    pub wait_calls: u64,
    pub fail_wait_call: Option<u64>,
    pub violations: Vec<String>,
}

impl Clock {
    fn known(&self, t: usize, s: usize) -> u64 {
        if t == s { self.pos[s] } else { self.vc[t][s] }
    }

    /// Memory `[addr, addr+len)` was freed on `s` (its last use was on `s`).
    pub fn record_free(&mut self, addr: u64, len: u64, s: Stream) {
        self.pos[s as usize] += 1;
        let p = self.pos[s as usize];
        if self.overlapping(addr, len).next().is_some() {
            self.violations.push(format!("free of {addr:#x}+{len}: memory already free"));
        }
        self.history.insert(addr, (addr + len, s, p));
    }

    fn overlapping(&self, addr: u64, len: u64) -> impl Iterator<Item = (u64, (u64, Stream, u64))> + '_ {
        let end = addr + len;
        let first = self.history.range(..=addr).next_back().map(|(&a, _)| a).unwrap_or(addr);
        self.history.range(first..end).filter(move |&(_, &(e, _, _))| e > addr).map(|(&a, &v)| (a, v))
    }

    /// Removes history in `[addr, addr+len)`, returning the removed pieces' `(stream, pos)`.
    fn take(&mut self, addr: u64, len: u64) -> Vec<(Stream, u64)> {
        let end = addr + len;
        let hits: Vec<_> = self.overlapping(addr, len).collect();
        let mut out = vec![];
        for (a, (e, s, p)) in hits {
            self.history.remove(&a);
            if a < addr {
                self.history.insert(a, (addr, s, p));
            }
            if e > end {
                self.history.insert(end, (e, s, p));
            }
            out.push((s, p));
        }
        out
    }

    /// Memory `[addr, addr+len)` is handed to stream `t`: every free of it on another stream must be
    /// ordered before `t`'s future work.
    pub fn record_alloc(&mut self, addr: u64, len: u64, t: Stream) {
        for (s, p) in self.take(addr, len) {
            if s != t && self.known(t as usize, s as usize) < p {
                self.violations.push(format!(
                    "{addr:#x}+{len} handed to stream {t} after free #{p} on stream {s} without wait \
                     (stream {t} knows #{} of {s})",
                    self.known(t as usize, s as usize)
                ));
            }
        }
    }

    /// A segment goes back to the upstream: every free in it must precede a synchronisation.
    pub fn record_release(&mut self, addr: u64, len: u64) {
        for (s, p) in self.take(addr, len) {
            if self.synced[s as usize] < p {
                self.violations.push(format!(
                    "segment {addr:#x}+{len} released with free #{p} on stream {s} not synchronised"
                ));
            }
        }
    }

    fn wait(&mut self, t: usize, s: usize) {
        self.waits += 1;
        for x in 0..STREAMS {
            let k = self.known(s, x);
            if x != t {
                self.vc[t][x] = self.vc[t][x].max(k);
            }
        }
    }

    fn synchronize(&mut self) {
        self.syncs += 1;
        for t in 0..STREAMS {
            self.vc[t] = self.pos;
        }
        self.synced = self.pos;
    }
}

/// `Ordering` over the vector-clock model.
#[derive(Debug, Clone, Default)]
pub struct ModelOrdering(pub Arc<Mutex<Clock>>);

impl Ordering for ModelOrdering {
    type Stream = Stream;
    fn wait(&self, waiter: Stream, on: Stream) -> Result<(), UpstreamError> {
        let mut c = self.0.lock();
        let call = c.wait_calls;
        c.wait_calls += 1;
        if c.fail_wait_call == Some(call) {
            return Err(UpstreamError::Other(700));
        }
        assert_ne!(waiter, on, "wait on itself");
        c.wait(waiter as usize, on as usize);
        Ok(())
    }
    fn synchronize(&self) -> Result<(), UpstreamError> {
        self.0.lock().synchronize();
        Ok(())
    }
}

/// A `HostUpstream` whose releases are checked against the ordering model.
#[derive(Debug)]
pub struct CheckedUpstream {
    pub host: HostUpstream,
    pub clock: Arc<Mutex<Clock>>,
}

impl Upstream for CheckedUpstream {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        self.host.allocate(bytes)
    }
    unsafe fn deallocate(&self, addr: u64, bytes: usize) {
        self.clock.lock().record_release(addr, bytes as u64);
        // SAFETY: forwarded from this method's caller, who keeps its contract.
        unsafe { self.host.deallocate(addr, bytes) };
    }
    fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        Some(self)
    }
}

/// Unmapped chunks are checked against the ordering model like released segments.
impl ExpandableUpstream for CheckedUpstream {
    fn chunk_bytes(&self) -> usize {
        self.host.chunk_bytes()
    }
    fn reservation_bytes(&self) -> usize {
        self.host.reservation_bytes()
    }
    fn reserve(&self, bytes: usize) -> Result<u64, UpstreamError> {
        self.host.reserve(bytes)
    }
    fn map(&self, addr: u64, bytes: usize) -> Result<(), UpstreamError> {
        self.host.map(addr, bytes)
    }
    unsafe fn unmap(&self, addr: u64, bytes: usize) -> Result<(), UpstreamError> {
        self.clock.lock().record_release(addr, bytes as u64);
        // SAFETY: forwarded from this method's caller, who keeps its contract.
        unsafe { self.host.unmap(addr, bytes) }
    }
    unsafe fn release(&self, base: u64, bytes: usize) {
        // SAFETY: forwarded from this method's caller, who keeps its contract.
        unsafe { self.host.release(base, bytes) };
    }
}

pub type Pool = CachingPool<CheckedUpstream, ModelOrdering>;

pub fn new_pool(capacity: usize, config: PoolConfig) -> Pool {
    let clock = Arc::new(Mutex::new(Clock::default()));
    CachingPool::new(
        CheckedUpstream { host: HostUpstream::new(capacity), clock: clock.clone() },
        ModelOrdering(clock),
        config,
    )
}

/// The documented size-class rule, written independently of the crate.
pub fn model_round(n: usize) -> u64 {
    let n = n as u64;
    if n <= 64 << 10 {
        n.div_ceil(512) * 512
    } else {
        let step = (1u64 << (63 - n.leading_zeros())) / 16;
        n.div_ceil(step) * step
    }
}

#[derive(Debug, Clone)]
pub enum Op {
    Alloc {
        size: usize,
        align: usize,
        stream: Stream,
    },
    /// Free live block `idx % live`, last used on `stream` (None: its allocation stream).
    Free {
        idx: usize,
        stream: Option<Stream>,
    },
    Trim,
    TrimTo(usize),
    Sync,
    ResetPeaks,
}

pub struct Live {
    pub block: Block,
    pub stream: Stream,
    pub rounded: u64,
}

/// Reference model of the statistics.
#[derive(Debug, Default, Clone)]
pub struct Model {
    pub current_bytes: u64,
    pub peak_bytes: u64,
    pub current_count: u64,
    pub peak_count: u64,
    pub requested: u64,
    pub allocations: u64,
    pub histogram: cumem_pool::Histogram,
}

pub struct Harness {
    pub pool: Pool,
    pub live: Vec<Live>,
    pub model: Model,
    /// Errors other than OutOfMemory are acceptable (fault injection).
    pub allow_errors: bool,
    pub errors: usize,
}

impl Harness {
    pub fn new(capacity: usize, config: PoolConfig) -> Harness {
        Harness {
            pool: new_pool(capacity, config),
            live: vec![],
            model: Model::default(),
            allow_errors: false,
            errors: 0,
        }
    }

    pub fn host(&self) -> &HostUpstream {
        &self.pool.upstream().host
    }

    pub fn clock(&self) -> parking_lot::MutexGuard<'_, Clock> {
        self.pool.ordering().0.lock()
    }

    pub fn apply(&mut self, op: &Op) {
        match *op {
            Op::Alloc { size, align, stream } => self.alloc(size, align, stream),
            Op::Free { idx, stream } => {
                if !self.live.is_empty() {
                    let i = idx % self.live.len();
                    self.free(i, stream);
                }
            }
            Op::Trim => {
                let r = self.pool.trim().unwrap();
                self.check_released_all_free(0, &format!("trim {r:?}"));
            }
            Op::TrimTo(keep) => {
                self.pool.trim_to(keep).unwrap();
                self.check_released_all_free(keep as u64, "trim_to");
            }
            Op::Sync => {
                self.pool.synchronize().unwrap();
                let t = self.pool.config().release_threshold as u64;
                self.check_released_all_free(t, "synchronize");
            }
            Op::ResetPeaks => {
                self.pool.reset_peaks();
                self.host().reset_peak();
                self.model.peak_bytes = self.model.current_bytes;
                self.model.peak_count = self.model.current_count;
            }
        }
        self.check();
    }

    pub fn alloc(&mut self, size: usize, align: usize, stream: Stream) {
        match self.pool.allocate(size, align, stream) {
            Ok(block) => {
                let rounded = model_round(size);
                assert_eq!(block.size(), size);
                assert_eq!(block.rounded_size() as u64, rounded, "size class of {size}");
                assert_eq!(block.addr() % align.max(512) as u64, 0, "alignment {align}");
                self.clock().record_alloc(block.addr(), rounded, stream);
                let m = &mut self.model;
                m.current_bytes += rounded;
                m.current_count += 1;
                m.peak_bytes = m.peak_bytes.max(m.current_bytes);
                m.peak_count = m.peak_count.max(m.current_count);
                m.requested += size as u64;
                m.allocations += 1;
                m.histogram.0[63 - (size as u64).leading_zeros() as usize] += 1;
                self.live.push(Live { block, stream, rounded });
            }
            Err(PoolError::OutOfMemory {
                requested,
                allocated,
                reserved,
                free_cached,
                largest_free_block,
            }) => {
                assert_eq!(requested, size);
                assert_eq!(allocated, self.model.current_bytes);
                assert_eq!(reserved, self.host().live_bytes());
                assert_eq!(free_cached, reserved - allocated);
                // Legitimate: nothing cached fits and the upstream cannot hold a minimal segment.
                let need = model_round(size) + align.max(512) as u64 - 512;
                assert!(
                    largest_free_block < need,
                    "OOM with a {largest_free_block} B block cached for {need}"
                );
                let minimal = if self.pool.expandable().is_some() {
                    // At most the chunks the block needs beyond its segment's free tail.
                    need.next_multiple_of(self.host().chunk_bytes() as u64)
                } else if need <= SMALL_LIMIT as u64 {
                    // Growth falls back to a segment of the small limit (`Segments::plan`; the
                    // normalized small segment size is never below it).
                    SMALL_LIMIT as u64
                } else {
                    need.next_multiple_of(2 << 20)
                };
                let room = self.host().capacity() - self.host().live_bytes();
                if !self.allow_errors {
                    assert!(room < minimal, "OOM with {room} B of upstream room for a {minimal} B segment");
                }
                self.check_released_all_free(0, "out-of-memory ladder");
                self.errors += 1;
            }
            Err(e) => {
                assert!(self.allow_errors, "unexpected error {e:?}");
                assert!(matches!(e, PoolError::Upstream(_) | PoolError::Ordering(_)), "{e:?}");
                self.errors += 1;
            }
        }
    }

    pub fn free(&mut self, i: usize, stream: Option<Stream>) {
        let l = self.live.swap_remove(i);
        let s = stream.unwrap_or(l.stream);
        self.clock().record_free(l.block.addr(), l.rounded, s);
        self.model.current_bytes -= l.rounded;
        self.model.current_count -= 1;
        self.model.requested -= l.block.size() as u64;
        self.pool.free(l.block, s).unwrap();
    }

    pub fn free_all(&mut self) {
        while !self.live.is_empty() {
            self.free(self.live.len() - 1, None);
        }
    }

    /// After a release step: if more than `keep` bytes stay cached, every segment holds a live block.
    fn check_released_all_free(&self, keep: u64, what: &str) {
        let s = self.pool.stats();
        if s.cached_bytes <= keep {
            return;
        }
        for (base, len) in self.pool.segments() {
            assert!(
                self.live.iter().any(|l| l.block.addr() >= base && l.block.addr() < base + len),
                "{what}: fully free segment {base:#x}+{len} kept with {} B cached > {keep}; cached ranges {:x?}, reservations {:x?}",
                s.cached_bytes,
                self.pool.cached_ranges(),
                self.host().reservations()
            );
        }
    }

    /// Every invariant, after every step.
    pub fn check(&self) {
        self.pool.validate().unwrap();
        {
            let c = self.clock();
            assert!(c.violations.is_empty(), "stream-safety violations: {:#?}", c.violations);
        }
        let host = self.host();
        assert!(host.violations().is_empty(), "upstream violations: {:?}", host.violations());
        // Segments are exactly what the upstream has live.
        let segs = self.pool.segments();
        let up: Vec<(u64, u64)> = host.live().into_iter().map(|(a, l)| (a, l as u64)).collect();
        assert_eq!(segs, up, "pool segments vs upstream live allocations");
        // Live blocks and cached ranges tile the segments: no overlap, nothing missing.
        let mut items: Vec<(u64, u64, bool)> =
            self.live.iter().map(|l| (l.block.addr(), l.rounded, true)).collect();
        let cached = self.pool.cached_ranges();
        items.extend(cached.iter().map(|&(a, l)| (a, l, false)));
        items.sort_unstable();
        let mut seg_iter = segs.iter().peekable();
        let mut cursor: Option<(u64, u64)> = None; // (segment end, next expected address)
        for &(addr, len, is_live) in &items {
            let (end, next) = match cursor {
                Some((end, next)) if next < end => (end, next),
                _ => {
                    let &(base, slen) = seg_iter.next().expect("block outside any segment");
                    (base + slen, base)
                }
            };
            assert_eq!(addr, next, "gap or overlap at {addr:#x} (live: {is_live})");
            assert!(addr + len <= end, "block {addr:#x}+{len} crosses its segment end {end:#x}");
            cursor = Some((end, addr + len));
        }
        if let Some((end, next)) = cursor {
            assert_eq!(next, end, "segment tail not accounted for");
        }
        assert!(seg_iter.next().is_none(), "a segment is neither live nor cached");
        // Statistics equal the model's.
        let s = self.pool.stats();
        let m = &self.model;
        assert_eq!(
            (s.current_bytes, s.current_count, s.peak_bytes, s.peak_count),
            (m.current_bytes, m.current_count, m.peak_bytes, m.peak_count),
            "current/peak bytes/count"
        );
        assert_eq!((s.requested_bytes, s.allocations_total), (m.requested, m.allocations));
        assert_eq!(s.histogram, m.histogram);
        assert_eq!(s.reserved_bytes, host.live_bytes());
        assert_eq!(s.peak_reserved_bytes, host.peak_live_bytes());
        assert_eq!(s.cached_bytes, s.reserved_bytes - s.current_bytes);
        // `segments()` lists an expandable segment's mapped runs; `stats().segments` counts it once.
        let reservations = host.reservations();
        let plain = segs.iter().filter(|&&(b, _)| !reservations.iter().any(|&(r, l, _)| b >= r && b < r + l));
        assert_eq!(s.segments as usize, plain.count() + reservations.len());
        assert_eq!((s.upstream_allocations, s.upstream_frees), (host.allocations(), host.deallocations()));
        let largest = cached.iter().map(|&(_, l)| l).max().unwrap_or(0);
        assert_eq!(s.largest_free_block, largest);
        let f = s.fragmentation();
        assert!((0.0..=1.0).contains(&f));
    }

    /// Frees everything, trims, and checks nothing leaked.
    pub fn finish(mut self) {
        self.free_all();
        self.check();
        self.pool.trim().unwrap();
        self.check();
        let s = self.pool.stats();
        assert_eq!((s.current_bytes, s.current_count, s.reserved_bytes, s.cached_bytes), (0, 0, 0, 0));
        assert_eq!(self.host().live_bytes(), 0);
        assert!(self.pool.segments().is_empty());
        assert!(self.host().reservations().is_empty(), "reservations left: {:?}", self.host().reservations());
    }
}

/// A simulator fault that fails the `nth` next call of `function` made on this thread, once, with
/// `CUDA_ERROR_UNKNOWN`.
pub fn fails_once_on_this_thread(function: &str, nth: u64) -> cumem_sys::sim_control::FaultRule {
    cumem_sys::sim_control::FaultRule {
        this_thread_only: true,
        ..cumem_sys::sim_control::FaultRule::nth_call(
            function,
            nth,
            cumem_sys::sys::CUresult::CUDA_ERROR_UNKNOWN,
        )
    }
}
