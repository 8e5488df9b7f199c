//! Listening sockets: addresses as operators write them, binding that takes over only a dead
//! server's Unix socket (and waits, bounded, for one being killed), sockets handed over by systemd
//! or by a server restarting in place, and a waker for an accept loop that must stop.

use std::fmt;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

/// Where a listener listens: `unix:PATH` or `tcp:HOST:PORT`.
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
/// else is left as it is and refused: a server removes no file it did not make.
pub fn remove_stale_socket(path: &std::path::Path) -> std::io::Result<()> {
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
            format!(
                "{} exists and is not a socket; it is left alone (choose another path for the socket)",
                path.display()
            ),
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

/// Who may connect to a Unix socket this server makes: its mode and group, when given (others
/// keep what the umask and the server's user give).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SocketAccess {
    pub mode: Option<u32>,
    pub group: Option<u32>,
}

impl SocketAccess {
    /// Gives the socket its group, then its mode: until then it has the umask's, never more.
    pub fn apply(&self, path: &std::path::Path) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        if let Some(gid) = self.group {
            std::os::unix::fs::chown(path, None, Some(gid))
                .map_err(|e| std::io::Error::new(e.kind(), format!("giving {} to group {gid}: {e}", path.display())))?;
        }
        if let Some(mode) = self.mode {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|e| {
                std::io::Error::new(e.kind(), format!("setting mode {mode:o} on {}: {e}", path.display()))
            })?;
        }
        Ok(())
    }
}

/// Wakes the accept loop at once, where it may: a socket of this server's own is shut for
/// reading, which makes a waiting poll or accept return on Linux, even when its Unix socket
/// file is gone. One the service manager holds must stay open (shut, it would refuse the next
/// server's clients too): the loop must look at its flag now and then.
#[derive(Debug)]
pub struct ListenerWaker {
    socket: std::os::fd::OwnedFd,
    may_shut: bool,
}

impl ListenerWaker {
    pub fn wake(&self) {
        if self.may_shut {
            let _ = rustix::net::shutdown(&self.socket, rustix::net::Shutdown::Read);
        }
    }
}

impl Listener {
    /// Whether a client is waiting to be accepted, after waiting up to `patience` for one (or
    /// the socket to fail: accept then says how).
    pub fn client_waiting(&self, patience: Duration) -> bool {
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

    pub fn waker(&self) -> std::io::Result<ListenerWaker> {
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
