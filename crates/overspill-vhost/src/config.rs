//! What the device tells the driver: its virtio feature bits and its configuration space
//! (capacity, block size and topology, request limits), from the device's size and
//! capabilities.

use overspill_block::Capabilities;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX, VIRTIO_BLK_F_TOPOLOGY, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// virtio-blk counts in 512-byte sectors, whatever the block size.
pub const SECTOR_BYTES: u64 = 512;

/// The offset of the `writeback` byte in the configuration space (the write-cache setting the
/// driver may change when CONFIG_WCE is offered).
pub const WRITEBACK_OFFSET: usize = 32;

/// The configuration space up to `write_zeroes_may_unmap` and its padding (what QEMU asks for
/// with discard and write-zeroes on).
const CONFIG_BYTES: usize = 60;

/// What one request may ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes one read, write, discard or zeroing segment may cover.
    pub max_request_bytes: u64,
    /// Data buffers one request may have (`seg_max`).
    pub max_buffers: u32,
    /// Bytes one buffer may have (`size_max`).
    pub max_buffer_bytes: u32,
    /// Discard or zeroing segments one request may carry.
    pub max_segments: u32,
}

impl Default for Limits {
    /// 126 buffers of up to 256 KiB (QEMU's queues hold 128 descriptors, two of which are the
    /// header and the status), and requests of up to 32 MiB as over NBD.
    fn default() -> Self {
        Self { max_request_bytes: 32 << 20, max_buffers: 126, max_buffer_bytes: 256 << 10, max_segments: 256 }
    }
}

/// The device as the driver sees it.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    pub size: u64,
    pub capabilities: Capabilities,
    pub queues: u16,
    pub limits: Limits,
}

impl DeviceConfig {
    /// The virtio feature bits offered (the vhost-user protocol bit is the backend's to add).
    pub fn features(&self) -> u64 {
        let bit = |b: u32| 1u64 << b;
        let mut features = bit(VIRTIO_F_VERSION_1)
            | bit(VIRTIO_RING_F_INDIRECT_DESC)
            | bit(VIRTIO_RING_F_EVENT_IDX)
            | bit(VIRTIO_BLK_F_SIZE_MAX)
            | bit(VIRTIO_BLK_F_SEG_MAX)
            | bit(VIRTIO_BLK_F_BLK_SIZE)
            | bit(VIRTIO_BLK_F_TOPOLOGY)
            | bit(VIRTIO_BLK_F_MQ);
        let caps = self.capabilities;
        if caps.read_only {
            features |= bit(VIRTIO_BLK_F_RO);
        }
        if caps.can_flush {
            // The spec: CONFIG_WCE only with FLUSH.
            features |= bit(VIRTIO_BLK_F_FLUSH) | bit(VIRTIO_BLK_F_CONFIG_WCE);
        }
        if caps.can_trim && !caps.read_only {
            features |= bit(VIRTIO_BLK_F_DISCARD);
        }
        if caps.can_zero && !caps.read_only {
            features |= bit(VIRTIO_BLK_F_WRITE_ZEROES);
        }
        features
    }

    /// The configuration space, with the write cache as `write_back` says. Sectors of 512
    /// bytes, 4 KiB physical blocks (a golden image's partition table is in 512-byte sectors;
    /// 4 KiB logical ones would move it).
    pub fn space(&self, write_back: bool) -> [u8; CONFIG_BYTES] {
        let mut c = [0u8; CONFIG_BYTES];
        let limits = self.limits;
        let max_sectors = u32::try_from(limits.max_request_bytes / SECTOR_BYTES).unwrap_or(u32::MAX);
        c[0..8].copy_from_slice(&(self.size / SECTOR_BYTES).to_le_bytes());
        c[8..12].copy_from_slice(&limits.max_buffer_bytes.to_le_bytes());
        c[12..16].copy_from_slice(&limits.max_buffers.to_le_bytes());
        // geometry (16..20) left zero: not offered.
        c[20..24].copy_from_slice(&(SECTOR_BYTES as u32).to_le_bytes());
        c[24] = 3; // physical_block_exp: 2^3 sectors = 4 KiB
        c[25] = 0; // alignment_offset
        c[26..28].copy_from_slice(&8u16.to_le_bytes()); // min_io_size, in sectors
        c[28..32].copy_from_slice(&8u32.to_le_bytes()); // opt_io_size, in sectors
        c[WRITEBACK_OFFSET] = u8::from(write_back);
        c[34..36].copy_from_slice(&self.queues.to_le_bytes());
        c[36..40].copy_from_slice(&max_sectors.to_le_bytes()); // max_discard_sectors
        c[40..44].copy_from_slice(&limits.max_segments.to_le_bytes()); // max_discard_seg
        c[44..48].copy_from_slice(&8u32.to_le_bytes()); // discard_sector_alignment
        c[48..52].copy_from_slice(&max_sectors.to_le_bytes()); // max_write_zeroes_sectors
        c[52..56].copy_from_slice(&limits.max_segments.to_le_bytes()); // max_write_zeroes_seg
        c[56] = 1; // write_zeroes_may_unmap
        c
    }
}
