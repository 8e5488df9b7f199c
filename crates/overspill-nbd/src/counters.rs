//! What the protocol layer refused or answered with an error, for the server's metrics: error
//! replies by command and errno, and connections turned away or cut off by reason. Rare events,
//! so a lock per count costs nothing on the data path.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::wire::Errno;

/// Why a connection was turned away or cut off before it served an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Refusal {
    /// `--max-connections` reached.
    TooManyConnections,
    /// `--max-handshakes` reached with none old enough to shed.
    TooManyHandshakes,
    /// A slow handshake cut off to make room for a new connection.
    HandshakeShed,
    /// GO for an export that does not exist or is hidden from the client.
    UnknownExport,
    /// The export refused this client (a VM name in use or not allowed, a lost VM).
    Policy,
    /// The export exists and could not be opened.
    CannotOpen,
    /// The server lacked a resource to open the export (file descriptors at its limit).
    OutOfResources,
    /// The handshake did not finish within its deadline.
    HandshakeTimeout,
    /// The handshake broke the protocol.
    HandshakeError,
    /// The TLS handshake failed.
    Tls,
    /// A VM sent no request for `--idle-timeout`.
    IdleTimeout,
    /// A request did not arrive whole within `--request-timeout` of its first byte.
    RequestTimeout,
}

impl Refusal {
    pub const ALL: [Refusal; 12] = [
        Refusal::TooManyConnections,
        Refusal::TooManyHandshakes,
        Refusal::HandshakeShed,
        Refusal::UnknownExport,
        Refusal::Policy,
        Refusal::CannotOpen,
        Refusal::OutOfResources,
        Refusal::HandshakeTimeout,
        Refusal::HandshakeError,
        Refusal::Tls,
        Refusal::IdleTimeout,
        Refusal::RequestTimeout,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::TooManyConnections => "too-many-connections",
            Refusal::TooManyHandshakes => "too-many-handshakes",
            Refusal::HandshakeShed => "handshake-shed",
            Refusal::UnknownExport => "unknown-export",
            Refusal::Policy => "policy",
            Refusal::CannotOpen => "cannot-open",
            Refusal::OutOfResources => "out-of-resources",
            Refusal::HandshakeTimeout => "handshake-timeout",
            Refusal::HandshakeError => "handshake-error",
            Refusal::Tls => "tls",
            Refusal::IdleTimeout => "idle-timeout",
            Refusal::RequestTimeout => "request-timeout",
        }
    }
}

/// A request's command as the metrics name it.
pub fn command_name(kind: u16) -> &'static str {
    match kind {
        crate::wire::CMD_READ => "read",
        crate::wire::CMD_WRITE => "write",
        crate::wire::CMD_DISC => "disconnect",
        crate::wire::CMD_FLUSH => "flush",
        crate::wire::CMD_TRIM => "trim",
        crate::wire::CMD_WRITE_ZEROES => "write_zeroes",
        crate::wire::CMD_CACHE => "cache",
        crate::wire::CMD_BLOCK_STATUS => "block_status",
        _ => "other",
    }
}

pub fn errno_name(errno: Errno) -> &'static str {
    match errno {
        Errno::Perm => "EPERM",
        Errno::Io => "EIO",
        Errno::NoMem => "ENOMEM",
        Errno::Inval => "EINVAL",
        Errno::NoSpc => "ENOSPC",
        Errno::NotSup => "ENOTSUP",
        Errno::Shutdown => "ESHUTDOWN",
    }
}

#[derive(Debug, Default)]
pub struct ProtocolCounters {
    errors: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    refusals: Mutex<BTreeMap<Refusal, u64>>,
}

impl ProtocolCounters {
    pub fn error_reply(&self, command: &'static str, errno: Errno) {
        let mut errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        *errors.entry((command, errno_name(errno))).or_default() += 1;
    }

    pub fn refused(&self, why: Refusal) {
        *self.refusals.lock().unwrap_or_else(|p| p.into_inner()).entry(why).or_default() += 1;
    }

    /// Error replies so far: ((command, errno), count), only those that happened.
    pub fn error_replies(&self) -> Vec<((&'static str, &'static str), u64)> {
        self.errors.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, v)| (*k, *v)).collect()
    }

    /// Refusals so far, every reason (zero included, so that rates start from a known series).
    pub fn refusals(&self) -> Vec<(Refusal, u64)> {
        let counted = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        Refusal::ALL.iter().map(|r| (*r, counted.get(r).copied().unwrap_or(0))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_key() {
        let c = ProtocolCounters::default();
        c.error_reply("write", Errno::NoSpc);
        c.error_reply("write", Errno::NoSpc);
        c.error_reply("read", Errno::Io);
        c.refused(Refusal::Policy);
        assert_eq!(c.error_replies(), vec![(("read", "EIO"), 1), (("write", "ENOSPC"), 2)]);
        let refusals = c.refusals();
        assert_eq!(refusals.len(), Refusal::ALL.len());
        assert!(refusals.contains(&(Refusal::Policy, 1)) && refusals.contains(&(Refusal::Tls, 0)));
    }
}
