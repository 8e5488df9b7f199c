//! The whole server, handshake through transmission, over a Unix socketpair: the input is what a
//! client sends (after an optional valid handshake, see `overspill_fuzz::server_prefix`), then
//! the client half-closes. The server must greet, answer, and close once the client is done,
//! within seconds, with its connection thread gone, and must still serve a well-behaved client
//! afterwards. A panic in a connection thread aborts the process (libfuzzer-sys's panic hook),
//! so it is found even though the server would only log it.
#![no_main]

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use overspill_fuzz::{play, server_prefix, EXPORT_NAME, EXPORT_SIZE};
use overspill_nbd::client::Client;
use overspill_nbd::memory::OneExport;
use overspill_nbd::server::socketpair;
use overspill_nbd::{Server, ServerConfig};

/// Far above what serving a few kilobytes takes; what exceeds it is a server waiting for a client
/// that has already said it is done.
const PATIENCE: Duration = Duration::from_secs(5);

/// One server for the process: starting one per input would cost more than the input.
fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        // libFuzzer's main is not Rust's, so SIGPIPE is not ignored: a write to a connection the
        // other side has closed would kill the fuzzer instead of returning EPIPE.
        // SAFETY: setting a signal's disposition to SIG_IGN has no preconditions.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        Server::new(Arc::new(OneExport::new(EXPORT_NAME, EXPORT_SIZE)), ServerConfig::default())
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let server = server();
    let client = socketpair(server).expect("socketpair");
    play(client, [server_prefix(mode), rest.to_vec()].concat(), PATIENCE);
    assert!(idle(server), "connection thread still running after its socket closed");
    still_serves(server);
});

/// A fresh client with a real handshake can still write and read back: whatever the input did
/// did not wedge the server or the export.
fn still_serves(server: &Server) {
    static ROUND: AtomicU8 = AtomicU8::new(0);
    let stream = socketpair(server).expect("socketpair");
    stream.set_read_timeout(Some(PATIENCE)).expect("read timeout");
    let mut client = Client::handshake(Box::new(stream), EXPORT_NAME, true).expect("handshake after fuzz input");
    // A different pattern each time, so a write that did not land is not hidden by the last one.
    let pattern = vec![ROUND.fetch_add(1, Ordering::Relaxed); 4096];
    let offset = (EXPORT_SIZE - pattern.len()) as u64;
    client.write(offset, &pattern, false).expect("write");
    let mut back = vec![0u8; pattern.len()];
    client.read(offset, &mut back).expect("read");
    assert!(back == pattern, "read back other bytes than were written");
    client.disconnect().expect("disconnect");
    assert!(idle(server), "a well-behaved connection did not end");
}

/// Whether the server's connections have all ended, waiting up to [`PATIENCE`]. `wait_idle`
/// sleeps 5 ms between looks, ten times what a whole input takes; a thread ends microseconds after
/// its socket closes, so yielding catches it first.
fn idle(server: &Server) -> bool {
    for _ in 0..10_000 {
        if server.active_connections() == 0 {
            return true;
        }
        std::thread::yield_now();
    }
    server.wait_idle(PATIENCE)
}
