//! The Debian package as an operator gets it: `scripts/build-deb` packs the binary under test,
//! `dpkg -i` installs it into a clean Debian root (debootstrap: the host's release, with
//! systemd), `systemd-analyze verify --root` reads the installed units against that root, the
//! installed binary serves the installed conffile to QEMU's NBD client, and `overspill vm list`
//! finds that server through the conffile. Needs root (debootstrap, chroot, mounts in a private
//! namespace); without it the test says so and passes, except under CI=true.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[track_caller]
fn run(command: &mut Command) -> Output {
    let out = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?}: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A minimal Debian root of the host's release with what the package needs from a host (libssl,
/// systemd's units for verify, procps's kill for ExecReload), made once per target directory and
/// copied for each run, so that every run installs into a root no package of ours touched.
fn clean_root(into: &Path) {
    let release = std::fs::read_to_string("/etc/os-release").expect("/etc/os-release");
    let codename = release
        .lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .expect("VERSION_CODENAME in /etc/os-release")
        .trim_matches('"')
        .to_owned();
    let pristine = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("package-root-{codename}"));
    let complete = pristine.join(".overspill-root-complete");
    if !complete.exists() {
        let _ = std::fs::remove_dir_all(&pristine);
        run(Command::new("debootstrap")
            .args(["--variant=minbase", "--include=libssl3,systemd,procps", &codename])
            .arg(&pristine)
            .arg("http://deb.debian.org/debian"));
        std::fs::write(&complete, "").expect("marker");
    }
    run(Command::new("cp").arg("-a").arg(format!("{}/.", pristine.display())).arg(into));
}

/// A command run inside `root`, with /proc and /sys of its own mounted in a mount namespace that
/// ends with it (nothing to unmount, whatever happens to the test).
fn in_root(root: &Path, program: &str, args: &[&str]) -> Command {
    let mut command = Command::new("unshare");
    command
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"root=$1; shift; mount -t proc proc "$root/proc" && mount -t sysfs sys "$root/sys" && exec chroot "$root" "$@""#)
        .arg("sh")
        .arg(root)
        .arg(program)
        .args(args)
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("DEBIAN_FRONTEND", "noninteractive");
    command
}

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not after {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_package_installs_into_a_clean_root_and_serves() {
    let ci = std::env::var("CI").is_ok_and(|ci| ci == "true");
    if !nix::unistd::Uid::effective().is_root() {
        assert!(!ci, "CI=true and not root: this test must run in CI");
        eprintln!("skipped: installing a package into a debootstrap root needs root");
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("debs");
    run(Command::new(repo().join("scripts/build-deb"))
        .args(["--binary", env!("CARGO_BIN_EXE_overspill"), "--out"])
        .arg(&out));
    let version = format!("{}-1", env!("CARGO_PKG_VERSION"));
    let arch = String::from_utf8(run(Command::new("dpkg").arg("--print-architecture")).stdout).expect("utf-8");
    let deb = |name: &str| out.join(format!("{name}_{version}_{}.deb", arch.trim()));
    let (package, dbgsym) = (deb("overspill"), deb("overspill-dbgsym"));
    let sums = std::fs::read_to_string(out.join("SHA256SUMS")).expect("SHA256SUMS");
    assert!(sums.contains("overspill_") && sums.contains("overspill-dbgsym_"), "{sums}");
    run(Command::new("sha256sum").arg("--check").arg("SHA256SUMS").current_dir(&out));

    // The binary is stripped; its debug information is in the dbgsym package, by build id.
    let listing = text(&run(Command::new("dpkg-deb").arg("--contents").arg(&package)));
    for path in [
        "./usr/bin/overspill",
        "./usr/lib/systemd/system/overspill.service",
        "./usr/lib/systemd/system/overspill.socket",
        "./usr/lib/systemd/system/overspill-libvirt-reboots.service",
        "./etc/overspill/overspill.toml",
        "./etc/libvirt/hooks/qemu.d/overspill",
        "./etc/apparmor.d/abstractions/libvirt-qemu.d/overspill",
        "./usr/share/man/man1/overspill-serve.1.gz",
        "./usr/share/bash-completion/completions/overspill",
        "./usr/share/zsh/vendor-completions/_overspill",
        "./usr/share/fish/vendor_completions.d/overspill.fish",
        "./usr/share/doc/overspill/overspill-alerts.yml",
        "./usr/share/doc/overspill/grafana-dashboard.json",
        "./usr/share/doc/overspill/copyright",
    ] {
        assert!(listing.lines().any(|l| l.ends_with(path)), "{path} missing from the package:\n{listing}");
    }
    let conffiles = text(&run(Command::new("dpkg-deb").args(["--info"]).arg(&package).arg("conffiles")));
    assert!(conffiles.contains("/etc/overspill/overspill.toml"), "{conffiles}");

    let root = tmp.path().join("root");
    std::fs::create_dir(&root).expect("root");
    clean_root(&root);
    std::fs::copy(&package, root.join("tmp/overspill.deb")).expect("copy");
    std::fs::copy(&dbgsym, root.join("tmp/overspill-dbgsym.deb")).expect("copy");
    // No systemd runs in the root: the maintainer scripts must not fail for it.
    run(&mut in_root(&root, "dpkg", &["-i", "/tmp/overspill.deb", "/tmp/overspill-dbgsym.deb"]));

    let installed = root.join("usr/bin/overspill");
    let sections = text(&run(Command::new("readelf").arg("--section-headers").arg(&installed)));
    assert!(!sections.contains(".debug_info"), "the installed binary keeps its debug information");
    let size = std::fs::metadata(&installed).expect("installed binary").len();
    assert!(size < 40 << 20, "the installed binary is {size} bytes: not stripped?");
    let notes = text(&run(Command::new("readelf").arg("--notes").arg(&installed)));
    let build_id = notes.lines().find_map(|l| l.trim().strip_prefix("Build ID: ")).expect("a build id").trim();
    let debug = root.join(format!("usr/lib/debug/.build-id/{}/{}.debug", &build_id[..2], &build_id[2..]));
    let debug_sections = text(&run(Command::new("readelf").arg("--section-headers").arg(&debug)));
    assert!(debug_sections.contains(".debug_info"), "{} holds no debug information", debug.display());

    // The installed units, as systemd reads them from that root.
    let units: Vec<String> = ["overspill.service", "overspill.socket", "overspill-libvirt-reboots.service"]
        .iter()
        .map(|unit| format!("/usr/lib/systemd/system/{unit}"))
        .collect();
    let verify = Command::new("systemd-analyze")
        .arg("verify")
        .arg(format!("--root={}", root.display()))
        .args(&units)
        .output()
        .expect("systemd-analyze");
    assert!(verify.status.success() && text(&verify).trim().is_empty(), "verify:\n{}", text(&verify));

    // The man pages have what clap cannot write.
    let page = text(&run(Command::new("zcat").arg(root.join("usr/share/man/man1/overspill-serve.1.gz"))));
    for section in ["EXAMPLES", "EXIT STATUS", "SIGNALS", "FILES"] {
        assert!(page.contains(&format!(".SH {section}")) || page.contains(&format!(".SH \"{section}\"")), "{section}");
    }

    // The installed binary serves the installed conffile (its golden image at the path the
    // conffile names); only the socket (the socket unit's) and the metrics port differ.
    std::fs::create_dir_all(root.join("srv/golden")).expect("golden dir");
    let golden = vec![0xa5u8; 4 << 20];
    std::fs::write(root.join("srv/golden/current.img"), &golden).expect("golden");
    std::fs::create_dir_all(root.join("run/overspill")).expect("run");
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port();
    let log = std::fs::File::create(tmp.path().join("serve.log")).expect("log");
    let mut server = in_root(
        &root,
        "/usr/bin/overspill",
        &[
            "serve",
            "--config",
            "/etc/overspill/overspill.toml",
            "--listen",
            "unix:/run/overspill.sock",
            "--metrics",
            &format!("tcp:127.0.0.1:{metrics_port}"),
        ],
    )
    .stdin(Stdio::null())
    .stdout(log.try_clone().expect("log"))
    .stderr(log)
    .spawn()
    .expect("the installed server");
    let socket = root.join("run/overspill.sock");
    let server_log = || std::fs::read_to_string(tmp.path().join("serve.log")).unwrap_or_default();
    wait_for("the installed server's socket", Duration::from_secs(30), || {
        assert!(server.try_wait().expect("wait").is_none(), "the installed server exited:\n{}", server_log());
        socket.exists()
    });
    let uri = format!("nbd+unix:///@vm1?socket={}", socket.display());
    let io = run(Command::new("qemu-io").args(["-f", "raw", &uri]).args([
        "-c",
        "write -P 0x5a 1M 64k",
        "-c",
        "read -P 0x5a 1M 64k",
        "-c",
        "read -P 0xa5 0 64k",
    ]));
    let io = text(&io);
    assert!(!io.contains("verification failed") && io.matches("65536/65536").count() == 3, "{io}");
    let info =
        text(&run(Command::new("nbdinfo").arg("--size").arg(format!("nbd+unix:///?socket={}", socket.display()))));
    assert_eq!(info.trim(), golden.len().to_string());

    // `overspill vm` as installed finds that server through the conffile's control key; a
    // connection stays open meanwhile (a clean disconnect ends a VM's overlay: nothing to list).
    let mut guest = Command::new("qemu-io")
        .args(["-f", "raw", &format!("nbd+unix:///@vm2?socket={}", socket.display()), "-c", "sleep 60000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-io (package qemu-utils)");
    wait_for("vm2 connected in the installed vm list", Duration::from_secs(30), || {
        assert!(guest.try_wait().expect("wait").is_none(), "qemu-io ended early");
        let list = text(&run(&mut in_root(&root, "/usr/bin/overspill", &["vm", "list"])));
        list.lines().any(|l| l.contains("vm2") && l.contains("connected"))
    });
    guest.kill().expect("kill qemu-io");
    guest.wait().expect("qemu-io");

    let pid = nix::unistd::Pid::from_raw(server.id() as i32);
    // unshare, sh and chroot each exec the next: the pid is the server's own.
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let status = server.wait().expect("wait");
    assert!(status.success(), "the installed server stopped with {status}:\n{}", server_log());

    // Enabled as operations.md says, offline (no systemd runs in the root).
    let units = ["overspill.socket", "overspill.service", "overspill-libvirt-reboots.service"];
    run(Command::new("systemctl").arg(format!("--root={}", root.display())).arg("enable").args(units));
    let links = || -> Vec<PathBuf> {
        let found =
            run(Command::new("find").arg(root.join("etc/systemd/system")).args(["-type", "l", "-name", "overspill*"]));
        text(&found).lines().map(PathBuf::from).collect()
    };
    assert!(links().len() >= units.len(), "systemctl enable made no links: {:?}", links());

    // Removal keeps the conffile (and the links: a reinstall finds the units enabled); a purge
    // takes both.
    run(&mut in_root(&root, "dpkg", &["--remove", "overspill-dbgsym", "overspill"]));
    assert!(!installed.exists());
    assert!(root.join("etc/overspill/overspill.toml").exists(), "a removal took the conffile");
    run(&mut in_root(&root, "dpkg", &["--purge", "overspill"]));
    assert!(!root.join("etc/overspill/overspill.toml").exists(), "a purge left the conffile");
    assert_eq!(links(), Vec::<PathBuf>::new(), "a purge left the units' enable links");
}
