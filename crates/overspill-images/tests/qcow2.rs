//! The qcow2 reader against images made and written by qemu's own tools, compared byte for byte
//! with `qemu-img convert`'s raw output.

mod common;

use std::path::Path;

use common::{assert_reads_match, run, s};
use overspill_engine::{EngineError, GoldenImage};
use overspill_images::open_image;
use overspill_images::qcow2::Qcow2Image;

/// A qcow2 image with data, zeroed and unallocated regions, and its raw equivalent.
fn make_image(dir: &Path, options: &str) -> (std::path::PathBuf, Vec<u8>) {
    let qcow = dir.join(format!("golden-{}.qcow2", options.replace([',', '='], "_")));
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", options, s(&qcow), "40M"]);
    run(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            "write -P 0x11 0 100k",
            "-c",
            "write -P 0x22 1000k 3000k",
            "-c",
            "write -P 0x33 20m 4k",
            "-c",
            "write -z 1m 256k",
            "-c",
            "write -P 0x44 39m 1m",
            "-c",
            "discard 2m 64k",
            s(&qcow),
        ],
    );
    let raw = dir.join("expected.raw");
    run("qemu-img", &["convert", "-f", "qcow2", "-O", "raw", s(&qcow), s(&raw)]);
    (qcow, std::fs::read(&raw).expect("raw image"))
}

#[test]
fn reads_what_qemu_wrote_for_v2_v3_and_small_and_large_clusters() {
    let dir = tempfile::tempdir().expect("tempdir");
    for options in ["compat=1.1", "compat=0.10", "compat=1.1,cluster_size=4096", "compat=1.1,cluster_size=2M"] {
        let (qcow, expected) = make_image(dir.path(), options);
        let image = open_image(&qcow).expect("qcow2 opens");
        assert!(image.describe().contains("qcow2"), "{options}: sniffed as qcow2");
        assert_reads_match(image.as_ref(), &expected);
    }
}

#[test]
fn refuses_what_it_does_not_support() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let (qcow, _) = make_image(d, "compat=1.1");
    // A backing file.
    let overlay = d.join("overlay.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", s(&qcow), s(&overlay)]);
    let err = Qcow2Image::open(&overlay).err().expect("backing file refused");
    assert!(err.to_string().contains("backing file"), "{err}");
    // Subclusters.
    let extended = d.join("extended.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", "extended_l2=on", s(&extended), "8M"]);
    assert!(matches!(Qcow2Image::open(&extended), Err(EngineError::Config(m)) if m.contains("subclusters")));
    // Compressed clusters open, and fail to read with a clear error.
    let compressed = d.join("compressed.qcow2");
    run("qemu-img", &["convert", "-c", "-f", "qcow2", "-O", "qcow2", s(&qcow), s(&compressed)]);
    let image = Qcow2Image::open(&compressed).expect("opens");
    let mut buf = vec![0u8; 4096];
    let err = image.read_at(&mut buf, 0).expect_err("compressed cluster");
    assert_eq!(err.kind(), std::io::ErrorKind::Unsupported);
    // Not qcow2 at all: opened as raw.
    let raw = d.join("plain.img");
    std::fs::write(&raw, vec![5u8; 8192]).expect("write");
    assert!(!open_image(&raw).expect("raw").describe().contains("qcow2"));
    // A truncated header.
    let short = d.join("short.qcow2");
    std::fs::write(&short, [0x51, 0x46, 0x49, 0xfb, 0, 0, 0, 3]).expect("write");
    assert!(open_image(&short).is_err());
}
