//! An adaptor that logs every allocate and free of any resource as one CSV row, in the format of
//! RMM's `logging_resource_adaptor` ([`trace_format`](crate::trace_format)), so that a workload's
//! allocations can be replayed later against another resource, here or in RMM.
//!
//! The hot path only takes the time and pushes a small record onto a bounded queue (it waits only
//! when 65,536 rows are waiting to be written); a background thread formats the rows and writes them
//! through a buffer. [`flush`](LoggingResource::flush) waits until
//! every row pushed so far is written and flushed; dropping the adaptor does the same. An I/O error
//! is logged (`tracing::warn`, once) and counted, never raised in the program's allocations.
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use cumem_core::{AllocLayout, Allocation, Context, DeviceResource, Error, Result, Stream};

use crate::trace_format::{TraceAction, TraceRecord, write_header};

/// Bytes the writer thread buffers before writing to its output.
const WRITE_BUFFER: usize = 64 << 10;
/// Rows queued for the writer at most: a program that allocates faster than its log can be written
/// waits for the writer rather than growing the queue without bound (or losing rows a replay needs).
const QUEUE: usize = 1 << 16;

/// What the hot path sends to the writer thread.
enum Message {
    Row(TraceRecord),
    /// Write and flush everything received so far, then answer with the flush's outcome.
    Flush(mpsc::SyncSender<io::Result<()>>),
}

/// Logs every allocation and free made through it, then forwards them to the wrapped resource.
pub struct LoggingResource<R: ?Sized> {
    inner: Arc<R>,
    /// `None` only during drop, which closes the channel so the writer finishes.
    tx: Option<SyncSender<Message>>,
    writer: Option<JoinHandle<()>>,
    io_errors: Arc<AtomicU64>,
}

impl<R: DeviceResource + ?Sized> LoggingResource<R> {
    /// Wraps `inner`, writing the log (header first) to `out` from a background thread.
    ///
    /// # Errors
    /// The background thread could not be started.
    pub fn new(inner: Arc<R>, out: impl Write + Send + 'static) -> io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let io_errors = Arc::new(AtomicU64::new(0));
        let errors = io_errors.clone();
        let writer = std::thread::Builder::new()
            .name("cumem-log-writer".into())
            .spawn(move || write_rows(rx, BufWriter::with_capacity(WRITE_BUFFER, out), &errors))?;
        Ok(LoggingResource { inner, tx: Some(tx), writer: Some(writer), io_errors })
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
    pub fn flush(&self) -> io::Result<()> {
        let (ack, done) = mpsc::sync_channel(1);
        let gone = || io::Error::other("the log writer thread has stopped");
        self.tx.as_ref().ok_or_else(gone)?.send(Message::Flush(ack)).map_err(|_| gone())?;
        done.recv().map_err(|_| gone())?
    }

    /// Writes and flushes that failed so far (each is logged once with `tracing::warn`).
    pub fn io_errors(&self) -> u64 {
        self.io_errors.load(Ordering::Relaxed)
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
        // The writer outlives every sender but the one drop takes, so a send fails only if the
        // writer thread panicked; the row is then lost, which `flush` reports.
        if let Some(tx) = &self.tx {
            let _ = tx.send(Message::Row(record));
        }
    }
}

/// A small number naming the calling thread, stable for its lifetime (RMM writes a hash of the
/// thread id; replay only needs rows of one thread to share a number).
fn thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static NUMBER: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    NUMBER.with(|n| *n)
}

/// The writer thread: header, then rows until every sender is gone, then a last flush.
fn write_rows(rx: Receiver<Message>, mut out: BufWriter<impl Write>, errors: &AtomicU64) {
    let mut warned = false;
    let mut note = |result: io::Result<()>| -> io::Result<()> {
        if let Err(e) = &result {
            errors.fetch_add(1, Ordering::Relaxed);
            if !warned {
                warned = true;
                tracing::warn!(error = %e, "writing the allocation log failed; rows are being lost");
            }
        }
        result
    };
    let _ = note(write_header(&mut out));
    for message in rx {
        match message {
            Message::Row(record) => {
                let _ = note(record.write_csv(&mut out));
            }
            Message::Flush(ack) => {
                let _ = ack.send(note(out.flush()));
            }
        }
    }
    let _ = note(out.flush());
}

impl<R: ?Sized> Drop for LoggingResource<R> {
    fn drop(&mut self) {
        // Closing the channel lets the writer drain it, flush and stop.
        drop(self.tx.take());
        if let Some(writer) = self.writer.take()
            && writer.join().is_err()
        {
            tracing::warn!("the allocation log writer panicked; the end of the log may be lost");
        }
    }
}

impl<R: fmt::Debug + ?Sized> fmt::Debug for LoggingResource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoggingResource")
            .field("inner", &self.inner)
            .field("io_errors", &self.io_errors.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

// SAFETY: forwards every request unchanged to the wrapped resource, which upholds the contract;
// logging only reads the request and the result.
unsafe impl<R: DeviceResource + ?Sized> DeviceResource for LoggingResource<R> {
    fn context(&self) -> &Context {
        self.inner.context()
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
