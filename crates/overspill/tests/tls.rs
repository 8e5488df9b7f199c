//! TLS and access control against real clients: `overspill serve` on TCP with x509 certificates
//! (rustls) or pre-shared keys (OpenSSL), driven by qemu-io, qemu-img and nbdinfo, which speak
//! TLS through GnuTLS, the stack qemu and libnbd ship with. Certificates are made fresh per test
//! with rcgen.
//!
//! Each test checks what a client that should get in can do (read, write, read back over TLS),
//! that those that should not are refused (plain text, a foreign CA, no certificate, a wrong
//! key, an identity not allowed), and that the server serves on after every refusal.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
};
use serde_json::Value;
use tempfile::TempDir;

mod common;

const GOLDEN_BYTES: usize = 8 << 20;

/// A golden image whose every 4 KiB block holds its own number, so reads can be checked.
fn golden(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let bytes: Vec<u8> = (0..GOLDEN_BYTES).map(|i| (i / 4096) as u8 ^ 0x5a).collect();
    std::fs::write(&path, bytes).expect("golden image");
    path
}

// ---------------------------------------------------------------------------------------------
// Credentials

/// A CA, and what it signed.
struct Authority {
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn params(names: &[&str], common_name: &str) -> CertificateParams {
    let mut params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).expect("params");
    params.distinguished_name.push(DnType::CommonName, common_name);
    params.not_before = rcgen::date_time_ymd(2024, 1, 1);
    params.not_after = rcgen::date_time_ymd(2099, 1, 1);
    params
}

impl Authority {
    fn new(name: &str) -> Self {
        let mut ca = params(&[], name);
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("CA key");
        let cert = ca.self_signed(&key).expect("CA certificate");
        Self { cert, key }
    }

    /// Writes `<prefix>-cert.pem` and `<prefix>-key.pem` into `dir`, and the CA as `ca-cert.pem`.
    fn issue(&self, dir: &Path, prefix: &str, common_name: &str, server: bool) {
        let mut leaf = if server { params(&["localhost"], common_name) } else { params(&[], common_name) };
        if server {
            leaf.subject_alt_names.push(SanType::IpAddress([127, 0, 0, 1].into()));
        }
        leaf.extended_key_usages =
            vec![if server { ExtendedKeyUsagePurpose::ServerAuth } else { ExtendedKeyUsagePurpose::ClientAuth }];
        let key = KeyPair::generate().expect("leaf key");
        let cert = leaf.signed_by(&key, &self.cert, &self.key).expect("leaf certificate");
        std::fs::create_dir_all(dir).expect("credentials dir");
        std::fs::write(dir.join(format!("{prefix}-cert.pem")), cert.pem()).expect("cert");
        std::fs::write(dir.join(format!("{prefix}-key.pem")), key.serialize_pem()).expect("key");
        std::fs::write(dir.join("ca-cert.pem"), self.cert.pem()).expect("CA cert");
    }
}

// ---------------------------------------------------------------------------------------------
// The server and the clients

struct Server {
    process: common::Serve,
    port: u16,
}

impl Server {
    fn start(dir: &Path, args: &[&str]) -> Self {
        // A port the kernel just handed out and took back: free unless something races us.
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
        let listen = format!("tcp:127.0.0.1:{port}");
        let args = [&["--listen", listen.as_str()], args].concat();
        let process = common::Serve::start(dir, &args, &[], || TcpStream::connect(("127.0.0.1", port)).is_ok());
        Self { process, port }
    }

    fn log_text(&self) -> String {
        self.process.log_text()
    }

    #[track_caller]
    fn assert_running(&mut self) {
        self.process.assert_running();
    }

    /// qemu's `--image-opts` for an export over TLS with the credentials object `tls0`.
    fn qemu_opts(&self, export: &str) -> String {
        format!(
            "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={},export={export},tls-creds=tls0",
            self.port
        )
    }

    /// A libnbd URI; `query` carries the TLS settings.
    fn uri(&self, user: Option<&str>, export: &str, query: &str) -> String {
        let user = user.map(|u| format!("{u}@")).unwrap_or_default();
        format!("nbds://{user}127.0.0.1:{}/{export}?{query}", self.port)
    }
}

/// Runs a client that must succeed; what it printed.
#[track_caller]
fn run_ok(program: &str, args: &[&str]) -> String {
    let out = common::run_ok(Path::new("."), program, args);
    out.stdout + &out.stderr
}

/// Runs a client that must be refused; what it printed.
#[track_caller]
fn run_refused(program: &str, args: &[&str]) -> String {
    let out = common::run_tool(Path::new("."), program, args);
    assert!(!out.status.success(), "{program} {args:?} should have been refused:\n{}", out.all());
    out.stdout + &out.stderr
}

/// Writes a pattern and reads it back on one connection (one VM), and reads an untouched
/// golden block: the whole data path over TLS.
fn qemu_io_round_trip(server: &Server, object: &str, export: &str) {
    let opts = server.qemu_opts(export);
    let out = run_ok(
        "qemu-io",
        &[
            "--object",
            object,
            "--image-opts",
            &opts,
            "-c",
            "write -P 0xab 1M 64k",
            "-c",
            "read -P 0xab 1M 64k",
            // Large enough to be received from the TLS stream straight into the overlay's pages.
            "-c",
            "write -P 0xcd 3M 2M",
            "-c",
            "read -P 0xcd 3M 2M",
            // Block 7 of the golden image holds 7 ^ 0x5a.
            "-c",
            "read -P 0x5d 28k 4k",
        ],
    );
    assert!(!out.contains("failed") && out.matches("read 65536/65536").count() == 1, "{out}");
    assert!(out.contains("read 2097152/2097152"), "{out}");
}

fn nbdinfo_size(uri: &str) -> u64 {
    let text = run_ok("nbdinfo", &["--json", uri]);
    let start = text.find('{').unwrap_or_else(|| panic!("no JSON from nbdinfo:\n{text}"));
    let info: Value = serde_json::from_str(&text[start..]).unwrap_or_else(|e| panic!("nbdinfo JSON: {e}\n{text}"));
    info["exports"][0]["export-size"].as_u64().unwrap_or_else(|| panic!("no size in {info}"))
}

fn listed(uri: &str) -> Vec<String> {
    let text = run_ok("nbdinfo", &["--list", "--json", uri]);
    let start = text.find('{').unwrap_or_else(|| panic!("no JSON from nbdinfo:\n{text}"));
    let list: Value = serde_json::from_str(&text[start..]).unwrap_or_else(|e| panic!("nbdinfo JSON: {e}\n{text}"));
    let mut names: Vec<String> = list["exports"]
        .as_array()
        .unwrap_or_else(|| panic!("no exports in {list}"))
        .iter()
        .map(|e| e["export-name"].as_str().unwrap_or_default().to_owned())
        .collect();
    names.sort();
    names
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

// ---------------------------------------------------------------------------------------------
// Tests

/// x509 with client certificates required: qemu-io, qemu-img and nbdinfo with a certificate from
/// the right CA get in and read and write; plain text, a certificate from another CA and no
/// certificate at all are refused, and the server goes on.
#[test]
fn x509_clients_with_the_right_certificate_get_in_and_no_one_else() {
    let dir = TempDir::new().expect("tempdir");
    let image = golden(dir.path(), "golden.img");
    let ca = Authority::new("overspill test CA");
    let server_dir = dir.path().join("server");
    ca.issue(&server_dir, "server", "localhost", true);
    let alice = dir.path().join("alice");
    ca.issue(&alice, "client", "alice", false);
    let rogue = dir.path().join("rogue");
    let rogue_ca = Authority::new("someone else's CA");
    rogue_ca.issue(&rogue, "client", "alice", false);
    // Trusts the server's CA, but has its certificate from elsewhere.
    std::fs::copy(server_dir.join("ca-cert.pem"), rogue.join("ca-cert.pem")).expect("copy CA");
    let anonymous = dir.path().join("anonymous");
    std::fs::create_dir_all(&anonymous).expect("dir");
    std::fs::copy(server_dir.join("ca-cert.pem"), anonymous.join("ca-cert.pem")).expect("copy CA");

    let export = format!("golden={}", path(&image));
    let mut server = Server::start(
        dir.path(),
        &[
            "--export",
            &export,
            "--tls-cert",
            path(&server_dir.join("server-cert.pem")),
            "--tls-key",
            path(&server_dir.join("server-key.pem")),
            "--tls-client-ca",
            path(&server_dir.join("ca-cert.pem")),
        ],
    );

    let object = format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", path(&alice));
    qemu_io_round_trip(&server, &object, "golden@vm-1");
    let info = run_ok(
        "qemu-img",
        &["info", "--output=json", "--object", &object, "--image-opts", &server.qemu_opts("golden")],
    );
    assert!(info.contains(&format!("\"virtual-size\": {GOLDEN_BYTES}")), "{info}");
    let certificates = format!("tls-certificates={}", path(&alice));
    assert_eq!(nbdinfo_size(&server.uri(None, "golden", &certificates)), GOLDEN_BYTES as u64);

    let plain = run_refused("nbdinfo", &[&format!("nbd://127.0.0.1:{}/golden", server.port)]);
    assert!(plain.to_lowercase().contains("tls"), "a plain-text client is told TLS is required:\n{plain}");
    run_refused("nbdinfo", &[&server.uri(None, "golden", &format!("tls-certificates={}", path(&rogue)))]);
    run_refused("nbdinfo", &[&server.uri(None, "golden", &format!("tls-certificates={}", path(&anonymous)))]);
    let wrong = format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", path(&rogue));
    run_refused("qemu-img", &["info", "--object", &wrong, "--image-opts", &server.qemu_opts("golden")]);

    server.assert_running();
    assert_eq!(nbdinfo_size(&server.uri(None, "golden", &certificates)), GOLDEN_BYTES as u64, "still serving");
    assert!(server.log_text().contains("identity=alice"), "the client's identity is its common name");
}

/// Pre-shared keys as qemu's tls-creds-psk and libnbd use them: the right key gets in, a wrong
/// key or an unknown identity does not, and with `--tls on` a plain-text client is served too.
#[test]
fn psk_clients_with_the_right_key_get_in() {
    let dir = TempDir::new().expect("tempdir");
    let image = golden(dir.path(), "golden.img");
    let keys = dir.path().join("server.psk");
    std::fs::write(&keys, "alice:0123456789abcdef0123456789abcdef\n").expect("keys");
    let qemu_dir = dir.path().join("qemu");
    std::fs::create_dir_all(&qemu_dir).expect("dir");
    std::fs::copy(&keys, qemu_dir.join("keys.psk")).expect("keys.psk");
    let wrong = dir.path().join("wrong.psk");
    std::fs::write(&wrong, "alice:00000000000000000000000000000000\n").expect("keys");
    let stranger = dir.path().join("stranger.psk");
    std::fs::write(&stranger, "mallory:0123456789abcdef0123456789abcdef\n").expect("keys");

    let export = format!("golden={}", path(&image));
    let mut server = Server::start(dir.path(), &["--export", &export, "--tls-psk", path(&keys), "--tls", "on"]);

    let object = format!("tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice", path(&qemu_dir));
    qemu_io_round_trip(&server, &object, "golden");
    let psk = |file: &Path| format!("tls-psk-file={}", path(file));
    assert_eq!(nbdinfo_size(&server.uri(Some("alice"), "golden", &psk(&keys))), GOLDEN_BYTES as u64);
    run_refused("nbdinfo", &[&server.uri(Some("alice"), "golden", &psk(&wrong))]);
    run_refused("nbdinfo", &[&server.uri(Some("mallory"), "golden", &psk(&stranger))]);
    // `on`, not `require`: TLS is offered, plain text still served.
    let plain = run_ok("nbdinfo", &["--json", &format!("nbd://127.0.0.1:{}/golden", server.port)]);
    assert!(plain.contains(&GOLDEN_BYTES.to_string()), "{plain}");

    server.assert_running();
    assert!(server.log_text().contains("identity=alice"), "the PSK identity is the client's identity");
}

/// `--allow`: each identity lists and opens only its images (under any VM name); others look
/// as if they did not exist.
#[test]
fn each_identity_sees_and_opens_only_the_images_allowed_it() {
    let dir = TempDir::new().expect("tempdir");
    let golden_image = golden(dir.path(), "golden.img");
    let other_image = golden(dir.path(), "other.img");
    let keys = dir.path().join("keys.psk");
    std::fs::write(&keys, "alice:aa11aa11aa11aa11aa11aa11aa11aa11\nbob:bb22bb22bb22bb22bb22bb22bb22bb22\n")
        .expect("keys");
    let golden_export = format!("golden={}", path(&golden_image));
    let other_export = format!("other={}", path(&other_image));
    let mut server = Server::start(
        dir.path(),
        &[
            "--export",
            &golden_export,
            "--export",
            &other_export,
            "--tls-psk",
            path(&keys),
            "--allow",
            "alice=golden",
            "--allow",
            "bob=golden,other",
        ],
    );
    let psk = format!("tls-psk-file={}", path(&keys));
    assert_eq!(listed(&server.uri(Some("alice"), "", &psk)), ["golden"]);
    assert_eq!(listed(&server.uri(Some("bob"), "", &psk)), ["golden", "other"]);
    assert_eq!(nbdinfo_size(&server.uri(Some("alice"), "golden@vm-7", &psk)), GOLDEN_BYTES as u64);
    let refused = run_refused("nbdinfo", &[&server.uri(Some("alice"), "other", &psk)]);
    assert!(refused.contains("other"), "{refused}");
    assert_eq!(nbdinfo_size(&server.uri(Some("bob"), "other@vm-1", &psk)), GOLDEN_BYTES as u64);
    server.assert_running();
}

/// A VM is its maker's: alice's QEMU dies mid-session (no NBD_CMD_DISC, its overlay waits), and
/// bob, whose key the server knows and who may open the same image, cannot open her VM by its
/// name, neither while it waits nor once a restarted server has rebuilt it; alice's next QEMU
/// reads back what she wrote.
#[test]
fn a_vm_is_opened_only_by_the_identity_that_made_it() {
    let dir = TempDir::new().expect("tempdir");
    let image = golden(dir.path(), "golden.img");
    let keys = dir.path().join("keys.psk");
    let (alice_key, bob_key) = ("alice:aa11aa11aa11aa11aa11aa11aa11aa11\n", "bob:bb22bb22bb22bb22bb22bb22bb22bb22\n");
    std::fs::write(&keys, [alice_key, bob_key].concat()).expect("keys");
    let credentials = |who: &str, key: &str| {
        let client_dir = dir.path().join(who);
        std::fs::create_dir_all(&client_dir).expect("dir");
        std::fs::write(client_dir.join("keys.psk"), key).expect("keys.psk");
        format!("tls-creds-psk,id=tls0,endpoint=client,dir={},username={who}", path(&client_dir))
    };
    let (alice, bob) = (credentials("alice", alice_key), credentials("bob", bob_key));
    let export = format!("golden={}", path(&image));
    let args = ["--export", &export, "--tls-psk", path(&keys), "--reconnect-grace", "1m"];
    let qemu_io = |server: &Server, object: &str, commands: &[&str]| {
        let opts = server.qemu_opts("golden@desk");
        let mut args = vec!["--object", object, "--image-opts", &opts];
        args.extend(commands.iter().flat_map(|c| ["-c", c]));
        common::run_tool(Path::new("."), "qemu-io", &args)
    };
    let bob_is_refused = |server: &mut Server| {
        let out = qemu_io(server, &bob, &["read 0 4k"]);
        assert!(!out.status.success(), "bob opened alice's VM:\n{}", out.all());
        // Logged as the refusal goes out: the client may hear it first.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !server.log_text().contains("VM desk belongs to another client identity") {
            assert!(std::time::Instant::now() < deadline, "{}", server.log_text());
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        server.assert_running();
    };

    let mut server = Server::start(dir.path(), &args);
    let out = qemu_io(&server, &alice, &["write -P 0xa1 0 64k", "sigraise 9"]);
    assert!(out.stdout.contains("wrote 65536/65536"), "{}", out.all());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !server.log_text().contains("its overlay waits for it to reconnect") {
        assert!(std::time::Instant::now() < deadline, "the VM is not in grace:\n{}", server.log_text());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    bob_is_refused(&mut server);
    let out = qemu_io(&server, &alice, &["read -P 0xa1 0 64k", "sigraise 9"]);
    assert!(out.stdout.contains("read 65536/65536") && !out.stdout.contains("failed"), "{}", out.all());

    // SIGTERM hands the VM over; the next server learns its owner from the ledger.
    server.process.stop();
    let mut server = Server::start(dir.path(), &args);
    bob_is_refused(&mut server);
    let out = qemu_io(&server, &alice, &["read -P 0xa1 0 64k"]);
    assert!(out.status.success() && !out.stdout.contains("failed"), "{}", out.all());
    server.assert_running();
}
