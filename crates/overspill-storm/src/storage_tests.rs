use super::*;

fn disk(name: &str) -> DeviceSpec {
    DeviceSpec::built_in(name).expect("built in")
}

/// `n` 4 KiB reads, `gap` seconds apart, at VM-private offsets.
fn reads(n: usize, gap: f64, golden: bool) -> VmBoot {
    let mut boot = VmBoot::default();
    for i in 0..n {
        boot.push(i as f64 * gap, [Request { write: false, golden, offset: i as u64 * 1_048_576, bytes: 4096 }]);
    }
    boot
}

#[test]
fn a_storage_file_names_or_describes_its_device() {
    let spec = StorageSpec::from_toml(
        "device = \"hdd10k\"\ndisks = 8\nraid = \"5\"\ncache_mib = 512\nqueue_depth = 32\npower_on_interval_s = 1.5\n",
    )
    .expect("valid");
    assert_eq!((spec.disks, spec.raid, spec.cache_bytes, spec.queue_depth), (8, Raid::R5, 512 << 20, Some(32)));
    assert_eq!((spec.power_on_group, spec.power_on_interval_s), (1, 1.5));
    let custom = "device = { name = \"mine\", mb_per_s = 250.0, iops = [[1.0, 200.0], [16.0, 400.0]] }\n";
    assert_eq!(StorageSpec::from_toml(custom).expect("valid").device.iops_at(16), 400.0);
    let err = StorageSpec::from_toml("device = \"floppy\"\n").expect_err("unknown device");
    assert!(err.contains("hdd7200"), "{err}");
    let err = StorageSpec::from_toml("device = \"ssd\"\nraid = \"5\"\n").expect_err("one disk");
    assert!(err.contains("RAID 5 needs at least 3"), "{err}");
    assert!(StorageSpec::from_toml("device = \"ssd\"\nbogus = 1\n").is_err());
    let full = StorageSpec::from_toml("device = \"ssd\"\nclones = \"full\"\n").expect("valid");
    assert_eq!((full.clones, spec.clones), (Clones::Full, Clones::Linked));
}

#[test]
fn the_latency_curve_interpolates_between_its_points() {
    // Its own points, not a built-in class's: those move when their sources do.
    let d = DeviceSpec {
        name: "d".into(),
        iops: vec![(1.0, 80.0), (4.0, 110.0), (16.0, 150.0), (32.0, 165.0)],
        mb_per_s: 150.0,
    };
    assert_eq!(d.iops_at(1), 80.0);
    assert_eq!(d.iops_at(10), 130.0);
    assert_eq!(d.iops_at(100), 165.0);
}

#[test]
fn one_vm_on_an_idle_disk_waits_only_for_each_read() {
    let spec = StorageSpec { vm_queue_depth: 1, ..StorageSpec::single(disk("hdd7200")) };
    let e = simulate_boots(&spec, &[reads(100, 0.0, false)], 1, 0).expect("a boot");
    let one = 1.0 / 80.0 + 4096.0 / 150e6 + ARRAY_LATENCY_S;
    assert!((e.avg_s - 100.0 * one).abs() < 1e-6, "{e:?}");
    // A slow trace is paced by its own gaps, not the disk.
    let e = simulate_boots(&spec, &[reads(100, 0.1, false)], 1, 0).expect("a boot");
    assert!((e.avg_s - (9.9 + one)).abs() < 1e-6, "{e:?}");
}

#[test]
fn vms_sharing_a_disk_queue_and_their_boot_times_spread() {
    let spec = StorageSpec { power_on_group: 1, power_on_interval_s: 1.0, ..StorageSpec::single(disk("hdd7200")) };
    let e = simulate_boots(&spec, &[reads(200, 0.01, false)], 10, 0).expect("boots");
    assert!(e.max_s > e.avg_s && e.avg_s > e.min_s, "{e:?}");
    assert!((e.power_on_s - 9.0).abs() < 1e-9, "{e:?}");
    assert_eq!(e.booted_per_interval.iter().sum::<usize>(), 10);
    assert_eq!(e.boots_s.len(), 10);
}

#[test]
fn boot_times_are_kept_in_power_on_order() {
    // VM 0 boots 200 reads, VM 1 (powered on a second later) 10: the first is the longer boot.
    let spec = StorageSpec { power_on_group: 1, power_on_interval_s: 1.0, ..StorageSpec::single(disk("hdd7200")) };
    let e = simulate_boots(&spec, &[reads(200, 0.0, false), reads(10, 0.0, false)], 2, 0).expect("boots");
    assert_eq!(e.boots_s.len(), 2);
    assert!(e.boots_s[0] > e.boots_s[1], "{e:?}");
    assert_eq!((e.boots_s[0], e.boots_s[1]), (e.max_s, e.min_s));
}

#[test]
fn a_queue_depth_limit_slows_a_wide_array() {
    let array = StorageSpec { disks: 8, ..StorageSpec::single(disk("hdd15k")) };
    let boots = [reads(300, 0.0, false)];
    let open = simulate_boots(&array, &boots, 20, 0).expect("boots");
    let narrow = simulate_boots(&StorageSpec { queue_depth: Some(4), ..array.clone() }, &boots, 20, 0).expect("boots");
    assert!(narrow.avg_s > open.avg_s * 1.5, "{narrow:?} against {open:?}");
}

#[test]
fn shared_reads_hit_the_controller_cache_and_the_read_cache() {
    // One at a time, so that the first has read everything before the next asks.
    let plain = StorageSpec { power_on_group: 1, power_on_interval_s: 5.0, ..StorageSpec::single(disk("hdd7200")) };
    let spec = StorageSpec { cache_bytes: 64 << 20, ..plain.clone() };
    let boots = [reads(200, 0.0, true)];
    let cold = simulate_boots(&plain, &boots, 10, 0).expect("boots");
    let cached = simulate_boots(&spec, &boots, 10, 0).expect("boots");
    assert!(cached.avg_s < cold.avg_s / 3.0, "{cached:?} against {cold:?}");
    let host_cached = simulate_boots(&plain, &boots, 10, 1 << 30).expect("boots");
    assert!(host_cached.avg_s < cold.avg_s / 3.0, "{host_cached:?} against {cold:?}");
}

#[test]
fn full_clones_do_not_share_the_controller_cache() {
    let linked = StorageSpec {
        power_on_group: 1,
        power_on_interval_s: 5.0,
        cache_bytes: 64 << 20,
        ..StorageSpec::single(disk("hdd7200"))
    };
    let full = StorageSpec { clones: Clones::Full, ..linked.clone() };
    let boots = [reads(200, 0.0, true)];
    let shared = simulate_boots(&linked, &boots, 10, 0).expect("boots");
    let own = simulate_boots(&full, &boots, 10, 0).expect("boots");
    assert!(own.avg_s > 3.0 * shared.avg_s, "{own:?} against {shared:?}");
    // Behind overspill's read cache the VMs read the one golden image, whatever the clones.
    let cached = simulate_boots(&full, &boots, 10, 1 << 30).expect("boots");
    assert!(cached.avg_s < own.avg_s / 3.0, "{cached:?} against {own:?}");
    assert!(full.describe().ends_with("full clones"), "{}", full.describe());
}

#[test]
fn a_smaller_write_part_of_the_cache_holds_fewer_writes_back() {
    let mut boot = VmBoot::default();
    for i in 0..2_000u64 {
        boot.push(0.0, [Request { write: true, golden: false, offset: i * 1_048_576, bytes: 4096 }]);
    }
    let half = StorageSpec { cache_bytes: 64 << 20, ..StorageSpec::single(disk("hdd10k")) };
    let small = StorageSpec { write_cache_bytes: Some(1 << 20), ..half.clone() };
    let roomy = simulate_boots(&half, std::slice::from_ref(&boot), 4, 0).expect("boots");
    let tight = simulate_boots(&small, &[boot], 4, 0).expect("boots");
    // 8,000 writes of 4 KiB fit half of 64 MiB, and are answered at once; 1 MiB holds 256.
    assert!(tight.avg_s > 10.0 * roomy.avg_s, "{tight:?} against {roomy:?}");
    assert!(small.describe().ends_with("(1 MiB for writes)"), "{}", small.describe());
    let too_big = StorageSpec { write_cache_bytes: Some(128 << 20), ..half };
    assert!(too_big.check().is_err());
    let file = "device = \"hdd10k\"\ncache_mib = 64\nwrite_cache_mib = 16\n";
    assert_eq!(StorageSpec::from_toml(file).expect("parses").write_cache_bytes, Some(16 << 20));
}

#[test]
fn raid5_small_writes_cost_more_than_raid10() {
    let mut boot = VmBoot::default();
    for i in 0..200u64 {
        boot.push(0.0, [Request { write: true, golden: false, offset: i * 1_048_576, bytes: 4096 }]);
    }
    let r10 = StorageSpec { disks: 4, raid: Raid::R10, ..StorageSpec::single(disk("hdd10k")) };
    let r5 = StorageSpec { raid: Raid::R5, ..r10.clone() };
    let a = simulate_boots(&r10, std::slice::from_ref(&boot), 8, 0).expect("boots");
    let b = simulate_boots(&r5, &[boot], 8, 0).expect("boots");
    assert!(b.avg_s > a.avg_s * 1.5, "{b:?} against {a:?}");
}

/// A cap on VMs booting at once: the first VMs boot as if the disk were theirs (sharing it with
/// a few, not with all), the later ones wait for a slot, every one boots, and the cap holds.
#[test]
fn paced_boots_finish_the_first_vms_sooner_and_every_vm_boots() {
    let spec = StorageSpec { vm_queue_depth: 1, ..StorageSpec::single(disk("hdd7200")) };
    let boots = [reads(200, 0.0, false)];
    let all = simulate_boots(&spec, &boots, 12, 0).expect("boots");
    let paced = simulate_paced_boots(&spec, &boots, 12, 0, Some(3)).expect("boots");
    assert_eq!(paced.booted_per_interval.iter().sum::<usize>(), 12);
    assert_eq!((all.max_booting, paced.max_booting), (None, Some(3)));
    // Alone on the disk, 200 reads take 200 / 80 s; three at a time, each about three times that.
    assert!(paced.min_s < all.min_s / 2.0, "paced first boot {:.1} s, all at once {:.1} s", paced.min_s, all.min_s);
    // The disk does the same work either way, a little less well at a shallower queue: the last
    // boot ends no sooner than all at once, and not much later.
    assert!(paced.max_s >= all.max_s * 0.9 && paced.max_s < all.max_s * 1.5, "{paced:?} against {all:?}");
    // One at a time: each boot alone, back to back.
    let one = simulate_paced_boots(&spec, &boots, 4, 0, Some(1)).expect("boots");
    let alone = simulate_boots(&spec, &boots, 1, 0).expect("a boot");
    assert!((one.max_s - 4.0 * alone.avg_s).abs() < 1e-6, "{one:?} against {alone:?}");
}

#[test]
fn the_host_counters_average_reads_and_writes_over_the_storms_intervals() {
    // 3 reads then 1 write, a second apart, 40 times: 160 requests served from 0 s to about
    // 159 s, so over 11 intervals of 15 s (165 s), the write-back cache taking the writes.
    let mut boot = VmBoot::default();
    for i in 0..160u64 {
        let write = i % 4 == 3;
        boot.push(i as f64, [Request { write, golden: false, offset: i * 1_048_576, bytes: 4096 }]);
    }
    let spec =
        StorageSpec { cache_bytes: 64 << 20, cache_mode: CacheMode::WriteBack, ..StorageSpec::single(disk("hdd7200")) };
    let e = simulate_boots(&spec, &[boot], 1, 0).expect("a boot");
    assert!((e.mean_read_iops - 120.0 / 165.0).abs() < 1e-9, "{e:?}");
    assert!((e.mean_write_iops - 40.0 / 165.0).abs() < 1e-9, "{e:?}");
}

#[test]
fn the_controller_counts_reads_that_follow_on_from_the_read_before() {
    let spec = StorageSpec::single(disk("hdd10k"));
    // One VM reading 4 KiB after 4 KiB: every read but the first continues the one before.
    let mut run = VmBoot::default();
    for i in 0..50u64 {
        run.push(0.0, [Request { write: false, golden: false, offset: i * 4096, bytes: 4096 }]);
    }
    let e = simulate_boots(&spec, &[run], 1, 0).expect("a boot");
    assert_eq!((e.controller_reads, e.sequential_reads), (50, 49));
    // A megabyte apart, none does, in either VM's space.
    let e = simulate_boots(&spec, &[reads(50, 0.0, false)], 2, 0).expect("a boot");
    assert_eq!((e.controller_reads, e.sequential_reads), (100, 0));
}

/// A boot of a million operations served from RAM (no storage request each) at the same
/// instant: done in a loop, where each such operation took a stack frame more and the run
/// overflowed the stack (found by review, session 52).
#[test]
fn a_long_run_of_operations_served_from_ram_is_no_recursion() {
    let mut boot = VmBoot::default();
    for _ in 0..1_000_000 {
        boot.push(0.0, []);
    }
    let estimate = simulate_boots(&StorageSpec::single(disk("ssd")), &[boot], 1, 0).expect("an estimate");
    assert_eq!(estimate.max_s, 0.0, "nothing reached the storage: {estimate:?}");
}
