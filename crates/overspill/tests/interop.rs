//! Interop: the real `overspill serve` binary, driven over a Unix socket by real NBD clients
//! (qemu-io, qemu-img, nbdinfo, nbdcopy, fio) and by the project's own client.
//!
//! Every connection is a fresh copy-on-write overlay, so whatever writes and reads back must do
//! both on one connection. A missing client binary fails the test rather than skipping it: CI
//! installs qemu-utils, libnbd-bin, nbdkit and fio, and a silently skipped interop test proves
//! nothing. Golden images are pseudo-random but deterministic, so any failure reproduces, and
//! every test checks at its end that the server left its golden image untouched.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use overspill_nbd::client::{Client, NbdUri};
use serde_json::Value;
use tempfile::TempDir;

const MIB: u64 = 1 << 20;
const SEGMENT_BYTES: u64 = 2 * MIB;
const GOLDEN_BYTES: usize = 64 << 20;
const ENOSPC: u32 = 28;
const DISCONNECT_MESSAGE: &str = "VM disconnected; its cache is dropped";
const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Data

mod common;
use common::{assert_same, http_get, pseudo_random, run_ok, run_tool, sample, scrape, spawn_tool, ToolOutput};

/// A golden image file with the bytes it was made from, to prove later that nobody wrote it.
struct Golden {
    path: PathBuf,
    bytes: Vec<u8>,
    mtime: SystemTime,
}

impl Golden {
    fn create(dir: &Path, name: &str, size: usize, seed: u64) -> Self {
        let path = dir.join(name);
        let bytes = pseudo_random(size, seed);
        std::fs::write(&path, &bytes).expect("writing golden image");
        let mtime = std::fs::metadata(&path).and_then(|m| m.modified()).expect("golden mtime");
        Self { path, bytes, mtime }
    }

    fn size(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn path(&self) -> &str {
        self.path.to_str().expect("utf-8 temp path")
    }

    #[track_caller]
    fn assert_untouched(&self) {
        let meta = std::fs::metadata(&self.path).expect("golden image still there");
        assert_eq!(meta.modified().expect("mtime"), self.mtime, "golden image {} mtime changed", self.path.display());
        let now = std::fs::read(&self.path).expect("reading golden image");
        assert_same(&now, &self.bytes, "golden image contents");
    }
}

/// What a VM's disk should read as: the golden bytes plus its own writes.
struct Model {
    golden: Vec<u8>,
    disk: Vec<u8>,
}

impl Model {
    fn new(golden: &Golden) -> Self {
        Self { golden: golden.bytes.clone(), disk: golden.bytes.clone() }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        self.disk[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }

    fn fill(&mut self, offset: u64, len: u64, byte: u8) {
        self.disk[offset as usize..(offset + len) as usize].fill(byte);
    }

    /// A TRIM of whole blocks: the overlay forgets them and they read from the golden image.
    fn trim(&mut self, offset: u64, len: u64) {
        assert_eq!((offset % 4096, len % 4096), (0, 0), "model trims whole blocks only");
        let range = offset as usize..(offset + len) as usize;
        self.disk[range.clone()].copy_from_slice(&self.golden[range]);
    }

    fn range(&self, offset: u64, len: u64) -> &[u8] {
        &self.disk[offset as usize..(offset + len) as usize]
    }
}

// ---------------------------------------------------------------------------------------------
// The server under test

/// The server's two cache directories.
#[derive(Debug, Clone, Copy)]
enum CacheDir {
    /// `--spill-dir`: spill files (`ram+disk`) and local cache files (`disk`).
    Spill,
    /// `--shared-dir`: differencing files (`shared`).
    Shared,
}

/// A running `overspill serve` with its own socket, cache directories and JSON log file; killed
/// when dropped (and its log shown if the test failed).
struct Server {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
    spill_dir: PathBuf,
    shared_dir: PathBuf,
}

impl Server {
    /// Serves `golden` as export "" with `extra` arguments (mode, sizes, more exports).
    fn start(dir: &Path, golden: &Golden, extra: &[&str]) -> Self {
        let socket = dir.join("s.sock");
        let log = dir.join("server.log");
        let spill_dir = dir.join("spill");
        let shared_dir = dir.join("shared");
        let log_file = std::fs::File::create(&log).expect("creating server log");
        let child = Command::new(env!("CARGO_BIN_EXE_overspill"))
            .arg("--log-json")
            .arg("serve")
            .args(["--base", golden.path()])
            .arg("--listen")
            .arg(format!("unix:{}", socket.display()))
            .arg("--spill-dir")
            .arg(&spill_dir)
            .arg("--shared-dir")
            .arg(&shared_dir)
            .arg("--memory-dir")
            .arg(dir.join("memory"))
            // No host-memory pressure from whatever else runs on the machine: targets stay put.
            .args(["--ram-floor", "0"])
            // These tests watch overlays end with their connections (libnbd's clients close
            // without NBD_CMD_DISC); overlays waiting for a reconnect are tests/lifecycle.rs's.
            .args(["--reconnect-grace", "0"])
            // Most of these tests write as anonymous clients, each to its own throwaway overlay.
            .arg("--anonymous-writes")
            .args(extra)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("starting overspill serve");
        let mut server = Self { child, socket, log, spill_dir, shared_dir };
        server.wait_ready();
        server
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

    /// The NBD URI of an export (`""` is the base image; `@VM` names the VM).
    fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }

    fn client(&self, export: &str) -> Client {
        let uri: NbdUri = self.uri(export).parse().expect("valid URI");
        Client::connect(&uri).unwrap_or_else(|e| panic!("connecting to {export:?}: {e}\n{}", self.log_text()))
    }

    #[track_caller]
    fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().expect("try_wait") {
            panic!("overspill serve died with {status}:\n{}", self.log_text());
        }
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

    /// Waits until `vm` has disconnected and returns the stats it logged.
    fn wait_disconnect(&self, vm: &str) -> Value {
        self.wait_for(&format!("VM {vm} to disconnect"), || {
            self.events(DISCONNECT_MESSAGE).into_iter().find(|f| f["vm"] == vm)
        })
    }

    /// Waits until at least `n` VMs have disconnected; returns all their stats.
    fn wait_disconnects(&self, n: usize) -> Vec<Value> {
        self.wait_for(&format!("{n} VMs to disconnect"), || {
            let events = self.events(DISCONNECT_MESSAGE);
            (events.len() >= n).then_some(events)
        })
    }

    fn wait_for<T>(&self, what: &str, probe: impl FnMut() -> Option<T>) -> T {
        common::wait_for(what, WAIT, || self.log_text(), probe)
    }

    fn dir(&self, which: CacheDir) -> &Path {
        match which {
            CacheDir::Spill => &self.spill_dir,
            CacheDir::Shared => &self.shared_dir,
        }
    }

    /// This server's cache files of one kind (`spill`, `cache`, `diff`) in `dir`.
    fn cache_files(&self, dir: &Path, suffix: &str) -> Vec<PathBuf> {
        let prefix = format!("overspill-{}-", self.child.id());
        let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
        entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                name.starts_with(&prefix) && name.ends_with(&format!(".{suffix}"))
            })
            .collect()
    }

    fn only_cache_file(&self, dir: &Path, suffix: &str) -> PathBuf {
        let files = self.cache_files(dir, suffix);
        assert_eq!(files.len(), 1, "expected one .{suffix} file in {}, found {files:?}", dir.display());
        files.into_iter().next().expect("one file")
    }

    fn wait_no_cache_files(&self, dir: &Path, suffix: &str) {
        self.wait_for(&format!(".{suffix} files in {} to go", dir.display()), || {
            self.cache_files(dir, suffix).is_empty().then_some(())
        });
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let text = self.log_text();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!("--- last lines of the server log ---");
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

fn u64_field(fields: &Value, name: &str) -> u64 {
    fields[name].as_u64().unwrap_or_else(|| panic!("log field {name} missing or not a number in {fields}"))
}

// ---------------------------------------------------------------------------------------------
// Real clients

/// qemu-io's `read -v` hex dump lines (`0000a000:  61 62 ... ab.`) as (offset, bytes).
fn parse_hex_dump(output: &str) -> Vec<(u64, Vec<u8>)> {
    output
        .lines()
        .filter_map(|line| {
            let (address, rest) = line.split_once(":  ")?;
            if address.len() < 8 || !address.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            let offset = u64::from_str_radix(address, 16).ok()?;
            // The last field is the ASCII column (alphanumerics and dots, no spaces).
            let mut fields: Vec<&str> = rest.split_whitespace().collect();
            fields.pop()?;
            let bytes = fields.iter().map(|h| u8::from_str_radix(h, 16)).collect::<Result<Vec<u8>, _>>().ok()?;
            Some((offset, bytes))
        })
        .collect()
}

/// Reads a whole disk over one connection, in 4 MiB requests.
fn read_disk(client: &mut Client) -> Vec<u8> {
    let size = client.size();
    let mut disk = vec![0u8; size as usize];
    for (i, chunk) in disk.chunks_mut(4 << 20).enumerate() {
        client.read(i as u64 * (4 << 20), chunk).expect("reading the disk back");
    }
    disk
}

fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).expect("stat cache file").blocks() * 512
}

// ---------------------------------------------------------------------------------------------
// Tests

/// qemu-io writes patterns (aligned, unaligned, zeroes, discards; more than the RAM target, so
/// they spill) and reads them back on the same connection, its own pattern check and a hex
/// dump both compared.
#[test]
fn qemu_io_writes_zeroes_and_discards_read_back_on_one_connection() {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 1);
    let server = Server::start(dir.path(), &golden, &["--ram", "4M"]);
    let mut model = Model::new(&golden);
    let mut commands: Vec<String> = Vec::new();
    let mut write = |model: &mut Model, byte: u8, offset: u64, len: u64| {
        commands.push(format!("write -P {byte:#04x} {offset} {len}"));
        model.fill(offset, len, byte);
    };
    write(&mut model, 0xab, 4096, MIB);
    write(&mut model, 0x11, 1000, 3000);
    // Straddles a 4 KiB boundary and overwrites the head of the 0xab range.
    write(&mut model, 0x22, 4000, 300);
    // 12 MiB, three times the RAM target: most of it goes to the spill file.
    write(&mut model, 0xcd, 16 * MIB, 12 * MIB);
    // Straddles a 2 MiB segment boundary.
    write(&mut model, 0x77, 30 * MIB - 10, 20);
    write(&mut model, 0x5e, 40 * MIB + 1, 3 * MIB + 7);
    commands.push(format!("write -z {} {}", 18 * MIB, MIB));
    model.fill(18 * MIB, MIB, 0);
    commands.push(format!("write -z {} {}", 19 * MIB + 100, 5000));
    model.fill(19 * MIB + 100, 5000, 0);
    commands.push(format!("discard {} {}", 22 * MIB, 2 * MIB));
    model.trim(22 * MIB, 2 * MIB);
    commands.push(format!("discard {} {}", 41 * MIB, MIB));
    model.trim(41 * MIB, MIB);

    let patterns: [(u8, u64, u64); 12] = [
        (0x11, 1000, 3000),
        (0x22, 4000, 300),
        (0xab, 4300, 4096 + MIB - 4300),
        (0xcd, 16 * MIB, 2 * MIB),
        (0, 18 * MIB, MIB),
        (0xcd, 19 * MIB, 100),
        (0, 19 * MIB + 100, 5000),
        (0xcd, 19 * MIB + 5100, 3 * MIB - 5100),
        (0xcd, 24 * MIB, 4 * MIB),
        (0x77, 30 * MIB - 10, 20),
        (0x5e, 40 * MIB + 1, MIB - 1),
        (0x5e, 42 * MIB, MIB + 8),
    ];
    for (byte, offset, len) in patterns {
        assert!(model.range(offset, len).iter().all(|&b| b == byte), "test bug: model disagrees at {offset}");
        commands.push(format!("read -P {byte:#04x} {offset} {len}"));
    }
    // Hex dumps where the disk must show golden bytes: never written, discarded, or next to a
    // small write.
    let dumps: [(u64, u64); 7] = [
        (0, 1000),
        (4096 + MIB, 4096),
        (22 * MIB, 4096),
        (24 * MIB - 4096, 4096),
        (28 * MIB, 8192),
        (30 * MIB - 4096, 4096 + 4096),
        (41 * MIB - 16, 32),
    ];
    for (offset, len) in dumps {
        commands.push(format!("read -v {offset} {len}"));
    }

    let uri = server.uri("@qemu-io");
    let mut args = vec!["-f", "raw", &uri];
    for c in &commands {
        args.extend(["-c", c]);
    }
    let out = run_tool(dir.path(), "qemu-io", &args);
    assert!(!out.stdout.contains("Pattern verification failed"), "qemu-io pattern check failed:\n{}", out.all());
    assert!(out.status.success(), "qemu-io failed:\n{}", out.all());

    let dumped = parse_hex_dump(&out.stdout);
    let dumped_bytes: usize = dumped.iter().map(|(_, b)| b.len()).sum();
    assert_eq!(dumped_bytes as u64, dumps.iter().map(|d| d.1).sum::<u64>(), "hex dump incomplete:\n{}", out.all());
    for (offset, bytes) in dumped {
        assert_same(&bytes, model.range(offset, bytes.len() as u64), &format!("qemu-io dump at {offset:#x}"));
    }

    let stats = server.wait_disconnect("qemu-io");
    assert!(u64_field(&stats, "spill_write_ops") > 0, "12 MiB over a 4 MiB target should spill: {stats}");
    assert!(server.cache_files(&server.spill_dir, "spill").is_empty(), "spill file left after disconnect");
    golden.assert_untouched();
}

#[test]
fn nbdinfo_shows_size_block_sizes_flags_and_lists_exports() {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 2);
    let other = Golden::create(dir.path(), "other.img", 16 << 20, 3);
    let export = format!("other={}", other.path());
    let server = Server::start(dir.path(), &golden, &["--export", &export]);

    let out = run_ok(dir.path(), "nbdinfo", &["--json", &server.uri("")]);
    let info: Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("nbdinfo JSON: {e}\n{}", out.all()));
    let exports = info["exports"].as_array().expect("exports array");
    assert_eq!(exports.len(), 1, "{info}");
    let e = &exports[0];
    assert_eq!(e["export-name"], "");
    assert_eq!(e["export-size"].as_u64(), Some(golden.size()), "{e}");
    let minimum = e["block_size_minimum"].as_u64().expect("minimum block size");
    assert!((1..=512).contains(&minimum), "minimum block size {minimum}");
    assert_eq!(e["block_size_preferred"].as_u64(), Some(4096), "{e}");
    assert_eq!(e["block_size_maximum"].as_u64(), Some(32 << 20), "{e}");
    for flag in ["can_trim", "can_zero", "can_flush"] {
        assert_eq!(e[flag], true, "{flag} in {e}");
    }
    assert_eq!(e["can_multi_conn"], false, "each connection is its own overlay: {e}");
    assert_eq!(e["is_read_only"], false, "{e}");

    let out = run_ok(dir.path(), "nbdinfo", &["--list", "--json", &server.uri("")]);
    let list: Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("nbdinfo JSON: {e}\n{}", out.all()));
    let mut listed: Vec<(String, u64)> = list["exports"]
        .as_array()
        .expect("exports array")
        .iter()
        .map(|e| (e["export-name"].as_str().expect("name").to_owned(), e["export-size"].as_u64().expect("size")))
        .collect();
    listed.sort();
    assert_eq!(listed, [(String::new(), golden.size()), ("other".to_owned(), other.size())]);

    // The plain-text listing names both too.
    let out = run_ok(dir.path(), "nbdinfo", &["--list", &server.uri("")]);
    assert!(out.stdout.contains("export=\"other\""), "{}", out.all());
    assert!(out.stdout.contains("export=\"\""), "{}", out.all());

    golden.assert_untouched();
    other.assert_untouched();
}

#[test]
fn nbdcopy_copies_the_golden_image_and_own_client_reads_its_writes_back() {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 4);
    let server = Server::start(dir.path(), &golden, &["--ram", "4M"]);

    let copy = dir.path().join("out.img");
    run_ok(dir.path(), "nbdcopy", &[&server.uri(""), copy.to_str().expect("utf-8")]);
    assert_same(&std::fs::read(&copy).expect("reading copy"), &golden.bytes, "nbdcopy of the export");

    let mut client = server.client("@writer");
    let mut model = Model::new(&golden);
    let writes: [(u64, usize, u64); 6] = [
        (0, 4096, 10),
        (5000, 10_000, 11),
        (2 * MIB - 3, 7, 12),
        (10 * MIB, 9 << 20, 13),
        (12 * MIB + 4095, 70_000, 14),
        (golden.size() - 4097, 4097, 15),
    ];
    for (offset, len, seed) in writes {
        let data = pseudo_random(len, seed);
        client.write(offset, &data, false).expect("write");
        model.write(offset, &data);
    }
    client.write_zeroes(11 * MIB + 17, 3 * 4096, false).expect("write_zeroes");
    model.fill(11 * MIB + 17, 3 * 4096, 0);
    client.trim(16 * MIB, 2 * MIB as u32).expect("trim");
    model.trim(16 * MIB, 2 * MIB);
    client.flush().expect("flush");
    assert_same(&read_disk(&mut client), &model.disk, "disk read back over the writing connection");
    client.disconnect().expect("disconnect");

    let stats = server.wait_disconnect("writer");
    assert!(u64_field(&stats, "spill_write_ops") > 0, "9 MiB over a 4 MiB target should spill: {stats}");
    golden.assert_untouched();
}

/// fio with its NBD engine: four jobs (four connections, four overlays) write 48 MiB each at
/// random with an 8 MiB RAM target and verify every block; the spill file sees only whole
/// 2 MiB segments.
#[test]
fn fio_random_writes_verify_and_spill_in_whole_segments() {
    fio_verify_while_spilling(&[]);
}

/// The same with O_DIRECT segment writes and one background writer for four VMs, so that most
/// segments are written in line by a VM that found the writer busy.
#[test]
fn fio_verifies_with_direct_spill_writes_and_a_busy_writer() {
    fio_verify_while_spilling(&["--spill-direct", "--spill-writers", "1"]);
}

/// Large writes are received from the socket straight into RAM pages (and fresh pages for new
/// blocks); fio writes and overwrites (two loops) with sizes up to 2 MiB and not multiples of
/// 4 KiB, verified, with a RAM tier that holds everything and with one that spills.
#[test]
fn fio_verifies_large_unaligned_writes_received_into_pages() {
    for ram in ["256M", "8M"] {
        let dir = TempDir::new().expect("tempdir");
        let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 7);
        let server = Server::start(dir.path(), &golden, &["--ram", ram]);
        let uri = format!("--uri={}", server.uri(""));
        let out = run_tool(
            dir.path(),
            "fio",
            &[
                "--name=large",
                "--ioengine=nbd",
                &uri,
                "--rw=randwrite",
                "--bsrange=1k-2m",
                "--bs_unaligned=1",
                "--size=24m",
                "--loops=2",
                "--iodepth=4",
                "--numjobs=2",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
            ],
        );
        assert_fio_verified(&out, &format!("--ram {ram}"));
        golden.assert_untouched();
    }
}

fn assert_fio_verified(out: &ToolOutput, what: &str) {
    let text = out.all();
    for bad in ["bad magic", "verify: bad", "bad header", "crc32c: verify failed", "verify failed"] {
        assert!(!text.contains(bad), "{what}: fio reported {bad:?}:\n{text}");
    }
    assert!(out.status.success(), "{what}: fio failed:\n{text}");
    assert!(out.stdout.contains("err= 0"), "{what}: fio jobs report errors:\n{text}");
}

fn fio_verify_while_spilling(extra: &[&str]) {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 5);
    let mut args = vec!["--ram", "8M"];
    args.extend_from_slice(extra);
    let server = Server::start(dir.path(), &golden, &args);
    let uri = format!("--uri={}", server.uri(""));
    let out = run_tool(
        dir.path(),
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &uri,
            "--rw=randwrite",
            "--bs=4k",
            "--size=48m",
            "--iodepth=16",
            "--numjobs=4",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ],
    );
    assert_fio_verified(&out, "spilling");

    // fio probes the export before the jobs start; those connections write nothing.
    let deadline = Instant::now() + WAIT;
    let writers = loop {
        let writers: Vec<Value> =
            server.wait_disconnects(4).into_iter().filter(|f| u64_field(f, "guest_writes") > 0).collect();
        if writers.len() >= 4 || Instant::now() > deadline {
            break writers;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(writers.len(), 4, "expected four writing VMs: {writers:?}");
    for stats in &writers {
        let ops = u64_field(stats, "spill_write_ops");
        let bytes = u64_field(stats, "spill_write_bytes");
        assert!(ops > 0, "48 MiB over an 8 MiB target should spill: {stats}");
        assert_eq!(bytes, ops * SEGMENT_BYTES, "every spill write must be one whole 2 MiB segment: {stats}");
        assert_eq!(u64_field(stats, "spill_segments"), ops, "{stats}");
    }
    server.wait_no_cache_files(&server.spill_dir, "spill");
    golden.assert_untouched();
}

#[test]
fn qemu_img_info_and_convert_see_the_golden_image() {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 6);
    let server = Server::start(dir.path(), &golden, &[]);

    let out = run_ok(dir.path(), "qemu-img", &["info", "--output=json", "-f", "raw", &server.uri("")]);
    let info: Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("qemu-img JSON: {e}\n{}", out.all()));
    assert_eq!(info["virtual-size"].as_u64(), Some(golden.size()), "{info}");
    let out = run_ok(dir.path(), "qemu-img", &["info", "-f", "raw", &server.uri("")]);
    assert!(out.stdout.contains("virtual size: 64 MiB (67108864 bytes)"), "{}", out.all());

    let copy = dir.path().join("copy.img");
    run_ok(
        dir.path(),
        "qemu-img",
        &["convert", "-f", "raw", "-O", "raw", &server.uri(""), copy.to_str().expect("utf-8")],
    );
    assert_same(&std::fs::read(&copy).expect("reading copy"), &golden.bytes, "qemu-img convert of the export");
    golden.assert_untouched();
}

/// Trimmed data gives its spill space back to the filesystem, and the file goes with the VM.
#[test]
fn trimmed_spill_space_returns_to_the_filesystem() {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 7);
    let server = Server::start(dir.path(), &golden, &["--ram", "4M"]);
    let mut client = server.client("@trimmer");
    let spill = server.only_cache_file(&server.spill_dir, "spill");
    let mut model = Model::new(&golden);

    let data = pseudo_random(40 << 20, 70);
    for (i, chunk) in data.chunks(MIB as usize).enumerate() {
        client.write(8 * MIB + i as u64 * MIB, chunk, false).expect("write");
    }
    model.write(8 * MIB, &data);
    let full = allocated_bytes(&spill);
    assert!(full >= 30 * MIB, "40 MiB written over a 4 MiB target, but the spill file holds only {full} bytes");
    assert_same(&read_disk(&mut client), &model.disk, "disk before trim");

    for offset in (0..golden.size()).step_by(32 << 20) {
        client.trim(offset, 32 << 20).expect("trim");
    }
    let after = allocated_bytes(&spill);
    assert!(after <= 4 * MIB, "after trimming everything the spill file still holds {after} bytes (was {full})");
    assert_same(&read_disk(&mut client), &golden.bytes, "disk after trimming everything");

    client.disconnect().expect("disconnect");
    server.wait_disconnect("trimmer");
    server.wait_no_cache_files(&server.spill_dir, "spill");
    assert!(!spill.exists(), "{} still exists after disconnect", spill.display());
    golden.assert_untouched();
}

/// One connection in `mode` writes, zeroes and trims, and reads it all back. `files` names the
/// VM's cache file (suffix and directory) if the mode keeps one: it must exist while the VM is
/// connected and go when it disconnects.
fn check_mode(mode: &str, files: Option<(&str, CacheDir)>) {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 8);
    let server = Server::start(dir.path(), &golden, &["--mode", mode, "--ram", "4M"]);
    let mut client = server.client("@modal");
    let mut model = Model::new(&golden);
    // 6 MiB in ram mode would pass a 4 MiB target; keep it within for ram.
    let big = if mode == "ram" { MIB as usize } else { 6 << 20 };
    let writes: [(u64, usize, u64); 4] = [(0, 4096, 80), (3000, 9000, 81), (MIB, big, 82), (50 * MIB + 1, 3, 83)];
    for (offset, len, seed) in writes {
        let data = pseudo_random(len, seed);
        client.write(offset, &data, false).unwrap_or_else(|e| panic!("{mode}: write at {offset}: {e}"));
        model.write(offset, &data);
    }
    client.write_zeroes(MIB + 4096, 8192, false).expect("write_zeroes");
    model.fill(MIB + 4096, 8192, 0);
    client.trim(MIB + 65536, 65536).expect("trim");
    model.trim(MIB + 65536, 65536);
    assert_same(&read_disk(&mut client), &model.disk, &format!("mode {mode}: disk read back"));

    match files {
        Some((suffix, dir)) => {
            let file = server.only_cache_file(server.dir(dir), suffix);
            assert!(allocated_bytes(&file) > 0, "{mode}: cache file {file:?} holds nothing");
        }
        None => {
            for suffix in ["spill", "cache", "diff"] {
                assert!(server.cache_files(&server.spill_dir, suffix).is_empty(), "{mode}: unexpected .{suffix}");
                assert!(server.cache_files(&server.shared_dir, suffix).is_empty(), "{mode}: unexpected .{suffix}");
            }
        }
    }
    client.disconnect().expect("disconnect");
    let stats = server.wait_disconnect("modal");
    assert_eq!(u64_field(&stats, "guest_writes"), writes.len() as u64, "{stats}");
    if let Some((suffix, dir)) = files {
        server.wait_no_cache_files(server.dir(dir), suffix);
    }
    golden.assert_untouched();
}

#[test]
fn mode_disk_keeps_a_cache_file_in_the_spill_dir() {
    check_mode("disk", Some(("cache", CacheDir::Spill)));
}

#[test]
fn mode_shared_keeps_a_differencing_file_in_the_shared_dir() {
    check_mode("shared", Some(("diff", CacheDir::Shared)));
}

#[test]
fn mode_ram_plus_disk_keeps_a_spill_file() {
    check_mode("ram+disk", Some(("spill", CacheDir::Spill)));
}

#[test]
fn mode_ram_keeps_no_files() {
    check_mode("ram", None);
}

/// Mode `ram`: a VM whose RAM target is full gets ENOSPC, keeps what it wrote, and another VM
/// connected at the same time is not affected.
#[test]
fn mode_ram_full_gives_enospc_to_that_vm_only() {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 9);
    let server = Server::start(dir.path(), &golden, &["--mode", "ram", "--ram", "1M"]);
    let mut full = server.client("@full");
    let mut other = server.client("@other");
    let mut model = Model::new(&golden);

    let mut acknowledged = 0u64;
    let errno = loop {
        assert!(acknowledged < 4 * MIB, "no ENOSPC after {acknowledged} bytes with a 1 MiB RAM target");
        let data = pseudo_random(4096, 900 + acknowledged / 4096);
        match full.write(acknowledged, &data, false) {
            Ok(()) => {
                model.write(acknowledged, &data);
                acknowledged += 4096;
            }
            Err(e) => break e.errno().unwrap_or_else(|| panic!("write failed without an errno: {e}")),
        }
    };
    assert_eq!(errno, ENOSPC);
    assert!(acknowledged >= MIB / 2, "ENOSPC after only {acknowledged} bytes with a 1 MiB target");

    // The other VM writes and reads as if nothing happened.
    let data = pseudo_random(256 << 10, 99);
    other.write(5 * MIB + 512, &data, false).expect("the other VM's write");
    let mut back = vec![0u8; data.len()];
    other.read(5 * MIB + 512, &mut back).expect("the other VM's read");
    assert_same(&back, &data, "the other VM's data");

    // The full VM still reads everything it was told was written, and golden data beyond.
    let mut back = vec![0u8; (acknowledged + MIB) as usize];
    full.read(0, &mut back).expect("read after ENOSPC");
    assert_same(&back, model.range(0, acknowledged + MIB), "full VM's disk after ENOSPC");
    // Trimming gives room back.
    full.trim(0, 64 << 10).expect("trim");
    model.trim(0, 64 << 10);
    let data = pseudo_random(8192, 98);
    full.write(acknowledged, &data, false).expect("write after trimming");
    model.write(acknowledged, &data);
    let mut back = vec![0u8; (acknowledged + MIB) as usize];
    full.read(0, &mut back).expect("read");
    assert_same(&back, model.range(0, acknowledged + MIB), "full VM's disk after trim and write");

    full.disconnect().expect("disconnect");
    other.disconnect().expect("disconnect");
    golden.assert_untouched();
}

/// Mode `ram+disk` with a spill limit: the VM that fills it gets ENOSPC but keeps every
/// acknowledged write, and a VM connected at the same time keeps working.
#[test]
fn full_spill_gives_enospc_and_keeps_acknowledged_data() {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 10);
    let server = Server::start(dir.path(), &golden, &["--ram", "1M", "--spill-max", "8M"]);
    let mut full = server.client("@full");
    let mut other = server.client("@other");
    let mut model = Model::new(&golden);

    const CHUNK: usize = 64 << 10;
    let data = pseudo_random(GOLDEN_BYTES, 1000);
    let mut acknowledged = 0u64;
    let mut error = None;
    for chunk in data.chunks(CHUNK) {
        match full.write(acknowledged, chunk, false) {
            Ok(()) => {
                model.write(acknowledged, chunk);
                acknowledged += chunk.len() as u64;
            }
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    let error = error.expect("64 MiB written through a 1 MiB RAM target into an 8 MiB spill limit without ENOSPC");
    assert_eq!(error.errno(), Some(ENOSPC), "{error}");
    assert!(acknowledged >= 4 * MIB, "ENOSPC after only {acknowledged} bytes: the spill file was not used");
    let spill_files = server.cache_files(&server.spill_dir, "spill");
    for file in &spill_files {
        assert!(allocated_bytes(file) <= 8 * MIB, "{file:?} exceeds the 8 MiB spill limit");
    }

    // The other VM has its own spill limit and works normally, spilling too.
    let other_data = pseudo_random(4 << 20, 1001);
    other.write(32 * MIB, &other_data, false).expect("the other VM's write");
    let mut back = vec![0u8; other_data.len()];
    other.read(32 * MIB, &mut back).expect("the other VM's read");
    assert_same(&back, &other_data, "the other VM's data");

    // Everything acknowledged reads back; the failed write's range is unspecified; the rest
    // still reads from the golden image.
    let mut back = vec![0u8; acknowledged as usize];
    full.read(0, &mut back).expect("read after ENOSPC");
    assert_same(&back, model.range(0, acknowledged), "acknowledged data after ENOSPC");
    let after_failed = acknowledged + CHUNK as u64;
    let mut back = vec![0u8; 4 << 20];
    full.read(after_failed, &mut back).expect("read");
    assert_same(&back, model.range(after_failed, 4 << 20), "golden data past the failed write");

    // Trimming what was written makes room again.
    let mut offset = 0;
    while offset < after_failed {
        let len = (after_failed - offset).min(32 << 20);
        full.trim(offset, len as u32).expect("trim");
        offset += len;
    }
    model.trim(0, after_failed);
    let again = pseudo_random(3 << 20, 1002);
    full.write(0, &again, false).expect("write after trimming a full spill");
    model.write(0, &again);
    let mut back = vec![0u8; 8 << 20];
    full.read(0, &mut back).expect("read");
    assert_same(&back, model.range(0, 8 << 20), "disk after trim and rewrite");

    full.disconnect().expect("disconnect");
    other.disconnect().expect("disconnect");
    golden.assert_untouched();
}

/// Garbage handshakes, a connection dropped in the middle of a request and a client killed with
/// SIGKILL in the middle of its writes cost their own connection only.
#[test]
fn bad_clients_cost_only_their_own_connection() {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 11);
    let mut server = Server::start(dir.path(), &golden, &["--ram", "4M"]);
    let mut healthy = server.client("@healthy");
    let mut model = Model::new(&golden);
    let mut round = 0u64;
    let mut check_healthy = |client: &mut Client, model: &mut Model| {
        round += 1;
        let offset = round * 3 * MIB + 123;
        let data = pseudo_random(MIB as usize, 2000 + round);
        client.write(offset, &data, false).expect("healthy client's write");
        model.write(offset, &data);
        let mut back = vec![0u8; 4 * MIB as usize];
        client.read(round * 3 * MIB, &mut back).expect("healthy client's read");
        assert_same(&back, model.range(round * 3 * MIB, 4 * MIB), "healthy client's data");
    };
    check_healthy(&mut healthy, &mut model);

    // Garbage right after the greeting, and garbage without waiting for it: each is closed.
    let greeting_first = |stream: &mut UnixStream| {
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).expect("greeting");
        assert_eq!(&greeting[..8], b"NBDMAGIC");
    };
    for (garbage, read_greeting) in
        [(pseudo_random(4096, 3), true), (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), false)]
    {
        let mut raw = UnixStream::connect(&server.socket).expect("connect");
        if read_greeting {
            greeting_first(&mut raw);
        }
        // The server may close before it has read everything; a reset is fine.
        let _ = raw.write_all(&garbage);
        raw.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        let mut sink = Vec::new();
        match raw.read_to_end(&mut sink) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            Err(e) => panic!("server did not close a connection that sent garbage: {e}"),
        }
        server.assert_running();
        check_healthy(&mut healthy, &mut model);
    }

    // A client that goes away in the middle of a write request's payload.
    let raw = UnixStream::connect(&server.socket).expect("connect");
    let mut dropped =
        Client::handshake(Box::new(raw.try_clone().expect("clone")), "@dropped", false).expect("handshake");
    dropped.write(0, &[7u8; 4096], false).expect("a whole write first");
    let mut header = Vec::new();
    header.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    header.extend_from_slice(&0u16.to_be_bytes());
    header.extend_from_slice(&1u16.to_be_bytes()); // NBD_CMD_WRITE
    header.extend_from_slice(&99u64.to_be_bytes());
    header.extend_from_slice(&(8 * MIB).to_be_bytes());
    header.extend_from_slice(&(MIB as u32).to_be_bytes());
    header.extend_from_slice(&[0x55; 1000]);
    (&raw).write_all(&header).expect("half a request");
    raw.shutdown(std::net::Shutdown::Both).expect("shutdown");
    drop((dropped, raw));
    let stats = server.wait_disconnect("dropped");
    assert_eq!(u64_field(&stats, "guest_writes"), 1, "the truncated write must not be applied: {stats}");
    server.assert_running();
    check_healthy(&mut healthy, &mut model);

    // qemu-io killed with SIGKILL in the middle of a long run of writes.
    let uri = server.uri("@killed");
    let write_cmds: Vec<String> = (0..2000).map(|i| format!("write -P 0x42 {} {}", (i % 60) * MIB, MIB)).collect();
    let mut args = vec!["-f", "raw", uri.as_str()];
    for c in &write_cmds {
        args.extend(["-c", c.as_str()]);
    }
    let mut qemu_io = spawn_tool(dir.path(), "qemu-io", &args);
    // Its stdout is a pipe, so stdio buffers it: the first "wrote" line arrives after a few
    // dozen writes have been acknowledged.
    let stdout = qemu_io.stdout.take().expect("qemu-io stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let wrote = std::io::BufRead::lines(std::io::BufReader::new(stdout))
            .map_while(Result::ok)
            .any(|line| line.starts_with("wrote "));
        let _ = tx.send(wrote);
    });
    let wrote = rx.recv_timeout(WAIT).expect("qemu-io wrote nothing within the timeout");
    assert!(wrote, "qemu-io ended without writing");
    assert!(qemu_io.try_wait().expect("try_wait").is_none(), "qemu-io finished 2000 writes before it could be killed");
    qemu_io.kill().expect("SIGKILL qemu-io");
    qemu_io.wait().expect("reap qemu-io");
    let stats = server.wait_disconnect("killed");
    assert!(u64_field(&stats, "guest_writes") > 0, "qemu-io was killed before writing: {stats}");
    server.assert_running();
    check_healthy(&mut healthy, &mut model);

    // A new real client works too, and only the healthy VM's spill file is left.
    let uri = server.uri("@after");
    run_ok(
        dir.path(),
        "qemu-io",
        &["-f", "raw", &uri, "-c", "write -P 0x99 4096 65536", "-c", "read -P 0x99 4096 65536"],
    );
    server.wait_disconnect("after");
    let files = server.cache_files(&server.spill_dir, "spill");
    assert_eq!(files.len(), 1, "only the healthy VM's spill file should remain: {files:?}");
    healthy.disconnect().expect("disconnect");
    server.wait_no_cache_files(&server.spill_dir, "spill");
    golden.assert_untouched();
}

// ---------------------------------------------------------------------------------------------
// Metrics

fn metrics_url(server: &Server) -> String {
    server.wait_for("the metrics endpoint", || {
        server.events("metrics endpoint up").first().and_then(|f| f["metrics"].as_str().map(str::to_owned))
    })
}

fn promtool_check(body: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("promtool is not installed (apt-get install prometheus): {e}"));
    child.stdin.take().expect("stdin").write_all(body.as_bytes()).expect("feed promtool");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn metrics_pass_promtool_equal_the_engine_and_leave_with_the_vm() {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 31);
    let server = Server::start(dir.path(), &golden, &["--ram", "4M", "--metrics", "tcp:127.0.0.1:0"]);
    let url = metrics_url(&server);

    // Another VM works in the background while the endpoint is scraped.
    let fio = spawn_tool(
        dir.path(),
        "fio",
        &[
            "--name=bg",
            "--ioengine=nbd",
            &format!("--uri={}", server.uri("@vm-fio")),
            "--rw=randrw",
            "--bs=4k",
            "--size=32m",
            "--iodepth=8",
            "--time_based",
            "--runtime=2",
        ],
    );
    let mut me = server.client("@vm-me");
    let block = vec![0x42u8; 4096];
    for i in 0..3000u64 {
        me.write(i * 4096, &block, false).expect("write");
    }
    let mut buf = vec![0u8; 4096];
    for i in 0..500u64 {
        me.read((i * 7919 % 4096) * 4096, &mut buf).expect("read");
    }
    for i in 0..10u64 {
        me.trim(i * MIB, MIB as u32).expect("trim");
    }
    for _ in 0..5 {
        me.flush().expect("flush");
    }
    // Two reads past the end (EINVAL), and a connection to an export that is not there.
    for _ in 0..2 {
        assert!(me.read(GOLDEN_BYTES as u64, &mut buf).is_err(), "a read past the end fails");
    }
    let unknown: NbdUri = server.uri("no-such-image@vm-x").parse().expect("uri");
    assert!(Client::connect(&unknown).is_err(), "an unknown export is refused");
    let (_, _, body) = http_get(&url, "text/plain");
    promtool_check(&body);
    let s = overspill::stat::parse(&body);
    let vm = [("vm", "vm-me")];
    let with = |extra: &[(&'static str, &'static str)]| -> Vec<(&'static str, &'static str)> {
        vm.iter().chain(extra).copied().collect()
    };
    assert_eq!(sample(&s, "overspill_vm_guest_requests_total", &with(&[("op", "write")])), 3000.0);
    assert_eq!(sample(&s, "overspill_vm_guest_requests_total", &with(&[("op", "read")])), 500.0);
    assert_eq!(sample(&s, "overspill_vm_guest_requests_total", &with(&[("op", "trim")])), 10.0);
    assert_eq!(sample(&s, "overspill_vm_guest_requests_total", &with(&[("op", "flush")])), 5.0);
    assert_eq!(sample(&s, "overspill_vm_guest_bytes_total", &with(&[("op", "write")])), 3000.0 * 4096.0);
    let served: f64 = ["ram", "spill", "golden", "zero", "cache_file"]
        .iter()
        .map(|t| sample(&s, "overspill_vm_guest_read_blocks_total", &with(&[("served_by", t)])))
        .sum();
    assert_eq!(served, 500.0, "every read block served by exactly one tier");
    let errors = [("command", "read"), ("errno", "EINVAL")];
    assert_eq!(sample(&s, "overspill_nbd_error_replies_total", &errors), 2.0, "error replies by command and errno");
    let refused = [("reason", "unknown-export")];
    assert_eq!(sample(&s, "overspill_nbd_refused_connections_total", &refused), 1.0, "refusals by reason");
    let build = [("version", env!("CARGO_PKG_VERSION")), ("features", "s3,http")];
    assert_eq!(sample(&s, "overspill_build_info", &build), 1.0, "build info with the default features");
    let spill_ops = sample(&s, "overspill_vm_storage_ops_total", &with(&[("tier", "spill"), ("direction", "write")]));
    let spill_bytes =
        sample(&s, "overspill_vm_storage_bytes_total", &with(&[("tier", "spill"), ("direction", "write")]));
    assert!(spill_ops > 0.0, "12 MiB of writes against a 4 MiB target spill");
    assert_eq!(spill_bytes, spill_ops * SEGMENT_BYTES as f64);
    assert_eq!(sample(&s, "overspill_vm_spill_write_size_bytes_count", &vm), spill_ops);
    assert_eq!(sample(&s, "overspill_vm_spill_write_size_bytes_bucket", &with(&[("le", "2097152")])), spill_ops);
    assert_eq!(sample(&s, "overspill_vm_request_duration_seconds_count", &with(&[("op", "write")])), 3000.0);
    assert!(sample(&s, "overspill_vm_cache_memory_used_bytes", &vm) <= (4 * MIB + SEGMENT_BYTES + 64 * 1024) as f64);

    // The live view shows the VM.
    let stat =
        run_ok(dir.path(), env!("CARGO_BIN_EXE_overspill"), &["stat", "--url", &url, "--once", "--interval", "0.2"]);
    assert!(stat.stdout.contains("default@vm-me") && stat.stdout.contains("total"), "{}", stat.all());

    // OpenMetrics on request, and /healthz.
    let (_, content_type, open) = http_get(&url, "application/openmetrics-text; version=1.0.0");
    assert!(content_type.starts_with("application/openmetrics-text"), "{content_type}");
    assert!(open.ends_with("# EOF\n") && open.contains("# TYPE overspill_guest_requests counter"));
    let (status, _, health) = http_get(&url.replace("/metrics", "/healthz"), "*/*");
    assert!(status.contains("200") && health == "ok\n", "{status} {health}");

    // The engine's own figures, logged as the VM leaves, equal what was scraped last.
    me.disconnect().expect("disconnect");
    let logged = server.wait_disconnect("vm-me");
    assert_eq!(u64_field(&logged, "guest_writes") as f64, 3000.0);
    assert_eq!(u64_field(&logged, "guest_reads") as f64, 500.0);
    assert_eq!(u64_field(&logged, "spill_write_ops") as f64, spill_ops);
    assert_eq!(
        u64_field(&logged, "golden_reads") as f64,
        sample(&s, "overspill_vm_storage_ops_total", &with(&[("tier", "golden")]))
    );

    let status = fio.wait_with_output().expect("fio").status;
    assert!(status.success(), "fio failed");
    server.wait_disconnect("vm-fio");
    let after = scrape(&url);
    assert!(after.keys().all(|(_, labels)| !labels.contains_key("vm")), "per-VM series leave with their VMs");
    assert!(sample(&after, "overspill_guest_requests_total", &[("op", "write")]) >= 3000.0, "totals keep counting");
    assert_eq!(sample(&after, "overspill_connected_vms", &[]), 0.0);
    golden.assert_untouched();
}

/// A qcow2 golden image (made by qemu-img from a raw one) serves the same bytes, and stays as it
/// was: nbdcopy of the export equals the raw image, and qemu-io's writes land in the overlay only.
#[test]
fn a_qcow2_golden_image_serves_the_bytes_of_its_raw_twin() {
    let dir = TempDir::new().expect("tempdir");
    let raw = Golden::create(dir.path(), "golden.raw", GOLDEN_BYTES, 41);
    let qcow_path = dir.path().join("golden.qcow2");
    run_ok(
        dir.path(),
        "qemu-img",
        &["convert", "-f", "raw", "-O", "qcow2", raw.path(), qcow_path.to_str().expect("utf-8")],
    );
    let qcow_bytes = std::fs::read(&qcow_path).expect("qcow2 bytes");
    let mtime = std::fs::metadata(&qcow_path).and_then(|m| m.modified()).expect("mtime");
    let qcow = Golden { path: qcow_path, bytes: qcow_bytes, mtime };
    let server = Server::start(dir.path(), &qcow, &["--ram", "4M"]);
    let copy = dir.path().join("out.img");
    run_ok(dir.path(), "nbdcopy", &[&server.uri(""), copy.to_str().expect("utf-8")]);
    assert_same(&std::fs::read(&copy).expect("reading copy"), &raw.bytes, "nbdcopy of a qcow2 export");
    let out = run_ok(
        dir.path(),
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x5a 1m 8m", "-c", "read -P 0x5a 1m 8m", &server.uri("@q")],
    );
    assert!(!out.all().contains("Pattern verification failed"), "{}", out.all());
    server.wait_disconnect("q");
    qcow.assert_untouched();
    raw.assert_untouched();
}

/// Image versions: a VM keeps the version it connected to while new VMs get the newly
/// activated one, and the old version is released when its last VM leaves.
#[test]
fn vms_keep_their_image_version_and_old_versions_are_released() {
    let dir = TempDir::new().expect("tempdir");
    let d = dir.path();
    let store = d.join("images");
    let overspill = env!("CARGO_BIN_EXE_overspill");
    let store_arg = store.to_str().expect("utf-8");
    let v1 = Golden::create(d, "v1.img", 8 << 20, 51);
    let v2 = Golden::create(d, "v2.img", 8 << 20, 52);
    run_ok(d, overspill, &["image", "--images", store_arg, "publish", "win7", v1.path(), "--activate"]);
    let base = Golden::create(d, "base.img", 4 << 20, 53);
    let server = Server::start(d, &base, &["--images", store_arg]);

    let mut old = server.client("win7@vm-old");
    let mut buf = vec![0u8; 4096];
    old.read(4096, &mut buf).expect("read");
    assert_same(&buf, &v1.bytes[4096..8192], "first VM reads v1");

    let out = run_ok(d, overspill, &["image", "--images", store_arg, "publish", "win7", v2.path(), "--activate"]);
    assert!(out.stdout.contains("v2"), "{}", out.all());
    let list = run_ok(d, overspill, &["image", "--images", store_arg, "list"]);
    assert!(list.stdout.contains("* v2") && list.stdout.contains("  v1"), "{}", list.all());

    let mut new = server.client("win7@vm-new");
    new.read(4096, &mut buf).expect("read");
    assert_same(&buf, &v2.bytes[4096..8192], "a new VM gets v2");
    old.read(4096, &mut buf).expect("read");
    assert_same(&buf, &v1.bytes[4096..8192], "the running VM keeps v1");
    let listed = run_ok(d, "nbdinfo", &["--list", &server.uri("")]);
    assert!(listed.stdout.contains("win7"), "{}", listed.all());

    assert!(server.events("golden image version released: its last VM left").is_empty());
    old.disconnect().expect("disconnect");
    let released = server.wait_for("v1 to be released", || {
        server.events("golden image version released: its last VM left").into_iter().find(|f| f["image"] == "win7:v1")
    });
    assert_eq!(released["image"], "win7:v1");
    new.read(0, &mut buf).expect("v2 still serves");
    assert_same(&buf, &v2.bytes[..4096], "v2 after v1 left");

    // `activate win7 1` means v1, the name `list` shows (versions are only ever vN).
    let out = run_ok(d, overspill, &["image", "--images", store_arg, "activate", "win7", "1"]);
    assert!(out.stdout.contains("win7 v1 (current)"), "{}", out.all());
    let list = run_ok(d, overspill, &["image", "--images", store_arg, "list"]);
    assert!(list.stdout.contains("* v1") && list.stdout.contains("  v2"), "{}", list.all());
    v1.assert_untouched();
    v2.assert_untouched();
}

/// A large read is one guest request whatever the server makes of it: answered in 1 MiB slices,
/// and with its zeroed runs sent as hole chunks (never read), it counts once, with all its bytes,
/// each block by the tier it reads from.
#[test]
fn a_large_read_with_holes_counts_once_with_every_block() {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 33);
    let server = Server::start(dir.path(), &golden, &["--metrics", "tcp:127.0.0.1:0"]);
    let url = metrics_url(&server);
    let mut vm = server.client("@vm-holes");
    assert!(vm.structured_replies(), "hole chunks need structured replies");
    vm.write_zeroes(0, MIB as u32, false).expect("zero the first MiB");
    vm.write(MIB, &[7u8; 4096], false).expect("a block in RAM");
    // 3 MiB: the zeroed MiB (a hole chunk), a RAM block, the rest golden, in three slices.
    let mib = MIB as usize;
    let mut buf = vec![1u8; 3 * mib];
    vm.read(0, &mut buf).expect("read");
    assert!(buf[..mib].iter().all(|&b| b == 0), "the zeroed MiB reads as zeroes");
    assert_same(&buf[mib..mib + 4096], &[7u8; 4096], "the written block");
    assert_same(&buf[mib + 4096..], &golden.bytes[mib + 4096..3 * mib], "golden data");
    // 2 MiB at an offset that is no block's start: 513 blocks, each counted once, the ones at
    // slice ends included.
    let at = 3 * mib + 512;
    vm.read(at as u64, &mut buf[..2 * mib]).expect("an unaligned read");
    assert_same(&buf[..2 * mib], &golden.bytes[at..at + 2 * mib], "unaligned golden data");
    let (_, _, body) = http_get(&url, "text/plain");
    let s = overspill::stat::parse(&body);
    let labels = |extra: &[(&'static str, &'static str)]| -> Vec<(&'static str, &'static str)> {
        [("vm", "vm-holes")].iter().chain(extra).copied().collect()
    };
    assert_eq!(sample(&s, "overspill_vm_guest_requests_total", &labels(&[("op", "read")])), 2.0, "two requests");
    assert_eq!(sample(&s, "overspill_vm_guest_bytes_total", &labels(&[("op", "read")])), (5 * MIB) as f64);
    let timed = sample(&s, "overspill_vm_request_duration_seconds_count", &labels(&[("op", "read")]));
    assert_eq!(timed, 2.0, "one latency sample per request");
    let blocks = |tier| sample(&s, "overspill_vm_guest_read_blocks_total", &labels(&[("served_by", tier)]));
    assert_eq!(blocks("zero"), 256.0, "the zeroed MiB, sent as a hole");
    assert_eq!(blocks("ram"), 1.0);
    assert_eq!(blocks("golden"), (511 + 513) as f64);
    vm.disconnect().expect("disconnect");
}

/// One HTTP client that pipelines requests and never reads the answers (what stalled the
/// endpoint's only thread for every health check) holds only its own connection: `/healthz` and
/// `/metrics` answer other clients at once, and the server stays up.
#[test]
fn a_metrics_client_that_never_reads_stalls_no_one_else() {
    let dir = TempDir::new().expect("tempdir");
    let golden = Golden::create(dir.path(), "golden.img", GOLDEN_BYTES, 37);
    let server = Server::start(dir.path(), &golden, &["--metrics", "tcp:127.0.0.1:0"]);
    let url = metrics_url(&server);
    let host = url.strip_prefix("http://").and_then(|rest| rest.split('/').next()).expect("host").to_owned();
    // Several VMs, so that each answer is large enough to fill a socket's buffers soon.
    let _vms: Vec<_> = (0..20).map(|i| server.client(&format!("@vm-{i}"))).collect();
    let mut hogs = Vec::new();
    for _ in 0..4 {
        let mut hog = std::net::TcpStream::connect(&host).expect("connect");
        let request = format!("GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n").repeat(1000);
        hog.set_write_timeout(Some(Duration::from_secs(2))).expect("timeout");
        // The server stops reading a connection whose answers pile up: the rest of the
        // requests may not fit in the socket.
        let _ = hog.write_all(request.as_bytes());
        hogs.push(hog);
    }
    for _ in 0..5 {
        let started = Instant::now();
        let (status, _, body) = http_get(&url.replace("/metrics", "/healthz"), "*/*");
        assert!(status.contains("200") && body == "ok\n", "{status} {body}");
        assert!(started.elapsed() < Duration::from_secs(3), "/healthz took {:?}", started.elapsed());
        let samples = scrape(&url);
        assert_eq!(sample(&samples, "overspill_connected_vms", &[]), 20.0);
    }
    drop(hogs);
    let (status, _, _) = http_get(&url.replace("/metrics", "/healthz"), "*/*");
    assert!(status.contains("200"), "{status}");
}
