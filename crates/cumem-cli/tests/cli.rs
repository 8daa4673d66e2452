//! The `cumem` binary as a user runs it, on the simulator: `replay` on every committed trace with a
//! chart rendered to pixels, `--json` that parses, `bench` in its quick form, and errors that say
//! what is wrong. Each run has the simulator's leak check on, so a leaking command exits non-zero.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use resvg::{tiny_skia, usvg};
use serde_json::Value;

fn cumem(args: &[&str]) -> Output {
    cumem_on("leak_check=1", args)
}

/// [`cumem`] on the simulator configured by `sim` (`CUMEM_SIM`).
fn cumem_on(sim: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cumem"))
        .args(["--driver", "sim"])
        .args(args)
        .env("CUMEM_SIM", sim)
        .env_remove("CUMEM_LOG")
        .output()
        .expect("the cumem binary runs")
}

/// Runs `cumem` and kills it if it has not exited within a minute, so a command that hangs fails the
/// test instead of hanging it.
fn cumem_bounded(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cumem"))
        .args(["--driver", "sim"])
        .args(args)
        .env("CUMEM_SIM", "leak_check=1")
        .env_remove("CUMEM_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the cumem binary runs");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("cumem {args:?} did not exit within a minute");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn succeeded(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "cumem failed ({}):\n{stderr}", out.status);
    assert!(!stderr.contains('\u{1b}'), "no progress bar when stderr is not a terminal:\n{stderr}");
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
}

fn scratch(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{}-{name}", std::process::id()))
}

/// Renders an SVG file and counts, per colour, the pixels within a small distance of it.
fn pixels_near(svg: &Path, colors: &[(u8, u8, u8)]) -> Vec<usize> {
    let data = std::fs::read(svg).unwrap();
    let tree = usvg::Tree::from_data(&data, &usvg::Options::default()).expect("the chart is valid SVG");
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height()).unwrap();
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    colors
        .iter()
        .map(|&(r, g, b)| {
            pixmap
                .pixels()
                .iter()
                .filter(|p| {
                    p.alpha() == 255
                        && p.red().abs_diff(r) <= 8
                        && p.green().abs_diff(g) <= 8
                        && p.blue().abs_diff(b) <= 8
                })
                .count()
        })
        .collect()
}

/// The colour of the live-bytes line in `replay_cmd.rs` (drawn once when every strategy made the
/// same allocations, as on every committed trace).
const LIVE_COLOR: (u8, u8, u8) = (0x40, 0x40, 0x40);

/// The strategies' colours in `strategy.rs`.
const STRATEGY_COLORS: [(&str, (u8, u8, u8)); 4] = [
    ("caching", (0x1f, 0x77, 0xb4)),
    ("caching-expandable", (0x94, 0x67, 0xbd)),
    ("native", (0xd6, 0x27, 0x28)),
    ("driver", (0x2c, 0xa0, 0x2c)),
];

#[test]
fn every_committed_trace_replays_and_each_strategy_is_drawn() {
    for trace in ["training", "inference", "random"] {
        let svg = scratch(&format!("{trace}.svg"));
        let log = repo(&format!("traces/{trace}.csv"));
        let out = cumem(&[
            "replay",
            log.to_str().unwrap(),
            "--pool",
            "caching,caching-expandable,native,driver",
            "--svg",
            svg.to_str().unwrap(),
        ]);
        let table = succeeded(&out);
        assert!(table.contains("simulated") && table.contains("reserved÷live"), "{table}");
        for (name, _) in STRATEGY_COLORS {
            assert!(table.lines().any(|l| l.starts_with(name)), "{trace}: no row for {name}:\n{table}");
        }
        let counts = pixels_near(&svg, &STRATEGY_COLORS.map(|(_, c)| c));
        for ((name, _), count) in STRATEGY_COLORS.iter().zip(counts) {
            // The legend's sample line alone is about 24×3 pixels; a drawn series is far more.
            assert!(count > 300, "{trace}: {name}'s series is not drawn ({count} pixels of its colour)");
        }
        // Live against reserved: the live line is drawn too, the axes say what they measure and
        // the legend names every line.
        let live = pixels_near(&svg, &[LIVE_COLOR])[0];
        assert!(live > 300, "{trace}: the live series is not drawn ({live} pixels)");
        let text = std::fs::read_to_string(&svg).unwrap();
        for label in ["trace row (allocations and frees, in log order)", "MiB", "live (requested)"]
            .into_iter()
            .map(String::from)
            .chain(STRATEGY_COLORS.iter().map(|(name, _)| format!("{name} reserved")))
        {
            // plotters writes each text element's content on a line of its own.
            assert!(text.lines().any(|l| l.trim() == label), "{trace}: no text `{label}` in the chart");
        }
        std::fs::remove_file(&svg).unwrap();
    }
}

#[test]
fn a_header_only_trace_charts_empty_axes() {
    let log = scratch("header-only.csv");
    std::fs::write(&log, "Thread,Time,Action,Pointer,Size,Stream\n").unwrap();
    let svg = scratch("header-only.svg");
    succeeded(&cumem_bounded(&["replay", log.to_str().unwrap(), "--svg", svg.to_str().unwrap()]));
    let data = std::fs::read(&svg).unwrap();
    usvg::Tree::from_data(&data, &usvg::Options::default()).expect("the chart is valid SVG");
    std::fs::remove_file(&svg).unwrap();
    std::fs::remove_file(&log).unwrap();
}

#[test]
fn a_strategy_left_out_is_not_drawn() {
    let svg = scratch("caching-only.svg");
    let log = repo("traces/training.csv");
    succeeded(&cumem(&[
        "replay",
        log.to_str().unwrap(),
        "--pool",
        "caching",
        "--svg",
        svg.to_str().unwrap(),
    ]));
    let counts = pixels_near(&svg, &STRATEGY_COLORS.map(|(_, c)| c));
    assert!(counts[0] > 300 && counts[1..].iter().all(|&c| c == 0), "{counts:?}");
    std::fs::remove_file(&svg).unwrap();
}

#[test]
fn replay_json_parses_and_agrees_between_strategies() {
    let fixture = repo("crates/cumem-pool/tests/fixtures/rmm_log.csv");
    let out = cumem(&["replay", fixture.to_str().unwrap(), "--json"]);
    let json: Value = serde_json::from_str(&succeeded(&out)).expect("stdout is one JSON document");
    assert_eq!(json["simulated"], true);
    assert_eq!(json["rows"], 12);
    assert_eq!(
        json["skipped_strategies"],
        serde_json::json!([]),
        "every strategy runs on the default device"
    );
    let strategies = json["strategies"].as_array().unwrap();
    let names: Vec<&str> = strategies.iter().map(|s| s["strategy"].as_str().unwrap()).collect();
    assert_eq!(names, ["caching", "caching-expandable", "native", "driver"]);
    for s in strategies {
        assert_eq!(s["peak_live_bytes"], (4 << 20) + (256 << 10) + 1000);
        assert_eq!(
            (s["skipped_unknown_frees"].as_u64(), s["skipped_failed_rows"].as_u64()),
            (Some(1), Some(1))
        );
        assert_eq!(
            s["stream_mapping"],
            serde_json::json!([
                { "logged": "0x0", "replayed_on": "legacy" },
                { "logged": "0x55d0c8a1b2c0", "replayed_on": "non-blocking" },
            ])
        );
        let peak_reserved = s["peak_reserved_bytes"].as_u64().unwrap();
        assert!(peak_reserved > 0 && peak_reserved >= s["peak_live_bytes"].as_u64().unwrap(), "{s}");
        assert!(s["allocate"]["p50_ns"].as_u64().unwrap() <= s["allocate"]["p99_ns"].as_u64().unwrap());
        let samples = s["samples"].as_array().unwrap();
        // 12 rows and up to 1000 samples: every row is sampled, so the peak is among them.
        assert_eq!(samples.len(), 12);
        let sampled_peak = samples.iter().map(|x| x["reserved_bytes"].as_u64().unwrap()).max();
        assert_eq!(sampled_peak, Some(peak_reserved), "{s}");
        for x in samples {
            let (live, reserved) = (x["live_bytes"].as_f64().unwrap(), x["reserved_bytes"].as_f64().unwrap());
            let expected = if reserved == 0.0 { 0.0 } else { 1.0 - live.min(reserved) / reserved };
            // Within an ulp or so: serde_json's default float parsing is not exact to the last bit.
            let got = x["fragmentation"].as_f64().unwrap();
            assert!((got - expected).abs() < 1e-12, "fragmentation over time: {x}");
        }
    }
}

#[test]
fn bench_quick_reports_every_kind_labelled_simulated() {
    let svg = scratch("bench.svg");
    let out = cumem(&["bench", "--quick", "--max-size", "64KiB", "--json", "--svg", svg.to_str().unwrap()]);
    let json: Value = serde_json::from_str(&succeeded(&out)).expect("stdout is one JSON document");
    assert_eq!(json["simulated"], true);
    let bandwidth = json["bandwidth"].as_array().unwrap();
    assert_eq!(bandwidth.len(), 4 * 9, "1, 4, 16 and 64 KiB, nine kinds of copy each");
    for row in bandwidth {
        assert_eq!(row["simulated"], true);
        assert!(row["gb_per_s"].as_f64().unwrap() > 0.0, "{row}");
    }
    let memories: std::collections::BTreeSet<&str> =
        bandwidth.iter().map(|r| r["memory"].as_str().unwrap()).collect();
    assert_eq!(
        memories.into_iter().collect::<Vec<_>>(),
        ["device", "mapped", "pageable", "pinned", "staged"]
    );
    let pools: Vec<&str> =
        json["pool_latency"].as_array().unwrap().iter().map(|r| r["strategy"].as_str().unwrap()).collect();
    assert_eq!(pools, ["caching", "caching-expandable", "native", "driver"]);
    // Every kind of copy is a line of four points (one per size) in its colour from `bench.rs`.
    // Where the lines lie on one another depends on timing, so only the last one drawn, D2D's, is
    // sure to show in the pixels.
    let text = std::fs::read_to_string(&svg).unwrap();
    for color in ["1F77B4", "E377C2", "FF7F0E", "2CA02C", "D62728", "BCBD22", "9467BD", "8C564B", "17BECF"] {
        let series = text.lines().filter(|l| l.contains(&format!("stroke=\"#{color}\""))).any(|l| {
            l.split("points=\"")
                .nth(1)
                .is_some_and(|points| points.split(' ').filter(|p| p.contains(',')).count() == 4)
        });
        assert!(series, "no line of four points in #{color}");
    }
    let counts = pixels_near(&svg, &[(0x17, 0xbe, 0xcf)]);
    assert!(counts[0] > 100, "D2D's line is not drawn: {counts:?}");
    std::fs::remove_file(&svg).unwrap();

    let table = succeeded(&cumem(&["bench", "--quick", "--max-size", "4KiB"]));
    assert!(table.contains("GB/s (simulated") && table.contains("ns per pair (simulated"), "{table}");
}

#[test]
fn bad_input_is_an_error_that_says_what() {
    let out = cumem(&["replay", "no/such/trace.csv"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // A typed error (exit status 1, the CLI's own line), not a panic (101) or a leak (86).
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cumem: error:") && stderr.contains("no/such/trace.csv"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let bad = scratch("bad.csv");
    std::fs::write(&bad, "Thread,Time,Action,Pointer,Size,Stream\n1,0.5,resize,0x10,12,0x0\n").unwrap();
    let out = cumem(&["replay", bad.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("line 2") && stderr.contains("unknown action"),
        "{stderr}"
    );
    std::fs::remove_file(&bad).unwrap();

    let training = repo("traces/training.csv");
    let out = cumem(&["replay", training.to_str().unwrap(), "--json", "--svg", "/nonexistent/dir/x.svg"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("/nonexistent/dir/x.svg"), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "the unwritable chart fails before anything is replayed: {}",
        String::from_utf8_lossy(&out.stdout)
    );

    let out = cumem(&["replay", "x.csv", "--pool", "caching,buddy"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("buddy"));
    let out = cumem(&["bench", "--max-size", "12"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--max-size"));
}

/// The bar's exact command for each committed trace: `--pool caching,native,driver --svg t.svg`
/// exits 0 with a row per strategy giving reserved ÷ live, and each strategy's line is drawn.
#[test]
fn the_bars_replay_command_exits_0_on_every_trace() {
    for trace in ["training", "inference", "random"] {
        let svg = scratch(&format!("bar-{trace}.svg"));
        let log = repo(&format!("traces/{trace}.csv"));
        let out = cumem(&[
            "replay",
            log.to_str().unwrap(),
            "--pool",
            "caching,native,driver",
            "--svg",
            svg.to_str().unwrap(),
        ]);
        let table = succeeded(&out);
        let header = table.lines().find(|l| l.starts_with("strategy")).expect("a table header");
        let column =
            header.split_whitespace().position(|c| c == "reserved÷live").expect("a reserved÷live column");
        for name in ["caching", "native", "driver"] {
            let row = table.lines().find(|l| l.split_whitespace().next() == Some(name)).unwrap();
            // Each of the two byte columns before it is a number and a unit, as each header is two words.
            let ratio: f64 = row.split_whitespace().nth(column).unwrap().parse().unwrap();
            assert!(ratio >= 1.0, "{trace}: {name} reserves less than it holds live? {row}");
        }
        let counts = pixels_near(&svg, &[STRATEGY_COLORS[0].1, STRATEGY_COLORS[2].1, STRATEGY_COLORS[3].1]);
        assert!(counts.iter().all(|&c| c > 300), "{trace}: {counts:?}");
        assert_eq!(pixels_near(&svg, &[STRATEGY_COLORS[1].1])[0], 0, "caching-expandable was not asked for");
        std::fs::remove_file(&svg).unwrap();
    }
}

/// On a terminal the long commands draw a progress bar on stderr: run under `script`, which gives
/// the command a pseudo-terminal, the bar's count of trace rows (`{pos}/{len}`) appears. (The tests
/// above check that no bar is drawn when stderr is not a terminal.)
#[test]
fn a_progress_bar_is_drawn_on_a_terminal() {
    // Not skipped when missing: these tests run the CLI on the simulator, where nothing is skipped
    // (a pass that checked nothing would hide the terminal path from CI).
    assert!(
        Command::new("script").arg("--version").output().is_ok(),
        "this test needs `script` (util-linux) to give the CLI a pseudo-terminal; install it"
    );
    let log = repo("traces/training.csv");
    let rows = std::fs::read_to_string(&log).unwrap().lines().count() - 1;
    let command =
        format!("{} --driver sim replay {} --pool caching", env!("CARGO_BIN_EXE_cumem"), log.display());
    let out = Command::new("script")
        .args(["-q", "-e", "-c", &command, "/dev/null"])
        .env("TERM", "xterm")
        .env("CUMEM_SIM", "leak_check=1")
        .env_remove("CUMEM_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("script runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "cumem under script failed ({}):\n{text}", out.status);
    assert!(text.contains(&format!("/{rows}")), "no bar counting the {rows} rows on the terminal:\n{text}");
}

/// Malformed traces: a row that does not parse (bytes that are not UTF-8 included) fails with its
/// line number and a non-zero exit; rows that parse but make no sense together (a free before its
/// allocation, a pointer allocated twice, zero and impossible sizes) replay, and `--json` counts
/// each kind of skipped row by value, the same for every strategy.
#[test]
fn malformed_traces_name_their_line_or_replay_counting_what_was_skipped() {
    const HEADER: &[u8] = b"Thread,Time,Action,Pointer,Size,Stream\n";
    let unreadable: [(&[u8], &str); 4] = [
        (b"1,0.5,allocate,0x10,12,0x0\n\xff\xfe,0.6,free,0x10,12,0x0\n", "line 3: the line is not UTF-8"),
        (b"1,0.5,allocate,0x10,-12,0x0\n", "line 2: the size"),
        (b"1,inf,allocate,0x10,12,0x0\n", "line 2: the time"),
        (b"1,0.5,allocate,0xg0,12,0x0\n", "line 2: the pointer"),
    ];
    for (i, (rows, says)) in unreadable.into_iter().enumerate() {
        let bad = scratch(&format!("malformed-{i}.csv"));
        std::fs::write(&bad, [HEADER, rows].concat()).unwrap();
        let out = cumem(&["replay", bad.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "expected `{says}`:\n{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        std::fs::remove_file(&bad).unwrap();
    }

    let odd = scratch("odd.csv");
    let rows = b"1,0.1,free,0x10,12,0x0\n\
                 1,0.2,allocate,0x10,12,0x0\n\
                 1,0.3,allocate,0x10,24,0x0\n\
                 1,0.4,allocate,0x20,0,0x0\n\
                 1,0.5,allocate,0x30,1099511627776,0x7\n\
                 1,0.6,allocate failure,(nil),5,0x0\n\
                 1,0.7,free,0x10,12,0x0\n";
    std::fs::write(&odd, [HEADER, rows].concat()).unwrap();
    let json: Value = serde_json::from_str(&succeeded(&cumem(&["replay", odd.to_str().unwrap(), "--json"])))
        .expect("--json prints JSON");
    std::fs::remove_file(&odd).unwrap();
    let strategies = json["strategies"].as_array().unwrap();
    assert_eq!(strategies.len(), 4);
    for s in strategies {
        let counts: Vec<u64> = [
            "allocations",
            "frees",
            "peak_live_bytes",
            "skipped_unknown_frees",
            "skipped_duplicate_pointers",
            "skipped_zero_sizes",
            "failed_allocations",
            "skipped_failed_rows",
            "freed_at_end",
        ]
        .iter()
        .map(|k| s[k].as_u64().unwrap_or_else(|| panic!("{k} missing in {s}")))
        .collect();
        // One 12-byte allocation made and freed; the 1 TiB one refused by the device.
        assert_eq!(counts, [1, 1, 12, 1, 1, 1, 1, 1, 0], "{}", s["strategy"]);
    }
}

/// `--svg` naming the trace itself (a slip of the shell's completion) is refused before the chart
/// file is created, so the trace is left as it was; it used to be truncated and overwritten.
#[test]
fn a_chart_path_that_names_the_trace_is_refused_and_the_trace_kept() {
    let log = scratch("own-chart.csv");
    let text =
        "Thread,Time,Action,Pointer,Size,Stream\n1,0.1,allocate,0x10,4096,0x0\n1,0.2,free,0x10,4096,0x0\n";
    std::fs::write(&log, text).unwrap();
    // The same file by another spelling of its path.
    let dir = log.parent().unwrap();
    let aliased = dir.join(".").join(log.file_name().unwrap());
    let out = cumem(&["replay", log.to_str().unwrap(), "--svg", aliased.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("names the trace"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), text, "the trace is untouched");
    std::fs::remove_file(&log).unwrap();
}

/// On a device without memory pools the native strategy cannot be created: `replay` and `bench`
/// leave it out with a note (and in `--json` a `skipped_strategies` entry) and run the others; one
/// unsupported strategy used to end the whole command with an error.
#[test]
fn a_strategy_the_device_cannot_run_is_skipped_and_the_others_run() {
    const NO_POOLS: &str = "leak_check=1,memory_pools_supported=0";
    let fixture = repo("crates/cumem-pool/tests/fixtures/rmm_log.csv");
    let note = "not run: native (memory pools is not supported on device 0)";

    let table = succeeded(&cumem_on(NO_POOLS, &["replay", fixture.to_str().unwrap()]));
    for name in ["caching", "caching-expandable", "driver"] {
        assert!(
            table.lines().any(|l| l.split_whitespace().next() == Some(name)),
            "no row for {name}:\n{table}"
        );
    }
    assert!(!table.lines().any(|l| l.starts_with("native ")), "{table}");
    assert!(table.lines().any(|l| l == note), "{table}");

    let out = cumem_on(NO_POOLS, &["replay", fixture.to_str().unwrap(), "--json"]);
    let json: Value = serde_json::from_str(&succeeded(&out)).expect("stdout is one JSON document");
    let names: Vec<&str> =
        json["strategies"].as_array().unwrap().iter().map(|s| s["strategy"].as_str().unwrap()).collect();
    assert_eq!(names, ["caching", "caching-expandable", "driver"]);
    assert_eq!(
        json["skipped_strategies"],
        serde_json::json!([{ "strategy": "native", "reason": "memory pools is not supported on device 0" }])
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains(note));

    let out = cumem_on(NO_POOLS, &["bench", "--quick", "--max-size", "4KiB", "--json"]);
    let json: Value = serde_json::from_str(&succeeded(&out)).expect("stdout is one JSON document");
    let pools: Vec<&str> =
        json["pool_latency"].as_array().unwrap().iter().map(|r| r["strategy"].as_str().unwrap()).collect();
    assert_eq!(pools, ["caching", "caching-expandable", "driver"]);
    assert_eq!(json["skipped_strategies"][0]["strategy"], "native");
    let table = succeeded(&cumem_on(NO_POOLS, &["bench", "--quick", "--max-size", "4KiB"]));
    assert!(table.lines().any(|l| l == note), "{table}");
}

/// Entries of `svg`'s directory whose names contain its file name, `svg` itself excluded: what a
/// run left beside the chart.
fn beside(svg: &Path) -> Vec<String> {
    let name = svg.file_name().unwrap().to_str().unwrap();
    std::fs::read_dir(svg.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != name && n.contains(name))
        .collect()
}

/// A run that fails after its chart's path was checked leaves the chart already there as it was,
/// and no temporary file beside it: the chart is drawn beside its path and renamed over it only
/// once complete (the file used to be truncated first, so a failure left it empty).
#[test]
fn a_failing_run_leaves_an_earlier_chart_untouched() {
    let svg = scratch("earlier.svg");
    let earlier = "<svg>an earlier chart</svg>";
    std::fs::write(&svg, earlier).unwrap();
    // A 4 MiB device: the sweep's 4 MiB copies cannot be allocated, after the smaller ones ran.
    let out = cumem_on(
        "leak_check=1,memory=4MiB",
        &["bench", "--max-size", "4MiB", "--svg", svg.to_str().unwrap()],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cumem: error: out of memory"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&svg).unwrap(), earlier, "the earlier chart is kept");
    assert_eq!(beside(&svg), Vec::<String>::new(), "nothing left beside the chart");

    // The same run on a device big enough replaces it with a complete chart.
    succeeded(&cumem(&["bench", "--quick", "--max-size", "4KiB", "--svg", svg.to_str().unwrap()]));
    let data = std::fs::read(&svg).unwrap();
    usvg::Tree::from_data(&data, &usvg::Options::default()).expect("the chart is valid SVG");
    assert_eq!(beside(&svg), Vec::<String>::new(), "nothing left beside the chart");
    std::fs::remove_file(&svg).unwrap();
}

/// A hard link to the trace given as `--svg` names the same file by a path no canonicalisation
/// equates: it is refused too, and the trace is left as it was.
#[test]
fn a_chart_path_hard_linked_to_the_trace_is_refused_and_the_trace_kept() {
    let log = scratch("linked-chart.csv");
    let text =
        "Thread,Time,Action,Pointer,Size,Stream\n1,0.1,allocate,0x10,4096,0x0\n1,0.2,free,0x10,4096,0x0\n";
    std::fs::write(&log, text).unwrap();
    let link = scratch("linked-chart.svg");
    std::fs::hard_link(&log, &link).unwrap();
    let out = cumem(&["replay", log.to_str().unwrap(), "--svg", link.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("names the trace"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), text, "the trace is untouched");
    assert_eq!(std::fs::read_to_string(&link).unwrap(), text, "so is its link");
    std::fs::remove_file(&link).unwrap();
    std::fs::remove_file(&log).unwrap();
}
