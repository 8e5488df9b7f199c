//! The built-in profiles against the seeds' published figures (`data/seed-iops.csv`, a copy
//! of the project's calibration data with its README, so that a clone alone passes its tests):
//! generated request counts, read shares and volumes within ±10%.

use overspill_storm::profile::{Op, OpKind, Workload};

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
                OpKind::Read => {
                    t.reads += 1.0;
                    t.read_bytes += f64::from(op.len);
                    if op.len <= 4096 {
                        t.small_reads += 1.0;
                    }
                }
                OpKind::Write => {
                    t.writes += 1.0;
                    t.write_bytes += f64::from(op.len);
                }
                OpKind::Flush => t.flushes += 1.0,
                OpKind::Trim | OpKind::Zero => {}
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
