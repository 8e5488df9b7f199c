//! Memory that yields, against the real server and real clients: a VM that has made no request
//! for a while gives its RAM tier to a neighbour held below its own `--ram` by `--ram-total`,
//! without a write of its own to make it; the golden image's read cache, which holds within
//! `--ram-total` too, gives back first, down to its floor; and every byte reads back.

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use tempfile::TempDir;

mod common;
use common::{metrics_url, sample, scrape, spawn_tool, Serve};

const MIB: f64 = (1 << 20) as f64;

/// `overspill serve` over `golden` with 32 MiB per VM and 48 MiB for all, and `extra`.
fn serve(dir: &Path, golden: &Path, socket: &Path, extra: &[&str]) -> Serve {
    let listen = format!("unix:{}", socket.display());
    let args = [
        &[
            "--base",
            golden.to_str().expect("utf-8"),
            "--listen",
            &listen,
            "--ram",
            "32M",
            "--ram-total",
            "48M",
            "--metrics",
            "tcp:127.0.0.1:0",
        ][..],
        extra,
    ]
    .concat();
    Serve::start_named_only(dir, &args, &[], || socket.exists())
}

/// A host-wide figure, or a VM's (0 before its series appear with its first request).
fn figure(url: &str, family: &str, vm: Option<&str>) -> f64 {
    let samples = scrape(url);
    let labels: Vec<(&str, &str)> = vm.map(|vm| ("vm", vm)).into_iter().collect();
    let listed = samples
        .keys()
        .any(|(name, l)| name == family && labels.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v)));
    if listed {
        sample(&samples, family, &labels)
    } else {
        0.0
    }
}

fn vm_memory(url: &str, vm: &str) -> f64 {
    figure(url, "overspill_vm_cache_memory_used_bytes", Some(vm))
}

/// qemu-io running `commands` on `export` (`@NAME` for a named VM, empty for the read-only
/// golden image).
fn qemu_io(dir: &Path, socket: &Path, export: &str, commands: &[String]) -> Child {
    let mut args = vec!["-f".to_string(), "raw".to_string()];
    if export.is_empty() {
        args.push("-r".into());
    }
    for command in commands {
        args.extend(["-c".to_string(), command.clone()]);
    }
    args.push(format!("nbd+unix:///{export}?socket={}", socket.display()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    spawn_tool(dir, "qemu-io", &args)
}

/// Waits for a qemu-io run that must have read back `read` bytes at offset 0 as it expected.
fn read_back(what: &str, child: Child, read: &str) -> String {
    let out = child.wait_with_output().expect("qemu-io");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what}: {text}");
    assert!(!text.contains("failed"), "{what}: {text}");
    assert!(text.contains(&format!("read {read}/{read} bytes at offset 0")), "{what}: {text}");
    text
}

/// What [`busy_writer`] read back: its 28 MiB, and the 32 MiB it wrote after them.
fn busy_read_back(child: Child) {
    let text = read_back("busy", child, "29360128");
    assert!(text.contains("read 33554432/33554432 bytes at offset 29360128"), "busy, its later writes: {text}");
}

/// A VM writing 28 MiB, then 4 MiB a second `seconds` times (over the next 32 MiB, round and
/// round; at least 8), then reading all 60 MiB back.
/// A MiB a request: the budget is checked as a request's blocks land but counted at its end, so
/// one 28 MiB request would land whole whatever the others hold.
fn busy_writer(seconds: usize) -> Vec<String> {
    assert!(seconds >= 8, "every 4 MiB of the 32 written");
    let mut commands: Vec<String> = (0..28).map(|mib| format!("write -P 0x62 {mib}M 1M")).collect();
    for k in 0..seconds {
        commands.extend(["sleep 1000".to_string(), format!("write -P 0x63 {}M 4M", 28 + 4 * (k % 8))]);
    }
    commands.extend(["read -P 0x62 0 28M".into(), "read -P 0x63 28M 32M".into()]);
    commands
}

/// Waits until `done` says so, at most `limit`; `state` says what it saw if not.
fn wait_until(limit: Duration, mut done: impl FnMut() -> bool, state: impl Fn() -> String) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "after {limit:?}: {}", state());
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn a_quiet_vm_gives_its_ram_to_a_held_neighbour() {
    let dir = TempDir::new().expect("tempdir");
    let golden = dir.path().join("golden.img");
    std::fs::File::create(&golden).and_then(|f| f.set_len(64 << 20)).expect("golden");
    let socket = dir.path().join("nbd.sock");
    let server = serve(dir.path(), &golden, &socket, &[]);
    let url = metrics_url(&server);

    // The quiet VM writes 28 MiB, all into RAM, then waits connected (45 s) before it reads
    // them back.
    let commands = ["write -P 0x51 0 28M".into(), "sleep 45000".into(), "read -P 0x51 0 28M".into()];
    let quiet = qemu_io(dir.path(), &socket, "@quiet", &commands);
    wait_until(
        Duration::from_secs(20),
        || vm_memory(&url, "quiet") >= 28.0 * MIB,
        || "the quiet VM's 28 MiB never reached RAM".into(),
    );
    // Its neighbour writes 28 MiB (held at the 48 MiB cap, it spills), then 4 MiB a second for
    // 40 s: both are still there at the deadline below.
    let busy = qemu_io(dir.path(), &socket, "@busy", &busy_writer(40));

    // Within the quiet period (10 s) and a few passes, the quiet VM gives its RAM back and the
    // busy one grows past what the cap left it (20 MiB).
    wait_until(
        Duration::from_secs(35),
        || vm_memory(&url, "quiet") <= 4.0 * MIB && vm_memory(&url, "busy") >= 28.0 * MIB,
        || {
            let (quiet, busy) = (vm_memory(&url, "quiet"), vm_memory(&url, "busy"));
            format!(
                "the quiet VM holds {:.1} MiB, the busy one {:.1} MiB\n{}",
                quiet / MIB,
                busy / MIB,
                server.log_text()
            )
        },
    );
    let given = figure(&url, "overspill_host_memory_given_back_bytes_total", None);
    assert!(given >= 24.0 * MIB, "{:.1} MiB given back", given / MIB);
    read_back("quiet", quiet, "29360128");
    busy_read_back(busy);
}

/// The golden image's read cache fills the room the VMs leave, then gives it back (down to its
/// floor) as soon as a VM is held, with no quiet period to wait for.
#[test]
fn the_read_cache_gives_back_first_down_to_its_floor() {
    let dir = TempDir::new().expect("tempdir");
    let golden = dir.path().join("golden.img");
    std::fs::write(&golden, vec![0x6c; 64 << 20]).expect("golden");
    let socket = dir.path().join("nbd.sock");
    let server = serve(dir.path(), &golden, &socket, &["--read-cache-floor", "8M"]);
    let url = metrics_url(&server);
    let cached = || figure(&url, "overspill_host_read_cache_bytes", None);

    let (hits, misses) = (
        || figure(&url, "overspill_read_cache_hits_total", None),
        || figure(&url, "overspill_read_cache_misses_total", None),
    );
    read_back("reader", qemu_io(dir.path(), &socket, "", &["read -P 0x6c 0 40M".into()]), "41943040");
    // Read twice while the cache holds it all: the second pass hits every chunk.
    let missed_first = misses();
    read_back("reader, warm", qemu_io(dir.path(), &socket, "", &["read -P 0x6c 0 40M".into()]), "41943040");
    assert_eq!(misses(), missed_first, "a warm cache missed");
    let held = cached();
    assert!((39.0 * MIB..=48.0 * MIB).contains(&held), "the read cache holds {:.1} MiB of the 48", held / MIB);

    let busy = qemu_io(dir.path(), &socket, "@busy", &busy_writer(25));
    wait_until(
        Duration::from_secs(20),
        || vm_memory(&url, "busy") >= 28.0 * MIB,
        || {
            format!(
                "the busy VM holds {:.1} MiB, the read cache {:.1} MiB",
                vm_memory(&url, "busy") / MIB,
                cached() / MIB
            )
        },
    );
    let left = cached();
    assert!(left >= 8.0 * MIB - 1.0, "the read cache kept its floor: {:.1} MiB", left / MIB);
    assert!(left <= 20.0 * MIB, "the read cache holds {:.1} MiB beside a VM at its target", left / MIB);
    let (hits_before, misses_before) = (hits(), misses());
    read_back("reader again", qemu_io(dir.path(), &socket, "", &["read -P 0x6c 0 40M".into()]), "41943040");
    // The hit ratio shows what the cache gave back: the chunks it no longer holds are missed.
    let (hit, missed) = (hits() - hits_before, misses() - misses_before);
    assert!(missed > 0.0, "the shrunk cache still hit all: {hit} hits");
    let ratio = hit / (hit + missed);
    assert!(ratio < 0.75, "the hit ratio after giving back is {ratio:.2} (it held at most 20 of 40 MiB)");
    busy_read_back(busy);
}

/// The pages of a VM a killed server held stay in the memory directory for the next server,
/// which rebuilds the VM from them and waits its grace for the VM's client: until then the
/// operator sees the VM in grace in `vm list`, its RAM in the metrics and its files in the
/// directory. A VM no client claims in its grace is lost (it wrote), and its pages go.
#[test]
fn a_killed_servers_pages_wait_for_their_vm_and_go_when_no_client_claims_it() {
    let dir = TempDir::new().expect("tempdir");
    let golden = dir.path().join("golden.img");
    std::fs::File::create(&golden).and_then(|f| f.set_len(64 << 20)).expect("golden");
    let socket = dir.path().join("nbd.sock");
    let memory_files = || -> Vec<String> {
        let entries = std::fs::read_dir(dir.path().join("memory")).map(|d| d.flatten().collect::<Vec<_>>());
        entries.unwrap_or_default().iter().map(|e| e.file_name().to_string_lossy().into_owned()).collect()
    };
    let server = serve(dir.path(), &golden, &socket, &[]);
    read_back(
        "gone",
        qemu_io(dir.path(), &socket, "@gone", &["write -P 0x47 0 8M".into(), "read -P 0x47 0 8M".into()]),
        "8388608",
    );
    // qemu-io ended with NBD_CMD_DISC: a VM that quits deliberately leaves nothing.
    wait_until(
        Duration::from_secs(10),
        || memory_files().iter().all(|f| !f.contains("gone")),
        || format!("{:?}", memory_files()),
    );
    let held = spawn_tool(
        dir.path(),
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x48 0 8M",
            "-c",
            "sleep 60000",
            &format!("nbd+unix:///@held?socket={}", socket.display()),
        ],
    );
    let url = metrics_url(&server);
    wait_until(Duration::from_secs(20), || vm_memory(&url, "held") >= 8.0 * MIB, || "held never wrote".into());
    server.kill();
    let mut held = held;
    held.kill().and_then(|()| held.wait()).expect("qemu-io killed with its server");

    let control = dir.path().join("control.sock");
    let server = serve(
        dir.path(),
        &golden,
        &socket,
        &["--reconnect-grace", "8s", "--control", control.to_str().expect("utf-8")],
    );
    let list = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_overspill"))
            .args(["vm", "list", "--control", control.to_str().expect("utf-8")])
            .output()
            .expect("overspill vm list");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // (The killed server's socket file is still there: the new one is ready once it answers.)
    wait_until(Duration::from_secs(20), || list().contains("in-grace"), || format!("VMs: {}", list()));
    let listed = list();
    assert!(listed.contains("held") && !listed.contains("gone"), "{listed}");
    assert!(memory_files().iter().any(|f| f.starts_with("vm-held.")), "{:?}", memory_files());
    let url = metrics_url(&server);
    assert!(vm_memory(&url, "held") >= 8.0 * MIB, "the rebuilt VM's RAM: {}", vm_memory(&url, "held"));
    wait_until(
        Duration::from_secs(20),
        || memory_files().is_empty() && list().contains("lost"),
        || format!("files {:?}, VMs {}\n{}", memory_files(), list(), server.log_text()),
    );
}
