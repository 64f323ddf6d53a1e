//! Output: JSON for programs, plain tables and lines for people, progress on stderr.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use comfy_table::{presets, ContentArrangement, Table};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

/// Where results go: `--json` or tables.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Out {
    /// Print JSON.
    pub(crate) json: bool,
}

impl Out {
    /// Prints `value` as pretty JSON on stdout.
    pub(crate) fn json<T: Serialize + ?Sized>(&self, value: &T) -> anyhow::Result<()> {
        let text = serde_json::to_string_pretty(value).context("encoding the output as JSON")?;
        line(&text)
    }
}

/// Prints one line on stdout; a closed pipe (`| head`) is not an error.
pub(crate) fn line(text: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{text}") {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("writing to stdout"),
    }
}

/// A borderless table with a header row, as `kubectl` prints them.
pub(crate) fn table<I, S>(header: I) -> Table
where
    I: IntoIterator<Item = S>,
    S: Into<comfy_table::Cell>,
{
    let mut table = Table::new();
    table
        .load_preset(presets::NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header);
    table
}

/// Prints a table, and `empty` instead when it has no rows.
pub(crate) fn print_table(table: &Table, empty: &str) -> anyhow::Result<()> {
    if table.row_iter().next().is_none() {
        return line(empty);
    }
    line(table.to_string().trim_end())
}

/// A time as `2026-12-05 14:03:07`, or `-`.
pub(crate) fn time(t: Option<DateTime<Utc>>) -> String {
    t.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_else(|| "-".to_owned())
}

/// A duration in whole seconds as `4s`, `3m12s`, `2h05m`, `3d04h`.
pub(crate) fn age(seconds: Option<f64>) -> String {
    let Some(s) = seconds else {
        return "-".to_owned();
    };
    let s = s.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

/// A JSON value on one line, cut to `max` characters.
pub(crate) fn short_json(value: &serde_json::Value, max: usize) -> String {
    short(&value.to_string(), max)
}

/// Text on one line (line breaks as spaces), cut to `max` characters.
pub(crate) fn short(text: &str, max: usize) -> String {
    let text = text.replace(['\n', '\r'], " ");
    if text.chars().count() <= max {
        text
    } else {
        let cut: String = text.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}

/// A progress bar on stderr for work done in batches towards a `total` counted up front (pruning, a bulk
/// cancel): the items done so far of the total, their rate and the time left, advanced with
/// [`ProgressBar::inc`]. Work that appears while it runs grows the total ([`advance`]). Hidden when stderr is
/// not a terminal, or with `--json`.
pub(crate) fn progress(out: Out, what: &str, total: u64) -> ProgressBar {
    let bar = if out.json || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{msg}: [{wide_bar}] {human_pos}/{human_len} ({per_sec}, {elapsed}, {eta} left)",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

/// Advances `bar` by `n` items, growing its total when more was done than counted up front (work that
/// appeared while it ran).
pub(crate) fn advance(bar: &ProgressBar, n: u64) {
    bar.inc(n);
    if let Some(len) = bar.length() {
        if bar.position() > len {
            bar.set_length(bar.position());
        }
    }
}

/// A spinner on stderr with a message (hidden when stderr is not a terminal, or with `--json`).
pub(crate) fn spinner(out: Out, what: &str) -> ProgressBar {
    let bar = if out.json || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        ProgressBar::new_spinner()
    };
    bar.set_message(what.to_owned());
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

/// Asks `question` on the terminal; `true` for `y` or `yes`. Refuses (an error saying to pass `--yes`)
/// when stdin is not a terminal, so scripts never hang on a prompt.
pub(crate) fn confirm(question: &str) -> anyhow::Result<bool> {
    if !std::io::stdin().is_terminal() {
        anyhow::bail!(
            "{question}: not confirmed (stdin is not a terminal); pass --yes to go ahead"
        );
    }
    eprint!("{question} [y/N] ");
    std::io::stderr().flush().ok();
    let mut answer = String::new();
    std::io::stdin()
        .read_line(&mut answer)
        .context("reading the answer")?;
    Ok(matches!(answer.trim().to_lowercase().as_str(), "y" | "yes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_at_a_glance() {
        assert_eq!(age(None), "-");
        assert_eq!(age(Some(4.7)), "4s");
        assert_eq!(age(Some(192.0)), "3m12s");
        assert_eq!(age(Some(7500.0)), "2h05m");
        assert_eq!(age(Some(273600.0)), "3d04h");
    }

    #[test]
    fn long_json_is_cut() {
        let v = serde_json::json!({"text": "abcdefghijklmnopqrstuvwxyz"});
        assert_eq!(short_json(&v, 100), v.to_string());
        let cut = short_json(&v, 10);
        assert_eq!(cut.chars().count(), 10);
        assert!(cut.ends_with('…'));
    }
}
