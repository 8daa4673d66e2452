//! The allocation-trace format: one CSV row per allocate or free, as RAPIDS RMM's
//! `logging_resource_adaptor` writes it, so that logs move between RMM and cumem in both directions.
//!
//! The header is `Thread,Time,Action,Pointer,Size,Stream`. A row names the thread (an integer), the
//! time, the action (`allocate`, `free`, or `allocate failure`), the device pointer and stream in
//! hexadecimal, and the size in bytes.
//!
//! RMM's adaptor (`logging_resource_adaptor_impl.cpp`) writes each row through the spdlog pattern
//! `%t,%H:%M:%S.%f,%v` and the message `allocate,%p,%zu,%s`: the OS thread id, the time of day to
//! the microsecond, the pointer as C's `%p` prints it (`(nil)` for the null pointer of a failed
//! allocation) and the stream as a C++ stream prints a pointer (`0` for the default stream, `0x…`
//! otherwise). Its user guide shows seconds since the epoch and the older word `deallocate`.
//! Reading accepts all of these (RMM's own replay parser maps `(nil)` to 0 as well); writing uses
//! seconds since the epoch (a time of day wraps at midnight), `allocate`/`free`/`allocate failure`
//! and `0x`-prefixed pointers and streams, which RMM's replay parser reads.
//!
//! ```
//! use cumem_pool::trace_format::{TraceAction, TraceRecord, parse_trace, write_header};
//!
//! let mut csv = Vec::new();
//! write_header(&mut csv).unwrap();
//! let row = TraceRecord {
//!     thread: 7,
//!     time: 1_700_000_000.25,
//!     action: TraceAction::Allocate,
//!     pointer: 0x7f00_0000_0000,
//!     size: 4096,
//!     stream: 0,
//! };
//! row.write_csv(&mut csv).unwrap();
//! let text = String::from_utf8(csv).unwrap();
//! assert_eq!(text, "Thread,Time,Action,Pointer,Size,Stream\n7,1700000000.250000,allocate,0x7f0000000000,4096,0x0\n");
//! assert_eq!(parse_trace(text.as_bytes()).unwrap(), vec![row]);
//! ```

use std::io::{self, BufRead, Write};

/// The header line of a trace, without its newline.
pub const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// What one trace row records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceAction {
    /// A successful allocation of `size` bytes at `pointer`.
    Allocate,
    /// A free of the allocation at `pointer` (RMM writes `free`; older logs `deallocate`).
    Free,
    /// An allocation of `size` bytes that failed (RMM's `allocate failure`); nothing was allocated.
    AllocateFailure,
}

impl TraceAction {
    /// The word written in the `Action` column.
    pub fn as_str(self) -> &'static str {
        match self {
            TraceAction::Allocate => "allocate",
            TraceAction::Free => "free",
            TraceAction::AllocateFailure => "allocate failure",
        }
    }

    fn parse(word: &str) -> Option<Self> {
        match word.trim() {
            "allocate" => Some(TraceAction::Allocate),
            "free" | "deallocate" => Some(TraceAction::Free),
            "allocate failure" | "allocate_failure" => Some(TraceAction::AllocateFailure),
            _ => None,
        }
    }
}

/// One row of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceRecord {
    /// The thread that made the call (an opaque integer; rows of one thread keep their order).
    pub thread: u64,
    /// When, in seconds (since the epoch, or since midnight for RMM's older time-of-day form).
    pub time: f64,
    /// What happened.
    pub action: TraceAction,
    /// The device address allocated or freed (0 for a failed allocation).
    pub pointer: u64,
    /// Bytes requested.
    pub size: usize,
    /// The stream the call named (its handle value; 0 is the legacy default stream).
    pub stream: u64,
}

impl TraceRecord {
    /// Writes the row as one CSV line, newline included.
    ///
    /// # Errors
    /// Whatever the writer reports.
    pub fn write_csv(&self, out: &mut impl Write) -> io::Result<()> {
        writeln!(
            out,
            "{},{:.6},{},{:#x},{},{:#x}",
            self.thread,
            self.time,
            self.action.as_str(),
            self.pointer,
            self.size,
            self.stream
        )
    }
}

/// Writes [`HEADER`] and a newline.
///
/// # Errors
/// Whatever the writer reports.
pub fn write_header(out: &mut impl Write) -> io::Result<()> {
    writeln!(out, "{HEADER}")
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceParseError {
    /// Reading the input failed.
    #[error("reading the trace failed: {0}")]
    Io(#[from] io::Error),
    /// The first line is not a header with the six RMM columns.
    #[error("line 1: expected the header `{HEADER}`, found `{found}`")]
    Header {
        /// The line found instead.
        found: String,
    },
    /// A row that does not parse; `line` counts from 1, header included.
    #[error("line {line}: {reason}: `{text}`")]
    Row {
        /// The line number, counting the header as line 1.
        line: usize,
        /// What is wrong with it.
        reason: &'static str,
        /// The line as read.
        text: String,
    },
}

/// Reads a whole trace: the header, then one record per non-empty line, in file order.
///
/// Column names are matched without regard to case or surrounding spaces, so RMM's logs and
/// hand-edited ones both read.
///
/// # Errors
/// [`TraceParseError`] naming the first line that does not parse.
pub fn parse_trace(input: impl BufRead) -> Result<Vec<TraceRecord>, TraceParseError> {
    let mut lines = input.split(b'\n').map(|bytes| {
        // Lines are read as bytes, so that one that is not UTF-8 is named by its number rather
        // than ending the read with an I/O error; a `\r` before the newline is dropped, as
        // `BufRead::lines` does.
        bytes.map(|mut b| {
            if b.last() == Some(&b'\r') {
                b.pop();
            }
            String::from_utf8(b).map_err(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
        })
    });
    let header = match lines.next().transpose()? {
        None => String::new(),
        Some(Ok(header)) => header,
        Some(Err(found)) => return Err(TraceParseError::Header { found }),
    };
    let columns: Vec<String> = header.split(',').map(|c| c.trim().to_ascii_lowercase()).collect();
    let expected: Vec<String> = HEADER.split(',').map(str::to_ascii_lowercase).collect();
    if columns != expected {
        return Err(TraceParseError::Header { found: header });
    }
    let mut records = Vec::new();
    for (index, line) in lines.enumerate() {
        let number = index + 2;
        let line = match line? {
            Ok(line) => line,
            Err(text) => {
                return Err(TraceParseError::Row { line: number, reason: "the line is not UTF-8", text });
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        let row = |reason| TraceParseError::Row { line: number, reason, text: line.clone() };
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let [thread, time, action, pointer, size, stream] = fields[..] else {
            return Err(row("expected 6 comma-separated fields"));
        };
        records.push(TraceRecord {
            thread: parse_integer(thread).ok_or_else(|| row("the thread is not an integer"))?,
            time: parse_time(time).ok_or_else(|| row("the time is neither seconds nor HH:MM:SS.f"))?,
            action: TraceAction::parse(action).ok_or_else(|| row("unknown action"))?,
            pointer: parse_integer(pointer).ok_or_else(|| row("the pointer is not an integer"))?,
            size: parse_integer(size)
                .and_then(|s| usize::try_from(s).ok())
                .ok_or_else(|| row("the size is not an integer"))?,
            stream: parse_integer(stream).ok_or_else(|| row("the stream is not an integer"))?,
        });
    }
    Ok(records)
}

/// Decimal, or hexadecimal with a `0x` prefix (RMM writes pointers and streams that way), or C's
/// `%p` of a null pointer, `(nil)` (RMM's pointer of a failed allocation, as glibc prints it).
fn parse_integer(text: &str) -> Option<u64> {
    if text == "(nil)" {
        return Some(0);
    }
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

/// Seconds with a fraction, or RMM's older `HH:MM:SS.ffffff` time of day.
fn parse_time(text: &str) -> Option<f64> {
    let parts: Vec<&str> = text.split(':').collect();
    let seconds = match parts[..] {
        [seconds] => seconds.parse::<f64>().ok()?,
        [h, m, s] => {
            let (h, m, s) = (h.parse::<u32>().ok()?, m.parse::<u32>().ok()?, s.parse::<f64>().ok()?);
            f64::from(h) * 3600.0 + f64::from(m) * 60.0 + s
        }
        _ => return None,
    };
    seconds.is_finite().then_some(seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_forms_rmm_has_written() {
        let log = "Thread, Time, Action, Pointer, Size, Stream\n\
                   140573312345856,1634567890.234567,allocate,0x7f8a40000400,2048,0x7f8a38001020\n\
                   \n\
                   12,10:30:45.500000,deallocate,0x7F8A40000400,2048,0x0\n\
                   12,10:30:46.000000,allocate failure,0x0,1099511627776,0x0\n";
        let rows = parse_trace(log.as_bytes()).unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].thread, 140_573_312_345_856);
        assert_eq!(
            (rows[0].action, rows[0].pointer, rows[0].size),
            (TraceAction::Allocate, 0x7f8a_4000_0400, 2048)
        );
        assert_eq!(rows[0].stream, 0x7f8a_3800_1020);
        assert_eq!((rows[1].action, rows[1].time), (TraceAction::Free, 10.0 * 3600.0 + 30.0 * 60.0 + 45.5));
        assert_eq!((rows[2].action, rows[2].size), (TraceAction::AllocateFailure, 1 << 40));
    }

    /// Rows exactly as RMM's adaptor writes them: `%t,%H:%M:%S.%f,` then `allocate,%p,%zu,%s`, where
    /// `%p` of the failed allocation's null pointer is glibc's `(nil)` and the default stream is
    /// printed by a C++ stream as `0`.
    #[test]
    fn reads_rows_as_rmms_adaptor_prints_them() {
        let log = "Thread,Time,Action,Pointer,Size,Stream\n\
                   48213,11:05:51.539463,allocate,0x7f3a52000000,1048576,0\n\
                   48213,11:05:51.539470,allocate failure,(nil),1099511627776,0x55d0c8a1b2c0\n\
                   48213,11:05:51.539501,free,0x7f3a52000000,1048576,0\n";
        let rows = parse_trace(log.as_bytes()).unwrap();
        let seen: Vec<_> = rows.iter().map(|r| (r.thread, r.action, r.pointer, r.size, r.stream)).collect();
        assert_eq!(
            seen,
            [
                (48213, TraceAction::Allocate, 0x7f3a_5200_0000, 1 << 20, 0),
                (48213, TraceAction::AllocateFailure, 0, 1 << 40, 0x55d0_c8a1_b2c0),
                (48213, TraceAction::Free, 0x7f3a_5200_0000, 1 << 20, 0),
            ]
        );
        assert_eq!(rows[0].time, 11.0 * 3600.0 + 5.0 * 60.0 + 51.539463);
    }

    #[test]
    fn names_the_line_that_is_wrong() {
        match parse_trace("Thread,Time,Action,Pointer,Size,Stream\n1,2.0,allocate,0x10,12\n".as_bytes()) {
            Err(TraceParseError::Row { line: 2, reason, .. }) => assert!(reason.contains("6")),
            other => panic!("expected a row error on line 2, got {other:?}"),
        }
        match parse_trace("Thread,Time,Action,Pointer,Size,Stream\n1,2.0,resize,0x10,12,0\n".as_bytes()) {
            Err(TraceParseError::Row { line: 2, reason: "unknown action", .. }) => {}
            other => panic!("expected an unknown action, got {other:?}"),
        }
        assert!(matches!(parse_trace("a,b\n".as_bytes()), Err(TraceParseError::Header { .. })));
        assert!(matches!(parse_trace("".as_bytes()), Err(TraceParseError::Header { .. })));
    }

    /// Bytes that are not UTF-8 (a binary file, a log cut mid-character) name their line like
    /// any other bad row, instead of ending the read with a bare I/O error.
    #[test]
    fn a_line_that_is_not_utf8_is_named_by_its_number() {
        let log = b"Thread,Time,Action,Pointer,Size,Stream\r\n1,0.5,allocate,0x10,12,0x0\r\n\xff\xfe,0.6,free,0x10,12,0x0\n";
        match parse_trace(&log[..]) {
            Err(TraceParseError::Row { line: 3, reason, text }) => {
                assert!(reason.contains("UTF-8"), "{reason}");
                assert!(text.ends_with(",0.6,free,0x10,12,0x0"), "{text}");
            }
            other => panic!("expected a row error on line 3, got {other:?}"),
        }
        assert!(matches!(parse_trace(&b"\xffThread,Time\n"[..]), Err(TraceParseError::Header { .. })));
        // Windows line ends read as before.
        let crlf = "Thread,Time,Action,Pointer,Size,Stream\r\n1,0.5,allocate,0x10,12,0x0\r\n";
        assert_eq!(parse_trace(crlf.as_bytes()).unwrap()[0].stream, 0);
    }

    #[test]
    fn what_is_written_reads_back_unchanged() {
        let rows = [
            TraceRecord {
                thread: 1,
                time: 0.5,
                action: TraceAction::Allocate,
                pointer: 0x100,
                size: 1,
                stream: 3,
            },
            TraceRecord {
                thread: 2,
                time: 1.25,
                action: TraceAction::Free,
                pointer: 0x100,
                size: 1,
                stream: 3,
            },
            TraceRecord {
                thread: 2,
                time: 2.0,
                action: TraceAction::AllocateFailure,
                pointer: 0,
                size: 9,
                stream: 0,
            },
        ];
        let mut csv = Vec::new();
        write_header(&mut csv).unwrap();
        for row in &rows {
            row.write_csv(&mut csv).unwrap();
        }
        assert_eq!(parse_trace(csv.as_slice()).unwrap(), rows);
    }
}
