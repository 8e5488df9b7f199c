//! The sockets: one per VM declared for vhost-user, `DIR/NAME.sock`, made before its VMM
//! starts (a vhost-user socket serves one device, and QEMU connects to it at start). Each has a
//! thread that accepts one connection at a time, opens the VM's device for it, and serves it
//! until it ends; a VMM started with `reconnect-ms` comes back by itself after a restart.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use overspill_block::ExportProvider;
use overspill_net::listen::ListenerWaker;
use overspill_net::{ListenAddr, Listener};
use vhost_user_backend::VhostUserDaemon;
use virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use crate::backend::{lock, Blk, Opener};
use crate::config::{DeviceConfig, Limits};

/// How long an accept loop waits before it looks at its stop flag again (a waker cuts it short
/// where it may).
const ACCEPT_LOOK_AGAIN: Duration = Duration::from_millis(500);

/// A VM served over vhost-user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VhostExport {
    /// The VM's name: its socket's name, and what GET_ID answers (cut to 20 bytes).
    pub vm: String,
    /// What the device is opened as, the name an NBD client would give (`IMAGE@VM`).
    pub export: String,
}

/// The vhost-user sockets of a server and their threads.
pub struct VhostExports {
    stop: Arc<AtomicBool>,
    served: Vec<Served>,
}

struct Served {
    vm: String,
    socket: PathBuf,
    waker: ListenerWaker,
    connection: Arc<Mutex<Option<Arc<Blk>>>>,
    thread: JoinHandle<()>,
}

impl VhostExports {
    /// Makes each VM's socket in `dir` (a stale one is replaced, a live one or anything else
    /// is an error naming it) and starts serving them, each VM's device with `queues` queues,
    /// each queue watched for `poll` after its last request before its thread sleeps.
    pub fn start(
        dir: &Path,
        exports: &[VhostExport],
        provider: Arc<dyn ExportProvider>,
        queues: u16,
        poll: Duration,
    ) -> io::Result<Self> {
        let mut listeners = Vec::with_capacity(exports.len());
        for export in exports {
            let path = socket_path(dir, &export.vm)?;
            listeners.push((export.clone(), path.clone(), Listener::bind(&ListenAddr::Unix(path))?));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut served = Vec::with_capacity(listeners.len());
        for (export, socket, listener) in listeners {
            let waker = listener.waker()?;
            let connection = Arc::new(Mutex::new(None));
            let serving = Serving {
                export: export.clone(),
                provider: provider.clone(),
                queues,
                poll,
                stop: stop.clone(),
                connection: connection.clone(),
            };
            let thread = std::thread::Builder::new()
                .name(format!("vhost-{}", export.vm))
                .spawn(move || serving.accept_loop(listener))?;
            served.push(Served { vm: export.vm, socket, waker, connection, thread });
        }
        Ok(Self { stop, served })
    }

    /// The sockets, one per VM.
    pub fn sockets(&self) -> impl Iterator<Item = &Path> {
        self.served.iter().map(|served| served.socket.as_path())
    }

    /// Stops serving: no connection is accepted any more, each one open stops taking requests,
    /// finishes the one in hand and closes (those left are sent again to the next server), and
    /// its device is dropped, the VM waiting in its reconnect grace.
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        for served in &self.served {
            served.waker.wake();
            if let Some(connection) = lock(&served.connection).as_ref() {
                connection.close();
            }
        }
        for served in self.served {
            if served.thread.join().is_err() {
                tracing::error!(vm = %served.vm, "the vhost-user thread panicked");
            }
        }
    }
}

/// `dir/NAME.sock`, for a name that is one path component.
fn socket_path(dir: &Path, vm: &str) -> io::Result<PathBuf> {
    if vm.is_empty() || vm.contains('/') || vm == "." || vm == ".." {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{vm:?} cannot name a vhost-user socket")));
    }
    Ok(dir.join(format!("{vm}.sock")))
}

struct Serving {
    export: VhostExport,
    provider: Arc<dyn ExportProvider>,
    queues: u16,
    poll: Duration,
    stop: Arc<AtomicBool>,
    connection: Arc<Mutex<Option<Arc<Blk>>>>,
}

impl Serving {
    fn accept_loop(self, listener: Listener) {
        let vm = self.export.vm.as_str();
        let Listener::Unix(unix, ..) = &listener else {
            tracing::error!(vm, "a vhost-user socket must be a Unix socket");
            return;
        };
        while !self.stop.load(Ordering::SeqCst) {
            if !listener.client_waiting(ACCEPT_LOOK_AGAIN) || self.stop.load(Ordering::SeqCst) {
                continue;
            }
            if let Err(error) = self.serve_one(unix) {
                tracing::warn!(vm, %error, "vhost-user connection ended with an error");
            }
        }
    }

    /// Accepts the waiting connection and serves it until it ends. The device is opened when
    /// the VMM first asks about it; until then the export says what it will be.
    fn serve_one(&self, unix: &std::os::unix::net::UnixListener) -> io::Result<()> {
        let vm = self.export.vm.as_str();
        let Some(info) = self.provider.info(&self.export.export) else {
            tracing::warn!(vm, export = %self.export.export, "vhost-user connection refused: no such export");
            drop(unix.accept());
            return Ok(());
        };
        let config = DeviceConfig {
            size: info.size,
            capabilities: info.capabilities,
            queues: self.queues,
            limits: Limits::default(),
        };
        let id = vm.as_bytes()[..vm.len().min(VIRTIO_BLK_ID_BYTES as usize)].to_vec();
        let (provider, export) = (self.provider.clone(), self.export.export.clone());
        let opener: Opener = Box::new(move || provider.open(&export, None));
        let memory = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let blk = Arc::new(Blk::new(opener, memory.clone(), config, id, self.poll));
        let result = self.run_daemon(&blk, unix, memory);
        *lock(&self.connection) = None;
        drop(blk.take_device());
        result
    }

    fn run_daemon(
        &self,
        blk: &Arc<Blk>,
        unix: &std::os::unix::net::UnixListener,
        memory: crate::backend::Memory,
    ) -> io::Result<()> {
        let vm = self.export.vm.as_str();
        let daemon_error = |e: vhost_user_backend::Error| io::Error::other(e.to_string());
        let mut daemon = VhostUserDaemon::new(format!("vhost-user-{vm}"), blk.clone(), memory).map_err(daemon_error)?;
        // A listener of its own (no path: it removes no file) on the same socket.
        let mut listener = vhost::vhost_user::Listener::from(unix.try_clone()?);
        daemon.start(&mut listener).map_err(daemon_error)?;
        blk.set_shutdown(daemon.shutdown_handle());
        *lock(&self.connection) = Some(blk.clone());
        // A stop that came before the connection was registered did not close it.
        if self.stop.load(Ordering::SeqCst) {
            blk.close();
        }
        tracing::info!(vm, "vhost-user connection opened");
        let ended = daemon.wait();
        // Dropping the daemon stops and joins its worker: no request is carried out after.
        drop(daemon);
        tracing::info!(vm, "vhost-user connection closed");
        match ended {
            Ok(()) => Ok(()),
            // A VMM that quits or dies closes the socket: an ordinary end.
            Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => Ok(()),
            Err(error) => Err(daemon_error(error)),
        }
    }
}
