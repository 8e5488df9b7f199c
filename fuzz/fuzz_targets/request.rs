//! Request framing and validation at the edge: every request header, against every export size,
//! capability set and payload limit. What passes `validate` reaches the device unchecked, so a
//! range past the end or a length above the limit getting through is a bug below; a good request
//! refused is a client broken for nothing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use overspill_block::Capabilities;
use overspill_fuzz::REQUEST_INPUT_BYTES;
use overspill_nbd::request::{validate, Command, FramingError, RequestHeader};
use overspill_nbd::wire::*;

fuzz_target!(|data: &[u8]| {
    let mut input = [0u8; REQUEST_INPUT_BYTES];
    input[..data.len().min(REQUEST_INPUT_BYTES)].copy_from_slice(&data[..data.len().min(REQUEST_INPUT_BYTES)]);
    let raw: [u8; REQUEST_HEADER_BYTES] = input[..REQUEST_HEADER_BYTES].try_into().expect("28 bytes");
    let (size, max, bits) = (be_u64(&input[28..]), be_u32(&input[36..]), input[40]);
    let bit = |n: u8| bits & (1 << n) != 0;
    let caps = Capabilities {
        read_only: bit(0),
        can_flush: bit(1),
        can_fua: bit(2),
        can_trim: bit(3),
        can_zero: bit(4),
        can_fast_zero: bit(5),
        // Only the transmission flags read it: no request is valid or invalid for it.
        can_multi_conn: bit(6),
    };

    let h = match RequestHeader::parse(&raw) {
        Ok(h) => h,
        Err(FramingError::BadMagic(magic)) => return assert!(magic != REQUEST_MAGIC && magic == be_u32(&raw)),
        Err(other) => panic!("parse failed on more than the magic: {other}"),
    };
    let mut encoded = Vec::new();
    h.encode(&mut encoded);
    assert_eq!(encoded, raw, "parse and encode disagree");

    // Only a write carries a payload, and only one within the limit is read off the wire.
    let payload = h.payload_bytes(max);
    match payload {
        Ok(n) => assert_eq!(n, if h.kind == CMD_WRITE { h.length } else { 0 }),
        Err(FramingError::PayloadTooLarge { length, max: m }) => {
            assert!(h.kind == CMD_WRITE && length == h.length && m == max && length > max)
        }
        Err(other) => panic!("{other}"),
    }

    // The spec, restated: which requests a server with these capabilities must serve.
    let (fua, no_hole, fast) =
        (h.flags & CMD_FLAG_FUA != 0, h.flags & CMD_FLAG_NO_HOLE != 0, h.flags & CMD_FLAG_FAST_ZERO != 0);
    let writable = !caps.read_only;
    // FUA is valid on every command once negotiated (checked with `can_fua` below).
    let (allowed_flags, supported) = match h.kind {
        // DF is never advertised: refused.
        CMD_READ => (CMD_FLAG_FUA, true),
        CMD_WRITE => (CMD_FLAG_FUA, writable),
        CMD_TRIM => (CMD_FLAG_FUA, writable && caps.can_trim),
        CMD_WRITE_ZEROES => (
            CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            writable && caps.can_zero && (!fast || caps.can_fast_zero),
        ),
        CMD_FLUSH => (CMD_FLAG_FUA, caps.can_flush),
        // DISC has no reply to refuse with: the client leaves whatever it sent.
        CMD_DISC => (u16::MAX, true),
        CMD_CACHE => (CMD_FLAG_FUA, true),
        // Whether a context was selected is the connection's to check; a zero length asks
        // about nothing.
        CMD_BLOCK_STATUS => (CMD_FLAG_FUA | CMD_FLAG_REQ_ONE, h.length > 0),
        _ => (0, false),
    };
    let ranged = !matches!(h.kind, CMD_FLUSH | CMD_DISC);
    let end = h.offset.checked_add(u64::from(h.length));
    let in_range = end.is_some_and(|end| end <= size);
    let servable = supported
        && h.flags & !allowed_flags == 0
        && (!fua || caps.can_fua || h.kind == CMD_DISC)
        && (!ranged || in_range)
        && (h.kind != CMD_READ || h.length <= max);

    let result = validate(&h, size, caps, max);
    assert_eq!(result.is_ok(), servable, "{h:?} size {size} max {max} {caps:?}: {result:?}");
    let command = match result {
        Ok(command) => command,
        Err(errno) => {
            // EPERM only for writes to a read-only export; ENOSPC only for writes past the end.
            let writes = matches!(h.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
            match errno {
                Errno::Perm => assert!(writes && caps.read_only),
                Errno::NoSpc => assert!(matches!(h.kind, CMD_WRITE | CMD_WRITE_ZEROES) && !in_range),
                Errno::Inval => {}
                other => panic!("validate answered {other:?}"),
            }
            return;
        }
    };

    // What the device will be handed: in range, within the limit, flags as sent.
    let (offset, length) = (h.offset, h.length);
    let expected = match h.kind {
        CMD_READ => Command::Read { offset, length },
        CMD_WRITE => Command::Write { offset, length, fua },
        CMD_TRIM => Command::Trim { offset, length, fua },
        CMD_WRITE_ZEROES => Command::WriteZeroes { offset, length, may_trim: !no_hole, fast_only: fast, fua },
        CMD_FLUSH => Command::Flush,
        CMD_CACHE => Command::Cache { offset, length },
        CMD_BLOCK_STATUS => Command::BlockStatus { offset, length, req_one: h.flags & CMD_FLAG_REQ_ONE != 0 },
        _ => Command::Disconnect,
    };
    assert_eq!(command, expected);
    if let Command::Read { offset, length }
    | Command::Write { offset, length, .. }
    | Command::Trim { offset, length, .. }
    | Command::WriteZeroes { offset, length, .. } = command
    {
        assert!(offset.checked_add(u64::from(length)).is_some_and(|end| end <= size), "past the end");
    }
    if let Command::Read { length, .. } | Command::Write { length, .. } = command {
        // A write's limit is payload_bytes' job, which runs first on the wire.
        assert!(length <= max || payload.is_err(), "{length} above the {max}-byte limit");
    }
});
