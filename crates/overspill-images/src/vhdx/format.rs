//! VHDX's on-disk structures as [MS-VHDX] defines them: the region and metadata GUIDs, the
//! payload and bitmap states, little-endian fields, CRC-32C checksums and the two headers.

use std::path::Path;

use overspill_engine::EngineError;

pub(super) const MIB: u64 = 1 << 20;
pub(super) const KIB64: u64 = 64 * 1024;
pub(super) const SIGNATURE: &[u8; 8] = b"vhdxfile";
pub(super) const HEADER_OFFSETS: [u64; 2] = [KIB64, 2 * KIB64];
pub(super) const HEADER_BYTES: usize = 4096;
pub(super) const REGION_TABLE_OFFSETS: [u64; 2] = [3 * KIB64, 4 * KIB64];
pub(super) const REGION_TABLE_BYTES: usize = 64 * 1024;
/// At most 2,047 entries of 32 bytes after a 32-byte header: the metadata table's 64 KiB.
pub(super) const METADATA_TABLE_BYTES: u64 = 64 * 1024;
pub(super) const MAX_TABLE_ENTRIES: u32 = 2047;
pub(super) const MAX_METADATA_ITEM: u32 = 1 << 20;
/// Sectors described by one sector bitmap block (1 MiB of bits): what sets the chunk ratio.
pub(super) const SECTORS_PER_BITMAP_BLOCK: u64 = 1 << 23;
pub(super) const MAX_VIRTUAL_SIZE: u64 = 64 << 40;
/// A chain deeper than this is taken for a loop the inode check missed (hard links across
/// bind mounts, say) rather than recursed into.
pub const MAX_CHAIN_DEPTH: usize = 64;
/// Extents one call reports at most: a heavily fragmented differencing disk asked about its
/// whole length answers in parts, as the trait allows, rather than build a huge list.
pub(super) const MAX_EXTENTS: usize = 4096;
/// Bytes of sector bitmaps kept in memory per layer, the most recently used: every partially
/// present block read would otherwise keep its bitmap for good (512 MiB for a 2 TiB disk of
/// 512-byte sectors read end to end).
pub(super) const BITMAP_CACHE_BYTES: u64 = 16 << 20;
/// Blocks one extents call looks at at most, for the same reason on a large empty disk.
pub(super) const MAX_EXTENT_STEPS: usize = 1 << 20;

// Payload block states (the low three bits of a BAT entry).
pub(super) const PAYLOAD_NOT_PRESENT: u64 = 0;
pub(super) const PAYLOAD_UNDEFINED: u64 = 1;
pub(super) const PAYLOAD_ZERO: u64 = 2;
pub(super) const PAYLOAD_UNMAPPED: u64 = 3;
/// UNMAPPED as the 0.95 draft of the spec numbered it; qemu reads it as zeroes too, and so do
/// we, for files written to that draft.
pub(super) const PAYLOAD_UNMAPPED_V095: u64 = 5;
pub(super) const PAYLOAD_FULLY_PRESENT: u64 = 6;
pub(super) const PAYLOAD_PARTIALLY_PRESENT: u64 = 7;
pub(super) const SB_BLOCK_PRESENT: u64 = 6;
pub(super) const STATE_MASK: u64 = 7;
/// FileOffsetMB: bits 20–63, so the entry masked is the byte offset.
pub(super) const OFFSET_MASK: u64 = !(MIB - 1);

pub(super) type Guid = [u8; 16];

/// A GUID in the mixed-endian binary form the file holds (the first three fields little-endian).
pub(super) const fn guid(d1: u32, d2: u16, d3: u16, d4: [u8; 8]) -> Guid {
    let a = d1.to_le_bytes();
    let b = d2.to_le_bytes();
    let c = d3.to_le_bytes();
    [a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], d4[0], d4[1], d4[2], d4[3], d4[4], d4[5], d4[6], d4[7]]
}

pub(super) const BAT_REGION: Guid = guid(0x2dc2_7766, 0xf623, 0x4200, [0x9d, 0x64, 0x11, 0x5e, 0x9b, 0xfd, 0x4a, 0x08]);
pub(super) const METADATA_REGION: Guid =
    guid(0x8b7c_a206, 0x4790, 0x4b9a, [0xb8, 0xfe, 0x57, 0x5f, 0x05, 0x0f, 0x88, 0x6e]);
pub(super) const FILE_PARAMETERS: Guid =
    guid(0xcaa1_6737, 0xfa36, 0x4d43, [0xb3, 0xb6, 0x33, 0xf0, 0xaa, 0x44, 0xe7, 0x6b]);
pub(super) const VIRTUAL_DISK_SIZE: Guid =
    guid(0x2fa5_4224, 0xcd1b, 0x4876, [0xb2, 0x11, 0x5d, 0xbe, 0xd8, 0x3b, 0xf4, 0xb8]);
/// The virtual disk ID, which a VM sees as its disk's SCSI page 83 identifier.
pub(super) const PAGE_83_DATA: Guid =
    guid(0xbeca_12ab, 0xb2e6, 0x4523, [0x93, 0xef, 0xc3, 0x09, 0xe0, 0x00, 0xc7, 0x46]);
pub(super) const LOGICAL_SECTOR_SIZE: Guid =
    guid(0x8141_bf1d, 0xa96f, 0x4709, [0xba, 0x47, 0xf2, 0x33, 0xa8, 0xfa, 0xab, 0x5f]);
pub(super) const PHYSICAL_SECTOR_SIZE: Guid =
    guid(0xcda3_48c7, 0x445d, 0x4471, [0x9c, 0xc9, 0xe9, 0x88, 0x52, 0x51, 0xc5, 0x56]);
pub(super) const PARENT_LOCATOR: Guid =
    guid(0xa8d3_5f2d, 0xb30b, 0x454d, [0xab, 0xf7, 0xd3, 0xd8, 0x48, 0x34, 0xab, 0x0c]);
pub(super) const VHDX_PARENT_TYPE: Guid =
    guid(0xb04a_efb7, 0xd19e, 0x4a81, [0xb7, 0x89, 0x25, 0xb8, 0xe9, 0x44, 0x59, 0x13]);

/// Whether a file's first bytes are the VHDX file type identifier.
pub fn has_magic(first: &[u8]) -> bool {
    first.get(..8) == Some(&SIGNATURE[..])
}

/// A GUID as the parent locator writes it: lowercase, in braces.
pub fn guid_string(g: &Guid) -> String {
    let d1 = u32::from_le_bytes([g[0], g[1], g[2], g[3]]);
    let d2 = u16::from_le_bytes([g[4], g[5]]);
    let d3 = u16::from_le_bytes([g[6], g[7]]);
    let tail: String = g[10..].iter().map(|b| format!("{b:02x}")).collect();
    format!("{{{d1:08x}-{d2:04x}-{d3:04x}-{:02x}{:02x}-{tail}}}", g[8], g[9])
}

/// Reads `{xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx}` (braces optional, any case) into binary form.
pub(super) fn parse_guid(text: &str) -> Option<Guid> {
    let text = text.trim();
    let text = text.strip_prefix('{').and_then(|t| t.strip_suffix('}')).unwrap_or(text);
    let parts: Vec<&str> = text.split('-').collect();
    let [p1, p2, p3, p4, p5] = parts.as_slice() else { return None };
    if p1.len() != 8 || p2.len() != 4 || p3.len() != 4 || p4.len() != 4 || p5.len() != 12 {
        return None;
    }
    let hex = |s: &str| -> Option<Vec<u8>> {
        (0..s.len()).step_by(2).map(|i| s.get(i..i + 2).and_then(|pair| u8::from_str_radix(pair, 16).ok())).collect()
    };
    let d1 = u32::from_str_radix(p1, 16).ok()?;
    let d2 = u16::from_str_radix(p2, 16).ok()?;
    let d3 = u16::from_str_radix(p3, 16).ok()?;
    let mut d4 = [0u8; 8];
    for (slot, byte) in d4.iter_mut().zip(hex(p4)?.into_iter().chain(hex(p5)?)) {
        *slot = byte;
    }
    Some(guid(d1, d2, d3, d4))
}

/// What a malformed structure says, before it is given the file's name.
pub(super) type Why = String;

pub(super) fn bytes<const N: usize>(b: &[u8], at: usize) -> std::result::Result<[u8; N], Why> {
    at.checked_add(N)
        .and_then(|end| b.get(at..end))
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| format!("a structure ends early (field at byte {at})"))
}

pub(super) fn le16(b: &[u8], at: usize) -> std::result::Result<u16, Why> {
    Ok(u16::from_le_bytes(bytes(b, at)?))
}

pub(super) fn le32(b: &[u8], at: usize) -> std::result::Result<u32, Why> {
    Ok(u32::from_le_bytes(bytes(b, at)?))
}

pub(super) fn le64(b: &[u8], at: usize) -> std::result::Result<u64, Why> {
    Ok(u64::from_le_bytes(bytes(b, at)?))
}

/// CRC-32C of `buf` with its checksum field (at `at`) taken as zero, as the spec computes it.
pub(super) fn checksum_ok(buf: &[u8], at: usize) -> bool {
    let (Some(head), Some(stored), Some(tail)) = (buf.get(..at), buf.get(at..at + 4), buf.get(at + 4..)) else {
        return false;
    };
    let crc = crc32c::crc32c_append(crc32c::crc32c_append(crc32c::crc32c(head), &[0; 4]), tail);
    stored == crc.to_le_bytes()
}

pub(super) fn refuse(path: &Path, why: impl std::fmt::Display) -> EngineError {
    EngineError::Config(format!("{}: {why}", path.display()))
}

/// One of the two headers, when its signature and checksum are right.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) sequence: u64,
    pub(super) data_write_guid: Guid,
    pub(super) log_guid: Guid,
    pub(super) version: u16,
    pub(super) log_offset: u64,
    pub(super) log_length: u32,
}

pub(super) fn parse_header(buf: &[u8]) -> Option<Header> {
    if buf.get(..4) != Some(b"head") || !checksum_ok(buf, 4) {
        return None;
    }
    Some(Header {
        sequence: le64(buf, 8).ok()?,
        data_write_guid: bytes(buf, 32).ok()?,
        log_guid: bytes(buf, 48).ok()?,
        version: le16(buf, 66).ok()?,
        log_length: le32(buf, 68).ok()?,
        log_offset: le64(buf, 72).ok()?,
    })
}

/// Where a structure lies in the file, for the overlap checks.
#[derive(Debug, Clone, Copy)]
pub(super) struct Span {
    pub(super) what: &'static str,
    pub(super) offset: u64,
    pub(super) len: u64,
}

impl Span {
    pub(super) fn overlaps(&self, offset: u64, len: u64) -> bool {
        offset < self.offset.saturating_add(self.len) && self.offset < offset.saturating_add(len)
    }
}

/// The known metadata items, as read.
#[derive(Debug, Default)]
pub(super) struct Metadata {
    pub(super) block_size: Option<u32>,
    pub(super) leave_blocks_allocated: bool,
    pub(super) has_parent: bool,
    pub(super) virtual_size: Option<u64>,
    pub(super) disk_id: Option<Guid>,
    pub(super) logical_sector: Option<u32>,
    pub(super) physical_sector: Option<u32>,
    /// The item's bytes: parsed only for a differencing disk, so that a stray one in another
    /// disk refuses nothing.
    pub(super) parent_locator: Option<Vec<u8>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Fixed,
    Dynamic,
    Differencing,
}

impl Kind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Fixed => "fixed",
            Self::Dynamic => "dynamic",
            Self::Differencing => "differencing",
        }
    }
}
