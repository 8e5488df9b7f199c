//! The qcow2 golden image reader on hostile files: each input is the image file itself (qcow2 has
//! no checksums, so every byte the fuzzer changes reaches the header, extensions, L1 and L2
//! tables or compressed clusters). A backing file name may point at `parent.img` beside it, a
//! small raw file the target writes once, or at the input itself (a loop).
//!
//! Opening must give an image or an error, never a panic; an image that opens must read
//! (anywhere, past its end too) and describe its extents without panicking, the extents tiling
//! the range asked for and calling zero only what reads as zeroes.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use overspill_engine::{Allocation, GoldenImage};
use overspill_fuzz::remove_at_exit;
use overspill_images::qcow2::Qcow2Image;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = std::path::Path::new("/dev/shm");
        let parent = if shm.is_dir() { shm.to_owned() } else { std::env::temp_dir() };
        let dir = parent.join(format!("overspill-fuzz-qcow2-{}", std::process::id()));
        // A directory of a process with this pid that died without cleaning up.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the work directory");
        remove_at_exit(&dir);
        let pattern: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8 | 1).collect();
        std::fs::write(dir.join("parent.img"), pattern).expect("writing the backing file");
        dir
    })
}

fn check(image: &Qcow2Image) {
    let size = image.size();
    let _ = image.describe();
    let _ = image.identity();
    for (at, len) in [(0, 70_000), (65_536 - 3000, 9000), (size.saturating_sub(4000), 8192), (size, 512)] {
        let mut buf = vec![0xeeu8; len];
        if image.read_at(&mut buf, at).is_ok() && at >= size {
            assert!(buf.iter().all(|&b| b == 0), "bytes past the end read as zero");
        }
    }
    let span = size.min(4 << 20);
    let Ok(extents) = image.extents(0, span) else { return };
    let total: u64 = extents.iter().map(|e| e.len).sum();
    assert!(total > 0 || span == 0, "no extent for {span} bytes");
    assert!(total <= span, "extents of {total} bytes for {span}");
    assert!(extents.iter().all(|e| e.len > 0), "an empty extent");
    let mut at = 0u64;
    for extent in extents.iter().take(64) {
        if extent.state != Allocation::Data {
            let mut buf = vec![0xeeu8; extent.len.min(1 << 20) as usize];
            if image.read_at(&mut buf, at).is_ok() {
                assert!(buf.iter().all(|&b| b == 0), "{extent:?} at {at} reads as data");
            }
        }
        at += extent.len;
    }
}

fuzz_target!(|data: &[u8]| {
    let path = dir().join("disk.qcow2");
    std::fs::write(&path, data).expect("writing the input");
    if let Ok(image) = Qcow2Image::open(&path) {
        check(&image);
    }
});
