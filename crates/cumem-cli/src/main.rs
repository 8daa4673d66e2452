//! `cumem`: device information, a demonstration of cumem, allocation-trace replay and benchmarks,
//! on a GPU or on the simulator.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, Subcommand};
use cumem::DriverResource;
use cumem::copy::{StreamCopy, copy_d2d};
use cumem::driver::{self, DriverChoice, DriverKind};
use cumem::prelude::*;

/// Prints a line to stdout; a closed pipe (`cumem info | head`) is not an error worth a panic.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

mod bench;
mod chart;
mod progress;
mod replay_cmd;
mod strategy;
mod units;

use strategy::Strategy;
use units::human;

#[derive(Parser)]
#[command(name = "cumem", version, about = "Type-safe CUDA memory management: info, demo, replay and bench")]
struct Cli {
    /// Which driver to use: auto (the real one when it sees a device and is the libcuda.so cudarc
    /// would call, else the simulator; a mismatch seen only after the driver's cuInit is an error),
    /// real, or sim.
    /// Read as the library reads CUMEM_DRIVER: any case, and `cuda` or `simulator` too.
    #[arg(
        long,
        value_name = "auto|real|sim",
        value_parser = parse_driver,
        env = "CUMEM_DRIVER",
        default_value = "auto",
        global = true
    )]
    driver: DriverChoice,
    #[command(subcommand)]
    command: Command,
}

/// `--driver` and `CUMEM_DRIVER` go through the library's own parser, so that a value one accepts
/// the other does too.
fn parse_driver(value: &str) -> Result<DriverChoice, String> {
    value.parse().map_err(|e: Error| e.to_string())
}

#[derive(Subcommand)]
enum Command {
    /// List devices, their memory and capabilities.
    Info,
    /// Allocate, upload, copy, verify and free device memory, saying what happens.
    Demo {
        /// Elements per buffer.
        #[arg(long, default_value_t = 1 << 20)]
        elements: usize,
    },
    /// Replay an allocation trace (RMM's logging_resource_adaptor CSV) against each strategy and
    /// compare peak live and reserved bytes and latencies.
    Replay {
        /// The trace to replay.
        log: PathBuf,
        /// The strategies to compare, comma-separated.
        #[arg(
            long = "pool",
            value_enum,
            value_delimiter = ',',
            default_value = "caching,caching-expandable,native,driver"
        )]
        pools: Vec<Strategy>,
        /// Also draw live and reserved bytes over the trace into this SVG file.
        #[arg(long)]
        svg: Option<PathBuf>,
        /// Print JSON on stdout instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Measure copy bandwidth (H2D, D2H, D2D; pageable, staged, pinned, mapped) over sizes from 1 KiB, and
    /// the allocate+free latency of each strategy.
    Bench {
        /// The largest copy of the sweep (for example 64MiB).
        #[arg(long, value_parser = units::parse_size, default_value = "256MiB")]
        max_size: usize,
        /// Sizes up to 1 MiB only, fewer repetitions: a quick look.
        #[arg(long)]
        quick: bool,
        /// Also draw bandwidth against size into this SVG file.
        #[arg(long)]
        svg: Option<PathBuf>,
        /// Print JSON on stdout instead of the tables.
        #[arg(long)]
        json: bool,
    },
}

/// Why a command failed: the driver or cumem said no, or the input was unusable.
pub enum Failure {
    /// An error from cumem or the driver.
    Cuda(Error),
    /// A file that cannot be read, a trace that does not parse, a chart that cannot be written.
    Input(String),
    /// Every call succeeded, yet the data read back is not what was written: a bug in cumem or
    /// the driver, not a driver refusal.
    WrongData(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Cuda(e)
    }
}

fn main() -> ExitCode {
    // Warnings are shown unless CUMEM_LOG says otherwise: they report what a user should act on
    // (a driver passed over, memory that could not be given back).
    let filter = tracing_subscriber::EnvFilter::builder()
        .with_default_directive(tracing_subscriber::filter::LevelFilter::WARN.into())
        .with_env_var("CUMEM_LOG")
        .from_env_lossy();
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let cli = Cli::parse();
    let choice = cli.driver;
    let result = driver::select(choice).map_err(Failure::from).and_then(|kind| {
        let simulated = kind == DriverKind::Simulator;
        match cli.command {
            Command::Info => {
                say!("{}", banner(kind));
                info().map_err(Failure::from)
            }
            Command::Demo { elements } => {
                let size = demo_size(elements)?;
                say!("{}", banner(kind));
                demo(size)
            }
            Command::Replay { log, pools, svg, json } => {
                // JSON owns stdout, so that it parses as a whole.
                if json {
                    eprintln!("{}", banner(kind))
                } else {
                    say!("{}", banner(kind))
                }
                replay_cmd::run(&replay_cmd::ReplayArgs { log, pools, svg, json }, simulated)
            }
            Command::Bench { max_size, quick, svg, json } => {
                if json {
                    eprintln!("{}", banner(kind))
                } else {
                    say!("{}", banner(kind))
                }
                bench::run(&bench::BenchArgs { max_size, quick, svg, json }, simulated)
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Cuda(e @ Error::DriverNotFound { .. })) => {
            // The error names what was searched. `--driver sim` is a way out only where the
            // simulator was not tried: `auto` tried it already, and could not find it.
            eprintln!("cumem: error: {e}");
            match choice {
                DriverChoice::Real => eprintln!("cumem: use --driver sim to run on the simulator"),
                DriverChoice::Auto => eprintln!(
                    "cumem: to run on the simulator, set {} to the path of its library (libcumem_sim.so)",
                    driver::SIM_LIB_ENV
                ),
                DriverChoice::Simulator => {}
            }
            ExitCode::FAILURE
        }
        Err(Failure::Cuda(e)) => {
            eprintln!("cumem: error: {e}");
            ExitCode::FAILURE
        }
        Err(Failure::Input(e) | Failure::WrongData(e)) => {
            eprintln!("cumem: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn banner(kind: DriverKind) -> String {
    let what = driver::description().unwrap_or_default();
    match kind {
        DriverKind::Simulator => format!("cumem: running on the simulator, not a GPU ({what})"),
        DriverKind::Real => format!("cumem: running on the GPU driver ({what})"),
    }
}

fn info() -> Result<()> {
    say!("driver version: {}", driver::driver_version()?);
    for device in Device::all()? {
        let caps = device.capabilities()?;
        let (major, minor) = caps.compute_capability;
        let mem = device.context()?.mem_info()?;
        say!("device {}: {}", device.ordinal(), device.name()?);
        say!("  compute capability {major}.{minor}");
        say!("  memory: {} total, {} free", human(mem.total), human(mem.free));
        let flags = [
            ("unified addressing", caps.unified_addressing),
            ("managed memory", caps.managed_memory),
            ("concurrent managed access", caps.concurrent_managed_access),
            ("memory pools", caps.memory_pools),
            ("virtual memory", caps.virtual_memory),
            ("host mapping", caps.host_mapping),
            ("host register", caps.host_register),
        ];
        for (name, on) in flags {
            say!("  {name:<26} {}", if on { "yes" } else { "no" });
        }
    }
    // Peer matrix: A = peer access with native atomics, P = peer access, . = none.
    for line in cumem::peer::Topology::probe()?.to_string().lines() {
        say!("{line}");
    }
    Ok(())
}

/// The demo's buffers: `elements` values of `u32`, `bytes` bytes each.
struct DemoSize {
    elements: usize,
    bytes: usize,
}

/// Checks `--elements` before anything is allocated: the demo numbers its values with `u32`, and
/// a buffer's bytes must fit `usize`.
fn demo_size(elements: usize) -> Result<DemoSize, Failure> {
    let too_many =
        || Failure::Input(format!("--elements {elements} is more than the demo's {} values", u32::MAX));
    if u32::try_from(elements).is_err() {
        return Err(too_many());
    }
    let bytes = elements.checked_mul(size_of::<u32>()).ok_or_else(too_many)?;
    Ok(DemoSize { elements, bytes })
}

fn demo(size: DemoSize) -> Result<(), Failure> {
    let DemoSize { elements, bytes } = size;
    let ctx = Device::get(0)?.context()?;
    let before = ctx.mem_info()?;
    // Refused before the host data is built: that alone is `bytes` of host memory, and a size the
    // device can never hold would have the process abort on a failed host allocation first.
    if bytes.checked_mul(2).is_none_or(|both| both > before.total) {
        return Err(Failure::Input(format!(
            "--elements {elements}: the demo's two device buffers of {} each do not fit device 0's {} of memory",
            human(bytes),
            human(before.total)
        )));
    }
    say!("device 0: {} ({} free of {})", ctx.device().name()?, human(before.free), human(before.total));
    let started = Instant::now();
    {
        let stream = Stream::non_blocking(&ctx)?;
        let mut data: Vec<u32> = Vec::new();
        data.try_reserve_exact(elements).map_err(|e| {
            Failure::Input(format!(
                "--elements {elements}: no {} of host memory for the demo's data: {e}",
                human(bytes)
            ))
        })?;
        data.extend((0..=u32::MAX).take(elements).map(|i| i.wrapping_mul(2_654_435_761)));
        let host = PinnedBuffer::from_slice(&ctx, &data)?;
        say!("pinned   {} of host memory", human(bytes));

        let mut a = DeviceBuffer::<u32>::new(&stream, elements)?;
        let mut b = DeviceBuffer::<u32>::zeroed(&stream, elements)?;
        let during = ctx.mem_info()?;
        say!(
            "alloc    two device buffers of {} at {:#x} and {:#x} (device memory in use: +{})",
            human(bytes),
            a.device_ptr(),
            b.device_ptr(),
            human(before.free.saturating_sub(during.free))
        );

        stream.copy_h2d(&host, &mut a)?;
        say!("upload   {} host -> device, queued on a non-blocking stream", human(bytes));
        copy_d2d(&a, &mut b)?;
        say!("copy     {} device -> device (ordered after the upload by an event)", human(bytes));
        let half = elements / 2;
        stream.fill(&mut b.slice_mut(half..)?, 0xFFFF_FFFFu32)?;
        say!("memset   the second half of the copy to 0xffffffff");

        let mut back = PinnedBuffer::<u32>::zeroed(&ctx, elements)?;
        stream.copy_d2h(&b, &mut back)?;
        say!("download {} device -> pinned host, queued", human(bytes));
        let seen = back.as_slice()?; // waits for the download, nothing else
        let expected = |i: usize| if i < half { data[i] } else { u32::MAX };
        if let Some(i) = (0..elements).find(|&i| seen[i] != expected(i)) {
            return Err(Failure::WrongData(format!(
                "the demo read back wrong data: element {i} is {:#010x}, expected {:#010x}",
                seen[i],
                expected(i)
            )));
        }
        say!("verify   all {elements} elements match (first half copied, second half filled)");
    }
    pools(&ctx)?;
    // The device's default caching pool keeps its segments for reuse: give them back first, so
    // that the free memory shown is what the buffers' drops returned.
    cumem::pool::trim_current(&ctx.device())?;
    let after = ctx.mem_info()?;
    say!(
        "free     everything dropped: {} free again; {:.1} ms in all",
        human(after.free),
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

/// The caching pool against cuMemAlloc on the same workload.
fn pools(ctx: &Context) -> Result<()> {
    const BUFFERS: usize = 20_000;
    let streams = [Stream::non_blocking(ctx)?, Stream::non_blocking(ctx)?];
    let size = |i: usize| 256 + (i * 7919) % (64 << 10);
    let pool = Arc::new(CachingResource::with_driver(ctx, PoolConfig::default()));
    let resource = pool.clone();
    let t = Instant::now();
    for i in 0..BUFFERS {
        drop(DeviceBuffer::<u8>::new_in(&resource, &streams[i % 2], size(i))?);
    }
    let pooled = t.elapsed().as_nanos() as f64 / BUFFERS as f64;
    let stats = pool.stats();
    say!(
        "pool     {BUFFERS} buffers of 256 B..64 KiB on 2 streams from the caching pool: {pooled:.0} ns each, \
         {} cuMemAlloc call(s), {} reserved",
        stats.upstream_allocations,
        human(stats.reserved_bytes as usize)
    );
    let direct = Arc::new(DriverResource::new(ctx));
    let t = Instant::now();
    for i in 0..BUFFERS / 10 {
        drop(DeviceBuffer::<u8>::new_in(&direct, &streams[i % 2], size(i))?);
    }
    let plain = t.elapsed().as_nanos() as f64 / (BUFFERS / 10) as f64;
    say!(
        "         the same with cuMemAlloc/cuMemFree: {plain:.0} ns each ({:.0}x the pool's time)",
        plain / pooled
    );
    pool.trim()?;
    Ok(())
}
