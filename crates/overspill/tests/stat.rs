//! `overspill stat` on a real terminal: a pseudo-terminal of 80×24 with the real binary in it,
//! against a real server that is killed and started again under it.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use overspill_nbd::client::{Client, NbdUri};
use tempfile::TempDir;

mod common;
use common::{pseudo_random, Serve};

/// Everything the program wrote to its terminal so far.
#[derive(Clone, Default)]
struct Screen(Arc<Mutex<Vec<u8>>>);

impl Screen {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("screen")).into_owned()
    }

    /// Waits until the output after byte `from` holds `wanted`; returns where it ends.
    #[track_caller]
    fn wait_for(&self, wanted: &str, from: usize) -> usize {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = self.text();
            if let Some(at) = text.get(from..).and_then(|t| t.find(wanted)) {
                return from + at + wanted.len();
            }
            assert!(Instant::now() < deadline, "no {wanted:?} on the screen after byte {from}:\n{text:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A golden image, the socket and metrics port a server will use, and the server on them.
struct Setup {
    tmp: TempDir,
    golden: PathBuf,
    socket: PathBuf,
    port: u16,
}

impl Setup {
    fn new(seed: u64) -> (Self, Serve) {
        let tmp = TempDir::new().expect("tempdir");
        let golden = tmp.path().join("golden.img");
        std::fs::write(&golden, pseudo_random(4 << 20, seed)).expect("golden image");
        let socket = tmp.path().join("nbd.sock");
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
        let setup = Self { tmp, golden, socket, port };
        let server = setup.start();
        (setup, server)
    }

    fn start(&self) -> Serve {
        let listen = format!("unix:{}", self.socket.display());
        let metrics = format!("tcp:127.0.0.1:{}", self.port);
        let args = ["--base", self.golden.to_str().expect("utf-8"), "--listen", &listen, "--metrics", &metrics];
        let endpoint = format!("127.0.0.1:{}", self.port);
        Serve::start(self.tmp.path(), &args, &[], || {
            std::os::unix::net::UnixStream::connect(&self.socket).is_ok()
                && std::net::TcpStream::connect(&endpoint).is_ok()
        })
    }

    fn uri(&self, vm: &str) -> NbdUri {
        format!("nbd+unix:///@{vm}?socket={}", self.socket.display()).parse().expect("uri")
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/metrics", self.port)
    }
}

/// The full-screen view: alternate screen, the VM and the server's figures, sort keys, a
/// server killed and started again under it (it keeps trying and shows the VM waiting in
/// grace), and `q` quits, leaving the terminal as it was.
#[test]
fn stat_is_a_full_screen_view_that_rides_through_a_server_restart() {
    let (setup, server) = Setup::new(3);
    let mut vm = Client::connect(&setup.uri("watched")).expect("connect");
    for i in 0..64u64 {
        vm.write(i * 4096, &[5; 4096], false).expect("write");
    }

    let size = nix::pty::Winsize { ws_row: 24, ws_col: 80, ws_xpixel: 0, ws_ypixel: 0 };
    let pty = nix::pty::openpty(Some(&size), None).expect("openpty");
    let slave = |fd: &OwnedFd| Stdio::from(fd.try_clone().expect("dup the terminal"));
    // setsid --ctty: the terminal becomes the program's own, as in a login shell.
    let mut stat = Command::new("setsid")
        .args(["--ctty", env!("CARGO_BIN_EXE_overspill"), "stat", "--interval", "0.3"])
        .args(["--url", &setup.url()])
        .stdin(slave(&pty.slave))
        .stdout(slave(&pty.slave))
        .stderr(slave(&pty.slave))
        .spawn()
        .expect("setsid (util-linux) runs overspill stat");
    drop(pty.slave);
    let screen = Screen::default();
    let mut keys = std::fs::File::from(pty.master.try_clone().expect("dup the terminal"));
    let reader = {
        let screen = screen.clone();
        let mut master = std::fs::File::from(pty.master);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // Ends with EIO once the program has gone and the terminal has no one on it.
            while let Ok(n @ 1..) = master.read(&mut buf) {
                screen.0.lock().expect("screen").extend_from_slice(&buf[..n]);
            }
        })
    };

    let at = screen.wait_for("default@watched", 0);
    let text = screen.text();
    assert!(text.contains("\x1b[?1049h"), "no alternate screen: {text:?}");
    assert!(text.contains("VMs 1 connected") && text.contains("q quit"), "{text:?}");
    keys.write_all(b"n").expect("key");
    let at = screen.wait_for("by name", at);

    server.kill();
    let at = screen.wait_for("unreachable", at);
    drop(vm);
    let mut server = setup.start();
    // The new server knows the VM from its ledger and waits for it to come back.
    screen.wait_for("1 in grace", at);

    keys.write_all(b"q").expect("key");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = stat.try_wait().expect("try_wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "q did not quit:\n{:?}", screen.text());
        std::thread::sleep(Duration::from_millis(50));
    };
    reader.join().expect("reader");
    assert!(status.success(), "stat exited with {status}:\n{:?}", screen.text());
    assert!(screen.text().contains("\x1b[?1049l"), "the screen was not restored");
    server.stop();
}

/// `--once --json`: one view for scripts, with the rates of the interval.
#[test]
fn stat_once_prints_json_for_scripts() {
    let (setup, mut server) = Setup::new(4);
    let mut vm = Client::connect(&setup.uri("scripted")).expect("connect");
    // Writes all through the interval, so that its rate is not zero.
    let writer = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut i = 0u64;
        while Instant::now() < deadline {
            vm.write(i % 512 * 4096, &[7; 4096], false).expect("write");
            i += 1;
        }
        vm.disconnect().expect("disconnect");
    });
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["stat", "--once", "--json", "--interval", "1", "--url", &setup.url()])
        .output()
        .expect("overspill stat");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let view: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let vms = view["vms"].as_array().expect("vms");
    let me = vms.iter().find(|v| v["vm"] == "scripted").unwrap_or_else(|| panic!("{view:#}"));
    assert!(me["writes_per_second"].as_f64().expect("rate") > 0.0, "{view:#}");
    assert!(me["cache_memory_bytes"].as_u64().expect("bytes") >= 4096, "{view:#}");
    assert_eq!(view["server"]["vms_connected"], 1, "{view:#}");
    assert_eq!(view["server"]["version"], env!("CARGO_PKG_VERSION"));
    writer.join().expect("writer");
    server.stop();
}
