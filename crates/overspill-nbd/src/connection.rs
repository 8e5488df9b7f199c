//! One client connection, from greeting to disconnect, on a blocking socket.
//!
//! A connection is one VM: its device is owned by the connection's thread, requests are served in
//! order (the overlay is single-writer anyway, and its RAM tier is a memcpy), and replies are
//! batched: they collect in an output buffer that is written out only before the connection
//! would block reading, so a pipelined burst of 32 requests costs one read and one write
//! syscall, while a lone request is answered at once. A large write's reply goes out as soon as
//! it is served.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::counters::{ProtocolCounters, Refusal};
use crate::deadlined::Deadlined;
use crate::handshake::{Handshake, HandshakeError, Negotiated, Progress};
use crate::replies::{block_status, execute, read, reply_status, OUTPUT_HIGH_WATER};
use crate::request::{errno_of, validate, Command, FramingError, RequestHeader};
use crate::stream::{
    DeadlinePassed, Deadlines, Wait, Wire, WirePayload, DIRECT_RECEIVE_BYTES, INPUT_BYTES, READ_AFTER_DIRECT_BYTES,
};
use crate::wire::*;
use overspill_block::{ExportAccess, ExportProvider};
use overspill_net::{ServerTls, TlsMode, Transport};

/// The default of [`Limits::poll_before_sleep`]: longer than a client's turnaround between a
/// reply and its next request at low queue depth (20 µs got half the gain on 4 KiB QD8 writes,
/// 50 µs all of it), short enough that an idle VM costs nothing to speak of.
pub const DEFAULT_POLL_BEFORE_SLEEP: Duration = Duration::from_micros(50);

/// The default of [`Limits::request_timeout`]: a 32 MiB write at 10 Mbit/s takes 27 s.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// The default of [`Limits::quiet_after`]: far longer than any pause inside a guest's burst of
/// writes, so a device gives back what it keeps for them only once they are over.
pub const DEFAULT_QUIET_AFTER: Duration = Duration::from_secs(10);

/// Limits that bound what one client can make the server do.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest read or write payload accepted; advertised as the maximum block size.
    pub max_payload_bytes: u32,
    /// Time a client has, from its connection, to finish the handshake (TLS included), however
    /// it spreads its bytes.
    pub handshake_timeout: Duration,
    /// A connection with no request for this long is closed; `None` waits forever.
    pub idle_timeout: Option<Duration>,
    /// Time a request has to arrive whole (header and payload) once its first byte has, however
    /// the client spreads its bytes; a connection that takes longer is closed.
    pub request_timeout: Duration,
    /// Between requests, how long to poll the socket before sleeping until the client sends
    /// (zero: sleep at once).
    pub poll_before_sleep: Duration,
    /// A client that has sent nothing for this long is quiet: its device hears of it
    /// ([`overspill_block::BlockDevice::idle`]), once per quiet spell, at the first wake-up of its wait after this
    /// (the waits wake every third of the shortest deadline, at most every 20 s).
    pub quiet_after: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_payload_bytes: 32 << 20,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: None,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            poll_before_sleep: DEFAULT_POLL_BEFORE_SLEEP,
            quiet_after: DEFAULT_QUIET_AFTER,
        }
    }
}

/// What a server asks of a client before serving it: TLS, and which exports its identity may open.
#[derive(Clone, Default)]
pub struct Security {
    pub tls: Option<Arc<ServerTls>>,
    pub access: Option<Arc<dyn ExportAccess>>,
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Security").field("tls", &self.tls).field("access", &self.access.is_some()).finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
    #[error("framing: {0}")]
    Framing(#[from] FramingError),
    #[error("socket: {0}")]
    Io(#[from] io::Error),
    #[error("client went away in the middle of a message")]
    Truncated,
    #[error("TLS: {0}")]
    Tls(io::Error),
    /// The server had to close a connection whose socket was fine (a read that failed after its
    /// simple reply began, a device that asked for more than a write's payload): a TLS client
    /// still hears close_notify.
    #[error("{0}")]
    Abandoned(String),
}

/// How a connection ended without error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// The client aborted during the handshake, or closed before choosing an export.
    NoExport,
    /// The client sent NBD_CMD_DISC, or closed between requests.
    Disconnected { export: String, requests: u64 },
}

/// Serves one connection to its end. Errors are this connection's only; the caller logs them.
pub fn serve_connection<T: Transport>(
    stream: T,
    exports: &dyn ExportProvider,
    limits: &Limits,
) -> Result<Ending, ConnectionError> {
    serve_connection_until(stream, exports, limits, &AtomicBool::new(false))
}

/// Like [`serve_connection`], and once `stop` is set it ends at the first point where it would
/// wait for the client: the request in hand (and any already read) is served and answered, no
/// further request is read. The server sets `stop` and then shuts the stream for reading, which
/// wakes a connection blocked waiting for a request.
pub fn serve_connection_until<T: Transport>(
    stream: T,
    exports: &dyn ExportProvider,
    limits: &Limits,
    stop: &AtomicBool,
) -> Result<Ending, ConnectionError> {
    serve_secured_connection(stream, exports, limits, &Security::default(), &Arc::default(), stop)
}

/// Like [`serve_connection_until`], with TLS and export access as `security` says, counting
/// error replies and refusals in `counters`.
pub fn serve_secured_connection<T: Transport>(
    stream: T,
    exports: &dyn ExportProvider,
    limits: &Limits,
    security: &Security,
    counters: &Arc<ProtocolCounters>,
    stop: &AtomicBool,
) -> Result<Ending, ConnectionError> {
    serve_tracked(stream, exports, limits, security, counters, stop, &mut || {}, &|| false)
}

/// Like [`serve_secured_connection`], calling `handshake_over` once the handshake has opened an
/// export (the server counts connections still in their handshake). A connection for which
/// `shed` says yes at its end was cut off by the server to make room, and counted so then: how
/// the cut ended it (an error of the shut stream, TLS's or the handshake's) is not counted again.
#[allow(clippy::too_many_arguments)]
pub(crate) fn serve_tracked<T: Transport>(
    stream: T,
    exports: &dyn ExportProvider,
    limits: &Limits,
    security: &Security,
    counters: &Arc<ProtocolCounters>,
    stop: &AtomicBool,
    handshake_over: &mut dyn FnMut(),
    shed: &dyn Fn() -> bool,
) -> Result<Ending, ConnectionError> {
    let result = serve_counted(stream, exports, limits, security, counters, stop, handshake_over);
    if shed() {
        return result;
    }
    let refusal = match &result {
        Err(ConnectionError::Handshake(HandshakeError::ExportRefused(_, why))) => Some(*why),
        Err(ConnectionError::Handshake(_)) => Some(Refusal::HandshakeError),
        // A TLS handshake cut by the handshake's deadline is that deadline's.
        Err(ConnectionError::Tls(e)) if e.kind() == io::ErrorKind::TimedOut => Some(Refusal::HandshakeTimeout),
        Err(ConnectionError::Tls(_)) => Some(Refusal::Tls),
        Err(ConnectionError::Io(e)) if e.kind() == io::ErrorKind::TimedOut => {
            match e.get_ref().and_then(|inner| inner.downcast_ref::<DeadlinePassed>()) {
                Some(DeadlinePassed(Wait::Idle(_))) => Some(Refusal::IdleTimeout),
                Some(DeadlinePassed(Wait::Request(_) | Wait::Reply(_))) => Some(Refusal::RequestTimeout),
                None => Some(Refusal::HandshakeTimeout),
            }
        }
        _ => None,
    };
    if let Some(why) = refusal {
        counters.refused(why);
    }
    result
}

fn serve_counted<T: Transport>(
    stream: T,
    exports: &dyn ExportProvider,
    limits: &Limits,
    security: &Security,
    counters: &Arc<ProtocolCounters>,
    stop: &AtomicBool,
    handshake_over: &mut dyn FnMut(),
) -> Result<Ending, ConnectionError> {
    let mode = security.tls.as_ref().map_or(TlsMode::Off, |tls| tls.mode());
    let mut handshake =
        Handshake::with_tls(mode).with_access(security.access.clone()).with_max_payload(limits.max_payload_bytes);
    // From accept to the end of option haggling, TLS included: one deadline.
    let stream = Deadlined::new(stream, limits.handshake_timeout);
    let mut wire = Wire::new(stream, Handshake::greeting(), counters.clone());
    match negotiate(&mut wire, &mut handshake, exports, stop)? {
        Negotiation::Done(negotiated) => start_transmission(&mut wire, negotiated, limits, stop, handshake_over),
        Negotiation::StartTls => {
            let Some(tls) = &security.tls else {
                return Err(ConnectionError::Tls(io::Error::other("STARTTLS acknowledged without credentials")));
            };
            // The client waits for the ACK before its ClientHello, so anything read already
            // is plain text sent after STARTTLS: a protocol violation, and it cannot be TLS.
            if !wire.buffered().is_empty() {
                return Err(ConnectionError::Tls(io::Error::other("plain text after STARTTLS")));
            }
            let Wire { stream, output, .. } = wire;
            let stream = tls.accept(stream).map_err(ConnectionError::Tls)?;
            tracing::debug!(identity = %stream.identity().unwrap_or("-"), "TLS started");
            handshake.tls_started(stream.identity().map(str::to_owned));
            let mut wire = Wire::new(stream, output, counters.clone());
            let ending = match negotiate(&mut wire, &mut handshake, exports, stop) {
                Ok(Negotiation::Done(negotiated)) => {
                    start_transmission(&mut wire, negotiated, limits, stop, handshake_over)
                }
                Ok(Negotiation::StartTls) => Err(ConnectionError::Tls(io::Error::other("STARTTLS twice"))),
                Err(error) => Err(error),
            };
            close_tls(&mut wire, &ending);
            ending
        }
    }
}

/// However a TLS session ends (DISC, ABORT, bad input, a deadline, the server's shutdown), the
/// client hears close_notify before the connection closes, as the spec asks of every hard
/// disconnect; not when the socket itself failed, since nobody is left to hear it. The write is
/// bounded: a client that stopped reading cannot hold the connection open with it.
fn close_tls<T: Transport>(wire: &mut Wire<T>, ending: &Result<Ending, ConnectionError>) {
    if let Err(ConnectionError::Io(error)) = ending {
        if error.kind() != io::ErrorKind::TimedOut {
            return;
        }
    }
    let closed = wire.stream.set_write_timeout(Some(CLOSE_NOTIFY_TIMEOUT)).and_then(|()| wire.stream.close());
    if let Err(error) = closed {
        tracing::debug!(%error, "could not send close_notify");
    }
}

/// How long sending close_notify may take.
const CLOSE_NOTIFY_TIMEOUT: Duration = Duration::from_secs(1);

enum Negotiation {
    /// An export was opened, or (`None`) the client left without one.
    Done(Option<Negotiated>),
    /// The ACK to STARTTLS is sent: the TLS handshake comes next.
    StartTls,
}

/// Options until the handshake ends or turns to TLS. Once the server is stopping, options are
/// answered NBD_REP_ERR_SHUTDOWN: the server gives handshakes a moment before it stops reading.
fn negotiate<T: Transport>(
    wire: &mut Wire<T>,
    handshake: &mut Handshake,
    exports: &dyn ExportProvider,
    stop: &AtomicBool,
) -> Result<Negotiation, ConnectionError> {
    loop {
        if stop.load(Ordering::Relaxed) {
            handshake.shut_down();
        }
        let (used, progress) = handshake.advance(&wire.input[wire.start..wire.end], &mut wire.output, exports)?;
        wire.consume(used);
        if let Some(why) = handshake.take_refusal() {
            wire.counters.refused(why);
        }
        match progress {
            Progress::NeedMore => {
                if !wire.fill(1)? {
                    return Ok(Negotiation::Done(None));
                }
            }
            Progress::Close => {
                wire.flush()?;
                return Ok(Negotiation::Done(None));
            }
            Progress::StartTls => {
                wire.flush()?;
                return Ok(Negotiation::StartTls);
            }
            Progress::SendFirst => wire.flush()?,
            Progress::Transmission(negotiated) => return Ok(Negotiation::Done(Some(negotiated))),
        }
    }
}

/// Serves the export the handshake opened; a client that left without one ends here.
fn start_transmission<T: Transport>(
    wire: &mut Wire<T>,
    negotiated: Option<Negotiated>,
    limits: &Limits,
    stop: &AtomicBool,
    handshake_over: &mut dyn FnMut(),
) -> Result<Ending, ConnectionError> {
    let Some(negotiated) = negotiated else { return Ok(Ending::NoExport) };
    handshake_over();
    let deadlines = Deadlines { idle: limits.idle_timeout, request: limits.request_timeout };
    wire.stream.set_read_timeout(Some(deadlines.tick()))?;
    // (A zero timeout is not one a socket takes: no bound then, as for reads.)
    wire.stream.set_write_timeout(Some(deadlines.request).filter(|limit| !limit.is_zero()))?;
    wire.deadlines = Some(deadlines);
    wire.poll = limits.poll_before_sleep;
    tracing::debug!(export = %negotiated.export, structured = negotiated.structured_replies, "transmission");
    transmit(wire, negotiated, limits, stop)
}

fn transmit<T: Transport>(
    wire: &mut Wire<T>,
    mut session: Negotiated,
    limits: &Limits,
    stop: &AtomicBool,
) -> Result<Ending, ConnectionError> {
    let mut requests = 0u64;
    let size = session.info.size;
    let caps = session.info.capabilities;
    let max = limits.max_payload_bytes;
    loop {
        // Between requests, with nothing read ahead: the one point where stopping loses nothing
        // the client was told about. A request partly read is finished first.
        if wire.buffered().is_empty() && stop.load(Ordering::Relaxed) {
            break;
        }
        wire.next_request();
        if !cut_short_by_stop(wire.need_request(session.device.as_mut(), limits.quiet_after), stop)? {
            break;
        }
        wire.mid_request = true;
        let mut raw = [0u8; REQUEST_HEADER_BYTES];
        raw.copy_from_slice(&wire.buffered()[..REQUEST_HEADER_BYTES]);
        let header = RequestHeader::parse(&raw)?;
        if session.device.closing() {
            tracing::info!(export = %session.export, "device taken away: closing the connection unanswered");
            break;
        }
        let payload = header.payload_bytes(max)? as usize;
        let unread = (REQUEST_HEADER_BYTES + payload).saturating_sub(wire.buffered().len());
        if unread > DIRECT_RECEIVE_BYTES || REQUEST_HEADER_BYTES + payload > INPUT_BYTES {
            requests += 1;
            wire.consume(REQUEST_HEADER_BYTES);
            let mut data = WirePayload { wire, unread: payload, failed: None };
            let result = match validate(&header, size, caps, max) {
                Ok(Command::Write { offset, fua, .. }) => session
                    .device
                    .write_from(offset, payload, fua, &mut data)
                    .map_err(|e| (errno_of(e.kind), e.message)),
                Ok(_) => unreachable!("only writes have a payload"),
                Err(errno) => Err((errno, "invalid request".into())),
            };
            if !cut_short_by_stop(data.finish(), stop)? {
                break;
            }
            wire.read_limit = READ_AFTER_DIRECT_BYTES;
            reply_status(wire, &session, &header, result);
            // A write this large took reads of its own, so one more syscall for its reply is
            // cheap; holding the reply back until the socket runs dry would stall the client's
            // queue (with 1 MiB writes at QD4 it gets all four completions at once, then sends
            // four more while the server waits).
            wire.flush()?;
            continue;
        }
        // The header is buffered, so this can only fail or succeed, not see a clean end.
        if !cut_short_by_stop(wire.need(REQUEST_HEADER_BYTES + payload), stop)? {
            break;
        }
        requests += 1;
        let command = validate(&header, size, caps, max);
        let data_range = REQUEST_HEADER_BYTES..REQUEST_HEADER_BYTES + payload;
        let disconnect = match command {
            Err(errno) => {
                reply_status(wire, &session, &header, Err((errno, "invalid request".into())));
                false
            }
            Ok(Command::Disconnect) => {
                session.device.disconnect();
                true
            }
            Ok(Command::Read { offset, length }) => {
                read(wire, &mut session, header.cookie, offset, length)?;
                false
            }
            Ok(Command::BlockStatus { offset, length, req_one }) => {
                block_status(wire, &mut session, &header, offset, length, req_one);
                false
            }
            Ok(command) => {
                let data = &wire.input[wire.start..][data_range.clone()];
                let result = execute(session.device.as_mut(), command, data, max);
                reply_status(wire, &session, &header, result.map_err(|e| (errno_of(e.kind), e.message)));
                false
            }
        };
        wire.consume(REQUEST_HEADER_BYTES + payload);
        if disconnect {
            break;
        }
        if wire.unsent() >= OUTPUT_HIGH_WATER {
            wire.flush()?;
        }
    }
    wire.flush()?;
    // The device goes first: a client that saw the connection close after its DISC may connect
    // again at once under the same name, and must find the VM let go of by then.
    let Negotiated { export, device, .. } = session;
    drop(device);
    // The client may be gone already; the connection ends cleanly either way.
    if let Err(error) = wire.stream.close() {
        tracing::debug!(%error, "closing the session");
    }
    Ok(Ending::Disconnected { export, requests })
}

/// A request the server's own shutdown cut off half-read (the stop shuts the socket for reading
/// while the client may be sending) was never taken, so the connection ends as a disconnect,
/// not as bad input. Over TLS with certificates (rustls) that shut socket reads as an end with
/// no close_notify before it, an error: it is the same stop, and the session is still shut
/// down properly (close_notify) as the connection ends.
fn cut_short_by_stop(needed: Result<bool, ConnectionError>, stop: &AtomicBool) -> Result<bool, ConnectionError> {
    match needed {
        Err(ConnectionError::Truncated) if stop.load(Ordering::Relaxed) => Ok(false),
        Err(ConnectionError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof && stop.load(Ordering::Relaxed) => {
            Ok(false)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;
    use std::io::{IoSliceMut, Write};

    use overspill_block::Payload;

    /// A client sending `bytes` in pieces, then `tail`, or going away after `cut` bytes.
    fn sender(
        bytes: Vec<u8>,
        tail: &'static [u8],
        cut: Option<usize>,
    ) -> (Wire<UnixStream>, std::thread::JoinHandle<()>) {
        let (mut client, server) = UnixStream::pair().expect("socketpair");
        let wire = Wire::new(server, Vec::new(), Arc::default());
        let thread = std::thread::spawn(move || {
            let sent = &bytes[..cut.unwrap_or(bytes.len())];
            for piece in sent.chunks(100_000) {
                // The peer may have given up already; that is what some tests are about.
                if client.write_all(piece).is_err() {
                    return;
                }
            }
            if cut.is_none() {
                let _ = client.write_all(tail);
                // Held open until the reader is done, so the tail is not followed by an end.
                std::thread::sleep(Duration::from_millis(500));
            }
        });
        (wire, thread)
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn a_payload_comes_from_read_ahead_then_the_socket_and_what_the_device_leaves_is_skipped() {
        let payload = pattern(3 << 20);
        let (mut wire, client) = sender(payload.clone(), b"next", None);
        // The request loop has read some of the payload ahead with the header.
        assert!(wire.need(1000).expect("read ahead"));
        let mut pages = vec![[0u8; 4096]; 256];
        let mut data = WirePayload { wire: &mut wire, unread: payload.len(), failed: None };
        let mut buffers: Vec<IoSliceMut<'_>> = pages.iter_mut().map(|page| IoSliceMut::new(page)).collect();
        data.receive(&mut buffers).expect("first MiB");
        assert!(data.finish().expect("the other 2 MiB skipped"));
        assert_eq!(pages.concat(), payload[..1 << 20]);
        assert!(wire.need(4).expect("next request"));
        assert_eq!(&wire.buffered()[..4], b"next");
        assert_eq!(wire.input.len(), INPUT_BYTES, "a large payload does not grow the input buffer");
        client.join().expect("client");
    }

    #[test]
    fn a_polling_connection_receives_a_payload_whole_and_reads_little_ahead_after_it() {
        let payload = pattern(2 << 20);
        let next: &'static [u8] = Box::leak(pattern(1 << 20).into_boxed_slice());
        let (mut wire, client) = sender(payload.clone(), next, None);
        wire.poll = Duration::from_micros(50);
        let mut pages = vec![[0u8; 4096]; 512];
        let mut data = WirePayload { wire: &mut wire, unread: payload.len(), failed: None };
        let mut buffers: Vec<IoSliceMut<'_>> = pages.iter_mut().map(|page| IoSliceMut::new(page)).collect();
        data.receive(&mut buffers).expect("the payload");
        assert!(data.finish().expect("nothing left"));
        assert_eq!(pages.concat(), payload);
        // What follows a payload received straight into the device is read only a little ahead,
        // even with a whole MiB waiting: it may be the next large payload.
        std::thread::sleep(Duration::from_millis(100));
        wire.read_limit = READ_AFTER_DIRECT_BYTES;
        assert!(wire.need(REQUEST_HEADER_BYTES).expect("next request"));
        let buffered = wire.buffered().len();
        assert!((REQUEST_HEADER_BYTES..=READ_AFTER_DIRECT_BYTES).contains(&buffered), "read {buffered} ahead");
        assert_eq!(wire.buffered(), &next[..buffered]);
        // The limit held for one read only.
        assert!(wire.need(buffered + 1).expect("more"));
        assert!(wire.buffered().len() > READ_AFTER_DIRECT_BYTES);
        // The client may still be sending the rest: it stops when the connection goes.
        drop(wire);
        client.join().expect("client");
    }

    #[test]
    fn a_client_gone_mid_payload_ends_the_connection() {
        let payload = pattern(1 << 20);
        let (mut wire, client) = sender(payload.clone(), b"", Some(300_000));
        let mut page = vec![0u8; 1 << 20];
        let mut data = WirePayload { wire: &mut wire, unread: payload.len(), failed: None };
        assert!(data.receive(&mut [IoSliceMut::new(&mut page)]).is_err());
        assert!(matches!(data.finish(), Err(ConnectionError::Truncated)));
        client.join().expect("client");
    }

    #[test]
    fn a_device_cannot_take_more_than_the_payload() {
        let (mut wire, client) = sender(pattern(8192), b"", None);
        let mut page = vec![0u8; 8193];
        let mut data = WirePayload { wire: &mut wire, unread: 8192, failed: None };
        assert!(data.receive(&mut [IoSliceMut::new(&mut page)]).is_err());
        assert!(data.finish().is_err(), "the connection ends");
        client.join().expect("client");
    }
}
