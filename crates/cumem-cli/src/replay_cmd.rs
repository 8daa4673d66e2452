//! `cumem replay LOG`: the strategies side by side on one allocation trace, as a table, JSON or a chart.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use cumem::pool::replay::{ReplayOptions, ReplayReport, ReplayedOn, replay_with};
use cumem::pool::trace_format::parse_trace;
use cumem::prelude::*;
use plotters::style::RGBColor;
use serde_json::{Value, json};

use crate::Failure;
use crate::chart::{self, Axes, ChartFile, Series};
use crate::progress;
use crate::strategy::{Skipped, Strategy};
use crate::units::human;

/// What `cumem replay` was asked to do.
pub struct ReplayArgs {
    /// The trace (RMM's CSV).
    pub log: PathBuf,
    /// The strategies to compare, in order.
    pub pools: Vec<Strategy>,
    /// Where to draw live and reserved bytes over the trace.
    pub svg: Option<PathBuf>,
    /// JSON on stdout instead of the table.
    pub json: bool,
}

/// Replays the trace against each strategy in turn, each on a fresh resource, and reports.
pub fn run(args: &ReplayArgs, simulated: bool) -> Result<(), Failure> {
    let file = File::open(&args.log).map_err(|e| Failure::Input(format!("{}: {e}", args.log.display())))?;
    let trace = parse_trace(BufReader::new(file))
        .map_err(|e| Failure::Input(format!("{}: {e}", args.log.display())))?;
    let chart = match &args.svg {
        // The chart replaces the file at its path: a path naming the trace itself (by any
        // spelling or link) would destroy the user's log.
        Some(svg) if chart::same_file(svg, &args.log) => {
            return Err(Failure::Input(format!(
                "--svg {} names the trace being replayed; choose another file for the chart",
                svg.display()
            )));
        }
        Some(svg) => Some(ChartFile::create(svg).map_err(Failure::Input)?),
        None => None,
    };
    let ctx = Device::get(0)?.context()?;
    let mut pools: Vec<Strategy> = Vec::new();
    for &strategy in &args.pools {
        if !pools.contains(&strategy) {
            pools.push(strategy);
        }
    }
    let mut results = Vec::new();
    let mut skipped = Vec::new();
    for strategy in pools {
        let resource = match strategy.resource_or_skip(&ctx)? {
            Ok(resource) => resource,
            Err(skip) => {
                skipped.push(skip);
                continue;
            }
        };
        let bar = progress::bar(trace.len() as u64, strategy.name());
        let report = replay_with(&resource, &trace, &ReplayOptions::default(), &mut |done| {
            bar.set_position(done as u64)
        })?;
        bar.finish_and_clear();
        // Dropped before the next strategy starts: a pool gives its cached memory back here.
        drop(resource);
        results.push((strategy, report));
    }
    if args.json {
        say!("{}", to_json(&args.log, trace.len(), simulated, &results, &skipped));
        for skip in &skipped {
            eprintln!("cumem: {}", skip.note());
        }
    } else {
        print_table(&args.log, trace.len(), simulated, &results);
        for skip in &skipped {
            say!("{}", skip.note());
        }
    }
    if let Some(chart) = chart {
        let path = chart.path().to_owned();
        draw(chart, &args.log, simulated, &results).map_err(Failure::Input)?;
        if !args.json {
            say!("chart: {}", path.display());
        }
    }
    Ok(())
}

fn micros(ns: u64) -> String {
    format!("{:.1}", ns as f64 / 1e3)
}

fn print_table(log: &Path, rows: usize, simulated: bool, results: &[(Strategy, ReplayReport)]) {
    let Some((_, first)) = results.first() else { return };
    say!(
        "replay of {}: {rows} rows, {} thread(s), {} stream(s){}",
        log.display(),
        first.threads,
        first.streams,
        if simulated { " (simulated: latencies are the simulator's, not a GPU's)" } else { "" }
    );
    say!(
        "{:<w$} {:>11} {:>13} {:>14} {:>10} {:>10} {:>10} {:>10} {:>7}",
        "strategy",
        "peak live",
        "peak reserved",
        "reserved÷live",
        "alloc p50",
        "alloc p99",
        "free p50",
        "free p99",
        "failed",
        w = Strategy::NAME_WIDTH
    );
    for (strategy, r) in results {
        say!(
            "{:<w$} {:>11} {:>13} {:>14.3} {:>8}µs {:>8}µs {:>8}µs {:>8}µs {:>7}",
            strategy.name(),
            human(r.peak_live_bytes),
            human(r.peak_reserved_bytes),
            r.reserved_per_live(),
            micros(r.allocate.p50_ns),
            micros(r.allocate.p99_ns),
            micros(r.free.p50_ns),
            micros(r.free.p99_ns),
            r.failed_allocations,
            w = Strategy::NAME_WIDTH
        );
    }
    let skipped = [
        (first.skipped_unknown_frees, "frees of pointers the log never allocated"),
        (first.skipped_failed_rows, "failed-allocation rows"),
        (first.skipped_zero_sizes, "zero-byte allocations"),
        (first.skipped_duplicate_pointers, "allocations of a pointer already live"),
    ];
    for (count, what) in skipped {
        if count > 0 {
            say!("skipped: {count} {what}");
        }
    }
    if first.freed_at_end > 0 {
        say!(
            "the log ended with {} allocation(s) live; the replay freed them afterwards",
            first.freed_at_end
        );
    }
}

fn to_json(
    log: &Path,
    rows: usize,
    simulated: bool,
    results: &[(Strategy, ReplayReport)],
    skipped: &[Skipped],
) -> Value {
    let latency = |l: &cumem::pool::replay::Latency| json!({ "count": l.count, "p50_ns": l.p50_ns, "p99_ns": l.p99_ns, "max_ns": l.max_ns });
    let strategies: Vec<Value> = results
        .iter()
        .map(|(strategy, r)| {
            json!({
                "strategy": strategy.name(),
                "simulated": simulated,
                "allocations": r.allocation_sizes.len(),
                "frees": r.frees,
                "peak_live_bytes": r.peak_live_bytes,
                "peak_reserved_bytes": r.peak_reserved_bytes,
                "reserved_per_live": r.reserved_per_live(),
                "allocate": latency(&r.allocate),
                "free": latency(&r.free),
                "failed_allocations": r.failed_allocations,
                "skipped_unknown_frees": r.skipped_unknown_frees,
                "skipped_failed_rows": r.skipped_failed_rows,
                "skipped_zero_sizes": r.skipped_zero_sizes,
                "skipped_duplicate_pointers": r.skipped_duplicate_pointers,
                "freed_at_end": r.freed_at_end,
                "stream_mapping": r.stream_mapping.iter().map(|&(logged, on)| json!({
                    "logged": format!("{logged:#x}"),
                    "replayed_on": match on {
                        ReplayedOn::Legacy => "legacy",
                        ReplayedOn::PerThread => "per-thread",
                        ReplayedOn::NonBlocking => "non-blocking",
                    },
                })).collect::<Vec<_>>(),
                "samples": r.samples.iter().map(|s| json!({
                    "row": s.row, "time": s.time, "live_bytes": s.live_bytes, "reserved_bytes": s.reserved_bytes,
                    "fragmentation": s.fragmentation(),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "trace": log.display().to_string(),
        "rows": rows,
        "simulated": simulated,
        "strategies": strategies,
        "skipped_strategies": skipped.iter().map(Skipped::to_json).collect::<Vec<_>>(),
    })
}

/// Live and reserved MiB over the trace's rows: one reserved line per strategy, and the live line
/// (dashed, over the reserved ones) once when every strategy made the same allocations (otherwise one
/// each, lighter).
fn draw(
    chart: ChartFile,
    log: &Path,
    simulated: bool,
    results: &[(Strategy, ReplayReport)],
) -> Result<(), String> {
    const MIB: f64 = (1 << 20) as f64;
    let line = |r: &ReplayReport, live: bool| -> Vec<(f64, f64)> {
        r.samples
            .iter()
            .map(|s| (s.row as f64, if live { s.live_bytes } else { s.reserved_bytes } as f64 / MIB))
            .collect()
    };
    let mut series = Vec::new();
    let same_live = results
        .windows(2)
        .all(|w| w[0].1.samples.iter().map(|s| s.live_bytes).eq(w[1].1.samples.iter().map(|s| s.live_bytes)));
    if let (true, Some((_, first))) = (same_live, results.first()) {
        series.push(Series {
            label: "live (requested)".into(),
            color: RGBColor(0x40, 0x40, 0x40),
            points: line(first, true),
            dashed: true,
        });
    } else {
        for (strategy, r) in results {
            let RGBColor(red, green, blue) = strategy.color();
            let tint = |c: u8| ((u16::from(c) + 255) / 2) as u8;
            series.push(Series {
                label: format!("{} live", strategy.name()),
                color: RGBColor(tint(red), tint(green), tint(blue)),
                points: line(r, true),
                dashed: true,
            });
        }
    }
    for (strategy, r) in results {
        series.push(Series {
            label: format!("{} reserved", strategy.name()),
            color: strategy.color(),
            points: line(r, false),
            dashed: false,
        });
    }
    let title = format!(
        "{}: live vs reserved device memory{}",
        log.file_name().map_or_else(|| log.display().to_string(), |n| n.to_string_lossy().into_owned()),
        if simulated { " (simulated)" } else { "" }
    );
    chart.line_chart(
        &Axes {
            title: &title,
            x_label: "trace row (allocations and frees, in log order)",
            y_label: "MiB",
            x_ticks: &|x| format!("{x:.0}"),
            y_ticks: &|y| format!("{y:.0}"),
        },
        &series,
    )
}
