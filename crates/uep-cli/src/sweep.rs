//! `uep bench --sweep KEY=V1,V2,...`: run the benchmark once per value of one
//! parameter and show how latency and bandwidth follow it, as a CSV table and
//! a two-panel SVG figure.
//!
//! Each value runs as a child `uep bench --json <base args> <key args>` (so
//! every point is a fresh set of ranks, verified against the reference like
//! any other run); the children's JSON reports are collected into
//! `sweep-<key>.csv` (one row per value per op) and `sweep-<key>.svg` (left:
//! average latency in µs, log scale; right: GB/s per rank; both against the
//! swept value on a log axis, one line per op).
//!
//! How a value becomes flags:
//!
//! * `tokens`: tokens per rank of the modes that run. With `--mode all` (the
//!   default) a value up to [`LL_MAX_TOKENS`] sets both `--tokens` and
//!   `--ll-tokens`; a larger one sets `--tokens` and `--mode normal`, because
//!   low-latency mode is for decode batches (DeepEP sizes its LL buffers for
//!   at most 128 tokens a rank, and they grow with `E * R * T * H`). With
//!   `--mode normal` only `--tokens` is set, with `--mode ll` only
//!   `--ll-tokens`. A `--num-worst-tokens` in the base args follows as
//!   `ranks * value`.
//! * `ranks`: `--ranks`; when the experts do not divide evenly, `--experts`
//!   is raised to the next multiple of the ranks (the CSV's rows say so in
//!   their `note`), and a `--num-worst-tokens` follows as `value * tokens`.
//! * any other key (`hidden`, `topk`, `experts`, `ll-tokens`, ...):
//!   `--<key> <value>`.
//!
//! Values must be positive numbers (the x axis is logarithmic).

use std::ffi::{OsStr, OsString};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::args::{BenchArgs, Modes};

/// Largest tokens value for which a `tokens` sweep also runs low-latency mode.
pub const LL_MAX_TOKENS: u64 = 128;

/// A parsed `KEY=V1,V2,...`.
#[derive(Clone, Debug, PartialEq)]
pub struct SweepSpec {
    /// The parameter, as a flag name without dashes (`_` read as `-`).
    pub key: String,
    /// The values as written, with their numeric value, in the order given.
    pub values: Vec<(String, f64)>,
}

/// Parses `KEY=V1,V2,...`: a key made of letters, digits, `-` and `_`, and
/// one or more positive numbers.
pub fn parse_spec(spec: &str) -> anyhow::Result<SweepSpec> {
    let usage = "expected KEY=V1,V2,... such as tokens=1,8,32,128,512,4096";
    let (key, list) = spec
        .split_once('=')
        .ok_or_else(|| anyhow::anyhow!("--sweep {spec:?}: no '=': {usage}"))?;
    let key = key.trim().trim_start_matches("--").replace('_', "-");
    if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        anyhow::bail!("--sweep {spec:?}: {key:?} is not a flag name: {usage}");
    }
    let mut values = Vec::new();
    for v in list.split(',').map(str::trim).filter(|v| !v.is_empty()) {
        match v.parse::<f64>() {
            Ok(x) if x > 0.0 && x.is_finite() => values.push((v.to_string(), x)),
            _ => anyhow::bail!(
                "--sweep {spec:?}: value {v:?} is not a positive number (the x axis is logarithmic)"
            ),
        }
    }
    if values.is_empty() {
        anyhow::bail!("--sweep {spec:?}: no values: {usage}");
    }
    Ok(SweepSpec { key, values })
}

/// Parses `uep bench` flags the way the CLI does.
#[derive(Parser, Debug)]
#[command(name = "uep bench", args_override_self = true)]
struct Wrapped {
    #[command(flatten)]
    args: BenchArgs,
}

fn parse_bench(args: &[OsString]) -> anyhow::Result<BenchArgs> {
    let argv = std::iter::once(OsString::from("uep bench")).chain(args.iter().cloned());
    Wrapped::try_parse_from(argv)
        .map(|w| w.args)
        .map_err(|e| anyhow::anyhow!("{}", e.render().to_string().trim_end()))
}

/// Drops every `--sweep` / `--sweep-out` flag (and its value), so a child
/// never sweeps again.
pub fn strip_sweep_flags(args: &[OsString]) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut skip_next = false;
    for a in args {
        if std::mem::take(&mut skip_next) {
            continue;
        }
        let s = a.to_string_lossy();
        if s == "--sweep" || s == "--sweep-out" {
            skip_next = true;
        } else if !(s.starts_with("--sweep=") || s.starts_with("--sweep-out=")) {
            out.push(a.clone());
        }
    }
    out
}

/// The flags of this process's `uep bench` invocation (everything after
/// `bench`), without the sweep's own flags: what [`run_sweep`] wants as
/// `base_args`.
pub fn base_args_from_env() -> Vec<OsString> {
    let all: Vec<OsString> = std::env::args_os().skip(1).collect();
    let after = all
        .iter()
        .position(|a| a == OsStr::new("bench"))
        .map_or(&all[..], |i| &all[i + 1..]);
    strip_sweep_flags(after)
}

/// The flags one value adds to the base args, and a note when a flag had to
/// change to make the point valid.
pub fn value_args(
    key: &str,
    value: &str,
    base: &BenchArgs,
) -> anyhow::Result<(Vec<String>, Option<String>)> {
    let whole = || -> anyhow::Result<u64> {
        value
            .parse()
            .map_err(|_| anyhow::anyhow!("--sweep {key}: value {value:?} must be a whole number"))
    };
    let mut out = Vec::new();
    let mut note = None;
    let flag = |f: &str, x: String| [format!("--{f}"), x];
    match key {
        "tokens" => {
            let v = whole()?;
            match base.mode {
                Modes::All if v <= LL_MAX_TOKENS => {
                    out.extend(flag("tokens", value.into()));
                    out.extend(flag("ll-tokens", value.into()));
                }
                Modes::All => {
                    out.extend(flag("tokens", value.into()));
                    out.extend(flag("mode", "normal".into()));
                    note = Some(format!(
                        "normal mode only: low-latency mode runs up to {LL_MAX_TOKENS} tokens"
                    ));
                }
                Modes::Normal => out.extend(flag("tokens", value.into())),
                Modes::Ll => out.extend(flag("ll-tokens", value.into())),
            }
            if base.num_worst_tokens > 0 && base.mode != Modes::Ll {
                out.extend(flag(
                    "num-worst-tokens",
                    (v as usize * base.ranks).to_string(),
                ));
            }
        }
        "ranks" => {
            let v = whole()?;
            if v == 0 {
                anyhow::bail!("--sweep ranks: 0 ranks cannot run");
            }
            out.extend(flag("ranks", value.into()));
            let r = v as usize;
            if base.experts % r != 0 {
                let experts = base.experts.div_ceil(r) * r;
                out.extend(flag("experts", experts.to_string()));
                note = Some(format!(
                    "experts {} -> {experts} to divide over {r} ranks",
                    base.experts
                ));
            }
            if base.num_worst_tokens > 0 {
                out.extend(flag("num-worst-tokens", (r * base.tokens).to_string()));
            }
        }
        other => out.extend(flag(other, value.into())),
    }
    Ok((out, note))
}

/// One row of the sweep: one op's report at one value.
#[derive(Clone, Debug, PartialEq)]
pub struct SweepRow {
    /// The swept value as written.
    pub value: String,
    /// Its number (x coordinate).
    pub x: f64,
    /// The op's JSON report from `uep bench --json`.
    pub report: serde_json::Value,
    /// Why flags other than the key changed for this value, if they did.
    pub note: Option<String>,
}

/// Columns of the CSV taken from each report, in order.
const REPORT_COLUMNS: [&str; 15] = [
    "op",
    "mode",
    "ranks",
    "nodes",
    "tokens",
    "hidden",
    "dtype",
    "bytes_per_rank",
    "avg_us",
    "p50_us",
    "p99_us",
    "min_us",
    "max_us",
    "gbps",
    "verified",
];

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The rows as CSV: `key,value,<report columns>,note`.
pub fn render_csv(key: &str, rows: &[SweepRow]) -> String {
    let mut out = format!("key,value,{},note\n", REPORT_COLUMNS.join(","));
    for r in rows {
        let cells: Vec<String> = REPORT_COLUMNS
            .iter()
            .map(|c| match &r.report[*c] {
                serde_json::Value::String(s) => csv_field(s),
                serde_json::Value::Null => String::new(),
                v => v.to_string(),
            })
            .collect();
        let _ = writeln!(
            out,
            "{},{},{},{}",
            csv_field(key),
            csv_field(&r.value),
            cells.join(","),
            csv_field(r.note.as_deref().unwrap_or(""))
        );
    }
    out
}

/// Axis title of the swept parameter.
fn x_title(key: &str) -> String {
    match key {
        "tokens" => "tokens per rank".into(),
        "ll-tokens" => "low-latency tokens per rank".into(),
        "ranks" => "ranks".into(),
        "hidden" => "hidden size".into(),
        "topk" => "top-k".into(),
        "experts" => "experts".into(),
        other => other.into(),
    }
}

/// Colour-blind-safe line colours (Okabe–Ito).
const COLORS: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
];

/// Ops in first-seen order with their (x, y) points, sorted by x; points
/// where `y` is missing or not positive (when `positive`) are left out.
fn series(rows: &[SweepRow], field: &str, positive: bool) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut out: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in rows {
        let op = r.report["op"].as_str().unwrap_or("?").to_string();
        let Some(y) = r.report[field].as_f64() else {
            continue;
        };
        if !y.is_finite() || (positive && y <= 0.0) {
            continue;
        }
        match out.iter_mut().find(|(o, _)| *o == op) {
            Some((_, pts)) => pts.push((r.x, y)),
            None => out.push((op, vec![(r.x, y)])),
        }
    }
    for (_, pts) in &mut out {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// `[lo, hi]` of the values, widened so single points and flat lines still
/// get an axis.
fn span(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| {
        (l.min(v), h.max(v))
    });
    if !lo.is_finite() {
        return if log { (0.1, 10.0) } else { (0.0, 1.0) };
    }
    if log {
        // Pad by a share of the decades shown, at least 10%, so the end
        // points sit clear of the frame whatever the range.
        let pad = (hi / lo).powf(0.06).max(1.1);
        (lo / pad, hi * pad)
    } else {
        (0.0, if hi > 0.0 { hi * 1.12 } else { 1.0 })
    }
}

/// Tick positions of a log axis over `[lo, hi]`: the 1-2-5 sequence, or
/// only the powers of ten when that would crowd the axis.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut ticks = Vec::new();
    let mut decade = 10f64.powi(lo.log10().floor() as i32);
    while decade <= hi && ticks.len() < 1000 {
        for m in [1.0, 2.0, 5.0] {
            let t = decade * m;
            if t >= lo && t <= hi {
                ticks.push(t);
            }
        }
        decade *= 10.0;
    }
    if ticks.len() > 10 {
        ticks.retain(|t| (t.log10() - t.log10().round()).abs() < 1e-9);
    }
    ticks
}

/// A short number for tick labels: at most two decimals, trailing zeros
/// dropped (`0.5`, `1.25`, `100`), scientific below 0.01.
fn tick(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        return "0".into();
    }
    if a < 0.01 {
        return format!("{v:.1e}");
    }
    let s = if a >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    };
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// One legend for both panels, centred in a row above them (the panels
/// share ops and colours, and a legend inside a panel would hide data).
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    ops: &[&str],
) -> anyhow::Result<()> {
    const FONT: u32 = 15;
    // The SVG backend measures no text: estimate a label at 0.55 em a character.
    let widths: Vec<i32> = ops
        .iter()
        .map(|op| 30 + (op.chars().count() as f64 * FONT as f64 * 0.55) as i32 + 24)
        .collect();
    let total: i32 = widths.iter().sum();
    let (w, h) = area.dim_in_pixel();
    let mut x = (w as i32 - total).max(0) / 2;
    let y = h as i32 / 2;
    for (i, op) in ops.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        area.draw(&PathElement::new(
            vec![(x, y), (x + 24, y)],
            c.stroke_width(3),
        ))
        .map_err(draw_err)?;
        area.draw(&Circle::new((x + 12, y), 3, c.filled()))
            .map_err(draw_err)?;
        area.draw(&Text::new(
            op.to_string(),
            (x + 30, y),
            ("sans-serif", FONT)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Left, VPos::Center)),
        ))
        .map_err(draw_err)?;
        x += widths[i];
    }
    Ok(())
}

fn draw_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing the sweep figure failed: {e}")
}

/// Draws the two-panel figure (latency and GB/s against the swept value) to
/// `path` as SVG.
pub fn render_svg(key: &str, rows: &[SweepRow], title: &str, path: &Path) -> anyhow::Result<()> {
    let xs: Vec<f64> = {
        let mut xs: Vec<f64> = rows.iter().map(|r| r.x).collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        xs
    };
    let (x0, x1) = span(xs.iter().copied(), true);
    let latency = series(rows, "avg_us", true);
    // Ops that move no bytes (layout) have no bandwidth to show.
    let bandwidth: Vec<_> = series(rows, "gbps", false)
        .into_iter()
        .filter(|(_, pts)| pts.iter().any(|p| p.1 > 0.0))
        .collect();
    let color_of = |op: &str| {
        let i = latency
            .iter()
            .position(|(o, _)| o == op)
            .unwrap_or(latency.len());
        COLORS[i % COLORS.len()]
    };

    let root = SVGBackend::new(path, (1280, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(draw_err)?;
    let (legend, panels) = root.split_vertically(34);
    draw_legend(
        &legend,
        &latency
            .iter()
            .map(|(op, _)| op.as_str())
            .collect::<Vec<_>>(),
    )?;
    let (left, right) = panels.split_horizontally(640);
    let xlabel = x_title(key);
    let x = || (x0..x1).log_scale().with_key_points(xs.clone());
    // Left: latency, log-log.
    let (y0, y1) = span(
        latency.iter().flat_map(|(_, p)| p.iter().map(|q| q.1)),
        true,
    );
    let y = (y0..y1).log_scale().with_key_points(log_ticks(y0, y1));
    let chart = panel(&left, "latency (average per iteration)", x(), y)?;
    draw_lines(chart, (&xlabel, "latency (µs)"), &latency, color_of)?;
    // Right: bandwidth, log x, linear y from 0.
    let (y0, y1) = span(
        bandwidth.iter().flat_map(|(_, p)| p.iter().map(|q| q.1)),
        false,
    );
    let chart = panel(&right, "bandwidth (bytes a rank sends / time)", x(), y0..y1)?;
    draw_lines(chart, (&xlabel, "GB/s per rank"), &bandwidth, color_of)?;
    root.present().map_err(draw_err)?;
    Ok(())
}

/// A panel of the figure: SVG, x and y as `X` and `Y` map them.
type Chart<'a, 'b, X, Y> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<X, Y>>;

/// A chart of the figure, captioned, on `area`.
fn panel<'a, 'b, X: AsRangedCoord, Y: AsRangedCoord>(
    area: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    caption: &str,
    x: X,
    y: Y,
) -> anyhow::Result<Chart<'a, 'b, X::CoordDescType, Y::CoordDescType>> {
    ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 17))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(70)
        .build_cartesian_2d(x, y)
        .map_err(draw_err)
}

/// The mesh (axes titled `x_desc` and `y_desc`) and a line with dots per op.
fn draw_lines<X, Y>(
    mut chart: Chart<'_, '_, X, Y>,
    (x_desc, y_desc): (&str, &str),
    lines: &[(String, Vec<(f64, f64)>)],
    color_of: impl Fn(&str) -> RGBColor,
) -> anyhow::Result<()>
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .axis_desc_style(("sans-serif", 16))
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(*v))
        .label_style(("sans-serif", 13))
        .bold_line_style(RGBColor(215, 215, 215))
        .light_line_style(TRANSPARENT)
        .draw()
        .map_err(draw_err)?;
    for (op, pts) in lines {
        let c = color_of(op);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(draw_err)?;
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(draw_err)?;
    }
    Ok(())
}

/// Last `n` lines of `s`, for error messages.
fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Runs `uep bench --json <base_args> <value's flags>` for every value of
/// `spec` (`KEY=V1,V2,...`) with the current executable, writes
/// `out_dir/sweep-<key>.csv` and `out_dir/sweep-<key>.svg`, and prints their
/// paths.
///
/// `base_args` are the bench flags after `bench` ([`base_args_from_env`]);
/// sweep flags in them are ignored. A value whose run fails is reported on
/// stderr and left out; the others still make the files. Returns `Ok(true)`
/// when every run succeeded and every report was verified, `Ok(false)`
/// otherwise, and an error for a bad spec or flags, or when no run succeeded.
pub fn run_sweep(spec: &str, base_args: &[OsString], out_dir: &Path) -> anyhow::Result<bool> {
    run_sweep_with(&std::env::current_exe()?, spec, base_args, out_dir)
}

/// [`run_sweep`] with `exe` as the `uep` program run for each value.
pub fn run_sweep_with(
    exe: &Path,
    spec: &str,
    base_args: &[OsString],
    out_dir: &Path,
) -> anyhow::Result<bool> {
    let spec = parse_spec(spec)?;
    let base_args = strip_sweep_flags(base_args);
    let base = parse_bench(&base_args)?;
    // Check every point's flags before running anything.
    let mut plans = Vec::new();
    for (value, x) in &spec.values {
        let (extra, note) = value_args(&spec.key, value, &base)?;
        let mut args: Vec<OsString> = base_args.clone();
        args.extend(extra.iter().map(OsString::from));
        parse_bench(&args).map_err(|e| {
            anyhow::anyhow!(
                "--sweep {}={value}: the flags {extra:?} are not valid: {e}",
                spec.key
            )
        })?;
        plans.push((value.clone(), *x, args, note));
    }
    std::fs::create_dir_all(out_dir)
        .map_err(|e| anyhow::anyhow!("creating {}: {e}", out_dir.display()))?;
    let (mut rows, mut failed) = (Vec::new(), Vec::new());
    let n = plans.len();
    for (i, (value, x, args, note)) in plans.into_iter().enumerate() {
        eprintln!("uep bench --sweep: {}={value} ({}/{n})", spec.key, i + 1);
        match run_point(exe, &args)? {
            Ok(reports) => rows.extend(reports.into_iter().map(|report| SweepRow {
                value: value.clone(),
                x,
                report,
                note: note.clone(),
            })),
            Err(why) => {
                eprintln!("uep bench --sweep: {}={value} failed ({why}", spec.key);
                failed.push(value);
            }
        }
    }
    if rows.is_empty() {
        anyhow::bail!(
            "--sweep {}: every run failed ({}); see the messages above",
            spec.key,
            failed.join(", ")
        );
    }
    let all_verified = (rows.iter()).all(|r| r.report["verified"] == serde_json::Value::Bool(true));
    write_outputs(&spec.key, &base, &rows, out_dir)?;
    if !failed.is_empty() {
        eprintln!(
            "uep bench --sweep: {} value(s) failed and are missing: {}",
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(failed.is_empty() && all_verified)
}

/// One point of a sweep: `exe bench --json ARGS`, its reports; `Ok(Err(why))` where
/// the run failed (its status and the end of its stderr).
fn run_point(
    exe: &Path,
    args: &[OsString],
) -> anyhow::Result<Result<Vec<serde_json::Value>, String>> {
    let out = Command::new(exe)
        .arg("bench")
        .arg("--json")
        .args(args)
        .env_remove("RANK")
        .output()
        .map_err(|e| anyhow::anyhow!("starting {}: {e}", exe.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    Ok(match serde_json::from_str(&stdout) {
        Ok(reports) if out.status.success() => Ok(reports),
        _ => Err(format!(
            "{}):\n{}",
            out.status,
            tail(&String::from_utf8_lossy(&out.stderr), 20)
        )),
    })
}

/// The sweep's CSV and SVG in `out_dir` (their paths printed).
fn write_outputs(
    key: &str,
    base: &BenchArgs,
    rows: &[SweepRow],
    out_dir: &Path,
) -> anyhow::Result<()> {
    let stem = format!("sweep-{key}");
    let csv: PathBuf = out_dir.join(format!("{stem}.csv"));
    let svg: PathBuf = out_dir.join(format!("{stem}.svg"));
    std::fs::write(&csv, render_csv(key, rows))
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", csv.display()))?;
    let dtype = if base.fp8 { "FP8 dispatch" } else { "BF16" };
    let ranks = match key {
        "ranks" => "R".to_string(),
        _ => base.ranks.to_string(),
    };
    let title = format!(
        "uep bench: {ranks} ranks, hidden {}, top-k {}, {} experts, {dtype}; sweeping {}",
        base.hidden,
        base.topk,
        base.experts,
        x_title(key)
    );
    render_svg(key, rows, &title, &svg)?;
    println!("{}", csv.display());
    println!("{}", svg.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn specs_parse_and_reject_clearly() {
        let s = parse_spec("tokens=1,8, 32,4096").unwrap();
        assert_eq!(s.key, "tokens");
        assert_eq!(
            s.values.iter().map(|v| v.1).collect::<Vec<_>>(),
            [1.0, 8.0, 32.0, 4096.0]
        );
        assert_eq!(parse_spec("ll_tokens=4").unwrap().key, "ll-tokens");
        for (bad, why) in [
            ("tokens", "no '='"),
            ("tokens=", "no values"),
            ("tokens=0,8", "not a positive number"),
            ("tokens=x", "not a positive number"),
            ("to ken=1", "not a flag name"),
        ] {
            let e = parse_spec(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn sweep_flags_are_stripped() {
        let a = os(&[
            "--ranks",
            "2",
            "--sweep",
            "tokens=1",
            "--sweep-out=d",
            "--json",
        ]);
        assert_eq!(strip_sweep_flags(&a), os(&["--ranks", "2", "--json"]));
        let a = os(&["--sweep=ranks=2,3", "--sweep-out", "x", "--hidden", "256"]);
        assert_eq!(strip_sweep_flags(&a), os(&["--hidden", "256"]));
    }

    #[test]
    fn values_become_valid_flags() {
        let base = parse_bench(&os(&["--ranks", "4"])).unwrap();
        let (a, n) = value_args("tokens", "8", &base).unwrap();
        assert_eq!(a, ["--tokens", "8", "--ll-tokens", "8"]);
        assert!(n.is_none());
        let (a, n) = value_args("tokens", "512", &base).unwrap();
        assert_eq!(a, ["--tokens", "512", "--mode", "normal"]);
        assert!(n.unwrap().contains("normal mode only"));
        let ll = parse_bench(&os(&["--mode", "ll"])).unwrap();
        assert_eq!(
            value_args("tokens", "512", &ll).unwrap().0,
            ["--ll-tokens", "512"]
        );
        let (a, n) = value_args("ranks", "3", &base).unwrap();
        assert_eq!(a, ["--ranks", "3", "--experts", "258"]);
        assert!(n.unwrap().contains("256 -> 258"));
        assert_eq!(value_args("ranks", "2", &base).unwrap().0, ["--ranks", "2"]);
        let worst = parse_bench(&os(&["--num-worst-tokens", "16384"])).unwrap();
        assert_eq!(
            value_args("tokens", "1024", &worst).unwrap().0,
            [
                "--tokens",
                "1024",
                "--mode",
                "normal",
                "--num-worst-tokens",
                "4096"
            ]
        );
        assert_eq!(
            value_args("hidden", "512", &base).unwrap().0,
            ["--hidden", "512"]
        );
        assert!(value_args("tokens", "1.5", &base).is_err());
        assert_eq!(
            log_ticks(15.0, 3000.0),
            [20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]
        );
        assert_eq!(log_ticks(0.5, 20000.0), [1.0, 10.0, 100.0, 1000.0, 10000.0]);
        assert_eq!(
            [0.5, 1.0, 1.25, 2.5, 150.4, 0.001].map(tick),
            ["0.5", "1", "1.25", "2.5", "150", "1.0e-3"]
        );
        // Every produced set of flags parses as `uep bench` flags.
        for (k, v) in [("tokens", "4096"), ("ranks", "3"), ("hidden", "1024")] {
            let mut args = os(&["--ranks", "4"]);
            args.extend(
                value_args(k, v, &base)
                    .unwrap()
                    .0
                    .iter()
                    .map(OsString::from),
            );
            parse_bench(&args).unwrap();
        }
        assert!(parse_bench(&os(&["--no-such-flag", "1"])).is_err());
    }

    fn row(value: &str, op: &str, avg: f64, gbps: f64) -> SweepRow {
        SweepRow {
            value: value.into(),
            x: value.parse().unwrap(),
            report: serde_json::json!({
                "op": op, "mode": "normal", "ranks": 2, "nodes": 1, "tokens": 8,
                "hidden": 256, "dtype": "bf16", "bytes_per_rank": 4096, "avg_us": avg,
                "p50_us": avg, "p99_us": avg, "min_us": avg, "max_us": avg,
                "gbps": gbps, "verified": true
            }),
            note: (op == "combine").then(|| "a, \"quoted\" note".to_string()),
        }
    }

    #[test]
    fn csv_has_a_row_per_value_per_op() {
        let rows = [
            row("1", "dispatch", 10.5, 1.25),
            row("1", "combine", 12.0, 1.0),
        ];
        let csv = render_csv("tokens", &rows);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("key,value,op,mode,ranks"));
        assert_eq!(
            lines[1],
            "tokens,1,dispatch,normal,2,1,8,256,bf16,4096,10.5,10.5,10.5,10.5,10.5,1.25,true,"
        );
        assert!(
            lines[2].ends_with(",\"a, \"\"quoted\"\" note\""),
            "{}",
            lines[2]
        );
        let header_cols = lines[0].split(',').count();
        assert_eq!(lines[1].split(',').count(), header_cols);
    }

    #[test]
    fn svg_shows_every_op_and_both_axes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.svg");
        let mut rows = Vec::new();
        for (v, s) in [("1", 1.0), ("8", 3.0), ("128", 20.0), ("4096", 200.0)] {
            rows.push(row(v, "layout", 5.0 * s, 0.0));
            rows.push(row(v, "dispatch", 30.0 * s, 2.0 * s.sqrt()));
        }
        render_svg("tokens", &rows, "test figure", &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        for text in [
            "tokens per rank",
            "latency (µs)",
            "GB/s per rank",
            "dispatch",
            "layout",
            "4096",
        ] {
            assert!(svg.contains(text), "missing {text:?}");
        }
        // A single value still draws.
        render_svg("ranks", &rows[..2], "one point", &path).unwrap();
    }

    /// A stand-in `uep` that logs its arguments, fails for `--tokens 3`, and
    /// reports `verified: false` for `--tokens 7`.
    fn fake_uep(dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let log = dir.join("args.log");
        let script = dir.join("fake-uep");
        let report = r#"[{"op":"dispatch","mode":"normal","ranks":2,"nodes":1,"tokens":1,"hidden":256,"dtype":"bf16","bytes_per_rank":512,"avg_us":10.0,"p50_us":10.0,"p99_us":11.0,"min_us":9.0,"max_us":11.0,"gbps":0.05,"verified":VERIFIED}]"#;
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\necho \"$*\" >> '{}'\ncase \"$*\" in\n*'--tokens 3 '*) echo boom >&2; exit 1;;\n*'--tokens 7 '*) echo '{}';;\n*) echo '{}';;\nesac\n",
                log.display(),
                report.replace("VERIFIED", "false"),
                report.replace("VERIFIED", "true"),
            ),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        script
    }

    #[test]
    fn sweep_runs_a_child_per_value_and_writes_both_files() {
        let dir = tempfile::tempdir().unwrap();
        let exe = fake_uep(dir.path());
        let out = dir.path().join("out");
        let base = os(&["--ranks", "2", "--sweep", "tokens=9", "--hidden", "256"]);
        let ok = run_sweep_with(&exe, "tokens=1,200", &base, &out).unwrap();
        assert!(ok);
        let log = std::fs::read_to_string(dir.path().join("args.log")).unwrap();
        assert_eq!(
            log.lines().collect::<Vec<_>>(),
            [
                "bench --json --ranks 2 --hidden 256 --tokens 1 --ll-tokens 1",
                "bench --json --ranks 2 --hidden 256 --tokens 200 --mode normal",
            ]
        );
        let csv = std::fs::read_to_string(out.join("sweep-tokens.csv")).unwrap();
        assert_eq!(csv.lines().count(), 3, "{csv}");
        assert!(csv
            .lines()
            .nth(2)
            .unwrap()
            .starts_with("tokens,200,dispatch,"));
        assert!(std::fs::read_to_string(out.join("sweep-tokens.svg"))
            .unwrap()
            .contains("<svg"));

        // A failing value is left out and makes the result false; so does an
        // unverified report.
        assert!(!run_sweep_with(&exe, "tokens=1,3", &base, &out).unwrap());
        let csv = std::fs::read_to_string(out.join("sweep-tokens.csv")).unwrap();
        assert_eq!(csv.lines().count(), 2, "{csv}");
        assert!(!run_sweep_with(&exe, "tokens=7", &base, &out).unwrap());
        // Nothing succeeded: an error naming the values.
        let e = run_sweep_with(&exe, "tokens=3", &base, &out).unwrap_err();
        assert!(e.to_string().contains("every run failed (3)"), "{e}");
        // Flags the bench does not know are caught before anything runs.
        let e = run_sweep_with(&exe, "no-such-flag=1", &base, &out).unwrap_err();
        assert!(e.to_string().contains("not valid"), "{e}");
    }
}
