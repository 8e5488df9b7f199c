//! Helpers shared by this crate's integration tests (each test file includes it as a module).
#![allow(dead_code)] // each test file uses its own subset

pub mod qmp;

use std::io::{ErrorKind, Read, Write};

use overspill::stat::Samples;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A 4 MiB golden image of pseudo-random bytes, `dir/golden.img`.
pub fn golden(dir: &Path) -> PathBuf {
    let path = dir.join("golden.img");
    std::fs::write(&path, pseudo_random(4 << 20, 7)).expect("golden image");
    path
}

/// Export `export` of the server listening on Unix socket `socket`.
pub fn socket_uri(socket: &Path, export: &str) -> overspill_nbd::client::NbdUri {
    format!("nbd+unix:///{export}?socket={}", socket.display()).parse().expect("uri")
}

/// Sends `signal` (`HUP`, `TERM`) to process `pid`.
pub fn nix_kill(pid: u32, signal: &str) {
    let status = Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status().expect("kill");
    assert!(status.success());
}

/// `overspill serve ARGS` that must fail at start: its standard error.
pub fn serve_must_fail(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .arg("serve")
        .args(["--ram-floor", "0", "--listen", &format!("unix:{}", dir.join("nbd.sock").display())])
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .stdin(Stdio::null())
        .output()
        .expect("run overspill serve");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "serve {args:?} started:\n{stderr}");
    assert!(!dir.join("nbd.sock").exists(), "serve {args:?} listened before refusing:\n{stderr}");
    stderr
}

/// How long a real client may run before the test calls it hung.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// Deterministic pseudo-random bytes (xorshift64*), so that a failure reproduces.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Compares two disk contents without printing megabytes: names the first differing byte.
#[track_caller]
pub fn assert_same(actual: &[u8], expected: &[u8], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length differs");
    if let Some(i) = actual.iter().zip(expected).position(|(a, b)| a != b) {
        let end = actual[i..].iter().zip(&expected[i..]).position(|(a, b)| a == b).map_or(actual.len(), |n| i + n);
        panic!(
            "{what}: first difference at byte {i} (differs through {end}): got {:02x?}, expected {:02x?}",
            &actual[i..(i + 16).min(actual.len())],
            &expected[i..(i + 16).min(expected.len())]
        );
    }
}

pub struct ToolOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl ToolOutput {
    pub fn all(&self) -> String {
        format!("exit status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}", self.status, self.stdout, self.stderr)
    }
}

/// The Debian package a client comes in, for the message when it is missing.
pub fn package_of(program: &str) -> &'static str {
    match program {
        "qemu-io" | "qemu-img" => "qemu-utils",
        "nbdinfo" | "nbdcopy" => "libnbd-bin",
        "fio" => "fio",
        _ => "?",
    }
}

/// Starts a client in `dir` (fio, for one, leaves state files in its working directory).
pub fn spawn_tool(dir: &Path, program: &str, args: &[&str]) -> Child {
    Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| match e.kind() {
            ErrorKind::NotFound => panic!(
                "{program} is not installed, and this interop test needs it: apt-get install {} ({e})",
                package_of(program)
            ),
            _ => panic!("cannot run {program}: {e}"),
        })
}

/// Runs a client to its end (at most [`TOOL_TIMEOUT`]) and captures what it printed.
pub fn run_tool(dir: &Path, program: &str, args: &[&str]) -> ToolOutput {
    let mut child = spawn_tool(dir, program, args);
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut text);
            }
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let deadline = Instant::now() + TOOL_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{program} {args:?} still running after {TOOL_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let stdout = stdout.join().expect("stdout reader");
    let stderr = stderr.join().expect("stderr reader");
    ToolOutput { status, stdout, stderr }
}

/// Runs a client that must succeed.
#[track_caller]
pub fn run_ok(dir: &Path, program: &str, args: &[&str]) -> ToolOutput {
    let out = run_tool(dir, program, args);
    assert!(out.status.success(), "{program} {args:?} failed:\n{}", out.all());
    out
}

/// A running `overspill serve` with its log in a file: killed when dropped, its log shown if the
/// test failed.
pub struct Serve {
    pub child: Child,
    pub log: PathBuf,
}

impl Serve {
    /// Starts `overspill serve ARGS` (its log in `dir/server.log`) with a spill directory in
    /// `dir` and no free-memory floor unless ARGS give one; `env` is added to its environment. Returns once `ready`
    /// says it listens.
    /// Anonymous connections may write (`--anonymous-writes`), as most tests of the protocol
    /// and the engine need.
    pub fn start(dir: &Path, args: &[&str], env: &[(&str, &str)], ready: impl Fn() -> bool) -> Self {
        Self::start_with(Path::new(env!("CARGO_BIN_EXE_overspill")), dir, args, env, ready, true)
    }

    /// As [`Self::start`], with the server's default for anonymous connections (read-only).
    pub fn start_named_only(dir: &Path, args: &[&str], env: &[(&str, &str)], ready: impl Fn() -> bool) -> Self {
        Self::start_with(Path::new(env!("CARGO_BIN_EXE_overspill")), dir, args, env, ready, false)
    }

    /// As [`Self::start_named_only`], the server started by the path `program` (a link to the
    /// binary, as a package manager or an operator may install it).
    #[allow(dead_code)]
    pub fn start_as(program: &Path, dir: &Path, args: &[&str], ready: impl Fn() -> bool) -> Self {
        Self::start_with(program, dir, args, &[], ready, false)
    }

    fn start_with(
        program: &Path,
        dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        ready: impl Fn() -> bool,
        anonymous_writes: bool,
    ) -> Self {
        let log = dir.join("server.log");
        let child = Command::new(program)
            .arg("serve")
            .args(["--spill-dir", dir.join("spill").to_str().expect("utf-8 temp path")])
            .args(if args.contains(&"--ram-floor") { &[][..] } else { &["--ram-floor", "0"][..] })
            // Named VMs' pages: in the test's directory, not /dev/shm.
            .args(["--memory-dir", dir.join("memory").to_str().expect("utf-8 temp path")])
            .args(if anonymous_writes { &["--anonymous-writes"][..] } else { &[][..] })
            .args(args)
            .env("RUST_LOG", "debug")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("creating the server log"))
            .spawn()
            .expect("starting overspill serve");
        let mut server = Self { child, log };
        // A server settles moves left in doubt before it listens: up to 20 s of asking a peer.
        let deadline = Instant::now() + Duration::from_secs(40);
        while !ready() {
            server.assert_running();
            assert!(Instant::now() < deadline, "overspill serve not listening:\n{}", server.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log holds `line`: the server logs through a background writer, so a line
    /// may land a moment after what it reports has been seen.
    #[allow(dead_code)]
    #[track_caller]
    pub fn wait_log(&self, line: &str) {
        let what = format!("{line:?}");
        wait_for(&what, Duration::from_secs(20), || self.log_text(), || self.log_text().contains(line).then_some(()));
    }

    /// SIGTERM, and waits for the server to exit; it must exit 0.
    #[allow(dead_code)]
    #[track_caller]
    pub fn stop(&mut self) {
        let sent = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().expect("kill");
        assert!(sent.success(), "kill -TERM failed");
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "overspill serve exited with {status} after SIGTERM:\n{}", self.log_text());
    }

    /// SIGKILL, as a crash: the server must have been running until then.
    #[allow(dead_code)]
    #[track_caller]
    pub fn kill(mut self) {
        self.assert_running();
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reaping the killed server");
    }

    #[track_caller]
    pub fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().expect("try_wait") {
            panic!("overspill serve exited with {status}:\n{}", self.log_text());
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- server log ---\n{}", self.log_text());
        }
    }
}

/// The server's metrics endpoint, from its log. The log is written by a thread of its own, so
/// the line may come a moment after the socket a test waited for.
#[allow(dead_code)]
pub fn metrics_url(server: &Serve) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let log = server.log_text();
        let url = log.lines().find_map(|line| {
            let at = line.find("metrics=http://")? + "metrics=".len();
            Some(line[at..].split_whitespace().next()?.trim_matches('"').to_string())
        });
        match url {
            Some(url) => return url,
            None if std::time::Instant::now() < deadline => std::thread::sleep(std::time::Duration::from_millis(20)),
            None => panic!("no metrics endpoint in the log:\n{log}"),
        }
    }
}

/// A plain HTTP GET: (status line, Content-Type, body).
pub fn http_get(url: &str, accept: &str) -> (String, String, String) {
    let rest = url.strip_prefix("http://").expect("http URL");
    let (host, path) = rest.split_once('/').expect("URL with a path");
    let mut stream = std::net::TcpStream::connect(host).expect("connect to the metrics endpoint");
    write!(stream, "GET /{path} HTTP/1.0\r\nHost: {host}\r\nAccept: {accept}\r\n\r\n").expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let (head, body) = response.split_once("\r\n\r\n").expect("HTTP response");
    let content_type = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Type: ").or_else(|| l.strip_prefix("content-type: ")))
        .unwrap_or_default()
        .to_owned();
    (head.lines().next().unwrap_or_default().to_owned(), content_type, body.to_owned())
}

pub fn scrape(url: &str) -> Samples {
    let (status, _, body) = http_get(url, "text/plain");
    assert!(status.contains("200"), "{status}");
    overspill::stat::parse(&body)
}

/// The value of the one series of `family` whose labels include all of `labels`.
pub fn sample(samples: &Samples, family: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<f64> = samples
        .iter()
        .filter(|((name, l), _)| {
            name == family && labels.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, v)| *v)
        .collect();
    assert_eq!(found.len(), 1, "{family} {labels:?}: {found:?}");
    found[0]
}

/// A real guest's job (`overspill::guests::GuestKit`): says which image version it booted (if
/// the image has a `version.txt`) and whether the marker a boot before it would have left is
/// there, leaves the marker and reboots.
pub const REBOOTING_JOB: &str = r#"mount /dev/vda /mnt || exit 1
[ -e /mnt/version.txt ] && echo "VERSION $(cat /mnt/version.txt)"
if [ -e /mnt/marker ]; then echo "MARKER FOUND"; else echo "NO MARKER"; fi
echo "before the reboot" > /mnt/marker
sync
umount /mnt
echo REBOOTING
reboot -f
"#;

/// Polls `probe` every 20 ms until it finds something, for at most `wait`; fails naming `what`,
/// with the server's log (`log`), if it never does.
#[allow(dead_code)]
#[track_caller]
pub fn wait_for<T>(what: &str, wait: Duration, log: impl Fn() -> String, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + wait;
    loop {
        if let Some(found) = probe() {
            return found;
        }
        assert!(Instant::now() < deadline, "no {what} in the log after {wait:?}:\n{}", log());
        std::thread::sleep(Duration::from_millis(20));
    }
}
