//! The built-in profiles and the storage model against the seeds' published figures
//! (`data/seed-iops.csv`, a copy of the project's calibration data with its README, so that a
//! clone alone passes its tests).
//!
//! The first three tests are **generator checks, not calibration**: each profile was sized from
//! the very figures they compare with (win7-vdi's `ios` and `read_fraction` are the means of
//! seed 000's MCS rows; linux-boot's counts and size weights, the bloated profile's write sizes,
//! were chosen for those totals), so they hold by construction. They catch a generator that
//! stops drawing what its profile says. The fourth checks what the generator draws against a
//! figure from outside the seeds, held out (the volume of a Windows 7 boot). The model tests
//! below them compare the engine's output with seed figures it was not sized on (or say which
//! figure a parameter was fitted on).

mod common;

use common::Held;
use overspill_block::GuestOp;
use overspill_storm::profile::{Area, Op, Workload};

fn calibration_rows() -> Vec<Vec<String>> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/seed-iops.csv");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with("source,"))
        .map(|l| l.split(',').map(str::to_owned).collect())
        .collect()
}

fn within(what: &str, got: f64, want: f64) {
    assert!((got - want).abs() <= 0.10 * want, "{what}: generated {got:.1}, the seeds say {want:.1} (±10%)");
}

struct Tally {
    reads: f64,
    writes: f64,
    read_bytes: f64,
    write_bytes: f64,
    small_reads: f64,
    flushes: f64,
}

/// Mean per VM over `vms` VMs of one phase.
fn tally(workload: &Workload, phase: usize, vms: u64) -> Tally {
    let mut t = Tally { reads: 0.0, writes: 0.0, read_bytes: 0.0, write_bytes: 0.0, small_reads: 0.0, flushes: 0.0 };
    for vm in 0..vms {
        let ops: Vec<Op> = workload.generate(7, vm).swap_remove(phase);
        for op in ops {
            match op.kind {
                GuestOp::Read => {
                    t.reads += 1.0;
                    t.read_bytes += f64::from(op.len);
                    if op.len <= 4096 {
                        t.small_reads += 1.0;
                    }
                }
                GuestOp::Write => {
                    t.writes += 1.0;
                    t.write_bytes += f64::from(op.len);
                }
                GuestOp::Flush => t.flushes += 1.0,
                GuestOp::Trim | GuestOp::Zero => {}
            }
        }
    }
    let n = vms as f64;
    Tally {
        reads: t.reads / n,
        writes: t.writes / n,
        read_bytes: t.read_bytes / n,
        write_bytes: t.write_bytes / n,
        small_reads: t.small_reads / n,
        flushes: t.flushes / n,
    }
}

/// Generator check (by construction, see the top): win7-vdi draws its profile's counts.
#[test]
fn generator_draws_win7_vdi_as_sized_on_seed_000s_mcs_rows() {
    let rows = calibration_rows();
    let workload = Workload::built_in("win7-vdi").expect("built in");
    for (p, phase) in workload.phases.iter().enumerate() {
        // Columns: source, platform, provisioning, ram_cache_mb, phase, vms, users, duration_s,
        // total_io_per_vm, iops_per_vm, read_iops_per_vm, write_iops_per_vm, read_pct.
        let seed: Vec<&Vec<String>> =
            rows.iter().filter(|r| r[2] == "mcs" && r[1] == "win7-hyperv-sata7200" && r[4] == phase.name).collect();
        assert!(!seed.is_empty(), "seed rows for {}", phase.name);
        let mean =
            |col: usize| seed.iter().map(|r| r[col].parse::<f64>().expect("number")).sum::<f64>() / seed.len() as f64;
        let t = tally(&workload, p, 5);
        within(&format!("{} IOs per VM", phase.name), t.reads + t.writes, mean(8));
        within(&format!("{} read %", phase.name), 100.0 * t.reads / (t.reads + t.writes), mean(12));
    }
}

/// Generator check (by construction): the bloated profile's logon writes total what its sizes
/// were chosen for.
#[test]
fn generator_draws_the_bloated_logon_as_sized_about_270_mb() {
    let workload = Workload::built_in("win7-vdi-bloated-profile").expect("built in");
    let logon = workload.phases.iter().position(|p| p.name == "logon").expect("logon phase");
    let t = tally(&workload, logon, 10);
    within("bloated logon bytes written per user", t.write_bytes, 270e6);
    assert!(t.write_bytes > 256.0 * 1048576.0, "overruns a 256 MB cache");
}

/// Generator check (by construction): linux-boot draws the counts and sizes it was given.
#[test]
fn generator_draws_linux_boot_as_sized() {
    let workload = Workload::built_in("linux-boot").expect("built in");
    let t = tally(&workload, 0, 20);
    within("reads", t.reads, 2800.0);
    within("average read KiB", t.read_bytes / t.reads / 1024.0, 29.0);
    within("reads of 4 KiB or less, %", 100.0 * t.small_reads / t.reads, 57.0);
    within("MiB read", t.read_bytes / 1048576.0, 80.0);
    within("writes", t.writes, 100.0);
    within("MiB written", t.write_bytes / 1048576.0, 8.5);
    within("flushes", t.flushes, 30.0);
}

/// Held out, loosely: the volume a Windows boot moves. The boot's request sizes have no source
/// (the one public trace is a laptop's, docs/planning.md), but ThinIO, a VDI vendor (its
/// RAM-caching filter driver; "ThinIO facts and figures, Part 2: The Bootstorm chestnut", 2014,
/// a blog post that gives no method) found "a typical windows 7 boot" to the logon screen, idle
/// until every service started, reads "500-600 mb" and writes "between 20 and 30mb". What the
/// generator draws for a boot (the profile's sizes, seed 000's request counts: another lab's
/// image; ThinIO counted ~70,000 requests, ~8 KB each) must come within 1.5× of that range,
/// either way; a boot of 4 KiB requests only would read a sixth of it and fail.
const VDI_BOOT_READ_MB: (f64, f64) = (500.0, 600.0);
const VDI_BOOT_WRITTEN_MB: (f64, f64) = (20.0, 30.0);
const VDI_BOOT_FACTOR: f64 = 1.5;

/// MB read and written per VM by a workload's boot.
fn boot_volume_mb(workload: &Workload) -> (f64, f64) {
    let boot = workload.phases.iter().position(|p| p.name == "boot").expect("boot phase");
    let t = tally(workload, boot, 5);
    (t.read_bytes / 1e6, t.write_bytes / 1e6)
}

/// The measured range widened by the tolerance, and its middle.
fn vdi_boot_held((low, high): (f64, f64)) -> (f64, (f64, f64)) {
    ((low + high) / 2.0, (low / VDI_BOOT_FACTOR, high * VDI_BOOT_FACTOR))
}

#[test]
fn win7_boot_moves_about_the_volume_a_measured_vdi_boot_moves() {
    let workload = Workload::built_in("win7-vdi").expect("built in");
    let (read_mb, written_mb) = boot_volume_mb(&workload);
    let ((read_mid, read_held), (written_mid, written_held)) =
        (vdi_boot_held(VDI_BOOT_READ_MB), vdi_boot_held(VDI_BOOT_WRITTEN_MB));
    // What the profile states, beside what the generator draws: its mean sizes times its counts.
    let boot = workload.phases.iter().find(|p| p.name == "boot").expect("boot phase");
    let mean = |sizes: &[(u32, f64)]| {
        sizes.iter().map(|&(size, weight)| f64::from(size) * weight).sum::<f64>()
            / sizes.iter().map(|&(_, weight)| weight).sum::<f64>()
    };
    let ios = boot.ios as f64;
    let nominal_read = ios * boot.read_fraction * mean(&boot.read_sizes) / 1e6;
    let nominal_written = ios * (1.0 - boot.read_fraction) * mean(&boot.write_sizes) / 1e6;
    println!(
        "win7-vdi boot per VM: {read_mb:.0} MB read ({:.2}× of {read_mid}), {written_mb:.1} MB written ({:.2}× of {written_mid}); the profile's means times its counts: {nominal_read:.0} and {nominal_written:.1} MB",
        read_mb / read_mid,
        written_mb / written_mid
    );
    assert!(holds(read_held, read_mb), "boot reads {read_mb:.0} MB; measured {VDI_BOOT_READ_MB:?} MB");
    assert!(holds(written_held, written_mb), "boot writes {written_mb:.1} MB; measured {VDI_BOOT_WRITTEN_MB:?} MB");
}

/// How a boot's reads fall on the disk: MiB read and distinct MiB, the share of the 4 KiB
/// blocks read that an earlier read of the boot had read, and the 16 KiB and 256 KiB chunks
/// touched over the distinct bytes, as `scripts/windows-trace-figures` counts them for a trace.
fn read_locality(ops: &[Op]) -> [f64; 5] {
    use std::collections::HashSet;
    let (mut bytes, mut blocks, mut before) = (0u64, 0u64, 0u64);
    let mut read = HashSet::new();
    let mut chunks = [(16u64 << 10, HashSet::new()), (256 << 10, HashSet::new())];
    for op in ops.iter().filter(|op| op.kind == GuestOp::Read) {
        let end = op.offset + u64::from(op.len).max(1) - 1;
        bytes += u64::from(op.len);
        for block in op.offset / 4096..=end / 4096 {
            blocks += 1;
            before += u64::from(!read.insert(block));
        }
        for (size, touched) in &mut chunks {
            touched.extend(op.offset / *size..=end / *size);
        }
    }
    // A phase without reads reads nothing: no division by zero.
    let (distinct, blocks) = ((read.len().max(1) * 4096) as f64, blocks.max(1) as f64);
    let spread = |(size, touched): &(u64, HashSet<u64>)| touched.len() as f64 * *size as f64 / distinct;
    let mib = MIB as f64;
    [bytes as f64 / mib, distinct / mib, before as f64 / blocks, spread(&chunks[0]), spread(&chunks[1])]
}

/// A study, not a check (docs/planning.md, the system region): how `win7-vdi`'s boot reads
/// fall on its disk with its 1.5 GiB system region and with larger ones, beside what
/// `scripts/windows-trace-figures` counts for the Windows trace's boot. Prints a markdown table.
#[test]
#[ignore = "a study: cargo test --release -p overspill-storm --test calibration boot_read_locality -- --ignored --nocapture"]
fn study_boot_read_locality_against_the_windows_trace() {
    println!("| system region | MiB read (distinct) | blocks read before | 16 / 256 KiB chunks over distinct |");
    println!("| --- | --- | --- | --- |");
    for system_mib in [1536, 3072, 6144] {
        let mut w = Workload::built_in("win7-vdi").expect("built in");
        common::grow_system_region(&mut w, system_mib);
        let boot = w.phases.iter().position(|p| p.name == "boot").expect("boot phase");
        let [read, distinct, before, spread16, spread256] = read_locality(&w.generate(7, 0)[boot]);
        println!(
            "| {:.1} GiB | {read:.1} ({distinct:.1} distinct) | {before:.3} | {spread16:.2} / {spread256:.2} |",
            system_mib as f64 / 1024.0
        );
    }
}

// What reaches storage, through the engine itself (`model`: the overlays `serve` runs, with
// in-memory files), against the seeds' storage-side figures.

use overspill_engine::{StorageTier, VmStats, WriteCacheMode};
use overspill_storm::driver::{RunPlan, DIRECT, TIERS};
use overspill_storm::model::{simulate, simulate_observed, ModelConfig};
use overspill_storm::report::{config_report, ConfigReport, TierRow};
use overspill_storm::StormConfig;

const MIB: u64 = 1 << 20;

// How close each held figure must come, read by its test and by the sensitivity study alike.
// A factor `f` holds a figure within `seed / f ..= seed * f`; points within `seed ± p`.
/// Seed 000's PVS 256 MB rows: boot fitted (10%), logon and steady held out.
const PVS_256_FACTORS: [(&str, f64); 3] = [("boot", 1.1), ("logon", 2.0), ("steady", 2.0)];
/// Seed 000's bloated-profile rows, logon and steady.
const BLOATED_FACTOR: f64 = 1.5;
/// Seed 001's Windows 10 figure (% of MCS's writes), by proxy.
const WIN10_PCT: f64 = 1.49;
const WIN10_FACTOR: f64 = 3.0;
/// Seed 002: PVS with its cache on disk against MCS at the logon storm, "just over half".
const SEED_002_DISK_SHARE: (f64, f64) = (0.45, 0.65);
/// Seed 001 at 4 GB: the base image's reads, ~7% of MCS's operations (fitted there).
const SWEEP_4GB_LEFT_PCT: f64 = 7.0;
const SWEEP_4GB_POINTS: f64 = 3.0;
/// Seed 001's other sweep rows, in percentage points.
const SWEEP_POINTS: f64 = 15.0;
/// Seed 000's XenApp 12 GB rows.
const XENAPP_12GB_FACTOR: f64 = 1.5;
/// The read share of seed 000's event-log disk (its `read_pct`), in percentage points.
const EVENT_LOG_READ_POINTS: f64 = 10.0;
/// Dell's Table 7: steady state's read share, the source of `read_own` there, within a factor
/// (boot's and logon's are upper bounds); the steady write size within a factor.
const DELL_STEADY_READ_FACTOR: f64 = 2.0;
const DELL_WRITE_SIZE_FACTOR: f64 = 1.5;

fn factor_range(seed: f64, factor: f64) -> (f64, f64) {
    (seed / factor, seed * factor)
}

fn holds((low, high): (f64, f64), figure: f64) -> bool {
    (low..=high).contains(&figure)
}

/// `vms` VMs of `workload` (boots together, a logon every 30 s as in seed 001) through one
/// write-cache configuration with the default 1 GiB shared read cache.
fn model_run(workload: &str, vms: usize, mode: WriteCacheMode, ram: u64) -> ConfigReport {
    model_run_with(workload, vms, mode, ram, 1 << 30)
}

/// As [`model_run`], with a read cache of `read_cache` bytes (0: none, as MCS had).
fn model_run_with(workload: &str, vms: usize, mode: WriteCacheMode, ram: u64, read_cache: u64) -> ConfigReport {
    model_run_of(&Workload::built_in(workload).expect("built in"), vms, mode, ram, read_cache)
}

fn model_run_of(workload: &Workload, vms: usize, mode: WriteCacheMode, ram: u64, read_cache: u64) -> ConfigReport {
    model_run_observed(workload, vms, mode, ram, read_cache, |_, _, _| {})
}

/// [`model_run_of`], calling `observe(vm, phase, stats)` after each request with the VM's
/// engine counters as they stand then (see [`simulate_observed`]).
fn model_run_observed(
    workload: &Workload,
    vms: usize,
    mode: WriteCacheMode,
    ram: u64,
    read_cache: u64,
    mut observe: impl FnMut(usize, usize, &VmStats),
) -> ConfigReport {
    let config =
        StormConfig { vms, boot_interval_s: 0.0, logon_interval_s: 30.0, speed: None, workload_seed: 1, bucket_s: 60 };
    let plan = RunPlan::from_workload(workload, &config);
    let model = ModelConfig { mode, ram_bytes: ram, read_cache_bytes: read_cache, bucket_s: config.bucket_s };
    let results = simulate_observed(&plan, &model, |vm, phase, _, stats| observe(vm, phase, stats)).expect("model");
    let report = config_report(&format!("{mode} {}M", ram / MIB), &plan, &config, &results, 0.0);
    assert!(report.failed_vms.is_empty(), "{:?}", report.failed_vms);
    report
}

/// A `ram+disk` run of `ram` bytes (1 GiB read cache) and, per phase in the workload's order,
/// what of its spill traffic per VM is overspill's own compaction, in 4 KiB units: the windows
/// it read (all spill reads but the guest's own blocks, a lower bound: a guest block read from
/// the segment still in memory counts as the guest's without reaching the file) and the live
/// blocks it moved into new segments.
fn model_run_with_compaction(workload: &Workload, vms: usize, ram: u64) -> (ConfigReport, Vec<(f64, f64)>) {
    let counters = |s: &VmStats| {
        [s.spill_read.bytes.get() / 4096, s.read_blocks_spill.get(), s.compaction_bytes_moved.get() / 4096]
    };
    let mut last = vec![[0u64; 3]; vms];
    let mut per_phase = vec![[0u64; 3]; workload.phases.len()];
    let run = model_run_observed(workload, vms, WriteCacheMode::RamDisk, ram, 1 << 30, |vm, phase, stats| {
        let now = counters(stats);
        for (sum, (now, before)) in per_phase[phase].iter_mut().zip(now.iter().zip(last[vm])) {
            *sum += now - before;
        }
        last[vm] = now;
    });
    let n = vms as f64;
    let compaction =
        per_phase.into_iter().map(|[read, guest, moved]| (read.saturating_sub(guest) as f64 / n, moved as f64 / n));
    (run, compaction.collect())
}

fn tier<'a>(report: &'a ConfigReport, phase: &str, tier: StorageTier) -> &'a TierRow {
    tier_named(report, phase, tier.title()).expect("tier row")
}

/// A phase's row of the tier titled `name`, if the run reached it (the event-log disk's,
/// `TIERS[DIRECT]`, only where a workload has event logs apart).
fn tier_named<'a>(report: &'a ConfigReport, phase: &str, name: &str) -> Option<&'a TierRow> {
    let phase = report.phases.iter().find(|p| p.phase == phase).expect("phase");
    phase.tiers.iter().find(|row| row.tier == name)
}

/// The phases seed 001's sums cover: its Login VSI test logged the users on and ran their
/// sessions; it names no boot, and docs/calibration-plan.md §1a infers there was none.
const LOGIN_VSI: [&str; 2] = ["logon", "steady"];

/// A tier's reads (`Some(true)`), writes (`Some(false)`) or both per VM over [`LOGIN_VSI`], in
/// 4 KiB operations.
fn login_vsi_4k(report: &ConfigReport, t: StorageTier, reads: Option<bool>) -> f64 {
    let bytes = |row: &TierRow| match reads {
        Some(true) => row.read_bytes_per_vm,
        Some(false) => row.write_bytes_per_vm,
        None => row.read_bytes_per_vm + row.write_bytes_per_vm,
    };
    LOGIN_VSI.iter().map(|p| bytes(tier(report, p, t))).sum::<f64>() / 4096.0
}

/// What seed 001's sweep measures of an RDS host, from the model: the MCS baseline (`shared`,
/// no read cache: MCS read the image from the same storage) and, per memory-cache size, the
/// temporary cache disk (the spill file), over [`LOGIN_VSI`]. The sweep's reductions are in 4
/// KiB units; the base image's share at 4 GB in operations, the unit of the seed's "total sum
/// reduction in IOPS".
struct Mcsio {
    workload: Workload,
    /// The baseline's writes on shared storage, and its reads and writes (the base image's
    /// reads included), in 4 KiB operations (the seed's caches wrote in place; overspill's 2 MiB
    /// segments would make the comparison one of I/O sizes).
    mcs_writes: f64,
    mcs_all: f64,
    /// The base image's share of the baseline's operations on shared storage: what is left there
    /// once a memory cache holds every write (seed 001 at 4 GB).
    base_image_share: f64,
}

impl Mcsio {
    fn of(workload: Workload) -> Self {
        let mcs = model_run_of(&workload, 1, WriteCacheMode::Shared, 0, 0);
        let mcs_writes = login_vsi_4k(&mcs, StorageTier::Shared, Some(false));
        let mcs_all = login_vsi_4k(&mcs, StorageTier::Shared, None) + login_vsi_4k(&mcs, StorageTier::Golden, None);
        let ops = |t: StorageTier| LOGIN_VSI.iter().map(|p| tier(&mcs, p, t).total_ops_per_vm).sum::<f64>();
        let base_image_share = ops(StorageTier::Golden) / (ops(StorageTier::Golden) + ops(StorageTier::Shared));
        Self { workload, mcs_writes, mcs_all, base_image_share }
    }

    /// How much less the cache disk takes than the baseline, in percent, with `mb` of memory
    /// cache: writes against writes, or (`writes_only` false) reads and writes against both.
    fn reduction(&self, mb: u64, writes_only: bool) -> f64 {
        let run = model_run_of(&self.workload, 1, WriteCacheMode::RamDisk, mb * MIB, 1 << 30);
        let (disk, base) = if writes_only {
            (login_vsi_4k(&run, StorageTier::Spill, Some(false)), self.mcs_writes)
        } else {
            (login_vsi_4k(&run, StorageTier::Spill, None), self.mcs_all)
        };
        100.0 * (1.0 - disk / base)
    }
}

/// Seed 001's MCSIO sweep (`data/seed-mcsio-sweep.csv`), row by row in the seed's own metric:
/// `writes` holds the temporary cache disk's writes to the MCS baseline's writes on shared
/// storage, `reads+writes` the sums ([`Mcsio`]). Here: the `xenapp-rds` host, the spill file in
/// `ram+disk` against `shared`, within ±15 percentage points. `xenapp-rds`'s logon volume and
/// write locality were sized on this sweep: these rows are a fit, not held out, except the 256
/// MB reads+writes row, which the fit missed and which is reported, not held (docs/storm.md).
///
/// And the sweep's last figure: at 4 GB, with the cache disk unused, "a total sum reduction in
/// IOPS of ~93% on the standard shared MCS storage": what MCSIO leaves there is the base image's
/// reads, 7% of the baseline's operations. `xenapp-rds`'s `read_own` (how many of a session's
/// reads come back to what the host wrote, not to the base image) was fitted on it, so it is
/// held close, within ±3 points; the other rows barely depend on it (0.7 → 0.8 moves each by
/// under 1 point: `bench/sensitivity`).
#[test]
fn the_mcsio_sweep_of_seed_001_comes_out_for_an_rds_host() {
    let sweep = mcsio_rds_sweep();
    assert_eq!(sweep.len(), 5, "five figures of the RDS half");
    let rds = Mcsio::of(Workload::built_in("xenapp-rds").expect("built in"));
    assert!(rds.mcs_writes > 100_000.0, "the RDS host writes: {}", rds.mcs_writes);
    let left = 100.0 * rds.base_image_share;
    eprintln!("4096 MB, shared storage: the base image's reads, {left:.1}% of MCS's operations (seed 001: ~7%)");
    assert!(
        (left - SWEEP_4GB_LEFT_PCT).abs() <= SWEEP_4GB_POINTS,
        "at 4 GB MCSIO leaves the base image's reads on shared storage: {left:.1}% of MCS's operations; seed 001: ~{SWEEP_4GB_LEFT_PCT}% (±{SWEEP_4GB_POINTS} points)"
    );
    for (mb, metric, seed_pct) in sweep {
        let reduction = rds.reduction(mb, metric == "writes");
        eprintln!("{mb} MB, {metric}: the cache disk takes {reduction:.0}% less than MCS (seed 001: -{seed_pct}%)");
        if mb == 256 && metric == "reads+writes" {
            continue;
        }
        assert!(
            (reduction - seed_pct).abs() <= SWEEP_POINTS,
            "{mb} MB, {metric}: the cache disk takes {reduction:.0}% less than MCS; seed 001 says {seed_pct}% (±{SWEEP_POINTS} points)"
        );
    }
}

/// The RDS half of seed 001's sweep (`data/seed-mcsio-sweep.csv`): memory cache MB, metric
/// (`writes` or `reads+writes`), the seed's reduction in percent.
fn mcsio_rds_sweep() -> Vec<(u64, String, f64)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/seed-mcsio-sweep.csv");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with("source,") && l.contains("rds-win2012r2"))
        .map(|l| {
            let cols: Vec<&str> = l.split(',').collect();
            (cols[2].parse().expect("MB"), cols[3].to_owned(), cols[4].parse().expect("percent"))
        })
        .collect()
}

/// Seed 001's Windows 10 half, held out of every fit: with a 256 MB memory cache the temporary
/// cache disk's reads and writes summed to 1.49% of the writes MCS put on shared storage
/// (20 against 1,339 IOPS, summed over the LoginVSI test). No Windows 10 workload exists here
/// and the seed gives no per-VM figures to build one, so `win7-vdi` stands in for it (a
/// proxy: same kind of desktop, another Windows): over logon and steady state (the seed's
/// LoginVSI test has no boot), the cache disk (spill and event logs) against MCS's writes
/// must come within a factor of 3 of 1.49%.
#[test]
fn the_windows_10_half_of_seed_001_comes_out_for_a_vdi_desktop_by_proxy() {
    let (disk, mcs_writes) = win10_by_proxy(&Workload::built_in("win7-vdi").expect("built in"));
    let pct = 100.0 * disk / mcs_writes;
    eprintln!(
        "win10 by proxy: cache disk {disk:.0} against MCS writes {mcs_writes:.0} per VM: {pct:.2}% (seed 001: 1.49%)"
    );
    assert!(
        holds(factor_range(WIN10_PCT, WIN10_FACTOR), pct),
        "{pct:.2}% of MCS's writes; seed 001: {WIN10_PCT}% (within {WIN10_FACTOR}×)"
    );
}

/// Seed 001's Windows 10 figure through `desktop`, 5 VMs, over logon and steady state: the cache
/// disk's I/Os (spill and event logs) under a 256 MB memory cache, and MCS's writes, per VM.
fn win10_by_proxy(desktop: &Workload) -> (f64, f64) {
    let mcs = model_run_of(desktop, 5, WriteCacheMode::Shared, 0, 0);
    let run = model_run_of(desktop, 5, WriteCacheMode::RamDisk, 256 * MIB, 1 << 30);
    let phases = ["logon", "steady"];
    let disk = phases.iter().map(|p| cache_disk_ios(&run, p)).sum();
    let mcs_writes = phases.iter().map(|p| tier(&mcs, p, StorageTier::Shared).writes_per_vm).sum();
    (disk, mcs_writes)
}

/// Seed 002, held out of every fit: 20 Windows 7 desktops on one vSphere datastore, Login VSI
/// starting "one login every fifteen seconds", the datastore's IOPS at the logon storm's peak:
/// "MCS consumed around 100 IOPS per VM at its peak. In comparison PVS with Disk consumed just
/// over half as many IOPS as MCS, at around 55 IOPS per VM", and PVS's RAM cache (256 MB) kept
/// "near zero throughout the logon storm". MCS puts everything on the datastore, base-image
/// reads included; PVS with its cache on disk puts only the writes and the reads of what the VM
/// wrote there ("Both PVS caching methods utilize low read IOPS due to the fact that PVS reads
/// the vDisk blocks over the network"). So the ratio, 0.55 as read off the seed's chart, is
/// mostly MCS's write share: it tests `win7-vdi`'s logon read share (seed 000's, another lab's)
/// and bounds from above how many of its reads come back to its own writes (`read_own`, the
/// Windows trace's 0.017; up to about 0.34), and nothing was fitted on it. The seed's absolute figures are
/// not compared (its 5 MB profiles and Login VSI workload drove each desktop harder than seed
/// 000's, whose counts `win7-vdi` carries); the logon phase is compared, the phase the seed's
/// peak belongs to. Held within ±0.1 ("around" both figures); the RAM cache's datastore traffic
/// (the event-log disk's, at the share fitted on seed 000) under 5% of MCS's.
#[test]
fn seed_002s_logon_storm_leaves_pvs_with_disk_just_over_half_of_mcs() {
    let storm = LogonStorm::of(&Workload::built_in("win7-vdi").expect("built in"));
    let LogonStorm { mcs, pvs_disk, pvs_ram } = storm;
    let (disk_ratio, ram_ratio) = (storm.disk_ratio(), pvs_ram / mcs);
    eprintln!(
        "logon storm, datastore ops per VM: MCS {mcs:.0}, PVS disk {pvs_disk:.0} ({disk_ratio:.2} of MCS; seed 002: ~55 of ~100), PVS RAM 256 MB {pvs_ram:.0} ({:.1}%)",
        100.0 * ram_ratio
    );
    assert!(mcs > 4000.0, "MCS puts a whole logon on the datastore: {mcs:.0} ops per VM");
    assert!(
        holds(SEED_002_DISK_SHARE, disk_ratio),
        "PVS with its cache on disk took {disk_ratio:.2} of MCS's datastore ops at logon; seed 002: just over half {SEED_002_DISK_SHARE:?}"
    );
    assert!(ram_ratio < 0.05, "PVS RAM cache: {:.1}% of MCS's datastore ops; seed 002: near zero", 100.0 * ram_ratio);
}

/// Seed 002's logon storm through the model: the datastore's operations per VM over the logon
/// phase under MCS, PVS with its cache on disk (its event logs on the same disk) and PVS's RAM
/// cache of 256 MB.
#[derive(Clone, Copy)]
struct LogonStorm {
    mcs: f64,
    pvs_disk: f64,
    pvs_ram: f64,
}

impl LogonStorm {
    fn of(workload: &Workload) -> Self {
        let config = StormConfig {
            vms: 20,
            boot_interval_s: 0.0,
            logon_interval_s: 15.0,
            speed: None,
            workload_seed: 1,
            bucket_s: 15,
        };
        let plan = RunPlan::from_workload(workload, &config);
        let logon_ops = |mode: WriteCacheMode, tiers: &[&str]| {
            let model = ModelConfig { mode, ram_bytes: 256 * MIB, read_cache_bytes: 0, bucket_s: config.bucket_s };
            let results = simulate(&plan, &model).expect("model");
            let report = config_report(&mode.to_string(), &plan, &config, &results, 0.0);
            assert!(report.failed_vms.is_empty(), "{mode}: {:?}", report.failed_vms);
            let logon = report.phases.iter().find(|p| p.phase == "logon").expect("a logon phase");
            logon.tiers.iter().filter(|r| tiers.contains(&r.tier.as_str())).map(|r| r.total_ops_per_vm).sum::<f64>()
        };
        let title = |t: StorageTier| t.title();
        let mcs = logon_ops(WriteCacheMode::Shared, &[title(StorageTier::Shared), title(StorageTier::Golden)]);
        let pvs_disk = logon_ops(WriteCacheMode::Disk, &[title(StorageTier::CacheFile), TIERS[DIRECT]]);
        let pvs_ram = logon_ops(
            WriteCacheMode::RamDisk,
            &[title(StorageTier::Spill), title(StorageTier::CacheFile), TIERS[DIRECT]],
        );
        Self { mcs, pvs_disk, pvs_ram }
    }

    fn disk_ratio(&self) -> f64 {
        self.pvs_disk / self.mcs
    }
}

/// What reached a PVS-style cache disk per VM in `phase`, counted as the seed's cache disk took
/// it: the event-log disk's requests as they are (in place), overspill's spill and cache-file
/// traffic in 4 KiB units (the seed's cache wrote in place, "mostly 4K").
fn cache_disk_ios(run: &ConfigReport, phase: &str) -> f64 {
    let direct = tier_named(run, phase, TIERS[DIRECT]).map_or(0.0, |r| r.total_ops_per_vm);
    let spilled: f64 =
        [StorageTier::Spill, StorageTier::CacheFile].iter().map(|&t| tier(run, phase, t).ios_4k_per_vm()).sum();
    direct + spilled
}

/// Seed 000, PVS RAM cache with overflow, 256 MB, 11 Windows 7 VMs (rows `pvs-ram-overflow,256`):
/// the cache disk took 536 I/Os per VM at boot, 101 at logon and 290 in steady state (2.5, 0.56
/// and 0.1 IOPS over the seed's windows) although the RAM cache never overflowed: the event logs
/// were "redirected directly to the write cache disk". `win7-vdi`'s event-log share was fitted on
/// the boot row alone (so boot must come out, within 10%, or the generator does not deliver its
/// share); the logon and steady rows are held out of the fit and must come out within a factor
/// of 2. Nothing spills at 256 MB: the cache disk's traffic is the event logs'. Each row's share
/// of reads is checked too ([`event_log_reads_as_seed_000s`]: set from these rows).
#[test]
fn the_pvs_cache_disk_at_256_mb_takes_the_event_logs_as_seed_000_measured() {
    let rows = calibration_rows();
    let run = model_run("win7-vdi", 11, WriteCacheMode::RamDisk, 256 * MIB);
    for (phase, factor) in PVS_256_FACTORS {
        let seed = rows
            .iter()
            .find(|r| r[1] == "win7-hyperv-sata7200" && r[2] == "pvs-ram-overflow" && r[3] == "256" && r[4] == phase)
            .expect("seed row");
        let seed_ios: f64 = seed[8].parse().expect("total IOs per VM");
        let ios = cache_disk_ios(&run, phase);
        let spilled = tier(&run, phase, StorageTier::Spill).total_ops_per_vm;
        eprintln!("{phase}: cache disk {ios:.0} I/Os per VM (seed 000: {seed_ios}), {spilled:.0} spill writes");
        assert_eq!(spilled, 0.0, "{phase}: 256 MB holds a win7-vdi VM's writes");
        let (low, high) = factor_range(seed_ios, factor);
        assert!(
            holds((low, high), ios),
            "{phase}: the cache disk took {ios:.0} I/Os per VM; seed 000 measured {seed_ios} ({low:.0} to {high:.0})"
        );
        event_log_reads_as_seed_000s(&run, phase, seed);
    }
    // MCS keeps no event-log disk: the same requests reach its differencing disk.
    let mcs = model_run("win7-vdi", 2, WriteCacheMode::Shared, 0);
    assert!(mcs.phases.iter().all(|p| p.tiers.iter().all(|r| r.tier != TIERS[DIRECT] || r.total_ops_per_vm == 0.0)));
}

/// The read share of what reached the event-log disk in `phase`, against the seed row's
/// `read_pct` (the cache disk took the event logs alone there), within
/// [`EVENT_LOG_READ_POINTS`]. The shares were set from these rows (`event_log_reads`: 56% at
/// boot from the Win7 row, none after, where the Win7 and XenApp rows read 1-9%), so this
/// checks the generator and the event-log disk's accounting, not a fit.
fn event_log_reads_as_seed_000s(run: &ConfigReport, phase: &str, seed: &[String]) {
    let seed_pct: f64 = seed[12].parse().expect("read_pct");
    let pct = event_log_read_pct(run, phase);
    eprintln!("{phase}: the event-log disk read {pct:.1}% of its requests (seed 000: {seed_pct}%)");
    assert!(
        (pct - seed_pct).abs() <= EVENT_LOG_READ_POINTS,
        "{phase}: {pct:.1}% of the event-log disk's requests were reads; seed 000: {seed_pct}% (±{EVENT_LOG_READ_POINTS} points)"
    );
}

fn event_log_read_pct(run: &ConfigReport, phase: &str) -> f64 {
    tier_named(run, phase, TIERS[DIRECT]).and_then(|r| r.read_pct).expect("event-log I/O")
}

/// Seed 000's bloated profile: 11 VMs copying ~270 MB each at logon overran the 256 MB RAM
/// cache, and the cache disk then took 4.56 IOPS per VM over the 16-minute logon (4,390
/// operations per VM) and 0.85 in steady state (2,301 per VM over 45 minutes; rows
/// `win7-hyperv-sata7200-bloated-profile`). The same overflow through overspill, counted in
/// 4 KiB operations as the seed's cache wrote them, within a factor of 1.5 of each; and in
/// overspill's own operations (2 MiB segments) far under 1 IOPS per VM.
///
/// The count is all overspill's spill traffic, its compaction included, which the seed's cache,
/// writing in place, did not have (it rewrote a block where it lay; overspill rewrites it in RAM
/// and evicts it again later). How much of the count that is gets printed, not held: the two
/// designs move different bytes for the same guest, and the steady locality was fitted through
/// overspill's.
#[test]
fn the_bloated_profile_overflows_at_logon_and_in_steady_state_as_seed_000_measured() {
    let rows = calibration_rows();
    let bloated = Workload::built_in("win7-vdi-bloated-profile").expect("built in");
    let (run, compaction) = model_run_with_compaction(&bloated, 11, 256 * MIB);
    for phase in ["logon", "steady"] {
        let seed = rows
            .iter()
            .find(|r| r[1] == "win7-hyperv-sata7200-bloated-profile" && r[3] == "256" && r[4] == phase)
            .expect("seed row");
        let seed_ios: f64 = seed[8].parse().expect("total IOs per VM");
        let spill = tier(&run, phase, StorageTier::Spill);
        let ios = cache_disk_ios(&run, phase);
        eprintln!("{phase}: {ios:.0} I/Os per VM (seed 000: {seed_ios}), {:.3} spill IOPS", spill.iops_per_vm);
        let (read, moved) = compaction[bloated.phases.iter().position(|p| p.name == phase).expect("the phase")];
        let without = ios - read - moved;
        eprintln!(
            "{phase}: of them overspill's compaction read {read:.0} and moved {moved:.0}; without it {without:.0} ({:.2}× the seed's)",
            without / seed_ios
        );
        // The seed's reads, and the cache disk's: spill reads in 4 KiB units, the event logs'.
        let seed_reads = seed_ios * seed[12].parse::<f64>().expect("read_pct") / 100.0;
        let event_log_reads = tier_named(&run, phase, TIERS[DIRECT]).map_or(0.0, |r| r.reads_per_vm);
        let reads = spill.read_bytes_per_vm / 4096.0 + event_log_reads;
        eprintln!(
            "{phase}: reads {reads:.0}, {:.0} of them not compaction's (seed 000: about {seed_reads:.0}): printed, not held",
            reads - read
        );
        assert!(
            holds(factor_range(seed_ios, BLOATED_FACTOR), ios),
            "{phase}: the cache disk (spill, event logs) took {ios:.0} I/Os per VM; seed 000's {seed_ios} (within {BLOATED_FACTOR}×)"
        );
        assert!(spill.iops_per_vm < 0.2, "{phase}: {:.3} spill IOPS per VM", spill.iops_per_vm);
    }
}

/// `xenapp-rds` as seed 000's PVS hosts ran: their event logs redirected to the cache disk, at
/// `win7-vdi`'s share of requests (fitted there, on seed 000's Win7 256 MB boot row) and its
/// phases' shares of reads among them (read at boot, appended to afterwards). That is a
/// PVS setting, not the guest's: seed 001's MCSIO redirected nothing, and its sweep runs the
/// workload as it is.
fn xenapp_rds_under_pvs() -> Workload {
    let mut workload = Workload::built_in("xenapp-rds").expect("built in");
    let desktop = Workload::built_in("win7-vdi").expect("built in");
    workload.direct_share = desktop.direct_share;
    for phase in &mut workload.phases {
        let like = desktop.phases.iter().find(|p| p.name == phase.name).expect("the desktop's phases");
        phase.event_log_reads = like.event_log_reads;
    }
    let logs = workload.disk.areas.iter_mut().find(|a| a.name == "logs").expect("a logs area");
    logs.size_mib -= 64;
    let start_mib = logs.start_mib + logs.size_mib;
    workload.disk.areas.push(Area { name: "eventlog".into(), start_mib, size_mib: 64, direct: true });
    workload
}

/// Seed 000's XenApp rows, their totals held out of every fit (the 12 GB rows' read shares
/// helped set `event_log_reads`): what reached the PVS cache disk per XenApp VM
/// (30 user sessions each) at logon and in steady state. With 12 GB of RAM cache (vSphere, 10
/// VMs) nothing overflowed: the event logs alone, which the `win7-vdi` share predicts within
/// 1.5× (held). With 3 GB and 1 GB (Hyper-V, 2 VMs) the hosts overflowed, and there the
/// workload, sized on seed 001's RDS hosts, writes far more new data at logon than seed 000's
/// XenApp hosts did: those four rows are printed, not held (docs/storm.md says by how much).
#[test]
fn seed_000s_xenapp_rows_held_out_event_logs_come_out_overflow_is_reported() {
    let rows = calibration_rows();
    let workload = xenapp_rds_under_pvs();
    for (platform, mb) in
        [("xenapp65-vsphere-nfs", 12288), ("xenapp65-hyperv-sata7200", 3072), ("xenapp65-hyperv-sata7200", 1024)]
    {
        let run = model_run_of(&workload, 1, WriteCacheMode::RamDisk, mb * MIB, 1 << 30);
        assert!(run.failed_vms.is_empty(), "{:?}", run.failed_vms);
        for phase in ["logon", "steady"] {
            let seed =
                rows.iter().find(|r| r[1] == platform && r[3] == mb.to_string() && r[4] == phase).expect("seed row");
            let seed_ios: f64 = seed[8].parse().expect("total IOs per VM");
            let ios = cache_disk_ios(&run, phase);
            let spill = tier(&run, phase, StorageTier::Spill);
            let spilled = spill.ios_4k_per_vm();
            eprintln!(
                "{platform} {mb} MB {phase}: cache disk {ios:.0} I/Os per XenApp VM ({spilled:.0} of them spill, {:.0} MiB written there) against the seed's {seed_ios}: {:.2}×",
                spill.write_bytes_per_vm / MIB as f64,
                ios / seed_ios
            );
            if mb == 12288 {
                assert_eq!(spilled, 0.0, "{phase}: 12 GB holds the host's writes");
                assert!(
                    holds(factor_range(seed_ios, XENAPP_12GB_FACTOR), ios),
                    "{phase}: the event logs took {ios:.0} I/Os per XenApp VM; seed 000 measured {seed_ios} (within {XENAPP_12GB_FACTOR}×)"
                );
                event_log_reads_as_seed_000s(&run, phase, seed);
            }
        }
    }
}

/// A change to every built-in workload's figures that no seed gives (docs/planning.md marks them
/// "none"), for the sensitivity study below.
type Nudge = (&'static str, fn(&mut Workload));

fn scale_sizes(sizes: &mut [(u32, f64)], by: f64) {
    for (size, _) in sizes {
        *size = ((f64::from(*size) * by) as u32 / 4096).max(1) * 4096;
    }
}

const NUDGES: [Nudge; 12] = [
    ("as built", |_| {}),
    ("write sizes ×2", |w| w.phases.iter_mut().for_each(|p| scale_sizes(&mut p.write_sizes, 2.0))),
    ("write sizes ×½ (at least 4 KiB)", |w| w.phases.iter_mut().for_each(|p| scale_sizes(&mut p.write_sizes, 0.5))),
    ("read sizes ×2", |w| w.phases.iter_mut().for_each(|p| scale_sizes(&mut p.read_sizes, 2.0))),
    ("read sizes ×½ (at least 4 KiB)", |w| w.phases.iter_mut().for_each(|p| scale_sizes(&mut p.read_sizes, 0.5))),
    ("read_shared ×½", |w| w.phases.iter_mut().for_each(|p| p.read_shared *= 0.5)),
    ("read_own ×2 (at most 1 − read_shared)", |w| {
        w.phases.iter_mut().for_each(|p| p.read_own = (p.read_own * 2.0).min(1.0 - p.read_shared))
    }),
    ("trims per write ×2", |w| w.phases.iter_mut().for_each(|p| p.trims_per_write *= 2.0)),
    ("trims per write ×0", |w| w.phases.iter_mut().for_each(|p| p.trims_per_write = 0.0)),
    ("flushes ×2", |w| w.phases.iter_mut().for_each(|p| p.flushes *= 2)),
    ("write areas even", |w| {
        w.phases.iter_mut().for_each(|p| {
            let even = 1.0 / p.write_areas.len() as f64;
            p.write_areas.iter_mut().for_each(|(_, weight)| *weight = even)
        })
    }),
    ("write areas twice as large (the disk grown to fit)", |w| {
        let disk = &mut w.disk;
        disk.areas.sort_by_key(|a| a.start_mib);
        let mut next = disk.system_mib;
        for area in &mut disk.areas {
            area.start_mib = next;
            area.size_mib *= 2;
            next += area.size_mib;
        }
        disk.size_mib = disk.size_mib.max(next);
    }),
];

/// A held figure: what, here, the seed's, the test's tolerance as a closed range.
type HeldFigure = (String, f64, f64, (f64, f64));

/// The figures the tests above hold, for workloads changed by `nudge`.
fn held_figures(nudge: fn(&mut Workload)) -> Vec<HeldFigure> {
    let workload = |name: &str| {
        let mut w = Workload::built_in(name).expect("built in");
        nudge(&mut w);
        w
    };
    let rows = calibration_rows();
    // A seed row's column: 8, total I/Os per VM; 12, the share of reads.
    let seed_column = |platform: &str, mb: &str, phase: &str, column: usize| -> f64 {
        let row = rows.iter().find(|r| r[1] == platform && r[3] == mb && r[4] == phase).expect("seed row");
        row[column].parse().expect("a number")
    };
    // A run's cache-disk I/Os in each phase against a seed row's, held within a factor, and, where
    // the event logs had the cache disk to themselves, their share of reads.
    let per_phase = |label: &str,
                     run: &ConfigReport,
                     (platform, mb): (&str, &str),
                     phases: &[(&str, f64)],
                     event_logs_alone: bool| {
        let figure = |&(phase, factor): &(&str, f64)| -> Vec<HeldFigure> {
            let want = seed_column(platform, mb, phase, 8);
            let mut figures =
                vec![(format!("{label} {phase}, I/Os"), cache_disk_ios(run, phase), want, factor_range(want, factor))];
            if event_logs_alone {
                let want = seed_column(platform, mb, phase, 12);
                let held = (want - EVENT_LOG_READ_POINTS, want + EVENT_LOG_READ_POINTS);
                figures.push((
                    format!("{label} {phase}, event-log % reads"),
                    event_log_read_pct(run, phase),
                    want,
                    held,
                ));
            }
            figures
        };
        phases.iter().flat_map(figure).collect::<Vec<_>>()
    };
    let mut figures = Vec::new();
    let win7 = workload("win7-vdi");
    let (read_mb, written_mb) = boot_volume_mb(&win7);
    for (what, here, measured) in
        [("boot MB read", read_mb, VDI_BOOT_READ_MB), ("boot MB written", written_mb, VDI_BOOT_WRITTEN_MB)]
    {
        let (middle, held) = vdi_boot_held(measured);
        figures.push((format!("ThinIO's {what}"), here, middle, held));
    }
    let pvs = model_run_of(&win7, 11, WriteCacheMode::RamDisk, 256 * MIB, 1 << 30);
    figures.extend(per_phase("PVS 256 MB", &pvs, ("win7-hyperv-sata7200", "256"), &PVS_256_FACTORS, true));
    let bloated = model_run_of(&workload("win7-vdi-bloated-profile"), 11, WriteCacheMode::RamDisk, 256 * MIB, 1 << 30);
    let platform = ("win7-hyperv-sata7200-bloated-profile", "256");
    let phases = [("logon", BLOATED_FACTOR), ("steady", BLOATED_FACTOR)];
    figures.extend(per_phase("bloated", &bloated, platform, &phases, false));
    let (disk, mcs_writes) = win10_by_proxy(&win7);
    let win10 = factor_range(WIN10_PCT, WIN10_FACTOR);
    figures.push(("Win10 by proxy, % of MCS writes".into(), 100.0 * disk / mcs_writes, WIN10_PCT, win10));
    let ratio = 100.0 * LogonStorm::of(&win7).disk_ratio();
    let (low, high) = SEED_002_DISK_SHARE;
    let held = (100.0 * low, 100.0 * high);
    figures.push(("seed 002 logon, PVS disk, % of MCS".into(), ratio, (held.0 + held.1) / 2.0, held));
    let rds = Mcsio::of(workload("xenapp-rds"));
    let less = 100.0 - SWEEP_4GB_LEFT_PCT;
    let held = (less - SWEEP_4GB_POINTS, less + SWEEP_4GB_POINTS);
    figures.push(("sweep 4 GB shared storage, % less".into(), 100.0 * (1.0 - rds.base_image_share), less, held));
    // The study leaves out the 4 GB row (−100%: the cache disk unused).
    for (mb, metric, want) in mcsio_rds_sweep().into_iter().filter(|&(mb, ..)| mb < 4096) {
        let writes_only = metric == "writes";
        let what = format!("sweep {mb} MB {}, % less", if writes_only { "writes" } else { "r+w" });
        // The 256 MB reads+writes row is a recorded miss: no tolerance holds it.
        let held =
            if mb == 256 && !writes_only { (f64::NAN, f64::NAN) } else { (want - SWEEP_POINTS, want + SWEEP_POINTS) };
        figures.push((what, rds.reduction(mb, writes_only), want, held));
    }
    let mut rds_pvs = xenapp_rds_under_pvs();
    nudge(&mut rds_pvs);
    let big = model_run_of(&rds_pvs, 1, WriteCacheMode::RamDisk, 12288 * MIB, 1 << 30);
    figures.extend(per_phase(
        "XenApp 12 GB",
        &big,
        ("xenapp65-vsphere-nfs", "12288"),
        &[("logon", XENAPP_12GB_FACTOR), ("steady", XENAPP_12GB_FACTOR)],
        true,
    ));
    figures.extend(dell_figures(&win7));
    figures
}

/// How much the held figures move when the figures no seed gives are changed, one at a time,
/// every workload alike: a study, not a check (minutes long; `bench/sensitivity` runs it and
/// keeps its table). Prints a markdown table: each figure under each change, and whether the
/// test's tolerance still holds it ("out" where it does not).
#[test]
#[ignore = "a study, minutes long: bench/sensitivity runs it"]
fn sensitivity_of_the_held_figures_to_the_unsourced_ones() {
    let figures = |&(_, nudge): &Nudge| {
        let held = |(what, here, seed, held): HeldFigure| Held {
            what,
            here,
            against: format!("{seed}"),
            // A NaN range is a recorded miss, held by no test.
            holds: held.0.is_nan() || holds(held, here),
        };
        held_figures(nudge).into_iter().map(held).collect()
    };
    common::print_study(&NUDGES, |&(name, _)| name, figures, "the source's", 2);
}

/// Dell's BP1018 (`data/dell-bp1018.csv`): Windows 7 desktops under PVS with each write cache on
/// the desktop's own disk, the SAN's read share and mean request sizes per phase. `win7-vdi`
/// through `disk` mode (PVS's cache disk: overspill's per-VM cache file, with the event-log
/// disk beside it), the two together per VM:
/// - read shares: Dell's include the PVS servers' vDisk reads, so a desktop's cache disk read at
///   most that much: boot's (13%) and logon's (3%) are held out as upper bounds (the boot's
///   reads nothing here, its `read_own` being the Windows trace's 0 and its event logs unread,
///   so its bound checks only that nothing else comes to read at boot); steady
///   state's (0.2%) is where `win7-vdi`'s steady `read_own` comes from, so it is held only
///   within [`DELL_STEADY_READ_FACTOR`] (the generator delivers it);
/// - the steady state's mean write size (9 KB) is held out, within [`DELL_WRITE_SIZE_FACTOR`];
///   boot's and logon's (5 KB) are printed, not held: `win7-vdi` writes larger at both
///   (docs/planning.md says by how much, and why Dell's tuned desktops may write smaller).
///
/// Dell's desktops kept their event logs in the write cache, thrown away at each restart (the
/// paper redirects none), so at boot they read no logs kept from earlier runs:
/// `event_log_reads` is none here in every phase. They ran Login VSI's light workload and seed
/// 000's the medium one, so request counts are not compared.
#[test]
fn dell_bp1018s_pvs_cache_disks_read_as_little_as_win7_vdis() {
    let figures = dell_figures(&Workload::built_in("win7-vdi").expect("built in"));
    assert_eq!(figures.len(), 6, "read share and write size of boot, logon and steady state");
    for (what, here, dell, held) in figures {
        let verdict = if held.0.is_nan() { "printed, not held" } else { "held" };
        eprintln!("{what}: {here:.2} (Dell: {dell}; {verdict})");
        assert!(held.0.is_nan() || holds(held, here), "{what}: {here:.2}; Dell: {dell}, held within {held:?}");
    }
}

/// [`dell_bp1018s_pvs_cache_disks_read_as_little_as_win7_vdis`]'s figures for `desktop`, a
/// recorded miss with a NaN range.
fn dell_figures(desktop: &Workload) -> Vec<HeldFigure> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/dell-bp1018.csv");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut desktop = desktop.clone();
    desktop.phases.iter_mut().for_each(|p| p.event_log_reads = 0.0);
    let run = model_run_of(&desktop, 5, WriteCacheMode::Disk, 0, 1 << 30);
    let mut figures = Vec::new();
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.starts_with("phase,")) {
        let row: Vec<&str> = line.split(',').collect();
        let (phase, dell_read_pct, dell_write_kib): (&str, f64, f64) =
            (row[0], row[3].parse().expect("read_pct"), row[6].parse().expect("write_kb"));
        let disks =
            [StorageTier::CacheFile.title(), TIERS[DIRECT]].into_iter().filter_map(|t| tier_named(&run, phase, t));
        let (reads, writes, written) = disks.fold((0.0, 0.0, 0.0), |(r, w, b), row| {
            (r + row.reads_per_vm, w + row.writes_per_vm, b + row.write_bytes_per_vm)
        });
        let (read_held, write_held) = if phase == "steady" {
            (factor_range(dell_read_pct, DELL_STEADY_READ_FACTOR), factor_range(dell_write_kib, DELL_WRITE_SIZE_FACTOR))
        } else {
            ((0.0, dell_read_pct), (f64::NAN, f64::NAN))
        };
        let read_pct = 100.0 * reads / (reads + writes);
        figures.push((format!("Dell {phase}, % reads"), read_pct, dell_read_pct, read_held));
        figures.push((format!("Dell {phase}, KiB a write"), written / writes / 1024.0, dell_write_kib, write_held));
    }
    figures
}
