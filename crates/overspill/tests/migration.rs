//! A named VM moves between two servers that are each other's peers (live migration): the
//! destination's connection takes the VM's overlay from the source (RAM tier and spill), its
//! requests wait until the switchover, and every acknowledged write reads back there. The
//! switchover comes from whichever happens first, the destination's first request or the
//! source's end; a move given up leaves the VM where it was. Two real servers on one host, with
//! our NBD client and with QEMU migrating a guest's disk.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use overspill_nbd::client::{Client, NbdUri};
use serde_json::Value;
use tempfile::TempDir;

mod common;
use common::{assert_same, pseudo_random, Serve};

const GOLDEN_BYTES: usize = 32 << 20;
const WAIT: Duration = Duration::from_secs(20);

/// One host, one golden image, two servers: `a` and `b`, each the other's peer.
struct Pair {
    dir: TempDir,
    golden: PathBuf,
    golden_bytes: Vec<u8>,
}

struct Side {
    name: &'static str,
    dir: PathBuf,
}

impl Side {
    fn socket(&self) -> PathBuf {
        self.dir.join("nbd.sock")
    }

    fn peer_socket(&self) -> PathBuf {
        self.dir.join("peer.sock")
    }

    fn uri(&self, vm: &str) -> NbdUri {
        format!("nbd+unix:///@{vm}?socket={}", self.socket().display()).parse().expect("uri")
    }

    fn connect(&self, vm: &str) -> Client {
        Client::connect(&self.uri(vm)).unwrap_or_else(|e| panic!("connecting {vm} to {}: {e}", self.name))
    }

    /// `overspill vm list --json` of this side's server.
    fn list(&self) -> Vec<Value> {
        let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
            .args(["vm", "--control"])
            .arg(self.dir.join("spill/state/control.sock"))
            .args(["list", "--json"])
            .stdin(Stdio::null())
            .output()
            .expect("overspill vm list");
        assert!(out.status.success(), "vm list: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("vm list --json")
    }

    fn state_of(&self, vm: &str) -> Option<String> {
        self.list().iter().find(|v| v["vm"] == vm).map(|v| v["state"].as_str().unwrap_or_default().to_owned())
    }
}

impl Pair {
    fn new() -> Self {
        let dir = TempDir::new().expect("tempdir");
        let golden = dir.path().join("golden.img");
        let golden_bytes = pseudo_random(GOLDEN_BYTES, 5);
        std::fs::write(&golden, &golden_bytes).expect("golden image");
        for side in ["a", "b"] {
            std::fs::create_dir_all(dir.path().join(side)).expect("side dir");
        }
        Self { dir, golden, golden_bytes }
    }

    fn side(&self, name: &'static str) -> Side {
        Side { name, dir: self.dir.path().join(name) }
    }

    /// Serves side `name`, the other side its peer; 1 MiB of RAM per VM, so that VMs spill.
    fn serve(&self, name: &'static str) -> Serve {
        let (this, other) = (self.side(name), self.side(if name == "a" { "b" } else { "a" }));
        let listen = format!("unix:{}", this.socket().display());
        let peer_listen = format!("unix:{}", this.peer_socket().display());
        let peer = format!("unix:{}", other.peer_socket().display());
        let args = [
            "--base",
            self.golden.to_str().expect("utf-8"),
            "--listen",
            &listen,
            "--ram",
            "1M",
            "--peer-listen",
            &peer_listen,
            "--peer",
            &peer,
        ];
        let socket = this.socket();
        Serve::start_named_only(&this.dir, &args, &[], move || std::os::unix::net::UnixStream::connect(&socket).is_ok())
    }

    #[track_caller]
    fn assert_golden_unchanged(&self) {
        assert_same(&std::fs::read(&self.golden).expect("golden"), &self.golden_bytes, "the golden image");
    }
}

/// What the VM's disk should read: the golden image with its writes.
struct Model(Vec<u8>);

impl Model {
    fn write(&mut self, client: &mut Client, offset: usize, data: &[u8]) {
        client.write(offset as u64, data, false).unwrap_or_else(|e| panic!("write at {offset}: {e}"));
        self.0[offset..offset + data.len()].copy_from_slice(data);
    }

    fn zero(&mut self, client: &mut Client, offset: usize, len: usize) {
        client.write_zeroes(offset as u64, len as u32, false).expect("write zeroes");
        self.0[offset..offset + len].fill(0);
    }

    fn trim(&mut self, client: &mut Client, offset: usize, len: usize, golden: &[u8]) {
        client.trim(offset as u64, len as u32).expect("trim");
        self.0[offset..offset + len].copy_from_slice(&golden[offset..offset + len]);
    }

    #[track_caller]
    fn assert_reads_back(&self, client: &mut Client, what: &str) {
        let mut disk = vec![0u8; self.0.len()];
        for (i, chunk) in disk.chunks_mut(4 << 20).enumerate() {
            client.read((i * (4 << 20)) as u64, chunk).unwrap_or_else(|e| panic!("{what}: read: {e}"));
        }
        assert_same(&disk, &self.0, what);
    }
}

/// Writes that fill the RAM tier and spill (8 MiB against 1 MiB), a zeroed and a trimmed range.
fn first_writes(model: &mut Model, client: &mut Client, golden: &[u8]) {
    model.write(client, 0, &pseudo_random(8 << 20, 11));
    model.zero(client, 9 << 20, 1 << 20);
    model.trim(client, 1 << 20, 256 << 10, golden);
}

/// Writes while the move's pre-copy runs: new blocks, and overwrites of blocks sent already.
fn writes_during_pre_copy(model: &mut Model, client: &mut Client) {
    for round in 0..20u64 {
        let offset = ((round * 7919) % 3000) as usize * 4096;
        model.write(client, offset, &pseudo_random(64 << 10, 100 + round));
        model.write(client, (16 << 20) + offset, &pseudo_random(4096, 200 + round));
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[track_caller]
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The destination's first request asks for the switchover while the source still writes: it
/// is answered from the moved state, and the source's next request fails (the source server
/// has given the VM up).
#[test]
fn a_vm_moves_to_the_peer_its_destination_connects_to_and_its_writes_go_with_it() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let _server_a = pair.serve("a");
    let _server_b = pair.serve("b");
    let mut model = Model(pair.golden_bytes.clone());
    let mut source = a.connect("desk");
    first_writes(&mut model, &mut source, &pair.golden_bytes);

    let mut destination = b.connect("desk");
    assert_eq!(a.state_of("desk").as_deref(), Some("outgoing"), "A while the move runs");
    assert_eq!(b.state_of("desk").as_deref(), Some("incoming"), "B while the move runs");
    writes_during_pre_copy(&mut model, &mut source);

    model.assert_reads_back(&mut destination, "the destination after the switchover");
    assert!(source.write(0, &[1; 4096], false).is_err(), "the source wrote after the switchover");
    assert_eq!(a.state_of("desk"), None, "A gave the VM up");
    assert_eq!(b.state_of("desk").as_deref(), Some("connected"));
    // The VM lives on at B, as any VM: its writes go on there.
    model.write(&mut destination, 20 << 20, &pseudo_random(1 << 20, 300));
    model.assert_reads_back(&mut destination, "the destination after more writes");
    pair.assert_golden_unchanged();
}

/// The source's clean end (QEMU's NBD_CMD_DISC as libvirt stops it) comes before the
/// destination's first request: it is the switchover, not the VM's end.
#[test]
fn the_sources_end_before_the_destinations_first_request_hands_the_vm_over() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let _server_a = pair.serve("a");
    let _server_b = pair.serve("b");
    let mut model = Model(pair.golden_bytes.clone());
    let mut source = a.connect("desk");
    first_writes(&mut model, &mut source, &pair.golden_bytes);
    let mut destination = b.connect("desk");
    writes_during_pre_copy(&mut model, &mut source);
    source.disconnect().expect("NBD_CMD_DISC");
    wait_for("A gives the VM up", || a.state_of("desk").is_none());
    assert_eq!(b.state_of("desk").as_deref(), Some("connected"));
    model.assert_reads_back(&mut destination, "the destination after the source's end");
    pair.assert_golden_unchanged();
}

/// A move given up (the destination goes away before its first request, as when a migration
/// is cancelled): the VM goes on at the source with every write, and B holds nothing of it.
#[test]
fn a_move_given_up_leaves_the_vm_at_the_source() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let _server_a = pair.serve("a");
    let _server_b = pair.serve("b");
    let mut model = Model(pair.golden_bytes.clone());
    let mut source = a.connect("desk");
    first_writes(&mut model, &mut source, &pair.golden_bytes);
    let destination = b.connect("desk");
    writes_during_pre_copy(&mut model, &mut source);
    drop(destination);
    wait_for("A keeps the VM", || a.state_of("desk").as_deref() == Some("connected"));
    wait_for("B drops its copy", || b.state_of("desk").is_none());
    model.write(&mut source, 12 << 20, &pseudo_random(2 << 20, 400));
    model.assert_reads_back(&mut source, "the source after the move was given up");
    // A second move of the same VM, after the first was given up.
    let mut destination = b.connect("desk");
    model.assert_reads_back(&mut destination, "the destination of a second move");
    pair.assert_golden_unchanged();
}

/// A VM in its grace at the source (its connection lost) moves too: the destination's
/// connection takes it.
#[test]
fn a_vm_in_its_grace_at_the_source_moves_to_the_destination() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let _server_a = pair.serve("a");
    let _server_b = pair.serve("b");
    let mut model = Model(pair.golden_bytes.clone());
    let mut source = a.connect("desk");
    first_writes(&mut model, &mut source, &pair.golden_bytes);
    drop(source);
    wait_for("the VM waits in its grace at A", || a.state_of("desk").as_deref() == Some("in-grace"));
    let mut destination = b.connect("desk");
    model.assert_reads_back(&mut destination, "the destination");
    assert_eq!(a.state_of("desk"), None);
    pair.assert_golden_unchanged();
}

/// The ledger of a source killed after the switchover says the VM moved: a restarted source
/// does not resume its stale copy, and sends a connection of that name to the peer.
#[test]
fn a_restarted_source_never_resumes_a_vm_it_handed_over() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let server_a = pair.serve("a");
    let _server_b = pair.serve("b");
    let mut model = Model(pair.golden_bytes.clone());
    let mut source = a.connect("desk");
    first_writes(&mut model, &mut source, &pair.golden_bytes);
    let mut destination = b.connect("desk");
    model.assert_reads_back(&mut destination, "the destination");
    drop(source);
    server_a.kill();
    let _server_a = pair.serve("a");
    assert_eq!(a.state_of("desk"), None, "the restarted source holds the VM");
    // Back to A: B holds it live, so A takes it from B.
    drop(destination);
    wait_for("the VM waits in its grace at B", || b.state_of("desk").as_deref() == Some("in-grace"));
    let mut back = a.connect("desk");
    model.assert_reads_back(&mut back, "the VM moved back to the restarted source");
    let _ = Path::new("");
    pair.assert_golden_unchanged();
}
