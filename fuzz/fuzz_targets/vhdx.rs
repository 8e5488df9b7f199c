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
use overspill_engine::{EngineError, GoldenImage};
use overspill_fuzz::{check_image, image_work_dir, vhdx_builder, vhdx_file, vhdx_parent};
use overspill_images::vhdx::VhdxImage;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| image_work_dir("vhdx", |dir| vhdx_parent().write(&dir.join("parent.vhdx"))))
}

fn check(image: &VhdxImage) {
    let size = image.size();
    // At the start, across the first block boundaries, at and past the end; extents of the first
    // 16 MiB (what a file of this target's size can map).
    let reads = [(0, 70_000), (1 << 20, 5000), ((1 << 20) - 3000, 9000), (size.saturating_sub(4000), 8192)];
    check_image(image, &reads, 16 << 20);
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
