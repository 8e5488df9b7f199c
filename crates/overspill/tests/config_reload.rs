//! `serve --config FILE`, and the signals around a configuration: its keys are serve's flags
//! (the command line wins); a reload whose configuration would not start, or would lose the
//! running VMs, is refused and the server goes on; a SIGTERM while the server starts ends it.

use std::os::unix::fs::MetadataExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use overspill_nbd::client::Client;
use tempfile::TempDir;

mod common;
use common::{golden, nix_kill, serve_must_fail, socket_uri, Serve};

/// `serve --config FILE`: the file's keys are serve's flags, and a flag on the command line
/// wins over the file; a key that is no flag is refused in one line naming it.
#[test]
fn a_config_file_sets_flags_and_the_command_line_wins() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("from-config.sock");
    let config = tmp.path().join("overspill.toml");
    std::fs::write(
        &config,
        format!(
            "base = {golden:?}\nlisten = \"unix:{}\"\nram = \"64M\"\nreconnect-grace = \"30s\"\nexport = [\"second={golden}\"]\nsocket-mode = 660\n",
            socket.display(),
            golden = golden.display().to_string()
        ),
    )
    .expect("config");
    let args = ["--config", config.to_str().expect("utf-8"), "--ram", "32M"];
    let mut server = Serve::start(tmp.path(), &args, &[], || std::os::unix::net::UnixStream::connect(&socket).is_ok());
    let vm = Client::connect(&socket_uri(&socket, "second@vm")).expect("the config's second export serves");
    // A mode written as a decimal integer is the octal it reads as (0o660 is refused below).
    assert_eq!(std::fs::metadata(&socket).expect("socket").mode() & 0o777, 0o660);
    vm.disconnect().expect("disconnect");
    server.stop();
    let log = server.log_text();
    let serving = log.lines().find(|l| l.contains("serving")).unwrap_or_else(|| panic!("no serving line:\n{log}"));
    assert!(serving.contains("ram_per_vm=32.0 MiB"), "the command line's --ram wins: {serving}");
    assert!(serving.contains("reconnect_grace=30s"), "the file's reconnect-grace applies: {serving}");

    std::fs::write(&config, "rma = \"64M\"\n").expect("config");
    let stderr = serve_must_fail(tmp.path(), &["--config", config.to_str().expect("utf-8")]);
    assert!(stderr.contains("\"rma\" is not a flag of serve") && stderr.contains("overspill.toml"), "{stderr}");
    // TOML's 0o660 is the integer 432, which the flag read as octal 0432: open to every user.
    std::fs::write(&config, "socket-mode = 0o660\n").expect("config");
    let stderr = serve_must_fail(tmp.path(), &["--config", config.to_str().expect("utf-8")]);
    assert!(stderr.contains("socket-mode = 432: write the octal mode as a string"), "{stderr}");
}

/// `systemctl reload` after an edit of the configuration: a file the server could not start
/// with (a typo), or one that keeps the VMs' state elsewhere (the restarted server would find
/// no VM, and each running guest would reconnect to a fresh overlay over the golden image), is
/// refused, said in the log, and the server goes on as it is; a good edit restarts it.
#[test]
fn a_reload_that_would_not_start_or_would_lose_the_vms_is_refused_and_the_server_goes_on() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = golden(tmp.path());
    let socket = tmp.path().join("reload.sock");
    let config = tmp.path().join("overspill.toml");
    // The state directory in the file (the test's harness gives the spill directory itself).
    let state_dir = |name: &str| format!("state-dir = {:?}\n", tmp.path().join(name).display().to_string());
    let good = format!(
        "base = {:?}\nlisten = \"unix:{}\"\nram = \"64M\"\n{}",
        golden.display().to_string(),
        socket.display(),
        state_dir("state")
    );
    std::fs::write(&config, &good).expect("config");
    let args = ["--config", config.to_str().expect("utf-8")];
    let mut server = Serve::start(tmp.path(), &args, &[], || std::os::unix::net::UnixStream::connect(&socket).is_ok());
    let pid = server.child.id();
    server.wait_log("serving");
    for (edit, said) in [
        (format!("{good}rma = \"64M\"\n"), "\"rma\" is not a flag of serve"),
        (
            good.replace(&state_dir("state"), &state_dir("elsewhere")),
            "a restart in place would not find the running VMs",
        ),
    ] {
        assert_ne!(edit, good, "the test edits the configuration");
        std::fs::write(&config, &edit).expect("config");
        let refusals = server.log_text().matches("SIGHUP: not restarting").count();
        nix_kill(pid, "HUP");
        let deadline = Instant::now() + Duration::from_secs(20);
        while server.log_text().matches("SIGHUP: not restarting").count() == refusals {
            assert!(Instant::now() < deadline, "no refusal of the reload:\n{}", server.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = server.log_text();
        assert!(log.contains(said), "the refusal does not say {said:?}:\n{log}");
        assert!(!log.contains("draining"), "the server drained for a reload it refused:\n{log}");
        server.assert_running();
        Client::connect(&socket_uri(&socket, "@vm")).expect("still serving").disconnect().expect("disconnect");
    }
    std::fs::write(&config, &good).expect("config");
    nix_kill(pid, "HUP");
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.log_text().matches("serving").count() < 2 {
        assert!(Instant::now() < deadline, "a good reload did not restart:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    server.assert_running();
    assert_eq!(server.child.id(), pid);
}

/// A SIGTERM while the server starts (a golden image on a web server that does not answer, or
/// many VMs to rebuild) ends the start at once, as its default action did: taken from the
/// start of serve for the sake of SIGHUP, it once waited for the server to serve (systemd's
/// stop waited out its timeout, then killed it).
#[test]
fn a_sigterm_while_starting_ends_the_start() {
    let tmp = TempDir::new().expect("tempdir");
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
    let port = silent.local_addr().expect("address").port();
    // Accepts connections, reads nothing and answers nothing.
    let _silent = std::thread::spawn(move || {
        let held: Vec<_> = silent.incoming().take(8).collect();
        std::thread::sleep(Duration::from_secs(60));
        drop(held);
    });
    let log = tmp.path().join("server.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .arg("serve")
        .args(["--base", &format!("http://127.0.0.1:{port}/golden.img")])
        .args(["--listen", &format!("unix:{}", tmp.path().join("nbd.sock").display())])
        .args(["--spill-dir", tmp.path().join("spill").to_str().expect("utf-8")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("overspill serve");
    std::thread::sleep(Duration::from_secs(1));
    assert!(child.try_wait().expect("wait").is_none(), "the start ended by itself");
    nix_kill(child.id(), "TERM");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "still starting 10 s after SIGTERM:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(15), "ended as SIGTERM's default action ends it: {status:?}");
}
