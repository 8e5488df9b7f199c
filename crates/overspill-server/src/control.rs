//! The control socket and `overspill vm`: list the named VMs, reset or drop one, declare one
//! for a frontend that listens per VM (vhost-user).
//!
//! One JSON request per line on a Unix socket (`{"op":"list"}`, `{"op":"reset","vm":"NAME"}`,
//! `{"op":"drop","vm":"NAME"}`, `{"op":"add","vm":"NAME","image":"IMAGE"}`), one JSON answer
//! per line. The socket is made mode 0600 (the
//! server's user only: a reset throws a VM's writes away); each connection gets a thread and
//! [`TIMEOUT`] for its whole request, capped in length, and at most [`MAX_CLIENTS`] are answered
//! at once (a script looping on `vm list` without reading its answers, or stuck, must not pile up
//! threads in the server that holds the VMs).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use overspill_block::VmSockets;
use overspill_net::{ListenAddr, Listener};
use serde::{Deserialize, Serialize};

use crate::migration::{HeldAtPeer, Located, Peers};
use crate::vm_limits::HostBudget;
use crate::vms::{VmRegistry, VmState, VmStatus};
use crate::{check_name, ServerError};

/// Where `serve` puts its control socket unless told otherwise: inside its default state directory.
pub const DEFAULT_CONTROL_SOCKET: &str = "/var/tmp/overspill/state/control.sock";

/// Longest request line accepted.
const MAX_REQUEST_BYTES: usize = 4096;
/// Time a client has to send its whole request (and to take its answer).
const TIMEOUT: Duration = Duration::from_secs(5);
/// Clients answered at once; others are closed at once, unanswered.
const MAX_CLIENTS: usize = 16;

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    List,
    Reset {
        vm: String,
        /// Refused, rather than done, if the VM is connected when the server looks (the libvirt
        /// hook at a domain's start: a VM connected is another QEMU's disk). Checked and done
        /// under one lock, where a `list` before it could be overtaken by a reconnect.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        unless_connected: bool,
        /// At this server's peers too, each unless the VM is connected there (the libvirt hook
        /// at a domain's fresh start: a peer's copy in grace, the VM's last run there, would
        /// otherwise be taken by its first connection here).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        everywhere: bool,
    },
    Drop {
        vm: String,
    },
    /// Declares a VM whose frontend listens on a socket of its own (vhost-user) on an image
    /// (none: the one it is declared with already, or the default one).
    Add {
        vm: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        image: Option<String>,
    },
    /// Where VM `vm` runs among this server's peers: a peer that holds it live (`peer` in the
    /// answer) is where a migration to this host takes it from (the libvirt hook asks).
    Locate {
        vm: String,
    },
    /// Sets a VM's limits (its operations and bytes per second), live; with neither changed,
    /// says them. With `group`, `vm` names a group, whose limits its VMs share.
    Limit {
        vm: String,
        #[serde(default)]
        group: bool,
        #[serde(default)]
        ops: RateChange,
        #[serde(default)]
        bytes: RateChange,
    },
    /// Sets one of the host's budgets (golden-image fetches, spill writes), live; with neither
    /// changed, says it. (A request of its own, not a flag of `Limit`: a server that does not
    /// know it refuses it rather than limit a VM of that name.)
    HostLimit {
        budget: HostBudget,
        #[serde(default)]
        ops: RateChange,
        #[serde(default)]
        bytes: RateChange,
    },
    /// VM `vm`'s boot is over (a guest agent or the operator knows): its boot slot goes to the
    /// next VM in line, and its golden-image fetches no longer go first.
    Booted {
        vm: String,
    },
    /// Captures VM `vm` as the next version of its image (an image of the store): its overlay
    /// ends with it.
    Capture {
        vm: String,
    },
    /// Writes VM `vm`'s disk as checkpoint `name` of its image; the VM goes on.
    Checkpoint {
        vm: String,
        name: String,
    },
    /// Makes forks `names` of checkpoint `from` (`IMAGE:@NAME`), or of VM `from` through a new
    /// checkpoint `checkpoint` of it.
    Fork {
        from: String,
        names: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        checkpoint: Option<String>,
    },
    /// The test group of image stages: replaced by `set` if given; answered with it as it is.
    TestGroup {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        set: Option<Vec<String>>,
    },
}

/// A limit as `vm limit` changes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RateChange {
    #[default]
    Keep,
    Off,
    Set {
        per_second: u64,
        burst: u64,
    },
}

impl RateChange {
    fn change(self) -> Option<Option<overspill_block::Rate>> {
        match self {
            Self::Keep => None,
            Self::Off => Some(None),
            Self::Set { per_second, burst } => Some(Some(overspill_block::Rate { per_second, burst })),
        }
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Answer {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vms: Option<Vec<VmStatus>>,
    /// The socket of a VM just declared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
    /// With a list: where the server makes vhost-user sockets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vhost_user_dir: Option<PathBuf>,
    /// With a list or a checkpoint: the image store the server serves (`serve --images`), so
    /// that `vm checkpoint --to` and `vm fork MANIFEST` take checkpoints out and bring them in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<PathBuf>,
    /// With a checkpoint or a fork: the checkpoint's label, `IMAGE:@NAME`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    /// With a list: where the server listens for NBD clients (`unix:PATH`, `tcp:HOST:PORT`),
    /// so that a libvirt hook tells its disks from another NBD server's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_listen: Option<Vec<String>>,
    /// With a locate: the peer that holds the VM live.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// With a reset `everywhere`: the server took `everywhere` in. A server of an earlier release
    /// ignores the field it does not know and resets the VM here only, so its answer, `ok` as
    /// it is, leaves this false ([`ask`] then finds out whether it has peers it skipped).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub everywhere: bool,
}

/// The control socket of a server: the listener (its file goes with it) and the per-VM
/// sockets' frontend, known once it has started.
pub struct Control {
    _listener: Arc<Listener>,
    sockets: Arc<OnceLock<Arc<dyn VmSockets>>>,
    peers: Arc<OnceLock<Peers>>,
    nbd_listen: Arc<OnceLock<Vec<String>>>,
}

impl Control {
    /// From now on `list` tells where the server listens for NBD clients.
    pub fn serve_nbd_listen(&self, addresses: Vec<String>) {
        let _ = self.nbd_listen.set(addresses);
    }

    /// From now on `add` declares VMs on `sockets`, and `drop` and `list` see them.
    pub fn serve_sockets(&self, sockets: Arc<dyn VmSockets>) {
        let _ = self.sockets.set(sockets);
    }

    /// From now on `locate` asks `peers`.
    pub fn serve_peers(&self, peers: Peers) {
        let _ = self.peers.set(peers);
    }
}

/// What the control socket acts on.
struct Targets {
    registry: Arc<VmRegistry>,
    sockets: Arc<OnceLock<Arc<dyn VmSockets>>>,
    peers: Arc<OnceLock<Peers>>,
    nbd_listen: Arc<OnceLock<Vec<String>>>,
}

/// Serves the control socket at `path` on a thread of its own; the socket goes with the
/// returned [`Control`].
pub fn spawn(path: &Path, registry: Arc<VmRegistry>) -> Result<Control, ServerError> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        crate::files::own_directory(dir).map_err(|e| ServerError::io(format!("creating {}", dir.display()), e))?;
    }
    let listener = Arc::new(Listener::bind(&ListenAddr::Unix(path.to_owned())).map_err(|e| {
        ServerError::io(format!("control socket {} (each server needs a --state-dir of its own)", path.display()), e)
    })?);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| ServerError::io(format!("making {} private", path.display()), e))?;
    let Listener::Unix(socket, ..) = listener.as_ref() else { unreachable!("bound a unix address") };
    let socket = socket.try_clone().map_err(|e| ServerError::io("control socket", e))?;
    let clients = Arc::new(AtomicUsize::new(0));
    let sockets = Arc::new(OnceLock::new());
    let peers = Arc::new(OnceLock::new());
    let nbd_listen = Arc::new(OnceLock::new());
    let targets =
        Arc::new(Targets { registry, sockets: sockets.clone(), peers: peers.clone(), nbd_listen: nbd_listen.clone() });
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for stream in socket.incoming() {
                let stream = match stream {
                    Ok(stream) => stream,
                    // Out of file descriptors, most likely: the client waits in the backlog,
                    // and this thread must not spin a core until one is free.
                    Err(error) => {
                        tracing::debug!(%error, "control socket: accept failed");
                        std::thread::sleep(std::time::Duration::from_millis(10));
                        continue;
                    }
                };
                if !peer_may_control(&stream) {
                    continue;
                }
                if clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
                    clients.fetch_sub(1, Ordering::SeqCst);
                    tracing::warn!("control socket: {MAX_CLIENTS} clients already being answered; one more closed");
                    continue;
                }
                let (targets, answering) = (targets.clone(), Answering(clients.clone()));
                let _ = std::thread::Builder::new().name("control-client".into()).spawn(move || {
                    let _answering = answering;
                    if let Err(error) = answer(stream, &targets) {
                        tracing::debug!(%error, "control client");
                    }
                });
            }
        })
        .map_err(|e| ServerError::io("starting the control thread", e))?;
    Ok(Control { _listener: listener, sockets, peers, nbd_listen })
}

/// Whether the client at the other end of `stream` runs as the server's user or root. The
/// socket's mode (0600) says the same, but only from the moment it is set: a client of another
/// user could connect between the bind, under the umask's mode, and the chmod, and wait in the
/// backlog to be answered.
fn peer_may_control(stream: &UnixStream) -> bool {
    match rustix::net::sockopt::socket_peercred(stream) {
        Ok(peer) if peer.uid.is_root() || peer.uid == rustix::process::geteuid() => true,
        Ok(peer) => {
            tracing::warn!(
                uid = peer.uid.as_raw(),
                pid = peer.pid.as_raw_nonzero().get(),
                "control socket: a client of another user refused"
            );
            false
        }
        Err(error) => {
            tracing::warn!(%error, "control socket: the client's user is unknown; refused");
            false
        }
    }
}

/// One client being answered, counted until it is dropped: when its thread ends, however it
/// ends (a panic in a reset unwinds), or with the closure of a thread that could not start.
struct Answering(Arc<AtomicUsize>);

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn answer(stream: UnixStream, targets: &Targets) -> std::io::Result<()> {
    let deadline = Instant::now() + TIMEOUT;
    let line = read_request(&stream, deadline)?;
    let answer = match serde_json::from_slice::<Request>(&line) {
        Ok(Request::List) => Answer {
            ok: true,
            vms: Some(targets.list()),
            vhost_user_dir: targets.sockets().map(|sockets| sockets.directory()),
            nbd_listen: targets.nbd_listen.get().cloned(),
            images: targets.registry.image_store().map(|store| store.root().to_owned()),
            ..Answer::default()
        },
        // Every name the server keeps passed this check when its VM opened.
        Ok(Request::Reset { vm, unless_connected, everywhere }) => targets.reset(&vm, unless_connected, everywhere),
        Ok(Request::Locate { vm }) => targets.locate(&vm),
        Ok(Request::Drop { vm }) => outcome(check_name("VM", &vm).and_then(|()| targets.drop_vm(&vm))),
        Ok(Request::Limit { ops: RateChange::Set { per_second: 0, .. }, .. })
        | Ok(Request::Limit { bytes: RateChange::Set { per_second: 0, .. }, .. })
        | Ok(Request::HostLimit { ops: RateChange::Set { per_second: 0, .. }, .. })
        | Ok(Request::HostLimit { bytes: RateChange::Set { per_second: 0, .. }, .. }) => Answer {
            ok: false,
            message: Some("a rate of 0 would stop the VM; use off for no limit".into()),
            ..Answer::default()
        },
        Ok(Request::HostLimit { budget, ops, bytes }) => {
            let book = targets.registry.limits();
            let limits = book.set_host(budget, ops.change(), bytes.change());
            let idle = if budget == HostBudget::Spill && !book.spill_paced() {
                " (nothing spills through this server's segment writers: mode other than ram+disk, or --spill-writers 0)"
            } else {
                ""
            };
            Answer { ok: true, message: Some(format!("host budget for {budget}: {limits}{idle}")), ..Answer::default() }
        }
        Ok(Request::Capture { vm }) => match crate::check_name("VM", &vm).map(|()| store_for(targets, "capture")) {
            Err(error) => outcome(Err(error)),
            Ok(Err(why)) => refused(why),
            Ok(Ok(store)) => match targets.registry.capture(&vm, store) {
                Ok((image, version)) => Answer {
                    ok: true,
                    message: Some(format!(
                        "{vm}: captured as {image} {version}, a layer over the version it booted; its overlay ends \
                         (`overspill image test {image} {version}` gives it to the test group)"
                    )),
                    ..Answer::default()
                },
                Err(why) => refused(why),
            },
        },
        Ok(Request::Checkpoint { vm, name }) => match store_for(targets, "checkpoint") {
            Err(why) => refused(why),
            Ok(store) => match targets.registry.checkpoint(&vm, &name, store) {
                Ok(label) => Answer {
                    ok: true,
                    message: Some(format!(
                        "{vm}: its disk is checkpoint {label} (`overspill vm fork {label} --as NAME,…` starts VMs from it)"
                    )),
                    images: Some(store.root().to_owned()),
                    checkpoint: Some(label),
                    ..Answer::default()
                },
                Err(why) => refused(why),
            },
        },
        Ok(Request::Fork { from, names, checkpoint }) => match store_for(targets, "fork") {
            Err(why) => refused(why),
            Ok(store) => {
                let registry = &targets.registry;
                let label = match (from.contains(':'), checkpoint) {
                    (true, None) => Ok(from.clone()),
                    (true, Some(_)) => Err(format!("{from} is a checkpoint already: name no new one")),
                    // The names are checked first: a checkpoint holds the VM still while it is
                    // written, for nothing if the forks are refused after it.
                    (false, Some(name)) => {
                        registry.may_fork(&names).and_then(|()| registry.checkpoint(&from, &name, store))
                    }
                    (false, None) => Err("forking a VM needs a name for its checkpoint".to_owned()),
                };
                let forked = label.and_then(|label| {
                    registry.fork(&label, &names, store).map(|()| label.clone()).map_err(|why| {
                        if from.contains(':') {
                            why
                        } else {
                            format!("{why} (checkpoint {label} is written: `overspill vm fork {label} --as …` forks it)")
                        }
                    })
                });
                match forked {
                    Ok(label) => Answer {
                        ok: true,
                        message: Some(format!(
                            "{}: forks of {label}; each starts from it at its first connection",
                            names.join(",")
                        )),
                        ..Answer::default()
                    },
                    Err(why) => refused(why),
                }
            }
        },
        Ok(Request::TestGroup { set }) => {
            let registry = &targets.registry;
            if let Some(patterns) = set {
                tracing::info!(?patterns, "test group set");
                registry.set_test_vms(patterns);
            }
            let patterns = registry.test_vms();
            let message = if patterns.is_empty() {
                "no test group: every new VM gets production".to_owned()
            } else {
                format!("test group: {} (new VMs of it get an image's test version)", patterns.join(", "))
            };
            Answer { ok: true, message: Some(message), ..Answer::default() }
        }
        Ok(Request::Booted { vm }) => match crate::check_name("VM", &vm) {
            Ok(()) => {
                let message = if targets.registry.boots().booted(&vm) {
                    format!("{vm}: boot over; its slot goes to the next VM in line")
                } else {
                    format!("{vm}: not booting (its boot was over, or it has no fresh overlay)")
                };
                Answer { ok: true, message: Some(message), ..Answer::default() }
            }
            Err(error) => outcome(Err(error)),
        },
        Ok(Request::Limit { vm: group, group: true, ops, bytes }) => match crate::vm_limits::check_group(&group) {
            Ok(()) => {
                let book = targets.registry.limits();
                let limits = book.set_group(&group, ops.change(), bytes.change());
                let unknown = if book.group_known(&group) {
                    ""
                } else {
                    " (no serve --group names it: no VM is in it; an image's group is image:NAME)"
                };
                Answer { ok: true, message: Some(format!("group {group:?}: {limits}{unknown}")), ..Answer::default() }
            }
            Err(error) => outcome(Err(error)),
        },
        Ok(Request::Limit { vm, group: false, ops, bytes }) => match crate::check_name("VM", &vm) {
            Ok(()) => {
                let limits = targets.registry.limits().set(&vm, ops.change(), bytes.change());
                Answer { ok: true, message: Some(format!("{vm}: {limits}")), ..Answer::default() }
            }
            Err(error) => outcome(Err(error)),
        },
        Ok(Request::Add { vm, image }) => match targets.add(&vm, image.as_deref()) {
            Ok((message, socket)) => {
                Answer { ok: true, message: Some(message), socket: Some(socket), ..Answer::default() }
            }
            Err(error) => outcome(Err(error)),
        },
        Err(error) => Answer { ok: false, message: Some(format!("bad request: {error}")), ..Answer::default() },
    };
    let mut text = serde_json::to_string(&answer).map_err(std::io::Error::other)?;
    text.push('\n');
    stream.set_write_timeout(Some(TIMEOUT))?;
    (&stream).write_all(text.as_bytes())
}

impl Targets {
    fn sockets(&self) -> Option<&Arc<dyn VmSockets>> {
        self.sockets.get()
    }

    /// `vm reset`: here, and with `everywhere` at every peer too (here first: a VM connected
    /// here stops it before any peer's copy goes).
    fn reset(&self, vm: &str, unless_connected: bool, everywhere: bool) -> Answer {
        let here = check_name("VM", vm).and_then(|()| match self.registry.reset_with(vm, !unless_connected) {
            Err(ServerError::NoSuchVm(_)) if everywhere => Ok(format!("{vm}: not held here")),
            other => other,
        });
        let peers = self.peers.get().filter(|_| everywhere);
        let answer = match (here, peers) {
            (Ok(done), Some(peers)) => match peers.reset_everywhere(vm) {
                Ok(()) => outcome(Ok(format!("{done}; {PEERS_ASKED}"))),
                Err(HeldAtPeer(why)) => Answer { ok: false, message: Some(why), ..Answer::default() },
            },
            (here, _) => outcome(here),
        };
        Answer { everywhere, ..answer }
    }

    fn locate(&self, vm: &str) -> Answer {
        if let Err(error) = check_name("VM", vm) {
            return outcome(Err(error));
        }
        let Some(peers) = self.peers.get() else {
            return Answer {
                ok: true,
                message: Some("this server has no peers (serve --peer)".into()),
                ..Answer::default()
            };
        };
        match peers.locate(vm, self.registry.holding(vm) == crate::vms::Holding::Live) {
            Located::Live(address) => Answer {
                ok: true,
                message: Some(format!("{vm} runs at peer {address}")),
                peer: Some(address.to_string()),
                ..Answer::default()
            },
            Located::Nowhere => Answer { ok: true, message: Some(format!("no peer holds {vm}")), ..Answer::default() },
            Located::Refused(why) => Answer { ok: false, message: Some(why), ..Answer::default() },
        }
    }

    /// The registry's VMs, and the declared ones that have no overlay yet.
    fn list(&self) -> Vec<VmStatus> {
        let mut vms = self.registry.list();
        let declared = self.sockets().map(|sockets| sockets.declared()).unwrap_or_default();
        for (vm, image, socket) in declared {
            if let Some(listed) = vms.iter_mut().find(|listed| listed.vm == vm) {
                listed.socket = Some(socket);
                continue;
            }
            vms.push(VmStatus {
                vm,
                image,
                owner: None,
                state: VmState::Declared,
                memory_bytes: 0,
                spill_bytes: 0,
                age_s: 0,
                detail: "its socket waits for its VMM".to_owned(),
                socket: Some(socket),
            });
        }
        vms.sort_by(|a, b| a.vm.cmp(&b.vm));
        vms
    }

    fn add(&self, vm: &str, image: Option<&str>) -> Result<(String, PathBuf), ServerError> {
        check_name("VM", vm)?;
        if let Some(image) = image.filter(|image| !image.is_empty()) {
            check_name("image", image)?;
        }
        let sockets =
            self.sockets().ok_or_else(|| ServerError::Control("the server is still starting: try again".into()))?;
        let socket = sockets.declare(vm, image).map_err(|e| ServerError::Control(e.to_string()))?;
        Ok((format!("{vm}: vhost-user socket {}", socket.display()), socket))
    }

    /// Withdraws the VM's socket first, so that no VMM can open the VM between its overlay's
    /// end and its socket's, then ends its overlay.
    fn drop_vm(&self, vm: &str) -> Result<String, ServerError> {
        let withdrawn = match self.sockets() {
            Some(sockets) => sockets.withdraw(vm).map_err(|e| ServerError::Control(e.to_string()))?,
            None => false,
        };
        match self.registry.drop_vm(vm) {
            Err(ServerError::NoSuchVm(_)) if withdrawn => Ok(format!("{vm}: its vhost-user socket is removed")),
            Ok(message) if withdrawn => Ok(format!("{message}; its vhost-user socket is removed")),
            Err(error) if withdrawn => Err(ServerError::Control(format!("{error} (its vhost-user socket is removed)"))),
            other => other,
        }
    }
}

/// The request line, up to its newline (or the end of the stream), within `deadline` for all
/// of it: a timeout per read would let a client sending a byte at a time hold its thread for
/// [`MAX_REQUEST_BYTES`] timeouts.
fn read_request(mut stream: &UnixStream, deadline: Instant) -> std::io::Result<Vec<u8>> {
    let mut line = Vec::new();
    let mut buffer = [0u8; 512];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        let read = match stream.read(&mut buffer) {
            Ok(0) => return Ok(line),
            Ok(read) => read,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(error),
        };
        if let Some(end) = buffer[..read].iter().position(|&b| b == b'\n') {
            line.extend_from_slice(&buffer[..end]);
            return Ok(line);
        }
        line.extend_from_slice(&buffer[..read]);
        if line.len() > MAX_REQUEST_BYTES {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "request too long"));
        }
    }
}

/// The image store a request writes to, or the answer refusing it.
fn store_for<'a>(targets: &'a Targets, what: &str) -> Result<&'a crate::images::ImageStore, String> {
    targets
        .registry
        .image_store()
        .ok_or_else(|| format!("this server serves no image store (--images), where a {what} is written"))
}

fn refused(why: String) -> Answer {
    Answer { ok: false, message: Some(why), ..Answer::default() }
}

fn outcome(result: Result<String, ServerError>) -> Answer {
    match result {
        Ok(message) => Answer { ok: true, message: Some(message), ..Answer::default() },
        Err(error) => Answer { ok: false, message: Some(error.to_string()), ..Answer::default() },
    }
}

/// Sends one request to the control socket at `control` and returns the server's answer.
/// How long `vm capture` waits for the server's answer.
const CAPTURE_TIMEOUT: Duration = Duration::from_secs(3600);
/// How long a request that asks the server's peers (`vm reset --everywhere`) may take.
const PEERS_TIMEOUT: Duration = Duration::from_secs(120);

pub fn ask(control: &Path, request: &Request) -> Result<Answer, ServerError> {
    let stream = UnixStream::connect(control).map_err(|e| {
        ServerError::io(format!("connecting to the control socket {} (is serve running?)", control.display()), e)
    })?;
    let io = |e| ServerError::io(format!("talking to {}", control.display()), e);
    // A capture writes what the VM changed (gigabytes, maybe) before it answers.
    let writes_a_layer = matches!(request, Request::Capture { .. } | Request::Checkpoint { .. } | Request::Fork { .. });
    // A reset everywhere asks every peer in turn, each up to a connect, a TLS handshake and an
    // answer (seconds each when a peer is down).
    let asks_peers = matches!(request, Request::Reset { everywhere: true, .. });
    let timeout = match (writes_a_layer, asks_peers) {
        (true, _) => CAPTURE_TIMEOUT,
        (_, true) => PEERS_TIMEOUT,
        _ => TIMEOUT,
    };
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    let mut text = serde_json::to_string(request).map_err(|e| ServerError::Control(e.to_string()))?;
    text.push('\n');
    (&stream).write_all(text.as_bytes()).map_err(io)?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(io)?;
    let answer: Answer =
        serde_json::from_str(&line).map_err(|e| ServerError::Control(format!("the server's answer {line:?}: {e}")))?;
    match request {
        Request::Reset { vm, everywhere: true, .. } if !answer.everywhere => peers_skipped(control, vm, answer),
        _ => Ok(answer),
    }
}

/// What a server of session 51's release, which asked its peers already, says once none keeps
/// the VM (it sent no `everywhere` back).
const PEERS_ASKED: &str = "none of this server's peers keeps it";

/// The answer to a reset `everywhere` that a server of an earlier release may have taken for a
/// reset here (an upgraded binary, the server not restarted yet): as it is if that server asked
/// its peers (session 51's release did), refused the reset (its reason stands), or has no
/// peers; else a refusal, for a copy of the VM at a peer was left for its next start to take.
fn peers_skipped(control: &Path, vm: &str, answer: Answer) -> Result<Answer, ServerError> {
    if !answer.ok || answer.message.as_deref().is_some_and(|said| said.contains(PEERS_ASKED)) {
        return Ok(answer);
    }
    let located = ask(control, &Request::Locate { vm: vm.to_owned() })?;
    let said = located.message.unwrap_or_default();
    // A release before peers does not know `locate`; a later one without `--peer` says so.
    if said.starts_with("bad request") || said.starts_with("this server has no peers") {
        return Ok(answer);
    }
    Ok(Answer {
        ok: false,
        message: Some(format!(
            "the server at {} is of an earlier release that resets {vm} here only, not at its peers: \
             restart it (systemctl reload overspill) so that it runs this release",
            control.display()
        )),
        ..Answer::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vms::Lifecycle;

    /// The answer to a `list`; empty if the server closed the connection unanswered.
    fn list(path: &Path) -> String {
        let stream = UnixStream::connect(path).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut answer = String::new();
        // A server that closed at once may have done so before the request went.
        if (&stream).write_all(b"{\"op\":\"list\"}\n").is_ok() {
            let _ = BufReader::new(&stream).read_line(&mut answer);
        }
        answer
    }

    /// A name no VM could have (a path, a hidden file) is refused as such by `reset` and `drop`,
    /// not looked up.
    #[test]
    fn reset_and_drop_refuse_names_no_vm_can_have() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("control.sock");
        let registry = VmRegistry::new(Lifecycle::default()).expect("registry");
        let _listener = spawn(&path, registry).expect("control socket");
        for op in ["reset", "drop"] {
            for (vm, refused) in [("../etc", true), (".hidden", true), ("vm-17", false)] {
                let stream = UnixStream::connect(&path).expect("connect");
                stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
                let request = format!("{{\"op\":\"{op}\",\"vm\":\"{vm}\"}}\n");
                (&stream).write_all(request.as_bytes()).expect("request");
                let mut answer = String::new();
                BufReader::new(&stream).read_line(&mut answer).expect("answer");
                assert!(answer.contains("\"ok\":false"), "{op} {vm}: {answer}");
                assert_eq!(answer.contains("not allowed"), refused, "{op} {vm}: {answer}");
            }
        }
    }

    /// A client of another user that reached the socket (its mode made open here, as the
    /// umask could leave it before the chmod) is closed unanswered; the server's own user is
    /// answered.
    #[test]
    fn a_client_of_another_user_is_refused_whatever_the_sockets_mode() {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root to run a client as another user");
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
        let path = dir.path().join("control.sock");
        let registry = VmRegistry::new(Lifecycle::default()).expect("registry");
        let _listener = spawn(&path, registry).expect("control socket");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).expect("chmod socket");
        let script = "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\ns.settimeout(10)\n\
                      try:\n s.sendall(b'{\"op\":\"list\"}\\n')\n print(repr(s.recv(4096)))\n\
                      except (ConnectionResetError, BrokenPipeError):\n print('closed')";
        let output = std::process::Command::new("python3")
            .args(["-c", script, path.to_str().expect("utf-8")])
            .uid(65534)
            .gid(65534)
            .output()
            .expect("python3");
        let answer = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        assert!(matches!(answer.trim(), "b''" | "closed"), "another user's client was answered: {answer}");
        assert!(list(&path).contains("\"ok\":true"), "the server's own user is answered");
    }

    /// A client sending its request a byte at a time gets the same few seconds for all of it as
    /// one sending it at once; clients beyond the cap are closed unanswered, and answered again
    /// once the others are done.
    #[test]
    fn slow_and_surplus_clients_do_not_hold_the_control_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("control.sock");
        let registry = VmRegistry::new(Lifecycle::default()).expect("registry");
        let _listener = spawn(&path, registry).expect("control socket");
        assert!(list(&path).contains("\"ok\":true"));

        let trickler = UnixStream::connect(&path).expect("connect");
        let started = Instant::now();
        let mut closed = false;
        while started.elapsed() < TIMEOUT * 3 {
            if (&trickler).write_all(b" ").is_err() {
                closed = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        assert!(closed, "a client sending a byte every 200 ms was still read after {:?}", started.elapsed());

        let idle: Vec<UnixStream> = (0..MAX_CLIENTS).map(|_| UnixStream::connect(&path).expect("connect")).collect();
        // The accept loop takes them in order: the next one is past the cap.
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(list(&path), "", "a client past the cap was answered");
        drop(idle);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !list(&path).contains("\"ok\":true") {
            assert!(Instant::now() < deadline, "never answered again once the others left");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A reset `everywhere` is done at the peers, or refused: a server of session 51's release
    /// (which asked its peers but sends no `everywhere` back) and a refusal pass as answered; an
    /// earlier one, which takes it for a reset here only, passes only if it has no peers to skip.
    #[test]
    fn a_reset_everywhere_is_never_a_reset_here_only_at_a_server_with_peers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let reset = Request::Reset { vm: "desk".into(), unless_connected: true, everywhere: true };

        let path = dir.path().join("control.sock");
        let _listener = spawn(&path, VmRegistry::new(Lifecycle::default()).expect("registry")).expect("control socket");
        let answer = ask(&path, &reset).expect("answer");
        assert!(answer.ok && answer.everywhere, "this release, no peers: {answer:?}");

        // Session 51's release asked its peers, and said so: its answer stands, no locate.
        let path = dir.path().join("session-51.sock");
        let server = earlier_release(
            &path,
            r#"{"ok":true,"message":"desk: reset; none of this server's peers keeps it"}"#,
            None,
        );
        assert!(ask(&path, &reset).expect("answer").ok);
        server.join().expect("session 51's server");
        // Nor is a refusal's reason replaced.
        let path = dir.path().join("refused.sock");
        let server = earlier_release(&path, r#"{"ok":false,"message":"VM desk runs at peer b"}"#, None);
        assert_eq!(ask(&path, &reset).expect("answer").message.as_deref(), Some("VM desk runs at peer b"));
        server.join().expect("the refusing server");
        for (locate_says, passes) in [
            (r#"{"ok":true,"message":"this server has no peers (serve --peer)"}"#, true),
            (r#"{"ok":false,"message":"bad request: unknown variant `locate`"}"#, true),
            (r#"{"ok":true,"message":"no peer holds desk"}"#, false),
        ] {
            let path = dir.path().join(format!("earlier-{passes}-{}.sock", locate_says.len()));
            let server = earlier_release(&path, r#"{"ok":true,"message":"desk: reset"}"#, Some(locate_says));
            let answer = ask(&path, &reset).expect("answer");
            server.join().expect("earlier release's server");
            assert_eq!(answer.ok, passes, "locate said {locate_says}: {answer:?}");
            if !passes {
                let message = answer.message.unwrap_or_default();
                assert!(message.contains("earlier release") && message.contains("desk"), "{message}");
            }
        }
    }

    /// A control socket answering as an earlier release did: `reset_says` to the reset, then,
    /// if asked, `locate_says` to the locate that follows.
    fn earlier_release(
        path: &Path,
        reset_says: &'static str,
        locate_says: Option<&'static str>,
    ) -> std::thread::JoinHandle<()> {
        let listener = std::os::unix::net::UnixListener::bind(path).expect("bind");
        std::thread::spawn(move || {
            let answers = [("reset", Some(reset_says)), ("locate", locate_says)];
            for (op, answer) in answers.into_iter().filter_map(|(op, answer)| Some((op, answer?))) {
                let (stream, _) = listener.accept().expect("accept");
                let mut request = String::new();
                BufReader::new(&stream).read_line(&mut request).expect("request");
                assert!(request.contains(&format!(r#""op":"{op}""#)), "asked {request} for a {op}");
                (&stream).write_all(format!("{answer}\n").as_bytes()).expect("answer");
            }
        })
    }
}
