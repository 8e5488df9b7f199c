//! The S3 source against `tests/data/range_server.py` answering path-style requests as an S3
//! store (ranges, ETag, If-Match). Its one test sets this process's `AWS_*` variables, which
//! the source reads: a test binary of its own, so that nothing else runs beside it.
#![cfg(feature = "s3")]

#[allow(dead_code)] // Shared with the overspill crate's tests, which use other parts.
#[path = "common/web_server.rs"]
mod web_server;

use std::path::Path;
use std::time::{Duration, SystemTime};

use overspill_engine::GoldenImage;
use overspill_sources::s3::S3Image;
use web_server::WebServer;

const IMAGE_BYTES: usize = (1 << 20) + 4321;

fn bytes(seed: u8) -> Vec<u8> {
    (0..IMAGE_BYTES).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

fn open(server: &WebServer) -> Result<S3Image, String> {
    // The only test of this binary sets them; no other thread reads the environment meanwhile.
    std::env::set_var("AWS_ENDPOINT", format!("http://127.0.0.1:{}", server.port));
    for (name, value) in [
        ("AWS_ALLOW_HTTP", "true"),
        ("AWS_ACCESS_KEY_ID", "x"),
        ("AWS_SECRET_ACCESS_KEY", "y"),
        ("AWS_REGION", "us-east-1"),
    ] {
        std::env::set_var(name, value);
    }
    S3Image::open_from_env("golden", "golden.img", 1 << 20).map_err(|e| e.to_string())
}

/// A new object put in place of the old, dated later.
fn replace(path: &Path) {
    let new = path.with_extension("new");
    std::fs::write(&new, bytes(2)).expect("new object");
    let later = SystemTime::now() + Duration::from_secs(10);
    std::fs::File::options().write(true).open(&new).and_then(|f| f.set_modified(later)).expect("mtime");
    std::fs::rename(&new, path).expect("rename");
}

#[test]
fn a_replaced_object_fails_reads_and_a_store_without_etags_is_refused() {
    // Caught by If-Match (412), and by the reply's ETag where the store ignores If-Match.
    for options in [&["--s3", "golden"][..], &["--s3", "golden", "--ignore-conditions"]] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("golden.img");
        let original = bytes(1);
        std::fs::write(&path, &original).expect("object");
        let server = WebServer::ranges(dir.path(), options);
        let image = open(&server).expect("open");
        assert_eq!(image.size(), IMAGE_BYTES as u64);
        assert!(image.identity().is_some_and(|identity| identity.contains("etag")));
        let mut buf = vec![0u8; 64 << 10];
        image.read_at(&mut buf, 4096).expect("read");
        assert!(buf[..] == original[4096..4096 + (64 << 10)], "{options:?}: the object's bytes");
        replace(&path);
        let error = image.read_at(&mut buf, 4096).expect_err("a read of the replaced object").to_string();
        eprintln!("{options:?}: {error}");
        if options.contains(&"--ignore-conditions") {
            assert!(error.contains("replaced"), "{error}");
        }
    }
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("golden.img"), bytes(1)).expect("object");
    let server = WebServer::ranges(dir.path(), &["--s3", "golden", "--no-etag"]);
    let error = open(&server).err().expect("refused without an ETag");
    assert!(error.contains("no ETag"), "{error}");
}
