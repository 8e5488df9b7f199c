//! The sockets: one per VM declared for vhost-user, `DIR/NAME.sock`, made before its VMM
//! starts (a vhost-user socket serves one device, and QEMU connects to it at start). VMs are
//! declared at start (the server's flags) or at run time (the control socket's `add`, kept in
//! a record file so that they come back after a restart until withdrawn). Each socket has a
//! thread that accepts one connection at a time, opens the VM's device for it, and serves it
//! until it ends; a VMM started with `reconnect-ms` comes back by itself after a restart.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use overspill_block::{ExportProvider, VmSockets};
use overspill_net::listen::ListenerWaker;
use overspill_net::{ListenAddr, Listener, SocketAccess};
use vhost_user_backend::VhostUserDaemon;
use virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use crate::backend::{lock, Blk, Opener};
use crate::config::{DeviceConfig, Limits};

/// How long an accept loop waits before it looks at its stop flag again (a waker cuts it short
/// where it may).
const ACCEPT_LOOK_AGAIN: Duration = Duration::from_millis(500);
/// How often a connection is looked at from outside its threads: a VM reset while its guest
/// sends nothing closes within this (its worker sleeps until a kick).
const WATCH_EVERY: Duration = Duration::from_secs(1);
/// How long a client that connected may stay silent: the socket serves one connection at a
/// time, and one that says nothing would keep the VM's QEMU in the backlog.
const FIRST_MESSAGE_WITHIN: Duration = Duration::from_secs(10);

/// A VM served over vhost-user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VhostExport {
    /// The VM's name: its socket's name, and what GET_ID answers (cut to 20 bytes).
    pub vm: String,
    /// Its golden image's export name (empty: the default image).
    pub image: String,
}

impl VhostExport {
    /// What the device is opened as, the name an NBD client would give.
    fn export_name(&self) -> String {
        format!("{}@{}", self.image, self.vm)
    }
}

/// Where and how the sockets are served.
#[derive(Debug, Clone)]
pub struct VhostSettings {
    /// The sockets' directory.
    pub dir: PathBuf,
    /// Who may connect to them.
    pub access: SocketAccess,
    /// Queues each device offers.
    pub queues: u16,
    /// How long a queue is watched after its last request before its thread sleeps.
    pub poll: Duration,
    /// The file that keeps the VMs declared at run time (`None`: they last as long as the
    /// process), and how it is written whole (the server's own way with its state files).
    pub record: Option<(PathBuf, WriteWhole)>,
}

/// Replaces a file with these bytes in one step, durably.
pub type WriteWhole = fn(&Path, &[u8]) -> io::Result<()>;

/// The vhost-user sockets of a server and their threads.
pub struct VhostExports {
    settings: VhostSettings,
    provider: Arc<dyn ExportProvider>,
    served: Mutex<BTreeMap<String, Served>>,
}

struct Served {
    export: VhostExport,
    /// Declared at run time, and so written in the record.
    recorded: bool,
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    waker: ListenerWaker,
    connection: Arc<Mutex<Option<Arc<Blk>>>>,
    thread: JoinHandle<()>,
}

impl Served {
    /// Stops accepting, closes the connection in hand (its request finished first) and waits
    /// for the thread, whose listener removes the socket.
    fn end(self) {
        self.stop.store(true, Ordering::SeqCst);
        self.waker.wake();
        if let Some(connection) = lock(&self.connection).as_ref() {
            connection.close();
        }
        if self.thread.join().is_err() {
            tracing::error!(vm = %self.export.vm, "the vhost-user thread panicked");
        }
    }
}

impl VhostExports {
    /// Makes the socket of each VM in `declared` and of each VM the record holds (a stale
    /// socket is replaced, a live one or anything else is an error naming it) and starts
    /// serving them. A record that cannot be read is an error: a VM it declares would find no
    /// socket when its VMM reconnects.
    pub fn start(
        settings: VhostSettings,
        declared: &[VhostExport],
        provider: Arc<dyn ExportProvider>,
    ) -> io::Result<Self> {
        let recorded = match &settings.record {
            Some((record, _)) => read_record(record)?,
            None => Vec::new(),
        };
        let exports = Self { settings, provider, served: Mutex::new(BTreeMap::new()) };
        {
            let mut served = lock(&exports.served);
            for (export, recorded) in declared.iter().map(|e| (e, false)).chain(recorded.iter().map(|e| (e, true))) {
                if let Some(already) = served.get(&export.vm) {
                    if already.export.image != export.image {
                        tracing::warn!(
                            vm = %export.vm, image = %export.image, serving = %already.export.image,
                            "a VM declared twice on different images: it is served on the first"
                        );
                    }
                    continue;
                }
                let serving = exports.serve(export.clone(), recorded)?;
                served.insert(export.vm.clone(), serving);
            }
        }
        Ok(exports)
    }

    fn serve(&self, export: VhostExport, recorded: bool) -> io::Result<Served> {
        let socket = socket_path(&self.settings.dir, &export.vm)?;
        let listener = Listener::bind(&ListenAddr::Unix(socket.clone()))?;
        self.settings.access.apply(&socket)?;
        let waker = listener.waker()?;
        let (stop, connection) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(None)));
        let serving = Serving {
            export: export.clone(),
            provider: self.provider.clone(),
            queues: self.settings.queues,
            poll: self.settings.poll,
            stop: stop.clone(),
            connection: connection.clone(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("vhost-{}", export.vm))
            .spawn(move || serving.accept_loop(listener))?;
        Ok(Served { export, recorded, socket, stop, waker, connection, thread })
    }

    /// The sockets, one per VM.
    pub fn sockets(&self) -> Vec<PathBuf> {
        lock(&self.served).values().map(|served| served.socket.clone()).collect()
    }

    /// Stops serving: no connection is accepted any more, each one open stops taking requests,
    /// finishes the one in hand and closes (those left are sent again to the next server), and
    /// its device is dropped, the VM waiting in its reconnect grace. The record stays for the
    /// next server.
    pub fn stop(&self) {
        let served = std::mem::take(&mut *lock(&self.served));
        // Every socket told first, so that they all close at once.
        for served in served.values() {
            served.stop.store(true, Ordering::SeqCst);
            served.waker.wake();
        }
        for served in served.into_values() {
            served.end();
        }
    }

    /// Writes the VMs declared at run time in the record, whole, or leaves the old one.
    fn write_record(&self, served: &BTreeMap<String, Served>) -> io::Result<()> {
        let Some((record, write_whole)) = &self.settings.record else { return Ok(()) };
        let mut text = String::from(RECORD_HEADER);
        for served in served.values().filter(|served| served.recorded) {
            text += &format!("{}={}\n", served.export.vm, served.export.image);
        }
        write_whole(record, text.as_bytes())
            .map_err(|e| io::Error::new(e.kind(), format!("writing {}: {e}", record.display())))
    }
}

impl Drop for VhostExports {
    fn drop(&mut self) {
        self.stop();
    }
}

impl VmSockets for VhostExports {
    fn declare(&self, vm: &str, image: Option<&str>) -> io::Result<PathBuf> {
        let mut served = lock(&self.served);
        if let Some(already) = served.get(vm) {
            return match image {
                Some(image) if image != already.export.image => Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!(
                        "VM {vm} is declared on image {:?} already (withdraw it first to change its image)",
                        already.export.image
                    ),
                )),
                _ => Ok(already.socket.clone()),
            };
        }
        let export = VhostExport { vm: vm.to_owned(), image: image.unwrap_or_default().to_owned() };
        if self.provider.info(&export.export_name()).is_none() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no golden image {:?} to serve VM {vm} on", export.image),
            ));
        }
        let serving = self.serve(export, true)?;
        let socket = serving.socket.clone();
        served.insert(vm.to_owned(), serving);
        if let Err(error) = self.write_record(&served) {
            // Not kept, so not made: a socket gone after the next restart would strand its VM.
            if let Some(serving) = served.remove(vm) {
                serving.end();
            }
            return Err(error);
        }
        tracing::info!(vm, socket = %socket.display(), "vhost-user VM declared");
        Ok(socket)
    }

    fn withdraw(&self, vm: &str) -> io::Result<bool> {
        let mut served = lock(&self.served);
        let Some(serving) = served.get(vm) else { return Ok(false) };
        if lock(&serving.connection).is_some() {
            return Err(io::Error::new(
                io::ErrorKind::ResourceBusy,
                format!("VM {vm} has a VMM connected to {}: stop it first", serving.socket.display()),
            ));
        }
        let serving = served.remove(vm).expect("looked up above");
        let recorded = serving.recorded;
        serving.end();
        if recorded {
            self.write_record(&served)?;
        }
        tracing::info!(vm, "vhost-user VM withdrawn: its socket is gone");
        Ok(true)
    }

    fn declared(&self) -> Vec<(String, String, PathBuf)> {
        lock(&self.served)
            .values()
            .map(|served| (served.export.vm.clone(), served.export.image.clone(), served.socket.clone()))
            .collect()
    }

    fn directory(&self) -> PathBuf {
        self.settings.dir.clone()
    }
}

const RECORD_HEADER: &str =
    "# VMs declared for vhost-user at run time (overspill vm add), NAME=IMAGE: written by the server\n";

/// The VMs a record declares; none if it does not exist.
fn read_record(record: &Path) -> io::Result<Vec<VhostExport>> {
    let text = match std::fs::read_to_string(record) {
        Ok(text) => text,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(io::Error::new(error.kind(), format!("reading {}: {error}", record.display()))),
    };
    let mut exports = Vec::new();
    for (number, line) in text.lines().enumerate().filter(|(_, line)| !line.starts_with('#') && !line.is_empty()) {
        let Some((vm, image)) = line.split_once('=') else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} line {}: {line:?} is not NAME=IMAGE", record.display(), number + 1),
            ));
        };
        socket_path(Path::new("."), vm)?;
        exports.push(VhostExport { vm: vm.to_owned(), image: image.to_owned() });
    }
    Ok(exports)
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
        let export = self.export.export_name();
        let Some(info) = self.provider.info(&export) else {
            tracing::warn!(vm, image = %self.export.image, "vhost-user connection refused: no such golden image");
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
        let provider = self.provider.clone();
        let opener: Opener = Box::new(move |hurry| provider.open_hurried(&export, None, hurry));
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
        let watcher = watch(blk.clone(), vm.to_owned());
        let ended = daemon.wait();
        if let Some((over, thread)) = watcher {
            over.store(true, Ordering::SeqCst);
            thread.thread().unpark();
            let _ = thread.join();
        }
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

/// Watches a connection from outside its threads until `over` is set: closes it once its VM is
/// reset (an idle guest's worker sleeps until a kick, and would serve its old overlay to the
/// next request, hours later), or if the client says nothing within [`FIRST_MESSAGE_WITHIN`].
fn watch(blk: Arc<Blk>, vm: String) -> Option<(Arc<AtomicBool>, JoinHandle<()>)> {
    let over = Arc::new(AtomicBool::new(false));
    let seen = over.clone();
    let began = std::time::Instant::now();
    let spawned = std::thread::Builder::new().name(format!("vhost-watch-{vm}")).spawn(move || {
        while !seen.load(Ordering::SeqCst) {
            if blk.to_close() {
                blk.close();
                return;
            }
            if !blk.greeted() && began.elapsed() >= FIRST_MESSAGE_WITHIN {
                tracing::warn!(vm, "vhost-user client said nothing for {FIRST_MESSAGE_WITHIN:?}: connection closed");
                blk.close();
                return;
            }
            std::thread::park_timeout(WATCH_EVERY);
        }
    });
    match spawned {
        Ok(thread) => Some((over, thread)),
        Err(error) => {
            tracing::warn!(%error, "no thread to watch a vhost-user connection: a reset closes it at its next request");
            None
        }
    }
}
