//! Helpers shared by this crate's integration tests (each test file includes it as a module).
#![allow(dead_code)] // each test file uses its own subset

/// Deterministic pseudo-random bytes (xorshift64*), so that a failure reproduces.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Compares two disk contents without printing megabytes: names the first differing byte.
#[track_caller]
pub fn assert_same(actual: &[u8], expected: &[u8], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length differs");
    if let Some(i) = actual.iter().zip(expected).position(|(a, b)| a != b) {
        let end = actual[i..].iter().zip(&expected[i..]).position(|(a, b)| a == b).map_or(actual.len(), |n| i + n);
        panic!(
            "{what}: first difference at byte {i} (differs through {end}): got {:02x?}, expected {:02x?}",
            &actual[i..(i + 16).min(actual.len())],
            &expected[i..(i + 16).min(expected.len())]
        );
    }
}
