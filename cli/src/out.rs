//! Writing to stdout without panicking when the reader goes away (`ncclreshard … | head`).

use ncclreshard::Mesh;
use std::io::Write;

/// Writes `text` to stdout. If stdout is closed or fails, there is no one left to report to:
/// exit with status 1 rather than panic.
pub fn print(text: &str) {
    let mut stdout = std::io::stdout().lock();
    if stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
        .is_err()
    {
        std::process::exit(1);
    }
}

/// Writes one line (a newline is added).
pub fn line(text: &str) {
    print(&format!("{text}\n"));
}

/// `0-127` for a contiguous ascending rank list, else the list itself.
pub fn ranks(ranks: &[u32]) -> String {
    match (ranks.first(), ranks.last()) {
        (Some(&first), Some(&last))
            if ranks.len() > 2 && ranks.windows(2).all(|w| w[0].checked_add(1) == Some(w[1])) =>
        {
            format!("{first}-{last}")
        }
        _ => {
            // Holes (a survivors' layout) as `_`.
            let shown: Vec<String> = ranks
                .iter()
                .map(|&r| {
                    if r == Mesh::HOLE {
                        "_".to_string()
                    } else {
                        r.to_string()
                    }
                })
                .collect();
            format!("[{}]", shown.join(", "))
        }
    }
}

/// Serialises `value` as pretty JSON plus a newline.
pub fn json<T: serde::Serialize>(value: &T) -> String {
    let mut text = serde_json::to_string_pretty(value).expect("CLI output types serialise");
    text.push('\n');
    text
}

/// Bytes in decimal units (`1.23 GB`), like link datasheets; exact below 1 kB.
pub fn bytes(n: u64) -> String {
    const UNITS: [(&str, f64); 4] = [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)];
    let x = n as f64;
    match UNITS.iter().find(|(_, size)| x >= *size) {
        Some((unit, size)) => format!("{:.2} {unit}", x / size),
        None => format!("{n} B"),
    }
}

/// Seconds with three significant-ish digits (`14.2 s`, `0.873 s`, `12.5 ms`).
pub fn seconds(s: f64) -> String {
    if s >= 10.0 {
        format!("{s:.1} s")
    } else if s >= 0.1 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

/// An integer with thousands separators (`1,234,567`).
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let head = match digits.len() % 3 {
        0 => 3.min(digits.len()),
        r => r,
    };
    let mut text = digits[..head].to_string();
    for group in digits.as_bytes()[head..].chunks(3) {
        text.push(',');
        text.push_str(std::str::from_utf8(group).expect("ASCII digits"));
    }
    text
}

/// `a / b` as a ratio (`16.2×`); `-` when `b` is zero.
pub fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "-".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_like_a_person_writes_them() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(123_456), "123,456");
        assert_eq!(count(1_234_567), "1,234,567");
        assert_eq!(bytes(999), "999 B");
        assert_eq!(bytes(1500), "1.50 kB");
        assert_eq!(bytes(65_520_000_000), "65.52 GB");
        assert_eq!(seconds(14.21), "14.2 s");
        assert_eq!(seconds(0.8731), "0.873 s");
        assert_eq!(seconds(0.0125), "12.50 ms");
        assert_eq!(ratio(3.0, 2.0), "1.50×");
        assert_eq!(ratio(3.0, 0.0), "-");
    }
}
