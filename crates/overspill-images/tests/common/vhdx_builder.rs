//! Writes VHDX files by the spec ([MS-VHDX]) for the tests, and for the fuzz target's seeds (the
//! fuzz crate includes this file): above all differencing disks, which `qemu-img` cannot make
//! ("Backing file not supported"), and blocks in every state.
//!
//! Written independently of the reader in `src/vhdx.rs`, so that a misreading of the spec in
//! one is not silently shared by the other. The layout is the one Hyper-V and qemu use, every
//! structure 1 MiB-aligned:
//!
//! ```text
//! 0       file type identifier ("vhdxfile", creator)
//! 64 KiB  header 1 (sequence 1)        128 KiB header 2 (sequence 2, current)
//! 192 KiB region table                 256 KiB its copy
//! 1 MiB   log (1 MiB, empty: LogGuid zero)
//! 2 MiB   metadata region (1 MiB): the table, items from 64 KiB on
//! 3 MiB   BAT (whole MiBs)
//! then    payload blocks and sector bitmap blocks, in the order the BAT names them
//! ```
//!
//! Only the bytes that are not zero are written (`pieces`), so a large virtual disk with a few
//! small blocks of data makes a small sparse file.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

pub const MIB: u64 = 1 << 20;
pub const HEADER_OFFSETS: [u64; 2] = [0x1_0000, 0x2_0000];
pub const HEADER_BYTES: usize = 4096;
pub const REGION_TABLE_OFFSETS: [u64; 2] = [0x3_0000, 0x4_0000];
pub const REGION_TABLE_BYTES: usize = 0x1_0000;
const LOG_OFFSET: u64 = MIB;
pub const METADATA_OFFSET: u64 = 2 * MIB;
pub const BAT_OFFSET: u64 = 3 * MIB;

/// GUIDs as the spec prints them: the first three fields are stored little-endian.
pub fn guid(text: &str) -> [u8; 16] {
    let hex: String = text.chars().filter(char::is_ascii_hexdigit).collect();
    assert_eq!(hex.len(), 32, "{text}");
    let byte = |i: usize| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex");
    let mut out = [0u8; 16];
    for (slot, i) in out.iter_mut().zip([3, 2, 1, 0, 5, 4, 7, 6, 8, 9, 10, 11, 12, 13, 14, 15]) {
        *slot = byte(i);
    }
    out
}

/// The lowercase, braced form the parent locator's `parent_linkage` holds.
pub fn guid_text(g: &[u8; 16]) -> String {
    let order = [3, 2, 1, 0, 5, 4, 7, 6, 8, 9, 10, 11, 12, 13, 14, 15];
    let hex: Vec<String> = order.iter().map(|&i| format!("{:02x}", g[i])).collect();
    format!(
        "{{{}-{}-{}-{}-{}}}",
        hex[..4].concat(),
        hex[4..6].concat(),
        hex[6..8].concat(),
        hex[8..10].concat(),
        hex[10..].concat()
    )
}

/// A made-up GUID: distinct seeds give distinct GUIDs.
pub fn guid_from(seed: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    out[8..].copy_from_slice(&(!seed).wrapping_mul(0xbf58_476d_1ce4_e5b9).to_le_bytes());
    out
}

const BAT_GUID: &str = "2DC27766-F623-4200-9D64-115E9BFD4A08";
const METADATA_GUID: &str = "8B7CA206-4790-4B9A-B8FE-575F050F886E";
const FILE_PARAMETERS: &str = "CAA16737-FA36-4D43-B3B6-33F0AA44E76B";
const VIRTUAL_DISK_SIZE: &str = "2FA54224-CD1B-4876-B211-5DBED83BF4B8";
const VIRTUAL_DISK_ID: &str = "BECA12AB-B2E6-4523-93EF-C309E000C746";
const LOGICAL_SECTOR_SIZE: &str = "8141BF1D-A96F-4709-BA47-F233A8FAAB5F";
const PHYSICAL_SECTOR_SIZE: &str = "CDA348C7-445D-4471-9CC9-E9885251C556";
const PARENT_LOCATOR: &str = "A8D35F2D-B30B-454D-ABF7-D3D84834AB0C";
const VHDX_LOCATOR_TYPE: &str = "B04AEFB7-D19E-4A81-B789-25B8E9445913";

/// One payload block of the disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Block {
    NotPresent,
    Undefined,
    Zero,
    Unmapped,
    /// In the file: these bytes, then zeroes to the end of the block.
    Full(Vec<u8>),
    /// In the file (these bytes, then zeroes), but only the sectors flagged in `present` (one
    /// flag a logical sector, missing flags clear): the others are the parent's.
    Partial {
        data: Vec<u8>,
        present: Vec<bool>,
    },
}

impl Block {
    fn state(&self) -> u64 {
        match self {
            Self::NotPresent => 0,
            Self::Undefined => 1,
            Self::Zero => 2,
            Self::Unmapped => 3,
            Self::Full(_) => 6,
            Self::Partial { .. } => 7,
        }
    }
}

/// What a VHDX file holds.
#[derive(Debug, Clone)]
pub struct Spec {
    pub virtual_size: u64,
    pub block_size: u32,
    pub logical_sector: u32,
    pub physical_sector: u32,
    /// LeaveBlocksAllocated: what marks a fixed disk.
    pub fixed: bool,
    pub data_write_guid: [u8; 16],
    pub log_guid: [u8; 16],
    /// The parent locator's keys and values: set, the file is a differencing disk (HasParent).
    pub parent: Option<Vec<(String, String)>>,
    /// Payload blocks in order; blocks past the end of the list are not present.
    pub blocks: Vec<Block>,
}

/// The file: its length, and where its bytes that are not zero go.
pub struct Layout {
    pub len: u64,
    pub pieces: Vec<(u64, Vec<u8>)>,
}

/// Stores the CRC-32C of `buf` (its checksum field at `at` taken as zero) in that field.
pub fn set_checksum(buf: &mut [u8], at: usize) {
    buf[at..at + 4].fill(0);
    let crc = crc32c::crc32c(buf);
    buf[at..at + 4].copy_from_slice(&crc.to_le_bytes());
}

/// Recomputes the checksums of the headers and region tables in a whole file's bytes, for
/// changes made to them on purpose (or by a fuzzer, to get past the checksums).
pub fn reseal(file: &mut [u8]) {
    for (offsets, len) in [(HEADER_OFFSETS, HEADER_BYTES), (REGION_TABLE_OFFSETS, REGION_TABLE_BYTES)] {
        for offset in offsets {
            if let Some(buf) = file.get_mut(offset as usize..offset as usize + len) {
                set_checksum(buf, 4);
            }
        }
    }
}

fn utf16(text: &str) -> Vec<u8> {
    text.encode_utf16().flat_map(u16::to_le_bytes).collect()
}

fn put(buf: &mut [u8], at: usize, bytes: &[u8]) {
    buf[at..at + bytes.len()].copy_from_slice(bytes);
}

impl Spec {
    /// A dynamic disk with 512-byte logical and 4 KiB physical sectors and no block present.
    pub fn new(virtual_size: u64, block_size: u32) -> Self {
        Self {
            virtual_size,
            block_size,
            logical_sector: 512,
            physical_sector: 4096,
            fixed: false,
            data_write_guid: guid_from(virtual_size ^ u64::from(block_size)),
            log_guid: [0; 16],
            parent: None,
            blocks: Vec::new(),
        }
    }

    /// Makes it a differencing disk on the parent at `relative_path` (backslashes, from this
    /// file's directory) whose DataWriteGuid is `parent_guid`.
    pub fn on_parent(mut self, relative_path: &str, parent_guid: &[u8; 16]) -> Self {
        self.parent = Some(vec![
            ("parent_linkage".to_owned(), guid_text(parent_guid)),
            ("relative_path".to_owned(), relative_path.to_owned()),
        ]);
        self
    }

    pub fn block(mut self, index: usize, block: Block) -> Self {
        if self.blocks.len() <= index {
            self.blocks.resize(index + 1, Block::NotPresent);
        }
        self.blocks[index] = block;
        self
    }

    pub fn payload_blocks(&self) -> u64 {
        self.virtual_size.div_ceil(u64::from(self.block_size))
    }

    /// Payload blocks per sector bitmap block: 2^23 sectors' worth.
    pub fn chunk_ratio(&self) -> u64 {
        (1u64 << 23) * u64::from(self.logical_sector) / u64::from(self.block_size)
    }

    fn bat_entries(&self) -> u64 {
        let (blocks, ratio) = (self.payload_blocks(), self.chunk_ratio());
        if self.parent.is_some() {
            blocks.div_ceil(ratio) * (ratio + 1)
        } else {
            blocks + blocks.saturating_sub(1) / ratio
        }
    }

    pub fn layout(&self) -> Layout {
        let mut pieces = Vec::new();

        let mut ident = b"vhdxfile".to_vec();
        ident.extend(utf16("overspill tests"));
        pieces.push((0, ident));

        for (sequence, offset) in [(1u64, HEADER_OFFSETS[0]), (2, HEADER_OFFSETS[1])] {
            let mut h = vec![0u8; HEADER_BYTES];
            put(&mut h, 0, b"head");
            put(&mut h, 8, &sequence.to_le_bytes());
            put(&mut h, 16, &guid_from(0xf11e));
            put(&mut h, 32, &self.data_write_guid);
            put(&mut h, 48, &self.log_guid);
            put(&mut h, 64, &0u16.to_le_bytes()); // LogVersion
            put(&mut h, 66, &1u16.to_le_bytes()); // Version
            put(&mut h, 68, &(MIB as u32).to_le_bytes());
            put(&mut h, 72, &LOG_OFFSET.to_le_bytes());
            set_checksum(&mut h, 4);
            pieces.push((offset, h));
        }

        let bat_len = (self.bat_entries() * 8).div_ceil(MIB).max(1) * MIB;
        let mut rt = vec![0u8; REGION_TABLE_BYTES];
        put(&mut rt, 0, b"regi");
        put(&mut rt, 8, &2u32.to_le_bytes());
        for (i, (id, offset, len)) in
            [(BAT_GUID, BAT_OFFSET, bat_len), (METADATA_GUID, METADATA_OFFSET, MIB)].into_iter().enumerate()
        {
            let at = 16 + i * 32;
            put(&mut rt, at, &guid(id));
            put(&mut rt, at + 16, &offset.to_le_bytes());
            put(&mut rt, at + 24, &(len as u32).to_le_bytes());
            put(&mut rt, at + 28, &1u32.to_le_bytes()); // required
        }
        set_checksum(&mut rt, 4);
        for offset in REGION_TABLE_OFFSETS {
            pieces.push((offset, rt.clone()));
        }

        pieces.push((METADATA_OFFSET, self.metadata()));

        // The BAT, and the blocks after it.
        let ratio = self.chunk_ratio();
        let block_size = u64::from(self.block_size);
        let sectors_per_block = block_size / u64::from(self.logical_sector);
        let mut bat = vec![0u64; self.bat_entries() as usize];
        let mut next = BAT_OFFSET + bat_len;
        for (index, block) in self.blocks.iter().enumerate() {
            let index = index as u64;
            assert!(index < self.payload_blocks(), "block {index} is past the end of the disk");
            let slot = (index + index / ratio) as usize;
            let mut entry = block.state();
            if let Block::Full(data) | Block::Partial { data, .. } = block {
                assert!(data.len() as u64 <= block_size);
                entry |= next;
                if !data.is_empty() {
                    pieces.push((next, data.clone()));
                }
                next += block_size;
            }
            if let Block::Partial { present, .. } = block {
                let chunk = index / ratio;
                let bitmap_slot = (chunk * (ratio + 1) + ratio) as usize;
                if bat[bitmap_slot] == 0 {
                    bat[bitmap_slot] = next | 6; // SB_BLOCK_PRESENT
                    next += MIB;
                }
                let mut bits = vec![0u8; (sectors_per_block / 8) as usize];
                for (sector, _) in present.iter().enumerate().filter(|(_, &p)| p) {
                    bits[sector / 8] |= 1 << (sector % 8);
                }
                let at = (bat[bitmap_slot] & !(MIB - 1)) + (index % ratio) * (sectors_per_block / 8);
                pieces.push((at, bits));
            }
            bat[slot] = entry;
        }
        pieces.push((BAT_OFFSET, bat.iter().flat_map(|e| e.to_le_bytes()).collect()));
        Layout { len: next, pieces }
    }

    fn metadata(&self) -> Vec<u8> {
        let mut items: Vec<(&str, u32, Vec<u8>)> = Vec::new();
        let bits = u32::from(self.fixed) | (u32::from(self.parent.is_some()) << 1);
        let params = [self.block_size.to_le_bytes(), bits.to_le_bytes()].concat();
        // Flags: 2 IsVirtualDisk, 4 IsRequired.
        items.push((FILE_PARAMETERS, 4, params));
        items.push((VIRTUAL_DISK_SIZE, 6, self.virtual_size.to_le_bytes().to_vec()));
        items.push((VIRTUAL_DISK_ID, 6, guid_from(0xd15c).to_vec()));
        items.push((LOGICAL_SECTOR_SIZE, 6, self.logical_sector.to_le_bytes().to_vec()));
        items.push((PHYSICAL_SECTOR_SIZE, 6, self.physical_sector.to_le_bytes().to_vec()));
        if let Some(pairs) = &self.parent {
            items.push((PARENT_LOCATOR, 4, parent_locator(pairs)));
        }
        let mut region = vec![0u8; 0x1_0000];
        put(&mut region, 0, b"metadata");
        put(&mut region, 10, &(items.len() as u16).to_le_bytes());
        for (i, (id, flags, item)) in items.into_iter().enumerate() {
            let at = 32 + i * 32;
            let offset = region.len() as u32;
            put(&mut region, at, &guid(id));
            put(&mut region, at + 16, &offset.to_le_bytes());
            put(&mut region, at + 20, &(item.len() as u32).to_le_bytes());
            put(&mut region, at + 24, &flags.to_le_bytes());
            region.extend(item);
        }
        region
    }

    /// Writes the file: a sparse one, only the bytes that are not zero.
    pub fn write(&self, path: &Path) {
        let layout = self.layout();
        let file = File::create(path).expect("create VHDX");
        file.set_len(layout.len).expect("size VHDX");
        for (offset, bytes) in &layout.pieces {
            file.write_all_at(bytes, *offset).expect("write VHDX");
        }
    }
}

/// The parent locator item: its type, the key-value table, then the UTF-16LE strings.
fn parent_locator(pairs: &[(String, String)]) -> Vec<u8> {
    let mut item = guid(VHDX_LOCATOR_TYPE).to_vec();
    item.extend(0u16.to_le_bytes());
    item.extend((pairs.len() as u16).to_le_bytes());
    let mut strings: Vec<u8> = Vec::new();
    let base = item.len() + pairs.len() * 12;
    for (key, value) in pairs {
        let (key, value) = (utf16(key), utf16(value));
        let key_at = base + strings.len();
        strings.extend(&key);
        let value_at = base + strings.len();
        strings.extend(&value);
        item.extend((key_at as u32).to_le_bytes());
        item.extend((value_at as u32).to_le_bytes());
        item.extend((key.len() as u16).to_le_bytes());
        item.extend((value.len() as u16).to_le_bytes());
    }
    item.extend(strings);
    item
}

/// A VHDX file's DataWriteGuid, from its current header (the one with the higher sequence
/// number; the checksums are not checked here).
pub fn data_write_guid(path: &Path) -> [u8; 16] {
    let file = File::open(path).expect("open VHDX");
    let mut best = (0u64, [0u8; 16]);
    for offset in HEADER_OFFSETS {
        let mut h = [0u8; 48];
        file.read_exact_at(&mut h, offset).expect("read header");
        let sequence = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
        if sequence >= best.0 {
            best = (sequence, h[32..48].try_into().expect("16 bytes"));
        }
    }
    best.1
}

/// Changes both headers of a VHDX file with `edit` and recomputes their checksums.
pub fn edit_headers(path: &Path, edit: impl Fn(&mut [u8])) {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).expect("open VHDX");
    for offset in HEADER_OFFSETS {
        let mut h = vec![0u8; HEADER_BYTES];
        file.read_exact_at(&mut h, offset).expect("read header");
        edit(&mut h);
        set_checksum(&mut h, 4);
        file.write_all_at(&h, offset).expect("write header");
    }
}
