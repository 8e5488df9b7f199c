//! What an operator meets when starting `overspill serve` on a real host: a listen path that is
//! not a socket, a socket that libvirt's QEMU (another user) must reach, a log reader that dies.
//! Each runs the real binary; the socket test connects with `nbdinfo` as an unprivileged user.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use overspill_nbd::client::{Client, NbdUri};
use tempfile::TempDir;

mod common;
use common::{pseudo_random, run_tool, Serve};

fn golden(dir: &Path) -> PathBuf {
    let path = dir.join("golden.img");
    std::fs::write(&path, pseudo_random(4 << 20, 7)).expect("golden image");
    path
}

fn socket_uri(socket: &Path, export: &str) -> NbdUri {
    format!("nbd+unix:///{export}?socket={}", socket.display()).parse().expect("uri")
}

#[test]
fn a_listen_path_that_is_a_regular_file_is_refused_and_left_alone() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let before = std::fs::read(&golden).expect("read");
    let listen = format!("unix:{}", golden.display());
    let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["serve", "--base", golden.to_str().expect("utf-8"), "--listen", &listen, "--ram-floor", "0"])
        .args(["--spill-dir", tmp.path().join("spill").to_str().expect("utf-8")])
        .stdin(Stdio::null())
        .output()
        .expect("run overspill serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "serve started on a regular file:\n{stderr}");
    assert!(stderr.contains("not a socket") && stderr.contains("golden.img"), "{stderr}");
    assert_eq!(std::fs::read(&golden).expect("the golden image is still there"), before);
}

/// libvirt runs QEMU as its own user: the socket must let that user's group in, and nobody else.
#[test]
fn socket_mode_and_group_let_exactly_the_chosen_group_connect() {
    let tmp = TempDir::new().expect("tempdir");
    // The unprivileged client must reach the socket through the directory.
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let base = ["--base", golden.to_str().expect("utf-8"), "--listen", &listen];
    // nobody:nogroup stands for libvirt-qemu:libvirt-qemu.
    let as_nobody = |uri: &str| {
        run_tool(tmp.path(), "setpriv", &["--reuid=65534", "--regid=65534", "--clear-groups", "nbdinfo", "--size", uri])
    };
    let uri = format!("nbd+unix:///?socket={}", socket.display());

    let server = Serve::start(
        tmp.path(),
        &[&base[..], &["--socket-mode", "660", "--socket-group", "65534"]].concat(),
        &[],
        || socket.exists(),
    );
    let metadata = std::fs::metadata(&socket).expect("socket");
    assert_eq!(metadata.mode() & 0o777, 0o660);
    assert_eq!(metadata.gid(), 65534);
    let out = as_nobody(&uri);
    assert!(out.status.success(), "the socket's group could not connect:\n{}", out.all());
    assert_eq!(out.stdout.trim(), (4u64 << 20).to_string());
    drop(server);

    // The first server was killed: its socket file stays until the next one replaces it.
    let server = Serve::start(tmp.path(), &[&base[..], &["--socket-mode", "600"]].concat(), &[], || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    let out = as_nobody(&uri);
    assert!(!out.status.success(), "another user connected to a 600 socket:\n{}", out.all());
    assert!(out.all().contains("ermission denied"), "{}", out.all());
    drop(server);
}

/// `overspill serve … 2>&1 | tee log`, and tee dies: VMs still connect, SIGTERM still drains.
#[test]
fn a_dead_log_reader_neither_stops_new_vms_nor_sigterm() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("nbd.sock");
    let (log_reader, log_writer) = std::io::pipe().expect("pipe");
    let mut child = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["serve", "--base", golden.to_str().expect("utf-8"), "--ram-floor", "0"])
        .args(["--listen", &format!("unix:{}", socket.display())])
        .args(["--spill-dir", tmp.path().join("spill").to_str().expect("utf-8")])
        .env("RUST_LOG", "debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_writer)
        .spawn()
        .expect("start serve");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "serve never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The log's reader goes away: every later log line meets a broken pipe.
    drop(log_reader);
    for vm in 0..5u64 {
        let mut client = Client::connect(&socket_uri(&socket, &format!("@vm{vm}"))).expect("a VM connects");
        let data = pseudo_random(64 * 1024, vm);
        client.write(vm * 65536, &data, false).expect("write");
        let mut back = vec![0; data.len()];
        client.read(vm * 65536, &mut back).expect("read");
        assert_eq!(back, data);
        client.disconnect().expect("disconnect");
    }
    nix_kill(child.id(), "TERM");
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("SIGTERM did not stop a server whose log reader died");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status}");
}

fn nix_kill(pid: u32, signal: &str) {
    let status = Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status().expect("kill");
    assert!(status.success());
}
