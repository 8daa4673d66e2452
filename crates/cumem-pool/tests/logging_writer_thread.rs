//! The logging adaptor's writer thread emits warnings itself (a failing output), so a subscriber
//! runs on it. What that subscriber does with the adaptor must not wait for the writer, which is
//! busy running it: a flush fails at once (`ErrorKind::Deadlock`), a row logged while the queue is
//! full is dropped and counted, and dropping the adaptor's last handle there does not join the
//! thread to itself. Its own binary: the subscriber is the process's global default (the writer
//! is another thread). Under a watchdog, since each of these would otherwise hang.

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cumem_core::{AllocLayout, Allocation, Context, Device, DeviceResource, Stream};
use cumem_pool::LoggingResource;
use cumem_sys::testing;
use parking_lot::Mutex;

/// Hands out addresses and takes them back: rows for the log, no device memory.
#[derive(Debug)]
struct Addresses {
    ctx: Context,
    next: AtomicU64,
}

// SAFETY: never hands out memory anyone uses (this test only logs the calls); each address is
// new, so no two allocations overlap.
unsafe impl DeviceResource for Addresses {
    fn context(&self) -> &Context {
        &self.ctx
    }
    fn allocate(&self, _: AllocLayout, _: &Stream) -> cumem_core::Result<Allocation> {
        Ok(Allocation::from_ptr(self.next.fetch_add(512, Relaxed)))
    }
    unsafe fn deallocate(&self, _: Allocation, _: AllocLayout, _: &Stream) {}
}

/// An output whose every write fails.
struct Failing;

impl Write for Failing {
    fn write(&mut self, _: &[u8]) -> io::Result<usize> {
        Err(io::Error::other("disk on fire"))
    }
    fn flush(&mut self) -> io::Result<()> {
        Err(io::Error::other("disk on fire"))
    }
}

type Log = LoggingResource<Addresses>;

/// What the subscriber saw on the writer thread: the flush's error kind, and the error count
/// before and after it logged more rows than the queue holds.
type Seen = (Option<io::ErrorKind>, u64, u64);

/// The adaptor, handed to the subscriber once the test has let go of its own handle.
static LOG: Mutex<Option<Arc<Log>>> = Mutex::new(None);
static DONE: OnceLock<Mutex<Sender<Seen>>> = OnceLock::new();

/// Rows the subscriber logs: more than the adaptor's queue holds (65,536).
const ROWS: usize = 70_000;

fn on_writer_warning() {
    static FIRED: AtomicBool = AtomicBool::new(false);
    if FIRED.swap(true, Relaxed) {
        return;
    }
    // Wait for the test to hand the adaptor over (the last handle).
    let deadline = Instant::now() + Duration::from_secs(30);
    let log = loop {
        if let Some(log) = LOG.lock().take() {
            break log;
        }
        assert!(Instant::now() < deadline, "the test never handed the adaptor over");
        std::thread::sleep(Duration::from_millis(1));
    };
    let flushed = log.flush().err().map(|e| e.kind());
    let before = log.io_errors();
    let stream = Stream::legacy(log.inner().context());
    let layout = AllocLayout::new(512, 256).unwrap();
    for _ in 0..ROWS {
        log.allocate(layout, &stream).unwrap();
    }
    let after = log.io_errors();
    drop(log); // the last handle, on the writer thread
    DONE.get().unwrap().lock().send((flushed, before, after)).unwrap();
}

#[test]
fn a_subscriber_on_the_writer_thread_flushes_logs_and_drops_without_waiting_for_it() {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let (done, seen) = channel();
    DONE.set(Mutex::new(done)).unwrap();
    tracing::subscriber::set_global_default(testing::OnEvent(|event: &tracing::Event<'_>| {
        if std::thread::current().name() == Some("cumem-log-writer")
            && testing::event_message(event).starts_with("writing the allocation log failed")
        {
            on_writer_warning();
        }
    }))
    .unwrap();
    let (c, c2) = (ctx.clone(), ctx.clone());
    testing::within_watchdog("a subscriber using the adaptor on its writer thread", move || {
        let log = Arc::new(
            LoggingResource::new(Arc::new(Addresses { ctx: c, next: AtomicU64::new(1 << 20) }), Failing)
                .unwrap(),
        );
        // More rows than the writer's 64 KiB buffer holds: its first write to the output fails
        // and warns on the writer thread, where the subscriber waits for the handle below (so
        // this thread must not wait for the writer before handing it over).
        let stream = Stream::legacy(&c2);
        let layout = AllocLayout::new(512, 256).unwrap();
        for _ in 0..4096 {
            log.allocate(layout, &stream).unwrap();
        }
        *LOG.lock() = Some(log);
        let (flushed, before, after) =
            seen.recv_timeout(Duration::from_secs(50)).expect("the subscriber finished");
        assert_eq!(flushed, Some(io::ErrorKind::Deadlock), "a flush on the writer thread");
        // The rows beyond the queue's 65,536 (fewer, if some of this thread's rows were still
        // queued) were dropped and counted instead of waiting for the writer.
        let lost = after - before;
        assert!((ROWS - (1 << 16)) as u64 <= lost && lost <= ROWS as u64, "{lost} rows found the queue full");
    });
    drop(ctx);
    if let Some(ctl) = testing::sim_control() {
        assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
        let live = ctl.live_report();
        assert!(live.is_clean(), "{live}");
    }
}
