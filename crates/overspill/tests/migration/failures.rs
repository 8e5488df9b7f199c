//! Moves that meet trouble: either server SIGKILLed at the very steps of the switchover (held
//! there by `OVERSPILL_TEST_MOVE_PAUSE`), the peer link cut while both servers live, and the
//! peer link between hosts (TLS over TCP), which a server of another CA cannot use. In every
//! case the VM ends up at exactly one server with every acknowledged write.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{pseudo_random, Serve};
use crate::harness::*;

/// Side `name` of `pair`, the other its peer, holding each move at `step` for 3 s.
fn serve_pausing(pair: &Pair, name: &'static str, step: &str) -> Serve {
    let (this, other) = (pair.side(name), pair.side(if name == "a" { "b" } else { "a" }));
    let peer_listen = format!("unix:{}", this.peer_socket().display());
    let peer = format!("unix:{}", other.peer_socket().display());
    serve_side_with(&pair.golden, &this, [&peer_listen, &peer], "1M", &[], &[("OVERSPILL_TEST_MOVE_PAUSE", step)])
}

#[track_caller]
fn wait_for_log(server: &Serve, line: &str) {
    wait_for(&format!("{line:?} in the server's log"), || server.log_text().contains(line));
}

const PAUSED: &str = "move paused for a test";

/// The destination's write, which asks for the switchover, on a thread of its own while `kill`
/// waits for the move's test pause and SIGKILLs the destination's server: the write must not
/// have been acknowledged.
fn a_write_asking_while(destination: overspill_nbd::client::Client, kill: impl FnOnce()) {
    let asking = std::thread::spawn(move || {
        let mut destination = destination;
        destination.write(30 << 20, &[9; 4096], false).is_ok()
    });
    kill();
    assert!(!asking.join().expect("the destination's write"), "a write acknowledged by a killed destination");
}

/// The destination `b`, `a` its peer, its requests waiting 1 s at the gate (instead of 25).
fn serve_waiting_a_second(pair: &Pair, a: &Side, b: &Side) -> Serve {
    let peers = [a.peer_socket(), b.peer_socket()].map(|socket| format!("unix:{}", socket.display()));
    let wait = [("OVERSPILL_TEST_GATE_WAIT_MS", "1000")];
    serve_side_with(&pair.golden, b, [&peers[1], &peers[0]], "1M", &[], &wait)
}

/// Writes before the move (RAM and spill, a zeroed range; no TRIM, whose reads after a restart
/// are unspecified), and the destination's connection, whose move is in its pre-copy.
fn moving(pair: &Pair, a: &Side, b: &Side) -> (Model, overspill_nbd::client::Client, overspill_nbd::client::Client) {
    let mut model = Model(pair.golden_bytes.clone());
    let mut source = a.connect("desk");
    model.write(&mut source, 0, &pseudo_random(8 << 20, 11));
    model.zero(&mut source, 9 << 20, 1 << 20);
    let destination = b.connect("desk");
    writes_during_pre_copy(&mut model, &mut source);
    (model, source, destination)
}

/// The source killed after it sent its final delta, before the destination's `Ready` reached
/// it: its ledger never said moved, so the VM is its restart's. The destination, in doubt,
/// asks, hears that the source holds it, and takes it from there again; its write, which
/// asked for the switchover, waits through all of it and lands on the whole state.
#[test]
fn a_source_killed_at_its_final_delta_keeps_the_vm_and_the_destination_takes_it_again() {
    let log = source_killed_at("final");
    assert!(log.contains("VM move in doubt") && log.contains("begins again"), "not in doubt, then again:\n{log}");
}

/// A move whose source server is SIGKILLed at `step` of the switchover (and comes back a second
/// later, as systemd restarts it), the destination's write asking for the switchover meanwhile:
/// the VM ends up at the destination with every write, the restarted source holding nothing of
/// it. The destination's log.
fn source_killed_at(step: &str) -> String {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let server_a = serve_pausing(&pair, "a", step);
    let server_b = pair.serve("b");
    let (mut model, source, mut destination) = moving(&pair, &a, &b);
    let _server_a = std::thread::scope(|scope| {
        let restarted = scope.spawn(|| {
            wait_for_log(&server_a, PAUSED);
            server_a.kill();
            std::thread::sleep(Duration::from_secs(1));
            pair.serve("a")
        });
        model.write(&mut destination, 30 << 20, &pseudo_random(4096, 190));
        restarted.join().expect("restarted source")
    });
    drop(source);
    model.assert_reads_back(&mut destination, &format!("the destination after the source died at {step}"));
    assert_eq!(b.state_of("desk").as_deref(), Some("connected"));
    assert_eq!(a.state_of("desk"), None, "the restarted source kept a copy");
    // The VM ends at the destination (its guest powered off), and starts there afresh: the
    // source no longer says it sent the VM there (it was told the move settled), which refused
    // the name for good (until session 51).
    destination.disconnect().expect("the VM's end");
    wait_for("B ends the VM", || b.state_of("desk").is_none());
    let mut fresh = b.connect("desk");
    let mut back = vec![0u8; 4096];
    fresh.read(0, &mut back).expect("read");
    assert_eq!(&back[..], &pair.golden_bytes[..4096], "the fresh start read other than the golden image");
    pair.assert_golden_unchanged();
    server_b.log_text()
}

/// The same with QEMU: the migration completes and the source QEMU quits (its NBD_CMD_DISC is
/// the switchover, not the VM's end), and the source's server dies at its final delta. Its
/// restart holds the VM (in its grace), the destination takes it from there, and the
/// destination QEMU reads every write and writes on.
#[test]
fn a_qemu_migration_whose_source_server_dies_at_the_final_delta_ends_at_the_destination() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let server_a = serve_pausing(&pair, "a", "final");
    let server_b = pair.serve("b");
    let mut source = crate::qemu(&a, None);
    for write in ["write -P 0x11 0 4M", "write -P 0x22 4M 4M", "write -z 8M 1M"] {
        crate::qemu_io(&mut source, write);
    }
    let migration = pair.dir.path().join("migration.sock");
    let mut destination = crate::qemu(&b, Some(&migration));
    wait_for("B takes the VM in", || b.state_of("desk").as_deref() == Some("incoming"));
    source.execute(
        serde_json::json!({"execute": "migrate", "arguments": {"uri": format!("unix:{}", migration.display())}}),
    );
    crate::wait_migration(&mut source, "completed");
    drop(source.quit());
    wait_for_log(&server_a, PAUSED);
    server_a.kill();
    let _server_a = pair.serve("a");
    let reads = ["read -P 0x11 0 4M", "read -P 0x22 4M 4M", "read -P 0 8M 1M"];
    crate::qemu_io(&mut destination, "write -P 0x88 20M 1M");
    for read in reads {
        crate::qemu_io(&mut destination, read);
    }
    crate::qemu_io(&mut destination, "read -P 0x88 20M 1M");
    crate::assert_patterns_read(&destination.quit(), reads.len() + 1);
    assert_eq!(a.state_of("desk"), None, "the restarted source kept a copy");
    assert!(server_b.log_text().contains("begins again"), "B did not take the VM again:\n{}", server_b.log_text());
    pair.assert_golden_unchanged();
}

/// The source killed after its ledger said moved, before it told the destination: the
/// destination, in doubt, asks the restarted source, whose ledger answers "moved to you".
#[test]
fn a_source_killed_after_its_commit_leaves_the_vm_at_the_destination() {
    let log = source_killed_at("committed");
    assert!(log.contains("VM move in doubt"), "the destination was never in doubt:\n{log}");
    assert!(!log.contains("begins again"), "moved here already, the VM was taken again:\n{log}");
}

/// The destination killed after its ledger said "in doubt", before it said `Ready`: the source
/// never committed, gives the move up, and its VM goes on with every write; the restarted
/// destination asks the source, hears it holds the VM, and drops its copy.
#[test]
fn a_destination_killed_before_it_says_ready_leaves_the_vm_at_the_source() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let server_a = pair.serve("a");
    let server_b = serve_pausing(&pair, "b", "ready");
    let (mut model, mut source, destination) = moving(&pair, &a, &b);
    a_write_asking_while(destination, || {
        wait_for_log(&server_b, PAUSED);
        server_b.kill();
    });
    wait_for("A keeps the VM", || a.state_of("desk").as_deref() == Some("connected"));
    writes_during_pre_copy(&mut model, &mut source);
    let _server_b = pair.serve("b");
    wait_for("the restarted destination drops its copy", || b.state_of("desk").is_none());
    model.assert_reads_back(&mut source, "the source after its destination died");
    assert!(server_a.log_text().contains("move to a peer given up"), "{}", server_a.log_text());
    pair.assert_golden_unchanged();
}

/// The source's QEMU quits cleanly (NBD_CMD_DISC, as it does once the guest runs at the
/// destination), which starts the switchover, and the move then fails (the destination killed
/// before it says `Ready`): the source keeps the VM for its reconnect grace, not as a VM that
/// ended, and the restarted destination takes it again with every write. (Until session 51 the
/// source ended it as a powered-off VM: the destination, whose guest runs, found nothing to
/// take and started the name from the golden image, or refused it.)
#[test]
fn a_move_failing_after_the_sources_clean_end_keeps_the_vm_for_the_destination() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let server_a = pair.serve("a");
    let server_b = serve_pausing(&pair, "b", "ready");
    let (model, source, destination) = moving(&pair, &a, &b);
    source.disconnect().expect("the source's clean end");
    wait_for_log(&server_b, PAUSED);
    server_b.kill();
    drop(destination);
    wait_for("the move given up at A", || server_a.log_text().contains("move to a peer given up"));
    assert_eq!(a.state_of("desk").as_deref(), Some("in-grace"), "{}", server_a.log_text());
    let _server_b = pair.serve("b");
    let mut destination = b.connect("desk");
    model.assert_reads_back(&mut destination, "the destination after the move failed and was made again");
    wait_for("A holds nothing of the VM", || a.state_of("desk").is_none());
    pair.assert_golden_unchanged();
}

/// A switchover slower than the wait of the destination's first write (the source held 3 s at
/// its final delta, the wait 1 s here instead of 25): that write fails, and only it. The move
/// commits, and the same connection serves the VM on with every acknowledged write. (Until
/// session 49 the failed wait counted as an operator's reset: the connection's next request
/// ended it, the VM with it, and the destination's next connection found golden data.)
#[test]
fn a_switchover_slower_than_the_first_writes_wait_fails_that_write_alone() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let server_a = serve_pausing(&pair, "a", "final");
    let server_b = serve_waiting_a_second(&pair, &a, &b);
    let (mut model, source, mut destination) = moving(&pair, &a, &b);
    let refused = destination.write(30 << 20, &[9; 4096], false);
    assert!(refused.is_err(), "a write acknowledged before the VM's state arrived");
    wait_for_log(&server_a, PAUSED);
    wait_for("the move commits", || b.state_of("desk").as_deref() == Some("connected"));
    drop(source);
    model.assert_reads_back(&mut destination, "the destination's connection after its write's wait ran out");
    model.write(&mut destination, 30 << 20, &pseudo_random(4096, 191));
    model.assert_reads_back(&mut destination, "the destination after a write of its own");
    assert_eq!(b.state_of("desk").as_deref(), Some("connected"));
    assert_eq!(a.state_of("desk"), None, "the source kept a copy");
    let log = server_b.log_text();
    assert!(log.contains("did not arrive from the peer within 1.0 s"), "{log}");
    pair.assert_golden_unchanged();
}

/// A source that goes quiet once asked to switch over (SIGSTOPped: its peer link stays open):
/// the destination gives the move up after 15 s without a word, tries it again for 30 s, and
/// drops its copy; the source, running again, has the VM with every write. (Until session 49
/// the destination waited for the source's last changes for ever, failing each request after
/// its wait.)
#[test]
fn a_source_silent_at_the_switchover_fails_the_move_and_keeps_the_vm() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let server_a = pair.serve("a");
    let server_b = serve_waiting_a_second(&pair, &a, &b);
    let (mut model, mut source, mut destination) = moving(&pair, &a, &b);
    let signal = |which: &str| {
        let sent = std::process::Command::new("kill").args([which, &server_a.child.id().to_string()]).status();
        assert!(sent.is_ok_and(|s| s.success()), "kill {which}");
    };
    signal("-STOP");
    let refused = destination.write(30 << 20, &[9; 4096], false);
    assert!(refused.is_err(), "a write acknowledged before the VM's state arrived");
    let dropped = "VM move from a peer failed: its copy here is dropped";
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while !server_b.log_text().contains(dropped) {
        if std::time::Instant::now() > deadline {
            signal("-CONT");
            panic!("the destination still waits for its silent source:\n{}", server_b.log_text());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    signal("-CONT");
    assert!(server_b.log_text().contains("the peer sent nothing for 15 s"), "{}", server_b.log_text());
    wait_for("A keeps the VM", || a.state_of("desk").as_deref() == Some("connected"));
    model.assert_reads_back(&mut source, "the source after its move failed");
    writes_during_pre_copy(&mut model, &mut source);
    model.assert_reads_back(&mut source, "the source writing on");
    wait_for("B holds nothing of the VM", || b.state_of("desk").is_none());
    drop(destination);
    pair.assert_golden_unchanged();
}

/// A destination that said `Ready` (its copy may be the VM's from then on) answers a peer that
/// asks with "moving", not "nothing": a third server, hearing "moved to B" from the source and
/// "nothing" from B, would start the name from the golden image (until session 51).
#[test]
fn a_destination_past_ready_says_the_vm_is_moving() {
    use overspill_server::control::{ask, Request};
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let _server_a = pair.serve("a");
    // Paused long enough for the question on a loaded machine.
    let peers = [a.peer_socket(), b.peer_socket()].map(|socket| format!("unix:{}", socket.display()));
    let pause = [("OVERSPILL_TEST_MOVE_PAUSE", "ready"), ("OVERSPILL_TEST_MOVE_PAUSE_SECS", "10")];
    let server_b = serve_side_with(&pair.golden, &b, [&peers[1], &peers[0]], "1M", &[], &pause);
    let (_model, source, destination) = moving(&pair, &a, &b);
    let mut located = None;
    a_write_asking_while(destination, || {
        wait_for_log(&server_b, PAUSED);
        let control = a.dir.join("spill/state/control.sock");
        located = Some(ask(&control, &Request::Locate { vm: "desk".into() }).expect("locate at A"));
        server_b.kill();
    });
    let located = located.expect("asked");
    let said = located.message.unwrap_or_default();
    assert!(!located.ok && said.contains("moving"), "B past Ready, as A hears it: {said}");
    drop(source);
}

/// The destination killed after it said `Ready`, its source held before its ledger says moved:
/// the restarted destination, in doubt, hears "moving" from the source and asks again until the
/// source's ledger says moved to it, and keeps the VM with every write. (Until session 49
/// "moving" read as "the source kept it": the destination dropped its copy, the source then
/// committed, and the VM's name was refused everywhere, its writes gone.)
#[test]
fn a_destination_restarted_while_its_source_commits_keeps_the_vm() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let server_a = serve_pausing(&pair, "a", "readied");
    let server_b = pair.serve("b");
    let (model, source, destination) = moving(&pair, &a, &b);
    a_write_asking_while(destination, || {
        wait_for_log(&server_a, PAUSED);
        server_b.kill();
    });
    let server_b = pair.serve("b");
    wait_for("A hands the VM over", || a.state_of("desk").is_none());
    drop(source);
    let log = server_b.log_text();
    assert!(log.contains("its peer says it moved here"), "the restarted destination did not keep the VM:\n{log}");
    let mut destination = b.connect("desk");
    model.assert_reads_back(&mut destination, "the restarted destination");
    pair.assert_golden_unchanged();
}

/// As above, the source held at that step longer than the restarted destination asks (20 s):
/// the destination cannot tell whether the VM is its own yet, so it keeps its copy's files and
/// refuses the name; the source then commits to it. (Until session 51 the destination dropped its
/// copy on "still moving" at its deadline, and the commit that followed left the VM's writes
/// nowhere.)
#[test]
fn a_destination_whose_source_commits_after_it_stops_asking_keeps_its_copy() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let peers = [a.peer_socket(), b.peer_socket()].map(|socket| format!("unix:{}", socket.display()));
    let pause = [("OVERSPILL_TEST_MOVE_PAUSE", "readied"), ("OVERSPILL_TEST_MOVE_PAUSE_SECS", "26")];
    let server_a = serve_side_with(&pair.golden, &a, [&peers[0], &peers[1]], "1M", &[], &pause);
    let server_b = pair.serve("b");
    let (_model, source, destination) = moving(&pair, &a, &b);
    a_write_asking_while(destination, || {
        wait_for_log(&server_a, PAUSED);
        server_b.kill();
    });
    let server_b = pair.serve("b");
    let log = server_b.log_text();
    assert!(log.contains("still moving it after 20 s"), "the restarted destination did not give up asking:\n{log}");
    assert!(b.dir.join("spill/state/vm-desk.json").exists(), "the destination dropped its copy:\n{log}");
    assert_eq!(b.state_of("desk").as_deref(), Some("lost"));
    wait_for("A hands the VM over", || a.state_of("desk").is_none());
    drop(source);
    let refused = overspill_nbd::client::Client::connect(&b.uri("desk"));
    assert!(refused.is_err(), "the name is served");
    pair.assert_golden_unchanged();
}

/// The source's connection lost during the move (a network blip, no NBD_CMD_DISC: its guest
/// may still run there and reconnect), then the migration cancelled (the destination QEMU quits
/// cleanly): the lost connection did not hand the VM over, so the destination's end gives the
/// move up and the source's guest reconnects to every write. (Until session 51 the lost
/// connection started the switchover: the VM committed to the destination, ended there with its
/// QEMU, and the source's reconnecting guest was served the golden image.)
#[test]
fn a_source_connection_lost_during_the_move_does_not_hand_the_vm_over() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let server_a = pair.serve("a");
    let _server_b = pair.serve("b");
    let (model, source, destination) = moving(&pair, &a, &b);
    drop(source);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(b.state_of("desk").as_deref(), Some("incoming"), "the VM was handed over:\n{}", server_a.log_text());
    destination.disconnect().expect("the destination QEMU quits");
    wait_for("the move given up at A", || server_a.log_text().contains("move to a peer given up"));
    let mut source = a.connect("desk");
    model.assert_reads_back(&mut source, "the source's guest reconnecting after the cancelled migration");
    pair.assert_golden_unchanged();
}

/// The source's ledger says it moved the VM (its destination killed before it heard so), and
/// the destination's host then comes back without its state: a connection for the VM at the
/// source is refused by name, never served a fresh overlay in place of the record (until session
/// 51 the source asked its peers, heard "nothing", and started the name from the golden image).
/// `vm reset` forgets the record, and the VM starts afresh.
#[test]
fn a_source_whose_vm_moved_away_never_serves_the_name_afresh_on_its_own() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let server_a = serve_pausing(&pair, "a", "committed");
    let server_b = pair.serve("b");
    let (_model, source, destination) = moving(&pair, &a, &b);
    a_write_asking_while(destination, || {
        wait_for_log(&server_a, PAUSED);
        server_b.kill();
    });
    wait_for("A hands the VM over", || a.state_of("desk").is_none());
    drop(source);
    std::fs::remove_dir_all(b.dir.join("spill")).expect("B's host loses its state");
    let _server_b = pair.serve("b");
    let refused = overspill_nbd::client::Client::connect(&a.uri("desk"));
    assert!(refused.is_err(), "the source served the moved VM's name afresh:\n{}", server_a.log_text());
    server_a.wait_log("was moved from here to");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["vm", "--control"])
        .arg(a.dir.join("spill/state/control.sock"))
        .args(["reset", "desk"])
        .output()
        .expect("vm reset");
    assert!(out.status.success(), "vm reset: {}", String::from_utf8_lossy(&out.stderr));
    let mut fresh = a.connect("desk");
    let mut back = vec![0u8; 4096];
    fresh.read(0, &mut back).expect("read");
    assert_eq!(&back[..], &pair.golden_bytes[..4096]);
    pair.assert_golden_unchanged();
}

/// A Unix-socket relay between a server and its peer's socket, whose connections can be cut
/// while both servers live.
struct Relay {
    links: Arc<Mutex<Vec<UnixStream>>>,
}

impl Relay {
    fn start(at: &Path, to: PathBuf) -> Self {
        let listener = UnixListener::bind(at).expect("relay socket");
        let links: Arc<Mutex<Vec<UnixStream>>> = Arc::default();
        let held = links.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = UnixStream::connect(&to) else { continue };
                let ends = [&client, &server].map(|s| s.try_clone().expect("clone"));
                held.lock().expect("links").extend(ends);
                for (mut from, mut into) in
                    [(client.try_clone().expect("clone"), server.try_clone().expect("clone")), (server, client)]
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut into);
                        let _ = into.shutdown(std::net::Shutdown::Both);
                        let _ = from.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Self { links }
    }

    /// Cuts every link open now; new ones still go through.
    fn cut(&self) {
        for link in self.links.lock().expect("links").drain(..) {
            let _ = link.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// The peer link cut in the middle of the pre-copy, both servers alive: the source gives the
/// move up and its VM goes on writing; the destination asks for it again and takes it whole.
#[test]
fn a_peer_link_cut_during_the_move_leaves_the_vm_at_the_source_until_the_move_is_made_again() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let relay_socket = pair.dir.path().join("relay.sock");
    let relay = Relay::start(&relay_socket, a.peer_socket());
    let server_a = pair.serve("a");
    let b_listen = format!("unix:{}", b.peer_socket().display());
    let server_b =
        serve_side_with(&pair.golden, &b, [&b_listen, &format!("unix:{}", relay_socket.display())], "1M", &[], &[]);
    let (mut model, mut source, mut destination) = moving(&pair, &a, &b);
    relay.cut();
    writes_during_pre_copy(&mut model, &mut source);
    wait_for_log(&server_b, "VM move from a peer begins again");
    // The move made again: reads at the source see its latest writes, a write switches over.
    writes_during_pre_copy(&mut model, &mut source);
    model.assert_reads_back(&mut destination, "the destination, its move made again");
    model.write(&mut destination, 30 << 20, &pseudo_random(4096, 192));
    model.assert_reads_back(&mut destination, "the destination after the switchover");
    assert!(source.write(0, &[1; 4096], false).is_err(), "the source wrote after the switchover");
    assert_eq!(a.state_of("desk"), None);
    assert!(server_a.log_text().contains("move to a peer given up"), "the cut did not end a move");
    pair.assert_golden_unchanged();
}

// ---------------------------------------------------------------------------------------------
// Between hosts: TLS over TCP

/// Two servers each the other's peer over TCP with certificates of one CA: the VM moves as
/// over a Unix socket. A third server, whose certificate another CA signed, names the first
/// as its peer: the TLS handshake refuses it, so it refuses the VM (it cannot ask), and the
/// first server's VM is untouched.
#[test]
fn a_vm_moves_over_tls_between_hosts_and_a_server_of_another_ca_gets_nothing() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let stranger = Side { name: "x", dir: pair.dir.path().join("x") };
    std::fs::create_dir_all(&stranger.dir).expect("dir");
    let (fleet, elsewhere) = (Authority::new("fleet"), Authority::new("elsewhere"));
    let (port_a, port_b) = (free_port(), free_port());
    let tcp = |port: u16| format!("tcp:127.0.0.1:{port}");
    let serve = |side: &Side, ca: &Authority, name: &str, [listen, peer]: [String; 2]| {
        let flags = ca.credentials(&side.dir, name);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        serve_side_with(&pair.golden, side, [&listen, &peer], "1M", &flags, &[])
    };
    let server_a = serve(&a, &fleet, "host-a", [tcp(port_a), tcp(port_b)]);
    let _server_b = serve(&b, &fleet, "host-b", [tcp(port_b), tcp(port_a)]);
    let stranger_peer = format!("unix:{}", stranger.peer_socket().display());
    let _server_x = serve(&stranger, &elsewhere, "host-x", [stranger_peer, tcp(port_a)]);

    let (mut model, mut source, mut destination) = moving(&pair, &a, &b);
    model.assert_reads_back(&mut destination, "the destination before the switchover, read over TLS");
    let refused = overspill_nbd::client::Client::connect(&stranger.uri("desk"));
    assert!(refused.is_err(), "a server of another CA took the VM");
    wait_for_log(&server_a, "a peer connection was refused");

    model.write(&mut destination, 30 << 20, &pseudo_random(4096, 193));
    model.assert_reads_back(&mut destination, "the destination after the switchover");
    assert!(source.write(0, &[1; 4096], false).is_err(), "the source wrote after the switchover");
    assert_eq!(a.state_of("desk"), None);
    assert_eq!(b.state_of("desk").as_deref(), Some("connected"));
    assert!(server_a.log_text().contains("host-b"), "A does not know B by its certificate's name");
    pair.assert_golden_unchanged();
}
