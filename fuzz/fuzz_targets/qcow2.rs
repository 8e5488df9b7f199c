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
use overspill_engine::GoldenImage;
use overspill_fuzz::{check_image, image_work_dir};
use overspill_images::qcow2::Qcow2Image;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        image_work_dir("qcow2", |dir| {
            let pattern: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8 | 1).collect();
            std::fs::write(dir.join("parent.img"), pattern).expect("writing the backing file");
        })
    })
}

fuzz_target!(|data: &[u8]| {
    let path = dir().join("disk.qcow2");
    std::fs::write(&path, data).expect("writing the input");
    if let Ok(image) = Qcow2Image::open(&path) {
        let size = image.size();
        let reads = [(0, 70_000), (65_536 - 3000, 9000), (size.saturating_sub(4000), 8192), (size, 512)];
        check_image(&image, &reads, 4 << 20);
    }
});
