//! A QEMU driven over QMP on its stdio, for the tests that run real QEMU processes.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A QEMU with `-qmp stdio`, killed when dropped.
pub struct Qmp {
    pub child: Child,
    input: ChildStdin,
    lines: Receiver<String>,
    /// What QEMU printed on stdout besides QMP (qemu-io's output, for one).
    pub printed: Vec<String>,
    log: PathBuf,
}

impl Qmp {
    /// QEMU paused before the guest runs (-S), with no devices but those of `args`, under TCG.
    pub fn start(dir: &Path, args: &[String]) -> Self {
        Self::start_logged(dir, "qemu.log", args, true)
    }

    /// QEMU with its log in `dir/log`, paused before the guest runs (-S) if `paused`.
    pub fn start_logged(dir: &Path, log: &str, args: &[String], paused: bool) -> Self {
        let log = dir.join(log);
        let mut child = Command::new("qemu-system-x86_64")
            .args(["-accel", "tcg", "-nodefaults", "-no-user-config", "-display", "none", "-qmp", "stdio"])
            .args(if paused { &["-S"][..] } else { &[][..] })
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("qemu log"))
            .spawn()
            .unwrap_or_else(|e| {
                panic!("qemu-system-x86_64 is not installed (apt-get install qemu-system-x86; scripts/test does): {e}")
            });
        let input = child.stdin.take().expect("qemu stdin");
        let output = BufReader::new(child.stdout.take().expect("qemu stdout"));
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in output.lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        let mut qmp = Self { child, input, lines, printed: Vec::new(), log };
        let greeting = qmp.next_line();
        assert!(greeting.contains("\"QMP\""), "no QMP greeting: {greeting}");
        qmp.execute(serde_json::json!({"execute": "qmp_capabilities"}));
        qmp
    }

    pub fn next_line(&mut self) -> String {
        self.lines.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
            let status = self.child.try_wait().ok().flatten();
            panic!("QEMU said nothing on QMP ({status:?}):\n{}", std::fs::read_to_string(&self.log).unwrap_or_default())
        })
    }

    /// Runs one command; its "return" value (events in between are skipped).
    pub fn execute(&mut self, command: Value) -> Value {
        // One write: QEMU acts on a command at its closing brace, and after `quit` it is gone
        // before a separate write of the newline could reach it (EPIPE, seen in CI).
        self.input.write_all(format!("{command}\n").as_bytes()).expect("writing to QMP");
        loop {
            let line = self.next_line();
            if !line.starts_with('{') {
                self.printed.push(line);
                continue;
            }
            let reply: Value = serde_json::from_str(&line).expect("QMP speaks JSON");
            if let Some(value) = reply.get("return") {
                return value.clone();
            }
            assert!(reply.get("event").is_some(), "{command} failed: {reply}");
        }
    }

    /// `quit`, and QEMU exits; everything it printed besides QMP.
    pub fn quit(mut self) -> Vec<String> {
        self.execute(serde_json::json!({"execute": "quit"}));
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().expect("try_wait").is_none() {
            assert!(Instant::now() < deadline, "QEMU did not quit");
            std::thread::sleep(Duration::from_millis(20));
        }
        // qemu-io prints through stdio, whose buffer reaches the pipe at the latest when QEMU exits.
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(10)) {
            if !line.starts_with('{') {
                self.printed.push(line);
            }
        }
        std::mem::take(&mut self.printed)
    }
    /// Runs an HMP command (`qemu-io DRIVE "..."`, say); what it returned.
    pub fn human(&mut self, command_line: &str) -> String {
        let reply = self.execute(serde_json::json!({
            "execute": "human-monitor-command",
            "arguments": {"command-line": command_line}
        }));
        reply.as_str().unwrap_or_default().to_owned()
    }

    /// QEMU's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Qmp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
