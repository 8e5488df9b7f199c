//! Failures the server must survive, against the real `overspill serve` binary where a real
//! failure can be arranged: a spill filesystem that fills up, a server killed with SIGKILL and
//! restarted next to a live one, and SIGTERM while VMs are connected. Golden-image read errors
//! cannot be made with a real file on demand, so that test runs the real exports and server
//! in-process over a golden image with injected faults.
//!
//! These tests mount filesystems, so they run as root (CI does); one that cannot mount fails
//! with the reason rather than passing without testing anything.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use overspill_engine::faults::{Fault, FaultPlan, FaultyImage, Op, Rule, Trigger};
use overspill_engine::{GoldenImage, HostMemory, MemImage, WriteCacheMode};
use overspill_nbd::client::{Client, ClientError, NbdUri};
use overspill_nbd::server::socketpair;
use overspill_nbd::ServerConfig;
use overspill_server::exports::{CacheSettings, OverlayExports, DEFAULT_SPILL_WRITERS};
use serde_json::Value;
use tempfile::TempDir;

const MIB: u64 = 1 << 20;
const GOLDEN_BYTES: usize = 32 << 20;
const ENOSPC: u32 = 28;
const EIO: u32 = 5;
const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Data

mod common;
use common::{assert_same, pseudo_random};

fn golden_file(dir: &Path, seed: u64) -> (PathBuf, Vec<u8>) {
    let path = dir.join("golden.img");
    let bytes = pseudo_random(GOLDEN_BYTES, seed);
    std::fs::write(&path, &bytes).expect("writing golden image");
    (path, bytes)
}

#[track_caller]
fn read_back(client: &mut Client, offset: u64, expected: &[u8], what: &str) {
    let mut buf = vec![0u8; expected.len()];
    client.read(offset, &mut buf).unwrap_or_else(|e| panic!("{what}: read at {offset}: {e}"));
    assert_same(&buf, expected, what);
}

/// A closed connection, not an NBD error reply.
#[track_caller]
fn assert_closed(error: &ClientError, who: &str) {
    assert!(error.errno().is_none(), "{who}: expected the connection to be closed, got an error reply: {error}");
}

// ---------------------------------------------------------------------------------------------
// The server under test (the pieces of interop.rs's harness these tests need)

/// A running `overspill serve` with its own socket and JSON log; killed when dropped (and its
/// log shown if the test failed).
struct Server {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
    spill_dir: PathBuf,
}

impl Server {
    /// Serves `golden` as export "" on `dir/<name>.sock`, spilling to `spill_dir`.
    fn start(dir: &Path, name: &str, golden: &Path, spill_dir: &Path, extra: &[&str]) -> Self {
        let socket = dir.join(format!("{name}.sock"));
        let log = dir.join(format!("{name}.log"));
        let log_file = std::fs::File::create(&log).expect("creating server log");
        // These tests count per-process spill files and their removal at SIGTERM: VMs here
        // end with their connections (handing over across restarts is tests/lifecycle.rs),
        // unless a test asks for a grace (its state then lives in a memory directory).
        let grace: &[&str] = if extra.contains(&"--reconnect-grace") { &[] } else { &["--reconnect-grace", "0"] };
        // In the test's directory, not /dev/shm, unless the test gives its own.
        let memory = dir.join(format!("{name}-memory"));
        let memory: Vec<&std::ffi::OsStr> = if extra.contains(&"--memory-dir") {
            Vec::new()
        } else {
            vec!["--memory-dir".as_ref(), memory.as_os_str()]
        };
        let child = Command::new(env!("CARGO_BIN_EXE_overspill"))
            .arg("--log-json")
            .arg("serve")
            .arg("--base")
            .arg(golden)
            .arg("--listen")
            .arg(format!("unix:{}", socket.display()))
            .arg("--spill-dir")
            .arg(spill_dir)
            .arg("--shared-dir")
            .arg(dir.join(format!("{name}-shared")))
            // Servers may share a spill directory, never a state directory (its ledger and
            // control socket are one server's).
            .arg("--state-dir")
            .arg(dir.join(format!("{name}-state")))
            .args(grace)
            .args(memory)
            // No host-memory pressure from whatever else runs on the machine: targets stay put.
            .args(["--ram-floor", "0"])
            // Anonymous clients write here, each to its own throwaway overlay.
            .arg("--anonymous-writes")
            .args(extra)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("starting overspill serve");
        let mut server = Self { child, socket, log, spill_dir: spill_dir.to_path_buf() };
        server.wait_ready();
        server
    }

    /// Server `name` in `dir`, spilling to `spill` (which other servers share) with named VMs
    /// that outlive it (a grace, its own memory directory).
    fn sharing(dir: &Path, name: &str, golden: &Path, spill: &Path) -> Self {
        let memory = dir.join(format!("{name}-memory"));
        let memory = memory.to_str().expect("utf-8");
        Self::start(dir, name, golden, spill, &["--ram", "1M", "--reconnect-grace", "1m", "--memory-dir", memory])
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!("overspill serve exited with {status} before listening:\n{}", self.log_text());
            }
            if UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "overspill serve not listening after {WAIT:?}:\n{}", self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A VM on the base image, named `vm` in the logs.
    fn client(&self, vm: &str) -> Client {
        let uri: NbdUri = format!("nbd+unix:///@{vm}?socket={}", self.socket.display()).parse().expect("valid URI");
        Client::connect(&uri).unwrap_or_else(|e| panic!("connecting {vm}: {e}\n{}", self.log_text()))
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The `fields` of every JSON log line with this message.
    fn events(&self, message: &str) -> Vec<Value> {
        self.log_text()
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter_map(|v| v.get("fields").cloned())
            .filter(|fields| fields["message"] == message)
            .collect()
    }

    /// Waits for `probe` to find something: the server logs through a background writer, so a
    /// line may land a moment after what it reports (the socket up, a refusal) has been seen.
    fn wait_for<T>(&self, what: &str, probe: impl FnMut() -> Option<T>) -> T {
        common::wait_for(what, WAIT, || self.log_text(), probe)
    }

    /// The `fields` of the first JSON log line with this message, waited for.
    fn first_event(&self, message: &str) -> Value {
        self.wait_for(message, || self.events(message).into_iter().next())
    }

    /// Waits until the log holds `line`.
    fn wait_log(&self, line: &str) {
        self.wait_for(line, || self.log_text().contains(line).then_some(()))
    }

    /// This server's spill files.
    fn spill_files(&self) -> Vec<PathBuf> {
        spill_files_of(&self.spill_dir, self.pid())
    }

    /// SIGKILL, and reaped, so that its pid is gone from /proc as it would be for a real crash.
    fn kill9(&mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reaping the killed server");
    }

    /// SIGTERM; waits up to `limit` for the exit and says how long it took.
    fn terminate(&mut self, limit: Duration) -> (ExitStatus, Duration) {
        let started = Instant::now();
        let status = Command::new("kill").args(["-TERM", &self.pid().to_string()]).status().expect("running kill");
        assert!(status.success(), "kill -TERM failed: {status}");
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return (status, started.elapsed());
            }
            assert!(started.elapsed() < limit, "still running {limit:?} after SIGTERM:\n{}", self.log_text());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let text = self.log_text();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!("--- last lines of the server log {} ---", self.log.display());
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

/// The spill files of server `pid` in `dir` (`overspill-<pid>-<vm>.spill`).
fn spill_files_of(dir: &Path, pid: u32) -> Vec<PathBuf> {
    let prefix = format!("overspill-{pid}-");
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.starts_with(&prefix) && name.ends_with(".spill")
        })
        .collect();
    files.sort();
    files
}

fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// A small real filesystem

/// A mounted filesystem of a few MiB, unmounted when dropped.
struct SmallFs {
    dir: PathBuf,
    /// The image file of a loop mount, removed after unmounting.
    image: Option<PathBuf>,
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program).args(args).output().map_err(|e| format!("cannot run {program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{program} {args:?}: {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl SmallFs {
    /// A tmpfs of `mib` MiB at `dir`; where tmpfs cannot be mounted, a loop-mounted ext4 image.
    fn mount(dir: &Path, mib: u64) -> Self {
        std::fs::create_dir_all(dir).expect("mount point");
        let target = dir.to_str().expect("utf-8 path");
        let tmpfs = run("mount", &["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs", target]);
        let Err(tmpfs_error) = tmpfs else { return Self { dir: dir.to_path_buf(), image: None } };
        let image = dir.with_extension("ext4");
        let image_arg = image.to_str().expect("utf-8 path");
        let ext4 = std::fs::File::create(&image)
            .and_then(|f| f.set_len(mib * MIB))
            .map_err(|e| format!("creating {image_arg}: {e}"))
            .and_then(|()| run("mkfs.ext4", &["-q", "-F", image_arg]))
            .and_then(|()| run("mount", &["-o", "loop", image_arg, target]));
        match ext4 {
            Ok(()) => Self { dir: dir.to_path_buf(), image: Some(image) },
            Err(ext4_error) => panic!(
                "this test needs a small filesystem and could mount neither (run it as root):\n  \
                 tmpfs: {tmpfs_error}\n  loop ext4: {ext4_error}"
            ),
        }
    }
}

impl SmallFs {
    /// A tmpfs of `mib` MiB at `dir` that keeps files in 2 MiB huge pages where the kernel can.
    fn mount_huge(dir: &Path, mib: u64) -> Self {
        std::fs::create_dir_all(dir).expect("mount point");
        let target = dir.to_str().expect("utf-8 path");
        run("mount", &["-t", "tmpfs", "-o", &format!("size={mib}m,huge=always"), "tmpfs", target])
            .unwrap_or_else(|e| panic!("this test mounts a tmpfs (run it as root): {e}"));
        Self { dir: dir.to_path_buf(), image: None }
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let target = self.dir.to_str().unwrap_or_default();
        if let Err(error) = run("umount", &[target]) {
            eprintln!("{error}; unmounting lazily");
            let _ = run("umount", &["-l", target]);
        }
        if let Some(image) = &self.image {
            let _ = std::fs::remove_file(image);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tests

/// What [`write_until_refused`] writes at a time.
const CHUNK: usize = 256 * 1024;

/// Writes fresh chunks from `start` on until one is refused, calling `between` with the count
/// acknowledged so far after each; returns the acknowledged chunks and the refusal. Fails if
/// 28 MiB go in (the tests' filesystems hold 16).
fn write_until_refused(
    client: &mut Client,
    start: u64,
    server: &Server,
    mut between: impl FnMut(usize),
) -> (Vec<(u64, Vec<u8>)>, ClientError) {
    let mut acked: Vec<(u64, Vec<u8>)> = Vec::new();
    loop {
        let offset = start + (acked.len() * CHUNK) as u64;
        assert!(
            offset - start < 28 * MIB,
            "28 MiB written and a 16 MiB filesystem never filled:\n{}",
            server.log_text()
        );
        let data = pseudo_random(CHUNK, 1000 + offset / CHUNK as u64);
        match client.write(offset, &data, false) {
            Ok(()) => acked.push((offset, data)),
            Err(error) => return (acked, error),
        }
        between(acked.len());
    }
}

/// The memory directory (a tmpfs holding the RAM tier's pages of VMs that outlive the process)
/// fills up: a store into a page the filesystem has no room for would kill the whole server
/// (SIGBUS). The VM writing gets ENOSPC instead and keeps what it was told it wrote; the server
/// and the other VMs go on, and the room comes back when the writer leaves.
#[test]
fn a_full_memory_directory_gives_enospc_to_the_writer_and_the_server_lives() {
    let tmp = TempDir::new().expect("tempdir");
    let (golden, golden_bytes) = golden_file(tmp.path(), 33);
    let fs = SmallFs::mount(&tmp.path().join("memory"), 16);
    let memory = fs.dir.to_str().expect("utf-8").to_owned();
    let spill = tmp.path().join("spill");
    std::fs::create_dir_all(&spill).expect("spill dir");
    let args = ["--mode", "ram", "--ram", "64M", "--reconnect-grace", "1m", "--memory-dir", &memory];
    let mut server = Server::start(tmp.path(), "s", &golden, &spill, &args);
    let mut a = server.client("a");
    let mut b = server.client("b");
    let (acked, enospc) = write_until_refused(&mut a, 0, &server, |_| {});
    assert_eq!(enospc.errno(), Some(ENOSPC), "A's write failed with {enospc}, not ENOSPC:\n{}", server.log_text());
    eprintln!("A: {} KiB acknowledged, then {enospc}", acked.len() * CHUNK / 1024);
    assert!(acked.len() * CHUNK >= 4 * MIB as usize, "A got {} KiB in before ENOSPC", acked.len() * CHUNK / 1024);
    assert!(server.child.try_wait().expect("try_wait").is_none(), "the server died:\n{}", server.log_text());
    for (offset, data) in &acked {
        read_back(&mut a, *offset, data, "A's acknowledged data after ENOSPC");
    }
    let golden_at = 40 * MIB as usize / 4 + 4321;
    read_back(&mut b, golden_at as u64, &golden_bytes[golden_at..golden_at + 100_000], "golden through B");

    // A leaves (its pages go), and B has the room.
    a.disconnect().expect("A disconnects");
    let data = pseudo_random(4 * MIB as usize, 78);
    let deadline = Instant::now() + WAIT;
    while let Err(error) = b.write(0, &data, false) {
        assert!(Instant::now() < deadline, "B never got A's room back: {error}\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    read_back(&mut b, 0, &data, "B's data");
    b.disconnect().expect("B disconnects");
}

/// The memory directory fills after the server started (other users of `/run`): a VM that can
/// spill (`ram+disk`) must spill, not get ENOSPC for pages the filesystem no longer has, large
/// writes included. The server bounds the VMs by the directory's room (sampled once a second)
/// and cuts them to their share when it runs short, so that the pages they give back return to
/// the filesystem.
#[test]
fn a_memory_directory_others_fill_after_the_start_makes_vms_spill_not_fail() {
    let tmp = TempDir::new().expect("tempdir");
    let (golden, golden_bytes) = golden_file(tmp.path(), 34);
    let fs = SmallFs::mount(&tmp.path().join("memory"), 96);
    let memory = fs.dir.to_str().expect("utf-8").to_owned();
    let spill = tmp.path().join("spill");
    std::fs::create_dir_all(&spill).expect("spill dir");
    let args = [
        "--mode",
        "ram+disk",
        "--ram",
        "64M",
        "--reconnect-grace",
        "1m",
        "--memory-dir",
        &memory,
        "--metrics",
        "tcp:127.0.0.1:0",
    ];
    let server = Server::start(tmp.path(), "s", &golden, &spill, &args);
    let metrics = server.first_event("metrics endpoint up")["metrics"].as_str().expect("metrics URL").to_owned();
    let room = || {
        let fs = nix::sys::statvfs::statvfs(fs.dir.as_path()).expect("statvfs");
        fs.blocks_available() * fs.fragment_size()
    };
    let mut a = server.client("a");
    // What the VM's disk holds: the golden image under every write acknowledged.
    let mut disk = golden_bytes;
    let mut writes = 0u64;
    let mut write = |a: &mut Client, offset: u64, len: usize| {
        writes += 1;
        let data = pseudo_random(len, 2000 + writes);
        if let Err(error) = a.write(offset, &data, false) {
            panic!(
                "the write of {len} bytes at {offset} failed ({error}) with {} KiB free in the memory directory:\n{}",
                room() >> 10,
                server.log_text()
            );
        }
        disk[offset as usize..offset as usize + len].copy_from_slice(&data);
    };
    for offset in (0..8 * MIB).step_by(CHUNK) {
        write(&mut a, offset, CHUNK);
    }
    // Someone else takes all but 8 MiB of the directory: less than half of what the server
    // keeps free for one VM (6 MiB, and 32 MiB for a largest request, but at most a quarter of
    // the filesystem: 24 MiB).
    let theirs = pseudo_random((room() - 8 * MIB) as usize, 99);
    std::fs::write(fs.dir.join("someone-else"), &theirs).expect("another user's file");
    let held_to_a_share = || {
        let (status, _, body) = common::http_get(&metrics, "text/plain");
        assert!(status.contains("200"), "{status}");
        body.contains("overspill_host_cache_memory_per_vm_cap_bytes ")
    };
    let deadline = Instant::now() + WAIT;
    while !held_to_a_share() {
        assert!(Instant::now() < deadline, "the VM was never held to its share:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    // 64 MiB more over the whole 32 MiB disk, twice: small writes and 4 MiB ones.
    for round in 0..2 {
        let mut offset = 0;
        while offset < GOLDEN_BYTES as u64 {
            let len = if (offset / MIB + round * 8) % 16 < 8 { CHUNK } else { 4 * MIB as usize };
            write(&mut a, offset, len);
            offset += len as u64;
        }
    }
    for offset in (0..GOLDEN_BYTES).step_by(4 * MIB as usize) {
        read_back(
            &mut a,
            offset as u64,
            &disk[offset..offset + 4 * MIB as usize],
            "A's disk, spilled as the directory filled",
        );
    }
    assert_eq!(std::fs::read(fs.dir.join("someone-else")).expect("their file"), theirs, "the other user's file");
    a.disconnect().expect("A disconnects");
}

/// An in-place cache file (`--mode disk`) is rebuilt after a crash from the blocks its
/// filesystem reports as data. One that reports data in larger units (here a tmpfs in 2 MiB huge
/// pages) cannot say which blocks the VM wrote: the VM is refused, its files kept, rather than
/// served zeroes where it wrote nothing. Where the kernel keeps that tmpfs in 4 KiB pages after
/// all, the VM is recovered, and every block reads as it should.
#[test]
fn a_cache_file_whose_filesystem_cannot_tell_its_blocks_is_not_rebuilt_wrongly() {
    let tmp = TempDir::new().expect("tempdir");
    let (golden, golden_bytes) = golden_file(tmp.path(), 34);
    let fs = SmallFs::mount_huge(&tmp.path().join("spill"), 64);
    let exact = overspill_engine::store::reports_blocks_exactly(&fs.dir).expect("probe");
    eprintln!("the huge-page tmpfs reports 4 KiB blocks exactly: {exact}");
    let args = ["--mode", "disk", "--ram", "1M", "--reconnect-grace", "1m"];
    let server = Server::start(tmp.path(), "s", &golden, &fs.dir, &args);
    let mut vm = server.client("vm");
    let written = pseudo_random(4096, 35);
    vm.write(MIB, &written, false).expect("write");
    drop(vm);
    drop(server);

    let server = Server::start(tmp.path(), "s", &golden, &fs.dir, &args);
    let uri: NbdUri = format!("nbd+unix:///@vm?socket={}", server.socket.display()).parse().expect("uri");
    match Client::connect(&uri) {
        Ok(mut vm) => {
            assert!(exact, "recovered from a filesystem that cannot tell its blocks:\n{}", server.log_text());
            read_back(&mut vm, MIB, &written, "the written block");
            let next = (MIB + 4096) as usize;
            read_back(&mut vm, next as u64, &golden_bytes[next..next + 8192], "golden blocks beside it");
        }
        Err(error) => {
            assert!(!exact, "refused on a filesystem that tells its blocks: {error}\n{}", server.log_text());
            assert!(fs.dir.join("vm-vm.cache").exists(), "the refused VM's cache file is gone");
            // The refusal says why.
            server.wait_log("4 KiB");
        }
    }
}

/// Servers may share a spill directory, and VM names are each server's own: a VM of the same
/// name on two of them must not take the other's files (they are named after the VM). The
/// second is refused while the first holds them, and the first's data is its own after a crash.
#[test]
fn servers_sharing_a_spill_directory_never_take_each_others_files() {
    let tmp = TempDir::new().expect("tempdir");
    let (golden, _) = golden_file(tmp.path(), 36);
    let spill = tmp.path().join("spill");
    std::fs::create_dir_all(&spill).expect("spill dir");
    let start = |name: &str| Server::sharing(tmp.path(), name, &golden, &spill);
    let a = start("a");
    let b = start("b");
    let mut on_a = a.client("vm1");
    let data = pseudo_random(4 * MIB as usize, 37);
    on_a.write(0, &data, false).expect("A's vm1 writes, spilling");
    let spill_file = spill.join("vm-vm1.spill");
    let inode = std::fs::metadata(&spill_file).expect("A's spill file").ino();

    let uri: NbdUri = format!("nbd+unix:///@vm1?socket={}", b.socket.display()).parse().expect("uri");
    if let Ok(mut on_b) = Client::connect(&uri) {
        assert!(on_b.write(0, &[1; 4096], false).is_err(), "B's vm1 was given state files under A's names");
    }
    // (Logged as the refusal goes out: the client may hear it first.)
    b.wait_log("another process");
    assert_eq!(std::fs::metadata(&spill_file).expect("A's spill file").ino(), inode, "B took A's spill file");

    // A crashes and comes back: its vm1's data is its own.
    drop(on_a);
    drop(a);
    let a = start("a");
    let mut on_a = a.client("vm1");
    read_back(&mut on_a, 0, &data, "A's vm1 after a crash");
    on_a.disconnect().expect("disconnect");
}

/// The other way round: B's VM crashed with it and waits in B's files for B's next start. A's
/// VM of the same name is refused those files (no ledger of A's names them), never given them
/// as leftovers to remove; and a reset of a VM B lost leaves the files A holds.
#[test]
fn a_crashed_servers_files_wait_for_it_and_a_reset_there_spares_another_servers() {
    let tmp = TempDir::new().expect("tempdir");
    let (golden, _) = golden_file(tmp.path(), 38);
    let spill = tmp.path().join("spill");
    std::fs::create_dir_all(&spill).expect("spill dir");
    let start = |name: &str| Server::sharing(tmp.path(), name, &golden, &spill);
    let vm_command = |server: &str, args: &[&str]| {
        let control = tmp.path().join(format!("{server}-state/control.sock"));
        let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
            .arg("vm")
            .arg("--control")
            .arg(control)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("overspill vm");
        assert!(out.status.success(), "vm {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let spill_file = spill.join("vm-vm1.spill");

    let mut b = start("b");
    let b_data = pseudo_random(4 * MIB as usize, 39);
    b.client("vm1").write(0, &b_data, false).expect("B's vm1 writes, spilling");
    b.kill9();
    let inode = std::fs::metadata(&spill_file).expect("B's spill file").ino();

    let a = start("a");
    let uri: NbdUri = format!("nbd+unix:///@vm1?socket={}", a.socket.display()).parse().expect("uri");
    if let Ok(mut on_a) = Client::connect(&uri) {
        assert!(on_a.write(0, &[1; 4096], false).is_err(), "A's vm1 was given B's state files");
    }
    a.wait_log("no ledger entry of this server names it");
    assert_eq!(std::fs::metadata(&spill_file).expect("B's spill file").ino(), inode, "A took B's spill file");
    let mut b = start("b");
    let mut on_b = b.client("vm1");
    read_back(&mut on_b, 0, &b_data, "B's vm1 after B's crash, A having asked for the name");
    drop(on_b);
    b.kill9();

    // B's vm1 loses its spill file (an operator's hand): B's next start cannot rebuild it. A's
    // vm1 then makes files of that name, and B's reset of its lost vm1 leaves them to A.
    std::fs::remove_file(&spill_file).expect("remove B's spill file");
    let mut on_a = a.client("vm1");
    let a_data = pseudo_random(4 * MIB as usize, 40);
    on_a.write(0, &a_data, false).expect("A's vm1 writes, spilling");
    let inode = std::fs::metadata(&spill_file).expect("A's spill file").ino();
    let b = start("b");
    assert!(vm_command("b", &["list"]).contains("lost"), "B's vm1 is lost:\n{}", b.log_text());
    vm_command("b", &["reset", "vm1"]);
    assert_eq!(std::fs::metadata(&spill_file).expect("A's spill file").ino(), inode, "B's reset took A's file");
    drop(on_a);
    drop(a);
    let a = start("a");
    read_back(&mut a.client("vm1"), 0, &a_data, "A's vm1 after B's reset and A's crash");
}

/// The spill filesystem fills up: the VM writing gets ENOSPC and keeps what it was told it
/// wrote; another VM on the same server goes on reading and writing in its RAM.
#[test]
fn a_full_spill_filesystem_gives_enospc_to_the_writer_and_others_go_on() {
    let tmp = TempDir::new().expect("tempdir");
    let (golden, golden_bytes) = golden_file(tmp.path(), 31);
    // Declared before the server, so the server is gone before the unmount.
    let fs = SmallFs::mount(&tmp.path().join("spill"), 16);
    let server = Server::start(tmp.path(), "s", &golden, &fs.dir, &["--ram", "1M"]);
    let mut a = server.client("a");
    let mut b = server.client("b");

    // B's own blocks: 256 KiB, well inside its 1 MiB of RAM.
    let b_area = 64 * MIB / 4;
    let mut b_data = pseudo_random(256 * 1024, 32);
    b.write(b_area, &b_data, false).expect("B writes into RAM");

    // A writes fresh data until the filesystem is full; each acknowledged chunk is remembered.
    let (acked, enospc) = write_until_refused(&mut a, 0, &server, |written| {
        // B, between A's writes: its blocks, and the golden image where it wrote nothing.
        let i = written % 64;
        let block = pseudo_random(4096, 2000 + written as u64);
        b.write(b_area + i as u64 * 4096, &block, false).expect("B writes while A fills the disk");
        b_data[i * 4096..(i + 1) * 4096].copy_from_slice(&block);
        read_back(&mut b, b_area, &b_data, "B's blocks while A fills the disk");
    });
    assert_eq!(enospc.errno(), Some(ENOSPC), "A's write failed with {enospc}, not ENOSPC");
    eprintln!("A: {} KiB acknowledged, then {enospc}", acked.len() * CHUNK / 1024);
    assert!(acked.len() * CHUNK >= 8 * MIB as usize, "A got {} KiB in before ENOSPC", acked.len() * CHUNK / 1024);
    // The operator hears of it too, naming the VM, once and not for every refused write. Log
    // lines reach the file through the server's log thread: a moment after the reply.
    let deadline = Instant::now() + WAIT;
    while !server.log_text().contains("a write got ENOSPC") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = server.log_text();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("WARN") && l.contains("a write got ENOSPC")).collect();
    assert!(!warnings.is_empty() && warnings.iter().all(|l| l.contains("\"vm\":\"a\"")), "{log}");
    assert!(warnings.len() <= 2, "a warning per refused write: {warnings:?}");
    let spill = server.spill_files();
    assert_eq!(spill.len(), 2, "one spill file per VM: {spill:?}");

    // Everything A was told it wrote reads back, from RAM, the open segment and the full disk.
    for (offset, data) in &acked {
        read_back(&mut a, *offset, data, "A's acknowledged data after ENOSPC");
    }
    // A can still overwrite what it holds in RAM, or gets ENOSPC again: never anything else.
    let (last_offset, _) = acked.last().expect("A wrote something");
    match a.write(*last_offset, &[0x5a; 4096], false) {
        Ok(()) => read_back(&mut a, *last_offset, &[0x5a; 4096], "A's overwrite"),
        Err(error) => assert_eq!(error.errno(), Some(ENOSPC), "{error}"),
    }

    // B goes on as before: writes in RAM, reads of its data and of the golden image.
    for i in 0..64 {
        let block = pseudo_random(4096, 3000 + i as u64);
        b.write(b_area + i as u64 * 4096, &block, false).expect("B writes after A's ENOSPC");
        b_data[i * 4096..(i + 1) * 4096].copy_from_slice(&block);
    }
    read_back(&mut b, b_area, &b_data, "B's blocks after A's ENOSPC");
    let golden_at = 40 * MIB as usize / 4 + 12345;
    read_back(&mut b, golden_at as u64, &golden_bytes[golden_at..golden_at + 100_000], "golden through B");

    // A VM that disconnects gives the space back, and the next one can spill again.
    a.disconnect().expect("A disconnects");
    let deadline = Instant::now() + WAIT;
    while server.spill_files().len() > 1 {
        assert!(Instant::now() < deadline, "A's spill file still there:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = server.client("c");
    let data = pseudo_random(4 * MIB as usize, 77);
    c.write(0, &data, false).expect("C spills once A's file is gone");
    read_back(&mut c, 0, &data, "C's data");
}

/// A VM keeps dead segments of its spill file allocated, to write its next segments over
/// them; once another VM is refused space, it gives them back at its next write, and the VM
/// that was refused can write again.
#[test]
fn a_vm_refused_space_gets_back_the_dead_segments_another_vm_keeps() {
    let tmp = TempDir::new().expect("tempdir");
    let (golden, _) = golden_file(tmp.path(), 41);
    let fs = SmallFs::mount(&tmp.path().join("spill"), 16);
    let server = Server::start(tmp.path(), "s", &golden, &fs.dir, &["--ram", "8M"]);

    let mut b = server.client("b");
    let (first, overwrite) = spill_and_keep_dead_segments(&mut b);
    let b_file = server.spill_files().into_iter().next().expect("B's spill file");
    let b_before = allocated_bytes(&b_file);
    eprintln!("B's spill file: {} KiB allocated", b_before / 1024);
    assert!(b_before >= 6 * MIB, "B's dead segments are not kept: {} KiB", b_before / 1024);

    // A fills the rest of the filesystem. B reads meanwhile: it is not quiet (a quiet VM gives
    // its kept segments back by itself), and a read does not hear of the shortage.
    let mut a = server.client("a");
    let mut golden_block = vec![0u8; 4096];
    let (acked, enospc) = write_until_refused(&mut a, 0, &server, |_| {
        b.read(0, &mut golden_block).expect("B reads while A fills the disk");
    });
    assert_eq!(enospc.errno(), Some(ENOSPC), "A's write failed with {enospc}, not ENOSPC");
    assert_eq!(allocated_bytes(&b_file), b_before, "B kept its space while it only read");

    // B's next write (one block, into its RAM) hears of it and punches its dead segments.
    b.write(KEPT_RAM, &overwrite[..4096], false).expect("B writes into RAM");
    let b_after = allocated_bytes(&b_file);
    eprintln!("B's spill file: {} KiB allocated after A was refused", b_after / 1024);
    assert!(b_before - b_after >= 4 * MIB, "B gave back only {} KiB", (b_before - b_after) / 1024);

    // A writes again where it was refused, and everything of both reads back.
    let offset = (acked.len() * CHUNK) as u64;
    let data = pseudo_random(CHUNK, 9);
    a.write(offset, &data, false).expect("A writes in the space B gave back");
    read_back(&mut a, offset, &data, "A's write after B gave space back");
    for (offset, data) in &acked {
        read_back(&mut a, *offset, data, "A's acknowledged data");
    }
    read_back_kept(&mut b, &first, &overwrite);
}

/// What [`spill_and_keep_dead_segments`] keeps in RAM, and spills.
const KEPT_RAM: u64 = 6 * MIB;
const KEPT_SPILLED: u64 = 8 * MIB;

/// A VM with an 8 MiB RAM target fills its RAM and spills four segments; then it trims what is
/// in RAM and overwrites three spilled segments' worth, which now fits in RAM: those segments
/// die with nothing to take their place, and stay allocated, kept. One spilled segment stays
/// live (a log with nothing live gives its kept segments back by itself). Returns what it wrote
/// first, and the overwrite.
fn spill_and_keep_dead_segments(vm: &mut Client) -> (Vec<u8>, Vec<u8>) {
    let write_all = |vm: &mut Client, offset: u64, data: &[u8]| {
        for (i, piece) in data.chunks(CHUNK).enumerate() {
            vm.write(offset + (i * CHUNK) as u64, piece, false).expect("the VM's writes fit");
        }
    };
    let first = pseudo_random((KEPT_RAM + KEPT_SPILLED) as usize, 500);
    write_all(vm, 0, &first);
    vm.trim(0, KEPT_RAM as u32).expect("the VM trims what it holds in RAM");
    let overwrite = pseudo_random(6 * MIB as usize, 501);
    write_all(vm, KEPT_RAM, &overwrite);
    // Segments are written in the background: a flush waits for the last one to land, so the
    // allocation measured after it is not overtaken by it later.
    vm.flush().expect("the VM flushes");
    (first, overwrite)
}

/// Reads back what [`spill_and_keep_dead_segments`] left live.
fn read_back_kept(vm: &mut Client, first: &[u8], overwrite: &[u8]) {
    read_back(vm, KEPT_RAM, overwrite, "the overwritten blocks");
    let live = (KEPT_RAM + 6 * MIB) as usize;
    read_back(vm, live as u64, &first[live..], "the blocks still in the spill log");
}

/// A connected VM that sends nothing for 10 s gives back the dead spill segments it kept for
/// its next writes, the few always kept too, at the next wake-up of its connection's wait for a
/// request (every third of `--request-timeout`, here 2 s), with no other VM short of space; its
/// data reads back.
#[test]
fn a_quiet_vm_gives_back_the_dead_segments_it_kept() {
    let tmp = TempDir::new().expect("tempdir");
    let (golden, _) = golden_file(tmp.path(), 41);
    let server =
        Server::start(tmp.path(), "s", &golden, &tmp.path().join("spill"), &["--ram", "8M", "--request-timeout", "6"]);
    let mut vm = server.client("quiet");
    let (first, overwrite) = spill_and_keep_dead_segments(&mut vm);
    let file = server.spill_files().into_iter().next().expect("the VM's spill file");
    let before = allocated_bytes(&file);
    assert!(before >= 6 * MIB, "the dead segments are not kept: {} KiB", before / 1024);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut now = before;
    while before - now < 6 * MIB {
        assert!(Instant::now() < deadline, "the quiet VM kept {} of {} KiB", now / 1024, before / 1024);
        std::thread::sleep(Duration::from_millis(50));
        now = allocated_bytes(&file);
    }
    eprintln!("the quiet VM's spill file: {} KiB allocated, then {} KiB", before / 1024, now / 1024);
    read_back_kept(&mut vm, &first, &overwrite);
}

/// A server killed with SIGKILL leaves its spill file behind; the next server on the directory
/// removes it, and leaves alone the file of another server that is still running, whose VM
/// keeps its data.
#[test]
fn a_restart_removes_the_dead_servers_spill_files_and_keeps_the_live_ones() {
    let tmp = TempDir::new().expect("tempdir");
    let (golden, golden_bytes) = golden_file(tmp.path(), 41);
    let shared_spill = tmp.path().join("spill");
    let spill_enough = |client: &mut Client, seed: u64| {
        // 4 MiB against a 1 MiB RAM target: whole segments go to the spill file.
        let data = pseudo_random(4 * MIB as usize, seed);
        client.write(0, &data, false).expect("write");
        data
    };

    let mut one = Server::start(tmp.path(), "one", &golden, &shared_spill, &["--ram", "1M"]);
    let mut vm1 = one.client("vm1");
    spill_enough(&mut vm1, 1);
    let two = Server::start(tmp.path(), "two", &golden, &shared_spill, &["--ram", "1M"]);
    let mut vm2 = two.client("vm2");
    let vm2_data = spill_enough(&mut vm2, 2);
    let one_files = one.spill_files();
    let two_files = two.spill_files();
    assert_eq!((one_files.len(), two_files.len()), (1, 1), "{one_files:?} {two_files:?}");
    // Segments are written in the background: give the last one a moment to land.
    for (file, who) in [(&one_files[0], "server one's VM spilled"), (&two_files[0], "server two's VM spilled")] {
        let deadline = Instant::now() + WAIT;
        while allocated_bytes(file) == 0 {
            assert!(Instant::now() < deadline, "{who}: its spill file has nothing allocated");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    one.kill9();
    drop(vm1);
    assert!(one_files[0].exists(), "SIGKILL leaves the spill file behind");

    let three = Server::start(tmp.path(), "three", &golden, &shared_spill, &["--ram", "1M"]);
    assert!(!one_files[0].exists(), "server three removed the dead server's spill file");
    assert!(two_files[0].exists(), "server three left the live server's spill file alone");
    three.first_event("removed cache file of a dead server");
    let removed = three.events("removed cache file of a dead server");
    assert_eq!(removed.len(), 1, "one file removed: {removed:?}");

    read_back(&mut vm2, 0, &vm2_data, "server two's VM after server three started");
    let mut vm3 = three.client("vm3");
    read_back(&mut vm3, 8 * MIB, &golden_bytes[8 * MIB as usize..9 * MIB as usize], "server three serves");
}

/// SIGTERM drains: accepting stops, in-flight requests are answered, connections close, cache
/// files and the socket go, and the server exits 0 within a few seconds.
#[test]
fn sigterm_drains_connections_removes_files_and_exits_zero() {
    let tmp = TempDir::new().expect("tempdir");
    let (golden, golden_bytes) = golden_file(tmp.path(), 51);
    let spill_dir = tmp.path().join("spill");
    let mut server = Server::start(tmp.path(), "s", &golden, &spill_dir, &["--ram", "1M"]);
    let mut idle = server.client("idle");
    read_back(&mut idle, 0, &golden_bytes[..4096], "idle VM's first read");

    // One write at a time, so every request the server took is one whose reply the client reads.
    let streaming = {
        let mut client = server.client("stream");
        std::thread::spawn(move || {
            let mut acked = 0u64;
            loop {
                // 64 KiB over 8 MiB, wrapping: enough to spill against the 1 MiB target.
                let offset = (acked % 128) * 64 * 1024;
                match client.write(offset, &pseudo_random(64 * 1024, acked), false) {
                    Ok(()) => acked += 1,
                    Err(error) => return (acked, error),
                }
            }
        })
    };
    let deadline = Instant::now() + WAIT;
    while server.spill_files().len() < 2 || allocated_bytes(&server.spill_files()[1]) == 0 {
        assert!(Instant::now() < deadline, "the streaming VM never spilled:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(10));
    }
    let files = server.spill_files();

    let (status, took) = server.terminate(Duration::from_secs(5));
    assert!(status.success(), "exit status {status} after SIGTERM:\n{}", server.log_text());
    assert!(took < Duration::from_secs(3), "drained in {took:?}");

    let (acked, error) = streaming.join().expect("streaming client");
    eprintln!("drained in {took:?}; the streaming VM had {acked} writes acknowledged, then: {error}");
    assert_closed(&error, "streaming VM");
    // The server's count of the streaming VM's requests is the client's count of replies: none
    // was taken and then dropped without an answer.
    let disconnects = server.events("disconnected");
    let stream = disconnects
        .iter()
        .find(|f| f["export"].as_str().is_some_and(|e| e.ends_with("@stream")))
        .unwrap_or_else(|| panic!("no disconnect logged for the streaming VM:\n{}", server.log_text()));
    assert_eq!(stream["requests"].as_u64(), Some(acked), "requests served vs replies the VM read: {stream}");
    assert!(acked > 0);

    let mut buf = [0u8; 4096];
    assert_closed(&idle.read(0, &mut buf).expect_err("the idle VM was disconnected"), "idle VM");
    for file in &files {
        assert!(!file.exists(), "{} left behind", file.display());
    }
    assert!(!server.socket.exists(), "the Unix socket was removed");
    assert_eq!(server.events("VM disconnected; its cache is dropped").len(), 2, "both overlays dropped");
    assert_eq!(server.events("shut down").len(), 1, "the server logged its end");
}

/// Golden-image read errors reach only the request that met them: the same VM and another one
/// go on reading elsewhere and writing, and a VM that overwrote the bad blocks reads its own.
#[test]
fn golden_read_errors_reach_only_the_readers_of_the_bad_range() {
    let tmp = TempDir::new().expect("tempdir");
    let golden_bytes = pseudo_random(16 << 20, 61);
    let bad = 5 * MIB..5 * MIB + 8192;
    let faulty = FaultyImage::new(
        Arc::new(MemImage::new(golden_bytes.clone())),
        FaultPlan::new(61).rule(Rule::new(Op::Read, Fault::Io, Trigger::From(1)).within(bad.clone())),
    );
    let faults = faulty.handle();
    let images = BTreeMap::from([(String::new(), Arc::new(faulty) as Arc<dyn GoldenImage>)]);
    let settings = CacheSettings {
        mode: WriteCacheMode::RamDisk,
        ram_target_bytes: MIB,
        spill_max_bytes: None,
        spill_direct: false,
        spill_writers: DEFAULT_SPILL_WRITERS,
        spill_dir: tmp.path().join("spill"),
        shared_dir: tmp.path().join("shared"),
        // Through the shared read cache, as served: a failed fetch must not be cached as data.
        read_cache_bytes: 4 * MIB,
    };
    let mut exports = OverlayExports::new(images, settings, HostMemory::unlimited()).expect("exports");
    // Anonymous clients that write, each to its own throwaway overlay.
    exports.allow_anonymous_writes();
    let server = overspill_nbd::Server::new(Arc::new(exports), ServerConfig::default());
    let connect = || {
        let stream = socketpair(&server).expect("socketpair");
        Client::handshake(Box::new(stream), "", true).expect("handshake")
    };
    let mut reader = connect();
    let mut other = connect();
    let golden = |range: std::ops::Range<u64>| golden_bytes[range.start as usize..range.end as usize].to_vec();

    let mut buf = vec![0u8; 64 * 1024];
    let error = reader.read(bad.start - 4096, &mut buf).expect_err("a read over the bad range fails");
    assert_eq!(error.errno(), Some(EIO), "{error}");
    assert!(faults.injected().io > 0);
    // The same connection goes on: other ranges read, writes land, and the bad range still fails.
    read_back(&mut reader, 0, &golden(0..64 * 1024), "reader, elsewhere");
    read_back(&mut reader, bad.end + 64 * 1024, &golden(bad.end + 64 * 1024..bad.end + 128 * 1024), "reader");
    let data = pseudo_random(12_288, 62);
    reader.write(MIB + 100, &data, false).expect("reader writes");
    read_back(&mut reader, MIB + 100, &data, "reader's write");
    let error = reader.read(bad.start, &mut buf[..4096]).expect_err("still bad");
    assert_eq!(error.errno(), Some(EIO), "{error}");
    // Another VM: fine everywhere else, and the bad range fails for it too, on its own request.
    read_back(&mut other, 2 * MIB, &golden(2 * MIB..2 * MIB + 256 * 1024), "other VM");
    other.write(0, &data, false).expect("other VM writes");
    read_back(&mut other, 0, &data, "other VM's write");
    let error = other.read(bad.start + 4096, &mut buf[..4096]).expect_err("bad for everyone");
    assert_eq!(error.errno(), Some(EIO), "{error}");
    // Whole blocks written over the bad range are the VM's own: no golden read, no error.
    let cover = pseudo_random(8192, 63);
    other.write(bad.start, &cover, false).expect("overwrite the bad blocks");
    read_back(&mut other, bad.start, &cover, "the VM's own copy of the bad blocks");
    // A partial write into a bad block must read it first, and fails with EIO, not ENOSPC.
    let error = reader.write(bad.start + 10, &[1; 100], false).expect_err("partial write over a bad block");
    assert_eq!(error.errno(), Some(EIO), "{error}");
    read_back(&mut reader, MIB + 100, &data, "reader after all that");
    reader.disconnect().expect("disconnect");
    other.disconnect().expect("disconnect");
}
