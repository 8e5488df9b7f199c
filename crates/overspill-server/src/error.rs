//! The server's error type, the one mapping of engine errors onto what NBD reports, and the rule
//! for names that become file names.

use std::io;

use overspill_block::{DeviceError, DeviceErrorKind};
use overspill_engine::EngineError;

/// Longest image, version or VM name.
pub const NAME_MAX: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(
        "{what} name {name:?} is not allowed: use 1-{NAME_MAX} letters, digits, '-', '_' or '.', not starting with '.'"
    )]
    BadName { what: &'static str, name: String },
    #[error("image {0} has no current version")]
    NoCurrentVersion(String),
    #[error("image {image}: its current version {version} is not published")]
    CurrentNotPublished { image: String, version: String },
    #[error("image {image} has no version {version}")]
    NoSuchVersion { image: String, version: String },
    #[error("image {image}: {why}")]
    Stage { image: String, why: String },
    #[error("no VM named {0:?}")]
    NoSuchVm(String),
    #[error("{0} is connected: `vm reset {0}` disconnects it and drops its overlay")]
    VmConnected(String),
    #[error("{0} is moving between this server and peer {1}: try again once the move is done or given up")]
    VmMoving(String, String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error("{context}: {source}")]
    Engine {
        context: String,
        #[source]
        source: EngineError,
    },
    #[error("{0} reads through a backing file or parent: a version must be one file, so publish a flattened copy (qemu-img convert -O qcow2 or -O vhdx)")]
    Layered(String),
    /// The control socket's peer said something that is not an answer, or refused the request.
    #[error("{0}")]
    Control(String),
}

impl ServerError {
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Self::Io { context: context.into(), source }
    }
}

/// Image, version and VM names become file names and NBD export names: 1-64 of
/// `[A-Za-z0-9._-]`, not starting with `.` (so never `..`, a path or a hidden file).
pub fn check_name(what: &'static str, name: &str) -> Result<(), ServerError> {
    let ok = !name.is_empty()
        && name.len() <= NAME_MAX
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if ok {
        Ok(())
    } else {
        Err(ServerError::BadName { what, name: name.to_owned() })
    }
}

/// The one mapping from engine errors to what the protocol layer reports.
pub fn device_error(error: EngineError) -> DeviceError {
    let kind = match &error {
        EngineError::Io { source, .. } if is_out_of_descriptors(source) => {
            return DeviceError::new(
                DeviceErrorKind::Exhausted,
                format!("the server is out of file descriptors (raise its open-file limit, LimitNOFILE=): {error}"),
            );
        }
        EngineError::NoSpace(_) => DeviceErrorKind::NoSpace,
        EngineError::OutOfRange { .. } => DeviceErrorKind::Invalid,
        EngineError::Io { .. } | EngineError::Config(_) => DeviceErrorKind::Io,
        // A VM whose state cannot be recovered is refused, never served something else.
        EngineError::Corrupt(_) => DeviceErrorKind::Refused,
    };
    DeviceError::new(kind, error.to_string())
}

/// EMFILE (this process's limit) or ENFILE (the system's): each VM holds a few descriptors.
pub fn is_out_of_descriptors(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(code) if code == libc_errno::EMFILE || code == libc_errno::ENFILE)
}

/// Linux's numbers (the server runs on Linux only).
mod libc_errno {
    pub const ENFILE: i32 = 23;
    pub const EMFILE: i32 = 24;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_plain() {
        for good in ["vm-17", "a", "Win7.pool_3", "v12", &"x".repeat(NAME_MAX)] {
            assert!(check_name("VM", good).is_ok(), "{good}");
        }
        for bad in
            ["", ".", "..", ".hidden", "../../tmp/pwned", "a/b", "x\ny", "a b", "q\"{}", "ü", &"x".repeat(NAME_MAX + 1)]
        {
            assert!(check_name("VM", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn engine_errors_keep_their_meaning_on_the_wire() {
        let kind = |e| device_error(e).kind;
        assert_eq!(kind(EngineError::NoSpace("full".into())), DeviceErrorKind::NoSpace);
        assert_eq!(kind(EngineError::OutOfRange { offset: 1, len: 1, size: 1 }), DeviceErrorKind::Invalid);
        assert_eq!(kind(EngineError::Corrupt("torn".into())), DeviceErrorKind::Refused);
        assert_eq!(kind(EngineError::Config("bad".into())), DeviceErrorKind::Io);
        let emfile = io::Error::from_raw_os_error(libc_errno::EMFILE);
        assert_eq!(kind(EngineError::from_io("opening", emfile)), DeviceErrorKind::Exhausted);
        let eacces = io::Error::from_raw_os_error(13);
        assert_eq!(kind(EngineError::from_io("opening", eacces)), DeviceErrorKind::Io);
    }
}
