//! Reports in the seeds' table format: per phase and tier, # of VMs, duration, total IO
//! operations per VM, IOPS per VM, read and write IOPS, read/write ratio, plus the p95 of per-VM
//! IOPS. Printed as text, written as JSON (every figure) and as HTML with IOPS-over-time charts.
//!
//! IOPS are total operations over the phase's window in profile time (the real duration the
//! profile stands for), whatever the wall time of the run; TRIMs and flushes are counted apart.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::driver::{BlockTally, Ops, RunPlan, StormConfig, VmResult, GUEST, READ_CACHE, TIERS};

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

impl TierRow {
    /// The tier's traffic per VM counted in 4 KiB operations: how the seeds' in-place write
    /// caches, fed "mostly 4K random write I/O" (seed 000), would have issued the same bytes.
    /// overspill's spill writes whole 2 MiB segments instead, so its own operation count is far
    /// lower; this is the figure to hold against the seeds' cache-disk IOPS.
    pub fn ios_4k_per_vm(&self) -> f64 {
        (self.read_bytes_per_vm + self.write_bytes_per_vm) / 4096.0
    }
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
    /// Each phase's window in profile seconds, from the first VM's start of it to the last
    /// VM's end.
    pub phase_windows_s: Vec<(f64, f64)>,
    /// The write-cache mode (`shared`, `ram+disk`, …) and RAM per VM of an in-process server;
    /// `None` for an outside one. What the seeds' figures are matched on.
    pub mode: Option<String>,
    pub ram_bytes: Option<u64>,
    /// The shared read cache in front of the golden image of an in-process server (0: none).
    pub read_cache_bytes: Option<u64>,
    /// Real guests: each VM's boot time, from QEMU's start to the guest's "booted" marker, and
    /// when it booted in seconds since the configuration's storm started (in VM order; `None`
    /// for a VM that did not boot). `None` for synthetic VMs.
    pub boot_times_s: Option<Vec<Option<f64>>>,
    pub booted_at_s: Option<Vec<Option<f64>>>,
    /// Synthetic VMs: when each one's boot ran, from its first request answered (after any
    /// wait for a boot slot) to its first phase's end, in seconds since the storm started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot_windows_s: Option<Vec<Option<(f64, f64)>>>,
    /// Synthetic VMs: their boots' reads as they saw them, mean and 99th percentile, in ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot_read_ms: Option<ReadLatency>,
    /// VMs copying beside the storm (`storm --copiers`): how many, their limit, what they moved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copiers: Option<CopierFigures>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ReadLatency {
    pub reads: usize,
    pub mean_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl ReadLatency {
    /// Of `samples` in µs; `None` without any.
    pub fn of(mut samples: Vec<u32>) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let n = samples.len();
        let ms = |us: u32| f64::from(us) / 1000.0;
        Some(Self {
            reads: n,
            mean_ms: samples.iter().map(|&us| f64::from(us)).sum::<f64>() / n as f64 / 1000.0,
            p99_ms: ms(samples[(n * 99).div_ceil(100).saturating_sub(1)]),
            max_ms: ms(samples[n - 1]),
        })
    }
}

/// The copying VMs of a fairness run: each reads the golden image and writes its own disk,
/// 1 MiB at a time, back to back, for as long as the storm runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CopierFigures {
    pub vms: usize,
    /// Each copier's limit (`vm limit --bandwidth`), bytes per second; `None`: unlimited.
    pub limit_bytes_per_s: Option<u64>,
    pub bytes_copied: u64,
    pub mib_per_s: f64,
}

impl ConfigReport {
    /// What went wrong for this configuration's guests, if anything: errors per phase, VMs that
    /// failed. A configuration with any failed: none of its figures is a result to compare.
    pub fn failure(&self) -> Option<String> {
        let mut parts: Vec<String> = self
            .phases
            .iter()
            .filter(|phase| phase.errors > 0)
            .map(|phase| format!("{} guest errors ({} ENOSPC) in {}", phase.errors, phase.enospc, phase.phase))
            .collect();
        if !self.failed_vms.is_empty() {
            parts.push(format!(
                "{} of {} VMs failed ({})",
                self.failed_vms.len(),
                self.vms,
                self.failed_vms.join("; ")
            ));
        }
        (!parts.is_empty()).then(|| parts.join(", "))
    }

    /// Minimum, mean and maximum boot time of the VMs that booted, and how many did.
    pub fn boot_summary(&self) -> Option<(f64, f64, f64, usize)> {
        let times: Vec<f64> = self.boot_times_s.as_ref()?.iter().flatten().copied().collect();
        let n = times.len();
        (n > 0).then(|| {
            let min = times.iter().copied().fold(f64::INFINITY, f64::min);
            let max = times.iter().copied().fold(0.0, f64::max);
            (min, times.iter().sum::<f64>() / n as f64, max, n)
        })
    }

    /// "boot: min 9.8 s, avg 11.2 s, max 12.9 s of wall clock (3 of 3 VMs booted)": this run's
    /// time on this machine, not the profile's (a synthetic storm runs unpaced unless asked);
    /// for synthetic VMs also their boots' read latency, and in a fairness run what the copiers
    /// beside them moved.
    pub fn boot_text(&self) -> Option<String> {
        let all = self.boot_times_s.as_ref()?.len();
        let mut text = match self.boot_summary() {
            Some((min, avg, max, n)) => {
                format!("boot: min {min:.1} s, avg {avg:.1} s, max {max:.1} s of wall clock ({n} of {all} VMs booted)")
            }
            None => format!("boot: none of {all} VMs booted"),
        };
        if let Some(reads) = &self.boot_read_ms {
            text.push_str(&format!(
                "; its reads: mean {:.2} ms, p99 {:.2} ms, max {:.1} ms",
                reads.mean_ms, reads.p99_ms, reads.max_ms
            ));
        }
        if let Some(copiers) = &self.copiers {
            let limit = copiers
                .limit_bytes_per_s
                .map_or("unlimited".to_owned(), |rate| format!("limited to {}/s each", format_bytes(rate)));
            text.push_str(&format!(
                "; beside it {} copying VMs ({limit}) moved {:.1} MiB/s",
                copiers.vms, copiers.mib_per_s
            ));
        }
        Some(text)
    }
}

/// Where and how a report was made, printed at its top.
#[derive(Debug, Clone, Serialize)]
pub struct RunInfo {
    pub version: String,
    /// The source commit, when the binary runs from a git checkout.
    pub commit: Option<String>,
    pub command: String,
    /// Host name, kernel, CPU model and count.
    pub machine: String,
    /// UTC, RFC 3339.
    pub date: String,
}

impl RunInfo {
    /// This process, on this machine, now.
    pub fn here() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).map(|s| s.trim().to_owned()).ok();
        let cpu = read("/proc/cpuinfo")
            .and_then(|info| {
                info.lines().find(|l| l.starts_with("model name"))?.split_once(':').map(|(_, m)| m.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown CPU".into());
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let machine = format!(
            "{}, Linux {}, {cpu} ({cpus} CPUs)",
            read("/proc/sys/kernel/hostname").unwrap_or_else(|| "unknown host".into()),
            read("/proc/sys/kernel/osrelease").unwrap_or_else(|| "?".into()),
        );
        let commit = std::process::Command::new("git")
            .args(["-C", env!("CARGO_MANIFEST_DIR"), "rev-parse", "--short=12", "HEAD"])
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned());
        Self {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            commit,
            command: std::env::args().collect::<Vec<_>>().join(" "),
            machine,
            date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct StormReport {
    pub run: RunInfo,
    pub workload: String,
    pub description: String,
    /// The seeds' platform the workload models ([`crate::seeds`]), if any.
    pub seed_platform: Option<String>,
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
        phase_windows_s: timeline.windows_ms.iter().map(|&(s, e)| (s as f64 / 1000.0, e as f64 / 1000.0)).collect(),
        mode: None,
        ram_bytes: None,
        read_cache_bytes: None,
        // Synthetic VMs: from the driver's clock (real guests' own markers replace them).
        boot_times_s: results
            .iter()
            .any(|r| r.booted_at_s.is_some())
            .then(|| results.iter().map(|r| Some(r.booted_at_s? - r.boot_began_s?)).collect()),
        booted_at_s: results
            .iter()
            .any(|r| r.booted_at_s.is_some())
            .then(|| results.iter().map(|r| r.booted_at_s).collect()),
        boot_windows_s: results
            .iter()
            .any(|r| r.first_answered_s.is_some())
            .then(|| results.iter().map(|r| Some((r.first_answered_s?, r.booted_at_s?))).collect()),
        boot_read_ms: ReadLatency::of(results.iter().flat_map(|r| r.boot_read_us.iter().copied()).collect()),
        copiers: None,
    }
}

/// The tier rows worth a line: the guest's always, storage tiers that saw operations, and the
/// read cache only where there is one (without, its requests are the golden image's reads).
pub(crate) fn shown_rows<'a>(config: &'a ConfigReport, phase: &'a PhaseReport) -> impl Iterator<Item = &'a TierRow> {
    let no_read_cache = config.read_cache_bytes == Some(0);
    phase.tiers.iter().filter(move |row| {
        row.tier == TIERS[GUEST]
            || (config.has_storage && row.total_ops_per_vm > 0.0 && !(no_read_cache && row.tier == TIERS[READ_CACHE]))
    })
}

/// "86%/14%", or "-" without operations.
pub(crate) fn read_write_text(row: &TierRow) -> String {
    row.read_pct.map_or("-".to_owned(), |r| format!("{r:.0}%/{:.0}%", 100.0 - r))
}

/// Where guest reads were served from, in percent: "RAM 4.3%, spill 0.0%, …"; `None` when the
/// server's counters were not at hand.
pub(crate) fn served_text(config: &ConfigReport) -> Option<String> {
    let b = &config.blocks;
    if !config.has_storage || b.guest_read_blocks == 0 {
        return None;
    }
    let pct = |n: u64| 100.0 * n as f64 / b.guest_read_blocks as f64;
    Some(format!(
        "RAM {:.1}%, spill {:.1}%, golden image {:.1}%, zeroes {:.1}%, cache file {:.1}%",
        pct(b.read_ram),
        pct(b.read_spill),
        pct(b.read_golden),
        pct(b.read_zero),
        pct(b.read_cache_file)
    ))
}

pub(crate) fn duration_text(s: f64) -> String {
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
    let _ = write!(out, "{}", failures_text(report));
    for (p, (phase, source)) in report.phase_sources.iter().enumerate() {
        let _ = writeln!(out, "\n== {phase} ==  (profile: {source})");
        let _ = writeln!(
            out,
            "{:<22} {:<16} {:>5} {:>9} {:>13} {:>9} {:>9} {:>9} {:>11} {:>8}",
            "configuration", "tier", "VMs", "duration", "IO ops / VM", "IOPS/VM", "read", "write", "read/write", "p95"
        );
        for config in &report.configs {
            let Some(phase) = config.phases.get(p) else { continue };
            for row in shown_rows(config, phase) {
                let ratio = read_write_text(row);
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
        if let Some(served) = served_text(c) {
            let _ = writeln!(out, "  reads served by: {served}");
        }
        if let Some(boot) = c.boot_text() {
            let _ = writeln!(out, "  {boot}");
        }
        for failure in &c.failed_vms {
            let _ = writeln!(out, "  failed: {failure}");
        }
    }
    out
}

/// The configurations whose guests got errors, said before any figure: a configuration that
/// failed has no result, only what it did before it failed. Empty when none did.
pub fn failures_text(report: &StormReport) -> String {
    let mut out = String::new();
    for config in &report.configs {
        if let Some(failure) = config.failure() {
            let _ = writeln!(out, "FAILED {}: {failure}; its figures are not results", config.label);
        }
    }
    out
}

/// Writes `report.json` and `report.html` into `dir`.
pub fn write_files(report: &StormReport, dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let json = serde_json::to_string_pretty(report).map_err(std::io::Error::other)?;
    std::fs::write(dir.join("report.json"), json)?;
    let page = crate::page::html(report).map_err(std::io::Error::other)?;
    std::fs::write(dir.join("report.html"), page)
}

/// Bytes in binary units, one decimal: `256.0 MiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
