//! Transmission requests: parsing (total, bounded) and validation at the edge.
//!
//! [`RequestHeader::parse`] fails only when framing is lost (wrong magic, or a write payload too
//! large to accept), which closes the connection. [`validate`] turns everything else a client can
//! get wrong (unknown command or flag, a range past the end, a read above the maximum) into an
//! errno for that one request, so the device below only ever sees requests it can serve.

use crate::wire::*;
use overspill_block::{Capabilities, DeviceErrorKind};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FramingError {
    #[error("request magic {0:#x} is wrong")]
    BadMagic(u32),
    #[error("write of {length} bytes exceeds the {max}-byte maximum payload")]
    PayloadTooLarge { length: u32, max: u32 },
}

impl RequestHeader {
    pub fn parse(b: &[u8; REQUEST_HEADER_BYTES]) -> Result<Self, FramingError> {
        let magic = be_u32(b);
        if magic != REQUEST_MAGIC {
            return Err(FramingError::BadMagic(magic));
        }
        Ok(Self {
            flags: be_u16(&b[4..]),
            kind: be_u16(&b[6..]),
            cookie: be_u64(&b[8..]),
            offset: be_u64(&b[16..]),
            length: be_u32(&b[24..]),
        })
    }

    /// Bytes of data that follow the header on the wire. Checked against the limit before any
    /// buffer is allocated for them.
    pub fn payload_bytes(&self, max_payload: u32) -> Result<u32, FramingError> {
        if self.kind != CMD_WRITE {
            return Ok(0);
        }
        if self.length > max_payload {
            return Err(FramingError::PayloadTooLarge { length: self.length, max: max_payload });
        }
        Ok(self.length)
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        put_u32(out, REQUEST_MAGIC);
        put_u16(out, self.flags);
        put_u16(out, self.kind);
        put_u64(out, self.cookie);
        put_u64(out, self.offset);
        put_u32(out, self.length);
    }
}

/// A request that passed validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read { offset: u64, length: u32 },
    Write { offset: u64, length: u32, fua: bool },
    Flush,
    Trim { offset: u64, length: u32, fua: bool },
    WriteZeroes { offset: u64, length: u32, may_trim: bool, fast_only: bool, fua: bool },
    Cache { offset: u64, length: u32 },
    BlockStatus { offset: u64, length: u32, req_one: bool },
    Disconnect,
}

/// The one mapping from device errors to the wire.
pub fn errno_of(kind: DeviceErrorKind) -> Errno {
    match kind {
        DeviceErrorKind::Io => Errno::Io,
        DeviceErrorKind::NoSpace => Errno::NoSpc,
        DeviceErrorKind::Invalid => Errno::Inval,
        DeviceErrorKind::NotSupported => Errno::NotSup,
        DeviceErrorKind::ReadOnly | DeviceErrorKind::Refused => Errno::Perm,
        DeviceErrorKind::Exhausted => Errno::NoMem,
    }
}

/// Checks a request against the export; `Err` is the errno to reply with.
pub fn validate(h: &RequestHeader, size: u64, caps: Capabilities, max_payload: u32) -> Result<Command, Errno> {
    if h.kind == CMD_DISC {
        // DISC has no reply to carry an error: whatever its flags, offset and length, the
        // client is leaving, cleanly.
        return Ok(Command::Disconnect);
    }
    // FUA is valid on every command once negotiated ("the server MUST accept all commands with
    // this flag set, even if the flag has no effect"), as nbdkit and qemu-nbd do; checked below.
    let allowed_flags = CMD_FLAG_FUA
        | match h.kind {
            // DF is never advertised (SEND_DF), and a read carrying it would bind the server to
            // one content chunk, which large and sparse reads are not: refused, not ignored.
            CMD_READ | CMD_WRITE | CMD_TRIM | CMD_FLUSH | CMD_CACHE => 0,
            CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
            CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            _ => return Err(Errno::Inval),
        };
    if h.flags & !allowed_flags != 0 {
        return Err(Errno::Inval);
    }
    let fua = h.flags & CMD_FLAG_FUA != 0;
    let writes = matches!(h.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && caps.read_only {
        return Err(Errno::Perm);
    }
    let supported = match h.kind {
        CMD_FLUSH => caps.can_flush,
        CMD_TRIM => caps.can_trim,
        CMD_WRITE_ZEROES => caps.can_zero && (h.flags & CMD_FLAG_FAST_ZERO == 0 || caps.can_fast_zero),
        _ => true,
    };
    if !supported || (fua && !caps.can_fua) {
        return Err(Errno::Inval);
    }
    if matches!(h.kind, CMD_READ) && h.length > max_payload {
        return Err(Errno::Inval);
    }
    if h.kind == CMD_BLOCK_STATUS && h.length == 0 {
        // The spec leaves it unspecified; an error is an answer a client can act on.
        return Err(Errno::Inval);
    }
    let in_range = h.offset.checked_add(u64::from(h.length)).is_some_and(|end| end <= size);
    if !in_range && h.kind != CMD_FLUSH {
        // The spec asks for ENOSPC when a write reaches past the end, EINVAL for the rest.
        return Err(if matches!(h.kind, CMD_WRITE | CMD_WRITE_ZEROES) { Errno::NoSpc } else { Errno::Inval });
    }
    let (offset, length) = (h.offset, h.length);
    Ok(match h.kind {
        CMD_READ => Command::Read { offset, length },
        CMD_WRITE => Command::Write { offset, length, fua },
        CMD_FLUSH => Command::Flush,
        CMD_TRIM => Command::Trim { offset, length, fua },
        CMD_CACHE => Command::Cache { offset, length },
        CMD_BLOCK_STATUS => Command::BlockStatus { offset, length, req_one: h.flags & CMD_FLAG_REQ_ONE != 0 },
        CMD_WRITE_ZEROES => Command::WriteZeroes {
            offset,
            length,
            may_trim: h.flags & CMD_FLAG_NO_HOLE == 0,
            fast_only: h.flags & CMD_FLAG_FAST_ZERO != 0,
            fua,
        },
        // Unknown commands were refused above.
        _ => return Err(Errno::Inval),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPS: Capabilities = Capabilities {
        read_only: false,
        can_flush: true,
        can_fua: true,
        can_trim: true,
        can_zero: true,
        can_fast_zero: false,
        can_multi_conn: false,
    };

    fn header(kind: u16, flags: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader { flags, kind, cookie: 7, offset, length }
    }

    #[test]
    fn round_trips_and_rejects_bad_magic() {
        let h = header(CMD_WRITE, CMD_FLAG_FUA, 1 << 40, 4096);
        let mut bytes = Vec::new();
        h.encode(&mut bytes);
        let array: [u8; REQUEST_HEADER_BYTES] = bytes.clone().try_into().expect("28 bytes");
        assert_eq!(RequestHeader::parse(&array), Ok(h));
        bytes[0] ^= 1;
        let array: [u8; REQUEST_HEADER_BYTES] = bytes.try_into().expect("28 bytes");
        assert!(matches!(RequestHeader::parse(&array), Err(FramingError::BadMagic(_))));
        assert_eq!(
            header(CMD_WRITE, 0, 0, 100).payload_bytes(64),
            Err(FramingError::PayloadTooLarge { length: 100, max: 64 })
        );
        assert_eq!(header(CMD_READ, 0, 0, 100).payload_bytes(64), Ok(0));
    }

    #[test]
    fn validation_follows_the_spec() {
        let v = |h: RequestHeader| validate(&h, 1 << 20, CAPS, 1 << 16);
        assert_eq!(v(header(CMD_READ, 0, 0, 4096)), Ok(Command::Read { offset: 0, length: 4096 }));
        assert_eq!(v(header(CMD_READ, 0, (1 << 20) - 1, 2)), Err(Errno::Inval));
        assert_eq!(v(header(CMD_WRITE, 0, (1 << 20) - 1, 2)), Err(Errno::NoSpc));
        assert_eq!(v(header(CMD_WRITE_ZEROES, 0, u64::MAX, 2)), Err(Errno::NoSpc));
        assert_eq!(v(header(CMD_TRIM, 0, 1 << 20, 1)), Err(Errno::Inval));
        assert_eq!(v(header(CMD_READ, 0, 0, 1 << 17)), Err(Errno::Inval), "above the maximum");
        assert_eq!(v(header(9, 0, 0, 0)), Err(Errno::Inval), "unknown command");
        assert_eq!(v(header(CMD_FLUSH, CMD_FLAG_NO_HOLE, 0, 0)), Err(Errno::Inval), "flag not allowed");
        assert_eq!(v(header(CMD_FLUSH, CMD_FLAG_FUA, 0, 0)), Ok(Command::Flush), "FUA is valid on every command");
        assert_eq!(v(header(CMD_READ, CMD_FLAG_FUA, 0, 4096)), Ok(Command::Read { offset: 0, length: 4096 }));
        let no_fua = Capabilities { can_fua: false, ..CAPS };
        assert_eq!(validate(&header(CMD_READ, CMD_FLAG_FUA, 0, 512), 4096, no_fua, 4096), Err(Errno::Inval));
        assert_eq!(v(header(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 512)), Err(Errno::Inval), "not advertised");
        assert_eq!(
            v(header(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE | CMD_FLAG_FUA, 0, 512)),
            Ok(Command::WriteZeroes { offset: 0, length: 512, may_trim: false, fast_only: false, fua: true })
        );
        let ro = Capabilities { read_only: true, ..CAPS };
        assert_eq!(validate(&header(CMD_TRIM, 0, 0, 512), 4096, ro, 4096), Err(Errno::Perm));
        assert_eq!(v(header(CMD_DISC, 0, u64::MAX, u32::MAX)), Ok(Command::Disconnect));
    }
}
