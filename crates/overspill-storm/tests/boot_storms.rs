//! Seed 003 (Demartek: 90 Windows 7 VMs booting on internal HDDs, Fibre Channel HDDs and Fibre
//! Channel SSDs) through the planner's storage model, from the calibrated win7-vdi boot (seed
//! 000's I/O per boot), each configuration powered on at the pace it needed in the seed ("Time
//! Taken to Issue Start Commands" over its 90 VMs).
//!
//! Two readings of the seed. Its appendix names the arrays (internal: 15 × 15K disks, RAID 0;
//! Fibre Channel: 12 × 15K disks and 24 SSDs, RAID 0) and its VMs were cloned, each its own copy:
//! played that way, every boot's reads miss the controller cache, the storms are disk-bound and
//! last about as long as the seed's, but every VM shares the disks evenly and finishes near the
//! storm's end, so averages sit near the maxima and cache size does nothing (docs/planning.md).
//! The shape of the seed's changes comes out on linked clones and the arrays of the first test,
//! which are this test's choice, stated in full, fitted by a search (docs/planning.md): the
//! seed's changes in average boot time within ±10 points, SSD against HDD within the seed's
//! 2.3× to 4.2×.

use overspill_engine::WriteCacheMode;
use overspill_storm::driver::RunPlan;
use overspill_storm::plan::{boot_estimate, BootEstimate, PlanOptions};
use overspill_storm::storage::{CacheMode, Clones, DeviceSpec, Raid, StorageSpec};
use overspill_storm::{StormConfig, Workload};

const VMS: usize = 90;

/// The win7-vdi boot on `k` distinct VMs, its requests spread over 15 s (Demartek's fastest boot
/// took 16 s; seed 000's 120 s was its measuring window, not the boot's own length).
fn win7_boots(k: usize) -> RunPlan {
    let mut w = Workload::built_in("win7-vdi").expect("built in");
    w.phases.truncate(1);
    w.phases[0].duration_s = 15.0;
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

/// A 2013 Fibre Channel SSD as the seed's array drove it (it peaked near 13k IOPS in all).
fn fc_ssd() -> DeviceSpec {
    DeviceSpec { name: "fc-ssd".into(), iops: vec![(1.0, 3000.0), (8.0, 8000.0), (64.0, 15000.0)], mb_per_s: 250.0 }
}

/// The internal RAID controller: 7 × 7.2K disks in RAID 0, a write-back cache, no queue limit.
fn internal(cache_mib: u64, issue_s: f64) -> StorageSpec {
    StorageSpec {
        disks: 7,
        raid: Raid::R0,
        cache_bytes: cache_mib << 20,
        cache_mode: CacheMode::WriteBack,
        power_on_group: 1,
        power_on_interval_s: issue_s / (VMS - 1) as f64,
        ..StorageSpec::single(DeviceSpec::built_in("hdd7200").expect("built in"))
    }
}

/// The Fibre Channel array: its 1744 MB cache, 2.5 ms of fabric and controller per request, a
/// controller good for 16k IOPS, and the HBA's queue depth.
fn fibre_channel(device: DeviceSpec, disks: usize, mode: CacheMode, queue_depth: usize, issue_s: f64) -> StorageSpec {
    StorageSpec {
        disks,
        raid: Raid::R5,
        cache_bytes: 1744 << 20,
        cache_mode: mode,
        queue_depth: Some(queue_depth),
        controller_iops: Some(16_000.0),
        array_latency_s: 0.002_5,
        power_on_group: 1,
        power_on_interval_s: issue_s / (VMS - 1) as f64,
        ..StorageSpec::single(device)
    }
}

fn estimate(plan: &RunPlan, storage: StorageSpec, ram: Option<u64>) -> BootEstimate {
    let options = PlanOptions {
        ram: vec![],
        mode: WriteCacheMode::RamDisk,
        read_cache_bytes: if ram.is_some() { 1 << 30 } else { 0 },
        storage: Some(storage),
        vms: VMS,
        boot_max: None,
    };
    let e = boot_estimate(plan, &options, ram).expect("simulates").0.expect("an estimate");
    let clock = |s: f64| format!("{}:{:02}", (s / 60.0) as u64, (s % 60.0) as u64);
    println!(
        "{:<95} power-ons {} boot min {} max {} avg {} peak {:.0} IOPS",
        e.storage,
        clock(e.power_on_s),
        clock(e.min_s),
        clock(e.max_s),
        clock(e.avg_s),
        e.peak_iops
    );
    e
}

fn change(before: &BootEstimate, after: &BootEstimate) -> f64 {
    (after.avg_s / before.avg_s - 1.0) * 100.0
}

/// A fit, not a check: the arrays below were chosen by a search so that the seed's changes come
/// out (docs/planning.md), so this test holds the model to what it was fitted on. It guards the
/// fit against changes to the model; the checks against the seed are the own-array test below.
#[test]
fn seed_003s_boot_storm_shape_on_arrays_fitted_to_it() {
    let plan = win7_boots(10);
    let hdd15k = || DeviceSpec::built_in("hdd15k").expect("built in");
    // The seed's FC array with 384 MB of its 1744 MB cache for writes, 2.08 ms of fabric and
    // controller per request and a controller good for 18,500 IOPS; 9 HDDs or 22 SSDs.
    let fc = |device, disks, mode, queue_depth, issue_s| StorageSpec {
        write_cache_bytes: Some(384 << 20),
        controller_iops: Some(18_500.0),
        array_latency_s: 0.002_08,
        ..fibre_channel(device, disks, mode, queue_depth, issue_s)
    };
    let int512 = estimate(&plan, internal(512, 119.0), None);
    let int1g = estimate(&plan, internal(1024, 107.0), None);
    let fc32 = estimate(&plan, fc(hdd15k(), 9, CacheMode::ReadOnly, 32, 276.0), None);
    let fc254 = estimate(&plan, fc(hdd15k(), 9, CacheMode::WriteBack, 254, 98.0), None);
    let ssd32 = estimate(&plan, fc(fc_ssd(), 22, CacheMode::WriteBack, 32, 61.0), None);
    let ssd254 = estimate(&plan, fc(fc_ssd(), 22, CacheMode::WriteBack, 254, 40.0), None);
    let (cache, hdd_qd, ssd_qd) = (change(&int512, &int1g), change(&fc32, &fc254), change(&ssd32, &ssd254));
    let hdds = [&int512, &int1g, &fc32, &fc254];
    let ratios: Vec<f64> = hdds.iter().flat_map(|h| [&ssd32, &ssd254].map(|s| h.avg_s / s.avg_s)).collect();
    let (lo, hi) = (ratios.iter().copied().fold(f64::MAX, f64::min), ratios.iter().copied().fold(0.0, f64::max));
    println!("controller cache 512 MB → 1 GB: {cache:+.0}% (seed −18%); queue depth 32 → 254: HDD {hdd_qd:+.0}% (seed −33%), SSD {ssd_qd:+.0}% (seed −18%); SSD faster than HDD by {lo:.3}× to {hi:.3}× (seed 2.3× to 4.2×)");

    // Queues spread boot times: the first VMs boot before the storm builds, the last wait.
    for e in [&int512, &int1g, &fc32, &fc254, &ssd32, &ssd254] {
        assert!(e.max_s > 1.5 * e.min_s, "{e:?}");
        assert_eq!(e.booted_per_interval.iter().sum::<usize>(), VMS);
    }
    // Each change shortens the average boot within ±10 points of the seed's change.
    assert!((cache + 18.0).abs() <= 10.0, "controller cache: {cache:.0}% against the seed's −18%");
    assert!((hdd_qd + 33.0).abs() <= 10.0, "HDD queue depth: {hdd_qd:.0}% against the seed's −33%");
    assert!((ssd_qd + 18.0).abs() <= 10.0, "SSD queue depth: {ssd_qd:.0}% against the seed's −18%");
    // SSDs boot faster than every HDD configuration by 2.3× to 4.2×, as in the seed.
    assert!(lo >= 2.3 && hi <= 4.2, "SSD against HDD: {lo:.3}× to {hi:.3}×");

    // The same 90 VMs with overspill in front of the internal 512 MB array (ram+disk at 256 MB
    // per VM, a 1 GiB shared read cache): the array sees the spill and the read cache's misses.
    let behind = estimate(&plan, internal(512, 119.0), Some(256 << 20));
    assert!(behind.avg_s < 0.25 * int512.avg_s, "{behind:?} against {int512:?}");
    assert!(behind.peak_iops < 0.25 * int512.peak_iops, "{behind:?} against {int512:?}");
}

/// The seed's own arrays, its VMs full clones: the storms last about as long as the seed's (the
/// disks' work over their throughput), the HDD arrays serve what 15K disks serve, and SSDs boot
/// the fleet faster than any HDD array.
#[test]
fn seed_003s_own_arrays_as_full_clones_last_as_long_as_its_storms() {
    let plan = win7_boots(10);
    let hdd15k = || DeviceSpec::built_in("hdd15k").expect("built in");
    let own = |spec: StorageSpec| StorageSpec { raid: Raid::R0, clones: Clones::Full, ..spec };
    let internal_15k = |mib, issue_s| own(StorageSpec { device: hdd15k(), disks: 15, ..internal(mib, issue_s) });
    // (configuration, the seed's longest boot and peak IOPS)
    let storms = [
        (internal_15k(512, 119.0), 9 * 60 + 40, 5_382.0),
        (internal_15k(1024, 107.0), 8 * 60 + 20, 5_842.0),
        (own(fibre_channel(hdd15k(), 12, CacheMode::ReadOnly, 32, 276.0)), 11 * 60 + 20, 3_278.0),
        (own(fibre_channel(hdd15k(), 12, CacheMode::WriteBack, 254, 98.0)), 6 * 60 + 42, 5_669.0),
        (own(fibre_channel(fc_ssd(), 24, CacheMode::WriteBack, 32, 61.0)), 2 * 60 + 17, 12_981.0),
        (own(fibre_channel(fc_ssd(), 24, CacheMode::WriteBack, 254, 40.0)), 60 + 57, 12_489.0),
    ];
    let estimates: Vec<(BootEstimate, f64, f64)> = storms
        .into_iter()
        .map(|(spec, seed_max_s, seed_peak)| (estimate(&plan, spec, None), f64::from(seed_max_s), seed_peak))
        .collect();
    for (e, seed_max_s, seed_peak) in &estimates {
        let (length, peak) = (e.max_s / seed_max_s, e.peak_iops / seed_peak);
        println!("longest boot {length:.2}× the seed's, peak IOPS {peak:.2}×: {}", e.storage);
        assert!((0.6..=1.6).contains(&length), "longest boot {length:.2}× the seed's: {e:?}");
        assert!((0.5..=1.5).contains(&peak), "peak IOPS {peak:.2}× the seed's: {e:?}");
    }
    let slowest_ssd = estimates[4..].iter().map(|(e, _, _)| e.avg_s).fold(0.0, f64::max);
    let fastest_hdd = estimates[..4].iter().map(|(e, _, _)| e.avg_s).fold(f64::MAX, f64::min);
    assert!(fastest_hdd > 2.0 * slowest_ssd, "HDD {fastest_hdd:.0} s against SSD {slowest_ssd:.0} s");
}

/// A study, not a check (docs/planning.md, "What the model lacks on the seed's own arrays"):
/// the seed's own arrays, full clones, each VM powered on once the one before has had its 30
/// storage reads answered (`power_on_ios`, fitted on the internal 512 MB array's 1:59 to issue
/// the start commands), instead of at the pace the seed measured. Prints each storm, and the FC
/// HDD read-cache storm again with 0.5 ms of fabric and controller instead of 2.5.
#[test]
#[ignore = "a study: cargo test --release -p overspill-storm --test boot_storms -- --ignored --nocapture"]
fn study_power_ons_driven_by_storage_on_the_seeds_own_arrays() {
    let plan = win7_boots(10);
    let hdd15k = || DeviceSpec::built_in("hdd15k").expect("built in");
    let paced = |spec: StorageSpec| StorageSpec {
        raid: Raid::R0,
        clones: Clones::Full,
        power_on_interval_s: 0.0,
        power_on_ios: 30,
        ..spec
    };
    let internal_15k = |mib| paced(StorageSpec { device: hdd15k(), disks: 15, ..internal(mib, 0.0) });
    let storms = [
        ("internal 512 MB (seed: power-ons 1:59, avg 4:30)", internal_15k(512)),
        ("internal 1 GB (1:47, 3:42)", internal_15k(1024)),
        ("FC HDD QD32, read cache (4:36, 5:02)", paced(fibre_channel(hdd15k(), 12, CacheMode::ReadOnly, 32, 0.0))),
        ("FC HDD QD254, write-back (1:38, 3:22)", paced(fibre_channel(hdd15k(), 12, CacheMode::WriteBack, 254, 0.0))),
        ("FC SSD QD32 (1:01, 1:28)", paced(fibre_channel(fc_ssd(), 24, CacheMode::WriteBack, 32, 0.0))),
        ("FC SSD QD254 (0:40, 1:12)", paced(fibre_channel(fc_ssd(), 24, CacheMode::WriteBack, 254, 0.0))),
        (
            "FC HDD QD32, read cache, 0.5 ms array latency",
            StorageSpec {
                array_latency_s: 0.000_5,
                ..paced(fibre_channel(hdd15k(), 12, CacheMode::ReadOnly, 32, 0.0))
            },
        ),
    ];
    for (name, spec) in storms {
        println!("{name}:");
        estimate(&plan, spec, None);
    }
}
