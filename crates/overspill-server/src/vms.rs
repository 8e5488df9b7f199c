//! The VMs a server knows, and how long each one's overlay lives.
//!
//! A VM is named by its export name, `IMAGE@NAME`; a connection without a name is anonymous:
//! its overlay is its own and ends with it, as it always did. A named VM's overlay is in one of
//! these states:
//!
//! ```text
//!            open (name free)                 NBD_CMD_DISC, vm reset, vm drop
//!   (none) ─────────────────▶ connected ─────────────────────────────────────────▶ (none)
//!                              │     ▲
//!     connection lost          │     │ open with the same name and image
//!     (EOF, reset, error,      ▼     │
//!      idle timeout)          in grace ─── vm reset / vm drop / grace over, never wrote ─▶ (none)
//!                              │
//!                              └── grace over (at once with no grace), had written ─▶ lost
//!
//!   lost: the VM had writes that could not be kept for it (its grace ran out, or a server of
//!   this boot ended and could not hand them over); its name is refused, across restarts (a
//!   tombstone in the ledger), until `vm reset`: never served golden data in place of its
//!   writes. A connection cut for idleness waits in grace with no end.
//! ```
//!
//! "Connected" admits one connection per name: a second one would see another disk. The ledger
//! (`--state-dir`) holds one small file per named VM with acknowledged writes, made before the
//! first of them is acknowledged and removed when its overlay deliberately ends; a server that
//! starts and finds files of an earlier server of the same boot knows which names lost their
//! writes. Files from an earlier boot are void (the VMs died with the host) and are removed.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use overspill_block::{DeviceError, DeviceErrorKind};
use overspill_engine::VmStats;

use crate::boot_pacing::BootPacing;
use crate::ledger::{
    remove_leftover_state_files, remove_state_files, Ledger, LeftBehind, Marks, Recoverable, StateRecord,
};
use crate::live::Live;
use crate::multi_conn::NamePatterns;
use crate::vm_limits::VmLimits;
use crate::vm_overlay::VmOverlay;

#[path = "vms_images.rs"]
mod images;
#[path = "vms_moves.rs"]
mod moves;
#[path = "vms_relief.rs"]
mod relief;
#[path = "vms_reset.rs"]
mod reset;
#[path = "vms_status.rs"]
mod status;
pub use moves::{Asker, Direction, Holding, MoveCounters, MoveProgress, Offer};
pub(crate) use moves::{Moving, Outgoing};
pub use status::{VmHandle, VmState, VmStatus};

/// How long overlays outlive their connections, and where the ledger is kept.
#[derive(Debug, Clone, Default)]
pub struct Lifecycle {
    /// A named VM whose connection ended without NBD_CMD_DISC keeps its overlay this long;
    /// past it (at once with zero) a VM that wrote is lost and one that did not is forgotten.
    /// A connection cut for idleness waits with no end.
    pub reconnect_grace: Duration,
    /// The ledger's directory; `None` keeps no ledger (in-process servers of a storm).
    pub state_dir: Option<PathBuf>,
    /// Where named VMs' pages, segment summaries and zero logs live (tmpfs), so that their
    /// overlays outlive the process; `None` keeps overlays in this process only.
    pub memory_dir: Option<PathBuf>,
}

impl Lifecycle {
    /// Whether named VMs' overlays outlive the process: with a ledger, a memory directory and
    /// a grace to come back in.
    pub fn persistent(&self) -> bool {
        self.state_dir.is_some() && self.memory_dir.is_some() && !self.reconnect_grace.is_zero()
    }
}

/// What a named connection's end means for its overlay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// NBD_CMD_DISC, or an operator reset: the overlay ends.
    Deliberate,
    /// The connection was lost: the overlay waits for the VM to reconnect.
    Lost,
    /// The server cut a quiet connection (`--idle-timeout`): the VM is paused or suspended,
    /// not gone, so its overlay waits for it however long it takes (until a reset).
    Idle,
}

/// How an anonymous connection's overlay is named in logs, metrics and traces: `#` is in no
/// VM name, so it never clashes with a named VM's label.
pub fn anonymous_label(number: u64) -> String {
    format!("anon#{number}")
}

/// What a VM's connection got from [`VmRegistry::claim`].
pub(crate) enum Claim {
    /// A new overlay is to be made; the VM is registered as connected under `number`.
    Fresh { number: u64, reset: Arc<AtomicBool> },
    /// The overlay the VM left behind, with its counters.
    Resume { number: u64, reset: Arc<AtomicBool>, parked: Box<VmOverlay> },
    /// Another connection of a VM that allows several (`serve --multi-conn`): it shares the
    /// overlay its first connection serves.
    Join { number: u64, reset: Arc<AtomicBool>, live: Arc<Live> },
    /// Another connection of such a VM while its first is still making the overlay (a client
    /// opens its connections at once): ask again in a moment.
    Connecting,
    /// The VM is connected and takes no second connection. The first may be ending unseen yet
    /// (its DISC or its socket's close still unread: a QEMU restarted at once): ask again in a
    /// moment, then refuse with [`VmRegistry::already_connected`].
    Held,
}

#[derive(Debug, Default)]
pub struct VmRegistry {
    inner: Mutex<Registered>,
    lifecycle: Lifecycle,
    ledger: Option<Ledger>,
    /// The server is ending: connections it closes are not VMs leaving.
    stopping: AtomicBool,
    /// [`Self::hand_over_all_in_grace`] has run: a connection that ends after it (one the drain
    /// gave up on) is handed over at once, since nobody would later.
    handed_over: AtomicBool,
    /// Where this server makes VMs' state files (set by the exports): a lost VM whose ledger file
    /// cannot be read says nowhere, and its reset looks here.
    state_places: std::sync::OnceLock<StateRecord>,
    /// See [`Self::orphans`].
    orphans: Mutex<()>,
    /// Golden images found changed while VMs were served over them (see
    /// [`Self::golden_image_changed`]).
    golden_image_changes: std::sync::atomic::AtomicU64,
    limits: VmLimits,
    boots: Arc<BootPacing>,
    multi_conn: NamePatterns,
    /// The test group of image stages: name patterns, and `group:NAME` for a named group.
    test_vms: NamePatterns,
    /// The image store VMs are served from, if any (`serve --images`): `vm capture` writes to it.
    image_store: std::sync::OnceLock<crate::images::ImageStore>,
    /// Golden images' content digests, for moves between hosts (servers with peers).
    image_digests: std::sync::OnceLock<Arc<crate::image_digest::ImageDigests>>,
    moves: MoveCounters,
}

#[derive(Default)]
struct Registered {
    vms: BTreeMap<u64, Entry>,
    /// Named VMs' numbers.
    names: HashMap<String, u64>,
    /// Names whose writes were lost with an earlier server, and why.
    lost: BTreeMap<String, String>,
    /// Names pinned to a checkpoint (`vm fork`), on disk in the state directory.
    forks: crate::forks::ForkBook,
    /// VMs an earlier server of this boot left state for, until the exports rebuild them.
    recoverable: Vec<Recoverable>,
    /// Names whose ledger file, written before this boot, could not be read (cut short by the
    /// host's crash): their VMs ended with the host, and the files of those names where this
    /// server makes them go once it says where that is.
    earlier_boot_unreadable: Vec<String>,
    departed: VmStats,
    next_number: u64,
}

impl fmt::Debug for Registered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registered").field("vms", &self.vms.len()).field("lost", &self.lost).finish_non_exhaustive()
    }
}

struct Entry {
    /// `export` is the image's label (with its version, for a versioned image).
    handle: VmHandle,
    /// The image name the VM asked for: a reconnect must ask for the same.
    image: String,
    /// The TLS identity of the client that made the overlay: only that identity may resume it.
    owner: Option<String>,
    named: bool,
    created: Instant,
    reset: Arc<AtomicBool>,
    /// The ledger has this VM's file.
    marked: bool,
    /// The ledger knows this VM has changed its disk (a persistent VM's file is made before
    /// its first write, marked unwritten until then).
    written: bool,
    /// Where the overlay keeps state that outlives the process, if it does.
    state: Option<StateRecord>,
    grace: Option<Grace>,
    /// Why the VM is to be lost when its connection ends (its golden image changed under it):
    /// its overlay goes then, not now, so that its files go by name while the name is its own.
    lose_at_end: Option<String>,
    /// The overlay while a connection serves it (see `live`), for a move to find.
    live: Option<Weak<Live>>,
    /// A move of the VM to or from a peer server, under way.
    moving: Option<Moving>,
    /// Connections beyond the first that share the overlay (`serve --multi-conn`): the VM's
    /// connection ends with the last of them.
    extra_connections: u32,
}

struct Grace {
    /// `None`: the server cut the VM for idleness, and it waits until its client comes back.
    until: Option<Instant>,
    parked: VmOverlay,
}

/// A stopping server's part for one VM whose connection is gone: its state, if it outlives the
/// process, is kept for the next server; either way its ledger entry stays (a VM without such
/// state is then refused by the next server rather than served golden data).
fn hand_over(entry: &mut Entry, parked: &mut VmOverlay) {
    if entry.state.is_some() {
        parked.hand_over();
        tracing::info!(vm = %entry.handle.vm, "server stopping: this VM's overlay is kept for the next server");
    } else if entry.marked {
        tracing::warn!(vm = %entry.handle.vm, "server stopping: this VM's writes are lost; its name will be refused");
    }
    entry.marked = false;
}

/// Registry locks guard plain bookkeeping: a panic elsewhere leaves it usable.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl VmRegistry {
    /// A registry with a ledger in `lifecycle.state_dir` (created if missing), which learns
    /// from the files there which names lost their writes with an earlier server.
    pub fn new(lifecycle: Lifecycle) -> std::io::Result<Arc<Self>> {
        let ledger = match &lifecycle.state_dir {
            Some(dir) => Some(Ledger::open(dir)?),
            None => None,
        };
        let LeftBehind { lost, recoverable, earlier_boot_unreadable } =
            ledger.as_ref().map(Ledger::left_behind).unwrap_or_default();
        for (vm, why) in &lost {
            tracing::warn!(vm, why, "VM refused until `overspill vm reset` ({why})");
        }
        let forks = crate::forks::ForkBook::open(lifecycle.state_dir.as_deref())?;
        let registry = Arc::new(Self {
            inner: Mutex::new(Registered {
                lost,
                forks,
                recoverable,
                earlier_boot_unreadable,
                next_number: 1,
                ..Registered::default()
            }),
            lifecycle,
            ledger,
            stopping: AtomicBool::new(false),
            handed_over: AtomicBool::new(false),
            state_places: std::sync::OnceLock::new(),
            orphans: Mutex::new(()),
            golden_image_changes: Default::default(),
            limits: VmLimits::default(),
            boots: Arc::default(),
            multi_conn: NamePatterns::default(),
            test_vms: NamePatterns::default(),
            image_store: std::sync::OnceLock::new(),
            image_digests: std::sync::OnceLock::new(),
            moves: MoveCounters::default(),
        });
        if !registry.lifecycle.reconnect_grace.is_zero() {
            spawn_grace_keeper(Arc::downgrade(&registry));
        }
        Ok(registry)
    }

    /// Where this server makes VMs' state files (`memory_dir` and `spill_dir` of `places`).
    pub fn set_state_places(&self, places: StateRecord) {
        for vm in std::mem::take(&mut lock(&self.inner).earlier_boot_unreadable) {
            // Its files first, then its ledger file: a crash between leaves the file, and the
            // next server does this again (rather than files no ledger file names, which would
            // refuse the name).
            if remove_leftover_state_files(&vm, &places).is_empty() {
                if let Some(ledger) = &self.ledger {
                    ledger.unmark(&vm);
                }
            }
        }
        // Not before: a server that keeps no state files (no grace) leaves an earlier boot's
        // cut-short entries, and the marker must go on naming that boot for the next server.
        if let Some(Err(error)) = self.ledger.as_ref().map(Ledger::mark_boot) {
            tracing::warn!(%error, "could not record this boot in the state directory");
        }
        let _ = self.state_places.set(places);
    }

    pub fn reconnect_grace(&self) -> Duration {
        self.lifecycle.reconnect_grace
    }

    /// Every VM with an overlay, connected or in grace.
    pub fn snapshot(&self) -> Vec<VmHandle> {
        lock(&self.inner).vms.values().map(|e| e.handle.clone()).collect()
    }

    /// The VMs with an overlay and a copy of the ended VMs' counters, taken together so that a
    /// VM ending during a scrape is counted exactly once.
    pub fn snapshot_with_departed(&self) -> (Vec<VmHandle>, VmStats) {
        let inner = lock(&self.inner);
        let departed = VmStats::default();
        departed.absorb(&inner.departed);
        (inner.vms.values().map(|e| e.handle.clone()).collect(), departed)
    }

    /// Admits a connection of a client with TLS identity `identity`: anonymous (`vm` is `None`)
    /// or named. A named VM resumes its overlay if it has one in grace over the same image; it is
    /// refused while another connection has it, when its writes were lost, or when the client
    /// is not the identity that made it (a name is no secret: without this, any client allowed
    /// the image could read and write another's disk by naming its VM).
    pub(crate) fn claim(&self, vm: Option<&str>, export: &str, identity: Option<&str>) -> Result<Claim, DeviceError> {
        let refuse = |message: String| {
            tracing::warn!(vm = ?vm.unwrap_or_default(), export, "VM refused: {message}");
            Err(DeviceError::new(DeviceErrorKind::Refused, message))
        };
        let mut inner = lock(&self.inner);
        let number = inner.next_number;
        let Some(vm) = vm else {
            inner.next_number += 1;
            let reset = Arc::new(AtomicBool::new(false));
            inner.vms.insert(number, Entry::new(export, &anonymous_label(number), false, reset.clone()));
            return Ok(Claim::Fresh { number, reset });
        };
        if inner.lost.contains_key(vm) {
            // Why (the image, the server that ended) is in the log and `vm list`, not told to a
            // client that may not be the VM's.
            return refuse(format!(
                "VM {vm} had writes that were lost; run `overspill vm reset {vm}` to start it from {}",
                reset::start_of(&inner, vm)
            ));
        }
        if let Some(fork) = inner.forks.get(vm) {
            if fork.dropped {
                return refuse(format!("VM {vm} is a fork that was dropped; `overspill vm reset {vm}` frees its name"));
            }
            if fork.image != export {
                return refuse(format!(
                    "VM {vm} is a fork of {}:{}: connect it to export {}@{vm}",
                    fork.image, fork.checkpoint, fork.image
                ));
            }
        }
        if let Some(&existing) = inner.names.get(vm) {
            let entry = inner.vms.get_mut(&existing).expect("names point at entries");
            if entry.owner.as_deref().is_some_and(|owner| identity != Some(owner)) {
                // Neither its state nor its image is told: they are the other client's.
                return refuse(format!("VM {vm} belongs to another client identity"));
            }
            if let Some(moving) = &entry.moving {
                return refuse(format!("VM {vm} is moving between this server and peer {}", moving.peer));
            }
            if entry.grace.is_none() {
                // Not one whose connection has ended (its overlay on its way to grace).
                let shared = entry.live.as_ref().and_then(Weak::upgrade).filter(|live| live.state().ended.is_none());
                match shared {
                    Some(live) if self.multi_conn.allows(vm) && entry.image == export => {
                        entry.extra_connections += 1;
                        tracing::info!(
                            vm,
                            connections = entry.extra_connections + 1,
                            "VM connection added (multi-conn)"
                        );
                        return Ok(Claim::Join { number: existing, reset: entry.reset.clone(), live });
                    }
                    None if self.multi_conn.allows(vm) && entry.image == export => return Ok(Claim::Connecting),
                    _ => return Ok(Claim::Held),
                }
            }
            if entry.image != export {
                return refuse(format!(
                    "VM {vm} has an overlay over {} waiting for it; it cannot reconnect to {export} \
                     (`overspill vm reset {vm}` first)",
                    entry.handle.export
                ));
            }
            let grace = entry.grace.take().expect("checked");
            if grace.until.is_none() {
                self.mark_quiet(entry, false);
            }
            tracing::info!(vm, export, "VM reconnected: its overlay resumes");
            // A reset meant for a connection that has ended since is not this one's.
            entry.reset.store(false, Ordering::SeqCst);
            return Ok(Claim::Resume { number: existing, reset: entry.reset.clone(), parked: Box::new(grace.parked) });
        }
        inner.next_number += 1;
        let reset = Arc::new(AtomicBool::new(false));
        let mut entry = Entry::new(export, vm, true, reset.clone());
        entry.owner = identity.map(str::to_owned);
        inner.vms.insert(number, entry);
        inner.names.insert(vm.to_owned(), number);
        Ok(Claim::Fresh { number, reset })
    }

    /// The refusal of a second connection of `vm`, which still has its first after a while.
    pub(crate) fn already_connected(vm: &str, export: &str) -> DeviceError {
        let message = format!(
            "VM {vm} is already connected; one connection per VM (serve --multi-conn {vm} lets several clients \
             share it)"
        );
        tracing::warn!(vm, export, "VM refused: {message}");
        DeviceError::new(DeviceErrorKind::Refused, message)
    }

    /// A VM named `vm` that no server holds any more though one did when this one started
    /// (a predecessor still exiting then, say): its state to rebuild now, before its client is
    /// admitted. A name with a VM here, or known lost, has none.
    /// Call with [`Self::orphans`] held, through the VM's rebuilding.
    pub fn take_orphan(&self, vm: &str) -> Option<Recoverable> {
        let known = |inner: &Registered| inner.names.contains_key(vm) || inner.lost.contains_key(vm);
        if known(&lock(&self.inner)) {
            return None;
        }
        // Outside the registry's lock: reading the entry may wait for its server to finish exiting.
        let orphan = self.ledger.as_ref()?.orphan(vm)?;
        let mut inner = lock(&self.inner);
        if known(&inner) {
            return None;
        }
        match orphan {
            Ok(recoverable) => Some(recoverable),
            Err(why) => {
                tracing::error!(vm, why, "VM refused until `overspill vm reset` ({why})");
                inner.lost.insert(vm.to_owned(), why);
                None
            }
        }
    }

    /// Held while a VM that a server gone since this one started left behind is rebuilt
    /// ([`Self::take_orphan`]) or reset: one at a time.
    pub fn orphans(&self) -> std::sync::MutexGuard<'_, ()> {
        lock(&self.orphans)
    }

    /// The VMs an earlier server left state for, to be rebuilt (once).
    pub fn take_recoverable(&self) -> Vec<Recoverable> {
        std::mem::take(&mut lock(&self.inner).recoverable)
    }

    /// A VM rebuilt from an earlier server's state: in grace from now, waiting for its client.
    pub fn adopt_recovered(&self, recovered: &Recoverable, image_label: &str, stats: Arc<VmStats>, parked: VmOverlay) {
        let mut inner = lock(&self.inner);
        // The ledger file named the server that left the state: it names this one from now on,
        // which holds the files, so that no other process takes them for a dead server's.
        if let Some(ledger) = &self.ledger {
            let (vm, owner) = (&recovered.vm, recovered.owner.as_deref());
            let marks = Marks {
                unwritten: recovered.unwritten,
                quiet: recovered.quiet,
                incoming: recovered.incoming.clone(),
                ..Marks::default()
            };
            if let Err(error) = ledger.write_entry(vm, &recovered.image, owner, Some(recovered.state.clone()), marks) {
                tracing::warn!(vm, %error, "could not name this server in the VM's ledger file");
            }
        }
        let number = inner.next_number;
        inner.next_number += 1;
        let mut entry = Entry::new(&recovered.image, &recovered.vm, true, Arc::new(AtomicBool::new(false)));
        entry.handle.export = image_label.to_owned();
        entry.handle.stats = stats;
        entry.marked = true;
        entry.written = !recovered.unwritten;
        entry.owner = recovered.owner.clone();
        entry.state = Some(recovered.state.clone());
        // A VM cut for idleness waits with no end here too: its guest is paused, not gone.
        let until = (!recovered.quiet).then(|| Instant::now() + self.lifecycle.reconnect_grace);
        entry.grace = Some(Grace { until, parked });
        // Served to no one until the peer it was moving from says whose copy is the VM's.
        entry.moving = recovered.incoming.as_ref().map(|peer| moves::Moving {
            direction: moves::Direction::Incoming,
            peer: peer.clone(),
            progress: Arc::default(),
            // It had said `Ready` (its ledger says in doubt): see `Holding`.
            committed: true,
        });
        inner.names.insert(recovered.vm.clone(), number);
        inner.vms.insert(number, entry);
    }

    /// A VM whose state an earlier server left but that cannot be rebuilt: its name is refused
    /// until an operator resets it (its files stay for a look).
    /// One that had written nothing loses nothing: its files go and it starts afresh.
    pub fn refuse_unrecoverable(&self, recoverable: &Recoverable, why: String) {
        let vm = recoverable.vm.as_str();
        if recoverable.unwritten {
            // Loud all the same: a guest still running sees the image served now from its next
            // read, which is another image than it read before if that one was replaced.
            tracing::warn!(vm, why, "VM state cannot be recovered, and the VM had written nothing: it starts afresh");
            if let Some(ledger) = &self.ledger {
                // Not open here (the recovery closed what it opened): a server sharing the
                // directories may hold files of this name.
                ledger.retire(vm, &recoverable.state, remove_leftover_state_files);
            }
            return;
        }
        tracing::error!(vm, why, "VM state cannot be recovered: its name is refused until `overspill vm reset`");
        lock(&self.inner).lost.insert(vm.to_owned(), format!("its state could not be recovered: {why}"));
    }

    /// What VM `vm` runs over (`IMAGE:VERSION` for a version of the store), if this server
    /// holds it.
    pub fn booted_label(&self, vm: &str) -> Option<String> {
        let inner = lock(&self.inner);
        let number = inner.names.get(vm)?;
        inner.vms.get(number).map(|entry| entry.handle.export.clone())
    }

    /// Names the image version a VM just claimed got, for logs, metrics and `vm list`.
    pub fn label(&self, number: u64, image_label: &str) {
        if let Some(entry) = lock(&self.inner).vms.get_mut(&number) {
            entry.handle.export = image_label.to_owned();
        }
    }

    /// The counters of a VM just claimed, shared with its overlay.
    pub fn stats(&self, number: u64) -> Option<Arc<VmStats>> {
        lock(&self.inner).vms.get(&number).map(|e| e.handle.stats.clone())
    }

    /// Records in the ledger that a named VM's overlay keeps its state in files named after it,
    /// before the files are made: a next server then removes the files, until
    /// [`Self::mark_made`] says the overlay stands, and rebuilds it from them after that.
    pub fn mark_persistent(&self, number: u64, state: StateRecord) -> std::io::Result<()> {
        let Some(ledger) = &self.ledger else { return Ok(()) };
        let mut inner = lock(&self.inner);
        let Some(entry) = inner.vms.get_mut(&number) else { return Ok(()) };
        let marks = Marks { making: true, unwritten: !entry.written, ..Marks::default() };
        ledger.write_entry(&entry.handle.vm, &entry.image, entry.owner.as_deref(), Some(state.clone()), marks)?;
        entry.marked = true;
        entry.state = Some(state);
        Ok(())
    }

    /// Records in the ledger that a persistent VM's overlay stands, before it serves anything:
    /// from now on a next server rebuilds it.
    pub fn mark_made(&self, number: u64) -> std::io::Result<()> {
        let Some(ledger) = &self.ledger else { return Ok(()) };
        let inner = lock(&self.inner);
        let Some(entry) = inner.vms.get(&number) else { return Ok(()) };
        let marks = Marks { unwritten: !entry.written, ..Marks::default() };
        ledger.write_entry(&entry.handle.vm, &entry.image, entry.owner.as_deref(), entry.state.clone(), marks)
    }

    /// Records in the ledger whether a VM whose state outlives the process waits, cut for
    /// idleness, with no end (see `LedgerEntry::quiet`). Best effort: without it a next server
    /// gives the VM the grace of a lost connection.
    fn mark_quiet(&self, entry: &Entry, quiet: bool) {
        let (Some(ledger), Some(state)) = (&self.ledger, &entry.state) else { return };
        let marks = Marks { unwritten: !entry.written, quiet, ..Marks::default() };
        let written =
            ledger.write_entry(&entry.handle.vm, &entry.image, entry.owner.as_deref(), Some(state.clone()), marks);
        if let Err(error) = written {
            tracing::warn!(vm = %entry.handle.vm, %error, "could not record in the ledger that this VM waits for idleness");
        }
    }

    /// Records in the ledger that a named VM has writes, before the first is acknowledged.
    /// `Ok(false)`: not recorded yet, as the VM is moving here (the move records it when it
    /// commits; ask again for the next change).
    pub fn mark_written(&self, number: u64) -> std::io::Result<bool> {
        let Some(ledger) = &self.ledger else { return Ok(true) };
        let mut inner = lock(&self.inner);
        let Some(entry) = inner.vms.get_mut(&number) else { return Ok(true) };
        match &entry.moving {
            Some(moving) if moving.direction == moves::Direction::Incoming => {
                // Its ledger entry is the move's to write (it serves nothing before the move
                // commits), with this write counted.
                entry.written = true;
                return Ok(false);
            }
            // The ledger says the VM is the peer's: it must go on saying so.
            Some(moving) if moving.committed => {
                return Err(std::io::Error::other(format!("the VM has moved to peer {}", moving.peer)));
            }
            _ => {}
        }
        if entry.named && !entry.marked {
            ledger.mark_with(&entry.handle.vm, &entry.handle.export, entry.owner.as_deref(), None)?;
            entry.marked = true;
        } else if entry.state.is_some() && !entry.written {
            ledger.mark_with(&entry.handle.vm, &entry.image, entry.owner.as_deref(), entry.state.clone())?;
        }
        entry.written = true;
        Ok(true)
    }

    /// The server is about to close its connections (SIGTERM, a restart): called before it
    /// does. A named VM whose connection it closes without a grace to wait in (`--reconnect-grace
    /// 0`) loses its writes with the overlay, and its ledger entry stays: the next server
    /// refuses the name until `vm reset`, as after a crash, rather than serve it golden data.
    pub fn server_stopping(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        // No connection is to wait for a boot slot through the drain.
        self.boots.release_all();
    }

    /// Whether the server is stopping ([`Self::server_stopping`]).
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Whether [`Self::end`] would keep VM `number`'s overlay, for its client to come back to or
    /// for the next server, rather than drop it. An answer for work worth doing before the end
    /// (outside the lock), not a promise: a reset may come in between.
    pub fn would_keep(&self, number: u64, ending: Ending) -> bool {
        let maintained = self.maintained(number);
        self.keeps(&lock(&self.inner), number, ending, maintained)
    }

    /// `maintained`: the VM is its image's maintenance VM (see [`Self::maintained`]), whose
    /// overlay outlives every ending but a reset's.
    fn keeps(&self, inner: &Registered, number: u64, ending: Ending, maintained: bool) -> bool {
        inner.vms.get(&number).is_some_and(|entry| {
            entry.named
                && match ending {
                    _ if maintained => true,
                    Ending::Deliberate => false,
                    Ending::Lost => !self.lifecycle.reconnect_grace.is_zero(),
                    Ending::Idle => true,
                }
                && !entry.reset.load(Ordering::SeqCst)
        })
    }

    /// A connection of VM `number` ended. A named VM that lost its connection keeps `parked` for
    /// the grace period; otherwise it is returned, for the caller to drop outside the lock.
    pub fn end(&self, number: u64, ending: Ending, mut parked: VmOverlay) -> Option<VmOverlay> {
        // Read before the registry's lock is taken: it reads the image store.
        let maintains = self.maintained(number);
        let mut inner = lock(&self.inner);
        if let Some(entry) = inner.vms.get(&number).filter(|entry| entry.named) {
            // Its connection is gone, whatever comes next (a reconnect resumes a VM running
            // already): a boot slot it held goes to the next VM.
            self.boots.booted(&entry.handle.vm);
        }
        if let Some(why) = inner.vms.get(&number).and_then(|entry| entry.lose_at_end.clone()) {
            return self.lose_keeping_files(&mut inner, number, Some(parked), &why);
        }
        let grace = self.lifecycle.reconnect_grace;
        // The maintenance VM's overlay is the next version: it outlives the guest's boots
        // (QEMU ends with NBD_CMD_DISC at each power-off) until it is captured or dropped.
        let keep = self.keeps(&inner, number, ending, maintains);
        if keep && self.handed_over.load(Ordering::SeqCst) {
            // Parked now, it would go with the registry as the process ends, its files with it,
            // while its ledger entry stays: the next server would find the VM's writes lost.
            let entry = inner.vms.get_mut(&number).expect("checked");
            if maintains {
                // The next server keeps it waiting with no end too.
                self.mark_quiet(entry, true);
            }
            hand_over(entry, &mut parked);
            return self.forget(&mut inner, number, Some(parked));
        }
        if keep {
            let entry = inner.vms.get_mut(&number).expect("checked");
            let until = if maintains {
                tracing::info!(
                    vm = %entry.handle.vm,
                    "maintenance VM disconnected: its overlay waits for its next boot (`overspill vm capture` makes it \
                     the next version, `overspill vm drop` throws it away)"
                );
                self.mark_quiet(entry, true);
                None
            } else if ending == Ending::Idle {
                tracing::info!(
                    vm = %entry.handle.vm,
                    "VM connection cut for idleness: its overlay waits for its client, however long (until `overspill vm reset`)"
                );
                self.mark_quiet(entry, true);
                None
            } else {
                tracing::info!(
                    vm = %entry.handle.vm,
                    grace_s = grace.as_secs(),
                    "VM connection lost without a deliberate end (NBD_CMD_DISC, or QEMU stopping its vhost-user device): its overlay waits for it to reconnect"
                );
                Some(Instant::now() + grace)
            };
            entry.grace = Some(Grace { until, parked });
            return None;
        }
        let stopping = self.stopping.load(Ordering::SeqCst);
        let lost_writes =
            inner.vms.get(&number).is_some_and(|e| e.named && e.written && !e.reset.load(Ordering::SeqCst));
        if ending == Ending::Lost && !stopping && lost_writes {
            // No grace to wait in (--reconnect-grace 0): the guest may well be running still and
            // reconnect at once, so its name must not come back fresh.
            return self.lose(&mut inner, number, Some(parked), "its connection was lost and --reconnect-grace is 0");
        }
        if ending == Ending::Lost && stopping {
            if let Some(entry) = inner.vms.get_mut(&number).filter(|e| e.named && e.marked && e.state.is_none()) {
                tracing::warn!(vm = %entry.handle.vm, "server stopping: this VM's writes are lost; its name will be refused");
                // The ledger entry stays (see `server_stopping`).
                entry.marked = false;
            }
        }
        self.forget(&mut inner, number, Some(parked))
    }

    /// Each VM's I/O limits, and the host's budgets.
    pub fn limits(&self) -> &VmLimits {
        &self.limits
    }

    /// Which VMs boot, and the cap on how many at once.
    pub fn boots(&self) -> &Arc<BootPacing> {
        &self.boots
    }

    /// The VM names whose connections may be several at once, sharing one overlay.
    pub fn allow_multi_conn(&self, patterns: Vec<String>) {
        self.multi_conn.set(patterns);
    }

    /// Whether VM `vm`'s clients may connect several times at once.
    pub fn multi_conn_allowed(&self, vm: &str) -> bool {
        self.multi_conn.allows(vm)
    }

    /// One of several connections of a VM ends: `true` while others still serve it (the VM's
    /// connection has not ended), `false` for its last (or only) one.
    pub(crate) fn leave(&self, number: u64) -> bool {
        let mut inner = lock(&self.inner);
        match inner.vms.get_mut(&number) {
            Some(entry) if entry.extra_connections > 0 => {
                entry.extra_connections -= 1;
                tracing::info!(vm = %entry.handle.vm, connections = entry.extra_connections + 1, "VM connection ended; others go on");
                true
            }
            Some(entry) => {
                // The last: its overlay is about to be parked or ended, so nobody joins it now
                // (a claim waits until it is in grace, then resumes it). A move keeps its hold.
                if entry.moving.is_none() {
                    entry.live = None;
                }
                false
            }
            None => false,
        }
    }

    /// A VM claimed whose overlay could not be made.
    pub fn forget_failed(&self, number: u64) {
        let mut inner = lock(&self.inner);
        // The overlay never stood, and the files it made went with it: any of its names still
        // there, held, is another server's (made between the check and the making).
        let parked = self.forget_with(&mut inner, number, None, remove_leftover_state_files);
        drop(inner);
        drop(parked);
    }

    /// For a server that stops: every overlay in grace whose state outlives the process is
    /// handed over (its files and ledger entry stay, for the next server to rebuild); the others
    /// are dropped, their names kept in the ledger so that the next server refuses them rather
    /// than serve them golden data.
    pub fn hand_over_all_in_grace(&self) {
        let mut inner = lock(&self.inner);
        self.handed_over.store(true, Ordering::SeqCst);
        let numbers: Vec<u64> = inner.vms.iter().filter(|(_, e)| e.grace.is_some()).map(|(n, _)| *n).collect();
        let mut parked = Vec::new();
        for number in numbers {
            let Some(entry) = inner.vms.get_mut(&number) else { continue };
            if let Some(mut grace) = entry.grace.take() {
                hand_over(entry, &mut grace.parked);
                parked.extend(self.forget(&mut inner, number, Some(grace.parked)));
            }
        }
        drop(inner);
        drop(parked);
    }

    /// Overlays whose grace ran out, taken out of the registry. A VM that had written is lost
    /// (its guest may still be running, paused or cut off for longer than the grace, and would
    /// read golden data where it wrote); one that never wrote is simply forgotten.
    fn expire(&self, now: Instant) -> Vec<VmOverlay> {
        let expired: Vec<u64> = lock(&self.inner)
            .vms
            .iter()
            .filter(|(_, e)| e.grace.as_ref().and_then(|g| g.until).is_some_and(|until| until <= now))
            .map(|(n, _)| *n)
            .collect();
        // A VM made its image's maintenance VM while in its grace waits with no end instead.
        let maintained: Vec<u64> = expired.iter().copied().filter(|&n| self.maintained(n)).collect();
        let mut inner = lock(&self.inner);
        for n in &maintained {
            if let Some(entry) = inner.vms.get_mut(n) {
                if let Some(grace) = entry.grace.as_mut() {
                    grace.until = None;
                    self.mark_quiet(entry, true);
                }
            }
        }
        let grace = self.lifecycle.reconnect_grace.as_secs();
        expired
            .into_iter()
            .filter(|n| !maintained.contains(n))
            .filter_map(|n| {
                // Still in its grace, and past it: not resumed in between.
                let entry =
                    inner.vms.get(&n).filter(|e| e.grace.as_ref().and_then(|g| g.until).is_some_and(|u| u <= now))?;
                let vm = entry.handle.vm.clone();
                if entry.written {
                    let why = format!("it did not reconnect within its grace ({grace} s)");
                    self.lose(&mut inner, n, None, &why)
                } else {
                    tracing::info!(vm, "VM did not reconnect within its grace, and had written nothing: forgotten");
                    self.forget(&mut inner, n, None)
                }
            })
            .collect()
    }

    /// Ends a VM's overlay whose writes cannot be kept for it: its memory and files are given
    /// back, and its name is refused until `vm reset` (a tombstone in the ledger keeps it so
    /// across restarts). Returns its overlay, for the caller to drop outside the lock.
    fn lose(&self, inner: &mut Registered, number: u64, overlay: Option<VmOverlay>, why: &str) -> Option<VmOverlay> {
        self.lose_with(inner, number, overlay, why, true)
    }

    /// As [`Self::lose`], but its files stay until `vm reset` (as a recovery that failed
    /// leaves them): a golden image found changed may be a false alarm (a `touch`), and the
    /// VM's writes are then still there to look at.
    fn lose_keeping_files(
        &self,
        inner: &mut Registered,
        number: u64,
        overlay: Option<VmOverlay>,
        why: &str,
    ) -> Option<VmOverlay> {
        self.lose_with(inner, number, overlay, why, false)
    }

    fn lose_with(
        &self,
        inner: &mut Registered,
        number: u64,
        overlay: Option<VmOverlay>,
        why: &str,
        remove_files: bool,
    ) -> Option<VmOverlay> {
        let Some(entry) = inner.vms.remove(&number) else { return overlay };
        let vm = entry.handle.vm.clone();
        self.boots.booted(&vm);
        tracing::error!(vm, why, "VM lost: its writes are given up and its name refused until `overspill vm reset`");
        inner.departed.absorb(&entry.handle.stats);
        inner.names.remove(&vm);
        let mut overlay = overlay.or(entry.grace.map(|g| g.parked));
        if let Some(ledger) = &self.ledger {
            // The tombstone still says where the state files were: a crash before they are gone
            // leaves them named, and `vm reset` removes them.
            if let Err(error) =
                ledger.write_tombstone(&vm, &entry.image, entry.owner.as_deref(), entry.state.clone(), why)
            {
                tracing::warn!(vm, %error, "could not write the lost VM's tombstone: a restart finds its old entry");
            }
            if let Some(state) = &entry.state {
                if remove_files {
                    remove_state_files(&vm, state);
                }
                if let Some(overlay) = &mut overlay {
                    overlay.keep_state();
                }
            }
        }
        inner.lost.insert(vm, why.to_owned());
        overlay
    }

    /// Removes a VM: its counters go to the departed, its ledger file and state files go.
    /// Returns its overlay (`overlay`, or the one parked in grace), for the caller to drop
    /// outside the lock.
    ///
    /// The state files go here, by name, while the name is still this VM's: once the lock is
    /// released a next VM of the same name may make files of the same names, which the old
    /// overlay's drop (it may wait for a segment write first) would remove by name, and a crash
    /// before that drop would leave files that no ledger file names. The overlay is told to
    /// leave its files alone; it keeps using them, unlinked, until it is dropped.
    fn forget(&self, inner: &mut Registered, number: u64, overlay: Option<VmOverlay>) -> Option<VmOverlay> {
        self.forget_with(inner, number, overlay, remove_state_files)
    }

    fn forget_with<T>(
        &self,
        inner: &mut Registered,
        number: u64,
        overlay: Option<VmOverlay>,
        remove_files: impl FnOnce(&str, &StateRecord) -> T,
    ) -> Option<VmOverlay> {
        let Some(entry) = inner.vms.remove(&number) else { return overlay };
        inner.departed.absorb(&entry.handle.stats);
        if entry.named {
            inner.names.remove(&entry.handle.vm);
            // Under the lock: a next VM of the name may be made fresh once it is released.
            self.boots.booted(&entry.handle.vm);
            self.limits.forget_vm(&entry.handle.vm);
        }
        let mut overlay = overlay.or(entry.grace.map(|g| g.parked));
        if entry.marked {
            if let Some(ledger) = &self.ledger {
                match &entry.state {
                    Some(state) => {
                        ledger.retire(&entry.handle.vm, state, remove_files);
                        if let Some(overlay) = &mut overlay {
                            overlay.keep_state();
                        }
                    }
                    None => ledger.unmark(&entry.handle.vm),
                }
            }
        }
        overlay
    }
}

impl Entry {
    fn new(export: &str, vm: &str, named: bool, reset: Arc<AtomicBool>) -> Self {
        Self {
            handle: VmHandle { export: export.to_owned(), vm: vm.to_owned(), stats: Arc::default() },
            image: export.to_owned(),
            owner: None,
            named,
            created: Instant::now(),
            reset,
            marked: false,
            written: false,
            state: None,
            grace: None,
            lose_at_end: None,
            live: None,
            moving: None,
            extra_connections: 0,
        }
    }
}

/// An image label as logs and refusals show it: the empty export name is `--base`'s image.
pub fn shown_image(label: &str) -> &str {
    if label.is_empty() {
        "the default image (--base)"
    } else {
        label
    }
}

/// Ends overlays whose grace ran out, once a second, for as long as the registry lives.
fn spawn_grace_keeper(registry: Weak<VmRegistry>) {
    let spawned = std::thread::Builder::new().name("vm-grace".into()).spawn(move || loop {
        std::thread::sleep(Duration::from_millis(250));
        let Some(registry) = registry.upgrade() else { return };
        // Dropped here, outside the lock: an overlay's drop waits for its last segment write.
        drop(registry.expire(Instant::now()));
    });
    if let Err(error) = spawned {
        tracing::error!(%error, "could not start the grace keeper: overlays in grace are kept until reset");
    }
}

#[cfg(test)]
#[path = "vms_tests.rs"]
mod tests;
