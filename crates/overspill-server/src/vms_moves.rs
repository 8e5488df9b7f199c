//! The registry's part in moving a VM between servers (see `migration`): which VM moves, to or
//! from which peer, how far along, and what the ledger says at each step, so that exactly one
//! server holds a VM's writes whatever stops when.
//!
//! ```text
//!   sending end (A)                               receiving end (B)
//!   connected / in grace ── start_outgoing ──▶ outgoing        claim_incoming ──▶ incoming
//!                                                 │  (ledger: making, files removed at a restart)
//!                         final delta, fenced ──▶ │ ──────────────────────────▶ incoming_ready
//!                                                 │      (ledger: incoming from A, in doubt)
//!   outgoing_committed (ledger: moved to B) ◀──── Ready
//!   finish_outgoing(moved) ─────── Committed ──────────────────────────▶ incoming_committed
//!                                                                        (ledger: a VM as any)
//! ```
//!
//! The sending end's ledger says "moved" before the receiving end serves anything, so a sender
//! restarted after a crash never resumes its stale copy; a receiver that ends before it heard
//! the move was done refuses the name after its restart rather than guess.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use overspill_block::{DeviceError, DeviceErrorKind};
use serde::{Deserialize, Serialize};

use super::{lock, Ending, Entry, Grace, VmRegistry};
use crate::ledger::{remove_state_files, Marks};
use crate::live::Live;
use crate::vm_overlay::VmOverlay;

/// Which way a VM moves, seen from this server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Outgoing,
    Incoming,
}

/// How far a move has come.
#[derive(Debug, Default)]
pub struct MoveProgress {
    pub bytes: AtomicU64,
    /// Pre-copy rounds: each ends when every block the VM had changed was sent once.
    pub rounds: AtomicU64,
    pub blocks_left: AtomicU64,
}

/// A move under way, on a VM's entry.
pub(crate) struct Moving {
    pub(crate) direction: Direction,
    pub(crate) peer: String,
    pub(crate) progress: Arc<MoveProgress>,
    /// Sending end: the ledger says the VM is the peer's (see
    /// [`VmRegistry::outgoing_committed`]); nothing here may change it any more. Receiving
    /// end: it said it has the whole state (`Ready`), so the copy here may be the VM's.
    pub(crate) committed: bool,
}

/// Moves since the server started, for the metrics.
#[derive(Debug, Default)]
pub struct MoveCounters {
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub rounds: AtomicU64,
    pub moved_out: AtomicU64,
    pub moved_in: AtomicU64,
    pub aborted: AtomicU64,
    /// Switchovers seen by a receiving end: from its first request (or the sender's end) to
    /// the VM served here, in microseconds.
    pub switchovers: AtomicU64,
    pub switchover_micros_sum: AtomicU64,
    pub switchover_micros_max: AtomicU64,
}

impl MoveCounters {
    pub(crate) fn switchover(&self, took: std::time::Duration) {
        let micros = took.as_micros() as u64;
        self.switchovers.fetch_add(1, Ordering::Relaxed);
        self.switchover_micros_sum.fetch_add(micros, Ordering::Relaxed);
        self.switchover_micros_max.fetch_max(micros, Ordering::Relaxed);
    }
}

/// What a server holds of a VM, as it tells a peer that asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "holding", rename_all = "kebab-case")]
pub enum Holding {
    Nothing,
    /// Its overlay, connected or in grace: its writes are here.
    Live,
    /// It is moving from here to a peer and may be that peer's any moment: ask again.
    Moving,
    /// Its writes were lost here, for this reason: it is refused until `vm reset`.
    Lost {
        why: String,
    },
    /// It was handed to this peer.
    Moved {
        to: String,
    },
}

/// What a receiving end is told of the VM it takes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    /// The image it runs over (`name:version` for a versioned image): the receiving end must
    /// have exactly this one.
    pub image_label: String,
    pub image_identity: Option<String>,
    /// The image's content digest (`image_digest`), where the sending end has computed it: a
    /// receiving end on another host, where `image_identity` never matches, compares it instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_digest: Option<String>,
    pub disk_bytes: u64,
    /// The TLS identity that made it, the only one that may open it.
    pub owner: Option<String>,
    pub written: bool,
    /// The VM is a fork (`vm fork`): its pin goes with it, recorded at the receiving end before
    /// the move commits and forgotten at the sending end once it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork: Option<crate::forks::Fork>,
}

/// Who asks for a VM at the receiving end: the client identity its connection proved (TLS),
/// if any. The sending end checks it against the VM's owner before the VM starts moving: a
/// client may not put another's VM on the move (its reconnects refused meanwhile) by asking.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Asker {
    pub identity: Option<String>,
}

/// A VM this server is sending, from [`VmRegistry::start_outgoing`].
pub(crate) struct Outgoing {
    pub(crate) number: u64,
    pub(crate) vm: String,
    pub(crate) live: Arc<Live>,
    pub(crate) offer: Offer,
    pub(crate) progress: Arc<MoveProgress>,
    /// The VM was in its grace when its move began (no connection here), until then (`None`:
    /// cut for idleness, without end): it goes back there if the move is given up.
    from_grace: Option<Option<Instant>>,
}

impl Outgoing {
    /// The VM was in its grace here when its move began: no connection here to wait for.
    pub(crate) fn had_no_connection(&self) -> bool {
        self.from_grace.is_some()
    }
}

impl VmRegistry {
    /// The overlay a connection of VM `number` serves, for a move to find.
    pub(crate) fn attach_live(&self, number: u64, live: &Arc<Live>) {
        if let Some(entry) = lock(&self.inner).vms.get_mut(&number) {
            entry.live = Some(Arc::downgrade(live));
        }
    }

    /// Moves since the server started.
    pub fn move_counters(&self) -> &MoveCounters {
        &self.moves
    }

    /// What this server holds of VM `vm`, for a peer that asks.
    pub fn holding(&self, vm: &str) -> Holding {
        let inner = lock(&self.inner);
        if let Some(why) = inner.lost.get(vm) {
            return Holding::Lost { why: why.clone() };
        }
        if let Some(number) = inner.names.get(vm) {
            return match inner.vms.get(number).and_then(|e| e.moving.as_ref()) {
                // Not this server's yet: the peer that sends it holds it. From `Ready` on (and
                // recovered in doubt) the copy here may be the VM's: "moving", so that nobody
                // asking takes the name for free (a third server, hearing "moved to B" from the
                // sender and "nothing" here, started it from the golden image).
                Some(moving) if moving.direction == Direction::Incoming && moving.committed => Holding::Moving,
                Some(moving) if moving.direction == Direction::Incoming => Holding::Nothing,
                Some(moving) if moving.committed => Holding::Moved { to: moving.peer.clone() },
                Some(_) => Holding::Moving,
                None => Holding::Live,
            };
        }
        drop(inner);
        match self.ledger.as_ref().and_then(|ledger| ledger.moved_to(vm)) {
            Some(to) => Holding::Moved { to },
            None => Holding::Nothing,
        }
    }

    /// Begins sending VM `vm` to `peer`, which asks for it over image `image` for `asker`: its
    /// overlay is shared with the move from now on (its connection goes on), or taken out of
    /// its grace.
    pub(crate) fn start_outgoing(
        &self,
        vm: &str,
        image: &str,
        peer: &str,
        asker: Option<&Asker>,
    ) -> Result<Outgoing, String> {
        let mut inner = lock(&self.inner);
        let number = *inner.names.get(vm).ok_or_else(|| format!("this server does not hold VM {vm}"))?;
        let entry = inner.vms.get_mut(&number).expect("names point at entries");
        if let (Some(owner), Some(asker)) = (&entry.owner, asker) {
            if asker.identity.as_ref() != Some(owner) {
                return Err(format!("VM {vm} belongs to another client identity"));
            }
        }
        if let Some(moving) = &entry.moving {
            return Err(format!("VM {vm} is already moving (with peer {})", moving.peer));
        }
        if entry.image != image {
            return Err(format!("VM {vm} runs over image {}, not {image}", shown(&entry.image)));
        }
        if entry.reset.load(Ordering::SeqCst) || entry.lose_at_end.is_some() {
            return Err(format!("VM {vm} is being reset or lost here"));
        }
        if entry.extra_connections > 0 {
            // Its connections would end one by one, each a switchover: it stays.
            return Err(format!("VM {vm} has several connections (multi-conn), and does not move"));
        }
        // A fork's pin goes with it (see [`Offer::fork`]).
        let fork = inner.forks.get(vm).cloned();
        let entry = inner.vms.get_mut(&number).expect("names point at entries");
        let from_grace = entry.grace.as_ref().map(|grace| grace.until);
        let live = match entry.grace.take() {
            Some(grace) => Arc::new(Live::new(grace.parked)),
            None => entry
                .live
                .as_ref()
                .and_then(Weak::upgrade)
                .ok_or_else(|| format!("VM {vm} is connecting: try again"))?,
        };
        // A peer's reads find it there, whether it came from a connection or from its grace.
        entry.live = Some(Arc::downgrade(&live));
        let started = live.update(|state| {
            let free = state.ended.is_none() && !state.outgoing;
            state.outgoing |= free;
            free
        });
        if !started {
            return Err(format!("VM {vm}'s connection is ending: try again"));
        }
        let progress = Arc::new(MoveProgress::default());
        entry.moving = Some(Moving {
            direction: Direction::Outgoing,
            peer: peer.to_owned(),
            progress: progress.clone(),
            committed: false,
        });
        let mut offer = Offer {
            image_label: entry.handle.export.clone(),
            image_identity: entry.state.as_ref().and_then(|state| state.image_identity.clone()),
            image_digest: None,
            disk_bytes: 0,
            owner: entry.owner.clone(),
            written: entry.written,
            fork,
        };
        drop(inner);
        // Outside the registry's lock: the move takes the VM's lock first, then the registry's.
        let (disk_bytes, running_over) =
            live.vm().as_ref().map_or((0, None), |vm| (vm.overlay.size(), vm.overlay.image_identity()));
        offer.disk_bytes = disk_bytes;
        // A VM without state files (no reconnect grace) records no identity: the image it runs
        // over is compared all the same.
        offer.image_identity = offer.image_identity.or(running_over);
        offer.image_digest = offer
            .image_identity
            .as_deref()
            .and_then(|identity| self.image_digests().and_then(|digests| digests.get(identity)));
        tracing::info!(vm, peer, "VM moving to a peer server: pre-copy begins");
        Ok(Outgoing { number, vm: vm.to_owned(), live, offer, progress, from_grace })
    }

    /// Reads VM `vm`'s disk for `peer`, the one it is moving to (its reads before the
    /// switchover): `Ok(false)` when it is not moving from here to there (any more). No other
    /// peer reads it.
    pub(crate) fn read_for_peer(&self, vm: &str, peer: &str, offset: u64, buf: &mut [u8]) -> Result<bool, String> {
        let live = {
            let inner = lock(&self.inner);
            let Some(entry) = inner.names.get(vm).and_then(|number| inner.vms.get(number)) else { return Ok(false) };
            let moving_to = |m: &Moving| m.direction == Direction::Outgoing && m.peer == peer;
            if !entry.moving.as_ref().is_some_and(moving_to) {
                return Ok(false);
            }
            entry.live.as_ref().and_then(Weak::upgrade)
        };
        let Some(live) = live else { return Ok(false) };
        let mut vm = live.vm();
        let Some(vm) = vm.as_mut() else { return Ok(false) };
        vm.overlay.read(offset, buf).map(|()| true).map_err(|e| e.to_string())
    }

    /// The receiving end has the VM's whole state, the VM's requests here held back: the
    /// ledger says the VM is the peer's from now on, before the peer is told so.
    pub(crate) fn outgoing_committed(&self, out: &Outgoing, peer: &str) -> std::io::Result<()> {
        let mut inner = lock(&self.inner);
        let Some(entry) = inner.vms.get_mut(&out.number) else {
            return Err(std::io::Error::other("the VM is no longer registered"));
        };
        if let Some(ledger) = &self.ledger {
            let marks = Marks { moved: Some(peer.to_owned()), unwritten: !entry.written, ..Marks::default() };
            ledger.write_entry(&out.vm, &entry.image, entry.owner.as_deref(), entry.state.clone(), marks)?;
        }
        if let Some(moving) = entry.moving.as_mut() {
            moving.committed = true;
        }
        Ok(())
    }

    /// Whether VM `number` has written (the sending end tells the receiving end at the
    /// switchover).
    pub(crate) fn has_written(&self, number: u64) -> bool {
        lock(&self.inner).vms.get(&number).is_some_and(|entry| entry.written)
    }

    /// Ends a move from here. `moved`: the peer holds the VM; its overlay (`vm`, taken out of
    /// the shared slot) and files go, its connection here closes at its next request, and the
    /// ledger keeps where it went. Otherwise the VM goes on here as before the move: connected,
    /// back in its grace, or ended as its connection ended meanwhile.
    pub(crate) fn finish_outgoing(&self, out: Outgoing, moved: Option<VmOverlay>) {
        let mut inner = lock(&self.inner);
        if let Some(mut overlay) = moved {
            self.moves.moved_out.fetch_add(1, Ordering::Relaxed);
            let Some(entry) = inner.vms.remove(&out.number) else { return };
            inner.names.remove(&out.vm);
            inner.departed.absorb(&entry.handle.stats);
            entry.reset.store(true, Ordering::SeqCst);
            self.boots().booted(&out.vm);
            if let Some(state) = &entry.state {
                remove_state_files(&out.vm, state);
                overlay.keep_state();
            }
            if let (Some(ledger), Some(moving)) = (&self.ledger, &entry.moving) {
                let marks = Marks { moved: Some(moving.peer.clone()), ..Marks::default() };
                if let Err(error) = ledger.write_entry(&out.vm, &entry.image, entry.owner.as_deref(), None, marks) {
                    tracing::warn!(vm = out.vm, %error, "could not rewrite the moved VM's ledger entry");
                }
            }
            if out.offer.fork.is_some() {
                // The peer recorded the pin before the move committed: it is the peer's now.
                if let Err(error) = inner.forks.remove(&out.vm) {
                    tracing::warn!(vm = out.vm, %error, "the moved fork's pin could not be forgotten here");
                }
            }
            drop(inner);
            tracing::info!(vm = out.vm, "VM moved to its peer: its state here is given up");
            drop(overlay);
            return;
        }
        drop(inner);
        self.moves.aborted.fetch_add(1, Ordering::Relaxed);
        // The VM's lock before the registry's, as everywhere a move takes both.
        let parked = {
            let mut vm = out.live.vm();
            if let Some(vm) = vm.as_mut() {
                vm.overlay.stop_moving();
            }
            if out.from_grace.is_some() {
                vm.take()
            } else {
                None
            }
        };
        let ended = out.live.update(|state| {
            state.outgoing = false;
            state.ended
        });
        let mut inner = lock(&self.inner);
        let Some(entry) = inner.vms.get_mut(&out.number) else { return };
        entry.moving = None;
        if let Some(parked) = parked {
            // A VM cut for idleness (a paused guest) waits on without end, as it did; another
            // gets its grace again.
            let until = match out.from_grace {
                Some(None) => None,
                _ => Some(Instant::now() + self.lifecycle.reconnect_grace),
            };
            entry.grace = Some(Grace { until, parked });
            return;
        }
        drop(inner);
        if let Some(ending) = ended {
            // The connection ended during the move and left its end to it. A clean end
            // (NBD_CMD_DISC) is what a source QEMU sends as it quits once the guest runs at the
            // destination: a move given up after it leaves a running guest there, which takes
            // the VM from here again as it reconnects. So the VM waits, as after a lost
            // connection, rather than end as a powered-off VM would (the destination would then
            // find nothing to take, and its guest golden data).
            let ending = match ending {
                Ending::Deliberate => Ending::Lost,
                other => other,
            };
            let vm = out.live.vm().take();
            if let Some(vm) = vm {
                drop(self.end(out.number, ending, vm));
            }
        }
    }

    /// Peer `peer` says the VM this server moved to it is settled there: the ledger forgets
    /// where the VM went, if it went there.
    pub(crate) fn moved_acknowledged_by(&self, vm: &str, peer: &str) {
        if self.ledger.as_ref().and_then(|ledger| ledger.moved_to(vm)).as_deref() == Some(peer) {
            self.moved_acknowledged(vm);
        }
    }

    /// The peer heard the move was done: the ledger need not say where the VM went any more.
    pub(crate) fn moved_acknowledged(&self, vm: &str) {
        let Some(ledger) = &self.ledger else { return };
        // Only the moved entry: a VM of this name may have come back since.
        if !lock(&self.inner).names.contains_key(vm) && ledger.moved_to(vm).is_some() {
            ledger.unmark(vm);
        }
    }

    /// A VM that a peer holds live is taken from it: it is registered here as incoming (served
    /// nothing until the move commits). A copy of the name here, in grace or lost, is
    /// outranked by the peer's live one and dropped.
    pub(crate) fn claim_incoming(
        &self,
        vm: &str,
        image: &str,
        offer: &Offer,
        peer: &str,
        identity: Option<&str>,
    ) -> Result<(u64, Arc<MoveProgress>, Arc<std::sync::atomic::AtomicBool>), DeviceError> {
        let refuse = |message: String| {
            tracing::warn!(vm, peer, "VM refused: {message}");
            Err(DeviceError::new(DeviceErrorKind::Refused, message))
        };
        if offer.owner.as_deref().is_some_and(|owner| identity != Some(owner)) {
            return refuse(format!("VM {vm} belongs to another client identity"));
        }
        let mut inner = lock(&self.inner);
        // A fork's pin comes with it, or the name is refused: never a fork served as none here,
        // nor a VM as another checkpoint's fork.
        match (inner.forks.get(vm), &offer.fork) {
            (Some(here), _) if here.dropped => return refuse(format!("VM {vm} is a dropped fork here")),
            (Some(here), Some(there)) if here != there => {
                return refuse(format!(
                    "VM {vm} is a fork of {}:{} here, not of its peer's",
                    here.image, here.checkpoint
                ))
            }
            (Some(_), None) => return refuse(format!("VM {vm} is a fork here, and none at its peer")),
            (None, None) if offer.image_label.contains(":@") => {
                return refuse(format!("VM {vm} runs over a checkpoint at its peer, which sends no fork's pin"))
            }
            (None, Some(fork)) if fork.image != image || fork.dropped => {
                return refuse(format!("VM {vm}'s pin at its peer does not fit image {image}"))
            }
            (None, Some(fork)) => {
                if let Err(error) = inner.forks.add(vec![(vm.to_owned(), fork.clone())]) {
                    return refuse(format!("VM {vm} is a fork, and its pin cannot be recorded here: {error}"));
                }
            }
            _ => {}
        }
        let mut dropped = None;
        if inner.lost.remove(vm).is_some() {
            tracing::warn!(vm, peer, "a peer holds this VM live: its lost copy here is given up");
            if let Some(ledger) = &self.ledger {
                match ledger.state_of(vm) {
                    Some(state) => ledger.retire(vm, &state, crate::ledger::remove_leftover_state_files),
                    None => ledger.unmark(vm),
                }
            }
        }
        if let Some(&existing) = inner.names.get(vm) {
            let entry = inner.vms.get(&existing).expect("names point at entries");
            if entry.grace.is_none() {
                return refuse(format!("VM {vm} is connected here too; one connection per VM"));
            }
            tracing::warn!(vm, peer, "a peer holds this VM live: its copy in grace here is given up");
            dropped = self.forget(&mut inner, existing, None);
        }
        let number = inner.next_number;
        inner.next_number += 1;
        let reset = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut entry = Entry::new(image, vm, true, reset.clone());
        entry.owner = offer.owner.clone();
        entry.written = offer.written;
        let progress = Arc::new(MoveProgress::default());
        entry.moving = Some(Moving {
            direction: Direction::Incoming,
            peer: peer.to_owned(),
            progress: progress.clone(),
            committed: false,
        });
        inner.vms.insert(number, entry);
        inner.names.insert(vm.to_owned(), number);
        drop(inner);
        drop(dropped);
        Ok((number, progress, reset))
    }

    /// The receiving end has the VM's whole state and is about to say so: from now on a next
    /// server here cannot tell whether the move was done, and refuses the name.
    /// `written`: the VM had written at the sending end.
    pub(crate) fn incoming_ready(&self, number: u64, written: bool) -> std::io::Result<()> {
        if let Some(entry) = lock(&self.inner).vms.get_mut(&number) {
            entry.written |= written;
            if let Some(moving) = entry.moving.as_mut() {
                moving.committed = true;
            }
        }
        self.rewrite_incoming(number, true)
    }

    /// The sending end said the move is done: the VM is this server's, as any other.
    pub(crate) fn incoming_committed(&self, number: u64) -> std::io::Result<()> {
        self.rewrite_incoming(number, false)?;
        self.moves.moved_in.fetch_add(1, Ordering::Relaxed);
        if let Some(entry) = lock(&self.inner).vms.get_mut(&number) {
            entry.moving = None;
        }
        Ok(())
    }

    fn rewrite_incoming(&self, number: u64, in_doubt: bool) -> std::io::Result<()> {
        let Some(ledger) = &self.ledger else { return Ok(()) };
        let mut inner = lock(&self.inner);
        let Some(entry) = inner.vms.get_mut(&number) else { return Ok(()) };
        if entry.state.is_none() {
            // A VM whose state does not outlive the process: a next server refuses its name
            // once it has written (as `mark_written` does for any VM), rather than serve golden
            // data; the sender's ledger says where it went meanwhile.
            if !in_doubt && entry.written {
                ledger.mark_with(&entry.handle.vm, &entry.handle.export, entry.owner.as_deref(), None)?;
                entry.marked = true;
            }
            return Ok(());
        }
        let incoming = in_doubt.then(|| entry.moving.as_ref().map(|m| m.peer.clone())).flatten();
        let marks = Marks { unwritten: !entry.written, incoming, ..Marks::default() };
        ledger.write_entry(&entry.handle.vm, &entry.image, entry.owner.as_deref(), entry.state.clone(), marks)
    }

    /// A move here that did not happen: the copy made here goes (the sender's is the VM's), or,
    /// when `lost` says why, the name is refused (the move's outcome is unknown) and its files
    /// kept. `vm`: the overlay, if the caller holds it.
    pub(crate) fn incoming_failed(&self, number: u64, vm: Option<VmOverlay>, lost: Option<&str>) {
        self.moves.aborted.fetch_add(1, Ordering::Relaxed);
        let mut inner = lock(&self.inner);
        // A fork's pin recorded for the move goes with it (the VM goes on at its peer, which
        // keeps its own), unless the name is lost here.
        let forked = inner.vms.get(&number).filter(|e| e.handle.export.contains(":@")).map(|e| e.handle.vm.clone());
        if let Some(name) = forked.filter(|_| lost.is_none()) {
            if let Err(error) = inner.forks.remove(&name) {
                tracing::warn!(vm = name, %error, "the pin of a fork that did not move here could not be forgotten");
            }
        }
        let overlay = match lost {
            Some(why) => self.lose_keeping_files(&mut inner, number, vm, why),
            None => self.forget(&mut inner, number, vm),
        };
        drop(inner);
        drop(overlay);
    }

    /// VMs recovered in doubt (their server ended between saying it had a moving VM's whole
    /// state and hearing the move was done): each name, and the peer it was moving from.
    pub(crate) fn in_doubt(&self) -> Vec<(String, String)> {
        lock(&self.inner)
            .vms
            .values()
            .filter(|entry| entry.grace.is_some())
            .filter_map(|entry| {
                let moving = entry.moving.as_ref().filter(|m| m.direction == Direction::Incoming)?;
                Some((entry.handle.vm.clone(), moving.peer.clone()))
            })
            .collect()
    }

    /// Settles a VM recovered in doubt: `Ok(true)`, the copy here is the VM's (in grace as any
    /// recovered VM); `Ok(false)`, the peer kept it (the copy here goes); `Err`, nobody can tell
    /// (the name is refused, its files kept).
    pub(crate) fn settle_in_doubt(&self, vm: &str, outcome: Result<bool, String>) {
        let Some(number) = lock(&self.inner).names.get(vm).copied() else { return };
        match outcome {
            Ok(true) => {
                if let Err(error) = self.incoming_committed(number) {
                    tracing::warn!(vm, %error, "could not record the VM as this server's");
                }
                tracing::info!(vm, "VM recovered in doubt: its peer says it moved here; it waits for its client");
            }
            Ok(false) => {
                tracing::info!(vm, "VM recovered in doubt: its peer kept it; the copy here is dropped");
                let mut inner = lock(&self.inner);
                let overlay = self.forget(&mut inner, number, None);
                drop(inner);
                drop(overlay);
            }
            Err(why) => {
                let why = format!("its move here was interrupted at the switchover, and {why}");
                let mut inner = lock(&self.inner);
                let overlay = self.lose_keeping_files(&mut inner, number, None, &why);
                drop(inner);
                drop(overlay);
            }
        }
    }

    /// How a VM's move shows in `vm list`.
    pub(crate) fn move_detail(moving: &Moving) -> String {
        let progress = &moving.progress;
        let mib = progress.bytes.load(Ordering::Relaxed) as f64 / (1 << 20) as f64;
        let rounds = progress.rounds.load(Ordering::Relaxed);
        let left = progress.blocks_left.load(Ordering::Relaxed);
        match moving.direction {
            Direction::Outgoing => {
                format!("to {}: {mib:.1} MiB sent, {rounds} rounds, {left} blocks left", moving.peer)
            }
            Direction::Incoming => format!("from {}: {mib:.1} MiB received, {rounds} rounds", moving.peer),
        }
    }
}

fn shown(image: &str) -> &str {
    super::shown_image(image)
}
