//! `overspill libvirt-hook`, run the way libvirt runs a qemu hook (the domain, the operation,
//! its sub-operation and extra argument; the domain XML on standard input), against a real
//! server: a migration to this host and a restore of a domain whose overlay is gone are refused,
//! every plain start begins from the golden image, and a running domain's reconnect or a
//! domain without overspill disks is left alone.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use overspill_nbd::client::{Client, NbdUri};
use tempfile::TempDir;

mod common;
use common::{pseudo_random, Serve};

const DISK: usize = 8 << 20;

struct Host {
    dir: TempDir,
    golden: Vec<u8>,
    socket: PathBuf,
    _server: Serve,
}

impl Host {
    fn new() -> Self {
        let dir = TempDir::new().expect("tempdir");
        let golden = pseudo_random(DISK, 5);
        let image = dir.path().join("golden.img");
        std::fs::write(&image, &golden).expect("golden image");
        let socket = dir.path().join("nbd.sock");
        let listen = format!("unix:{}", socket.display());
        let control = dir.path().join("control.sock");
        let args = [
            "--base",
            image.to_str().expect("utf-8"),
            "--listen",
            &listen,
            "--control",
            control.to_str().expect("utf-8"),
            "--ram",
            "4M",
        ];
        let ready = socket.clone();
        let server = Serve::start_named_only(dir.path(), &args, &[], move || {
            std::os::unix::net::UnixStream::connect(&ready).is_ok()
        });
        Self { dir, golden, socket, _server: server }
    }

    fn connect(&self, vm: &str) -> Client {
        let uri: NbdUri = format!("nbd+unix:///@{vm}?socket={}", self.socket.display()).parse().expect("uri");
        Client::connect(&uri).unwrap_or_else(|e| panic!("connecting {vm}: {e}"))
    }

    /// A VM that wrote its first 64 KiB and lost its connection (a killed QEMU): in grace.
    fn written_and_in_grace(&self, vm: &str) {
        let mut client = self.connect(vm);
        client.write(0, &[0xab; 65536], false).expect("write");
        drop(client);
        let deadline = Instant::now() + Duration::from_secs(15);
        while !self.vm_list().contains("in-grace") {
            assert!(Instant::now() < deadline, "{vm} never in grace: {}", self.vm_list());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn first_bytes(&self, vm: &str) -> Vec<u8> {
        let mut client = self.connect(vm);
        let mut buf = vec![0; 65536];
        client.read(0, &mut buf).expect("read");
        client.disconnect().expect("disconnect");
        buf
    }

    fn vm_list(&self) -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
            .args(["vm", "--control", self.control().to_str().expect("utf-8"), "list"])
            .output()
            .expect("overspill vm list");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn control(&self) -> PathBuf {
        self.dir.path().join("control.sock")
    }

    /// The hook as docs/libvirt-hook runs it for libvirt: `overspill libvirt-hook [OPTIONS] --
    /// DOMAIN OP SUB EXTRA < XML` (a domain's name may begin with `-`).
    fn hook(&self, domain: &str, operation: &str, sub: &str, xml: &str) -> (bool, String, String) {
        self.hook_with(&[], domain, operation, sub, xml)
    }

    fn hook_with(
        &self,
        options: &[&str],
        domain: &str,
        operation: &str,
        sub: &str,
        xml: &str,
    ) -> (bool, String, String) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_overspill"))
            .arg("libvirt-hook")
            .args(["--control", self.control().to_str().expect("utf-8")])
            .arg("--run-dir")
            .arg(self.dir.path().join("hook"))
            .args(options)
            .args(["--wait", "1s", "--"])
            .args([domain, operation, sub, "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("overspill libvirt-hook");
        child.stdin.take().expect("stdin").write_all(xml.as_bytes()).expect("XML on stdin");
        let out = child.wait_with_output().expect("hook output");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    }
}

/// A domain's XML as libvirt passes it, its disk an overspill VM on `socket`.
fn domain_xml(domain: &str, vm: &str, socket: &Path) -> String {
    format!(
        "<domain type='kvm'><name>{domain}</name><memory unit='KiB'>262144</memory><devices>\
         <disk type='network' device='disk'><driver name='qemu' type='raw'/>\
         <source protocol='nbd' name='@{vm}'><host transport='unix' socket='{}'/><reconnect delay='30'/></source>\
         <target dev='vda' bus='virtio'/></disk></devices></domain>",
        socket.display()
    )
}

#[test]
fn a_migration_to_this_host_is_refused_by_vm_name_and_other_domains_pass() {
    let host = Host::new();
    let xml = domain_xml("desktop-17", "vm-17", &host.socket);
    let (ok, stdout, stderr) = host.hook("desktop-17", "migrate", "begin", &xml);
    assert!(!ok, "the migration was let through: {stderr}");
    assert!(stderr.contains("vm-17") && stderr.contains("desktop-17"), "{stderr}");
    // libvirt takes a migrate hook's standard output for the domain's new XML.
    assert!(stdout.is_empty(), "{stdout}");
    // libvirt allows a name that looks like a flag.
    let xml = domain_xml("-desk", "vm-18", &host.socket);
    let (ok, _, stderr) = host.hook("-desk", "migrate", "begin", &xml);
    assert!(!ok && stderr.contains("vm-18") && stderr.contains("domain -desk"), "{stderr}");

    let plain = "<domain type='kvm'><name>other</name><devices><disk type='file' device='disk'>\
                 <source file='/var/lib/libvirt/images/other.qcow2'/><target dev='vda'/></disk></devices></domain>";
    for operation in ["migrate", "prepare", "restore"] {
        let (ok, stdout, stderr) = host.hook("other", operation, "begin", plain);
        assert!(ok && stdout.is_empty(), "{operation} of a domain without overspill disks: {stderr}");
    }
}

#[test]
fn every_plain_start_begins_from_the_golden_image_and_a_reconnect_keeps_the_overlay() {
    let host = Host::new();
    host.written_and_in_grace("vm-1");
    let xml = domain_xml("desktop-1", "vm-1", &host.socket);
    // libvirtd restarted and found the domain running: nothing happens to its disk.
    for operation in ["reconnect", "attach", "started", "stopped", "release"] {
        let (ok, _, stderr) = host.hook("desktop-1", operation, "begin", &xml);
        assert!(ok, "{operation}: {stderr}");
    }
    assert_eq!(host.first_bytes("vm-1"), [0xab; 65536], "the overlay after reconnect/attach");
    // Nor does input it cannot read fail an operation it does not act on: libvirt kills the
    // domain's QEMU when the hook fails at `reconnect`.
    let unreadable = "<domain><devices><disk type='network'><source protocol='nbd' name='@a&bogus;'/></disk></devices>";
    for operation in ["reconnect", "attach", "started"] {
        let (ok, _, stderr) = host.hook("desktop-1", operation, "begin", unreadable);
        assert!(ok, "{operation} over XML it cannot read: {stderr}");
    }

    host.written_and_in_grace("vm-1");
    let (ok, _, stderr) = host.hook("desktop-1", "prepare", "begin", &xml);
    assert!(ok, "{stderr}");
    assert_eq!(host.first_bytes("vm-1"), host.golden[..65536], "a start after prepare");

    // A VM the server has never seen starts as it is.
    let (ok, _, stderr) = host.hook("new", "prepare", "begin", &domain_xml("new", "vm-new", &host.socket));
    assert!(ok, "a start of a VM the server does not know: {stderr}");
}

/// A restore is refused: the save ended the overlay (QEMU's NBD_CMD_DISC), and an overlay
/// waiting under the VM's name then is another session's, started and killed since the save.
#[test]
fn a_restore_is_refused_whether_or_not_an_overlay_waits_under_the_name() {
    let host = Host::new();
    let xml = domain_xml("desktop-2", "vm-2", &host.socket);
    // virsh save: QEMU quits with NBD_CMD_DISC, and the overlay ends.
    let mut client = host.connect("vm-2");
    client.write(0, &[0xcd; 65536], false).expect("write");
    client.disconnect().expect("disconnect");
    let (ok, stdout, stderr) = host.hook("desktop-2", "restore", "begin", &xml);
    assert!(!ok, "a restore over a dropped overlay was let through: {stderr}");
    assert!(stderr.contains("vm-2") && stderr.contains("managedsave-remove"), "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");

    // A later session of the VM, killed: its overlay waits, and is still not the saved one's.
    host.written_and_in_grace("vm-2");
    let (ok, _, stderr) = host.hook("desktop-2", "restore", "begin", &xml);
    assert!(!ok, "a restore onto another session's overlay was let through: {stderr}");
    assert_eq!(host.first_bytes("vm-2"), [0xab; 65536], "the refused restore left the overlay alone");
}

/// A VM still connected is another QEMU's disk (a second domain naming the same VM): a start
/// is refused rather than take the disk from under that running guest.
#[test]
fn a_start_is_refused_while_the_vm_is_connected() {
    let host = Host::new();
    let mut running = host.connect("vm-3");
    running.write(0, &[0xee; 65536], false).expect("write");
    let (ok, _, stderr) = host.hook("clone", "prepare", "begin", &domain_xml("clone", "vm-3", &host.socket));
    assert!(!ok, "a second domain took a connected VM: {stderr}");
    assert!(stderr.contains("vm-3") && stderr.contains("connected"), "{stderr}");
    let mut buf = vec![0; 65536];
    running.read(0, &mut buf).expect("the running guest goes on");
    assert_eq!(buf, [0xee; 65536]);
    running.disconnect().expect("disconnect");
}

/// At a start, the hook declares each vhost-user VM whose socket is in the server's vhost-user
/// directory (QEMU connects to it as it starts, so it must exist before) and resets it; a
/// vhost-user disk of another backend is left alone. A hook told another directory than the
/// server's refuses the start, naming both paths.
#[test]
fn a_start_makes_a_vhost_user_vms_socket_and_leaves_other_backends_alone() {
    let host = Host::new();
    let ours = host.dir.path().join("spill/state/vhost-user/desk-5.sock");
    let theirs = host.dir.path().join("qsd/disk0.sock");
    let disks = |sockets: &[&Path]| -> String {
        let disks: String = sockets
            .iter()
            .map(|s| {
                format!("<disk type='vhostuser' device='disk'><source type='unix' path='{}'/></disk>", s.display())
            })
            .collect();
        format!("<domain type='kvm'><name>desk</name><devices>{disks}</devices></domain>")
    };
    let xml = disks(&[&ours, &theirs]);
    for start in ["first", "second"] {
        let (ok, _, stderr) = host.hook("desk", "prepare", "begin", &xml);
        assert!(ok, "{start} start: {stderr}");
        assert!(std::os::unix::net::UnixStream::connect(&ours).is_ok(), "no socket after the {start} start");
    }
    let list = host.vm_list();
    assert!(list.lines().any(|l| l.starts_with("desk-5 ") && l.contains("declared")), "{list}");
    assert!(!list.contains("disk0"), "another backend's disk was declared: {list}");

    let qsd = host.dir.path().join("qsd");
    let options = ["--vhost-user-dir", qsd.to_str().expect("utf-8")];
    let (ok, _, stderr) = host.hook_with(&options, "desk", "prepare", "begin", &disks(&[&theirs]));
    assert!(!ok, "a start on a socket the server does not make: {stderr}");
    assert!(stderr.contains(&theirs.display().to_string()) && stderr.contains("spill/state/vhost-user"), "{stderr}");
    assert!(!host.vm_list().contains("disk0"), "the refused start declared a VM: {}", host.vm_list());
}

/// Disks of another NBD server (an export naming `@vm` at another socket) or of another
/// vhost-user backend (a `.sock` elsewhere) are not the hook's: their domains migrate and
/// restore as if it were not installed. The same disk at this server's socket is refused; and
/// with no server to ask, the hook cannot tell and refuses rather than risk golden data.
#[test]
fn other_servers_disks_are_left_alone_unless_the_server_cannot_be_asked() {
    let host = Host::new();
    let elsewhere = domain_xml("elsewhere", "vm-9", &host.dir.path().join("other-nbd.sock"));
    let spdk = "<domain type='kvm'><name>spdk</name><devices><disk type='vhostuser' device='disk'>\
                <source type='unix' path='/var/tmp/spdk/vhost.0.sock'/></disk></devices></domain>";
    for operation in ["migrate", "restore"] {
        for (domain, xml) in [("elsewhere", elsewhere.as_str()), ("spdk", spdk)] {
            let (ok, stdout, stderr) = host.hook(domain, operation, "begin", xml);
            assert!(ok && stdout.is_empty(), "{operation} of {domain}, another server's disk: {stderr}");
        }
    }
    let ours = domain_xml("ours", "vm-9", &host.socket);
    let (ok, _, stderr) = host.hook("ours", "migrate", "begin", &ours);
    assert!(!ok && stderr.contains("vm-9"), "this server's disk: {stderr}");

    let gone = host.dir.path().join("no-server.sock");
    let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["libvirt-hook", "--control", gone.to_str().expect("utf-8"), "--wait", "1s", "--"])
        .args(["elsewhere", "restore", "begin", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            child.stdin.take().expect("stdin").write_all(elsewhere.as_bytes())?;
            child.wait_with_output()
        })
        .expect("overspill libvirt-hook");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("vm-9"), "no server to ask, and let through: {stderr}");
}
