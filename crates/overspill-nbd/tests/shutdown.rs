//! Draining a server over a real Unix listener: after `ShutdownHandle::shutdown` the accept loop
//! returns, a request being served is answered, idle connections are closed, connections still
//! in the handshake hear NBD_REP_ERR_SHUTDOWN for their next options and are closed soon after,
//! every device is dropped, and no acknowledged write is missing.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use overspill_block::{BlockDevice, Capabilities, DeviceError, ExportInfo, ExportProvider, ReadRequest};
use overspill_nbd::client::{Client, ClientError};
use overspill_nbd::memory::{MemoryDevice, OneExport};
use overspill_nbd::server::HANDSHAKE_SHUTDOWN_GRACE;
use overspill_nbd::wire::*;
use overspill_nbd::{Server, ServerConfig};
use overspill_net::{ListenAddr, Listener};

const SIZE: usize = 1 << 20;
const BLOCK: usize = 4096;
/// A write here takes [`SLOW`], so a test can shut down while it is being served.
const SLOW_OFFSET: u64 = (SIZE - BLOCK) as u64;
const SLOW: Duration = Duration::from_millis(400);

/// One shared in-memory disk whose devices count their drops and are slow at [`SLOW_OFFSET`].
struct Exports {
    inner: OneExport,
    opened: AtomicUsize,
    dropped: Arc<AtomicUsize>,
    slow_started: std::sync::Mutex<mpsc::Sender<()>>,
}

struct Device {
    inner: MemoryDevice,
    dropped: Arc<AtomicUsize>,
    slow_started: mpsc::Sender<()>,
}

impl Drop for Device {
    fn drop(&mut self) {
        self.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

impl BlockDevice for Device {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn read(&mut self, request: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.inner.read(request, offset, buf)
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        if offset == SLOW_OFFSET {
            let _ = self.slow_started.send(());
            std::thread::sleep(SLOW);
        }
        self.inner.write(offset, data, fua)
    }
    fn write_zeroes(
        &mut self,
        offset: u64,
        len: u64,
        may_trim: bool,
        fast: bool,
        fua: bool,
    ) -> Result<(), DeviceError> {
        self.inner.write_zeroes(offset, len, may_trim, fast, fua)
    }
    fn trim(&mut self, offset: u64, length: u64, fua: bool) -> Result<(), DeviceError> {
        self.inner.trim(offset, length, fua)
    }
    fn flush(&mut self) -> Result<(), DeviceError> {
        self.inner.flush()
    }
}

impl ExportProvider for Exports {
    fn list(&self) -> Vec<ExportInfo> {
        self.inner.list()
    }
    fn info(&self, name: &str) -> Option<ExportInfo> {
        self.inner.info(name)
    }
    fn open(&self, name: &str, identity: Option<&str>) -> Result<Box<dyn BlockDevice>, DeviceError> {
        self.inner.open(name, identity)?;
        self.opened.fetch_add(1, Ordering::SeqCst);
        let slow_started = self.slow_started.lock().expect("sender lock").clone();
        Ok(Box::new(Device { inner: self.inner.device().clone(), dropped: self.dropped.clone(), slow_started }))
    }
}

struct Harness {
    _dir: tempfile::TempDir,
    socket: std::path::PathBuf,
    server: Arc<Server>,
    exports: Arc<Exports>,
    slow_started: mpsc::Receiver<()>,
    accept_loop: std::thread::JoinHandle<std::io::Result<()>>,
    listener: Arc<Listener>,
}

fn start() -> Harness {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("nbd.sock");
    let listener = Arc::new(Listener::bind(&ListenAddr::Unix(socket.clone())).expect("bind"));
    let (tx, slow_started) = mpsc::channel();
    let exports = Arc::new(Exports {
        inner: OneExport::new("disk", SIZE),
        opened: AtomicUsize::new(0),
        dropped: Arc::new(AtomicUsize::new(0)),
        slow_started: std::sync::Mutex::new(tx),
    });
    let server = Arc::new(Server::new(exports.clone(), ServerConfig::default()));
    let accept_loop = {
        let (server, listener) = (server.clone(), listener.clone());
        std::thread::spawn(move || server.run(&listener))
    };
    Harness { _dir: dir, socket, server, exports, slow_started, accept_loop, listener }
}

fn connect(socket: &std::path::Path) -> Client {
    let stream = UnixStream::connect(socket).expect("connect");
    Client::handshake(Box::new(stream), "disk", true).expect("handshake")
}

/// A closed connection, not an NBD error reply: the server went away between requests.
#[track_caller]
fn assert_closed(error: &ClientError, who: &str) {
    assert!(error.errno().is_none(), "{who}: expected the connection to be closed, got an error reply: {error}");
}

fn block(i: u64) -> Vec<u8> {
    vec![(i as u8) | 1; BLOCK]
}

#[test]
fn shutdown_answers_the_request_in_hand_closes_everything_and_stops_accepting() {
    let h = start();
    let mut idle = connect(&h.socket);
    let mut in_handshake = UnixStream::connect(&h.socket).expect("connect");
    let mut greeting = [0u8; 18];
    in_handshake.read_exact(&mut greeting).expect("greeting");

    // A client streaming writes, one at a time, to distinct blocks until the connection closes.
    let streaming = {
        let socket = h.socket.clone();
        std::thread::spawn(move || {
            let mut client = connect(&socket);
            let mut acked = 0u64;
            loop {
                // Below the slow block, and wrapping so the stream outlasts any scheduling.
                let offset = (acked % (SLOW_OFFSET / BLOCK as u64)) * BLOCK as u64;
                match client.write(offset, &block(acked), false) {
                    Ok(()) => acked += 1,
                    Err(error) => return (acked, error),
                }
            }
        })
    };
    // A client whose write is being served when shutdown comes.
    let slow = {
        let socket = h.socket.clone();
        std::thread::spawn(move || {
            let mut client = connect(&socket);
            let written = client.write(SLOW_OFFSET, &[0xee; BLOCK], false);
            let after = client.write(0, &[0xdd; BLOCK], false);
            (written, after)
        })
    };
    h.slow_started.recv_timeout(Duration::from_secs(5)).expect("the slow write started");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(h.server.active_connections(), 4);

    let started = Instant::now();
    h.server.shutdown_handle().shutdown();
    h.accept_loop.join().expect("accept thread").expect("run returns Ok after shutdown");
    assert!(h.server.wait_idle(Duration::from_secs(5)), "connections still open: {}", h.server.active_connections());
    let took = started.elapsed();
    assert!(took >= SLOW / 2, "the slow request was waited for, not cut off ({took:?})");
    assert!(took < Duration::from_secs(3), "drained in {took:?}");
    let opened = h.exports.opened.load(Ordering::SeqCst);
    assert_eq!(opened, 3, "idle, streaming and slow clients opened devices");
    assert_eq!(h.exports.dropped.load(Ordering::SeqCst), opened, "every device was dropped");

    let (written, after) = slow.join().expect("slow client");
    written.expect("the request in hand when shutdown came was answered");
    assert_closed(&after.expect_err("no request is served after shutdown"), "slow client");

    let (acked, error) = streaming.join().expect("streaming client");
    assert_closed(&error, "streaming client");
    assert!(acked > 0, "the streaming client got some writes in");
    // Every acknowledged write is on the disk, and nothing after the last one was applied.
    let disk = h.exports.inner.device().snapshot();
    let blocks = SLOW_OFFSET / BLOCK as u64;
    for i in acked.saturating_sub(blocks)..acked {
        let offset = ((i % blocks) * BLOCK as u64) as usize;
        assert_eq!(disk[offset..offset + BLOCK], block(i)[..], "acknowledged write {i} of {acked}");
    }
    assert_eq!(disk[SLOW_OFFSET as usize..], [0xee; BLOCK][..]);

    let mut buf = [0u8; BLOCK];
    assert_closed(&idle.read(0, &mut buf).expect_err("the idle connection was closed"), "idle client");
    let mut rest = Vec::new();
    assert_eq!(in_handshake.read_to_end(&mut rest).expect("end of stream"), 0, "handshake connection closed");

    // The socket goes with the listener, so no client can connect to a server that is gone.
    let h_socket = h.socket.clone();
    drop(h.listener);
    assert!(!h_socket.exists(), "the Unix socket was removed");
    assert!(UnixStream::connect(&h_socket).is_err());
}

#[test]
fn an_idle_server_stops_at_once_and_a_second_shutdown_is_harmless() {
    let h = start();
    // Give the accept loop time to block in accept, so the wake-up is what ends it.
    std::thread::sleep(Duration::from_millis(50));
    let started = Instant::now();
    let handle = h.server.shutdown_handle();
    handle.shutdown();
    handle.shutdown();
    assert!(handle.is_requested());
    h.accept_loop.join().expect("accept thread").expect("run returns Ok");
    assert!(h.server.wait_idle(Duration::from_secs(1)));
    assert!(started.elapsed() < Duration::from_secs(1), "took {:?}", started.elapsed());
    assert_eq!(h.exports.opened.load(Ordering::SeqCst), 0, "the wake-up connection opened no device");
}

/// A server of one export of `size` bytes on a TCP port of its own: the server, its address,
/// its accept loop.
fn tcp_server(size: usize) -> (Arc<Server>, String, std::thread::JoinHandle<std::io::Result<()>>) {
    let listener = Arc::new(Listener::bind(&ListenAddr::Tcp("127.0.0.1:0".into())).expect("bind"));
    let ListenAddr::Tcp(addr) = listener.local_addr() else { panic!("a TCP listener has a TCP address") };
    let server = Arc::new(Server::new(Arc::new(OneExport::new("disk", size)), ServerConfig::default()));
    let accept_loop = {
        let server = server.clone();
        std::thread::spawn(move || server.run(&listener))
    };
    (server, addr, accept_loop)
}

/// The same drain over TCP: shutting a TCP socket for reading also wakes a blocked read.
#[test]
fn shutdown_closes_idle_tcp_connections() {
    let (server, addr, accept_loop) = tcp_server(SIZE);
    let stream = std::net::TcpStream::connect(&addr).expect("connect");
    let mut client = Client::handshake(Box::new(stream), "disk", false).expect("handshake");
    client.write(0, &[7; BLOCK], false).expect("write");
    server.shutdown_handle().shutdown();
    accept_loop.join().expect("accept thread").expect("run returns Ok");
    assert!(server.wait_idle(Duration::from_secs(2)), "the idle TCP connection was closed");
    let mut buf = [0u8; BLOCK];
    assert_closed(&client.read(0, &mut buf).expect_err("closed"), "TCP client");
}

/// A TCP client is probed while idle (keepalive): a client host that dies without a word is
/// found gone, its VM free to connect again, rather than held "connected" for ever. The kernel
/// shows the server's end of the connection with its keepalive timer running (`/proc/net/tcp`,
/// timer 2), an idle socket without keepalive with none.
#[test]
fn idle_tcp_connections_are_probed_by_keepalive() {
    let (server, addr, accept_loop) = tcp_server(SIZE);
    let stream = std::net::TcpStream::connect(&addr).expect("connect");
    let (server_port, client_port) =
        (stream.peer_addr().expect("peer").port(), stream.local_addr().expect("local").port());
    let mut client = Client::handshake(Box::new(stream), "disk", false).expect("handshake");
    client.write(0, &[7; BLOCK], false).expect("write");
    // Timer 2 is the socket's own timer: keepalive, on an established socket.
    let timer_of = |local: u16, remote: u16| -> Option<String> {
        let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
        table.lines().skip(1).find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let port = |field: &str| u16::from_str_radix(field.rsplit(':').next()?, 16).ok();
            (port(fields[1]) == Some(local) && port(fields[2]) == Some(remote))
                .then(|| fields[5].split(':').next().unwrap_or_default().to_owned())
        })
    };
    // Once the last reply is acknowledged (until then the retransmission timer, 1, shows).
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut server_end, mut client_end) = (None, None);
    while Instant::now() < deadline {
        (server_end, client_end) = (timer_of(server_port, client_port), timer_of(client_port, server_port));
        if server_end.as_deref() == Some("02") && client_end.as_deref() == Some("00") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(server_end.as_deref(), Some("02"), "the server's end is not probed");
    assert_eq!(client_end.as_deref(), Some("00"), "the client's end (no keepalive)");
    server.shutdown_handle().shutdown();
    accept_loop.join().expect("accept thread").expect("run returns Ok");
}

/// A stop over TCP while the client has a request the server never read (it was still
/// writing the reply before it): the reply it was writing reaches the client whole before the
/// connection ends. Closed with unread input, a TCP socket resets, and the kernel throws away
/// the reply's bytes not yet sent.
#[test]
fn a_stop_over_tcp_delivers_the_reply_in_hand_whole() {
    const LARGE: usize = 32 << 20;
    let (server, addr, accept_loop) = tcp_server(LARGE);
    // A small receive buffer, set before the connection is made (the window is taken then):
    // the server's last bytes are still in its send queue when it closes.
    let stream = {
        use rustix::net::{sockopt, AddressFamily, SocketType};
        let socket = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).expect("socket");
        sockopt::set_socket_recv_buffer_size(&socket, 64 << 10).expect("SO_RCVBUF");
        let to: std::net::SocketAddr = addr.parse().expect("address");
        rustix::net::connect(&socket, &to).expect("connect");
        std::net::TcpStream::from(socket)
    };
    let mut client = Client::handshake(Box::new(stream), "disk", false).expect("handshake");
    client.write(LARGE as u64 - BLOCK as u64, &[0x5a; BLOCK], false).expect("write");
    // More than the sockets' buffers hold: the server is still writing it when the next comes.
    let large = client.send_request(CMD_READ, 0, 0, LARGE as u32, &[]).expect("send");
    std::thread::sleep(Duration::from_millis(300));
    let unread = client.send_request(CMD_READ, 0, 0, BLOCK as u32, &[]).expect("send");
    std::thread::sleep(Duration::from_millis(100));
    server.shutdown_handle().shutdown();
    let mut buf = vec![0u8; LARGE];
    client.reply(large, Some((0, &mut buf))).expect("the reply in hand, whole");
    assert!(buf[LARGE - BLOCK..].iter().all(|&b| b == 0x5a), "its last block");
    assert_closed(&client.reply(unread, None).expect_err("never read, never answered"), "TCP client");
    accept_loop.join().expect("accept thread").expect("run returns Ok");
}

/// Someone removed the Unix socket file (a careless cleanup, another server binding the path):
/// no connection can reach the accept loop any more, and shutdown must still end it.
#[test]
fn shutdown_ends_the_accept_loop_even_when_the_socket_file_is_gone() {
    let h = start();
    std::thread::sleep(Duration::from_millis(50));
    std::fs::remove_file(&h.socket).expect("remove the socket file");
    h.server.shutdown_handle().shutdown();
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(h.accept_loop.join());
    });
    let ended = finished.recv_timeout(Duration::from_secs(30)).expect("the accept loop ended");
    ended.expect("accept thread").expect("run returns Ok");
}

/// Reads one option reply: (option, type, payload).
fn option_reply(stream: &mut UnixStream) -> (u32, u32, Vec<u8>) {
    let mut header = [0u8; 20];
    stream.read_exact(&mut header).expect("option reply header");
    assert_eq!(be_u64(&header), OPTION_REPLY_MAGIC);
    let mut payload = vec![0u8; be_u32(&header[16..]) as usize];
    stream.read_exact(&mut payload).expect("option reply payload");
    (be_u32(&header[8..]), be_u32(&header[12..]), payload)
}

/// A client in the middle of its handshake when shutdown comes: its next options are answered
/// NBD_REP_ERR_SHUTDOWN (GO included, so it never opens the export), its ABORT is acknowledged
/// and the connection closes; one that stays silent is closed after the grace.
#[test]
fn options_during_shutdown_get_err_shutdown_and_abort_ends_the_session() {
    let h = start();
    let mut talking = UnixStream::connect(&h.socket).expect("connect");
    let mut silent = UnixStream::connect(&h.socket).expect("connect");
    let mut greeting = [0u8; 18];
    for stream in [&mut talking, &mut silent] {
        stream.read_exact(&mut greeting).expect("greeting");
    }
    let mut hello = Vec::new();
    put_u32(&mut hello, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    put_option(&mut hello, OPT_STRUCTURED_REPLY, &[]);
    talking.write_all(&hello).expect("send");
    assert_eq!(option_reply(&mut talking).1, REP_ACK, "before shutdown, options are served");

    let started = Instant::now();
    h.server.shutdown_handle().shutdown();
    h.accept_loop.join().expect("accept thread").expect("run returns Ok after shutdown");
    for (option, data) in [(OPT_LIST, Vec::new()), (OPT_GO, info_request("disk", &[])), (0x4242, b"x".to_vec())] {
        let mut message = Vec::new();
        put_option(&mut message, option, &data);
        talking.write_all(&message).expect("the server still reads options");
        let (answered, kind, text) = option_reply(&mut talking);
        assert_eq!((answered, kind), (option, REP_ERR_SHUTDOWN), "option {option}: {}", String::from_utf8_lossy(&text));
    }
    let mut abort = Vec::new();
    put_option(&mut abort, OPT_ABORT, &[]);
    talking.write_all(&abort).expect("send ABORT");
    assert_eq!(option_reply(&mut talking).1, REP_ACK, "ABORT is acknowledged during shutdown");
    let mut rest = Vec::new();
    assert_eq!(talking.read_to_end(&mut rest).expect("end of stream"), 0, "closed after ABORT");

    assert_eq!(silent.read_to_end(&mut rest).expect("end of stream"), 0, "the silent handshake is closed");
    assert!(h.server.wait_idle(Duration::from_secs(5)), "connections still open: {}", h.server.active_connections());
    let took = started.elapsed();
    assert!(took >= HANDSHAKE_SHUTDOWN_GRACE, "the silent handshake had its grace ({took:?})");
    assert!(took < HANDSHAKE_SHUTDOWN_GRACE * 3, "the silent handshake was closed in {took:?}");
    assert_eq!(h.exports.opened.load(Ordering::SeqCst), 0, "no export was opened during shutdown");
}
