//! The handshake's one deadline over a whole stream.

use std::io::{self, IoSliceMut, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use overspill_net::{ReadStopper, Transport};

/// A stream whose reads and writes share one deadline until a timeout is set: the handshake's.
/// Each read may wait only for what is left of it, so a client dribbling a byte a second cannot
/// hold a connection slot past the deadline (a plain per-read timeout starts afresh with every
/// byte); each write too, so a client that does not read its replies cannot either. Setting a
/// read or write timeout, as the transmission phase does, ends the deadline.
///
/// In transmission it keeps the deadline of the replies being sent instead (see
/// [`Transport::set_write_deadline`]): under TLS one write of replies is many socket writes,
/// each of which the socket's own timeout bounds alone.
pub(crate) struct Deadlined<T> {
    inner: T,
    deadline: Instant,
    active: AtomicBool,
    replies: Mutex<ReplyBound>,
}

/// The replies' deadline while a flush runs; the socket's write timeout as last armed, and as
/// transmission set it. Re-armed only when the time left falls well below what is armed (a
/// setsockopt before every write would cost the fast path), and put back as transmission set
/// it when the flush is over (a timeout lowered for one slow flush would otherwise cut the
/// next ones short).
#[derive(Default)]
struct ReplyBound {
    by: Option<Instant>,
    armed: Option<Duration>,
    configured: Option<Duration>,
}

/// How far past the replies' deadline a write may wait: the socket's timeout is re-armed once
/// the time left is this much below it.
const REARM_SLACK: Duration = Duration::from_millis(500);

impl<T: Transport> Deadlined<T> {
    pub(crate) fn new(inner: T, within: Duration) -> Self {
        Self { inner, deadline: Instant::now() + within, active: AtomicBool::new(true), replies: Mutex::default() }
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
        if let Some(left) = self.left()? {
            return self.inner.set_write_timeout(Some(left));
        }
        let mut replies = self.replies.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(by) = replies.by else { return Ok(()) };
        let left = by.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "replies not taken in time"));
        }
        if replies.armed.is_some_and(|armed| left + REARM_SLACK >= armed) {
            return Ok(());
        }
        replies.armed = Some(left);
        self.inner.set_write_timeout(Some(left))
    }

    /// What is left of the deadline while it holds.
    pub(crate) fn left(&self) -> io::Result<Option<Duration>> {
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
        let mut replies = self.replies.lock().unwrap_or_else(PoisonError::into_inner);
        (replies.armed, replies.configured) = (timeout, timeout);
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

    fn set_write_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        let mut replies = self.replies.lock().unwrap_or_else(PoisonError::into_inner);
        replies.by = deadline;
        if deadline.is_none() && replies.armed != replies.configured {
            replies.armed = replies.configured;
            return self.inner.set_write_timeout(replies.configured);
        }
        Ok(())
    }

    fn close(&mut self) -> io::Result<()> {
        // The goodbye is not held to the last replies' deadline.
        self.set_write_deadline(None)?;
        self.inner.close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    /// A flush that ran short of time lowers the socket's write timeout for its last writes;
    /// once it is over the timeout is transmission's again (a lowered one cut the next
    /// flushes short, and a goodbye sent after a quiet spell failed at once).
    #[test]
    fn the_write_timeout_lowered_for_one_flush_is_put_back_after_it() {
        let (ours, _theirs) = UnixStream::pair().expect("socketpair");
        let probe = ours.try_clone().expect("clone");
        let mut stream = Deadlined::new(ours, Duration::from_secs(10));
        stream.set_write_timeout(Some(Duration::from_secs(60))).expect("transmission's timeout");
        stream.set_write_deadline(Some(Instant::now() + Duration::from_millis(300))).expect("deadline");
        stream.write_all(b"reply").expect("write");
        let lowered = probe.write_timeout().expect("timeout").expect("set");
        assert!(lowered <= Duration::from_millis(300), "armed {lowered:?} for the flush's last 300 ms");
        stream.set_write_deadline(None).expect("flush over");
        assert_eq!(probe.write_timeout().expect("timeout"), Some(Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(400));
        stream.write_all(b"goodbye").expect("a write after the flush is not held to its deadline");
    }
}
