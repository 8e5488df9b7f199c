//! How long a new `overspill serve` takes to rebuild every VM an earlier one left: 100 named VMs
//! each write 256 MiB (past the 8 GiB `--ram-total`, so most of it spills) and leave without
//! NBD_CMD_DISC; the server is stopped (SIGTERM: a planned restart) and started again, then
//! killed (SIGKILL: a crash) and started again. Each time: from the new process's start to its
//! socket accepting, every VM rebuilt, and the per-VM recovery times from its log; then every VM
//! reconnects by name and a sample of each one's blocks is read back and checked.
//!
//! `cargo bench -p overspill --bench recovery` writes `bench/results/recovery-<rev>.md`.
//! `RECOVERY_VMS`, `RECOVERY_STATE_MIB` and `RECOVERY_DIR` (default /var/tmp: the spill files
//! hold most of the state) change the run.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use overspill_nbd::client::{Client, NbdUri};

const MIB: usize = 1 << 20;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{name}: a number")))
}

/// The bytes VM `vm` writes at `offset`: its number and the offset in every 16 bytes.
fn pattern(vm: usize, offset: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    for (i, chunk) in bytes.chunks_exact_mut(16).enumerate() {
        chunk[..8].copy_from_slice(&(vm as u64).to_le_bytes());
        chunk[8..].copy_from_slice(&(offset + i as u64 * 16).to_le_bytes());
    }
    bytes
}

struct Host {
    dir: PathBuf,
    socket: PathBuf,
    golden: PathBuf,
    memory: PathBuf,
}

impl Host {
    fn start(&self, log: &Path) -> (Child, Duration) {
        let started = Instant::now();
        let listen = format!("unix:{}", self.socket.display());
        let mut child = Command::new(env!("CARGO_BIN_EXE_overspill"))
            .arg("serve")
            .args(["--base", self.golden.to_str().expect("utf-8"), "--listen", &listen])
            .args(["--spill-dir", self.dir.join("spill").to_str().expect("utf-8")])
            .args(["--memory-dir", self.memory.to_str().expect("utf-8")])
            .args(["--ram-floor", "0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).expect("log"))
            .spawn()
            .expect("overspill serve");
        while std::os::unix::net::UnixStream::connect(&self.socket).is_err() {
            if let Some(status) = child.try_wait().expect("try_wait") {
                panic!("overspill serve exited with {status}: {}", std::fs::read_to_string(log).unwrap_or_default());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        (child, started.elapsed())
    }

    fn client(&self, vm: usize) -> Client {
        let uri: NbdUri = format!("nbd+unix:///@vm{vm}?socket={}", self.socket.display()).parse().expect("uri");
        Client::connect(&uri).unwrap_or_else(|e| panic!("vm{vm}: {e}"))
    }
}

/// Per-VM recovery times (ms) the server logged.
fn recovery_ms(log: &Path) -> Vec<u64> {
    let text = std::fs::read_to_string(log).expect("log");
    text.lines()
        .filter(|line| line.contains("VM overlay recovered"))
        .filter_map(|line| line.split("ms=").nth(1)?.split_whitespace().next()?.parse().ok())
        .collect()
}

fn stats(ms: &mut [u64]) -> String {
    ms.sort_unstable();
    if ms.is_empty() {
        return "none".into();
    }
    format!("{} / {} / {} ms (sum {} ms)", ms[0], ms[ms.len() / 2], ms[ms.len() - 1], ms.iter().sum::<u64>())
}

fn du(path: &Path) -> u64 {
    let out = Command::new("du").args(["-sb"]).arg(path).output().expect("du");
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(0)
}

fn main() {
    // `cargo bench` passes --bench; nothing else is taken.
    let vms = env_or("RECOVERY_VMS", 100);
    let state_mib = env_or("RECOVERY_STATE_MIB", 256);
    let base = std::env::var("RECOVERY_DIR").unwrap_or_else(|_| "/var/tmp".into());
    let dir = tempfile::Builder::new().prefix("overspill-recovery").tempdir_in(&base).expect("tempdir");
    let memory = tempfile::Builder::new().prefix("overspill-recovery").tempdir_in("/dev/shm").expect("tmpfs dir");
    let host = Host {
        dir: dir.path().to_path_buf(),
        socket: dir.path().join("nbd.sock"),
        golden: dir.path().join("golden.img"),
        memory: memory.path().join("memory"),
    };
    std::fs::File::create(&host.golden).and_then(|f| f.set_len((state_mib * MIB) as u64)).expect("golden image");
    let (mut server, _) = host.start(&dir.path().join("server-1.log"));

    let written = Instant::now();
    std::thread::scope(|scope| {
        for worker in 0..4 {
            let host = &host;
            scope.spawn(move || {
                for vm in (worker..vms).step_by(4) {
                    let mut client = host.client(vm);
                    for mib in 0..state_mib {
                        let offset = (mib * MIB) as u64;
                        client.write(offset, &pattern(vm, offset, MIB), false).expect("write");
                    }
                    // Gone without NBD_CMD_DISC: the overlay waits for its VM.
                    drop(client);
                }
            });
        }
    });
    let write_time = written.elapsed();
    // Let the connections' ends reach the server before it is stopped.
    std::thread::sleep(Duration::from_secs(2));
    let in_memory = du(&host.memory);
    let on_disk = du(&dir.path().join("spill"));

    let mut report = String::new();
    let rev = Command::new("git").args(["rev-parse", "--short", "HEAD"]).output().expect("git");
    let rev = String::from_utf8_lossy(&rev.stdout).trim().to_string();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let _ = writeln!(report, "# Recovery: {vms} VMs × {state_mib} MiB of state, revision {rev}\n");
    let _ = writeln!(
        report,
        "Command: `cargo bench -p overspill --bench recovery` on {cores} cores. Server: defaults (`--ram 256M`, \
         `--ram-total 8G`), spill files in {base}, pages in /dev/shm.\n"
    );
    let _ = writeln!(report, "| figure | value |\n| --- | --- |");
    let _ = writeln!(
        report,
        "| state written (QD1, 4 clients, 1 MiB writes) | {} MiB in {:.1} s |",
        vms * state_mib,
        write_time.as_secs_f64()
    );
    let _ = writeln!(report, "| state in the memory directory (tmpfs) | {} MiB |", in_memory >> 20);
    let _ = writeln!(report, "| state in the spill directory | {} MiB |", on_disk >> 20);

    let mut check = |label: &str, log: &Path, ready: Duration| -> bool {
        let mut ms = recovery_ms(log);
        let recovered = ms.len();
        let _ = writeln!(report, "| {label}: start to accepting connections | {:.2} s |", ready.as_secs_f64());
        let _ = writeln!(report, "| {label}: VMs rebuilt | {recovered} of {vms} |");
        let _ = writeln!(report, "| {label}: per VM, min / median / max | {} |", stats(&mut ms));
        recovered == vms
    };

    // A planned restart.
    let stop = Command::new("kill").args(["-TERM", &server.id().to_string()]).status().expect("kill");
    assert!(stop.success());
    server.wait().expect("wait");
    let log = dir.path().join("server-2.log");
    let (mut server, ready) = host.start(&log);
    let all_after_stop = check("after SIGTERM", &log, ready);

    // A crash.
    server.kill().expect("SIGKILL");
    server.wait().expect("wait");
    let log = dir.path().join("server-3.log");
    let (mut server, ready) = host.start(&log);
    let all_after_kill = check("after SIGKILL", &log, ready);

    // Every VM resumes by name; 16 MiB of each, spread over its disk, reads back.
    let checked = Instant::now();
    let mut wrong = 0;
    for vm in 0..vms {
        let mut client = host.client(vm);
        let mut buf = vec![0u8; MIB];
        for mib in (0..state_mib).step_by((state_mib / 16).max(1)) {
            let offset = (mib * MIB) as u64;
            client.read(offset, &mut buf).expect("read");
            if buf != pattern(vm, offset, MIB) {
                wrong += 1;
            }
        }
        // A clean end this time: the overlay and its files go.
        client.disconnect().expect("disconnect");
    }
    let _ = writeln!(
        report,
        "| read back after both restarts (16 MiB per VM) | {} wrong MiB, in {:.1} s |",
        wrong,
        checked.elapsed().as_secs_f64()
    );
    let verdict = all_after_stop && all_after_kill && wrong == 0;
    let _ = writeln!(report, "\nTarget: every VM rebuilt and back within 5 s of a restart.");
    let _ = writeln!(report, "Verdict: {}", if verdict { "every VM rebuilt, every block read back" } else { "FAIL" });
    let _ = server.kill();
    let _ = server.wait();
    print!("{report}");
    let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/results");
    let path = results.join(format!("recovery-{rev}.md"));
    std::fs::write(&path, &report).expect("writing the report");
    eprintln!("written to {}", path.display());
}
