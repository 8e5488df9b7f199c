//! The built-in profiles against the seeds' published figures (`data/seed-iops.csv`, a copy
//! of the project's calibration data with its README, so that a clone alone passes its tests):
//! generated request counts, read shares and volumes within ±10%.

use overspill_block::GuestOp;
use overspill_storm::profile::{Op, Workload};

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

#[test]
fn win7_vdi_matches_the_mcs_baseline_of_seed_000() {
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

#[test]
fn the_bloated_profile_writes_about_270_mb_at_logon() {
    let workload = Workload::built_in("win7-vdi-bloated-profile").expect("built in");
    let logon = workload.phases.iter().position(|p| p.name == "logon").expect("logon phase");
    let t = tally(&workload, logon, 10);
    within("bloated logon bytes written per user", t.write_bytes, 270e6);
    assert!(t.write_bytes > 256.0 * 1048576.0, "overruns a 256 MB cache");
}

#[test]
fn linux_boot_matches_its_measured_shape() {
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

// What reaches storage, through the engine itself (`model`: the overlays `serve` runs, with
// in-memory files), against the seeds' storage-side figures.

use overspill_engine::{StorageTier, WriteCacheMode};
use overspill_storm::driver::RunPlan;
use overspill_storm::model::{simulate, ModelConfig};
use overspill_storm::report::{config_report, ConfigReport, TierRow};
use overspill_storm::StormConfig;

const MIB: u64 = 1 << 20;

/// `vms` VMs of `workload` (boots together, a logon every 30 s as in seed 001) through one
/// write-cache configuration with the default 1 GiB shared read cache.
fn model_run(workload: &str, vms: usize, mode: WriteCacheMode, ram: u64) -> ConfigReport {
    let workload = Workload::built_in(workload).expect("built in");
    let config =
        StormConfig { vms, boot_interval_s: 0.0, logon_interval_s: 30.0, speed: None, workload_seed: 1, bucket_s: 60 };
    let plan = RunPlan::from_workload(&workload, &config);
    let model = ModelConfig { mode, ram_bytes: ram, read_cache_bytes: 1 << 30, bucket_s: config.bucket_s };
    let results = simulate(&plan, &model).expect("model");
    let report = config_report(&format!("{mode} {}M", ram / MIB), &plan, &config, &results, 0.0);
    assert!(report.failed_vms.is_empty(), "{:?}", report.failed_vms);
    report
}

fn tier<'a>(report: &'a ConfigReport, phase: &str, tier: StorageTier) -> &'a TierRow {
    let phase = report.phases.iter().find(|p| p.phase == phase).expect("phase");
    phase.tiers.iter().find(|row| row.tier == tier.title()).expect("tier row")
}

/// A tier's traffic per VM over the whole run, in 4 KiB operations.
fn whole_run_4k(report: &ConfigReport, t: StorageTier) -> f64 {
    report.phases.iter().map(|p| tier(report, &p.phase, t).ios_4k_per_vm()).sum()
}

/// Seed 001's MCSIO sweep on RDS workers: the temporary cache disk's I/O against the MCS
/// baseline's shared-storage I/O falls by 39% at 256 MB of memory cache, 50% at 512 MB, 77% at
/// 1 GB, and to nothing at 4 GB (`data/seed-mcsio-sweep.csv`). Here: the `xenapp-rds` host, the
/// spill file's traffic in `ram+disk` against the differencing file's in `shared`, both in 4 KiB
/// operations (the seed's caches wrote in place; overspill's 2 MiB segments would make the
/// comparison one of I/O sizes, not of what overflowed), within ±15 percentage points.
#[test]
fn the_mcsio_sweep_of_seed_001_comes_out_for_an_rds_host() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/seed-mcsio-sweep.csv");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let sweep: Vec<(u64, f64)> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with("source,"))
        .map(|l| {
            let cols: Vec<&str> = l.split(',').collect();
            (cols[2].parse().expect("MB"), cols[3].parse().expect("percent"))
        })
        .collect();
    assert_eq!(sweep.len(), 4, "four memory-cache sizes in the seed");
    let baseline = whole_run_4k(&model_run("xenapp-rds", 1, WriteCacheMode::Shared, 0), StorageTier::Shared);
    assert!(baseline > 100_000.0, "the RDS host writes: {baseline}");
    let mut previous = -1.0;
    for (mb, seed_pct) in sweep {
        let run = model_run("xenapp-rds", 1, WriteCacheMode::RamDisk, mb * MIB);
        let disk = whole_run_4k(&run, StorageTier::Spill);
        let reduction = 100.0 * (1.0 - disk / baseline);
        eprintln!(
            "{mb} MB: cache disk {disk:.0} of {baseline:.0} 4 KiB I/Os: -{reduction:.0}% (seed 001: -{seed_pct}%)"
        );
        assert!(
            (reduction - seed_pct).abs() <= 15.0,
            "{mb} MB: the cache disk takes {reduction:.0}% less than MCS; seed 001 says {seed_pct}% (±15 points)"
        );
        assert!(reduction >= previous, "more memory never means more cache-disk I/O");
        previous = reduction;
    }
}

/// Seed 000, PVS RAM cache with overflow, 256 MB, 11 Windows 7 VMs (rows `pvs-ram-overflow,256`):
/// the storage behind the write caches saw 2.5 IOPS per VM at boot, 0.56 at logon, 0.1 in steady
/// state. overspill with the same cache keeps the write caches' storage (spill, local cache
/// file, shared differencing file: every write-cache tier) under 1 IOPS per VM in every phase,
/// in its own operations. Golden-image reads are the shared read cache's misses, the seeds'
/// "system cache" (PVS streamed the vDisk from its server's RAM), and are not part of it.
#[test]
fn ram_with_overflow_at_256_mb_keeps_write_cache_storage_under_1_iops_per_vm() {
    let run = model_run("win7-vdi", 11, WriteCacheMode::RamDisk, 256 * MIB);
    for phase in &run.phases {
        let iops: f64 = [StorageTier::Shared, StorageTier::CacheFile, StorageTier::Spill]
            .iter()
            .map(|&t| tier(&run, &phase.phase, t).iops_per_vm)
            .sum();
        let guest = phase.tiers.iter().find(|r| r.tier == "guest").expect("guest row").iops_per_vm;
        assert!(guest > 5.0, "{}: the guests worked ({guest:.1} IOPS per VM)", phase.phase);
        assert!(iops < 1.0, "{}: {iops:.3} write-cache storage IOPS per VM", phase.phase);
    }
}

/// Seed 000's bloated profile: 11 VMs copying ~270 MB each at logon overran the 256 MB RAM
/// cache, and the cache disk then took 4.56 IOPS per VM over the 16-minute logon (4,390
/// operations per VM) and 0.85 in steady state (2,301 per VM over 45 minutes; rows
/// `win7-hyperv-sata7200-bloated-profile`). The same overflow through overspill, counted in
/// 4 KiB operations as the seed's cache wrote them, within a factor of 1.5 of each; and in
/// overspill's own operations (2 MiB segments) far under 1 IOPS per VM.
#[test]
fn the_bloated_profile_overflows_at_logon_and_in_steady_state_as_seed_000_measured() {
    let rows = calibration_rows();
    let run = model_run("win7-vdi-bloated-profile", 11, WriteCacheMode::RamDisk, 256 * MIB);
    for phase in ["logon", "steady"] {
        let seed = rows
            .iter()
            .find(|r| r[1] == "win7-hyperv-sata7200-bloated-profile" && r[3] == "256" && r[4] == phase)
            .expect("seed row");
        let seed_ios: f64 = seed[8].parse().expect("total IOs per VM");
        let spill = tier(&run, phase, StorageTier::Spill);
        let ios = spill.ios_4k_per_vm();
        eprintln!("{phase}: {ios:.0} 4 KiB I/Os per VM (seed 000: {seed_ios}), {:.3} spill IOPS", spill.iops_per_vm);
        assert!(
            ios >= seed_ios / 1.5 && ios <= seed_ios * 1.5,
            "{phase}: the spill took {ios:.0} 4 KiB I/Os per VM; seed 000's cache disk {seed_ios} (within 1.5x)"
        );
        assert!(spill.iops_per_vm < 0.2, "{phase}: {:.3} spill IOPS per VM", spill.iops_per_vm);
    }
}
