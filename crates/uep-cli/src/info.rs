//! `uep info`: what this machine offers uep — the libfabric providers and which fit.

use std::fmt::Write as _;

/// The report `uep info` prints.
pub fn report() -> anyhow::Result<String> {
    let providers = uep_transport::list_providers()?;
    let default = uep_transport::FabricOptions::from_env().provider;
    let mut out = String::new();
    writeln!(out, "uep {}", env!("CARGO_PKG_VERSION"))?;
    writeln!(
        out,
        "cores: {}; default provider: {default} (set UEP_FI_PROVIDER or --provider to change)",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    )?;
    for (k, default) in uep_transport::ENV_DEFAULTS {
        let now = std::env::var(k).unwrap_or_default();
        writeln!(
            out,
            "{k}={now} (uep's default {default}; set it to override)"
        )?;
    }
    writeln!(
        out,
        "libfabric providers ({} entries, distinct ones below):",
        providers.len()
    )?;
    // libfabric lists one entry per address of an interface: show each kind once.
    let mut rows: Vec<[String; 7]> = providers.iter().map(provider_row).collect();
    let mut seen = std::collections::HashSet::new();
    rows.retain(|r| seen.insert(r.clone()));
    let header = [
        "provider",
        "domain",
        "ep",
        "RMA write",
        "CQ data",
        "delivery",
        "uep",
    ];
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let mut l = String::from(" ");
        for (cell, w) in cells.iter().zip(widths) {
            let _ = write!(l, " {cell:<w$}");
        }
        l.trim_end().to_string()
    };
    writeln!(out, "{}", line(&header.map(String::from)))?;
    for row in &rows {
        writeln!(out, "{}", line(row))?;
    }
    let fitting = providers.iter().filter(|p| p.fits()).count();
    writeln!(
        out,
        "{fitting} provider entr{} fit uep; every transport is treated as unordered without atomics unless proven otherwise",
        if fitting == 1 { "y" } else { "ies" }
    )?;
    Ok(out)
}

/// One provider entry as a row of the table.
fn provider_row(p: &uep_transport::ProviderInfo) -> [String; 7] {
    let yes_no = |b: bool| if b { "yes" } else { "no" }.to_string();
    [
        p.provider.clone(),
        p.domain.clone(),
        p.ep_type.clone(),
        yes_no(p.rma_write && p.remote_write),
        format!("{} B", p.cq_data_size),
        if p.ordered { "ordered" } else { "unordered" }.into(),
        if p.fits() {
            "fits".into()
        } else {
            "no (needs RDM + RMA write + >= 4 B remote CQ data)".into()
        },
    ]
}
