//! Ending VMs by name (`overspill vm reset`, `vm drop`): a VM in any state, a lost one, one an
//! earlier server left; with the two kinds of VM whose names outlive their overlays: forks (a
//! dropped fork is refused until reset) and an image's maintenance VM (whose overlay a reset
//! leaves alone: it is the image's next version).

use std::sync::atomic::Ordering;

use super::{lock, Registered, VmRegistry};
use crate::ledger::remove_leftover_state_files;
use crate::ServerError;

/// What VM `vm` starts from when its overlay is new: its checkpoint if it is a fork.
pub(super) fn start_of(inner: &Registered, vm: &str) -> String {
    match inner.forks.get(vm) {
        Some(fork) if !fork.dropped => format!("its checkpoint {}:{}", fork.image, fork.checkpoint),
        _ => "the golden image".to_owned(),
    }
}

impl VmRegistry {
    /// Ends a VM's overlay whatever its state: a connected VM's connection closes at its next
    /// request (unanswered, so its client sends it again to the fresh overlay). A fork starts
    /// from its checkpoint again; a dropped fork's name is freed.
    pub fn reset(&self, vm: &str) -> Result<String, ServerError> {
        self.reset_with(vm, true)
    }

    /// [`Self::reset`], refused with [`ServerError::VmConnected`] unless `even_connected`
    /// when the VM is connected as the registry's lock is held.
    pub fn reset_with(&self, vm: &str, even_connected: bool) -> Result<String, ServerError> {
        let number = lock(&self.inner).names.get(vm).copied();
        let maintained = number
            .filter(|&number| self.maintained(number))
            .and_then(|number| lock(&self.inner).vms.get(&number).map(|entry| entry.image.clone()));
        if let Some(image) = maintained {
            // The libvirt hook resets every VM at its start: the maintenance VM boots on its writes.
            tracing::info!(vm, image, "reset of the maintenance VM declined: its writes are the image's next version");
            return Ok(format!(
                "{vm} is image {image}'s maintenance VM: its writes are kept across its boots (`overspill vm capture \
                 {vm}` makes them the next version; `overspill image maintain {image} --none` first for a reset)"
            ));
        }
        let mut inner = lock(&self.inner);
        let forgotten = inner.forks.forget_dropped(vm).map_err(|e| ServerError::io("updating the forks' book", e))?;
        let held = inner.names.contains_key(vm) || inner.lost.contains_key(vm);
        if forgotten {
            tracing::info!(vm, "dropped fork reset by the operator: its name starts from its image again");
        }
        let unforked = "no longer a fork: its next connection starts from its image's version";
        match (held, inner.forks.get(vm)) {
            (false, _) if forgotten => return Ok(format!("{vm}: {unforked}")),
            (false, Some(fork)) => {
                return Ok(format!(
                    "{vm}: a fork of {}:{} with no overlay yet: nothing to reset",
                    fork.image, fork.checkpoint
                ))
            }
            _ => {}
        }
        drop(inner);
        let ended = self.end_by_name(vm, even_connected);
        if forgotten {
            ended.map(|message| format!("{message}; {unforked}"))
        } else {
            ended
        }
    }

    /// Ends the overlay of a VM that is not connected (in grace or lost). A fork's pin goes
    /// too: its name is refused from then on, until `vm reset`.
    pub fn drop_vm(&self, vm: &str) -> Result<String, ServerError> {
        let mut inner = lock(&self.inner);
        match inner.forks.get(vm) {
            None => {
                drop(inner);
                let ended = self.end_by_name(vm, false)?;
                self.restart_maintenance(vm);
                return Ok(ended);
            }
            Some(fork) if fork.dropped => {
                return Ok(format!("{vm}: a dropped fork already; `overspill vm reset {vm}` frees its name"))
            }
            Some(_) => {}
        }
        let number = inner.names.get(vm).copied();
        if let Some(entry) = number.and_then(|number| inner.vms.get(&number)) {
            if let Some(moving) = &entry.moving {
                return Err(ServerError::VmMoving(vm.to_owned(), moving.peer.clone()));
            }
            if entry.grace.is_none() {
                return Err(ServerError::VmConnected(vm.to_owned()));
            }
        }
        inner.forks.drop_fork(vm).map_err(|e| ServerError::io("updating the forks' book", e))?;
        let parked = number.and_then(|number| self.forget(&mut inner, number, None));
        let lost = inner.lost.contains_key(vm);
        drop(inner);
        drop(parked);
        if lost {
            // Its tombstone and files go as a lost VM's drop takes them; the name stays refused
            // as a dropped fork's.
            self.end_by_name(vm, false)?;
        }
        tracing::info!(vm, "fork dropped by the operator: its name is refused until `vm reset`");
        Ok(format!("{vm}: fork dropped; its name is refused until `overspill vm reset {vm}`"))
    }

    /// A maintenance VM's overlay thrown away on purpose (`vm drop`, whether it waited or was
    /// lost): its next boot begins over the marker's version instead of being refused.
    fn restart_maintenance(&self, vm: &str) {
        let Some(store) = self.image_store.get() else { return };
        let images = match store.images() {
            Ok(images) => images,
            Err(error) => return tracing::warn!(vm, %error, "could not read the image store after a drop"),
        };
        for image in images.iter().filter(|i| i.maintenance.as_ref().is_some_and(|m| m.vm == vm && m.begun)) {
            match store.restart_maintenance(&image.name, vm) {
                Ok(_) => {
                    tracing::info!(vm, image = image.name, "maintenance overlay dropped: its next boot begins over")
                }
                Err(error) => {
                    tracing::warn!(vm, image = image.name, %error, "could not record the maintenance VM's drop")
                }
            }
        }
    }

    /// Whether VM `number` is its image's maintenance VM (`overspill image maintain`) over the
    /// version the marker names. Reads the image store: call it without the registry's lock.
    pub(crate) fn maintained(&self, number: u64) -> bool {
        let named = lock(&self.inner)
            .vms
            .get(&number)
            .filter(|entry| entry.named)
            .map(|entry| (entry.image.clone(), entry.handle.vm.clone(), entry.handle.export.clone()));
        named.is_some_and(|(image, vm, label)| self.maintains(&image, &vm, &label))
    }

    /// Whether VM `vm`, over image label `label`, is image `image`'s maintenance VM: named by the
    /// marker, over the version it names (an overlay over another version is any VM's).
    pub(crate) fn maintains(&self, image: &str, vm: &str, label: &str) -> bool {
        let store = self.image_store.get();
        store.and_then(|store| store.maintenance(image)).is_some_and(|m| {
            m.vm == vm && label.strip_prefix(image).and_then(|l| l.strip_prefix(':')) == Some(&m.version)
        })
    }

    /// The checkpoint fork `vm` starts from, unless it is no fork or a dropped one.
    pub fn fork_of(&self, vm: &str) -> Option<crate::forks::Fork> {
        lock(&self.inner).forks.get(vm).filter(|fork| !fork.dropped).cloned()
    }

    fn end_by_name(&self, vm: &str, even_connected: bool) -> Result<String, ServerError> {
        self.end_by_name_or_orphan(vm, even_connected, true)
    }

    fn end_by_name_or_orphan(&self, vm: &str, even_connected: bool, orphans: bool) -> Result<String, ServerError> {
        let mut inner = lock(&self.inner);
        if inner.lost.remove(vm).is_some() {
            if let Some(ledger) = &self.ledger {
                match ledger.state_of(vm) {
                    // Not open here: a server sharing the spill directory may hold files of
                    // this name (see `remove_leftover_state_files`).
                    Some(state) => ledger.retire(vm, &state, remove_leftover_state_files),
                    // An unreadable ledger file: its VM's files, where this server makes them,
                    // would otherwise refuse the name for good (a new VM never takes files
                    // that no ledger file names).
                    None => {
                        ledger.unmark(vm);
                        if let Some(places) = self.state_places.get() {
                            remove_leftover_state_files(vm, places);
                        }
                    }
                }
            }
            let start = start_of(&inner, vm);
            tracing::info!(vm, "lost VM reset by the operator: it starts from {start}");
            return Ok(format!("{vm}: its lost writes are forgotten; it starts from {start}"));
        }
        let Some(&number) = inner.names.get(vm) else {
            drop(inner);
            return if orphans {
                self.reset_orphan(vm, even_connected)
            } else {
                Err(ServerError::NoSuchVm(vm.to_owned()))
            };
        };
        let entry = inner.vms.get_mut(&number).expect("names point at entries");
        if let Some(moving) = &entry.moving {
            return Err(ServerError::VmMoving(vm.to_owned(), moving.peer.clone()));
        }
        if entry.grace.is_none() {
            if !even_connected {
                return Err(ServerError::VmConnected(vm.to_owned()));
            }
            entry.reset.store(true, Ordering::SeqCst);
            // Its writes go with the reset, as with any reset: not lost, started over.
            entry.lose_at_end = None;
            tracing::info!(vm, "VM reset by the operator: its connection closes at its next request or within 20 s");
            return Ok(format!("{vm}: reset; its connection closes at its next request (within 20 s if it sends none) and it starts over"));
        }
        let start = start_of(&inner, vm);
        let parked = self.forget(&mut inner, number, None);
        drop(inner);
        drop(parked);
        tracing::info!(vm, "VM overlay dropped by the operator");
        Ok(format!("{vm}: overlay dropped; the next connection starts from {start}"))
    }

    /// A VM this server does not hold, whose ledger entry a server gone since this one started
    /// left (one still exiting then): its state is given up, so that a start after the reset
    /// (the libvirt hook's) does not rebuild it. Anything else is no VM of this server's.
    fn reset_orphan(&self, vm: &str, even_connected: bool) -> Result<String, ServerError> {
        let Some(ledger) = &self.ledger else { return Err(ServerError::NoSuchVm(vm.to_owned())) };
        let one_at_a_time = self.orphans();
        let known = |inner: &Registered| inner.names.contains_key(vm) || inner.lost.contains_key(vm);
        let orphan = ledger.orphan(vm);
        if known(&lock(&self.inner)) {
            // Came in meanwhile (a connection, a refusal): reset as such, once, and refused as
            // such if it is connected and the caller asked for that.
            drop(one_at_a_time);
            return self.end_by_name_or_orphan(vm, even_connected, false);
        }
        match orphan {
            Some(Ok(orphan)) => ledger.retire(vm, &orphan.state, remove_leftover_state_files),
            Some(Err(_)) => match ledger.state_of(vm) {
                Some(state) => ledger.retire(vm, &state, remove_leftover_state_files),
                None => ledger.unmark(vm),
            },
            // A record that the VM was moved to a peer (one never told the move was done): the
            // name is refused here while it stands.
            None if ledger.moved_to(vm).is_some() => {
                ledger.unmark(vm);
                tracing::info!(vm, "record of the VM's move to a peer forgotten by the operator");
                return Ok(format!(
                    "{vm}: the record of its move to a peer is forgotten; it starts from the golden image"
                ));
            }
            None => return Err(ServerError::NoSuchVm(vm.to_owned())),
        }
        tracing::info!(vm, "VM left by an earlier server reset by the operator: it starts from the golden image");
        Ok(format!("{vm}: the state an earlier server left is given up; it starts from the golden image"))
    }
}
