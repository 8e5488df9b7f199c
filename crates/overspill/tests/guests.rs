//! Real QEMU guests (Debian's cloud kernel and a busybox initramfs, under TCG) whose disk is an
//! NBD export of `overspill serve`: what a VM sees, not what a client library sees.

use std::path::Path;
use std::time::Duration;

use tempfile::TempDir;

mod common;
use common::Serve;
#[path = "common/guest.rs"]
mod guest;
use guest::{ext4_image, Guest, GuestKit};

const FILES: u32 = 24;

/// Writes 24 files of 1 MiB of random bytes to the golden filesystem, each followed by its
/// checksum, a `sync` (so that "WROTE n" means the server acknowledged files 1..n) and a short
/// pause (so that a server killed at "WROTE n" dies while the guest writes on), then remounts
/// with the page cache dropped and checks every checksum against what the disk holds.
fn writer_job() -> String {
    format!(
        r#"mount /dev/vda /mnt || exit 1
grep -q "golden file" /mnt/golden.txt || {{ echo "GOLDEN FILE WRONG"; exit 1; }}
i=1
while [ $i -le {FILES} ]; do
  dd if=/dev/urandom of=/mnt/f$i bs=64k count=16 2>/dev/null
  (cd /mnt && sha256sum f$i >> sums)
  sync
  echo "WROTE $i"
  sleep 0.3
  i=$((i+1))
done
umount /mnt
echo 3 > /proc/sys/vm/drop_caches
mount /dev/vda /mnt || exit 1
if (cd /mnt && sha256sum -c sums > /tmp/check 2>&1); then
  echo "CHECKSUMS OK $(wc -l < /mnt/sums)"
else
  cat /tmp/check
  echo "CHECKSUMS FAILED"
fi
umount /mnt
"#
    )
}

fn serve(dir: &Path, golden: &Path, socket: &Path) -> Serve {
    let listen = format!("unix:{}", socket.display());
    // A 4 MiB RAM target: most of the 24 MiB the guest writes is spilled.
    let args = ["--base", golden.to_str().expect("utf-8"), "--listen", &listen, "--ram", "4M"];
    let socket = socket.to_path_buf();
    // A killed server leaves its socket file: ready is when a connection is accepted.
    Serve::start(dir, &args, &[], move || std::os::unix::net::UnixStream::connect(&socket).is_ok())
}

/// The issue's "done when": a guest writing files with checksums rides through a SIGKILL and
/// restart of the server, then through a planned restart (SIGTERM, start), and every checksum
/// holds when it reads its files back from the disk. QEMU's NBD client reconnects by itself
/// (`reconnect-delay`); the guest sees a stall, no error.
#[test]
fn a_guest_writing_files_rides_through_a_killed_and_a_stopped_server() {
    let dir = TempDir::new().expect("tempdir");
    let golden = ext4_image(dir.path(), 64, &[("golden.txt", b"golden file\n")]);
    let golden_before = std::fs::read(&golden).expect("golden image");
    let kit = GuestKit::build(dir.path(), &writer_job());
    let socket = dir.path().join("nbd.sock");
    let server = serve(dir.path(), &golden, &socket);
    let mut guest = Guest::boot(&kit, dir.path(), &socket, "@writer", 60);

    guest.wait_for("WROTE 6\n", Duration::from_secs(180));
    server.kill();
    let mut server = serve(dir.path(), &golden, &socket);
    let log = server.log_text();
    assert!(log.contains("VM overlay recovered from the previous server"), "not recovered after SIGKILL:\n{log}");

    guest.wait_for("WROTE 14\n", Duration::from_secs(180));
    server.stop();
    let server = serve(dir.path(), &golden, &socket);
    let log = server.log_text();
    assert!(log.contains("VM overlay recovered from the previous server"), "not handed over at SIGTERM:\n{log}");

    let console = guest.wait_exit(Duration::from_secs(300));
    assert!(console.contains(&format!("CHECKSUMS OK {FILES}")), "checksums after two restarts:\n{console}");
    assert!(console.contains("JOB EXIT 0"), "{console}");
    assert!(std::fs::read(&golden).expect("golden image") == golden_before, "the golden image was written");
    drop(server);
}
