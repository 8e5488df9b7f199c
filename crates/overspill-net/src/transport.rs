//! Byte streams a frontend serves on: Unix and TCP sockets, either end of a socketpair, or a TLS
//! session over one ([`crate::tls`]), with what a server needs beyond `Read + Write`: timeouts, a
//! way to stop a blocked read from another thread, reads that do not wait.

use std::io::{self, IoSliceMut, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::listen::ListenAddr;

/// Ends a stream's reads from another thread: a read blocked on it returns end of stream.
pub type ReadStopper = Box<dyn Fn() -> io::Result<()> + Send>;

/// A byte stream the server can serve on: a Unix or TCP socket (or either end of a socketpair).
pub trait Transport: Read + Write + Send + 'static {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;

    /// Bounds writes, so that a goodbye to a client that no longer reads cannot block forever.
    fn set_write_timeout(&self, _timeout: Option<Duration>) -> io::Result<()> {
        Ok(())
    }

    /// A handle that shuts the stream for reading from another thread, so that a server shutting
    /// down can wake connections blocked waiting for a request. `None` if the stream has none;
    /// such a connection then ends only when its client goes.
    fn read_stopper(&self) -> Option<ReadStopper> {
        None
    }

    /// Reads what has arrived into `bufs`, in order, without waiting: `None` if the stream
    /// cannot.
    fn read_now(&mut self, _bufs: &mut [IoSliceMut<'_>]) -> Option<io::Result<usize>> {
        None
    }

    /// Bounds the writes to come, however many socket writes each one takes (a TLS write of a
    /// few MiB is many): none may wait past `deadline` (`None`: the bound is over). Kept by a
    /// wrapper that re-arms the socket's write timeout as the time left runs out (the server's
    /// handshake wrapper, under every connection, TLS or not); nothing otherwise.
    fn set_write_deadline(&self, _deadline: Option<std::time::Instant>) -> io::Result<()> {
        Ok(())
    }

    /// Ends the session on the stream before it is dropped: TLS sends its close_notify (NBD_CMD_DISC
    /// requires the TLS session shut down before the connection closes). Nothing for a socket.
    fn close(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn recv_now(fd: std::os::fd::BorrowedFd<'_>, bufs: &mut [IoSliceMut<'_>]) -> Option<io::Result<usize>> {
    let mut no_control = rustix::net::RecvAncillaryBuffer::default();
    let received = rustix::net::recvmsg(fd, bufs, &mut no_control, rustix::net::RecvFlags::DONTWAIT);
    Some(received.map(|r| r.bytes).map_err(io::Error::from))
}

impl Transport for std::os::unix::net::UnixStream {
    fn read_now(&mut self, bufs: &mut [IoSliceMut<'_>]) -> Option<io::Result<usize>> {
        recv_now(std::os::fd::AsFd::as_fd(self), bufs)
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_read_timeout(self, timeout)
    }

    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_write_timeout(self, timeout)
    }

    fn read_stopper(&self) -> Option<ReadStopper> {
        // A second descriptor for the same socket: shutdown acts on the socket, not the fd.
        let socket = self.try_clone().ok()?;
        Some(Box::new(move || socket.shutdown(Shutdown::Read)))
    }
}

impl Transport for std::net::TcpStream {
    fn read_now(&mut self, bufs: &mut [IoSliceMut<'_>]) -> Option<io::Result<usize>> {
        recv_now(std::os::fd::AsFd::as_fd(self), bufs)
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        std::net::TcpStream::set_read_timeout(self, timeout)
    }

    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        std::net::TcpStream::set_write_timeout(self, timeout)
    }

    fn read_stopper(&self) -> Option<ReadStopper> {
        let socket = self.try_clone().ok()?;
        Some(Box::new(move || socket.shutdown(Shutdown::Read)))
    }

    fn close(&mut self) -> io::Result<()> {
        linger(self);
        Ok(())
    }
}

/// Has the kernel probe `tcp` while it is idle (30 s, then 3 probes 10 s apart): a peer whose
/// host died or vanished behind a partition (no FIN, no RST) is found gone in about a minute,
/// where a side that never sends on an idle connection would otherwise wait for it for ever.
/// A live host answers the probes whatever its process does.
pub fn keep_alive(tcp: &TcpStream) -> io::Result<()> {
    use rustix::net::sockopt;
    sockopt::set_socket_keepalive(tcp, true)?;
    sockopt::set_tcp_keepidle(tcp, Duration::from_secs(30))?;
    sockopt::set_tcp_keepintvl(tcp, Duration::from_secs(10))?;
    Ok(sockopt::set_tcp_keepcnt(tcp, 3)?)
}

/// How long a TCP connection this end closes waits for the peer to take the last bytes and close
/// its side.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// Ends a TCP connection without a reset: a socket closed with input it never read resets the
/// connection, and the kernel throws away what it had not sent yet (the end of the last reply).
/// So the sending side is shut (the peer reads the replies, then the end), and whatever the peer
/// still sends (requests the server will not answer) is read and dropped until the peer closes,
/// for at most [`CLOSE_LINGER`].
pub fn linger(tcp: &TcpStream) {
    let _ = tcp.shutdown(Shutdown::Write);
    let deadline = std::time::Instant::now() + CLOSE_LINGER;
    if tcp.set_nonblocking(false).is_err() {
        return;
    }
    let mut sink = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() || tcp.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match (&*tcp).read(&mut sink) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
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

    fn set_write_deadline(&self, deadline: Option<std::time::Instant>) -> std::io::Result<()> {
        (**self).set_write_deadline(deadline)
    }

    fn close(&mut self) -> std::io::Result<()> {
        (**self).close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A boxed stream ends its session as the stream itself would (a boxed TLS stream once
    /// dropped without its close_notify).
    #[test]
    fn a_boxed_stream_passes_close_on() {
        struct Closing(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl io::Read for Closing {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Ok(0)
            }
        }
        impl io::Write for Closing {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                Ok(buf.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        impl Transport for Closing {
            fn set_read_timeout(&self, _: Option<Duration>) -> io::Result<()> {
                Ok(())
            }
            fn close(&mut self) -> io::Result<()> {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
                Ok(())
            }
        }
        let closed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut boxed: Box<dyn Transport> = Box::new(Closing(closed.clone()));
        Transport::close(&mut boxed).expect("close");
        assert!(closed.load(std::sync::atomic::Ordering::SeqCst));
    }
}
