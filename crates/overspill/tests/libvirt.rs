//! `overspill libvirt-hook` under a real libvirtd (started here: `virtlogd -d`, `libvirtd -d`;
//! systemd is not the init on these machines), with a real QEMU (TCG) domain whose disk is a
//! named VM of a real `overspill serve`: a start resets the VM's overlay, and `virsh restore`
//! of a domain whose overlay went with its save is refused by the hook, naming the VM, and the
//! domain stays off. Needs root (libvirt's system instance); under `CI=true` it must run.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use overspill_nbd::client::{Client, NbdUri};
use tempfile::TempDir;

mod common;
use common::Serve;

const URI: &str = "qemu:///system";

fn virsh(args: &[&str]) -> Output {
    Command::new("timeout")
        .args(["120", "virsh", "-c", URI])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("virsh (libvirt-clients)")
}

fn libvirtd_answers() -> bool {
    virsh(&["version"]).status.success()
}

/// The daemons this test started, stopped when it ends.
struct Daemons(Vec<Child>);

impl Drop for Daemons {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// libvirt's system daemons, started here in the foreground of children we own; `None` when
/// they cannot run on this machine (not root, not installed), said on stderr. A libvirtd
/// already running is refused: it found its hooks when it started, before ours was there.
fn start_libvirt(hook: &Path) -> Option<Daemons> {
    let ci = std::env::var("CI").is_ok_and(|ci| ci == "true");
    let why_not = if !Path::new("/usr/sbin/libvirtd").exists() {
        Some("libvirtd is not installed (apt-get install -t bookworm-backports libvirt-daemon-system; scripts/test does)")
    } else if !nix_is_root() {
        Some("libvirt's system instance needs root")
    } else if libvirtd_answers() {
        Some("a libvirtd is already running: it looks for hooks when it starts, so this test starts its own")
    } else {
        None
    };
    if let Some(why) = why_not {
        assert!(!ci, "CI=true and {why}: this test must run in CI");
        eprintln!("skipped: {why}");
        return None;
    }
    assert!(hook.exists(), "the hook is installed before libvirtd starts");
    let spawn = |program: &str| {
        Command::new(program)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {program}: {e}"))
    };
    let daemons = Daemons(vec![spawn("/usr/sbin/virtlogd"), spawn("/usr/sbin/libvirtd")]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !libvirtd_answers() {
        assert!(Instant::now() < deadline, "libvirtd did not answer within a minute");
        std::thread::sleep(Duration::from_millis(200));
    }
    Some(daemons)
}

fn nix_is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A hook file of ours in libvirt's qemu.d, removed when dropped (never one we did not make).
struct InstalledHook(PathBuf);

impl InstalledHook {
    fn install(control: &Path, marks: &Path) -> Option<Self> {
        let dir = Path::new("/etc/libvirt/hooks/qemu.d");
        std::fs::create_dir_all(dir).ok()?;
        let path = dir.join(format!("overspill-test-{}", std::process::id()));
        let script = format!(
            "#!/bin/sh\nexec {} libvirt-hook --control {} --marks {} --wait 5s \"$@\"\n",
            env!("CARGO_BIN_EXE_overspill"),
            control.display(),
            marks.display()
        );
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).open(&path).ok()?;
        file.write_all(script.as_bytes()).ok()?;
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).ok()?;
        Some(Self(path))
    }
}

impl Drop for InstalledHook {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A domain this test defined, destroyed and undefined when dropped.
struct Domain(String);

impl Drop for Domain {
    fn drop(&mut self) {
        let _ = virsh(&["destroy", &self.0]);
        let _ = virsh(&["undefine", &self.0]);
    }
}

#[test]
fn libvirt_starts_a_domain_on_a_reset_overlay_and_refuses_its_restore_once_the_overlay_is_gone() {
    if !Path::new("/usr/sbin/libvirtd").exists() && std::env::var("CI").map_or(true, |ci| ci != "true") {
        eprintln!("skipped: libvirtd is not installed");
        return;
    }
    let dir = TempDir::new().expect("tempdir");
    // QEMU runs as libvirt-qemu: it must reach the server's socket.
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let golden = dir.path().join("golden.img");
    std::fs::File::create(&golden).and_then(|f| f.set_len(16 << 20)).expect("golden image");
    let socket = dir.path().join("nbd.sock");
    let control = dir.path().join("control.sock");
    let listen = format!("unix:{}", socket.display());
    let ready = socket.clone();
    let server = Serve::start_named_only(
        dir.path(),
        &[
            "--base",
            golden.to_str().expect("utf-8"),
            "--listen",
            &listen,
            "--socket-mode",
            "666",
            "--control",
            control.to_str().expect("utf-8"),
        ],
        &[],
        move || std::os::unix::net::UnixStream::connect(&ready).is_ok(),
    );
    let Some(hook) = InstalledHook::install(&control, &dir.path().join("marks")) else {
        panic!("cannot install a hook in /etc/libvirt/hooks/qemu.d (root needed)")
    };
    let Some(_daemons) = start_libvirt(&hook.0) else { return };

    // The VM wrote, and its QEMU was killed: its overlay waits, in grace.
    let vm = format!("lv-{}", std::process::id());
    let uri: NbdUri = format!("nbd+unix:///@{vm}?socket={}", socket.display()).parse().expect("uri");
    let mut client = Client::connect(&uri).expect("the VM connects");
    client.write(0, &[0xab; 65536], false).expect("write");
    drop(client);

    let name = format!("overspill-test-{}", std::process::id());
    let xml = format!(
        "<domain type='qemu'><name>{name}</name><memory unit='MiB'>64</memory><vcpu>1</vcpu>\
         <os><type arch='x86_64' machine='pc'>hvm</type></os><devices>\
         <disk type='network' device='disk'><driver name='qemu' type='raw'/>\
         <source protocol='nbd' name='@{vm}'><host transport='unix' socket='{}'/><reconnect delay='10'/></source>\
         <target dev='vda' bus='virtio'/></disk><serial type='pty'/></devices></domain>",
        socket.display()
    );
    let xml_file = dir.path().join("domain.xml");
    std::fs::write(&xml_file, xml).expect("domain XML");
    let defined = virsh(&["define", xml_file.to_str().expect("utf-8")]);
    assert!(defined.status.success(), "virsh define: {}", String::from_utf8_lossy(&defined.stderr));
    let _domain = Domain(name.clone());

    // A start: the hook resets the VM before QEMU connects.
    let started = virsh(&["start", &name]);
    assert!(started.status.success(), "virsh start: {}", String::from_utf8_lossy(&started.stderr));
    let log = server.log_text();
    let dropped = log.find(&format!("VM overlay dropped by the operator vm=\"{vm}\""));
    let dropped = dropped.or_else(|| log.find("VM overlay dropped by the operator"));
    assert!(dropped.is_some(), "the start did not reset the VM:\n{log}");

    // A save ends QEMU, and its disk's connection with NBD_CMD_DISC: the overlay is gone, and the
    // hook refuses the restore, naming the VM, rather than run the saved guest on golden data.
    let saved = dir.path().join("saved.img");
    let save = virsh(&["save", &name, saved.to_str().expect("utf-8")]);
    assert!(save.status.success(), "virsh save: {}", String::from_utf8_lossy(&save.stderr));
    let restore = virsh(&["restore", saved.to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&restore.stderr);
    assert!(!restore.status.success(), "the restore went through:\n{said}");
    assert!(said.contains("cannot be restored") && said.contains(&vm), "{said}");
    let state = virsh(&["domstate", &name]);
    assert_eq!(String::from_utf8_lossy(&state.stdout).trim(), "shut off");
    drop(server);
}
