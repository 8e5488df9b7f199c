//! The accept loop over a listener of `overspill_net`: one thread per connection, a cap on
//! connections.
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
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::connection::{serve_tracked, ConnectionError, Ending, Limits, Security};
use crate::counters::{ProtocolCounters, Refusal};
use overspill_block::ExportProvider;
use overspill_net::listen::ListenerWaker;
use overspill_net::{Listener, ReadStopper, Transport};

/// How long the accept loop waits for a client before it looks at the shutdown flag again: the
/// waker may not shut a socket systemd holds, and a connection of our own to its path may be
/// refused to this service's user (the shipped unit's socket is root's and libvirt's, mode
/// 0660), so an idle server would otherwise stop or restart only when the next client came.
const ACCEPT_LOOK_AGAIN: Duration = Duration::from_millis(200);

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
                    if let Err(error) = configure_accepted(&s) {
                        tracing::warn!(%peer, %error, "could not set TCP keepalive on a connection");
                    }
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
        let (handshakes, handshake_key) = (self.handshakes.clone(), handshake.key);
        let spawned = std::thread::Builder::new().name(format!("nbd-{id}")).spawn(move || {
            let _slot = slot;
            let _registration = registration;
            let over = &mut || {
                handshaking.store(false, Ordering::SeqCst);
                handshake.release()
            };
            let shed = &|| handshake_key.is_some_and(|key| lock(&handshakes).shed.contains(&key));
            let ending =
                serve_tracked(stream, exports.as_ref(), &limits, &security, &counters, &shutdown.0.stop, over, shed);
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

/// Replies are batched by the connection, so Nagle would only add latency. Keepalive probes
/// (see [`overspill_net::transport::keep_alive`]) find a client whose host died without a word:
/// the server never sends on an idle connection, so without them the VM would stay "connected"
/// for ever and be refused at its next connection; with them the connection is lost in about a
/// minute and the VM waits out its grace for its client, as after any lost connection.
fn configure_accepted(stream: &std::net::TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    overspill_net::transport::keep_alive(stream)
}
