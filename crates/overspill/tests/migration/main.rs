//! A named VM moves between two servers that are each other's peers (live migration): the
//! destination's connection takes the VM's overlay from the source (RAM tier and spill), its
//! requests wait until the switchover, and every acknowledged write reads back there. The
//! switchover comes from whichever happens first, the destination's first request or the
//! source's end; a move given up leaves the VM where it was. Two real servers on one host, with
//! our NBD client and with QEMU migrating a guest's disk.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use overspill_nbd::client::Client;
use serde_json::Value;
use tempfile::TempDir;

#[path = "../common/mod.rs"]
mod common;
mod failures;
mod harness;

use common::qmp::Qmp;
use common::{assert_same, metrics_url, pseudo_random, sample, scrape};
use harness::*;

/// Before the switchover the destination's reads are read at the source (QEMU reads a
/// destination's first sector at its start): they see the source's latest writes. The
/// destination's first write asks for the switchover while the source still writes: it lands
/// over the moved state, and the source's next request fails (the source server has given the
/// VM up).
#[test]
fn a_vm_moves_to_the_peer_its_destination_connects_to_and_its_writes_go_with_it() {
    let pair = Pair::new();
    let Started { a, b, server_a, server_b, mut model, mut source } = pair.start();

    let mut destination = b.connect("desk");
    assert_eq!(a.state_of("desk").as_deref(), Some("outgoing"), "A while the move runs");
    assert_eq!(b.state_of("desk").as_deref(), Some("incoming"), "B while the move runs");
    writes_during_pre_copy(&mut model, &mut source);
    model.assert_reads_back(&mut destination, "the destination before the switchover");
    model.write(&mut source, 5 << 20, &pseudo_random(8192, 150));
    model.assert_reads_back(&mut destination, "the destination, after a write at the source");
    assert_eq!(a.state_of("desk").as_deref(), Some("outgoing"), "reads moved the VM");

    model.write(&mut destination, 30 << 20, &pseudo_random(4096, 160));
    model.assert_reads_back(&mut destination, "the destination after the switchover");
    assert!(source.write(0, &[1; 4096], false).is_err(), "the source wrote after the switchover");
    assert_eq!(a.state_of("desk"), None, "A gave the VM up");
    assert_eq!(b.state_of("desk").as_deref(), Some("connected"));
    // The VM lives on at B, as any VM: its writes go on there.
    model.write(&mut destination, 20 << 20, &pseudo_random(1 << 20, 300));
    model.assert_reads_back(&mut destination, "the destination after more writes");
    pair.assert_golden_unchanged();

    let (at_a, at_b) = (scrape(&metrics_url(&server_a)), scrape(&metrics_url(&server_b)));
    let moves = |samples, outcome: &str| sample(samples, "overspill_vm_moves_total", &[("outcome", outcome)]);
    assert_eq!((moves(&at_a, "out"), moves(&at_a, "in"), moves(&at_b, "in")), (1.0, 0.0, 1.0));
    let sent = sample(&at_a, "overspill_vm_move_bytes_total", &[("direction", "sent")]);
    let received = sample(&at_b, "overspill_vm_move_bytes_total", &[("direction", "received")]);
    // Everything written before the move (8 MiB of data), some of it again.
    assert!(sent >= (8 << 20) as f64 && sent == received, "sent {sent}, received {received}");
    assert_eq!(sample(&at_b, "overspill_vm_switchover_seconds_count", &[]), 1.0);
}

/// Two hosts each with their own copy of the golden image (another file: another device and
/// inode, which the VM's recorded identity names): the VM moves when the copies' contents are
/// the same (their digests, computed from each server's start), and is refused, staying at the
/// source, when one byte differs. (Until session 51 every move between hosts with a file image
/// was refused: the identity compared was the source host's file's.)
#[test]
fn a_vm_moves_between_hosts_with_their_own_copies_of_the_image_only_if_the_bytes_match() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let copy = pair.dir.path().join("golden-at-b.img");
    // One byte apart: refused, the VM stays at the source.
    let mut other = pair.golden_bytes.clone();
    other[7 << 20] ^= 1;
    std::fs::write(&copy, &other).expect("another image at B");
    let server_b = serve_side(&copy, &b, &a, "1M");
    let server_a = pair.serve("a");
    let mut model = Model(pair.golden_bytes.clone());
    let mut source = a.connect("desk");
    first_writes(&mut model, &mut source, &pair.golden_bytes);
    wait_for("the digests", || {
        server_b.log_text().contains("image digest computed") && server_a.log_text().contains("image digest computed")
    });
    let refused = overspill_nbd::client::Client::connect(&b.uri("desk"));
    assert!(refused.is_err(), "the VM moved over other bytes");
    server_b.wait_log("their contents differ");
    assert_eq!(a.state_of("desk").as_deref(), Some("connected"));
    drop(server_b);

    // The same bytes in another file: it moves, with every write.
    std::fs::remove_file(&copy).expect("remove");
    std::fs::copy(&pair.golden, &copy).expect("a copy at B");
    let server_b = serve_side(&copy, &b, &a, "1M");
    wait_for("B's digest", || server_b.log_text().contains("image digest computed"));
    let mut destination = b.connect("desk");
    model.write(&mut destination, 30 << 20, &pseudo_random(4096, 170));
    model.assert_reads_back(&mut destination, "the destination over its own copy of the image");
    assert_eq!(a.state_of("desk"), None);
    pair.assert_golden_unchanged();
}

/// The source's clean end (QEMU's NBD_CMD_DISC as libvirt stops it) comes before the
/// destination's first request: it is the switchover, not the VM's end.
#[test]
fn the_sources_end_before_the_destinations_first_request_hands_the_vm_over() {
    let pair = Pair::new();
    let Started { a, b, server_a: _server_a, server_b: _server_b, mut model, mut source } = pair.start();
    let mut destination = b.connect("desk");
    writes_during_pre_copy(&mut model, &mut source);
    source.disconnect().expect("NBD_CMD_DISC");
    wait_for("A gives the VM up", || a.state_of("desk").is_none());
    assert_eq!(b.state_of("desk").as_deref(), Some("connected"));
    model.assert_reads_back(&mut destination, "the destination after the source's end");
    pair.assert_golden_unchanged();
}

/// A move given up (the destination goes away before its first request, as when a migration
/// is cancelled): the VM goes on at the source with every write, and B holds nothing of it.
#[test]
fn a_move_given_up_leaves_the_vm_at_the_source() {
    let pair = Pair::new();
    let Started { a, b, server_a: _server_a, server_b: _server_b, mut model, mut source } = pair.start();
    let destination = b.connect("desk");
    writes_during_pre_copy(&mut model, &mut source);
    drop(destination);
    wait_for("A keeps the VM", || a.state_of("desk").as_deref() == Some("connected"));
    wait_for("B drops its copy", || b.state_of("desk").is_none());
    model.write(&mut source, 12 << 20, &pseudo_random(2 << 20, 400));
    model.assert_reads_back(&mut source, "the source after the move was given up");
    // A second move of the same VM, after the first was given up.
    let mut destination = b.connect("desk");
    model.assert_reads_back(&mut destination, "the destination of a second move");
    pair.assert_golden_unchanged();
}

/// A peer down (its host gone) does not refuse the reconnect of a VM this server holds in its
/// grace: no other server can hold it. A VM this server does not hold is still refused while a
/// peer cannot be asked. (Until session 51 one peer down refused every reconnect.)
#[test]
fn a_peer_down_does_not_refuse_a_vm_held_here() {
    let pair = Pair::new();
    let Started { a, b: _b, server_a: _server_a, server_b, model, source } = pair.start();
    drop(source);
    wait_for("the VM waits in its grace at A", || a.state_of("desk").as_deref() == Some("in-grace"));
    server_b.kill();
    let mut back = a.connect("desk");
    model.assert_reads_back(&mut back, "the VM reconnecting while its peer is down");
    let refused = overspill_nbd::client::Client::connect(&a.uri("elsewhere"));
    assert!(refused.is_err(), "a VM not held here was served while a peer cannot be asked");
    pair.assert_golden_unchanged();
}

/// A VM cut for idleness waits for its client without end (a paused guest); a move of it
/// that fails leaves it waiting so, not on a grace that ends. (Until session 51 it came back
/// with the reconnect grace, after which its writes were lost and its name refused.)
#[test]
fn an_idle_cut_vm_whose_move_fails_waits_on_without_end() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let peers = [a.peer_socket(), b.peer_socket()].map(|socket| format!("unix:{}", socket.display()));
    let _server_a = serve_side_with(&pair.golden, &a, [&peers[0], &peers[1]], "1M", &["--idle-timeout", "1s"], &[]);
    let pause = [("OVERSPILL_TEST_MOVE_PAUSE", "ready")];
    let server_b = serve_side_with(&pair.golden, &b, [&peers[1], &peers[0]], "1M", &[], &pause);
    let mut model = Model(pair.golden_bytes.clone());
    let mut source = a.connect("desk");
    model.write(&mut source, 0, &pseudo_random(64 << 10, 12));
    let detail = |side: &Side| {
        let listed = side.list();
        listed.iter().find(|v| v["vm"] == "desk").map(|v| v["detail"].as_str().unwrap_or_default().to_owned())
    };
    wait_for("the VM cut for idleness", || detail(&a).is_some_and(|d| d.contains("cut for idleness")));
    drop(source);
    // The move fails: its destination is killed before it says it has the whole state.
    let destination = b.connect("desk");
    server_b.wait_log("move paused for a test");
    server_b.kill();
    drop(destination);
    wait_for("A holds the VM again", || a.state_of("desk").as_deref() == Some("in-grace"));
    let now = detail(&a).unwrap_or_default();
    assert!(now.contains("cut for idleness"), "the VM's wait now: {now}");
    let mut back = a.connect("desk");
    model.assert_reads_back(&mut back, "the idle VM back after the failed move");
    pair.assert_golden_unchanged();
}

/// A VM in its grace at the source (its connection lost) moves too: the destination's
/// connection takes it.
#[test]
fn a_vm_in_its_grace_at_the_source_moves_to_the_destination() {
    let pair = Pair::new();
    let Started { a, b, server_a: _server_a, server_b: _server_b, model, source } = pair.start();
    drop(source);
    wait_for("the VM waits in its grace at A", || a.state_of("desk").as_deref() == Some("in-grace"));
    let mut destination = b.connect("desk");
    model.assert_reads_back(&mut destination, "the destination");
    assert_eq!(a.state_of("desk"), None);
    pair.assert_golden_unchanged();
}

/// The ledger of a source killed after the switchover says the VM moved: a restarted source
/// does not resume its stale copy, and sends a connection of that name to the peer.
#[test]
fn a_restarted_source_never_resumes_a_vm_it_handed_over() {
    let pair = Pair::new();
    let Started { a, b, server_a, server_b: _server_b, mut model, source } = pair.start();
    let mut destination = b.connect("desk");
    model.write(&mut destination, 20 << 20, &pseudo_random(4096, 170));
    model.assert_reads_back(&mut destination, "the destination");
    drop(source);
    server_a.kill();
    let _server_a = pair.serve("a");
    assert_eq!(a.state_of("desk"), None, "the restarted source holds the VM");
    // Back to A: B holds it live, so A takes it from B.
    drop(destination);
    wait_for("the VM waits in its grace at B", || b.state_of("desk").as_deref() == Some("in-grace"));
    let mut back = a.connect("desk");
    model.assert_reads_back(&mut back, "the VM moved back to the restarted source");
    pair.assert_golden_unchanged();
}

/// A QEMU whose disk is VM `desk` at `side`, as libvirt would give it: `-incoming` makes it a
/// migration's destination.
fn qemu(side: &Side, incoming: Option<&Path>) -> Qmp {
    let drive =
        format!("driver=nbd,server.type=unix,server.path={},export=@desk,if=none,id=d0", side.socket().display());
    let mut args: Vec<String> = ["-m", "64", "-drive", &drive, "-device", "virtio-blk-pci,drive=d0,id=disk0"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    if let Some(socket) = incoming {
        args.extend(["-incoming".to_owned(), format!("unix:{}", socket.display())]);
    }
    // The source's guest runs (SeaBIOS: no kernel is needed for a disk's move); the destination
    // starts when the migration ends.
    Qmp::start_logged(&side.dir, "qemu.log", &args, false)
}

/// `qemu-io` on the VM's disk in QEMU, through the monitor.
fn qemu_io(qemu: &mut Qmp, command: &str) {
    let said = qemu.human(&format!("qemu-io d0 \"{command}\""));
    assert!(!said.to_lowercase().contains("error"), "qemu-io {command}: {said}");
}

#[track_caller]
fn wait_migration(qemu: &mut Qmp, status: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let state = qemu.execute(serde_json::json!({"execute": "query-migrate"}));
        let now = state["status"].as_str().unwrap_or_default().to_owned();
        if now == status {
            return;
        }
        assert!(!matches!(now.as_str(), "failed" | "cancelled"), "migration {now}, waiting for {status}: {state}");
        assert!(Instant::now() < deadline, "migration still {now}, waiting for {status}:\n{}", qemu.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Pattern reads of the disk in QEMU: each must have read its bytes whole, none mismatched
/// (qemu-io prints through QEMU's stdout, read once QEMU has quit).
#[track_caller]
fn assert_patterns_read(printed: &[String], reads: usize) {
    let failed: Vec<&String> = printed.iter().filter(|l| l.contains("Pattern verification failed")).collect();
    assert!(failed.is_empty(), "qemu-io read back other bytes: {failed:?}\n{printed:?}");
    let read = printed.iter().filter(|l| l.starts_with("read ") && l.contains(" bytes at offset ")).count();
    assert_eq!(read, reads, "qemu-io reads that completed: {printed:?}");
}

/// QEMU migrates a running VM whose disk is at server A to a QEMU whose disk is at B: writes
/// before the migration (spilling at A), writes while QEMU holds the migration before its
/// switchover (overspill's pre-copy running), and all of them read back through the
/// destination QEMU, before the source QEMU ends (read at A) and after (at B, which then
/// holds the VM).
#[test]
fn qemu_migrates_a_running_vm_between_peer_servers() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let _server_a = pair.serve("a");
    let _server_b = pair.serve("b");
    let mut source = qemu(&a, None);
    for write in ["write -P 0x11 0 4M", "write -P 0x22 4M 4M", "write -z 8M 1M"] {
        qemu_io(&mut source, write);
    }
    let migration = pair.dir.path().join("migration.sock");
    let destination = qemu(&b, Some(&migration));
    wait_for("B takes the VM in", || b.state_of("desk").as_deref() == Some("incoming"));
    source.execute(serde_json::json!({"execute": "migrate-set-capabilities", "arguments": {
        "capabilities": [{"capability": "pause-before-switchover", "state": true}]}}));
    source.execute(
        serde_json::json!({"execute": "migrate", "arguments": {"uri": format!("unix:{}", migration.display())}}),
    );
    wait_migration(&mut source, "pre-switchover");
    for write in ["write -P 0x33 2M 1M", "write -P 0x44 12M 2M"] {
        qemu_io(&mut source, write);
    }
    source.execute(serde_json::json!({"execute": "migrate-continue", "arguments": {"state": "pre-switchover"}}));
    wait_migration(&mut source, "completed");
    let mut destination = destination;
    let reads = [
        "read -P 0x11 0 2M",
        "read -P 0x33 2M 1M",
        "read -P 0x11 3M 1M",
        "read -P 0x22 4M 4M",
        "read -P 0 8M 1M",
        "read -P 0x44 12M 2M",
    ];
    // Read at A: the VM is still A's while the source QEMU lives (libvirt stops it next).
    for read in reads {
        qemu_io(&mut destination, read);
    }
    assert_eq!(a.state_of("desk").as_deref(), Some("outgoing"));
    // The source's end (NBD_CMD_DISC) is the switchover.
    drop(source.quit());
    wait_for("A gives the VM up", || a.state_of("desk").is_none());
    assert_eq!(b.state_of("desk").as_deref(), Some("connected"));
    for read in reads {
        qemu_io(&mut destination, read);
    }
    qemu_io(&mut destination, "write -P 0x88 20M 1M");
    qemu_io(&mut destination, "read -P 0x88 20M 1M");
    assert_patterns_read(&destination.quit(), 2 * reads.len() + 1);
    pair.assert_golden_unchanged();
}

/// A migration cancelled at its switchover (`migrate_cancel`): the destination QEMU exits, B
/// drops its copy, and the VM goes on at A with every write.
#[test]
fn a_cancelled_qemu_migration_leaves_the_vm_at_the_source() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let _server_a = pair.serve("a");
    let _server_b = pair.serve("b");
    let mut source = qemu(&a, None);
    qemu_io(&mut source, "write -P 0x55 0 6M");
    let migration = pair.dir.path().join("migration.sock");
    let mut destination = qemu(&b, Some(&migration));
    wait_for("B takes the VM in", || b.state_of("desk").as_deref() == Some("incoming"));
    source.execute(serde_json::json!({"execute": "migrate-set-capabilities", "arguments": {
        "capabilities": [{"capability": "pause-before-switchover", "state": true}]}}));
    source.execute(
        serde_json::json!({"execute": "migrate", "arguments": {"uri": format!("unix:{}", migration.display())}}),
    );
    wait_migration(&mut source, "pre-switchover");
    qemu_io(&mut source, "write -P 0x66 1M 1M");
    source.execute(serde_json::json!({"execute": "migrate_cancel"}));
    wait_migration(&mut source, "cancelled");
    source.execute(serde_json::json!({"execute": "cont"}));
    wait_for("the destination QEMU exits", || destination.child.try_wait().expect("try_wait").is_some());
    wait_for("B drops its copy", || b.state_of("desk").is_none());
    assert_eq!(a.state_of("desk").as_deref(), Some("connected"));
    qemu_io(&mut source, "write -P 0x77 5M 1M");
    for read in ["read -P 0x55 0 1M", "read -P 0x66 1M 1M", "read -P 0x55 2M 3M", "read -P 0x77 5M 1M"] {
        qemu_io(&mut source, read);
    }
    assert_patterns_read(&source.quit(), 4);
    pair.assert_golden_unchanged();
}

/// `overspill libvirt-hook` at the destination, as libvirt runs it for an incoming migration
/// (`DOMAIN migrate begin -`, the domain XML on standard input): exit status and what it said.
fn migrate_hook(side: &Side, vm: &str) -> (bool, String) {
    hook(side, vm, "migrate")
}

/// `overspill libvirt-hook DOMAIN OPERATION begin -` at `side` for a domain whose disk is VM `vm`
/// there: exit status and what it said. Its notes between steps in the side's `hook` directory.
fn hook(side: &Side, vm: &str, operation: &str) -> (bool, String) {
    use std::io::Write;
    let xml = format!(
        "<domain type='kvm'><name>dom-{vm}</name><devices><disk type='network' device='disk'>\
         <driver name='qemu' type='raw'/><source protocol='nbd' name='@{vm}'><host transport='unix' socket='{}'/>\
         </source><target dev='vda' bus='virtio'/></disk></devices></domain>",
        side.socket().display()
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["libvirt-hook", "--control"])
        .arg(side.dir.join("spill/state/control.sock"))
        .arg("--run-dir")
        .arg(side.dir.join("hook"))
        .args(["--wait", "1s", "--", &format!("dom-{vm}"), operation, "begin", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("overspill libvirt-hook");
    child.stdin.take().expect("stdin").write_all(xml.as_bytes()).expect("XML on stdin");
    let out = child.wait_with_output().expect("hook output");
    assert!(out.stdout.is_empty(), "libvirt takes a migrate hook's output for new XML: {:?}", out.stdout);
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The libvirt hook lets a migration through to a host whose server has the source's server as
/// a peer holding the VM live, and refuses one of a VM no peer holds (a migration from a host
/// that is not a peer would start it from the golden image).
#[test]
fn the_libvirt_hook_lets_a_migration_through_only_from_a_peer_that_holds_the_vm() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let _server_a = pair.serve("a");
    let _server_b = pair.serve("b");
    let mut source = a.connect("desk");
    source.write(0, &[7; 4096], false).expect("write");
    let (ok, said) = migrate_hook(&b, "desk");
    assert!(ok, "the hook refused a migration from a peer holding the VM: {said}");
    assert!(said.contains("desk") && said.contains(&a.peer_socket().display().to_string()), "{said}");
    let (ok, said) = migrate_hook(&b, "elsewhere");
    assert!(!ok, "the hook let through a VM no peer holds: {said}");
    assert!(said.contains("cannot be migrated") && said.contains("elsewhere"), "{said}");
    // Asking moved nothing.
    assert_eq!(a.state_of("desk").as_deref(), Some("connected"));
    assert_eq!(b.state_of("desk"), None);
    // The start that follows the migration (libvirt's `prepare` at the destination) leaves the
    // source's running VM alone, and the move goes on as the destination QEMU connects.
    let (ok, said) = hook(&b, "desk", "prepare");
    assert!(ok, "the hook refused the start of a migration it let through: {said}");
    assert_eq!(a.state_of("desk").as_deref(), Some("connected"));
    let mut destination = b.connect("desk");
    let mut back = [0u8; 4096];
    destination.read(0, &mut back).expect("read at the destination");
    assert_eq!(back, [7; 4096], "the destination read other than the source's write");
    drop(source);
}

/// A fresh start (libvirt's `prepare` with no migration before it) of a VM whose last run was at
/// a peer and waits there in grace (its QEMU killed there) begins from the golden image: the
/// hook resets the peer's copy too, which the VM's first connection here would otherwise take,
/// booting the next user of a pooled desktop into the last one's writes. A VM connected at the
/// peer refuses the start, naming it.
#[test]
fn a_fresh_start_never_takes_a_peers_copy_of_the_vm() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let _server_a = pair.serve("a");
    let _server_b = pair.serve("b");
    let mut last_run = a.connect("desk");
    last_run.write(0, &[7; 4096], false).expect("write");

    let (ok, said) = hook(&b, "desk", "prepare");
    assert!(!ok, "a start went ahead while the VM runs at a peer: {said}");
    assert!(said.contains("desk") && said.contains(&a.peer_socket().display().to_string()), "{said}");
    assert_eq!(a.state_of("desk").as_deref(), Some("connected"));

    // Its QEMU killed at A: the overlay waits there for a reconnect.
    drop(last_run);
    wait_for("desk in grace at A", || a.state_of("desk").as_deref() == Some("in-grace"));
    let (ok, said) = hook(&b, "desk", "prepare");
    assert!(ok, "the fresh start was refused: {said}");
    assert_eq!(a.state_of("desk"), None, "the peer kept the VM's last run");
    let mut fresh = b.connect("desk");
    let mut back = [0u8; 4096];
    fresh.read(0, &mut back).expect("read");
    assert_eq!(&back[..], &pair.golden_bytes[..4096], "the fresh start read the last run's writes");
    fresh.disconnect().expect("disconnect");
    pair.assert_golden_unchanged();
}

/// The source's server killed during the pre-copy: the destination's move fails, and it tries
/// again while its connection lives; its write waits (never golden data) until the restarted
/// source has recovered the VM and the move has taken it from there whole.
#[test]
fn a_source_killed_during_the_move_keeps_the_vm_and_the_move_takes_it_from_its_restart() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let server_a = pair.serve("a");
    let _server_b = pair.serve("b");
    let mut model = Model(pair.golden_bytes.clone());
    let mut source = a.connect("desk");
    // No TRIM: what a trimmed block reads after a restart is unspecified (docs/lifecycle.md).
    model.write(&mut source, 0, &pseudo_random(8 << 20, 11));
    model.zero(&mut source, 9 << 20, 1 << 20);
    let mut destination = b.connect("desk");
    writes_during_pre_copy(&mut model, &mut source);
    server_a.kill();
    drop(source);
    let _server_a = std::thread::scope(|scope| {
        // The source's server comes back a second later (systemd's Restart=).
        let restarted = scope.spawn(|| {
            std::thread::sleep(Duration::from_secs(1));
            pair.serve("a")
        });
        model.write(&mut destination, 30 << 20, &pseudo_random(4096, 190));
        restarted.join().expect("restarted source")
    });
    model.assert_reads_back(&mut destination, "the destination after the source's restart");
    assert_eq!(b.state_of("desk").as_deref(), Some("connected"));
    assert_eq!(a.state_of("desk"), None);
    pair.assert_golden_unchanged();
}

/// The destination's server killed during the pre-copy: the source gives the move up and its
/// VM goes on with every write; the restarted destination holds nothing of it.
#[test]
fn a_destination_killed_during_the_move_leaves_the_vm_at_the_source() {
    let pair = Pair::new();
    let Started { a, b, server_a: _server_a, server_b, mut model, mut source } = pair.start();
    let destination = b.connect("desk");
    writes_during_pre_copy(&mut model, &mut source);
    server_b.kill();
    drop(destination);
    wait_for("A keeps the VM", || a.state_of("desk").as_deref() == Some("connected"));
    writes_during_pre_copy(&mut model, &mut source);
    model.assert_reads_back(&mut source, "the source after the destination died");
    let _server_b = pair.serve("b");
    assert_eq!(b.state_of("desk"), None, "the restarted destination holds a copy");
    pair.assert_golden_unchanged();
}

/// The destination's server killed after the switchover: the VM is its own (the source's ledger
/// says moved), so its restart recovers it and the VM's next connection resumes it there.
#[test]
fn a_destination_killed_after_the_switchover_keeps_the_vm() {
    let pair = Pair::new();
    let Started { a, b, server_a: _server_a, server_b, mut model, source } = pair.start();
    let mut destination = b.connect("desk");
    model.write(&mut destination, 24 << 20, &pseudo_random(4096, 180));
    drop(source);
    wait_for("A gives the VM up", || a.state_of("desk").is_none());
    server_b.kill();
    drop(destination);
    let _server_b = pair.serve("b");
    assert_eq!(b.state_of("desk").as_deref(), Some("in-grace"), "the restarted destination recovered the VM");
    let mut back = b.connect("desk");
    model.assert_reads_back(&mut back, "the VM after its destination's restart");
    pair.assert_golden_unchanged();
}

/// QMP on a unix socket (`-qmp unix:PATH,server=on,wait=off`), for a guest whose console is
/// QEMU's stdio.
struct QmpSocket {
    reader: std::io::BufReader<std::os::unix::net::UnixStream>,
    writer: std::os::unix::net::UnixStream,
}

impl QmpSocket {
    fn connect(path: &Path) -> Self {
        let deadline = Instant::now() + WAIT;
        let stream = loop {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(stream) => break stream,
                Err(error) => {
                    assert!(Instant::now() < deadline, "QMP socket {}: {error}", path.display());
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        stream.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
        let writer = stream.try_clone().expect("clone");
        let mut qmp = Self { reader: std::io::BufReader::new(stream), writer };
        let greeting = qmp.line();
        assert!(greeting.contains("\"QMP\""), "no QMP greeting: {greeting}");
        qmp.execute(serde_json::json!({"execute": "qmp_capabilities"}));
        qmp
    }

    fn line(&mut self) -> String {
        use std::io::BufRead;
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("reading QMP");
        line
    }

    fn execute(&mut self, command: Value) -> Value {
        use std::io::Write;
        self.writer.write_all(format!("{command}\n").as_bytes()).expect("writing QMP");
        loop {
            let reply: Value = serde_json::from_str(&self.line()).expect("QMP speaks JSON");
            if let Some(value) = reply.get("return") {
                return value.clone();
            }
            assert!(reply.get("event").is_some(), "{command} failed: {reply}");
        }
    }
}

/// The "done when": a real guest (busybox, TCG) writing checksummed files is migrated
/// by QEMU from server A to server B while it writes, with its writes spilling at both (4 MiB
/// of RAM per VM), and every checksum holds when it reads its files back at B.
#[test]
fn a_guest_writing_files_is_live_migrated_and_every_checksum_holds() {
    use overspill::guests::{checksummed_writes_job, ext4_image, nbd_disk, BootOptions, Guest, GuestKit};
    const FILES: u32 = 16;
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let golden = ext4_image(pair.dir.path(), 64, &[("golden.txt", b"golden file\n")]).expect("golden image");
    let golden_before = std::fs::read(&golden).expect("golden image");
    let _server_a = serve_side(&golden, &a, &b, "4M");
    let _server_b = serve_side(&golden, &b, &a, "4M");
    let kit = GuestKit::build(pair.dir.path(), &checksummed_writes_job(FILES, "0.5")).expect("guest kit");
    let machine = |side: &Side, extra: &[String]| {
        let mut args = nbd_disk(&side.socket(), "@desk", 30);
        args.extend(["-qmp".to_owned(), format!("unix:{},server=on,wait=off", side.dir.join("qmp.sock").display())]);
        args.extend_from_slice(extra);
        args
    };
    let mut source =
        Guest::start(&kit, &a.dir.join("guest"), &machine(&a, &[]), BootOptions::default()).expect("source guest");
    source.wait_for("WROTE 4\n", Duration::from_secs(240)).expect("WROTE 4");
    let migration = pair.dir.path().join("migration.sock");
    let incoming = ["-incoming".to_owned(), format!("unix:{}", migration.display())];
    let mut destination = Guest::start(&kit, &b.dir.join("guest"), &machine(&b, &incoming), BootOptions::default())
        .expect("destination guest");
    wait_for("B takes the VM in", || b.state_of("desk").as_deref() == Some("incoming"));
    wait_for("the destination QEMU listens for the migration", || migration.exists());
    let mut qmp = QmpSocket::connect(&a.dir.join("qmp.sock"));
    qmp.execute(
        serde_json::json!({"execute": "migrate", "arguments": {"uri": format!("unix:{}", migration.display())}}),
    );
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let status = qmp.execute(serde_json::json!({"execute": "query-migrate"}));
        match status["status"].as_str().unwrap_or_default() {
            "completed" => break,
            "failed" | "cancelled" => panic!("migration: {status}"),
            _ => assert!(Instant::now() < deadline, "migration not done: {status}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let written_at_source =
        (1..=FILES).rev().find(|n| source.console_text().contains(&format!("WROTE {n}\n"))).unwrap_or(0);
    // libvirt stops the source QEMU once the destination runs.
    source.kill();
    let console = destination.wait_exit(Duration::from_secs(300)).expect("the guest powers off at B");
    assert!(console.contains(&format!("CHECKSUMS OK {FILES}")), "checksums at B:\n{console}");
    assert!(written_at_source < FILES, "the migration came after the guest's last write");
    assert_eq!(a.state_of("desk"), None, "A still holds the VM");
    assert_eq!(std::fs::read(&golden).expect("golden image"), golden_before, "the golden image was written");
}

/// Latencies of 4 KiB writes, one every millisecond (about 1,000 IOPS), at random offsets in
/// the first GiB, until one fails or `stop` is set: each write's start (since `epoch`) and how
/// long it took, and the error that ended it.
fn paced_writes(
    mut client: Client,
    seed: u64,
    epoch: Instant,
    stop: &std::sync::atomic::AtomicBool,
) -> (Vec<(Duration, Duration)>, Option<String>) {
    let mut samples = Vec::new();
    let mut state = seed | 1;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let offset = (state % (1 << 18)) * 4096;
        let started = Instant::now();
        if let Err(error) = client.write(offset, &[(state & 0xff) as u8; 4096], false) {
            return (samples, Some(error.to_string()));
        }
        samples.push((started - epoch, started.elapsed()));
        std::thread::sleep(Duration::from_millis(1));
    }
    (samples, None)
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// `bench/migrate`: moves a VM with 256 MiB in RAM and 1 GiB spilled from A to B over the peer
/// link on this machine, and measures the pre-copy's time and the pause overspill adds at the
/// switchover (QEMU's own downtime for guest RAM apart): our NBD client writes 4 KiB at about
/// 1,000 IOPS at the source through the pre-copy, then at the destination, whose first write
/// asks for the switchover. Over a Unix socket, or with `OVERSPILL_BENCH_LINK=tls` over TLS on
/// TCP (loopback), as between hosts. Results to bench/results/migrate-<rev>[-tls].md. Run in
/// release.
#[test]
#[ignore = "a benchmark: bench/migrate runs it"]
fn bench_move_256m_in_ram_and_1g_spilled() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = TempDir::new_in("/var/tmp").expect("tempdir");
    let golden = dir.path().join("golden.img");
    std::fs::File::create(&golden).and_then(|f| f.set_len(2 << 30)).expect("sparse golden image");
    for side in ["a", "b"] {
        std::fs::create_dir_all(dir.path().join(side)).expect("side dir");
    }
    let (a, b) = (Side { name: "a", dir: dir.path().join("a") }, Side { name: "b", dir: dir.path().join("b") });
    let tls = std::env::var("OVERSPILL_BENCH_LINK").is_ok_and(|link| link == "tls");
    let (_server_a, _server_b) = if tls {
        let fleet = Authority::new("fleet");
        let (port_a, port_b) = (free_port(), free_port());
        let tcp = |port: u16| format!("tcp:127.0.0.1:{port}");
        let serve = |side: &Side, name: &str, [listen, peer]: [String; 2]| {
            let flags = fleet.credentials(&side.dir, name);
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            serve_side_with(&golden, side, [&listen, &peer], "256M", &flags, &[])
        };
        (serve(&a, "host-a", [tcp(port_a), tcp(port_b)]), serve(&b, "host-b", [tcp(port_b), tcp(port_a)]))
    } else {
        (serve_side(&golden, &a, &b, "256M"), serve_side(&golden, &b, &a, "256M"))
    };
    let link =
        if tls { "TLS 1.3 on TCP over loopback (rustls, ring; a relay thread per link)" } else { "a Unix socket" };
    let mut source = a.connect("bench");
    let chunk = pseudo_random(4 << 20, 21);
    let written = Instant::now();
    for i in 0..320u64 {
        source.write(i * (4 << 20), &chunk, false).expect("filling the VM");
    }
    source.flush().expect("flush");
    let fill_s = written.elapsed().as_secs_f64();
    let listed = a.list();
    let entry = listed.iter().find(|v| v["vm"] == "bench").expect("the VM at A");
    let (ram_mib, spill_mib) =
        (entry["memory_bytes"].as_u64().unwrap_or(0) >> 20, entry["spill_bytes"].as_u64().unwrap_or(0) >> 20);

    let epoch = Instant::now();
    let stop = AtomicBool::new(false);
    let (source_samples, source_end, first_write, dest_samples, precopy) = std::thread::scope(|scope| {
        let writer = scope.spawn(|| paced_writes(source, 1, epoch, &stop));
        let connect_started = Instant::now();
        let mut destination = b.connect("bench");
        let connected = connect_started.elapsed();
        // Pre-copy done: A has sent every block once and keeps up with the writes.
        let precopy = loop {
            let detail = a.list().iter().find(|v| v["vm"] == "bench").map(|v| v["detail"].to_string());
            if detail.as_deref().is_some_and(|d| d.contains(" 0 blocks left") && !d.contains(" 0 rounds")) {
                break connect_started.elapsed();
            }
            assert!(connect_started.elapsed() < Duration::from_secs(300), "pre-copy not done: {detail:?}");
            std::thread::sleep(Duration::from_millis(20));
        };
        std::thread::sleep(Duration::from_secs(1));
        let switch_started = Instant::now();
        destination.write(1 << 30, &[0x77; 4096], false).expect("the destination's first write");
        let first_write = (switch_started - epoch, switch_started.elapsed());
        let (source_samples, source_end) = writer.join().expect("source writer");
        let stop_after = std::thread::spawn(|| std::thread::sleep(Duration::from_secs(2)));
        let dest = scope.spawn(|| paced_writes(destination, 2, epoch, &stop));
        stop_after.join().expect("timer");
        stop.store(true, Ordering::Relaxed);
        let (dest_samples, dest_end) = dest.join().expect("destination writer");
        assert!(dest_end.is_none(), "a destination write failed: {dest_end:?}");
        (source_samples, source_end, first_write, dest_samples, (connected, precopy))
    });
    assert!(source_end.is_some(), "the source never stopped writing");
    // Requests at the source that started within 100 ms of the switchover: those the fence held.
    let around = |samples: &[(Duration, Duration)]| {
        samples
            .iter()
            .filter(|(at, _)| at.abs_diff(first_write.0) < Duration::from_millis(100))
            .map(|(_, took)| *took)
            .max()
            .unwrap_or_default()
    };
    let worst_source = around(&source_samples);
    let mut dest_latencies: Vec<Duration> = dest_samples.iter().map(|(_, took)| *took).collect();
    dest_latencies.sort();
    let percentile = |p: usize| dest_latencies.get(dest_latencies.len() * p / 100).copied().unwrap_or_default();
    let at_a = scrape(&metrics_url(&_server_a));
    let sent = sample(&at_a, "overspill_vm_move_bytes_total", &[("direction", "sent")]);
    let rounds = sample(&at_a, "overspill_vm_move_rounds_total", &[]);
    let at_b = scrape(&metrics_url(&_server_b));
    let switchover = sample(&at_b, "overspill_vm_switchover_max_seconds", &[]);

    // A sample of what moved reads back at B.
    let mut check = b.connect("bench");
    let mut back = vec![0u8; 4 << 20];
    for i in (0..320u64).step_by(37) {
        check.read(i * (4 << 20), &mut back).expect("read back");
        if i * (4 << 20) < (1 << 30) {
            // The paced writes changed blocks of the first GiB: count the chunk's untouched bytes.
            let same = back.iter().zip(&chunk).filter(|(x, y)| x == y).count();
            assert!(same > back.len() * 9 / 10, "chunk {i} at B is not what A held");
        } else {
            assert_same(&back, &chunk, &format!("chunk {i} at B"));
        }
    }
    let rev = Command::new("git").args(["rev-parse", "--short", "HEAD"]).output().expect("git");
    let rev = String::from_utf8_lossy(&rev.stdout).trim().to_owned();
    let report = format!(
        "# Moving a VM between two servers on one host ({rev})\n\n\
         `bench/migrate` (crates/overspill/tests/migration/main.rs, `bench_move_256m_in_ram_and_1g_spilled`, release \
         build); two `overspill serve` with `--ram 256M`, each the other's peer over {link}, spill and memory \
         directories under /var/tmp; 2 cores, noisy. The VM was filled with 1,280 MiB by our NBD client \
         ({fill_s:.1} s); then it held {ram_mib} MiB of cache memory and {spill_mib} MiB spilled at A.\n\n\
         | figure | value |\n|---|---|\n\
         | destination's connection (handshake, peer query, offer) | {connect:.1} ms |\n\
         | pre-copy: every block sent once, the source writing 4 KiB at ~1,000 IOPS | {precopy:.2} s |\n\
         | block data sent (all rounds) | {sent_mib:.0} MiB in {rounds} rounds |\n\
         | the destination's first write (asks for the switchover, waits for it) | {first:.1} ms |\n\
         | switchover at B, from the ask to the VM served there (metric) | {switchover_ms:.1} ms |\n\
         | worst source write within 100 ms of the switchover (held by the fence) | {worst:.1} ms |\n\
         | source writes acknowledged before it was cut off | {source_writes} |\n\
         | destination writes after the switchover: p50 / p99 / max | {p50:.2} / {p99:.2} / {max:.2} ms |\n\n\
         Target: under 100 ms for the switchover pause. The source's last request failed with: {source_end}.\n",
        connect = ms(precopy.0),
        precopy = precopy.1.as_secs_f64(),
        sent_mib = sent / 1048576.0,
        first = ms(first_write.1),
        switchover_ms = switchover * 1000.0,
        worst = ms(worst_source),
        source_writes = source_samples.len(),
        p50 = ms(percentile(50)),
        p99 = ms(percentile(99)),
        max = ms(dest_latencies.last().copied().unwrap_or_default()),
        source_end = source_end.unwrap_or_default(),
    );
    let out = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../../bench/results/migrate-{rev}{}.md", if tls { "-tls" } else { "" }));
    std::fs::write(&out, &report).expect("writing the results");
    println!("{report}");
}

/// A fork moves with its pin: at the destination it reads what it wrote at the source, and once
/// its overlay ends there its next boot starts from its checkpoint again, not from the image's
/// version; the source forgets it. Both servers serve one image store.
#[test]
fn a_fork_moves_with_its_pin() {
    let pair = Pair::new();
    let (a, b) = (pair.side("a"), pair.side("b"));
    let store = pair.dir.path().join("images");
    let store_arg = store.to_str().expect("utf-8");
    let overspill = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_overspill")).args(args).stdin(Stdio::null()).output().expect("run");
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "overspill {args:?}: {said}");
        said
    };
    overspill(&["image", "--images", store_arg, "publish", "win", pair.golden.to_str().expect("utf-8"), "--activate"]);
    let serve = |this: &Side, other: &Side| {
        let peer_listen = format!("unix:{}", this.peer_socket().display());
        let peer = format!("unix:{}", other.peer_socket().display());
        serve_side_with(&pair.golden, this, [&peer_listen, &peer], "1M", &["--images", store_arg], &[])
    };
    let (_server_a, _server_b) = (serve(&a, &b), serve(&b, &a));
    let connect = |side: &Side, vm: &str| {
        let uri = format!("nbd+unix:///win@{vm}?socket={}", side.socket().display());
        Client::connect(&uri.parse().expect("uri")).unwrap_or_else(|e| panic!("{vm} at {}: {e}", side.name))
    };
    let control_a = a.dir.join("spill/state/control.sock");
    let control_a = control_a.to_str().expect("utf-8");
    let mut src = connect(&a, "src");
    src.write(0, &[0x5a; 4096], false).expect("src writes");
    overspill(&["vm", "checkpoint", "src", "--as", "c1", "--control", control_a]);
    overspill(&["vm", "fork", "win:@c1", "--as", "f", "--control", control_a]);
    let mut f = connect(&a, "f");
    f.write(4096, &[0x6b; 4096], false).expect("f writes at A");
    drop(f);
    wait_for("f waits in its grace at A", || a.state_of("f").as_deref() == Some("in-grace"));

    let read = |client: &mut Client, at: u64| {
        let mut buf = [0u8; 4096];
        client.read(at, &mut buf).expect("read");
        buf
    };
    let mut f = connect(&b, "f");
    assert_eq!((read(&mut f, 0), read(&mut f, 4096)), ([0x5a; 4096], [0x6b; 4096]), "f at B: its writes moved");
    assert_eq!(a.state_of("f"), None, "A forgot the fork, pin and all");
    f.disconnect().expect("f powers off at B");
    let mut f = connect(&b, "f");
    let golden_second_block: [u8; 4096] = pair.golden_bytes[4096..8192].try_into().expect("a block");
    assert_eq!(
        (read(&mut f, 0), read(&mut f, 4096)),
        ([0x5a; 4096], golden_second_block),
        "f's next boot at B starts from its checkpoint"
    );
    f.disconnect().expect("f leaves");
    src.disconnect().expect("src leaves");
}
