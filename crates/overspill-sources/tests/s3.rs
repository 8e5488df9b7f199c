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

    // A store whose reply says 1 TiB and never ends: the read fails once the body runs past
    // the range asked for, and the client hangs up, having taken about what it asked.
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("golden.img"), bytes(1)).expect("object");
    let server = WebServer::ranges(dir.path(), &["--s3", "golden", "--misbehave", "endless-body", "--after", "0"]);
    let image = open(&server).expect("open");
    let error = image.read_at(&mut vec![0u8; 64 << 10], 0).expect_err("an endless body").to_string();
    assert!(error.contains("runs past"), "{error}");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let sent = loop {
        let log = server.log_text();
        let said = log.lines().find_map(|line| line.strip_prefix("range_server: endless body: "));
        if let Some(sent) = said.and_then(|rest| rest.split(' ').next()).and_then(|n| n.parse::<u64>().ok()) {
            break sent;
        }
        assert!(std::time::Instant::now() < deadline, "the server never stopped sending:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("the endless body: {sent} bytes sent before the client hung up");
    assert!(sent < 64 << 20, "{sent} bytes taken for a read of 64 KiB");

    // A store that drops every connection: tried once and again `MAX_RETRIES` times, not the
    // 11 times over 3 minutes of object_store's defaults.
    let dropping = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = dropping.local_addr().expect("address").port();
    let tries = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = tries.clone();
    std::thread::spawn(move || {
        for stream in dropping.incoming() {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(stream);
        }
    });
    std::env::set_var("AWS_ENDPOINT", format!("http://127.0.0.1:{port}"));
    let error = S3Image::open_from_env("golden", "golden.img", 1 << 20).err().expect("no store").to_string();
    let tries = tries.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!("a store that drops every connection: {tries} tries, then {error}");
    assert_eq!(tries, 1 + overspill_sources::s3::MAX_RETRIES, "{error}");
}
