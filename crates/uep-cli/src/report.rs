//! How `uep bench` reports results: one [`OpReport`] per measured operation,
//! printed as an aligned table for people ([`render_table`]) or as JSON for
//! scripts ([`render_json`]), with latency statistics from [`Samples`] and an
//! optional progress bar ([`Progress`]) that never pollutes stdout or logs.
//!
//! Bandwidth follows the DeepEP convention (docs/architecture.md): bytes a rank sends over
//! the average time of one iteration, in GB/s (1e9 bytes per second), split
//! the way the field prints it into intra-node (NVLink / shared memory) and
//! network (RDMA) parts.

use std::io::IsTerminal;
use std::time::Duration;

/// The measurements of one operation (e.g. `dispatch`) in one configuration.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct OpReport {
    /// Operation: `"layout"`, `"dispatch"`, `"combine"`, `"ll_dispatch"`, `"ll_combine"`, ...
    pub op: String,
    /// `"normal"`, `"low_latency"` or `"layout"`.
    pub mode: String,
    /// Total ranks.
    pub ranks: usize,
    /// Nodes the ranks span.
    pub nodes: usize,
    /// Tokens per rank.
    pub tokens: usize,
    /// Hidden size (elements per token).
    pub hidden: usize,
    /// Payload type: `"bf16"` or `"fp8"`.
    pub dtype: String,
    /// Bytes a rank sends per iteration (DeepEP's conventions), mean over ranks.
    pub bytes_per_rank: u64,
    /// The part of `bytes_per_rank` that crosses nodes (RDMA); 0 on one node.
    pub net_bytes_per_rank: u64,
    /// Bytes a rank actually handed to its proxy for other nodes per iteration, mean
    /// over ranks: `net_bytes_per_rank` plus metadata, headers and token counts.
    pub net_wire_bytes_per_rank: u64,
    /// `bytes_per_rank / avg time`, in GB/s (1e9 bytes/s).
    pub gbps: f64,
    /// `net_bytes_per_rank / avg time`, in GB/s.
    pub net_gbps: f64,
    /// What the machine reaches moving the same bytes (memcpy / raw
    /// transport), in GB/s, when measured.
    pub limit_gbps: Option<f64>,
    /// Mean time of one iteration, µs.
    pub avg_us: f64,
    /// Fastest iteration, µs.
    pub min_us: f64,
    /// Slowest iteration, µs.
    pub max_us: f64,
    /// Median iteration (nearest rank), µs.
    pub p50_us: f64,
    /// 99th percentile iteration (nearest rank), µs.
    pub p99_us: f64,
    /// Timed iterations.
    pub iters: usize,
    /// Whether the results were checked against the reference and matched.
    pub verified: bool,
    /// The device that ran the op's phases (`"host"`, `"emu"`, `"cuda"`).
    pub device: String,
    /// The phases that ran as kernels in the op's calls on any rank, by their `Device`
    /// method names (`"layout"`, `"cast"`, ...); the others ran on CPU threads.
    pub kernel_phases: Vec<String>,
}

/// GB/s (1e9 bytes per second) for `bytes` moved in `avg_us` microseconds;
/// 0 when the time is not positive (nothing measurable).
pub fn gbps(bytes: u64, avg_us: f64) -> f64 {
    if avg_us > 0.0 {
        // bytes / (µs * 1e-6) / 1e9 == bytes / (µs * 1e3)
        bytes as f64 / (avg_us * 1e3)
    } else {
        0.0
    }
}

/// Latency statistics of a set of samples, all in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// Mean.
    pub avg_us: f64,
    /// Minimum.
    pub min_us: f64,
    /// Maximum.
    pub max_us: f64,
    /// Median, nearest-rank.
    pub p50_us: f64,
    /// 99th percentile, nearest-rank.
    pub p99_us: f64,
}

/// Per-iteration durations of one operation.
#[derive(Clone, Debug, Default)]
pub struct Samples {
    durations: Vec<Duration>,
}

impl Samples {
    /// No samples yet.
    pub fn new() -> Self {
        Samples::default()
    }

    /// No samples yet, with room for `n` without reallocating (so pushing
    /// inside a timed loop does not allocate).
    pub fn with_capacity(n: usize) -> Self {
        Samples {
            durations: Vec::with_capacity(n),
        }
    }

    /// Records one iteration.
    pub fn push(&mut self, d: Duration) {
        self.durations.push(d);
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.durations.len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.durations.is_empty()
    }

    /// The recorded durations, in order.
    pub fn durations(&self) -> &[Duration] {
        &self.durations
    }

    /// Mean, min, max, p50 and p99 in µs; `None` without samples.
    ///
    /// Percentiles are nearest-rank: the p-th percentile of n sorted samples
    /// is the one at 1-based rank `ceil(p/100 * n)`, always an observed value.
    pub fn summary(&self) -> Option<Summary> {
        if self.durations.is_empty() {
            return None;
        }
        let mut sorted = self.durations.clone();
        sorted.sort_unstable();
        let n = sorted.len();
        // Integer arithmetic keeps ceil(p * n / 100) exact.
        let nearest_rank = |p: usize| {
            let rank = (p * n).div_ceil(100).max(1);
            sorted[rank - 1]
        };
        let total: u128 = sorted.iter().map(Duration::as_nanos).sum();
        let us = |d: Duration| d.as_nanos() as f64 / 1e3;
        Some(Summary {
            avg_us: total as f64 / n as f64 / 1e3,
            min_us: us(sorted[0]),
            max_us: us(sorted[n - 1]),
            p50_us: us(nearest_rank(50)),
            p99_us: us(nearest_rank(99)),
        })
    }
}

/// Column alignment in [`render_table`].
#[derive(Clone, Copy)]
enum Align {
    Left,
    Right,
}

const COLUMNS: &[(&str, Align)] = &[
    ("op", Align::Left),
    ("dtype", Align::Left),
    ("tokens", Align::Right),
    ("hidden", Align::Right),
    ("ranks×nodes", Align::Right),
    ("bytes/rank", Align::Right),
    ("intra GB/s", Align::Right),
    ("net GB/s", Align::Right),
    ("limit GB/s", Align::Right),
    ("% of limit", Align::Right),
    ("avg µs", Align::Right),
    ("min µs", Align::Right),
    ("max µs", Align::Right),
    ("verified", Align::Right),
];

/// The cells of one table row, in [`COLUMNS`] order.
fn row_cells(r: &OpReport) -> Vec<String> {
    let dash = || "-".to_string();
    let moves_bytes = r.bytes_per_rank > 0;
    // Intra-node bandwidth is the non-network share of the same bytes over
    // the same time.
    let intra = if moves_bytes {
        format!("{:.2}", (r.gbps - r.net_gbps).max(0.0))
    } else {
        dash()
    };
    let net = if moves_bytes && r.nodes > 1 {
        format!("{:.2}", r.net_gbps)
    } else {
        dash()
    };
    let (limit, percent) = match r.limit_gbps {
        Some(limit) if moves_bytes && limit > 0.0 => (
            format!("{limit:.2}"),
            format!("{:.1}%", 100.0 * r.gbps / limit),
        ),
        Some(limit) => (format!("{limit:.2}"), dash()),
        None => (dash(), dash()),
    };
    vec![
        r.op.clone(),
        r.dtype.clone(),
        r.tokens.to_string(),
        r.hidden.to_string(),
        format!("{}×{}", r.ranks, r.nodes),
        human_bytes(r.bytes_per_rank),
        intra,
        net,
        limit,
        percent,
        format!("{:.2}", r.avg_us),
        format!("{:.2}", r.min_us),
        format!("{:.2}", r.max_us),
        if r.verified { "✓" } else { "✗" }.to_string(),
    ]
}

/// Renders reports as a table with a header, a rule and one row per report.
/// Columns are padded by character count (`µ`, `×`, `✓` are one column
/// wide each), so every line has the same width and no trailing spaces.
/// Columns without a value (no network on one node, no measured limit, an
/// operation that moves no bytes) show `-`.
pub fn render_table(reports: &[OpReport]) -> String {
    let rows: Vec<Vec<String>> = reports.iter().map(row_cells).collect();
    let widths: Vec<usize> = COLUMNS
        .iter()
        .enumerate()
        .map(|(i, (title, _))| {
            rows.iter()
                .map(|row| row[i].chars().count())
                .chain(std::iter::once(title.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[String]| -> String {
        let padded: Vec<String> = cells
            .iter()
            .zip(COLUMNS)
            .zip(&widths)
            .map(|((cell, (_, align)), &width)| {
                let pad = " ".repeat(width - cell.chars().count());
                match align {
                    Align::Left => format!("{cell}{pad}"),
                    Align::Right => format!("{pad}{cell}"),
                }
            })
            .collect();
        padded.join("  ")
    };
    let titles: Vec<String> = COLUMNS.iter().map(|(t, _)| t.to_string()).collect();
    let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    let mut out = String::new();
    for cells in [&titles, &rule].into_iter().chain(&rows) {
        out.push_str(&line(cells));
        out.push('\n');
    }
    out
}

/// Renders reports as a pretty-printed JSON array, one object per report,
/// with the field names of [`OpReport`] (`limit_gbps` is `null` when unknown;
/// non-finite numbers also become `null`).
pub fn render_json(reports: &[OpReport]) -> String {
    // Cannot fail: OpReport holds only strings, integers, floats and an
    // Option, all of which serde_json serialises unconditionally.
    serde_json::to_string_pretty(reports).expect("OpReport always serialises to JSON")
}

/// `n` bytes in binary units with one decimal, e.g. `"14.0 MiB"`; plain
/// bytes below 1 KiB (`"512 B"`).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    // Move up while the value would print as 1024.0 or more, so 1048575
    // bytes reads "1.0 MiB", not "1024.0 KiB".
    while value >= 1023.95 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A progress bar on stderr, drawn only when asked for and stderr is a
/// terminal; otherwise every method does nothing, which keeps `--json`
/// output and CI logs clean.
#[derive(Clone, Debug)]
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    /// A bar counting to `total`, labelled `label`; drawn only if `enabled`
    /// and stderr is a terminal.
    pub fn new(total: u64, label: &str, enabled: bool) -> Self {
        let visible = enabled && std::io::stderr().is_terminal();
        Progress::with_visibility(total, label, visible)
    }

    fn with_visibility(total: u64, label: &str, visible: bool) -> Self {
        if !visible {
            return Progress { bar: None };
        }
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(total),
            indicatif::ProgressDrawTarget::stderr(),
        );
        // The template is a constant; fall back to the default bar rather than
        // fail a benchmark over cosmetics.
        let style = indicatif::ProgressStyle::with_template(
            "{prefix:>12} [{bar:30}] {pos}/{len} {msg} ({elapsed})",
        )
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_prefix(label.to_string());
        Progress { bar: Some(bar) }
    }

    /// Whether this bar draws anything.
    pub fn is_visible(&self) -> bool {
        self.bar.is_some()
    }

    /// Advances by `n` steps.
    pub fn inc(&self, n: u64) {
        if let Some(bar) = &self.bar {
            bar.inc(n);
        }
    }

    /// Sets the text shown after the counter.
    pub fn set_message(&self, msg: &str) {
        if let Some(bar) = &self.bar {
            bar.set_message(msg.to_string());
        }
    }

    /// Removes the bar from the terminal; the results that follow stand alone.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }

    /// Current position (0 when hidden).
    pub fn position(&self) -> u64 {
        self.bar.as_ref().map_or(0, |bar| bar.position())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(op: &str, nodes: usize, limit: Option<f64>, verified: bool) -> OpReport {
        OpReport {
            op: op.to_string(),
            mode: "normal".to_string(),
            ranks: 8 * nodes,
            nodes,
            tokens: 4096,
            hidden: 7168,
            dtype: "bf16".to_string(),
            bytes_per_rank: 14 * 1024 * 1024,
            net_bytes_per_rank: if nodes > 1 { 7 * 1024 * 1024 } else { 0 },
            net_wire_bytes_per_rank: 0,
            gbps: 150.0,
            net_gbps: if nodes > 1 { 45.5 } else { 0.0 },
            limit_gbps: limit,
            avg_us: 97.861,
            min_us: 90.0,
            max_us: 1234.5,
            p50_us: 96.0,
            p99_us: 1200.0,
            iters: 50,
            verified,
            device: "emu".to_string(),
            kernel_phases: vec!["layout".to_string(), "reduce".to_string()],
        }
    }

    #[test]
    fn table_has_every_op_and_aligned_columns() {
        let mut layout = report("layout", 1, None, true);
        layout.bytes_per_rank = 0;
        layout.mode = "layout".to_string();
        let reports = vec![
            layout,
            report("dispatch", 1, Some(300.0), true),
            report("combine", 2, None, false),
            report("ll_dispatch", 1, Some(0.0), true),
        ];
        let table = render_table(&reports);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 2 + reports.len(), "{table}");
        let width = lines[0].chars().count();
        for line in &lines {
            assert_eq!(
                line.chars().count(),
                width,
                "ragged line {line:?} in\n{table}"
            );
            assert_eq!(line.trim_end(), *line, "trailing space in {line:?}");
        }
        for (r, line) in reports.iter().zip(&lines[2..]) {
            assert!(line.starts_with(&r.op), "{line}");
        }
        for title in [
            "op",
            "intra GB/s",
            "net GB/s",
            "limit GB/s",
            "% of limit",
            "avg µs",
            "verified",
        ] {
            assert!(
                lines[0].contains(title),
                "{title} missing from {}",
                lines[0]
            );
        }
        // Every column starts at the same character offset on every line:
        // check the column boundaries that the rule line defines.
        let rule: Vec<char> = lines[1].chars().collect();
        for line in &lines[2..] {
            for (i, c) in line.chars().enumerate() {
                if rule[i] == ' ' {
                    assert_eq!(c, ' ', "column gap not blank at {i} in {line:?}");
                }
            }
        }
        let cells = |line: &str| {
            line.split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        // layout moves no bytes: no bandwidth, no limit.
        assert_eq!(cells(lines[2])[5..10], ["0", "B", "-", "-", "-"]);
        // dispatch: one node, so no network column; 150 of 300 GB/s is 50%.
        let dispatch = cells(lines[3]);
        assert_eq!(dispatch[4], "8×1");
        assert_eq!(
            dispatch[5..12],
            ["14.0", "MiB", "150.00", "-", "300.00", "50.0%", "97.86"]
        );
        assert_eq!(dispatch.last().unwrap(), "✓");
        // combine: two nodes, intra = total - net.
        let combine = cells(lines[4]);
        assert_eq!(combine[4], "16×2");
        assert_eq!(combine[7..11], ["104.50", "45.50", "-", "-"]);
        assert_eq!(combine.last().unwrap(), "✗");
        // A zero limit is shown but no percentage is made of it.
        assert_eq!(cells(lines[5])[9..11], ["0.00", "-"]);
        assert_eq!(render_table(&[]).lines().count(), 2);
    }

    #[test]
    fn json_round_trips_every_field() {
        let reports = vec![
            report("dispatch", 2, Some(300.0), true),
            report("ll_combine", 1, None, false),
        ];
        let json = render_json(&reports);
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        let array = value.as_array().unwrap();
        assert_eq!(array.len(), 2);
        let fields = [
            "op",
            "mode",
            "ranks",
            "nodes",
            "tokens",
            "hidden",
            "dtype",
            "bytes_per_rank",
            "net_bytes_per_rank",
            "net_wire_bytes_per_rank",
            "gbps",
            "net_gbps",
            "limit_gbps",
            "avg_us",
            "min_us",
            "max_us",
            "p50_us",
            "p99_us",
            "iters",
            "verified",
            "device",
            "kernel_phases",
        ];
        for object in array {
            let object = object.as_object().unwrap();
            assert_eq!(object.len(), fields.len());
            for f in fields {
                assert!(object.contains_key(f), "missing {f}");
            }
        }
        let first = &array[0];
        assert_eq!(first["op"], "dispatch");
        assert_eq!(first["ranks"], 16);
        assert_eq!(first["bytes_per_rank"], 14 * 1024 * 1024);
        assert_eq!(first["net_gbps"], 45.5);
        assert_eq!(first["limit_gbps"], 300.0);
        assert_eq!(first["verified"], true);
        assert_eq!(first["device"], "emu");
        assert_eq!(
            first["kernel_phases"],
            serde_json::json!(["layout", "reduce"])
        );
        assert!(array[1]["limit_gbps"].is_null());
        assert_eq!(render_json(&[]).trim(), "[]");
    }

    #[test]
    fn samples_statistics_nearest_rank() {
        assert_eq!(Samples::new().summary(), None);
        let mut s = Samples::with_capacity(100);
        // 1..=100 µs, pushed in reverse to check sorting.
        for us in (1..=100u64).rev() {
            s.push(Duration::from_micros(us));
        }
        assert_eq!(s.len(), 100);
        assert_eq!(s.durations()[0], Duration::from_micros(100));
        assert_eq!(s.durations()[99], Duration::from_micros(1));
        let sum = s.summary().unwrap();
        assert_eq!(sum.min_us, 1.0);
        assert_eq!(sum.max_us, 100.0);
        assert_eq!(sum.avg_us, 50.5);
        assert_eq!(sum.p50_us, 50.0);
        assert_eq!(sum.p99_us, 99.0);

        // n = 10: p50 is rank ceil(5) = 5, p99 is rank ceil(9.9) = 10.
        let mut s = Samples::new();
        for ns in [
            7000u64, 1000, 9000, 3000, 5000, 2000, 10000, 4000, 8000, 6000,
        ] {
            s.push(Duration::from_nanos(ns));
        }
        let sum = s.summary().unwrap();
        assert_eq!((sum.p50_us, sum.p99_us, sum.avg_us), (5.0, 10.0, 5.5));

        // One sample: every statistic is that sample; sub-µs precision kept.
        let mut s = Samples::new();
        s.push(Duration::from_nanos(1500));
        let sum = s.summary().unwrap();
        assert_eq!(
            [sum.avg_us, sum.min_us, sum.max_us, sum.p50_us, sum.p99_us],
            [1.5; 5]
        );
        assert!(!s.is_empty());
    }

    #[test]
    fn human_bytes_cases() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1024), "1.0 KiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(14 * 1024 * 1024), "14.0 MiB");
        assert_eq!(human_bytes(1024 * 1024 - 1), "1.0 MiB");
        assert_eq!(human_bytes(3 * (1 << 30) / 2), "1.5 GiB");
        assert_eq!(human_bytes(1 << 40), "1.0 TiB");
        assert_eq!(human_bytes(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn gbps_is_bytes_per_nanosecond() {
        assert_eq!(gbps(1_000_000, 1.0), 1000.0);
        assert_eq!(gbps(7168 * 2 * 4096, 1000.0), 58.720256);
        assert_eq!(gbps(1, 0.0), 0.0);
    }

    #[test]
    fn progress_hidden_unless_enabled_on_a_terminal() {
        let off = Progress::new(10, "dispatch", false);
        assert!(!off.is_visible());
        off.inc(3);
        off.set_message("x");
        off.finish();
        assert_eq!(off.position(), 0);
        let auto = Progress::new(10, "dispatch", true);
        assert_eq!(auto.is_visible(), std::io::stderr().is_terminal());
        auto.finish();
        // The drawing path itself (indicatif draws nothing if stderr is not a terminal).
        let on = Progress::with_visibility(10, "dispatch", true);
        assert!(on.is_visible());
        on.inc(4);
        on.set_message("iter 4");
        assert_eq!(on.position(), 4);
        on.finish();
    }
}
