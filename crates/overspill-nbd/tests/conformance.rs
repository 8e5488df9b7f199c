//! The NBD protocol's requirements on a server (`doc/proto.md` of NetworkBlockDevice/nbd), one
//! test or more each, in raw bytes over a socketpair (or TLS over one) to the real [`Server`].
//! docs/nbd-conformance.md lists every requirement, where the spec states it and which test
//! holds it (here, in tests/server.rs, tests/shutdown.rs, the unit tests or crates/overspill).
//!
//! Each assertion is one a server breaking the requirement would fail: the helpers below parse
//! what the server sends without trusting it (magic, lengths, cookies, flags).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openssl::ssl::{ShutdownState, Ssl, SslContext, SslMethod, SslStream, SslVersion};
use overspill_block::{
    BlockDevice, Capabilities, DeviceError, DeviceErrorKind, ExportAccess, ExportInfo, ExportProvider, Extent,
    ReadRequest, DEFAULT_BLOCK_SIZES,
};
use overspill_nbd::counters::Refusal;
use overspill_nbd::memory::MemoryDevice;
use overspill_nbd::server::socketpair;
use overspill_nbd::wire::*;
use overspill_nbd::{Limits, Security, Server, ServerConfig};
use overspill_net::{ServerTls, TlsMode};

const NAME: &str = "disk";
/// Four reply slices of this server (1 MiB each), so that a whole-disk read takes several chunks.
const SIZE: usize = 4 << 20;

// Values of the spec this crate's `wire` module has no use for.
const OPT_PEEK_EXPORT: u32 = 4;
const OPT_EXTENDED_HEADERS: u32 = 11;
const TFLAG_ROTATIONAL: u16 = 1 << 4;
const TFLAG_SEND_DF: u16 = 1 << 7;
const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
const TFLAG_SEND_RESIZE: u16 = 1 << 9;
const TFLAG_BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;
const CMD_RESIZE: u16 = 8;
const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// The error values the spec defines: EPERM EIO ENOMEM EINVAL ENOSPC EOVERFLOW ENOTSUP ESHUTDOWN.
const ALLOWED_ERRNOS: [u32; 8] = [1, 5, 12, 22, 28, 75, 95, 108];
const EPERM: u32 = 1;
const EIO: u32 = 5;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;
const EOVERFLOW: u32 = 75;
const ENOTSUP: u32 = 95;
/// Strings (export names, error messages) may not be longer.
const MAX_STRING: usize = 4096;

// ---------------------------------------------------------------------------------------------
// A disk that records what reaches it, with capabilities and failures chosen by the test.

#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Write { offset: u64, length: usize, fua: bool },
    Zero { offset: u64, length: u64, may_trim: bool, fast_only: bool, fua: bool },
    Trim { offset: u64, length: u64, fua: bool },
    Flush,
    Disconnect,
}

#[derive(Clone)]
struct Disk {
    memory: MemoryDevice,
    caps: Capabilities,
    calls: Arc<Mutex<Vec<Call>>>,
    /// Once set, every call fails with this.
    fail: Arc<Mutex<Option<DeviceError>>>,
    /// Reads reaching this offset fail with EIO.
    bad_from: u64,
    /// Zeroing is no faster than writing: FAST_ZERO requests are refused.
    slow_zero: bool,
    open_error: Option<DeviceError>,
}

impl Disk {
    fn new(caps: Capabilities) -> Self {
        Self {
            memory: MemoryDevice::new(SIZE),
            caps,
            calls: Arc::default(),
            fail: Arc::default(),
            bad_from: u64::MAX,
            slow_zero: false,
            open_error: None,
        }
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().expect("calls").clone()
    }

    fn fail_with(&self, error: Option<DeviceError>) {
        *self.fail.lock().expect("fail") = error;
    }

    fn failing(&self) -> Result<(), DeviceError> {
        match &*self.fail.lock().expect("fail") {
            Some(error) => Err(error.clone()),
            None => Ok(()),
        }
    }

    fn log(&self, call: Call) {
        self.calls.lock().expect("calls").push(call);
    }
}

impl BlockDevice for Disk {
    fn size(&self) -> u64 {
        SIZE as u64
    }
    fn capabilities(&self) -> Capabilities {
        self.caps
    }
    fn read(&mut self, request: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.failing()?;
        if offset + buf.len() as u64 > self.bad_from {
            return Err(DeviceError::new(DeviceErrorKind::Io, "bad sector"));
        }
        self.memory.read(request, offset, buf)
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.failing()?;
        self.log(Call::Write { offset, length: data.len(), fua });
        self.memory.write(offset, data, fua)
    }
    fn write_zeroes(
        &mut self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast: bool,
        fua: bool,
    ) -> Result<(), DeviceError> {
        self.failing()?;
        self.log(Call::Zero { offset, length, may_trim, fast_only: fast, fua });
        if fast && self.slow_zero {
            return Err(DeviceError::new(DeviceErrorKind::NotSupported, "zeroing is no faster than writing"));
        }
        self.memory.write_zeroes(offset, length, may_trim, fast, fua)
    }
    fn trim(&mut self, offset: u64, length: u64, fua: bool) -> Result<(), DeviceError> {
        self.failing()?;
        self.log(Call::Trim { offset, length, fua });
        self.memory.trim(offset, length, fua)
    }
    fn flush(&mut self) -> Result<(), DeviceError> {
        self.failing()?;
        self.log(Call::Flush);
        Ok(())
    }
    fn disconnect(&mut self) {
        self.log(Call::Disconnect);
    }
    /// Even 4 KiB blocks are data, odd ones holes: many extents for any range. A hole reads as
    /// zeroes when its bytes are zeroes (which the server may then send as a hole chunk).
    fn block_status(&mut self, offset: u64, length: u64) -> Result<Vec<Extent>, DeviceError> {
        self.failing()?;
        let mut extents = Vec::new();
        let (mut at, end) = (offset, offset + length);
        while at < end {
            let block_end = ((at / 4096 + 1) * 4096).min(end);
            let hole = (at / 4096) % 2 == 1;
            let mut bytes = vec![0u8; (block_end - at) as usize];
            self.memory.read_at(at, &mut bytes)?;
            let zero = hole && bytes.iter().all(|&b| b == 0);
            extents.push(Extent { length: block_end - at, hole, zero });
            at = block_end;
        }
        Ok(extents)
    }
}

impl ExportProvider for Disk {
    fn list(&self) -> Vec<ExportInfo> {
        self.info(NAME).into_iter().collect()
    }
    fn info(&self, name: &str) -> Option<ExportInfo> {
        (name == NAME).then(|| ExportInfo {
            name: NAME.into(),
            description: "a test disk".into(),
            size: SIZE as u64,
            capabilities: self.caps,
            block_sizes: DEFAULT_BLOCK_SIZES,
        })
    }
    fn open(&self, name: &str, _identity: Option<&str>) -> Result<Box<dyn BlockDevice>, DeviceError> {
        if let Some(error) = &self.open_error {
            return Err(error.clone());
        }
        if name != NAME {
            return Err(DeviceError::new(DeviceErrorKind::Invalid, "no such export"));
        }
        Ok(Box::new(self.clone()))
    }
}

fn limits(max_payload: u32) -> Limits {
    Limits { max_payload_bytes: max_payload, handshake_timeout: Duration::from_secs(10), ..Limits::default() }
}

fn serve_with(disk: &Disk, limits: Limits, security: Security) -> Server {
    Server::new(Arc::new(disk.clone()), ServerConfig { limits, security, ..ServerConfig::default() })
}

fn serve(disk: &Disk) -> Server {
    serve_with(disk, Limits::default(), Security::default())
}

// ---------------------------------------------------------------------------------------------
// A client that speaks raw bytes and trusts nothing it is sent.

#[derive(Debug, Clone, PartialEq, Eq)]
struct OptReply {
    option: u32,
    kind: u32,
    payload: Vec<u8>,
}

#[derive(Debug)]
struct Chunk {
    flags: u16,
    kind: u16,
    cookie: u64,
    payload: Vec<u8>,
}

impl Chunk {
    fn is_error(&self) -> bool {
        self.kind & (1 << 15) != 0
    }

    /// The error value and message of an error chunk, checked against its length.
    fn error(&self) -> (u32, String) {
        assert!(self.is_error(), "not an error chunk: {self:?}");
        assert!(self.payload.len() >= 6, "error chunk of {} bytes", self.payload.len());
        let errno = be_u32(&self.payload);
        let message_len = usize::from(be_u16(&self.payload[4..]));
        assert!(message_len <= self.payload.len() - 6, "message length {message_len} past the chunk");
        let message = std::str::from_utf8(&self.payload[6..6 + message_len]).expect("UTF-8 message").to_owned();
        (errno, message)
    }
}

#[derive(Debug)]
enum Reply {
    Simple { error: u32, cookie: u64 },
    Chunk(Chunk),
}

impl Reply {
    fn cookie(&self) -> u64 {
        match self {
            Reply::Simple { cookie, .. } => *cookie,
            Reply::Chunk(c) => c.cookie,
        }
    }
}

struct Conn<S> {
    s: S,
}

impl Conn<UnixStream> {
    /// A new connection whose greeting has been read and checked.
    fn open(server: &Server) -> Self {
        let s = socketpair(server).expect("socketpair");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut conn = Conn { s };
        let greeting = conn.bytes(18);
        assert_eq!(be_u64(&greeting), NBDMAGIC);
        assert_eq!(be_u64(&greeting[8..]), IHAVEOPT);
        conn
    }

    /// Greeting read, client flags sent.
    fn start(server: &Server, client_flags: u32) -> Self {
        let mut conn = Self::open(server);
        conn.send(&client_flags.to_be_bytes());
        conn
    }

    /// In transmission on `NAME` (through GO), with structured replies if asked for; returns
    /// the transmission flags.
    fn transmission(server: &Server, structured: bool) -> (Self, u16) {
        let mut conn = Self::start(server, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
        let flags = conn.negotiate(structured);
        (conn, flags)
    }
}

impl<S: Read + Write> Conn<S> {
    fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).expect("send");
        self.s.flush().expect("flush");
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut buf = vec![0u8; n];
        self.s.read_exact(&mut buf).expect("the server's bytes");
        buf
    }

    fn option(&mut self, option: u32, data: &[u8]) {
        let mut msg = Vec::new();
        put_option(&mut msg, option, data);
        self.send(&msg);
    }

    fn opt_reply(&mut self) -> OptReply {
        let header = self.bytes(20);
        assert_eq!(be_u64(&header), OPTION_REPLY_MAGIC, "option reply magic");
        let len = be_u32(&header[16..]) as usize;
        assert!(len < 1 << 20, "option reply of {len} bytes");
        OptReply { option: be_u32(&header[8..]), kind: be_u32(&header[12..]), payload: self.bytes(len) }
    }

    /// Every reply to `option`, up to and including its final one (ACK or an error); each must
    /// name `option`.
    fn ask(&mut self, option: u32, data: &[u8]) -> Vec<OptReply> {
        self.option(option, data);
        let mut replies = Vec::new();
        loop {
            let reply = self.opt_reply();
            assert_eq!(reply.option, option, "a reply must name the option it answers: {reply:?}");
            let last = reply.kind == REP_ACK || reply.kind & (1 << 31) != 0;
            replies.push(reply);
            if last {
                return replies;
            }
        }
    }

    /// The final reply's type.
    fn ask_final(&mut self, option: u32, data: &[u8]) -> u32 {
        self.ask(option, data).last().expect("a final reply").kind
    }

    /// Structured replies if asked for, then GO on `NAME`; the transmission flags.
    fn negotiate(&mut self, structured: bool) -> u16 {
        if structured {
            assert_eq!(self.ask_final(OPT_STRUCTURED_REPLY, &[]), REP_ACK);
        }
        let replies = self.ask(OPT_GO, &info_request(NAME, &[INFO_BLOCK_SIZE]));
        assert_eq!(replies.last().map(|r| r.kind), Some(REP_ACK), "GO: {replies:?}");
        let export = info_export(&replies).expect("GO's NBD_INFO_EXPORT");
        be_u16(&export[10..])
    }

    fn request(&mut self, kind: u16, flags: u16, cookie: u64, offset: u64, length: u32, payload: &[u8]) {
        self.send(&request(kind, flags, cookie, offset, length, payload));
    }

    fn reply(&mut self) -> Reply {
        let magic = be_u32(&self.bytes(4));
        match magic {
            SIMPLE_REPLY_MAGIC => {
                let rest = self.bytes(12);
                Reply::Simple { error: be_u32(&rest), cookie: be_u64(&rest[4..]) }
            }
            STRUCTURED_REPLY_MAGIC => {
                let rest = self.bytes(16);
                let len = be_u32(&rest[12..]) as usize;
                Reply::Chunk(Chunk {
                    flags: be_u16(&rest),
                    kind: be_u16(&rest[2..]),
                    cookie: be_u64(&rest[4..]),
                    payload: self.bytes(len),
                })
            }
            other => panic!("reply magic {other:#x}"),
        }
    }

    fn simple(&mut self, cookie: u64) -> u32 {
        match self.reply() {
            Reply::Simple { error, cookie: c } => {
                assert_eq!(c, cookie, "cookie");
                error
            }
            other => panic!("a simple reply was due, got {other:?}"),
        }
    }

    fn chunk(&mut self, cookie: u64) -> Chunk {
        match self.reply() {
            Reply::Chunk(c) => {
                assert_eq!(c.cookie, cookie, "cookie");
                assert_eq!(c.flags & !REPLY_FLAG_DONE, 0, "chunk flags other than DONE: {c:?}");
                c
            }
            other => panic!("a structured reply was due, got {other:?}"),
        }
    }

    /// The error value of a request that returns no data, in either reply style: a simple reply,
    /// or structured chunks ending with DONE (errors carried by an error chunk).
    fn status(&mut self, cookie: u64) -> u32 {
        let mut error = 0;
        loop {
            match self.reply() {
                Reply::Simple { error: e, cookie: c } => {
                    assert_eq!(c, cookie, "cookie");
                    return e;
                }
                Reply::Chunk(c) => {
                    assert_eq!(c.cookie, cookie, "cookie");
                    assert_eq!(c.flags & !REPLY_FLAG_DONE, 0, "chunk flags other than DONE: {c:?}");
                    if c.is_error() {
                        error = c.error().0;
                        assert_ne!(error, 0, "an error chunk's error must be nonzero");
                    } else {
                        assert_eq!(c.kind, REPLY_TYPE_NONE, "a data chunk for a request without data: {c:?}");
                        assert!(c.payload.is_empty(), "NBD_REPLY_TYPE_NONE has no payload");
                    }
                    if c.flags & REPLY_FLAG_DONE != 0 {
                        return error;
                    }
                }
            }
        }
    }

    /// Sends a request without data and returns its error value.
    fn command(&mut self, kind: u16, flags: u16, offset: u64, length: u32) -> u32 {
        self.request(kind, flags, 0x5eed, offset, length, &[]);
        self.status(0x5eed)
    }

    fn write(&mut self, flags: u16, offset: u64, data: &[u8]) -> u32 {
        self.request(CMD_WRITE, flags, 0x3717e, offset, data.len() as u32, data);
        self.status(0x3717e)
    }

    /// A read in either reply style: the data, or the error value.
    fn read(&mut self, offset: u64, length: u32, structured: bool) -> Result<Vec<u8>, u32> {
        self.request(CMD_READ, 0, 0x4ead, offset, length, &[]);
        if !structured {
            return match self.simple(0x4ead) {
                0 => Ok(self.bytes(length as usize)),
                e => Err(e),
            };
        }
        let (data, error) = self.structured_read(0x4ead, offset, length);
        error.map_or(Ok(data), Err)
    }

    /// A structured read's chunks, checked as the spec wants them: data within the request,
    /// no overlap, DONE on the last chunk only, enough data when there is no error. Returns the
    /// data (zeroes where no chunk said anything) and the error, if any.
    fn structured_read(&mut self, cookie: u64, offset: u64, length: u32) -> (Vec<u8>, Option<u32>) {
        let mut data = vec![0u8; length as usize];
        let mut covered: Vec<(u64, u64)> = Vec::new();
        let mut error = None;
        loop {
            let c = self.chunk(cookie);
            match c.kind {
                REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE => {
                    let (at, len) = if c.kind == REPLY_TYPE_OFFSET_DATA {
                        assert!(c.payload.len() >= 9, "OFFSET_DATA of {} bytes", c.payload.len());
                        (be_u64(&c.payload), c.payload.len() as u64 - 8)
                    } else {
                        assert_eq!(c.payload.len(), 12, "OFFSET_HOLE length");
                        let len = u64::from(be_u32(&c.payload[8..]));
                        assert_ne!(len, 0, "a hole of no bytes");
                        (be_u64(&c.payload), len)
                    };
                    assert!(at >= offset && at + len <= offset + u64::from(length), "chunk outside the request");
                    assert!(covered.iter().all(|&(a, l)| at + len <= a || a + l <= at), "overlapping chunks");
                    covered.push((at, len));
                    if c.kind == REPLY_TYPE_OFFSET_DATA {
                        let from = (at - offset) as usize;
                        data[from..from + len as usize].copy_from_slice(&c.payload[8..]);
                    }
                }
                REPLY_TYPE_NONE => assert!(c.payload.is_empty(), "NBD_REPLY_TYPE_NONE has no payload"),
                _ if c.is_error() => {
                    let (errno, _) = c.error();
                    assert_ne!(errno, 0, "an error chunk's error must be nonzero");
                    error = Some(errno);
                }
                other => panic!("chunk type {other} in a read's reply"),
            }
            if c.flags & REPLY_FLAG_DONE != 0 {
                if c.kind == REPLY_TYPE_NONE {
                    assert!(c.payload.is_empty());
                }
                break;
            }
        }
        if error.is_none() {
            let total: u64 = covered.iter().map(|&(_, l)| l).sum();
            assert_eq!(total, u64::from(length), "a successful read's chunks must cover the request");
        }
        (data, error)
    }

    /// Whether the server closed the connection (rather than sending anything or going quiet).
    fn closed(&mut self) -> bool {
        let mut buf = [0u8; 1];
        matches!(self.s.read(&mut buf), Ok(0))
    }
}

fn request(kind: u16, flags: u16, cookie: u64, offset: u64, length: u32, payload: &[u8]) -> Vec<u8> {
    let mut msg = Vec::new();
    put_u32(&mut msg, REQUEST_MAGIC);
    put_u16(&mut msg, flags);
    put_u16(&mut msg, kind);
    put_u64(&mut msg, cookie);
    put_u64(&mut msg, offset);
    put_u32(&mut msg, length);
    msg.extend_from_slice(payload);
    msg
}

/// The payload of the NBD_INFO_EXPORT among `replies`, checked for its length.
fn info_export(replies: &[OptReply]) -> Option<Vec<u8>> {
    let infos = infos(replies, INFO_EXPORT);
    assert!(infos.len() <= 1, "NBD_INFO_EXPORT sent {} times", infos.len());
    let info = infos.into_iter().next()?;
    assert_eq!(info.len(), 12, "NBD_INFO_EXPORT's length must be 12");
    Some(info)
}

fn infos(replies: &[OptReply], kind: u16) -> Vec<Vec<u8>> {
    replies
        .iter()
        .filter(|r| r.kind == REP_INFO)
        .inspect(|r| assert!(r.payload.len() >= 2, "NBD_REP_INFO without a type"))
        .filter(|r| be_u16(&r.payload) == kind)
        .map(|r| r.payload.clone())
        .collect()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

// ---------------------------------------------------------------------------------------------
// Handshake.

/// Handshake flags: a fixed-newstyle server MUST set NBD_FLAG_FIXED_NEWSTYLE, and MUST NOT set
/// any flag but it and NBD_FLAG_NO_ZEROES.
#[test]
fn the_greeting_is_fixed_newstyle_with_no_undefined_flags() {
    let server = serve(&Disk::new(Capabilities::ALL));
    let s = socketpair(&server).expect("socketpair");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut conn = Conn { s };
    let greeting = conn.bytes(18);
    assert_eq!(be_u64(&greeting), NBDMAGIC);
    assert_eq!(be_u64(&greeting[8..]), IHAVEOPT);
    let flags = be_u16(&greeting[16..]);
    assert_ne!(flags & FLAG_FIXED_NEWSTYLE, 0, "fixed newstyle not advertised");
    assert_eq!(flags & !(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES), 0, "undefined handshake flags {flags:#x}");
}

/// Baseline: an option the server does not implement MUST get NBD_REP_ERR_UNSUP (naming the
/// option), and the next option MUST still be parsed; that includes the extensions this server
/// leaves out (PEEK_EXPORT, extended headers). And a NOTLS server MUST NOT answer anything with
/// NBD_REP_ERR_TLS_REQD; STARTTLS MUST get UNSUP or POLICY. The option length is what lets a
/// server skip an option it does not understand, so one carrying a MiB is skipped too (and a
/// known option with more data than it can need gets TOO_BIG).
#[test]
fn unimplemented_options_get_unsup_and_the_next_option_is_still_read() {
    let server = serve(&Disk::new(Capabilities::ALL));
    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
    let junk = pattern(1 << 20, 7);
    for (option, data) in [
        (OPT_PEEK_EXPORT, &[][..]),
        (OPT_EXTENDED_HEADERS, &[][..]),
        (0, &[][..]),
        (0x4242_4242, &junk[..3000]),
        (u32::MAX, &junk[..100]),
        (0x4343_4343, &junk[..]),
    ] {
        let replies = conn.ask(option, data);
        assert_eq!(replies.len(), 1, "option {option:#x}: {replies:?}");
        assert_eq!(replies[0].kind, REP_ERR_UNSUP, "option {option:#x}");
    }
    assert_eq!(conn.ask_final(OPT_INFO, &junk[..20_000]), REP_ERR_TOO_BIG, "INFO with 20,000 bytes of data");
    let starttls = conn.ask_final(OPT_STARTTLS, &[]);
    assert!(starttls == REP_ERR_UNSUP || starttls == REP_ERR_POLICY, "STARTTLS without TLS: {starttls:#x}");
    // Still in step: LIST, INFO on a missing export, then GO, all answered and none TLS_REQD.
    let mut seen = Vec::new();
    seen.extend(conn.ask(OPT_LIST, &[]));
    seen.extend(conn.ask(OPT_INFO, &info_request("missing", &[])));
    seen.extend(conn.ask(OPT_GO, &info_request(NAME, &[])));
    assert!(seen.iter().all(|r| r.kind != REP_ERR_TLS_REQD), "TLS_REQD from a NOTLS server: {seen:?}");
    assert_eq!(seen.last().map(|r| r.kind), Some(REP_ACK), "GO after the unknown options");
    assert_eq!(conn.command(CMD_FLUSH, 0, 0, 0), 0, "in transmission");
}

/// NBD_OPT_EXPORT_NAME cannot answer with an error: for an export that does not exist the server
/// MUST terminate the session (and sends nothing that could pass for the export's details).
#[test]
fn export_name_for_a_missing_export_ends_the_session() {
    let server = serve(&Disk::new(Capabilities::ALL));
    for options_first in [false, true] {
        let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
        if options_first {
            assert_eq!(conn.ask_final(OPT_STRUCTURED_REPLY, &[]), REP_ACK);
        }
        conn.option(OPT_EXPORT_NAME, b"missing");
        assert!(conn.closed(), "the session goes on after EXPORT_NAME of a missing export");
    }
}

/// NBD_OPT_ABORT: the server MUST reply with NBD_REP_ACK; it SHOULD ignore any data sent along.
/// Then the session ends.
#[test]
fn abort_is_acknowledged_even_with_data_and_the_session_ends() {
    let server = serve(&Disk::new(Capabilities::ALL));
    for data in [&[][..], b"stray bytes"] {
        let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
        let replies = conn.ask(OPT_ABORT, data);
        assert_eq!(replies, vec![OptReply { option: OPT_ABORT, kind: REP_ACK, payload: vec![] }]);
        assert!(conn.closed(), "the connection outlives ABORT");
    }
}

/// NBD_OPT_STRUCTURED_REPLY takes no data; the server SHOULD refuse one that has some with
/// NBD_REP_ERR_INVALID, and then structured replies are not negotiated: a read gets a simple
/// reply (a server MUST use only simple replies unless they were negotiated).
#[test]
fn structured_reply_with_data_is_invalid_and_leaves_simple_replies() {
    let server = serve(&Disk::new(Capabilities::ALL));
    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    assert_eq!(conn.ask_final(OPT_STRUCTURED_REPLY, b"x"), REP_ERR_INVALID);
    conn.negotiate(false);
    conn.request(CMD_READ, 0, 9, 0, 512, &[]);
    assert_eq!(conn.simple(9), 0);
    assert_eq!(conn.bytes(512), vec![0u8; 512]);
}

/// NBD_OPT_INFO and NBD_OPT_GO: success MUST include NBD_INFO_EXPORT (length 12) before the ACK;
/// information requests the server does not know MUST be ignored; an information type SHOULD
/// appear once; an INFO followed by a GO with the same parameters MUST get the same information.
#[test]
fn info_and_go_describe_the_export_alike_and_ignore_unknown_requests() {
    let disk = Disk::new(Capabilities::ALL);
    let server = serve(&disk);
    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    let asked = [0x7777, INFO_EXPORT, INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE, 0xffff];
    let info = conn.ask(OPT_INFO, &info_request(NAME, &asked));
    let go = conn.ask(OPT_GO, &info_request(NAME, &asked));
    for replies in [&info, &go] {
        assert_eq!(replies.last().map(|r| r.kind), Some(REP_ACK), "{replies:?}");
        assert!(replies[..replies.len() - 1].iter().all(|r| r.kind == REP_INFO), "{replies:?}");
        let export = info_export(replies).expect("NBD_INFO_EXPORT before the ACK");
        assert_eq!(be_u64(&export[2..]), SIZE as u64);
        assert_ne!(be_u16(&export[10..]) & TFLAG_HAS_FLAGS, 0);
        let kinds: Vec<u16> = replies.iter().filter(|r| r.kind == REP_INFO).map(|r| be_u16(&r.payload)).collect();
        let distinct: BTreeSet<u16> = kinds.iter().copied().collect();
        assert_eq!(distinct.len(), kinds.len(), "an information type sent twice: {kinds:?}");
        let name = infos(replies, INFO_NAME);
        assert!(name.iter().all(|n| &n[2..] == NAME.as_bytes()), "NBD_INFO_NAME");
    }
    let sorted = |replies: &[OptReply]| {
        let mut payloads: Vec<Vec<u8>> = replies.iter().map(|r| r.payload.clone()).collect();
        payloads.sort();
        payloads
    };
    assert_eq!(sorted(&info), sorted(&go), "INFO then GO with the same parameters must agree");
    // GO ended the handshake: the next bytes answer a request.
    assert_eq!(conn.command(CMD_FLUSH, 0, 0, 0), 0);
}

/// After the ACK to NBD_OPT_GO the server MUST NOT send zero padding, whether or not the client
/// set NBD_FLAG_C_NO_ZEROES: the first bytes after it are the reply to the first request.
#[test]
fn go_is_followed_by_no_padding_whatever_the_client_flags() {
    let server = serve(&Disk::new(Capabilities::ALL));
    for client_flags in [CLIENT_FIXED_NEWSTYLE, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES] {
        let mut conn = Conn::start(&server, client_flags);
        conn.negotiate(false);
        conn.request(CMD_READ, 0, 77, 0, 16, &[]);
        let first = conn.bytes(16);
        assert_eq!(be_u32(&first), SIMPLE_REPLY_MAGIC, "bytes after GO's ACK with client flags {client_flags:#x}");
        assert_eq!(be_u64(&first[8..]), 77);
    }
}

/// NBD_INFO_BLOCK_SIZE (length 14): the minimum MUST be a power of 2 no larger than 64 KiB, the
/// preferred MUST be a power of 2 at least max(minimum, 512), the maximum MUST be at least the
/// preferred; the export size SHOULD be a multiple of the minimum; by default the maximum
/// SHOULD be at least 2^25 and at least 1 MiB for an export that large. A client that asks for
/// no sizes is still let in (SHOULD NOT refuse it; the server keeps to the defaults).
#[test]
fn advertised_block_sizes_keep_to_the_spec() {
    let disk = Disk::new(Capabilities::ALL);
    for (limits, default) in [(Limits::default(), true), (limits(64 << 10), false)] {
        let max_payload = limits.max_payload_bytes;
        let server = serve_with(&disk, limits, Security::default());
        let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
        let replies = conn.ask(OPT_INFO, &info_request(NAME, &[INFO_BLOCK_SIZE]));
        let sizes = infos(&replies, INFO_BLOCK_SIZE);
        assert_eq!(sizes.len(), 1, "{replies:?}");
        let sizes = &sizes[0];
        assert_eq!(sizes.len(), 14, "NBD_INFO_BLOCK_SIZE's length must be 14");
        let (min, preferred, max) = (be_u32(&sizes[2..]), be_u32(&sizes[6..]), be_u32(&sizes[10..]));
        assert!(min.is_power_of_two() && min <= 1 << 16, "minimum {min}");
        assert!(preferred.is_power_of_two() && preferred >= min.max(512), "preferred {preferred}");
        assert!(max >= preferred, "maximum {max} below preferred {preferred}");
        assert!(max <= max_payload, "maximum {max} above what the connection accepts ({max_payload})");
        assert_eq!(SIZE as u64 % u64::from(min), 0, "export size not a multiple of the minimum");
        if default {
            assert_eq!((min, preferred), (1, 4096), "the default sizes");
            assert!(max >= 1 << 25, "default maximum {max}");
        }
        let go = conn.ask(OPT_GO, &info_request(NAME, &[]));
        assert_eq!(go.last().map(|r| r.kind), Some(REP_ACK), "GO without size requests: {go:?}");
        // The minimum is 1: an unaligned request is served.
        conn.request(CMD_WRITE, 0, 1, 3, 5, b"12345");
        assert_eq!(conn.simple(1), 0);
    }
}

// ---------------------------------------------------------------------------------------------
// TLS.

const PSK_IDENTITY: &str = "alice";
const PSK_KEY: [u8; 16] = *b"0123456789abcdef";

fn psk_security(dir: &Path, mode: TlsMode, access: Option<Arc<dyn ExportAccess>>) -> Security {
    let keys = dir.join("keys.psk");
    let hex: String = PSK_KEY.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&keys, format!("{PSK_IDENTITY}:{hex}\n")).expect("keys");
    let tls = ServerTls::psk(mode, &keys).expect("PSK credentials");
    Security { tls: Some(Arc::new(tls)), access }
}

/// x509 credentials (rustls): a self-signed certificate; clients need none.
fn x509_security(dir: &Path, mode: TlsMode) -> Security {
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("certificate");
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, certified.cert.pem()).expect("cert");
    std::fs::write(&key, certified.key_pair.serialize_pem()).expect("key");
    let tls = ServerTls::x509(mode, &cert, &key, None).expect("x509 credentials");
    Security { tls: Some(Arc::new(tls)), access: None }
}

/// STARTTLS (which must have been acknowledged), then the TLS handshake: as `alice` with her
/// pre-shared key if `psk`, else with no credentials (against a certificate, not verified).
fn upgrade_with(conn: Conn<UnixStream>, psk: bool, max_version: Option<SslVersion>) -> Conn<SslStream<UnixStream>> {
    let mut builder = SslContext::builder(SslMethod::tls_client()).expect("context");
    if let Some(version) = max_version {
        builder.set_max_proto_version(Some(version)).expect("version");
        if psk {
            builder.set_cipher_list("ECDHE-PSK:PSK").expect("PSK suites");
        }
    }
    if psk {
        builder.set_psk_client_callback(|_, _, identity, key| {
            identity[..PSK_IDENTITY.len()].copy_from_slice(PSK_IDENTITY.as_bytes());
            identity[PSK_IDENTITY.len()] = 0;
            key[..PSK_KEY.len()].copy_from_slice(&PSK_KEY);
            Ok(PSK_KEY.len())
        });
    }
    let ssl = Ssl::new(&builder.build()).expect("ssl");
    let s = ssl.connect(conn.s).unwrap_or_else(|e| panic!("TLS handshake: {e}"));
    Conn { s }
}

/// A TLS-only server's security, with pre-shared keys (OpenSSL) or certificates (rustls).
fn required_tls(dir: &Path, psk: bool) -> Security {
    if psk {
        psk_security(dir, TlsMode::Require, None)
    } else {
        x509_security(dir, TlsMode::Require)
    }
}

fn upgrade(conn: Conn<UnixStream>, max_version: Option<SslVersion>) -> Conn<SslStream<UnixStream>> {
    upgrade_with(conn, true, max_version)
}

struct OnlyAlice;

impl ExportAccess for OnlyAlice {
    fn allows(&self, identity: Option<&str>, _: &str) -> bool {
        identity == Some(PSK_IDENTITY)
    }
}

/// FORCEDTLS: before TLS every option but STARTTLS and ABORT, INFO and unknown options included,
/// MUST get NBD_REP_ERR_TLS_REQD; EXPORT_NAME MUST end the session; STARTTLS MUST get ACK.
/// After TLS the server MUST NOT send TLS_REQD, and a second STARTTLS MUST get
/// NBD_REP_ERR_INVALID.
#[test]
fn forced_tls_refuses_everything_but_starttls_until_tls_is_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let security = psk_security(dir.path(), TlsMode::Require, None);
    let server = serve_with(&Disk::new(Capabilities::ALL), limits(1 << 20), security);

    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
    for (option, data) in [
        (OPT_INFO, info_request(NAME, &[])),
        (OPT_GO, info_request(NAME, &[])),
        (OPT_LIST, vec![]),
        (OPT_STRUCTURED_REPLY, vec![]),
        (OPT_SET_META_CONTEXT, vec![0; 8]),
        (0x4242, b"unknown".to_vec()),
    ] {
        let replies = conn.ask(option, &data);
        assert_eq!(replies.len(), 1, "option {option:#x}: {replies:?}");
        assert_eq!(replies[0].kind, REP_ERR_TLS_REQD, "option {option:#x} before TLS");
    }
    assert_eq!(conn.ask(OPT_ABORT, &[]), vec![OptReply { option: OPT_ABORT, kind: REP_ACK, payload: vec![] }]);

    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
    conn.option(OPT_EXPORT_NAME, NAME.as_bytes());
    assert!(conn.closed(), "EXPORT_NAME before TLS must end the session");

    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
    assert_eq!(conn.ask(OPT_STARTTLS, &[]), vec![OptReply { option: OPT_STARTTLS, kind: REP_ACK, payload: vec![] }]);
    let mut conn = upgrade(conn, None);
    let mut seen = Vec::new();
    seen.extend(conn.ask(0x4242, b"unknown"));
    assert_eq!(seen.last().map(|r| r.kind), Some(REP_ERR_UNSUP));
    assert_eq!(conn.ask_final(OPT_STARTTLS, &[]), REP_ERR_INVALID, "STARTTLS over TLS");
    seen.extend(conn.ask(OPT_LIST, &[]));
    seen.extend(conn.ask(OPT_INFO, &info_request("missing", &[])));
    seen.extend(conn.ask(OPT_INFO, &info_request(NAME, &[])));
    assert!(seen.iter().all(|r| r.kind != REP_ERR_TLS_REQD), "TLS_REQD after TLS: {seen:?}");
    conn.negotiate(true);
    assert_eq!(conn.read(0, 4096, true), Ok(vec![0; 4096]));
}

/// SELECTIVETLS: an export only TLS can open (here: the allow-list grants it to the identity
/// `alice` only) MUST get NBD_REP_ERR_TLS_REQD from INFO and GO before TLS, and EXPORT_NAME on
/// it MUST end the session. The server MUST NOT send TLS_REQD to any other option, nor after
/// TLS.
#[test]
fn selective_tls_asks_for_tls_for_exports_only_tls_opens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let security = psk_security(dir.path(), TlsMode::On, Some(Arc::new(OnlyAlice)));
    let server = serve_with(&Disk::new(Capabilities::ALL), limits(1 << 20), security);

    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
    assert_eq!(conn.ask_final(OPT_INFO, &info_request(NAME, &[])), REP_ERR_TLS_REQD, "INFO before TLS");
    assert_eq!(conn.ask_final(OPT_GO, &info_request(NAME, &[])), REP_ERR_TLS_REQD, "GO before TLS");
    let others = [conn.ask(OPT_LIST, &[]), conn.ask(OPT_STRUCTURED_REPLY, &[]), conn.ask(0x4242, &[])].concat();
    assert!(others.iter().all(|r| r.kind != REP_ERR_TLS_REQD), "TLS_REQD for other options: {others:?}");

    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
    conn.option(OPT_EXPORT_NAME, NAME.as_bytes());
    assert!(conn.closed(), "EXPORT_NAME of a TLS-only export before TLS must end the session");

    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
    assert_eq!(conn.ask_final(OPT_STARTTLS, &[]), REP_ACK);
    let mut conn = upgrade(conn, None);
    let missing = conn.ask(OPT_INFO, &info_request("missing", &[]));
    assert_eq!(missing.last().map(|r| r.kind), Some(REP_ERR_UNKNOWN), "after TLS: {missing:?}");
    conn.negotiate(false);
    assert_eq!(conn.read(0, 512, false), Ok(vec![0; 512]));
}

/// Implementations supporting TLS MUST support TLS 1.2: a client that speaks nothing newer gets
/// in, with either kind of credentials.
#[test]
fn tls_1_2_is_supported() {
    for psk in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let security = required_tls(dir.path(), psk);
        let server = serve_with(&Disk::new(Capabilities::ALL), limits(1 << 20), security);
        let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
        assert_eq!(conn.ask_final(OPT_STARTTLS, &[]), REP_ACK);
        let mut conn = upgrade_with(conn, psk, Some(SslVersion::TLS1_2));
        assert_eq!(conn.s.ssl().version_str(), "TLSv1.2", "psk {psk}");
        conn.negotiate(true);
        assert_eq!(conn.write(0, 0, &[5; 512]), 0);
        assert_eq!(conn.read(0, 512, true), Ok(vec![5; 512]));
    }
}

/// NBD_CMD_DISC over TLS: the server MUST shut the TLS session down (close_notify) and then
/// close the connection; a TLS client sees a clean end, not a truncated stream. With either
/// kind of credentials (OpenSSL for pre-shared keys, rustls for certificates).
#[test]
fn disc_over_tls_ends_the_tls_session_before_the_connection() {
    for psk in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = Disk::new(Capabilities::ALL);
        let security = required_tls(dir.path(), psk);
        let server = serve_with(&disk, limits(1 << 20), security);
        let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
        assert_eq!(conn.ask_final(OPT_STARTTLS, &[]), REP_ACK);
        let mut conn = upgrade_with(conn, psk, None);
        conn.negotiate(false);
        conn.request(CMD_WRITE, 0, 1, 0, 4, b"abcd");
        conn.request(CMD_DISC, 0, 2, 0, 0, &[]);
        assert_eq!(conn.simple(1), 0, "the write before DISC is answered");
        let mut buf = [0u8; 16];
        let end = conn.s.read(&mut buf);
        let shutdown = conn.s.get_shutdown();
        assert!(
            matches!(end, Ok(0)) && shutdown.contains(ShutdownState::RECEIVED),
            "psk {psk}: after DISC: {end:?}, close_notify received: {}",
            shutdown.contains(ShutdownState::RECEIVED)
        );
        assert!(disk.calls().contains(&Call::Disconnect));
    }
}

/// A client that asks for TLS and then never starts it is cut at the handshake's deadline and
/// counted as such (the TLS handshake is part of the handshake), not as a failed TLS handshake;
/// with either kind of credentials.
#[test]
fn a_tls_handshake_never_begun_is_counted_at_the_handshake_deadline() {
    for psk in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let limits = Limits { handshake_timeout: Duration::from_millis(500), ..limits(1 << 20) };
        let server = serve_with(&Disk::new(Capabilities::ALL), limits, required_tls(dir.path(), psk));
        let counters = server.counters();
        let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
        assert_eq!(conn.ask_final(OPT_STARTTLS, &[]), REP_ACK);
        assert!(server.wait_idle(Duration::from_secs(10)), "psk {psk}: the handshake outlived its deadline");
        let refusals = counters.refusals();
        assert!(refusals.contains(&(Refusal::HandshakeTimeout, 1)), "psk {psk}: {refusals:?}");
        assert!(refusals.contains(&(Refusal::Tls, 0)), "psk {psk}: {refusals:?}");
        drop(conn);
    }
}

/// Over TLS, a client that takes its replies a little at a time, each piece within the socket's
/// write timeout, is still cut once the replies of one flush have taken longer than the request
/// timeout: the deadline holds inside the TLS layer's writes (one TLS write of a few MiB is many
/// socket writes, and the clock was read only between TLS writes: a client trickling could hold
/// the thread for hours).
#[test]
fn a_tls_client_taking_its_replies_a_trickle_at_a_time_is_cut_at_the_request_timeout() {
    for psk in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let limits = Limits { request_timeout: Duration::from_secs(2), ..limits(1 << 20) };
        let server = serve_with(&Disk::new(Capabilities::ALL), limits, required_tls(dir.path(), psk));
        let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
        assert_eq!(conn.ask_final(OPT_STARTTLS, &[]), REP_ACK);
        let mut conn = upgrade_with(conn, psk, None);
        conn.negotiate(false);
        // 16 MiB of replies asked for at once.
        for cookie in 0..16 {
            conn.request(CMD_READ, 0, cookie, 0, 1 << 20, &[]);
        }
        let started = std::time::Instant::now();
        let mut piece = vec![0u8; 64 << 10];
        let ended = loop {
            std::thread::sleep(Duration::from_millis(1500));
            let mut taken = 0;
            let mut end = false;
            while taken < piece.len() {
                match conn.s.read(&mut piece[taken..]) {
                    Ok(0) | Err(_) => {
                        end = true;
                        break;
                    }
                    Ok(n) => taken += n,
                }
            }
            if end || started.elapsed() > Duration::from_secs(40) {
                break end;
            }
        };
        assert!(ended, "psk {psk}: still served after {:?}", started.elapsed());
        assert!(server.wait_idle(Duration::from_secs(10)), "psk {psk}");
    }
}

/// DISC over TLS after a spell longer than the request timeout since the last reply: the
/// session is still shut down with close_notify (the last flush's deadline, kept past it, once
/// failed the goodbye at once).
#[test]
fn disc_over_tls_after_a_quiet_spell_still_ends_the_tls_session() {
    for psk in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let limits = Limits { request_timeout: Duration::from_millis(800), ..limits(1 << 20) };
        let server = serve_with(&Disk::new(Capabilities::ALL), limits, required_tls(dir.path(), psk));
        let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
        assert_eq!(conn.ask_final(OPT_STARTTLS, &[]), REP_ACK);
        let mut conn = upgrade_with(conn, psk, None);
        conn.negotiate(false);
        conn.request(CMD_WRITE, 0, 1, 0, 4, b"abcd");
        assert_eq!(conn.simple(1), 0);
        std::thread::sleep(Duration::from_millis(1500));
        conn.request(CMD_DISC, 0, 2, 0, 0, &[]);
        let mut buf = [0u8; 16];
        let end = conn.s.read(&mut buf);
        let received = conn.s.get_shutdown().contains(ShutdownState::RECEIVED);
        assert!(matches!(end, Ok(0)) && received, "psk {psk}: {end:?}, close_notify received: {received}");
    }
}

type TlsConn = Conn<SslStream<UnixStream>>;
/// A way to end a TLS session, named.
type TlsEnding = (&'static str, fn(&mut TlsConn));

/// Every other end of a TLS session shuts TLS down first too (a hard disconnect SHOULD): ABORT
/// over TLS, a framing error during negotiation, a bad request in transmission, a read that
/// fails after its simple reply began (the server's own reason to close), and a handshake
/// deadline that passes after TLS is up; with either kind of credentials.
#[test]
fn every_end_of_a_tls_session_sends_close_notify() {
    for psk in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let security = required_tls(dir.path(), psk);
        let limits = Limits { handshake_timeout: Duration::from_millis(1500), ..limits(4 << 20) };
        let mut disk = Disk::new(Capabilities::ALL);
        disk.bad_from = 3 << 19;
        let server = serve_with(&disk, limits, security);
        let over_tls = || {
            let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
            assert_eq!(conn.ask_final(OPT_STARTTLS, &[]), REP_ACK);
            upgrade_with(conn, psk, None)
        };
        let ends: [TlsEnding; 5] = [
            ("ABORT", |conn| assert_eq!(conn.ask_final(OPT_ABORT, &[]), REP_ACK)),
            ("a bad option magic", |conn| conn.send(&[0x55; 16])),
            ("a bad request magic", |conn| {
                conn.negotiate(false);
                conn.send(&[0x55; 28]);
            }),
            ("a read failing after its simple reply began", |conn| {
                conn.negotiate(false);
                conn.request(CMD_READ, 0, 9, 0, 2 << 20, &[]);
            }),
            ("the handshake deadline", |_| {}),
        ];
        for (what, end_it) in ends {
            let mut conn = over_tls();
            end_it(&mut conn);
            // What the server sent before it closed (a reply's first slice), then the end.
            let mut buf = vec![0u8; 64 << 10];
            let end = loop {
                match conn.s.read(&mut buf) {
                    Ok(n) if n > 0 => continue,
                    other => break other,
                }
            };
            let received = conn.s.get_shutdown().contains(ShutdownState::RECEIVED);
            assert!(matches!(end, Ok(0)) && received, "psk {psk}, {what}: {end:?}, close_notify received: {received}");
        }
    }
}

/// A server that stops closes an idle TLS session as it closes any other: close_notify first,
/// then the connection, with either kind of credentials (rustls reports the shut socket under
/// it as a truncated session, which is still the server's own stop).
#[test]
fn a_stopping_server_ends_idle_tls_sessions_with_close_notify() {
    for psk in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = serve_with(&Disk::new(Capabilities::ALL), limits(1 << 20), required_tls(dir.path(), psk));
        let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
        assert_eq!(conn.ask_final(OPT_STARTTLS, &[]), REP_ACK);
        let mut conn = upgrade_with(conn, psk, None);
        conn.negotiate(false);
        conn.request(CMD_WRITE, 0, 1, 0, 4, b"abcd");
        assert_eq!(conn.simple(1), 0, "the write is answered");
        server.shutdown_handle().shutdown();
        let mut buf = [0u8; 16];
        let end = conn.s.read(&mut buf);
        let received = conn.s.get_shutdown().contains(ShutdownState::RECEIVED);
        assert!(matches!(end, Ok(0)) && received, "psk {psk}: {end:?}, close_notify received: {received}");
        assert!(server.wait_idle(Duration::from_secs(10)), "psk {psk}: the connection ended");
    }
}

// ---------------------------------------------------------------------------------------------
// Transmission flags.

/// Transmission flags: NBD_FLAG_HAS_FLAGS MUST always be set; a flag for a feature the server does
/// not support MUST NOT be; SEND_DF MUST be clear without structured replies (and this server,
/// which does not implement DF, never sets it); SEND_FAST_ZERO MUST be clear when
/// SEND_WRITE_ZEROES is. Both ways into transmission (GO, EXPORT_NAME) advertise the same.
/// Commands a clear flag stands for get an error, and the connection goes on.
#[test]
fn transmission_flags_claim_only_what_the_device_can_do() {
    let nothing = Capabilities::default();
    let cases = [
        (
            Capabilities::ALL,
            TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO,
        ),
        (nothing, 0),
        (Capabilities { read_only: true, can_flush: true, ..nothing }, TFLAG_READ_ONLY | TFLAG_SEND_FLUSH),
        (Capabilities { can_zero: false, can_fast_zero: true, can_trim: true, ..nothing }, TFLAG_SEND_TRIM),
        (
            Capabilities { can_zero: true, can_fast_zero: false, can_fua: true, ..nothing },
            TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FUA,
        ),
    ];
    let never =
        TFLAG_SEND_DF | TFLAG_ROTATIONAL | TFLAG_CAN_MULTI_CONN | TFLAG_SEND_RESIZE | TFLAG_BLOCK_STATUS_PAYLOAD;
    for (caps, expected) in cases {
        let server = serve(&Disk::new(caps));
        for structured in [false, true] {
            let (mut conn, flags) = Conn::transmission(&server, structured);
            // CACHE is always understood (a device that cannot prefetch does nothing).
            assert_eq!(flags, TFLAG_HAS_FLAGS | TFLAG_SEND_CACHE | expected, "{caps:?}, structured {structured}");
            assert_eq!(flags & never, 0);
            // What is not advertised is refused, without losing the connection.
            if !caps.can_flush {
                assert_eq!(conn.command(CMD_FLUSH, 0, 0, 0), EINVAL, "FLUSH not advertised");
            }
            if !caps.can_trim && !caps.read_only {
                assert_eq!(conn.command(CMD_TRIM, 0, 0, 512), EINVAL, "TRIM not advertised");
            }
            if !caps.can_zero && !caps.read_only {
                assert_eq!(conn.command(CMD_WRITE_ZEROES, 0, 0, 512), EINVAL, "WRITE_ZEROES not advertised");
            }
            if !caps.can_fua {
                assert_eq!(conn.command(CMD_READ, CMD_FLAG_FUA, 0, 0), EINVAL, "FUA not advertised");
            }
            assert_eq!(conn.read(0, 512, structured), Ok(vec![0; 512]));
        }
        let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
        conn.option(OPT_EXPORT_NAME, NAME.as_bytes());
        let answer = conn.bytes(10);
        assert_eq!(be_u64(&answer), SIZE as u64);
        assert_eq!(
            be_u16(&answer[8..]),
            TFLAG_HAS_FLAGS | TFLAG_SEND_CACHE | expected,
            "EXPORT_NAME's flags, {caps:?}"
        );
    }
}

/// NBD_FLAG_READ_ONLY: the server MUST error every write; it SHOULD be EPERM. Nothing reaches the
/// disk, and a refused write's payload is skipped so the next request is read right.
#[test]
fn a_read_only_export_errors_every_write() {
    let disk = Disk::new(Capabilities { read_only: true, ..Capabilities::ALL });
    disk.memory.clone().write(0, &[9; 4096], false).expect("seed");
    let server = serve(&disk);
    for structured in [false, true] {
        let (mut conn, flags) = Conn::transmission(&server, structured);
        assert_ne!(flags & TFLAG_READ_ONLY, 0);
        assert_eq!(conn.write(0, 0, &[1; 4096]), EPERM, "WRITE");
        assert_eq!(conn.write(CMD_FLAG_FUA, 0, &pattern(300 << 10, 1)), EPERM, "a large WRITE");
        assert_eq!(conn.command(CMD_TRIM, 0, 0, 4096), EPERM, "TRIM");
        assert_eq!(conn.command(CMD_WRITE_ZEROES, 0, 0, 4096), EPERM, "WRITE_ZEROES");
        assert_eq!(conn.read(0, 4096, structured), Ok(vec![9; 4096]), "unchanged, and in step");
    }
    assert!(disk.calls().iter().all(|c| matches!(c, Call::Disconnect)), "writes reached the disk: {:?}", disk.calls());
}

// ---------------------------------------------------------------------------------------------
// Replies.

/// Without NBD_OPT_STRUCTURED_REPLY the server MUST use only simple replies: for data, for errors
/// (a failed read carries no payload), for commands it does not know.
#[test]
fn without_structured_replies_every_reply_is_simple() {
    let disk = Disk::new(Capabilities::ALL);
    disk.memory.clone().write(0, &pattern(4096, 3), false).expect("seed");
    let server = serve(&disk);
    let (mut conn, _) = Conn::transmission(&server, false);
    let mut burst = Vec::new();
    burst.extend(request(CMD_READ, 0, 1, SIZE as u64 - 10, 20, &[]));
    burst.extend(request(CMD_BLOCK_STATUS, 0, 2, 0, 4096, &[]));
    burst.extend(request(CMD_READ, CMD_FLAG_DF | 0x40, 3, 0, 64, &[]));
    burst.extend(request(CMD_READ, 0, 4, 0, 4096, &[]));
    conn.send(&burst);
    assert_eq!(conn.simple(1), EINVAL, "read past the end");
    assert_eq!(conn.simple(2), EINVAL, "BLOCK_STATUS");
    assert_eq!(conn.simple(3), EINVAL, "a flag not defined");
    // No payload followed the errors: the next reply is right here.
    assert_eq!(conn.simple(4), 0);
    assert_eq!(conn.bytes(4096), pattern(4096, 3));
}

/// With structured replies negotiated the server MUST NOT use a simple reply for NBD_CMD_READ,
/// not even for an early EINVAL (bad flags, past the end, above the maximum); error chunks carry
/// a nonzero error, and may carry a message. Other commands may get simple replies, without a
/// payload. A zero-length read gets a well-formed reply too.
#[test]
fn with_structured_replies_reads_never_get_simple_replies() {
    let server = serve_with(&Disk::new(Capabilities::ALL), limits(64 << 10), Security::default());
    let (mut conn, _) = Conn::transmission(&server, true);
    for (flags, offset, length, errno) in [
        (0, SIZE as u64 - 10, 20, EINVAL),
        (0, u64::MAX - 1, 4096, EINVAL),
        (0x40, 0, 512, EINVAL),
        (0, 0, (64 << 10) + 1, EINVAL),
        (0, 0, 0, 0),
    ] {
        conn.request(CMD_READ, flags, 31, offset, length, &[]);
        let c = conn.chunk(31);
        assert_ne!(c.flags & REPLY_FLAG_DONE, 0, "one chunk is the whole reply here: {c:?}");
        if errno == 0 {
            assert_eq!((c.kind, c.payload.len()), (REPLY_TYPE_NONE, 0), "zero-length read: {c:?}");
        } else {
            let (e, message) = c.error();
            assert_eq!(e, errno, "read flags {flags:#x} at {offset} for {length}");
            assert!(message.len() <= MAX_STRING);
        }
    }
    assert_eq!(conn.write(0, 0, b"data"), 0);
    assert_eq!(conn.read(0, 4, true), Ok(b"data".to_vec()));
}

/// A structured read: content chunks lie within the request, do not overlap, cover it all when
/// there is no error; DONE MUST be on the last chunk and only there; no flag but DONE; no chunk's
/// data larger than the advertised maximum payload. Here a read of three reply slices and a bit.
#[test]
fn a_structured_read_is_chunks_that_tile_the_request_and_end_with_done() {
    let disk = Disk::new(Capabilities::ALL);
    let data = pattern(SIZE, 5);
    disk.memory.clone().write(0, &data, false).expect("seed");
    let server = serve_with(&disk, limits(SIZE as u32), Security::default());
    let (mut conn, _) = Conn::transmission(&server, true);
    let mut probe = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
    let sizes = infos(&probe.ask(OPT_INFO, &info_request(NAME, &[INFO_BLOCK_SIZE])), INFO_BLOCK_SIZE);
    let max = be_u32(&sizes[0][10..]) as usize;
    for (offset, length) in [(0u64, SIZE as u32), (7, SIZE as u32 - 9), (4096, 1)] {
        conn.request(CMD_READ, 0, 0xc0ffee, offset, length, &[]);
        let mut chunks = Vec::new();
        loop {
            let c = conn.chunk(0xc0ffee);
            let done = c.flags & REPLY_FLAG_DONE != 0;
            chunks.push(c);
            if done {
                break;
            }
        }
        let mut covered = 0u64;
        let mut next = offset;
        for c in &chunks {
            assert_eq!(c.kind, REPLY_TYPE_OFFSET_DATA, "chunk type {}", c.kind);
            assert!(c.payload.len() >= 9 && c.payload.len() - 8 <= max, "chunk of {} bytes", c.payload.len());
            let at = be_u64(&c.payload);
            // This server sends its chunks in order; in any order, they would have to tile too.
            assert_eq!(at, next, "chunks must not overlap or leave gaps");
            let len = c.payload.len() - 8;
            assert_eq!(&c.payload[8..], &data[at as usize..at as usize + len]);
            next += len as u64;
            covered += len as u64;
        }
        assert_eq!(covered, u64::from(length), "the chunks cover the request");
    }
    // Check the same through the generic checker, with a zero-length read for good measure.
    assert_eq!(conn.read(100, 5000, true), Ok(data[100..5100].to_vec()));
}

/// A large structured read may send what reads as zeroes as hole chunks (NBD_REPLY_TYPE_OFFSET_HOLE,
/// 12 bytes: offset, length): data and hole chunks together tile the request, in order, DONE on
/// the last only; a hole only where the device says the range reads as zeroes, and never where
/// the device holds data. Here the disk's odd 4 KiB blocks are zero holes past its first 128 KiB.
#[test]
fn a_large_structured_read_sends_zero_runs_as_hole_chunks() {
    let disk = Disk::new(Capabilities::ALL);
    let data = pattern(128 << 10, 9);
    disk.memory.clone().write(0, &data, false).expect("seed");
    let server = serve_with(&disk, limits(SIZE as u32), Security::default());
    let (mut conn, _) = Conn::transmission(&server, true);
    let (offset, length) = (4096 * 3 + 100, 512 << 10);
    conn.request(CMD_READ, 0, 0x401e, offset, length, &[]);
    let (mut next, mut holes) = (offset, 0);
    loop {
        let c = conn.chunk(0x401e);
        let at = be_u64(&c.payload);
        assert_eq!(at, next, "chunks tile the request in order");
        let len = match c.kind {
            REPLY_TYPE_OFFSET_DATA => {
                let len = c.payload.len() as u64 - 8;
                let mut expected = vec![0u8; len as usize];
                disk.memory.read_at(at, &mut expected).expect("read");
                assert_eq!(c.payload[8..], expected[..], "data at {at}");
                len
            }
            REPLY_TYPE_OFFSET_HOLE => {
                assert_eq!(c.payload.len(), 12, "a hole chunk is offset and length");
                let len = u64::from(be_u32(&c.payload[8..]));
                assert!(at >= 128 << 10, "a hole over the disk's data at {at}");
                assert!(
                    at % 8192 == 4096 && len == 4096,
                    "a hole at {at} of {len}: only the odd blocks read as zeroes"
                );
                holes += 1;
                len
            }
            other => panic!("chunk type {other} in a read reply"),
        };
        next += len;
        if c.flags & REPLY_FLAG_DONE != 0 {
            break;
        }
    }
    assert_eq!(next, offset + u64::from(length), "the chunks cover the request");
    // The odd blocks 33 to 129; block 131, which the request ends 100 bytes into, is too short
    // a run of zeroes for a hole chunk.
    assert_eq!(holes, 49, "hole chunks");
    // Small reads stay plain data, and the generic reader puts holes back as zeroes.
    let mut expected = vec![0u8; length as usize];
    disk.memory.read_at(offset, &mut expected).expect("read");
    assert_eq!(conn.read(offset, length, true), Ok(expected));
}

/// A structured read failing part way: the content chunks already sent are followed by an error
/// chunk (error nonzero), DONE on the last chunk only; no chunk claims the bytes that failed. The
/// connection goes on. An error message never exceeds the 4096-byte string limit, however long
/// the device's.
#[test]
fn a_structured_read_failing_part_way_ends_with_an_error_chunk() {
    let mut disk = Disk::new(Capabilities::ALL);
    let data = pattern(SIZE, 6);
    disk.memory.clone().write(0, &data, false).expect("seed");
    disk.bad_from = (SIZE / 2) as u64 + 5;
    let server = serve_with(&disk, limits(SIZE as u32), Security::default());
    let (mut conn, _) = Conn::transmission(&server, true);
    // Slices are 1 MiB: the first two are sent before the third fails.
    let length = SIZE as u32;
    conn.request(CMD_READ, 0, 0xbad, 0, length, &[]);
    let (got, error) = conn.structured_read(0xbad, 0, length);
    assert_eq!(error, Some(EIO));
    assert!(got[..SIZE / 2] == data[..SIZE / 2], "the slices before the bad one came as data chunks");
    assert_eq!(conn.read(0, 4096, true), Ok(data[..4096].to_vec()), "the connection goes on");

    let long = "x".repeat(10_000);
    disk.fail_with(Some(DeviceError::new(DeviceErrorKind::Io, long)));
    for kind in [CMD_READ, CMD_WRITE] {
        let payload = if kind == CMD_WRITE { vec![1; 512] } else { vec![] };
        conn.request(kind, 0, 0x10, 0, 512, &payload);
        let c = conn.chunk(0x10);
        let (errno, message) = c.error();
        assert_eq!(errno, EIO);
        assert!(message.len() <= MAX_STRING, "a {}-byte error message", message.len());
        assert_ne!(c.flags & REPLY_FLAG_DONE, 0);
    }
}

/// Every reply MUST carry the cookie of its request, unchanged; every request but DISC is
/// answered exactly once, errors included, and a write's payload is consumed even when it is
/// refused. Pipelined, in both reply styles.
#[test]
fn every_request_is_answered_once_with_its_own_cookie() {
    let disk = Disk::new(Capabilities::ALL);
    let server = serve_with(&disk, limits(64 << 10), Security::default());
    for structured in [false, true] {
        let (mut conn, _) = Conn::transmission(&server, structured);
        // cookie -> (length of data a good read returns, or None)
        let mut expect: BTreeMap<u64, Option<u32>> = BTreeMap::new();
        let mut burst = Vec::new();
        let cookies = [0, u64::MAX, 0x8000_0000_0000_0001, 1 << 32, 42, 0xdead_beef_dead_beef];
        for (i, &base) in cookies.iter().enumerate() {
            let c = |n: u64| base.wrapping_add(n * 0x0101_0101);
            let at = (i as u64) * 8192;
            burst.extend(request(CMD_WRITE, 0, c(0), at, 4096, &pattern(4096, i as u8)));
            burst.extend(request(CMD_READ, 0, c(1), at, 4096, &[]));
            burst.extend(request(CMD_READ, 0, c(2), SIZE as u64, 1, &[]));
            burst.extend(request(CMD_WRITE, 0, c(3), SIZE as u64 - 1, 4096, &[0xee; 4096]));
            burst.extend(request(CMD_FLUSH, 0, c(4), 0, 0, &[]));
            burst.extend(request(CMD_TRIM, 0, c(5), at + 4096, 4096, &[]));
            burst.extend(request(CMD_WRITE_ZEROES, 0, c(6), at + 4096, 512, &[]));
            burst.extend(request(99, 0, c(7), 0, 0, &[]));
            for (n, data) in
                [(0, None), (1, Some(4096)), (2, None), (3, None), (4, None), (5, None), (6, None), (7, None)]
            {
                assert!(expect.insert(c(n), data).is_none(), "cookies are distinct");
            }
        }
        conn.send(&burst);
        let mut answered: BTreeMap<u64, usize> = BTreeMap::new();
        let mut open: BTreeSet<u64> = BTreeSet::new();
        while answered.len() < expect.len() || !open.is_empty() {
            let reply = conn.reply();
            let cookie = reply.cookie();
            let data = *expect.get(&cookie).unwrap_or_else(|| panic!("a reply with cookie {cookie:#x}, never sent"));
            match reply {
                Reply::Simple { error, .. } => {
                    assert!(!structured || data.is_none(), "a simple reply to a read");
                    assert!(!open.contains(&cookie), "a simple reply amid a structured one");
                    *answered.entry(cookie).or_default() += 1;
                    if let (0, Some(len)) = (error, data) {
                        conn.bytes(len as usize);
                    }
                }
                Reply::Chunk(chunk) => {
                    assert!(structured, "a structured reply was never negotiated");
                    if chunk.flags & REPLY_FLAG_DONE != 0 {
                        open.remove(&cookie);
                        *answered.entry(cookie).or_default() += 1;
                    } else {
                        assert!(!answered.contains_key(&cookie), "chunks after DONE for {cookie:#x}");
                        open.insert(cookie);
                    }
                }
            }
        }
        assert!(answered.values().all(|&n| n == 1), "answered more than once: {answered:?}");
        assert_eq!(answered.keys().collect::<Vec<_>>(), expect.keys().collect::<Vec<_>>());
        assert_eq!(conn.read(0, 4096, structured), Ok(pattern(4096, 0)), "in step after the burst");
    }
}

/// NBD_CMD_DISC: the server MUST handle every outstanding request, then close; DISC itself gets
/// no reply.
#[test]
fn disc_answers_what_came_before_it_and_closes_without_a_reply() {
    let disk = Disk::new(Capabilities::ALL);
    let server = serve(&disk);
    for structured in [false, true] {
        let (mut conn, _) = Conn::transmission(&server, structured);
        let mut burst = Vec::new();
        burst.extend(request(CMD_WRITE, 0, 1, 8192, 4096, &[0x77; 4096]));
        burst.extend(request(CMD_READ, 0, 2, 8192, 4096, &[]));
        burst.extend(request(CMD_WRITE_ZEROES, CMD_FLAG_FUA, 3, 8192, 512, &[]));
        burst.extend(request(CMD_FLUSH, 0, 4, 0, 0, &[]));
        burst.extend(request(CMD_DISC, 0, 5, 0, 0, &[]));
        conn.send(&burst);
        assert_eq!(conn.status(1), 0);
        if structured {
            let (data, error) = conn.structured_read(2, 8192, 4096);
            assert_eq!((data, error), (vec![0x77; 4096], None));
        } else {
            assert_eq!(conn.simple(2), 0);
            assert_eq!(conn.bytes(4096), vec![0x77; 4096]);
        }
        assert_eq!(conn.status(3), 0);
        assert_eq!(conn.status(4), 0);
        assert!(conn.closed(), "DISC got a reply, or the connection stayed open");
    }
    // No reply could carry an error: a DISC with flags it does not take, or a range past the
    // end, still ends the connection cleanly, unanswered.
    for flags in [CMD_FLAG_NO_HOLE, CMD_FLAG_DF | CMD_FLAG_REQ_ONE, 0x8000] {
        let (mut conn, _) = Conn::transmission(&server, true);
        conn.send(&request(CMD_DISC, flags, 6, SIZE as u64, 4096, &[]));
        assert!(conn.closed(), "DISC with flags {flags:#x} got a reply, or the connection stayed open");
    }
    let calls = disk.calls();
    assert_eq!(calls.iter().filter(|c| **c == Call::Disconnect).count(), 5);
    assert_eq!(calls.last(), Some(&Call::Disconnect), "DISC was handled after the requests before it");
}

// ---------------------------------------------------------------------------------------------
// Commands.

/// NBD_CMD_FLUSH MUST NOT be answered before the writes already answered are on stable storage:
/// the device's flush runs before the reply. NBD_CMD_FLAG_FUA: the server MUST accept it on every
/// command once SEND_FUA is advertised, and MUST NOT reply to a write with FUA before it is
/// persisted: the device is told, for WRITE, WRITE_ZEROES and TRIM alike.
#[test]
fn flush_and_fua_reach_the_device_before_the_reply() {
    let disk = Disk::new(Capabilities::ALL);
    let server = serve(&disk);
    let (mut conn, flags) = Conn::transmission(&server, false);
    assert_ne!(flags & TFLAG_SEND_FUA, 0);
    assert_eq!(conn.write(0, 0, &[1; 4096]), 0);
    assert_eq!(conn.command(CMD_FLUSH, 0, 0, 0), 0);
    assert_eq!(disk.calls().last(), Some(&Call::Flush), "FLUSH answered before the device flushed");

    assert_eq!(conn.write(CMD_FLAG_FUA, 4096, &[2; 4096]), 0);
    assert_eq!(disk.calls().last(), Some(&Call::Write { offset: 4096, length: 4096, fua: true }));
    let big = pattern(200 << 10, 4);
    assert_eq!(conn.write(CMD_FLAG_FUA, 8192, &big), 0, "a write received straight into the device");
    assert_eq!(disk.calls().last(), Some(&Call::Write { offset: 8192, length: big.len(), fua: true }));
    assert_eq!(conn.command(CMD_WRITE_ZEROES, CMD_FLAG_FUA, 0, 512), 0);
    assert!(matches!(disk.calls().last(), Some(Call::Zero { fua: true, .. })));
    assert_eq!(conn.command(CMD_TRIM, CMD_FLAG_FUA, 0, 512), 0);
    assert!(matches!(disk.calls().last(), Some(Call::Trim { fua: true, .. })));
    assert_eq!(conn.command(CMD_FLUSH, CMD_FLAG_FUA, 0, 0), 0, "FUA on FLUSH");
    conn.request(CMD_READ, CMD_FLAG_FUA, 8, 0, 16, &[]);
    assert_eq!(conn.simple(8), 0, "FUA on READ");
    assert_eq!(conn.bytes(16), vec![0; 16]);
    assert_eq!(conn.command(CMD_READ, CMD_FLAG_DF, 0, 16), EINVAL, "DF, never advertised");
    assert_eq!(conn.write(0, 0, &[3; 512]), 0);
    assert_eq!(disk.calls().last(), Some(&Call::Write { offset: 0, length: 512, fua: false }), "no FUA, none passed");
}

/// NBD_CMD_WRITE_ZEROES: the area MUST read back as zeroes; NBD_CMD_FLAG_NO_HOLE MUST be supported
/// when WRITE_ZEROES is advertised (the device is told not to punch a hole). With FAST_ZERO
/// advertised: a request with NBD_CMD_FLAG_FAST_ZERO that cannot be fast MUST fail with ENOTSUP
/// (and SHOULD leave the data alone); one without the flag MUST NOT fail with ENOTSUP. Without
/// FAST_ZERO advertised the flag SHOULD get EINVAL.
#[test]
fn write_zeroes_honours_no_hole_and_fast_zero() {
    let mut disk = Disk::new(Capabilities::ALL);
    disk.slow_zero = true;
    let server = serve(&disk);
    for structured in [false, true] {
        let (mut conn, flags) = Conn::transmission(&server, structured);
        assert_ne!(flags & TFLAG_SEND_FAST_ZERO, 0);
        assert_eq!(conn.write(0, 0, &[0xff; 8192]), 0);
        assert_eq!(conn.command(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 100, 1000), 0);
        assert_eq!(
            disk.calls().last(),
            Some(&Call::Zero { offset: 100, length: 1000, may_trim: false, fast_only: false, fua: false })
        );
        let mut expected = vec![0xff; 8192];
        expected[100..1100].fill(0);
        assert_eq!(conn.read(0, 8192, structured), Ok(expected.clone()));
        assert_eq!(conn.command(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 2000, 1000), ENOTSUP, "slow FAST_ZERO");
        assert_eq!(conn.read(0, 8192, structured), Ok(expected.clone()), "a refused fast zero changed the data");
        assert_eq!(conn.command(CMD_WRITE_ZEROES, 0, 2000, 1000), 0, "without FAST_ZERO, no ENOTSUP");
        assert!(matches!(disk.calls().last(), Some(Call::Zero { may_trim: true, fast_only: false, .. })));
        expected[2000..3000].fill(0);
        assert_eq!(conn.read(0, 8192, structured), Ok(expected));
    }
    let server = serve(&Disk::new(Capabilities { can_fast_zero: false, ..Capabilities::ALL }));
    let (mut conn, flags) = Conn::transmission(&server, false);
    assert_eq!(flags & TFLAG_SEND_FAST_ZERO, 0);
    assert_eq!(conn.command(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 512), EINVAL, "FAST_ZERO not advertised");
    assert_eq!(conn.command(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 0, 512), 0);
}

/// Commands never negotiated (NBD_CMD_BLOCK_STATUS without meta contexts, CACHE and RESIZE, which
/// this server does not advertise, and unknown types) get an error, EINVAL where the spec says
/// SHOULD, and the connection goes on. A request in the extended-header format, never
/// negotiated, breaks framing: the server may and does close the connection, touching nothing.
#[test]
fn commands_never_negotiated_get_einval_and_the_connection_goes_on() {
    let disk = Disk::new(Capabilities::ALL);
    let server = serve(&disk);
    for structured in [false, true] {
        let (mut conn, _) = Conn::transmission(&server, structured);
        for (kind, flags) in
            [(CMD_BLOCK_STATUS, 0), (CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE), (CMD_RESIZE, 0), (9, 0), (u16::MAX, 0)]
        {
            assert_eq!(conn.command(kind, flags, 0, 4096), EINVAL, "command {kind} flags {flags:#x}");
        }
        assert_eq!(conn.command(CMD_FLUSH, 1 << 15, 0, 0), EINVAL, "an undefined command flag");
        assert_eq!(conn.read(0, 512, structured), Ok(vec![0; 512]));
    }
    let (mut conn, _) = Conn::transmission(&server, true);
    let mut extended = Vec::new();
    put_u32(&mut extended, EXTENDED_REQUEST_MAGIC);
    put_u16(&mut extended, 0);
    put_u16(&mut extended, CMD_WRITE);
    put_u64(&mut extended, 1);
    put_u64(&mut extended, 0);
    put_u64(&mut extended, 4);
    extended.extend_from_slice(b"oops");
    conn.send(&extended);
    assert!(conn.closed(), "an extended-header request was taken for something");
    assert!(disk.calls().iter().all(|c| !matches!(c, Call::Write { .. })));
}

/// Requests past the end of the export: reads and trims SHOULD get EINVAL, writes and write-zeroes
/// ENOSPC; offsets whose end overflows 64 bits are past the end too. A refused write's payload is
/// skipped.
#[test]
fn requests_past_the_end_get_einval_or_enospc() {
    let disk = Disk::new(Capabilities::ALL);
    let server = serve(&disk);
    for structured in [false, true] {
        let (mut conn, _) = Conn::transmission(&server, structured);
        let end = SIZE as u64;
        assert_eq!(conn.command(CMD_TRIM, 0, end - 512, 1024), EINVAL, "TRIM");
        assert_eq!(conn.command(CMD_TRIM, 0, u64::MAX, 1), EINVAL, "TRIM, overflowing");
        assert_eq!(conn.read(u64::MAX - 1, 2, structured), Err(EINVAL), "READ, overflowing");
        assert_eq!(conn.read(end, 1, structured), Err(EINVAL), "READ");
        assert_eq!(conn.command(CMD_WRITE_ZEROES, 0, end - 1, 2), ENOSPC, "WRITE_ZEROES");
        assert_eq!(conn.write(0, end - 1, &[1, 2]), ENOSPC, "WRITE");
        assert_eq!(conn.write(0, end, &pattern(100 << 10, 9)), ENOSPC, "a large WRITE");
        assert_eq!(conn.read(end - 1, 1, structured), Ok(vec![0]), "the last byte, in step");
    }
    assert!(disk.calls().iter().all(|c| matches!(c, Call::Disconnect)), "{:?}", disk.calls());
}

/// Zero-length READ, WRITE, TRIM and WRITE_ZEROES: what the server does is unspecified, but it
/// SHOULD NOT disconnect. Each is answered and the connection goes on.
#[test]
fn zero_length_requests_do_not_disconnect() {
    let server = serve(&Disk::new(Capabilities::ALL));
    for structured in [false, true] {
        let (mut conn, _) = Conn::transmission(&server, structured);
        assert_eq!(conn.write(0, 4096, &[]), 0, "WRITE of nothing");
        assert_eq!(conn.command(CMD_TRIM, 0, 4096, 0), 0, "TRIM of nothing");
        assert_eq!(conn.command(CMD_WRITE_ZEROES, 0, 4096, 0), 0, "WRITE_ZEROES of nothing");
        assert_eq!(conn.read(4096, 0, structured), Ok(vec![]), "READ of nothing");
        assert_eq!(conn.read(SIZE as u64, 0, structured), Ok(vec![]), "READ of nothing at the end");
        assert_eq!(conn.read(0, 512, structured), Ok(vec![0; 512]));
    }
}

/// TRIM and WRITE_ZEROES carry no payload: a length above the maximum payload is allowed, and
/// the server SHOULD NOT disconnect (it may answer EINVAL or EOVERFLOW; this one serves them).
#[test]
fn trim_and_zero_longer_than_the_maximum_payload_are_served() {
    let disk = Disk::new(Capabilities::ALL);
    disk.memory.clone().write(0, &vec![0xab; SIZE], false).expect("seed");
    let server = serve_with(&disk, limits(64 << 10), Security::default());
    let (mut conn, _) = Conn::transmission(&server, false);
    let zeroed = conn.command(CMD_WRITE_ZEROES, 0, 0, 512 << 10);
    assert!([0, EINVAL, EOVERFLOW].contains(&zeroed), "WRITE_ZEROES above the maximum: {zeroed}");
    let trimmed = conn.command(CMD_TRIM, 0, 512 << 10, 512 << 10);
    assert!([0, EINVAL, EOVERFLOW].contains(&trimmed), "TRIM above the maximum: {trimmed}");
    assert_eq!((zeroed, trimmed), (0, 0), "this server serves them");
    assert_eq!(conn.read(0, 64 << 10, false), Ok(vec![0; 64 << 10]));
    assert_eq!(conn.read((512 << 10) - 1, 1, false), Ok(vec![0]));
}

/// Error values: the server may only send those the spec defines (EPERM EIO ENOMEM EINVAL ENOSPC
/// EOVERFLOW ENOTSUP ESHUTDOWN), whatever the device reports, in both reply styles.
#[test]
fn error_values_are_only_those_the_spec_defines() {
    let disk = Disk::new(Capabilities::ALL);
    let server = serve(&disk);
    let kinds = [
        DeviceErrorKind::Io,
        DeviceErrorKind::NoSpace,
        DeviceErrorKind::Invalid,
        DeviceErrorKind::NotSupported,
        DeviceErrorKind::ReadOnly,
        DeviceErrorKind::Refused,
        DeviceErrorKind::Exhausted,
    ];
    for structured in [false, true] {
        let (mut conn, _) = Conn::transmission(&server, structured);
        for kind in kinds {
            disk.fail_with(Some(DeviceError::new(kind, "failed")));
            let results = [
                conn.read(0, 512, structured).expect_err("read"),
                conn.write(0, 0, &[1; 512]),
                conn.command(CMD_FLUSH, 0, 0, 0),
                conn.command(CMD_TRIM, 0, 0, 512),
                conn.command(CMD_WRITE_ZEROES, 0, 0, 512),
            ];
            for errno in results {
                assert!(ALLOWED_ERRNOS.contains(&errno), "{kind:?} became error value {errno}");
            }
            disk.fail_with(None);
        }
        assert_eq!(conn.read(0, 512, structured), Ok(vec![0; 512]));
    }
}

/// Strings the server sends, error messages included, MUST be no longer than 4096 bytes: an
/// option error naming an export, or a device's error, is cut to fit.
#[test]
fn option_error_messages_stay_within_the_string_limit() {
    let server = serve(&Disk::new(Capabilities::ALL));
    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
    let name = "n".repeat(MAX_STRING);
    for option in [OPT_INFO, OPT_GO] {
        let replies = conn.ask(option, &info_request(&name, &[]));
        let last = replies.last().expect("a reply");
        assert_eq!(last.kind, REP_ERR_UNKNOWN);
        assert!(last.payload.len() <= MAX_STRING, "a {}-byte error message", last.payload.len());
        assert!(std::str::from_utf8(&last.payload).is_ok());
    }
    let mut disk = Disk::new(Capabilities::ALL);
    disk.open_error = Some(DeviceError::new(DeviceErrorKind::Io, "é".repeat(5000)));
    let server = serve(&disk);
    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE);
    let replies = conn.ask(OPT_GO, &info_request(NAME, &[]));
    let last = replies.last().expect("a reply");
    assert_ne!(last.kind & (1 << 31), 0, "GO of an export that cannot open: {last:?}");
    assert!(last.payload.len() <= MAX_STRING, "a {}-byte error message", last.payload.len());
    assert!(std::str::from_utf8(&last.payload).is_ok(), "cut inside a character");
}

// ---------------------------------------------------------------------------------------------
// Metadata contexts, BLOCK_STATUS and CACHE (rows 87–93).

/// The (id, name) of each NBD_REP_META_CONTEXT, and the final reply's type.
fn contexts(replies: &[OptReply]) -> (Vec<(u32, String)>, u32) {
    let (last, rest) = replies.split_last().expect("a final reply");
    let found = rest
        .iter()
        .map(|r| {
            assert_eq!(r.kind, REP_META_CONTEXT, "only META_CONTEXT replies before the final one: {r:?}");
            let name = std::str::from_utf8(&r.payload[4..]).expect("UTF-8 context name").to_owned();
            (be_u32(&r.payload), name)
        })
        .collect();
    (found, last.kind)
}

/// Rows 87–89. Metadata contexts need structured replies (SET: SHOULD refuse; LIST: MAY, and
/// does, as nbdkit and qemu-nbd); LIST with no query lists every context, `base:` lists the
/// base namespace, unknown namespaces are ignored; SET selects `base:allocation` with an ID;
/// malformed requests get INVALID, unknown exports UNKNOWN, and negotiation goes on.
#[test]
fn metadata_contexts_are_listed_and_selected_as_the_spec_says() {
    let server = serve(&Disk::new(Capabilities::ALL));
    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    let wanted = meta_context_request(NAME, &[BASE_ALLOCATION]);
    assert_eq!(conn.ask_final(OPT_SET_META_CONTEXT, &wanted), REP_ERR_INVALID, "SET before structured replies");
    assert_eq!(conn.ask_final(OPT_LIST_META_CONTEXT, &wanted), REP_ERR_INVALID, "LIST before structured replies");
    assert_eq!(conn.ask_final(OPT_STRUCTURED_REPLY, &[]), REP_ACK);
    let base = vec![(0, BASE_ALLOCATION.to_owned())];
    for queries in [&["base:"][..], &[BASE_ALLOCATION][..], &["x-other:thing", "base:"][..]] {
        let listed = contexts(&conn.ask(OPT_LIST_META_CONTEXT, &meta_context_request(NAME, queries)));
        assert_eq!(listed, (base.clone(), REP_ACK), "LIST {queries:?}");
    }
    let depth = vec![(0, ALLOCATION_DEPTH.to_owned())];
    for queries in [&["qemu:"][..], &[ALLOCATION_DEPTH][..], &["qemu:dirty-bitmap:x", "qemu:"][..]] {
        let listed = contexts(&conn.ask(OPT_LIST_META_CONTEXT, &meta_context_request(NAME, queries)));
        assert_eq!(listed, (depth.clone(), REP_ACK), "LIST {queries:?}");
    }
    let both = [base.clone(), depth].concat();
    let listed = contexts(&conn.ask(OPT_LIST_META_CONTEXT, &meta_context_request(NAME, &[])));
    assert_eq!(listed, (both, REP_ACK), "LIST of everything");
    for queries in [&["x-other:thing"][..], &["base:nonesuch"][..], &["qemu:dirty-bitmap:x"][..]] {
        let listed = contexts(&conn.ask(OPT_LIST_META_CONTEXT, &meta_context_request(NAME, queries)));
        assert_eq!(listed, (vec![], REP_ACK), "LIST {queries:?} finds nothing");
    }
    // SET ignores `base:` and unknown leaves; it selects base:allocation alone.
    assert_eq!(contexts(&conn.ask(OPT_SET_META_CONTEXT, &meta_context_request(NAME, &["base:"]))), (vec![], REP_ACK));
    let (selected, last) = contexts(&conn.ask(OPT_SET_META_CONTEXT, &wanted));
    assert_eq!(last, REP_ACK);
    assert_eq!(selected.len(), 1);
    assert_eq!(selected[0].1, BASE_ALLOCATION);
    // Malformed: a query running past the option, a count the data cannot hold, a query with
    // no namespace; an unknown export.
    let mut past = meta_context_request(NAME, &[BASE_ALLOCATION]);
    past.truncate(past.len() - 3);
    let mut lying = meta_context_request(NAME, &[]);
    let count_at = lying.len() - 4;
    lying[count_at..].copy_from_slice(&1000u32.to_be_bytes());
    for (what, data) in
        [("past the end", past), ("count", lying), ("no colon", meta_context_request(NAME, &["allocation"]))]
    {
        for option in [OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT] {
            assert_eq!(conn.ask_final(option, &data), REP_ERR_INVALID, "{what}, option {option}");
        }
    }
    for option in [OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT] {
        let reply = conn.ask_final(option, &meta_context_request("missing", &[BASE_ALLOCATION]));
        assert_eq!(reply, REP_ERR_UNKNOWN, "option {option}");
    }
    // The failed SET above forgot the selection: BLOCK_STATUS is not negotiated.
    assert_eq!(conn.negotiate(true) & TFLAG_SEND_CACHE, TFLAG_SEND_CACHE);
    assert_eq!(conn.command(CMD_BLOCK_STATUS, 0, 0, 4096), EINVAL, "a failed SET selects nothing");
}

/// The descriptors of a BLOCK_STATUS reply: one chunk of type BLOCK_STATUS with DONE, for the
/// context `id`, length 4 + 8n.
fn block_status(conn: &mut Conn<UnixStream>, id: u32, flags: u16, offset: u64, length: u32) -> Vec<(u32, u32)> {
    conn.request(CMD_BLOCK_STATUS, flags, 0xb5, offset, length, &[]);
    let chunk = conn.chunk(0xb5);
    assert_eq!(chunk.kind, REPLY_TYPE_BLOCK_STATUS, "{chunk:?}");
    assert_eq!(chunk.flags, REPLY_FLAG_DONE, "one chunk per context, the last");
    let payload = &chunk.payload;
    assert!(payload.len() >= 12 && (payload.len() - 4).is_multiple_of(8), "{} bytes", payload.len());
    assert_eq!(be_u32(payload), id, "the ID SET assigned");
    payload[4..].chunks_exact(8).map(|d| (be_u32(d), be_u32(&d[4..]))).collect()
}

/// Rows 90–92. BLOCK_STATUS answers with one chunk for the selected context; descriptors have
/// nonzero lengths, cover the range from its offset, never run past the request, and neighbours
/// with equal flags are merged; REQ_ONE gives exactly one descriptor no longer than asked. A
/// range past the end and a zero length get EINVAL, and the connection goes on.
#[test]
fn block_status_describes_the_range_asked_for_and_no_more() {
    let server = serve(&Disk::new(Capabilities::ALL));
    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    assert_eq!(conn.ask_final(OPT_STRUCTURED_REPLY, &[]), REP_ACK);
    let (selected, _) = contexts(&conn.ask(OPT_SET_META_CONTEXT, &meta_context_request(NAME, &[BASE_ALLOCATION])));
    let id = selected[0].0;
    conn.negotiate(false);
    let hole = STATE_HOLE | STATE_ZERO;
    // From an unaligned offset: the device's alternating 4 KiB blocks, the first cut short.
    let descriptors = block_status(&mut conn, id, 0, 1000, 20000);
    assert_eq!(descriptors, vec![(3096, 0), (4096, hole), (4096, 0), (4096, hole), (4096, 0), (520, hole)]);
    assert_eq!(block_status(&mut conn, id, CMD_FLAG_REQ_ONE, 1000, 20000), vec![(3096, 0)]);
    assert_eq!(block_status(&mut conn, id, CMD_FLAG_REQ_ONE, 4096, 100), vec![(100, hole)], "REQ_ONE within length");
    // The whole disk: every descriptor nonzero, and they add up to the disk.
    let whole = block_status(&mut conn, id, 0, 0, SIZE as u32);
    assert!(whole.iter().all(|d| d.0 > 0));
    assert_eq!(whole.iter().map(|d| u64::from(d.0)).sum::<u64>(), SIZE as u64);
    assert_eq!(conn.command(CMD_BLOCK_STATUS, 0, SIZE as u64 - 512, 1024), EINVAL, "past the end");
    assert_eq!(conn.command(CMD_BLOCK_STATUS, 0, 0, 0), EINVAL, "zero length");
    assert_eq!(conn.command(CMD_BLOCK_STATUS, CMD_FLAG_DF, 0, 4096), EINVAL, "a flag BLOCK_STATUS has not");
    assert_eq!(conn.read(0, 512, true), Ok(vec![0; 512]), "the connection goes on");
}

/// With both contexts selected, BLOCK_STATUS answers a chunk for each, in the order of their
/// IDs, DONE on the last: `base:allocation`'s holes and `qemu:allocation-depth`'s layers (this
/// device has no image below it: all its own, depth 1).
#[test]
fn block_status_answers_a_chunk_per_selected_context() {
    let server = serve(&Disk::new(Capabilities::ALL));
    let mut conn = Conn::start(&server, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    assert_eq!(conn.ask_final(OPT_STRUCTURED_REPLY, &[]), REP_ACK);
    let request = meta_context_request(NAME, &[ALLOCATION_DEPTH, BASE_ALLOCATION]);
    let (selected, last) = contexts(&conn.ask(OPT_SET_META_CONTEXT, &request));
    assert_eq!(last, REP_ACK);
    let names: Vec<&str> = selected.iter().map(|(_, name)| name.as_str()).collect();
    assert_eq!(names, [BASE_ALLOCATION, ALLOCATION_DEPTH]);
    let (base_id, depth_id) = (selected[0].0, selected[1].0);
    assert_ne!(base_id, depth_id);
    conn.negotiate(false);
    for (flags, expected_base, expected_depth) in [
        (
            0,
            vec![(3096, 0), (4096, STATE_HOLE | STATE_ZERO), (4096, 0), (712, STATE_HOLE | STATE_ZERO)],
            vec![(12000, 1)],
        ),
        (CMD_FLAG_REQ_ONE, vec![(3096, 0)], vec![(12000, 1)]),
    ] {
        conn.request(CMD_BLOCK_STATUS, flags, 0xd7, 1000, 12000, &[]);
        let mut answers = Vec::new();
        for _ in 0..2 {
            let chunk = conn.chunk(0xd7);
            assert_eq!(chunk.kind, REPLY_TYPE_BLOCK_STATUS, "{chunk:?}");
            let payload = &chunk.payload;
            let descriptors: Vec<(u32, u32)> =
                payload[4..].chunks_exact(8).map(|d| (be_u32(d), be_u32(&d[4..]))).collect();
            answers.push((be_u32(payload), chunk.flags, descriptors));
        }
        assert_eq!(answers[0], (base_id, 0, expected_base), "base:allocation first, not the last chunk");
        assert_eq!(answers[1], (depth_id, REPLY_FLAG_DONE, expected_depth), "then the depths, DONE");
    }
    assert_eq!(conn.read(0, 512, true), Ok(vec![0; 512]), "the connection goes on");
}

/// Row 93. CACHE is advertised and answered (a prefetch or nothing, never a change); flags it
/// does not know and ranges past the end get EINVAL.
#[test]
fn cache_is_advertised_and_answered() {
    let disk = Disk::new(Capabilities::ALL);
    let server = serve(&disk);
    for structured in [false, true] {
        let (mut conn, flags) = Conn::transmission(&server, structured);
        assert_eq!(flags & TFLAG_SEND_CACHE, TFLAG_SEND_CACHE);
        assert_eq!(conn.command(CMD_CACHE, 0, 0, 1 << 20), 0);
        assert_eq!(conn.command(CMD_CACHE, CMD_FLAG_FUA, 4096, 4096), 0, "FUA is valid on every command");
        assert_eq!(conn.command(CMD_CACHE, CMD_FLAG_NO_HOLE, 0, 4096), EINVAL, "a flag CACHE has not");
        assert_eq!(conn.command(CMD_CACHE, 0, SIZE as u64, 4096), EINVAL, "past the end");
        assert_eq!(conn.read(0, 512, structured), Ok(vec![0; 512]));
    }
    assert!(
        disk.calls().iter().all(|call| matches!(call, Call::Disconnect)),
        "CACHE changed nothing: {:?}",
        disk.calls()
    );
}
