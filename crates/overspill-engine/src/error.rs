//! The engine's one error type.

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The write cache has no room: RAM-only mode is full, or the spill space is exhausted.
    #[error("no space left in the write cache: {0}")]
    NoSpace(String),
    /// A range outside the virtual disk reached the engine; the protocol layer should have
    /// refused it.
    #[error("range {offset}+{len} is outside the {size}-byte disk")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("invalid configuration: {0}")]
    Config(String),
    /// State left by a previous process that cannot be trusted: the VM it belongs to must not
    /// be served from it.
    #[error("unrecoverable state: {0}")]
    Corrupt(String),
}

impl EngineError {
    /// File errors become `NoSpace` when the filesystem is full, so the guest sees ENOSPC, not EIO.
    pub fn from_io(what: &'static str, source: io::Error) -> Self {
        if is_no_space(&source) {
            Self::NoSpace(format!("{what}: {source}"))
        } else {
            Self::Io { what, source }
        }
    }
}

/// Whether a file error says there is no room: the filesystem is full, a quota is reached
/// (EDQUOT) or the file may grow no further (EFBIG). NBD asks ENOSPC for all of them.
pub(crate) fn is_no_space(error: &io::Error) -> bool {
    let no_room = [rustix::io::Errno::NOSPC, rustix::io::Errno::DQUOT, rustix::io::Errno::FBIG];
    no_room.iter().any(|errno| error.raw_os_error() == Some(errno.raw_os_error()))
        || matches!(
            error.kind(),
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded | io::ErrorKind::FileTooLarge
        )
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quota_or_a_file_size_limit_is_no_space_too() {
        for errno in [rustix::io::Errno::NOSPC, rustix::io::Errno::DQUOT, rustix::io::Errno::FBIG] {
            let error = io::Error::from_raw_os_error(errno.raw_os_error());
            assert!(matches!(EngineError::from_io("writing", error), EngineError::NoSpace(_)), "{errno:?}");
        }
        let eio = io::Error::from_raw_os_error(rustix::io::Errno::IO.raw_os_error());
        assert!(matches!(EngineError::from_io("writing", eio), EngineError::Io { .. }));
    }
}
