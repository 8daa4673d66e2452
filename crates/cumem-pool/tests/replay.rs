//! Replaying allocation traces: a log in RMM's own format, round trips through the logging adaptor and
//! the trace writer, the same trace against every strategy, and the rows a replay skips or cannot make.

use std::sync::Arc;

use cumem_core::{Context, Device, DeviceBuffer, DeviceResource, DriverResource, Stream};
use cumem_pool::replay::{ReplayOptions, ReplayReport, ReplayedOn, replay, replay_with};
use cumem_pool::trace_format::{TraceAction, TraceRecord, parse_trace, write_header};
use cumem_pool::{CachingResource, LoggingResource, MemPool, MemPoolOptions, NativePoolResource, PoolConfig};
use cumem_sys::testing;
use serial_test::serial;

// Reserved bytes are the whole device's used memory, so the tests of this binary run one at a
// time: another test's allocations would count in a replay running beside it.

fn ctx() -> Context {
    testing::init();
    Device::get(0).unwrap().context().unwrap()
}

/// One of each strategy the CLI compares, fresh.
fn strategies(ctx: &Context) -> Vec<(&'static str, Arc<dyn DeviceResource>)> {
    vec![
        ("caching", Arc::new(CachingResource::with_driver(ctx, PoolConfig::default()))),
        (
            "native",
            Arc::new(NativePoolResource::new(MemPool::create(ctx, MemPoolOptions::default()).unwrap())),
        ),
        ("driver", Arc::new(DriverResource::new(ctx))),
    ]
}

/// `fixtures/rmm_log.csv` is written as RMM's `logging_resource_adaptor` prints a log: its header
/// `Thread,Time,Action,Pointer,Size,Stream`, then rows of the spdlog pattern `%t,%H:%M:%S.%f,`
/// followed by `allocate,%p,%zu,%s` (`(nil)` for a failed allocation's pointer, `0` for the default
/// stream, OS thread ids); two threads, the default stream and one created stream.
#[test]
#[serial]
fn a_log_in_rmms_format_replays() {
    let ctx = ctx();
    let fixture = include_str!("fixtures/rmm_log.csv");
    let trace = parse_trace(fixture.as_bytes()).unwrap();
    for (name, resource) in strategies(&ctx) {
        let report = replay(&resource, &trace).unwrap();
        assert_eq!(report.allocation_sizes, vec![4 << 20, 256 << 10, 1000, 128 << 10, 2 << 20], "{name}");
        assert_eq!(report.peak_live_bytes, (4 << 20) + (256 << 10) + 1000, "{name}");
        assert_eq!(
            (report.frees, report.skipped_unknown_frees, report.skipped_failed_rows, report.freed_at_end),
            (5, 1, 1, 0),
            "{name}: the first row frees what the log never allocated; one row is a failure"
        );
        assert_eq!((report.threads, report.streams, report.failed_allocations), (2, 2, 0), "{name}");
        assert_eq!(
            report.stream_mapping,
            [(0, ReplayedOn::Legacy), (0x55d0_c8a1_b2c0, ReplayedOn::NonBlocking)],
            "{name}: RMM's default stream is the legacy stream, not a stream of its own"
        );
        assert!(report.peak_reserved_bytes >= report.peak_live_bytes, "{name}: {report:?}");
        assert_eq!((report.allocate.count, report.free.count), (5, 5), "{name}");
        assert!(
            report.allocate.p50_ns <= report.allocate.p99_ns
                && report.allocate.p99_ns <= report.allocate.max_ns
        );
        let last = report.samples.last().unwrap();
        assert_eq!((last.row, last.live_bytes), (trace.len() - 1, 0), "{name}");
    }
}

fn read_trace(path: &std::path::Path) -> Vec<TraceRecord> {
    parse_trace(std::io::BufReader::new(std::fs::File::open(path).unwrap())).unwrap()
}

fn allocated_sizes(trace: &[TraceRecord]) -> Vec<usize> {
    trace.iter().filter(|r| r.action == TraceAction::Allocate).map(|r| r.size).collect()
}

/// The round trip: a workload of buffers on two streams, logged through the logging adaptor, then
/// replayed through a fresh pool that is itself logged, makes the same allocations in the same
/// order and reaches the same peak of live bytes.
#[test]
#[serial]
fn a_workload_logged_through_the_logging_adaptor_replays_the_same() {
    let ctx = ctx();
    // The system's temporary directory, not CARGO_TARGET_TMPDIR: that is a path on the machine that
    // built the test, which a test binary run elsewhere (on a GPU machine) does not have.
    let dir = std::env::temp_dir();
    let name = |which: &str| dir.join(format!("cumem-replay-{}-{which}.csv", std::process::id()));
    let (first, second) = (name("first"), name("second"));
    let streams = [Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap()];
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let logged = Arc::new(LoggingResource::to_file(pool, &first).unwrap());
    let (mut live, mut sizes) = (Vec::new(), Vec::new());
    let (mut live_bytes, mut peak) = (0usize, 0usize);
    for i in 0..600usize {
        if i % 5 == 4 || live.len() > 50 {
            let buffer: DeviceBuffer<u8> = live.swap_remove((i * 31) % live.len());
            live_bytes -= buffer.len();
        } else {
            let size = 1 + (i * 104_729) % (2 << 20);
            live.push(DeviceBuffer::<u8>::new_in(&logged, &streams[i % 2], size).unwrap());
            sizes.push(size);
            live_bytes += size;
            peak = peak.max(live_bytes);
        }
    }
    drop(live);
    logged.flush().unwrap();
    drop(logged);
    let trace = read_trace(&first);
    assert_eq!(allocated_sizes(&trace), sizes, "the log holds the workload");

    let fresh = Arc::new(
        LoggingResource::to_file(
            Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default())),
            &second,
        )
        .unwrap(),
    );
    let report = replay(&fresh, &trace).unwrap();
    fresh.flush().unwrap();
    drop(fresh);
    assert_eq!(report.allocation_sizes, sizes);
    assert_eq!(report.peak_live_bytes, peak);
    assert_eq!(
        (report.streams, report.threads, report.skipped_unknown_frees, report.freed_at_end),
        (2, 1, 0, 0)
    );
    let replayed = read_trace(&second);
    assert_eq!(
        allocated_sizes(&replayed),
        sizes,
        "the replay's own log has the same sizes in the same order"
    );
    assert_eq!(replayed.len(), trace.len(), "and as many frees");
    std::fs::remove_file(&first).unwrap();
    std::fs::remove_file(&second).unwrap();
}

/// A workload with a known sequence of sizes, written as a trace the way the logging adaptor writes
/// it, read back and replayed through a fresh pool.
#[test]
#[serial]
fn a_written_trace_replays_with_the_same_sizes_and_peak() {
    let ctx = ctx();
    let mut rows = Vec::new();
    let mut live: Vec<(u64, usize)> = Vec::new();
    let (mut live_bytes, mut peak, mut sizes) = (0usize, 0usize, Vec::new());
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..2000u64 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let time = 1_700_000_000.0 + i as f64 * 1e-6;
        if live.len() > 40 || (!live.is_empty() && seed.is_multiple_of(3)) {
            let (pointer, size) = live.swap_remove((seed >> 8) as usize % live.len());
            live_bytes -= size;
            rows.push(TraceRecord {
                thread: 3,
                time,
                action: TraceAction::Free,
                pointer,
                size,
                stream: seed % 2,
            });
        } else {
            let size = 1 + (seed >> 20) as usize % (3 << 20);
            let pointer = 0x7f00_0000_0000 + i * (4 << 20);
            live.push((pointer, size));
            live_bytes += size;
            peak = peak.max(live_bytes);
            sizes.push(size);
            rows.push(TraceRecord {
                thread: 3,
                time,
                action: TraceAction::Allocate,
                pointer,
                size,
                stream: seed % 2,
            });
        }
    }
    let mut csv = Vec::new();
    write_header(&mut csv).unwrap();
    for row in &rows {
        row.write_csv(&mut csv).unwrap();
    }
    let trace = parse_trace(csv.as_slice()).unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let report = replay(&pool, &trace).unwrap();
    assert_eq!(report.allocation_sizes, sizes);
    assert_eq!(report.peak_live_bytes, peak);
    assert_eq!(report.freed_at_end, live.len());
    assert_eq!(pool.stats().allocations_total as usize, sizes.len(), "every allocation reached the pool");
    assert_eq!(pool.stats().current_bytes, 0, "the replay freed everything it allocated");
}

#[test]
#[serial]
fn reserved_bytes_are_the_devices_used_memory() {
    let ctx = ctx();
    // Three 3 MiB buffers live at once: cuMemAlloc charges 4 MiB each (2 MiB granules), while the
    // caching pool carves them from its own segments, which it keeps after the frees.
    let mut rows = Vec::new();
    for (i, action) in [TraceAction::Allocate; 3].into_iter().chain([TraceAction::Free; 3]).enumerate() {
        let pointer = 0x7f00_0000_0000 + (i as u64 % 3) * (4 << 20);
        rows.push(TraceRecord { thread: 1, time: i as f64, action, pointer, size: 3 << 20, stream: 0 });
    }
    let driver = replay(&Arc::new(DriverResource::new(&ctx)), &rows).unwrap();
    assert_eq!(driver.peak_live_bytes, 9 << 20);
    assert!(driver.peak_reserved_bytes >= 12 << 20, "{driver:?}");
    assert_eq!(driver.samples.last().unwrap().reserved_bytes, 0, "cuMemFree gave everything back");
    // Fragmentation over time: the share of reserved memory not live, after every row.
    let over_time: Vec<(usize, usize, f64)> = driver
        .samples
        .iter()
        .map(|s| (s.live_bytes >> 20, s.reserved_bytes >> 20, s.fragmentation()))
        .collect();
    if testing::sim_control().is_some() {
        assert_eq!(
            over_time,
            [(3, 4, 0.25), (6, 8, 0.25), (9, 12, 0.25), (6, 8, 0.25), (3, 4, 0.25), (0, 0, 0.0)],
            "the simulator charges whole 2 MiB granules"
        );
    } else {
        assert_eq!(over_time.len(), 6);
        assert!(over_time.iter().all(|&(_, _, f)| (0.0..1.0).contains(&f)), "{over_time:?}");
    }
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let cached = replay(&pool, &rows).unwrap();
    assert_eq!(cached.samples.last().unwrap().reserved_bytes as u64, pool.stats().reserved_bytes);
    assert!(cached.reserved_per_live() >= 1.0, "{cached:?}");
}

#[test]
#[serial]
fn allocations_the_resource_refuses_are_counted_and_their_frees_skipped() {
    let ctx = ctx();
    let rows = [
        TraceRecord {
            thread: 1,
            time: 0.0,
            action: TraceAction::Allocate,
            pointer: 0x10,
            size: 1 << 50,
            stream: 0,
        },
        TraceRecord {
            thread: 1,
            time: 0.1,
            action: TraceAction::Allocate,
            pointer: 0x20,
            size: 0,
            stream: 0,
        },
        TraceRecord {
            thread: 1,
            time: 0.2,
            action: TraceAction::Allocate,
            pointer: 0x30,
            size: 512,
            stream: 0,
        },
        TraceRecord {
            thread: 1,
            time: 0.3,
            action: TraceAction::Allocate,
            pointer: 0x30,
            size: 512,
            stream: 0,
        },
        TraceRecord {
            thread: 1,
            time: 0.4,
            action: TraceAction::Free,
            pointer: 0x10,
            size: 1 << 50,
            stream: 0,
        },
        TraceRecord { thread: 1, time: 0.5, action: TraceAction::Free, pointer: 0x30, size: 512, stream: 0 },
    ];
    let report: ReplayReport = replay(&Arc::new(DriverResource::new(&ctx)), &rows).unwrap();
    assert_eq!(report.failed_allocations, 1, "no device has a PiB");
    assert_eq!(report.skipped_zero_sizes, 1);
    assert_eq!(report.skipped_duplicate_pointers, 1);
    assert_eq!(report.skipped_unknown_frees, 1, "the free of the refused allocation");
    assert_eq!((report.allocation_sizes, report.frees, report.peak_live_bytes), (vec![512], 1, 512));
}

#[test]
#[serial]
fn samples_are_bounded_and_progress_reaches_the_end() {
    let ctx = ctx();
    let rows: Vec<TraceRecord> = (0..1000u64)
        .map(|i| TraceRecord {
            thread: 1,
            time: i as f64,
            action: if i % 2 == 0 { TraceAction::Allocate } else { TraceAction::Free },
            pointer: 0x1000 + i / 2 * 0x1000,
            size: 4096,
            stream: 0,
        })
        .collect();
    let mut done = Vec::new();
    let report = replay_with(
        &Arc::new(DriverResource::new(&ctx)),
        &rows,
        &ReplayOptions { max_samples: 64 },
        &mut |n| done.push(n),
    )
    .unwrap();
    assert!(report.samples.len() <= 64 && report.samples.len() >= 32, "{}", report.samples.len());
    assert_eq!(report.samples.last().unwrap().row, 999);
    assert!(report.samples.windows(2).all(|w| w[0].row < w[1].row));
    assert_eq!(done.last(), Some(&1000));
    assert_eq!(report.peak_live_bytes, 4096);
}

/// The special stream values CUDA defines keep their meaning: 1 is the legacy stream like 0, 2 a
/// per-thread default stream; only other values get non-blocking streams of their own.
#[test]
#[serial]
fn special_stream_values_are_replayed_on_their_kind_of_stream() {
    let ctx = ctx();
    let row = |thread, i: u64, action, stream| TraceRecord {
        thread,
        time: i as f64,
        action,
        pointer: 0x1000 * (1 + i / 2),
        size: 4096,
        stream,
    };
    let rows: Vec<TraceRecord> = [(1, 0), (1, 1), (1, 2), (2, 2), (1, 0x7f00_1234)]
        .into_iter()
        .enumerate()
        .flat_map(|(k, (thread, stream))| {
            let i = 2 * k as u64;
            [row(thread, i, TraceAction::Allocate, stream), row(thread, i + 1, TraceAction::Free, stream)]
        })
        .collect();
    let report = replay(&Arc::new(DriverResource::new(&ctx)), &rows).unwrap();
    assert_eq!(
        report.stream_mapping,
        [
            (0, ReplayedOn::Legacy),
            (1, ReplayedOn::Legacy),
            (2, ReplayedOn::PerThread),
            (0x7f00_1234, ReplayedOn::NonBlocking)
        ]
    );
    assert_eq!((report.streams, report.frees, report.failed_allocations), (4, 5, 0));
}

/// 301 rows make a tick of 3 rows, which the last row does not end: progress still reaches 301.
#[test]
#[serial]
fn progress_reaches_the_last_row_when_the_tick_does_not_divide_the_trace() {
    let ctx = ctx();
    let rows: Vec<TraceRecord> = (0..301u64)
        .map(|i| TraceRecord {
            thread: 1,
            time: i as f64,
            action: if i % 2 == 0 { TraceAction::Allocate } else { TraceAction::Free },
            pointer: 0x1000 + i / 2 * 0x1000,
            size: 4096,
            stream: 0,
        })
        .collect();
    let mut done = Vec::new();
    let report =
        replay_with(&Arc::new(DriverResource::new(&ctx)), &rows, &ReplayOptions::default(), &mut |n| {
            done.push(n)
        })
        .unwrap();
    assert_eq!(done.last(), Some(&301), "{done:?}");
    assert!(done.windows(2).all(|w| w[0] < w[1]), "{done:?}");
    assert_eq!(report.freed_at_end, 1);
}

/// RMM's adaptor logs the time of day (`%H:%M:%S.%f`): sample times of a log that runs past
/// midnight go on from the day before instead of jumping back.
#[test]
#[serial]
fn sample_times_go_on_past_midnight() {
    let ctx = ctx();
    let log = "Thread,Time,Action,Pointer,Size,Stream\n\
               7,23:59:59.500000,allocate,0x7f0000000000,4096,0\n\
               7,23:59:59.900000,allocate,0x7f0000001000,4096,0\n\
               7,00:00:00.100000,free,0x7f0000000000,4096,0\n\
               7,00:00:00.300000,free,0x7f0000001000,4096,0\n";
    let trace = parse_trace(log.as_bytes()).unwrap();
    let report = replay(&Arc::new(DriverResource::new(&ctx)), &trace).unwrap();
    let times: Vec<f64> = report.samples.iter().map(|s| (s.time * 10.0).round() / 10.0).collect();
    assert_eq!(times, [0.0, 0.4, 0.6, 0.8]);
    assert_eq!((report.peak_live_bytes, report.frees), (8192, 2));
}
