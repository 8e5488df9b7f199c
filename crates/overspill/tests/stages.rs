//! Image stages, PVS's way of updating a golden image: a new version goes to the test group
//! first (`overspill image test`, `serve --test-vms`), then to every new VM (`image promote`),
//! and back (`image rollback`), each one command, none touching a running VM's version. Real
//! server, real NBD connections, the real `overspill image` command.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use overspill_nbd::client::{Client, NbdUri};

mod common;
use common::Serve;

/// `overspill image --images STORE ARGS`: whether it succeeded, and what it printed.
fn image(store: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .arg("image")
        .arg("--images")
        .arg(store)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("overspill image");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn image_ok(store: &Path, args: &[&str]) -> String {
    let (ok, text) = image(store, args);
    assert!(ok, "image {args:?}: {text}");
    text
}

/// A server over image store `store` with a control socket, `lab-*` its test group, and
/// `extra` flags: the server, its NBD socket and its control socket.
fn serve_store(dir: &Path, store: &Path, extra: &[&str]) -> (Serve, PathBuf, PathBuf) {
    let (socket, control) = (dir.join("nbd.sock"), dir.join("control.sock"));
    let listen = format!("unix:{}", socket.display());
    let args = [
        &["--images", store.to_str().expect("utf-8"), "--listen", &listen][..],
        &["--control", control.to_str().expect("utf-8"), "--test-vms", "lab-*"],
        extra,
    ]
    .concat();
    let server = Serve::start_named_only(dir, &args, &[], || socket.exists() && control.exists());
    (server, socket, control)
}

/// The byte VM `vm`'s disk starts with, over a connection left open (returned).
fn first_byte(socket: &Path, vm: &str) -> (u8, Client) {
    let mut client = connect(socket, "win", vm).unwrap_or_else(|e| panic!("{vm}: {e}"));
    (byte_at(&mut client, 0), client)
}

/// Publishes a 4 MiB version of `image` in `store`, every byte `byte` (made beside the store as
/// `IMAGE-BYTE.img`), production when `activate`: the file it was published from.
fn publish_filled(store: &Path, image: &str, byte: u8, activate: bool) -> PathBuf {
    let file = store.with_file_name(format!("{image}-{byte:02x}.img"));
    std::fs::write(&file, vec![byte; 4 << 20]).expect("a version's file");
    let file_arg = file.to_str().expect("utf-8");
    image_ok(store, &[&["publish", image, file_arg][..], if activate { &["--activate"] } else { &[] }].concat());
    file
}

/// A publisher with a strict umask (077) making the store: every directory it makes is
/// searchable by the server's user, the store's root and those above it included (only the
/// image's own directory was, and a server running as its own user found the store empty).
#[test]
fn a_store_made_under_a_strict_umask_is_open_to_the_servers_user() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("srv/overspill/images");
    let file = dir.path().join("golden.img");
    std::fs::write(&file, vec![0x33u8; 1 << 20]).expect("golden");
    let published = Command::new("sh")
        .args([
            "-c",
            "umask 077 && exec \"$0\" image --images \"$1\" publish win \"$2\"",
            env!("CARGO_BIN_EXE_overspill"),
        ])
        .arg(&store)
        .arg(&file)
        .output()
        .expect("sh");
    assert!(published.status.success(), "{}", String::from_utf8_lossy(&published.stderr));
    for made in [dir.path().join("srv"), dir.path().join("srv/overspill"), store.clone(), store.join("win")] {
        let mode = std::fs::metadata(&made).expect("made").permissions().mode() & 0o777;
        assert_eq!(mode, 0o755, "{} is {mode:o}", made.display());
    }
    let version = std::fs::metadata(store.join("win/v1.img")).expect("v1").permissions().mode() & 0o777;
    assert_eq!(version, 0o444);
}

/// An image directory the lister cannot read (another user's) hides no other image.
#[test]
fn an_image_that_cannot_be_read_hides_no_other() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to list as another user");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let store = dir.path().join("images");
    publish_filled(&store, "win", 0x21, true);
    publish_filled(&store, "zz", 0x22, true);
    std::fs::set_permissions(store.join("zz"), std::fs::Permissions::from_mode(0o700)).expect("chmod zz");
    let listed = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["image", "--images"])
        .arg(&store)
        .arg("list")
        .uid(65534)
        .gid(65534)
        .output()
        .expect("overspill image list");
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.status.success(), "{text}{}", String::from_utf8_lossy(&listed.stderr));
    assert!(text.contains("win"), "{text}");
}

#[test]
fn the_test_group_gets_the_test_version_promote_gives_it_to_all_and_rollback_takes_it_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("images");
    publish_filled(&store, "win", 0x11, true);
    let v2 = publish_filled(&store, "win", 0x22, false);
    let (ok, text) = image(&store, &["promote", "win"]);
    assert!(!ok && text.contains("no test version to promote"), "{text}");
    image_ok(&store, &["test", "win", "2"]);
    let list = image_ok(&store, &["list"]);
    assert!(list.contains("v1     production") && list.contains("v2     test"), "{list}");

    // An image with a test version and no production one yet: only the test group can boot it.
    image_ok(&store, &["publish", "fresh", v2.to_str().expect("utf-8")]);
    image_ok(&store, &["test", "fresh", "1"]);
    let (server, socket, control) = serve_store(dir.path(), &store, &["--group", "office=desk-*"]);
    let fresh: NbdUri = format!("nbd+unix:///fresh@lab-9?socket={}", socket.display()).parse().expect("uri");
    let mut lab = Client::connect(&fresh).expect("a test VM boots an image that has only a test version");
    let mut buf = vec![0u8; 4096];
    lab.read(0, &mut buf).expect("read");
    assert_eq!(buf[0], 0x22);
    let production: NbdUri = format!("nbd+unix:///fresh@desk-9?socket={}", socket.display()).parse().expect("uri");
    assert!(Client::connect(&production).is_err(), "a production VM has no version of it to boot");

    let (byte, _lab) = first_byte(&socket, "lab-1");
    assert_eq!(byte, 0x22, "a test VM gets the test version");
    let (byte, mut desk) = first_byte(&socket, "desk-1");
    assert_eq!(byte, 0x11, "a production VM gets production");

    let said = image_ok(&store, &["promote", "win"]);
    assert!(said.contains("v2 (current)"), "{said}");
    let (byte, _) = first_byte(&socket, "desk-2");
    assert_eq!(byte, 0x22, "after the promote every new VM gets v2");
    let (byte, _) = first_byte(&socket, "lab-2");
    assert_eq!(byte, 0x22, "with no test version, test VMs follow production");
    let mut buf = vec![0u8; 4096];
    desk.read(1 << 20, &mut buf).expect("desk-1 reads on");
    assert!(buf.iter().all(|&b| b == 0x11), "a running VM keeps the version it booted");

    let said = image_ok(&store, &["rollback", "win"]);
    assert!(said.contains("v1 (current)"), "{said}");
    let (byte, _) = first_byte(&socket, "desk-3");
    assert_eq!(byte, 0x11, "after the rollback new VMs get v1 again");
    let (ok, text) = image(&store, &["rollback", "win"]);
    assert!(!ok && text.contains("no earlier production version"), "one rollback undoes one change: {text}");
    let (ok, text) = image(&store, &["test", "win", "9"]);
    assert!(!ok && text.contains("no version v9"), "{text}");

    // The test group changed live, here to a named group's VMs.
    image_ok(&store, &["test", "win", "v2"]);
    let said = vm(&control, &["test-group", "group:office"]);
    assert!(said.contains("test group: group:office"), "{said}");
    let (byte, _) = first_byte(&socket, "desk-4");
    assert_eq!(byte, 0x22, "a VM of the named group is in the test group now");
    let (byte, _) = first_byte(&socket, "lab-3");
    assert_eq!(byte, 0x11, "lab-* is no longer");
    let said = vm(&control, &["test-group", "--none"]);
    assert!(said.contains("no test group"), "{said}");
    let (byte, _) = first_byte(&socket, "desk-5");
    assert_eq!(byte, 0x11, "with no test group every new VM gets production");
    drop(server);
}

/// `overspill vm ARGS --control CONTROL`, as it ended.
fn vm_run(control: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_overspill"))
        .arg("vm")
        .args(args)
        .arg("--control")
        .arg(control)
        .stdin(Stdio::null())
        .output()
        .expect("overspill vm")
}

/// `overspill vm ARGS --control CONTROL`, which must succeed: what it printed.
fn vm(control: &Path, args: &[&str]) -> String {
    let out = vm_run(control, args);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "vm {args:?}: {text}");
    text
}

/// qemu-img finds qcow2 layer `layer` sound and reading `expected` (through its backing file).
fn assert_layer_reads(dir: &Path, layer: &Path, expected: &[u8]) {
    let check = Command::new("qemu-img").args(["check", "-f", "qcow2"]).arg(layer).output().expect("qemu-img check");
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stdout));
    let expected_file = dir.join("expected.raw");
    std::fs::write(&expected_file, expected).expect("expected");
    let compare = Command::new("qemu-img")
        .args(["compare", "-f", "qcow2", "-F", "raw"])
        .arg(layer)
        .arg(&expected_file)
        .output()
        .expect("qemu-img compare");
    assert!(compare.status.success(), "{}", String::from_utf8_lossy(&compare.stdout));
}

/// `vm capture`: a maintenance VM's writes (data, zeroes, a trim back to the image) become the
/// next version, a qcow2 layer over the one it booted that `qemu-img check` finds sound and
/// `qemu-img compare` finds equal to what the VM saw; the test group then boots it and production
/// VMs do not; the captured VM's overlay ended, so it boots afresh.
#[test]
fn a_captured_vm_becomes_the_next_version_that_the_test_group_boots() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("images");
    publish_filled(&store, "win", 0x11, true);
    let (server, socket, control) = serve_store(dir.path(), &store, &[]);

    // The maintenance VM writes, zeroes and trims, and stays connected.
    let uri: NbdUri = format!("nbd+unix:///win@maint?socket={}", socket.display()).parse().expect("uri");
    let mut maint = Client::connect(&uri).expect("maint connects");
    maint.write(1 << 20, &vec![0x5au8; 64 << 10], false).expect("write");
    maint.write(3 << 20, &vec![0x66u8; 64 << 10], false).expect("write");
    maint.write_zeroes(2 << 20, 64 << 10, false).expect("zeroes");
    maint.trim(3 << 20, 64 << 10).expect("trim");
    let said = vm(&control, &["capture", "maint"]);
    assert!(said.contains("captured as win v2"), "{said}");
    let mut buf = vec![0u8; 4096];
    assert!(maint.read(0, &mut buf).is_err(), "the captured VM's connection closes at its next request");

    let layer = store.join("win/v2.qcow2");
    let mut expected = vec![0x11u8; 4 << 20];
    expected[1 << 20..(1 << 20) + (64 << 10)].fill(0x5a);
    expected[2 << 20..(2 << 20) + (64 << 10)].fill(0);
    assert_layer_reads(dir.path(), &layer, &expected);

    image_ok(&store, &["test", "win", "v2"]);
    // The layer and the version under it in one file: the next version, which the test stage
    // names from now on; the same bytes as v2's chain.
    let said = image_ok(&store, &["compact", "win", "2"]);
    assert!(said.contains("win v3 (test): v2 in one file"), "{said}");
    let flat = store.join("win/v3.img");
    let info = Command::new("qemu-img").args(["info", "--output=json"]).arg(&flat).output().expect("qemu-img info");
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).expect("qemu-img info's JSON");
    assert_eq!((info["format"].as_str(), info.get("backing-filename")), (Some("raw"), None), "{info}");
    let compare = Command::new("qemu-img").args(["compare", "-q"]).arg(&layer).arg(&flat).output().expect("compare");
    assert!(compare.status.success(), "the flat version differs from the chain");
    let read_at = |vm: &str, offset: u64| {
        let uri: NbdUri = format!("nbd+unix:///win@{vm}?socket={}", socket.display()).parse().expect("uri");
        let mut client = Client::connect(&uri).unwrap_or_else(|e| panic!("{vm}: {e}"));
        let mut buf = vec![0u8; 4096];
        client.read(offset, &mut buf).expect("read");
        buf[0]
    };
    assert_eq!((read_at("lab-1", 1 << 20), read_at("lab-2", 2 << 20), read_at("lab-3", 3 << 20)), (0x5a, 0, 0x11));
    assert_eq!(read_at("desk-1", 1 << 20), 0x11, "production VMs boot v1");
    assert_eq!(read_at("maint", 1 << 20), 0x11, "the captured VM's overlay ended: it boots production afresh");
    let (ok, text) = {
        let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
            .args(["vm", "capture", "nobody", "--control"])
            .arg(&control)
            .output()
            .expect("overspill vm");
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    assert!(!ok && text.contains("holds no VM nobody"), "{text}");
    drop(server);
}

/// The byte at `offset` of VM `vm`'s disk, over a connection that stays open.
fn byte_at(client: &mut Client, offset: u64) -> u8 {
    let mut buf = vec![0u8; 4096];
    client.read(offset, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == buf[0]), "one run of bytes at {offset}");
    buf[0]
}

fn connect(socket: &Path, image: &str, vm: &str) -> Result<Client, String> {
    let uri: NbdUri = format!("nbd+unix:///{image}@{vm}?socket={}", socket.display()).parse().expect("uri");
    Client::connect(&uri).map_err(|e| e.to_string())
}

/// `overspill vm ARGS`, expected to fail: what it said.
fn vm_refused(control: &Path, args: &[&str]) -> String {
    let out = vm_run(control, args);
    assert!(!out.status.success(), "vm {args:?} succeeded: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `vm checkpoint` writes a running VM's disk as a layer (qemu-img finds it sound and equal to
/// what the VM saw) while the VM goes on; `vm fork` starts VMs from it: each sees the
/// checkpoint, diverges on its own (a write or a TRIM in one is not in another), starts from the
/// checkpoint again once its overlay ends, and outlives a server restart while it waits; a
/// dropped fork is refused until reset, after which the name boots production.
#[test]
fn forks_of_a_checkpoint_start_from_it_diverge_apart_and_outlive_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("images");
    publish_filled(&store, "win", 0x11, true);
    let (mut server, socket, control) = serve_store(dir.path(), &store, &[]);

    let mut src = connect(&socket, "win", "src").expect("src connects");
    src.write(1 << 20, &vec![0x5au8; 64 << 10], false).expect("write");
    src.write(3 << 20, &vec![0x66u8; 64 << 10], false).expect("write");
    src.write_zeroes(2 << 20, 64 << 10, false).expect("zeroes");
    let said = vm(&control, &["checkpoint", "src", "--as", "c1"]);
    assert!(said.contains("checkpoint win:@c1"), "{said}");
    src.write(1 << 20, &vec![0x77u8; 4096], false).expect("the checkpointed VM goes on");
    assert_eq!(byte_at(&mut src, 1 << 20), 0x77);

    let layer = store.join("win/checkpoints/c1.qcow2");
    let mut expected = vec![0x11u8; 4 << 20];
    expected[1 << 20..(1 << 20) + (64 << 10)].fill(0x5a);
    expected[2 << 20..(2 << 20) + (64 << 10)].fill(0);
    expected[3 << 20..(3 << 20) + (64 << 10)].fill(0x66);
    assert_layer_reads(dir.path(), &layer, &expected);
    assert!(vm_refused(&control, &["checkpoint", "src", "--as", "c1"]).contains("written once"));

    let said = vm(&control, &["fork", "win:@c1", "--as", "a,b"]);
    assert!(said.contains("a,b: forks of win:@c1"), "{said}");
    let list = vm(&control, &["list"]);
    assert!(list.lines().any(|l| l.starts_with("b ") && l.contains("win:@c1") && l.contains("fork")), "{list}");
    assert!(vm_refused(&control, &["fork", "win:@c1", "--as", "src"]).contains("exists already"));
    assert!(vm_refused(&control, &["fork", "win:@nope", "--as", "z"]).contains("no version @nope"));
    assert!(vm_refused(&control, &["fork", "win:v1", "--as", "z"]).contains("no checkpoint"));

    let mut a = connect(&socket, "win", "a").expect("fork a connects");
    assert_eq!(
        [0, 1 << 20, 2 << 20, 3 << 20].map(|offset| byte_at(&mut a, offset)),
        [0x11, 0x5a, 0, 0x66],
        "a fork starts from the checkpoint, not from what its source wrote after it"
    );
    a.write(0, &vec![0x99u8; 4096], false).expect("a writes");
    a.write(3 << 20, &vec![0xaau8; 4096], false).expect("a writes");
    a.trim(3 << 20, 4096).expect("a trims");
    assert_eq!(byte_at(&mut a, 3 << 20), 0x66, "a TRIM reads the checkpoint again");
    let mut b = connect(&socket, "win", "b").expect("fork b connects");
    assert_eq!([0, 1 << 20, 3 << 20].map(|offset| byte_at(&mut b, offset)), [0x11, 0x5a, 0x66], "b is not a");
    b.disconnect().expect("b leaves cleanly");
    a.disconnect().expect("a leaves cleanly");
    let mut a = connect(&socket, "win", "a").expect("a again");
    assert_eq!(byte_at(&mut a, 0), 0x11, "an ended fork starts from its checkpoint again");
    a.disconnect().expect("a leaves");

    // A fork straight from a running VM, through a checkpoint of it.
    let said = vm(&control, &["fork", "src", "--as", "c", "--checkpoint", "c2"]);
    assert!(said.contains("forks of win:@c2"), "{said}");
    let mut c = connect(&socket, "win", "c").expect("fork c connects");
    assert_eq!(byte_at(&mut c, 1 << 20), 0x77, "c is src as it is now");
    assert!(vm_refused(&control, &["capture", "c"]).contains("runs over checkpoint win:@c2"));
    c.disconnect().expect("c leaves");
    let refused = vm_refused(&control, &["fork", "src", "--as", "z,a", "--checkpoint", "c3"]);
    assert!(refused.contains("a is a fork of win:@c1 already"), "{refused}");
    assert!(!store.join("win/checkpoints/c3.qcow2").exists(), "no checkpoint is written for forks refused");
    assert!(connect(&socket, "other", "c").is_err(), "a fork connects to its own image only");
    src.disconnect().expect("src leaves");

    server.stop();
    let (mut server, socket, control) = serve_store(dir.path(), &store, &[]);
    let list = vm(&control, &["list"]);
    assert!(["a ", "b ", "c "].iter().all(|n| list.lines().any(|l| l.starts_with(n) && l.contains("fork"))), "{list}");
    let mut b = connect(&socket, "win", "b").expect("b after the restart");
    assert_eq!(byte_at(&mut b, 1 << 20), 0x5a, "a fork outlives the server");
    b.disconnect().expect("b leaves");

    vm(&control, &["drop", "b"]);
    let refused = connect(&socket, "win", "b").expect_err("a dropped fork is refused");
    assert!(refused.contains("dropped"), "{refused}");
    assert!(vm(&control, &["drop", "b"]).contains("dropped fork already"));
    assert!(vm_refused(&control, &["fork", "win:@c1", "--as", "b"]).contains("dropped fork"));
    let list = vm(&control, &["list"]);
    assert!(list.lines().any(|l| l.starts_with("b ") && l.contains("dropped")), "{list}");
    let said = vm(&control, &["reset", "b"]);
    assert!(said.contains("no longer a fork"), "{said}");
    let mut b = connect(&socket, "win", "b").expect("b after its reset");
    assert_eq!(byte_at(&mut b, 1 << 20), 0x11, "a reset fork's name boots production");
    b.disconnect().expect("b leaves");

    // A fork whose checkpoint is gone is refused, never started from the image instead.
    std::fs::remove_file(store.join("win/checkpoints/c2.qcow2")).expect("remove c2");
    let refused = connect(&socket, "win", "c").expect_err("c's checkpoint is gone");
    assert!(refused.contains("fork of win:@c2"), "{refused}");
    server.stop();
}

/// A checkpoint chain (a checkpoint of a fork of a checkpoint) taken out of one store to a
/// directory and brought into another that has the same version: the layers arrive whole
/// (qemu-img finds them equal) and a fork there reads what the VM wrote here. A store whose
/// version has other bytes, and a layer altered on the way, are refused, leaving no checkpoint.
#[test]
fn a_checkpoint_taken_out_to_a_directory_forks_in_another_store_with_the_same_version() {
    let dir = tempfile::tempdir().expect("tempdir");
    let [here, there, other, harmed] =
        ["here", "there", "other", "harmed"].map(|name| dir.path().join(name)).map(|d| (d.join("images"), d));
    let golden = dir.path().join("v1.img");
    std::fs::write(&golden, vec![0x11u8; 4 << 20]).expect("golden");
    for (store, _) in [&here, &there, &harmed] {
        image_ok(store, &["publish", "win", golden.to_str().expect("utf-8"), "--activate"]);
    }
    let different = dir.path().join("different.img");
    std::fs::write(&different, vec![0x12u8; 4 << 20]).expect("different");
    image_ok(&other.0, &["publish", "win", different.to_str().expect("utf-8"), "--activate"]);

    std::fs::create_dir_all(&here.1).expect("dir");
    let (mut server, socket, control) = serve_store(&here.1, &here.0, &[]);
    let mut src = connect(&socket, "win", "src").expect("src");
    src.write(1 << 20, &vec![0x5au8; 64 << 10], false).expect("write");
    vm(&control, &["checkpoint", "src", "--as", "c1"]);
    vm(&control, &["fork", "win:@c1", "--as", "f"]);
    let mut f = connect(&socket, "win", "f").expect("f");
    f.write(2 << 20, &vec![0x6bu8; 64 << 10], false).expect("write");
    f.write_zeroes(1 << 20, 4096, false).expect("zeroes");
    let out = dir.path().join("out");
    let said = vm(&control, &["checkpoint", "f", "--as", "c2", "--to", out.to_str().expect("utf-8")]);
    assert!(said.contains("2 layer(s)") && said.contains("win@c2.json"), "{said}");
    server.stop();

    let manifest = out.join("win@c2.json");
    let said = image_ok(&there.0, &["checkpoint-import", manifest.to_str().expect("utf-8")]);
    assert!(said.contains("win:@c2: brought in"), "{said}");
    for name in ["c1", "c2"] {
        let (a, b) = (
            here.0.join(format!("win/checkpoints/{name}.qcow2")),
            there.0.join(format!("win/checkpoints/{name}.qcow2")),
        );
        let compare = Command::new("qemu-img").args(["compare", "-q"]).arg(&a).arg(&b).output().expect("qemu-img");
        assert!(compare.status.success(), "{name} arrived other than it left");
    }
    let said = image_ok(&there.0, &["checkpoint-import", manifest.to_str().expect("utf-8")]);
    assert!(said.contains("brought in"), "an import run again keeps what is there: {said}");

    let (mut server, socket, control) = serve_store(&there.1, &there.0, &[]);
    // Forked straight from the manifest: brought into the server's store (there already: kept).
    let said = vm(&control, &["fork", manifest.to_str().expect("utf-8"), "--as", "g"]);
    assert!(said.contains("g: forks of win:@c2"), "{said}");
    let mut g = connect(&socket, "win", "g").expect("g");
    assert_eq!(
        [0, 1 << 20, (1 << 20) + 4096, 2 << 20].map(|offset| byte_at(&mut g, offset)),
        [0x11, 0, 0x5a, 0x6b],
        "a fork in the other store reads what src and f wrote in this one"
    );
    g.disconnect().expect("g leaves");
    // Which layer holds each range, as QEMU's tools ask: g's own (1, nothing yet), c2 (2), c1
    // (3), v1 (4).
    let uri = format!("nbd+unix:///win@g?socket={}", socket.display());
    let mapped = common::run_ok(dir.path(), "nbdinfo", &["--map=qemu:allocation-depth", "--json", &uri]);
    let map: Vec<serde_json::Value> = serde_json::from_str(&mapped.stdout).expect("nbdinfo's JSON");
    let seen: Vec<(u64, u64, u64)> = map
        .iter()
        .map(|e| {
            (
                e["offset"].as_u64().expect("offset"),
                e["length"].as_u64().expect("length"),
                e["type"].as_u64().expect("depth"),
            )
        })
        .collect();
    let mib = 1u64 << 20;
    let expected = [
        (0, mib, 4),
        (mib, 4096, 2),
        (mib + 4096, (64 << 10) - 4096, 3),
        (mib + (64 << 10), mib - (64 << 10), 4),
        (2 * mib, 64 << 10, 2),
        (2 * mib + (64 << 10), 2 * mib - (64 << 10), 4),
    ];
    assert_eq!(seen, expected, "nbdinfo --map=qemu:allocation-depth of a fork of a checkpoint of a fork");
    server.stop();

    let (ok, said) = image(&other.0, &["checkpoint-import", manifest.to_str().expect("utf-8")]);
    assert!(!ok && said.contains("is not the one the checkpoint lies on"), "{said}");
    let layer = out.join("win@c1.qcow2");
    let mut bytes = std::fs::read(&layer).expect("layer");
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&layer, bytes).expect("harm it");
    let (ok, said) = image(&harmed.0, &["checkpoint-import", manifest.to_str().expect("utf-8")]);
    assert!(!ok && said.contains("is not what its manifest says"), "{said}");
    let left: Vec<_> =
        std::fs::read_dir(harmed.0.join("win/checkpoints")).map(|d| d.flatten().collect()).unwrap_or_default();
    assert!(left.is_empty(), "a refused import leaves nothing: {left:?}");
}

/// The maintenance stage: VM maint, made win's maintenance VM over v1 while v2 is production,
/// boots v1; its overlay outlives a clean disconnect (a power-off), the reset the libvirt hook
/// asks at each start, and a server restart; no other VM sees its writes; its capture is the
/// next version (a layer over v1) and ends the stage, after which maint boots production
/// afresh. A second maintenance VM is refused while one is named.
#[test]
fn the_maintenance_vm_keeps_its_writes_across_its_boots_until_captured() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("images");
    publish_filled(&store, "win", 0x11, true);
    publish_filled(&store, "win", 0x22, true);
    let said = image_ok(&store, &["maintain", "win", "maint", "1"]);
    assert!(said.contains("VM maint maintains it over v1"), "{said}");
    let (ok, said) = image(&store, &["maintain", "win", "other"]);
    assert!(!ok && said.contains("VM maint maintains it already"), "{said}");
    assert!(image_ok(&store, &["list"]).contains("maintenance: VM maint over v1"));

    let (mut server, socket, control) = serve_store(dir.path(), &store, &[]);
    let mut maint = connect(&socket, "win", "maint").expect("maint");
    assert_eq!(byte_at(&mut maint, 0), 0x11, "the maintenance VM boots the version it maintains");
    maint.write(1 << 20, &vec![0x5au8; 64 << 10], false).expect("write");
    maint.disconnect().expect("maint powers off");
    let list = vm(&control, &["list"]);
    assert!(list.lines().any(|l| l.starts_with("maint ") && l.contains("maintenance VM")), "{list}");
    assert!(vm(&control, &["reset", "maint"]).contains("maintenance VM"), "the hook's reset is declined");
    let mut maint = connect(&socket, "win", "maint").expect("maint boots again");
    assert_eq!(byte_at(&mut maint, 1 << 20), 0x5a, "its writes outlive its power-off and the reset");
    maint.disconnect().expect("maint powers off");
    let mut desk = connect(&socket, "win", "desk").expect("desk");
    assert_eq!([0, 1 << 20].map(|at| byte_at(&mut desk, at)), [0x22, 0x22], "no other VM sees them");
    desk.disconnect().expect("desk leaves");

    server.stop();
    let (mut server, socket, control) = serve_store(dir.path(), &store, &[]);
    let mut maint = connect(&socket, "win", "maint").expect("maint after the restart");
    assert_eq!(byte_at(&mut maint, 1 << 20), 0x5a, "its writes outlive the server");
    let said = vm(&control, &["capture", "maint"]);
    assert!(said.contains("captured as win v3"), "{said}");
    assert!(!image_ok(&store, &["list"]).contains("maintenance:"), "the capture ends the stage");
    drop(maint);
    let mut maint = connect(&socket, "win", "maint").expect("maint afterwards");
    assert_eq!(byte_at(&mut maint, 1 << 20), 0x22, "maint is any VM now: production, afresh");
    maint.disconnect().expect("maint leaves");
    image_ok(&store, &["test", "win", "3"]);
    let mut lab = connect(&socket, "win", "lab-1").expect("lab-1");
    assert_eq!([0, 1 << 20].map(|at| byte_at(&mut lab, at)), [0x11, 0x5a], "v3 is v1 with maint's writes");
    lab.disconnect().expect("lab leaves");
    server.stop();
}

/// A VM made the maintenance VM while it waits in its reconnect grace waits with no end from
/// then on, rather than being lost when its grace runs out; a marker naming another version
/// than the one a VM's overlay runs over does not make that overlay the maintenance one.
#[test]
fn a_vm_made_the_maintenance_vm_in_its_grace_outlives_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("images");
    for image in ["win", "lin"] {
        publish_filled(&store, image, 0x11, true);
        publish_filled(&store, image, 0x11, false);
    }
    let (mut server, socket, control) = serve_store(dir.path(), &store, &["--reconnect-grace", "2s"]);
    for (image, vm) in [("win", "m"), ("lin", "other")] {
        let mut client = connect(&socket, image, vm).expect("connects");
        client.write(1 << 20, &vec![0x5au8; 4096], false).expect("write");
        drop(client); // its connection lost, not ended: its grace begins
    }
    image_ok(&store, &["maintain", "win", "m"]);
    image_ok(&store, &["maintain", "lin", "other", "2"]);
    std::thread::sleep(std::time::Duration::from_millis(3500));
    let list = vm(&control, &["list"]);
    assert!(list.lines().any(|l| l.starts_with("m ") && l.contains("maintenance VM")), "{list}");
    assert!(list.lines().any(|l| l.starts_with("other ") && l.contains("lost")), "over v1, not v2: {list}");
    let mut m = connect(&socket, "win", "m").expect("m comes back");
    assert_eq!(byte_at(&mut m, 1 << 20), 0x5a, "its writes waited");
    m.disconnect().expect("m powers off");
    server.stop();
}

/// The maintenance VM's overlay lives in the memory directory: a host reboot takes it (its
/// ledger file then names an earlier boot, and goes). Its next start is refused by name, not
/// begun afresh over the version, which would silently lose the maintenance work; naming the
/// VM again (`image maintain`) begins it from the version.
#[test]
fn a_maintenance_vm_whose_overlay_a_reboot_took_is_refused_until_named_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("images");
    publish_filled(&store, "win", 0x11, true);
    image_ok(&store, &["maintain", "win", "maint"]);
    let (mut server, socket, _control) = serve_store(dir.path(), &store, &[]);
    let mut maint = connect(&socket, "win", "maint").expect("maint");
    maint.write(1 << 20, &vec![0x5au8; 64 << 10], false).expect("write");
    maint.disconnect().expect("maint powers off");
    server.stop();
    let listed = image_ok(&store, &["list"]);
    assert!(listed.contains("maintenance: VM maint over v1 (its overlay, begun, is the next version)"), "{listed}");

    // The host reboots: the memory directory (tmpfs) is empty, the ledger file of another boot.
    let ledger_file = dir.path().join("spill/state/vm-maint.json");
    let mut entry: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&ledger_file).expect("the VM's ledger file")).expect("JSON");
    entry["boot_id"] = "an earlier boot".into();
    std::fs::write(&ledger_file, serde_json::to_vec(&entry).expect("JSON")).expect("ledger file");
    for file in std::fs::read_dir(dir.path().join("memory")).expect("memory dir").flatten() {
        std::fs::remove_file(file.path()).expect("a page file");
    }
    let (mut server, socket, control) = serve_store(dir.path(), &store, &[]);
    let refused = connect(&socket, "win", "maint").expect_err("maint starts over v1 alone");
    assert!(refused.contains("maintenance VM") && refused.contains("is gone"), "{refused}");
    let mut desk = connect(&socket, "win", "desk").expect("other VMs go on");
    assert_eq!(byte_at(&mut desk, 1 << 20), 0x11);
    desk.disconnect().expect("desk leaves");

    image_ok(&store, &["maintain", "win", "maint", "1"]);
    let mut maint = connect(&socket, "win", "maint").expect("maint named again");
    assert_eq!(byte_at(&mut maint, 1 << 20), 0x11, "its overlay begun again from v1");
    maint.write(1 << 20, &vec![0x6bu8; 4096], false).expect("write");
    maint.disconnect().expect("maint powers off");
    // Thrown away by the operator, its next boot begins over v1 (not refused).
    let said = vm(&control, &["drop", "maint"]);
    assert!(said.contains("maint"), "{said}");
    let mut maint = connect(&socket, "win", "maint").expect("maint after vm drop");
    assert_eq!(byte_at(&mut maint, 1 << 20), 0x11, "vm drop threw its writes away");
    maint.disconnect().expect("maint powers off");
    server.stop();
}
