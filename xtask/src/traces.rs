//! `cargo xtask traces`: writes the allocation traces in `traces/` that `cumem replay` starts from.
//!
//! Each trace is generated from a fixed seed, so running the task again rewrites the same bytes; the
//! rows are RMM's `logging_resource_adaptor` CSV, written by `cumem_pool::trace_format`:
//!
//! - `training.csv`: a training loop. Weights and optimizer state are allocated once; each step
//!   picks a batch size, allocates every layer's activations going forward (with a short-lived
//!   workspace per layer), then frees them in reverse going backward while gradients come and go.
//! - `inference.csv`: an inference server. Requests of mixed sizes (prompt, key/value cache growing
//!   with the generated length, output) arrive over time and are served by 4 worker threads, each
//!   on its own stream; a request's memory lives until it completes, so lifetimes interleave.
//! - `random.csv`: RMM's `random_allocations` benchmark pattern: while under the allocation count,
//!   allocate with probability 73 % (a size uniform in 1 B ..= 4 MiB), otherwise free a live
//!   allocation chosen at random; then free the rest. Freed addresses are reused, as an allocator
//!   reuses them: an allocation takes the smallest freed block it fits, whole, before new address
//!   space, so the replay meets pointers that were live, freed, and live again.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use cumem_pool::trace_format::{TraceAction, TraceRecord, write_header};

/// The first thread's id. RMM logs spdlog's `%t` (the OS thread id); any integer serves, since a
/// replay only needs the rows of one thread to share it.
const THREAD_BASE: u64 = 140_245_167_736_640;
/// Where the synthetic address space starts (a typical device address on Linux).
const ADDRESS_BASE: u64 = 0x7f3a_4000_0000;
/// The first trace's timestamp (seconds since the epoch).
const EPOCH: f64 = 1_763_800_000.0;

/// Writes every trace into `dir`, saying what it wrote.
pub fn generate(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    for (name, rows) in
        [("training.csv", training()), ("inference.csv", inference()), ("random.csv", random())]
    {
        let path = dir.join(name);
        let shown = Path::new("traces").join(name);
        let write = || -> std::io::Result<()> {
            let mut out = BufWriter::new(File::create(&path)?);
            write_header(&mut out)?;
            for row in &rows {
                row.write_csv(&mut out)?;
            }
            out.flush()
        };
        write().map_err(|e| format!("writing {}: {e}", path.display()))?;
        eprintln!("    wrote {} ({} rows)", shown.display(), rows.len());
    }
    Ok(())
}

/// SplitMix64: small, seeded, and the same on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// A logged allocation: its pointer and size.
type Allocation = (u64, usize);

/// Records rows with addresses that never overlap a live allocation and a clock that moves on.
struct Log {
    rows: Vec<TraceRecord>,
    next_address: u64,
    time: f64,
    /// Freed blocks (address, bytes) that later allocations may take, when addresses are reused.
    freed: Option<Vec<(u64, u64)>>,
    /// The bytes of the block behind each live pointer, when addresses are reused.
    blocks: std::collections::HashMap<u64, u64>,
}

impl Log {
    /// A log whose addresses are never reused, which keeps every pointer unambiguous.
    fn new() -> Self {
        Log {
            rows: Vec::new(),
            next_address: ADDRESS_BASE,
            time: EPOCH,
            freed: None,
            blocks: std::collections::HashMap::new(),
        }
    }

    /// A log that hands a freed block, whole, to the next allocation that fits it best.
    fn reusing_addresses() -> Self {
        Log { freed: Some(Vec::new()), ..Log::new() }
    }

    fn allocate(&mut self, thread: u64, stream: u64, size: usize, micros: f64) -> (u64, usize) {
        // 256-byte aligned like RMM's.
        let needed = (size as u64).next_multiple_of(256);
        let reused = self.freed.as_mut().and_then(|freed| {
            let best = (0..freed.len())
                .filter(|&i| freed[i].1 >= needed)
                .min_by_key(|&i| (freed[i].1, freed[i].0))?;
            Some(freed.swap_remove(best))
        });
        let (pointer, bytes) = reused.unwrap_or_else(|| {
            let pointer = self.next_address;
            self.next_address += needed;
            (pointer, needed)
        });
        if self.freed.is_some() {
            self.blocks.insert(pointer, bytes);
        }
        self.push(thread, TraceAction::Allocate, pointer, size, stream, micros);
        (pointer, size)
    }

    fn free(&mut self, thread: u64, stream: u64, (pointer, size): (u64, usize), micros: f64) {
        if let Some(freed) = &mut self.freed {
            let bytes = self.blocks.remove(&pointer).expect("only live allocations are freed");
            freed.push((pointer, bytes));
        }
        self.push(thread, TraceAction::Free, pointer, size, stream, micros);
    }

    /// Moves the clock to `micros` after the start, unless it is already later.
    fn advance_to(&mut self, micros: u64) {
        self.time = self.time.max(EPOCH + micros as f64 * 1e-6);
    }

    fn push(
        &mut self,
        thread: u64,
        action: TraceAction,
        pointer: u64,
        size: usize,
        stream: u64,
        micros: f64,
    ) {
        self.time += micros * 1e-6;
        self.rows.push(TraceRecord { thread, time: self.time, action, pointer, size, stream });
    }
}

fn training() -> Vec<TraceRecord> {
    const LAYERS: usize = 24;
    const STEPS: usize = 60;
    const HIDDEN: usize = 512;
    const SEQUENCE: usize = 256;
    let mut rng = Rng(0x7a1_2024);
    let mut log = Log::new();
    let (thread, stream) = (THREAD_BASE, 0);
    // Weights (fp16, 4·hidden² per layer) and Adam's two moments in fp32, kept for the whole run.
    let mut persistent = Vec::new();
    for _ in 0..LAYERS {
        for bytes in [4 * HIDDEN * HIDDEN * 2, 4 * HIDDEN * HIDDEN * 4, 4 * HIDDEN * HIDDEN * 4] {
            persistent.push(log.allocate(thread, stream, bytes, 20.0));
        }
    }
    for _ in 0..STEPS {
        let batch = [4usize, 6, 8, 12][rng.range(0, 3) as usize];
        let tokens = batch * SEQUENCE - rng.range(0, 64) as usize; // padding trimmed per batch
        let input = log.allocate(thread, stream, tokens * 8, 15.0);
        let mut activations = Vec::new();
        for layer in 0..LAYERS {
            // Attention and the MLP keep differently sized tensors for backward.
            let width = if layer % 2 == 0 { HIDDEN } else { 4 * HIDDEN };
            activations.push(log.allocate(thread, stream, tokens * width * 2, 30.0));
            let workspace = log.allocate(thread, stream, rng.range(64 << 10, 4 << 20) as usize, 5.0);
            log.free(thread, stream, workspace, 40.0);
        }
        let loss = log.allocate(thread, stream, tokens * 4, 10.0);
        let mut upstream = log.allocate(thread, stream, tokens * HIDDEN * 2, 10.0);
        log.free(thread, stream, loss, 5.0);
        for activation in activations.into_iter().rev() {
            let gradient = log.allocate(thread, stream, tokens * HIDDEN * 2, 30.0);
            let weight_gradient = log.allocate(thread, stream, 4 * HIDDEN * HIDDEN * 2, 10.0);
            log.free(thread, stream, activation, 40.0);
            log.free(thread, stream, upstream, 5.0);
            log.free(thread, stream, weight_gradient, 20.0); // applied by the optimizer at once
            upstream = gradient;
        }
        log.free(thread, stream, upstream, 5.0);
        log.free(thread, stream, input, 200.0);
    }
    for allocation in persistent.into_iter().rev() {
        log.free(thread, stream, allocation, 5.0);
    }
    log.rows
}

fn inference() -> Vec<TraceRecord> {
    const WORKERS: u64 = 4;
    const REQUESTS: usize = 1800;
    let mut rng = Rng(0x1f3e_4e5c);
    let mut log = Log::new();
    let workers: Vec<(u64, u64)> =
        (0..WORKERS).map(|w| (THREAD_BASE - (w + 1) * 0x80_1000, 0x55d0_c8a1_b2c0 + w * 0x1a0)).collect();
    // Live requests: (completion time in µs, worker, allocations).
    let mut live: Vec<(u64, usize, Vec<Allocation>)> = Vec::new();
    let mut now = 0u64;
    for request in 0..REQUESTS {
        now += rng.range(50, 900);
        log.advance_to(now);
        // Complete what finished before this arrival, in completion order.
        live.sort_by_key(|&(done, worker, _)| (std::cmp::Reverse(done), worker));
        while live.last().is_some_and(|&(done, _, _)| done <= now) {
            let (_, worker, allocations) = live.pop().expect("checked above");
            let (thread, stream) = workers[worker];
            for allocation in allocations.into_iter().rev() {
                log.free(thread, stream, allocation, 3.0);
            }
        }
        let worker = request % WORKERS as usize;
        let (thread, stream) = workers[worker];
        // Prompt lengths are mostly short with a long tail; outputs vary independently.
        let prompt = if rng.range(0, 9) == 0 { rng.range(1024, 8192) } else { rng.range(16, 1024) } as usize;
        let generated = rng.range(1, 512) as usize;
        let mut allocations = vec![
            log.allocate(thread, stream, prompt * 4, 4.0),
            log.allocate(thread, stream, (prompt + generated) * 2 * 16 * 64 * 2, 6.0),
        ];
        let scratch = log.allocate(thread, stream, prompt * 4096 * 2, 3.0);
        log.free(thread, stream, scratch, 8.0);
        allocations.push(log.allocate(thread, stream, generated * 4, 2.0));
        live.push((now + generated as u64 * rng.range(20, 60), worker, allocations));
    }
    live.sort_by_key(|&(done, worker, _)| (done, worker));
    for (_, worker, allocations) in live {
        let (thread, stream) = workers[worker];
        for allocation in allocations.into_iter().rev() {
            log.free(thread, stream, allocation, 3.0);
        }
    }
    log.rows
}

fn random() -> Vec<TraceRecord> {
    const ALLOCATIONS: usize = 8000;
    const MAX_SIZE: u64 = 4 << 20;
    const MAX_USAGE: usize = 1 << 30;
    let mut rng = Rng(0x2a);
    let mut log = Log::reusing_addresses();
    let (thread, stream) = (THREAD_BASE, 0);
    let mut live: Vec<(u64, usize)> = Vec::new();
    let (mut made, mut usage) = (0usize, 0usize);
    while !live.is_empty() || made < ALLOCATIONS {
        let allocate = live.is_empty() || (rng.range(0, 99) < 73 && made < ALLOCATIONS && usage < MAX_USAGE);
        if allocate {
            let allocation = log.allocate(thread, stream, rng.range(1, MAX_SIZE) as usize, 2.0);
            usage += allocation.1;
            made += 1;
            live.push(allocation);
        } else {
            let index = rng.range(0, live.len() as u64 - 1) as usize;
            let allocation = live.swap_remove(index);
            usage -= allocation.1;
            log.free(thread, stream, allocation, 2.0);
        }
    }
    log.rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_traces_are_what_the_generator_writes() {
        let dir = std::env::temp_dir().join(format!("cumem-traces-{}", std::process::id()));
        generate(&dir).unwrap();
        let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces");
        for name in ["training.csv", "inference.csv", "random.csv"] {
            let fresh = std::fs::read(dir.join(name)).unwrap();
            let kept = std::fs::read(committed.join(name)).unwrap();
            assert!(fresh == kept, "traces/{name} differs from what `cargo xtask traces` writes; rerun it");
            let rows = cumem_pool::trace_format::parse_trace(fresh.as_slice()).unwrap();
            assert!(rows.len() <= 20_000, "traces/{name} has {} rows; CI replays it", rows.len());
            if name == "random.csv" {
                let allocated = rows.iter().filter(|r| r.action == TraceAction::Allocate);
                let distinct: std::collections::HashSet<u64> = allocated.clone().map(|r| r.pointer).collect();
                assert!(distinct.len() < allocated.count() / 2, "random.csv reuses freed addresses");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
