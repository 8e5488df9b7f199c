//! A connection's byte stream: the input buffer requests are parsed from, replies batched in the
//! output until the connection would block, the waits (poll, then sleep; idle ticks; deadlines)
//! and a write's payload received straight into the device's buffers.

use std::io::{self, IoSlice, IoSliceMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use overspill_block::{BlockDevice, Payload};
use overspill_net::Transport;

use crate::connection::ConnectionError;
use crate::counters::ProtocolCounters;
use crate::wire::*;

/// Input buffer size: room for a burst of pipelined 4 KiB writes per read syscall. Larger write
/// payloads are received straight into the device's buffers ([`WirePayload`]), so it does not
/// grow for them.
pub(crate) const INPUT_BYTES: usize = 256 * 1024;
/// A write payload with more than this still unread is received straight into the device's
/// buffers; a smaller rest is read into the input buffer, with whatever follows it, in one read.
pub(crate) const DIRECT_RECEIVE_BYTES: usize = 64 * 1024;
/// What the first read after a payload received straight into the device reads at most: the next
/// request's header and a small payload. A full read-ahead there takes the start of the next large
/// write's payload too, which is then copied twice (socket to input buffer to device).
pub(crate) const READ_AFTER_DIRECT_BYTES: usize = 4096 + REQUEST_HEADER_BYTES;
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

pub(crate) struct Wire<T> {
    pub(crate) stream: T,
    /// How long to poll for input before sleeping (see [`Wire::poll_for_input`]); zero during
    /// the handshake.
    pub(crate) poll: Duration,
    pub(crate) poll_skips: u32,
    /// The next read takes at most this much (see [`READ_AFTER_DIRECT_BYTES`]).
    pub(crate) read_limit: usize,
    pub(crate) counters: Arc<ProtocolCounters>,
    /// `input[start..end]` is received and not yet consumed.
    pub(crate) input: Vec<u8>,
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) output: Vec<u8>,
    /// Read data the device lent ([`BlockDevice::read_shared`]), each piece to go out after
    /// `output[..at]`, so that replies still leave in order and together, one `writev`.
    pub(crate) lent: Vec<(usize, Bytes)>,
    pub(crate) lent_bytes: usize,
    /// Transmission's deadlines (the handshake has its own, in [`crate::deadlined::Deadlined`]).
    pub(crate) deadlines: Option<Deadlines>,
    /// What a read that blocks now waits for, and since when.
    pub(crate) waiting: Option<(Wait, Instant)>,
    /// The request's header has been read: more bytes are part of it.
    pub(crate) mid_request: bool,
    /// A blocked wait for the next request that wakes with nothing read returns an [`IdleTick`]
    /// error, so that the device hears of the quiet; otherwise it waits on.
    pub(crate) report_idle: bool,
}

/// Inside the `TimedOut` error of a transmission deadline that passed: which one.
#[derive(Debug)]
pub(crate) struct DeadlinePassed(pub(crate) Wait);

impl std::fmt::Display for DeadlinePassed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.describe())
    }
}

impl std::error::Error for DeadlinePassed {}

/// What a connection waits for when it blocks reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
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
pub(crate) fn written(result: io::Result<usize>, reply_limit: Option<Duration>) -> io::Result<usize> {
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
pub(crate) struct Deadlines {
    pub(crate) idle: Option<Duration>,
    pub(crate) request: Duration,
}

impl Deadlines {
    /// How often a blocked read wakes to look at the clock: a deadline is enforced within a
    /// third of itself, and an idle VM wakes now and then (at most every 20 s), not per request.
    pub(crate) fn tick(&self) -> Duration {
        let shortest = self.idle.map_or(self.request, |idle| idle.min(self.request));
        (shortest / 3).clamp(Duration::from_millis(10), Duration::from_secs(20))
    }
}

impl<T: Transport> Wire<T> {
    pub(crate) fn new(stream: T, output: Vec<u8>, counters: Arc<ProtocolCounters>) -> Self {
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
    pub(crate) fn next_request(&mut self) {
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

    pub(crate) fn buffered(&self) -> &[u8] {
        &self.input[self.start..self.end]
    }

    pub(crate) fn consume(&mut self, n: usize) {
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
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        if self.lent.is_empty() && self.output.is_empty() {
            return Ok(());
        }
        let reply_limit = self.deadlines.map(|d| d.request);
        let began = Instant::now();
        // Held inside each write too (under TLS one write is many socket writes), and only for
        // this flush: a goodbye or a TLS record sent later is not held to it.
        self.stream.set_write_deadline(reply_limit.filter(|limit| !limit.is_zero()).map(|limit| began + limit))?;
        let flushed = self.send_output(reply_limit, began);
        let cleared = self.stream.set_write_deadline(None);
        flushed.and(cleared)
    }

    fn send_output(&mut self, reply_limit: Option<Duration>, began: Instant) -> io::Result<()> {
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
    pub(crate) fn lend(&mut self, pieces: Vec<Bytes>) {
        let at = self.output.len();
        for piece in pieces {
            self.lent_bytes += piece.len();
            self.lent.push((at, piece));
        }
    }

    /// Bytes waiting to be sent.
    pub(crate) fn unsent(&self) -> usize {
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
    pub(crate) fn fill(&mut self, want: usize) -> io::Result<bool> {
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
    pub(crate) fn need_request(
        &mut self,
        device: &mut dyn BlockDevice,
        quiet_after: Duration,
    ) -> Result<bool, ConnectionError> {
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
    pub(crate) fn need(&mut self, n: usize) -> Result<bool, ConnectionError> {
        while self.buffered().len() < n {
            let had = self.buffered().len();
            if !self.fill(n)? {
                return if had == 0 { Ok(false) } else { Err(ConnectionError::Truncated) };
            }
        }
        Ok(true)
    }
}

/// The unread part of a write's payload: first what was read ahead into the input buffer, then
/// the socket, read with `readv` straight into the device's buffers.
pub(crate) struct WirePayload<'a, T> {
    pub(crate) wire: &'a mut Wire<T>,
    pub(crate) unread: usize,
    /// Why receiving failed; the connection ends with it.
    pub(crate) failed: Option<ConnectionError>,
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
    pub(crate) fn finish(mut self) -> Result<bool, ConnectionError> {
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
