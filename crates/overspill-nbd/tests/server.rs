//! The server over real sockets (socketpairs and a Unix listener) with the project's client and
//! with raw bytes: correct replies, and bad input that costs one connection, never the server.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use overspill_block::{
    BlockDevice, Capabilities, DeviceError, DeviceErrorKind, ExportInfo, ExportProvider, ReadRequest,
};
use overspill_nbd::client::{Client, ClientError};
use overspill_nbd::counters::Refusal;
use overspill_nbd::memory::OneExport;
use overspill_nbd::server::socketpair;
use overspill_nbd::wire::*;
use overspill_nbd::{Limits, Server, ServerConfig};

const SIZE: usize = 1 << 20;

fn server() -> (Server, OneExport) {
    let exports = OneExport::new("disk", SIZE);
    let config = ServerConfig {
        limits: Limits {
            max_payload_bytes: 1 << 16,
            handshake_timeout: Duration::from_secs(2),
            idle_timeout: None,
            ..Limits::default()
        },
        max_connections: 8,
        ..ServerConfig::default()
    };
    (Server::new(Arc::new(exports.clone()), config), exports)
}

fn client(server: &Server, structured: bool) -> Client {
    let stream = socketpair(server).expect("socketpair");
    Client::handshake(Box::new(stream), "disk", structured).expect("handshake")
}

/// A client that keeps working is the proof that the server survived whatever came before.
fn assert_healthy(server: &Server) {
    let mut c = client(server, true);
    let data = vec![0xa5u8; 8192];
    c.write(4096, &data, false).expect("write");
    let mut back = vec![0u8; 8192];
    c.read(4096, &mut back).expect("read");
    assert_eq!(back, data);
    c.disconnect().expect("disc");
}

#[test]
fn reads_writes_trims_and_zeroes_with_both_reply_styles() {
    let (server, exports) = server();
    for structured in [false, true] {
        let mut c = client(&server, structured);
        assert_eq!(c.size(), SIZE as u64);
        assert_eq!(c.structured_replies(), structured);
        assert!(c.can_trim() && c.can_zero() && c.can_flush());
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        c.write(1000, &data, true).expect("write");
        c.write_zeroes(2000, 100, false).expect("zero");
        c.flush().expect("flush");
        c.trim(0, 4096).expect("trim");
        let mut back = vec![0u8; data.len()];
        c.read(1000, &mut back).expect("read");
        let mut expected = data.clone();
        expected[1000..1100].fill(0);
        assert_eq!(back, expected);
        let mut empty = [];
        c.read(0, &mut empty).expect("zero-length read");
        c.disconnect().expect("disc");
    }
    assert_eq!(exports.device().snapshot()[2000..2100], [0u8; 100]);
}

#[test]
fn invalid_requests_get_errors_and_the_connection_goes_on() {
    let (server, _) = server();
    for structured in [false, true] {
        let mut c = client(&server, structured);
        let mut buf = vec![0u8; 4096];
        let err = c.read(SIZE as u64 - 100, &mut buf).expect_err("past the end");
        assert_eq!(err.errno(), Some(Errno::Inval as u32));
        let err = c.write(SIZE as u64, &buf, false).expect_err("past the end");
        assert_eq!(err.errno(), Some(Errno::NoSpc as u32));
        let err = c.write_zeroes(u64::MAX - 10, 4096, false).expect_err("offset overflow");
        assert_eq!(err.errno(), Some(Errno::NoSpc as u32));
        let mut big = vec![0u8; (1 << 16) + 1];
        let err = c.read(0, &mut big).expect_err("above the maximum block size");
        assert_eq!(err.errno(), Some(Errno::Inval as u32));
        let cookie = c.send_request(200, 0, 0, 0, &[]).expect("send");
        let err = c.reply(cookie, None).expect_err("unknown command");
        assert_eq!(err.errno(), Some(Errno::Inval as u32));
        let cookie = c.send_request(CMD_FLUSH, CMD_FLAG_FUA | 0x100, 0, 0, &[]).expect("send");
        assert_eq!(c.reply(cookie, None).expect_err("bad flags").errno(), Some(Errno::Inval as u32));
        // FUA, once negotiated, is valid on every command, even where it means nothing.
        let cookie = c.send_request(CMD_FLUSH, CMD_FLAG_FUA, 0, 0, &[]).expect("send");
        c.reply(cookie, None).expect("FLUSH with FUA");
        let cookie = c.send_request(CMD_READ, CMD_FLAG_FUA, 0, 512, &[]).expect("send");
        c.reply(cookie, Some((0, &mut buf[..512]))).expect("READ with FUA");
        // Still in sync: a normal round trip works on the same connection.
        c.write(0, &[7; 512], false).expect("write after errors");
        c.read(0, &mut buf[..512]).expect("read after errors");
        assert_eq!(buf[..512], [7u8; 512]);
    }
    assert_healthy(&server);
}

fn raw(server: &Server) -> UnixStream {
    let s = socketpair(server).expect("socketpair");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    s
}

/// Reads until the server closes; `true` if it did (rather than timing out).
fn closed_by_server(s: &mut UnixStream) -> bool {
    let mut sink = [0u8; 4096];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(_) => return false,
        }
    }
}

fn after_handshake(server: &Server) -> UnixStream {
    let mut s = raw(server);
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    let mut msg = Vec::new();
    put_u32(&mut msg, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    put_u64(&mut msg, IHAVEOPT);
    put_u32(&mut msg, OPT_EXPORT_NAME);
    put_u32(&mut msg, 4);
    msg.extend_from_slice(b"disk");
    s.write_all(&msg).expect("send");
    let mut answer = [0u8; 10];
    s.read_exact(&mut answer).expect("export answer");
    s
}

#[test]
fn broken_framing_closes_only_that_connection() {
    let (server, _) = server();
    let mut cases: Vec<(&str, UnixStream, Vec<u8>)> = Vec::new();
    // Garbage instead of client flags.
    cases.push(("garbage handshake", raw(&server), b"GET / HTTP/1.1\r\n\r\n".to_vec()));
    // A bad option magic.
    let mut bad_opt = Vec::new();
    put_u32(&mut bad_opt, CLIENT_FIXED_NEWSTYLE);
    put_u64(&mut bad_opt, 0xdead_beef);
    put_u64(&mut bad_opt, 0);
    cases.push(("wrong option magic", raw(&server), bad_opt));
    // An export name far longer than any (other options that long are skipped and answered).
    let mut huge = Vec::new();
    put_u32(&mut huge, CLIENT_FIXED_NEWSTYLE);
    put_u64(&mut huge, IHAVEOPT);
    put_u32(&mut huge, OPT_EXPORT_NAME);
    put_u32(&mut huge, u32::MAX);
    cases.push(("oversized export name", raw(&server), huge));
    // Transmission: wrong request magic.
    cases.push(("wrong request magic", after_handshake(&server), vec![0x55; 28]));
    // A write whose payload is over the limit: framing cannot be trusted.
    let mut big_write = Vec::new();
    put_u32(&mut big_write, REQUEST_MAGIC);
    put_u16(&mut big_write, 0);
    put_u16(&mut big_write, CMD_WRITE);
    put_u64(&mut big_write, 1);
    put_u64(&mut big_write, 0);
    put_u32(&mut big_write, u32::MAX);
    cases.push(("oversized write", after_handshake(&server), big_write));
    for (what, mut stream, bytes) in cases {
        let _ = stream.write_all(&bytes);
        assert!(closed_by_server(&mut stream), "{what}: server should close the connection");
        assert_healthy(&server);
    }
}

#[test]
fn a_client_that_vanishes_mid_write_costs_nothing_else() {
    let (server, exports) = server();
    let mut s = after_handshake(&server);
    let mut msg = Vec::new();
    put_u32(&mut msg, REQUEST_MAGIC);
    put_u16(&mut msg, 0);
    put_u16(&mut msg, CMD_WRITE);
    put_u64(&mut msg, 1);
    put_u64(&mut msg, 0);
    put_u32(&mut msg, 4096);
    msg.extend_from_slice(&[0xee; 1000]);
    s.write_all(&msg).expect("send half a write");
    drop(s);
    assert_healthy(&server);
    // The half-sent write was never applied.
    assert!(exports.device().snapshot()[..1000].iter().all(|&b| b != 0xee));
}

#[test]
fn connections_over_the_limit_are_refused_and_slots_come_back() {
    let (server, _) = server();
    let held: Vec<Client> = (0..8).map(|_| client(&server, false)).collect();
    let stream = socketpair(&server).expect("socketpair");
    assert!(Client::handshake(Box::new(stream), "disk", false).is_err(), "ninth connection refused");
    drop(held);
    // Threads notice the closed sockets and release their slots.
    for _ in 0..100 {
        if server.active_connections() == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_healthy(&server);
}

#[test]
fn unknown_export_is_refused_by_go() {
    let (server, _) = server();
    let stream = socketpair(&server).expect("socketpair");
    match Client::handshake(Box::new(stream), "nope", true) {
        Err(ClientError::Refused { reply, .. }) => assert_eq!(reply, (1 << 31) | 6),
        other => panic!("expected NBD_REP_ERR_UNKNOWN, got {other:?}"),
    }
}

/// A VM that sends nothing for longer than the idle timeout is disconnected; one that keeps
/// talking is not.
#[test]
fn idle_connections_are_closed_after_the_idle_timeout() {
    let exports = OneExport::new("disk", SIZE);
    let limits = Limits { idle_timeout: Some(Duration::from_millis(300)), ..Limits::default() };
    let server = Server::new(Arc::new(exports), ServerConfig { limits, ..ServerConfig::default() });
    let mut busy = client(&server, true);
    let mut idle = after_handshake(&server);
    let mut buf = vec![0u8; 4096];
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(100));
        busy.read(0, &mut buf).expect("a talking VM stays connected");
    }
    assert!(closed_by_server(&mut idle), "the silent VM was disconnected");
    assert_healthy(&server);
}

/// Writes larger than the input buffer are received straight into the device's buffers; one the
/// device refuses is read and dropped, so the requests after it are still found.
#[test]
fn large_writes_land_whole_and_a_refused_one_keeps_the_connection_in_step() {
    const DISK: usize = 8 << 20;
    let exports = OneExport::new("disk", DISK);
    let config = ServerConfig {
        limits: Limits {
            max_payload_bytes: 4 << 20,
            handshake_timeout: Duration::from_secs(2),
            idle_timeout: None,
            ..Limits::default()
        },
        max_connections: 2,
        ..ServerConfig::default()
    };
    let server = Server::new(Arc::new(exports.clone()), config);
    for structured in [false, true] {
        let mut c = client(&server, structured);
        let data: Vec<u8> = (0..(3 << 20) + 1000).map(|i: u32| (i % 253) as u8 ^ structured as u8).collect();
        c.write(4096 + 7, &data, false).expect("large write");
        let err = c.write(DISK as u64 - 4096, &data, false).expect_err("past the end");
        assert_eq!(err.errno(), Some(Errno::NoSpc as u32));
        let mut back = vec![0u8; data.len()];
        c.read(4096 + 7, &mut back).expect("read back");
        assert!(back == data, "the large write reads back");
        c.disconnect().expect("disc");
    }
    assert_healthy(&server);
}

/// The handshake has one deadline from the connection on: a client that sends a byte every
/// 250 ms, each well within any per-read timeout, is cut off once the 2 s are over.
#[test]
fn a_handshake_dribbled_byte_by_byte_is_cut_at_its_deadline() {
    let (server, _) = server();
    let counters = server.counters();
    let mut stream = socketpair(&server).expect("socketpair");
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).expect("greeting");
    let mut slow = Vec::new();
    slow.extend_from_slice(&(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).to_be_bytes());
    slow.extend_from_slice(&IHAVEOPT.to_be_bytes());
    slow.extend_from_slice(&OPT_GO.to_be_bytes());
    slow.extend_from_slice(&(4u32 + 8 + 2).to_be_bytes());
    slow.extend_from_slice(&8u32.to_be_bytes());
    slow.extend_from_slice(b"disk-xyz");
    slow.extend_from_slice(&0u16.to_be_bytes());
    assert!(slow.len() * 250 > 6_000, "enough bytes to outlast the deadline three times over");
    stream.set_read_timeout(Some(Duration::from_millis(1))).expect("timeout");
    let started = std::time::Instant::now();
    let mut cut_after = None;
    for byte in &slow {
        if stream.write_all(std::slice::from_ref(byte)).is_err() {
            cut_after = Some(started.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
        if let Ok(0) = stream.read(&mut [0u8; 64]) {
            cut_after = Some(started.elapsed());
            break;
        }
    }
    let cut_after = cut_after.expect("a dribbled handshake was never cut off");
    assert!(cut_after >= Duration::from_millis(1900), "cut off before its deadline: {cut_after:?}");
    assert_healthy(&server);
    // Counted as the connection's thread ends, just after the socket closes.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !counters.refusals().contains(&(Refusal::HandshakeTimeout, 1)) {
        assert!(std::time::Instant::now() < deadline, "not counted: {:?}", counters.refusals());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// An in-memory export whose reads fail from `bad` on, to see how a large read's reply ends,
/// and whose devices count the times they hear their connection is idle.
struct Instrumented {
    inner: OneExport,
    bad: u64,
    idles: Arc<AtomicUsize>,
}

impl Instrumented {
    fn new(size: usize, bad: u64) -> Self {
        Self { inner: OneExport::new("disk", size), bad, idles: Arc::default() }
    }
}

struct InstrumentedDevice {
    inner: Box<dyn BlockDevice>,
    bad: u64,
    idles: Arc<AtomicUsize>,
}

impl BlockDevice for InstrumentedDevice {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn read(&mut self, request: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        if offset + buf.len() as u64 > self.bad {
            return Err(DeviceError::new(DeviceErrorKind::Io, "bad sector"));
        }
        self.inner.read(request, offset, buf)
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.inner.write(offset, data, fua)
    }
    fn write_zeroes(&mut self, o: u64, l: u64, may_trim: bool, fast: bool, fua: bool) -> Result<(), DeviceError> {
        self.inner.write_zeroes(o, l, may_trim, fast, fua)
    }
    fn trim(&mut self, offset: u64, length: u64, fua: bool) -> Result<(), DeviceError> {
        self.inner.trim(offset, length, fua)
    }
    fn flush(&mut self) -> Result<(), DeviceError> {
        self.inner.flush()
    }
    fn idle(&mut self) {
        self.idles.fetch_add(1, Ordering::SeqCst);
    }
}

impl ExportProvider for Instrumented {
    fn list(&self) -> Vec<ExportInfo> {
        self.inner.list()
    }
    fn info(&self, name: &str) -> Option<ExportInfo> {
        self.inner.info(name)
    }
    fn open(&self, name: &str, identity: Option<&str>) -> Result<Box<dyn BlockDevice>, DeviceError> {
        let inner = self.inner.open(name, identity)?;
        Ok(Box::new(InstrumentedDevice { inner, bad: self.bad, idles: self.idles.clone() }))
    }
}

/// A connection whose client has sent nothing for `quiet_after` tells its device once, at the
/// first wake-up of its wait after that (every third of the request timeout, here 1 s), and
/// goes on serving; a client whose requests keep coming is not quiet, nor one part way through
/// a request.
#[test]
fn a_quiet_connection_tells_its_device_once_and_serves_on() {
    let limits = Limits {
        request_timeout: Duration::from_secs(3),
        quiet_after: Duration::from_millis(500),
        ..Limits::default()
    };
    let exports = Instrumented::new(SIZE, u64::MAX);
    let idles = exports.idles.clone();
    let server = Server::new(Arc::new(exports), ServerConfig { limits, ..ServerConfig::default() });
    let mut c = client(&server, true);
    let mut buf = vec![0u8; 4096];
    c.write(0, &[9; 4096], false).expect("write");
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(10));
        c.read(0, &mut buf).expect("read");
    }
    assert_eq!(idles.load(Ordering::SeqCst), 0, "requests every 10 ms are no quiet");
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(idles.load(Ordering::SeqCst), 1, "told once in 2.5 s of quiet");
    c.read(0, &mut buf).expect("served after the quiet");
    assert_eq!(buf, [9; 4096]);
    c.disconnect().expect("disc");

    let mut raw = after_handshake(&server);
    let read = request(CMD_READ, 7, 0, 4096, &[]);
    raw.write_all(&read[..10]).expect("part of a header");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(idles.load(Ordering::SeqCst), 1, "a client part way through a request is not quiet");
    raw.write_all(&read[10..]).expect("the rest of it");
    let mut reply = [0u8; 16 + 4096];
    raw.read_exact(&mut reply).expect("the reply");
    assert_eq!(reply[4..8], [0; 4], "no error");
    assert_eq!(reply[16..], [9; 4096]);
}

/// A read larger than a reply slice (1 MiB) that fails part way: with structured replies the
/// data chunks sent are followed by an error chunk and the connection goes on; with simple
/// replies, whose header already said "no error", the server closes the connection, as NBD
/// requires. A failure in the first slice is an ordinary error reply either way.
#[test]
fn a_large_read_failing_part_way_ends_its_reply_as_nbd_requires() {
    const DISK: usize = 8 << 20;
    let bad = (5 << 20) + 4096;
    let config =
        ServerConfig { limits: Limits { max_payload_bytes: 8 << 20, ..Limits::default() }, ..ServerConfig::default() };
    let server = Server::new(Arc::new(Instrumented::new(DISK, bad)), config);
    let mut buf = vec![0u8; 4 << 20];

    let mut c = client(&server, true);
    let err = c.read(2 << 20, &mut buf).expect_err("crosses the bad sector");
    assert_eq!(err.errno(), Some(Errno::Io as u32), "{err}");
    c.read(0, &mut buf).expect("the connection goes on");
    c.disconnect().expect("disc");

    let mut c = client(&server, false);
    let err = c.read(5 << 20, &mut buf[..2 << 20]).expect_err("fails in its first slice");
    assert_eq!(err.errno(), Some(Errno::Io as u32), "{err}");
    c.read(0, &mut buf).expect("still in step after an ordinary error");
    let err = c.read(2 << 20, &mut buf).expect_err("fails in a later slice");
    assert!(err.errno().is_none(), "a simple reply cannot carry a late error: {err}");
    assert!(c.read(0, &mut buf[..4096]).is_err(), "the server closed the connection");
    assert_healthy(&server);
}

/// A request as raw bytes: header, then `payload`.
fn request(kind: u16, cookie: u64, offset: u64, length: u32, payload: &[u8]) -> Vec<u8> {
    let mut msg = Vec::new();
    overspill_nbd::request::RequestHeader { flags: 0, kind, cookie, offset, length }.encode(&mut msg);
    msg.extend_from_slice(payload);
    msg
}

/// Sends `bytes` one at a time, `gap` apart, on a clone of `stream`; returns how long the server
/// let it go on before it closed the connection.
fn dribble(stream: &UnixStream, bytes: Vec<u8>, gap: Duration) -> Option<Duration> {
    let mut writer = stream.try_clone().expect("clone");
    let mut reader = stream.try_clone().expect("clone");
    reader.set_read_timeout(Some(Duration::from_millis(1))).expect("timeout");
    let started = std::time::Instant::now();
    for byte in &bytes {
        if writer.write_all(std::slice::from_ref(byte)).is_err() {
            return Some(started.elapsed());
        }
        std::thread::sleep(gap);
        if let Ok(0) = reader.read(&mut [0u8; 64]) {
            return Some(started.elapsed());
        }
    }
    None
}

fn with_request_timeout(timeout: Duration) -> Server {
    let limits = Limits { request_timeout: timeout, max_payload_bytes: 1 << 16, ..Limits::default() };
    Server::new(Arc::new(OneExport::new("disk", SIZE)), ServerConfig { limits, ..ServerConfig::default() })
}

/// Once a request's first byte has come, the rest must come within the request timeout, however
/// it is spread: a header, or a write's payload, dribbled a byte at a time is cut off, and
/// counted; a connection that is merely quiet between requests is not.
#[test]
fn a_request_dribbled_byte_by_byte_is_cut_at_its_deadline() {
    let server = with_request_timeout(Duration::from_millis(600));
    let counters = server.counters();
    let header = request(CMD_READ, 1, 0, 4096, &[]);
    let write = request(CMD_WRITE, 2, 0, 4096, &[9; 4096]);
    for (what, bytes) in [("header", header.clone()), ("write payload", write)] {
        let stream = after_handshake(&server);
        let cut = dribble(&stream, bytes, Duration::from_millis(100))
            .unwrap_or_else(|| panic!("a dribbled {what} was never cut off"));
        assert!(cut >= Duration::from_millis(550), "{what} cut off before its deadline: {cut:?}");
        assert!(cut < Duration::from_secs(3), "{what} cut off late: {cut:?}");
    }
    // Quiet for three request timeouts, then a whole request: answered.
    let mut quiet = after_handshake(&server);
    std::thread::sleep(Duration::from_millis(1800));
    quiet.write_all(&header).expect("send");
    let mut reply = [0u8; 16];
    quiet.read_exact(&mut reply).expect("a quiet connection is still served");
    assert_eq!(u32::from_be_bytes(reply[..4].try_into().expect("magic")), SIMPLE_REPLY_MAGIC);
    assert_healthy(&server);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !counters.refusals().contains(&(Refusal::RequestTimeout, 2)) {
        assert!(std::time::Instant::now() < deadline, "not counted: {:?}", counters.refusals());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends `message` over and over on a clone of `stream` until the server stops taking it.
fn flood(stream: &UnixStream, message: Vec<u8>) -> std::thread::JoinHandle<()> {
    let mut writer = stream.try_clone().expect("clone");
    std::thread::spawn(move || {
        let burst: Vec<u8> = message.iter().copied().cycle().take(message.len() * 1024).collect();
        while writer.write_all(&burst).is_ok() {}
    })
}

/// A client that pipelines requests and never reads the replies fills both socket buffers;
/// the server's write then waits on it. The connection is cut at the request timeout, counted,
/// and the server goes on: its thread does not hang in the write for good.
#[test]
fn a_client_that_never_takes_its_replies_is_cut_at_the_request_timeout() {
    let server = with_request_timeout(Duration::from_millis(600));
    let counters = server.counters();
    let stream = after_handshake(&server);
    let sender = flood(&stream, request(CMD_READ, 1, 0, 1 << 16, &[]));
    assert!(server.wait_idle(Duration::from_secs(10)), "the server still waits on the client");
    assert!(counters.refusals().contains(&(Refusal::RequestTimeout, 1)), "{:?}", counters.refusals());
    drop(stream);
    sender.join().expect("sender");
    assert_healthy(&server);
}

/// The same during the handshake: options sent and their replies never read. The handshake's
/// deadline covers the server's writes too.
#[test]
fn a_handshake_whose_replies_are_never_read_ends_at_its_deadline() {
    let (server, _) = server();
    let counters = server.counters();
    let mut stream = raw(&server);
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).expect("greeting");
    stream.write_all(&(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).to_be_bytes()).expect("flags");
    let mut list = Vec::new();
    put_u64(&mut list, IHAVEOPT);
    put_u32(&mut list, OPT_LIST);
    put_u32(&mut list, 0);
    let sender = flood(&stream, list);
    assert!(server.wait_idle(Duration::from_secs(8)), "the handshake outlived its deadline");
    assert!(counters.refusals().contains(&(Refusal::HandshakeTimeout, 1)), "{:?}", counters.refusals());
    drop(stream);
    sender.join().expect("sender");
    assert_healthy(&server);
}

/// A server of one `disk` accepting on a real Unix listener (in `dir`) on a thread of its own, with
/// a 20 s handshake timeout (so a handshake may be shed after 1 s); its socket's path.
fn accepting(dir: &std::path::Path, config: ServerConfig) -> (Arc<Server>, std::path::PathBuf) {
    use overspill_net::{ListenAddr, Listener};
    let socket = dir.join("nbd.sock");
    let listener = Listener::bind(&ListenAddr::Unix(socket.clone())).expect("bind");
    let limits = Limits { handshake_timeout: Duration::from_secs(20), ..Limits::default() };
    let server = Arc::new(Server::new(Arc::new(OneExport::new("disk", SIZE)), ServerConfig { limits, ..config }));
    let running = server.clone();
    std::thread::spawn(move || running.run(&listener));
    (server, socket)
}

/// Slow handshakes cannot hold the door shut: with every handshake slot and all but the
/// established VMs' connections held by clients that never finish theirs, a real client waits
/// in the backlog while the oldest slow handshakes are cut off, and gets in long before their
/// deadline; the established VMs keep their connections throughout.
#[test]
fn slow_handshakes_are_shed_before_anyone_else_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ServerConfig { max_connections: 6, max_handshakes: 3, ..ServerConfig::default() };
    let (server, socket) = accepting(dir.path(), config);
    let counters = server.counters();
    let connect = || {
        let stream = UnixStream::connect(&socket).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        Client::handshake(Box::new(stream), "disk", true)
    };
    let mut established: Vec<Client> = (0..2).map(|_| connect().expect("an established VM")).collect();
    // Six clients that connect and never say a word after the greeting.
    let slow: Vec<UnixStream> = (0..6).map(|_| UnixStream::connect(&socket).expect("connect")).collect();
    std::thread::sleep(Duration::from_millis(200));
    let started = std::time::Instant::now();
    let mut late = connect().expect("a real client gets in");
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(8), "it waited {waited:?} (the slow handshakes' deadline is 20 s)");
    late.write(0, &[1; 4096], false).expect("write");
    for vm in &mut established {
        vm.read(0, &mut [0u8; 4096]).expect("an established VM keeps its connection");
    }
    let shed = counters.refusals().into_iter().find(|(r, _)| *r == Refusal::HandshakeShed).map_or(0, |(_, n)| n);
    assert!(shed >= 4, "slow handshakes shed: {shed}");
    // Each cut is counted once, as shed: not again by how the cut ended its connection.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while server.active_connections() > 3 + 6 - shed as usize {
        assert!(std::time::Instant::now() < deadline, "the shed connections never ended");
        std::thread::sleep(Duration::from_millis(10));
    }
    let others: Vec<_> =
        counters.refusals().into_iter().filter(|&(r, n)| r != Refusal::HandshakeShed && n > 0).collect();
    assert!(others.is_empty(), "shed handshakes counted again: {others:?}");
    drop(slow);
}

/// A slow handshake is cut off only to let a waiting client in: with every handshake slot taken
/// and nobody in the backlog, a client that pauses past the shedding age (libnbd's option mode
/// between options, a TLS handshake on a loaded host) still finishes its handshake.
#[test]
fn a_slow_handshake_is_left_alone_while_nobody_waits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (server, socket) = accepting(dir.path(), ServerConfig { max_handshakes: 1, ..ServerConfig::default() });
    let counters = server.counters();
    let stream = UnixStream::connect(&socket).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    std::thread::sleep(Duration::from_millis(1600));
    let mut client = Client::handshake(Box::new(stream), "disk", true).expect("the slow handshake finishes");
    client.write(0, &[1; 4096], false).expect("write");
    let shed = counters.refusals().into_iter().find(|(r, _)| *r == Refusal::HandshakeShed).map_or(0, |(_, n)| n);
    assert_eq!(shed, 0, "a handshake was shed with nobody waiting");
}

/// An 8 GiB export that stores nothing and notes how much of it each BLOCK_STATUS and CACHE asks
/// the device about.
#[derive(Clone, Default)]
struct Asked(Arc<std::sync::Mutex<Vec<(u16, u64)>>>);

const HUGE: u64 = 8 << 30;

impl BlockDevice for Asked {
    fn size(&self) -> u64 {
        HUGE
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }
    fn read(&mut self, _: &ReadRequest, _offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        buf.fill(0);
        Ok(())
    }
    fn write(&mut self, _offset: u64, _data: &[u8], _fua: bool) -> Result<(), DeviceError> {
        Ok(())
    }
    fn write_zeroes(&mut self, _o: u64, _l: u64, _may_trim: bool, _fast: bool, _fua: bool) -> Result<(), DeviceError> {
        Ok(())
    }
    fn trim(&mut self, _offset: u64, _length: u64, _fua: bool) -> Result<(), DeviceError> {
        Ok(())
    }
    fn flush(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    fn block_status(&mut self, _offset: u64, length: u64) -> Result<Vec<overspill_block::Extent>, DeviceError> {
        self.0.lock().expect("asked").push((CMD_BLOCK_STATUS, length));
        Ok(vec![overspill_block::Extent { length, hole: true, zero: true }])
    }
    fn cache(&mut self, _offset: u64, length: u64) -> Result<(), DeviceError> {
        self.0.lock().expect("asked").push((CMD_CACHE, length));
        Ok(())
    }
}

impl ExportProvider for Asked {
    fn list(&self) -> Vec<ExportInfo> {
        self.info("disk").into_iter().collect()
    }
    fn info(&self, name: &str) -> Option<ExportInfo> {
        (name == "disk").then(|| ExportInfo {
            name: "disk".into(),
            description: String::new(),
            size: HUGE,
            capabilities: Capabilities::ALL,
            block_sizes: overspill_block::DEFAULT_BLOCK_SIZES,
        })
    }
    fn open(&self, _name: &str, _identity: Option<&str>) -> Result<Box<dyn BlockDevice>, DeviceError> {
        Ok(Box::new(self.clone()))
    }
}

/// One request may not make the device do unbounded work: BLOCK_STATUS asks it about 256 MiB at
/// most (REQ_ONE too) and the client asks again from where the reply stops, as the spec allows;
/// CACHE, a hint, prefetches at most a payload's worth (32 MiB) of the 4 GiB asked.
#[test]
fn one_request_asks_the_device_about_a_bounded_range() {
    let asked = Asked::default();
    let server = Server::new(Arc::new(asked.clone()), ServerConfig::default());
    let mut s = raw(&server);
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    let mut msg = Vec::new();
    put_u32(&mut msg, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    put_option(&mut msg, OPT_STRUCTURED_REPLY, &[]);
    let mut meta = Vec::new();
    put_u32(&mut meta, 4);
    meta.extend_from_slice(b"disk");
    put_u32(&mut meta, 1);
    put_u32(&mut meta, BASE_ALLOCATION.len() as u32);
    meta.extend_from_slice(BASE_ALLOCATION.as_bytes());
    put_option(&mut msg, OPT_SET_META_CONTEXT, &meta);
    put_option(&mut msg, OPT_GO, &info_request("disk", &[]));
    s.write_all(&msg).expect("options");
    loop {
        let mut head = [0u8; 20];
        s.read_exact(&mut head).expect("option reply");
        let (option, kind, len) = (be_u32(&head[8..]), be_u32(&head[12..]), be_u32(&head[16..]));
        std::io::copy(&mut (&mut s).take(u64::from(len)), &mut std::io::sink()).expect("option data");
        assert_eq!(kind & (1 << 31), 0, "option {option} refused");
        if option == OPT_GO && kind == REP_ACK {
            break;
        }
    }
    let length: u32 = !4095;
    for (kind, flags) in [(CMD_BLOCK_STATUS, 0), (CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE), (CMD_CACHE, 0)] {
        let mut msg = Vec::new();
        overspill_nbd::request::RequestHeader { flags, kind, cookie: 1, offset: 4096, length }.encode(&mut msg);
        s.write_all(&msg).expect("request");
        let mut magic = [0u8; 4];
        s.read_exact(&mut magic).expect("reply");
        if be_u32(&magic) == SIMPLE_REPLY_MAGIC {
            let mut rest = [0u8; 12];
            s.read_exact(&mut rest).expect("simple reply");
            assert_eq!(be_u32(&rest), 0, "no error");
        } else {
            let mut rest = [0u8; 16];
            s.read_exact(&mut rest).expect("chunk header");
            let mut payload = vec![0u8; be_u32(&rest[12..]) as usize];
            s.read_exact(&mut payload).expect("chunk payload");
            assert_eq!(be_u16(&rest[2..]), REPLY_TYPE_BLOCK_STATUS);
            assert!(be_u32(&payload[4..]) > 0 && payload.len() == 12, "one descriptor covering part of the range");
        }
    }
    let asked = asked.0.lock().expect("asked").clone();
    assert_eq!(asked, vec![(CMD_BLOCK_STATUS, 256 << 20), (CMD_BLOCK_STATUS, 256 << 20), (CMD_CACHE, 32 << 20)]);
}

/// A TLS handshake shed to make room is counted once, as shed: the cut also fails its TLS
/// handshake, which is not counted again as a TLS failure.
#[test]
fn a_shed_tls_handshake_is_counted_once() {
    use overspill_net::{ServerTls, TlsMode};
    let dir = tempfile::tempdir().expect("tempdir");
    let keys = dir.path().join("keys.psk");
    std::fs::write(&keys, "alice:000102030405060708090a0b0c0d0e0f\n").expect("keys");
    let tls = ServerTls::psk(TlsMode::Require, &keys).expect("PSK credentials");
    let security = overspill_nbd::Security { tls: Some(Arc::new(tls)), access: None };
    let config = ServerConfig { max_handshakes: 1, security, ..ServerConfig::default() };
    let (server, socket) = accepting(dir.path(), config);
    let counters = server.counters();
    // A client that asks for TLS and never begins its TLS handshake.
    let mut slow = UnixStream::connect(&socket).expect("connect");
    slow.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let mut greeting = [0u8; 18];
    slow.read_exact(&mut greeting).expect("greeting");
    let mut hello = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    hello.extend(IHAVEOPT.to_be_bytes());
    hello.extend(OPT_STARTTLS.to_be_bytes());
    hello.extend(0u32.to_be_bytes());
    slow.write_all(&hello).expect("STARTTLS");
    let mut reply = [0u8; 20];
    slow.read_exact(&mut reply).expect("STARTTLS reply");
    assert_eq!(u32::from_be_bytes(reply[12..16].try_into().expect("4 bytes")), REP_ACK);
    // Past the shedding age, a newcomer waits in the backlog: the slow handshake is cut.
    std::thread::sleep(Duration::from_millis(1200));
    let _late = UnixStream::connect(&socket).expect("connect");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let count = |what: Refusal| counters.refusals().into_iter().find(|(r, _)| *r == what).map_or(0, |(_, n)| n);
    while count(Refusal::HandshakeShed) == 0 || server.active_connections() > 1 {
        assert!(std::time::Instant::now() < deadline, "the slow TLS handshake was not cut: {:?}", counters.refusals());
        std::thread::sleep(Duration::from_millis(10));
    }
    let others: Vec<_> =
        counters.refusals().into_iter().filter(|&(r, n)| r != Refusal::HandshakeShed && n > 0).collect();
    assert!(others.is_empty(), "the shed handshake counted again: {others:?}");
    drop(slow);
}
