//! One client connection, from greeting to disconnect, on a blocking socket.
//!
//! A connection is one VM: its device is owned by the connection's thread, requests are served in
//! order (the overlay is single-writer anyway, and its RAM tier is a memcpy), and replies are
//! batched: they collect in an output buffer that is written out only before the connection
//! would block reading, so a pipelined burst of 32 requests costs one read and one write
//! syscall, while a lone request is answered at once. A large write's reply goes out as soon as
//! it is served.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::counters::{command_name, ProtocolCounters, Refusal};
use crate::handshake::{Handshake, HandshakeError, Negotiated, Progress, ALLOCATION_CONTEXT_ID};
use crate::request::{errno_of, validate, Command, FramingError, RequestHeader};
use crate::wire::*;
use overspill_block::{BlockDevice, DeviceError, ExportAccess, ExportProvider, Payload, ReadRequest};
use overspill_net::{ReadStopper, ServerTls, TlsMode, Transport};

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
    /// ([`BlockDevice::idle`]), once per quiet spell, at the first wake-up of its wait after this
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

/// A stream whose reads and writes share one deadline until a timeout is set: the handshake's.
/// Each read may wait only for what is left of it, so a client dribbling a byte a second cannot
/// hold a connection slot past the deadline (a plain per-read timeout starts afresh with every
/// byte); each write too, so a client that does not read its replies cannot either. Setting a
/// read or write timeout, as the transmission phase does, ends the deadline.
struct Deadlined<T> {
    inner: T,
    deadline: Instant,
    active: AtomicBool,
}

impl<T: Transport> Deadlined<T> {
    fn new(inner: T, within: Duration) -> Self {
        Self { inner, deadline: Instant::now() + within, active: AtomicBool::new(true) }
    }

    /// Before a read: the time left, as the socket's read timeout.
    fn arm(&self) -> io::Result<()> {
        match self.left()? {
            Some(left) => self.inner.set_read_timeout(Some(left)),
            None => Ok(()),
        }
    }

    /// Before a write: the time left, as the socket's write timeout. A client that sends
    /// options and never reads the replies fills both socket buffers; without this the write
    /// would block past the deadline, for good (the kernel keeps answering its zero window).
    fn arm_write(&self) -> io::Result<()> {
        match self.left()? {
            Some(left) => self.inner.set_write_timeout(Some(left)),
            None => Ok(()),
        }
    }

    /// What is left of the deadline while it holds.
    fn left(&self) -> io::Result<Option<Duration>> {
        if !self.active.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Self::expired());
        }
        Ok(Some(left))
    }

    fn expired() -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, "the handshake took longer than its deadline")
    }

    /// A read or write that timed out while the deadline holds says so.
    fn explain<R>(&self, result: io::Result<R>) -> io::Result<R> {
        match result {
            Err(e)
                if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
                    && self.active.load(Ordering::Relaxed) =>
            {
                Err(Self::expired())
            }
            other => other,
        }
    }
}

impl<T: Transport> Read for Deadlined<T> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm()?;
        let result = self.inner.read(buf);
        self.explain(result)
    }

    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        self.arm()?;
        let result = self.inner.read_vectored(bufs);
        self.explain(result)
    }
}

impl<T: Transport> Write for Deadlined<T> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm_write()?;
        let result = self.inner.write(buf);
        self.explain(result)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.arm_write()?;
        let result = self.inner.write_vectored(bufs);
        self.explain(result)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<T: Transport> Transport for Deadlined<T> {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.active.store(false, Ordering::Relaxed);
        self.inner.set_read_timeout(timeout)
    }

    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        // As for reads: a timeout of its own (transmission's, or the goodbye's once the
        // deadline has passed) takes over from the deadline.
        self.active.store(false, Ordering::Relaxed);
        self.inner.set_write_timeout(timeout)
    }

    fn read_stopper(&self) -> Option<ReadStopper> {
        self.inner.read_stopper()
    }

    fn read_now(&mut self, bufs: &mut [IoSliceMut<'_>]) -> Option<io::Result<usize>> {
        if self.active.load(Ordering::Relaxed) {
            return None;
        }
        self.inner.read_now(bufs)
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

/// Inside the `TimedOut` error of a transmission deadline that passed: which one.
#[derive(Debug)]
struct DeadlinePassed(Wait);

impl std::fmt::Display for DeadlinePassed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.describe())
    }
}

impl std::error::Error for DeadlinePassed {}

/// How a connection ended without error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// The client aborted during the handshake, or closed before choosing an export.
    NoExport,
    /// The client sent NBD_CMD_DISC, or closed between requests.
    Disconnected { export: String, requests: u64 },
}

/// Input buffer size: room for a burst of pipelined 4 KiB writes per read syscall. Larger write
/// payloads are received straight into the device's buffers ([`WirePayload`]), so it does not
/// grow for them.
const INPUT_BYTES: usize = 256 * 1024;
/// A write payload with more than this still unread is received straight into the device's
/// buffers; a smaller rest is read into the input buffer, with whatever follows it, in one read.
const DIRECT_RECEIVE_BYTES: usize = 64 * 1024;
/// What the first read after a payload received straight into the device reads at most: the next
/// request's header and a small payload. A full read-ahead there takes the start of the next large
/// write's payload too, which is then copied twice (socket to input buffer to device).
const READ_AFTER_DIRECT_BYTES: usize = 4096 + REQUEST_HEADER_BYTES;
/// Reads at least this long are sent from the device's own buffers ([`BlockDevice::read_shared`])
/// by the output's vectored write, not copied into the output first.
const SHARED_READ_BYTES: usize = 32 * 1024;
/// Flush the output early once this much is waiting, so large reads do not pile up.
const OUTPUT_HIGH_WATER: usize = 4 << 20;
/// Reads larger than this are answered in slices of at most this, ending on its multiples on
/// the disk (see [`read`]).
const READ_SLICE_BYTES: usize = 1 << 20;
/// Most buffers one `readv` takes (Linux's UIO_MAXIOV).
const MAX_IOVECS: usize = 1024;
/// Most buffers one read of a write's payload is handed. A socket gives what it holds, and a
/// Unix stream socket holds what its sender's buffer lets through (about 208 KiB by default),
/// while each call copies every descriptor it is handed into the kernel, polls that find
/// nothing included: with the 256 pages of a 1 MiB write, that copy was 1.4 % of the server's
/// samples while spilling. 64 pages cover what one read returns (a fuller TCP socket takes a
/// few more calls).
const PAYLOAD_READ_IOVECS: usize = 64;

/// Waits that sleep at once after a poll that found nothing.
const POLL_SKIPS_AFTER_MISS: u32 = 16;

struct Wire<T> {
    stream: T,
    /// How long to poll for input before sleeping (see [`Wire::poll_for_input`]); zero during
    /// the handshake.
    poll: Duration,
    poll_skips: u32,
    /// The next read takes at most this much (see [`READ_AFTER_DIRECT_BYTES`]).
    read_limit: usize,
    counters: Arc<ProtocolCounters>,
    /// `input[start..end]` is received and not yet consumed.
    input: Vec<u8>,
    start: usize,
    end: usize,
    output: Vec<u8>,
    /// Read data the device lent ([`BlockDevice::read_shared`]), each piece to go out after
    /// `output[..at]`, so that replies still leave in order and together, one `writev`.
    lent: Vec<(usize, Bytes)>,
    lent_bytes: usize,
    /// Transmission's deadlines (the handshake has its own, in [`Deadlined`]).
    deadlines: Option<Deadlines>,
    /// What a read that blocks now waits for, and since when.
    waiting: Option<(Wait, Instant)>,
    /// The request's header has been read: more bytes are part of it.
    mid_request: bool,
    /// A blocked wait for the next request that wakes with nothing read returns an [`IdleTick`]
    /// error, so that the device hears of the quiet; otherwise it waits on.
    report_idle: bool,
}

/// What a connection waits for when it blocks reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// The next request.
    Idle(Duration),
    /// The rest of a request whose first bytes came.
    Request(Duration),
    /// The client to take replies the socket cannot hold.
    Reply(Duration),
}

impl Wait {
    fn describe(&self) -> String {
        match self {
            Wait::Idle(limit) => format!("no request for {limit:?} (the idle timeout)"),
            Wait::Request(limit) => format!("a request took longer than {limit:?} to arrive whole"),
            Wait::Reply(limit) => format!("the client took longer than {limit:?} to take its replies"),
        }
    }
}

/// Inside the `WouldBlock` error of a connection's wait for its next request that woke with
/// nothing read (see [`Wire::report_idle`]): the waiting goes on once the device has heard.
#[derive(Debug)]
struct IdleTick;

impl std::fmt::Display for IdleTick {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no request yet")
    }
}

impl std::error::Error for IdleTick {}

fn is_idle_tick(error: &ConnectionError) -> bool {
    matches!(error, ConnectionError::Io(e) if e.get_ref().is_some_and(|inner| inner.is::<IdleTick>()))
}

/// The client sent no request for the idle timeout.
fn is_idle_deadline(error: &io::Error) -> bool {
    error.kind() == io::ErrorKind::TimedOut
        && error
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<DeadlinePassed>())
            .is_some_and(|d| matches!(d.0, Wait::Idle(_)))
}

/// A client that took no reply for `limit`.
fn stalled(limit: Duration) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, DeadlinePassed(Wait::Reply(limit)))
}

/// What one write of replies came to: the bytes sent (none if interrupted), or its error; in
/// transmission (`reply_limit`), a write that timed out is the client's stall.
fn written(result: io::Result<usize>, reply_limit: Option<Duration>) -> io::Result<usize> {
    match result {
        Ok(0) => Err(io::ErrorKind::WriteZero.into()),
        Ok(n) => Ok(n),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(0),
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
            Err(reply_limit.map_or(e, stalled))
        }
        Err(e) => Err(e),
    }
}

#[derive(Debug, Clone, Copy)]
struct Deadlines {
    idle: Option<Duration>,
    request: Duration,
}

impl Deadlines {
    /// How often a blocked read wakes to look at the clock: a deadline is enforced within a
    /// third of itself, and an idle VM wakes now and then (at most every 20 s), not per request.
    fn tick(&self) -> Duration {
        let shortest = self.idle.map_or(self.request, |idle| idle.min(self.request));
        (shortest / 3).clamp(Duration::from_millis(10), Duration::from_secs(20))
    }
}

impl<T: Transport> Wire<T> {
    fn new(stream: T, output: Vec<u8>, counters: Arc<ProtocolCounters>) -> Self {
        Self {
            stream,
            poll: Duration::ZERO,
            poll_skips: 0,
            read_limit: usize::MAX,
            counters,
            input: vec![0; INPUT_BYTES],
            start: 0,
            end: 0,
            output,
            lent: Vec::new(),
            lent_bytes: 0,
            deadlines: None,
            waiting: None,
            mid_request: false,
            report_idle: false,
        }
    }

    /// A new request begins: its wait starts afresh.
    fn next_request(&mut self) {
        self.waiting = None;
        self.mid_request = false;
    }

    /// Notes, before a read, what it waits for: the clock of a wait runs from its first read
    /// until the request is whole. An error once that is longer than its deadline: a client
    /// that dribbles bytes, each in time for a read, is cut off here.
    fn note_wait(&mut self) -> io::Result<()> {
        let Some(deadlines) = self.deadlines else { return Ok(()) };
        let wait = if self.mid_request || !self.buffered().is_empty() {
            Wait::Request(deadlines.request)
        } else {
            match deadlines.idle {
                Some(idle) => Wait::Idle(idle),
                None => {
                    self.waiting = None;
                    return Ok(());
                }
            }
        };
        match self.waiting {
            Some((w, _)) if w == wait => self.deadline_passed(),
            _ => {
                self.waiting = Some((wait, Instant::now()));
                Ok(())
            }
        }
    }

    /// The wait noted last, as an error once it is over its deadline.
    fn deadline_passed(&self) -> io::Result<()> {
        match self.waiting {
            Some((wait @ (Wait::Idle(limit) | Wait::Request(limit)), since)) if since.elapsed() >= limit => {
                Err(io::Error::new(io::ErrorKind::TimedOut, DeadlinePassed(wait)))
            }
            _ => Ok(()),
        }
    }

    /// A blocked read woke without data (the socket's timeout is the deadlines' tick): an error
    /// once the wait is over its deadline, otherwise read again. Other errors stand.
    fn check_deadline(&self, error: io::Error) -> io::Result<()> {
        if self.deadlines.is_none() || !matches!(error.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
            return Err(error);
        }
        self.deadline_passed()
    }

    fn buffered(&self) -> &[u8] {
        &self.input[self.start..self.end]
    }

    fn consume(&mut self, n: usize) {
        self.start += n;
        debug_assert!(self.start <= self.end);
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.input.len() > INPUT_BYTES {
                self.input = vec![0; INPUT_BYTES];
            }
        }
    }

    /// Sends the output. In transmission, the client has the request timeout to take it: a
    /// client that sends requests and stops reading replies would otherwise hold this thread
    /// (and the VM's export) in a write for good; the socket's write timeout bounds each write,
    /// the clock here the whole of it.
    fn flush(&mut self) -> io::Result<()> {
        if self.lent.is_empty() && self.output.is_empty() {
            return Ok(());
        }
        let reply_limit = self.deadlines.map(|d| d.request);
        let began = Instant::now();
        let over_time = |left: bool| match reply_limit {
            Some(limit) if left && began.elapsed() >= limit => Err(stalled(limit)),
            _ => Ok(()),
        };
        if self.lent.is_empty() {
            // The common case, one buffer of replies: no slices to build.
            let mut sent = 0;
            while sent < self.output.len() {
                sent += written(self.stream.write(&self.output[sent..]), reply_limit)?;
                over_time(sent < self.output.len())?;
            }
        } else {
            let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(2 * self.lent.len() + 1);
            let mut from = 0;
            for (at, piece) in &self.lent {
                if *at > from {
                    slices.push(IoSlice::new(&self.output[from..*at]));
                    from = *at;
                }
                slices.push(IoSlice::new(piece));
            }
            if from < self.output.len() {
                slices.push(IoSlice::new(&self.output[from..]));
            }
            let mut rest = slices.as_mut_slice();
            while !rest.is_empty() {
                let batch = rest.len().min(MAX_IOVECS);
                let n = written(self.stream.write_vectored(&rest[..batch]), reply_limit)?;
                IoSlice::advance_slices(&mut rest, n);
                over_time(!rest.is_empty())?;
            }
        }
        self.lent.clear();
        self.lent_bytes = 0;
        self.output.clear();
        // A socket sends on write; a TLS stream may hold the last record until flushed.
        self.stream.flush()
    }

    /// Queues `pieces` to go out after what the output holds now.
    fn lend(&mut self, pieces: Vec<Bytes>) {
        let at = self.output.len();
        for piece in pieces {
            self.lent_bytes += piece.len();
            self.lent.push((at, piece));
        }
    }

    /// Bytes waiting to be sent.
    fn unsent(&self) -> usize {
        self.output.len() + self.lent_bytes
    }

    /// Waits for input by asking the socket, without sleeping, for up to `poll`: a thread that
    /// sleeps in `read` must be woken by the client's next send, and on these virtual machines
    /// that wake-up (an inter-processor interrupt, a context switch) costs more than serving a
    /// 4 KiB request. 4 KiB writes into the RAM tier from one fio job (`bench/run`'s cells):
    /// QD1 14.6k → 32k IOPS, QD8 82k → 200k; 4 and 16 connections unchanged (docs/performance.md).
    /// A poll that finds nothing means the client is idle or slow: the next few waits sleep at
    /// once, so an idle VM costs one `poll` now and then. `None`: nothing arrived (or the stream
    /// cannot be asked), sleep in `read`.
    fn poll_for_input(&mut self) -> Option<io::Result<bool>> {
        if self.poll.is_zero() {
            return None;
        }
        if self.poll_skips > 0 {
            self.poll_skips -= 1;
            return None;
        }
        let until = Instant::now() + self.poll;
        let room = self.read_room();
        loop {
            match self.stream.read_now(&mut [IoSliceMut::new(&mut self.input[self.end..room])])? {
                Ok(n) => {
                    self.end += n;
                    return Some(Ok(n > 0));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= until {
                        self.poll_skips = POLL_SKIPS_AFTER_MISS;
                        return None;
                    }
                    // Other connections' threads may want this core more than this one wants
                    // to look again.
                    std::thread::yield_now();
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// Reads more input, making room for at least `want` buffered bytes; `false` at end of
    /// stream. Replies go out first: the client may wait for them before it sends more.
    fn fill(&mut self, want: usize) -> io::Result<bool> {
        self.flush()?;
        if self.input.len() - self.start < want || self.end == self.input.len() {
            self.input.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if self.input.len() < want {
                self.input.resize(want, 0);
            }
        }
        self.read_limit = self.read_limit.max(want.saturating_sub(self.buffered().len()));
        self.note_wait()?;
        let polled = self.poll_for_input();
        let room = self.read_room();
        self.read_limit = usize::MAX;
        if let Some(result) = polled {
            return result;
        }
        loop {
            match self.stream.read(&mut self.input[self.end..room]) {
                Ok(n) => {
                    self.end += n;
                    return Ok(n > 0);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.check_deadline(e)?;
                    if self.report_idle && !self.mid_request && self.buffered().is_empty() {
                        return Err(io::Error::new(io::ErrorKind::WouldBlock, IdleTick));
                    }
                }
            }
        }
    }

    /// Waits for the next request's header, telling `device` once the client has been quiet for
    /// `quiet_after`. `Ok(false)` if the stream ended before it began, or if the device was
    /// taken away while the client sent nothing ([`BlockDevice::closing`]): a quiet VM's
    /// connection closes within a wake-up, not at a next request that may be long coming.
    fn need_request(&mut self, device: &mut dyn BlockDevice, quiet_after: Duration) -> Result<bool, ConnectionError> {
        // Counted in wake-ups, each a tick of waiting with nothing read: no clock read per request.
        let tick = self.deadlines.map_or(Duration::ZERO, |deadlines| deadlines.tick());
        let mut quiet = Duration::ZERO;
        let mut told = false;
        self.report_idle = true;
        let needed = loop {
            match self.need(REQUEST_HEADER_BYTES) {
                Err(error) if is_idle_tick(&error) => {
                    if device.closing() {
                        tracing::info!("device taken away: closing the quiet connection");
                        break Ok(false);
                    }
                    quiet += tick;
                    if !told && quiet >= quiet_after {
                        device.idle();
                        told = true;
                    }
                }
                Err(ConnectionError::Io(error)) if is_idle_deadline(&error) => {
                    device.idle_timed_out();
                    break Err(ConnectionError::Io(error));
                }
                other => break other,
            }
        };
        self.report_idle = false;
        needed
    }

    /// Reads the middle of a payload into `bufs`, polling as [`Self::poll_for_input`] does before
    /// it sleeps: the client is in the middle of sending, so the rest is on its way, and a sleep
    /// here costs a wake-up for every chunk the client's socket buffer lets through.
    fn read_payload(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        self.note_wait()?;
        if !self.poll.is_zero() {
            let until = Instant::now() + self.poll;
            while let Some(result) = self.stream.read_now(bufs) {
                match result {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < until => {
                        std::thread::yield_now();
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    other => return other,
                }
            }
        }
        loop {
            match self.stream.read_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => self.check_deadline(e)?,
                other => return other,
            }
        }
    }

    /// Where the next read into the input buffer ends.
    fn read_room(&self) -> usize {
        self.end.saturating_add(self.read_limit).min(self.input.len())
    }

    /// Ensures `n` bytes are buffered. `Ok(false)` if the stream ended before any byte of them.
    fn need(&mut self, n: usize) -> Result<bool, ConnectionError> {
        while self.buffered().len() < n {
            let had = self.buffered().len();
            if !self.fill(n)? {
                return if had == 0 { Ok(false) } else { Err(ConnectionError::Truncated) };
            }
        }
        Ok(true)
    }
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
    serve_tracked(stream, exports, limits, security, counters, stop, &mut || {})
}

/// Like [`serve_secured_connection`], calling `handshake_over` once the handshake has opened an
/// export (the server counts connections still in their handshake).
pub(crate) fn serve_tracked<T: Transport>(
    stream: T,
    exports: &dyn ExportProvider,
    limits: &Limits,
    security: &Security,
    counters: &Arc<ProtocolCounters>,
    stop: &AtomicBool,
    handshake_over: &mut dyn FnMut(),
) -> Result<Ending, ConnectionError> {
    let result = serve_counted(stream, exports, limits, security, counters, stop, handshake_over);
    let refusal = match &result {
        Err(ConnectionError::Handshake(HandshakeError::ExportRefused(_))) => Some(Refusal::UnknownExport),
        Err(ConnectionError::Handshake(_)) => Some(Refusal::HandshakeError),
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
    // The client may be gone already; the connection ends cleanly either way.
    if let Err(error) = wire.stream.close() {
        tracing::debug!(%error, "closing the session");
    }
    Ok(Ending::Disconnected { export: session.export, requests })
}

/// The unread part of a write's payload: first what was read ahead into the input buffer, then
/// the socket, read with `readv` straight into the device's buffers.
struct WirePayload<'a, T> {
    wire: &'a mut Wire<T>,
    unread: usize,
    /// Why receiving failed; the connection ends with it.
    failed: Option<ConnectionError>,
}

impl<T: Transport> WirePayload<'_, T> {
    fn receive_into(&mut self, mut buffers: &mut [IoSliceMut<'_>]) -> Result<(), ConnectionError> {
        let wanted: usize = buffers.iter().map(|buffer| buffer.len()).sum();
        if wanted > self.unread {
            return Err(ConnectionError::Abandoned("the device asked for more than the write's payload".into()));
        }
        while !buffers.is_empty() {
            let n = if self.wire.buffered().is_empty() {
                // Replies go out before a read that may block, as in `fill`.
                self.wire.flush()?;
                let batch = buffers.len().min(PAYLOAD_READ_IOVECS);
                match self.wire.read_payload(&mut buffers[..batch]) {
                    Ok(0) => return Err(ConnectionError::Truncated),
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e.into()),
                }
            } else {
                let n = self.wire.buffered().len().min(buffers[0].len());
                buffers[0][..n].copy_from_slice(&self.wire.buffered()[..n]);
                self.wire.consume(n);
                n
            };
            self.unread -= n;
            IoSliceMut::advance_slices(&mut buffers, n);
        }
        Ok(())
    }

    /// Reads and drops what the device did not take (it failed, or the request was invalid), so
    /// that the next request is found. Reports a failure to receive.
    fn finish(mut self) -> Result<bool, ConnectionError> {
        if let Some(error) = self.failed.take() {
            return Err(error);
        }
        while self.unread > 0 {
            if self.wire.buffered().is_empty() && !self.wire.fill(1)? {
                return Err(ConnectionError::Truncated);
            }
            let n = self.wire.buffered().len().min(self.unread);
            self.wire.consume(n);
            self.unread -= n;
        }
        Ok(true)
    }
}

impl<T: Transport> Payload for WirePayload<'_, T> {
    fn receive(&mut self, buffers: &mut [IoSliceMut<'_>]) -> io::Result<()> {
        self.receive_into(buffers).map_err(|error| {
            let reported = io::Error::other(error.to_string());
            self.failed = Some(error);
            reported
        })
    }
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

fn execute(device: &mut dyn BlockDevice, command: Command, data: &[u8], max: u32) -> Result<(), DeviceError> {
    match command {
        Command::Write { offset, fua, .. } => device.write(offset, data, fua),
        Command::Flush => device.flush(),
        Command::Trim { offset, length, fua } => device.trim(offset, u64::from(length), fua),
        Command::WriteZeroes { offset, length, may_trim, fast_only, fua } => {
            device.write_zeroes(offset, u64::from(length), may_trim, fast_only, fua)
        }
        // A hint, which the spec lets a server follow in part: at most a payload's worth, so
        // that one 28-byte request cannot make the device fetch 4 GiB (its reply does not wait
        // for the client to take anything, as a read's would).
        Command::Cache { offset, length } => device.cache(offset, u64::from(length.min(max))),
        Command::Read { .. } | Command::BlockStatus { .. } | Command::Disconnect => {
            unreachable!("handled by the caller")
        }
    }
}

/// Replies to a command that returns no data. Structured replies are not needed for these
/// (the spec allows simple replies to anything but reads), but errors then carry a message.
fn reply_status<T>(
    wire: &mut Wire<T>,
    session: &Negotiated,
    header: &RequestHeader,
    result: Result<(), (Errno, String)>,
) {
    let cookie = header.cookie;
    if let Err((errno, _)) = &result {
        wire.counters.error_reply(command_name(header.kind), *errno);
    }
    match result {
        Ok(()) => simple_reply(&mut wire.output, cookie, 0),
        Err((errno, message)) if session.structured_replies => {
            structured_error(&mut wire.output, cookie, errno as u32, &message)
        }
        Err((errno, _)) => simple_reply(&mut wire.output, cookie, errno as u32),
    }
}

/// Descriptors in one block status reply at most, as the spec asks (2^20); a client asks again
/// from where the reply stopped.
const MAX_STATUS_DESCRIPTORS: usize = 1 << 20;
/// Of a block status request, what the device is asked about at most: the spec lets a server
/// answer for less than was asked "if looking up the information would be too
/// resource-intensive", and the client asks again from where the reply stopped. A device
/// walks its map block by block: 256 MiB is 65,536 blocks, at most 512 KiB of descriptors.
/// The same with REQ_ONE, which QEMU sends on every request: a smaller window would cut its
/// long extents (an empty disk) into many more round trips.
const STATUS_WINDOW_BYTES: u64 = 256 << 20;

/// Answers NBD_CMD_BLOCK_STATUS for `base:allocation`: one chunk of (length, flags)
/// descriptors, never past the request's end (so REQ_ONE's limit holds too), merged where
/// neighbours agree.
fn block_status<T>(
    wire: &mut Wire<T>,
    session: &mut Negotiated,
    header: &RequestHeader,
    offset: u64,
    length: u32,
    req_one: bool,
) {
    if !session.block_status {
        let why = "no metadata context was selected (NBD_OPT_SET_META_CONTEXT base:allocation)";
        reply_status(wire, session, header, Err((Errno::Inval, why.into())));
        return;
    }
    let extents = match session.device.block_status(offset, u64::from(length).min(STATUS_WINDOW_BYTES)) {
        Ok(extents) => extents,
        Err(error) => {
            reply_status(wire, session, header, Err((errno_of(error.kind), error.message)));
            return;
        }
    };
    let mut descriptors: Vec<(u32, u32)> = Vec::new();
    let mut left = length;
    for extent in extents {
        let len = extent.length.min(u64::from(left)) as u32;
        if len == 0 {
            break;
        }
        let flags = if extent.hole { STATE_HOLE } else { 0 } | if extent.zero { STATE_ZERO } else { 0 };
        let full = descriptors.len() == MAX_STATUS_DESCRIPTORS;
        match descriptors.last_mut() {
            Some((last_len, last_flags)) if *last_flags == flags => *last_len += len,
            _ if full => break,
            _ => descriptors.push((len, flags)),
        }
        left -= len;
        if req_one {
            break;
        }
    }
    if descriptors.is_empty() {
        let why = "the device reported no extents";
        reply_status(wire, session, header, Err((Errno::Io, why.into())));
        return;
    }
    let out = &mut wire.output;
    chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, header.cookie, 4 + 8 * descriptors.len() as u32);
    put_u32(out, ALLOCATION_CONTEXT_ID);
    for (len, flags) in descriptors {
        put_u32(out, len);
        put_u32(out, flags);
    }
}

/// Structured reads at least this long ask the device which parts read as zeroes, and send
/// those as hole chunks instead of data. Smaller reads are not worth the question: it costs an
/// index walk, and the 4-64 KiB reads of a running guest are almost never zero.
const SPARSE_READ_BYTES: usize = 256 * 1024;

/// Zero runs shorter than this travel as data: a hole chunk would save too little.
const MIN_HOLE_BYTES: u64 = 4096;

/// Answers a read. Data is read straight into the output buffer behind the reply header, so it
/// is copied once, or lent by the device ([`SHARED_READ_BYTES`]). A read larger than
/// [`READ_SLICE_BYTES`] is answered slice by slice, sending the output whenever it passes its
/// high water: a client that asks for large reads and never reads the replies holds at most that
/// much of the server's memory, and the server stops reading its requests (it waits in the
/// write) instead of queueing more replies. With structured replies, a large read's zero runs
/// are hole chunks ([`SPARSE_READ_BYTES`]).
fn read<T: Transport>(
    wire: &mut Wire<T>,
    session: &mut Negotiated,
    cookie: u64,
    offset: u64,
    length: u32,
) -> Result<(), ConnectionError> {
    let structured = session.structured_replies;
    let request = ReadRequest::begin(session.device.as_mut(), offset, u64::from(length));
    if structured && length == 0 {
        chunk_header(&mut wire.output, REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0);
        return Ok(());
    }
    let reply_start = wire.output.len();
    if !structured {
        simple_reply(&mut wire.output, cookie, 0);
    }
    let length = length as usize;
    let runs = if structured && length >= SPARSE_READ_BYTES {
        zero_runs(session.device.as_mut(), offset, length)
    } else {
        Vec::new()
    };
    let mut runs = runs.into_iter().peekable();
    let mut done = 0usize;
    loop {
        let at = offset + done as u64;
        // The next piece: a zero run starting here, or data up to the next run or slice end.
        // A read that needs slices has them end on multiples of their size on the disk, not of
        // the request: a device that counts what it reads block by block sees no block split
        // between two slices. A read that fits in one stays one.
        let to_slice_end = if length <= READ_SLICE_BYTES {
            length - done
        } else {
            READ_SLICE_BYTES - (at % READ_SLICE_BYTES as u64) as usize
        };
        let (piece, hole) = match runs.peek() {
            Some(&(start, len)) if start == at => {
                runs.next();
                (len as usize, true)
            }
            Some(&(start, _)) => (((start - at) as usize).min(to_slice_end), false),
            None => ((length - done).min(to_slice_end), false),
        };
        let last = done + piece == length;
        let flags = if last { REPLY_FLAG_DONE } else { 0 };
        let slice_start = wire.output.len();
        if hole {
            session.device.read_sent_as_zeroes(&request, at, piece as u64);
            chunk_header(&mut wire.output, flags, REPLY_TYPE_OFFSET_HOLE, cookie, 12);
            put_u64(&mut wire.output, at);
            put_u32(&mut wire.output, piece as u32);
        } else {
            if structured {
                chunk_header(&mut wire.output, flags, REPLY_TYPE_OFFSET_DATA, cookie, 8 + piece as u32);
                put_u64(&mut wire.output, at);
            }
            if let Err(error) = read_slice(wire, session.device.as_mut(), &request, at, piece) {
                tracing::debug!(%error, offset = at, length = piece, "read failed");
                let errno = errno_of(error.kind);
                wire.counters.error_reply("read", errno);
                if structured {
                    // After data chunks, an error chunk ends the reply.
                    wire.output.truncate(slice_start);
                    structured_error(&mut wire.output, cookie, errno as u32, &error.message);
                } else if done == 0 {
                    wire.output.truncate(reply_start);
                    simple_reply(&mut wire.output, cookie, errno as u32);
                } else {
                    // A simple reply said "no error" before its data: NBD's only way out is to close.
                    wire.output.truncate(slice_start);
                    wire.flush()?;
                    let why =
                        format!("a read failed after its reply began, so the connection closes: {}", error.message);
                    return Err(ConnectionError::Abandoned(why));
                }
                return Ok(());
            }
        }
        done += piece;
        if last {
            return Ok(());
        }
        if wire.unsent() >= OUTPUT_HIGH_WATER {
            wire.flush()?;
        }
    }
}

/// The runs of `[offset, offset + length)` the device says read as zeroes, as (offset, length),
/// in order, each at least [`MIN_HOLE_BYTES`]. A device that cannot tell, or fails to, has none:
/// the read then sends everything as data, which is never wrong.
fn zero_runs(device: &mut dyn BlockDevice, offset: u64, length: usize) -> Vec<(u64, u64)> {
    let extents = match device.block_status(offset, length as u64) {
        Ok(extents) => extents,
        Err(error) => {
            tracing::debug!(%error, offset, length, "block status for a sparse read failed: sending data");
            return Vec::new();
        }
    };
    let end = offset + length as u64;
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut at = offset;
    for extent in extents {
        let len = extent.length.min(end - at);
        if len == 0 {
            break;
        }
        if extent.zero {
            match runs.last_mut() {
                Some((start, run)) if *start + *run == at => *run += len,
                _ => runs.push((at, len)),
            }
        }
        at += len;
    }
    runs.retain(|&(_, len)| len >= MIN_HOLE_BYTES);
    runs
}

/// Appends `length` bytes of the device at `offset` to the output: lent, or copied in.
fn read_slice<T: Transport>(
    wire: &mut Wire<T>,
    device: &mut dyn BlockDevice,
    request: &ReadRequest,
    offset: u64,
    length: usize,
) -> Result<(), DeviceError> {
    if length >= SHARED_READ_BYTES {
        wire.lend(device.read_shared(request, offset, length)?);
        return Ok(());
    }
    let data_start = wire.output.len();
    wire.output.resize(data_start + length, 0);
    device.read(request, offset, &mut wire.output[data_start..])
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

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
