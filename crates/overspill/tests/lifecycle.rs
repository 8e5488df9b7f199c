//! A named VM's overlay lives as long as the VM, not as long as its connection nor its server:
//! a connection lost without NBD_CMD_DISC is resumed within the reconnect grace, a second
//! connection for a live name is refused, `overspill vm` lists, resets and drops, a killed or
//! stopped server hands every VM to the next, and state the next one cannot recover makes it
//! refuse that name until it is reset (never golden data in place of its writes). Against the
//! real binary, with our client and with qemu-io.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use overspill_nbd::client::{Client, NbdUri};
use serde_json::Value;
use tempfile::TempDir;

mod common;
use common::{assert_same, pseudo_random, run_tool, Serve};

const GOLDEN_BYTES: usize = 32 << 20;
/// Enough to spill against a 1 MiB RAM target: the resumed overlay is RAM tier and spill log.
const WRITTEN_BYTES: usize = 8 << 20;
const WAIT: Duration = Duration::from_secs(15);

struct Host {
    dir: TempDir,
    golden: PathBuf,
    golden_bytes: Vec<u8>,
    socket: PathBuf,
}

impl Host {
    fn new() -> Self {
        Self::with_disk(GOLDEN_BYTES)
    }

    fn with_disk(bytes: usize) -> Self {
        let dir = TempDir::new().expect("tempdir");
        let golden = dir.path().join("golden.img");
        let golden_bytes = pseudo_random(bytes, 3);
        std::fs::write(&golden, &golden_bytes).expect("golden image");
        let socket = dir.path().join("nbd.sock");
        Self { dir, golden, golden_bytes, socket }
    }

    fn serve(&self, extra: &[&str]) -> Serve {
        let listen = format!("unix:{}", self.socket.display());
        let mut args = vec!["--base", self.golden.to_str().expect("utf-8"), "--listen", &listen];
        if !extra.contains(&"--ram") {
            args.extend(["--ram", "1M"]);
        }
        args.extend_from_slice(extra);
        // A killed server leaves its socket file: ready is when a connection is accepted.
        let socket = self.socket.clone();
        Serve::start_named_only(self.dir.path(), &args, &[], move || {
            std::os::unix::net::UnixStream::connect(&socket).is_ok()
        })
    }

    fn uri(&self, vm: &str) -> NbdUri {
        format!("nbd+unix:///{}?socket={}", export(vm), self.socket.display()).parse().expect("uri")
    }

    fn connect(&self, vm: &str) -> Client {
        Client::connect(&self.uri(vm)).unwrap_or_else(|e| panic!("connecting {vm}: {e}"))
    }

    fn control(&self) -> PathBuf {
        self.dir.path().join("spill/state/control.sock")
    }

    /// `overspill vm ARGS` against this host's server.
    fn vm_command(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
            .arg("vm")
            .arg("--control")
            .arg(self.control())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("overspill vm");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    }

    fn states(&self) -> Vec<(String, String)> {
        let (ok, text) = self.vm_command(&["list", "--json"]);
        assert!(ok, "vm list: {text}");
        let vms: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("vm list --json: {e}: {text}"));
        let vms = vms.as_array().expect("array");
        // Every VM has the same keys; made without TLS, a VM's owner is null, not left out.
        assert!(vms.iter().all(|v| v.get("owner").is_some_and(Value::is_null)), "vm list --json: {text}");
        vms.iter()
            .map(|v| (v["vm"].as_str().unwrap_or("").to_owned(), v["state"].as_str().unwrap_or("").to_owned()))
            .collect()
    }

    /// Waits until `vm list` shows exactly these VMs in these states.
    #[track_caller]
    fn wait_for_states(&self, expected: &[(&str, &str)]) {
        let expected: Vec<(String, String)> =
            expected.iter().map(|(v, s)| ((*v).to_owned(), (*s).to_owned())).collect();
        let deadline = Instant::now() + WAIT;
        loop {
            let states = self.states();
            if states == expected {
                return;
            }
            assert!(Instant::now() < deadline, "VM states {states:?}, expected {expected:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A fresh connection for `vm` reads the golden image's first `len` bytes, then says DISC.
    #[track_caller]
    fn assert_reads_golden(&self, vm: &str, len: usize, what: &str) {
        let mut client = self.connect(vm);
        assert_same(&read_start(&mut client, len), &self.golden_bytes[..len], what);
        client.disconnect().expect("disconnect");
    }

    fn assert_golden_untouched(&self) {
        assert_same(&std::fs::read(&self.golden).expect("golden"), &self.golden_bytes, "golden image");
    }
}

fn export(vm: &str) -> String {
    if vm.is_empty() {
        String::new()
    } else {
        format!("@{vm}")
    }
}

/// Writes `WRITTEN_BYTES` of a VM's own data at the start of the disk, in 64 KiB writes.
fn write_pattern(client: &mut Client, seed: u64) -> Vec<u8> {
    let data = pseudo_random(WRITTEN_BYTES, seed);
    for (i, chunk) in data.chunks(64 << 10).enumerate() {
        client.write((i * (64 << 10)) as u64, chunk, false).expect("write");
    }
    data
}

fn read_start(client: &mut Client, len: usize) -> Vec<u8> {
    let mut buf = vec![0; len];
    for (i, chunk) in buf.chunks_mut(1 << 20).enumerate() {
        client.read((i << 20) as u64, chunk).expect("read");
    }
    buf
}

fn spill_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir.join("spill"))
        .map(|entries| {
            entries.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "spill")).collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_lost_connection_resumes_the_same_overlay_and_a_second_connection_is_refused() {
    let host = Host::new();
    let _server = host.serve(&["--reconnect-grace", "1m"]);
    let mut first = host.connect("vm1");
    let written = write_pattern(&mut first, 11);
    assert!(!spill_files(host.dir.path()).is_empty(), "the VM spilled");

    let Err(refused) = Client::connect(&host.uri("vm1")) else {
        panic!("a second connection for a live VM was let in")
    };
    assert!(refused.to_string().contains("already connected"), "{refused}");

    // The connection ends without NBD_CMD_DISC: a crashed QEMU, a network blip.
    drop(first);
    host.wait_for_states(&[("vm1", "in-grace")]);
    let mut again = host.connect("vm1");
    assert_same(&read_start(&mut again, WRITTEN_BYTES), &written, "resumed overlay");
    assert_eq!(host.states(), [("vm1".to_owned(), "connected".to_owned())]);

    // NBD_CMD_DISC ends it: the next connection starts from the golden image.
    again.disconnect().expect("disconnect");
    host.wait_for_states(&[]);
    host.assert_reads_golden("vm1", WRITTEN_BYTES, "after DISC");
    host.assert_golden_untouched();
}

/// A named VM that wrote and lost its connection with no grace to wait in, or did not come back
/// within it, is lost: its guest may still be running (paused, cut off, reconnecting late), so
/// its name is refused, across restarts, until `vm reset`, never served golden data where it
/// wrote. A VM that only read is forgotten and starts over.
#[test]
fn a_writer_without_a_grace_or_past_it_is_refused_by_name_until_reset() {
    let host = Host::new();
    let server = host.serve(&["--reconnect-grace", "0"]);
    let mut writer = host.connect("writer");
    write_pattern(&mut writer, 12);
    drop(writer);
    let mut reader = host.connect("reader");
    read_start(&mut reader, 1 << 20);
    drop(reader);
    host.wait_for_states(&[("writer", "lost")]);
    assert_refused_as_lost(&host, "writer");
    host.assert_reads_golden("reader", 1 << 20, "a VM that only read, grace 0");
    let (ok, text) = host.vm_command(&["reset", "writer"]);
    assert!(ok, "{text}");
    host.assert_reads_golden("writer", 1 << 20, "after reset, grace 0");
    drop(server);

    let server = host.serve(&["--reconnect-grace", "1s"]);
    let mut named = host.connect("vm2");
    write_pattern(&mut named, 14);
    drop(named);
    let mut reader = host.connect("vm3");
    read_start(&mut reader, 1 << 20);
    drop(reader);
    // Both wait a second; then the writer is lost, its files gone, and the reader forgotten.
    let deadline = Instant::now() + WAIT;
    while !spill_files(host.dir.path()).is_empty() || host.states() != [("vm2".to_owned(), "lost".to_owned())] {
        assert!(Instant::now() < deadline, "grace never ran out: {:?}\n{}", host.states(), server.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    server.wait_log("did not reconnect within its grace");
    assert_refused_as_lost(&host, "vm2");
    host.assert_reads_golden("vm3", 1 << 20, "a VM that only read, after its grace");
    host.wait_for_states(&[("vm2", "lost")]);

    // The name stays refused by the next server, killed or stopped before it.
    server.kill();
    let mut server = host.serve(&["--reconnect-grace", "1s"]);
    assert_eq!(host.states(), [("vm2".to_owned(), "lost".to_owned())], "after a restart");
    assert_refused_as_lost(&host, "vm2");
    server.stop();
    let server = host.serve(&["--reconnect-grace", "1s"]);
    assert_refused_as_lost(&host, "vm2");
    let (ok, text) = host.vm_command(&["reset", "vm2"]);
    assert!(ok, "{text}");
    host.assert_reads_golden("vm2", 1 << 20, "after reset");
    drop(server);
    host.assert_golden_untouched();
}

#[track_caller]
fn assert_refused_as_lost(host: &Host, vm: &str) {
    match Client::connect(&host.uri(vm)) {
        Ok(_) => panic!("{vm} was served after its writes were given up"),
        Err(refused) => assert!(refused.to_string().contains("lost"), "{vm}: {refused}"),
    }
}

/// A connection without a VM name is served read-only unless the server allows anonymous
/// writes: a QEMU started with the anonymous URI cannot write anything a reconnect would
/// lose, and inspection and copying still work.
#[test]
fn an_anonymous_connection_is_read_only_and_told_how_to_name_the_vm() {
    let host = Host::new();
    let server = host.serve(&[]);
    let uri = format!("nbd+unix:///?socket={}", host.socket.display());
    let dir = host.dir.path();

    let info = common::run_ok(dir, "nbdinfo", &["--json", &uri]);
    let info: Value = serde_json::from_str(&info.stdout).expect("nbdinfo --json");
    let export = &info["exports"][0];
    assert_eq!(export["is_read_only"], true, "{info}");
    let description = export["description"].as_str().unwrap_or_default();
    assert!(description.contains("IMAGE@NAME"), "{description}");

    let out = run_tool(dir, "qemu-io", &["-f", "raw", "-c", "write -P 7 0 64k", &uri]);
    assert!(!out.status.success(), "qemu-io wrote:\n{}", out.all());
    eprintln!("qemu-io's write to the anonymous export: {}", out.all());
    // Golden data is not zeroes: the read succeeds and the zero pattern does not match.
    let out = run_tool(dir, "qemu-io", &["-r", "-f", "raw", "-c", "read -P 0 0 64k", &uri]);
    assert!(out.stdout.contains("Pattern verification failed"), "golden data is not zeroes: {}", out.all());

    let mut client = Client::connect(&host.uri("")).expect("anonymous connection");
    let error = client.write(0, &[7; 4096], false).expect_err("an anonymous write");
    eprintln!("the anonymous write ended with: {error}");
    assert_same(&read_start(&mut client, 1 << 20), &host.golden_bytes[..1 << 20], "anonymous read");
    drop(client);

    let log = server.log_text();
    assert!(log.contains("anonymous connection"), "{log}");
    let serving = log.lines().find(|l| l.contains("serving")).unwrap_or_default();
    assert!(serving.contains(&format!("nbd+unix:///@NAME?socket={}", host.socket.display())), "{serving}");
    assert!(host.states().is_empty(), "an anonymous connection is no listed VM");
    host.assert_golden_untouched();
}

/// `--idle-timeout` cuts a quiet VM (paused, suspended), which is not gone: its overlay waits
/// for its client past the reconnect grace, in this server and the next ones (the ledger says
/// it was cut), and resumes with what it wrote.
#[test]
fn a_vm_cut_for_idleness_waits_past_its_grace_and_resumes() {
    let host = Host::new();
    let flags = ["--reconnect-grace", "1s", "--idle-timeout", "1"];
    let mut server = host.serve(&flags);
    let mut client = host.connect("sleeper");
    let written = write_pattern(&mut client, 15);
    let deadline = Instant::now() + WAIT;
    while !server.log_text().contains("cut for idleness") {
        assert!(Instant::now() < deadline, "never cut:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(client);
    let waits_past_its_grace = |when: &str| {
        // Three times its grace.
        std::thread::sleep(Duration::from_secs(3));
        assert_eq!(host.states(), [("sleeper".to_owned(), "in-grace".to_owned())], "{when}");
        let (ok, table) = host.vm_command(&["list"]);
        assert!(ok && table.contains("idleness"), "{when}: {table}");
    };
    waits_past_its_grace("cut");
    // A next server (an upgrade, a crash) keeps it waiting with no end too: its guest is still
    // paused, and a grace meant for lost connections would lose its writes.
    server.stop();
    server = host.serve(&flags);
    waits_past_its_grace("after a SIGTERM restart");
    server.kill();
    let _server = host.serve(&flags);
    waits_past_its_grace("after a SIGKILL restart");
    let mut again = host.connect("sleeper");
    assert_same(&read_start(&mut again, WRITTEN_BYTES), &written, "resumed after the idle cut");
    again.disconnect().expect("disconnect");
    host.wait_for_states(&[]);
}

/// Without a grace a VM's writes live only as long as its overlay, and a server that ends
/// while it is connected, stopped (SIGTERM: the drain closes its connection) or killed, takes
/// them along: the next server refuses the name until `vm reset`, never serving it the golden
/// image in place of what it wrote. A VM that only read reconnects freely.
#[test]
fn without_grace_a_writer_connected_when_the_server_ends_is_refused_until_reset() {
    for stop in ["SIGTERM", "SIGKILL"] {
        let host = Host::new();
        let mut server = host.serve(&["--reconnect-grace", "0"]);
        let mut writer = host.connect("writer");
        write_pattern(&mut writer, 60);
        let mut reader = host.connect("reader");
        read_start(&mut reader, 1 << 20);
        if stop == "SIGTERM" {
            server.stop();
        } else {
            server.kill();
        }
        drop((writer, reader));

        let server = host.serve(&["--reconnect-grace", "0"]);
        let refused = Client::connect(&host.uri("writer"));
        assert!(refused.is_err(), "{stop}: the writer was served after its writes were lost");
        assert_eq!(host.states(), [("writer".to_owned(), "lost".to_owned())], "{stop}");
        host.assert_reads_golden("reader", 1 << 20, "the reader, which never wrote");
        let (ok, text) = host.vm_command(&["reset", "writer"]);
        assert!(ok, "{text}");
        host.assert_reads_golden("writer", 1 << 20, "after reset");
        drop(server);
        host.assert_golden_untouched();
    }
}

#[test]
fn vm_reset_and_drop_end_overlays_and_the_next_connection_sees_golden_data() {
    let host = Host::new();
    let server = host.serve(&["--reconnect-grace", "1m", "--request-timeout", "3"]);
    for vm in ["a", "b"] {
        let mut client = host.connect(vm);
        write_pattern(&mut client, 20);
        drop(client);
    }
    let mut connected = host.connect("c");
    write_pattern(&mut connected, 21);
    host.wait_for_states(&[("a", "in-grace"), ("b", "in-grace"), ("c", "connected")]);
    let (ok, table) = host.vm_command(&["list"]);
    assert!(ok && table.contains("in-grace") && table.contains("connected"), "{table}");

    // drop refuses a connected VM; reset takes it away at its next request, or sooner.
    let (ok, text) = host.vm_command(&["drop", "c"]);
    assert!(!ok && text.contains("connected"), "{text}");
    let (ok, text) = host.vm_command(&["drop", "a"]);
    assert!(ok, "{text}");
    let (ok, text) = host.vm_command(&["reset", "b"]);
    assert!(ok, "{text}");
    let (ok, text) = host.vm_command(&["reset", "c"]);
    assert!(ok, "{text}");
    let (ok, text) = host.vm_command(&["reset", "nobody"]);
    assert!(!ok && text.contains("no VM named"), "{text}");
    // c sends nothing: its connection closes at the next wake-up of its wait (a third of the
    // request timeout), and a request after that finds it closed.
    host.wait_for_states(&[]);
    let mut buf = vec![0; 4096];
    let error = connected.read(0, &mut buf).expect_err("a reset VM's connection is closed");
    eprintln!("the reset VM's read ended with: {error}");
    for vm in ["a", "b", "c"] {
        host.assert_reads_golden(vm, 1 << 20, vm);
    }
    assert!(spill_files(host.dir.path()).is_empty() || server.log_text().contains("cache is dropped"));
    host.assert_golden_untouched();
}

/// Waits (at most [`WAIT`]) until `left` lists no file: a VM's files go as it leaves the VM
/// list, a moment after its client has gone.
fn wait_for_files_to_go(left: impl Fn() -> Vec<PathBuf>) {
    let deadline = Instant::now() + WAIT;
    while !left().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_killed_server_and_a_stopped_one_hand_every_vm_to_the_next() {
    let host = Host::new();
    let server = host.serve(&[]);
    let mut writer = host.connect("writer");
    let written = write_pattern(&mut writer, 30);
    let mut reader = host.connect("reader");
    read_start(&mut reader, 1 << 20);
    server.kill();
    drop((writer, reader));

    // A crash: the next server rebuilds both overlays and waits for their clients.
    let mut server = host.serve(&[]);
    host.wait_for_states(&[("reader", "in-grace"), ("writer", "in-grace")]);
    // The ledger names the server that holds the rebuilt VM now, not the one that crashed.
    let ledger = std::fs::read(host.dir.path().join("spill/state/vm-writer.json")).expect("the writer's ledger file");
    let ledger: Value = serde_json::from_slice(&ledger).expect("JSON");
    assert_eq!(ledger["pid"].as_u64(), Some(u64::from(server.child.id())), "{ledger}");
    let mut writer = host.connect("writer");
    assert_same(&read_start(&mut writer, WRITTEN_BYTES), &written, "the writer's data after a crash");
    // More writes, half over the old ones, then a planned stop (SIGTERM) with the VM connected.
    let more = pseudo_random(WRITTEN_BYTES, 31);
    for (i, chunk) in more.chunks(64 << 10).enumerate() {
        writer.write((WRITTEN_BYTES / 2 + i * (64 << 10)) as u64, chunk, false).expect("write");
    }
    server.stop();
    drop((writer, server));
    let server = host.serve(&[]);
    host.wait_for_states(&[("reader", "in-grace"), ("writer", "in-grace")]);
    let mut writer = host.connect("writer");
    let back = read_start(&mut writer, WRITTEN_BYTES + WRITTEN_BYTES / 2);
    assert_same(&back[..WRITTEN_BYTES / 2], &written[..WRITTEN_BYTES / 2], "the first writes after a restart");
    assert_same(&back[WRITTEN_BYTES / 2..], &more, "the later writes after a restart");
    writer.disconnect().expect("disconnect");
    host.assert_reads_golden("reader", 1 << 20, "the reader, which never wrote");
    host.wait_for_states(&[]);
    // (On a busy machine the server was once killed before the files went.)
    let memory = || -> Vec<PathBuf> {
        std::fs::read_dir(host.dir.path().join("memory")).expect("memory dir").flatten().map(|e| e.path()).collect()
    };
    wait_for_files_to_go(memory);
    drop(server);
    assert!(memory().is_empty(), "state files left after every VM ended: {:?}", memory());
    host.assert_golden_untouched();
}

/// A server started the instant its predecessor was SIGKILLed finds it still exiting (the
/// kernel tears down a process's memory, here hundreds of MiB of pages, before its sockets:
/// they accept, and its pid lives), waits for it rather than refusing to start or giving up
/// its VMs, and serves the VM's data back: RAM tier and spill alike.
#[test]
fn a_server_started_the_instant_its_predecessor_is_killed_serves_the_vm_back() {
    const DISK: usize = 288 << 20;
    const WRITTEN: usize = 256 << 20;
    let host = Host::with_disk(DISK);
    let server = host.serve(&["--ram", "128M"]);
    let mut client = host.connect("big");
    let written = pseudo_random(WRITTEN, 40);
    for (i, chunk) in written.chunks(1 << 20).enumerate() {
        client.write((i << 20) as u64, chunk, false).expect("write");
    }
    assert!(!spill_files(host.dir.path()).is_empty(), "half of it spilled");
    let killed = Command::new("kill").args(["-KILL", &server.child.id().to_string()]).status().expect("kill");
    assert!(killed.success());
    // At once, the old one unreaped: ready once it says it serves (the old socket may accept).
    let log = host.dir.path().join("server.log");
    let listen = format!("unix:{}", host.socket.display());
    let args = ["--base", host.golden.to_str().expect("utf-8"), "--listen", &listen, "--ram", "128M"];
    let next = Serve::start_named_only(host.dir.path(), &args, &[], || {
        std::fs::read_to_string(&log).is_ok_and(|text| text.contains("serving"))
    });
    drop((client, server));
    eprintln!("the new server's start:\n{}", next.log_text().lines().take(12).collect::<Vec<_>>().join("\n"));
    let mut again = host.connect("big");
    assert_same(&read_start(&mut again, WRITTEN), &written, "the VM after a restart at once");
    again.disconnect().expect("disconnect");
    host.wait_for_states(&[]);
    drop(next);
    host.assert_golden_untouched();
}

/// Every mode's VM survives a killed server: `ram` (pages only), and the in-place modes, whose
/// cache file (`disk`: in the spill directory, `shared`: in the shared one) is rebuilt from the
/// data it holds, with zeroed ranges from the zero log. A clean end removes every file.
#[test]
fn a_vm_in_every_mode_survives_a_killed_server() {
    for mode in ["ram", "disk", "shared"] {
        let host = Host::new();
        let shared = host.dir.path().join("shared");
        std::fs::create_dir_all(&shared).expect("shared dir");
        let args = ["--mode", mode, "--shared-dir", shared.to_str().expect("utf-8"), "--ram", "16M"];
        let server = host.serve(&args);
        let mut writer = host.connect("writer");
        let mut written = write_pattern(&mut writer, 40);
        // Zeroed blocks are holes in an in-place cache file: only the zero log tells them from
        // golden ones.
        writer.write_zeroes(1 << 20, 256 << 10, false).expect("zero");
        written[1 << 20..(1 << 20) + (256 << 10)].fill(0);
        server.kill();
        drop(writer);

        let server = host.serve(&args);
        host.wait_for_states(&[("writer", "in-grace")]);
        let mut writer = host.connect("writer");
        assert_same(&read_start(&mut writer, WRITTEN_BYTES), &written, &format!("mode {mode}: after a crash"));
        let golden_tail = read_start(&mut writer, WRITTEN_BYTES + (1 << 20));
        assert_same(&golden_tail[WRITTEN_BYTES..], &host.golden_bytes[WRITTEN_BYTES..WRITTEN_BYTES + (1 << 20)], mode);
        writer.disconnect().expect("disconnect");
        host.wait_for_states(&[]);
        // The overlay leaves the registry first and its files go as it drops, just after.
        let left = || -> Vec<PathBuf> {
            ["memory", "spill", "shared"]
                .iter()
                .flat_map(|dir| std::fs::read_dir(host.dir.path().join(dir)).into_iter().flatten().flatten())
                .map(|e| e.path())
                .filter(|p| p.to_string_lossy().contains("vm-writer"))
                .collect()
        };
        wait_for_files_to_go(left);
        drop(server);
        assert!(left().is_empty(), "mode {mode}: the VM's files are left after its clean end: {:?}", left());
        host.assert_golden_untouched();
    }
}

#[test]
fn state_a_server_cannot_recover_refuses_the_name_until_reset() {
    let host = Host::new();
    let server = host.serve(&[]);
    let mut writer = host.connect("writer");
    write_pattern(&mut writer, 30);
    server.kill();
    drop(writer);
    std::fs::write(host.dir.path().join("memory/vm-writer.zeros"), b"garbage").expect("corrupt the zero log");

    let server = host.serve(&[]);
    let uri = |vm: &str| format!("nbd+unix:///@{vm}?socket={}", host.socket.display());
    let out = run_tool(host.dir.path(), "nbdinfo", &["--size", &uri("writer")]);
    assert!(!out.status.success(), "a VM whose state was not recovered was served:\n{}", out.all());
    assert!(out.all().contains("policy"), "refused by policy:\n{}", out.all());
    let deadline = Instant::now() + WAIT;
    while !server.log_text().contains("vm reset writer") {
        assert!(Instant::now() < deadline, "the refusal says what to do:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(host.states().iter().find(|(vm, _)| vm == "writer").map(|(_, s)| s.as_str()), Some("lost"));
    let (ok, text) = host.vm_command(&["reset", "writer"]);
    assert!(ok, "{text}");
    assert!(!host.dir.path().join("memory/vm-writer.pages").exists(), "reset removes the state files");
    host.assert_reads_golden("writer", 1 << 20, "after reset");
    drop(server);
    host.assert_golden_untouched();
}

/// A server killed while it made a VM's state files (the ledger names them first, then they
/// are made, the zero log's header last) leaves a VM that served nothing: the next server
/// removes what was made and serves the name afresh, rather than refuse it as lost. The kill
/// is set back by hand into that window: the ledger file says "making", the zero log has no
/// header yet. A VM whose overlay stood is rebuilt beside it.
#[test]
fn a_vm_whose_state_a_killed_server_was_still_making_starts_afresh() {
    let host = Host::new();
    let server = host.serve(&[]);
    let mut made = host.connect("made");
    read_start(&mut made, 1 << 20);
    let mut writer = host.connect("writer");
    let written = write_pattern(&mut writer, 32);
    let ledger_path = host.dir.path().join("spill/state/vm-made.json");
    let ledger: Value = serde_json::from_slice(&std::fs::read(&ledger_path).expect("ledger file")).expect("JSON");
    assert!(ledger.get("making").is_none(), "a VM that is served is made: {ledger}");
    server.kill();
    drop((made, writer));
    let mut ledger = ledger;
    ledger["making"] = Value::Bool(true);
    std::fs::write(&ledger_path, serde_json::to_vec(&ledger).expect("JSON")).expect("ledger file");
    let zeros = host.dir.path().join("memory/vm-made.zeros");
    std::fs::File::options().write(true).open(&zeros).and_then(|f| f.set_len(0)).expect("cut the zero log");

    let server = host.serve(&[]);
    host.wait_for_states(&[("writer", "in-grace")]);
    assert!(!zeros.exists() && !ledger_path.exists(), "what was made is removed, the ledger file too");
    host.assert_reads_golden("made", 1 << 20, "a VM started afresh");
    let mut writer = host.connect("writer");
    assert_same(&read_start(&mut writer, WRITTEN_BYTES), &written, "the VM that was made, rebuilt");
    assert!(!server.log_text().contains("cannot be recovered"), "{}", server.log_text());
    drop((writer, server));
    host.assert_golden_untouched();
}

/// A ledger file that cannot be read (torn by a host crash, edited by hand) says nothing of its
/// VM's files: the name is refused until reset, and the reset removes the files this server
/// makes for that name (a new VM never takes over files no ledger file names).
#[test]
fn an_unreadable_ledger_file_refuses_the_name_and_a_reset_frees_it() {
    let host = Host::new();
    let server = host.serve(&[]);
    let mut writer = host.connect("writer");
    write_pattern(&mut writer, 31);
    server.kill();
    drop(writer);
    let ledger = host.dir.path().join("spill/state/vm-writer.json");
    assert!(ledger.exists(), "the writer's ledger file");
    std::fs::write(&ledger, b"{ torn").expect("tear the ledger file");

    let server = host.serve(&[]);
    assert_eq!(host.states().iter().find(|(vm, _)| vm == "writer").map(|(_, s)| s.as_str()), Some("lost"));
    let (ok, text) = host.vm_command(&["reset", "writer"]);
    assert!(ok, "{text}");
    assert!(!host.dir.path().join("spill/vm-writer.spill").exists(), "reset removes the spill file");
    host.assert_reads_golden("writer", 1 << 20, "after reset");
    drop(server);
    host.assert_golden_untouched();
}

/// A recovered VM goes on over the golden image its writes were made over: the version it had
/// even when another is current now, and never a file that changed under it (that name is
/// refused instead).
#[test]
fn a_recovered_vm_keeps_its_image_version_and_a_changed_image_refuses_it() {
    let host = Host::new();
    let store = host.dir.path().join("images");
    let image = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
            .arg("image")
            .arg("--images")
            .arg(&store)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("overspill image");
        assert!(out.status.success(), "image {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    image(&["publish", "win", host.golden.to_str().expect("utf-8"), "--activate"]);
    let serve = || host.serve(&["--images", store.to_str().expect("utf-8")]);
    let uri = |export: &str| -> NbdUri {
        format!("nbd+unix:///{export}?socket={}", host.socket.display()).parse().expect("uri")
    };
    let connect = |export: &str| Client::connect(&uri(export)).unwrap_or_else(|e| panic!("{export}: {e}"));

    let server = serve();
    let mut desk = connect("win@desk");
    let written = write_pattern(&mut desk, 40);
    let mut writer = host.connect("writer");
    write_pattern(&mut writer, 41);
    // A VM that only read: its state files exist (made at connect) and hold nothing of its own.
    let mut reader = host.connect("reader");
    read_start(&mut reader, 1 << 20);
    server.kill();
    drop((desk, writer, reader));

    // v2, half the size, becomes current, and the file under --base is rewritten with the same
    // bytes (a new modification time: `cp` over it would keep its inode and size too).
    let v2 = pseudo_random(GOLDEN_BYTES / 2, 42);
    let v2_file = host.dir.path().join("v2.img");
    std::fs::write(&v2_file, &v2).expect("v2");
    image(&["publish", "win", v2_file.to_str().expect("utf-8"), "--activate"]);
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(&host.golden, &host.golden_bytes).expect("rewrite the base image");

    let server = serve();
    let mut desk = connect("win@desk");
    let len = WRITTEN_BYTES + (4 << 20);
    let seen = read_start(&mut desk, len);
    assert_same(&seen[..WRITTEN_BYTES], &written, "desk's writes after the restart");
    assert_same(&seen[WRITTEN_BYTES..], &host.golden_bytes[WRITTEN_BYTES..len], "desk's unwritten blocks: still v1");
    // The size told at the handshake is v1's too, or the end of desk's disk is out of reach.
    assert_eq!(desk.size(), GOLDEN_BYTES as u64, "desk's disk keeps v1's size");
    let mut tail = vec![0; 1 << 20];
    desk.read((GOLDEN_BYTES - tail.len()) as u64, &mut tail).expect("desk reads the end of its disk");
    assert_same(&tail, &host.golden_bytes[GOLDEN_BYTES - tail.len()..], "the end of desk's disk: v1");
    desk.disconnect().expect("disconnect");
    let mut fresh = connect("win@fresh");
    assert_eq!(fresh.size(), v2.len() as u64, "a new VM's disk has v2's size");
    assert_same(&read_start(&mut fresh, 1 << 20), &v2[..1 << 20], "a new VM gets v2");
    fresh.disconnect().expect("disconnect");

    let writer_uri = format!("nbd+unix:///@writer?socket={}", host.socket.display());
    let out = run_tool(host.dir.path(), "nbdinfo", &["--size", &writer_uri]);
    assert!(!out.status.success(), "a VM whose base image changed was served:\n{}", out.all());
    let deadline = Instant::now() + WAIT;
    while !server.log_text().contains("no longer the image its writes were made over") {
        assert!(Instant::now() < deadline, "the refusal says why:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    // The VM that only read lost nothing: it is not refused, and reads the image as it is now.
    let mut reader = host.connect("reader");
    assert_same(&read_start(&mut reader, 1 << 20), &host.golden_bytes[..1 << 20], "the reader after the change");
    reader.disconnect().expect("disconnect");
    server.wait_log("had written nothing: it starts afresh");
    drop(server);
    host.assert_golden_untouched();
}

/// One qemu-io session, with `reconnect-delay`, across a SIGKILL of the server and a restart:
/// what it wrote before reads back after, from the same client.
#[test]
fn one_qemu_io_session_rides_through_a_killed_and_restarted_server() {
    use std::io::{BufRead, BufReader, Write};
    let host = Host::new();
    let server = host.serve(&[]);
    let image =
        format!("driver=nbd,server.type=unix,server.path={},export=@qvm,reconnect-delay=30", host.socket.display());
    let mut qemu = Command::new("qemu-io")
        .args(["--image-opts", &image])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-io");
    let mut input = qemu.stdin.take().expect("stdin");
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    let stdout = qemu.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let mut command = |text: &str, expect: &str| -> Vec<String> {
        writeln!(input, "{text}").expect("qemu-io command");
        let mut seen = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let line = lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|_| panic!("qemu-io: no {expect:?} after {text:?}; saw {seen:?}"));
            let done = line.contains(expect);
            seen.push(line);
            if done {
                return seen;
            }
        }
    };
    // 4 MiB (past the 1 MiB RAM target: spilled) and a block far out in RAM.
    // Each command's last line is its timing ("... ops; ...").
    command("write -P 0xab 0 4M", "ops;");
    command("write -P 0xcd 16M 4k", "ops;");
    server.kill();
    let _server = host.serve(&[]);
    for (read, len) in [("read -P 0xab 0 4M", "read 4194304/4194304"), ("read -P 0xcd 16M 4k", "read 4096/4096")] {
        let seen = command(read, "ops;");
        assert!(!seen.iter().any(|l| l.contains("verification failed")), "{read} after the restart: {seen:?}");
        assert!(seen.iter().any(|l| l.contains(len)), "{read}: {seen:?}");
    }
    command("quit", "");
    drop(input);
    let _ = qemu.wait();
    host.assert_golden_untouched();
}

#[test]
fn vm_names_outside_the_syntax_are_refused_at_the_handshake() {
    let host = Host::new();
    let server = host.serve(&[]);
    for bad in ["..", "../../../../tmp/pwned", ".hidden", "a%20b", "x%0Afake%20log%20line"] {
        let uri = format!("nbd+unix:///@{bad}?socket={}", host.socket.display());
        let out = run_tool(host.dir.path(), "nbdinfo", &["--size", &uri]);
        assert!(!out.status.success(), "VM name {bad:?} was served:\n{}", out.all());
        assert!(out.all().contains("policy"), "{bad:?}:\n{}", out.all());
    }
    assert!(!Path::new("/tmp/pwned").exists());
    // Log lines reach the file through the server's log queue: give the last one a moment.
    let deadline = Instant::now() + WAIT;
    while server.log_text().matches("is not allowed").count() < 5 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = server.log_text();
    assert_eq!(log.matches("is not allowed").count(), 5, "each refusal logged with the name quoted:\n{log}");
    assert!(!log.lines().any(|line| line.starts_with("fake log line")), "a name forged a log line:\n{log}");
}

/// qemu-io, the real client: a QEMU that dies (SIGKILL, no NBD_CMD_DISC) leaves its overlay to
/// the next QEMU for the same VM, which reads back every pattern it wrote.
#[test]
fn qemu_io_killed_mid_session_and_a_new_one_reads_back_what_it_wrote() {
    let host = Host::new();
    let _server = host.serve(&["--reconnect-grace", "1m"]);
    let image = format!("driver=nbd,server.type=unix,server.path={},export=@qvm", host.socket.display());
    // 4 MiB of 0xab (past the 1 MiB RAM target: spilled), 4 KiB of 0xcd at 16 MiB, then qemu-io
    // kills itself (SIGKILL): no NBD_CMD_DISC, as when QEMU crashes.
    let out = run_tool(
        host.dir.path(),
        "qemu-io",
        &["--image-opts", &image, "-c", "write -P 0xab 0 4M", "-c", "write -P 0xcd 16M 4k", "-c", "sigraise 9"],
    );
    assert!(out.stdout.matches("wrote").count() == 2, "{}", out.all());
    host.wait_for_states(&[("qvm", "in-grace")]);
    let holder = host.connect("qvm");
    let second = run_tool(host.dir.path(), "qemu-io", &["--image-opts", &image, "-c", "read 0 4k"]);
    assert!(!second.status.success(), "a second QEMU for a live VM was let in:\n{}", second.all());
    drop(holder);
    host.wait_for_states(&[("qvm", "in-grace")]);

    let out = run_tool(
        host.dir.path(),
        "qemu-io",
        &["--image-opts", &image, "-c", "read -P 0xab 0 4M", "-c", "read -P 0xcd 16M 4k"],
    );
    assert!(out.status.success(), "{}", out.all());
    assert!(!out.stdout.contains("Pattern verification failed"), "the resumed VM saw other data:\n{}", out.all());
    let verification_failed = out.stdout.matches("Pattern verification failed").count();
    assert_eq!(verification_failed, 0);
    host.assert_golden_untouched();
}

/// SIGHUP (`systemctl reload`): the server drains, hands every VM over and becomes a new server
/// in the same process; the VM reconnects by name to its writes.
#[test]
fn sighup_restarts_the_server_in_place_and_vms_resume() {
    let host = Host::new();
    let server = host.serve(&[]);
    let pid = server.child.id();
    let mut writer = host.connect("writer");
    let written = write_pattern(&mut writer, 50);
    let hup = Command::new("kill").args(["-HUP", &pid.to_string()]).status().expect("kill");
    assert!(hup.success());
    drop(writer);
    let deadline = Instant::now() + WAIT;
    while server.log_text().matches("serving").count() < 2 {
        assert!(Instant::now() < deadline, "no second serving line after SIGHUP:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    server.wait_log("restarting in place");
    host.wait_for_states(&[("writer", "in-grace")]);
    let mut writer = host.connect("writer");
    assert_same(&read_start(&mut writer, WRITTEN_BYTES), &written, "after SIGHUP");
    writer.disconnect().expect("disconnect");
    let mut server = server;
    server.assert_running();
    assert_eq!(server.child.id(), pid);
    drop(server);
    host.assert_golden_untouched();
}

/// An upgrade that flips a link (a versioned install directory, `update-alternatives`): SIGHUP
/// runs what the path the server was started by names now, the new release, not the file the
/// link resolved to at start.
#[test]
fn sighup_runs_the_release_the_start_path_names_now() {
    use std::os::unix::fs::{symlink, PermissionsExt};
    let host = Host::new();
    let dir = host.dir.path();
    let installed = dir.join("overspill");
    symlink(env!("CARGO_BIN_EXE_overspill"), &installed).expect("link to the first release");
    let listen = format!("unix:{}", host.socket.display());
    let args = ["--base", host.golden.to_str().expect("utf-8"), "--listen", &listen, "--ram", "1M"];
    let socket = host.socket.clone();
    let server =
        Serve::start_as(&installed, dir, &args, move || std::os::unix::net::UnixStream::connect(&socket).is_ok());
    let mut writer = host.connect("writer");
    let written = write_pattern(&mut writer, 52);
    drop(writer);

    // The "next release": a program that leaves a mark, then runs the binary.
    let marker = dir.join("next-release-ran");
    let next = dir.join("next-release");
    let script =
        format!("#!/bin/sh\necho \"$$\" > '{}'\nexec '{}' \"$@\"\n", marker.display(), env!("CARGO_BIN_EXE_overspill"));
    std::fs::write(&next, script).expect("next release");
    std::fs::set_permissions(&next, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let flipping = dir.join("overspill.new");
    symlink(&next, &flipping).expect("new link");
    std::fs::rename(&flipping, &installed).expect("flip the link");

    let pid = server.child.id();
    let hup = Command::new("kill").args(["-HUP", &pid.to_string()]).status().expect("kill");
    assert!(hup.success());
    let deadline = Instant::now() + WAIT;
    while server.log_text().matches("serving").count() < 2 {
        assert!(Instant::now() < deadline, "no second serving line after SIGHUP:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    let ran = std::fs::read_to_string(&marker).unwrap_or_else(|_| {
        panic!("the restart ran the release the link named at start, not the one it names now:\n{}", server.log_text())
    });
    assert_eq!(ran.trim(), pid.to_string(), "the next release ran as another process");
    let mut writer = host.connect("writer");
    assert_same(&read_start(&mut writer, WRITTEN_BYTES), &written, "after the upgrade");
    writer.disconnect().expect("disconnect");
    let mut server = server;
    server.assert_running();
}

/// Reloads asked for faster than the server restarts (a script, an impatient operator): one
/// during a drain joins it, one while the new program starts is ignored (SIGHUP's default action
/// would end the process there); none ends the server or a VM's writes.
#[test]
fn a_burst_of_reloads_never_ends_the_server() {
    const RELOAD_BEGUN: &str = "SIGHUP: draining connections";
    let host = Host::new();
    let server = host.serve(&[]);
    let pid = server.child.id();
    let mut writer = host.connect("writer");
    let written = write_pattern(&mut writer, 51);
    drop(writer);
    let burst_end = Instant::now() + Duration::from_secs(2);
    while Instant::now() < burst_end {
        let hup = Command::new("kill").args(["-HUP", &pid.to_string()]).status().expect("kill");
        assert!(hup.success(), "the server ended during the burst:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(3));
    }
    let mut server = server;
    // The last reload done: one program serving more than restarts begun, and still so a
    // moment later (a reload that waited for the program's start is logged as it begins).
    let deadline = Instant::now() + WAIT;
    let settled = |log: &str| log.matches("serving").count() > log.matches(RELOAD_BEGUN).count();
    loop {
        server.assert_running();
        if settled(&server.log_text()) {
            std::thread::sleep(Duration::from_millis(500));
            if settled(&server.log_text()) {
                break;
            }
        }
        assert!(Instant::now() < deadline, "not serving after the burst:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    let restarts = server.log_text().matches(RELOAD_BEGUN).count();
    assert!(restarts >= 2, "{restarts} restarts:\n{}", server.log_text());
    let mut writer = host.connect("writer");
    assert_same(&read_start(&mut writer, WRITTEN_BYTES), &written, "after a burst of reloads");
    writer.disconnect().expect("disconnect");
    server.assert_running();
    assert_eq!(server.child.id(), pid);
}

/// Every ledger entry says the format of the VM's state. A server reads the previous format
/// (an upgrade: entries without the field, as every server before it wrote them; the files they
/// name are laid out as today's) and refuses, by name, a format it does not know (state of a
/// newer release, after a downgrade), keeping its files: never a guess. The entries are those a
/// killed server of this test left, rewritten here, since an entry names this boot, pids and
/// paths and cannot be stored as a fixture.
#[test]
fn a_server_reads_the_previous_state_format_and_refuses_an_unknown_one() {
    let host = Host::new();
    let server = host.serve(&[]);
    let mut old = host.connect("old");
    let written = write_pattern(&mut old, 70);
    let mut future = host.connect("future");
    write_pattern(&mut future, 71);
    server.kill();
    drop((old, future));

    let ledger = |vm: &str| host.dir.path().join(format!("spill/state/vm-{vm}.json"));
    let rewrite = |vm: &str, format: Option<u64>| {
        let mut entry: Value = serde_json::from_slice(&std::fs::read(ledger(vm)).expect("ledger file")).expect("JSON");
        assert_eq!(entry["format"], 2, "{vm}: written in today's format: {entry}");
        let fields = entry.as_object_mut().expect("an object");
        match format {
            Some(format) => fields.insert("format".into(), format.into()),
            None => fields.remove("format"),
        };
        std::fs::write(ledger(vm), serde_json::to_vec(&entry).expect("JSON")).expect("rewriting");
    };
    rewrite("old", None);
    rewrite("future", Some(99));

    let server = host.serve(&[]);
    host.wait_for_states(&[("future", "lost"), ("old", "in-grace")]);
    let mut old = host.connect("old");
    assert_same(&read_start(&mut old, WRITTEN_BYTES), &written, "state of the previous format");
    old.disconnect().expect("disconnect");
    assert_refused_as_lost(&host, "future");
    let (ok, listed) = host.vm_command(&["list"]);
    assert!(ok && listed.contains("format 99"), "{listed}");
    assert!(host.dir.path().join("memory/vm-future.pages").exists(), "the unknown format's files are kept");
    let (ok, text) = host.vm_command(&["reset", "future"]);
    assert!(ok, "{text}");
    host.assert_reads_golden("future", 1 << 20, "after reset");
    drop(server);
    host.assert_golden_untouched();
}

/// The same with QEMU's own NBD client: a qemu-io that wrote (spilling) and died without
/// NBD_CMD_DISC does not come back within the grace, and the next QEMU for that VM, with
/// `reconnect-delay` as libvirt sets it, cannot open the disk; it is told the VM's writes were
/// lost, and is never served golden data. After `vm reset` it opens the golden image.
#[test]
fn qemu_io_back_after_its_grace_is_refused_by_name() {
    let host = Host::new();
    let server = host.serve(&["--reconnect-grace", "1s"]);
    let image =
        format!("driver=nbd,server.type=unix,server.path={},export=@late,reconnect-delay=5", host.socket.display());
    let out =
        run_tool(host.dir.path(), "qemu-io", &["--image-opts", &image, "-c", "write -P 0xab 0 4M", "-c", "sigraise 9"]);
    assert!(out.stdout.contains("wrote"), "{}", out.all());
    host.wait_for_states(&[("late", "lost")]);
    let late = run_tool(host.dir.path(), "qemu-io", &["--image-opts", &image, "-c", "read -P 0xab 0 4M"]);
    assert!(!late.status.success(), "a VM past its grace was served:\n{}", late.all());
    assert!(!late.stdout.contains("read "), "it read something:\n{}", late.all());
    assert!(late.stderr.contains("VM late had writes that were lost"), "told why:\n{}", late.all());
    server.wait_log("VM refused");
    let (ok, text) = host.vm_command(&["reset", "late"]);
    assert!(ok, "{text}");
    let fresh = run_tool(host.dir.path(), "qemu-io", &["--image-opts", &image, "-c", "read -P 0xab 0 4k"]);
    assert!(fresh.stdout.contains("Pattern verification failed"), "after reset, golden data:\n{}", fresh.all());
    host.assert_golden_untouched();
}

/// A VM whose server was alive when the next one started (stopped, say, and killed later) is
/// skipped at that start; once its server is gone, the VM's client gets it rebuilt at its
/// connection, and `vm reset` of such a VM gives its state up (the libvirt hook resets every VM
/// at a domain's start, and a fresh power-on must not boot into the old session's writes).
#[test]
fn a_vm_whose_server_outlived_the_next_ones_start_is_adopted_at_connect_or_reset() {
    let host = Host::new();
    let first = host.serve(&[]);
    let mut kept = host.connect("kept");
    let written = write_pattern(&mut kept, 80);
    let mut given_up = host.connect("given-up");
    write_pattern(&mut given_up, 81);
    let pid = first.child.id().to_string();
    assert!(Command::new("kill").args(["-STOP", &pid]).status().expect("kill").success());
    // Its sockets still accept: the next server gets others (its own control socket too).
    let socket = host.dir.path().join("second.sock");
    let control = host.dir.path().join("second-control.sock");
    let listen = format!("unix:{}", socket.display());
    let args = [
        "--base",
        host.golden.to_str().expect("utf-8"),
        "--listen",
        &listen,
        "--control",
        control.to_str().expect("utf-8"),
        "--ram",
        "1M",
    ];
    let ready = socket.clone();
    let second = Serve::start_named_only(host.dir.path(), &args, &[], move || {
        std::os::unix::net::UnixStream::connect(&ready).is_ok()
    });
    assert!(Command::new("kill").args(["-KILL", &pid]).status().expect("kill").success());
    drop((first, kept, given_up));

    let reset = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["vm", "--control", control.to_str().expect("utf-8"), "reset", "given-up"])
        .output()
        .expect("vm reset");
    assert!(reset.status.success(), "{}", String::from_utf8_lossy(&reset.stderr));
    let uri = |vm: &str| -> NbdUri { format!("nbd+unix:///@{vm}?socket={}", socket.display()).parse().expect("uri") };
    let mut client = Client::connect(&uri("kept")).expect("the kept VM");
    assert_same(&read_start(&mut client, WRITTEN_BYTES), &written, "adopted at connect");
    client.disconnect().expect("disconnect");
    let mut client = Client::connect(&uri("given-up")).expect("the reset VM");
    assert_same(&read_start(&mut client, 1 << 20), &host.golden_bytes[..1 << 20], "reset, then golden");
    client.disconnect().expect("disconnect");
    let log = second.log_text();
    assert!(log.contains("adopted") && log.contains("reset by the operator"), "{log}");
    host.assert_golden_untouched();
}
