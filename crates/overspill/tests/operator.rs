//! What an operator meets when starting `overspill serve` on a real host: a listen path that is
//! not a socket, a socket that libvirt's QEMU (another user) must reach, a log reader that dies.
//! Each runs the real binary; the socket test connects with `nbdinfo` as an unprivileged user.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use overspill_nbd::client::Client;
use tempfile::TempDir;

mod common;
use common::{
    golden, metrics_url, nix_kill, pseudo_random, run_ok, run_tool, sample, scrape, serve_must_fail, socket_uri, Serve,
};

/// `serve` with the test's golden image, its spill and memory directories in `dir` and no
/// free-memory floor, for a wrapper (prlimit, systemd-socket-activate) to run.
fn serve_args(dir: &Path, golden: &Path) -> Vec<String> {
    let path = |p: &Path| p.to_str().expect("utf-8 temp path").to_owned();
    let mut args =
        vec!["serve".to_owned(), "--base".to_owned(), path(golden), "--ram-floor".to_owned(), "0".to_owned()];
    for (flag, sub) in [("--spill-dir", "spill"), ("--memory-dir", "memory")] {
        args.extend([flag.to_owned(), path(&dir.join(sub))]);
    }
    args
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

    // NBD over TCP (the default listener) beside vhost-user sockets: the mode is theirs (it
    // was refused, as if it could apply only to the NBD socket, breaking docs/vhost-user.md's
    // command).
    let vhost = tmp.path().join("vhost");
    let desk = vhost.join("desk.sock");
    let args = ["--base", golden.to_str().expect("utf-8"), "--listen", "tcp:127.0.0.1:0", "--vhost-user", "desk"];
    let vhost_dir = ["--vhost-user-dir", vhost.to_str().expect("utf-8"), "--socket-mode", "660"];
    let mode_660 = || std::fs::metadata(&desk).is_ok_and(|m| m.mode() & 0o777 == 0o660);
    let mut server = Serve::start(tmp.path(), &[&args[..], &vhost_dir[..]].concat(), &[], mode_660);
    // The vhost-user sockets are made before the NBD listener: serving is what says it started.
    server.wait_log("serving");
    server.assert_running();
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

/// Waits until a server started by hand listens on `socket`, or fails the test if it exits
/// first or takes 20 s.
fn wait_listening(child: &mut std::process::Child, socket: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        assert!(child.try_wait().expect("try_wait").is_none(), "serve exited before listening");
        assert!(Instant::now() < deadline, "serve never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What will fail later fails at start, in one line that names the flag and the path, each
/// cause once.
#[test]
fn what_cannot_work_is_refused_at_start_in_one_line() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let golden_arg = golden.to_str().expect("utf-8");
    let under_a_file = format!("{golden_arg}/spill");
    let missing = tmp.path().join("missing.img");
    let cases: [(Vec<&str>, &[&str]); 10] = [
        (vec!["--base", golden_arg, "--spill-dir", &under_a_file], &["--spill-dir", "golden.img/spill"]),
        (
            vec!["--base", golden_arg, "--mode", "shared", "--shared-dir", &under_a_file],
            &["--shared-dir", "golden.img/spill"],
        ),
        (vec!["--base", missing.to_str().expect("utf-8")], &["missing.img", "No such file"]),
        (vec!["--base", golden_arg, "--ram", "2G", "--ram-total", "1G"], &["--ram", "--ram-total"]),
        (vec!["--images", golden_arg], &["--images", "golden.img"]),
        // 0 is "off" for --idle-timeout; for these it would cut every client at once.
        (vec!["--base", golden_arg, "--request-timeout", "0"], &["--request-timeout", "above 0"]),
        (vec!["--base", golden_arg, "--handshake-timeout", "0s"], &["--handshake-timeout", "above 0"]),
        // Found later, each VM that spills would be refused (and recovered ones lost).
        (vec!["--base", golden_arg, "--spill-max", "0"], &["--spill-max", "two 2 MiB segments"]),
        (vec!["--base", golden_arg, "--spill-max", "2M"], &["--spill-max", "at least 4M"]),
        (vec!["--base", golden_arg, "--remote-chunk", "100K"], &["--remote-chunk", "power of two"]),
    ];
    for (args, expected) in cases {
        let stderr = serve_must_fail(tmp.path(), &args);
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        let error = lines.last().copied().unwrap_or_default();
        assert!(error.starts_with("overspill: "), "{args:?}: the error is the last line:\n{stderr}");
        for part in expected {
            assert!(error.contains(part), "{args:?}: {part:?} missing from {error:?}");
        }
        assert!(!stderr.contains("Caused by") && !stderr.contains("backtrace"), "{args:?}:\n{stderr}");
        for (i, word) in error.split(": ").enumerate() {
            assert!(!error.split(": ").skip(i + 1).any(|w| w == word), "{args:?}: {word:?} twice in {error:?}");
        }
    }
    assert!(golden.is_file(), "the golden image is still there");
}

/// A socket group the server's user is not in (the packaged unit's dynamic user and QEMU's
/// group) is refused at start, saying how to put the user in it, rather than failing at the
/// first socket and taking every VM down with the server.
#[test]
fn a_socket_group_the_user_is_not_in_is_refused_at_start() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to run the server as another user");
        return;
    }
    let tmp = TempDir::new().expect("tempdir");
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let golden = golden(tmp.path());
    std::fs::set_permissions(&golden, std::fs::Permissions::from_mode(0o644)).expect("chmod golden");
    let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["serve", "--base"])
        .arg(&golden)
        .args(["--listen", &format!("unix:{}", tmp.path().join("nbd.sock").display())])
        .args(["--socket-mode", "660", "--socket-group", "root"])
        .uid(65534)
        .gid(65534)
        .stdin(Stdio::null())
        .output()
        .expect("run overspill serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("--socket-group root") && stderr.contains("SupplementaryGroups=root"), "{stderr}");
    assert!(!tmp.path().join("nbd.sock").exists(), "it listened before refusing");
}

/// `--log` wins over RUST_LOG, which applies when the flag is absent.
#[test]
fn the_log_flag_wins_over_rust_log() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("nbd.sock");
    let serving_logged = |log_flag: Option<&str>, rust_log: &str| -> bool {
        let listen = format!("unix:{}", socket.display());
        let mut args = vec!["--base", golden.to_str().expect("utf-8"), "--listen", &listen];
        if let Some(level) = log_flag {
            args.extend(["--log", level]);
        }
        let mut server = Serve::start(tmp.path(), &args, &[("RUST_LOG", rust_log)], || {
            std::os::unix::net::UnixStream::connect(&socket).is_ok()
        });
        server.stop();
        let log = server.log_text();
        if log.contains("serving") {
            // A named VM's URI: an unnamed one is served read-only.
            let uri = format!("nbd+unix:///@NAME?socket={}", socket.display());
            assert!(log.contains(&uri), "the serving line gives the URI {uri}:\n{log}");
        }
        log.contains("serving")
    };
    assert!(!serving_logged(Some("warn"), "info"), "--log warn, RUST_LOG=info: info lines were logged");
    assert!(serving_logged(Some("info"), "warn"), "--log info, RUST_LOG=warn: no info line");
    assert!(!serving_logged(None, "warn"), "RUST_LOG=warn alone: info lines were logged");
}

/// `--version` says the commit it was built from (this checkout's, when there is one) and its
/// optional features.
#[test]
fn version_names_the_commit_and_the_features() {
    let out = Command::new(env!("CARGO_BIN_EXE_overspill")).arg("--version").output().expect("overspill --version");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains(env!("CARGO_PKG_VERSION")) && text.contains("features: s3"), "{text}");
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned());
    match head {
        Some(commit) => assert!(text.contains(&format!("commit {commit}")), "{text} (HEAD is {commit})"),
        None => assert!(text.contains("commit unknown"), "{text}"),
    }
}

/// `--pidfile` names the server once it listens and goes when it stops.
#[test]
fn the_pidfile_names_the_server_while_it_runs() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("nbd.sock");
    let pidfile = tmp.path().join("run/overspill.pid");
    std::fs::create_dir_all(pidfile.parent().expect("parent")).expect("run dir");
    // Someone else's file whose name a careless temporary name would take.
    let neighbour = tmp.path().join("run/overspill.partial");
    std::fs::write(&neighbour, b"not overspill's").expect("neighbour");
    let listen = format!("unix:{}", socket.display());
    let args =
        ["--base", golden.to_str().expect("utf-8"), "--listen", &listen, "--pidfile", pidfile.to_str().expect("utf-8")];
    let mut server = Serve::start(tmp.path(), &args, &[], || pidfile.exists());
    let written = std::fs::read_to_string(&pidfile).expect("pidfile");
    assert_eq!(written.trim(), server.child.id().to_string());
    server.stop();
    assert!(!pidfile.exists(), "the pidfile outlived the server");
    assert_eq!(std::fs::read(&neighbour).expect("still there"), b"not overspill's");
}

/// A soft open-file limit below the hard one is raised at start: each VM holds descriptors.
#[test]
fn serve_raises_its_open_file_limit_to_the_hard_limit() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("nbd.sock");
    let mut child = Command::new("prlimit")
        .args(["--nofile=256:4096", "--"])
        .arg(env!("CARGO_BIN_EXE_overspill"))
        .args(serve_args(tmp.path(), &golden))
        .args(["--listen", &format!("unix:{}", socket.display())])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("prlimit (util-linux) runs serve");
    wait_listening(&mut child, &socket);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id())).expect("limits");
    let open_files = limits.lines().find(|l| l.starts_with("Max open files")).expect("open files line");
    let numbers: Vec<&str> = open_files.split_whitespace().filter(|w| w.parse::<u64>().is_ok()).collect();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(numbers, ["4096", "4096"], "{open_files}");
}

/// A server out of file descriptors says so: the VM it cannot take is told the real cause, not
/// "no such export", the refusal is counted under its own reason, the VMs already in go on, and
/// once one leaves the next gets in.
#[test]
fn a_server_out_of_file_descriptors_says_so_and_keeps_serving() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let args = ["--base", golden.to_str().expect("utf-8"), "--listen", &listen, "--metrics", "tcp:127.0.0.1:0"];
    let server = Serve::start(tmp.path(), &args, &[], || std::os::unix::net::UnixStream::connect(&socket).is_ok());
    let url = metrics_url(&server);
    let pid = server.child.id().to_string();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fd table").count();
    // Room for a few VMs and no more, set on the running server (it raised its own limit at start).
    // A VM holds seven descriptors (its socket twice, five arena and spill files), and the count
    // above may include the readiness probe's socket, so 48 leaves room for at least five VMs.
    let limit = format!("--nofile={0}:{0}", open + 48);
    run_ok(tmp.path(), "prlimit", &["--pid", &pid, &limit]);

    let mut vms = Vec::new();
    let refusal = loop {
        assert!(vms.len() < 48, "48 descriptors took {} VMs and no refusal", vms.len());
        // Bounded: were the server's table full at accept, the greeting would never come.
        let stream = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        match Client::handshake(Box::new(stream), &format!("@fd-{}", vms.len()), true) {
            Ok(vm) => vms.push(vm),
            Err(error) => break error.to_string(),
        }
    };
    assert!(vms.len() >= 2, "only {} VMs got in before: {refusal}", vms.len());
    assert!(refusal.contains("out of file descriptors"), "the client was told: {refusal}");
    for (i, vm) in vms.iter_mut().enumerate() {
        vm.write(0, &[i as u8; 4096], false).expect("a VM already in goes on");
    }
    for vm in vms.drain(..2) {
        vm.disconnect().expect("disconnect");
    }
    // The server closes a leaving VM's files and socket just after its reply to the disconnect,
    // so the next VM may find the table still full for a moment; it must get in soon after.
    let started = Instant::now();
    let mut late = loop {
        match Client::connect(&socket_uri(&socket, "@late")) {
            Ok(vm) => break vm,
            Err(error) if started.elapsed() < Duration::from_secs(10) => {
                assert!(error.to_string().contains("out of file descriptors"), "{error}");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(error) => panic!("no VM got in in 10 s after two left: {error}"),
        }
    };
    late.write(0, &[9; 4096], false).expect("write");
    let refused = sample(&scrape(&url), "overspill_nbd_refused_connections_total", &[("reason", "out-of-resources")]);
    assert!(refused >= 1.0, "the refusal was not counted as out-of-resources");
    // The log names the cause.
    server.wait_log("out of file descriptors");
}

/// `--ram-total` is a true cap: each spilling VM keeps its 2 MiB segment and an index in memory
/// (2.25 MiB set aside), so the cap admits as many VMs as it holds those and turns the next away
/// naming the cap; the VMs it took, all writing past their targets, settle under the cap.
#[test]
fn ram_total_is_a_true_cap_for_spilling_vms() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let base = ["--base", golden.to_str().expect("utf-8"), "--listen", &listen, "--metrics", "tcp:127.0.0.1:0"];
    let args = [&base[..], &["--ram", "4M", "--ram-total", "9M"]].concat();
    let server = Serve::start(tmp.path(), &args, &[], || std::os::unix::net::UnixStream::connect(&socket).is_ok());
    let url = metrics_url(&server);
    let mut vms: Vec<Client> =
        (0..4).map(|i| Client::connect(&socket_uri(&socket, &format!("@cap-{i}"))).expect("within the cap")).collect();
    let Err(refused) = Client::connect(&socket_uri(&socket, "@one-too-many")) else { panic!("a fifth VM got in") };
    assert!(refused.to_string().contains("--ram-total 9 MiB"), "the refusal names the cap: {refused}");
    let used = || sample(&scrape(&url), "overspill_host_cache_memory_used_bytes", &[]);
    let block = pseudo_random(64 << 10, 9);
    for round in 0..60u64 {
        for vm in &mut vms {
            vm.write(round * (64 << 10), &block, false).expect("write");
        }
    }
    // Targets are cut to the fair share at the next rebalance (each second); the VMs give the
    // excess back as they go on writing.
    let cap = (9 << 20) as f64;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut round = 0u64;
    while used() > cap {
        assert!(Instant::now() < deadline, "cache memory {} stays above the 9 MiB cap", used());
        for vm in &mut vms {
            vm.write(round % 60 * (64 << 10), &block, false).expect("write");
        }
        round += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    for vm in vms {
        vm.disconnect().expect("disconnect");
    }
    // NBD_CMD_DISC has no reply: the server ends each overlay a moment after the client has
    // sent it, and its memory counts until then.
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(error) = Client::connect(&socket_uri(&socket, "@later")) {
        assert!(Instant::now() < deadline, "no room again once the others left: {error}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// CPU time (user + system, in clock ticks) a process has used, from /proc.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // Fields after the command name (which may hold spaces): state is the 3rd, utime the 14th.
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime")
}

/// Connections poll their socket for a moment before sleeping, for the next request: a VM that
/// goes quiet must not keep a core busy.
#[test]
fn a_quiet_vm_costs_no_cpu_while_it_waits() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let args = ["--base", golden.to_str().expect("utf-8"), "--listen", &listen, "--poll-us", "1000"];
    let server = Serve::start(tmp.path(), &args, &[], || std::os::unix::net::UnixStream::connect(&socket).is_ok());
    let mut vm = Client::connect(&socket_uri(&socket, "@quiet")).expect("connect");
    for i in 0..200u64 {
        vm.write(i * 4096, &[7u8; 4096], false).expect("write");
    }
    let before = cpu_ticks(server.child.id());
    std::thread::sleep(Duration::from_secs(2));
    let used = cpu_ticks(server.child.id()) - before;
    // A poll that never gave up would use the whole 2 s (200 ticks at 100 Hz).
    assert!(used < 20, "a quiet VM's connection used {used} ticks of CPU in 2 s");
    vm.disconnect().expect("disconnect");
}

/// The systemd way, with systemd's own tool: the socket comes from the service manager (socket
/// activation, started by the first client), the server says READY=1 over NOTIFY_SOCKET once
/// it serves (Type=notify) and STOPPING=1 when told to stop, and leaves the socket, which is
/// the manager's, where it is for the next server.
#[test]
fn socket_activation_and_readiness_the_systemd_way() {
    use std::os::unix::net::UnixDatagram;
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("nbd.sock");
    let notify_path = tmp.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).expect("notify socket");
    notify.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let log = tmp.path().join("server.log");
    let mut activator = Command::new("systemd-socket-activate")
        .arg("--listen")
        .arg(&socket)
        .arg("-E")
        .arg(format!("NOTIFY_SOCKET={}", notify_path.display()))
        .arg("-E")
        .arg("RUST_LOG=info")
        .arg(env!("CARGO_BIN_EXE_overspill"))
        .args(serve_args(tmp.path(), &golden))
        // Set in a config for another address: the socket handed over wins, and the log says so.
        .args(["--listen", "tcp:127.0.0.1:9"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("systemd-socket-activate (package systemd)");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "systemd-socket-activate never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The first client starts the server, which finds it waiting on the socket it is handed.
    let mut vm = Client::connect(&socket_uri(&socket, "@activated")).expect("a VM connects through the passed socket");
    let mut message = [0u8; 512];
    let n = notify.recv(&mut message).expect("a notification");
    let text = String::from_utf8_lossy(&message[..n]).into_owned();
    assert!(text.lines().any(|l| l == "READY=1"), "{text}");
    assert!(text.contains(&format!("STATUS=serving nbd+unix:///@NAME?socket={}", socket.display())), "{text}");
    let data = pseudo_random(64 * 1024, 11);
    vm.write(0, &data, false).expect("write");
    let mut back = vec![0; data.len()];
    vm.read(0, &mut back).expect("read");
    assert_eq!(back, data);
    vm.disconnect().expect("disconnect");

    // SIGHUP (systemctl reload): RELOADING=1, then the same process, a new program, READY=1 on
    // the same socket; a VM that lost its connection to the restart finds its writes.
    let mut kept = Client::connect(&socket_uri(&socket, "@kept")).expect("connect");
    kept.write(0, &data, false).expect("write");
    drop(kept);
    nix_kill(activator.id(), "HUP");
    let mut said = String::new();
    while !said.lines().any(|l| l == "READY=1") {
        let n = notify.recv(&mut message).expect("notifications around the restart");
        said += &String::from_utf8_lossy(&message[..n]);
        said.push('\n');
    }
    assert!(said.lines().any(|l| l == "RELOADING=1") && !said.contains("STOPPING=1"), "{said}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut kept = loop {
        match Client::connect(&socket_uri(&socket, "@kept")) {
            Ok(client) => break client,
            Err(error) => assert!(Instant::now() < deadline, "@kept never got back in: {error}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    kept.read(0, &mut back).expect("read");
    assert_eq!(back, data, "the restarted server served @kept its own writes");
    kept.disconnect().expect("disconnect");

    // Stopped while idle, with no way to reach its socket by its path (the shipped unit's socket
    // refuses the service's own user; here the path is moved aside): it still stops at once.
    let aside = tmp.path().join("aside.sock");
    std::fs::rename(&socket, &aside).expect("move the socket aside");
    nix_kill(activator.id(), "TERM");
    let n = notify.recv(&mut message).expect("a notification at stop");
    let text = String::from_utf8_lossy(&message[..n]).into_owned();
    assert!(text.lines().any(|l| l == "STOPPING=1"), "{text}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = activator.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = activator.kill();
            panic!("an idle server told to stop was still waiting for a client after 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "{status}:\n{log_text}");
    assert!(log_text.contains("serving the socket systemd passed"), "{log_text}");
    assert!(log_text.contains("--listen is ignored") && log_text.contains("tcp:127.0.0.1:9"), "{log_text}");
    assert!(aside.exists(), "the server removed the socket the service manager owns");
}

/// The service manager's variables naming two sockets where it passed one: the server says so
/// and stops, where it used to bind a socket of its own nobody would connect to. The same
/// variables set for another process (a wrapper that started the server as its child) are not
/// the server's: it serves its own socket.
#[test]
fn socket_activation_variables_that_do_not_add_up_stop_the_server_with_the_reason() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("nbd.sock");
    let own = tmp.path().join("own.sock");
    let log = tmp.path().join("server.log");
    let child = Command::new("systemd-socket-activate")
        .arg("--listen")
        .arg(&socket)
        .arg("--fdname=nbd:control")
        .arg(env!("CARGO_BIN_EXE_overspill"))
        .args(serve_args(tmp.path(), &golden))
        .args(["--listen", &format!("unix:{}", own.display())])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("systemd-socket-activate (package systemd)");
    // Killed and reaped however the test ends.
    let mut activator = Serve { child, log };
    // The first client starts the server, which stops before it answers (the path appears
    // when the activator binds, a moment before it listens).
    let deadline = Instant::now() + Duration::from_secs(20);
    let client = loop {
        match std::os::unix::net::UnixStream::connect(&socket) {
            Ok(client) => break client,
            Err(error) => assert!(Instant::now() < deadline, "systemd-socket-activate never listened: {error}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = activator.child.try_wait().expect("try_wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "the server went on with socket variables that do not add up");
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(client);
    let log_text = activator.log_text();
    assert!(!status.success(), "{log_text}");
    assert!(log_text.contains("LISTEN_FDNAMES") && log_text.contains("do not add up"), "{log_text}");
    assert!(!own.exists(), "the server bound a socket of its own");
    // Told before any work of starting: no state made, no VM of a last server rebuilt.
    assert!(!tmp.path().join("spill").exists(), "the server made its state before it checked the sockets");

    let wrapped = TempDir::new().expect("tempdir");
    let other_pid = std::process::id().to_string();
    let foreign = [("LISTEN_PID", other_pid.as_str()), ("LISTEN_FDS", "1"), ("LISTEN_FDNAMES", "nbd:control")];
    let base = ["--base", golden.to_str().expect("utf-8"), "--listen", &format!("unix:{}", own.display())];
    let mut server = Serve::start(wrapped.path(), &base, &foreign, || own.exists());
    let mut vm = Client::connect(&socket_uri(&own, "@wrapped")).expect("a VM connects to the server's own socket");
    let data = pseudo_random(4096, 5);
    vm.write(0, &data, false).expect("write");
    let mut back = vec![0; data.len()];
    vm.read(0, &mut back).expect("read");
    assert_eq!(back, data);
    vm.disconnect().expect("disconnect");
    server.stop();
}

/// A memory cgroup for one test (v1 `memory` controller or v2), removed when dropped.
struct MemoryCgroup {
    dir: PathBuf,
    procs: PathBuf,
}

impl MemoryCgroup {
    /// A child of this process's own memory cgroup, limited to `limit` bytes.
    fn new(name: &str, limit: u64) -> Result<Self, String> {
        let membership = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
        for line in membership.lines() {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next(), fields.next().unwrap_or(""), fields.next().unwrap_or("/"));
            let relative = path.trim_start_matches('/');
            let (base, limit_file) = if controllers.split(',').any(|c| c == "memory") {
                (Path::new("/sys/fs/cgroup/memory").join(relative), "memory.limit_in_bytes")
            } else if controllers.is_empty() && Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
                (Path::new("/sys/fs/cgroup").join(relative), "memory.max")
            } else {
                continue;
            };
            let dir = base.join(name);
            let _ = std::fs::remove_dir(&dir);
            std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
            let group = Self { procs: dir.join("cgroup.procs"), dir };
            std::fs::write(group.dir.join(limit_file), limit.to_string())
                .map_err(|e| format!("limiting {}: {e}", group.dir.display()))?;
            return Ok(group);
        }
        Err(format!("no memory cgroup this test can make a child of:\n{membership}"))
    }

    fn add(&self, pid: u32) {
        std::fs::write(&self.procs, pid.to_string()).expect("moving the server into the cgroup");
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Bytes allocated to the spill files in `dir`.
fn spilled_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "spill"))
                .map(|e| e.metadata().map(|m| m.blocks() * 512).unwrap_or(0))
                .sum()
        })
        .unwrap_or(0)
}

/// Under a cgroup memory limit (`MemoryMax=`, a container) the free floor applies to the room
/// left in the cgroup, not to the host's free memory: with 256 MiB allowed and a 512 MiB floor, a
/// VM's writes spill that stay in RAM without the limit. Run as root (CI is), it fails with the
/// reason where no memory cgroup can be made.
#[test]
fn the_free_floor_applies_to_the_cgroup_memory_limit() {
    let run = |cgroup: Option<&MemoryCgroup>| -> u64 {
        let tmp = TempDir::new().expect("tempdir");
        let golden = golden(tmp.path());
        let socket = tmp.path().join("nbd.sock");
        let listen = format!("unix:{}", socket.display());
        let args = ["--base", golden.to_str().expect("utf-8"), "--listen", &listen, "--ram", "200M"];
        let mut args = args.to_vec();
        args.extend(["--ram-floor", "512M"]);
        let server = Serve::start(tmp.path(), &args, &[], || std::os::unix::net::UnixStream::connect(&socket).is_ok());
        if let Some(cgroup) = cgroup {
            cgroup.add(server.child.id());
        }
        // The sampler reads memory once a second.
        std::thread::sleep(Duration::from_millis(2500));
        let mut vm = Client::connect(&socket_uri(&socket, "")).expect("connect");
        let chunk = pseudo_random(1 << 20, 5);
        for i in 0..4u64 {
            vm.write(i << 20, &chunk, false).expect("write");
        }
        // 4 MiB of a 4 MiB disk written once; more of the same keeps the overlay's size.
        for round in 0..16u64 {
            for i in 0..4u64 {
                vm.write(i << 20, &pseudo_random(1 << 20, round * 4 + i), false).expect("write");
            }
        }
        vm.flush().expect("flush");
        std::thread::sleep(Duration::from_millis(300));
        let spilled = spilled_bytes(&tmp.path().join("spill"));
        drop(vm);
        spilled
    };
    assert_eq!(run(None), 0, "without a limit, 4 MiB stay in a 200 MiB RAM tier");
    let cgroup = MemoryCgroup::new(&format!("overspill-test-{}", std::process::id()), 256 << 20)
        .unwrap_or_else(|why| panic!("this test needs a memory cgroup (run as root): {why}"));
    let spilled = run(Some(&cgroup));
    assert!(spilled > 0, "under a 256 MiB cgroup limit with a 512 MiB floor, nothing spilled");
}

/// `overspill man [SUBCOMMAND]` renders pages `man` formats, with every flag; `overspill
/// completions SHELL` prints a script the shell accepts.
#[test]
fn man_pages_and_completions_render() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_overspill")).args(args).output().expect("overspill");
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    let tmp = TempDir::new().expect("tempdir");
    let page = tmp.path().join("overspill-serve.1");
    std::fs::write(&page, run(&["man", "serve"])).expect("page");
    let formatted =
        Command::new("man").arg("-l").arg(&page).env("MANWIDTH", "100").output().expect("man (package man-db)");
    let text = String::from_utf8_lossy(&formatted.stdout);
    assert!(formatted.status.success(), "{}", String::from_utf8_lossy(&formatted.stderr));
    for flag in ["--reconnect-grace", "--config", "--poll-us", "--pidfile", "--socket-group"] {
        assert!(text.contains(flag), "{flag} missing from the serve page:\n{text}");
    }
    for section in ["EXAMPLES", "EXIT STATUS", "SIGNALS", "FILES", "/etc/overspill/overspill.toml"] {
        assert!(text.contains(section), "{section} missing from the serve page:\n{text}");
    }
    // Every subcommand has a page (a subcommand without a version of its own once panicked).
    for sub in
        ["storm", "stat", "replay", "plan", "image", "vm", "libvirt-hook", "libvirt-reboots", "completions", "man"]
    {
        assert!(String::from_utf8_lossy(&run(&["man", sub])).contains("EXIT STATUS"), "overspill man {sub}");
    }
    assert!(String::from_utf8_lossy(&run(&["man"])).contains(".TH overspill 1"));
    let script = tmp.path().join("overspill.bash");
    std::fs::write(&script, run(&["completions", "bash"])).expect("script");
    let syntax = Command::new("bash").arg("-n").arg(&script).status().expect("bash");
    assert!(syntax.success(), "the bash completion script does not parse");
    assert!(std::fs::read_to_string(&script).expect("script").contains("--reconnect-grace"));

    // `overspill completions bash | head -1`: a reader that goes early ends the command
    // quietly (it panicked).
    let mut man = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["completions", "bash"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("overspill man");
    drop(man.stdout.take());
    let out = man.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked") && out.status.code() != Some(101), "{:?}: {stderr}", out.status);
}

/// A unit that leaves out `--memory-dir` keeps the VMs' pages in `/dev/shm`, which systemd
/// empties when such a unit stops, and one whose spill directory is under /tmp loses it with
/// PrivateTmp=: the server says so at start (systemd's INVOCATION_ID tells it that a unit
/// started it).
#[test]
fn pages_in_dev_shm_under_systemd_are_warned_of() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("nbd.sock");
    for (invocation, warned) in [(None, false), (Some("0123456789abcdef0123456789abcdef"), true)] {
        let log = tmp.path().join("server.log");
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_overspill"));
        command
            .arg("serve")
            .args(["--base", golden.to_str().expect("utf-8")])
            .args(["--listen", &format!("unix:{}", socket.display())])
            .args(["--spill-dir", tmp.path().join("spill").to_str().expect("utf-8")])
            .args(["--ram-floor", "0"])
            .env_remove("INVOCATION_ID")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"));
        if let Some(id) = invocation {
            command.env("INVOCATION_ID", id);
        }
        let mut child = command.spawn().expect("overspill serve");
        wait_listening(&mut child, &socket);
        nix_kill(child.id(), "TERM");
        assert!(child.wait().expect("wait").success());
        let text = std::fs::read_to_string(&log).expect("log");
        assert_eq!(text.contains("then no VM would outlive a"), warned, "{invocation:?}:\n{text}");
        // The spill directory (and the state in it) under /tmp: a unit's PrivateTmp= loses it.
        let under_tmp = tmp.path().starts_with("/tmp") || tmp.path().starts_with("/var/tmp");
        let private_tmp = text.contains("started by systemd with --spill-dir under /tmp or /var/tmp");
        assert_eq!(private_tmp, warned && under_tmp, "{invocation:?}:\n{text}");
        if warned {
            // The default memory directory the warning names, made in /dev/shm for this state
            // directory: gone with the server, which left no VM's pages in it.
            let name = text.split("dir=/dev/shm/").nth(1).and_then(|rest| rest.split_whitespace().next());
            let made = Path::new("/dev/shm").join(name.expect("the directory named"));
            assert!(!made.exists(), "{} left behind", made.display());
        }
    }
}

/// A `--ram-total` larger than the memory directory's filesystem can hold is capped at its room,
/// with a warning: pages past it would fail guests' writes with ENOSPC instead of spilling.
#[test]
fn ram_total_is_capped_at_the_memory_directorys_room() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let args = ["--base", golden.to_str().expect("utf-8"), "--listen", &listen, "--ram-total", "1000T"];
    let ready = socket.clone();
    let mut server =
        Serve::start(tmp.path(), &args, &[], move || std::os::unix::net::UnixStream::connect(&ready).is_ok());
    let log = server.log_text();
    assert!(log.contains("room for less than --ram-total"), "{log}");
    let serving = log.lines().find(|line| line.contains("serving")).expect("the serving line");
    // format_bytes writes 1000T as "1000.0 TiB".
    assert!(!serving.contains("ram_total=1000.0 TiB") && serving.contains("ram_total="), "{serving}");
    server.stop();
}

/// A size without a unit is refused, on the command line and in a config file (`--ram 256` was
/// 256 bytes, silently); `0` needs none. The flags of `vm` and `image` may follow the action.
#[test]
fn sizes_need_a_unit_and_vm_and_image_flags_may_follow_the_action() {
    let dir = TempDir::new().expect("tempdir");
    let image = golden(dir.path());
    let refused = serve_must_fail(dir.path(), &["--base", image.to_str().expect("utf-8"), "--ram", "256"]);
    assert!(refused.contains("--ram") && refused.contains("no unit") && refused.contains("256M"), "{refused}");
    let config = dir.path().join("overspill.toml");
    std::fs::write(&config, "ram-total = 8192\n").expect("config");
    let refused = serve_must_fail(
        dir.path(),
        &["--base", image.to_str().expect("utf-8"), "--config", config.to_str().expect("utf-8")],
    );
    assert!(refused.contains("--ram-total") && refused.contains("no unit"), "{refused}");

    let control = dir.path().join("nobody.sock");
    let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["vm", "list", "--control", control.to_str().expect("utf-8")])
        .output()
        .expect("overspill vm");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains(&control.display().to_string()), "vm list --control: {stderr}");
    let store = dir.path().join("store");
    std::fs::create_dir(&store).expect("store");
    let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["image", "list", "--images", store.to_str().expect("utf-8")])
        .output()
        .expect("overspill image");
    assert!(out.status.success(), "image list --images: {}", String::from_utf8_lossy(&out.stderr));
}

/// Under `--log-json`, the error that stops the process is a JSON line too: a collector that
/// parses each line would otherwise lose the one that says why the server stopped.
#[test]
fn a_fatal_error_under_log_json_is_a_json_line() {
    let dir = TempDir::new().expect("tempdir");
    let missing = dir.path().join("no-such-image.img");
    let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .arg("--log-json")
        .args(serve_args(dir.path(), &missing))
        .args(["--listen", &format!("unix:{}", dir.path().join("nbd.sock").display())])
        .stdin(Stdio::null())
        .output()
        .expect("overspill serve");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    let line: serde_json::Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("not JSON ({e}): {stderr}"));
    assert_eq!(line["level"], "ERROR", "{last}");
    let message = line["fields"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("no-such-image.img"), "{last}");
}
