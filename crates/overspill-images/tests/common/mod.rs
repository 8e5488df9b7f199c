//! What the format tests share: running qemu's tools, and reading an image back against the
//! bytes it should hold.
// Each test file uses its own part of this module.
#![allow(dead_code)]

pub mod vhdx_builder;

use std::path::Path;
use std::process::Command;

use overspill_engine::{Allocation, GoldenImage};

pub fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} must be installed (qemu-utils): {e}"));
    assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

pub fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

pub fn assert_reads_match(image: &dyn GoldenImage, expected: &[u8]) {
    assert_eq!(image.size(), expected.len() as u64);
    // Whole image in odd-sized pieces that straddle cluster boundaries.
    let mut offset = 0usize;
    let mut step = 77_777usize;
    while offset < expected.len() {
        let len = step.min(expected.len() - offset);
        let mut buf = vec![0xeeu8; len];
        image.read_at(&mut buf, offset as u64).expect("read");
        assert!(buf == expected[offset..offset + len], "bytes differ in {offset}+{len}");
        offset += len;
        step = step * 7 % 200_003 + 1;
    }
    let mut tail = [0xeeu8; 16];
    image.read_at(&mut tail, expected.len() as u64 - 8).expect("read past the end");
    assert_eq!(&tail[..8], &expected[expected.len() - 8..]);
    assert_eq!(tail[8..], [0u8; 8], "bytes past the end read as zero");
}

/// Asks for the whole image's extents (again from where an answer stopped) and checks that they
/// tile it and that what they call zero or a hole reads as zeroes; returns them as (offset,
/// length, state).
pub fn extents_of(image: &dyn GoldenImage, expected: &[u8]) -> Vec<(u64, u64, Allocation)> {
    let mut all = Vec::new();
    let mut at = 0u64;
    let size = image.size();
    while at < size {
        let extents = image.extents(at, size - at).expect("extents");
        assert!(!extents.is_empty(), "no extent at {at}");
        for extent in extents {
            assert!(extent.len > 0 && at + extent.len <= size, "extent {extent:?} at {at} past {size}");
            if extent.state != Allocation::Data {
                let range = at as usize..(at + extent.len) as usize;
                assert!(expected[range].iter().all(|&b| b == 0), "{extent:?} at {at} holds data");
            }
            all.push((at, extent.len, extent.state));
            at += extent.len;
        }
    }
    all
}

/// [`extents_of`], summed: the bytes of data, zeroes and holes.
pub fn assert_extents_agree(image: &dyn GoldenImage, expected: &[u8]) -> [u64; 3] {
    let mut totals = [0u64; 3];
    for (_, len, state) in extents_of(image, expected) {
        totals[state as usize] += len;
    }
    totals
}
