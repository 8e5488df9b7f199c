//! Per-VM limits at the device seam, against the real server and a real client: fio over NBD
//! drives two VMs at once, one limited live to 1,000 operations per second by `overspill vm
//! limit`, the other not. No timing is asserted: only that the limited VM did at most its rate
//! over the time fio itself measured, plus its burst and the requests in flight, and that the
//! other did more; and that the server's metrics say the limited one waited.

use std::path::Path;
use std::process::Command;

use tempfile::TempDir;

mod common;
use common::{metrics_url, sample, scrape, spawn_tool, Serve};

const RATE: u64 = 1000;
const BURST: u64 = 100;
const IODEPTH: u64 = 8;

fn overspill_vm(control: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .arg("vm")
        .args(args)
        .args(["--control", control.to_str().expect("utf-8")])
        .output()
        .expect("overspill vm");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "overspill vm {args:?}: {text}");
    text
}

/// Operations fio completed, and the time it ran them in (ms), from its JSON report.
fn fio_ops(stdout: &str) -> (u64, u64) {
    let report: serde_json::Value = serde_json::from_str(&stdout[stdout.find('{').expect("JSON")..]).expect("fio JSON");
    let job = &report["jobs"][0];
    let ops =
        job["read"]["total_ios"].as_u64().expect("read ios") + job["write"]["total_ios"].as_u64().expect("write ios");
    (ops, job["job_runtime"].as_u64().expect("runtime"))
}

/// A server over a 64 MiB golden image with a control socket and metrics, and `extra` flags.
struct Setup {
    dir: TempDir,
    socket: std::path::PathBuf,
    control: std::path::PathBuf,
    server: Serve,
}

fn start(extra: &[&str]) -> Setup {
    let dir = TempDir::new().expect("tempdir");
    let golden = dir.path().join("golden.img");
    std::fs::File::create(&golden).and_then(|f| f.set_len(64 << 20)).expect("golden");
    let socket = dir.path().join("nbd.sock");
    let control = dir.path().join("control.sock");
    let listen = format!("unix:{}", socket.display());
    let args = [
        &[
            "--base",
            golden.to_str().expect("utf-8"),
            "--listen",
            &listen,
            "--control",
            control.to_str().expect("utf-8"),
            "--metrics",
            "tcp:127.0.0.1:0",
        ][..],
        extra,
    ]
    .concat();
    let server = Serve::start_named_only(dir.path(), &args, &[], || socket.exists() && control.exists());
    Setup { dir, socket, control, server }
}

impl Setup {
    /// fio over NBD on VM `vm`: random 4 KiB reads and writes at IODEPTH for 3 s, JSON report.
    fn fio(&self, vm: &str) -> std::process::Child {
        let uri = format!("--uri=nbd+unix:///@{vm}?socket={}", self.socket.display());
        spawn_tool(
            self.dir.path(),
            "fio",
            &[
                &format!("--name={vm}"),
                "--ioengine=nbd",
                &uri,
                "--rw=randrw",
                "--bs=4k",
                "--size=32m",
                &format!("--iodepth={IODEPTH}"),
                "--time_based",
                "--runtime=3",
                "--output-format=json",
            ],
        )
    }
}

#[test]
fn a_vm_limited_live_holds_to_its_rate_and_its_neighbour_does_not_wait() {
    let setup = start(&[]);
    let (control, server) = (&setup.control, &setup.server);
    // Set before the VM comes: it gets them at its first request.
    let said = overspill_vm(control, &["limit", "slow", "--iops", &format!("{RATE}:{BURST}")]);
    assert!(said.contains("slow: 1000 ops/s (burst 100), no bytes limit"), "{said}");
    let (slow, fast) = (setup.fio("slow"), setup.fio("fast"));
    let (slow, fast) = (slow.wait_with_output().expect("fio"), fast.wait_with_output().expect("fio"));
    assert!(slow.status.success() && fast.status.success(), "{}", String::from_utf8_lossy(&slow.stderr));
    let (slow_ops, slow_ms) = fio_ops(&String::from_utf8_lossy(&slow.stdout));
    let (fast_ops, fast_ms) = fio_ops(&String::from_utf8_lossy(&fast.stdout));
    eprintln!("slow: {slow_ops} ops in {slow_ms} ms; fast: {fast_ops} ops in {fast_ms} ms");
    // fio's runtime starts after its connection: the server may have let a request or two
    // through before it, which the requests in flight cover.
    let most = RATE * slow_ms / 1000 + BURST + IODEPTH;
    assert!(slow_ops <= most, "the limited VM did {slow_ops} operations in {slow_ms} ms; at most {most}");
    assert!(fast_ops > slow_ops, "the unlimited VM did {fast_ops}, the limited one {slow_ops}");

    let samples = scrape(&metrics_url(server));
    let waited = sample(&samples, "overspill_vm_throttled_seconds_total", &[("vm", "slow")]);
    assert!(waited > 1.0, "the limited VM waited {waited} s in all");
    let fast_listed = samples.iter().any(|((family, labels), _)| {
        family == "overspill_vm_throttled_seconds_total" && labels.get("vm").map(String::as_str) == Some("fast")
    });
    assert!(!fast_listed, "a VM never limited is listed as throttled");

    // Off again, live.
    let said = overspill_vm(control, &["limit", "slow", "--iops", "off"]);
    assert!(said.contains("slow: no ops limit, no bytes limit"), "{said}");
    let refused = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["vm", "limit", "slow", "--iops", "0", "--control", control.to_str().expect("utf-8")])
        .output()
        .expect("overspill vm");
    assert_eq!(refused.status.code(), Some(2), "a rate of 0 is a usage error");
}

/// Two VMs of a named group share the group's 1,000 operations per second (set at `serve`),
/// while a VM outside it is not held; `vm limit --group` changes the group's limit live.
#[test]
fn a_groups_vms_share_its_rate_and_others_do_not_wait() {
    let setup = start(&["--group", "office=desk-*", "--group-limit-iops", &format!("office={RATE}:{BURST}")]);
    let (control, server) = (&setup.control, &setup.server);
    // The two fio runs' windows do not quite coincide: the bound is over the time from the
    // first's start to the last's end, which holds every request of both.
    let started = std::time::Instant::now();
    let runs: Vec<_> = ["desk-1", "desk-2", "other"].into_iter().map(|vm| (vm, setup.fio(vm))).collect();
    let mut done = Vec::new();
    for (vm, run) in runs {
        let out = run.wait_with_output().expect("fio");
        assert!(out.status.success(), "{vm}: {}", String::from_utf8_lossy(&out.stderr));
        done.push(fio_ops(&String::from_utf8_lossy(&out.stdout)));
    }
    let span_ms = started.elapsed().as_millis() as u64;
    let [(ops1, ms1), (ops2, ms2), (other_ops, other_ms)] = done[..] else { panic!("three runs") };
    eprintln!("desk-1: {ops1} ops in {ms1} ms; desk-2: {ops2} in {ms2} ms; other: {other_ops} in {other_ms} ms; all within {span_ms} ms");
    let most = RATE * span_ms / 1000 + BURST + 2 * IODEPTH;
    assert!(ops1 + ops2 <= most, "the group's VMs did {} operations together; at most {most}", ops1 + ops2);
    assert!(ops1 > 0 && ops2 > 0, "both of the group's VMs got through");
    assert!(other_ops > ops1 + ops2, "the VM outside the group did {other_ops}, the group {}", ops1 + ops2);

    let samples = scrape(&metrics_url(server));
    let waited = sample(&samples, "overspill_group_throttled_seconds_total", &[("group", "office")]);
    assert!(waited > 1.0, "the group's requests waited {waited} s in all");
    let image_listed = samples.iter().any(|((family, labels), _)| {
        family == "overspill_group_throttled_seconds_total" && labels.get("group").map(String::as_str) == Some("image:")
    });
    assert!(!image_listed, "the unlimited image group of `other` is listed as throttled");

    let said = overspill_vm(control, &["limit", "office", "--group", "--iops", "off"]);
    assert!(said.contains(r#"group "office": no ops limit, no bytes limit"#), "{said}");
    let said = overspill_vm(control, &["limit", "ofice", "--group", "--iops", "10"]);
    assert!(said.contains("no serve --group names it"), "a typo is said: {said}");
    let said = overspill_vm(control, &["limit", "image:", "--group", "--bandwidth", "100M"]);
    assert!(said.contains(r#"group "image:": no ops limit, 104857600 bytes/s"#), "{said}");
}
