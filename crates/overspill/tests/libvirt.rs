//! `overspill libvirt-hook` under a real libvirtd (started here: `virtlogd -d`, `libvirtd -d`;
//! systemd is not the init on these machines), with a real QEMU (TCG) domain whose disk is a
//! named VM of a real `overspill serve`: a start resets the VM's overlay; `virsh restore` of a
//! domain whose overlay went with its save is refused by the hook, naming the VM, and the domain
//! stays off; a live migration to a second libvirtd is aborted by the destination's hook; and a
//! guest that reboots under `<on_reboot>destroy</on_reboot>` is started again by
//! `overspill libvirt-reboots`, each boot on the golden image. Needs root (libvirt's system
//! instance); under `CI=true` it must run.

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
    /// The hook, running the overspill binary at `binary`.
    fn install(binary: &Path, control: &Path) -> Option<Self> {
        let dir = Path::new("/etc/libvirt/hooks/qemu.d");
        std::fs::create_dir_all(dir).ok()?;
        let path = dir.join(format!("overspill-test-{}", std::process::id()));
        let script = format!(
            "#!/bin/sh\nexec {} libvirt-hook --control {} --wait 5s -- \"$@\"\n",
            binary.display(),
            control.display()
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

/// One libvirtd at a time: each test starts its own (it reads its hooks when it starts).
static ONE_LIBVIRTD: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_libvirtd() -> std::sync::MutexGuard<'static, ()> {
    ONE_LIBVIRTD.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A host for one test: an `overspill serve` (named VMs only) whose socket libvirt's QEMU can
/// reach, the hook installed for it, and libvirt's daemons started after it. Fields drop in
/// order: the daemons stop before the hook goes and the server ends.
struct LibvirtHost {
    daemons: Daemons,
    _hook: InstalledHook,
    server: Serve,
    socket: PathBuf,
    control: PathBuf,
    dir: TempDir,
    _one: std::sync::MutexGuard<'static, ()>,
}

impl LibvirtHost {
    /// `None` (the test is skipped) where libvirt cannot run, unless `CI=true`. `golden` makes
    /// the golden image in the given directory; the hook runs `hook_binary` if given (the
    /// test's binary otherwise).
    fn start(golden: impl FnOnce(&Path) -> PathBuf, hook_binary: Option<PathBuf>) -> Option<Self> {
        Self::start_with(golden, hook_binary, &[])
    }

    /// [`Self::start`] with more flags for the server.
    fn start_with(golden: impl FnOnce(&Path) -> PathBuf, hook_binary: Option<PathBuf>, more: &[&str]) -> Option<Self> {
        let one = one_libvirtd();
        if !Path::new("/usr/sbin/libvirtd").exists() && std::env::var("CI").map_or(true, |ci| ci != "true") {
            eprintln!("skipped: libvirtd is not installed");
            return None;
        }
        let dir = TempDir::new().expect("tempdir");
        // QEMU runs as libvirt-qemu: it must reach the server's socket.
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
        let golden = golden(dir.path());
        let socket = dir.path().join("nbd.sock");
        let control = dir.path().join("control.sock");
        let listen = format!("unix:{}", socket.display());
        let ready = socket.clone();
        let args = [
            "--base",
            golden.to_str().expect("utf-8"),
            "--listen",
            &listen,
            "--socket-mode",
            "666",
            "--control",
            control.to_str().expect("utf-8"),
        ];
        let args = [&args[..], more].concat();
        let server = Serve::start_named_only(dir.path(), &args, &[], move || {
            std::os::unix::net::UnixStream::connect(&ready).is_ok()
        });
        let binary = hook_binary.unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_overspill")));
        let Some(hook) = InstalledHook::install(&binary, &control) else {
            panic!("cannot install a hook in /etc/libvirt/hooks/qemu.d (root needed)")
        };
        let daemons = start_libvirt(&hook.0)?;
        Some(Self { daemons, _hook: hook, server, socket, control, dir, _one: one })
    }

    /// Defines (`define`) or starts (`create`) a domain from `xml`, undefined when dropped.
    fn domain(&self, name: &str, how: &str, xml: &str) -> Domain {
        let file = self.dir.path().join(format!("{name}.xml"));
        std::fs::write(&file, xml).expect("domain XML");
        let done = virsh(&[how, file.to_str().expect("utf-8")]);
        assert!(done.status.success(), "virsh {how}: {}", String::from_utf8_lossy(&done.stderr));
        Domain(name.to_owned())
    }
}

fn sparse_golden(dir: &Path) -> PathBuf {
    let golden = dir.join("golden.img");
    std::fs::File::create(&golden).and_then(|f| f.set_len(16 << 20)).expect("golden image");
    golden
}

/// A disk of `socket`'s VM `vm` in a domain's XML.
fn overspill_disk(vm: &str, socket: &Path) -> String {
    format!(
        "<disk type='network' device='disk'><driver name='qemu' type='raw' cache='none'/>\
         <source protocol='nbd' name='@{vm}'><host transport='unix' socket='{}'/></source>\
         <target dev='vda' bus='virtio'/></disk>",
        socket.display()
    )
}

/// A domain with no OS of its own: its firmware finds nothing to boot and waits, which is all a
/// start, a save or a migration needs.
fn idle_domain(name: &str, vm: &str, socket: &Path) -> String {
    format!(
        "<domain type='qemu'><name>{name}</name><memory unit='MiB'>64</memory><vcpu>1</vcpu>\
         <os><type arch='x86_64' machine='pc'>hvm</type></os><devices>{}</devices></domain>",
        overspill_disk(vm, socket)
    )
}

#[test]
fn libvirt_starts_a_domain_on_a_reset_overlay_and_refuses_its_restore_once_the_overlay_is_gone() {
    let Some(host) = LibvirtHost::start(sparse_golden, None) else { return };
    // The VM wrote, and its QEMU was killed: its overlay waits, in grace.
    let vm = format!("lv-{}", std::process::id());
    let uri: NbdUri = format!("nbd+unix:///@{vm}?socket={}", host.socket.display()).parse().expect("uri");
    let mut client = Client::connect(&uri).expect("the VM connects");
    client.write(0, &[0xab; 65536], false).expect("write");
    drop(client);

    let name = format!("overspill-test-{}", std::process::id());
    let _domain = host.domain(&name, "define", &idle_domain(&name, &vm, &host.socket));
    // A start: the hook resets the VM before QEMU connects.
    let started = virsh(&["start", &name]);
    assert!(started.status.success(), "virsh start: {}", String::from_utf8_lossy(&started.stderr));
    let log = host.server.log_text();
    let reset = log.lines().any(|l| l.contains("VM overlay dropped by the operator") && l.contains(&vm));
    assert!(reset, "the start did not reset the VM:\n{log}");

    // A save ends QEMU, and its disk's connection with NBD_CMD_DISC: the overlay is gone, and the
    // hook refuses the restore, naming the VM, rather than run the saved guest on golden data.
    let saved = host.dir.path().join("saved.img");
    let save = virsh(&["save", &name, saved.to_str().expect("utf-8")]);
    assert!(save.status.success(), "virsh save: {}", String::from_utf8_lossy(&save.stderr));
    let restore = virsh(&["restore", saved.to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&restore.stderr);
    assert!(!restore.status.success(), "the restore went through:\n{said}");
    assert!(said.contains("cannot be restored") && said.contains(&vm), "{said}");
    let state = virsh(&["domstate", &name]);
    assert_eq!(String::from_utf8_lossy(&state.stdout).trim(), "shut off");
}

/// `<on_reboot>destroy</on_reboot>` plus `overspill libvirt-reboots`: a guest that reboots from
/// inside ends its QEMU (its overlay with it), the watcher starts the domain again, and every
/// boot finds the golden image, not the marker the boot before it left.
#[test]
fn under_libvirt_a_rebooted_guest_is_started_again_on_the_golden_image() {
    let golden = |dir: &Path| overspill::guests::ext4_image(dir, 16, &[("version.txt", b"v1\n")]).expect("golden");
    let Some(host) = LibvirtHost::start(golden, None) else { return };
    let kit = overspill::guests::GuestKit::build(&host.dir.path().join("kit"), common::REBOOTING_JOB).expect("kit");
    let name = format!("overspill-reboot-{}", std::process::id());
    let console = host.dir.path().join("console.log");
    let xml = format!(
        "<domain type='qemu'><name>{name}</name><memory unit='MiB'>256</memory><vcpu>1</vcpu>\
         <os><type arch='x86_64' machine='pc'>hvm</type><kernel>{}</kernel><initrd>{}</initrd>\
         <cmdline>console=ttyS0 panic=-1 quiet no_timer_check</cmdline></os>\
         <features><acpi/></features><on_reboot>destroy</on_reboot><devices>{}\
         <serial type='file'><source path='{}' append='on'/></serial></devices></domain>",
        kit.kernel.display(),
        kit.initrd.display(),
        overspill_disk(&name, &host.socket),
        console.display()
    );
    let _domain = host.domain(&name, "define", &xml);
    // Stopped before the domain is destroyed (dropped in the reverse order).
    let watcher_log = host.dir.path().join("watcher.log");
    let _watcher = Daemons(vec![Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["libvirt-reboots", "--connect", URI])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&watcher_log).expect("watcher log"))
        .spawn()
        .expect("overspill libvirt-reboots")]);
    // virsh subscribes right after it starts.
    std::thread::sleep(Duration::from_secs(2));
    let started = virsh(&["start", &name]);
    assert!(started.status.success(), "virsh start: {}", String::from_utf8_lossy(&started.stderr));

    // Three boots: the first two rebooted, each started again by the watcher.
    let deadline = Instant::now() + Duration::from_secs(300);
    let text = loop {
        let text = std::fs::read_to_string(&console).unwrap_or_default();
        if text.matches("REBOOTING").count() >= 2 && text.matches("NO MARKER").count() >= 3 {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "not three fresh boots:\n{text}\n--- watcher ---\n{}\n--- server ---\n{}",
            std::fs::read_to_string(&watcher_log).unwrap_or_default(),
            host.server.log_text()
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    assert!(!text.contains("MARKER FOUND"), "a boot saw the boot before it:\n{text}");
    let watched = std::fs::read_to_string(&watcher_log).unwrap_or_default();
    assert!(watched.contains("domain started again"), "{watched}");
}

/// A live migration to another host is refused by the hook on the destination, and the guest
/// runs on at the source with its overlay. The other host is a second libvirtd on this machine:
/// a session daemon as `nobody`, its host UUID set apart (libvirt refuses a migration to the host
/// it comes from), with its directories in the test's.
#[test]
fn a_live_migration_is_aborted_by_the_destinations_hook_and_the_guest_runs_on() {
    // The destination's hook runs as nobody: the binary where nobody can run it.
    let staging = TempDir::new().expect("tempdir");
    std::fs::set_permissions(staging.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let binary = staging.path().join("overspill");
    std::fs::copy(env!("CARGO_BIN_EXE_overspill"), &binary).expect("copying the binary");
    let Some(mut host) = LibvirtHost::start(sparse_golden, Some(binary)) else { return };

    // The other host: nobody's session libvirtd, with a host UUID of its own.
    let other = host.dir.path().join("other");
    let (config, runtime) = (other.join("config"), other.join("runtime"));
    std::fs::create_dir_all(config.join("libvirt")).expect("config dir");
    std::fs::create_dir_all(&runtime).expect("runtime dir");
    std::fs::write(config.join("libvirt/libvirtd.conf"), "host_uuid = \"0f5e1d6c-2b1a-4c3d-8e9f-0a1b2c3d4e5f\"\n")
        .expect("libvirtd.conf");
    let chown = Command::new("chown").args(["-R", "nobody:nogroup"]).arg(&other).status().expect("chown");
    assert!(chown.success());
    let other_log = host.dir.path().join("other.log");
    host.daemons.0.push(
        Command::new("setpriv")
            .args(["--reuid", "nobody", "--regid", "nogroup", "--clear-groups", "/usr/sbin/libvirtd"])
            .env("HOME", &other)
            .env("XDG_CONFIG_HOME", &config)
            .env("XDG_RUNTIME_DIR", &runtime)
            .env("XDG_CACHE_HOME", other.join("cache"))
            .env("XDG_DATA_HOME", other.join("data"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&other_log).expect("log"))
            .spawn()
            .expect("a session libvirtd as nobody"),
    );
    let other_socket = runtime.join("libvirt/libvirt-sock");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !other_socket.exists() {
        let log = std::fs::read_to_string(&other_log).unwrap_or_default();
        assert!(Instant::now() < deadline, "the second libvirtd did not start:\n{log}");
        std::thread::sleep(Duration::from_millis(200));
    }

    let vm = format!("mig-{}", std::process::id());
    let name = format!("overspill-migrate-{}", std::process::id());
    let _domain = host.domain(&name, "create", &idle_domain(&name, &vm, &host.socket));
    let destination = format!("qemu+unix:///session?socket={}", other_socket.display());
    let migrated = virsh(&["migrate", "--live", &name, &destination]);
    let said = String::from_utf8_lossy(&migrated.stderr);
    assert!(!migrated.status.success(), "the migration went through:\n{said}");
    assert!(said.contains("cannot be migrated") && said.contains(&vm), "{said}");
    let state = virsh(&["domstate", &name]);
    assert_eq!(String::from_utf8_lossy(&state.stdout).trim(), "running", "the guest runs on at the source");
    let listed = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["vm", "--control", host.control.to_str().expect("utf-8"), "list"])
        .output()
        .expect("vm list");
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.lines().any(|l| l.contains(&vm) && l.contains("connected")), "{listed}");
}

/// The docs' vhost-user recipe under libvirt: a domain with its memory shared (memfd) and a
/// `<disk type='vhostuser'>` on a socket in the server's vhost-user directory boots a guest
/// that writes a file and reads it back past its page cache. No flag declares the VM: the hook
/// makes its socket at the start (`vm add`), and resets the VM, as for NBD disks (the guest
/// finds the golden filesystem, not what an earlier session wrote over it); the guest's
/// power-off ends the VM (QEMU stops the device, then closes the socket).
#[test]
fn libvirt_runs_a_guest_on_a_vhost_user_disk() {
    let golden = |dir: &Path| overspill::guests::ext4_image(dir, 16, &[("golden.txt", b"golden\n")]).expect("golden");
    let vm = format!("lvu-{}", std::process::id());
    // A directory QEMU (libvirt-qemu) can pass through, unlike the server's state directory.
    let vhost_dir = std::env::temp_dir().join(format!("overspill-vhost-{}", std::process::id()));
    let more = ["--vhost-user-dir", vhost_dir.to_str().expect("utf-8")];
    let Some(host) = LibvirtHost::start_with(golden, None, &more) else { return };
    // The VM wrote over its filesystem's superblock (over NBD, the same VM) and its client was
    // killed: its overlay waits, in grace. Only the hook's reset at the start lets the guest
    // mount the golden filesystem.
    let uri: NbdUri = format!("nbd+unix:///@{vm}?socket={}", host.socket.display()).parse().expect("uri");
    let mut client = Client::connect(&uri).expect("the VM connects");
    client.write(0, &[0xab; 65536], false).expect("write");
    drop(client);
    let job = "mount /dev/vda /mnt || exit 1\n\
               grep -q golden /mnt/golden.txt || { echo GOLDEN WRONG; exit 1; }\n\
               echo written-over-vhost-user > /mnt/note.txt && sync && umount /mnt || exit 1\n\
               echo 3 > /proc/sys/vm/drop_caches\n\
               mount /dev/vda /mnt && grep -q written-over-vhost-user /mnt/note.txt && echo NOTE READ BACK\n";
    let kit = overspill::guests::GuestKit::build(&host.dir.path().join("kit"), job).expect("kit");
    let socket = vhost_dir.join(format!("{vm}.sock"));
    let name = format!("overspill-vhost-{}", std::process::id());
    let console = host.dir.path().join("console.log");
    let xml = format!(
        "<domain type='qemu'><name>{name}</name><memory unit='MiB'>256</memory><vcpu>1</vcpu>\
         <memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking>\
         <os><type arch='x86_64' machine='pc'>hvm</type><kernel>{}</kernel><initrd>{}</initrd>\
         <cmdline>console=ttyS0 panic=-1 quiet no_timer_check</cmdline></os>\
         <features><acpi/></features><on_poweroff>destroy</on_poweroff><devices>\
         <disk type='vhostuser' device='disk'><driver name='qemu' type='raw'/>\
         <source type='unix' path='{}'><reconnect enabled='yes' timeout='1'/></source>\
         <target dev='vda' bus='virtio'/></disk>\
         <serial type='file'><source path='{}' append='on'/></serial></devices></domain>",
        kit.kernel.display(),
        kit.initrd.display(),
        socket.display(),
        console.display()
    );
    let _domain = host.domain(&name, "define", &xml);
    let started = virsh(&["start", &name]);
    assert!(started.status.success(), "virsh start: {}", String::from_utf8_lossy(&started.stderr));
    let deadline = Instant::now() + Duration::from_secs(300);
    let text = loop {
        let text = std::fs::read_to_string(&console).unwrap_or_default();
        if text.contains("JOB EXIT") {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the guest did not finish:\n{text}\n--- server ---\n{}",
            host.server.log_text()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(text.contains("NOTE READ BACK") && text.contains("JOB EXIT 0"), "{text}");
    let log = host.server.log_text();
    assert!(log.lines().any(|l| l.contains("vhost-user connection opened") && l.contains(&vm)), "{log}");
    let reset = log.lines().any(|l| l.contains("VM overlay dropped by the operator") && l.contains(&vm));
    assert!(reset, "the start did not reset the VM:\n{log}");
    let declared = log.lines().any(|l| l.contains("vhost-user VM declared") && l.contains(&vm));
    assert!(declared, "the hook did not declare the VM:\n{log}");
    // Powered off: QEMU stops the device before it closes the socket, a deliberate end.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !host.server.log_text().contains("vhost-user connection closed") {
        assert!(Instant::now() < deadline, "the connection did not close:\n{}", host.server.log_text());
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = host.server.log_text();
    let (_, since_vhost) = log.split_once("vhost-user connection opened").expect("opened");
    assert!(!since_vhost.contains("without a deliberate end"), "the power-off was taken for a lost connection:\n{log}");
    assert!(since_vhost.contains("its cache is dropped"), "{log}");
    drop(host);
    let _ = std::fs::remove_dir(&vhost_dir);
}
