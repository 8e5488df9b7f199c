//! The peer listener: the socket peers connect to (Unix, or TCP behind TLS), how many of them
//! are served at once, and the thread each is served on.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use overspill_net::{ListenAddr, PeerTls};

use super::{serve_peer, ANSWER_TIMEOUT};
use crate::vms::VmRegistry;

/// Listens for peers: on a Unix socket, made mode 0600 (a peer can take any VM), or on TCP,
/// where only a peer with a certificate of the CA gets past the TLS handshake.
pub struct PeerListener {
    /// The socket file this server made.
    path: Option<PathBuf>,
}

impl Drop for PeerListener {
    fn drop(&mut self) {
        if let Some(path) = &self.path {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Answers peers at `address`: their questions, and their requests for VMs. A `tcp:` address
/// needs `tls`.
pub fn listen(
    address: &ListenAddr,
    name: String,
    tls: Option<Arc<PeerTls>>,
    registry: Arc<VmRegistry>,
) -> io::Result<PeerListener> {
    let serve =
        move |stream: UnixStream, proven: Option<String>| match serve_peer(stream, &name, proven.as_deref(), &registry)
        {
            Err(error) if error.kind() == io::ErrorKind::PermissionDenied => {
                tracing::warn!(%error, "a peer connection was refused")
            }
            Err(error) => tracing::debug!(%error, "peer connection ended"),
            Ok(()) => {}
        };
    match address {
        ListenAddr::Unix(path) => {
            // Only a dead server's socket is removed: a live one, or any other file, refuses.
            overspill_net::remove_stale_socket(path)?;
            let listener = UnixListener::bind(path)?;
            std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
            accept_loop(
                move || listener.accept().map(|(stream, _)| stream),
                move |stream| {
                    serve(stream, None);
                },
                MAX_PEER_CONNECTIONS,
            )?;
            Ok(PeerListener { path: Some(path.clone()) })
        }
        ListenAddr::Tcp(host_port) => {
            let tls = tls.ok_or_else(|| io::Error::other("a tcp: peer socket needs TLS credentials"))?;
            let listener = TcpListener::bind(host_port.as_str())?;
            let handshaking = Arc::new(Handshaking::default());
            accept_loop(
                move || listener.accept().map(|(tcp, _)| tcp),
                move |tcp: TcpStream| {
                    let Some(_handshake) = handshaking.begin(&tcp) else {
                        tracing::warn!(
                            "a peer connection was closed unserved: its address has {MAX_HANDSHAKES_PER_ADDRESS} TLS \
                             handshakes under way"
                        );
                        return;
                    };
                    let authenticated = tcp
                        .set_read_timeout(Some(ANSWER_TIMEOUT))
                        .and_then(|()| tcp.set_write_timeout(Some(ANSWER_TIMEOUT)))
                        .and_then(|()| tls.accept(tcp));
                    drop(_handshake);
                    match authenticated {
                        Ok(peer) => serve(peer.stream, Some(peer.identity)),
                        Err(error) => tracing::warn!(%error, "a peer connection was refused"),
                    }
                },
                MAX_PEER_CONNECTIONS,
            )?;
            Ok(PeerListener { path: None })
        }
    }
}

/// Peer connections served at once; more are closed as they come. Moves, their reads and
/// questions take one each: a host emptied by moving a hundred VMs at once takes two hundred.
/// Counted before TLS, so that connections nobody authenticates cannot take a thread each
/// without end.
const MAX_PEER_CONNECTIONS: usize = 256;

/// TLS handshakes under way at once from one address: connections that never finish theirs
/// hold a slot of [`MAX_PEER_CONNECTIONS`] each for the handshake's timeout, and one address
/// may not take them all from the real peers.
const MAX_HANDSHAKES_PER_ADDRESS: usize = 8;

/// The TLS handshakes under way, by the address they come from.
#[derive(Default)]
struct Handshaking(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

impl Handshaking {
    /// One more handshake from `tcp`'s address, unless it has as many as it may.
    fn begin(self: &Arc<Self>, tcp: &TcpStream) -> Option<Handshake> {
        let address = tcp.peer_addr().ok()?.ip();
        let mut under_way = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = under_way.entry(address).or_default();
        if *count >= MAX_HANDSHAKES_PER_ADDRESS {
            return None;
        }
        *count += 1;
        Some(Handshake { all: self.clone(), address })
    }
}

/// A TLS handshake counted for its address until it drops.
struct Handshake {
    all: Arc<Handshaking>,
    address: std::net::IpAddr,
}

impl Drop for Handshake {
    fn drop(&mut self) {
        let mut under_way = self.all.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(count) = under_way.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                under_way.remove(&self.address);
            }
        }
    }
}

/// Serves each connection `accept` takes in a thread of its own, at most `most` at once.
fn accept_loop<S: Send + 'static>(
    mut accept: impl FnMut() -> io::Result<S> + Send + 'static,
    serve: impl Fn(S) + Clone + Send + 'static,
    most: usize,
) -> io::Result<()> {
    let serving = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::thread::Builder::new().name("peer-listener".into()).spawn(move || loop {
        let stream = match accept() {
            Ok(stream) => stream,
            Err(error) => {
                // Out of descriptors, say: not a reason to spin.
                tracing::warn!(%error, "could not accept a peer");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let slot = Slot(serving.clone());
        if serving.fetch_add(1, Ordering::SeqCst) >= most {
            tracing::warn!(most, "a peer connection was closed unserved: as many are served already");
            continue;
        }
        let serve = serve.clone();
        let spawned = std::thread::Builder::new().name("peer".into()).spawn(move || {
            let _slot = slot;
            serve(stream);
        });
        if let Err(error) = spawned {
            tracing::warn!(%error, "could not serve a peer");
        }
    })?;
    Ok(())
}

/// One connection counted among those served: given back when it drops, however its
/// connection ended (a panic too).
struct Slot(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One address may have only so many TLS handshakes under way: a host opening connections
    /// it never authenticates cannot take every slot from the real peers.
    #[test]
    fn one_address_has_only_so_many_handshakes_under_way() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("listener");
        let address = listener.local_addr().expect("address");
        let handshaking = Arc::new(Handshaking::default());
        let mut connections = Vec::new();
        let mut handshakes = Vec::new();
        for _ in 0..=MAX_HANDSHAKES_PER_ADDRESS {
            connections.push(TcpStream::connect(address).expect("connect"));
            let (accepted, _) = listener.accept().expect("accept");
            handshakes.push(handshaking.begin(&accepted));
        }
        let begun = handshakes.iter().filter(|h| h.is_some()).count();
        assert_eq!(begun, MAX_HANDSHAKES_PER_ADDRESS, "the address's handshakes beyond the limit");
        handshakes.truncate(1);
        connections.push(TcpStream::connect(address).expect("connect"));
        let (accepted, _) = listener.accept().expect("accept");
        assert!(handshaking.begin(&accepted).is_some(), "the handshakes that ended gave their slots back");
    }

    /// Beyond `most` connections served at once, more are closed as they come, and a slot is
    /// given back as a connection ends, whatever its end.
    #[test]
    fn a_peer_listener_serves_at_most_so_many_connections_at_once() {
        use std::io::Read;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("peer.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let (release, released) = std::sync::mpsc::channel::<()>();
        let released = Arc::new(std::sync::Mutex::new(released));
        let serve = move |stream: UnixStream| {
            // Held until the test lets one go, which then ends by a panic.
            let let_go = released.lock().unwrap_or_else(std::sync::PoisonError::into_inner).recv().is_ok();
            drop(stream);
            assert!(!let_go, "a connection's end by a panic gives its slot back too");
        };
        accept_loop(move || listener.accept().map(|(stream, _)| stream), serve, 3).expect("listener");
        let connect = || {
            let stream = UnixStream::connect(&path).expect("connect");
            stream.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
            stream
        };
        // Closed by the listener (the read ends), or held by a server (the read times out).
        let closed_at_once = |mut stream: UnixStream| matches!(stream.read(&mut [0u8; 1]), Ok(0));
        // Accepted in order by one thread: the fourth finds the three before it served.
        let held: Vec<UnixStream> = (0..3).map(|_| connect()).collect();
        assert!(closed_at_once(connect()), "a fourth connection was served");
        release.send(()).expect("release one");
        // The slot comes back as its thread unwinds: a connection is served again soon after.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while closed_at_once(connect()) {
            assert!(std::time::Instant::now() < deadline, "a slot was not given back");
        }
        drop((held, release));
    }
}
