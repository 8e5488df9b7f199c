//! TLS for the link between peer servers (live migration between hosts): both ends present a
//! certificate that the fleet's CA signed, each checks the other's, and each knows the other by
//! its certificate's common name. Nothing but such a peer gets past the handshake.
//!
//! The link's users read on one thread while they write on another (a move sends blocks while
//! its replies arrive), and a TLS session is one state machine that cannot be split. So once
//! the handshake is done, a relay thread owns the session and its TCP socket and passes plain
//! bytes through one end of a socket pair; the caller gets the other end, an ordinary Unix
//! stream it may clone, time out and shut down. Shutting it down sends close_notify; the peer's
//! end, or a broken TCP connection, shows as the stream's end.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};
use rustls::pki_types::ServerName;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, Connection, ServerConfig, ServerConnection};

use crate::tls::{common_name, invalid, read_chain, read_key, read_roots, TlsError};

/// Plain bytes a relay holds for a reader that does not take them before it stops reading the
/// network (so a slow reader holds back its peer, not memory).
const HELD_FOR_READER: usize = 1 << 20;
const RELAY_BUFFER: usize = 64 << 10;
/// How long a connecting peer has to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// This server's credentials on the peer link: its certificate and key, and the CA every
/// peer's certificate must chain to, whichever end connects.
pub struct PeerTls {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    name: String,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTls").field("name", &self.name).finish()
    }
}

/// A link to a peer, its TLS handled by a relay thread.
#[derive(Debug)]
pub struct PeerStream {
    pub stream: UnixStream,
    /// The peer's certificate's common name.
    pub identity: String,
}

impl PeerTls {
    /// `cert` and `key` (PEM) are this server's; `ca` signed every peer's certificate, this
    /// one's included. The certificate's common name is the server's name among its peers.
    pub fn new(cert: &Path, key: &Path, ca: &Path) -> Result<Self, TlsError> {
        let chain = read_chain(cert)?;
        let name = chain.first().and_then(common_name).ok_or_else(|| {
            invalid(cert, "the certificate has no common name, by which peers would know this server")
        })?;
        let roots = Arc::new(read_roots(ca)?);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = |e: rustls::Error| TlsError::Config(e.to_string());
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(config)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), read_key(key)?)
            .map_err(|e| invalid(key, e))?;
        let client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(config)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, read_key(key)?)
            .map_err(|e| invalid(key, e))?;
        Ok(Self { server: Arc::new(server), client: Arc::new(client), name })
    }

    /// This server's name among its peers: its certificate's common name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The accepting end's handshake: the peer must present a certificate the CA signed.
    /// `tcp`'s timeouts bound the handshake.
    pub fn accept(&self, mut tcp: TcpStream) -> io::Result<PeerStream> {
        let mut connection = Connection::from(ServerConnection::new(self.server.clone()).map_err(io::Error::other)?);
        handshake(&mut connection, &mut tcp)?;
        relayed(connection, tcp)
    }

    /// The connecting end's handshake with the peer at `host` (its certificate must name it,
    /// as a DNS name or an IP address, and chain to the CA).
    pub fn connect(&self, mut tcp: TcpStream, host: &str) -> io::Result<PeerStream> {
        let server_name = ServerName::try_from(host.to_owned())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("peer host {host:?}: {e}")))?;
        let mut connection =
            Connection::from(ClientConnection::new(self.client.clone(), server_name).map_err(io::Error::other)?);
        handshake(&mut connection, &mut tcp)?;
        relayed(connection, tcp)
    }
}

/// Runs the handshake to its end within [`HANDSHAKE_TIMEOUT`], however the other end spreads
/// its bytes (an unauthenticated caller must not hold a thread longer).
fn handshake(connection: &mut Connection, tcp: &mut TcpStream) -> io::Result<()> {
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let refused = |e: rustls::Error| io::Error::new(io::ErrorKind::PermissionDenied, format!("TLS handshake: {e}"));
    while connection.is_handshaking() {
        while connection.wants_write() {
            connection.write_tls(tcp)?;
        }
        if !connection.is_handshaking() {
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the TLS handshake took too long"));
        }
        tcp.set_read_timeout(Some(left))?;
        let read = connection.read_tls(tcp).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock => io::Error::new(io::ErrorKind::TimedOut, "the TLS handshake took too long"),
            _ => e,
        });
        let read = match read {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => other?,
        };
        if read == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer left during the TLS handshake"));
        }
        if let Err(error) = connection.process_new_packets() {
            // Tells the other end why, if it still listens.
            let _ = connection.write_tls(tcp);
            return Err(refused(error));
        }
    }
    while connection.wants_write() {
        connection.write_tls(tcp)?;
    }
    Ok(())
}

/// Hands a session whose handshake is done to a relay thread.
fn relayed(mut connection: Connection, tcp: TcpStream) -> io::Result<PeerStream> {
    let identity =
        connection.peer_certificates().and_then(|chain| chain.first()).and_then(common_name).ok_or_else(|| {
            io::Error::new(io::ErrorKind::PermissionDenied, "the peer's certificate has no common name")
        })?;
    // The relay bounds what it takes from its user itself (see `relay`).
    connection.set_buffer_limit(None);
    let (near, far) = UnixStream::pair()?;
    // A peer host that vanishes ends the link in about a minute, not never: idle, by
    // keepalive probes; with data unacknowledged, by the user timeout.
    crate::transport::keep_alive(&tcp)?;
    rustix::net::sockopt::set_tcp_user_timeout(&tcp, 60_000)?;
    tcp.set_nonblocking(true)?;
    far.set_nonblocking(true)?;
    std::thread::Builder::new().name("peer-tls".into()).spawn(move || {
        if let Err(error) = relay(connection, tcp, far) {
            tracing::debug!(%error, "peer link ended");
        }
    })?;
    Ok(PeerStream { stream: near, identity })
}

/// Where a relay stands, each way.
struct Ends {
    /// The user has not shut its end down for writing: what it sends goes to the peer.
    local_sends: bool,
    /// The user has not hung up: what the peer sends is delivered.
    local_reads: bool,
    /// The peer has sent neither close_notify nor the connection's end.
    peer_sends: bool,
    /// The connection still carries what this end sends.
    network_up: bool,
    /// The user was shown the end of what the peer sends.
    local_told_end: bool,
}

/// Moves bytes between the TLS session on `tcp` and the plain stream `local` until both ways
/// are done (or neither can go on). Takes more from `local` only once the last of it is on the
/// network, and more from the network only while `local`'s reader keeps up; polls only the
/// ends it waits for, so a hung-up end never makes it spin. Plain bytes already received are
/// delivered even when the connection then fails.
fn relay(mut tls: Connection, mut tcp: TcpStream, mut local: UnixStream) -> io::Result<()> {
    let mut for_local: Vec<u8> = Vec::new();
    let mut buffer = vec![0u8; RELAY_BUFFER];
    let mut ends =
        Ends { local_sends: true, local_reads: true, peer_sends: true, network_up: true, local_told_end: false };
    let mut local_refuses = false;
    let mut failure: Option<io::Error> = None;
    let mut fail = |ends: &mut Ends, error: io::Error| {
        ends.network_up = false;
        ends.peer_sends = false;
        failure.get_or_insert(error);
    };
    loop {
        // Plain bytes the session holds: some may have come with the handshake's last flight.
        take_plaintext(&mut tls, &mut buffer, &mut for_local, &mut ends.peer_sends);
        while ends.network_up && tls.wants_write() {
            match tls.write_tls(&mut tcp) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => fail(&mut ends, e),
            }
        }
        while ends.local_reads && !for_local.is_empty() {
            match local.write(&for_local) {
                Ok(n) => drop(for_local.drain(..n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => ends.local_reads = false,
            }
        }
        if !ends.local_reads {
            for_local.clear();
        }
        if !ends.network_up && !local_refuses {
            // A user blocked sending learns at once that nothing goes out any more.
            let _ = local.shutdown(std::net::Shutdown::Read);
            local_refuses = true;
        }
        let receiving_done = !ends.peer_sends && for_local.is_empty();
        if receiving_done && !ends.local_told_end {
            // Half-closed: the user reads the end, and may still send.
            let _ = local.shutdown(std::net::Shutdown::Write);
            ends.local_told_end = true;
        }
        let sending_done = !ends.local_sends && !tls.wants_write();
        if (receiving_done || !ends.local_reads) && (sending_done || !ends.network_up) {
            break;
        }

        let mut tcp_events = PollFlags::empty();
        if ends.peer_sends && for_local.len() < HELD_FOR_READER {
            tcp_events |= PollFlags::IN;
        }
        if ends.network_up && tls.wants_write() {
            tcp_events |= PollFlags::OUT;
        }
        let mut local_events = PollFlags::empty();
        if ends.local_sends && ends.network_up && !tls.wants_write() {
            local_events |= PollFlags::IN;
        }
        if ends.local_reads && !for_local.is_empty() {
            local_events |= PollFlags::OUT;
        }
        if tcp_events.is_empty() && local_events.is_empty() {
            // Nothing can move any more (the network is gone with the user still sending).
            break;
        }
        let (tcp_ready, local_ready) = {
            let mut fds = Vec::with_capacity(2);
            if !tcp_events.is_empty() {
                fds.push(PollFd::new(&tcp, tcp_events));
            }
            if !local_events.is_empty() {
                fds.push(PollFd::new(&local, local_events));
            }
            match poll(&mut fds, None) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            let tcp_ready = if tcp_events.is_empty() { PollFlags::empty() } else { fds[0].revents() };
            let local_ready = if local_events.is_empty() { PollFlags::empty() } else { fds[fds.len() - 1].revents() };
            (tcp_ready, local_ready)
        };

        let woken = PollFlags::IN | PollFlags::HUP | PollFlags::ERR;
        if tcp_events.contains(PollFlags::IN) && tcp_ready.intersects(woken) {
            match tls.read_tls(&mut tcp) {
                Ok(0) => ends.peer_sends = false,
                Ok(_) => {
                    if let Err(error) = tls.process_new_packets() {
                        // The records before the bad one were decrypted: they are delivered.
                        take_plaintext(&mut tls, &mut buffer, &mut for_local, &mut ends.peer_sends);
                        let _ = tls.write_tls(&mut tcp);
                        fail(&mut ends, io::Error::new(io::ErrorKind::InvalidData, error));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => fail(&mut ends, e),
            }
        } else if tcp_ready.contains(PollFlags::ERR) {
            fail(&mut ends, io::Error::new(io::ErrorKind::BrokenPipe, "the peer link broke"));
        }
        if local_ready.contains(PollFlags::HUP) {
            ends.local_reads = false;
        }
        if local_events.contains(PollFlags::IN) && local_ready.intersects(woken) {
            match local.read(&mut buffer) {
                Ok(0) => {
                    tls.send_close_notify();
                    ends.local_sends = false;
                }
                Ok(n) => tls.writer().write_all(&buffer[..n])?,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => {
                    tls.send_close_notify();
                    ends.local_sends = false;
                    ends.local_reads = false;
                }
            }
        }
    }
    if ends.network_up {
        crate::transport::linger(&tcp);
    }
    failure.map_or(Ok(()), Err)
}

/// Moves the plain bytes the session has decrypted into `for_local`; `peer_sends` goes false at
/// the peer's close_notify or a connection cut without one (the reader then sees the stream
/// end where it was cut).
fn take_plaintext(tls: &mut Connection, buffer: &mut [u8], for_local: &mut Vec<u8>, peer_sends: &mut bool) {
    if !*peer_sends {
        return;
    }
    loop {
        match tls.reader().read(buffer) {
            Ok(0) => {
                *peer_sends = false;
                return;
            }
            Ok(n) => for_local.extend_from_slice(&buffer[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(_) => {
                *peer_sends = false;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
    use std::net::TcpListener;

    struct Ca {
        cert: rcgen::Certificate,
        key: KeyPair,
    }

    fn ca(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().expect("key");
        Ca { cert: params.self_signed(&key).expect("self-signed"), key }
    }

    /// Writes NAME.crt, NAME.key and ca.crt in `dir`; the certificate serves both ends.
    fn host(dir: &Path, ca: &Ca, name: &str) -> PeerTls {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &ca.cert, &ca.key).expect("signed");
        let (cert_path, key_path, ca_path) =
            (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")), dir.join(format!("{name}-ca.crt")));
        std::fs::write(&cert_path, cert.pem()).expect("write");
        std::fs::write(&key_path, key.serialize_pem()).expect("write");
        std::fs::write(&ca_path, ca.cert.pem()).expect("write");
        PeerTls::new(&cert_path, &key_path, &ca_path).expect("credentials")
    }

    /// Connects `client` to `server` over TCP: the accepting end's result and the connecting's.
    fn link(server: PeerTls, client: &PeerTls) -> (io::Result<PeerStream>, io::Result<PeerStream>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let accepting = std::thread::spawn(move || {
            let (tcp, _) = listener.accept().expect("accept");
            server.accept(tcp)
        });
        let tcp = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let connected = client.connect(tcp, "localhost");
        (accepting.join().expect("accepting thread"), connected)
    }

    #[test]
    fn peers_of_one_ca_know_each_other_and_move_bytes_both_ways_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fleet = ca("fleet");
        let (a, b) = (host(dir.path(), &fleet, "host-a"), host(dir.path(), &fleet, "host-b"));
        assert_eq!(a.name(), "host-a");
        let (accepted, connected) = link(a, &b);
        let (accepted, connected) = (accepted.expect("a accepts b"), connected.expect("b reaches a"));
        assert_eq!(accepted.identity, "host-b");
        assert_eq!(connected.identity, "host-a");

        // 8 MiB each way at the same time, from threads of their own, as a move does.
        let pattern = |seed: u8| (0..8usize << 20).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
        let (to_b, to_a): (Vec<u8>, Vec<u8>) = (pattern(1), pattern(2));
        let sender = |mut stream: UnixStream, data: Vec<u8>| {
            std::thread::spawn(move || {
                stream.write_all(&data).expect("send");
                stream.shutdown(std::net::Shutdown::Write).expect("shutdown");
            })
        };
        let senders = [
            sender(accepted.stream.try_clone().expect("clone"), to_b.clone()),
            sender(connected.stream.try_clone().expect("clone"), to_a.clone()),
        ];
        let (mut at_a, mut at_b) = (Vec::new(), Vec::new());
        let mut accepted_stream = accepted.stream;
        let mut connected_stream = connected.stream;
        let reading_b = std::thread::spawn(move || {
            connected_stream.read_to_end(&mut at_b).expect("b reads");
            at_b
        });
        accepted_stream.read_to_end(&mut at_a).expect("a reads");
        let at_b = reading_b.join().expect("b's reader");
        for sender in senders {
            sender.join().expect("sender");
        }
        assert!(at_a == to_a, "a received {} bytes, not what b sent", at_a.len());
        assert!(at_b == to_b, "b received {} bytes, not what a sent", at_b.len());
    }

    /// The connecting end's first bytes may reach the accepting end with its last handshake
    /// flight, decrypted before the relay starts: they are delivered all the same.
    #[test]
    fn bytes_sent_at_once_after_the_handshake_arrive() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fleet = ca("fleet");
        let (a, b) = (Arc::new(host(dir.path(), &fleet, "host-a")), host(dir.path(), &fleet, "host-b"));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        for round in 0..20u8 {
            let a = a.clone();
            let listener = listener.try_clone().expect("clone");
            let accepting = std::thread::spawn(move || {
                let (tcp, _) = listener.accept().expect("accept");
                let mut accepted = a.accept(tcp).expect("accepted");
                accepted.stream.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
                let mut hello = [0u8; 5];
                accepted.stream.read_exact(&mut hello).map(|()| hello)
            });
            // The connecting end by hand, so that its Finished and its first bytes leave in one
            // write, as a fast peer's may.
            let mut tcp = TcpStream::connect(("127.0.0.1", port)).expect("connect");
            let name = ServerName::try_from("localhost").expect("name");
            let mut connecting = ClientConnection::new(b.client.clone(), name).expect("client");
            while connecting.is_handshaking() {
                while connecting.wants_write() {
                    connecting.write_tls(&mut tcp).expect("write");
                }
                connecting.read_tls(&mut tcp).expect("read");
                connecting.process_new_packets().expect("the server's flight");
            }
            connecting.writer().write_all(&[round; 5]).expect("queue");
            while connecting.wants_write() {
                connecting.write_tls(&mut tcp).expect("Finished and the first bytes");
            }
            let received = accepting.join().expect("accepting thread");
            assert_eq!(received.expect("the first bytes, not a timeout"), [round; 5], "round {round}");
        }
    }

    #[test]
    fn an_end_dropped_shows_as_the_end_at_the_other() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fleet = ca("fleet");
        let (a, b) = (host(dir.path(), &fleet, "host-a"), host(dir.path(), &fleet, "host-b"));
        let (accepted, connected) = link(a, &b);
        let (mut accepted, connected) = (accepted.expect("accepted"), connected.expect("connected"));
        // A clone held by a reader thread, as a link's is: shutting down ends it too.
        let mut reader = connected.stream.try_clone().expect("clone");
        connected.stream.shutdown(std::net::Shutdown::Both).expect("shutdown");
        let mut byte = [0u8; 1];
        accepted.stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        assert_eq!(accepted.stream.read(&mut byte).expect("the end, not a timeout"), 0);
        assert_eq!(reader.read(&mut byte).expect("the end"), 0);
        accepted.stream.write_all(b"late").ok();
    }

    #[test]
    fn a_peer_of_another_ca_gets_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (fleet, stranger_ca) = (ca("fleet"), ca("elsewhere"));
        let a = host(dir.path(), &fleet, "host-a");
        let stranger = host(dir.path(), &stranger_ca, "host-x");
        let (accepted, connected) = link(a, &stranger);
        let refused = accepted.expect_err("a refuses a certificate its CA did not sign");
        assert_eq!(refused.kind(), io::ErrorKind::PermissionDenied, "{refused}");
        // The stranger does not trust a's certificate either.
        assert!(connected.is_err());

        // Nor does a trusted peer reach a server of another CA.
        let b = host(dir.path(), &fleet, "host-b");
        let x = host(dir.path(), &stranger_ca, "host-y");
        let (accepted, connected) = link(x, &b);
        assert!(connected.is_err(), "b must not accept a server its CA did not sign");
        assert!(accepted.is_err());
    }
}
