//! The storm report as an HTML page: run metadata and any failed configuration at the top; then,
//! per phase, this run beside the seeds' published figures where they measured the same thing,
//! in their unit, then what reached the write caches' storage and the golden image's per VM;
//! then storage IOPS over each phase's own time axis; then the tables.
//! Charts are SVG (plotters); legends are HTML beside them, so they never cover data.

use std::fmt::Write as _;

use plotters::coord::combinators::IntoLogRange;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use overspill_engine::StorageTier;

use crate::driver::{tier_index, DIRECT, TIERS};
use crate::report::{
    duration_text, read_write_text, served_text, shown_rows, text_tables, ConfigReport, StormReport, TierRow,
};
use crate::seeds::{self, SeedRow};

/// The tiers behind the VMs, as indices into [`TIERS`], in the order the bars are drawn: the
/// write caches' storage first, the golden image's, then the guests' event-log disk.
const STORAGE_TIERS: [usize; 5] = [
    tier_index(StorageTier::Shared),
    tier_index(StorageTier::CacheFile),
    tier_index(StorageTier::Spill),
    tier_index(StorageTier::Golden),
    DIRECT,
];
const TIER_COLORS: [RGBColor; 5] = [
    RGBColor(214, 39, 40),
    RGBColor(255, 127, 14),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];
const SEED_COLOR: RGBColor = RGBColor(190, 190, 190);
const READ_COLOR: RGBColor = RGBColor(70, 130, 180);
const WRITE_COLOR: RGBColor = RGBColor(230, 150, 60);
/// The floor of the log axis: less than this per VM is drawn as nothing.
const Y_FLOOR: f64 = 0.001;

fn hex(color: RGBColor) -> String {
    format!("#{:02x}{:02x}{:02x}", color.0, color.1, color.2)
}

fn config_color(i: usize) -> RGBColor {
    let (r, g, b) = Palette99::pick(i).rgb();
    RGBColor(r, g, b)
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// IOPS per VM at each storage tier in phase `p`, in [`STORAGE_TIERS`] order.
fn storage_iops(config: &ConfigReport, p: usize) -> [f64; 5] {
    let phase = config.phases.get(p);
    STORAGE_TIERS.map(|t| {
        phase.and_then(|ph| ph.tiers.iter().find(|row| row.tier == TIERS[t])).map_or(0.0, |row| row.iops_per_vm)
    })
}

/// The MCS baseline the reductions are measured against.
fn baseline(report: &StormReport) -> Option<&ConfigReport> {
    report.configs.iter().find(|c| c.mode.as_deref() == Some("shared"))
}

/// The seeds' figure for a configuration in phase `p`, if the seeds measured one like it.
pub fn seed_figure(report: &StormReport, config: &ConfigReport, p: usize) -> Option<SeedRow> {
    let platform = report.seed_platform.as_deref()?;
    let phase = &report.phase_sources.get(p)?.0;
    seeds::figure_for(platform, config.mode.as_deref()?, config.ram_bytes, phase)
}

/// The change against the baseline, as printed on the bars: "-97%".
pub fn reduction_text(total: f64, base: f64) -> Option<String> {
    (base > 0.0).then(|| format!("{:+.0}%", (total / base - 1.0) * 100.0))
}

fn error(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The write caches' own storage, and the event-log disk beside them: what the seeds' PVS
/// figures measure (their cache disk held both).
const WRITE_SIDE: [usize; 4] = [0, 1, 2, 4];
/// The golden image's storage: PVS's vDisk streaming, which the seeds' cache figures leave out.
const GOLDEN_SIDE: [usize; 1] = [3];
/// Behind a configuration whose guests got errors, in every chart, and the page's banner.
const FAILED_COLOR: RGBColor = RGBColor(255, 215, 215);
/// This run's traffic where the seeds' figure stands beside it.
const HERE_COLOR: RGBColor = RGBColor(90, 90, 140);

/// Text for a bar's group: "FAILED" for a configuration whose guests got errors.
fn failed_label(config: &ConfigReport) -> Option<String> {
    config.failure().map(|_| {
        let errors: u64 = config.phases.iter().map(|p| p.errors).sum();
        format!("FAILED ({errors} errors)")
    })
}

/// A grouped bar chart on a log axis with the 1 IOPS (or I/O) per VM line: one group per
/// configuration, its bars `values(config)` in `colors`, a band behind the groups of failed
/// configurations, `label(config)` above each group and its name below.
fn grouped_bars(
    configs: &[&ConfigReport],
    colors: &[(RGBColor, bool)],
    values: impl Fn(&ConfigReport) -> Vec<Option<f64>>,
    label: impl Fn(&ConfigReport) -> String,
    y_desc: &str,
    line: &str,
) -> Result<String, String> {
    let groups = configs.len().max(1);
    let width = (170 * groups as u32 + 120).clamp(700, 1400);
    let top = configs.iter().flat_map(|c| values(c)).flatten().fold(1.0f64, f64::max) * 8.0;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, 340)).into_drawing_area();
        root.fill(&WHITE).map_err(error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            // Room right of the plot for the 1-per-VM line's label, clear of the groups' labels.
            .margin_right(96)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..groups as f64, (Y_FLOOR..top).log_scale())
            .map_err(error)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_desc(y_desc)
            .y_label_formatter(&|v| if *v >= 1.0 { format!("{v:.0}") } else { format!("{v}") })
            .draw()
            .map_err(error)?;
        let slot = 0.8 / colors.len() as f64;
        for (g, config) in configs.iter().enumerate() {
            if config.failure().is_some() {
                let band = Rectangle::new([(g as f64 + 0.02, Y_FLOOR), (g as f64 + 0.98, top)], FAILED_COLOR.filled());
                chart.draw_series([band]).map_err(error)?;
            }
            let x0 = g as f64 + 0.1;
            let bars = values(config);
            for (i, value) in bars.iter().enumerate() {
                let Some(value) = value.filter(|v| *v > Y_FLOOR) else { continue };
                let (a, b) = (x0 + slot * i as f64, x0 + slot * (i as f64 + 0.85));
                let (color, outlined) = colors[i];
                chart.draw_series([Rectangle::new([(a, Y_FLOOR), (b, value)], color.filled())]).map_err(error)?;
                if outlined {
                    chart
                        .draw_series([Rectangle::new([(a, Y_FLOOR), (b, value)], BLACK.stroke_width(1))])
                        .map_err(error)?;
                }
            }
            let above = bars.iter().flatten().fold(Y_FLOOR, |m, v| m.max(*v)) * 1.4;
            let centre = g as f64 + 0.5;
            let text = failed_label(config).unwrap_or_else(|| label(config));
            let style = ("sans-serif", 14).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Bottom));
            chart.draw_series([Text::new(text, (centre, above), style)]).map_err(error)?;
            // The configuration's name under its group, in the label area.
            let (x, y) = chart.backend_coord(&(centre, Y_FLOOR));
            let name_style = ("sans-serif", 14).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Top));
            root.draw(&Text::new(config.label.clone(), (x, y + 8), name_style)).map_err(error)?;
        }
        let one = [(0.0, 1.0), (groups as f64, 1.0)];
        chart.draw_series(DashedLineSeries::new(one, 6, 4, BLACK.stroke_width(1))).map_err(error)?;
        let style = ("sans-serif", 12).into_font().color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center));
        let (x, y) = chart.backend_coord(&(groups as f64, 1.0));
        root.draw(&Text::new(line.to_owned(), (x + 6, y), style)).map_err(error)?;
        root.present().map_err(error)?;
    }
    Ok(svg)
}

/// IOPS per VM of phase `p` at the storage tiers `tiers` (indices into [`STORAGE_TIERS`]); for
/// the write side, the change against `shared` above each group.
fn tier_bars(report: &StormReport, p: usize, tiers: &[usize]) -> Result<String, String> {
    let configs: Vec<&ConfigReport> = report.configs.iter().collect();
    let colors: Vec<(RGBColor, bool)> = tiers.iter().map(|&i| (TIER_COLORS[i], false)).collect();
    let sum = |config: &ConfigReport| -> f64 { tiers.iter().map(|&i| storage_iops(config, p)[i]).sum() };
    let base = baseline(report).filter(|b| b.failure().is_none()).map(sum);
    let write_side = tiers == WRITE_SIDE;
    grouped_bars(
        &configs,
        &colors,
        |config| tiers.iter().map(|&i| Some(storage_iops(config, p)[i])).collect(),
        |config| match (base, config.mode.as_deref()) {
            (_, Some("shared")) if write_side => "baseline (MCS)".to_owned(),
            (Some(base), _) if write_side => {
                reduction_text(sum(config), base).map_or_else(String::new, |r| format!("{r} vs shared"))
            }
            _ => String::new(),
        },
        "IOPS per VM (log scale)",
        "1 IOPS per VM",
    )
}

/// The seeds' figure of phase `p` beside this run's, like for like: for each configuration the
/// seeds measured, the same tiers ([`seed_tiers`]) counted as the seeds counted them, I/Os per VM
/// over the phase (totals: the seeds' windows and this run's differ): for `shared` the
/// operations themselves (MCS's storage took the guests' requests as they were, and so does
/// overspill's here), for a write cache in 4 KiB units (the seeds' caches wrote in place,
/// "mostly 4K"; overspill's 2 MiB segments would otherwise count 512 times less for the same
/// bytes). `None` if no configuration has a seed figure.
fn seed_bars(report: &StormReport, p: usize) -> Result<Option<String>, String> {
    let configs: Vec<&ConfigReport> = report.configs.iter().filter(|c| seed_figure(report, c, p).is_some()).collect();
    if configs.is_empty() {
        return Ok(None);
    }
    let colors = [(HERE_COLOR, false), (SEED_COLOR, true)];
    let here = |config: &ConfigReport| -> f64 {
        let Some(phase) = config.phases.get(p) else { return 0.0 };
        let tiers = seed_tiers(config);
        let rows: Vec<&TierRow> = phase.tiers.iter().filter(|r| tiers.contains(&r.tier.as_str())).collect();
        as_the_seeds_counted(config, &rows)
    };
    let svg = grouped_bars(
        &configs,
        &colors,
        |config| vec![Some(here(config)), seed_figure(report, config, p).map(|s| s.total_io_per_vm)],
        |config| match seed_figure(report, config, p) {
            Some(seed) if seed.total_io_per_vm > 0.0 => format!("{:.2}× the seed", here(config) / seed.total_io_per_vm),
            _ => String::new(),
        },
        "I/Os per VM in the phase (log scale)",
        "1 I/O per VM",
    )?;
    Ok(Some(svg))
}

/// I/Os per VM of `rows` (the tiers a seed figure of `config` measured) as the seeds counted
/// them: the event-log disk's and shared storage's requests as they are (they took the guests'
/// requests in place, as the seeds' did), a write cache's traffic in 4 KiB I/Os.
fn as_the_seeds_counted(config: &ConfigReport, rows: &[&TierRow]) -> f64 {
    let in_place = |r: &TierRow| r.tier == TIERS[DIRECT] || config.mode.as_deref() == Some("shared");
    rows.iter().map(|r| if in_place(r) { r.total_ops_per_vm } else { r.ios_4k_per_vm() }).sum()
}

/// The tiers (names in [`TIERS`]) a configuration's seed figure measured: for `shared` (MCS)
/// every tier, golden-image reads included, as on the seeds' shared storage; for a write cache
/// its own storage and the event-log disk (the seeds' cache disk held both), not the golden
/// image, which the seeds' PVS runs streamed from the PVS server.
fn seed_tiers(config: &ConfigReport) -> Vec<&'static str> {
    let shared = config.mode.as_deref() == Some("shared");
    STORAGE_TIERS.iter().filter(|&&t| shared || t != tier_index(StorageTier::Golden)).map(|&t| TIERS[t]).collect()
}

/// What a seed row is, for a caption: "seed 000, PVS RAM+overflow 256 MB, 11 VMs".
fn seed_row_text(seed: &SeedRow) -> String {
    match seed.provisioning.as_str() {
        "mcs" => format!("seed {}, MCS, {} VMs", seed.source, seed.vms),
        _ => format!("seed {}, PVS RAM with overflow {} MB, {} VMs", seed.source, seed.ram_cache_mb, seed.vms),
    }
}

/// Storage IOPS per VM over phase `p`'s window, one line per configuration, each over its own
/// window (real guests' phases start and last as long as each configuration's guests took).
fn phase_timeline(report: &StormReport, p: usize) -> Result<String, String> {
    let windows: Vec<Option<(f64, f64)>> = report.configs.iter().map(|c| c.phase_windows_s.get(p).copied()).collect();
    let Some(longest) = windows.iter().flatten().map(|&(start, end)| end - start).reduce(f64::max) else {
        return Ok(String::new());
    };
    let bucket = report.bucket_s as f64;
    let minutes = longest >= 300.0;
    let scale = if minutes { 60.0 } else { 1.0 };
    let series: Vec<Vec<(f64, f64)>> = report
        .configs
        .iter()
        .zip(&windows)
        .map(|(c, window)| {
            let Some(&(start, end)) = window.as_ref() else { return Vec::new() };
            c.timeline_iops_per_vm
                .iter()
                .enumerate()
                .map(|(b, tiers)| (b as f64 * bucket, STORAGE_TIERS.iter().map(|&t| tiers[t]).sum::<f64>()))
                .filter(|&(at, _)| at + bucket > start && at < end)
                .map(|(at, v)| ((at.max(start) - start) / scale, v))
                .collect()
        })
        .collect();
    let x_max = (longest / scale).max(1.0 / scale);
    let y_max = series.iter().flatten().map(|p| p.1).fold(0.0f64, f64::max).max(0.01) * 1.15;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 260)).into_drawing_area();
        root.fill(&WHITE).map_err(error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..x_max, 0f64..y_max)
            .map_err(error)?;
        chart
            .configure_mesh()
            .x_desc(if minutes { "minutes into the phase" } else { "seconds into the phase" })
            .y_desc("storage IOPS per VM")
            .draw()
            .map_err(error)?;
        for (i, points) in series.into_iter().enumerate() {
            chart.draw_series(LineSeries::new(points, config_color(i).stroke_width(2))).map_err(error)?;
        }
        root.present().map_err(error)?;
    }
    Ok(svg)
}

/// The storage tiers of phase `p` that saw operations, per configuration, each as one bar of its
/// read and write shares (100%): whether a tier is read or written matters more to its disks
/// than a second log-scale picture of the totals.
fn read_write_bars(report: &StormReport, p: usize) -> Result<String, String> {
    let mut rows: Vec<(String, f64, f64)> = Vec::new();
    for config in &report.configs {
        let Some(phase) = config.phases.get(p) else { continue };
        for &t in &STORAGE_TIERS {
            if let Some(row) = phase.tiers.iter().find(|r| r.tier == TIERS[t] && r.total_ops_per_vm > 0.0) {
                let label = format!("{} · {} ({} IOPS/VM)", shown_label(config), row.tier, compact(row.iops_per_vm));
                rows.push((label, row.read_iops_per_vm, row.write_iops_per_vm));
            }
        }
    }
    if rows.is_empty() {
        return Ok(String::new());
    }
    let height = 70 + 26 * rows.len() as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, height)).into_drawing_area();
        root.fill(&WHITE).map_err(error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(330)
            .margin_right(30)
            .build_cartesian_2d(0f64..100f64, (0..rows.len()).into_segmented())
            .map_err(error)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(rows.len())
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => rows.get(*i).map_or_else(String::new, |r| r.0.clone()),
                _ => String::new(),
            })
            .x_desc("% of the tier's operations: reads, then writes")
            .x_label_formatter(&|v| format!("{v:.0}"))
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 13))
            .draw()
            .map_err(error)?;
        for (i, (_, reads, writes)) in rows.iter().enumerate() {
            let total = reads + writes;
            let read_pct = 100.0 * reads / total;
            let bar = |a: f64, b: f64, color: RGBColor| {
                Rectangle::new([(a, SegmentValue::Exact(i)), (b, SegmentValue::Exact(i + 1))], color.filled())
            };
            chart.draw_series([bar(0.0, read_pct, READ_COLOR), bar(read_pct, 100.0, WRITE_COLOR)]).map_err(error)?;
        }
        root.present().map_err(error)?;
    }
    Ok(svg)
}

fn compact(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.0}")
    } else if v >= 0.1 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// What the seeds measured beside what reached the same kind of storage here, in both units:
/// overspill's own operations, and its I/Os as the seeds counted them (the chart's bars: a
/// write cache's traffic in 4 KiB operations as the seeds' in-place caches would have issued
/// it, the event-log disk's and shared storage's requests as they are). For `shared` (MCS) every tier counts, golden-image reads
/// included, as in the seeds' MCS figures; for the write caches only their own storage, since
/// the seeds' PVS runs streamed the golden image from the PVS server's RAM.
fn seeds_table(report: &StormReport) -> String {
    let mut out = String::from(
        "<table><tr><th>phase</th><th>configuration</th><th>tiers compared</th><th>operations per VM here</th>\
         <th>as the seeds counted</th><th>seeds' I/Os per VM</th><th>IOPS/VM here</th><th>seeds' IOPS/VM</th>\
         <th>seed row</th><th>the model and this row</th></tr>",
    );
    let mut any = false;
    for (p, (phase, _)) in report.phase_sources.iter().enumerate() {
        for config in &report.configs {
            let (Some(seed), Some(ph)) = (seed_figure(report, config, p), config.phases.get(p)) else { continue };
            let compared = seed_tiers(config);
            let rows: Vec<_> = ph.tiers.iter().filter(|r| compared.contains(&r.tier.as_str())).collect();
            let ops: f64 = rows.iter().map(|r| r.total_ops_per_vm).sum();
            let iops: f64 = rows.iter().map(|r| r.iops_per_vm).sum();
            let counted = as_the_seeds_counted(config, &rows);
            let names = compared;
            any = true;
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td>{}</td><td>{}</td></tr>",
                html_escape(phase),
                html_escape(&config.label),
                names.join(", "),
                compact(ops),
                compact(counted),
                compact(seed.total_io_per_vm),
                compact(iops),
                compact(seed.iops_per_vm),
                html_escape(&format!(
                    "seed {}, {}, {}, {} MB, {} VMs",
                    seed.source, seed.platform, seed.provisioning, seed.ram_cache_mb, seed.vms
                )),
                html_escape(seed.role()),
            );
        }
    }
    out.push_str("</table>");
    if any {
        out
    } else {
        String::new()
    }
}

/// Real guests: how many VMs of each configuration had booted, over seconds since its storm
/// started, as a step curve per configuration; `None` without boot times.
fn boot_curve(report: &StormReport) -> Result<Option<String>, String> {
    if report.configs.iter().all(|c| c.booted_at_s.is_none()) {
        return Ok(None);
    }
    let curves: Vec<Vec<(f64, f64)>> = report
        .configs
        .iter()
        .map(|c| {
            let mut times: Vec<f64> = c.booted_at_s.iter().flatten().flatten().copied().collect();
            times.sort_by(f64::total_cmp);
            let mut points = vec![(0.0, 0.0)];
            for (n, &t) in times.iter().enumerate() {
                points.extend([(t, n as f64), (t, n as f64 + 1.0)]);
            }
            points
        })
        .collect();
    let x_max = curves.iter().flatten().map(|p| p.0).fold(1.0f64, f64::max) * 1.1;
    let vms = report.configs.iter().map(|c| c.vms).max().unwrap_or(1).max(1);
    let y_max = vms as f64;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 300)).into_drawing_area();
        root.fill(&WHITE).map_err(error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_max, 0f64..y_max * 1.05)
            .map_err(error)?;
        chart
            .configure_mesh()
            .x_desc("seconds since the storm started")
            .y_desc("VMs booted")
            .y_labels((vms + 1).min(11))
            // VMs come whole: no label between two counts.
            .y_label_formatter(&|v| if v.fract() == 0.0 { format!("{v:.0}") } else { String::new() })
            .draw()
            .map_err(error)?;
        for (i, mut points) in curves.into_iter().enumerate() {
            // The curve goes on flat to the right edge: no more VMs booted.
            let last = points.last().map_or(0.0, |p| p.1);
            points.push((x_max, last));
            chart.draw_series(LineSeries::new(points, config_color(i).stroke_width(2))).map_err(error)?;
        }
        root.present().map_err(error)?;
    }
    Ok(Some(svg))
}

/// A configuration's name as charts without room for a band show it: marked when it failed.
fn shown_label(config: &ConfigReport) -> String {
    match config.failure() {
        Some(_) => format!("{} (FAILED)", config.label),
        None => config.label.clone(),
    }
}

/// The configurations that failed, at the top of the page, before any figure.
fn failures_banner(report: &StormReport) -> String {
    let failed: Vec<String> = report
        .configs
        .iter()
        .filter_map(|c| Some(format!("<li><b>{}</b>: {}</li>", html_escape(&c.label), html_escape(&c.failure()?))))
        .collect();
    if failed.is_empty() {
        return String::new();
    }
    format!(
        "<div class=\"failed\"><b>Failed configurations</b>: their guests got errors, so their figures \
         say what they did before failing, not what the configuration costs.<ul>{}</ul></div>",
        failed.concat()
    )
}

fn legend(items: &[(String, RGBColor, bool)]) -> String {
    let mut out = String::from("<div class=\"legend\">");
    for (name, color, outlined) in items {
        let border = if *outlined { "border:1px solid #000;" } else { "" };
        let _ = write!(
            out,
            "<span class=\"sw\" style=\"background:{};{border}\"></span>{}",
            hex(*color),
            html_escape(name)
        );
    }
    out.push_str("</div>");
    out
}

fn metadata(report: &StormReport) -> String {
    let run = &report.run;
    let pacing = match report.paced {
        None => "requests back to back; IOPS over the profile's real durations".to_owned(),
        Some(speed) => format!("paced at {speed}× real time"),
    };
    let rows = [
        ("workload", format!("{}: {}", report.workload, report.description)),
        (
            "VMs",
            format!(
                "{}, boots every {} s, logons every {} s",
                report.vms, report.boot_interval_s, report.logon_interval_s
            ),
        ),
        ("pacing", pacing),
        ("seeds' platform", report.seed_platform.clone().unwrap_or_else(|| "none (no seed figures drawn)".into())),
        ("overspill", format!("{} ({})", run.version, run.commit.as_deref().unwrap_or("commit unknown"))),
        ("command", run.command.clone()),
        ("machine", run.machine.clone()),
        ("date", run.date.clone()),
    ];
    let mut out = String::from("<table class=\"meta\">");
    for (key, value) in rows {
        let _ = write!(out, "<tr><th>{key}</th><td>{}</td></tr>", html_escape(&value));
    }
    out.push_str("</table>");
    out
}

/// The seeds' table for one phase as HTML: a row per configuration and tier, and the seeds'
/// figure under each configuration it exists for.
fn phase_table(report: &StormReport, p: usize) -> String {
    let mut out = String::from(
        "<table><tr><th>configuration</th><th>tier</th><th>VMs</th><th>duration</th><th>IO ops / VM</th>\
         <th>IOPS / VM</th><th>read</th><th>write</th><th>read/write</th><th>p95 IOPS / VM</th></tr>",
    );
    for config in &report.configs {
        let Some(phase) = config.phases.get(p) else { continue };
        for row in shown_rows(config, phase) {
            let ratio = read_write_text(row);
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.0}</td><td>{:.3}</td><td>{:.3}</td>\
                 <td>{:.3}</td><td>{ratio}</td><td>{:.3}</td></tr>",
                html_escape(&config.label),
                html_escape(&row.tier),
                phase.vms,
                duration_text(phase.duration_s),
                row.total_ops_per_vm,
                row.iops_per_vm,
                row.read_iops_per_vm,
                row.write_iops_per_vm,
                row.p95_iops_per_vm
            );
        }
        if let Some(seed) = seed_figure(report, config, p) {
            let _ = write!(
                out,
                "<tr class=\"seed\"><td>{}</td><td>seed {} figure ({}, {} MB, {} VMs)</td><td>{}</td><td></td><td></td>\
                 <td>{}</td><td>{}</td><td>{}</td><td></td><td></td></tr>",
                html_escape(&config.label),
                seed.source,
                seed.provisioning,
                seed.ram_cache_mb,
                seed.vms,
                seed.vms,
                seed.iops_per_vm,
                seed.read_iops_per_vm,
                seed.write_iops_per_vm
            );
        }
        if phase.errors > 0 {
            let _ = write!(
                out,
                "<tr><td>{}</td><td colspan=\"9\">{} errors ({} ENOSPC)</td></tr>",
                html_escape(&config.label),
                phase.errors,
                phase.enospc
            );
        }
    }
    out.push_str("</table>");
    out
}

fn config_table(report: &StormReport) -> String {
    let mut out = String::from(
        "<table><tr><th>configuration</th><th>spill segments</th><th>peak spill / VM</th><th>peak RAM / VM</th>\
         <th>guest reads served by</th><th>wall time</th></tr>",
    );
    for c in &report.configs {
        let served = served_text(c).unwrap_or_else(|| "-".into());
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{:.1} MiB</td><td>{:.1} MiB</td><td>{served}</td><td>{:.1} s</td></tr>",
            html_escape(&c.label),
            c.spill_segments_written,
            c.peak_spill_bytes_max_vm as f64 / (1 << 20) as f64,
            c.peak_cache_memory_bytes_max_vm as f64 / (1 << 20) as f64,
            c.wall_s
        );
        if let Some(boot) = c.boot_text() {
            let _ = write!(out, "<tr><td>{}</td><td colspan=\"5\">{boot}</td></tr>", html_escape(&c.label));
        }
        for failure in &c.failed_vms {
            let _ = write!(
                out,
                "<tr><td>{}</td><td colspan=\"5\">failed: {}</td></tr>",
                html_escape(&c.label),
                html_escape(failure)
            );
        }
    }
    out.push_str("</table>");
    out
}

const STYLE: &str = "body{font-family:sans-serif;margin:2em;max-width:1400px;color:#222}\
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}\
td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}\
th{background:#f2f2f2}td:first-child,td:nth-child(2),th{text-align:left}\
table.meta td{text-align:left}tr.seed td{background:#f4f4f4;font-style:italic}\
.legend{margin:.3em 0 1.5em;font-size:13px}\
.legend .sw{display:inline-block;width:12px;height:12px;margin:0 5px 0 16px;vertical-align:middle}\
svg{display:block}\
div.failed{background:#ffd7d7;border:2px solid #c00;padding:.5em 1em;margin:1em 0}";

pub fn html(report: &StormReport) -> Result<String, String> {
    let mut out = String::new();
    let title = html_escape(&report.workload);
    let _ = write!(
        out,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>overspill storm: {title}</title>\
         <style>{STYLE}</style></head><body><h1>overspill storm: {title}</h1>{}",
        metadata(report)
    );
    out.push_str(&failures_banner(report));
    let _ = write!(
        out,
        "<h2>What reaches storage, per VM</h2><p>Per phase: first, where the seeds measured a \
         configuration like one here (<code>shared</code> against MCS, <code>ram+disk</code> \
         against PVS RAM cache with overflow to disk), this run's traffic at the storage the \
         seeds' figure covers beside it, both counted as the seeds counted them (I/Os per VM over \
         the phase: for <code>shared</code> the requests themselves, for a write cache in 4 KiB \
         units, as the seeds' caches wrote in place; grey outlined bars are the seeds' published \
         figures, not measured here). Then \
         IOPS per VM at the write caches' own storage, with the change against \
         <code>shared</code> (the MCS baseline) above each group, and last the golden image's \
         storage (PVS's vDisk streaming, which the seeds' cache figures leave out). Log scales; \
         the dashed line is 1 per VM. A configuration whose guests got errors is marked FAILED \
         on a red band: its figures are not results.</p>"
    );
    let tier_legend = |tiers: &[usize]| -> Vec<(String, RGBColor, bool)> {
        tiers.iter().map(|&i| (TIERS[STORAGE_TIERS[i]].to_owned(), TIER_COLORS[i], false)).collect()
    };
    let seed_legend =
        [("this run, same tiers".to_owned(), HERE_COLOR, false), ("seeds' figure".to_owned(), SEED_COLOR, true)];
    for (p, (phase, source)) in report.phase_sources.iter().enumerate() {
        // Real guests' phases last as long as each configuration's took.
        let durations: Vec<f64> =
            report.configs.iter().filter_map(|c| c.phases.get(p)).map(|ph| ph.duration_s).collect();
        let (shortest, longest) = durations.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &d| (lo.min(d), hi.max(d)));
        let duration = if longest - shortest >= 1.0 {
            format!("{} to {}", duration_text(shortest), duration_text(longest))
        } else {
            duration_text(longest)
        };
        let _ = write!(
            out,
            "<h3>{} ({duration})</h3><p class=\"source\">profile: {}</p>",
            html_escape(phase),
            html_escape(source)
        );
        if let Some(svg) = seed_bars(report, p)? {
            let rows: Vec<String> = report
                .configs
                .iter()
                .filter_map(|c| {
                    let seed = seed_figure(report, c, p)?;
                    let tiers = seed_tiers(c);
                    let nearest = match (c.ram_bytes, seed.provisioning.as_str()) {
                        (Some(ram), "pvs-ram-overflow") if ram / (1 << 20) != seed.ram_cache_mb => {
                            " (the seeds' nearest RAM size, not this one)"
                        }
                        _ => "",
                    };
                    Some(format!(
                        "<code>{}</code>: {} against {}{nearest}",
                        html_escape(&c.label),
                        tiers.join(" + "),
                        html_escape(&seed_row_text(&seed))
                    ))
                })
                .collect();
            let _ = write!(
                out,
                "<h4>Against the seeds, like for like</h4>{svg}{}<p class=\"source\">{}</p>",
                legend(&seed_legend),
                rows.join("; ")
            );
        }
        let _ = write!(
            out,
            "<h4>The write caches' storage</h4>{}{}<h4>The golden image's storage</h4>{}{}",
            tier_bars(report, p, &WRITE_SIDE)?,
            legend(&tier_legend(&WRITE_SIDE)),
            tier_bars(report, p, &GOLDEN_SIDE)?,
            legend(&tier_legend(&GOLDEN_SIDE))
        );
    }
    let seeds = seeds_table(report);
    if !seeds.is_empty() {
        let _ = write!(
            out,
            "<h2>Against the seeds, in both units</h2><p>The seeds counted operations at caches that \
             wrote in place, mostly 4 KiB at a time; overspill spills whole 2 MiB segments, so its \
             own operation count is far lower for the same overflow. The 4 KiB column counts the \
             same bytes as the seeds' caches would have issued them: it says whether the model \
             overflows as the seeds' guests did; the operations and IOPS columns say what overspill \
             asks of its disks. Totals per VM compare across runs; IOPS depend on each run's phase \
             window (how many VMs log on, how far apart).</p>{seeds}"
        );
    }
    out.push_str("<h2>Reads and writes at each storage tier</h2>");
    let rw_legend = [("reads".to_owned(), READ_COLOR, false), ("writes".to_owned(), WRITE_COLOR, false)];
    for (p, (phase, _)) in report.phase_sources.iter().enumerate() {
        let _ = write!(out, "<h3>{}</h3>{}{}", html_escape(phase), read_write_bars(report, p)?, legend(&rw_legend));
    }
    let config_legend: Vec<(String, RGBColor, bool)> =
        report.configs.iter().enumerate().map(|(i, c)| (shown_label(c), config_color(i), false)).collect();
    if let Some(svg) = boot_curve(report)? {
        let paced = report.configs.iter().any(|c| c.label.contains(", boot-max "));
        let _ = write!(
            out,
            "<h2>VMs booted over time</h2><p>Each step is a VM done booting (a real guest printing its \
             \"booted\" marker; a synthetic VM ending its workload's first phase), in seconds since \
             the configuration's storm started.{}</p>{svg}{}",
            if paced {
                " Configurations marked \"boot-max N\" ran with at most N VMs booting at once (serve \
                 --boot-max): a VM's first request waited for a slot."
            } else {
                ""
            },
            legend(&config_legend)
        );
    }
    out.push_str("<h2>Storage IOPS per VM over each phase</h2>");
    for (p, (phase, _)) in report.phase_sources.iter().enumerate() {
        let _ = write!(out, "<h3>{}</h3>{}{}", html_escape(phase), phase_timeline(report, p)?, legend(&config_legend));
    }
    out.push_str("<h2>Tables</h2>");
    for (p, (phase, _)) in report.phase_sources.iter().enumerate() {
        let _ = write!(out, "<h3>{}</h3>{}", html_escape(phase), phase_table(report, p));
    }
    let _ = write!(out, "<h2>Per configuration</h2>{}", config_table(report));
    let _ = write!(
        out,
        "<details><summary>The same tables as text</summary><pre>{}</pre></details></body></html>",
        html_escape(&text_tables(report))
    );
    Ok(out)
}
