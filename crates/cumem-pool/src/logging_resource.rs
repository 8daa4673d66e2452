//! An adaptor that logs every allocate and free of any resource as one CSV row, in the format of
//! RMM's `logging_resource_adaptor` ([`trace_format`](crate::trace_format)), so that a workload's
//! allocations can be replayed later against another resource, here or in RMM.
//!
//! The hot path only takes the time and pushes a small record onto a queue under an uncontended
//! lock: no system call, no formatting. A background thread takes the whole queue at once every few
//! milliseconds (sooner when it fills), formats the rows and writes them through a buffer; a program
//! that allocates faster than its log can be written waits once 65,536 rows are queued, rather than
//! growing the queue without bound or losing rows a replay needs.
//! [`flush`](LoggingResource::flush) waits until every row pushed so far is written and flushed;
//! dropping the adaptor does the same. An I/O error is logged (`tracing::warn`, once per run of
//! failures) and counted, never raised in the program's allocations; should the writer thread
//! stop (an output whose `write` panics), later rows are dropped and counted the same way, so the
//! queue never grows without bound.
//!
//! The writer thread emits warnings itself, so a subscriber may run on it. Nothing there waits
//! for the writer: [`flush`](LoggingResource::flush) on it fails at once
//! ([`io::ErrorKind::Deadlock`]), a row logged on it (a subscriber allocating through the adaptor)
//! that finds the queue full is dropped and counted like a row the writer can no longer write,
//! and dropping the adaptor's last handle on it lets the writer finish the log after the
//! subscriber returns, instead of joining itself.
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DeviceBuffer, DriverResource, Stream};
//! use cumem_pool::trace_format::{TraceAction, parse_trace};
//! use cumem_pool::{LoggingResource, StatisticsResource};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! let path = std::env::temp_dir().join(format!("cumem-doc-{}.csv", std::process::id()));
//! // Logging over statistics over the driver: each adaptor sees every request.
//! let stats = Arc::new(StatisticsResource::new(Arc::new(DriverResource::new(&ctx))));
//! let log = Arc::new(LoggingResource::to_file(stats.clone(), &path).expect("a writable temp dir"));
//! let buf = DeviceBuffer::<u32>::zeroed_in(&log, &stream, 250)?;
//! let ptr = buf.device_ptr();
//! drop(buf);
//! log.flush().expect("the log is written");
//! let rows = parse_trace(std::io::BufReader::new(std::fs::File::open(&path).unwrap())).unwrap();
//! let seen: Vec<_> = rows.iter().map(|r| (r.action, r.pointer, r.size)).collect();
//! assert_eq!(seen, [(TraceAction::Allocate, ptr, 1000), (TraceAction::Free, ptr, 1000)]);
//! assert_eq!(stats.counters().total_bytes, 1000);
//! # drop(log);
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::Arc;
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cumem_core::{AllocLayout, Allocation, Context, DeviceResource, Error, Result, Stream};
use parking_lot::{Condvar, Mutex};

use crate::trace_format::{TraceAction, TraceRecord, write_header};

/// Bytes the writer thread buffers before writing to its output.
const WRITE_BUFFER: usize = 64 << 10;
/// Rows queued at most; a thread that would queue more waits for the writer.
const QUEUE: usize = 1 << 16;
/// Rows queued at which the writer is woken before its next round.
const WAKE_AT: usize = QUEUE / 4;
/// How often a writer with rows to write takes the queue without being woken.
const ROUND: Duration = Duration::from_millis(10);

/// What the hot path, `flush` and the writer share.
#[derive(Default)]
struct Queue {
    state: Mutex<State>,
    /// Wakes the writer: the queue filled, a flush is wanted, the adaptor is closing, or the
    /// first row after the writer went idle.
    wake: Condvar,
    /// Wakes threads waiting for room in the queue or for a flush.
    progress: Condvar,
}

#[derive(Default)]
struct State {
    rows: Vec<TraceRecord>,
    /// Flushes asked for so far, and how many of them the writer has done.
    flushes_wanted: u64,
    flushes_done: u64,
    /// The outcome of the writer's last flush, as kind and message (an `io::Error` is not `Clone`).
    last_flush: Option<(io::ErrorKind, String)>,
    /// Writes and flushes that failed, and rows dropped unwritten.
    io_errors: u64,
    /// Rows dropped unwritten: the writer had stopped, or the row was logged on the writer thread
    /// with the queue full.
    lost_rows: u64,
    /// Whether each cause of lost rows was warned about (the writer stopped; a full queue on the
    /// writer thread): once per cause, so a subscriber that allocates cannot recurse.
    warned_gone: bool,
    warned_full: bool,
    /// The writer sleeps without a timeout until a row arrives.
    writer_idle: bool,
    writer_gone: bool,
    closing: bool,
}

/// Logs every allocation and free made through it, then forwards them to the wrapped resource.
pub struct LoggingResource<R: ?Sized> {
    inner: Arc<R>,
    queue: Arc<Queue>,
    writer: Option<JoinHandle<()>>,
    /// The writer thread, on which nothing may wait for the writer.
    writer_id: ThreadId,
}

impl<R: DeviceResource + ?Sized> LoggingResource<R> {
    /// Wraps `inner`, writing the log (header first) to `out` from a background thread.
    ///
    /// # Errors
    /// The background thread could not be started.
    pub fn new(inner: Arc<R>, out: impl Write + Send + 'static) -> io::Result<Self> {
        let queue = Arc::new(Queue::default());
        let shared = queue.clone();
        let writer = std::thread::Builder::new()
            .name("cumem-log-writer".into())
            .spawn(move || write_rows(&shared, BufWriter::with_capacity(WRITE_BUFFER, out)))?;
        let writer_id = writer.thread().id();
        Ok(LoggingResource { inner, queue, writer: Some(writer), writer_id })
    }

    /// Wraps `inner`, writing the log to a new file at `path` (truncated if it exists).
    ///
    /// # Errors
    /// The file could not be created, or the background thread could not be started.
    pub fn to_file(inner: Arc<R>, path: impl AsRef<Path>) -> io::Result<Self> {
        Self::new(inner, File::create(path)?)
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &Arc<R> {
        &self.inner
    }

    /// Waits until every row logged so far is written and the output flushed.
    ///
    /// # Errors
    /// The output's flush failed (the rows it held may be lost), or the writer thread is gone.
    /// Called on the writer thread itself (a tracing subscriber reacting to the writer's
    /// warning), an error of kind [`io::ErrorKind::Deadlock`] at once: only that thread could
    /// do the flush waited for.
    pub fn flush(&self) -> io::Result<()> {
        if self.on_writer() {
            return Err(io::Error::new(
                io::ErrorKind::Deadlock,
                "flushing the allocation log from its own writer thread (a subscriber of its warning)",
            ));
        }
        let mut st = self.queue.state.lock();
        st.flushes_wanted += 1;
        let mine = st.flushes_wanted;
        self.queue.wake.notify_one();
        while st.flushes_done < mine && !st.writer_gone {
            self.queue.progress.wait(&mut st);
        }
        if st.flushes_done < mine {
            return Err(io::Error::other("the log writer thread has stopped"));
        }
        match &st.last_flush {
            Some((kind, message)) => Err(io::Error::new(*kind, message.clone())),
            None => Ok(()),
        }
    }

    /// Writes and flushes that failed so far (each run of failures is logged with `tracing::warn`),
    /// and rows dropped unwritten because the writer thread had stopped (it panicked in the
    /// output's `write`) or because they were logged on the writer thread itself while the queue
    /// was full: each of those counts as one failed write.
    pub fn io_errors(&self) -> u64 {
        self.queue.state.lock().io_errors
    }

    #[inline]
    fn log(&self, action: TraceAction, pointer: u64, size: usize, stream: &Stream) {
        let record = TraceRecord {
            thread: thread_number(),
            time: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
            action,
            pointer,
            size,
            stream: stream.raw() as usize as u64,
        };
        let mut st = self.queue.state.lock();
        let mut lost = st.writer_gone;
        if st.rows.len() >= QUEUE && !st.writer_gone {
            if self.on_writer() {
                // Logged by a subscriber on the writer thread: only this thread makes room.
                lost = true;
            } else {
                self.wait_for_room(&mut st);
                lost = st.writer_gone;
            }
        }
        if lost {
            // Nobody will write it: keeping it would grow the queue for as long as the program
            // runs (or, on the writer thread, wait for itself). It counts as a failed write
            // instead.
            let gone = st.writer_gone;
            let first = Self::lose(&mut st, gone);
            drop(st);
            if first {
                // Not under the queue's lock: a subscriber may call `io_errors`, `flush` or
                // allocate through this adaptor (on the writer thread, neither waits: see the
                // module's docs). Warned once, so a subscriber that allocates here cannot recurse.
                if gone {
                    tracing::warn!("the allocation log writer has stopped; rows are being lost");
                } else {
                    tracing::warn!(
                        "a row logged on the allocation log's own writer thread found the queue full; rows are being lost"
                    );
                }
            }
            return;
        }
        st.rows.push(record);
        if st.writer_idle || st.rows.len() == WAKE_AT {
            st.writer_idle = false;
            self.queue.wake.notify_one();
        }
    }

    /// Counts a row dropped unwritten (`gone`: because the writer stopped); true for the first of
    /// its cause, which the caller warns about once it has let go of the queue's lock.
    #[cold]
    fn lose(st: &mut State, gone: bool) -> bool {
        st.lost_rows += 1;
        st.io_errors += 1;
        let warned = if gone { &mut st.warned_gone } else { &mut st.warned_full };
        !std::mem::replace(warned, true)
    }

    /// Whether the calling thread is the writer (only asked on paths that would wait for it).
    #[cold]
    fn on_writer(&self) -> bool {
        std::thread::current().id() == self.writer_id
    }

    #[cold]
    fn wait_for_room(&self, st: &mut parking_lot::MutexGuard<'_, State>) {
        self.queue.wake.notify_one();
        while st.rows.len() >= QUEUE && !st.writer_gone {
            self.queue.progress.wait(st);
        }
    }
}

/// A small number naming the calling thread, stable for its lifetime (RMM writes a hash of the
/// thread id; replay only needs rows of one thread to share a number).
fn thread_number() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static NUMBER: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    NUMBER.with(|n| *n)
}

/// Marks the writer gone however it ends, so `flush` and full queues never wait for it forever.
struct Gone<'a>(&'a Queue);

impl Drop for Gone<'_> {
    fn drop(&mut self) {
        self.0.state.lock().writer_gone = true;
        self.0.progress.notify_all();
    }
}

/// The writer thread: the header, then rounds of taking the whole queue and writing it, flushing
/// when asked and when closing.
fn write_rows(queue: &Queue, mut out: BufWriter<impl Write>) {
    let _gone = Gone(queue);
    let mut failing = false;
    let mut note = |result: io::Result<()>, errors: &mut u64| -> io::Result<()> {
        match &result {
            Err(e) => {
                *errors += 1;
                if !failing {
                    failing = true;
                    tracing::warn!(error = %e, "writing the allocation log failed; rows are being lost");
                }
            }
            Ok(()) => failing = false,
        }
        result
    };
    let mut errors = 0;
    let _ = note(write_header(&mut out), &mut errors);
    let mut batch = Vec::new();
    loop {
        let (flush, closing) = {
            let mut st = queue.state.lock();
            st.io_errors += std::mem::take(&mut errors);
            while st.rows.is_empty() && st.flushes_wanted == st.flushes_done && !st.closing {
                if st.writer_idle {
                    queue.wake.wait(&mut st);
                } else if queue.wake.wait_for(&mut st, ROUND).timed_out() && st.rows.is_empty() {
                    // Nothing came for a round: sleep until a row arrives (its thread wakes us).
                    st.writer_idle = true;
                }
            }
            std::mem::swap(&mut batch, &mut st.rows);
            queue.progress.notify_all(); // room in the queue
            (st.flushes_wanted, st.closing)
        };
        for record in batch.drain(..) {
            let _ = note(record.write_csv(&mut out), &mut errors);
        }
        let mut st_flush = None;
        let done = queue.state.lock().flushes_done;
        if flush > done || closing {
            st_flush = Some(note(out.flush(), &mut errors));
        }
        let mut st = queue.state.lock();
        st.io_errors += std::mem::take(&mut errors);
        if let Some(result) = st_flush {
            st.last_flush = result.err().map(|e| (e.kind(), e.to_string()));
            st.flushes_done = flush;
            queue.progress.notify_all();
        }
        if closing && st.rows.is_empty() {
            return;
        }
    }
}

impl<R: ?Sized> Drop for LoggingResource<R> {
    fn drop(&mut self) {
        self.queue.state.lock().closing = true;
        self.queue.wake.notify_one();
        let Some(writer) = self.writer.take() else { return };
        if std::thread::current().id() == self.writer_id {
            // The last handle dropped by a subscriber on the writer thread: a thread cannot join
            // itself. Detached; once the subscriber returns, the writer sees `closing`, writes
            // and flushes what is queued, and ends.
            tracing::debug!("allocation log dropped on its own writer thread; the writer finishes it");
            drop(writer);
            return;
        }
        if writer.join().is_err() {
            tracing::warn!("the allocation log writer panicked; the end of the log may be lost");
        }
    }
}

impl<R: fmt::Debug + ?Sized> fmt::Debug for LoggingResource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoggingResource")
            .field("inner", &self.inner)
            .field("io_errors", &self.queue.state.lock().io_errors)
            .finish_non_exhaustive()
    }
}

// SAFETY: forwards every request unchanged to the wrapped resource, which upholds the contract;
// logging only reads the request and the result.
unsafe impl<R: DeviceResource + ?Sized> DeviceResource for LoggingResource<R> {
    fn context(&self) -> &Context {
        self.inner.context()
    }

    fn usable_on_every_stream_at_once(&self) -> bool {
        self.inner.usable_on_every_stream_at_once()
    }

    fn cache_usage(&self) -> Option<cumem_core::CacheUsage> {
        self.inner.cache_usage()
    }

    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> Result<Allocation> {
        match self.inner.allocate(layout, stream) {
            Ok(allocation) => {
                self.log(TraceAction::Allocate, allocation.ptr, layout.bytes, stream);
                Ok(allocation)
            }
            Err(e) => {
                if matches!(e, Error::OutOfMemory { .. }) {
                    self.log(TraceAction::AllocateFailure, 0, layout.bytes, stream);
                }
                Err(e)
            }
        }
    }

    unsafe fn deallocate(&self, allocation: Allocation, layout: AllocLayout, stream: &Stream) {
        // Logged before the memory goes back, so that a thread reusing the address logs its
        // allocation after this free.
        self.log(TraceAction::Free, allocation.ptr, layout.bytes, stream);
        // SAFETY: forwarded unchanged from our caller, who upholds the contract.
        unsafe { self.inner.deallocate(allocation, layout, stream) }
    }
}
