//! Tests of the versioned image store and of the versions a server holds open.

use super::*;
use std::time::Duration;

/// A captured version whose first bytes (the guest's) are a qcow2 header is not compacted
/// into a raw file, which would be opened as that qcow2; one whose bytes are plain is, and
/// every marker that named it (production, previous) names the flat file.
#[test]
fn a_version_whose_first_bytes_are_an_image_header_is_not_compacted_into_a_raw_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ImageStore::new(&dir.path().join("images"));
    let file = dir.path().join("a.img");
    std::fs::write(&file, vec![1u8; 1 << 20]).expect("write");
    store.publish("win", &file, true).expect("publish");
    let layer = |first: &[u8]| {
        let block: Vec<u8> = first.iter().copied().chain(std::iter::repeat(7)).take(4096).collect();
        store
            .publish_layer("win", "v1", |path, backing, format| {
                let mut writer = overspill_images::qcow2_layer::LayerWriter::create(path, 1 << 20, backing, format)?;
                writer.data(0, &block)?;
                writer.finish()
            })
            .expect("capture")
    };
    let hostile = layer(b"QFI\xfb\0\0\0\x03");
    let error = store.compact("win", &hostile).expect_err("a header in the guest's first bytes");
    assert!(error.to_string().contains("cannot be a raw file"), "{error}");
    let plain = layer(b"plain");
    store.activate("win", &hostile).expect("activate");
    store.activate("win", &plain).expect("activate");
    let flat = store.compact("win", &plain).expect("compact");
    let entry = store.image("win").expect("image");
    assert_eq!((entry.current.as_deref(), entry.previous.as_deref()), (Some(flat.as_str()), Some(hostile.as_str())));
    let read = open_image(&store.version("win", &flat).expect("flat").path).expect("opens");
    let mut first = [0u8; 8];
    read.read_at(&mut first, 0).expect("read");
    assert_eq!(&first[..5], b"plain");
    let left: Vec<_> = std::fs::read_dir(dir.path().join("images/win"))
        .expect("dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".partial"))
        .collect();
    assert!(left.is_empty(), "a refused compaction leaves no partial file: {left:?}");
}

/// INFO and LIST describe a version once, not at every request: the description is kept
/// while the file stays the same one, and found again when the file under the version's
/// name changes, even with its old modification time (its length, change time or inode tell).
#[test]
fn a_version_is_described_once_until_its_file_changes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ImageStore::new(&dir.path().join("images"));
    let file = dir.path().join("a.img");
    std::fs::write(&file, vec![1u8; 8192]).expect("write");
    store.publish("win7", &file, true).expect("publish");
    let open = OpenVersions::new(store.clone(), 1 << 20, Arc::default(), HostMemory::unlimited());
    assert_eq!(open.describe("win7", open.store().current("win7").expect("current")).expect("describe").0, 8192);
    // What is kept is what is answered while the file is unchanged.
    for (_, size, _) in open.described.lock().expect("lock").values_mut() {
        *size = 4096;
    }
    assert_eq!(
        open.describe("win7", open.store().current("win7").expect("current")).expect("describe").0,
        4096,
        "described again at each request"
    );
    let path = store.current("win7").expect("current").path;
    let modified = std::fs::metadata(&path).expect("metadata").modified().expect("mtime");
    let mut perms = std::fs::metadata(&path).expect("metadata").permissions();
    #[allow(clippy::permissions_set_readonly_false)]
    perms.set_readonly(false);
    std::fs::set_permissions(&path, perms).expect("writable");
    // Grown in place, its modification time put back.
    let grown = std::fs::OpenOptions::new().write(true).open(&path).expect("open");
    grown.set_len(16384).expect("resize");
    grown.set_modified(modified).expect("set mtime");
    assert_eq!(
        open.describe("win7", open.store().current("win7").expect("current")).expect("describe").0,
        16384,
        "a grown file is described anew"
    );
    // Another file of the same length and modification time renamed into its place.
    let other = dir.path().join("other.img");
    std::fs::write(&other, vec![2u8; 16384]).expect("write");
    std::fs::File::options().write(true).open(&other).expect("open").set_modified(modified).expect("set mtime");
    for (_, size, _) in open.described.lock().expect("lock").values_mut() {
        *size = 4096;
    }
    std::fs::rename(&other, &path).expect("rename");
    assert_eq!(
        open.describe("win7", open.store().current("win7").expect("current")).expect("describe").0,
        16384,
        "a replaced file is described anew"
    );
}

#[test]
fn publish_activate_and_share_open_versions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ImageStore::new(&dir.path().join("images"));
    let file = dir.path().join("a.img");
    std::fs::write(&file, vec![1u8; 8192]).expect("write");
    // A source only its owner may read: the version is readable by the server all the same
    // (the mode is set, not copied from the source nor left to the publisher's umask).
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
    assert_eq!(store.publish("win7", &file, true).expect("publish"), "v1");
    let mode = |path: &Path| {
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(path).expect("stat").permissions()) & 0o777
    };
    let image_dir = dir.path().join("images/win7");
    assert_eq!(
        (mode(&image_dir), mode(&image_dir.join("v1.img")), mode(&image_dir.join("current"))),
        (0o755, 0o444, 0o644)
    );
    std::fs::write(&file, vec![2u8; 4096]).expect("write");
    assert_eq!(store.publish("win7", &file, false).expect("publish"), "v2");
    let entry = store.image("win7").expect("image");
    assert_eq!(entry.versions.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(), ["v1", "v2"]);
    assert_eq!(entry.current.as_deref(), Some("v1"));
    assert!(store.publish("../etc", &file, false).is_err(), "names stay inside the store");
    assert!(store.activate("win7", "v9").is_err());

    let caches = Arc::new(ReadCacheList::default());
    let open = OpenVersions::new(store.clone(), 1 << 20, caches.clone(), HostMemory::unlimited());
    let (v, first) = open.open("win7", open.store().current("win7").expect("current")).expect("current");
    let (_, again) = open.open("win7", open.store().current("win7").expect("current")).expect("current");
    assert_eq!(v, "v1");
    assert!(Arc::ptr_eq(&first, &again), "one open copy per version");
    assert_eq!(first.size(), 8192);
    store.activate("win7", "v2").expect("activate");
    let (v, second) = open.open("win7", open.store().current("win7").expect("current")).expect("current");
    assert_eq!((v.as_str(), second.size()), ("v2", 4096));
    assert_eq!(first.size(), 8192, "a VM on v1 keeps v1");
    assert_eq!(caches.live().len(), 2);
    drop((first, again));
    assert_eq!(caches.live().len(), 1, "v1's cache goes when its last user does");
}

/// A version removed by hand (the newest, say, found bad) leaves its number used: the next
/// publish is not served the removed one's bytes by a server still holding it open for its
/// VMs. And where a number does come back (removed with the store's record, as in a store
/// from before the record), the new file is opened afresh, not taken for the held one.
#[test]
fn a_removed_versions_number_never_serves_its_bytes_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ImageStore::new(&dir.path().join("images"));
    let file = dir.path().join("a.img");
    let publish = |fill: u8, len: usize| {
        std::fs::write(&file, vec![fill; len]).expect("write");
        store.publish("win7", &file, true).expect("publish")
    };
    assert_eq!((publish(1, 8192), publish(2, 8192)), ("v1".to_owned(), "v2".to_owned()));
    let open = OpenVersions::new(store.clone(), 1 << 20, Arc::default(), HostMemory::unlimited());
    let read_first = |image: &Arc<dyn GoldenImage>| {
        let mut byte = [0u8; 1];
        image.read_at(&mut byte, 0).expect("read");
        byte[0]
    };
    let (_, held_v2) = open.open("win7", open.store().current("win7").expect("current")).expect("current");
    assert_eq!(read_first(&held_v2), 2);
    let image_dir = dir.path().join("images/win7");
    std::fs::remove_file(image_dir.join("v2.img")).expect("remove v2");
    assert_eq!(publish(3, 4096), "v3", "the removed v2's number is not given again");
    let (v, image) = open.open("win7", open.store().current("win7").expect("current")).expect("current");
    assert_eq!((v.as_str(), image.size(), read_first(&image)), ("v3", 4096, 3));

    std::fs::remove_file(image_dir.join("v3.img")).expect("remove v3");
    std::fs::remove_file(image_dir.join(HIGHEST_GIVEN)).expect("remove the record");
    assert_eq!(publish(4, 16384), "v2", "without the record, the files are all that tell");
    let (v, image) = open.open("win7", open.store().current("win7").expect("current")).expect("current");
    assert_eq!((v.as_str(), image.size(), read_first(&image)), ("v2", 16384, 4), "the held v2 handed out");
    assert_eq!(open.describe("win7", open.store().current("win7").expect("current")).expect("describe").0, 16384);
    assert_eq!(read_first(&held_v2), 2, "the VMs on the removed v2 keep it");
}

/// A golden image is mostly holes: its version keeps them (a copy that wrote them out as
/// zeroes filled the store's disk), and holds the same bytes.
#[test]
fn a_published_version_keeps_the_images_holes() {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ImageStore::new(&dir.path().join("images"));
    let file = dir.path().join("sparse.img");
    let image = std::fs::File::create(&file).expect("create");
    image.set_len(256 << 20).expect("size");
    image.write_all_at(&[7u8; 65536], 0).expect("write");
    image.write_all_at(&[9u8; 4096], 100 << 20).expect("write");
    image.write_all_at(&[3u8; 10], (256 << 20) - 10).expect("write");
    drop(image);
    let allocated = |path: &Path| std::fs::metadata(path).expect("stat").blocks() * 512;
    if allocated(&file) > 1 << 20 {
        eprintln!("skipped: this filesystem keeps no holes");
        return;
    }
    assert_eq!(store.publish("win7", &file, true).expect("publish"), "v1");
    let version = store.current("win7").expect("current").path;
    assert!(allocated(&version) <= 1 << 20, "{} bytes allocated for 76 KiB of data", allocated(&version));
    assert!(std::fs::read(&version).expect("read") == std::fs::read(&file).expect("read"), "not the same bytes");
    // A block device (an LVM snapshot, say) has no length here: refused, not published empty.
    let err = store.publish("win7", Path::new("/dev/null"), false).expect_err("a device");
    assert!(err.to_string().contains("not a regular file"), "{err}");
    assert_eq!(store.image("win7").expect("image").versions.len(), 1);
}

/// A publish copies its file before it takes the image's lock (a capture or checkpoint of a
/// running VM waits for the lock holding its VM still): the whole copy, sealed, lies in the
/// image's directory while another holds the lock, and becomes a version once it is free.
#[test]
fn a_publish_copies_before_it_takes_the_images_lock() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ImageStore::new(&dir.path().join("images"));
    let image_dir = dir.path().join("images/win7");
    std::fs::create_dir_all(&image_dir).expect("image dir");
    let file = dir.path().join("golden.img");
    std::fs::write(&file, vec![0x5au8; 4 << 20]).expect("golden");
    let publisher = store
        .with_lock("win7", |_| {
            let publisher = {
                let (store, file) = (store.clone(), file.clone());
                std::thread::spawn(move || store.publish("win7", &file, false))
            };
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            let copied = || {
                std::fs::read_dir(&image_dir).expect("read dir").flatten().any(|entry| {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let meta = entry.metadata().expect("metadata");
                    name.ends_with(".partial") && meta.len() == 4 << 20 && meta.permissions().mode() & 0o777 == 0o444
                })
            };
            while !copied() {
                assert!(std::time::Instant::now() < deadline, "no sealed copy while the lock was held elsewhere");
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(publisher)
        })
        .expect("lock");
    assert_eq!(publisher.join().expect("publisher").expect("publish"), "v1");
    let bytes = std::fs::read(store.version("win7", "v1").expect("v1").path).expect("read");
    assert!(bytes.iter().all(|&b| b == 0x5a));
    let left: Vec<_> = std::fs::read_dir(&image_dir)
        .expect("read dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".partial"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Partial files a killed publisher of this host left (a dead pid's) go at the next locked
/// change of the image; another host's (its pids mean nothing here) and other files stay.
#[test]
fn a_dead_publishers_partial_files_go_and_another_hosts_stay() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ImageStore::new(&dir.path().join("images"));
    let image_dir = dir.path().join("images/win7");
    let checkpoints = image_dir.join(CHECKPOINTS);
    std::fs::create_dir_all(&checkpoints).expect("dirs");
    let mark = overspill_engine::store::host_mark();
    let dead = image_dir.join(format!(".overspill-4294967-publish0-{mark}.partial"));
    let dead_import = checkpoints.join(format!(".overspill-4294967-import3-{mark}.partial"));
    let elsewhere = image_dir.join(format!(".overspill-4294967-publish0-{mark}x.partial"));
    let other = image_dir.join(".notes.partial");
    for file in [&dead, &dead_import, &elsewhere, &other] {
        std::fs::write(file, b"half a copy").expect("plant");
    }
    let file = dir.path().join("golden.img");
    std::fs::write(&file, vec![1u8; 1 << 20]).expect("golden");
    store.publish("win7", &file, false).expect("publish");
    assert!(!dead.exists() && !dead_import.exists(), "a dead publisher's partial files stayed");
    assert!(elsewhere.exists() && other.exists());
}

/// Two operators (or two scripts) publishing at once: every publish gets a version of its
/// own, holding exactly the file it published.
#[test]
fn concurrent_publishes_never_share_a_version() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ImageStore::new(&dir.path().join("images"));
    let publishers: Vec<_> = (1..=2u8)
        .map(|publisher| {
            let store = store.clone();
            let dir = dir.path().to_owned();
            std::thread::spawn(move || {
                (0..6u8)
                    .map(|round| {
                        let fill = publisher * 16 + round;
                        let file = dir.join(format!("p{publisher}.img"));
                        std::fs::write(&file, vec![fill; 4 << 20]).expect("write");
                        (store.publish("win7", &file, false).expect("publish"), fill)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let published: Vec<(String, u8)> = publishers.into_iter().flat_map(|p| p.join().expect("publisher")).collect();
    let mut names: Vec<&str> = published.iter().map(|(name, _)| name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), 12, "each publish its own version: {published:?}");
    assert_eq!(store.image("win7").expect("image").versions.len(), 12);
    for (name, fill) in &published {
        let bytes = std::fs::read(store.version("win7", name).expect("version").path).expect("read");
        assert!(bytes.len() == 4 << 20 && bytes.iter().all(|b| b == fill), "{name} is not the file published");
    }
}

/// A VHDX version keeps its format's name; a layer whose backing file lies elsewhere is
/// refused, since a version must be one immutable file.
#[test]
fn versions_keep_their_format_and_layers_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let store = ImageStore::new(&d.join("images"));
    let qemu_img = |args: &[&str]| {
        let out = std::process::Command::new("qemu-img").args(args).current_dir(d).output().expect("qemu-img");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    qemu_img(&["create", "-q", "-f", "vhdx", "disk.vhdx", "8M"]);
    qemu_img(&["create", "-q", "-f", "qcow2", "base.qcow2", "8M"]);
    qemu_img(&["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", "base.qcow2", "top.qcow2"]);
    assert_eq!(store.publish("pvs", &d.join("disk.vhdx"), true).expect("publish"), "v1");
    assert!(d.join("images/pvs/v1.vhdx").is_file());
    assert_eq!(store.image("pvs").expect("image").versions.len(), 1, "listed");
    let err = store.publish("pvs", &d.join("top.qcow2"), false).expect_err("a layer is refused");
    assert!(matches!(err, ServerError::Layered(_)), "{err}");
    assert_eq!(store.publish("pvs", &d.join("base.qcow2"), false).expect("a standalone qcow2"), "v2");
}
