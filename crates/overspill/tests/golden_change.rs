//! A golden image written in place under a running server (an operator's `dd` or `qemu-img
//! convert` over the served file): no VM is served a byte of the change, the change is logged
//! and counted at once, the VMs over it are lost (refused by name until reset), new VMs are
//! refused, and a restarted server serves the image as it is now.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use overspill_nbd::client::{Client, NbdUri};
use tempfile::TempDir;

mod common;
use common::{metrics_url, pseudo_random, sample, scrape, Serve};

const MIB: u64 = 1 << 20;

fn uri(socket: &Path, export: &str) -> NbdUri {
    format!("nbd+unix:///{export}?socket={}", socket.display()).parse().expect("uri")
}

fn start(dir: &Path, golden: &Path, socket: &Path) -> Serve {
    let listen = format!("unix:{}", socket.display());
    let args = [
        "--base",
        golden.to_str().expect("utf-8"),
        "--listen",
        &listen,
        "--read-cache",
        "1M",
        "--reconnect-grace",
        "1m",
        "--metrics",
        "tcp:127.0.0.1:0",
    ];
    let _ = std::fs::remove_file(socket);
    Serve::start_named_only(dir, &args, &[], || socket.exists())
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within 15 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_golden_image_written_under_running_vms_never_reaches_them() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = tmp.path().join("golden.img");
    let old = pseudo_random((8 * MIB) as usize, 7);
    std::fs::write(&golden, &old).expect("golden");
    let socket = tmp.path().join("nbd.sock");
    let mut server = start(tmp.path(), &golden, &socket);
    let metrics = metrics_url(&server);

    let mut a = Client::connect(&uri(&socket, "@a")).expect("VM a");
    a.write(0, &[0x11; 4096], false).expect("a writes");
    let mut first = vec![0u8; 64 << 10];
    a.read(MIB, &mut first).expect("a reads the golden image");
    assert_eq!(first, old[MIB as usize..][..first.len()]);

    // Rewritten in place, as `dd conv=notrunc` would: same file, same inode.
    let new = vec![0xee; (MIB) as usize];
    let file = std::fs::OpenOptions::new().write(true).open(&golden).expect("open golden for writing");
    file.write_all_at(&new, 4 * MIB).expect("rewrite");
    file.sync_all().expect("sync");
    drop(file);

    // A read of what changed, before the watch could have seen it: an error or the old bytes,
    // never the new ones (nothing of that range was cached).
    let mut after = vec![0u8; 64 << 10];
    if a.read(4 * MIB, &mut after).is_ok() {
        assert_eq!(after, old[(4 * MIB) as usize..][..after.len()], "a VM was served the changed golden image");
    }

    wait_for("the change logged", || server.log_text().contains("golden image changed while served"));
    let log = server.log_text();
    let line = log.lines().find(|l| l.contains("golden image changed while served")).expect("line");
    assert!(line.contains("ERROR") && line.contains("vms=a"), "{line}");
    assert_eq!(sample(&scrape(&metrics), "overspill_golden_image_changes_total", &[]), 1.0);

    // VM a's connection is closed at its next request, unanswered, and its name refused.
    let mut buf = [0u8; 4096];
    let mut closed = false;
    for _ in 0..50 {
        if a.read(0, &mut buf).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(closed, "VM a was still served after its golden image changed");
    wait_for("VM a lost", || Client::connect(&uri(&socket, "@a")).is_err() && server.log_text().contains("VM lost"));
    let Err(refused) = Client::connect(&uri(&socket, "@a")) else { panic!("a admitted after it was lost") };
    let refused = refused.to_string();
    assert!(refused.contains("lost") && refused.contains("vm reset a"), "{refused}");
    // A new VM over the changed image is refused too, naming the image.
    let Err(refused) = Client::connect(&uri(&socket, "@b")) else { panic!("b admitted over a changed image") };
    let refused = refused.to_string();
    assert!(refused.contains("changed while served") && refused.contains("golden.img"), "{refused}");
    server.assert_running();

    // A restarted server serves the image as it is now; a stays lost until reset.
    server.stop();
    let server = start(tmp.path(), &golden, &socket);
    let mut b = Client::connect(&uri(&socket, "@b")).expect("VM b after the restart");
    let mut now = vec![0u8; 4096];
    b.read(4 * MIB, &mut now).expect("b reads");
    assert_eq!(now, new[..4096]);
    assert!(Client::connect(&uri(&socket, "@a")).is_err(), "a came back fresh after a restart");
    drop(server);
}
