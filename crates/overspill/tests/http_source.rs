//! A golden image on a web server, served by the real `overspill serve` and read over NBD by
//! `qemu-img compare` against the file itself: from `range_server.py` (the HTTP source's test
//! server in overspill-sources, which honours Range) over HTTP with the local disk tier, and
//! over HTTPS with a private CA trusted through `SSL_CERT_FILE`; and Python's `http.server`,
//! which ignores Range, refused at start.

mod common;
#[allow(dead_code)] // Shared with overspill-sources' tests, which use other parts.
#[path = "../../overspill-sources/tests/common/web_server.rs"]
mod web_server;

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{pseudo_random, run_ok, Serve};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};
use tempfile::TempDir;
use web_server::WebServer;

/// Not a multiple of the 256 KiB fetch chunk: the last chunk is short.
const GOLDEN_BYTES: usize = (24 << 20) + (3 << 12);
/// Stands for a presigned URL's signature, which must never reach the server's log.
const SIGNATURE: &str = "X-Amz-Signature=deadbeefcafe";

fn golden(dir: &Path) -> PathBuf {
    let path = dir.join("golden.img");
    std::fs::write(&path, pseudo_random(GOLDEN_BYTES, 19)).expect("golden image");
    path
}

/// `overspill serve` on a unix socket in `dir`, with `args`.
fn serve(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (Serve, String) {
    let socket = dir.join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let args = [&["--listen", listen.as_str()], args].concat();
    let server = Serve::start(dir, &args, env, || UnixStream::connect(&socket).is_ok());
    (server, format!("nbd+unix:///?socket={}", socket.display()))
}

/// `overspill serve ARGS` that must refuse to start: the last line of its standard error.
fn serve_must_fail(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .arg("serve")
        .args(["--ram-floor", "0", "--listen", &format!("unix:{}", dir.join("nbd.sock").display())])
        .args(["--spill-dir", dir.join("spill").to_str().expect("utf-8")])
        .args(["--memory-dir", dir.join("memory").to_str().expect("utf-8")])
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run overspill serve");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "serve {args:?} started:\n{stderr}");
    stderr.lines().rfind(|l| !l.trim().is_empty()).unwrap_or_default().to_owned()
}

#[test]
fn an_image_on_a_web_server_serves_its_exact_bytes_through_the_local_tier() {
    let dir = TempDir::new().expect("tempdir");
    let golden = golden(dir.path());
    let web = WebServer::ranges(dir.path(), &[]);
    let url = format!("http://127.0.0.1:{}/golden.img?{SIGNATURE}", web.port);
    // A read cache far smaller than the image: the second pass must come from the local tier.
    let (mut server, uri) = serve(dir.path(), &["--base", &url, "--local-tier", "--read-cache", "2M"], &[]);
    let golden = golden.to_str().expect("utf-8");
    run_ok(dir.path(), "qemu-img", &["compare", "-f", "raw", "-F", "raw", golden, &uri]);
    let fetched = web.gets();
    // Two proving GETs at open, then at least one per 256 KiB chunk; never whole-image GETs.
    assert!(fetched >= GOLDEN_BYTES.div_ceil(256 << 10), "{fetched} GETs");
    run_ok(dir.path(), "qemu-img", &["compare", "-f", "raw", "-F", "raw", golden, &uri]);
    assert_eq!(web.gets(), fetched, "the second pass fetched from the web server, not the local tier");
    server.assert_running();
    let log = server.log_text();
    assert!(!log.contains("deadbeefcafe"), "the signature is in the server's log:\n{log}");
    assert!(log.contains("/golden.img?REDACTED"), "the image is named in the log:\n{log}");
    server.stop();
}

/// A restart in place (SIGHUP) keeps the pid and begins its file numbers again: files the old
/// program left under that pid (a connection still draining when it ended) are the new one's
/// to remove, and never stop its local tier or a VM from making files of their own.
#[test]
fn a_restart_in_place_removes_the_files_its_old_program_left_and_makes_its_own() {
    let dir = TempDir::new().expect("tempdir");
    let golden = golden(dir.path());
    let web = WebServer::ranges(dir.path(), &[]);
    let url = format!("http://127.0.0.1:{}/golden.img", web.port);
    let (mut server, uri) = serve(dir.path(), &["--base", &url, "--local-tier", "--ram", "1M"], &[]);
    let pid = server.child.id();
    let spill = dir.path().join("spill");
    let mark = overspill_engine::store::host_mark();
    let ours = |name: &str| spill.join(format!("overspill-{pid}-{name}"));
    // Named as this version names them, and as versions before the host's mark did.
    let left = [
        ours(&format!("1-{mark}.spill")),
        ours(&format!("2-{mark}.spill")),
        ours(&format!("tier1-{mark}.golden")),
        ours("1.spill"),
        ours("tier1.golden"),
    ];
    for file in &left {
        std::fs::write(file, b"left by the old program").expect("plant");
    }
    let hup = Command::new("kill").args(["-HUP", &pid.to_string()]).status().expect("kill");
    assert!(hup.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while server.log_text().matches("serving").count() < 2 {
        server.assert_running();
        assert!(std::time::Instant::now() < deadline, "no second serving line after SIGHUP:\n{}", server.log_text());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    for file in &left {
        assert!(!file.exists(), "{} outlived the restart", file.display());
    }
    // An anonymous VM spills (1 MiB of RAM) into a file numbered from 1 again.
    run_ok(dir.path(), "qemu-io", &["-f", "raw", "-c", "write -P 0x5a 0 4M", "-c", "read -P 0x5a 0 4M", &uri]);
    let golden = golden.to_str().expect("utf-8");
    run_ok(dir.path(), "qemu-img", &["compare", "-f", "raw", "-F", "raw", golden, &uri]);
    let tiers: Vec<_> = std::fs::read_dir(&spill)
        .expect("spill dir")
        .flatten()
        .filter(|f| f.file_name().to_string_lossy().ends_with(".golden"))
        .collect();
    assert_eq!(tiers.len(), 1, "one local tier file after the restart: {tiers:?}");
    server.assert_running();
    assert_eq!(server.child.id(), pid);
    server.stop();
}

/// A qcow2 image on a web server would be served as its container's bytes (remote images are
/// raw disks): refused at start, saying what it is and what to do.
#[test]
fn a_qcow2_image_on_a_web_server_is_refused_at_start() {
    let dir = TempDir::new().expect("tempdir");
    let qcow2 = dir.path().join("golden.qcow2");
    run_ok(dir.path(), "qemu-img", &["create", "-q", "-f", "qcow2", qcow2.to_str().expect("utf-8"), "16M"]);
    let web = WebServer::ranges(dir.path(), &[]);
    let url = format!("http://127.0.0.1:{}/golden.qcow2", web.port);
    let error = serve_must_fail(dir.path(), &["--base", &url], &[]);
    assert!(error.contains("this is a qcow2 image") && error.contains("qemu-img convert -O raw"), "{error}");
}

#[test]
fn a_web_server_without_range_support_is_refused_at_start() {
    let dir = TempDir::new().expect("tempdir");
    golden(dir.path());
    let web = WebServer::plain(dir.path());
    let url = format!("http://127.0.0.1:{}/golden.img?{SIGNATURE}", web.port);
    let error = serve_must_fail(dir.path(), &["--base", &url], &[]);
    assert!(error.contains("does not support range requests"), "{error}");
    assert!(!error.contains("deadbeefcafe"), "{error}");
    let error = serve_must_fail(dir.path(), &["--export", &format!("win={url}"), "--local-tier"], &[]);
    assert!(error.contains("does not support range requests"), "{error}");
}

#[test]
fn https_with_a_private_ca_trusted_through_ssl_cert_file() {
    let dir = TempDir::new().expect("tempdir");
    let golden = golden(dir.path());
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
    let mut leaf = CertificateParams::new(vec!["localhost".to_owned()]).expect("leaf params");
    leaf.subject_alt_names.push(SanType::IpAddress([127, 0, 0, 1].into()));
    let leaf_key = KeyPair::generate().expect("leaf key");
    let leaf_cert = leaf.signed_by(&leaf_key, &ca_cert, &ca_key).expect("leaf certificate");
    let pem = |name: &str, text: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("PEM file");
        path.to_str().expect("utf-8").to_owned()
    };
    let ca_file = pem("ca.pem", ca_cert.pem());
    let (cert, key) = (pem("web-cert.pem", leaf_cert.pem()), pem("web-key.pem", leaf_key.serialize_pem()));
    let web = WebServer::ranges(dir.path(), &["--tls", &cert, &key]);
    let url = format!("https://127.0.0.1:{}/golden.img?{SIGNATURE}", web.port);

    // Without the CA the server's certificate is unknown: refused at start.
    let error = serve_must_fail(dir.path(), &["--base", &url], &[]);
    assert!(error.to_lowercase().contains("certificate"), "{error}");
    assert!(!error.contains("tried"), "a TLS refusal is not tried again: {error}");
    assert!(!error.contains("deadbeefcafe"), "{error}");

    let (mut server, uri) = serve(dir.path(), &["--base", &url], &[("SSL_CERT_FILE", &ca_file)]);
    run_ok(dir.path(), "qemu-img", &["compare", "-f", "raw", "-F", "raw", golden.to_str().expect("utf-8"), &uri]);
    server.stop();
}
