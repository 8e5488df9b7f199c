//! The two servers of a move and what the VM's disk should read: each test's harness.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use overspill_nbd::client::{Client, NbdUri};
use serde_json::Value;
use tempfile::TempDir;

use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};

use crate::common::{assert_same, pseudo_random, Serve};

pub const GOLDEN_BYTES: usize = 32 << 20;
pub const WAIT: Duration = Duration::from_secs(20);

/// One host, one golden image, two servers: `a` and `b`, each the other's peer.
pub struct Pair {
    pub dir: TempDir,
    pub golden: PathBuf,
    pub golden_bytes: Vec<u8>,
}

pub struct Side {
    pub name: &'static str,
    pub dir: PathBuf,
}

impl Side {
    pub fn socket(&self) -> PathBuf {
        self.dir.join("nbd.sock")
    }

    pub fn peer_socket(&self) -> PathBuf {
        self.dir.join("peer.sock")
    }

    pub fn uri(&self, vm: &str) -> NbdUri {
        format!("nbd+unix:///@{vm}?socket={}", self.socket().display()).parse().expect("uri")
    }

    pub fn connect(&self, vm: &str) -> Client {
        Client::connect(&self.uri(vm)).unwrap_or_else(|e| panic!("connecting {vm} to {}: {e}", self.name))
    }

    /// `overspill vm list --json` of this side's server.
    pub fn list(&self) -> Vec<Value> {
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

    pub fn state_of(&self, vm: &str) -> Option<String> {
        self.list().iter().find(|v| v["vm"] == vm).map(|v| v["state"].as_str().unwrap_or_default().to_owned())
    }
}

impl Pair {
    pub fn new() -> Self {
        let dir = TempDir::new().expect("tempdir");
        let golden = dir.path().join("golden.img");
        let golden_bytes = pseudo_random(GOLDEN_BYTES, 5);
        std::fs::write(&golden, &golden_bytes).expect("golden image");
        for side in ["a", "b"] {
            std::fs::create_dir_all(dir.path().join(side)).expect("side dir");
        }
        Self { dir, golden, golden_bytes }
    }

    pub fn side(&self, name: &'static str) -> Side {
        Side { name, dir: self.dir.path().join(name) }
    }

    /// Serves side `name`, the other side its peer; 1 MiB of RAM per VM, so that VMs spill.
    pub fn serve(&self, name: &'static str) -> Serve {
        let (this, other) = (self.side(name), self.side(if name == "a" { "b" } else { "a" }));
        serve_side(&self.golden, &this, &other, "1M")
    }

    /// Both servers, and VM `desk` at A with its first writes (our client's).
    pub fn start(&self) -> Started {
        let (a, b) = (self.side("a"), self.side("b"));
        let (server_a, server_b) = (self.serve("a"), self.serve("b"));
        let mut model = Model(self.golden_bytes.clone());
        let mut source = a.connect("desk");
        first_writes(&mut model, &mut source, &self.golden_bytes);
        Started { a, b, server_a, server_b, model, source }
    }

    #[track_caller]
    pub fn assert_golden_unchanged(&self) {
        assert_same(&std::fs::read(&self.golden).expect("golden"), &self.golden_bytes, "the golden image");
    }
}

/// Serves `this` side over `golden`, `other` its peer, with `ram` per VM and metrics.
pub fn serve_side(golden: &Path, this: &Side, other: &Side, ram: &str) -> Serve {
    let peer_listen = format!("unix:{}", this.peer_socket().display());
    let peer = format!("unix:{}", other.peer_socket().display());
    serve_side_with(golden, this, [&peer_listen, &peer], ram, &[], &[])
}

/// Serves `this` side over `golden` with its peer socket and its peer as `[peer_listen, peer]`
/// say, `ram` per VM, metrics, `more` flags and `env` in its environment.
pub fn serve_side_with(
    golden: &Path,
    this: &Side,
    [peer_listen, peer]: [&str; 2],
    ram: &str,
    more: &[&str],
    env: &[(&str, &str)],
) -> Serve {
    let listen = format!("unix:{}", this.socket().display());
    let mut args = vec![
        "--base",
        golden.to_str().expect("utf-8"),
        "--listen",
        &listen,
        "--ram",
        ram,
        "--peer-listen",
        peer_listen,
        "--peer",
        peer,
        "--metrics",
        "tcp:127.0.0.1:0",
    ];
    args.extend_from_slice(more);
    let socket = this.socket();
    Serve::start_named_only(&this.dir, &args, env, move || std::os::unix::net::UnixStream::connect(&socket).is_ok())
}

/// Two servers each the other's peer, and a VM at the first with writes that spilled.
pub struct Started {
    pub a: Side,
    pub b: Side,
    pub server_a: Serve,
    pub server_b: Serve,
    pub model: Model,
    pub source: Client,
}

/// What the VM's disk should read: the golden image with its writes.
pub struct Model(pub Vec<u8>);

impl Model {
    pub fn write(&mut self, client: &mut Client, offset: usize, data: &[u8]) {
        client.write(offset as u64, data, false).unwrap_or_else(|e| panic!("write at {offset}: {e}"));
        self.0[offset..offset + data.len()].copy_from_slice(data);
    }

    pub fn zero(&mut self, client: &mut Client, offset: usize, len: usize) {
        client.write_zeroes(offset as u64, len as u32, false).expect("write zeroes");
        self.0[offset..offset + len].fill(0);
    }

    pub fn trim(&mut self, client: &mut Client, offset: usize, len: usize, golden: &[u8]) {
        client.trim(offset as u64, len as u32).expect("trim");
        self.0[offset..offset + len].copy_from_slice(&golden[offset..offset + len]);
    }

    #[track_caller]
    pub fn assert_reads_back(&self, client: &mut Client, what: &str) {
        let mut disk = vec![0u8; self.0.len()];
        for (i, chunk) in disk.chunks_mut(4 << 20).enumerate() {
            client.read((i * (4 << 20)) as u64, chunk).unwrap_or_else(|e| panic!("{what}: read: {e}"));
        }
        assert_same(&disk, &self.0, what);
    }
}

/// Writes that fill the RAM tier and spill (8 MiB against 1 MiB), a zeroed and a trimmed range.
pub fn first_writes(model: &mut Model, client: &mut Client, golden: &[u8]) {
    model.write(client, 0, &pseudo_random(8 << 20, 11));
    model.zero(client, 9 << 20, 1 << 20);
    model.trim(client, 1 << 20, 256 << 10, golden);
}

/// Writes while the move's pre-copy runs: new blocks, and overwrites of blocks sent already.
pub fn writes_during_pre_copy(model: &mut Model, client: &mut Client) {
    for round in 0..20u64 {
        let offset = ((round * 7919) % 3000) as usize * 4096;
        model.write(client, offset, &pseudo_random(64 << 10, 100 + round));
        model.write(client, (16 << 20) + offset, &pseudo_random(4096, 200 + round));
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[track_caller]
pub fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A CA for peer servers' certificates (rcgen).
pub struct Authority {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Authority {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().expect("key");
        Self { cert: params.self_signed(&key).expect("CA"), key }
    }

    /// Writes `dir/host.crt`, `dir/host.key` and `dir/ca.crt`, for a host known as `name` and
    /// reached at 127.0.0.1: the flags that give them.
    pub fn credentials(&self, dir: &Path, name: &str) -> Vec<String> {
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.cert, &self.key).expect("certificate");
        let file = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).expect("credentials");
            path.display().to_string()
        };
        vec![
            "--tls".into(),
            "off".into(),
            "--tls-cert".into(),
            file("host.crt", cert.pem()),
            "--tls-key".into(),
            file("host.key", key.serialize_pem()),
            "--peer-ca".into(),
            file("ca.crt", self.cert.pem()),
        ]
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("address").port()
}
