//! The fleet plan: one host's worth of VMs through the engine, the golden store's load from it.

use overspill_block::GuestOp;
use overspill_engine::WriteCacheMode;
use overspill_storm::driver::RunPlan;
use overspill_storm::fleet::{plan_fleet, FleetOptions, GoldenStore};
use overspill_storm::{StormConfig, Workload};

fn boots(k: usize) -> RunPlan {
    let w = Workload::built_in("win7-vdi").expect("built in");
    let config = StormConfig {
        vms: k,
        boot_interval_s: 0.0,
        logon_interval_s: 0.0,
        speed: None,
        workload_seed: 5,
        bucket_s: 10,
    };
    RunPlan::from_workload(&w, &config)
}

/// The golden-image bytes VM `vm`'s boot reads when nothing caches them: each 4 KiB block of a
/// read that the VM does not hold.
fn golden_bytes_of(plan: &RunPlan, vm: usize) -> u64 {
    let mut own = std::collections::HashSet::new();
    let mut bytes = 0;
    for op in &plan.ops[vm][0] {
        let blocks = op.offset / 4096..(op.offset + u64::from(op.len)).div_ceil(4096);
        match op.kind {
            GuestOp::Read => bytes += 4096 * blocks.filter(|b| !own.contains(b)).count() as u64,
            GuestOp::Write | GuestOp::Zero => own.extend(blocks),
            GuestOp::Trim => blocks.for_each(|b| {
                own.remove(&b);
            }),
            GuestOp::Flush => {}
        }
    }
    bytes
}

#[test]
fn host_caches_cut_what_the_golden_store_serves() {
    let options = FleetOptions {
        hosts: 3,
        vms_per_host: 6,
        golden: GoldenStore::Rbd,
        mode: WriteCacheMode::RamDisk,
        ram_bytes: 8 << 20,
        read_cache_bytes: 1 << 30,
        // Boots take 120 s: 30 s apart, at most 4 of a host's 6 VMs boot at once.
        stagger_s: 30.0,
        interval_s: 10,
    };
    let plan = plan_fleet(&boots(3), &options).expect("plans");
    println!("{}", overspill_storm::fleet::markdown(&plan));
    assert_eq!(plan.store.len(), 6, "two storms × three cachings");
    for storm in plan.store.chunks(3) {
        let [none, cache, tier] = [&storm[0], &storm[1], &storm[2]];
        // Every VM reads the same system files: one host's cache serves most of them, in a
        // few large fetches. (Bytes can grow: a VM's scattered private reads each fetch a whole
        // 256 KiB chunk; the local tier fetches each chunk once.)
        assert!(cache.peak_iops * 3.0 < none.peak_iops, "{storm:?}");
        assert!(tier.avg_iops <= cache.avg_iops, "{storm:?}");
        assert!(cache.total_bytes >= tier.total_bytes && tier.total_bytes < none.total_bytes, "{storm:?}");
        assert!(none.peak_iops >= none.avg_iops && none.peak_mib_s >= none.avg_mib_s, "{storm:?}");
    }
    // Spreading the power-ons lowers the peak the store sees without the caches: 4 boots at
    // once at most instead of 6 (and the boots' own rates vary, hence 0.8, not 4/6).
    assert!(plan.store[3].peak_iops < 0.8 * plan.store[0].peak_iops, "{:?}", plan.store);
    // Without a read cache the store serves exactly the blocks no VM holds when it reads them,
    // counted here from the requests alone (a block is the VM's once written or zeroed, the
    // golden image's again once trimmed), for every host: the engine's golden reads and the
    // plan's sum over hosts against an independent count.
    let golden_bytes: u64 = (0..options.vms_per_host).map(|vm| golden_bytes_of(&boots(3), vm % 3)).sum();
    for none in [&plan.store[0], &plan.store[3]] {
        assert_eq!(none.total_bytes, options.hosts as u64 * golden_bytes, "{none:?}");
    }
    // 8 MiB of RAM per VM does not hold a win7 boot's writes: the host needs a spill disk.
    assert!(plan.host.spill_bytes > 0 && plan.host.spill_peak_iops > 0.0, "{:?}", plan.host);
    assert!(plan.host.ram_bytes > (1 << 30) && plan.host.ram_bytes <= 6 * (16 << 20) + (1 << 30), "{:?}", plan.host);
    assert_eq!(plan.host.guest_errors, 0);
    assert!(!overspill_storm::fleet::markdown(&plan).contains("FAILED"));
    // A file store has no local tier.
    let file = plan_fleet(&boots(3), &FleetOptions { golden: GoldenStore::File, ..options.clone() }).expect("plans");
    assert_eq!(file.store.len(), 4);
    // In RAM alone 8 MiB does not hold a boot's writes: the guests get errors, and the plan
    // says it failed before any figure.
    let ram = FleetOptions { mode: WriteCacheMode::Ram, ..options };
    let failed = plan_fleet(&boots(3), &ram).expect("plans");
    assert!(failed.host.guest_errors > 0, "{:?}", failed.host);
    assert!(
        overspill_storm::fleet::markdown(&failed).starts_with("**FAILED: "),
        "{}",
        overspill_storm::fleet::markdown(&failed)
    );
}
