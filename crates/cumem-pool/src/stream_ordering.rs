//! CUDA streams as the caching pool's [`Ordering`]: events and stream waits.
//!
//! The pool names streams by [`StreamKey`] (the driver handle), a small `Copy` value; this keeps
//! every [`Stream`] it has seen alive in a registry, so a handle cannot be destroyed and reused
//! while blocks freed on it may still be waited for. Registration is checked on every allocation
//! and free, so it is made cheap: a per-thread cache of the last stream registered.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, Stream};
//! use cumem_pool::{Ordering, StreamKey, StreamOrdering};
//! let ctx = Device::get(0)?.context()?;
//! let (a, b) = (Stream::non_blocking(&ctx)?, Stream::non_blocking(&ctx)?);
//! let ordering = StreamOrdering::new(&ctx);
//! let (ka, kb) = (ordering.register(&a), ordering.register(&b));
//! assert_ne!(ka, kb);
//! ordering.wait(kb, ka).unwrap(); // later work on b waits for a's work so far
//! ordering.synchronize().unwrap();
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};

use cumem_core::{Context, Error, Stream};
use parking_lot::RwLock;

use crate::{Ordering, UpstreamError};

/// A stream as the pool names it: its driver handle (0 for the legacy stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamKey(pub u64);

impl StreamKey {
    /// The key of `stream`.
    pub fn of(stream: &Stream) -> Self {
        StreamKey(stream.raw() as u64)
    }
}

/// Orders CUDA streams of one context for the caching pool.
#[derive(Debug)]
pub struct StreamOrdering {
    ctx: Context,
    id: usize,
    streams: RwLock<HashMap<StreamKey, Stream>>,
}

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

thread_local! {
    /// (ordering id, key) of the last stream this thread registered.
    static LAST_REGISTERED: Cell<(usize, StreamKey)> = const { Cell::new((0, StreamKey(0))) };
}

thread_local! {
    /// The full error behind the last `UpstreamError` made on this thread: the pool's error type
    /// carries only a code, and the pool calls its upstream and ordering on the caller's thread, so
    /// the resource can hand the caller the original error.
    static LAST_ERROR: std::cell::RefCell<Option<Error>> = const { std::cell::RefCell::new(None) };
}

pub(crate) fn to_upstream_error(e: &Error) -> UpstreamError {
    LAST_ERROR.with_borrow_mut(|last| *last = Some(e.clone()));
    match e {
        Error::OutOfMemory { .. } => UpstreamError::OutOfMemory,
        other => UpstreamError::Other(other.code().map_or(-1, |c| c as i32)),
    }
}

/// The error behind the last upstream or ordering failure on this thread, if any.
pub(crate) fn take_last_error() -> Option<Error> {
    LAST_ERROR.with_borrow_mut(Option::take)
}

impl StreamOrdering {
    /// An ordering for the streams of `ctx`.
    pub fn new(ctx: &Context) -> Self {
        StreamOrdering {
            ctx: ctx.clone(),
            id: NEXT_ID.fetch_add(1, AtomicOrdering::Relaxed),
            streams: RwLock::new(HashMap::new()),
        }
    }

    /// Registers `stream` (keeping it alive for as long as the ordering lives) and returns its key.
    #[inline]
    pub fn register(&self, stream: &Stream) -> StreamKey {
        let key = StreamKey::of(stream);
        if LAST_REGISTERED.get() == (self.id, key) {
            return key;
        }
        if !self.streams.read().contains_key(&key) {
            self.streams.write().entry(key).or_insert_with(|| stream.clone());
        }
        LAST_REGISTERED.set((self.id, key));
        key
    }

    fn stream(&self, key: StreamKey) -> Result<Stream, UpstreamError> {
        self.streams.read().get(&key).cloned().ok_or(UpstreamError::Other(-1))
    }

    /// The context whose streams this orders.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

impl Ordering for StreamOrdering {
    type Stream = StreamKey;

    fn wait(&self, waiter: StreamKey, on: StreamKey) -> Result<(), UpstreamError> {
        let (waiter, on) = (self.stream(waiter)?, self.stream(on)?);
        waiter.wait_for(&on).map_err(|e| to_upstream_error(&e))
    }

    fn synchronize(&self) -> Result<(), UpstreamError> {
        self.ctx.synchronize().map_err(|e| to_upstream_error(&e))
    }
}
