//! Byte counts for people: printing them (`1.5 MiB`) and reading them from the command line (`64MiB`).

/// `bytes` with a binary unit and one decimal.
pub fn human(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{v:.1} {}", UNITS[unit]) }
}

/// A size as written on the command line: a number with an optional `K`/`KiB`, `M`/`MiB` or
/// `G`/`GiB` suffix (binary units either way).
pub fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let digits = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let number: usize = number.parse().map_err(|_| format!("`{text}` does not start with a number"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" | "kb" => 10,
        "m" | "mib" | "mb" => 20,
        "g" | "gib" | "gb" => 30,
        other => return Err(format!("unknown unit `{other}` (use KiB, MiB or GiB)")),
    };
    number.checked_mul(1 << shift).filter(|&n| n > 0).ok_or_else(|| format!("`{text}` is not a usable size"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_and_print() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1k"), Ok(1024));
        assert!(parse_size("0").is_err() && parse_size("MiB").is_err() && parse_size("3 parsecs").is_err());
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(12), "12 B");
    }
}
