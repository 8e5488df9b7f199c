//! NBD multi-conn for the VMs `serve --multi-conn` names: advertised to them only, and nbdcopy
//! writes a VM's disk over 4 connections at once, all one overlay, which a connection held
//! through the copy reads back whole. A VM without it has one connection at a time, and the
//! next may come the instant the last one's DISC is answered by the server's close.

use std::path::Path;

use overspill_nbd::client::{Client, NbdUri};

mod common;
use common::{assert_same, pseudo_random, run_ok, Serve};

const DISK: usize = 64 << 20;

fn uri(socket: &Path, vm: &str) -> String {
    format!("nbd+unix:///@{vm}?socket={}", socket.display())
}

#[test]
fn nbdcopy_writes_a_multi_conn_vm_over_four_connections_into_one_overlay() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let golden = d.join("golden.img");
    std::fs::write(&golden, pseudo_random(DISK, 1)).expect("golden image");
    let socket = d.join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let args =
        ["--base", golden.to_str().expect("utf-8"), "--listen", &listen, "--multi-conn", "copy-*", "--ram", "8M"];
    let ready = socket.clone();
    let server =
        Serve::start_named_only(d, &args, &[], move || std::os::unix::net::UnixStream::connect(&ready).is_ok());

    let can_multi_conn = |vm: &str| {
        let out = run_ok(d, "nbdinfo", &["--json", &uri(&socket, vm)]);
        let info: serde_json::Value = serde_json::from_str(&out.stdout).expect("nbdinfo --json");
        info["exports"][0]["can_multi_conn"].as_bool().expect("can_multi_conn")
    };
    assert!(can_multi_conn("copy-1"), "a VM --multi-conn names");
    assert!(!can_multi_conn("desk"), "any other VM");

    // A connection held through the copy keeps the VM while nbdcopy's end theirs.
    let vm_uri: NbdUri = uri(&socket, "copy-1").parse().expect("uri");
    let mut held = Client::connect(&vm_uri).expect("the first connection");
    let source = d.join("source.raw");
    let data = pseudo_random(32 << 20, 2);
    std::fs::write(&source, &data).expect("source");
    let copy = ["--connections=4", "--threads=4", "--flush", source.to_str().expect("utf-8"), &uri(&socket, "copy-1")];
    run_ok(d, "nbdcopy", &copy);
    // nbdcopy's 4 connections joined the held one (the log is written by a thread of its own).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let joined = || server.log_text().matches("VM connection added (multi-conn)").count();
    while joined() < 4 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(joined(), 4, "connections nbdcopy added:\n{}", server.log_text());

    let mut back = vec![0u8; 32 << 20];
    for (i, piece) in back.chunks_mut(4 << 20).enumerate() {
        held.read((i * (4 << 20)) as u64, piece).expect("read back");
    }
    assert_same(&back, &data, "what nbdcopy wrote over 4 connections, read on another");
    let mut rest = vec![0u8; 4 << 20];
    held.read(32 << 20, &mut rest).expect("read past the copy");
    assert_same(&rest, &pseudo_random(DISK, 1)[32 << 20..36 << 20], "the golden image past the copy");
    // And the VM's whole disk copied out by nbdcopy over 4 connections, byte for byte.
    let out = d.join("out.raw");
    run_ok(d, "nbdcopy", &["--connections=4", "--threads=4", &uri(&socket, "copy-1"), out.to_str().expect("utf-8")]);
    let mut whole = pseudo_random(DISK, 1);
    whole[..32 << 20].copy_from_slice(&data);
    assert_same(&std::fs::read(&out).expect("out"), &whole, "the VM's disk as nbdcopy -C 4 copied it");
    held.disconnect().expect("disconnect");

    // Four clients opening a fresh VM at once, as a multi-conn client does: the first makes the
    // overlay, the others wait for it and join; each writes a quarter, one reads it all.
    let quarter = 4 << 20;
    let clients: Vec<Client> = std::thread::scope(|scope| {
        let opening: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| Client::connect(&uri(&socket, "copy-2").parse::<NbdUri>().expect("uri"))))
            .collect();
        opening.into_iter().map(|o| o.join().expect("thread").expect("every connection opens")).collect()
    });
    let mut clients = clients;
    for (i, client) in clients.iter_mut().enumerate() {
        client.write((i * quarter) as u64, &pseudo_random(quarter, 10 + i as u64), false).expect("write a quarter");
    }
    clients[3].flush().expect("flush on one");
    let mut whole = vec![0u8; 4 * quarter];
    clients[0].read(0, &mut whole).expect("read all on another");
    for i in 0..4 {
        assert_same(&whole[i * quarter..(i + 1) * quarter], &pseudo_random(quarter, 10 + i as u64), "a quarter");
    }
}

/// A VM's client may connect again the instant it ended its last connection. After NBD_CMD_DISC
/// and the server's close, the server has let go of the VM (CI once saw "already connected"
/// here, when the close came first) and the new connection starts from the golden image. After
/// a close without DISC (a killed QEMU started again at once), the server has perhaps not read
/// the close yet: the new connection waits for it and resumes the overlay.
#[test]
fn a_vm_connects_again_the_instant_its_last_connection_ends() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let golden = d.join("golden.img");
    let golden_bytes = pseudo_random(16 << 20, 3);
    std::fs::write(&golden, &golden_bytes).expect("golden image");
    let socket = d.join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    // A small RAM tier: each round spills, and ending an overlay with spill files takes long
    // enough for a reconnect to overtake it.
    let args = ["--base", golden.to_str().expect("utf-8"), "--listen", &listen, "--ram", "1M"];
    let ready = socket.clone();
    let _server =
        Serve::start_named_only(d, &args, &[], move || std::os::unix::net::UnixStream::connect(&ready).is_ok());
    let vm_uri: NbdUri = uri(&socket, "again").parse().expect("uri");
    let mut expected = golden_bytes[..4096].to_vec();
    for round in 0..60u8 {
        let mut client = Client::connect(&vm_uri).unwrap_or_else(|e| panic!("round {round}: {e}"));
        let mut first = vec![0u8; 4096];
        client.read(0, &mut first).expect("read");
        assert_same(&first, &expected, &format!("the start of the VM in round {round}"));
        for offset in (0..8 << 20).step_by(1 << 20) {
            client.write(offset, &[round; 1 << 20], false).expect("write");
        }
        if round % 2 == 0 {
            client.disconnect().expect("disconnect");
            expected.copy_from_slice(&golden_bytes[..4096]);
        } else {
            drop(client);
            expected.fill(round);
        }
    }
}
