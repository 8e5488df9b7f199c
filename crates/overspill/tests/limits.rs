//! Per-VM limits at the device seam, against the real server and a real client: fio over NBD
//! drives three VMs at once, one limited by name at `serve`, one by `overspill vm limit` before
//! it connects, both to 1,000 operations per second, the third not. No timing is asserted: only
//! that each limited VM did at most its rate over the time fio itself measured, plus its burst
//! and the requests in flight, and that the other did more; and that the server's metrics say
//! the limited ones waited, and had requests queued at their limit while fio ran.

use std::path::Path;
use std::process::Command;

use tempfile::TempDir;

mod common;
use common::{metrics_url, run_ok, sample, scrape, spawn_tool, Serve};

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
    /// The server's flags, for the next server.
    args: Vec<String>,
}

fn start(extra: &[&str]) -> Setup {
    start_over(None, extra)
}

/// Like [`start`], over a golden image of `fill` bytes throughout (none: a sparse one, which
/// reads as holes and costs the storage nothing).
fn start_over(fill: Option<u8>, extra: &[&str]) -> Setup {
    let dir = TempDir::new().expect("tempdir");
    let golden = dir.path().join("golden.img");
    match fill {
        Some(byte) => std::fs::write(&golden, vec![byte; 64 << 20]).expect("golden"),
        None => std::fs::File::create(&golden).and_then(|f| f.set_len(64 << 20)).expect("golden"),
    }
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
    let args = args.iter().map(|arg| arg.to_string()).collect();
    Setup { dir, socket, control, server, args }
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
fn vms_limited_by_name_before_they_connect_hold_to_their_rate_and_their_neighbour_does_not_wait() {
    let setup = start(&["--vm-limit-iops", &format!("slow={RATE}:{BURST}")]);
    let (control, server) = (&setup.control, &setup.server);
    // Set before the VM comes: it gets them at its first request.
    let said = overspill_vm(control, &["limit", "slow-live", "--iops", &format!("{RATE}:{BURST}")]);
    assert!(said.contains("slow-live: 1000 ops/s (burst 100), no bytes limit"), "{said}");
    let said = overspill_vm(control, &["limit", "slow"]);
    assert!(said.contains("slow: 1000 ops/s (burst 100), no bytes limit"), "serve --vm-limit-iops: {said}");
    let mut runs: Vec<_> = ["slow", "slow-live", "fast"].into_iter().map(|vm| setup.fio(vm)).collect();
    // While fio runs, each limited VM has a request waiting at its limit most of the time.
    let mut queued = [0.0f64; 2];
    while runs[..2].iter_mut().any(|run| run.try_wait().expect("fio").is_none()) {
        let samples = scrape(&metrics_url(server));
        for (most, vm) in queued.iter_mut().zip(["slow", "slow-live"]) {
            // Not listed until the VM's first request.
            let level = samples
                .iter()
                .filter(|((family, labels), _)| {
                    family == "overspill_vm_throttled_requests" && labels.get("vm").map(String::as_str) == Some(vm)
                })
                .map(|(_, v)| *v)
                .fold(0.0, f64::max);
            *most = most.max(level);
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let outputs: Vec<_> = runs.into_iter().map(|run| run.wait_with_output().expect("fio")).collect();
    for out in &outputs {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let [(slow_ops, slow_ms), (live_ops, live_ms), (fast_ops, fast_ms)] =
        outputs.iter().map(|out| fio_ops(&String::from_utf8_lossy(&out.stdout))).collect::<Vec<_>>()[..]
    else {
        panic!("three runs")
    };
    eprintln!("slow: {slow_ops} ops in {slow_ms} ms; slow-live: {live_ops} in {live_ms} ms; fast: {fast_ops} in {fast_ms} ms; queued at most {queued:?}");
    // fio's runtime starts after its connection: the server may have let a request or two
    // through before it, which the requests in flight cover.
    for (vm, ops, ms) in [("slow", slow_ops, slow_ms), ("slow-live", live_ops, live_ms)] {
        let most = RATE * ms / 1000 + BURST + IODEPTH;
        assert!(ops <= most, "{vm}, limited, did {ops} operations in {ms} ms; at most {most}");
        assert!(fast_ops > ops, "the unlimited VM did {fast_ops}, {vm} {ops}");
    }
    assert!(queued.iter().all(|&q| q >= 1.0), "requests queued at the limits: {queued:?}");

    let samples = scrape(&metrics_url(server));
    for vm in ["slow", "slow-live"] {
        let waited = sample(&samples, "overspill_vm_throttled_seconds_total", &[("vm", vm)]);
        assert!(waited > 1.0, "{vm}, limited, waited {waited} s in all");
    }
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

    // An image's group: `other` is in `image:` (the default image's), now held to the rate.
    let said = overspill_vm(control, &["limit", "image:", "--group", "--iops", &format!("{RATE}:{BURST}")]);
    assert!(said.contains(r#"group "image:": 1000 ops/s (burst 100)"#), "{said}");
    let out = setup.fio("other").wait_with_output().expect("fio");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (ops, ms) = fio_ops(&String::from_utf8_lossy(&out.stdout));
    let most = RATE * ms / 1000 + BURST + IODEPTH;
    eprintln!("other, in image:, limited: {ops} ops in {ms} ms (at most {most})");
    assert!(ops <= most, "the image group's VM did {ops} operations in {ms} ms; at most {most}");
    let waited =
        sample(&scrape(&metrics_url(server)), "overspill_group_throttled_seconds_total", &[("group", "image:")]);
    assert!(waited > 1.0, "the image group's requests waited {waited} s in all");
}

/// qemu-io on VM `vm`, holding its connection open for the commands written to its stdin (one
/// per line) until stdin closes.
fn held_qemu_io(setup: &Setup, vm: &str) -> std::process::Child {
    let uri = format!("nbd+unix:///@{vm}?socket={}", setup.socket.display());
    Command::new("qemu-io")
        .args(["-f", "raw", &uri])
        .current_dir(setup.dir.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("qemu-io (apt-get install qemu-utils)")
}

/// Writes one qemu-io command to a held connection.
fn say(client: &mut std::process::Child, command: &str) {
    use std::io::Write;
    let stdin = client.stdin.as_mut().expect("qemu-io stdin");
    writeln!(stdin, "{command}").and_then(|()| stdin.flush()).expect("qemu-io command");
}

/// Polls the server's metrics until `family` reaches `at_least`, within 20 s.
fn await_sample(server: &Serve, family: &str, labels: &[(&str, &str)], at_least: f64) -> f64 {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let value = sample(&scrape(&metrics_url(server)), family, labels);
        if value >= at_least {
            return value;
        }
        assert!(std::time::Instant::now() < until, "{family} stayed at {value}, below {at_least}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// `--boot-max 1`: a second fresh VM's first request waits while the first boots, and goes as
/// soon as `vm booted` says the first's boot is over; a VM resuming its overlay does not wait.
#[test]
fn beyond_the_boot_cap_a_fresh_vm_waits_until_a_boot_ends() {
    let setup = start(&["--boot-max", "1", "--boot-time", "10m"]);
    let (control, server) = (&setup.control, &setup.server);
    let mut first = held_qemu_io(&setup, "first");
    say(&mut first, "read 0 4k");
    await_sample(server, "overspill_vms_booting", &[], 1.0);
    let second = spawn_tool(
        setup.dir.path(),
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0 0 4k", &format!("nbd+unix:///@second?socket={}", setup.socket.display())],
    );
    await_sample(server, "overspill_vms_waiting_to_boot", &[], 1.0);
    // It waits for as long as the first boots: a while later, still waiting.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let samples = scrape(&metrics_url(server));
    assert_eq!(sample(&samples, "overspill_vms_waiting_to_boot", &[]), 1.0, "the second VM waits");
    assert_eq!(sample(&samples, "overspill_boots_total", &[]), 1.0, "one boot began");
    let said = overspill_vm(control, &["booted", "first"]);
    assert!(said.contains("first: boot over"), "{said}");
    let second = second.wait_with_output().expect("qemu-io");
    assert!(second.status.success(), "{}", String::from_utf8_lossy(&second.stderr));
    let samples = scrape(&metrics_url(server));
    assert_eq!(sample(&samples, "overspill_boots_total", &[]), 2.0);
    assert_eq!(sample(&samples, "overspill_vms_waiting_to_boot", &[]), 0.0);
    let waited = sample(&samples, "overspill_boot_wait_seconds_total", &[]);
    assert!(waited >= 0.3, "the second VM waited {waited} s for its slot");
    // The first VM goes on, its boot over (the second's clean end gave back its slot).
    say(&mut first, "read 4k 4k");
    drop(first.stdin.take());
    let first = first.wait_with_output().expect("qemu-io");
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let said = overspill_vm(control, &["booted", "nobody"]);
    assert!(said.contains("not booting"), "{said}");
}

/// The host's golden-fetch budget: a booting VM's fetches go ahead of it (never wait), and a
/// VM whose boot is over waits out the debt they left. No read cache: every golden read is a
/// fetch.
#[test]
fn booting_vms_fetches_go_first_at_the_golden_budget_and_the_others_wait() {
    let setup =
        start_over(Some(0x6f), &["--read-cache", "0", "--golden-limit-bandwidth", "4M:64K", "--boot-time", "10m"]);
    let (control, server) = (&setup.control, &setup.server);
    let mut running = held_qemu_io(&setup, "running");
    say(&mut running, "read 0 4k");
    await_sample(server, "overspill_vms_booting", &[], 1.0);
    overspill_vm(control, &["booted", "running"]);
    let waited = |samples: &overspill::stat::Samples| {
        sample(samples, "overspill_budget_throttled_seconds_total", &[("budget", "golden")])
    };
    let before = waited(&scrape(&metrics_url(server)));
    // 16 MiB at 4 MiB/s with a 64 KiB burst: more debt than going ahead may leave (two seconds'
    // worth), and the booting VM waits none of it.
    run_ok(
        setup.dir.path(),
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x6f 0 16M", &format!("nbd+unix:///@booting?socket={}", setup.socket.display())],
    );
    let samples = scrape(&metrics_url(server));
    assert_eq!(waited(&samples), before, "a booting VM's fetches waited for the budget");
    assert!(sample(&samples, "overspill_budget_golden_went_ahead_total", &[]) >= 1.0, "they went ahead");
    // The running VM's next fetch waits out that debt, two seconds' worth at most: at least the
    // half second asserted, however slow this machine was to send it.
    say(&mut running, "read -P 0x6f 1M 64k");
    drop(running.stdin.take());
    let running = running.wait_with_output().expect("qemu-io");
    assert!(running.status.success(), "{}", String::from_utf8_lossy(&running.stderr));
    let after = waited(&scrape(&metrics_url(server)));
    assert!(after - before >= 0.5, "the running VM waited {} s at the golden budget", after - before);
    // Without the cap on what going ahead leaves, it would have owed four seconds.
    assert!(after - before <= 2.2, "the running VM waited {} s: more than two seconds' debt", after - before);
    let said = overspill_vm(control, &["limit", "golden", "--host"]);
    assert!(said.contains("golden-image fetches: no ops limit, 4194304 bytes/s (burst 65536)"), "{said}");
}

/// The host's spill budget holds every VM's segment writes together to its rate: a VM writing
/// 24 MiB into 4 MiB of RAM spills about 20 MiB, at most rate × time + burst + the writes in
/// flight, and the budget's wait shows in the metrics; every byte reads back.
#[test]
fn the_spill_budget_paces_segment_writes_and_loses_nothing() {
    const SPILL_RATE: f64 = 8.0 * 1048576.0;
    let setup = start(&["--ram", "4M", "--spill-limit-bandwidth", "8M:2M", "--spill-writers", "2"]);
    let server = &setup.server;
    let started = std::time::Instant::now();
    let mut writer = held_qemu_io(&setup, "writer");
    say(&mut writer, "write -P 0x5a 0 24M");
    say(&mut writer, "read -P 0x5a 0 24M");
    drop(writer.stdin.take());
    let out = writer.wait_with_output().expect("qemu-io");
    let took = started.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && !text.contains("Pattern verification failed"), "{text}");
    let samples = scrape(&metrics_url(server));
    let spilled = sample(&samples, "overspill_storage_bytes_total", &[("tier", "spill"), ("direction", "write")]);
    // The burst, the segment that went into debt, and one being written per writer thread.
    let allowed = SPILL_RATE * took + (2.0 + 2.0 + 2.0 * 2.0) * 1048576.0;
    eprintln!("spilled {spilled} bytes in {took:.2} s; at most {allowed}");
    assert!(spilled >= 16.0 * 1048576.0, "the VM spilled {spilled} bytes");
    assert!(spilled <= allowed, "spilled {spilled} bytes in {took:.2} s; at most {allowed}");
    let waited = sample(&samples, "overspill_budget_throttled_seconds_total", &[("budget", "spill")]);
    assert!(waited > 0.5, "segment writes waited {waited} s at the spill budget");
}

/// A request waiting out a long limit (a 4 KiB write at 100 bytes a second: 40 s) stops waiting when its VM is reset (its connection closes at once after it)
/// or its server stops (the request is served and answered within the drain, and its write is
/// the next server's): a wait never holds a reset VM's connection, nor the drain, which gave up
/// after 10 s and left the VM to be recovered as after a crash, its request unanswered.
#[test]
fn a_request_waiting_for_its_limit_gives_way_to_a_reset_and_to_a_stop() {
    use overspill_nbd::client::{Client, NbdUri};
    use std::sync::mpsc;
    use std::time::Duration;
    let mut setup = start(&["--vm-limit-bandwidth", "held=100B:100B", "--vm-limit-bandwidth", "reset=100B:100B"]);
    let connect = |vm: &str| {
        let uri: NbdUri = format!("nbd+unix:///@{vm}?socket={}", setup.socket.display()).parse().expect("uri");
        Client::connect(&uri).unwrap_or_else(|e| panic!("connecting {vm}: {e}"))
    };
    // Each VM writes 4 KiB on a thread of its own, and says how that ended.
    let write_held_up = |mut client: Client| {
        let (said, ended) = mpsc::channel();
        std::thread::spawn(move || {
            let written = client.write(0, &[0x5a; 4096], false);
            let _ = said.send((written.map_err(|e| e.to_string()), client));
        });
        ended
    };
    let await_waiting =
        |server: &Serve, vm: &str| await_sample(server, "overspill_vm_throttled_requests", &[("vm", vm)], 1.0);

    let reset = write_held_up(connect("reset"));
    await_waiting(&setup.server, "reset");
    overspill_vm(&setup.control, &["reset", "reset"]);
    // The request in hand is served as any in hand at a reset is; the connection closes at the
    // next one.
    let (_, mut client) = reset.recv_timeout(Duration::from_secs(30)).expect("the reset VM's request still waits");
    let after = client.write(0, &[1; 4096], false);
    assert!(after.is_err(), "the reset VM's connection served on: {after:?}");

    let held = write_held_up(connect("held"));
    await_waiting(&setup.server, "held");
    setup.server.stop();
    let (written, client) = held.recv_timeout(Duration::from_secs(30)).expect("the request outlived the server");
    let log = setup.server.log_text();
    written.unwrap_or_else(|e| panic!("the write in hand at the stop was not served and answered: {e}\n{log}"));
    drop(client);
    assert!(!log.contains("still busy"), "the drain gave up on a waiting request:\n{log}");
    // The next server has the write.
    let args: Vec<&str> = setup.args.iter().map(String::as_str).collect();
    let socket = setup.socket.clone();
    let next = Serve::start_named_only(setup.dir.path(), &args, &[], move || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    let mut client = connect("held");
    // Within the limit's burst of 100 bytes: read at once.
    let mut back = vec![0u8; 64];
    client.read(0, &mut back).expect("read back");
    assert!(back.iter().all(|&b| b == 0x5a), "the write answered at the stop was lost");
    drop(next);
}
