//! The fleet plan: one host's worth of VMs through the engine, the golden store's load from it.

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

#[test]
fn host_caches_cut_what_the_golden_store_serves() {
    let options = FleetOptions {
        hosts: 3,
        vms_per_host: 6,
        golden: GoldenStore::Rbd,
        mode: WriteCacheMode::RamDisk,
        ram_bytes: 8 << 20,
        read_cache_bytes: 1 << 30,
        stagger_s: 10.0,
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
    // Spreading the power-ons lowers the peak the store sees without the caches.
    assert!(plan.store[3].peak_iops < plan.store[0].peak_iops, "{:?}", plan.store);
    // The hosts add up: a fleet of one host sees a third of the load.
    let one = plan_fleet(&boots(3), &FleetOptions { hosts: 1, ..options.clone() }).expect("plans");
    assert!((plan.store[0].peak_iops - 3.0 * one.store[0].peak_iops).abs() < 1e-6);
    assert_eq!(plan.store[1].total_bytes, 3 * one.store[1].total_bytes);
    // 8 MiB of RAM per VM does not hold a win7 boot's writes: the host needs a spill disk.
    assert!(plan.host.spill_bytes > 0 && plan.host.spill_peak_iops > 0.0, "{:?}", plan.host);
    assert!(plan.host.ram_bytes > (1 << 30) && plan.host.ram_bytes <= 6 * (16 << 20) + (1 << 30), "{:?}", plan.host);
    // A file store has no local tier.
    let file = plan_fleet(&boots(3), &FleetOptions { golden: GoldenStore::File, ..options }).expect("plans");
    assert_eq!(file.store.len(), 4);
}
