//! One virtio-blk request: its descriptors read as two byte streams (what the device may read:
//! the 16-byte header, then a write's data or discard segments; what it may write: a read's data
//! or the ID, then the status byte), checked, and carried out on a [`BlockDevice`]. Free of
//! virtqueues, so that it can be tested and fuzzed over plain memory.

use std::cell::Cell;
use std::io::{self, IoSliceMut};
use std::ops::Range;

use overspill_block::{BlockDevice, DeviceError, DeviceErrorKind, Payload, ReadRequest};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};

use crate::config::{Limits, SECTOR_BYTES};

/// Guest memory as the request sees it: copies in and out at guest addresses, `false` for an
/// address the guest does not have.
pub trait GuestBytes {
    fn read_at(&self, addr: u64, buf: &mut [u8]) -> bool;
    fn write_at(&self, addr: u64, data: &[u8]) -> bool;
}

/// A buffer of the request, in guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub addr: u64,
    pub len: u32,
}

/// A request's buffers: all the device may read come before all it may write, as the spec
/// requires of drivers.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Buffers {
    pub readable: Vec<Segment>,
    pub writable: Vec<Segment>,
}

/// What became of a request: the bytes written into its writable buffers (the used length
/// virtio reports) and the status byte it ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub written: u32,
    pub status: u8,
}

const HEADER_BYTES: usize = 16;
const SEGMENT_BYTES: usize = 16;

/// A byte stream over a list of segments.
struct Stream<'a> {
    segments: &'a [Segment],
    /// The segment the last piece was found in: its index and the stream offset it starts at.
    /// A request's bytes are taken in order (a write's data one device buffer after another,
    /// discard segments one by one, the status byte last), so the next search starts there: a
    /// chain of many small buffers is walked once, not once per device buffer.
    resume: Cell<(usize, u64)>,
}

impl<'a> Stream<'a> {
    fn new(segments: &'a [Segment]) -> Self {
        Self { segments, resume: Cell::new((0, 0)) }
    }

    fn len(&self) -> u64 {
        self.segments.iter().map(|s| u64::from(s.len)).sum()
    }

    /// Calls `visit` with each piece of `[from, from + len)` of the stream, in order: its guest
    /// address and its range within those `len` bytes. `false` if the stream is shorter, or as
    /// soon as `visit` returns `false`.
    fn each_piece(&self, from: u64, len: usize, mut visit: impl FnMut(u64, Range<usize>) -> bool) -> bool {
        let (mut index, mut start) = self.resume.get();
        if start > from {
            (index, start) = (0, 0);
        }
        let mut at = 0usize;
        while at < len {
            let Some(segment) = self.segments.get(index) else {
                return false;
            };
            let seg_len = u64::from(segment.len);
            let wanted = from.saturating_add(at as u64);
            if wanted - start >= seg_len {
                start += seg_len;
                index += 1;
                continue;
            }
            let within = wanted - start;
            // Within one segment's u32 length.
            let take = ((seg_len - within) as usize).min(len - at);
            self.resume.set((index, start));
            if !visit(segment.addr.wrapping_add(within), at..at + take) {
                return false;
            }
            at += take;
        }
        true
    }

    fn read(&self, memory: &dyn GuestBytes, from: u64, buf: &mut [u8]) -> bool {
        self.each_piece(from, buf.len(), |addr, range| memory.read_at(addr, &mut buf[range]))
    }

    fn write(&self, memory: &dyn GuestBytes, from: u64, data: &[u8]) -> bool {
        self.each_piece(from, data.len(), |addr, range| memory.write_at(addr, &data[range]))
    }
}

/// A write's data still in guest memory, given out in order: the device copies it once, from
/// guest memory straight into its own buffers (the RAM tier's pages).
struct GuestPayload<'a> {
    stream: &'a Stream<'a>,
    memory: &'a dyn GuestBytes,
    at: u64,
}

impl Payload for GuestPayload<'_> {
    fn receive(&mut self, buffers: &mut [IoSliceMut<'_>]) -> io::Result<()> {
        for buffer in buffers {
            if !self.stream.read(self.memory, self.at, buffer) {
                return Err(io::Error::other("a write's buffer is outside guest memory"));
            }
            self.at += buffer.len() as u64;
        }
        Ok(())
    }
}

/// Scratch bytes a connection keeps for reads, so that a read allocates and zeroes nothing;
/// beyond this it is given back after the request.
const SCRATCH_KEPT_BYTES: usize = 1 << 20;

/// Why a request was not carried out, as virtio says it.
enum Failure {
    /// The request is malformed or the device failed: VIRTIO_BLK_S_IOERR.
    Io(String),
    /// The request asks for what this device does not do: VIRTIO_BLK_S_UNSUPP.
    Unsupported(String),
}

impl From<DeviceError> for Failure {
    fn from(error: DeviceError) -> Self {
        match error.kind {
            DeviceErrorKind::NotSupported => Self::Unsupported(error.message),
            _ => Self::Io(error.to_string()),
        }
    }
}

/// Carries out the request in `buffers` on `device`, `id` being what GET_ID answers and
/// `write_back` whether the guest turned the write cache on (if not, each write is durable
/// before it completes, as FUA). Writes the status byte; the caller returns the request to the
/// guest with [`Outcome::written`]. A request too malformed to hold a status byte gets none.
/// `scratch` is the connection's buffer for reads, kept from one request to the next.
#[allow(clippy::too_many_arguments)]
pub fn serve(
    device: &mut dyn BlockDevice,
    memory: &dyn GuestBytes,
    buffers: &Buffers,
    limits: &Limits,
    id: &[u8],
    write_back: bool,
    scratch: &mut Vec<u8>,
) -> Outcome {
    let readable = Stream::new(&buffers.readable);
    let writable = Stream::new(&buffers.writable);
    let writable_len = writable.len();
    if writable_len == 0 {
        tracing::debug!("a virtio-blk request with no room for its status byte");
        return Outcome { written: 0, status: VIRTIO_BLK_S_IOERR as u8 };
    }
    let data_room = writable_len - 1;
    let request = Request { readable: &readable, writable: &writable, data_room, limits, id, write_back };
    let carried_out = carry_out(device, memory, &request, scratch);
    if scratch.capacity() > SCRATCH_KEPT_BYTES {
        *scratch = Vec::new();
    }
    let (written, status) = match carried_out {
        Ok(written) => (written, VIRTIO_BLK_S_OK),
        Err(Failure::Io(why)) => {
            tracing::debug!(%why, "virtio-blk request failed");
            (0, VIRTIO_BLK_S_IOERR)
        }
        Err(Failure::Unsupported(why)) => {
            tracing::debug!(%why, "virtio-blk request not supported");
            (0, VIRTIO_BLK_S_UNSUPP)
        }
    };
    let status = status as u8;
    if !writable.write(memory, data_room, &[status]) {
        tracing::debug!("a virtio-blk request's status byte is outside guest memory");
    }
    // The used length counts the status byte; it fits in u32 since a segment's length does.
    Outcome { written: u32::try_from(written + 1).unwrap_or(u32::MAX), status }
}

/// A request's buffers and what it is carried out with.
struct Request<'a> {
    readable: &'a Stream<'a>,
    writable: &'a Stream<'a>,
    /// Writable bytes before the status byte.
    data_room: u64,
    limits: &'a Limits,
    id: &'a [u8],
    write_back: bool,
}

fn carry_out(
    device: &mut dyn BlockDevice,
    memory: &dyn GuestBytes,
    request: &Request<'_>,
    scratch: &mut Vec<u8>,
) -> Result<u64, Failure> {
    let Request { readable, writable, data_room, limits, id, write_back } = *request;
    let mut header = [0u8; HEADER_BYTES];
    if !readable.read(memory, 0, &mut header) {
        return Err(Failure::Io("the request header is short or outside guest memory".into()));
    }
    let kind = u32::from_le_bytes(header[0..4].try_into().unwrap_or_default());
    let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
    let payload = readable.len() - HEADER_BYTES as u64;
    let fua = !write_back;
    match kind {
        VIRTIO_BLK_T_IN => {
            let offset = checked_range(device, sector, data_room, limits)?;
            let len = data_room as usize;
            if scratch.len() < len {
                scratch.resize(len, 0);
            }
            let data = &mut scratch[..len];
            let request = ReadRequest::begin(device, offset, data_room);
            device.read(&request, offset, data)?;
            if !writable.write(memory, 0, data) {
                return Err(Failure::Io("a read's buffer is outside guest memory".into()));
            }
            Ok(data_room)
        }
        VIRTIO_BLK_T_OUT => {
            let offset = checked_range(device, sector, payload, limits)?;
            read_only_check(device)?;
            let mut data = GuestPayload { stream: readable, memory, at: HEADER_BYTES as u64 };
            device.write_from(offset, payload as usize, fua, &mut data)?;
            Ok(0)
        }
        VIRTIO_BLK_T_FLUSH => {
            device.flush()?;
            Ok(0)
        }
        VIRTIO_BLK_T_GET_ID => {
            let mut answer = [0u8; VIRTIO_BLK_ID_BYTES as usize];
            let len = id.len().min(answer.len());
            answer[..len].copy_from_slice(&id[..len]);
            let room = (data_room as usize).min(answer.len());
            if !writable.write(memory, 0, &answer[..room]) {
                return Err(Failure::Io("the ID buffer is outside guest memory".into()));
            }
            Ok(room as u64)
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            read_only_check(device)?;
            let zeroing = kind == VIRTIO_BLK_T_WRITE_ZEROES;
            let segments = payload / SEGMENT_BYTES as u64;
            if segments == 0
                || !payload.is_multiple_of(SEGMENT_BYTES as u64)
                || segments > u64::from(limits.max_segments)
            {
                return Err(Failure::Io(format!("{payload} bytes of discard or zeroing segments")));
            }
            for i in 0..segments {
                let mut raw = [0u8; SEGMENT_BYTES];
                if !readable.read(memory, HEADER_BYTES as u64 + i * SEGMENT_BYTES as u64, &mut raw) {
                    return Err(Failure::Io("a segment is outside guest memory".into()));
                }
                let sector = u64::from_le_bytes(raw[0..8].try_into().unwrap_or_default());
                let sectors = u32::from_le_bytes(raw[8..12].try_into().unwrap_or_default());
                let flags = u32::from_le_bytes(raw[12..16].try_into().unwrap_or_default());
                let unmap = flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
                if flags & !VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0 || (unmap && !zeroing) {
                    return Err(Failure::Unsupported(format!("segment flags {flags:#x}")));
                }
                let len = u64::from(sectors) * SECTOR_BYTES;
                let offset = checked_range(device, sector, len, limits)?;
                if zeroing {
                    device.write_zeroes(offset, len, unmap, false, fua)?;
                } else {
                    device.trim(offset, len, fua)?;
                }
            }
            Ok(0)
        }
        other => Err(Failure::Unsupported(format!("request type {other}"))),
    }
}

/// The byte offset of `len` bytes at `sector`, if they are whole sectors inside the device and
/// no more than one request may carry.
fn checked_range(device: &dyn BlockDevice, sector: u64, len: u64, limits: &Limits) -> Result<u64, Failure> {
    let offset = sector.checked_mul(SECTOR_BYTES);
    match offset.and_then(|offset| offset.checked_add(len).map(|end| (offset, end))) {
        Some((offset, end))
            if end <= device.size() && len.is_multiple_of(SECTOR_BYTES) && len <= limits.max_request_bytes =>
        {
            Ok(offset)
        }
        _ => Err(Failure::Io(format!(
            "{len} bytes at sector {sector} do not fit a disk of {} bytes in whole sectors of at most {} bytes",
            device.size(),
            limits.max_request_bytes
        ))),
    }
}

fn read_only_check(device: &dyn BlockDevice) -> Result<(), Failure> {
    if device.capabilities().read_only {
        return Err(Failure::Io("the disk is read-only".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use virtio_bindings::virtio_blk::VIRTIO_BLK_T_SCSI_CMD;

    use super::*;
    use crate::testing::Disk;

    /// Guest memory: one buffer from address 0.
    struct Ram(RefCell<Vec<u8>>);

    impl GuestBytes for Ram {
        fn read_at(&self, addr: u64, buf: &mut [u8]) -> bool {
            let ram = self.0.borrow();
            let Some(end) = (addr as usize).checked_add(buf.len()).filter(|&end| end <= ram.len()) else {
                return false;
            };
            buf.copy_from_slice(&ram[addr as usize..end]);
            true
        }

        fn write_at(&self, addr: u64, data: &[u8]) -> bool {
            let mut ram = self.0.borrow_mut();
            let Some(end) = (addr as usize).checked_add(data.len()).filter(|&end| end <= ram.len()) else {
                return false;
            };
            ram[addr as usize..end].copy_from_slice(data);
            true
        }
    }

    fn disk() -> Disk {
        Disk::new(64 * 1024)
    }

    fn header(kind: u32, sector: u64) -> Vec<u8> {
        let mut h = kind.to_le_bytes().to_vec();
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&sector.to_le_bytes());
        h
    }

    /// Lays `readable` out in guest memory from 0x1000 and makes room for `writable` lengths at
    /// 0x8000 on; returns the memory and the buffers.
    fn request(readable: &[&[u8]], writable: &[u32]) -> (Ram, Buffers) {
        let room: usize = writable.iter().map(|&len| len as usize + 64).sum();
        let ram = Ram(RefCell::new(vec![0xee; (0x8000 + room).max(0x40000)]));
        let mut buffers = Buffers::default();
        let mut at = 0x1000u64;
        for piece in readable {
            ram.write_at(at, piece);
            buffers.readable.push(Segment { addr: at, len: piece.len() as u32 });
            at += piece.len() as u64 + 64;
        }
        let mut at = 0x8000u64;
        for &len in writable {
            buffers.writable.push(Segment { addr: at, len });
            at += u64::from(len) + 64;
        }
        (ram, buffers)
    }

    fn writable_bytes(ram: &Ram, buffers: &Buffers) -> Vec<u8> {
        let mut out = Vec::new();
        for segment in &buffers.writable {
            let mut piece = vec![0; segment.len as usize];
            assert!(ram.read_at(segment.addr, &mut piece));
            out.extend(piece);
        }
        out
    }

    fn serve_it(device: &mut Disk, ram: &Ram, buffers: &Buffers) -> Outcome {
        serve(device, ram, buffers, &Limits::default(), b"desk-01", true, &mut Vec::new())
    }

    #[test]
    fn a_stream_taken_in_order_is_searched_from_where_the_last_piece_was() {
        // 65,535 buffers of 512 bytes (a whole indirect table), taken 4 KiB at a time as the RAM
        // tier's pages take a write: each search starts at the segment the last one ended in,
        // so the chain is walked once in all, not once per page.
        let segments: Vec<Segment> = (0..65_535u64).map(|i| Segment { addr: i * 1024, len: 512 }).collect();
        let stream = Stream::new(&segments);
        for page in 0..(65_535 * 512 / 4096) as u64 {
            let mut pieces = Vec::new();
            assert!(stream.each_piece(page * 4096, 4096, |addr, range| {
                pieces.push((addr, range));
                true
            }));
            let first = page * 8;
            assert_eq!(pieces.len(), 8);
            assert_eq!(pieces[0], (first * 1024, 0..512));
            assert_eq!(pieces[7], ((first + 7) * 1024, 3584..4096));
            assert_eq!(stream.resume.get(), (first as usize + 7, (first + 7) * 512));
        }
        // Back before it: found again from the first segment; past the end: short.
        assert!(stream.each_piece(700, 10, |addr, range| addr == 1024 + 188 && range == (0..10)));
        assert!(!stream.each_piece(65_535 * 512 - 5, 10, |_, _| true));
    }

    /// A measurement, not a check: `cargo test --release -p overspill-vhost --lib
    /// a_write_over_the_most_buffers -- --ignored --nocapture` (docs/faults.md quotes it).
    #[test]
    #[ignore = "a measurement"]
    fn a_write_over_the_most_buffers_a_queue_may_chain_costs() {
        const SEGMENTS: u64 = 65_535;
        let segments: Vec<Segment> = (0..SEGMENTS).map(|i| Segment { addr: i * 512, len: 512 }).collect();
        let ram = Ram(RefCell::new(vec![7; (SEGMENTS * 512) as usize]));
        let stream = Stream::new(&segments);
        let mut pages = vec![vec![0u8; 4096]; (SEGMENTS * 512 / 4096) as usize];
        let mut slices: Vec<IoSliceMut<'_>> = pages.iter_mut().map(|p| IoSliceMut::new(p)).collect();
        let started = std::time::Instant::now();
        let mut payload = GuestPayload { stream: &stream, memory: &ram, at: 0 };
        payload.receive(&mut slices).expect("in memory");
        println!(
            "{} pages of 4 KiB from {SEGMENTS} buffers of 512 bytes: {:.1} ms",
            slices.len(),
            started.elapsed().as_secs_f64() * 1e3
        );
    }

    #[test]
    fn a_read_split_over_buffers_gets_the_disks_bytes_counted_once_and_status_ok() {
        let mut device = disk();
        // 1536 bytes at sector 3 into three buffers, the last also holding the status byte.
        let (ram, buffers) = request(&[&header(VIRTIO_BLK_T_IN, 3)], &[512, 700, 325]);
        let outcome = serve_it(&mut device, &ram, &buffers);
        assert_eq!(outcome, Outcome { written: 1537, status: VIRTIO_BLK_S_OK as u8 });
        let got = writable_bytes(&ram, &buffers);
        assert_eq!(&got[..1536], &device.bytes[1536..3072]);
        assert_eq!(got[1536], VIRTIO_BLK_S_OK as u8);
        assert_eq!(device.calls, ["begin 1536 1536"]);
    }

    #[test]
    fn a_write_gathers_its_buffers_and_is_durable_only_when_the_cache_is_off() {
        let mut device = disk();
        let data: Vec<u8> = (0..1024).map(|i| (i * 7) as u8).collect();
        let (ram, buffers) = request(&[&header(VIRTIO_BLK_T_OUT, 8), &data[..100], &data[100..]], &[1]);
        assert_eq!(serve_it(&mut device, &ram, &buffers).status, VIRTIO_BLK_S_OK as u8);
        assert_eq!(&device.bytes[4096..5120], &data[..]);
        let outcome = serve(&mut device, &ram, &buffers, &Limits::default(), b"x", false, &mut Vec::new());
        assert_eq!(outcome, Outcome { written: 1, status: VIRTIO_BLK_S_OK as u8 });
        assert_eq!(device.calls, ["write 4096 1024 fua=false", "write 4096 1024 fua=true"]);
    }

    #[test]
    fn requests_outside_the_disk_or_not_in_whole_sectors_fail_with_ioerr_and_touch_nothing() {
        let mut device = disk();
        let before = device.bytes.clone();
        let last_sector = device.bytes.len() as u64 / 512 - 1;
        for (readable, writable) in [
            (vec![header(VIRTIO_BLK_T_IN, last_sector)], vec![1024 + 1]),
            (vec![header(VIRTIO_BLK_T_IN, u64::MAX / 256)], vec![513]),
            (vec![header(VIRTIO_BLK_T_OUT, 0), vec![1; 100]], vec![1]),
            (vec![header(VIRTIO_BLK_T_IN, 0)], vec![(32 << 20) + 512 + 1]),
            // A header cut short.
            (vec![header(VIRTIO_BLK_T_IN, 0)[..10].to_vec()], vec![513]),
        ] {
            let pieces: Vec<&[u8]> = readable.iter().map(|r| r.as_slice()).collect();
            let (ram, buffers) = request(&pieces, &writable);
            let outcome = serve_it(&mut device, &ram, &buffers);
            assert_eq!(outcome.status, VIRTIO_BLK_S_IOERR as u8, "{readable:?} {writable:?}");
            assert_eq!(outcome.written, 1);
            assert_eq!(*writable_bytes(&ram, &buffers).last().expect("status"), VIRTIO_BLK_S_IOERR as u8);
        }
        assert_eq!(device.bytes, before);
        assert!(device.calls.is_empty(), "{:?}", device.calls);
    }

    #[test]
    fn get_id_answers_the_vm_name_nul_padded_and_unknown_requests_are_unsupported() {
        let mut device = disk();
        let (ram, buffers) = request(&[&header(VIRTIO_BLK_T_GET_ID, 0)], &[20, 1]);
        let outcome = serve_it(&mut device, &ram, &buffers);
        assert_eq!(outcome, Outcome { written: 21, status: VIRTIO_BLK_S_OK as u8 });
        let got = writable_bytes(&ram, &buffers);
        assert_eq!(&got[..20], b"desk-01\0\0\0\0\0\0\0\0\0\0\0\0\0");

        let (ram, buffers) = request(&[&header(VIRTIO_BLK_T_SCSI_CMD, 0)], &[1]);
        assert_eq!(serve_it(&mut device, &ram, &buffers).status, VIRTIO_BLK_S_UNSUPP as u8);
        let (ram, buffers) = request(&[&header(VIRTIO_BLK_T_FLUSH, 0)], &[1]);
        assert_eq!(serve_it(&mut device, &ram, &buffers).status, VIRTIO_BLK_S_OK as u8);
        assert_eq!(device.calls, ["flush"]);
    }

    fn segment(sector: u64, sectors: u32, flags: u32) -> Vec<u8> {
        let mut s = sector.to_le_bytes().to_vec();
        s.extend_from_slice(&sectors.to_le_bytes());
        s.extend_from_slice(&flags.to_le_bytes());
        s
    }

    #[test]
    fn discard_and_write_zeroes_carry_out_each_segment_and_refuse_unknown_flags() {
        let mut device = disk();
        let segments = [segment(8, 8, 0), segment(32, 16, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP)].concat();
        let (ram, buffers) = request(&[&header(VIRTIO_BLK_T_WRITE_ZEROES, 0), &segments], &[1]);
        assert_eq!(serve_it(&mut device, &ram, &buffers).status, VIRTIO_BLK_S_OK as u8);
        assert!(device.bytes[4096..8192].iter().all(|&b| b == 0));
        let (ram, buffers) = request(&[&header(VIRTIO_BLK_T_DISCARD, 0), &segment(0, 8, 0)], &[1]);
        assert_eq!(serve_it(&mut device, &ram, &buffers).status, VIRTIO_BLK_S_OK as u8);
        assert_eq!(device.calls, ["zero 4096 4096 trim=false", "zero 16384 8192 trim=true", "trim 0 4096"]);

        // Unmap on a discard, an unknown flag, a segment cut short: nothing done.
        for (kind, segments) in [
            (VIRTIO_BLK_T_DISCARD, segment(0, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP)),
            (VIRTIO_BLK_T_WRITE_ZEROES, segment(0, 8, 2)),
        ] {
            let (ram, buffers) = request(&[&header(kind, 0), &segments], &[1]);
            assert_eq!(serve_it(&mut device, &ram, &buffers).status, VIRTIO_BLK_S_UNSUPP as u8);
        }
        let (ram, buffers) = request(&[&header(VIRTIO_BLK_T_DISCARD, 0), &segment(0, 8, 0)[..12]], &[1]);
        assert_eq!(serve_it(&mut device, &ram, &buffers).status, VIRTIO_BLK_S_IOERR as u8);
        assert_eq!(device.calls.len(), 3);
    }

    #[test]
    fn a_request_with_no_writable_byte_gets_no_status_and_buffers_outside_memory_are_errors() {
        let mut device = disk();
        let (ram, buffers) = request(&[&header(VIRTIO_BLK_T_IN, 0)], &[]);
        assert_eq!(serve_it(&mut device, &ram, &buffers), Outcome { written: 0, status: VIRTIO_BLK_S_IOERR as u8 });
        let (ram, mut buffers) = request(&[&header(VIRTIO_BLK_T_IN, 0)], &[512, 1]);
        buffers.writable[0].addr = 1 << 40;
        assert_eq!(serve_it(&mut device, &ram, &buffers).status, VIRTIO_BLK_S_IOERR as u8);
        assert!(device.calls.iter().all(|call| call.starts_with("begin")), "{:?}", device.calls);
    }

    proptest::proptest! {
        /// Whatever a guest puts in its buffers, serving it neither panics nor writes outside
        /// the disk, and the status is one of virtio's three.
        #[test]
        fn any_request_gets_a_status_and_never_panics(
            kind in proptest::prop_oneof![0u32..16, proptest::num::u32::ANY],
            sector in proptest::prop_oneof![0u64..200, proptest::num::u64::ANY],
            payload in proptest::collection::vec(proptest::num::u8::ANY, 0..2048),
            writable in proptest::collection::vec(0u32..3000, 0..4),
        ) {
            let mut device = disk();
            let head = header(kind, sector);
            let (ram, buffers) = request(&[&head, &payload], &writable);
            let outcome = serve_it(&mut device, &ram, &buffers);
            proptest::prop_assert!(outcome.status <= VIRTIO_BLK_S_UNSUPP as u8);
            proptest::prop_assert_eq!(device.bytes.len(), 64 * 1024);
        }
    }
}
