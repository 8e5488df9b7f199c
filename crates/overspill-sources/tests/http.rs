//! The HTTP source against real web servers on this host: `tests/data/range_server.py` (ranges,
//! ETag, Last-Modified and preconditions, as nginx or S3 answer) in its several guises, and
//! Python's own `http.server`, which ignores Range and must be refused.
#![cfg(feature = "http")]

#[allow(dead_code)] // Shared with the overspill crate's tests, which use other parts.
#[path = "common/web_server.rs"]
mod web_server;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use overspill_engine::GoldenImage;
use overspill_sources::http::HttpImage;
use overspill_sources::{open_source, Source, SourceSettings};
use web_server::WebServer;

const IMAGE_BYTES: usize = (3 << 20) + 1234;
/// A presigned URL's credentials, which must never be shown.
const SECRETS: [&str; 3] = ["hunter2", "deadbeefcafe", "AKIAFAKEKEY"];

/// Deterministic bytes (xorshift64), so that a failure reproduces.
fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn golden(dir: &Path, seed: u64) -> (PathBuf, Vec<u8>) {
    let bytes = pseudo_random(IMAGE_BYTES, seed);
    let path = dir.join("golden.img");
    std::fs::write(&path, &bytes).expect("golden image");
    (path, bytes)
}

fn open(url: &str) -> Result<HttpImage, String> {
    let Source::Http { url } = Source::parse(url).expect("an HTTP URL") else { panic!("{url} is not an HTTP source") };
    HttpImage::open(&url, 256 << 10).map_err(|e| e.to_string())
}

/// Replaces the file as a publisher would: a new file renamed over the old, dated later.
fn replace(path: &Path) {
    let new = path.with_extension("new");
    std::fs::write(&new, pseudo_random(IMAGE_BYTES, 99)).expect("new image");
    let later = SystemTime::now() + Duration::from_secs(10);
    std::fs::File::options().write(true).open(&new).and_then(|f| f.set_modified(later)).expect("mtime");
    std::fs::rename(&new, path).expect("rename");
}

#[track_caller]
fn assert_no_secrets(text: &str) {
    for secret in SECRETS {
        assert!(!text.contains(secret), "{secret:?} shown in: {text}");
    }
}

/// A server that says its image is 2^62 bytes: refused at open, before a local tier sizes its
/// file and its tables from the claim (2^46 bytes of checksums); every VM would be refused such
/// a disk anyway.
#[test]
fn an_image_larger_than_an_overlay_maps_is_refused_at_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    golden(dir.path(), 3);
    let claim = (1u64 << 62).to_string();
    let server = WebServer::ranges(dir.path(), &["--claim-size", &claim]);
    let source = Source::parse(&server.url("golden.img")).expect("parse");
    let tier = dir.path().join("tier");
    let settings = SourceSettings { local_tier_dir: Some(tier.clone()), ..SourceSettings::default() };
    let error = open_source(&source, &settings).err().expect("refused").to_string();
    assert!(error.contains("16 TiB"), "{error}");
    let made: Vec<_> = std::fs::read_dir(&tier).map(|d| d.flatten().collect()).unwrap_or_default();
    assert!(made.is_empty(), "the local tier made {made:?}");
    // Within an overlay's reach, 4 KiB chunks over 16 TiB would keep 16.5 GiB of checksums: that
    // local tier is refused too, with what to change.
    let claim = overspill_engine::MAX_DISK_BYTES.to_string();
    let server = WebServer::ranges(dir.path(), &["--claim-size", &claim]);
    let source = Source::parse(&server.url("golden.img")).expect("parse");
    let settings = SourceSettings { remote_fetch_bytes: Some(4096), ..settings };
    let error = open_source(&source, &settings).err().expect("refused").to_string();
    assert!(error.contains("--remote-chunk"), "{error}");
}

#[test]
fn random_reads_equal_the_file_and_past_the_end_reads_zero() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, bytes) = golden(dir.path(), 1);
    // Every way of learning the image: HEAD with an ETag, HEAD refused (a URL presigned for
    // GET), no ETag (Last-Modified only), and validators only on GET replies.
    for options in [&[][..], &["--no-head"], &["--no-etag"], &["--validators-on-get-only"]] {
        let server = WebServer::ranges(dir.path(), options);
        let source = Source::parse(&server.url("golden.img")).expect("parse");
        let image = open_source(&source, &SourceSettings::default()).expect("open");
        assert_eq!(image.size(), IMAGE_BYTES as u64, "{options:?}");
        assert_eq!(image.preferred_fetch_bytes(), Some(overspill_sources::REMOTE_FETCH_BYTES));
        let identity = image.identity().expect("an identity");
        assert!(identity.contains(&format!("size {IMAGE_BYTES}")), "{identity}");
        let validator = if options == ["--no-etag"] { "last-modified" } else { "etag" };
        assert!(identity.contains(validator), "{options:?}: {identity}");
        let mut state = 0x1234_5678_u64;
        for _ in 0..100 {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let offset = (state >> 20) % (IMAGE_BYTES as u64 + 4096);
            let len = ((state >> 8) % (300 << 10)) as usize + 1;
            let mut buf = vec![0xa5u8; len];
            image.read_at(&mut buf, offset).expect("read");
            let inside = (IMAGE_BYTES as u64).saturating_sub(offset).min(len as u64) as usize;
            let start = offset as usize;
            assert!(buf[..inside] == bytes[start..start + inside], "{options:?}: {len} bytes at {offset} differ");
            assert!(buf[inside..].iter().all(|&b| b == 0), "{options:?}: past the end reads zero");
        }
        let mut whole = vec![0u8; IMAGE_BYTES];
        image.read_at(&mut whole, 0).expect("read all");
        assert!(whole == bytes, "{options:?}: the whole image differs");
    }
}

#[test]
fn a_server_without_range_support_is_refused_at_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    golden(dir.path(), 2);
    let server = WebServer::plain(dir.path());
    let error = open(&format!("{}?X-Amz-Signature=deadbeefcafe", server.url("golden.img"))).err().expect("refused");
    assert!(error.contains("does not support range requests"), "{error}");
    assert_no_secrets(&error);
    let missing = open(&server.url("missing.img")).err().expect("no such file");
    assert!(missing.contains("404"), "{missing}");
}

#[test]
fn a_replaced_image_fails_reads_rather_than_mixing_images() {
    // By If-Match, by the reply's ETag (a server that ignores preconditions), by
    // If-Unmodified-Since, by the reply's Last-Modified, by its absence where it is the only
    // validator, and by validators that only GET replies carry.
    let cases: [&[&str]; 7] = [
        &[],
        &["--ignore-conditions"],
        &["--no-etag"],
        &["--no-etag", "--ignore-conditions"],
        &["--no-etag", "--ignore-conditions", "--no-last-modified-on-206"],
        &["--validators-on-get-only"],
        &["--validators-on-get-only", "--ignore-conditions"],
    ];
    for options in cases {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, bytes) = golden(dir.path(), 3);
        let server = WebServer::ranges(dir.path(), options);
        let opened = open(&server.url("golden.img"));
        if options.contains(&"--no-last-modified-on-206") {
            // Nothing in such a reply shows which image it is from: refused at open, where the
            // last byte is read as every read will be.
            let error = opened.err().expect("replies without their only validator");
            assert!(error.contains("no Last-Modified"), "{error}");
            continue;
        }
        let image = opened.expect("open");
        let mut buf = vec![0u8; 4096];
        image.read_at(&mut buf, 8192).expect("read before");
        assert!(buf[..] == bytes[8192..8192 + 4096]);
        replace(&path);
        let error = image.read_at(&mut buf, 8192).expect_err("a read of the replaced image").to_string();
        assert!(error.contains("replaced"), "{options:?}: {error}");
    }
}

/// Replies that are not exactly the bytes asked for fail the read, however they are wrong (a
/// body cut short is tried again, and fails when every try is cut); a redirect is followed.
#[test]
fn a_reply_not_exactly_the_range_asked_for_fails_the_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, bytes) = golden(dir.path(), 6);
    for (how, error_says) in [
        ("shifted-range", "Content-Range"),
        ("cut-body", "tried 3 times"),
        ("long-body", "more than"),
        ("gzip", "encoded"),
        ("redirect", ""),
    ] {
        let server = WebServer::ranges(dir.path(), &["--misbehave", how]);
        let image = open(&server.url("golden.img")).unwrap_or_else(|e| panic!("{how}: open: {e}"));
        let mut buf = vec![0xa5u8; 65536];
        let read = image.read_at(&mut buf, 8192);
        if how == "redirect" {
            read.unwrap_or_else(|e| panic!("{how}: {e}"));
            assert!(buf[..] == bytes[8192..8192 + 65536], "{how}: the file's bytes");
        } else {
            let error = read.expect_err(how).to_string();
            assert!(error.contains(error_says), "{how}: {error}");
        }
    }
}

/// A server that sends neither ETag nor Last-Modified cannot show that it still serves the
/// image opened: refused at open, rather than mix a replaced image's blocks into VMs.
#[test]
fn a_server_without_validators_is_refused_at_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    golden(dir.path(), 4);
    let server = WebServer::ranges(dir.path(), &["--no-validators"]);
    let error = open(&server.url("golden.img")).err().expect("refused");
    assert!(error.contains("no ETag or Last-Modified"), "{error}");
}

#[test]
fn credentials_in_the_url_are_never_shown() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = golden(dir.path(), 4);
    let server = WebServer::ranges(dir.path(), &[]);
    let secret_url = |file: &str| {
        format!(
            "http://user:hunter2@127.0.0.1:{}/{file}?X-Amz-Credential=AKIAFAKEKEY&X-Amz-Signature=deadbeefcafe",
            server.port
        )
    };
    let image = open(&secret_url("golden.img")).expect("open");
    let shown = [
        image.describe(),
        image.identity().unwrap_or_default(),
        format!("{:?}", Source::parse(&secret_url("golden.img"))),
    ];
    for text in &shown {
        assert_no_secrets(text);
    }
    assert!(image.describe().ends_with("/golden.img?REDACTED"), "{}", image.describe());
    replace(&path);
    let mut buf = [0u8; 512];
    assert_no_secrets(&image.read_at(&mut buf, 0).expect_err("replaced").to_string());
    assert_no_secrets(&open(&secret_url("missing.img")).err().expect("404"));
    // Nothing listens there: a transport error, which reqwest would show with its URL.
    let closed = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
    let error = open(&format!("https://user:hunter2@127.0.0.1:{closed}/x?sig=deadbeefcafe")).err().expect("refused");
    assert!(error.contains("tried 3 times"), "{error}");
    assert_no_secrets(&error);
}

#[test]
fn transient_server_errors_are_tried_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, bytes) = golden(dir.path(), 5);
    // Every second GET is a 503: each read's first or second try succeeds.
    let server = WebServer::ranges(dir.path(), &["--fail-every", "2"]);
    let image = open(&server.url("golden.img")).expect("open");
    for offset in [0, 1 << 20, 2 << 20, IMAGE_BYTES - 65536] {
        let mut buf = vec![0u8; 65536];
        image.read_at(&mut buf, offset as u64).expect("read");
        assert!(buf[..] == bytes[offset..offset + 65536]);
    }
    // A server that always fails gives up after three tries with the status.
    let server = WebServer::ranges(dir.path(), &["--fail-every", "1", "--no-head"]);
    let error = open(&server.url("golden.img")).err().expect("always 503");
    assert!(error.contains("503") && error.contains("tried 3 times"), "{error}");
}
