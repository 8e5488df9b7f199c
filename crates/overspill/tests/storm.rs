//! `overspill storm` end to end: the real binary, in-process servers for every mode, real NBD
//! connections; and the storm client against nbdkit and qemu-nbd.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "common/page.rs"]
mod page;

fn overspill() -> Command {
    Command::new(env!("CARGO_BIN_EXE_overspill"))
}

fn run_storm(args: &[&str], out: &Path, work: &Path) -> Value {
    let output = overspill()
        .arg("storm")
        .args(args)
        .arg("--out")
        .arg(out)
        .arg("--work-dir")
        .arg(work)
        .output()
        .expect("run overspill storm");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "storm failed: {stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("== boot =="), "tables printed: {stdout}");
    let html = std::fs::read_to_string(out.join("report.html")).expect("report.html");
    assert!(html.contains("<svg") && html.contains("IO ops / VM"), "HTML has charts and tables");
    // Each configuration's server socket goes with it.
    let sockets: Vec<_> = std::fs::read_dir(work)
        .expect("work dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "sock"))
        .collect();
    assert!(sockets.is_empty(), "sockets left in the work directory: {sockets:?}");
    serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).expect("report.json")).expect("JSON parses")
}

fn config<'a>(report: &'a Value, label: &str) -> &'a Value {
    report["configs"]
        .as_array()
        .expect("configs")
        .iter()
        .find(|c| c["label"] == label)
        .unwrap_or_else(|| panic!("no configuration {label} in {}", report["configs"]))
}

fn tier<'a>(config: &'a Value, phase: usize, name: &str) -> &'a Value {
    config["phases"][phase]["tiers"].as_array().expect("tiers").iter().find(|t| t["tier"] == name).expect("tier")
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn every_mode_accounts_for_every_block() {
    let dir = tempfile::tempdir().expect("tempdir");
    let report = run_storm(
        &["--workload", "linux-boot", "--vms", "3", "--modes", "shared,disk,ram,ram+disk", "--ram", "4M,256M"],
        &dir.path().join("out"),
        &dir.path().join("work"),
    );
    let labels: Vec<&str> =
        report["configs"].as_array().expect("configs").iter().filter_map(|c| c["label"].as_str()).collect();
    assert_eq!(labels, ["shared", "disk", "ram 4M", "ram 256M", "ram+disk 4M", "ram+disk 256M"]);
    for c in report["configs"].as_array().expect("configs") {
        let label = c["label"].as_str().unwrap_or_default();
        assert_eq!(c["failed_vms"].as_array().map(Vec::len), Some(0), "{label}: {}", c["failed_vms"]);
        let b = &c["blocks"];
        let served: u64 = ["read_ram", "read_spill", "read_golden", "read_zero", "read_cache_file"]
            .iter()
            .map(|k| b[k].as_u64().expect("count"))
            .sum();
        assert_eq!(served, b["guest_read_blocks"].as_u64().expect("count"), "{label}: each read block served once");
        let landed: u64 =
            ["write_ram", "write_spill", "write_cache_file"].iter().map(|k| b[k].as_u64().expect("count")).sum();
        let errors = c["phases"][0]["errors"].as_u64().expect("errors");
        let guest_writes = b["guest_write_blocks"].as_u64().expect("count");
        if errors == 0 {
            assert_eq!(landed, guest_writes, "{label}: each written block lands once");
        } else {
            assert!(landed >= guest_writes, "{label}: acknowledged blocks all landed");
        }
        // The guest asked the same of every configuration.
        assert_eq!(f(&tier(c, 0, "guest")["total_ops_per_vm"]), 2900.0, "{label}");
    }
    let spill = |label: &str| tier(config(&report, label), 0, "spill").clone();
    assert_eq!(f(&spill("ram+disk 256M")["writes_per_vm"]), 0.0, "a target above the working set never spills");
    let small = spill("ram+disk 4M");
    assert!(f(&small["writes_per_vm"]) > 0.0, "a 4 MiB target spills a ~9 MiB working set");
    assert_eq!(f(&small["write_bytes_per_vm"]), f(&small["writes_per_vm"]) * 2097152.0, "every spill write is 2 MiB");
    assert!(config(&report, "ram 4M")["phases"][0]["enospc"].as_u64() > Some(0), "ram-only overflows to ENOSPC");
    assert_eq!(config(&report, "ram 256M")["phases"][0]["errors"].as_u64(), Some(0));
    assert!(f(&tier(config(&report, "shared"), 0, "shared storage")["writes_per_vm"]) > 0.0);
    assert!(f(&tier(config(&report, "disk"), 0, "local cache disk")["writes_per_vm"]) > 0.0);
    // Boot reads go to the golden image in every mode, through its shared read cache but in
    // mode shared, which stands for MCS: there every VM reads the golden image from storage.
    for label in &labels {
        assert!(f(&tier(config(&report, label), 0, "read cache")["reads_per_vm"]) > 2000.0, "{label}");
        assert!(f(&tier(config(&report, label), 0, "golden image")["reads_per_vm"]) > 0.0, "{label}");
    }
    let golden_bytes = |label: &str| f(&tier(config(&report, label), 0, "golden image")["read_bytes_per_vm"]);
    assert!(
        golden_bytes("shared") > 2.0 * golden_bytes("disk"),
        "MCS reads its golden blocks once per VM ({}), the cached modes once for all three ({})",
        golden_bytes("shared"),
        golden_bytes("disk")
    );
}

/// Every VM of a linux-boot storm reads the same blocks: with the shared read cache, storage
/// sees one VM's worth of reads whether one VM boots or four; without it, four times as many.
#[test]
fn the_shared_read_cache_reads_each_golden_block_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage_reads = |vms: &str, read_cache: &str| -> (f64, f64) {
        let report = run_storm(
            &["--workload", "linux-boot", "--vms", vms, "--modes", "ram+disk", "--read-cache", read_cache],
            &dir.path().join(format!("out-{vms}-{read_cache}")),
            &dir.path().join("work"),
        );
        let c = &report["configs"][0];
        let n: f64 = vms.parse().expect("number");
        (f(&tier(c, 0, "read cache")["reads_per_vm"]) * n, f(&tier(c, 0, "golden image")["read_bytes_per_vm"]) * n)
    };
    let (asked_1, fetched_1) = storage_reads("1", "1G");
    let (asked_4, fetched_4) = storage_reads("4", "1G");
    let (_, uncached_1) = storage_reads("1", "0");
    let (_, uncached_4) = storage_reads("4", "0");
    assert_eq!(asked_4, 4.0 * asked_1, "every VM asks the same");
    // Two VMs missing the same chunk at once may both fetch it; allow a little for that.
    assert!(fetched_4 <= fetched_1 * 1.25, "4 VMs fetched {fetched_4} bytes, 1 VM {fetched_1}");
    assert_eq!(uncached_4, 4.0 * uncached_1, "without the cache storage reads every VM's bytes");
    assert!(uncached_4 > fetched_4, "the cache saves bytes at four VMs: {uncached_4} vs {fetched_4}");
}

struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for_socket(path: &Path) {
    let start = Instant::now();
    while std::os::unix::net::UnixStream::connect(path).is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "{} never came up", path.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn spawn(program: &str, args: &[&str]) -> Peer {
    let child = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{program} must be installed (.ci/run installs it): {e}"));
    Peer(child)
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

#[test]
fn the_storm_client_drives_nbdkit_and_qemu_nbd() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let nbdkit_sock: PathBuf = d.join("nbdkit.sock");
    let _nbdkit = spawn("nbdkit", &["--foreground", "--unix", &s(&nbdkit_sock), "memory", "2G"]);
    let base = d.join("base.raw");
    std::fs::File::create(&base).and_then(|f| f.set_len(2 << 30)).expect("base image");
    let overlay = d.join("overlay.qcow2");
    let status = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b", &s(&base), &s(&overlay)])
        .status()
        .expect("qemu-img must be installed");
    assert!(status.success());
    let qemu_sock = d.join("qemu.sock");
    let _qemu = spawn("qemu-nbd", &["--persistent", "--shared=4", "-f", "qcow2", "-k", &s(&qemu_sock), &s(&overlay)]);
    // An overspill server as it runs by default, unnamed VMs read-only: each storm VM named by
    // `{n}`, its number.
    let overspill_sock = d.join("overspill.sock");
    let server_log = d.join("overspill.log");
    let _overspill = Peer(
        overspill()
            .args(["serve", "--base", &s(&base), "--listen", &format!("unix:{}", s(&overspill_sock))])
            .args(["--ram-floor", "0", "--spill-dir", &s(&d.join("spill")), "--memory-dir", &s(&d.join("memory"))])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&server_log).expect("server log"))
            .spawn()
            .expect("overspill serve"),
    );
    wait_for_socket(&nbdkit_sock);
    wait_for_socket(&qemu_sock);
    wait_for_socket(&overspill_sock);
    let targets = [
        format!("nbd+unix:///?socket={}", s(&nbdkit_sock)),
        format!("nbd+unix:///?socket={}", s(&qemu_sock)),
        format!("nbd+unix:///@storm-{{n}}?socket={}", s(&overspill_sock)),
    ];
    let report = run_storm(
        &["--workload", "linux-boot", "--vms", "3"]
            .into_iter()
            .chain(targets.iter().flat_map(|t| ["--target", t.as_str()]))
            .collect::<Vec<_>>(),
        &d.join("out"),
        &d.join("work"),
    );
    let log = std::fs::read_to_string(&server_log).expect("server log");
    for vm in ["storm-0", "storm-1", "storm-2"] {
        assert!(log.contains(&format!("vm=\"{vm}\"")), "{vm} is a named VM of the server:\n{log}");
    }
    let configs = report["configs"].as_array().expect("configs");
    assert_eq!(configs.len(), 3);
    for c in configs {
        assert_eq!(c["failed_vms"].as_array().map(Vec::len), Some(0), "{}: {}", c["label"], c["failed_vms"]);
        assert_eq!(c["phases"][0]["errors"].as_u64(), Some(0), "{}", c["label"]);
        assert_eq!(f(&tier(c, 0, "guest")["total_ops_per_vm"]), 2900.0);
        assert_eq!(c["has_storage"], false, "outside servers have no engine counters");
    }
}

/// The report page in a real browser: headless Chromium renders it, and the screenshot shows
/// the bars (the shared-storage red, the golden-image green and the seeds' grey are all on it)
/// and the failed configuration's red band and banner; every SVG chart on the page is
/// well-formed XML; the page has the seeds' figures beside this run's in their unit, the change
/// against the MCS baseline, run metadata and real tables. `ram 32M` runs out of RAM (ENOSPC):
/// it is marked failed at the top and in its charts, and never gets a "vs shared" figure.
#[test]
fn the_report_page_renders_in_a_real_browser() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out");
    let report = run_storm(
        &[
            "--workload",
            "win7-vdi",
            "--vms",
            "3",
            "--modes",
            "shared,ram,ram+disk",
            "--ram",
            "32M",
            "--logon-interval",
            "1",
        ],
        &out,
        &dir.path().join("work"),
    );
    assert_eq!(config(&report, "ram+disk 32M")["mode"], "ram+disk");
    assert_eq!(report["seed_platform"], "win7-hyperv-sata7200");
    let failed = config(&report, "ram 32M");
    let errors: u64 =
        failed["phases"].as_array().expect("phases").iter().map(|p| p["errors"].as_u64().expect("errors")).sum();
    assert!(errors > 0, "ram 32M got no errors: the test needs a configuration that fails");
    let html = std::fs::read_to_string(out.join("report.html")).expect("report.html");
    for needle in [
        "Against the seeds, like for like",
        "seeds' figure",
        "× the seed",
        "vs shared",
        "baseline (MCS)",
        "The golden image's storage",
        "the seeds' nearest RAM size, not this one",
        "<table class=\"meta\">",
        "<th>IOPS / VM</th>",
        "seed 000 figure",
        "Against the seeds, in both units",
        "<th>as the seeds counted</th>",
        // Which seed figures the model was fitted on, and which it predicts.
        "<th>the model and this row</th>",
        "fitted (win7-vdi's event-log share)",
        "held out (within 2×)",
        "Reads and writes at each storage tier",
        "<tr><td>ram+disk 32M</td><td>read cache</td>",
        "<div class=\"failed\"><b>Failed configurations</b>",
        "<li><b>ram 32M</b>:",
        &format!("FAILED ({errors} errors)"),
        "ram 32M (FAILED)",
    ] {
        assert!(html.contains(needle), "the page lacks {needle:?}");
    }
    // `shared` has no read cache: its golden reads are not shown twice.
    assert!(!html.contains("<tr><td>shared</td><td>read cache</td>"), "a read-cache row for shared");
    // Only the good configurations get a change against shared: one per phase.
    assert_eq!(html.matches("% vs shared").count(), 3, "a failed configuration was given a result");
    let svgs = page::parsed_svgs(&html);
    assert_eq!(
        svgs, 16,
        "per phase the seeds' chart, the write side, the golden image, read/write and a timeline; the boot curve"
    );

    let pixels = page::rendered_pixels(&out.join("report.html"), &dir.path().join("report.png"), 1300, 4200);
    let count = |rgb: [u8; 3]| pixels.iter().filter(|&&p| p == rgb).count();
    for (name, rgb) in [
        ("shared storage", [214, 39, 40]),
        ("golden image", [44, 160, 44]),
        ("seeds' figure", [190, 190, 190]),
        ("failed band", [255, 215, 215]),
    ] {
        assert!(count(rgb) > 500, "{name} bars are not on the screenshot ({} pixels)", count(rgb));
    }
}

/// `--boot-max 1`: each configuration runs again with the server booting one VM at a time, and
/// the report says when each VM's boot ran: paced, no two overlap (without the cap they do),
/// every VM boots, and the report's boot curve says which configuration was paced.
#[test]
fn a_paced_storm_boots_one_vm_at_a_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out");
    let report = run_storm(
        &["--workload", "linux-boot", "--vms", "4", "--modes", "ram+disk", "--ram", "64M", "--boot-max", "1"],
        &out,
        &dir.path().join("work"),
    );
    let windows = |label: &str| -> Vec<(f64, f64)> {
        let c = config(&report, label);
        let all = c["boot_windows_s"].as_array().unwrap_or_else(|| panic!("boot windows of {label}: {c}"));
        let mut windows: Vec<(f64, f64)> = all.iter().map(|w| (f(&w[0]), f(&w[1]))).collect::<Vec<_>>();
        windows.sort_by(|a, b| a.0.total_cmp(&b.0));
        windows
    };
    let overlapping = |windows: &[(f64, f64)]| windows.windows(2).filter(|pair| pair[1].0 < pair[0].1).count();
    let (all, paced) = (windows("ram+disk 64M"), windows("ram+disk 64M, boot-max 1"));
    assert_eq!((all.len(), paced.len()), (4, 4), "every VM booted");
    assert_eq!(overlapping(&paced), 0, "one boot at a time: {paced:?}");
    assert!(overlapping(&all) > 0, "without the cap the boots overlap: {all:?}");
    let html = std::fs::read_to_string(out.join("report.html")).expect("report.html");
    assert!(html.contains("VMs booted over time") && html.contains("boot-max N"), "the boot curve is drawn");
}

/// The fairness run (`--copiers`): the storm again beside a copying VM, unlimited and limited;
/// the limited copier moved no more than its limit allows over the time it ran (each MiB it
/// copies is a MiB read and a MiB written, both counted), the unlimited one more, and the
/// booting VMs' reads are reported.
#[test]
fn a_fairness_run_reports_the_copiers_beside_the_boots() {
    let dir = tempfile::tempdir().expect("tempdir");
    let report = run_storm(
        &[
            "--workload",
            "linux-boot",
            "--vms",
            "2",
            "--modes",
            "ram+disk",
            "--ram",
            "64M",
            "--copiers",
            "1",
            "--copier-limit",
            "4M:4M",
        ],
        &dir.path().join("out"),
        &dir.path().join("work"),
    );
    let copied = |label: &str| {
        let c = config(&report, label);
        assert!(f(&c["boot_read_ms"]["p99_ms"]) >= 0.0 && f(&c["boot_read_ms"]["reads"]) > 0.0, "{c}");
        let copiers = &c["copiers"];
        (f(&copiers["bytes_copied"]), f(&copiers["mib_per_s"]))
    };
    let (unlimited, _) = copied("ram+disk 64M, 1 copying");
    let (limited, mib_per_s) = copied("ram+disk 64M, 1 copying at 4M/s");
    let ran_s = limited / (mib_per_s * 1048576.0);
    let mib = 1048576.0;
    let allowed = (4.0 * mib * ran_s + 4.0 * mib + 2.0 * mib) / 2.0;
    assert!(limited <= allowed, "the limited copier copied {limited} bytes in {ran_s:.2} s; at most {allowed}");
    assert!(unlimited > limited, "the unlimited copier copied {unlimited}, the limited one {limited}");
    assert!(config(&report, "ram+disk 64M")["copiers"].is_null(), "the storm alone has no copiers");
    // The page says it beside each configuration's boots, in words.
    let html = std::fs::read_to_string(dir.path().join("out").join("report.html")).expect("report.html");
    assert!(html.contains("copying VMs (unlimited) moved"), "the unlimited copier on the page");
    assert!(html.contains("copying VMs (limited to 4.0 MiB/s each) moved"), "the limited copier on the page");
}
