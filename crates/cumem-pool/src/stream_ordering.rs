//! CUDA streams as the caching pool's [`Ordering`]: events and stream waits.
//!
//! The pool names streams by [`StreamKey`]: the context and the never-reused [`Stream::id`]
//! (which stands for the driver handle; for the per-thread default stream, the thread), two
//! words, `Copy`. The
//! ordering keeps each named stream's [`StreamTail`], never the stream: a dropped stream's tail
//! holds the event its drop recorded just before destroying it, so memory freed on it can still
//! be waited for, and the pool keeps no stream alive. Another stream that takes memory freed on a
//! stream waits for an event: recorded on demand while that stream lives, the retired event once
//! it is gone. A free records none, with one exception: blocks a thread cache kept for a stream
//! that has no arena in the pool (its frees all went to thread caches, or the arena table is
//! full) are ordered, when the cache gives them up, by retiring that live stream
//! ([`Ordering::retire`] records an event on it), and join the retired streams' memory. Dropped
//! streams are forgotten lazily, when the pool sweeps ([`Ordering::orphans`] /
//! [`Ordering::retire`]): their retired events join one list that stands for every forgotten
//! stream. Registration is checked on every allocation and free, so it is made
//! cheap: a per-thread cache of the last stream registered.
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
//! drop(a); // the ordering does not keep it alive: only its tail stays
//! assert_eq!(ordering.orphans(), vec![ka]);
//! ordering.wait(kb, ka).unwrap(); // waits on the event a's drop recorded
//! ordering.retire(ka).unwrap();
//! ordering.wait(kb, StreamKey::RETIRED).unwrap(); // waits for every forgotten stream's work
//! ordering.synchronize().unwrap();
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering as AtomicOrdering};

use cumem_core::{Context, Error, ErrorContext, Event, Stream, StreamTail};
use parking_lot::{Mutex, RwLock};

use crate::{Ordering, UpstreamError};

/// `CU_STREAM_LEGACY`: another name of the context's legacy (NULL) stream.
const STREAM_LEGACY: u64 = 0x1;
/// `CU_STREAM_PER_THREAD`: the calling thread's per-thread default stream.
const STREAM_PER_THREAD: u64 = 0x2;

/// A stream as the pool names it: its context and which stream of it. An ordinary stream is
/// named by its [`Stream::id`], which is never reused (a real driver hands a destroyed stream's
/// handle to the next stream created, observed on an H100; the id tells the two apart) and so
/// stands for the handle too; the legacy stream (handle NULL or `CU_STREAM_LEGACY`) by id 0; the
/// per-thread default stream (handle `CU_STREAM_PER_THREAD`, one stream per thread under one
/// handle) by its thread, with the top bit set. Two words: the pool compares and hashes a key on
/// every allocation and free.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct StreamKey {
    ctx: u64,
    id: u64,
}

/// The stream's [`Stream::id`] (0 for the legacy stream): the number `DriverResource`,
/// `NativePoolResource` and `CachingResource` record (as a `u64`) in the `stream` field of their
/// `allocate`/`free` trace events, so a subscriber reading that field sees one name per stream
/// across allocators; a per-thread default stream's key says so, with its thread's tag. The
/// caching pool's `allocate_slow` span records the key through this `Debug` text: an `EnvFilter`
/// field-value directive (`[{stream=5}]`, which matches span fields only, never an event's)
/// compares a numeric literal only with fields recorded as numbers, so it does not select that
/// span; a directive naming the span (`[allocate_slow]`) does.
impl std::fmt::Debug for StreamKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.id & PER_THREAD_KEY != 0 {
            write!(f, "per-thread-{}", self.id & !PER_THREAD_KEY)
        } else {
            write!(f, "{}", self.id)
        }
    }
}

/// The bit of [`StreamKey::id`] marking a per-thread default stream's key (stream ids are a
/// counter and never reach it).
const PER_THREAD_KEY: u64 = 1 << 63;

impl std::hash::Hash for StreamKey {
    /// One word: contexts are distinct pointers and ids distinct counters, so folding them loses
    /// almost nothing; equality still compares both.
    #[inline(always)]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.id ^ self.ctx.rotate_left(29));
    }
}

thread_local! {
    /// A small number naming this thread (never 0), for per-thread default stream keys.
    static THREAD_TAG: u64 = {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        NEXT.fetch_add(1, AtomicOrdering::Relaxed)
    };
}

impl StreamKey {
    /// The name of memory cached for retired streams (see [`Ordering::retired_stream`]); no stream
    /// has it (every stream's context handle is non-null).
    pub const RETIRED: StreamKey = StreamKey { ctx: 0, id: 0 };

    /// The key of `stream`.
    #[inline(always)]
    pub fn of(stream: &Stream) -> Self {
        let ctx = stream.context().raw() as u64;
        match stream.raw() as u64 {
            STREAM_LEGACY => StreamKey { ctx, id: 0 },
            STREAM_PER_THREAD => StreamKey { ctx, id: PER_THREAD_KEY | THREAD_TAG.with(|t| *t) },
            // The legacy stream made by `Stream::legacy` (handle NULL) has id 0 too.
            _ => StreamKey { ctx, id: stream.id() },
        }
    }

    /// Whether this names a per-thread default stream (which only its own thread can order).
    pub fn is_per_thread(&self) -> bool {
        self.id & PER_THREAD_KEY != 0
    }
}

/// Orders CUDA streams (of any context) for the caching pool.
#[derive(Debug)]
pub struct StreamOrdering {
    ctx: Context,
    id: usize,
    /// Bumped whenever a stream is forgotten, so per-thread registration caches are re-checked.
    generation: AtomicU64,
    /// The tails of the streams the pool names, which never keep a stream alive.
    streams: RwLock<HashMap<StreamKey, Arc<StreamTail>>>,
    /// Events recorded on retired streams (forgotten ones, and live ones retired for a free the
    /// pool had no arena for) whose completion has not been seen yet.
    /// Shared (`Arc`) so that `synchronize` and `wait` wait for a snapshot without holding the
    /// lock, which `retire` takes under the pool's locks.
    retired: Mutex<Vec<Arc<Event>>>,
    /// What `retire` let go of (completed retired events, forgotten tails), kept here to be
    /// dropped by [`Ordering::drop_deferred`], `synchronize`, or a `wait` for memory of retired
    /// streams: `retire` runs under the pool's locks, and destroying an event makes driver calls
    /// (which may wait behind another thread's `cuMemFree`, driver brief §17) and logs a failure
    /// (a subscriber may read the pool's stats, which take those locks).
    deferred: Mutex<Deferred>,
}

/// See [`StreamOrdering::deferred`].
#[derive(Debug, Default)]
struct Deferred {
    events: Vec<Arc<Event>>,
    tails: Vec<Arc<StreamTail>>,
}

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

thread_local! {
    /// (ordering id, generation, key) of the last stream this thread registered.
    static LAST_REGISTERED: Cell<(usize, u64, StreamKey)> =
        const { Cell::new((0, 0, StreamKey::RETIRED)) };
}

/// An error for a stream the ordering does not know (a pool bug: the pool only names streams it
/// registered and has not retired).
fn unknown_stream(op: &'static str) -> UpstreamError {
    UpstreamError::Driver(Error::InvalidHandle { ctx: ErrorContext::op(op) })
}

impl StreamOrdering {
    /// An ordering whose pool allocates on `ctx`'s device (its streams may be of any context).
    pub fn new(ctx: &Context) -> Self {
        StreamOrdering {
            ctx: ctx.clone(),
            id: NEXT_ID.fetch_add(1, AtomicOrdering::Relaxed),
            generation: AtomicU64::new(0),
            streams: RwLock::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
            deferred: Mutex::new(Deferred::default()),
        }
    }

    /// Registers `stream` (keeping its tail, not the stream, until the pool retires it) and
    /// returns its key.
    #[inline(always)]
    pub fn register(&self, stream: &Stream) -> StreamKey {
        let key = StreamKey::of(stream);
        let generation = self.generation.load(AtomicOrdering::Acquire);
        if LAST_REGISTERED.get() == (self.id, generation, key) {
            return key;
        }
        self.register_slow(stream, key, generation)
    }

    #[inline(never)]
    fn register_slow(&self, stream: &Stream, key: StreamKey, generation: u64) -> StreamKey {
        if !self.streams.read().contains_key(&key) {
            self.streams.write().entry(key).or_insert_with(|| stream.tail().clone());
        }
        LAST_REGISTERED.set((self.id, generation, key));
        key
    }

    /// Whether `stream` is a per-thread default stream (which the pool cannot order from other
    /// threads), from its handle alone.
    #[inline(always)]
    pub(crate) fn is_per_thread(stream: &Stream) -> bool {
        stream.raw() as u64 == STREAM_PER_THREAD
    }

    fn tail(&self, key: StreamKey, op: &'static str) -> Result<Arc<StreamTail>, UpstreamError> {
        self.streams.read().get(&key).cloned().ok_or_else(|| unknown_stream(op))
    }

    /// The context whose device the pool allocates on.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Number of stream tails currently held (registered and not retired; dropped streams count
    /// until the pool sweeps).
    pub fn streams_held(&self) -> usize {
        self.streams.read().len()
    }

    /// Takes the events of retired streams whose work has completed out of `events`, for the
    /// caller to drop with no lock held.
    fn prune(events: &mut Vec<Arc<Event>>) -> Vec<Arc<Event>> {
        events.extract_if(.., |e| matches!(e.query(), Ok(true))).collect()
    }

    /// Drops what [`retire`](Ordering::retire) kept for later. Call with no lock held (of the
    /// pool or of this ordering).
    fn drop_deferred_now(&self) {
        // Taken out in a statement of its own: the guard, a temporary, lives to the end of the
        // statement that takes it, and the drops (driver calls, a warning whose subscriber may
        // come back here) must run after it.
        let deferred = std::mem::take(&mut *self.deferred.lock());
        drop(deferred);
    }
}

impl Ordering for StreamOrdering {
    type Stream = StreamKey;

    fn wait(&self, waiter: StreamKey, on: StreamKey) -> Result<(), UpstreamError> {
        if waiter == on {
            return Ok(());
        }
        let w = self.tail(waiter, "StreamOrdering::wait (waiter)")?;
        // A stream leaves the map only by retirement, which moves its retired event to the list
        // first: a key no longer held is covered by the list.
        let on = if on == StreamKey::RETIRED { None } else { self.streams.read().get(&on).cloned() };
        match on {
            // No tail is locked across a driver call: the event is recorded (or the retired one
            // taken) through `on`, then the wait queued through the waiter.
            Some(on) => {
                if let Some(event) = on.after_work()? {
                    w.wait(&event)?;
                }
                Ok(())
            }
            None => {
                let (events, done) = {
                    let mut events = self.retired.lock();
                    let done = Self::prune(&mut events);
                    (events.clone(), done)
                };
                drop(done);
                self.drop_deferred_now();
                for e in &events {
                    w.wait(e)?;
                }
                Ok(())
            }
        }
    }

    /// Synchronises every stream named (each on its own context; a dropped one through its
    /// retired event) and every forgotten stream's event: all the work that may still use memory
    /// the pool caches, on whichever device, and no other.
    fn synchronize(&self) -> Result<(), UpstreamError> {
        let tails: Vec<Arc<StreamTail>> = self.streams.read().values().cloned().collect();
        for t in &tails {
            t.synchronize()?;
        }
        drop(tails);
        // The events stay listed until they are known complete: a concurrent `wait` on the retired
        // name (which takes this lock) must never find the list empty while their work still runs.
        // The wait itself holds no lock, so such a `wait` is never stuck behind it.
        let snapshot: Vec<Arc<Event>> = self.retired.lock().clone();
        for e in &snapshot {
            e.synchronize()?;
        }
        let done: Vec<Arc<Event>> = self
            .retired
            .lock()
            .extract_if(.., |e| snapshot.iter().any(|done| Arc::ptr_eq(e, done)))
            .collect();
        drop((done, snapshot));
        self.drop_deferred_now();
        Ok(())
    }

    fn retired_stream(&self) -> Option<StreamKey> {
        Some(StreamKey::RETIRED)
    }

    /// Streams the program has dropped (legacy handles never die, and any code can name them
    /// again).
    fn orphans(&self) -> Vec<StreamKey> {
        self.streams.read().iter().filter(|(_, t)| !t.is_legacy() && !t.is_alive()).map(|(&k, _)| k).collect()
    }

    fn retire(&self, key: StreamKey) -> Result<(), UpstreamError> {
        // Asked with the map unlocked: `after_work` makes driver calls that may wait (behind
        // another thread's `cuMemFree`, §17 of the driver brief) and may destroy the stream as its
        // handle's last holder, and every allocation on a stream new to the pool reads the map.
        let Some(tail) = self.streams.read().get(&key).cloned() else { return Ok(()) };
        // A live stream (a caller retiring one the program still uses) gets its event now.
        // Cloned, not taken: a `wait` that looked the tail up before this still finds the event.
        let alive = tail.is_alive();
        // A dropped stream's tail answers its retired event, `None` when its drop synchronised
        // it, or an error when its drop could do neither: then nothing tells when its work ends,
        // and the stream stays unretired (its memory is reused by no other stream).
        let event = tail.after_work()?;
        if let Some(event) = event {
            let done = {
                let mut events = self.retired.lock();
                let done = Self::prune(&mut events);
                events.push(event);
                done
            };
            // Not dropped here: the pool's sweep calls this under its locks.
            self.deferred.lock().events.extend(done);
        }
        if alive {
            // The program still uses the stream, maybe on another thread between its registration
            // and a `wait` that looks its tail up: keep the tail (the sweep removes it once the
            // stream is dropped), and keep every thread's registration cache valid.
            return Ok(());
        }
        // Removed only now that its event is listed: a `wait` that finds the key gone is covered
        // by the list. (Keys are never reused, so the entry is still this tail's, or already gone
        // by a concurrent retirement of the same stream.)
        let removed = self.streams.write().remove(&key);
        if removed.is_some() {
            self.generation.fetch_add(1, AtomicOrdering::Release);
        }
        // The tail may be the last holder of its context: dropped later, as the events are.
        let mut deferred = self.deferred.lock();
        deferred.tails.push(tail);
        deferred.tails.extend(removed);
        Ok(())
    }

    fn drop_deferred(&self) {
        self.drop_deferred_now();
    }
}
