//! Record, replay and plan: traces recorded by a live storm replay against another server, and
//! the planner's engine-only figures equal the live storm's counters.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "common/page.rs"]
mod page;

fn overspill(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_overspill")).args(args).output().expect("run overspill");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "overspill {args:?}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// A server process killed when dropped.
struct Daemon(std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `program` and waits until it accepts connections on `sock`.
fn daemon(program: &str, args: &[&str], sock: &Path) -> Daemon {
    let child = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{program} must be installed (.ci/run installs it): {e}"));
    let daemon = Daemon(child);
    let start = Instant::now();
    while std::os::unix::net::UnixStream::connect(sock).is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "{program} did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    daemon
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("report")).expect("JSON")
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn traces(dir: &Path) -> Vec<String> {
    let mut t: Vec<String> = std::fs::read_dir(dir)
        .expect("trace dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "trace"))
        .map(|p| s(&p))
        .collect();
    t.sort();
    t
}

/// Per-VM mean over a storm report's phases of one tier's reads or writes.
fn storm_tier(report: &Value, tier: &str, field: &str) -> f64 {
    report["configs"][0]["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .flat_map(|p| p["tiers"].as_array().cloned().unwrap_or_default())
        .filter(|t| t["tier"] == tier)
        .map(|t| t[field].as_f64().expect("number"))
        .sum()
}

/// Equal but for float rounding in the per-phase sums (the counts themselves are integers).
#[track_caller]
fn assert_same(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "{what}: planner {a}, live storm {b}");
}

fn plan_mean(row: &Value, field: &str) -> f64 {
    let vms = row["vms"].as_array().expect("vms");
    vms.iter().map(|v| v[field].as_f64().expect("number")).sum::<f64>() / vms.len() as f64
}

#[test]
fn the_planner_reproduces_a_live_storm_and_never_beats_its_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let rec: PathBuf = d.join("traces");
    overspill(&[
        "storm",
        "--workload",
        "win7-vdi-bloated-profile",
        "--vms",
        "3",
        "--modes",
        "ram+disk",
        "--ram",
        "64M",
        "--read-cache",
        "0",
        "--record",
        &s(&rec),
        "--out",
        &s(&d.join("storm")),
        "--work-dir",
        &s(&d.join("work")),
    ]);
    let storm = json(&d.join("storm/report.json"));
    let files = traces(&rec);
    assert_eq!(files.len(), 3, "one trace per VM");

    let mut args = vec!["plan".to_owned()];
    args.extend(files.iter().cloned());
    args.extend(["--ram", "16M,64M,256M,1G", "--read-cache", "0", "--out", &s(&d.join("plan"))].map(str::to_owned));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let text = overspill(&args);
    assert!(text.contains("spill wr LB"), "{text}");
    let plan = json(&d.join("plan/plan.json"));
    let rows = plan["rows"].as_array().expect("rows");
    let at_64m = rows.iter().find(|r| r["ram_bytes"] == 64u64 << 20).expect("64M row");

    // Same engine, same requests, same RAM: the same storage figures as the live storm.
    assert_same(plan_mean(at_64m, "golden_reads"), storm_tier(&storm, "golden image", "reads_per_vm"), "golden reads");
    let spill_writes = plan_mean(at_64m, "spill_writes");
    assert!(spill_writes > 0.0, "the bloated profile overruns 64 MiB");
    assert_same(spill_writes, storm_tier(&storm, "spill", "writes_per_vm"), "spill writes");
    assert_same(plan_mean(at_64m, "spill_reads"), storm_tier(&storm, "spill", "reads_per_vm"), "spill reads");

    // More memory, never more storage traffic; and the engine never beats the lower bound.
    let ops: Vec<f64> = rows.iter().map(|r| r["storage_ops_per_vm"].as_f64().expect("number")).collect();
    assert!(ops.windows(2).all(|w| w[1] <= w[0]), "storage ops by RAM size: {ops:?}");
    for r in rows {
        let bound = r["spill_writes_lower_bound_per_vm"].as_f64().expect("number");
        let engine = r["spill_writes_per_vm"].as_f64().expect("number");
        assert!(bound <= engine, "bound {bound} above the engine's {engine} at {}", r["ram_bytes"]);
    }
    assert!(rows[0]["spill_writes_lower_bound_per_vm"].as_f64() > Some(0.0), "16 MiB forces spilling");
    assert!(std::fs::read_to_string(d.join("plan/plan.html")).expect("html").contains("<svg"));
}

#[test]
fn traces_replay_against_nbdkit_and_the_planner_estimates_boots() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let rec = d.join("traces");
    overspill(&[
        "storm",
        "--workload",
        "linux-boot",
        "--vms",
        "2",
        "--modes",
        "ram+disk",
        "--record",
        &s(&rec),
        "--out",
        &s(&d.join("storm")),
        "--work-dir",
        &s(&d.join("work")),
    ]);
    let files = traces(&rec);
    let sock = d.join("nbdkit.sock");
    let nbdkit = daemon("nbdkit", &["--foreground", "--unix", &s(&sock), "memory", "2G"], &sock);
    let mut args = vec!["replay".to_owned()];
    args.extend(files.iter().cloned());
    args.extend(
        ["--fast", "--target", &format!("nbd+unix:///?socket={}", s(&sock)), "--out", &s(&d.join("replay"))]
            .map(str::to_owned),
    );
    let args_ref: Vec<&str> = args.iter().map(String::as_str).collect();
    overspill(&args_ref);
    drop(nbdkit);
    let replay = json(&d.join("replay/report.json"));
    let guest = storm_tier(&replay, "guest", "total_ops_per_vm");
    let storm = json(&d.join("storm/report.json"));
    assert_eq!(guest, storm_tier(&storm, "guest", "total_ops_per_vm"), "the replay issued every recorded request");
    assert_eq!(replay["configs"][0]["failed_vms"].as_array().map(Vec::len), Some(0));

    let mut args = vec!["plan".to_owned()];
    args.extend(files.iter().cloned());
    args.extend(
        [
            "--ram",
            "64M,256M",
            "--storage",
            "hdd7200",
            "--vms",
            "40",
            "--power-on",
            "2/1s",
            "--boot-max",
            "8",
            "--out",
            &s(&d.join("plan")),
        ]
        .map(str::to_owned),
    );
    let args_ref: Vec<&str> = args.iter().map(String::as_str).collect();
    let text = overspill(&args_ref);
    let plan = json(&d.join("plan/plan.json"));
    let with_cache = plan["rows"][0]["boot"]["avg_s"].as_f64().expect("estimate");
    let without = plan["boot_without_cache"]["avg_s"].as_f64().expect("estimate");
    assert!(with_cache < without, "the cache shortens the boot storm: {with_cache} vs {without}\n{text}");
    assert!(with_cache >= 19.0, "no VM boots faster than its own recorded boot");
    // Twenty groups of two, a second apart; queued VMs finish at different times.
    let boot = &plan["boot_without_cache"];
    assert_eq!(boot["power_on_s"].as_f64(), Some(19.0), "{boot}");
    assert!(boot["max_s"].as_f64() > boot["min_s"].as_f64(), "{boot}");
    let booted: u64 = boot["booted_per_interval"].as_array().expect("list").iter().filter_map(|n| n.as_u64()).sum();
    assert_eq!(booted, 40, "{boot}");
    // Paced to 8 at once (--boot-max): every VM still boots, the curve is drawn beside the
    // unpaced one, and the first VMs, sharing the disk with fewer, boot no slower.
    let paced = &plan["boot_without_cache_paced"];
    assert_eq!(paced["max_booting"].as_u64(), Some(8), "{paced}");
    let booted: u64 = paced["booted_per_interval"].as_array().expect("list").iter().filter_map(|n| n.as_u64()).sum();
    assert_eq!(booted, 40, "{paced}");
    assert!(paced["min_s"].as_f64() <= boot["min_s"].as_f64(), "{paced} against {boot}");
    assert!(plan["rows"][1]["boot_paced"]["avg_s"].as_f64().is_some(), "each RAM size paced too");
    assert!(text.contains("no cache, 8 at once"), "{text}");
    let page = std::fs::read_to_string(d.join("plan/plan.html")).expect("plan page");
    assert!(page.contains("no cache, 8 at once"), "the booted chart's legend names the paced curve");

    // Without overspill, linked clones share the golden image's blocks in the array's cache; full
    // clones each read their own copy, which the cache cannot share.
    let no_cache_avg = |clones: &str| {
        let out = d.join(format!("plan-{clones}"));
        let mut args = vec!["plan".to_owned()];
        args.extend(files.iter().cloned());
        args.extend(
            [
                "--ram",
                "256M",
                "--storage",
                "hdd7200",
                "--controller-cache",
                "256M",
                "--write-cache",
                "64M",
                "--clones",
                clones,
                "--vms",
                "20",
            ]
            .map(str::to_owned),
        );
        args.extend(["--out".to_owned(), s(&out)]);
        let args_ref: Vec<&str> = args.iter().map(String::as_str).collect();
        overspill(&args_ref);
        let plan = json(&out.join("plan.json"));
        assert!(plan["boot_without_cache"]["storage"]
            .as_str()
            .is_some_and(|d| d.contains("full") == (clones == "full") && d.contains("(64 MiB for writes)")));
        plan["boot_without_cache"]["avg_s"].as_f64().expect("estimate")
    };
    let (linked, full) = (no_cache_avg("linked"), no_cache_avg("full"));
    assert!(full > linked, "full clones boot no slower than linked ones: {full} s against {linked} s");

    // The page: storage, spill and the two boot charts, each its own SVG; a group per asked RAM
    // size, named as asked; the boot estimates in a table; and a browser draws the bars.
    let html = std::fs::read_to_string(d.join("plan/plan.html")).expect("plan.html");
    assert_eq!(page::parsed_svgs(&html), 4, "storage, spill, boot times, VMs booted");
    for needle in
        [">64 MiB<", ">256 MiB<", ">no cache<", "Boot storm estimate: 40 VMs", "time taken to issue power-ons</th>"]
    {
        assert!(html.contains(needle), "the plan page lacks {needle:?}");
    }
    let pixels = page::rendered_pixels(&d.join("plan/plan.html"), &d.join("plan.png"), 1100, 1800);
    let golden_green = pixels.iter().filter(|&&p| p == [44, 160, 44]).count();
    assert!(golden_green > 500, "the golden-image reads' bars are not on the screenshot ({golden_green} pixels)");
}

#[test]
fn serve_records_what_a_real_client_asked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let golden = d.join("golden.img");
    std::fs::File::create(&golden).and_then(|f| f.set_len(64 << 20)).expect("golden image");
    let sock = d.join("s.sock");
    let rec = d.join("rec");
    let listen = format!("unix:{}", s(&sock));
    let (spill, shared, memory) = (s(&d.join("spill")), s(&d.join("shared")), s(&d.join("memory")));
    let server = daemon(
        env!("CARGO_BIN_EXE_overspill"),
        &["serve", "--base", &s(&golden), "--listen", &listen, "--ram-floor", "0", "--spill-dir", &spill]
            .into_iter()
            .chain(["--shared-dir", &shared, "--memory-dir", &memory, "--record", &s(&rec)])
            .collect::<Vec<_>>(),
        &sock,
    );
    let uri = format!("nbd+unix:///@vm-rec?socket={}", s(&sock));
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 7 64k 128k", "-c", "read 64k 128k", "-c", "discard 64k 64k"])
        .args(["-c", "write -z 1m 8k", "-c", "flush", &uri])
        .output()
        .expect("qemu-io must be installed");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The trace is complete once the VM's overlay is dropped.
    let start = Instant::now();
    let trace = loop {
        let files = traces(&rec);
        if let Some(t) = files.first().and_then(|f| overspill_block::trace::Trace::read(Path::new(f)).ok()) {
            if t.records.iter().any(|r| r.kind == overspill_block::GuestOp::Flush) {
                break t;
            }
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no complete trace in {}", s(&rec));
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(server);
    use overspill_block::GuestOp::*;
    assert_eq!(trace.header.vm, "vm-rec");
    assert_eq!(trace.header.disk_bytes, 64 << 20);
    let seen: Vec<_> = trace.records.iter().map(|r| (r.kind, r.offset, r.length)).collect();
    for expected in [(Write, 65536, 131072), (Read, 65536, 131072), (Trim, 65536, 65536), (Zero, 1 << 20, 8192)] {
        assert!(seen.contains(&expected), "{expected:?} not in {seen:?}");
    }
    assert!(trace.records.windows(2).all(|w| w[0].time_us <= w[1].time_us), "times only go forward");
}
