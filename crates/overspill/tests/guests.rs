//! Real QEMU guests (Debian's cloud kernel and a busybox initramfs, under TCG, from
//! `overspill::guests`) whose disk is an NBD export of `overspill serve`: what a VM sees, not
//! what a client library sees.

use std::path::Path;
use std::time::Duration;

use tempfile::TempDir;

mod common;
use common::{metrics_url, sample, scrape, Serve};
use overspill::guests::{
    check_sums_job, checksummed_writes_job, ext4_image, vhost_user_disk, BootOptions, Extras, Guest, GuestKit,
};

const FILES: u32 = 24;

fn writer_job() -> String {
    checksummed_writes_job(FILES, "0.3")
}

fn serve(dir: &Path, golden: &Path, socket: &Path) -> Serve {
    serve_with(dir, golden, socket, &[])
}

fn serve_with(dir: &Path, golden: &Path, socket: &Path, more: &[&str]) -> Serve {
    let listen = format!("unix:{}", socket.display());
    // A 4 MiB RAM target: most of the 24 MiB the guest writes is spilled.
    let args = [&["--base", golden.to_str().expect("utf-8"), "--listen", &listen, "--ram", "4M"], more].concat();
    let socket = socket.to_path_buf();
    // A killed server leaves its socket file: ready is when a connection is accepted.
    Serve::start(dir, &args, &[], move || std::os::unix::net::UnixStream::connect(&socket).is_ok())
}

/// A server that serves VM `vm` over vhost-user too, its socket in `dir/vhost`; ready once that
/// socket accepts.
fn serve_vhost(dir: &Path, golden: &Path, vm: &str, more: &[&str]) -> Serve {
    let vhost_dir = dir.join("vhost");
    let vhost_socket = vhost_dir.join(format!("{vm}.sock"));
    let listen = format!("unix:{}", dir.join("nbd.sock").display());
    let args = [
        &["--base", golden.to_str().expect("utf-8"), "--listen", &listen],
        &["--vhost-user", vm, "--vhost-user-dir", vhost_dir.to_str().expect("utf-8")],
        more,
    ]
    .concat();
    Serve::start(dir, &args, &[], move || std::os::unix::net::UnixStream::connect(&vhost_socket).is_ok())
}

fn boot_vhost(kit: &GuestKit, dir: &Path, vm: &str) -> Guest {
    let options = BootOptions::default();
    let disk = vhost_user_disk(&dir.join("vhost").join(format!("{vm}.sock")), options.memory_mib);
    Guest::start(kit, dir, &disk, options).expect("guest")
}

/// The issue's "done when": a guest writing files with checksums rides through a SIGKILL and
/// restart of the server, then through a planned restart (SIGTERM, start), and every checksum
/// holds when it reads its files back from the disk. QEMU's NBD client reconnects by itself
/// (`reconnect-delay`); the guest sees a stall, no error.
#[test]
fn a_guest_writing_files_rides_through_a_killed_and_a_stopped_server() {
    let dir = TempDir::new().expect("tempdir");
    let golden = ext4_image(dir.path(), 64, &[("golden.txt", b"golden file\n")]).expect("golden image");
    let golden_before = std::fs::read(&golden).expect("golden image");
    let kit = GuestKit::build(dir.path(), &writer_job()).expect("guest kit");
    let socket = dir.path().join("nbd.sock");
    let server = serve(dir.path(), &golden, &socket);
    let mut guest = Guest::boot(&kit, dir.path(), &socket, "@writer", 60).expect("guest");

    guest.wait_for("WROTE 6\n", Duration::from_secs(180)).expect("WROTE 6");
    server.kill();
    let mut server = serve(dir.path(), &golden, &socket);
    server.wait_log("VM overlay recovered from the previous server");

    guest.wait_for("WROTE 14\n", Duration::from_secs(180)).expect("WROTE 14");
    server.stop();
    let server = serve(dir.path(), &golden, &socket);
    server.wait_log("VM overlay recovered from the previous server");

    let console = guest.wait_exit(Duration::from_secs(300)).expect("guest powers off");
    assert!(console.contains(&format!("CHECKSUMS OK {FILES}")), "checksums after two restarts:\n{console}");
    assert!(console.contains("JOB EXIT 0"), "{console}");
    assert!(std::fs::read(&golden).expect("golden image") == golden_before, "the golden image was written");
    drop(server);
}

/// Mounts `device` (set up by `setup`), writes 8 files to keep and 8 to delete (1 MiB of random
/// bytes each), pauses at "WRITTEN" for the test to read the server's counters, deletes the 8,
/// runs `fstrim`, pauses at "TRIMMED", then reads the kept files back past the page cache and
/// checks their checksums, and runs `teardown`.
fn trim_job(device: &str, setup: &str, teardown: &str) -> String {
    format!(
        r#"{setup}
mount {device} /mnt || exit 1
grep -q "golden file" /mnt/golden.txt || {{ echo "GOLDEN FILE WRONG"; exit 1; }}
for i in 1 2 3 4 5 6 7 8; do
  dd if=/dev/urandom of=/mnt/keep$i bs=64k count=16 2>/dev/null
  dd if=/dev/urandom of=/mnt/temp$i bs=64k count=16 2>/dev/null
done
(cd /mnt && sha256sum keep* > sums)
sync
echo WRITTEN
sleep 5
rm /mnt/temp*
sync
fstrim -v /mnt || echo "FSTRIM FAILED"
sync
echo TRIMMED
sleep 5
{check}{teardown}
"#,
        check = check_sums_job(device)
    )
}

/// A VM's figure from the server's metrics.
fn vm_figure(url: &str, family: &str, vm: &str, labels: &[(&str, &str)]) -> f64 {
    let mut wanted = vec![("vm", vm)];
    wanted.extend_from_slice(labels);
    sample(&scrape(url), family, &wanted)
}

/// Follows a guest running [`trim_job`] for VM `vm`: TRIM must reach the server and give the
/// deleted files' RAM back, the kept files must read back whole, and the VM's overlay must be gone
/// once the guest has ended (its client disconnected cleanly).
fn check_trim_run(server: &mut Serve, mut guest: Guest, vm: &str, dir: &Path) {
    let url = metrics_url(server);
    let memory = "overspill_vm_cache_memory_used_bytes";
    let trims = "overspill_vm_guest_requests_total";
    guest.wait_for("WRITTEN\n", Duration::from_secs(300)).expect("WRITTEN");
    let used_written = vm_figure(&url, memory, vm, &[]);
    let trims_written = vm_figure(&url, trims, vm, &[("op", "trim")]);
    assert!(used_written >= 16.0 * 1048576.0, "16 MiB written, {used_written} bytes of cache memory used");
    guest.wait_for("TRIMMED\n", Duration::from_secs(300)).expect("TRIMMED");
    let used_trimmed = vm_figure(&url, memory, vm, &[]);
    let trims_trimmed = vm_figure(&url, trims, vm, &[("op", "trim")]);
    let console = guest.console_text();
    assert!(!console.contains("FSTRIM FAILED"), "fstrim failed in the guest:\n{console}");
    assert!(trims_trimmed > trims_written, "no TRIM reached the server ({trims_written} then {trims_trimmed})");
    assert!(
        used_trimmed <= used_written - 7.0 * 1048576.0,
        "8 MiB deleted and trimmed gave back too little RAM: {used_written} then {used_trimmed} bytes"
    );
    let console = guest.wait_exit(Duration::from_secs(300)).expect("guest powers off");
    assert!(console.contains("CHECKSUMS OK 8"), "the kept files after TRIM:\n{console}");
    assert!(console.contains("JOB EXIT 0"), "{console}");
    // The clean end drops the overlay: its series leave the metrics, its files the disk.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let gone = !scrape(&url)
            .keys()
            .any(|(name, labels)| name == memory && labels.get("vm").map(String::as_str) == Some(vm));
        let files: Vec<_> = ["memory", "spill"]
            .iter()
            .flat_map(|sub| std::fs::read_dir(dir.join(sub)).into_iter().flatten().flatten())
            .map(|entry| entry.path())
            // The server's own ledger and control socket stay.
            .filter(|path| !path.ends_with("spill/state"))
            .collect();
        if gone && files.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "VM {vm} still has an overlay: metrics gone {gone}, files {files:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    server.assert_running();
}

/// The smoke test of a real host: a guest on a virtio disk (QEMU's NBD client, `discard=unmap`)
/// writes, deletes, TRIMs and reads back; TRIM reaches the server and gives RAM back, and the
/// overlay goes when the guest powers off.
#[test]
fn a_guest_trims_and_the_server_gives_its_ram_back() {
    let dir = TempDir::new().expect("tempdir");
    let golden = ext4_image(dir.path(), 64, &[("golden.txt", b"golden file\n")]).expect("golden image");
    let golden_before = std::fs::read(&golden).expect("golden image");
    let kit = GuestKit::build(dir.path(), &trim_job("/dev/vda", "", "")).expect("guest kit");
    let socket = dir.path().join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let args = ["--base", golden.to_str().expect("utf-8"), "--listen", &listen, "--ram", "64M"];
    let ready = || std::os::unix::net::UnixStream::connect(&socket).is_ok();
    let mut server = Serve::start(dir.path(), &[&args[..], &["--metrics", "tcp:127.0.0.1:0"]].concat(), &[], ready);
    let guest = Guest::boot(&kit, dir.path(), &socket, "@trimmer", 0).expect("guest");
    check_trim_run(&mut server, guest, "trimmer", dir.path());
    assert!(std::fs::read(&golden).expect("golden image") == golden_before, "the golden image was written");
}

/// The smoke test over vhost-user-blk: QEMU reads and writes the guest's memory through the
/// server's socket, TRIM (virtio discard) reaches the overlay and gives RAM back, and the
/// overlay goes when the guest powers off (QEMU stops the device before it closes the socket:
/// a deliberate end, as NBD_CMD_DISC is).
#[test]
fn a_guest_on_vhost_user_trims_and_the_server_gives_its_ram_back() {
    let dir = TempDir::new().expect("tempdir");
    let golden = ext4_image(dir.path(), 64, &[("golden.txt", b"golden file\n")]).expect("golden image");
    let golden_before = std::fs::read(&golden).expect("golden image");
    let kit = GuestKit::build(dir.path(), &trim_job("/dev/vda", "", "")).expect("guest kit");
    let mut server = serve_vhost(dir.path(), &golden, "vtrim", &["--ram", "64M", "--metrics", "tcp:127.0.0.1:0"]);
    let guest = boot_vhost(&kit, dir.path(), "vtrim");
    check_trim_run(&mut server, guest, "vtrim", dir.path());
    let log = server.log_text();
    assert!(log.contains("vhost-user connection opened"), "{log}");
    assert!(!log.contains("without a deliberate end"), "powering off was taken for a lost connection:\n{log}");
    assert!(std::fs::read(&golden).expect("golden image") == golden_before, "the golden image was written");
}

/// Continuity over vhost-user: the guest writing files with checksums rides through a SIGKILL,
/// a SIGTERM and a SIGHUP (restart in place) of the server. QEMU (`reconnect-ms`) reconnects to the next server and sends
/// again every request it had not had back; the next server rebuilt the VM from what the last
/// one left, so every checksum holds.
#[test]
fn a_guest_on_vhost_user_rides_through_a_killed_a_stopped_and_a_restarted_server() {
    let dir = TempDir::new().expect("tempdir");
    let golden = ext4_image(dir.path(), 64, &[("golden.txt", b"golden file\n")]).expect("golden image");
    let kit = GuestKit::build(dir.path(), &writer_job()).expect("guest kit");
    let ram = ["--ram", "4M"];
    let server = serve_vhost(dir.path(), &golden, "vwriter", &ram);
    let mut guest = boot_vhost(&kit, dir.path(), "vwriter");

    guest.wait_for("WROTE 6\n", Duration::from_secs(180)).expect("WROTE 6");
    // One frontend at a time: the VM's name is refused to an NBD client meanwhile.
    let uri = format!("nbd+unix:///@vwriter?socket={}", dir.path().join("nbd.sock").display());
    let nbdinfo = std::process::Command::new("nbdinfo").arg(&uri).output().expect("nbdinfo");
    assert!(!nbdinfo.status.success(), "an NBD client got a VM served over vhost-user");
    server.wait_log("VM refused: VM vwriter is already connected");
    server.kill();
    let mut server = serve_vhost(dir.path(), &golden, "vwriter", &ram);
    server.wait_log("VM overlay recovered from the previous server");

    guest.wait_for("WROTE 14\n", Duration::from_secs(180)).expect("WROTE 14");
    server.stop();
    let server = serve_vhost(dir.path(), &golden, "vwriter", &ram);
    server.wait_log("VM overlay recovered from the previous server");

    // SIGHUP: the server drains and starts again in the same process (an upgrade).
    guest.wait_for("WROTE 18\n", Duration::from_secs(180)).expect("WROTE 18");
    let pid = server.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-HUP", &pid]).status().expect("kill").success());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while server.log_text().matches("vhost-user sockets up").count() < 2 {
        assert!(std::time::Instant::now() < deadline, "no restart in place:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = server.log_text();
    assert_eq!(
        log.matches("VM overlay recovered from the previous server").count(),
        2,
        "not handed over at SIGHUP:\n{log}"
    );

    let console = guest.wait_exit(Duration::from_secs(300)).expect("guest powers off");
    assert!(console.contains(&format!("CHECKSUMS OK {FILES}")), "checksums after two restarts:\n{console}");
    assert!(console.contains("JOB EXIT 0"), "{console}");
    drop(server);
}

/// The same with the Linux kernel's own NBD client: `nbd-client` (Debian's, with the `nbd.ko` of
/// the guest's kernel) connects from inside the guest over QEMU's user network to the server's
/// TCP port with two connections (`-C 2`, a queue each, one overlay under them as `serve
/// --multi-conn` allows), and `nbd-client -d` ends them cleanly.
#[test]
fn the_kernel_nbd_client_in_a_guest_writes_trims_and_reads_back() {
    let dir = TempDir::new().expect("tempdir");
    let golden = ext4_image(dir.path(), 64, &[("golden.txt", b"golden file\n")]).expect("golden image");
    let golden_before = std::fs::read(&golden).expect("golden image");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let setup = format!(
        "ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 || exit 1\n\
         nbd-client 10.0.2.2 {port} /dev/nbd0 -N @kernel -b 4096 -C 2 || exit 1"
    );
    let job = trim_job("/dev/nbd0", &setup, "nbd-client -d /dev/nbd0");
    let extras =
        Extras { modules: &["nbd", "virtio_net"], programs: &[("/usr/sbin/nbd-client", "nbd-client")], disk: false };
    let kit = GuestKit::build_with(dir.path(), &job, &extras).expect("guest kit");
    let listen = format!("tcp:127.0.0.1:{port}");
    let args = [
        "--base",
        golden.to_str().expect("utf-8"),
        "--listen",
        &listen,
        "--ram",
        "64M",
        "--metrics",
        "tcp:127.0.0.1:0",
        "--multi-conn",
        "kernel",
    ];
    let ready = || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
    let mut server = Serve::start(dir.path(), &args, &[], ready);
    let guest = Guest::boot_networked(&kit, dir.path()).expect("guest");
    check_trim_run(&mut server, guest, "kernel", dir.path());
    let log = server.log_text();
    assert!(log.contains("VM connection added (multi-conn)"), "the kernel's second connection joined:\n{log}");
    assert!(std::fs::read(&golden).expect("golden image") == golden_before, "the golden image was written");
}

/// Fresh at every boot, the PVS way, under docs/lifecycle.md's recipe: QEMU with `-no-reboot`
/// (the same as `-action reboot=shutdown`) quits when its guest reboots, its NBD connection ends
/// with NBD_CMD_DISC and the overlay with it; started again for the same VM, the guest sees the
/// golden image in the version current now (published while it ran), not its own writes.
#[test]
fn a_guest_rebooted_under_the_recipe_comes_back_on_the_current_golden_image() {
    let dir = TempDir::new().expect("tempdir");
    let (v1_dir, v2_dir) = (dir.path().join("v1"), dir.path().join("v2"));
    let v1 = ext4_image(&v1_dir, 32, &[("version.txt", b"v1\n")]).expect("v1");
    let v2 = ext4_image(&v2_dir, 32, &[("version.txt", b"v2\n")]).expect("v2");
    let store = dir.path().join("images");
    let image = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_overspill"))
            .args(["image", "--images", store.to_str().expect("utf-8")])
            .args(args)
            .output()
            .expect("overspill image");
        assert!(out.status.success(), "image {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    image(&["publish", "desk", v1.to_str().expect("utf-8"), "--activate"]);
    let kit = GuestKit::build(dir.path(), common::REBOOTING_JOB).expect("guest kit");
    let socket = dir.path().join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let ready = socket.clone();
    let server = Serve::start_named_only(
        dir.path(),
        &["--images", store.to_str().expect("utf-8"), "--listen", &listen, "--ram", "4M"],
        &[],
        move || std::os::unix::net::UnixStream::connect(&ready).is_ok(),
    );

    let mut first = Guest::boot(&kit, &dir.path().join("boot1"), &socket, "desk@vm-r", 30).expect("first boot");
    first.wait_for("VERSION v1\n", Duration::from_secs(180)).expect("VERSION v1");
    // The next version, published while the VM runs: it goes on over v1 until it ends.
    image(&["publish", "desk", v2.to_str().expect("utf-8"), "--activate"]);
    let console = first.wait_exit(Duration::from_secs(180)).expect("QEMU quits at the guest's reboot");
    assert!(console.contains("NO MARKER") && console.contains("REBOOTING"), "{console}");
    let ended = std::time::Instant::now() + Duration::from_secs(15);
    while !server.log_text().contains("overlay dropped") && !server.log_text().contains("VM disconnected") {
        assert!(std::time::Instant::now() < ended, "the overlay never ended:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }

    // Whatever started QEMU starts it again (libvirt: on_reboot destroy, then a start).
    let mut second = Guest::boot(&kit, &dir.path().join("boot2"), &socket, "desk@vm-r", 30).expect("second boot");
    let console = second.wait_exit(Duration::from_secs(180)).expect("second boot");
    assert!(console.contains("VERSION v2"), "the second boot runs the current version:\n{console}");
    assert!(console.contains("NO MARKER"), "the second boot saw the first one's writes:\n{console}");
    drop(server);
}

/// Runs in each guest of the stages test: the maintenance VM (`role=install` on its kernel
/// command line) installs a file into the filesystem on its disk and stays up, its disk still;
/// the others say whether they find it.
const STAGES_JOB: &str = r#"mount /dev/vda /mnt || exit 1
if grep -q role=install /proc/cmdline; then
  echo "installed by maint" > /mnt/installed.txt
  sync
  umount /mnt
  sync
  echo INSTALLED
  sleep 600
fi
if [ -e /mnt/installed.txt ]; then echo "FOUND $(cat /mnt/installed.txt)"; else echo "NOT FOUND"; fi
umount /mnt
poweroff -f
"#;

/// An image update the PVS way, with real guests: the maintenance VM installs a file into the
/// filesystem on its disk; its overlay is captured as the next version, given to the test
/// group; a guest of the test group boots that version and finds the file, a production guest
/// boots the current version and does not.
#[test]
fn a_file_a_maintenance_guest_installs_reaches_the_test_group_and_not_production() {
    let dir = TempDir::new().expect("tempdir");
    let v1 = ext4_image(&dir.path().join("v1"), 32, &[("version.txt", b"v1\n")]).expect("v1");
    let store = dir.path().join("images");
    let overspill = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_overspill")).args(args).output().expect("overspill");
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "overspill {args:?}: {said}");
        said
    };
    let images = store.to_str().expect("utf-8");
    overspill(&["image", "--images", images, "publish", "desk", v1.to_str().expect("utf-8"), "--activate"]);
    overspill(&["image", "--images", images, "maintain", "desk", "maint"]);
    let kit = GuestKit::build(dir.path(), STAGES_JOB).expect("guest kit");
    let (socket, control) = (dir.path().join("nbd.sock"), dir.path().join("control.sock"));
    let listen = format!("unix:{}", socket.display());
    let ready = socket.clone();
    let args = ["--images", images, "--listen", &listen, "--control", control.to_str().expect("utf-8")];
    let server = Serve::start_named_only(dir.path(), &[&args[..], &["--test-vms", "lab-*"]].concat(), &[], move || {
        std::os::unix::net::UnixStream::connect(&ready).is_ok()
    });
    let boot = |name: &str, role: &str| {
        let options = BootOptions { append: format!("role={role}"), ..BootOptions::default() };
        let disk = overspill::guests::nbd_disk(&socket, &format!("desk@{name}"), 30);
        Guest::start(&kit, &dir.path().join(name), &disk, options).expect("boot")
    };

    let mut maint = boot("maint", "install");
    maint.wait_for("INSTALLED\n", Duration::from_secs(300)).expect("the maintenance guest installs its file");
    let control = control.to_str().expect("utf-8");
    let said = overspill(&["vm", "capture", "maint", "--control", control]);
    assert!(said.contains("captured as desk v2"), "{said}");
    maint.kill();
    overspill(&["image", "--images", images, "test", "desk", "2"]);

    let mut lab = boot("lab-1", "check");
    let console = lab.wait_exit(Duration::from_secs(300)).expect("the test guest");
    assert!(console.contains("FOUND installed by maint"), "the test group boots v2:\n{console}");
    let mut desk = boot("desk-1", "check");
    let console = desk.wait_exit(Duration::from_secs(300)).expect("the production guest");
    assert!(console.contains("NOT FOUND"), "production boots v1:\n{console}");
    drop(server);
}
