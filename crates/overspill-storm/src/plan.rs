//! The planner: replays recorded traces through the engine alone ([`crate::model`]) for several
//! RAM sizes, and reports what the storage would see; optionally estimates boot times on a
//! storage device model.
//!
//! The engine code is the same as `serve`'s, so for the same trace and RAM size the storage
//! figures equal a live storm's counters (with no shared read cache; with one, a VM's share of
//! the fetches depends on which VM got there first).
//!
//! The lower bound: a cache that may hold `C` blocks in RAM must, when `L` distinct blocks are
//! live (written and neither trimmed nor zeroed), have at least `L - C` of them on disk, each
//! written there once; in 2 MiB segments that is `ceil((L - C) / 512)` spill writes. No cache of
//! that size can do with fewer, whatever its policy; the engine comes close to the extent that it
//! spills only what the peak forces out.

use std::collections::HashSet;

use overspill_engine::{EngineError, StorageTier, WriteCacheMode};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Serialize;

use crate::driver::{tier_index, RunPlan, VmResult};
use crate::model::{simulate, simulate_observed, ModelConfig};
use crate::report::format_bytes;
pub use crate::storage::BootEstimate;
use crate::storage::{simulate_boots, simulate_paced_boots, Request, StorageSpec, VmBoot, INTERVAL_S};
use overspill_block::trace::Trace;
use overspill_block::GuestOp;

/// What to plan for.
#[derive(Debug, Clone)]
pub struct PlanOptions {
    /// RAM sizes per VM to compare.
    pub ram: Vec<u64>,
    pub mode: WriteCacheMode,
    /// Shared read cache in front of the golden image, as `serve --read-cache`.
    pub read_cache_bytes: u64,
    /// Estimate boot times on this storage.
    pub storage: Option<StorageSpec>,
    /// VMs booting at once for the estimate (traces are reused round-robin).
    pub vms: usize,
    /// Also estimate the boots with at most this many VMs booting at once (`serve --boot-max`).
    pub boot_max: Option<usize>,
}

/// Storage figures of one VM after its whole trace.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct VmFigures {
    pub golden_reads: u64,
    pub golden_read_bytes: u64,
    pub spill_writes: u64,
    pub spill_reads: u64,
    pub cache_file_reads: u64,
    pub cache_file_writes: u64,
    pub shared_reads: u64,
    pub shared_writes: u64,
    pub peak_spill_bytes: u64,
    pub peak_ram_bytes: u64,
    /// Storage ops of the trace's first phase (its boot, for boot-time estimates).
    pub first_phase_storage_ops: u64,
    pub first_phase_storage_bytes: u64,
    /// The part of those that were golden-image reads (shared between VMs by the read cache).
    pub first_phase_golden_ops: u64,
    pub first_phase_golden_bytes: u64,
    pub first_phase_duration_s: f64,
    /// Guest requests that failed (a write refused for want of room: RAM full in `ram` mode,
    /// the spill disk full): a RAM size that gives any is too small, whatever else it saves.
    pub errors: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RamRow {
    pub ram_bytes: u64,
    pub vms: Vec<VmFigures>,
    pub storage_ops_per_vm: f64,
    pub spill_writes_per_vm: f64,
    pub spill_writes_lower_bound_per_vm: f64,
    /// Engine spill writes over the lower bound (1.0 is optimal); `None` when the bound is 0.
    pub engine_over_bound: Option<f64>,
    pub boot: Option<BootEstimate>,
    /// The same boots with `boot_max` VMs booting at most at once.
    pub boot_paced: Option<BootEstimate>,
    /// Guest requests that failed, all VMs: the row is a failure if any did.
    pub errors: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    pub traces: Vec<String>,
    pub mode: String,
    pub read_cache_bytes: u64,
    pub rows: Vec<RamRow>,
    /// Boot times if every guest request went to the storage (no cache at all).
    pub boot_without_cache: Option<BootEstimate>,
    pub boot_without_cache_paced: Option<BootEstimate>,
}

/// Storage figures per VM of one simulation.
fn figures(plan: &RunPlan, results: &[VmResult]) -> Vec<VmFigures> {
    let golden = tier_index(StorageTier::Golden);
    let storage: Vec<usize> = StorageTier::ALL.iter().map(|&t| tier_index(t)).collect();
    results
        .iter()
        .enumerate()
        .map(|(vm, r)| {
            let total = |tier: usize| {
                r.phases
                    .iter()
                    .fold((0, 0), |(reads, writes), p| (reads + p.tiers[tier].reads, writes + p.tiers[tier].writes))
            };
            let first = r.phases.first().map(|p| p.tiers).unwrap_or_default();
            let first_ops = plan.ops[vm].first().map(Vec::as_slice).unwrap_or_default();
            let (lo, hi) = first_ops.iter().fold((u64::MAX, 0), |(lo, hi), op| (lo.min(op.at_ms), hi.max(op.at_ms)));
            VmFigures {
                golden_reads: total(golden).0,
                golden_read_bytes: r.phases.iter().map(|p| p.tiers[golden].read_bytes).sum(),
                spill_writes: total(tier_index(StorageTier::Spill)).1,
                spill_reads: total(tier_index(StorageTier::Spill)).0,
                cache_file_reads: total(tier_index(StorageTier::CacheFile)).0,
                cache_file_writes: total(tier_index(StorageTier::CacheFile)).1,
                shared_reads: total(tier_index(StorageTier::Shared)).0,
                shared_writes: total(tier_index(StorageTier::Shared)).1,
                peak_spill_bytes: r.peak_cache_disk_bytes,
                peak_ram_bytes: r.peak_cache_memory_bytes,
                first_phase_storage_ops: storage.iter().map(|&t| first[t].total()).sum(),
                first_phase_storage_bytes: storage.iter().map(|&t| first[t].read_bytes + first[t].write_bytes).sum(),
                first_phase_golden_ops: first[golden].reads,
                first_phase_golden_bytes: first[golden].read_bytes,
                first_phase_duration_s: if hi >= lo { (hi - lo) as f64 / 1e3 } else { 0.0 },
                errors: r.phases.iter().map(|p| p.errors).sum(),
            }
        })
        .collect()
}

/// Every storage operation of one VM, all tiers (the planner's "storage ops"): the parts of
/// [`STORAGE_PARTS`].
fn storage_ops(f: &VmFigures) -> u64 {
    f.golden_reads + f.spill_writes + f.spill_reads + cache_file_and_shared(f)
}

/// The reads and writes of a VM's write-cache file and of shared storage (modes `disk`, `shared`).
fn cache_file_and_shared(f: &VmFigures) -> u64 {
    f.cache_file_reads + f.cache_file_writes + f.shared_reads + f.shared_writes
}

/// The plan reads no timeline: one bucket holds the longest trace (a year; a timeline of 10 s
/// buckets took some 60 MB per VM of a month-long `serve --record` trace).
const ONE_BUCKET_S: u64 = overspill_block::trace::MAX_RECORD_TIME_US / 1_000_000 + 1;

fn model(plan: &RunPlan, options: &PlanOptions, ram: u64) -> Result<Vec<VmFigures>, EngineError> {
    let config = ModelConfig {
        mode: options.mode,
        ram_bytes: ram,
        read_cache_bytes: options.read_cache_bytes,
        bucket_s: ONE_BUCKET_S,
    };
    Ok(figures(plan, &simulate(plan, &config)?))
}

/// Each trace's boot (its first phase) as the storage sees it with no cache in front: every
/// guest read and write, a read of a block the VM never wrote marked golden (the storage model
/// sends it to the one shared image for linked clones, to the VM's own copy for full clones).
pub fn boots_without_cache(plan: &RunPlan) -> Vec<VmBoot> {
    plan.ops
        .iter()
        .map(|phases| {
            let mut written: HashSet<u64> = HashSet::new();
            let mut boot = VmBoot::default();
            for op in phases.first().map(Vec::as_slice).unwrap_or_default() {
                let write = match op.kind {
                    GuestOp::Read => false,
                    GuestOp::Write => true,
                    GuestOp::Trim | GuestOp::Zero | GuestOp::Flush => continue,
                };
                let blocks = op.offset / 4096..(op.offset + u64::from(op.len)).div_ceil(4096);
                let golden = !write && !blocks.clone().any(|b| written.contains(&b));
                if write {
                    written.extend(blocks);
                }
                boot.push(op.at_ms as f64 / 1e3, [Request { write, golden, offset: op.offset, bytes: op.len }]);
            }
            boot
        })
        .collect()
}

/// Each trace's boot as the storage sees it behind overspill at `ram` per VM: what every guest
/// request cost the overlay's tiers, from the engine's own run of the traces. Golden-image reads
/// are left to the storage model's read cache (the same code as serve's), which shares them
/// between the storm's VMs in the order they ask.
pub fn boots_through_overlay(plan: &RunPlan, options: &PlanOptions, ram: u64) -> Result<Vec<VmBoot>, EngineError> {
    let config = ModelConfig { mode: options.mode, ram_bytes: ram, read_cache_bytes: 0, bucket_s: ONE_BUCKET_S };
    let mut boots = vec![VmBoot::default(); plan.vms()];
    // Per VM: its counters after its last request, and where its next spill segment goes.
    let mut last = vec![[(0u64, 0u64, 0u64, 0u64); 4]; plan.vms()];
    let mut spill_at = vec![SPILL_SPACE; plan.vms()];
    simulate_observed(plan, &config, |vm, phase, op, stats| {
        let now = StorageTier::ALL.map(|t| {
            let r = t.reads(stats);
            let w = t.writes(stats);
            (r.ops.get(), r.bytes.get(), w.map_or(0, |w| w.ops.get()), w.map_or(0, |w| w.bytes.get()))
        });
        let before = std::mem::replace(&mut last[vm], now);
        if phase != 0 {
            return;
        }
        let mut requests = Vec::new();
        for (k, &tier) in StorageTier::ALL.iter().enumerate() {
            let (reads, read_bytes) = (now[k].0 - before[k].0, now[k].1 - before[k].1);
            let (writes, write_bytes) = (now[k].2 - before[k].2, now[k].3 - before[k].3);
            let golden = tier == StorageTier::Golden;
            for (count, bytes, write) in [(reads, read_bytes, false), (writes, write_bytes, true)] {
                for i in 0..count {
                    let each = bytes / count + u64::from(i < bytes % count);
                    // Spill writes append to the VM's log; everything else lands near the guest's
                    // offset (where a spill read finds its block is not known here).
                    let offset = if tier == StorageTier::Spill && write {
                        spill_at[vm] += each;
                        spill_at[vm] - each
                    } else {
                        op.offset + i * (bytes / count)
                    };
                    requests.push(Request { write, golden, offset, bytes: each as u32 });
                }
            }
        }
        boots[vm].push(op.at_ms as f64 / 1e3, requests);
    })?;
    Ok(boots)
}

/// Where a VM's spill log lies in its own space (past any guest disk).
const SPILL_SPACE: u64 = 1 << 39;

/// The boot estimates of `options.storage` for the traces of `plan`, all VMs at once and, with
/// `options.boot_max`, paced: behind overspill at `ram` per VM, or with no cache at all when
/// `ram` is `None`.
pub fn boot_estimate(
    plan: &RunPlan,
    options: &PlanOptions,
    ram: Option<u64>,
) -> Result<(Option<BootEstimate>, Option<BootEstimate>), EngineError> {
    let Some(storage) = &options.storage else { return Ok((None, None)) };
    let (boots, read_cache) = match ram {
        Some(ram) => (boots_through_overlay(plan, options, ram)?, options.read_cache_bytes),
        None => (boots_without_cache(plan), 0),
    };
    let all = simulate_boots(storage, &boots, options.vms, read_cache);
    let paced =
        options.boot_max.and_then(|max| simulate_paced_boots(storage, &boots, options.vms, read_cache, Some(max)));
    Ok((all, paced))
}

/// The most 4 KiB blocks each trace ever has live (written, not trimmed or zeroed since).
pub fn peak_live_blocks(trace: &Trace) -> u64 {
    let mut live: HashSet<u64> = HashSet::new();
    let mut peak = 0u64;
    for r in &trace.records {
        let first = r.offset / 4096;
        let end = (r.offset + u64::from(r.length)).div_ceil(4096);
        match r.kind {
            GuestOp::Write => {
                live.extend(first..end);
                peak = peak.max(live.len() as u64);
            }
            GuestOp::Trim | GuestOp::Zero => {
                // Only whole blocks are released, as the engine does.
                for b in r.offset.div_ceil(4096)..(r.offset + u64::from(r.length)) / 4096 {
                    live.remove(&b);
                }
            }
            GuestOp::Read | GuestOp::Flush => {}
        }
    }
    peak
}

pub fn spill_write_lower_bound(peak_live: u64, ram_bytes: u64) -> u64 {
    peak_live.saturating_sub(ram_bytes / 4096).div_ceil(512)
}

/// Plans `traces` (named `names` in the report) for every RAM size of `options`.
pub fn plan(traces: &[Trace], names: Vec<String>, options: &PlanOptions) -> Result<PlanReport, EngineError> {
    let run_plan = RunPlan::from_traces(traces).map_err(EngineError::Config)?;
    let mut sizes = options.ram.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let peaks: Vec<u64> = traces.iter().map(peak_live_blocks).collect();
    let mut rows = Vec::new();
    for &ram in &sizes {
        let vms = model(&run_plan, options, ram)?;
        let n = vms.len().max(1) as f64;
        let storage = vms.iter().map(storage_ops).sum::<u64>() as f64 / n;
        let spill_writes = vms.iter().map(|f| f.spill_writes).sum::<u64>() as f64 / n;
        let bound = if options.mode == WriteCacheMode::RamDisk {
            peaks.iter().map(|&p| spill_write_lower_bound(p, ram)).sum::<u64>() as f64 / n
        } else {
            0.0
        };
        let (boot, boot_paced) = boot_estimate(&run_plan, options, Some(ram))?;
        rows.push(RamRow {
            ram_bytes: ram,
            boot,
            boot_paced,
            storage_ops_per_vm: storage,
            spill_writes_per_vm: spill_writes,
            spill_writes_lower_bound_per_vm: bound,
            engine_over_bound: (bound > 0.0).then(|| spill_writes / bound),
            errors: vms.iter().map(|f| f.errors).sum(),
            vms,
        });
    }
    let (boot_without_cache, boot_without_cache_paced) = boot_estimate(&run_plan, options, None)?;
    Ok(PlanReport {
        traces: names,
        mode: options.mode.to_string(),
        read_cache_bytes: options.read_cache_bytes,
        rows,
        boot_without_cache,
        boot_without_cache_paced,
    })
}

/// The plan page: per RAM size what reaches storage, the engine's spill writes against the
/// bound, and the boot estimates, each on its own axes (their scales differ by orders of
/// magnitude), then the tables.
pub fn html(report: &PlanReport) -> Result<String, String> {
    let mut out = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>overspill plan</title><style>{PAGE_STYLE}</style>\
         </head><body><h1>overspill plan</h1><p>{} traces, mode <code>{}</code>, shared read cache {}; figures \
         per VM over the whole trace.</p>{}<h2>Storage operations per VM</h2>{}{}<h2>Spill writes per VM, and \
         the least any cache of that size could do</h2>{}{}",
        report.traces.len(),
        escape(&report.mode),
        format_bytes(report.read_cache_bytes),
        failures(report).iter().map(|f| format!("<p class=\"failed\">{}</p>", escape(f))).collect::<String>(),
        storage_chart(report)?,
        swatches(&STORAGE_PARTS.map(|(name, color)| (name, color))),
        spill_chart(report)?,
        swatches(&[("engine", SPILL_COLOR), ("lower bound", BOUND_COLOR)]),
    );
    let boots = boot_rows(report);
    if !boots.is_empty() {
        let first = boots[0].1;
        out.push_str(&format!(
            "<h2>Boot storm estimate: {} VMs on {}</h2>{}{}<h3>VMs booted per 15 s</h3>{}{}",
            first.vms,
            escape(&first.storage),
            boot_chart(&boots)?,
            swatches(&[("average", AVG_COLOR), ("min to max", WHISKER_COLOR)]),
            booted_chart(&boots)?,
            swatches(&boots.iter().enumerate().map(|(k, (l, _))| (l.as_str(), boot_color(k))).collect::<Vec<_>>()),
        ));
    }
    out.push_str(&format!("<h2>Tables</h2>{}</body></html>", tables(report)));
    Ok(out)
}

const PAGE_STYLE: &str = "body{font-family:sans-serif;margin:2em;max-width:1200px;color:#222}\
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}td,th{border:1px solid #ccc;padding:2px 8px;\
text-align:right}th{background:#f2f2f2}.legend{font-size:13px;margin:.3em 0 1.5em}\
.legend span{display:inline-block;width:12px;height:12px;margin:0 5px 0 16px;vertical-align:middle}svg{display:block}\
.failed{color:#b00;font-weight:bold}";

/// The parts of "storage ops", stacked in this order.
const STORAGE_PARTS: [(&str, RGBColor); 4] = [
    ("golden-image reads", RGBColor(44, 160, 44)),
    ("spill reads", RGBColor(31, 119, 180)),
    ("spill writes", RGBColor(214, 39, 40)),
    ("cache-file and shared reads and writes", RGBColor(255, 127, 14)),
];
const SPILL_COLOR: RGBColor = RGBColor(214, 39, 40);
const BOUND_COLOR: RGBColor = RGBColor(120, 120, 120);
const WHISKER_COLOR: RGBColor = RGBColor(60, 60, 60);
const AVG_COLOR: RGBColor = RGBColor(31, 119, 180);

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn swatches(items: &[(&str, RGBColor)]) -> String {
    let mut out = String::from("<div class=\"legend\">");
    for (name, c) in items {
        out.push_str(&format!("<span style=\"background:#{:02x}{:02x}{:02x}\"></span>{}", c.0, c.1, c.2, escape(name)));
    }
    out + "</div>"
}

fn error(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Mean per VM of the four parts of [`STORAGE_PARTS`].
fn storage_parts(row: &RamRow) -> [f64; 4] {
    let n = row.vms.len().max(1) as f64;
    let mean = |f: fn(&VmFigures) -> u64| row.vms.iter().map(f).sum::<u64>() as f64 / n;
    [mean(|f| f.golden_reads), mean(|f| f.spill_reads), mean(|f| f.spill_writes), mean(cache_file_and_shared)]
}

/// One series of bars: its colour, its column within each RAM size's group (series sharing a
/// column stack), and per RAM size the bar's bottom and top.
type Bars = (RGBColor, usize, Vec<(f64, f64)>);

/// Bars at the asked RAM sizes, one group and one tick each, whatever their spacing.
fn ram_bars(report: &PlanReport, y_desc: &str, series: &[Bars]) -> Result<String, String> {
    let n = report.rows.len().max(1);
    let y_max = series.iter().flat_map(|(_, _, bars)| bars.iter().map(|b| b.1)).fold(1.0f64, f64::max) * 1.1;
    let columns = series.iter().map(|(_, column, _)| column + 1).max().unwrap_or(1);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 300)).into_drawing_area();
        root.fill(&WHITE).map_err(error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(80)
            .build_cartesian_2d(0f64..n as f64, 0f64..y_max)
            .map_err(error)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .x_desc("RAM per VM")
            .y_desc(y_desc)
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 13))
            .draw()
            .map_err(error)?;
        let width = 0.7 / columns as f64;
        for (color, column, bars) in series {
            let left = 0.15 + width * *column as f64;
            for (i, &(low, high)) in bars.iter().enumerate() {
                if high > low {
                    let (a, b) = (i as f64 + left, i as f64 + left + width * 0.9);
                    chart.draw_series([Rectangle::new([(a, low), (b, high)], color.filled())]).map_err(error)?;
                }
            }
        }
        for (i, row) in report.rows.iter().enumerate() {
            let (x, y) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
            let style = ("sans-serif", 13).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Top));
            root.draw(&Text::new(ram_label(row), (x, y + 6), style)).map_err(error)?;
        }
        root.present().map_err(error)?;
    }
    Ok(svg)
}
fn storage_chart(report: &PlanReport) -> Result<String, String> {
    let parts: Vec<[f64; 4]> = report.rows.iter().map(storage_parts).collect();
    let series: Vec<Bars> = STORAGE_PARTS
        .iter()
        .enumerate()
        .map(|(k, (_, color))| {
            let bars = parts.iter().map(|p| (p[..k].iter().sum::<f64>(), p[..=k].iter().sum::<f64>())).collect();
            (*color, 0, bars)
        })
        .collect();
    ram_bars(report, "storage operations per VM", &series)
}

fn spill_chart(report: &PlanReport) -> Result<String, String> {
    let engine = report.rows.iter().map(|r| (0.0, r.spill_writes_per_vm)).collect();
    let bound = report.rows.iter().map(|r| (0.0, r.spill_writes_lower_bound_per_vm)).collect();
    ram_bars(report, "2 MiB spill writes per VM", &[(SPILL_COLOR, 0, engine), (BOUND_COLOR, 1, bound)])
}

/// The boot estimates to draw: per RAM size, then without any cache; each paced one after its
/// unpaced twin.
fn boot_rows(report: &PlanReport) -> Vec<(String, &BootEstimate)> {
    fn with_paced<'a>(
        label: String,
        all: Option<&'a BootEstimate>,
        paced: Option<&'a BootEstimate>,
    ) -> impl Iterator<Item = (String, &'a BootEstimate)> {
        let paced = paced.map(|b| (format!("{label}, {} at once", b.max_booting.unwrap_or(0)), b));
        all.map(|b| (label, b)).into_iter().chain(paced)
    }
    report
        .rows
        .iter()
        .flat_map(|r| with_paced(ram_label(r), r.boot.as_ref(), r.boot_paced.as_ref()))
        .chain(with_paced(
            "no cache".to_owned(),
            report.boot_without_cache.as_ref(),
            report.boot_without_cache_paced.as_ref(),
        ))
        .collect()
}

/// Per configuration a bar at the average boot time with a whisker from min to max, each
/// written out at its end.
fn boot_chart(boots: &[(String, &BootEstimate)]) -> Result<String, String> {
    let n = boots.len();
    // Room on the right for the figures written after the longest bar.
    let hi = boots.iter().map(|(_, b)| b.max_s / 60.0).fold(0.1f64, f64::max) * 1.5;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 70 + 36 * n as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(90)
            .build_cartesian_2d(0f64..hi, 0f64..n as f64)
            .map_err(error)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .x_desc("boot time, minutes")
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 13))
            .draw()
            .map_err(error)?;
        for (i, (label, b)) in boots.iter().enumerate() {
            // The first configuration on top.
            let y = (n - 1 - i) as f64;
            let (avg, min, max) = (b.avg_s / 60.0, b.min_s / 60.0, b.max_s / 60.0);
            let bar = Rectangle::new([(0.0, y + 0.2), (avg, y + 0.8)], AVG_COLOR.mix(0.6).filled());
            chart.draw_series([bar]).map_err(error)?;
            let whisker = [(min, y + 0.5), (max, y + 0.5)];
            chart.draw_series(LineSeries::new(whisker, WHISKER_COLOR.stroke_width(3))).map_err(error)?;
            let text = format!("avg {}, min {}, max {}", clock(b.avg_s), clock(b.min_s), clock(b.max_s));
            let style = ("sans-serif", 13).into_font().color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center));
            chart.draw_series([Text::new(text, (max.max(avg) + hi / 100.0, y + 0.5), style)]).map_err(error)?;
            let (x0, y0) = chart.backend_coord(&(0.0, y + 0.5));
            let name = ("sans-serif", 13).into_font().color(&BLACK).pos(Pos::new(HPos::Right, VPos::Center));
            root.draw(&Text::new(label.clone(), (x0 - 8, y0), name)).map_err(error)?;
        }
        root.present().map_err(error)?;
    }
    Ok(svg)
}

/// VMs whose boot ended in each 15 s interval, a line per configuration (as seed 003 plotted).
fn booted_chart(boots: &[(String, &BootEstimate)]) -> Result<String, String> {
    let intervals = boots.iter().map(|(_, b)| b.booted_per_interval.len()).max().unwrap_or(1).max(1);
    let most = boots.iter().flat_map(|(_, b)| b.booted_per_interval.iter().copied()).max().unwrap_or(1).max(1);
    let minutes = intervals as f64 * INTERVAL_S / 60.0;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 300)).into_drawing_area();
        root.fill(&WHITE).map_err(error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..minutes, 0f64..most as f64 * 1.1)
            .map_err(error)?;
        chart
            .configure_mesh()
            .x_desc("minutes since the first power-on")
            .y_desc("VMs booted per 15 s")
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 13))
            .draw()
            .map_err(error)?;
        for (k, (label, b)) in boots.iter().enumerate() {
            // Each interval's count at its end, as the seed's ESXTOP intervals were.
            let points = std::iter::once((0.0, 0.0)).chain(
                b.booted_per_interval.iter().enumerate().map(|(i, &n)| ((i + 1) as f64 * INTERVAL_S / 60.0, n as f64)),
            );
            // A paced estimate in a thinner line than the unpaced ones.
            let color = boot_color(k);
            let width = if b.max_booting.is_some() { 1 } else { 2 };
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(width)))
                .map_err(error)?
                .label(label.clone())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(width)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .draw()
            .map_err(error)?;
        root.present().map_err(error)?;
    }
    Ok(svg)
}

fn boot_color(k: usize) -> RGBColor {
    let (r, g, b) = Palette99::pick(k).rgb();
    RGBColor(r, g, b)
}

/// A RAM size as the boot estimates and charts name it, marked when its guests got errors.
fn ram_label(row: &RamRow) -> String {
    let size = format_bytes(row.ram_bytes).replace(".0 ", " ");
    if row.errors > 0 {
        format!("{size} (FAILED)")
    } else {
        size
    }
}

/// What failed, one line per RAM size whose guests got errors: said first, so that no figure
/// of such a size is read as a saving.
fn failures(report: &PlanReport) -> Vec<String> {
    report
        .rows
        .iter()
        .filter(|row| row.errors > 0)
        .map(|row| {
            format!(
                "FAILED at {} per VM: {} guest requests failed (writes refused for want of room); its \
                 figures are no saving",
                format_bytes(row.ram_bytes),
                row.errors
            )
        })
        .collect()
}

/// The figures as HTML tables: per RAM size, then the boot estimates.
fn tables(report: &PlanReport) -> String {
    let mut out = String::from(
        "<table><tr><th>RAM/VM</th><th>guest errors</th><th>storage ops</th><th>golden reads</th>\
         <th>spill writes</th><th>spill reads</th><th>spill writes, lower bound</th><th>engine/bound</th>\
         <th>peak spill</th><th>peak RAM</th></tr>",
    );
    for row in &report.rows {
        let p = storage_parts(row);
        let max = |f: fn(&VmFigures) -> u64| row.vms.iter().map(f).max().unwrap_or(0);
        out.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td>{:.0}</td><td>{:.0}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td>\
             <td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&ram_label(row)),
            row.errors,
            row.storage_ops_per_vm,
            p[0],
            p[2],
            p[1],
            row.spill_writes_lower_bound_per_vm,
            row.engine_over_bound.map_or("–".into(), |r| format!("{r:.2}")),
            format_bytes(max(|f| f.peak_spill_bytes)),
            format_bytes(max(|f| f.peak_ram_bytes)),
        ));
    }
    out.push_str("</table>");
    let boots = boot_rows(report);
    if !boots.is_empty() {
        out.push_str(
            "<table><tr><th rowspan=2>cache</th><th rowspan=2>time taken to issue power-ons</th>\
             <th colspan=3>time taken for a VM to boot</th><th rowspan=2>peak IOPS</th></tr>\
             <tr><th>minimum</th><th>maximum</th><th>average</th></tr>",
        );
        for (label, b) in boots {
            out.push_str(&format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.0}</td></tr>",
                escape(&label),
                clock(b.power_on_s),
                clock(b.min_s),
                clock(b.max_s),
                clock(b.avg_s),
                b.peak_iops
            ));
        }
        out.push_str("</table>");
    }
    out
}

fn clock(s: f64) -> String {
    format!("{}:{:02}", (s / 60.0) as u64, (s % 60.0) as u64)
}

pub fn text(report: &PlanReport) -> String {
    let mut out = format!(
        "Plan for {} traces, mode {}, shared read cache {}; figures per VM over the whole trace.\n\n",
        report.traces.len(),
        report.mode,
        format_bytes(report.read_cache_bytes)
    );
    for failure in failures(report) {
        out.push_str(&format!("{failure}\n"));
    }
    if report.rows.iter().any(|row| row.errors > 0) {
        out.push('\n');
    }
    out.push_str(&format!(
        "{:>18} {:>8} {:>12} {:>12} {:>12} {:>12} {:>14} {:>10} {:>12} {:>12}\n",
        "RAM/VM",
        "errors",
        "storage ops",
        "golden rd",
        "spill wr",
        "spill rd",
        "spill wr LB",
        "engine/LB",
        "peak spill",
        "peak RAM"
    ));
    for row in &report.rows {
        let n = row.vms.len().max(1) as f64;
        let mean = |f: fn(&VmFigures) -> u64| row.vms.iter().map(f).sum::<u64>() as f64 / n;
        let max = |f: fn(&VmFigures) -> u64| row.vms.iter().map(f).max().unwrap_or(0);
        out.push_str(&format!(
            "{:>18} {:>8} {:>12.0} {:>12.0} {:>12.1} {:>12.1} {:>14.1} {:>10} {:>12} {:>12}\n",
            ram_label(row),
            row.errors,
            row.storage_ops_per_vm,
            mean(|f| f.golden_reads),
            row.spill_writes_per_vm,
            mean(|f| f.spill_reads),
            row.spill_writes_lower_bound_per_vm,
            row.engine_over_bound.map_or("-".into(), |r| format!("{r:.2}")),
            format_bytes(max(|f| f.peak_spill_bytes)),
            format_bytes(max(|f| f.peak_ram_bytes)),
        ));
    }
    let boots = boot_rows(report);
    if let Some((_, first)) = boots.first() {
        out.push_str(&format!(
            "\nBoot storm estimate: {} VMs on {} (first trace phase as the boot; times mm:ss).\n",
            first.vms, first.storage
        ));
        out.push_str(&format!(
            "{:>20} {:>16} {:>10} {:>10} {:>10} {:>10}\n",
            "cache", "power-ons by", "min", "max", "avg", "peak IOPS"
        ));
        for (label, b) in boots {
            out.push_str(&format!(
                "{:>20} {:>16} {:>10} {:>10} {:>10} {:>10.0}\n",
                label,
                clock(b.power_on_s),
                clock(b.min_s),
                clock(b.max_s),
                clock(b.avg_s),
                b.peak_iops
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use overspill_block::trace::{Record, TraceHeader};

    /// A trace of 4 KiB writes over `mib` MiB, each block then read back.
    fn writes_then_reads(mib: u64) -> Trace {
        let header = TraceHeader { disk_bytes: 1 << 30, vm: "vm".into(), phases: vec!["boot".into()] };
        let blocks = mib * 256;
        let record =
            |i: u64, kind| Record { time_us: i, offset: (i % blocks) * 4096, length: 4096, kind, flags: 0, phase: 0 };
        let records = (0..blocks)
            .map(|i| record(i, GuestOp::Write))
            .chain((blocks..2 * blocks).map(|i| record(i, GuestOp::Read)));
        Trace { header, records: records.collect(), truncated_bytes: 0 }
    }

    fn options(mode: WriteCacheMode, ram: Vec<u64>) -> PlanOptions {
        PlanOptions { ram, mode, read_cache_bytes: 0, storage: None, vms: 1, boot_max: None }
    }

    /// A RAM size whose guests got errors (RAM full in `ram` mode) is said to have failed, first
    /// and in its row: its storage figures (none reach storage) would read as the best saving.
    #[test]
    fn a_ram_size_whose_guests_got_errors_is_shown_as_failed() {
        let trace = writes_then_reads(8);
        let report =
            plan(&[trace], vec!["t".into()], &options(WriteCacheMode::Ram, vec![1 << 20, 64 << 20])).expect("plan");
        assert!(report.rows[0].errors > 0 && report.rows[1].errors == 0, "1 MiB fails, 64 MiB holds the 8 MiB");
        let text = text(&report);
        assert!(text.starts_with("Plan for") && text.contains("FAILED at 1.0 MiB per VM"), "{text}");
        assert!(text.contains("1 MiB (FAILED)") && !text.contains("64 MiB (FAILED)"), "{text}");
        let page = html(&report).expect("html");
        assert!(page.contains("<p class=\"failed\">FAILED at 1.0 MiB") && page.contains("1 MiB (FAILED)"), "{page}");
    }

    /// Storage ops count every tier's reads and writes: a write-cache file's reads too.
    #[test]
    fn storage_ops_count_the_reads_of_every_tier() {
        let report =
            plan(&[writes_then_reads(1)], vec!["t".into()], &options(WriteCacheMode::Disk, vec![0])).expect("plan");
        let vm = &report.rows[0].vms[0];
        assert!(vm.cache_file_reads > 0 && vm.cache_file_writes > 0, "{vm:?}");
        assert_eq!(report.rows[0].storage_ops_per_vm, storage_ops(vm) as f64);
        assert_eq!(storage_ops(vm), vm.golden_reads + vm.cache_file_reads + vm.cache_file_writes);
    }

    #[test]
    fn the_lower_bound_counts_segments_of_what_ram_cannot_hold() {
        assert_eq!(spill_write_lower_bound(1000, 0), 2);
        assert_eq!(spill_write_lower_bound(1000, 1000 * 4096), 0);
    }
}
