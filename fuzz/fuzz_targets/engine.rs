//! The server as `overspill serve` runs it: NBD over a socketpair into `OverlayExports`, each VM
//! a real engine overlay in mode ram+disk over a golden image file, with a 64 KiB memory target
//! (a VM spills past 16 blocks), a 6 MiB spill limit, a 1 MiB shared read cache, and named VMs
//! that outlive their connections in files (a ledger, arenas and spill files in a temporary
//! directory). The input picks a handshake, an export (the anonymous default, a named VM, a VM
//! filled to the brink of its spill limit, or a name of the input's own), and whether the server
//! restarts and the session runs again; see `overspill_fuzz::engine_input`.
//!
//! After each input the server must have greeted, answered and closed, with its connection
//! threads gone; every file under the temporary directory must be one the server makes, for a
//! VM it still has (no name from the input reaches a path); VMs handed over across a restart
//! must read back the same; once the VMs left in grace are dropped, no VM, memory or file may be
//! left; the golden image must be unchanged; and a well-behaved client must still get a fresh
//! VM that spills what it writes and reads it back, and reads the golden image through the
//! shared read cache as it is.
#![no_main]

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use overspill_engine::{GoldenImage, HostMemory, RawImage, WriteCacheMode, BLOCK_BYTES, BLOCK_SIZE};
use overspill_fuzz::*;
use overspill_nbd::client::Client;
use overspill_nbd::server::socketpair;
use overspill_nbd::wire::{be_u16, be_u32, be_u64, Errno, CMD_TRIM, CMD_WRITE, REQUEST_HEADER_BYTES, REQUEST_MAGIC};
use overspill_nbd::{Server, ServerConfig};
use overspill_server::check_name;
use overspill_server::exports::{CacheSettings, OverlayExports, DEFAULT_SPILL_WRITERS};
use overspill_server::vms::{Lifecycle, VmRegistry, VmState, VmStatus};

/// Far above what serving a few kilobytes takes; what exceeds it is a server waiting for a client
/// that has already said it is done.
const PATIENCE: Duration = Duration::from_secs(5);

/// A power of two, for the fuzzer's "interesting" integers to hit the end; large enough for the
/// `@full` VM to fill two spill segments with blocks of its own.
const DISK_BYTES: usize = 8 << 20;
/// The golden image's data; the rest of it is a hole, read as zeroes.
const PATTERN_BYTES: usize = 256 << 10;
const RAM_TARGET_BYTES: u64 = 64 << 10;
/// Three 2 MiB segments: two for guest data, one the spill log holds back for compaction.
const SPILL_MAX_BYTES: u64 = 6 << 20;
/// What `@full` is left short of its spill limit: inputs of a few kilobytes can fill it.
const FULL_HEADROOM_BLOCKS: u64 = 8;
/// Longer than any run: VMs leave grace only when the target drops them, so every input
/// starts from the same state.
const GRACE: Duration = Duration::from_secs(24 * 3600);
/// How often the golden image is read back whole (its size and time are checked every input).
const GOLDEN_READ_EVERY: u64 = 64;

/// What the target keeps across inputs: the directory, the golden image, the running server.
struct Env {
    /// Holds only `work`: a file appearing beside it came from a path that escaped.
    base: PathBuf,
    work: PathBuf,
    golden_path: PathBuf,
    /// What the golden image holds, and its size and modification time.
    golden: Vec<u8>,
    golden_stamp: (u64, i64, i64),
    image: Arc<dyn GoldenImage>,
    host: Arc<HostMemory>,
    server: Server,
    registry: Arc<VmRegistry>,
    /// Blocks `@full` gets before the input: its spill limit less the headroom.
    full_blocks: u64,
    inputs: u64,
}

fn env() -> MutexGuard<'static, Env> {
    static ENV: OnceLock<Mutex<Env>> = OnceLock::new();
    // An input that failed aborts the process, so a poisoned lock is never seen again.
    ENV.get_or_init(|| Mutex::new(Env::new())).lock().expect("env lock")
}

fuzz_target!(|data: &[u8]| {
    let Some((mode, name, stream)) = engine_split(data) else { return };
    let mut env = env();
    env.inputs += 1;
    if mode & ENGINE_EXPORT_BITS == ENGINE_FULL {
        env.fill_full();
    }
    let input = [engine_prefix(mode, name), stream.to_vec()].concat();
    env.session(&input);
    if mode & ENGINE_RESTART != 0 {
        env.restart(&trimmed_blocks(&input));
    }
    if mode & ENGINE_AGAIN != 0 {
        env.session(&input);
    }
    env.check_files(false);
    env.drop_all();
    env.check_files(true);
    env.check_golden();
    env.still_serves();
});

impl Env {
    fn new() -> Self {
        // libFuzzer's main is not Rust's, so SIGPIPE is not ignored: a write to a connection the
        // other side has closed would kill the fuzzer instead of returning EPIPE.
        // SAFETY: setting a signal's disposition to SIG_IGN has no preconditions.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        // Memory directories belong on tmpfs, as `overspill serve` puts them, and the fuzzer's
        // files need not wear a disk.
        let shm = Path::new("/dev/shm");
        let parent = if shm.is_dir() { shm.to_owned() } else { std::env::temp_dir() };
        let base = parent.join(format!("overspill-fuzz-engine-{}", std::process::id()));
        let work = base.join("work");
        // A directory of a process with this pid that died without cleaning up.
        let _ = std::fs::remove_dir_all(&base);
        for dir in ["spill", "shared", "memory", "state"] {
            std::fs::create_dir_all(work.join(dir)).expect("creating the work directory");
        }
        remove_at_exit(&base);

        let golden = golden_bytes();
        let golden_path = work.join("golden.img");
        let mut file = std::fs::File::create(&golden_path).expect("creating the golden image");
        file.write_all(&golden[..PATTERN_BYTES]).expect("writing the golden image");
        file.set_len(DISK_BYTES as u64).expect("sizing the golden image");
        drop(file);
        let image: Arc<dyn GoldenImage> = Arc::new(RawImage::open(&golden_path).expect("opening the golden image"));
        // No free-memory floor: what the host is doing must not change what an input does.
        let host = HostMemory::new(64 << 20, 0);
        let (server, registry) = serve(&work, &image, &host);
        let mut env = Env {
            base,
            work,
            golden_stamp: stamp(&golden_path),
            golden_path,
            golden,
            image,
            host,
            server,
            registry,
            full_blocks: 0,
            inputs: 0,
        };
        env.full_blocks = env.calibrate_full() - FULL_HEADROOM_BLOCKS;
        env.drop_all();
        env.check_files(true);
        env
    }

    /// The fuzzer's connection (see [`play`]).
    fn session(&self, input: &[u8]) {
        play(socketpair(&self.server).expect("socketpair"), input.to_vec(), PATIENCE);
        self.idle("the fuzzer's connection");
    }

    /// A well-behaved client of `export`.
    fn client(&self, export: &str) -> Client {
        let stream = socketpair(&self.server).expect("socketpair");
        stream.set_read_timeout(Some(PATIENCE)).expect("read timeout");
        Client::handshake(Box::new(stream), export, true).unwrap_or_else(|e| panic!("handshake for {export:?}: {e}"))
    }

    /// Asserts that every connection has ended, waiting up to [`PATIENCE`]. `wait_idle` sleeps
    /// 5 ms between looks, ten times what a whole input takes; a thread ends microseconds after
    /// its socket closes, so yielding catches it first.
    fn idle(&self, whose: &str) {
        for _ in 0..10_000 {
            if self.server.active_connections() == 0 {
                return;
            }
            std::thread::yield_now();
        }
        assert!(self.server.wait_idle(PATIENCE), "{whose} still has its thread after its socket closed");
    }

    /// Writes `@full`'s blocks one at a time until the spill log refuses one; returns how many
    /// it took. The VM ends with NBD_CMD_DISC.
    fn calibrate_full(&self) -> u64 {
        let mut client = self.client(ENGINE_EXPORTS[2]);
        let mut block = 0;
        loop {
            assert!(
                (block + 1) * BLOCK_BYTES <= DISK_BYTES as u64,
                "@full filled its disk without reaching its spill limit"
            );
            match client.write(block * BLOCK_BYTES, &full_block(block), false) {
                Ok(()) => block += 1,
                Err(e) if e.errno() == Some(Errno::NoSpc as u32) => break,
                Err(e) => panic!("filling @full: block {block}: {e}"),
            }
        }
        assert!(block > 2 * FULL_HEADROOM_BLOCKS, "@full took only {block} blocks");
        client.disconnect().expect("disconnect");
        self.idle("@full's calibration");
        block
    }

    /// `@full` as [`Self::calibrate_full`] left it but for the headroom, in grace for the input:
    /// the same writes (pipelined, as placement does not depend on timing), then the
    /// connection is lost.
    fn fill_full(&self) {
        let mut client = self.client(ENGINE_EXPORTS[2]);
        let mut next = 0;
        while next < self.full_blocks {
            // A batch's replies (16 bytes each) fit the socket's buffer while its writes go out.
            let batch = next..(next + 64).min(self.full_blocks);
            let cookies: Vec<u64> = batch
                .clone()
                .map(|block| {
                    client
                        .send_request(CMD_WRITE, 0, block * BLOCK_BYTES, BLOCK_SIZE as u32, &full_block(block))
                        .expect("sending a write to @full")
                })
                .collect();
            for (block, cookie) in batch.clone().zip(cookies) {
                client.reply(cookie, None).unwrap_or_else(|e| panic!("filling @full: block {block}: {e}"));
            }
            next = batch.end;
        }
        drop(client);
        self.idle("@full's filling");
        assert_eq!(self.in_grace().iter().map(|s| s.vm.as_str()).collect::<Vec<_>>(), ["full"]);
    }

    fn in_grace(&self) -> Vec<VmStatus> {
        self.registry.list().into_iter().filter(|s| s.state == VmState::InGrace).collect()
    }

    /// The whole disk of a VM in grace, read by a client that then loses its connection, so the
    /// VM is in grace again.
    fn read_disk(&self, status: &VmStatus) -> Vec<u8> {
        let export = format!("{}@{}", status.image, status.vm);
        let mut client = self.client(&export);
        let mut disk = vec![0u8; DISK_BYTES];
        for (i, chunk) in disk.chunks_mut(1 << 20).enumerate() {
            client.read((i << 20) as u64, chunk).unwrap_or_else(|e| panic!("reading {export}: {e}"));
        }
        drop(client);
        self.idle("a reader of a VM in grace");
        disk
    }

    /// Stops the server as `overspill serve` does on SIGHUP, handing the VMs in grace over to
    /// the next one, which must rebuild each from its files to read back exactly the same, but
    /// for blocks in `trimmed`: copies a TRIM freed may come back (docs/lifecycle.md; NBD lets
    /// a trimmed block read as anything until it is written).
    fn restart(&mut self, trimmed: &[(usize, usize)]) {
        let before: Vec<(VmStatus, Vec<u8>)> =
            self.in_grace().into_iter().map(|s| (s.clone(), self.read_disk(&s))).collect();
        self.registry.hand_over_all_in_grace();
        assert!(self.registry.snapshot().is_empty(), "VMs left after the hand-over");
        let (server, registry) = serve(&self.work, &self.image, &self.host);
        (self.server, self.registry) = (server, registry);
        let after = self.registry.list();
        let named =
            |list: &mut dyn Iterator<Item = &VmStatus>| list.map(|s| (s.vm.clone(), s.state)).collect::<Vec<_>>();
        assert_eq!(
            named(&mut after.iter()),
            named(&mut before.iter().map(|(s, _)| s)),
            "the new server did not rebuild every VM handed over, in grace: {after:?}"
        );
        for (status, disk) in &before {
            let now = self.read_disk(status);
            // The blocks before each trimmed range (sorted, possibly overlapping), then the rest.
            let all = DISK_BYTES / BLOCK_SIZE;
            let mut from = 0;
            for &(first, end) in trimmed.iter().chain([&(all, all)]) {
                let kept = from * BLOCK_SIZE..first.max(from) * BLOCK_SIZE;
                if now[kept.clone()] != disk[kept.clone()] {
                    let at = kept.clone().find(|&i| now[i] != disk[i]).unwrap_or(kept.start);
                    panic!("{} reads back other bytes after the restart, from byte {at}", status.vm);
                }
                from = from.max(end);
            }
        }
    }

    /// Drops every VM left in grace, then asserts that nothing of any VM is left: no registry
    /// entry, no memory accounted to the host.
    fn drop_all(&self) {
        for status in self.registry.list() {
            assert_eq!(status.state, VmState::InGrace, "{status:?} with no connection left");
            self.registry.drop_vm(&status.vm).unwrap_or_else(|e| panic!("dropping {}: {e}", status.vm));
        }
        assert!(self.registry.snapshot().is_empty(), "VMs left: {:?}", self.registry.list());
        assert_eq!((self.host.vms(), self.host.used_bytes()), (0, 0), "VMs or memory still attached to the host");
    }

    /// Every file is one the server makes, named after a VM it has (in grace: no connection is
    /// left); once the VMs are dropped (`settled`), none is left.
    fn check_files(&self, settled: bool) {
        assert_eq!(entries(&self.base), ["work"], "a file beside the work directory");
        let top = entries(&self.work);
        assert_eq!(top, ["golden.img", "memory", "shared", "spill", "state"], "unexpected files in the work directory");
        let vms: Vec<String> = if settled { Vec::new() } else { self.in_grace().into_iter().map(|s| s.vm).collect() };
        let dirs: [(&str, &[&str]); 4] = [
            ("memory", &["pages", "slots", "segments", "zeros"]),
            ("spill", &["spill"]),
            ("state", &["json"]),
            ("shared", &[]),
        ];
        for (dir, suffixes) in dirs {
            for name in entries(&self.work.join(dir)) {
                // The boot the ledger's last server started in (docs/lifecycle.md).
                if dir == "state" && name == ".boot" {
                    continue;
                }
                let vm = name
                    .strip_prefix("vm-")
                    .and_then(|rest| rest.rsplit_once('.'))
                    .filter(|(_, suffix)| suffixes.contains(suffix))
                    .map(|(vm, _)| vm);
                let Some(vm) = vm else { panic!("{dir}/{name:?} is no file of a VM in grace (settled: {settled})") };
                assert!(check_name("VM", vm).is_ok(), "{dir}/{name:?} is named after a name the server refuses");
                assert!(
                    vms.iter().any(|v| v == vm),
                    "{dir}/{name:?} is left of a VM that is gone (settled: {settled})"
                );
            }
        }
    }

    fn check_golden(&self) {
        assert_eq!(stamp(&self.golden_path), self.golden_stamp, "the golden image was changed");
        if self.inputs % GOLDEN_READ_EVERY == 0 {
            let now = std::fs::read(&self.golden_path).expect("reading the golden image");
            assert!(now == self.golden, "the golden image holds other bytes");
        }
    }

    /// A fresh VM (anonymous and named in turn) spills what it writes and reads it back, and
    /// reads the golden image as it is through the read cache the fuzzer's VMs shared.
    fn still_serves(&mut self) {
        let round = self.inputs;
        let export = if round % 2 == 0 { "" } else { "@probe" };
        let mut client = self.client(export);
        let stats = match self.registry.snapshot().as_slice() {
            [vm] => vm.stats.clone(),
            other => panic!("{} VMs for one client", other.len()),
        };
        // Twice the memory target, so half of it at least is spilled; a different pattern each
        // time, so a write that did not land is not hidden by the last one.
        let blocks = 2 * RAM_TARGET_BYTES / BLOCK_BYTES;
        let pattern = (0..blocks).map(|i| vec![i as u8 ^ round as u8; BLOCK_SIZE]).collect::<Vec<_>>().concat();
        let offset = (DISK_BYTES - pattern.len()) as u64;
        client.write(offset, &pattern, false).expect("write");
        let mut back = vec![0u8; pattern.len()];
        client.read(offset, &mut back).expect("read");
        assert!(back == pattern, "{export:?} read back other bytes than were written");
        assert!(stats.read_blocks_spill.get() > 0, "{export:?} wrote twice its memory target and nothing spilled");
        let window = (round as usize % 4) * PATTERN_BYTES / 4;
        let mut golden = vec![0u8; PATTERN_BYTES / 4];
        client.read(window as u64, &mut golden).expect("read");
        assert!(golden == self.golden[window..window + golden.len()], "golden data read wrong at {window}");
        client.flush().expect("flush");
        client.disconnect().expect("disconnect");
        self.idle("a well-behaved connection");
        self.drop_all();
        self.check_files(true);
    }
}

/// A server over `work` as `overspill serve --mode ram+disk` makes one, with named VMs kept in
/// files for their reconnect grace (rebuilding any an earlier server handed over).
fn serve(work: &Path, image: &Arc<dyn GoldenImage>, host: &Arc<HostMemory>) -> (Server, Arc<VmRegistry>) {
    let settings = CacheSettings {
        mode: WriteCacheMode::RamDisk,
        ram_target_bytes: RAM_TARGET_BYTES,
        spill_max_bytes: Some(SPILL_MAX_BYTES),
        spill_direct: false,
        spill_writers: DEFAULT_SPILL_WRITERS,
        spill_dir: work.join("spill"),
        shared_dir: work.join("shared"),
        read_cache_bytes: 1 << 20,
    };
    let images = BTreeMap::from([(String::new(), image.clone())]);
    let mut exports = OverlayExports::new(images, settings, host.clone()).expect("exports");
    // The anonymous export writes to a throwaway overlay (`serve --anonymous-writes`), so that
    // inputs reach the engine through it too; without the flag it is read-only.
    exports.allow_anonymous_writes();
    exports
        .with_lifecycle(Lifecycle {
            reconnect_grace: GRACE,
            state_dir: Some(work.join("state")),
            memory_dir: Some(work.join("memory")),
        })
        .expect("lifecycle");
    let registry = exports.registry();
    (Server::new(Arc::new(exports), ServerConfig::default()), registry)
}

/// The blocks a TRIM in `input` may have freed, as sorted `[first, end)` block ranges: every
/// 28 bytes that read as a TRIM request, wherever they are (a superset of the TRIMs the server
/// saw, as they all came from the input), clamped to the disk.
fn trimmed_blocks(input: &[u8]) -> Vec<(usize, usize)> {
    let blocks = DISK_BYTES / BLOCK_SIZE;
    let mut ranges: Vec<(usize, usize)> = input
        .windows(REQUEST_HEADER_BYTES)
        .filter(|w| be_u32(w) == REQUEST_MAGIC && be_u16(&w[6..]) == CMD_TRIM)
        .map(|w| {
            let (offset, len) = (be_u64(&w[16..]), u64::from(be_u32(&w[24..])));
            let block = |byte: u64| usize::try_from(byte / BLOCK_BYTES).unwrap_or(usize::MAX).min(blocks);
            (block(offset), block(offset.saturating_add(len).saturating_add(BLOCK_BYTES - 1)))
        })
        .collect();
    ranges.sort_unstable();
    ranges
}

/// The golden image's bytes: a deterministic pattern (xorshift), then zeroes.
fn golden_bytes() -> Vec<u8> {
    let mut bytes = vec![0u8; DISK_BYTES];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for chunk in bytes[..PATTERN_BYTES].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    bytes
}

/// What `@full` holds in a block: its number, so a block read from the wrong slot shows.
/// (Built with slice copies: this crate's loops are instrumented, and a byte-at-a-time loop
/// over the thousand blocks of `@full` took most of the target's time.)
fn full_block(block: u64) -> Vec<u8> {
    block.to_le_bytes().repeat(BLOCK_SIZE / 8)
}

/// Size and modification time: a write through any descriptor changes the time.
fn stamp(path: &Path) -> (u64, i64, i64) {
    let meta = std::fs::metadata(path).expect("golden image metadata");
    (meta.len(), meta.mtime(), meta.mtime_nsec())
}

/// The names in a directory, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let read = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()));
    let mut names: Vec<String> =
        read.map(|entry| entry.expect("directory entry").file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}
