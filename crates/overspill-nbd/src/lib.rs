//! The NBD protocol, server side (and a small client): fixed-newstyle handshake, request framing
//! and replies, over the sockets of `overspill_net`, in plain text or upgraded to TLS by STARTTLS.
//!
//! This crate knows nothing of caching. It serves whatever `BlockDevice` (the seam of
//! `overspill_block`) an `ExportProvider` opens for each connection; transmission flags follow
//! from the device's `Capabilities`.
//! The handshake and request parsing are sans-IO ([`handshake`], [`request`]) so they can be
//! tested and fuzzed without sockets; [`connection`] moves the bytes.

pub mod client;
pub mod connection;
pub mod counters;
mod deadlined;
pub mod handshake;
pub mod memory;
mod replies;
pub mod request;
pub mod server;
mod stream;
pub mod wire;

pub use connection::{serve_connection, Limits, Security};
pub use server::{Server, ServerConfig};
