//! Message channels (`cumem-channel`) per strategy: messages/s each way and the latency of one
//! message, for 64-byte and 4 KiB messages, printed as a second table by `cargo xtask bench
//! transfer`.
//!
//! No kernel runs here (the project builds without a CUDA toolkit): the device side is played with
//! blocking copies through the channel's device views, as the tests do, so a figure is the host
//! side's cost plus the copies a consuming kernel would not need. The ratios between strategies
//! are what the table is for.

use std::time::{Duration, Instant};

use bytemuck::Pod;
use cumem_channel::{ChannelError, ControlBlock, Direction, RingChannel, TransferStrategy, VisibilityReport};
use cumem_copy::{copy_d2h, copy_h2d};
use cumem_core::{Context, Stream};

const HEAD: usize = ControlBlock::HEAD_WORD;
const TAIL: usize = ControlBlock::TAIL_WORD;
const CAPACITY: usize = 256;
const BATCH: usize = 64;

fn word<T: Pod>(ch: &mut RingChannel<T>, index: usize) -> Result<u64, ChannelError> {
    let mut v = [0u64];
    copy_d2h(&ch.device_side().control.slice(index..index + 1)?, &mut v)?;
    Ok(v[0])
}

fn set_word<T: Pod>(ch: &mut RingChannel<T>, index: usize, value: u64) -> Result<(), ChannelError> {
    copy_h2d(&[value], &mut ch.device_side().control.slice_mut(index..index + 1)?)?;
    Ok(())
}

/// The device consuming everything published (slots read in at most two pieces, then `head`).
fn consume<T: Pod>(ch: &mut RingChannel<T>, scratch: &mut [T]) -> Result<usize, ChannelError> {
    let cap = ch.capacity() as u64;
    let (head, tail) = (word(ch, HEAD)?, word(ch, TAIL)?);
    let mut at = head;
    while at < tail {
        let slot = (at % cap) as usize;
        let len = ((tail - at) as usize).min(ch.capacity() - slot);
        copy_d2h(&ch.device_side().slots.slice(slot..slot + len)?, &mut scratch[..len])?;
        at += len as u64;
    }
    set_word(ch, HEAD, tail)?;
    Ok((tail - head) as usize)
}

/// The device publishing `msgs` (all fit: the caller polls in between).
fn produce<T: Pod>(ch: &mut RingChannel<T>, msgs: &[T]) -> Result<(), ChannelError> {
    let cap = ch.capacity() as u64;
    let tail = word(ch, TAIL)?;
    let mut done = 0;
    while done < msgs.len() {
        let slot = ((tail + done as u64) % cap) as usize;
        let len = (msgs.len() - done).min(ch.capacity() - slot);
        copy_h2d(&msgs[done..done + len], &mut ch.device_side().slots.slice_mut(slot..slot + len)?)?;
        done += len;
    }
    set_word(ch, TAIL, tail + msgs.len() as u64)
}

/// One row: strategy, message size, messages/s host→device and device→host, µs per message alone.
pub struct ChannelRow {
    /// Strategy name.
    pub strategy: String,
    /// Bytes per message.
    pub message_bytes: usize,
    /// Messages per second host→device (batches of 64: send_batch, flush, device consumes).
    pub h2d_per_s: f64,
    /// Messages per second device→host (device publishes 64, host polls).
    pub d2h_per_s: f64,
    /// One message host→device alone: send, flush, device sees and consumes it (best of the runs).
    pub latency_us: f64,
    /// Why the device refused the strategy (a row of its own, not a failure of the bench).
    pub refused: Option<String>,
}

fn measure<T: Pod>(
    stream: &Stream,
    strategy: TransferStrategy,
    report: &VisibilityReport,
    rounds: usize,
) -> Result<(f64, f64, f64), ChannelError> {
    let mut scratch = vec![T::zeroed(); CAPACITY];
    let msgs = vec![T::zeroed(); BATCH];
    let mut h2d =
        RingChannel::<T>::new_checked(stream, Direction::HostToDevice, CAPACITY, strategy.clone(), report)?;
    let t = Instant::now();
    for _ in 0..rounds {
        let sent = h2d.send_batch(&msgs)?;
        h2d.flush_to_device()?;
        assert_eq!(consume(&mut h2d, &mut scratch)?, sent);
    }
    let h2d_rate = (rounds * BATCH) as f64 / t.elapsed().as_secs_f64();

    let mut best = Duration::MAX;
    for _ in 0..rounds {
        let t = Instant::now();
        let _ = h2d.send(msgs[0])?;
        h2d.flush_to_device()?;
        consume(&mut h2d, &mut scratch)?;
        best = best.min(t.elapsed());
    }

    let mut d2h = RingChannel::<T>::new_checked(stream, Direction::DeviceToHost, CAPACITY, strategy, report)?;
    let mut got = Vec::with_capacity(CAPACITY);
    let t = Instant::now();
    for _ in 0..rounds {
        produce(&mut d2h, &msgs)?;
        got.clear();
        d2h.poll_from_device(&mut got)?;
        assert_eq!(got.len(), BATCH);
    }
    let d2h_rate = (rounds * BATCH) as f64 / t.elapsed().as_secs_f64();
    Ok((h2d_rate, d2h_rate, best.as_secs_f64() * 1e6))
}

/// Every strategy the device runs, for 64 B and 4 KiB messages (`rounds` batches each).
pub fn channel_rows(ctx: &Context, rounds: usize) -> Result<Vec<ChannelRow>, ChannelError> {
    let report = VisibilityReport::detect(ctx.device())?;
    let stream = Stream::non_blocking(ctx)?;
    let strategies = [
        TransferStrategy::Sync,
        TransferStrategy::Async { stream: Stream::non_blocking(ctx)? },
        TransferStrategy::Unified,
        TransferStrategy::MappedPolling { interval: cumem_channel::DEFAULT_POLL_INTERVAL },
    ];
    let mut rows = Vec::new();
    for strategy in strategies {
        let name = strategy.kind().to_string();
        if let Err(e) = strategy.check_against(&report) {
            rows.push(ChannelRow {
                strategy: name,
                message_bytes: 0,
                h2d_per_s: 0.0,
                d2h_per_s: 0.0,
                latency_us: 0.0,
                refused: Some(e.to_string()),
            });
            continue;
        }
        for bytes in [64usize, 4096] {
            let (h2d_per_s, d2h_per_s, latency_us) = if bytes == 64 {
                measure::<[u64; 8]>(&stream, strategy.clone(), &report, rounds)?
            } else {
                measure::<[u64; 512]>(&stream, strategy.clone(), &report, rounds)?
            };
            rows.push(ChannelRow {
                strategy: name.clone(),
                message_bytes: bytes,
                h2d_per_s,
                d2h_per_s,
                latency_us,
                refused: None,
            });
        }
    }
    Ok(rows)
}

/// Prints the rows as a markdown table.
pub fn print_channel_table(rows: &[ChannelRow]) {
    println!(
        "\n## Message channels (cumem-channel; device side played by copies, capacity {CAPACITY}, batches of {BATCH})\n"
    );
    println!("| strategy | message | host→device msg/s | device→host msg/s | one message host→device (µs) |");
    println!("|---|---:|---:|---:|---:|");
    for r in rows {
        if let Some(why) = &r.refused {
            println!("| {} | | refused: {why} | | |", r.strategy);
            continue;
        }
        let size = if r.message_bytes >= 1024 {
            format!("{} KiB", r.message_bytes >> 10)
        } else {
            format!("{} B", r.message_bytes)
        };
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.1} |",
            r.strategy, size, r.h2d_per_s, r.d2h_per_s, r.latency_us
        );
    }
}
