//! NBD wire constants and encoders, as `proto.md` of the NetworkBlockDevice project defines them.
//! Every integer on the wire is big-endian.

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const CLIENT_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const CLIENT_NO_ZEROES: u32 = 1 << 1;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option replies.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
pub const REP_ERR_POLICY: u32 = REP_ERR | 2;
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR | 7;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;

// NBD_REP_INFO types.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// Commands and their flags.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Structured reply chunks.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;

// The base:allocation metadata context.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// QEMU's context of which layer of an image chain holds each range (docs/interop/nbd.rst in
/// QEMU): a 32-bit depth per extent, 0 for none, 1 for the top layer.
pub const ALLOCATION_DEPTH: &str = "qemu:allocation-depth";
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// Errno values as the protocol numbers them (Linux's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Errno {
    Perm = 1,
    Io = 5,
    NoMem = 12,
    Inval = 22,
    NoSpc = 28,
    NotSup = 95,
    Shutdown = 108,
}

/// Bytes of a request header: magic, flags, type, cookie, offset, length.
pub const REQUEST_HEADER_BYTES: usize = 28;
/// Bytes of a structured reply chunk header.
pub const CHUNK_HEADER_BYTES: usize = 20;
/// Bytes of a simple reply header.
pub const SIMPLE_REPLY_BYTES: usize = 16;

pub fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_be_bytes());
}

pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_be_bytes());
}

pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_be_bytes());
}

/// An option as a client sends it: header and data.
pub fn put_option(out: &mut Vec<u8>, option: u32, data: &[u8]) {
    put_u64(out, IHAVEOPT);
    put_u32(out, option);
    put_u32(out, data.len() as u32);
    out.extend_from_slice(data);
}

/// The data of NBD_OPT_INFO and NBD_OPT_GO: the export name and the information types asked for.
pub fn info_request(name: &str, requests: &[u16]) -> Vec<u8> {
    let mut data = Vec::with_capacity(6 + name.len() + 2 * requests.len());
    put_u32(&mut data, name.len() as u32);
    data.extend_from_slice(name.as_bytes());
    put_u16(&mut data, requests.len() as u16);
    for &r in requests {
        put_u16(&mut data, r);
    }
    data
}

/// The data of NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT: the export name and the
/// queries.
pub fn meta_context_request(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = Vec::with_capacity(8 + export.len() + queries.iter().map(|q| 4 + q.len()).sum::<usize>());
    put_u32(&mut data, export.len() as u32);
    data.extend_from_slice(export.as_bytes());
    put_u32(&mut data, queries.len() as u32);
    for query in queries {
        put_u32(&mut data, query.len() as u32);
        data.extend_from_slice(query.as_bytes());
    }
    data
}

/// An option reply header followed by its payload.
pub fn option_reply(out: &mut Vec<u8>, option: u32, reply: u32, payload: &[u8]) {
    put_u64(out, OPTION_REPLY_MAGIC);
    put_u32(out, option);
    put_u32(out, reply);
    // Payloads are built by this crate and stay far below 4 GiB.
    put_u32(out, payload.len() as u32);
    out.extend_from_slice(payload);
}

pub fn simple_reply(out: &mut Vec<u8>, cookie: u64, error: u32) {
    put_u32(out, SIMPLE_REPLY_MAGIC);
    put_u32(out, error);
    put_u64(out, cookie);
}

pub fn chunk_header(out: &mut Vec<u8>, flags: u16, kind: u16, cookie: u64, length: u32) {
    put_u32(out, STRUCTURED_REPLY_MAGIC);
    put_u16(out, flags);
    put_u16(out, kind);
    put_u64(out, cookie);
    put_u32(out, length);
}

/// A final NBD_REPLY_TYPE_ERROR chunk with a human-readable message.
pub fn structured_error(out: &mut Vec<u8>, cookie: u64, error: u32, message: &str) {
    // Messages are capped well below the protocol's 4096-byte string limit.
    let message = truncate_utf8(message, 1024);
    chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, 6 + message.len() as u32);
    put_u32(out, error);
    put_u16(out, message.len() as u16);
    out.extend_from_slice(message.as_bytes());
}

/// `s` cut to at most `max` bytes, at a character boundary: strings on the wire (error messages
/// among them) may not exceed 4096 bytes.
pub fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

pub fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

pub fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

pub fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}
