//! Sockets and TLS under every frontend (NBD today, vhost-user-blk and the peer link next) and
//! the control socket: listen addresses and listeners ([`listen`]), byte-stream transports
//! ([`transport`]), TLS with x509 or pre-shared keys ([`tls`]) and between peer servers
//! ([`peer_tls`]), and how to tell a killed process
//! that still holds its sockets from a live one ([`exiting`]). It speaks no protocol over them
//! (it knows only the NBD URI form of an address and NBD's names for the TLS modes, which
//! operators write).

pub mod exiting;
pub mod listen;
pub mod peer_tls;
pub mod tls;
pub mod transport;

pub use listen::{remove_stale_socket, ListenAddr, Listener, SocketAccess};
pub use peer_tls::{PeerStream, PeerTls};
pub use tls::{ServerTls, TlsMode};
pub use transport::{connect, ReadStopper, Transport};
