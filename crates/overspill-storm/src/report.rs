//! Reports in the seeds' table format: per phase and tier, # of VMs, duration, total IO
//! operations per VM, IOPS per VM, read and write IOPS, read/write ratio, plus the p95 of per-VM
//! IOPS. Printed as text, written as JSON (every figure) and as HTML with IOPS-over-time charts.
//!
//! IOPS are total operations over the phase's window in profile time (the real duration the
//! profile stands for), whatever the wall time of the run; TRIMs and flushes are counted apart.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use crate::driver::{BlockTally, Ops, RunPlan, StormConfig, VmResult, TIERS};

#[derive(Debug, Clone, Serialize)]
pub struct TierRow {
    pub tier: String,
    pub total_ops_per_vm: f64,
    pub reads_per_vm: f64,
    pub writes_per_vm: f64,
    pub iops_per_vm: f64,
    pub read_iops_per_vm: f64,
    pub write_iops_per_vm: f64,
    /// Share of reads in percent; `None` when there were no operations.
    pub read_pct: Option<f64>,
    pub p95_iops_per_vm: f64,
    pub read_bytes_per_vm: f64,
    pub write_bytes_per_vm: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PhaseReport {
    pub phase: String,
    pub vms: usize,
    pub duration_s: f64,
    pub tiers: Vec<TierRow>,
    pub trims_per_vm: f64,
    pub flushes_per_vm: f64,
    pub errors: u64,
    pub enospc: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ConfigReport {
    /// e.g. `ram+disk 256M`, or the URI of an outside server.
    pub label: String,
    pub vms: usize,
    pub phases: Vec<PhaseReport>,
    pub has_storage: bool,
    pub spill_segments_written: u64,
    pub peak_spill_bytes_max_vm: u64,
    pub peak_cache_memory_bytes_max_vm: u64,
    pub failed_vms: Vec<String>,
    /// Guest blocks and the tiers that served them, summed over VMs (in-process servers only).
    pub blocks: BlockTally,
    pub wall_s: f64,
    /// IOPS per VM over profile time, per tier: `timeline[bucket][tier]`.
    pub timeline_iops_per_vm: Vec<[f64; TIERS.len()]>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StormReport {
    pub workload: String,
    pub description: String,
    pub vms: usize,
    pub boot_interval_s: f64,
    pub logon_interval_s: f64,
    pub paced: Option<f64>,
    pub bucket_s: u64,
    pub phase_sources: Vec<(String, String)>,
    pub configs: Vec<ConfigReport>,
}

fn percentile_95(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    // Nearest rank.
    let rank = ((values.len() as f64) * 0.95).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

pub fn config_report(
    label: &str,
    plan: &RunPlan,
    config: &StormConfig,
    results: &[VmResult],
    wall_s: f64,
) -> ConfigReport {
    let timeline = &plan.timeline;
    let vms = results.len().max(1) as f64;
    let phases = plan
        .phase_names
        .iter()
        .enumerate()
        .map(|(p, phase)| {
            let (start, end) = timeline.windows_ms[p];
            // A phase nobody reached (a replay with fewer phases) must not divide by zero.
            let duration_s = ((end - start) as f64 / 1000.0).max(0.001);
            let tiers = TIERS
                .iter()
                .enumerate()
                .map(|(t, name)| {
                    let per_vm: Vec<Ops> = results.iter().map(|r| r.phases[p].tiers[t]).collect();
                    let sum = per_vm.iter().fold(Ops::default(), |mut acc, o| {
                        acc.reads += o.reads;
                        acc.writes += o.writes;
                        acc.read_bytes += o.read_bytes;
                        acc.write_bytes += o.write_bytes;
                        acc
                    });
                    TierRow {
                        tier: (*name).to_owned(),
                        total_ops_per_vm: sum.total() as f64 / vms,
                        reads_per_vm: sum.reads as f64 / vms,
                        writes_per_vm: sum.writes as f64 / vms,
                        iops_per_vm: sum.total() as f64 / vms / duration_s,
                        read_iops_per_vm: sum.reads as f64 / vms / duration_s,
                        write_iops_per_vm: sum.writes as f64 / vms / duration_s,
                        read_pct: (sum.total() > 0).then(|| 100.0 * sum.reads as f64 / sum.total() as f64),
                        p95_iops_per_vm: percentile_95(per_vm.iter().map(|o| o.total() as f64 / duration_s).collect()),
                        read_bytes_per_vm: sum.read_bytes as f64 / vms,
                        write_bytes_per_vm: sum.write_bytes as f64 / vms,
                    }
                })
                .collect();
            PhaseReport {
                phase: phase.clone(),
                vms: results.len(),
                duration_s,
                tiers,
                trims_per_vm: results.iter().map(|r| r.phases[p].trims).sum::<u64>() as f64 / vms,
                flushes_per_vm: results.iter().map(|r| r.phases[p].flushes).sum::<u64>() as f64 / vms,
                errors: results.iter().map(|r| r.phases[p].errors).sum(),
                enospc: results.iter().map(|r| r.phases[p].enospc).sum(),
            }
        })
        .collect();
    let buckets = results.first().map_or(0, |r| r.timeline.len());
    let timeline_iops_per_vm = (0..buckets)
        .map(|b| {
            std::array::from_fn(|t| {
                results.iter().map(|r| r.timeline[b][t].total()).sum::<u64>() as f64 / vms / config.bucket_s as f64
            })
        })
        .collect();
    ConfigReport {
        label: label.to_owned(),
        vms: results.len(),
        phases,
        has_storage: results.iter().any(|r| r.has_storage),
        spill_segments_written: results.iter().map(|r| r.spill_segments_written).sum(),
        peak_spill_bytes_max_vm: results.iter().map(|r| r.peak_cache_disk_bytes).max().unwrap_or(0),
        peak_cache_memory_bytes_max_vm: results.iter().map(|r| r.peak_cache_memory_bytes).max().unwrap_or(0),
        failed_vms: results.iter().filter_map(|r| r.failure.as_ref().map(|f| format!("vm {}: {f}", r.vm))).collect(),
        blocks: results.iter().fold(BlockTally::default(), |mut acc, r| {
            acc.add(&r.blocks);
            acc
        }),
        wall_s,
        timeline_iops_per_vm,
    }
}

fn duration_text(s: f64) -> String {
    if s >= 120.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{s:.0} s")
    }
}

/// The seeds' tables, one per phase, with a row per configuration and tier.
pub fn text_tables(report: &StormReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Workload {} ({}), {} VMs, boots every {} s, logons every {} s; {}.",
        report.workload,
        report.description,
        report.vms,
        report.boot_interval_s,
        report.logon_interval_s,
        match report.paced {
            None => "requests ran back to back; IOPS are over the profile's real durations".to_owned(),
            Some(speed) => format!("paced at {speed}x real time; IOPS are over the profile's real durations"),
        }
    );
    for (p, (phase, source)) in report.phase_sources.iter().enumerate() {
        let _ = writeln!(out, "\n== {phase} ==  (profile: {source})");
        let _ = writeln!(
            out,
            "{:<22} {:<16} {:>5} {:>9} {:>13} {:>9} {:>9} {:>9} {:>11} {:>8}",
            "configuration", "tier", "VMs", "duration", "IO ops / VM", "IOPS/VM", "read", "write", "read/write", "p95"
        );
        for config in &report.configs {
            let Some(phase) = config.phases.get(p) else { continue };
            for row in &phase.tiers {
                if row.tier != "guest" && (!config.has_storage || row.total_ops_per_vm == 0.0) {
                    continue;
                }
                let ratio = row.read_pct.map_or("-".to_owned(), |r| format!("{r:.0}%/{:.0}%", 100.0 - r));
                let _ = writeln!(
                    out,
                    "{:<22} {:<16} {:>5} {:>9} {:>13.0} {:>9.3} {:>9.3} {:>9.3} {:>11} {:>8.3}",
                    config.label,
                    row.tier,
                    phase.vms,
                    duration_text(phase.duration_s),
                    row.total_ops_per_vm,
                    row.iops_per_vm,
                    row.read_iops_per_vm,
                    row.write_iops_per_vm,
                    ratio,
                    row.p95_iops_per_vm
                );
            }
            if phase.errors > 0 {
                let _ = writeln!(out, "{:<22} {} errors ({} ENOSPC)", config.label, phase.errors, phase.enospc);
            }
        }
    }
    let _ = writeln!(
        out,
        "\n{:<22} {:>15} {:>16} {:>16} {:>9}",
        "configuration", "spill segments", "peak spill/VM", "peak RAM/VM", "wall s"
    );
    for c in &report.configs {
        let _ = writeln!(
            out,
            "{:<22} {:>15} {:>13.1} MiB {:>12.1} MiB {:>9.1}",
            c.label,
            c.spill_segments_written,
            c.peak_spill_bytes_max_vm as f64 / (1 << 20) as f64,
            c.peak_cache_memory_bytes_max_vm as f64 / (1 << 20) as f64,
            c.wall_s
        );
        if c.has_storage && c.blocks.guest_read_blocks > 0 {
            let b = &c.blocks;
            let pct = |n: u64| 100.0 * n as f64 / b.guest_read_blocks as f64;
            let _ = writeln!(
                out,
                "  reads served by: RAM {:.1}%, spill {:.1}%, golden image {:.1}%, zeroes {:.1}%, cache file {:.1}%",
                pct(b.read_ram),
                pct(b.read_spill),
                pct(b.read_golden),
                pct(b.read_zero),
                pct(b.read_cache_file)
            );
        }
        for failure in &c.failed_vms {
            let _ = writeln!(out, "  failed: {failure}");
        }
    }
    out
}

/// IOPS per VM over profile time for one tier, one line per configuration, as SVG.
fn chart(report: &StormReport, tier: usize) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 300)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let buckets = report.configs.iter().map(|c| c.timeline_iops_per_vm.len()).max().unwrap_or(1).max(2);
        let x_max = (buckets as u64 * report.bucket_s) as f64 / 60.0;
        let y_max = report
            .configs
            .iter()
            .flat_map(|c| c.timeline_iops_per_vm.iter().map(|b| b[tier]))
            .fold(0.0f64, f64::max)
            .max(1.0)
            * 1.1;
        let mut ctx = ChartBuilder::on(&root)
            .caption(format!("{}: IOPS per VM", TIERS[tier]), ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..x_max, 0f64..y_max)
            .map_err(|e| e.to_string())?;
        ctx.configure_mesh().x_desc("profile minutes").draw().map_err(|e| e.to_string())?;
        for (i, config) in report.configs.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let points = config
                .timeline_iops_per_vm
                .iter()
                .enumerate()
                .map(|(b, v)| ((b as u64 * report.bucket_s) as f64 / 60.0, v[tier]));
            ctx.draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(config.label.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color));
        }
        ctx.configure_series_labels().border_style(BLACK).background_style(WHITE).draw().map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

pub fn html(report: &StormReport) -> Result<String, String> {
    let mut out = String::new();
    let _ = write!(
        out,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>overspill storm: {}</title>\
         <style>body{{font-family:sans-serif;margin:2em}}pre{{font-size:12px}}</style></head><body>\
         <h1>overspill storm: {}</h1><p>{}</p>",
        html_escape(&report.workload),
        html_escape(&report.workload),
        html_escape(&report.description)
    );
    for tier in 0..TIERS.len() {
        let any = report.configs.iter().any(|c| c.timeline_iops_per_vm.iter().any(|b| b[tier] > 0.0));
        if any {
            out.push_str(&chart(report, tier)?);
        }
    }
    let _ = write!(out, "<h2>Tables</h2><pre>{}</pre></body></html>", html_escape(&text_tables(report)));
    Ok(out)
}

/// Writes `report.json` and `report.html` into `dir`.
pub fn write_files(report: &StormReport, dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let json = serde_json::to_string_pretty(report).map_err(std::io::Error::other)?;
    std::fs::write(dir.join("report.json"), json)?;
    let page = html(report).map_err(std::io::Error::other)?;
    std::fs::write(dir.join("report.html"), page)
}
