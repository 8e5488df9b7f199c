//! Request traces: what one VM asked of its disk, with no data, so that a run can be replayed
//! against any server or through the engine alone.
//!
//! Format, version 1 (all integers little-endian):
//!
//! ```text
//! header   magic "OVSPTRC\0" (8 bytes), version u32 = 1, record size u32 = 24,
//!          disk size u64, VM name (u16 length + UTF-8), phase count u16,
//!          each phase name (u16 length + UTF-8)
//! record   time since the trace's start in µs u64, offset u64, length u32,
//!          command u8 (NBD numbering: 0 read, 1 write, 3 flush, 4 trim, 6 write zeroes),
//!          flags u8 (NBD command flags, low byte), phase index u16
//! ```
//!
//! A writer that dies mid-record leaves a partial record at the end; readers stop before it and
//! say so. Records are fixed-size so a trace can be sliced or counted without parsing it.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::Path;

use crate::op::GuestOp;

const MAGIC: &[u8; 8] = b"OVSPTRC\0";
const VERSION: u32 = 1;
pub const RECORD_BYTES: usize = 24;
/// The latest time a record may have, from the trace's start: a year. A time past it is a
/// corrupt record, not a VM's (a planner laid its timeline out to it, and ran out of memory).
pub const MAX_RECORD_TIME_US: u64 = 366 * 24 * 3600 * 1_000_000;

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("not an overspill trace (bad magic)")]
    BadMagic,
    #[error("trace version {0} is not supported (this build reads version {VERSION})")]
    Version(u32),
    #[error("malformed trace: {0}")]
    Malformed(String),
}

/// A trace's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceHeader {
    pub disk_bytes: u64,
    pub vm: String,
    pub phases: Vec<String>,
}

/// One recorded request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub time_us: u64,
    pub offset: u64,
    pub length: u32,
    pub kind: GuestOp,
    pub flags: u8,
    pub phase: u16,
}

fn kind_code(kind: GuestOp) -> u8 {
    match kind {
        GuestOp::Read => 0,
        GuestOp::Write => 1,
        GuestOp::Flush => 3,
        GuestOp::Trim => 4,
        GuestOp::Zero => 6,
    }
}

fn kind_of(code: u8) -> Option<GuestOp> {
    Some(match code {
        0 => GuestOp::Read,
        1 => GuestOp::Write,
        3 => GuestOp::Flush,
        4 => GuestOp::Trim,
        6 => GuestOp::Zero,
        _ => return None,
    })
}

fn put_str(out: &mut Vec<u8>, s: &str) -> Result<(), TraceError> {
    let len = u16::try_from(s.len()).map_err(|_| TraceError::Malformed(format!("name of {} bytes", s.len())))?;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

pub struct TraceWriter {
    out: BufWriter<File>,
}

impl TraceWriter {
    pub fn create(path: &Path, header: &TraceHeader) -> Result<Self, TraceError> {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&VERSION.to_le_bytes());
        bytes.extend_from_slice(&(RECORD_BYTES as u32).to_le_bytes());
        bytes.extend_from_slice(&header.disk_bytes.to_le_bytes());
        put_str(&mut bytes, &header.vm)?;
        let count = u16::try_from(header.phases.len()).map_err(|_| TraceError::Malformed("too many phases".into()))?;
        bytes.extend_from_slice(&count.to_le_bytes());
        for phase in &header.phases {
            put_str(&mut bytes, phase)?;
        }
        let mut out = BufWriter::with_capacity(256 * 1024, File::create(path)?);
        out.write_all(&bytes)?;
        Ok(Self { out })
    }

    pub fn record(&mut self, r: &Record) -> io::Result<()> {
        let mut b = [0u8; RECORD_BYTES];
        b[0..8].copy_from_slice(&r.time_us.to_le_bytes());
        b[8..16].copy_from_slice(&r.offset.to_le_bytes());
        b[16..20].copy_from_slice(&r.length.to_le_bytes());
        b[20] = kind_code(r.kind);
        b[21] = r.flags;
        b[22..24].copy_from_slice(&r.phase.to_le_bytes());
        self.out.write_all(&b)
    }

    pub fn finish(mut self) -> io::Result<()> {
        self.out.flush()
    }
}

fn read_exact_or(input: &mut impl Read, buf: &mut [u8], what: &str) -> Result<(), TraceError> {
    input.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => TraceError::Malformed(format!("ends inside the {what}")),
        _ => TraceError::Io(e),
    })
}

fn read_str(input: &mut impl Read) -> Result<String, TraceError> {
    let mut len = [0u8; 2];
    read_exact_or(input, &mut len, "header")?;
    let mut bytes = vec![0u8; usize::from(u16::from_le_bytes(len))];
    read_exact_or(input, &mut bytes, "header")?;
    String::from_utf8(bytes).map_err(|_| TraceError::Malformed("a name is not UTF-8".into()))
}

/// A whole trace in memory.
#[derive(Debug, Clone)]
pub struct Trace {
    pub header: TraceHeader,
    pub records: Vec<Record>,
    /// Bytes of a partial last record that were ignored (a writer that died).
    pub truncated_bytes: usize,
}

impl Trace {
    pub fn read(path: &Path) -> Result<Self, TraceError> {
        let mut input = BufReader::new(File::open(path)?);
        Self::from_reader(&mut input)
    }

    pub fn from_reader(input: &mut impl Read) -> Result<Self, TraceError> {
        let mut fixed = [0u8; 24];
        read_exact_or(input, &mut fixed, "header")?;
        if &fixed[0..8] != MAGIC {
            return Err(TraceError::BadMagic);
        }
        let version = u32::from_le_bytes([fixed[8], fixed[9], fixed[10], fixed[11]]);
        if version != VERSION {
            return Err(TraceError::Version(version));
        }
        let record_bytes = u32::from_le_bytes([fixed[12], fixed[13], fixed[14], fixed[15]]);
        if record_bytes as usize != RECORD_BYTES {
            return Err(TraceError::Malformed(format!("record size {record_bytes}")));
        }
        let mut size = [0u8; 8];
        size.copy_from_slice(&fixed[16..24]);
        let disk_bytes = u64::from_le_bytes(size);
        let vm = read_str(input)?;
        let mut count = [0u8; 2];
        read_exact_or(input, &mut count, "header")?;
        let phases = (0..u16::from_le_bytes(count)).map(|_| read_str(input)).collect::<Result<Vec<_>, _>>()?;
        let mut rest = Vec::new();
        input.read_to_end(&mut rest)?;
        let truncated_bytes = rest.len() % RECORD_BYTES;
        let mut records = Vec::with_capacity(rest.len() / RECORD_BYTES);
        for (i, b) in rest.chunks_exact(RECORD_BYTES).enumerate() {
            let u64_at = |at: usize| {
                let mut a = [0u8; 8];
                a.copy_from_slice(&b[at..at + 8]);
                u64::from_le_bytes(a)
            };
            let kind = kind_of(b[20]).ok_or_else(|| TraceError::Malformed(format!("record {i}: command {}", b[20])))?;
            let phase = u16::from_le_bytes([b[22], b[23]]);
            if usize::from(phase) >= phases.len().max(1) {
                return Err(TraceError::Malformed(format!("record {i}: phase {phase} of {}", phases.len())));
            }
            let offset = u64_at(8);
            let length = u32::from_le_bytes([b[16], b[17], b[18], b[19]]);
            if offset.checked_add(u64::from(length)).is_none_or(|end| end > disk_bytes) {
                return Err(TraceError::Malformed(format!("record {i}: {offset}+{length} is past the disk")));
            }
            let time_us = u64_at(0);
            if time_us > MAX_RECORD_TIME_US {
                return Err(TraceError::Malformed(format!("record {i}: at {time_us} µs, more than a year in")));
            }
            records.push(Record { time_us, offset, length, kind, flags: b[21], phase });
        }
        Ok(Self { header: TraceHeader { disk_bytes, vm, phases }, records, truncated_bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_what_it_cannot_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("vm.trace");
        let header =
            TraceHeader { disk_bytes: 1 << 30, vm: "vm-3".into(), phases: vec!["boot".into(), "steady".into()] };
        let records = [
            Record { time_us: 5, offset: 4096, length: 8192, kind: GuestOp::Read, flags: 0, phase: 0 },
            Record { time_us: 9, offset: 0, length: 512, kind: GuestOp::Write, flags: 1, phase: 0 },
            Record { time_us: 2_000_000, offset: 1 << 20, length: 1 << 20, kind: GuestOp::Trim, flags: 0, phase: 1 },
            Record { time_us: 2_000_100, offset: 0, length: 0, kind: GuestOp::Flush, flags: 0, phase: 1 },
        ];
        let mut w = TraceWriter::create(&path, &header).expect("create");
        for r in &records {
            w.record(r).expect("record");
        }
        w.finish().expect("finish");
        let t = Trace::read(&path).expect("read");
        assert_eq!(t.header, header);
        assert_eq!(t.records, records);
        assert_eq!(
            std::fs::metadata(&path).expect("stat").len() as usize,
            24 + 2 + 4 + 2 + 2 + 4 + 2 + 6 + 4 * RECORD_BYTES
        );

        // A partial last record (a writer that died) is ignored and reported.
        let mut bytes = std::fs::read(&path).expect("read bytes");
        bytes.extend_from_slice(&[1, 2, 3]);
        let t = Trace::from_reader(&mut bytes.as_slice()).expect("partial tail");
        assert_eq!((t.records.len(), t.truncated_bytes), (4, 3));
        // Records past the disk or a year in, unknown commands, other versions and other files
        // are refused.
        let mut past = std::fs::read(&path).expect("read bytes");
        let first = past.len() - 4 * RECORD_BYTES;
        past[first + 8..first + 16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(Trace::from_reader(&mut past.as_slice()), Err(TraceError::Malformed(_))));
        let mut late = std::fs::read(&path).expect("read bytes");
        late[first..first + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(Trace::from_reader(&mut late.as_slice()), Err(TraceError::Malformed(_))));
        let mut cmd = std::fs::read(&path).expect("read bytes");
        cmd[first + 20] = 9;
        assert!(matches!(Trace::from_reader(&mut cmd.as_slice()), Err(TraceError::Malformed(_))));
        let mut version = std::fs::read(&path).expect("read bytes");
        version[8] = 2;
        assert!(matches!(Trace::from_reader(&mut version.as_slice()), Err(TraceError::Version(2))));
        assert!(matches!(
            Trace::from_reader(&mut &b"GIF89a..........................."[..]),
            Err(TraceError::BadMagic)
        ));
    }
}
