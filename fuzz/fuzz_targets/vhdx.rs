//! The VHDX golden image reader on hostile files: each input is a sparse file (see
//! `overspill_fuzz::vhdx_file`), opened as it is and again with its header and region table
//! checksums recomputed, so that the fuzzer's changes reach the region table, metadata, parent
//! locator and BAT rather than stop at a checksum. A differencing disk may name `parent.vhdx`
//! beside it, a small disk the target writes once (`overspill_fuzz::vhdx_parent`).
//!
//! Opening must give an image or a refusal (`EngineError::Config`), never a panic or an I/O
//! error; an image that opens must read (anywhere, past its end too) and describe its extents
//! without panicking, the extents tiling the range asked for and calling zero only what reads as
//! zeroes.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use overspill_engine::{Allocation, EngineError, GoldenImage};
use overspill_fuzz::{remove_at_exit, vhdx_builder, vhdx_file, vhdx_parent};
use overspill_images::vhdx::VhdxImage;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = std::path::Path::new("/dev/shm");
        let parent = if shm.is_dir() { shm.to_owned() } else { std::env::temp_dir() };
        let dir = parent.join(format!("overspill-fuzz-vhdx-{}", std::process::id()));
        // A directory of a process with this pid that died without cleaning up.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the work directory");
        remove_at_exit(&dir);
        vhdx_parent().write(&dir.join("parent.vhdx"));
        dir
    })
}

fn check(image: &VhdxImage) {
    let size = image.size();
    let _ = image.describe();
    let _ = image.identity();
    // Reads at the start, across the first block boundaries, at and past the end.
    for (at, len) in [(0, 70_000), (1 << 20, 5000), ((1 << 20) - 3000, 9000), (size.saturating_sub(4000), 8192)] {
        let mut buf = vec![0xeeu8; len];
        if image.read_at(&mut buf, at).is_ok() && at >= size {
            assert!(buf.iter().all(|&b| b == 0), "bytes past the end read as zero");
        }
    }
    // Extents of the first 16 MiB (what a file of this target's size can map), checked against
    // what the same range reads as.
    let span = size.min(16 << 20);
    let Ok(extents) = image.extents(0, span) else { return };
    let total: u64 = extents.iter().map(|e| e.len).sum();
    assert!(total > 0 || span == 0, "no extent for {span} bytes");
    assert!(total <= span, "extents of {total} bytes for {span}");
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
    let path = dir().join("disk.vhdx");
    let mut file = vhdx_file(data);
    for resealed in [false, true] {
        if resealed {
            vhdx_builder::reseal(&mut file);
        }
        std::fs::write(&path, &file).expect("writing the input");
        match VhdxImage::open(&path) {
            Ok(image) => check(&image),
            Err(EngineError::Config(_)) => {}
            Err(other) => panic!("a malformed file must be refused, not fail with: {other}"),
        }
    }
});
