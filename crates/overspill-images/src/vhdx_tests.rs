//! The VHDX reader's own tests (the format against real files is in tests/vhdx.rs).

use super::*;

#[test]
fn guids_read_as_the_locator_writes_them() {
    let text = "{83ed0ec3-24c8-49a6-a959-5e4bf1288bfb}";
    let g = parse_guid(text).expect("parses");
    assert_eq!(guid_string(&g), text);
    assert_eq!(parse_guid("83ED0EC3-24C8-49A6-A959-5E4BF1288BFB"), Some(g));
    assert_eq!(&g[..4], &[0xc3, 0x0e, 0xed, 0x83], "first field little-endian");
    for bad in [
        "",
        "{}",
        "{83ed0ec3-24c8-49a6-a959-5e4bf1288bf}",
        "{83ed0ec3-24c8-49a6-a959-5e4bf1288bfg}",
        "{é3ed0ec3-24c8-49a6-a959-5e4bf1288bfb}",
    ] {
        assert_eq!(parse_guid(bad), None, "{bad}");
    }
    assert_eq!(guid_string(&BAT_REGION), "{2dc27766-f623-4200-9d64-115e9bfd4a08}");
}

/// A parent locator item: the VHDX type, then `entries` as (key offset, value offset, key
/// length, value length), then `strings` at offset 20 + 12 × entries.
fn locator_item(entries: &[(u32, u32, u16, u16)], strings: &[u8]) -> Vec<u8> {
    let mut item = VHDX_PARENT_TYPE.to_vec();
    item.extend_from_slice(&[0, 0]);
    item.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    for &(key_offset, value_offset, key_len, value_len) in entries {
        item.extend_from_slice(&key_offset.to_le_bytes());
        item.extend_from_slice(&value_offset.to_le_bytes());
        item.extend_from_slice(&key_len.to_le_bytes());
        item.extend_from_slice(&value_len.to_le_bytes());
    }
    item.extend_from_slice(strings);
    item
}

fn utf16le(text: &str) -> Vec<u8> {
    text.encode_utf16().flat_map(u16::to_le_bytes).collect()
}

/// Honest strings parse; strings that overlap (so that a small item would decode to far more
/// than it holds) and a key given twice are refused.
#[test]
fn parent_locator_strings_must_fit_the_item_once() {
    let (key, value) = (utf16le("relative_path"), utf16le("..\\base.vhdx"));
    let base = 20 + 12;
    let strings = [key.clone(), value.clone()].concat();
    let honest = locator_item(&[(base, base + key.len() as u32, key.len() as u16, value.len() as u16)], &strings);
    let pairs = parse_parent_locator(&honest).expect("an honest locator");
    assert_eq!(pairs, vec![("relative_path".to_owned(), "..\\base.vhdx".to_owned())]);

    // 200 entries whose keys are windows, 2 bytes apart, into one 600-byte run of text: each
    // key is distinct, together they are 200 times what the item holds.
    let text: Vec<u8> = (0..300u16).flat_map(|i| (0x4e00 + i).to_le_bytes()).collect();
    let base = 20 + 12 * 200;
    let entries: Vec<_> = (0..200u32).map(|i| (base + 2 * i, base + 2 * i, 200, 200)).collect();
    let error = parse_parent_locator(&locator_item(&entries, &text)).expect_err("overlapping strings");
    assert!(error.contains("overlap"), "{error}");

    let strings = [key.clone(), value.clone(), key.clone(), value.clone()].concat();
    let (k, v) = (key.len() as u32, value.len() as u32);
    let twice =
        locator_item(&[(44, 44 + k, k as u16, v as u16), (44 + k + v, 44 + 2 * k + v, k as u16, v as u16)], &strings);
    let error = parse_parent_locator(&twice).expect_err("a key twice");
    assert!(error.contains("twice"), "{error}");
}

#[test]
fn locator_paths_resolve_from_the_childs_directory() {
    let child = Path::new("/store/versions/v2.vhdx");
    assert_eq!(locate(child, "relative_path", "..\\base.vhdx"), Some(PathBuf::from("/store/versions/../base.vhdx")));
    assert_eq!(locate(child, "relative_path", ".\\v1.vhdx"), Some(PathBuf::from("/store/versions/v1.vhdx")));
    assert_eq!(locate(child, "relative_path", "C:\\x.vhdx"), None);
    assert_eq!(locate(child, "absolute_win32_path", "\\\\?\\D:\\store\\base.vhdx"), None);
    assert_eq!(locate(child, "absolute_win32_path", "\\\\?\\/srv/base.vhdx"), Some(PathBuf::from("/srv/base.vhdx")));
    assert_eq!(locate(child, "volume_path", "\\\\?\\Volume{26a21bda-a627-11d7-9931-806e6f6e6963}\\b.vhdx"), None);
}

#[test]
fn checksums_are_crc32c_with_the_field_zeroed() {
    let mut buf = vec![7u8; 64];
    buf[4..8].fill(0);
    let crc = crc32c::crc32c(&buf);
    buf[4..8].copy_from_slice(&crc.to_le_bytes());
    assert!(checksum_ok(&buf, 4));
    buf[20] ^= 1;
    assert!(!checksum_ok(&buf, 4));
    assert!(!checksum_ok(&buf[..6], 4), "too short to hold the field");
}
