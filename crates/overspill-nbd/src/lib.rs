//! The NBD protocol, server side (and a small client): fixed-newstyle handshake, request framing
//! and replies, over Unix or TCP sockets, in plain text or upgraded to TLS by STARTTLS ([`tls`]).
//!
//! This crate knows nothing of caching. It serves whatever [`BlockDevice`] an [`ExportProvider`]
//! opens for each connection; transmission flags follow from the device's [`Capabilities`].
//! The handshake and request parsing are sans-IO ([`handshake`], [`request`]) so they can be
//! tested and fuzzed without sockets; [`connection`] moves the bytes.

pub mod client;
pub mod connection;
pub mod counters;
pub mod device;
pub mod exiting;
pub mod handshake;
pub mod memory;
pub mod request;
pub mod server;
pub mod tls;
pub mod wire;

pub use connection::{serve_connection, Limits, Security, Transport};
pub use device::{
    BlockDevice, BlockSizes, Capabilities, DeviceError, DeviceErrorKind, ExportAccess, ExportInfo, ExportProvider,
    Extent, Payload,
};
pub use server::{ListenAddr, Listener, Server, ServerConfig};
pub use tls::{ServerTls, TlsMode};
