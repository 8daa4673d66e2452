//! `cumem bench`: copy bandwidth by direction and kind of host memory over a size sweep, and the
//! latency of an allocation and free from each strategy.
//!
//! Host memory is pageable (a `Vec`, copied by the driver's blocking calls), staged (the same `Vec`
//! through cumem-copy's pinned [`StagingRing`], one ring for the whole sweep), pinned, or mapped.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use cumem::copy::{StagingRing, StreamCopy, copy_d2h, copy_h2d};
use cumem::prelude::*;
use plotters::style::RGBColor;
use serde_json::{Value, json};

use crate::Failure;
use crate::chart::{Axes, ChartFile, Series};
use crate::progress;
use crate::strategy::{Skipped, Strategy};
use crate::units::human;

/// The sweep's smallest copy.
const MIN_SIZE: usize = 1 << 10;

/// What `cumem bench` was asked to do.
pub struct BenchArgs {
    /// The largest copy of the sweep (sizes go up by 4× from 1 KiB).
    pub max_size: usize,
    /// Fewer repetitions and allocations, for a quick look (and tests).
    pub quick: bool,
    /// Where to draw bandwidth against size.
    pub svg: Option<PathBuf>,
    /// JSON on stdout instead of the tables.
    pub json: bool,
}

/// A copy the sweep measures: its direction and the memory on the host side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    H2dPageable,
    H2dStaged,
    H2dPinned,
    H2dMapped,
    D2hPageable,
    D2hStaged,
    D2hPinned,
    D2hMapped,
    D2d,
}

impl Kind {
    const ALL: [Kind; 9] = [
        Kind::H2dPageable,
        Kind::H2dStaged,
        Kind::H2dPinned,
        Kind::H2dMapped,
        Kind::D2hPageable,
        Kind::D2hStaged,
        Kind::D2hPinned,
        Kind::D2hMapped,
        Kind::D2d,
    ];

    fn direction(self) -> &'static str {
        match self {
            Kind::H2dPageable | Kind::H2dStaged | Kind::H2dPinned | Kind::H2dMapped => "H2D",
            Kind::D2hPageable | Kind::D2hStaged | Kind::D2hPinned | Kind::D2hMapped => "D2H",
            Kind::D2d => "D2D",
        }
    }

    fn memory(self) -> &'static str {
        match self {
            Kind::H2dPageable | Kind::D2hPageable => "pageable",
            Kind::H2dStaged | Kind::D2hStaged => "staged",
            Kind::H2dPinned | Kind::D2hPinned => "pinned",
            Kind::H2dMapped | Kind::D2hMapped => "mapped",
            Kind::D2d => "device",
        }
    }

    fn label(self) -> String {
        format!("{} {}", self.direction(), self.memory())
    }

    fn color(self) -> RGBColor {
        match self {
            Kind::H2dPageable => RGBColor(0x1f, 0x77, 0xb4),
            Kind::H2dStaged => RGBColor(0xe3, 0x77, 0xc2),
            Kind::H2dPinned => RGBColor(0xff, 0x7f, 0x0e),
            Kind::H2dMapped => RGBColor(0x2c, 0xa0, 0x2c),
            Kind::D2hPageable => RGBColor(0xd6, 0x27, 0x28),
            Kind::D2hStaged => RGBColor(0xbc, 0xbd, 0x22),
            Kind::D2hPinned => RGBColor(0x94, 0x67, 0xbd),
            Kind::D2hMapped => RGBColor(0x8c, 0x56, 0x4b),
            Kind::D2d => RGBColor(0x17, 0xbe, 0xcf),
        }
    }
}

struct Bandwidth {
    kind: Kind,
    bytes: usize,
    gb_per_s: f64,
}

struct PoolLatency {
    strategy: Strategy,
    pairs: usize,
    mean_ns: f64,
    p50_ns: u64,
    p99_ns: u64,
}

/// Runs the sweep and the pool latencies, then prints or draws them.
pub fn run(args: &BenchArgs, simulated: bool) -> Result<(), Failure> {
    if args.max_size < MIN_SIZE {
        return Err(Failure::Input(format!("--max-size must be at least {}", human(MIN_SIZE))));
    }
    let chart = args.svg.as_deref().map(ChartFile::create).transpose().map_err(Failure::Input)?;
    let max_size = if args.quick { args.max_size.min(1 << 20) } else { args.max_size };
    let sizes: Vec<usize> =
        std::iter::successors(Some(MIN_SIZE), |&s| s.checked_mul(4)).take_while(|&s| s <= max_size).collect();
    let ctx = Device::get(0)?.context()?;
    let stream = Stream::non_blocking(&ctx)?;
    let mut ring = StagingRing::new(&ctx)?;
    let bar = progress::bar((sizes.len() * Kind::ALL.len() + Strategy::ALL.len()) as u64, "bench");
    let mut bandwidth = Vec::new();
    for &bytes in &sizes {
        // Enough repetitions for a steady figure without letting the small sizes dominate the run.
        let budget: usize = if args.quick { 4 << 20 } else { 256 << 20 };
        let reps = (budget / bytes).clamp(3, 200);
        bar.set_message(format!("copies of {}", human(bytes)));
        for kind in Kind::ALL {
            let seconds = time_copies(&ctx, &stream, &mut ring, kind, bytes, reps)?;
            bandwidth.push(Bandwidth { kind, bytes, gb_per_s: (bytes * reps) as f64 / seconds / 1e9 });
            bar.inc(1);
        }
    }
    let pairs = if args.quick { 500 } else { 10_000 };
    let mut latency = Vec::new();
    let mut skipped = Vec::new();
    for strategy in Strategy::ALL {
        bar.set_message(format!("{} pool", strategy.name()));
        match strategy.resource_or_skip(&ctx)? {
            Ok(resource) => latency.push(pool_latency(&resource, &stream, strategy, pairs)?),
            Err(skip) => skipped.push(skip),
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    if args.json {
        say!("{}", to_json(simulated, &bandwidth, &latency, &skipped));
        for skip in &skipped {
            eprintln!("cumem: {}", skip.note());
        }
    } else {
        print_tables(simulated, &sizes, &bandwidth, &latency);
        for skip in &skipped {
            say!("{}", skip.note());
        }
    }
    if let Some(chart) = chart {
        let path = chart.path().to_owned();
        draw(chart, simulated, &bandwidth).map_err(Failure::Input)?;
        if !args.json {
            say!("chart: {}", path.display());
        }
    }
    Ok(())
}

/// Seconds for `reps` copies of `bytes` of `kind`, after one copy to warm up.
fn time_copies(
    ctx: &Context,
    stream: &Stream,
    ring: &mut StagingRing,
    kind: Kind,
    bytes: usize,
    reps: usize,
) -> Result<f64, Failure> {
    let mut device = DeviceBuffer::<u8>::zeroed(stream, bytes)?;
    let mut run = |copy: &mut dyn FnMut(&mut DeviceBuffer<u8>) -> Result<()>| -> Result<f64, Failure> {
        copy(&mut device)?;
        stream.synchronize()?;
        let started = Instant::now();
        for _ in 0..reps {
            copy(&mut device)?;
        }
        stream.synchronize()?;
        Ok(started.elapsed().as_secs_f64())
    };
    match kind {
        Kind::H2dPageable => {
            let host = pageable(bytes, 1)?;
            run(&mut |d| copy_h2d(&host, d))
        }
        Kind::D2hPageable => {
            let mut host = pageable(bytes, 0)?;
            run(&mut |d| copy_d2h(d, &mut host))
        }
        Kind::H2dStaged => {
            let host = pageable(bytes, 1)?;
            run(&mut |d| ring.copy_h2d(stream, &host, d))
        }
        Kind::D2hStaged => {
            let mut host = pageable(bytes, 0)?;
            run(&mut |d| ring.copy_d2h(stream, d, &mut host))
        }
        Kind::H2dPinned => {
            let host = PinnedBuffer::<u8>::zeroed(ctx, bytes)?;
            run(&mut |d| stream.copy_h2d(&host, d))
        }
        Kind::D2hPinned => {
            let mut host = PinnedBuffer::<u8>::zeroed(ctx, bytes)?;
            run(&mut |d| stream.copy_d2h(d, &mut host))
        }
        Kind::H2dMapped => {
            let host = MappedBuffer::<u8>::zeroed(ctx, bytes)?;
            run(&mut |d| stream.copy_h2d(&host, d))
        }
        Kind::D2hMapped => {
            let mut host = MappedBuffer::<u8>::zeroed(ctx, bytes)?;
            run(&mut |d| stream.copy_d2h(d, &mut host))
        }
        Kind::D2d => {
            let source = DeviceBuffer::<u8>::zeroed(stream, bytes)?;
            run(&mut |d| stream.copy_d2d(&source, d))
        }
    }
}

/// `bytes` of pageable host memory filled with `value`, or an input error where the host cannot
/// give that much (`vec!` would abort the process instead).
fn pageable(bytes: usize, value: u8) -> Result<Vec<u8>, Failure> {
    let mut host = Vec::new();
    host.try_reserve_exact(bytes).map_err(|e| {
        Failure::Input(format!("--max-size: no {} of host memory for a pageable copy: {e}", human(bytes)))
    })?;
    host.resize(bytes, value);
    Ok(host)
}

/// One allocation and its free, `pairs` times, sizes varying from 256 B to about 1 MiB.
fn pool_latency(
    resource: &Arc<dyn DeviceResource>,
    stream: &Stream,
    strategy: Strategy,
    pairs: usize,
) -> Result<PoolLatency> {
    let mut nanos = Vec::with_capacity(pairs);
    for i in 0..pairs {
        let bytes = 256 + (i * 7919) % (1 << 20);
        let started = Instant::now();
        drop(DeviceBuffer::<u8>::new_in(resource, stream, bytes)?);
        nanos.push(started.elapsed().as_nanos() as u64);
    }
    stream.synchronize()?;
    let mean_ns = nanos.iter().sum::<u64>() as f64 / pairs.max(1) as f64;
    nanos.sort_unstable();
    let rank = |p: usize| nanos.get((pairs * p).div_ceil(100).max(1) - 1).copied().unwrap_or(0);
    Ok(PoolLatency { strategy, pairs, mean_ns, p50_ns: rank(50), p99_ns: rank(99) })
}

fn print_tables(simulated: bool, sizes: &[usize], bandwidth: &[Bandwidth], latency: &[PoolLatency]) {
    let (copies_note, calls_note) = if simulated {
        (
            " (simulated: the simulator's memcpy, not a GPU's figures)",
            " (simulated: the simulator's driver calls, not a GPU's)",
        )
    } else {
        ("", "")
    };
    say!("copy bandwidth, GB/s{copies_note}");
    let mut header = format!("{:>10}", "size");
    for kind in Kind::ALL {
        header += &format!(" {:>12}", kind.label());
    }
    say!("{header}");
    for &bytes in sizes {
        let mut line = format!("{:>10}", human(bytes));
        for kind in Kind::ALL {
            let gb =
                bandwidth.iter().find(|b| b.kind == kind && b.bytes == bytes).map_or(0.0, |b| b.gb_per_s);
            line += &format!(" {gb:>12.2}");
        }
        say!("{line}");
    }
    say!("");
    say!("allocate + free of 256 B .. 1 MiB, ns per pair{calls_note}");
    say!(
        "{:<w$} {:>8} {:>10} {:>10} {:>10}",
        "strategy",
        "pairs",
        "mean",
        "p50",
        "p99",
        w = Strategy::NAME_WIDTH
    );
    for l in latency {
        say!(
            "{:<w$} {:>8} {:>10.0} {:>10} {:>10}",
            l.strategy.name(),
            l.pairs,
            l.mean_ns,
            l.p50_ns,
            l.p99_ns,
            w = Strategy::NAME_WIDTH
        );
    }
}

fn to_json(simulated: bool, bandwidth: &[Bandwidth], latency: &[PoolLatency], skipped: &[Skipped]) -> Value {
    json!({
        "simulated": simulated,
        "bandwidth": bandwidth.iter().map(|b| json!({
            "direction": b.kind.direction(),
            "memory": b.kind.memory(),
            "bytes": b.bytes,
            "gb_per_s": b.gb_per_s,
            "simulated": simulated,
        })).collect::<Vec<_>>(),
        "pool_latency": latency.iter().map(|l| json!({
            "strategy": l.strategy.name(),
            "pairs": l.pairs,
            "mean_ns": l.mean_ns,
            "p50_ns": l.p50_ns,
            "p99_ns": l.p99_ns,
            "simulated": simulated,
        })).collect::<Vec<_>>(),
        "skipped_strategies": skipped.iter().map(Skipped::to_json).collect::<Vec<_>>(),
    })
}

/// GB/s against the copy's size (log₂ on the horizontal axis), one line per kind of copy.
fn draw(chart: ChartFile, simulated: bool, bandwidth: &[Bandwidth]) -> Result<(), String> {
    let series: Vec<Series> = Kind::ALL
        .iter()
        .map(|&kind| Series {
            label: kind.label(),
            color: kind.color(),
            points: bandwidth
                .iter()
                .filter(|b| b.kind == kind)
                .map(|b| ((b.bytes as f64).log2(), b.gb_per_s))
                .collect(),
            dashed: false,
        })
        .collect();
    let title = format!("copy bandwidth by size{}", if simulated { " (simulated, not a GPU)" } else { "" });
    chart.line_chart(
        &Axes {
            title: &title,
            x_label: "copy size (bytes, log scale)",
            y_label: "GB/s",
            x_ticks: &|x| human(2f64.powf(*x).round() as usize),
            y_ticks: &|y| format!("{y:.1}"),
        },
        &series,
    )
}
