//! Writing to stdout without panicking when the reader goes away (`ncclreshard … | head`).

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
            if ranks.len() > 2 && ranks.windows(2).all(|w| w[1] == w[0] + 1) =>
        {
            format!("{first}-{last}")
        }
        _ => format!("{ranks:?}"),
    }
}

/// Serialises `value` as pretty JSON plus a newline.
pub fn json<T: serde::Serialize>(value: &T) -> String {
    let mut text = serde_json::to_string_pretty(value).expect("CLI output types serialise");
    text.push('\n');
    text
}
