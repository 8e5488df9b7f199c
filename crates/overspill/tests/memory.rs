//! Memory that yields, against the real server and real clients: a VM that has written nothing
//! for a while gives its RAM tier to a neighbour held below its own `--ram` by `--ram-total`,
//! without a write of its own to make it, and both read back every byte they wrote.

use std::time::{Duration, Instant};

use tempfile::TempDir;

mod common;
use common::{metrics_url, sample, scrape, spawn_tool, Serve};

const MIB: f64 = (1 << 20) as f64;

#[test]
fn a_quiet_vm_gives_its_ram_to_a_held_neighbour() {
    let dir = TempDir::new().expect("tempdir");
    let golden = dir.path().join("golden.img");
    std::fs::File::create(&golden).and_then(|f| f.set_len(64 << 20)).expect("golden");
    let socket = dir.path().join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let server = Serve::start_named_only(
        dir.path(),
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
        ],
        &[],
        || socket.exists(),
    );
    let url = metrics_url(&server);
    // A VM's series appear with its first request: nothing before that.
    let used = |vm: &str| {
        let samples = scrape(&url);
        let listed = samples.keys().any(|(family, labels)| {
            family == "overspill_vm_cache_memory_used_bytes" && labels.get("vm").map(String::as_str) == Some(vm)
        });
        if listed {
            sample(&samples, "overspill_vm_cache_memory_used_bytes", &[("vm", vm)])
        } else {
            0.0
        }
    };
    let qemu_io = |vm: &str, commands: &[String]| {
        let uri = format!("nbd+unix:///@{vm}?socket={}", socket.display());
        let mut args = vec!["-f".to_string(), "raw".to_string()];
        for command in commands {
            args.extend(["-c".to_string(), command.clone()]);
        }
        args.push(uri);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        spawn_tool(dir.path(), "qemu-io", &args)
    };

    // The quiet VM writes 28 MiB, all into RAM, then waits connected (30 s) before it reads
    // them back.
    let quiet = qemu_io("quiet", &["write -P 0x51 0 28M".into(), "sleep 30000".into(), "read -P 0x51 0 28M".into()]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while used("quiet") < 28.0 * MIB {
        assert!(Instant::now() < deadline, "the quiet VM's 28 MiB never reached RAM");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Its neighbour writes 28 MiB (held at the 48 MiB cap, it spills), then 4 MiB a second.
    let mut busy_commands = vec!["write -P 0x62 0 28M".to_string()];
    for k in 0..25 {
        busy_commands.extend(["sleep 1000".to_string(), format!("write -P 0x63 {}M 4M", 28 + 4 * (k % 8))]);
    }
    busy_commands.push("read -P 0x62 0 28M".into());
    let busy = qemu_io("busy", &busy_commands);

    // Within the quiet period (10 s) and a few passes, the quiet VM gives its RAM back and the
    // busy one grows past what the cap left it (20 MiB).
    let deadline = Instant::now() + Duration::from_secs(25);
    let (mut quiet_used, mut busy_used) = (used("quiet"), used("busy"));
    while quiet_used > 4.0 * MIB || busy_used < 28.0 * MIB {
        assert!(
            Instant::now() < deadline,
            "after 25 s the quiet VM holds {:.1} MiB, the busy one {:.1} MiB\n{}",
            quiet_used / MIB,
            busy_used / MIB,
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(250));
        (quiet_used, busy_used) = (used("quiet"), used("busy"));
    }
    let given = sample(&scrape(&url), "overspill_host_memory_given_back_bytes_total", &[]);
    assert!(given >= 24.0 * MIB, "{:.1} MiB given back", given / MIB);

    for (vm, child) in [("quiet", quiet), ("busy", busy)] {
        let out = child.wait_with_output().expect("qemu-io");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{vm}: {text}");
        assert!(!text.contains("failed"), "{vm}: {text}");
        assert!(text.contains("read 29360128/29360128 bytes at offset 0"), "{vm}: {text}");
    }
}
