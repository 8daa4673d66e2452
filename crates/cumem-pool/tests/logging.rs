//! The logging adaptor writes RMM's CSV log through its background writer: what it writes reads
//! back with `parse_trace` (sizes, order, pointers, streams), on `flush` and on drop; a failing
//! output is counted, never a panic.

use std::io::{self, Write};
use std::sync::Arc;

use cumem_core::{Device, DeviceBuffer, Stream};
use cumem_pool::trace_format::{TraceAction, TraceRecord, parse_trace};
use cumem_pool::{CachingResource, LimitingResource, LoggingResource, PoolConfig};
use cumem_sys::testing;
use parking_lot::Mutex;
use serial_test::parallel;

/// An output the test can read while the adaptor still owns the writer.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Shared {
    fn rows(&self) -> Vec<TraceRecord> {
        parse_trace(self.0.lock().as_slice()).unwrap()
    }
}

fn pool() -> (Stream, Stream, Arc<CachingResource>) {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap(), pool)
}

#[test]
#[parallel]
fn the_log_reads_back_with_sizes_order_pointers_and_streams() {
    let (s1, s2, pool) = pool();
    let out = Shared::default();
    let log = Arc::new(LoggingResource::new(pool, out.clone()).unwrap());
    let a = DeviceBuffer::<u8>::zeroed_in(&log, &s1, 1000).unwrap();
    let b = DeviceBuffer::<u32>::zeroed_in(&log, &s2, 3000).unwrap();
    let (pa, pb) = (a.device_ptr(), b.device_ptr());
    drop(a);
    let c = DeviceBuffer::<u8>::zeroed_in(&log, &s2, 77).unwrap();
    let pc = c.device_ptr();
    drop((b, c));
    log.flush().unwrap();
    let rows = out.rows();
    let seen: Vec<_> = rows.iter().map(|r| (r.action, r.pointer, r.size, r.stream)).collect();
    let (h1, h2) = (s1.raw() as usize as u64, s2.raw() as usize as u64);
    use TraceAction::{Allocate, Free};
    assert_eq!(
        seen,
        [
            (Allocate, pa, 1000, h1),
            (Allocate, pb, 12000, h2),
            (Free, pa, 1000, h1),
            (Allocate, pc, 77, h2),
            (Free, pb, 12000, h2),
            (Free, pc, 77, h2),
        ]
    );
    assert!(rows.iter().all(|r| r.thread == rows[0].thread), "one thread made every call");
    assert!(rows.windows(2).all(|w| w[0].time <= w[1].time), "times never go back");
    assert_eq!(log.io_errors(), 0);
}

#[test]
#[parallel]
fn dropping_the_adaptor_flushes_the_file() {
    let (s, _, pool) = pool();
    let path = std::env::temp_dir().join(format!("cumem-logging-test-{}.csv", std::process::id()));
    let log = Arc::new(LoggingResource::to_file(pool, &path).unwrap());
    for bytes in [256, 1 << 20, 5] {
        drop(DeviceBuffer::<u8>::zeroed_in(&log, &s, bytes).unwrap());
    }
    drop(log);
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).ok();
    let rows = parse_trace(text.as_bytes()).unwrap();
    let sizes: Vec<_> = rows.iter().map(|r| (r.action, r.size)).collect();
    use TraceAction::{Allocate, Free};
    assert_eq!(
        sizes,
        [(Allocate, 256), (Free, 256), (Allocate, 1 << 20), (Free, 1 << 20), (Allocate, 5), (Free, 5)]
    );
}

#[test]
#[parallel]
fn threads_keep_their_own_order_and_numbers() {
    let (s, _, pool) = pool();
    let out = Shared::default();
    let log = Arc::new(LoggingResource::new(pool, out.clone()).unwrap());
    std::thread::scope(|scope| {
        for t in 0..4usize {
            let (log, s) = (&log, &s);
            scope.spawn(move || {
                for i in 1..=50 {
                    drop(DeviceBuffer::<u8>::zeroed_in(log, s, t * 1000 + i).unwrap());
                }
            });
        }
    });
    log.flush().unwrap();
    let rows = out.rows();
    assert_eq!(rows.len(), 4 * 50 * 2);
    let mut threads: Vec<u64> = rows.iter().map(|r| r.thread).collect();
    threads.sort_unstable();
    threads.dedup();
    assert_eq!(threads.len(), 4);
    for thread in threads {
        let sizes: Vec<_> = rows.iter().filter(|r| r.thread == thread).map(|r| r.size).collect();
        let first = sizes[0];
        let expected: Vec<_> = (0..50).flat_map(|i| [first + i, first + i]).collect();
        assert_eq!(sizes, expected, "each thread's rows in its own order");
    }
}

#[test]
#[parallel]
fn an_out_of_memory_is_logged_as_a_failure() {
    let (s, _, pool) = pool();
    let out = Shared::default();
    let capped = Arc::new(LimitingResource::new(pool, 4096));
    let log = Arc::new(LoggingResource::new(capped, out.clone()).unwrap());
    assert!(DeviceBuffer::<u8>::zeroed_in(&log, &s, 5000).is_err());
    log.flush().unwrap();
    let rows = out.rows();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].action, rows[0].pointer, rows[0].size), (TraceAction::AllocateFailure, 0, 5000));
}

/// An output that refuses every write.
struct Broken;

impl Write for Broken {
    fn write(&mut self, _: &[u8]) -> io::Result<usize> {
        Err(io::Error::other("disk full"))
    }
    fn flush(&mut self) -> io::Result<()> {
        Err(io::Error::other("disk full"))
    }
}

#[test]
#[parallel]
fn a_failing_output_is_counted_not_raised() {
    let (s, _, pool) = pool();
    let log = Arc::new(LoggingResource::new(pool, Broken).unwrap());
    let buf = DeviceBuffer::<u8>::zeroed_in(&log, &s, 100).unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![0; 100], "allocations work on");
    drop(buf);
    assert!(log.flush().is_err());
    assert!(log.io_errors() >= 1);
    drop(log); // the last flush fails too, and is only logged
}

/// An output whose every write panics, which stops the writer thread at its first row.
struct Panics;

impl Write for Panics {
    fn write(&mut self, _: &[u8]) -> io::Result<usize> {
        panic!("the output panicked (on purpose)")
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Once the writer has stopped, rows are dropped and counted, not queued for nobody: a long
/// program with a dead writer would otherwise grow the queue for every allocation it makes.
#[test]
#[parallel]
fn rows_after_the_writer_stopped_are_counted_as_lost_not_queued() {
    let (s, _, pool) = pool();
    let log = Arc::new(LoggingResource::new(pool, Panics).unwrap());
    // The header's write panics: `flush` returns once the writer is gone, whatever the timing.
    let err = log.flush().expect_err("the writer has stopped");
    assert!(err.to_string().contains("stopped"), "{err}");
    assert_eq!(log.io_errors(), 0);
    for i in 0..100 {
        let buf = DeviceBuffer::<u8>::zeroed_in(&log, &s, 1 + i).unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![0; 1 + i], "allocations work on");
    }
    assert_eq!(log.io_errors(), 200, "each allocate and free row is lost, and counted");
    drop(log); // joins the panicked writer: logged, not raised
}

/// The "rows are being lost" warning is logged with no lock of the adaptor held: a subscriber that
/// reads the adaptor's error count, flushes it or allocates through it on that event goes on.
#[test]
#[parallel]
fn a_subscriber_that_uses_the_adaptor_inside_the_lost_rows_warning_does_not_hang() {
    let (s, _, pool) = pool();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let log = Arc::new(LoggingResource::new(pool, Panics).unwrap());
    log.flush().expect_err("the writer has stopped");
    testing::within_watchdog("a row lost under a subscriber that uses the adaptor", move || {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let subscriber = {
            let (log, seen) = (log.clone(), seen.clone());
            testing::OnEvent(move |event: &tracing::Event<'_>| {
                if testing::event_message(event)
                    == "the allocation log writer has stopped; rows are being lost"
                {
                    let errors = log.io_errors();
                    assert!(log.flush().is_err());
                    let stream = Stream::new(&ctx).unwrap();
                    let buf = DeviceBuffer::<u8>::zeroed_in(&log, &stream, 10).unwrap();
                    assert_eq!(buf.to_vec().unwrap(), [0; 10]);
                    drop(buf);
                    seen.lock().push(errors);
                }
            })
        };
        cumem_sys::testing::with_subscriber(subscriber, || {
            let buf = DeviceBuffer::<u8>::zeroed_in(&log, &s, 100).unwrap();
            assert_eq!(buf.to_vec().unwrap(), vec![0; 100]);
        });
        // Warned once, at the first lost row, which was already counted.
        assert_eq!(*seen.lock(), [1]);
        // The buffer's allocate and free, and the subscriber's.
        assert_eq!(log.io_errors(), 4);
    });
}

#[test]
#[parallel]
fn more_rows_than_the_queue_holds_are_all_written_in_order() {
    let (s, _, pool) = pool();
    let out = Shared::default();
    let log = Arc::new(LoggingResource::new(pool, out.clone()).unwrap());
    let layout = cumem_core::AllocLayout::new(512, 256).unwrap();
    let mut pointers = Vec::new();
    for _ in 0..40_000 {
        use cumem_core::DeviceResource;
        let a = log.allocate(layout, &s).unwrap();
        pointers.push(a.ptr);
        // SAFETY: allocated just above with `layout` on `s`, never used, freed once.
        unsafe { log.deallocate(a, layout, &s) };
    }
    log.flush().unwrap();
    let rows = out.rows();
    assert_eq!(rows.len(), 80_000);
    for (pair, ptr) in rows.chunks(2).zip(&pointers) {
        assert_eq!((pair[0].action, pair[0].pointer), (TraceAction::Allocate, *ptr));
        assert_eq!((pair[1].action, pair[1].pointer), (TraceAction::Free, *ptr));
    }
}

/// What a [`Writers`] output received: the bytes, and the name of the thread of each `write` call.
#[derive(Clone, Default)]
struct Written {
    bytes: Vec<u8>,
    writers: Vec<Option<String>>,
}

/// An output that notes which thread made each `write` call.
#[derive(Clone, Default)]
struct Writers(Arc<Mutex<Written>>);

impl Write for Writers {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut seen = self.0.lock();
        seen.bytes.extend_from_slice(buf);
        seen.writers.push(std::thread::current().name().map(String::from));
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
#[parallel]
fn rows_are_written_by_the_background_thread_in_buffered_batches() {
    let (s, _, pool) = pool();
    let out = Writers::default();
    let log = Arc::new(LoggingResource::new(pool, out.clone()).unwrap());
    for i in 0..1000 {
        drop(DeviceBuffer::<u8>::zeroed_in(&log, &s, 100 + i).unwrap());
    }
    assert_eq!(log.io_errors(), 0);
    log.flush().unwrap();
    let Written { bytes, writers } = out.0.lock().clone();
    assert_eq!(parse_trace(bytes.as_slice()).unwrap().len(), 2000, "every row was written");
    let here = std::thread::current().name().map(String::from);
    assert!(
        writers.iter().all(|w| w.as_deref() == Some("cumem-log-writer") && *w != here),
        "only the writer thread writes: {writers:?}"
    );
    // About 100 KB of rows through a 64 KiB buffer: a handful of writes, not one per row.
    assert!(writers.len() <= 8, "{} writes for 2000 rows ({} bytes)", writers.len(), bytes.len());
}
