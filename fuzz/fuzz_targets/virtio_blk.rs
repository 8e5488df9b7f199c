//! A virtio-blk request as a hostile guest lays it out: any header, any buffers (some outside
//! guest memory, some overlapping), any discard segments, over an in-memory disk. Serving it must
//! never panic, must end in one of virtio's three statuses, must report no more written than the
//! request's writable buffers hold, and must leave the disk alone for anything but a write, a
//! discard or a zeroing.
#![no_main]

use std::cell::RefCell;

use libfuzzer_sys::fuzz_target;
use overspill_nbd::memory::MemoryDevice;
use overspill_vhost::request::{serve, Buffers, GuestBytes, Segment};
use overspill_vhost::Limits;

const GUEST_BYTES: usize = 64 * 1024;
const DISK_BYTES: usize = 256 * 1024;

struct Ram(RefCell<Vec<u8>>);

impl GuestBytes for Ram {
    fn read_at(&self, addr: u64, buf: &mut [u8]) -> bool {
        let ram = self.0.borrow();
        match usize::try_from(addr).ok().and_then(|a| Some((a, a.checked_add(buf.len())?))) {
            Some((start, end)) if end <= ram.len() => {
                buf.copy_from_slice(&ram[start..end]);
                true
            }
            _ => false,
        }
    }

    fn write_at(&self, addr: u64, data: &[u8]) -> bool {
        let mut ram = self.0.borrow_mut();
        match usize::try_from(addr).ok().and_then(|a| Some((a, a.checked_add(data.len())?))) {
            Some((start, end)) if end <= ram.len() => {
                ram[start..end].copy_from_slice(data);
                true
            }
            _ => false,
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let byte = |i: usize| data.get(i).copied().unwrap_or(0);
    let word = |i: usize| u16::from_le_bytes([byte(i), byte(i + 1)]);
    let (readable, writable, flags) = (byte(0) % 5, byte(1) % 5, byte(2));
    let mut buffers = Buffers::default();
    let mut at = 3;
    for i in 0..readable + writable {
        // Addresses up to twice the guest's memory: half of them fall outside it.
        let segment = Segment { addr: u64::from(word(at)) * 2, len: u32::from(word(at + 2)) % 8192 };
        at += 4;
        if i < readable {
            buffers.readable.push(segment);
        } else {
            buffers.writable.push(segment);
        }
    }
    let mut memory = vec![0u8; GUEST_BYTES];
    let rest = data.get(at..).unwrap_or_default();
    memory[..rest.len().min(GUEST_BYTES)].copy_from_slice(&rest[..rest.len().min(GUEST_BYTES)]);
    let ram = Ram(RefCell::new(memory));
    // The request type: the readable stream's first 4 bytes, wherever its segments put them.
    let mut stream = Vec::new();
    for segment in &buffers.readable {
        // A zero-length buffer holds no bytes wherever it points: the device passes over it.
        if segment.len == 0 {
            continue;
        }
        let mut piece = vec![0u8; segment.len as usize];
        if !ram.read_at(segment.addr, &mut piece) {
            break;
        }
        stream.extend(piece);
    }
    let kind = stream.get(..4).map(|k| u32::from_le_bytes([k[0], k[1], k[2], k[3]]));
    let mut disk = MemoryDevice::new(DISK_BYTES);
    let before = disk.snapshot();
    let outcome = serve(&mut disk, &ram, &buffers, &Limits::default(), b"fuzz", flags & 1 != 0, &mut Vec::new());

    assert!(outcome.status <= 2, "status {}", outcome.status);
    let room: u64 = buffers.writable.iter().map(|s| u64::from(s.len)).sum();
    assert!(u64::from(outcome.written) <= room, "{} written in {room} bytes", outcome.written);
    // Only a write (1), a discard (11) or a zeroing (13) may change the disk.
    if !matches!(kind, Some(1 | 11 | 13)) {
        assert!(disk.snapshot() == before, "request type {kind:?} changed the disk");
    }
});
