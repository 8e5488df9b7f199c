//! Listening sockets and the accept loop: one thread per connection, a cap on connections.
//!
//! A [`ShutdownHandle`] drains a server: the accept loop returns, every connection answers the
//! request in hand and closes (see [`crate::connection::serve_connection_until`]), and
//! [`Server::wait_idle`] waits for their threads, so that whatever their devices hold is dropped
//! before the process exits.
//!
//! Threads rather than an async runtime: each VM's requests are served in order by the overlay
//! that owns its state, the work is memcpy or local file I/O that would block an executor anyway,
//! and a blocking read gives the lowest latency at queue depth 1. Hundreds of VMs are hundreds of
//! mostly idle threads, which Linux handles well.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::connection::{serve_tracked, ConnectionError, Ending, Limits, ReadStopper, Security, Transport};
use crate::counters::{ProtocolCounters, Refusal};
use crate::ExportProvider;

/// Where a server listens: `unix:PATH` or `tcp:HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Unix(PathBuf),
    Tcp(String),
}

impl ListenAddr {
    /// The NBD URI (as libnbd, qemu and nbdinfo take it) of `export` at this address.
    pub fn nbd_uri(&self, export: &str, tls: bool) -> String {
        let scheme = if tls { "nbds" } else { "nbd" };
        match self {
            Self::Unix(path) => format!("{scheme}+unix:///{export}?socket={}", path.display()),
            Self::Tcp(address) => format!("{scheme}://{address}/{export}"),
        }
    }
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path".into());
            }
            Ok(Self::Unix(path.into()))
        } else if let Some(addr) = s.strip_prefix("tcp:") {
            if !addr.contains(':') {
                return Err(format!("tcp:{addr} needs HOST:PORT"));
            }
            Ok(Self::Tcp(addr.to_owned()))
        } else {
            Err(format!("{s:?}: use unix:PATH or tcp:HOST:PORT"))
        }
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unix(path) => write!(f, "unix:{}", path.display()),
            Self::Tcp(addr) => write!(f, "tcp:{addr}"),
        }
    }
}

/// A bound listening socket. A Unix socket remembers the file it made, so that it removes that
/// file and nothing else when it goes; one handed over by systemd (`None`) made nothing.
#[derive(Debug)]
pub enum Listener {
    Unix(UnixListener, PathBuf, Option<FileIdentity>),
    Tcp(TcpListener, Origin),
}

/// Whether this process bound a socket or was handed it (socket activation): a socket the
/// service manager holds too must be left able to accept for the next server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Bound,
    Inherited,
}

/// Device and inode of a file, to tell "the socket we made" from whatever replaced it since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    device: u64,
    inode: u64,
}

impl FileIdentity {
    fn of(path: &std::path::Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let metadata = std::fs::symlink_metadata(path).ok()?;
        Some(Self { device: metadata.dev(), inode: metadata.ino() })
    }
}

impl Listener {
    /// Binds the address. At a Unix path, only a stale socket (a socket file nobody accepts on)
    /// is replaced: a live socket, or anything that is not a socket (a golden image given by
    /// mistake), is an error that names the path, and nothing is removed. The path's directory
    /// is locked meanwhile, so that two servers starting at once cannot both take it for stale.
    pub fn bind(addr: &ListenAddr) -> std::io::Result<Self> {
        match addr {
            ListenAddr::Unix(path) => {
                // Two servers starting at once on one path would both find its socket stale, and
                // the later removal could take the socket the other had just made: the check,
                // the removal and the bind happen under a lock on the directory.
                let _directory = lock_directory_of(path)?;
                remove_stale_socket(path)?;
                let listener = UnixListener::bind(path)
                    .map_err(|e| std::io::Error::new(e.kind(), format!("binding {}: {e}", path.display())))?;
                Ok(Self::Unix(listener, path.clone(), FileIdentity::of(path)))
            }
            ListenAddr::Tcp(addr) => TcpListener::bind(addr.as_str())
                .map(|listener| Self::Tcp(listener, Origin::Bound))
                .map_err(|e| std::io::Error::new(e.kind(), format!("binding {addr}: {e}"))),
        }
    }

    /// A listening socket this process was handed (systemd's socket activation): a Unix or TCP
    /// stream socket already listening. Its file, if it has one, is left where it is.
    pub fn from_inherited(socket: std::os::fd::OwnedFd) -> std::io::Result<Self> {
        use rustix::net::{sockopt, AddressFamily, SocketAddrUnix, SocketType};
        let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, what.to_owned());
        if sockopt::socket_type(&socket)? != SocketType::STREAM || !sockopt::socket_acceptconn(&socket)? {
            return Err(invalid("the inherited socket is not a listening stream socket"));
        }
        let address = rustix::net::getsockname(&socket)?;
        match address.address_family() {
            AddressFamily::UNIX => {
                let unix = SocketAddrUnix::try_from(address)?;
                let path =
                    unix.path_bytes().map(|p| PathBuf::from(std::ffi::OsStr::from_bytes(p))).ok_or_else(|| {
                        invalid("the inherited Unix socket has no path (abstract or unnamed sockets are not served)")
                    })?;
                Ok(Self::Unix(UnixListener::from(socket), path, None))
            }
            AddressFamily::INET | AddressFamily::INET6 => Ok(Self::Tcp(TcpListener::from(socket), Origin::Inherited)),
            _ => Err(invalid("the inherited socket is neither Unix nor TCP")),
        }
    }

    /// A second descriptor of the listening socket: a server that restarts in place hands it to
    /// the program it becomes.
    pub fn duplicate_fd(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        Ok(match self {
            Self::Unix(l, ..) => l.try_clone()?.into(),
            Self::Tcp(l, _) => l.try_clone()?.into(),
        })
    }

    /// Whether this listener was handed over rather than bound here.
    pub fn is_inherited(&self) -> bool {
        matches!(self, Self::Unix(_, _, None) | Self::Tcp(_, Origin::Inherited))
    }

    /// The bound address, with the real port when port 0 was asked for.
    pub fn local_addr(&self) -> ListenAddr {
        match self {
            Self::Unix(_, path, _) => ListenAddr::Unix(path.clone()),
            Self::Tcp(listener, _) => {
                ListenAddr::Tcp(listener.local_addr().map(|a: SocketAddr| a.to_string()).unwrap_or_else(|_| "?".into()))
            }
        }
    }
}

/// The directory `path` is in, locked (`flock`, exclusive) until the returned file is dropped;
/// `None` where the filesystem keeps no such locks, or the directory cannot be opened for
/// reading (one this user may only write to and pass through): binding goes on unlocked then,
/// as a lock no server can take guards nothing.
fn lock_directory_of(path: &std::path::Path) -> std::io::Result<Option<std::fs::File>> {
    use rustix::fs::{flock, FlockOperation};
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => std::path::Path::new("."),
    };
    let Ok(directory) = std::fs::File::open(dir) else { return Ok(None) };
    loop {
        match flock(&directory, FlockOperation::LockExclusive) {
            Ok(()) => return Ok(Some(directory)),
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::NOLCK | rustix::io::Errno::OPNOTSUPP) => return Ok(None),
            Err(e) => return Err(std::io::Error::new(e.kind(), format!("locking {}: {e}", dir.display()))),
        }
    }
}

/// The process that listens on the socket `stream` is connected to (Linux records it at
/// `listen()`), when the kernel says: not for one in a PID namespace this process cannot see
/// (the kernel says 0 then).
fn peer_pid(stream: &UnixStream) -> Option<u32> {
    let credentials = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials).ok()?;
    u32::try_from(credentials.pid()).ok().filter(|&pid| pid != 0)
}

/// Makes room for a new socket at `path`: nothing there, or a socket file that refuses
/// connections (its server died, or was exiting and has gone since) and is removed. Anything
/// else is left as it is and refused.
fn remove_stale_socket(path: &std::path::Path) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    use std::os::unix::fs::FileTypeExt;
    let metadata = match std::fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::new(e.kind(), format!("{}: {e}", path.display()))),
    };
    if !metadata.file_type().is_socket() {
        return Err(Error::new(
            ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket; it is left alone (choose another --listen path)", path.display()),
        ));
    }
    match UnixStream::connect(path) {
        // A killed predecessor's socket accepts until the kernel has torn down its memory: one
        // that is exiting is waited for (bounded), then the socket is stale.
        Ok(stream) => {
            if let Some(pid) = peer_pid(&stream).filter(|&pid| crate::exiting::exiting(pid)) {
                drop(stream);
                let what = "the server listening on this socket";
                if crate::exiting::wait_until_gone(pid, what, crate::exiting::EXIT_WAIT) {
                    return remove_stale_socket(path);
                }
            }
            Err(Error::new(ErrorKind::AddrInUse, format!("a server is already listening on {}", path.display())))
        }
        // Only "nobody accepts here" proves the socket stale; a permission error proves nothing.
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => std::fs::remove_file(path)
            .map_err(|e| Error::new(e.kind(), format!("removing the stale socket {}: {e}", path.display()))),
        Err(e) => Err(Error::new(e.kind(), format!("{} is a socket that cannot be checked: {e}", path.display()))),
    }
}

/// Wakes the accept loop at once, where it may: a socket of this server's own is shut for
/// reading, which makes a waiting poll or accept return on Linux, even when its Unix socket
/// file is gone. One the service manager holds must stay open (shut, it would refuse the next
/// server's clients too): the loop sees the flag within [`ACCEPT_LOOK_AGAIN`].
#[derive(Debug)]
struct ListenerWaker {
    socket: std::os::fd::OwnedFd,
    may_shut: bool,
}

impl ListenerWaker {
    fn wake(&self) {
        if self.may_shut {
            let _ = rustix::net::shutdown(&self.socket, rustix::net::Shutdown::Read);
        }
    }
}

/// How long the accept loop waits for a client before it looks at the shutdown flag again: the
/// waker may not shut a socket systemd holds, and a connection of our own to its path may be
/// refused to this service's user (the shipped unit's socket is root's and libvirt's, mode
/// 0660), so an idle server would otherwise stop or restart only when the next client came.
const ACCEPT_LOOK_AGAIN: Duration = Duration::from_millis(200);

impl Listener {
    /// Whether a client is waiting to be accepted, after waiting up to `patience` for one (or
    /// the socket to fail: accept then says how).
    fn client_waiting(&self, patience: Duration) -> bool {
        use rustix::event::{poll, PollFd, PollFlags};
        let fd: std::os::fd::BorrowedFd<'_> = match self {
            Self::Unix(l, ..) => l.as_fd(),
            Self::Tcp(l, _) => l.as_fd(),
        };
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        let timeout = rustix::event::Timespec::try_from(patience).ok();
        // An error (EINTR) is looked at again by the caller's loop, which checks the flag.
        poll(&mut fds, timeout.as_ref()).is_ok_and(|ready| ready > 0)
    }

    fn waker(&self) -> std::io::Result<ListenerWaker> {
        let socket = match self {
            Self::Unix(l, ..) => l.try_clone()?.into(),
            Self::Tcp(l, _) => l.try_clone()?.into(),
        };
        Ok(ListenerWaker { socket, may_shut: !self.is_inherited() })
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Only the socket this listener made: the path may have been taken over since, or the
        // socket may be systemd's.
        if let Self::Unix(_, path, Some(made)) = self {
            if FileIdentity::of(path) == Some(*made) {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub limits: Limits,
    pub max_connections: usize,
    /// Connections still in their handshake at once (part of `max_connections`): past it, new
    /// clients wait in the listen backlog and the oldest handshake is cut off once it has had
    /// its share of time, so slow clients cannot hold the door shut.
    pub max_handshakes: usize,
    pub security: Security,
    /// Where error replies and refusals are counted (the metrics read them).
    pub counters: Arc<ProtocolCounters>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            max_connections: 1024,
            max_handshakes: 128,
            security: Security::default(),
            counters: Arc::default(),
        }
    }
}

pub struct Server {
    exports: Arc<dyn ExportProvider>,
    config: ServerConfig,
    active: Arc<AtomicUsize>,
    handshakes: Arc<Mutex<Handshakes>>,
    shutdown: ShutdownHandle,
}

/// Connections still in their handshake, oldest first (keys only grow), each with when it
/// began and what cuts it off; and those cut off whose threads have not ended yet, which no
/// longer count as connections.
#[derive(Default)]
struct Handshakes {
    next_key: u64,
    live: BTreeMap<u64, (Instant, ReadStopper)>,
    shed: HashSet<u64>,
}

/// A connection's place among the handshakes: given up when its handshake ends, and its mark
/// as shed when its thread ends.
struct HandshakeEntry {
    handshakes: Arc<Mutex<Handshakes>>,
    key: Option<u64>,
}

impl HandshakeEntry {
    fn release(&mut self) {
        if let Some(key) = self.key {
            lock(&self.handshakes).live.remove(&key);
        }
    }
}

impl Drop for HandshakeEntry {
    fn drop(&mut self) {
        if let Some(key) = self.key {
            let mut handshakes = lock(&self.handshakes);
            handshakes.live.remove(&key);
            handshakes.shed.remove(&key);
        }
    }
}

/// Releases a connection slot however the connection's thread ends.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Stops a [`Server`] from any thread (a signal handler's, typically); cheap to clone.
#[derive(Clone, Default)]
pub struct ShutdownHandle(Arc<ShutdownState>);

#[derive(Default)]
struct ShutdownState {
    stop: AtomicBool,
    /// The accept loops' sockets (second descriptors of them), to wake the loops.
    listening: Mutex<Vec<ListenerWaker>>,
    /// What wakes each live connection blocked on a read.
    connections: Mutex<HashMap<u64, Registered>>,
    next_key: AtomicU64,
}

impl fmt::Debug for ShutdownHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShutdownHandle").field("requested", &self.is_requested()).finish_non_exhaustive()
    }
}

/// The registries hold only wake-up handles: a panic elsewhere leaves them usable.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl ShutdownHandle {
    pub fn is_requested(&self) -> bool {
        self.0.stop.load(Ordering::SeqCst)
    }

    /// Stops accepting and tells every connection to close after the request in hand. Returns
    /// at once; [`Server::wait_idle`] waits for the connections to go. Connections still in
    /// their handshake are stopped [`HANDSHAKE_SHUTDOWN_GRACE`] later: meanwhile their next
    /// option is answered NBD_REP_ERR_SHUTDOWN, as the spec asks, and a client that ABORTs
    /// leaves cleanly.
    pub fn shutdown(&self) {
        if self.0.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        for waker in lock(&self.0.listening).iter() {
            waker.wake();
        }
        let connections = lock(&self.0.connections);
        tracing::info!(connections = connections.len(), "shutting down: closing connections after their requests");
        let mut handshaking = 0;
        for connection in connections.values() {
            if connection.handshaking.load(Ordering::SeqCst) {
                handshaking += 1;
            } else {
                connection.stop();
            }
        }
        if handshaking > 0 {
            let handle = self.clone();
            let spawned = std::thread::Builder::new().name("nbd-shutdown".into()).spawn(move || {
                std::thread::sleep(HANDSHAKE_SHUTDOWN_GRACE);
                lock(&handle.0.connections).values().for_each(Registered::stop);
            });
            if spawned.is_err() {
                connections.values().for_each(Registered::stop);
            }
        }
    }

    /// Registers a connection's stopper; stops it at once if shutdown has begun.
    fn register(&self, id: u64, connection: Registered) {
        let mut connections = lock(&self.0.connections);
        // Checked under the lock that shutdown() takes after setting the flag, so a connection
        // registered while it runs is either in its list or sees the flag here.
        if self.is_requested() {
            connection.stop();
        }
        connections.insert(id, connection);
    }

    fn unregister(&self, id: u64) {
        lock(&self.0.connections).remove(&id);
    }
}

/// Forgets a connection's stopper (and closes its second descriptor) when its thread ends.
struct Registration {
    shutdown: ShutdownHandle,
    id: u64,
}

/// How long connections still in their handshake may go on after shutdown begins: long enough
/// for a client to send its next option, hear NBD_REP_ERR_SHUTDOWN and ABORT.
pub const HANDSHAKE_SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// A live connection as shutdown sees it.
struct Registered {
    stopper: ReadStopper,
    /// Still negotiating: shutdown stops it only after [`HANDSHAKE_SHUTDOWN_GRACE`].
    handshaking: Arc<AtomicBool>,
}

impl Registered {
    fn stop(&self) {
        // The peer may be gone already; nothing is left to wake then.
        let _ = (self.stopper)();
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.shutdown.unregister(self.id);
    }
}

impl Server {
    /// Where this server counts error replies and refusals.
    pub fn counters(&self) -> Arc<ProtocolCounters> {
        self.config.counters.clone()
    }

    pub fn new(exports: Arc<dyn ExportProvider>, config: ServerConfig) -> Self {
        Self {
            exports,
            config,
            active: Arc::new(AtomicUsize::new(0)),
            handshakes: Arc::default(),
            shutdown: ShutdownHandle::default(),
        }
    }

    /// How long a handshake is left alone before a newcomer may take its place: a real
    /// client's handshake takes milliseconds, TLS included, even on a loaded host.
    fn shed_age(&self) -> Duration {
        (self.config.limits.handshake_timeout / 2).min(Duration::from_secs(1))
    }

    fn handshakes_full(&self) -> bool {
        lock(&self.handshakes).live.len() >= self.config.max_handshakes
    }

    /// Connections that count against `max_connections`: not those shed and still ending.
    fn connections(&self) -> usize {
        let shed = lock(&self.handshakes).shed.len();
        self.active.load(Ordering::Relaxed).saturating_sub(shed)
    }

    /// Whether a newcomer must wait in the backlog: every handshake slot is taken, or every
    /// connection is and some of them are still handshakes that may be shed soon.
    fn must_wait(&self) -> bool {
        let handshakes = lock(&self.handshakes).live.len();
        handshakes >= self.config.max_handshakes
            || (handshakes > 0 && self.connections() >= self.config.max_connections)
    }

    /// Cuts off the oldest handshake if it has had [`Self::shed_age`]; whether one was.
    fn shed_oldest_handshake(&self) -> bool {
        let shed = {
            let mut handshakes = lock(&self.handshakes);
            match handshakes.live.first_key_value() {
                Some((&key, (began, _))) if began.elapsed() >= self.shed_age() => {
                    handshakes.shed.insert(key);
                    handshakes.live.remove(&key)
                }
                _ => None,
            }
        };
        let Some((began, stop)) = shed else { return false };
        tracing::info!(after = ?began.elapsed(), "slowest handshake cut off to make room");
        self.config.counters.refused(Refusal::HandshakeShed);
        // A stream that cannot be shut now ends at its handshake's deadline anyway.
        let _ = stop();
        true
    }

    pub fn active_connections(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// The handle that stops this server.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// Waits until no connection is left, or `timeout` passes; whether none is left.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.active_connections() > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    /// Accepts connections until shutdown is requested; each is served on its own thread.
    pub fn run(&self, listener: &Listener) -> std::io::Result<()> {
        lock(&self.shutdown.0.listening).push(listener.waker()?);
        let mut next_id = 0u64;
        let mut failures = AcceptFailures::default();
        loop {
            if self.shutdown.is_requested() {
                tracing::info!(listen = %listener.local_addr(), "no longer accepting connections");
                return Ok(());
            }
            // Slow handshakes fill their slots: new clients wait in the backlog meanwhile, and
            // the oldest handshake goes once it has had its time, if a client is waiting: a
            // handshake that only is slow (a client pausing between options) harms nobody.
            while self.must_wait() && !self.shutdown.is_requested() {
                if !(listener.client_waiting(Duration::ZERO) && self.shed_oldest_handshake()) {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            if !listener.client_waiting(ACCEPT_LOOK_AGAIN) {
                continue;
            }
            next_id += 1;
            let accepted = match listener {
                Listener::Unix(l, ..) => l.accept().map(|(s, _)| self.spawn_unless_stopping(s, next_id, "unix".into())),
                Listener::Tcp(l, _) => l.accept().map(|(s, peer)| {
                    // Replies are batched by the connection; Nagle would only add latency.
                    let _ = s.set_nodelay(true);
                    self.spawn_unless_stopping(s, next_id, peer.to_string())
                }),
            };
            match accepted {
                Ok(()) => {}
                // The listening socket shut by the shutdown's waker: nothing went wrong.
                Err(_) if self.shutdown.is_requested() => {}
                // Out of file descriptors or a client that reset before accept: keep serving.
                Err(error) => {
                    failures.note(&error);
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
        }
    }

    /// Once shutdown has begun, what accept returns is our own wake-up or a client too late:
    /// closing it at once is its answer.
    fn spawn_unless_stopping<T: Transport>(&self, stream: T, id: u64, peer: String) {
        if !self.shutdown.is_requested() {
            self.spawn(stream, id, peer);
        }
    }

    /// Serves one already-connected stream on a new thread (also used for socketpairs in tests).
    pub fn spawn<T: Transport>(&self, stream: T, id: u64, peer: String) {
        self.active.fetch_add(1, Ordering::Relaxed);
        let slot = Slot(self.active.clone());
        // Full: a slow handshake gives way before a newcomer is turned away.
        if self.connections() > self.config.max_connections && !self.shed_oldest_handshake() {
            tracing::warn!(peer, limit = self.config.max_connections, "connection refused: too many connections");
            self.config.counters.refused(Refusal::TooManyConnections);
            return;
        }
        if self.handshakes_full() && !self.shed_oldest_handshake() {
            tracing::warn!(peer, limit = self.config.max_handshakes, "connection refused: too many handshakes");
            self.config.counters.refused(Refusal::TooManyHandshakes);
            return;
        }
        let mut handshake = HandshakeEntry { handshakes: self.handshakes.clone(), key: None };
        if let Some(stop) = stream.read_stopper() {
            let mut handshakes = lock(&self.handshakes);
            let key = handshakes.next_key;
            handshakes.next_key += 1;
            handshakes.live.insert(key, (Instant::now(), stop));
            handshake.key = Some(key);
        }
        // Connection ids need not be unique (socketpairs all use 0): the registry keys on its own.
        let key = self.shutdown.0.next_key.fetch_add(1, Ordering::Relaxed);
        let handshaking = Arc::new(AtomicBool::new(true));
        let registration = match stream.read_stopper() {
            Some(stopper) => {
                self.shutdown.register(key, Registered { stopper, handshaking: handshaking.clone() });
                Some(Registration { shutdown: self.shutdown.clone(), id: key })
            }
            None => None,
        };
        let exports = self.exports.clone();
        let limits = self.config.limits.clone();
        let security = self.config.security.clone();
        let counters = self.config.counters.clone();
        let shutdown = self.shutdown.clone();
        let spawned = std::thread::Builder::new().name(format!("nbd-{id}")).spawn(move || {
            let _slot = slot;
            let _registration = registration;
            let ending =
                serve_tracked(stream, exports.as_ref(), &limits, &security, &counters, &shutdown.0.stop, &mut || {
                    handshaking.store(false, Ordering::SeqCst);
                    handshake.release()
                });
            log_ending(id, &peer, ending);
        });
        if let Err(error) = spawned {
            tracing::error!(%error, "could not start a connection thread");
        }
    }
}

fn log_ending(id: u64, peer: &str, ending: Result<Ending, ConnectionError>) {
    match ending {
        Ok(Ending::NoExport) => tracing::debug!(connection = id, peer, "closed during handshake"),
        Ok(Ending::Disconnected { export, requests }) => {
            tracing::info!(connection = id, peer, export, requests, "disconnected")
        }
        Err(ConnectionError::Io(error)) => tracing::info!(connection = id, peer, %error, "connection lost"),
        Err(ConnectionError::Abandoned(why)) => tracing::warn!(connection = id, peer, why, "connection closed"),
        Err(error) => tracing::warn!(connection = id, peer, %error, "connection closed: bad input"),
    }
}

/// Connects a client to a server over a fresh Unix socketpair, returning the client end.
pub fn socketpair(server: &Server) -> std::io::Result<UnixStream> {
    let (client, server_end) = UnixStream::pair()?;
    server.spawn(server_end, 0, "socketpair".into());
    Ok(client)
}

/// Failed accepts, logged at most every few seconds: while the process is out of file
/// descriptors the waiting client stays in the backlog and every retry fails the same way.
#[derive(Default)]
struct AcceptFailures {
    last_logged: Option<Instant>,
    since_logged: u64,
}

impl AcceptFailures {
    const EVERY: Duration = Duration::from_secs(10);

    fn note(&mut self, error: &std::io::Error) {
        self.since_logged += 1;
        if self.last_logged.is_some_and(|t| t.elapsed() < Self::EVERY) {
            return;
        }
        let failures = std::mem::take(&mut self.since_logged);
        // EMFILE and ENFILE (Linux's numbers): the server's or the system's table is full.
        if matches!(error.raw_os_error(), Some(23 | 24)) {
            tracing::warn!(%error, failures, "accept failed: out of file descriptors; new VMs wait until some leave (raise the open-file limit, LimitNOFILE=)");
        } else {
            tracing::warn!(%error, failures, "accept failed");
        }
        self.last_logged = Some(Instant::now());
    }
}

/// Connects to a listening address as a client would.
pub fn connect(addr: &ListenAddr) -> std::io::Result<Box<dyn Transport>> {
    Ok(match addr {
        ListenAddr::Unix(path) => Box::new(UnixStream::connect(path)?),
        ListenAddr::Tcp(addr) => {
            let stream = TcpStream::connect(addr.as_str())?;
            stream.set_nodelay(true)?;
            Box::new(stream)
        }
    })
}

impl Transport for Box<dyn Transport> {
    fn set_read_timeout(&self, timeout: Option<std::time::Duration>) -> std::io::Result<()> {
        (**self).set_read_timeout(timeout)
    }

    fn set_write_timeout(&self, timeout: Option<std::time::Duration>) -> std::io::Result<()> {
        (**self).set_write_timeout(timeout)
    }

    fn read_stopper(&self) -> Option<ReadStopper> {
        (**self).read_stopper()
    }

    fn read_now(&mut self, bufs: &mut [std::io::IoSliceMut<'_>]) -> Option<std::io::Result<usize>> {
        (**self).read_now(bufs)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn nbd_uris_name_the_socket_and_the_export() {
        let unix = ListenAddr::Unix("/run/overspill/nbd.sock".into());
        assert_eq!(unix.nbd_uri("", false), "nbd+unix:///?socket=/run/overspill/nbd.sock");
        assert_eq!(unix.nbd_uri("win7@vm1", true), "nbds+unix:///win7@vm1?socket=/run/overspill/nbd.sock");
        assert_eq!(ListenAddr::Tcp("[::1]:10809".into()).nbd_uri("", false), "nbd://[::1]:10809/");
    }

    use super::*;

    fn unix(path: &std::path::Path) -> ListenAddr {
        ListenAddr::Unix(path.to_owned())
    }

    #[test]
    fn a_file_at_the_listen_path_that_is_not_a_socket_is_refused_and_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("golden.img");
        std::fs::write(&path, b"precious").expect("write");
        let error = Listener::bind(&unix(&path)).expect_err("a regular file is no socket");
        assert!(error.to_string().contains("not a socket"), "{error}");
        assert!(error.to_string().contains("golden.img"), "{error}");
        assert_eq!(std::fs::read(&path).expect("still there"), b"precious");
    }

    #[test]
    fn a_live_socket_is_refused_and_a_stale_one_replaced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("nbd.sock");
        let first = Listener::bind(&unix(&path)).expect("bind");
        let error = Listener::bind(&unix(&path)).expect_err("someone listens there");
        assert_eq!(error.kind(), std::io::ErrorKind::AddrInUse, "{error}");
        drop(first);
        // A dead server's socket: the file stays, nobody accepts.
        drop(UnixListener::bind(&path).expect("bind"));
        assert!(path.exists());
        let second = Listener::bind(&unix(&path)).expect("stale socket replaced");
        drop(second);
        assert!(!path.exists(), "the listener removes the socket it made");
    }

    /// Servers starting at once on one path with a dead server's socket there: one binds, the
    /// others are told someone listens, and the path is the socket of the one that bound (an
    /// unlocked check-then-remove let a later one remove it and bind its own).
    #[test]
    fn servers_starting_at_once_on_a_stale_socket_leave_one_listening_where_clients_find_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("nbd.sock");
        for round in 0..50 {
            drop(UnixListener::bind(&path).expect("a dead server's socket"));
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
            let racers: Vec<_> = (0..4)
                .map(|_| {
                    let (path, barrier) = (path.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        Listener::bind(&unix(&path))
                    })
                })
                .collect();
            let bound: Vec<Listener> =
                racers.into_iter().filter_map(|racer| racer.join().expect("racer").ok()).collect();
            assert_eq!(bound.len(), 1, "round {round}: {} listeners bound", bound.len());
            let Some(Listener::Unix(listener, ..)) = bound.first() else { panic!("a Unix listener") };
            listener.set_nonblocking(true).expect("nonblocking");
            UnixStream::connect(&path).expect("clients reach the path");
            assert!(listener.accept().is_ok(), "round {round}: the path is not the bound listener's socket");
            drop(bound);
            assert!(!path.exists(), "the listener removes the socket it made");
        }
    }

    #[test]
    fn a_listener_does_not_remove_what_replaced_its_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("nbd.sock");
        let listener = Listener::bind(&unix(&path)).expect("bind");
        std::fs::remove_file(&path).expect("remove");
        std::fs::write(&path, b"someone else's").expect("write");
        drop(listener);
        assert_eq!(std::fs::read(&path).expect("kept"), b"someone else's");
    }
}
