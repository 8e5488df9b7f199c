//! Web servers for the HTTP source's tests, here and in the `overspill` crate's (which includes
//! this file): `tests/data/range_server.py` (ranges, ETag, Last-Modified and preconditions, as
//! nginx or S3 answer) and Python's own `http.server`, which ignores Range. Each is a process
//! killed when dropped, its request log in a file.

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct WebServer {
    child: Child,
    pub port: u16,
    log: PathBuf,
}

impl WebServer {
    /// `range_server.py` serving `dir` with `options`.
    pub fn ranges(dir: &Path, options: &[&str]) -> Self {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../overspill-sources/tests/data/range_server.py");
        let log = dir.join("web.log");
        let mut child = Command::new("python3")
            .arg(script)
            .arg("--dir")
            .arg(dir)
            .args(options)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("web server log"))
            .spawn()
            .unwrap_or_else(|e| panic!("python3 is needed for the HTTP source's tests: {e}"));
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("the server's first line");
        let port = line
            .trim()
            .strip_prefix("listening on ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("range_server.py said {line:?}"));
        Self { child, port, log }
    }

    /// `python3 -m http.server` serving `dir`: whole files only.
    pub fn plain(dir: &Path) -> Self {
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
        let log = dir.join("web.log");
        let child = Command::new("python3")
            .args(["-m", "http.server", "--bind", "127.0.0.1", "--directory"])
            .arg(dir)
            .arg(port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("web server log"))
            .spawn()
            .unwrap_or_else(|e| panic!("python3 is needed for the HTTP source's tests: {e}"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "python3 -m http.server is not listening");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, port, log }
    }

    pub fn url(&self, file: &str) -> String {
        format!("http://127.0.0.1:{}/{file}", self.port)
    }

    /// What the server has said on stderr so far (its request log, and its misbehaviours).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GETs the server has answered so far.
    pub fn gets(&self) -> usize {
        self.log_text().matches("\"GET ").count()
    }
}

impl Drop for WebServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
