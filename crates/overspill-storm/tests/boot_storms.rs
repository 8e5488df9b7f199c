//! Seed 003 (Demartek: 90 Windows 7 VMs booting at once on internal HDDs, Fibre Channel HDDs
//! and Fibre Channel SSDs) through the planner's storage model: the shape of its results.

use overspill_engine::WriteCacheMode;
use overspill_storm::driver::RunPlan;
use overspill_storm::plan::{boot_estimate, BootEstimate, PlanOptions};
use overspill_storm::storage::{CacheMode, DeviceSpec, Raid, StorageSpec};
use overspill_storm::{StormConfig, Workload};

/// The calibrated win7-vdi boot (seed 000's I/O per boot), on `k` distinct VMs, with its
/// requests spread over `boot_s` seconds.
fn win7_boots(k: usize, boot_s: f64) -> RunPlan {
    let mut w = Workload::built_in("win7-vdi").expect("built in");
    w.phases.truncate(1);
    w.phases[0].duration_s = boot_s;
    let config = StormConfig {
        vms: k,
        boot_interval_s: 0.0,
        logon_interval_s: 0.0,
        speed: None,
        workload_seed: 3,
        bucket_s: 10,
    };
    RunPlan::from_workload(&w, &config)
}

fn spec(device: &str, disks: usize, raid: Raid, cache_mib: u64, mode: CacheMode, qd: Option<usize>) -> StorageSpec {
    let env = |k: &str, d: f64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    StorageSpec {
        disks,
        raid,
        cache_bytes: cache_mib << 20,
        cache_mode: mode,
        queue_depth: qd,
        power_on_group: 1,
        power_on_interval_s: env("POI", 0.44),
        power_on_ios: env("PIO", 0.0) as usize,
        vm_queue_depth: env("VQD", 4.0) as usize,
        ..StorageSpec::single(DeviceSpec::built_in(device).expect("built in"))
    }
}

fn run(plan: &RunPlan, storage: StorageSpec, ram: Option<u64>) -> BootEstimate {
    let options = PlanOptions {
        ram: vec![],
        mode: WriteCacheMode::RamDisk,
        read_cache_bytes: if ram.is_some() { 1 << 30 } else { 0 },
        storage: Some(storage),
        vms: 90,
    };
    let e = boot_estimate(plan, &options, ram).expect("simulates").expect("an estimate");
    let c = |s: f64| format!("{}:{:02}", (s / 60.0) as u64, (s % 60.0) as u64);
    println!(
        "{:<60} issue {} min {} max {} avg {} peak {:.0}",
        e.storage,
        c(e.power_on_s),
        c(e.min_s),
        c(e.max_s),
        c(e.avg_s),
        e.peak_iops
    );
    e
}

#[test]
fn seed_003_shape() {
    let env = |k: &str, d: f64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let plan = win7_boots(10, env("BOOT", 15.0));
    let n_int = env("NINT", 8.0) as usize;
    let n_fc = env("NFC", 15.0) as usize;
    let n_ssd = env("NSSD", 4.0) as usize;
    let int512 = run(&plan, spec("hdd10k", n_int, Raid::R5, 512, CacheMode::WriteBack, None), None);
    let int1g = run(&plan, spec("hdd10k", n_int, Raid::R5, 1024, CacheMode::WriteBack, None), None);
    let fc32 = run(&plan, spec("hdd15k", n_fc, Raid::R5, 1744, CacheMode::ReadOnly, Some(32)), None);
    let fc254 = run(&plan, spec("hdd15k", n_fc, Raid::R5, 1744, CacheMode::WriteBack, Some(254)), None);
    let ssd32 = run(&plan, spec("ssd", n_ssd, Raid::R5, 1744, CacheMode::WriteBack, Some(32)), None);
    let ssd254 = run(&plan, spec("ssd", n_ssd, Raid::R5, 1744, CacheMode::WriteBack, Some(254)), None);
    let pct = |a: &BootEstimate, b: &BootEstimate| (b.avg_s / a.avg_s - 1.0) * 100.0;
    println!(
        "cache {:.0}% (seed -18), HDD qd {:.0}% (seed -33), SSD qd {:.0}% (seed -18)",
        pct(&int512, &int1g),
        pct(&fc32, &fc254),
        pct(&ssd32, &ssd254)
    );
    let hdd = [&int512, &int1g, &fc32, &fc254];
    let ssd = [&ssd32, &ssd254];
    let lo = hdd.iter().map(|h| h.avg_s).fold(f64::MAX, f64::min) / ssd.iter().map(|s| s.avg_s).fold(0.0, f64::max);
    let hi = hdd.iter().map(|h| h.avg_s).fold(0.0, f64::max) / ssd.iter().map(|s| s.avg_s).fold(f64::MAX, f64::min);
    println!("SSD faster by {lo:.1}x to {hi:.1}x (seed 2.3-4.2)");
    let over = run(&plan, spec("hdd10k", n_int, Raid::R5, 512, CacheMode::WriteBack, None), Some(256 << 20));
    let _ = over;
}
