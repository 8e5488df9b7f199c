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
//! which are this test's choice, stated in full, fitted by the search at the end of this file
//! (`bench/fit-seed-003`): the seed's changes in average boot time within ±10 points, SSD against
//! HDD within a tenth of the seed's 2.3× to 4.2×, its average boots; its host counters held out.

mod common;

use common::Held;
use overspill_engine::WriteCacheMode;
use overspill_storm::driver::RunPlan;
use overspill_storm::plan::{boot_estimate, BootEstimate, PlanOptions};
use overspill_storm::storage::{CacheMode, Clones, DeviceSpec, Raid, StorageSpec, ARRAY_LATENCY_S};
use overspill_storm::{StormConfig, Workload};

const VMS: usize = 90;

// What the tests hold, written once: the seed's changes in average boot time (its −18% for the
// controller cache, −33% and −18% for the HBA queue depth on HDDs and SSDs) within ±10 points;
// SSDs faster than every HDD configuration by the seed's 2.3× to 4.2×, each end within a tenth,
// and each storm's average boot within a factor range of the seed's; on the seed's own arrays
// the longest boot, the peak IOPS and the FC HDD storms' requests a second within a factor range
// of the seed's, their read shares within a few points, and SSDs more than twice as fast as any
// HDD array.
const SEED_CACHE_PCT: f64 = -18.0;
const SEED_HDD_QUEUE_PCT: f64 = -33.0;
const SEED_SSD_QUEUE_PCT: f64 = -18.0;
const CHANGE_POINTS: f64 = 10.0;
const SSD_OVER_HDD: (f64, f64) = (2.3, 4.2);
/// How far each end of the SSD-over-HDD range may lie from the seed's, as a share of it: the
/// fit's unit for it and for the average boots.
const SSD_OVER_HDD_SHARE: f64 = 0.1;
const OWN_LONGEST_BOOT: (f64, f64) = (0.6, 1.6);
const OWN_PEAK_IOPS: (f64, f64) = (0.5, 1.5);
const OWN_SSD_OVER_HDD_AT_LEAST: f64 = 2.0;
const FITTED_AVG_BOOT: (f64, f64) = (0.6, 1.6);
const OWN_MEAN_IOPS: (f64, f64) = (0.5, 1.5);
/// The seed's two storms read 0.6 points apart; the generator draws each request's kind, about
/// a point either way over a boot: 3 points leaves room for both and no more.
const READ_SHARE_POINTS: f64 = 3.0;

/// Seed 003's average boot, in the order of the arrays below (internal 512 MB, 1 GB; FC HDD
/// queue depth 32, 254; FC SSD 32, 254): 4:30, 3:42, 5:02, 3:22, 1:28, 1:12.
const SEED_AVG_BOOT_S: [f64; 6] = [270.0, 222.0, 302.0, 202.0, 88.0, 72.0];

/// Seed 003's Fibre Channel HDD storms as the host counted them (ESXTOP's 15 s intervals,
/// averaged over three tests; the seed does not say over which span): reads and writes per
/// second at HBA queue depth 32 (read cache), then 254 (write back). No fit used them.
const SEED_FC_HDD_READS_WRITES: [(f64, f64); 2] = [(2246.0, 354.0), (3010.0, 497.0)];

/// The win7-vdi boot (as `w` has it) on `k` distinct VMs, its requests spread over 15 s
/// (Demartek's fastest boot took 16 s; seed 000's 120 s was its measuring window, not the
/// boot's own length).
fn win7_boots_of(mut w: Workload, k: usize) -> RunPlan {
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

fn win7_boots(k: usize) -> RunPlan {
    win7_boots_of(Workload::built_in("win7-vdi").expect("built in"), k)
}

/// A 2013 Fibre Channel SSD as the seed's array drove it (it peaked near 13k IOPS in all).
fn fc_ssd() -> DeviceSpec {
    DeviceSpec { name: "fc-ssd".into(), iops: vec![(1.0, 3000.0), (8.0, 8000.0), (64.0, 15000.0)], mb_per_s: 250.0 }
}

fn hdd15k() -> DeviceSpec {
    DeviceSpec::built_in("hdd15k").expect("built in")
}

/// The internal RAID controller over `disks` of `device` in `raid`: a write-back cache, no queue
/// limit.
fn internal(device: DeviceSpec, disks: usize, raid: Raid, cache_mib: u64, issue_s: f64) -> StorageSpec {
    StorageSpec {
        disks,
        raid,
        cache_bytes: cache_mib << 20,
        cache_mode: CacheMode::WriteBack,
        power_on_group: 1,
        power_on_interval_s: issue_s / (VMS - 1) as f64,
        ..StorageSpec::single(device)
    }
}

/// The seed's SSD storms peaked at 12,981 and 12,489 IOPS, at HBA queue depths 32 and 254: the
/// same within 4% whatever the queue, read here as a ceiling of the array's (an inference: the
/// seed states none). The model puts its controller there: a seed figure used as an input, so
/// the SSD storms' peaks are not checks.
const SEED_SSD_CEILING_IOPS: f64 = 12_981.0;

/// The Fibre Channel array: its 1744 MB cache, a controller at the seed's SSD ceiling, the
/// model's default time per request (as the internal arrays), and the HBA's queue depth.
fn fibre_channel(device: DeviceSpec, disks: usize, mode: CacheMode, queue_depth: usize, issue_s: f64) -> StorageSpec {
    StorageSpec {
        disks,
        raid: Raid::R5,
        cache_bytes: 1744 << 20,
        cache_mode: mode,
        queue_depth: Some(queue_depth),
        controller_iops: Some(SEED_SSD_CEILING_IOPS),
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
        "{:<95} power-ons {} boot min {} max {} avg {} peak {:.0} IOPS, mean {:.0} reads/s {:.0} writes/s",
        e.storage,
        clock(e.power_on_s),
        clock(e.min_s),
        clock(e.max_s),
        clock(e.avg_s),
        e.peak_iops,
        e.mean_read_iops,
        e.mean_write_iops
    );
    e
}

/// A pair of FC HDD storms (queue depth 32, then 254) against the seed's host counters: each
/// storm's share of reads (%) beside the seed's, its mean requests per second over the seed's,
/// and how much the mean rose from one to the other (%) beside the seed's rise.
struct HostRates {
    read_pct: [(f64, f64); 2],
    mean_iops_over_seed: [f64; 2],
    rise_pct: (f64, f64),
}

fn host_rates(storms: [&BootEstimate; 2]) -> HostRates {
    let total = |(reads, writes): (f64, f64)| reads + writes;
    let read_pct = |rates: (f64, f64)| 100.0 * rates.0 / total(rates);
    let here = storms.map(|e| (e.mean_read_iops, e.mean_write_iops));
    let seed = SEED_FC_HDD_READS_WRITES;
    let rise = |pair: [(f64, f64); 2]| (total(pair[1]) / total(pair[0]) - 1.0) * 100.0;
    let rates = HostRates {
        read_pct: [0, 1].map(|i| (read_pct(here[i]), read_pct(seed[i]))),
        mean_iops_over_seed: [0, 1].map(|i| total(here[i]) / total(seed[i])),
        rise_pct: (rise(here), rise(seed)),
    };
    let [(r32, s32), (r254, s254)] = rates.read_pct;
    let [m32, m254] = rates.mean_iops_over_seed;
    let (rise_here, rise_seed) = rates.rise_pct;
    println!(
        "FC HDD storms as the host counts them, queue depth 32 and 254: reads {r32:.1}% and {r254:.1}% of requests (seed {s32:.1}%, {s254:.1}%); mean requests per second {m32:.2}× and {m254:.2}× the seed's; from 32 to 254 {rise_here:+.0}% (seed {rise_seed:+.0}%)"
    );
    rates
}

/// No storage change moves the share of reads (the model passes each request through as it
/// is): this checks seed 000's boot read share, an input of the workload, against seed 003's
/// host counters, and the storm's counting of reads and writes.
fn assert_read_shares_as_the_seeds(rates: &HostRates) {
    for (here, seed) in rates.read_pct {
        assert!(
            (here - seed).abs() <= READ_SHARE_POINTS,
            "FC HDD storm: {here:.1}% reads against the seed's {seed:.1}%"
        );
    }
}

/// "Boot times stayed below two minutes for the first 17-19 VMs booted in HDD optimal
/// configurations" (the internal 1 GB array and the FC HDDs at queue depth 254, write back).
const SEED_FIRST_UNDER_TWO_MINUTES: (usize, usize) = (17, 19);

/// How many of the first VMs powered on booted, each from its power-on to its end, in under two
/// minutes, in the storms of the seed's optimal HDD configurations (the internal 1 GB array, the
/// FC HDDs at queue depth 254), printed beside the seed's.
fn print_boots_under_two_minutes(internal_1g: &BootEstimate, fc_hdd_254: &BootEstimate) {
    let under = |e: &BootEstimate| e.boots_s.iter().take_while(|&&s| s < 120.0).count();
    let (low, high) = SEED_FIRST_UNDER_TWO_MINUTES;
    println!(
        "the first VMs powered on that booted in under two minutes: internal 1 GB {}, FC HDD queue depth 254 {} (seed: the first {low}-{high})",
        under(internal_1g),
        under(fc_hdd_254)
    );
}

/// Most VMs whose boot ended in one 15 s interval (the seed's internal arrays: 6 with the 512
/// MB cache, 8 with 1 GB).
fn most_booted_at_once(e: &BootEstimate) -> usize {
    e.booted_per_interval.iter().copied().max().unwrap_or(0)
}

/// Seed 003's internal arrays sat behind Dell PERC H710 and H710P controllers, whose read policy
/// by default is adaptive read-ahead: it reads ahead once the two latest reads were sequential,
/// and stops when reads are random (the PERC H710/H710P/H810 user's guide, "Virtual Disk Read
/// Cache Policies"). The model has no read-ahead, which is what adaptive read-ahead does if
/// next to no read continues the one before it. Under 1 in 100 here, as the storms print.
fn assert_adaptive_read_ahead_would_stay_off(internal: &[BootEstimate]) {
    for e in internal {
        let share = e.sequential_reads as f64 / e.controller_reads.max(1) as f64;
        println!(
            "reads continuing the read before them: {} of {} ({:.4}%): {}",
            e.sequential_reads,
            e.controller_reads,
            100.0 * share,
            e.storage
        );
        assert!(e.controller_reads > 0 && share < 0.01, "{share:.4} of the reads: {e:?}");
    }
}

fn change(before: &BootEstimate, after: &BootEstimate) -> f64 {
    (after.avg_s / before.avg_s - 1.0) * 100.0
}

fn within((low, high): (f64, f64), figure: f64) -> bool {
    (low..=high).contains(&figure)
}

/// The test's arrays, fitted to seed 003 by `fit_seed_003s_arrays_holding_out_its_host_counters`
/// (bench/results/fit-seed-003-earlier-d16f4b8.md), each changed by `nudge`: internal 512 MB and
/// 1 GB, 7 × 7.2K RAID 0; FC HDDs at queue depth 32 (read cache) and 254 (write back), FC SSDs at
/// 32 and 254, 11 HDDs or 24 SSDs RAID 5 behind 256 MB of the 1744 MB cache for writes, 2 ms of
/// fabric and controller per request and a controller good for 21,000 IOPS.
fn fitted_arrays(nudge: SpecNudge) -> [StorageSpec; 6] {
    let mut arrays = arrays_at(FITTED_ARRAYS);
    arrays.iter_mut().for_each(nudge);
    arrays
}

/// Where the fit ended (`FIT_GRID`'s indices).
const FITTED_ARRAYS: FitPoint = [0, 3, 0, 4, 5, 2, 1, 4, 4];

/// Whether each end of an SSD-over-HDD range lies within a tenth of the seed's.
fn ssd_over_hdd_as_the_seeds((lo, hi): (f64, f64)) -> [bool; 2] {
    let near = |figure: f64, seed: f64| (figure / seed - 1.0).abs() <= SSD_OVER_HDD_SHARE;
    [near(lo, SSD_OVER_HDD.0), near(hi, SSD_OVER_HDD.1)]
}

/// What seed 003's storms on the fitted arrays give: the three changes in average boot time
/// (controller cache, queue depth on HDDs and SSDs), the range of SSD-over-HDD ratios, and each
/// storm's average boot over the seed's.
struct FittedShape {
    cache: f64,
    hdd_queue: f64,
    ssd_queue: f64,
    ssd_over_hdd: (f64, f64),
    avg_boot: Vec<f64>,
}

fn fitted_shape(plan: &RunPlan, arrays: [StorageSpec; 6]) -> (FittedShape, [BootEstimate; 6]) {
    let storms = arrays.map(|spec| estimate(plan, spec, None));
    let [int512, int1g, fc32, fc254, ssd32, ssd254] = &storms;
    let ratios: Vec<f64> =
        [int512, int1g, fc32, fc254].iter().flat_map(|h| [ssd32, ssd254].map(|s| h.avg_s / s.avg_s)).collect();
    let shape = FittedShape {
        cache: change(int512, int1g),
        hdd_queue: change(fc32, fc254),
        ssd_queue: change(ssd32, ssd254),
        ssd_over_hdd: (ratios.iter().copied().fold(f64::MAX, f64::min), ratios.iter().copied().fold(0.0, f64::max)),
        avg_boot: storms.iter().zip(SEED_AVG_BOOT_S).map(|(e, seed_s)| e.avg_s / seed_s).collect(),
    };
    (shape, storms)
}

/// The seed's own arrays (its appendix), its VMs full clones, each changed by `nudge`, with the
/// seed's longest boot (s) and peak IOPS: internal 15 × 15K RAID 0 behind 512 MB and 1 GB; FC
/// 12 × 15K at queue depth 32 (read cache) and 254 (write back); FC 24 SSDs at 32 and 254.
fn own_arrays(nudge: SpecNudge) -> [(StorageSpec, f64, f64); 6] {
    let own = |spec: StorageSpec| StorageSpec { raid: Raid::R0, clones: Clones::Full, ..spec };
    let internal_15k = |mib, issue_s| own(internal(hdd15k(), 15, Raid::R0, mib, issue_s));
    let mut arrays = [
        (internal_15k(512, 119.0), 9.0 * 60.0 + 40.0, 5_382.0),
        (internal_15k(1024, 107.0), 8.0 * 60.0 + 20.0, 5_842.0),
        (own(fibre_channel(hdd15k(), 12, CacheMode::ReadOnly, 32, 276.0)), 11.0 * 60.0 + 20.0, 3_278.0),
        (own(fibre_channel(hdd15k(), 12, CacheMode::WriteBack, 254, 98.0)), 6.0 * 60.0 + 42.0, 5_669.0),
        // The ceiling the model's FC controller has is this storm's peak.
        (own(fibre_channel(fc_ssd(), 24, CacheMode::WriteBack, 32, 61.0)), 2.0 * 60.0 + 17.0, SEED_SSD_CEILING_IOPS),
        (own(fibre_channel(fc_ssd(), 24, CacheMode::WriteBack, 254, 40.0)), 60.0 + 57.0, 12_489.0),
    ];
    arrays.iter_mut().for_each(|(spec, ..)| nudge(spec));
    arrays
}

/// What the storms on the seed's own arrays give: each storm's longest boot and peak IOPS over
/// the seed's, and the fastest HDD array's average boot over the slowest SSD array's.
struct OwnArrays {
    longest_boot: Vec<f64>,
    peak_iops: Vec<f64>,
    ssd_over_hdd: f64,
    host: HostRates,
    storms: Vec<BootEstimate>,
}

fn own_arrays_against_the_seed(plan: &RunPlan, arrays: [(StorageSpec, f64, f64); 6]) -> OwnArrays {
    let storms = arrays.clone().map(|(spec, ..)| estimate(plan, spec, None));
    let slowest_ssd = storms[4..].iter().map(|e| e.avg_s).fold(0.0, f64::max);
    let fastest_hdd = storms[..4].iter().map(|e| e.avg_s).fold(f64::MAX, f64::min);
    OwnArrays {
        longest_boot: storms.iter().zip(&arrays).map(|(e, (_, seed_max_s, _))| e.max_s / seed_max_s).collect(),
        peak_iops: storms.iter().zip(&arrays).map(|(e, (.., seed_peak))| e.peak_iops / seed_peak).collect(),
        ssd_over_hdd: fastest_hdd / slowest_ssd,
        host: host_rates([&storms[2], &storms[3]]),
        storms: storms.into(),
    }
}

/// A fit, not a check: the arrays were chosen by the search below so that the seed's changes,
/// SSD-over-HDD range and average boots come out, so this test holds the model to what it was
/// fitted on. It guards the fit against changes to the model; the checks against the seed are
/// the figures held out of the fit, printed here, and the own-array test below.
#[test]
fn seed_003s_boot_storm_shape_on_arrays_fitted_to_it() {
    // `FITTED_ARRAYS` are positions in the grid's lists: a value added to a list moves them.
    let fit_ended_on = "internal 7× hdd7200 R0; FC 11 HDDs or 24 SSDs R5, 256 MiB for writes, 21000 IOPS, 2 ms";
    assert_eq!(describe_point(FITTED_ARRAYS), fit_ended_on, "bench/results/fit-seed-003-earlier-d16f4b8.md");
    let plan = win7_boots(10);
    let (shape, storms) = fitted_shape(&plan, fitted_arrays(|_| {}));
    let FittedShape { cache, hdd_queue, ssd_queue, ssd_over_hdd: (lo, hi), .. } = shape;
    println!("controller cache 512 MB → 1 GB: {cache:+.0}% (seed −18%); queue depth 32 → 254: HDD {hdd_queue:+.0}% (seed −33%), SSD {ssd_queue:+.0}% (seed −18%); SSD faster than HDD by {lo:.3}× to {hi:.3}× (seed 2.3× to 4.2×)");
    // Held out of the fit: the seed's host counters on its FC HDD storms (their read shares
    // held, as on the own arrays; their rates printed, a miss), how many of its internal
    // arrays' VMs finished in one 15 s interval (printed, a miss) and how many of its optimal
    // configurations' VMs booted within two minutes (printed).
    let host = host_rates([&storms[2], &storms[3]]);
    let [internal512, internal1g] = [&storms[0], &storms[1]].map(most_booted_at_once);
    println!("most VMs booted in one 15 s interval: internal 512 MB {internal512}, 1 GB {internal1g} (seed 6, 8)");
    print_boots_under_two_minutes(&storms[1], &storms[3]);
    assert_read_shares_as_the_seeds(&host);
    assert_adaptive_read_ahead_would_stay_off(&storms[..2]);

    // The seed's boots ended one after another (0:53 to 9:40 on the internal 512 MB array);
    // here they end together, so the longest over the shortest is about the storm's length
    // over the same less the two minutes of power-ons: printed, a miss.
    let int512 = &storms[0];
    let spread = int512.max_s / int512.min_s;
    println!("internal 512 MB: longest boot over the shortest {spread:.2}× (seed 11×)");
    // Each average boot within a factor of the seed's (fitted on: they bound the storms' length).
    let avg_boot = &shape.avg_boot;
    println!("average boots over the seed's: {avg_boot:.2?}");
    for (e, ratio) in storms.iter().zip(avg_boot) {
        assert!(within(FITTED_AVG_BOOT, *ratio), "average boot {ratio:.2}× the seed's: {e:?}");
    }
    // Each change shortens the average boot within ±10 points of the seed's change.
    assert!((cache - SEED_CACHE_PCT).abs() <= CHANGE_POINTS, "controller cache: {cache:.0}% against the seed's −18%");
    let hdd = hdd_queue;
    assert!((hdd - SEED_HDD_QUEUE_PCT).abs() <= CHANGE_POINTS, "HDD queue depth: {hdd:.0}% against the seed's −33%");
    let ssd = ssd_queue;
    assert!((ssd - SEED_SSD_QUEUE_PCT).abs() <= CHANGE_POINTS, "SSD queue depth: {ssd:.0}% against the seed's −18%");
    // SSDs boot faster than every HDD configuration by 2.3× to 4.2×, as in the seed, each end
    // within a tenth (the fit's unit).
    assert_eq!(ssd_over_hdd_as_the_seeds((lo, hi)), [true, true], "SSD against HDD: {lo:.3}× to {hi:.3}×");

    // The same 90 VMs with overspill in front of the internal 512 MB array (ram+disk at 256 MB
    // per VM, a 1 GiB shared read cache): the array sees the spill and the read cache's misses.
    let [internal_512, ..] = fitted_arrays(|_| {});
    let behind = estimate(&plan, internal_512, Some(256 << 20));
    assert!(behind.avg_s < 0.25 * int512.avg_s, "{behind:?} against {int512:?}");
    assert!(behind.peak_iops < 0.25 * int512.peak_iops, "{behind:?} against {int512:?}");
}

/// The seed's own arrays, its VMs full clones: the storms last about as long as the seed's (the
/// disks' work over their throughput), the HDD arrays serve what 15K disks serve, and SSDs boot
/// the fleet faster than any HDD array.
#[test]
fn seed_003s_own_arrays_as_full_clones_last_as_long_as_its_storms() {
    let own = own_arrays_against_the_seed(&win7_boots(10), own_arrays(|_| {}));
    for ((e, length), peak) in own.storms.iter().zip(&own.longest_boot).zip(&own.peak_iops) {
        println!("longest boot {length:.2}× the seed's, peak IOPS {peak:.2}×: {}", e.storage);
        assert!(within(OWN_LONGEST_BOOT, *length), "longest boot {length:.2}× the seed's: {e:?}");
    }
    // The SSD storms' peaks are the controller's ceiling, which is the seed's: only the HDD
    // arrays' peaks are checks.
    for (e, peak) in own.storms.iter().zip(&own.peak_iops).take(4) {
        assert!(within(OWN_PEAK_IOPS, *peak), "peak IOPS {peak:.2}× the seed's: {e:?}");
    }
    let ratio = own.ssd_over_hdd;
    assert!(ratio > OWN_SSD_OVER_HDD_AT_LEAST, "the fastest HDD array over the slowest SSD array: {ratio:.2}×");
    // The FC HDD storms as the seed's host counted them: as many requests a second, give or take
    // half, and reads in the same share (seed 000's Windows 7 boot against seed 003's).
    assert_read_shares_as_the_seeds(&own.host);
    for mean in own.host.mean_iops_over_seed {
        assert!(within(OWN_MEAN_IOPS, mean), "FC HDD storm: mean requests per second {mean:.2}× the seed's");
    }
    let [internal512, internal1g] = [&own.storms[0], &own.storms[1]].map(most_booted_at_once);
    println!("most VMs booted in one 15 s interval: internal 512 MB {internal512}, 1 GB {internal1g} (seed 6, 8)");
    print_boots_under_two_minutes(&own.storms[1], &own.storms[3]);
    assert_adaptive_read_ahead_would_stay_off(&own.storms[..2]);
}

/// A study, not a check (docs/planning.md, "What the model lacks on the seed's own arrays"):
/// the seed's own arrays, full clones, each VM powered on once the one before has had its 30
/// storage reads answered (`power_on_ios`, fitted on the internal 512 MB array's 1:59 to issue
/// the start commands), instead of at the pace the seed measured. Prints each storm.
#[test]
#[ignore = "a study: cargo test --release -p overspill-storm --test boot_storms -- --ignored --nocapture"]
fn study_power_ons_driven_by_storage_on_the_seeds_own_arrays() {
    let plan = win7_boots(10);
    let paced = |spec: StorageSpec| StorageSpec {
        raid: Raid::R0,
        clones: Clones::Full,
        power_on_interval_s: 0.0,
        power_on_ios: 30,
        ..spec
    };
    let internal_15k = |mib| paced(internal(hdd15k(), 15, Raid::R0, mib, 0.0));
    let storms = [
        ("internal 512 MB (seed: power-ons 1:59, avg 4:30)", internal_15k(512)),
        ("internal 1 GB (1:47, 3:42)", internal_15k(1024)),
        ("FC HDD QD32, read cache (4:36, 5:02)", paced(fibre_channel(hdd15k(), 12, CacheMode::ReadOnly, 32, 0.0))),
        ("FC HDD QD254, write-back (1:38, 3:22)", paced(fibre_channel(hdd15k(), 12, CacheMode::WriteBack, 254, 0.0))),
        ("FC SSD QD32 (1:01, 1:28)", paced(fibre_channel(fc_ssd(), 24, CacheMode::WriteBack, 32, 0.0))),
        ("FC SSD QD254 (0:40, 1:12)", paced(fibre_channel(fc_ssd(), 24, CacheMode::WriteBack, 254, 0.0))),
    ];
    for (name, spec) in storms {
        println!("{name}:");
        estimate(&plan, spec, None);
    }
}

/// A change to a figure of the storage model that no source gives (docs/planning.md marks them
/// "none"), for the study below: to the boot's workload, to every array of the fitted test, to
/// every array of the own-array test.
type StorageNudge = (&'static str, fn(&mut Workload), SpecNudge, SpecNudge);
type SpecNudge = fn(&mut StorageSpec);

/// `(queue depth, IOPS)`, a point of a device's curve.
type Point = (f64, f64);

/// Moves the disk classes' points between their first and last depth (the depth-4 and depth-16
/// points, where a reordering disk puts them: tests/disk_queue_depths.rs) to
/// `to(depth, iops, first, last)`. The test's own FC SSD curve is a fit and is left alone.
fn disks_middle_points(spec: &mut StorageSpec, to: fn(f64, f64, Point, Point) -> f64) {
    if !spec.device.name.starts_with("hdd") {
        return;
    }
    let points = &mut spec.device.iops;
    let (first, last) = (points[0], points[points.len() - 1]);
    for point in points.iter_mut().filter(|(depth, _)| *depth > first.0 && *depth < last.0) {
        point.1 = to(point.0, point.1, first, last);
    }
}

/// The middle points on the straight line between the first and the last.
fn disks_middle_on_the_line(spec: &mut StorageSpec) {
    disks_middle_points(spec, |depth, _, (d0, i0), (d1, i1)| i0 + (i1 - i0) * (depth - d0) / (d1 - d0));
}

/// The middle points halfway up to the last.
fn disks_middle_halfway_up(spec: &mut StorageSpec) {
    disks_middle_points(spec, |_, iops, _, (_, last)| (iops + last) / 2.0);
}

fn disks_bandwidth(spec: &mut StorageSpec, by: f64) {
    if spec.device.name.starts_with("hdd") {
        spec.device.mb_per_s *= by;
    }
}

/// Scales an array's own time per request where it is the model's default (0.2 ms, no source);
/// the fitted FC array's 2 ms is a fit.
fn default_latency(spec: &mut StorageSpec, by: f64) {
    if spec.array_latency_s == ARRAY_LATENCY_S {
        spec.array_latency_s *= by;
    }
}

fn fc_controller(spec: &mut StorageSpec, by: f64) {
    spec.controller_iops = spec.controller_iops.map(|iops| iops * by);
}

fn write_part_where_unset(spec: &mut StorageSpec, share: f64) {
    if spec.write_cache_bytes.is_none() {
        spec.write_cache_bytes = Some((spec.cache_bytes as f64 * share) as u64);
    }
}

const STORAGE_NUDGES: [StorageNudge; 13] = [
    ("as built", |_| {}, |_| {}, |_| {}),
    (
        "disks' depths 4 and 16 on the straight line from depth 1 to 32",
        |_| {},
        disks_middle_on_the_line,
        disks_middle_on_the_line,
    ),
    ("disks' depths 4 and 16 halfway up to depth 32", |_| {}, disks_middle_halfway_up, disks_middle_halfway_up),
    ("disks' bandwidth ×½", |_| {}, |s| disks_bandwidth(s, 0.5), |s| disks_bandwidth(s, 0.5)),
    ("disks' bandwidth ×2", |_| {}, |s| disks_bandwidth(s, 2.0), |s| disks_bandwidth(s, 2.0)),
    ("arrays' latency, the default 0.2 ms, ×½", |_| {}, |s| default_latency(s, 0.5), |s| default_latency(s, 0.5)),
    ("arrays' latency, the default 0.2 ms, ×2", |_| {}, |s| default_latency(s, 2.0), |s| default_latency(s, 2.0)),
    // Not unsourced, but inferred (a ceiling the seed's SSD peaks suggest and the seed does not
    // state): what rests on it.
    ("own FC arrays' ceiling (12,981 IOPS) ×0.8", |_| {}, |_| {}, |s| fc_controller(s, 0.8)),
    ("own FC arrays' ceiling (12,981 IOPS) ×1.25", |_| {}, |_| {}, |s| fc_controller(s, 1.25)),
    (
        "write part a quarter of the cache (where not set: half)",
        |_| {},
        |s| write_part_where_unset(s, 0.25),
        |s| write_part_where_unset(s, 0.25),
    ),
    (
        "write part three quarters of the cache (where not set: half)",
        |_| {},
        |s| write_part_where_unset(s, 0.75),
        |s| write_part_where_unset(s, 0.75),
    ),
    ("system region (1.5 GiB) ×½", |w| w.disk.system_mib /= 2, |_| {}, |_| {}),
    (
        "system region (1.5 GiB) ×2, the disk grown to fit",
        |w| common::grow_system_region(w, 2 * w.disk.system_mib),
        |_| {},
        |_| {},
    ),
];

/// What an end of the SSD-over-HDD range is held to, in the study's table.
fn ends_text(seed: f64) -> String {
    format!("{seed} ± {}%", SSD_OVER_HDD_SHARE * 100.0)
}

fn range_text((low, high): (f64, f64)) -> String {
    format!("{low}-{high}")
}

/// Seed 003's held figures under one change: what, the value, what the test holds it to, and
/// whether it holds.
fn held_storm_figures(&(_, workload, fitted, own): &StorageNudge) -> Vec<Held> {
    let mut w = Workload::built_in("win7-vdi").expect("built in");
    workload(&mut w);
    let plan = win7_boots_of(w, 10);
    let (shape, _) = fitted_shape(&plan, fitted_arrays(fitted));
    let own = own_arrays_against_the_seed(&plan, own_arrays(own));
    let near = |figure: f64, seed: f64| (figure - seed).abs() <= CHANGE_POINTS;
    // Figures of several storms: the least and the most of them, each held to a range.
    let least = |what, figures: &[f64], range| {
        let least = figures.iter().copied().fold(f64::MAX, f64::min);
        (what, least, range_text(range), within(range, least))
    };
    let most = |what, figures: &[f64], range| {
        let most = figures.iter().copied().fold(0.0, f64::max);
        (what, most, range_text(range), within(range, most))
    };
    let (lo, hi) = shape.ssd_over_hdd;
    let [lo_holds, hi_holds] = ssd_over_hdd_as_the_seeds((lo, hi));
    let hdd_peaks = &own.peak_iops[..4];
    vec![
        (
            "fitted: cache, %",
            shape.cache,
            format!("{SEED_CACHE_PCT} ± {CHANGE_POINTS}"),
            near(shape.cache, SEED_CACHE_PCT),
        ),
        (
            "fitted: HDD queue depth, %",
            shape.hdd_queue,
            format!("{SEED_HDD_QUEUE_PCT} ± {CHANGE_POINTS}"),
            near(shape.hdd_queue, SEED_HDD_QUEUE_PCT),
        ),
        (
            "fitted: SSD queue depth, %",
            shape.ssd_queue,
            format!("{SEED_SSD_QUEUE_PCT} ± {CHANGE_POINTS}"),
            near(shape.ssd_queue, SEED_SSD_QUEUE_PCT),
        ),
        ("fitted: SSD over HDD, least ×", lo, ends_text(SSD_OVER_HDD.0), lo_holds),
        ("fitted: SSD over HDD, most ×", hi, ends_text(SSD_OVER_HDD.1), hi_holds),
        least("fitted: average boot, least × seed's", &shape.avg_boot, FITTED_AVG_BOOT),
        most("fitted: average boot, most × seed's", &shape.avg_boot, FITTED_AVG_BOOT),
        least("own: longest boot, least × seed's", &own.longest_boot, OWN_LONGEST_BOOT),
        most("own: longest boot, most × seed's", &own.longest_boot, OWN_LONGEST_BOOT),
        least("own: HDD peak IOPS, least × seed's", hdd_peaks, OWN_PEAK_IOPS),
        most("own: HDD peak IOPS, most × seed's", hdd_peaks, OWN_PEAK_IOPS),
        (
            "own: SSD over HDD ×",
            own.ssd_over_hdd,
            format!("> {OWN_SSD_OVER_HDD_AT_LEAST}"),
            own.ssd_over_hdd > OWN_SSD_OVER_HDD_AT_LEAST,
        ),
        least("own: FC HDD requests/s, least × seed's", &own.host.mean_iops_over_seed, OWN_MEAN_IOPS),
        most("own: FC HDD requests/s, most × seed's", &own.host.mean_iops_over_seed, OWN_MEAN_IOPS),
    ]
    .into_iter()
    .map(|(what, here, against, holds): (&str, f64, String, bool)| Held { what: what.into(), here, against, holds })
    .collect()
}

/// How much seed 003's held figures move when a figure of the storage model that no source
/// gives is changed, one at a time, on every array of both tests: a study, not a check (a few
/// minutes; `bench/sensitivity` runs it and keeps its table). Prints a markdown table.
#[test]
#[ignore = "a study, minutes long: bench/sensitivity runs it"]
fn sensitivity_of_seed_003s_figures_to_the_unsourced_storage_ones() {
    common::print_study(&STORAGE_NUDGES, |nudge| nudge.0, held_storm_figures, "held", 2);
}

/// What the fit of seed 003's arrays may choose, one list of values per choice: the internal
/// arrays' disks, their class and RAID level; the FC arrays' HDDs and SSDs, their RAID level, the
/// part of the 1744 MB cache writes may hold, the controller's ceiling, the fabric and
/// controller's time per request. Each VM keeps its 4 requests in flight (loosely sourced: the
/// Windows trace's boot, docs/planning.md), not fitted.
struct FitGrid {
    internal_device: [&'static str; 3],
    internal_disks: [usize; 8],
    raid: [Raid; 3],
    fc_hdd_disks: [usize; 8],
    fc_ssd_disks: [usize; 7],
    write_part_mib: [u64; 6],
    controller_iops: [f64; 6],
    latency_ms: [f64; 8],
}

const FIT_GRID: FitGrid = FitGrid {
    internal_device: ["hdd7200", "hdd10k", "hdd15k"],
    internal_disks: [4, 5, 6, 7, 8, 10, 12, 15],
    raid: [Raid::R0, Raid::R10, Raid::R5],
    fc_hdd_disks: [6, 8, 9, 10, 11, 12, 15, 18],
    fc_ssd_disks: [8, 12, 16, 20, 22, 24, 28],
    write_part_mib: [128, 256, 384, 512, 640, 872],
    controller_iops: [12_981.0, 15_000.0, 18_000.0, 18_500.0, 21_000.0, 24_000.0],
    latency_ms: [0.2, 0.5, 1.0, 1.5, 2.0, 2.08, 2.5, 3.0],
};

/// A point of the grid: an index into each list, in `FitGrid`'s order (the internal RAID level
/// and the FC one are two choices from the one list).
type FitPoint = [usize; 9];

fn fit_grid_sizes() -> FitPoint {
    let g = &FIT_GRID;
    [
        g.internal_device.len(),
        g.internal_disks.len(),
        g.raid.len(),
        g.fc_hdd_disks.len(),
        g.fc_ssd_disks.len(),
        g.raid.len(),
        g.write_part_mib.len(),
        g.controller_iops.len(),
        g.latency_ms.len(),
    ]
}

/// The six arrays of a point of the grid, in the order of `fitted_arrays`.
fn arrays_at(p: FitPoint) -> [StorageSpec; 6] {
    let g = &FIT_GRID;
    let internal = |mib, issue_s| {
        let device = DeviceSpec::built_in(g.internal_device[p[0]]).expect("built in");
        internal(device, g.internal_disks[p[1]], g.raid[p[2]], mib, issue_s)
    };
    let fc = |device, disks, mode, queue_depth, issue_s| StorageSpec {
        raid: g.raid[p[5]],
        write_cache_bytes: Some(g.write_part_mib[p[6]] << 20),
        controller_iops: Some(g.controller_iops[p[7]]),
        array_latency_s: g.latency_ms[p[8]] / 1000.0,
        ..fibre_channel(device, disks, mode, queue_depth, issue_s)
    };
    let (hdds, ssds) = (g.fc_hdd_disks[p[3]], g.fc_ssd_disks[p[4]]);
    [
        internal(512, 119.0),
        internal(1024, 107.0),
        fc(hdd15k(), hdds, CacheMode::ReadOnly, 32, 276.0),
        fc(hdd15k(), hdds, CacheMode::WriteBack, 254, 98.0),
        fc(fc_ssd(), ssds, CacheMode::WriteBack, 32, 61.0),
        fc(fc_ssd(), ssds, CacheMode::WriteBack, 254, 40.0),
    ]
}

/// How far a shape lies from the figures the fit is made on, and only those: the seed's three
/// changes (in units of the tests' ±10 points), the ends of its SSD-over-HDD range and its six
/// average boots (each in units of a tenth of the seed's). The seed's host counters and its VMs'
/// finishing order are not looked at: they are held out. (Fitted on the changes and the range
/// alone, with each VM's queue depth a choice too, the climb ends on arrays whose storms are
/// 1.6-1.8× the seed's length, and one request a VM: bench/results/fit-seed-003-7be6708.md.)
fn fit_distance(shape: &FittedShape) -> f64 {
    let points = |figure: f64, seed: f64| ((figure - seed) / CHANGE_POINTS).powi(2);
    let shares = |figure: f64, seed: f64| ((figure / seed - 1.0) / SSD_OVER_HDD_SHARE).powi(2);
    let (lo, hi) = shape.ssd_over_hdd;
    points(shape.cache, SEED_CACHE_PCT)
        + points(shape.hdd_queue, SEED_HDD_QUEUE_PCT)
        + points(shape.ssd_queue, SEED_SSD_QUEUE_PCT)
        + shares(lo, SSD_OVER_HDD.0)
        + shares(hi, SSD_OVER_HDD.1)
        + shape.avg_boot.iter().map(|&over_seed| shares(over_seed, 1.0)).sum::<f64>()
}

fn describe_point(p: FitPoint) -> String {
    let g = &FIT_GRID;
    format!(
        "internal {}× {} {:?}; FC {} HDDs or {} SSDs {:?}, {} MiB for writes, {} IOPS, {} ms",
        g.internal_disks[p[1]],
        g.internal_device[p[0]],
        g.raid[p[2]],
        g.fc_hdd_disks[p[3]],
        g.fc_ssd_disks[p[4]],
        g.raid[p[5]],
        g.write_part_mib[p[6]],
        g.controller_iops[p[7]],
        g.latency_ms[p[8]]
    )
}

/// Where the fit starts by default: the arrays an earlier search chose (a scratch program, not
/// kept: 7 × 7.2K RAID 0 internal; on Fibre Channel 9 HDDs or 22 SSDs RAID 5, 384 MB for writes,
/// 18,500 IOPS, 2.08 ms), which the grid holds for that reason.
const FIT_FROM_THE_EARLIER_SEARCH: FitPoint = [0, 3, 0, 2, 4, 2, 2, 3, 5];

/// The other start (`FIT_FROM=appendix`): the seed's own arrays (15 × 15K internal, 12 × 15K and
/// 24 SSDs on Fibre Channel, RAID 0, half the cache for writes, the controller at the seed's SSD
/// ceiling, the model's default 0.2 ms), played as linked clones.
const FIT_FROM_THE_APPENDIX: FitPoint = [2, 7, 0, 5, 5, 0, 5, 0, 0];

#[test]
fn the_fits_starts_are_the_arrays_they_are_said_to_be() {
    // Grid positions move when a value is added to a list: the starts are checked by name.
    let earlier = "internal 7× hdd7200 R0; FC 9 HDDs or 22 SSDs R5, 384 MiB for writes, 18500 IOPS, 2.08 ms";
    assert_eq!(describe_point(FIT_FROM_THE_EARLIER_SEARCH), earlier);
    let appendix = "internal 15× hdd15k R0; FC 12 HDDs or 24 SSDs R0, 872 MiB for writes, 12981 IOPS, 0.2 ms";
    assert_eq!(describe_point(FIT_FROM_THE_APPENDIX), appendix);
}

/// The points one step from `here`: one choice moved to any other of its values (a step to the
/// next value alone stalls: from the seed's arrays, with the averages scored, such a climb ends
/// with the SSDs' queue-depth change at +26%, bench/results/fit-seed-003-44b41ff.md).
fn neighbours(here: FitPoint, sizes: FitPoint) -> impl Iterator<Item = FitPoint> {
    (0..here.len()).flat_map(move |i| {
        (0..sizes[i]).filter(move |&v| v != here[i]).map(move |v| {
            let mut p = here;
            p[i] = v;
            p
        })
    })
}

/// Two choices moved together, each to a value beside its own: where moving one choice alone
/// helps no more, the figures may still trade one against the other (a slower FC HDD array at
/// queue depth 32 against a faster one at 254).
fn pair_steps(here: FitPoint, sizes: FitPoint) -> Vec<FitPoint> {
    let beside = |i: usize| [here[i].checked_sub(1), Some(here[i] + 1).filter(|&v| v < sizes[i])].into_iter().flatten();
    let mut steps = Vec::new();
    for i in 0..here.len() {
        for j in i + 1..here.len() {
            for vi in beside(i) {
                for vj in beside(j) {
                    let mut p = here;
                    (p[i], p[j]) = (vi, vj);
                    steps.push(p);
                }
            }
        }
    }
    steps
}

/// Seed 003's arrays fitted again, by a program kept here so that the fit can be read and re-run
/// (the fitted test's arrays came from a scratch search that was not kept): a coordinate search
/// over `FIT_GRID` (one choice to any of its values; where that helps no more, two choices each
/// to a value beside its own), from the earlier search's arrays or (`FIT_FROM=appendix`) from
/// the seed's own, scored by `fit_distance` alone. Prints every step and, at the end, the
/// figures held out of it. `bench/fit-seed-003` runs it and keeps what it printed.
#[test]
#[ignore = "a fit, tens of minutes: bench/fit-seed-003 runs it"]
fn fit_seed_003s_arrays_holding_out_its_host_counters() {
    let plan = win7_boots(10);
    let sizes = fit_grid_sizes();
    let mut scored: std::collections::HashMap<FitPoint, f64> = std::collections::HashMap::new();
    let score = |p: FitPoint| fit_distance(&fitted_shape(&plan, arrays_at(p)).0);
    let mut here = match std::env::var("FIT_FROM").as_deref() {
        Ok("appendix") => FIT_FROM_THE_APPENDIX,
        Ok("earlier") | Err(_) => FIT_FROM_THE_EARLIER_SEARCH,
        Ok(other) => panic!("FIT_FROM={other}: the fit starts from `earlier` (the default) or `appendix`"),
    };
    let mut score_all = |points: Vec<FitPoint>| {
        let unscored: Vec<FitPoint> = points.iter().copied().filter(|p| !scored.contains_key(p)).collect();
        // Two points at a time: two CPUs, as the sensitivity studies.
        for pair in unscored.chunks(2) {
            let scores: Vec<(FitPoint, f64)> = std::thread::scope(|scope| {
                let runs: Vec<_> = pair.iter().map(|&p| (p, scope.spawn(move || score(p)))).collect();
                runs.into_iter().map(|(p, run)| (p, run.join().expect("a fit run"))).collect()
            });
            scored.extend(scores);
        }
        let best = points.into_iter().min_by(|a, b| scored[a].total_cmp(&scored[b])).expect("a step");
        (best, scored[&best])
    };
    let mut distance = score_all(vec![here]).1;
    println!("| step | arrays | distance |");
    println!("| --- | --- | --- |");
    println!("| start | {} | {distance:.3} |", describe_point(here));
    for step in 1.. {
        let (mut best, mut best_distance) = score_all(neighbours(here, sizes).collect());
        let mut moved = "one choice";
        if best_distance >= distance {
            (best, best_distance) = score_all(pair_steps(here, sizes));
            moved = "two choices";
        }
        if best_distance >= distance {
            break;
        }
        (here, distance) = (best, best_distance);
        println!("| {step} ({moved}) | {} | {distance:.3} |", describe_point(here));
    }
    println!();
    println!("{} points simulated; the fit: {}", scored.len(), describe_point(here));
    let (shape, storms) = fitted_shape(&plan, arrays_at(here));
    let FittedShape { cache, hdd_queue, ssd_queue, ssd_over_hdd: (lo, hi), ref avg_boot } = shape;
    println!("fitted on: controller cache {cache:+.1}% (seed −18%); queue depth HDD {hdd_queue:+.1}% (seed −33%), SSD {ssd_queue:+.1}% (seed −18%); SSD over HDD {lo:.2}× to {hi:.2}× (seed 2.3× to 4.2×); average boots over the seed's {avg_boot:.2?}");
    print!("held out: ");
    host_rates([&storms[2], &storms[3]]);
    let [internal512, internal1g] = [&storms[0], &storms[1]].map(most_booted_at_once);
    println!(
        "held out: most VMs booted in one 15 s interval: internal 512 MB {internal512}, 1 GB {internal1g} (seed 6, 8)"
    );
    print!("held out: ");
    print_boots_under_two_minutes(&storms[1], &storms[3]);
}
