//! The registry's part in golden images: VMs lost when their image changes under them, the
//! image store VMs are served from, the test group of image stages (which VMs boot a test
//! version), and capturing a VM's overlay as the next version of its image (`overspill vm
//! capture`): what the VM changed over the version it booted, written by the image store as a
//! layer over that version. The VM stays still while it is read (its lock held; a connected
//! guest's requests wait), and its overlay ends with the capture: a connected VM's connection
//! closes at its next request, as after `vm reset`, and its next boot gets whatever version its
//! stage names. A checkpoint (`vm checkpoint`) is written the same way, as a layer of the
//! store that is no version, and the VM goes on; forks (`vm fork`) are names pinned to one
//! (see `forks`).

use std::sync::atomic::Ordering;
use std::sync::Weak;

use overspill_images::qcow2_layer::write_overlay;

use super::{lock, Registered, VmRegistry};
use crate::images::ImageStore;
use crate::vm_overlay::VmOverlay;

impl VmRegistry {
    /// The golden image `image_label` (as VMs' `export` shows it) was found changed under the
    /// VMs served over it: they would read a mix of old and new bytes, so each is lost (refused
    /// by name until `vm reset`). A connected VM's connection closes at its next request,
    /// unanswered, and the VM is lost as it ends; a VM in its grace is lost at once; an anonymous
    /// one is only disconnected. Returns the named VMs, for the log.
    pub fn golden_image_changed(&self, image_label: &str, why: &str) -> Vec<String> {
        self.golden_image_changes.fetch_add(1, Ordering::Relaxed);
        let mut inner = lock(&self.inner);
        let over: Vec<u64> =
            inner.vms.iter().filter(|(_, entry)| entry.handle.export == image_label).map(|(n, _)| *n).collect();
        let mut named = Vec::new();
        let mut parked = Vec::new();
        for number in over {
            let Some(entry) = inner.vms.get_mut(&number) else { continue };
            entry.reset.store(true, Ordering::SeqCst);
            if !entry.named {
                continue;
            }
            named.push(entry.handle.vm.clone());
            if entry.grace.is_some() {
                parked.extend(self.lose_keeping_files(&mut inner, number, None, why));
            } else {
                entry.lose_at_end = Some(why.to_owned());
            }
        }
        drop(inner);
        drop(parked);
        named
    }

    /// How many times a golden image was found changed while served.
    pub fn golden_image_changes(&self) -> u64 {
        self.golden_image_changes.load(Ordering::Relaxed)
    }

    /// The image store the exports serve (`serve --images`).
    pub fn set_image_store(&self, store: crate::images::ImageStore) {
        let _ = self.image_store.set(store);
    }

    /// Golden images' digests are kept by `digests` from now on (a server with peers).
    pub fn use_image_digests(&self, digests: std::sync::Arc<crate::image_digest::ImageDigests>) {
        let _ = self.image_digests.set(digests);
    }

    pub fn image_digests(&self) -> Option<&std::sync::Arc<crate::image_digest::ImageDigests>> {
        self.image_digests.get()
    }

    pub fn image_store(&self) -> Option<&crate::images::ImageStore> {
        self.image_store.get()
    }

    /// Names the test group of image stages (`serve --test-vms`, `vm test-group`): VM name
    /// patterns, or `group:NAME` for the VMs of a named group (`serve --group`).
    pub fn set_test_vms(&self, patterns: Vec<String>) {
        self.test_vms.set(patterns);
    }

    pub fn test_vms(&self) -> Vec<String> {
        self.test_vms.patterns()
    }

    /// Whether VM `vm` is in the test group: a new overlay of it gets an image's test version.
    pub fn in_test_group(&self, vm: &str) -> bool {
        let group = self.limits.named_group_of(vm);
        self.test_vms.patterns().iter().any(|pattern| match pattern.strip_prefix("group:") {
            Some(name) => group.as_deref() == Some(name),
            None => crate::multi_conn::glob_matches(pattern.as_bytes(), vm.as_bytes()),
        })
    }

    /// Captures VM `vm` as the next version of its image in `store`: returns the image's name
    /// and the new version's.
    pub fn capture(&self, vm: &str, store: &ImageStore) -> Result<(String, String), String> {
        let (number, label, live) = self.source_vm(vm, "capture")?;
        let (image, below) = split_label(&label);
        if below.starts_with('@') {
            return Err(format!(
                "VM {vm} runs over checkpoint {label} (a fork): a version is captured from a VM over a version"
            ));
        }
        // The VM's lock is held from the read of its overlay to its end: no request of it is
        // served in between (none acknowledged that the layer would lack).
        let mut guard = live.vm();
        let held = still(vm, &mut guard)?;
        let version = store
            .publish_layer(image, below, |path, backing, format| {
                write_overlay(&mut held.overlay, path, backing, format)
            })
            .map_err(|e| e.to_string())?;
        // Its connection closes at its next request (the slot is empty); its entry, ledger and
        // state files go now, by number (the VM's lock first, then the registry's, as a move).
        let overlay = guard.take();
        // Before the VM's lock goes: a reconnect in between would start a fresh overlay over
        // the maintained version, as the maintenance VM still.
        if let Err(error) = store.end_maintenance(image, Some(vm)) {
            tracing::warn!(vm, image, %error, "the maintenance stage could not be ended: end it with `overspill image maintain --none`");
        }
        let ended = {
            let mut inner = lock(&self.inner);
            if let Some(entry) = inner.vms.get(&number) {
                entry.reset.store(true, Ordering::SeqCst);
            }
            self.forget(&mut inner, number, overlay)
        };
        drop(guard);
        drop(ended);
        tracing::info!(vm, image, version, below = label, "VM captured as a new image version; its overlay ends");
        Ok((image.to_owned(), version))
    }

    /// Writes VM `vm`'s disk as it is now as checkpoint `checkpoint` of its image in `store`:
    /// a layer of what it changed over what it runs over (a version, or a fork's checkpoint).
    /// The VM is held still while it is read (its requests wait) and goes on after it, its
    /// overlay untouched. Returns the checkpoint's label, `IMAGE:@CHECKPOINT`.
    pub fn checkpoint(&self, vm: &str, checkpoint: &str, store: &ImageStore) -> Result<String, String> {
        let (_, label, live) = self.source_vm(vm, "checkpoint")?;
        let (image, below) = split_label(&label);
        let mut guard = live.vm();
        let held = still(vm, &mut guard)?;
        store
            .write_checkpoint(image, below, checkpoint, |path, backing, format| {
                write_overlay(&mut held.overlay, path, backing, format)
            })
            .map_err(|e| e.to_string())?;
        drop(guard);
        tracing::info!(vm, image, checkpoint, below = label, "VM checkpointed; it goes on");
        Ok(format!("{image}:@{checkpoint}"))
    }

    /// Makes `names` forks of checkpoint `label` (`IMAGE:@CHECKPOINT`, in `store`), all or none:
    /// each starts from the checkpoint at its first connection, nothing copied.
    pub fn fork(&self, label: &str, names: &[String], store: &ImageStore) -> Result<(), String> {
        let (image, checkpoint) = split_label(label);
        if !checkpoint.starts_with('@') {
            return Err(format!("{label} is no checkpoint (IMAGE:@NAME)"));
        }
        store.version(image, checkpoint).map_err(|e| e.to_string())?;
        let mut inner = lock(&self.inner);
        self.check_fork_names(&inner, names)?;
        let pin = crate::forks::Fork { image: image.to_owned(), checkpoint: checkpoint.to_owned(), dropped: false };
        inner
            .forks
            .add(names.iter().map(|name| (name.clone(), pin.clone())).collect())
            .map_err(|e| format!("recording the forks: {e}"))?;
        drop(inner);
        tracing::info!(checkpoint = label, forks = %names.join(","), "forks made");
        Ok(())
    }

    /// Why `names` cannot be made forks now, if they cannot (see [`Self::check_fork_names`]):
    /// asked before a VM is checkpointed to fork it.
    pub fn may_fork(&self, names: &[String]) -> Result<(), String> {
        self.check_fork_names(&lock(&self.inner), names)
    }

    /// Each name valid, given once and free (no VM here, lost, in the ledger, or a fork, dropped
    /// or not), and a state directory to record forks in.
    fn check_fork_names(&self, inner: &Registered, names: &[String]) -> Result<(), String> {
        if names.is_empty() {
            return Err("name the forks (--as A,B,…)".to_owned());
        }
        if !inner.forks.can_record() {
            return Err("this server has no state directory (--state-dir) to record forks in".to_owned());
        }
        let mut seen = std::collections::HashSet::new();
        for name in names {
            crate::check_name("VM", name).map_err(|e| e.to_string())?;
            if !seen.insert(name) {
                return Err(format!("{name} is named twice"));
            }
            match inner.forks.get(name) {
                Some(fork) if fork.dropped => {
                    return Err(format!("{name} is a dropped fork: `overspill vm reset {name}` frees the name first"))
                }
                Some(fork) => return Err(format!("{name} is a fork of {}:{} already", fork.image, fork.checkpoint)),
                None => {}
            }
            let in_ledger = self.ledger.as_ref().is_some_and(|ledger| ledger.path(name).exists());
            if inner.names.contains_key(name) || inner.lost.contains_key(name) || in_ledger {
                return Err(format!("VM {name} exists already (`overspill vm list`): a fork takes a new name"));
            }
        }
        Ok(())
    }

    /// The number, label and live overlay of VM `vm`, connected and still enough to read:
    /// what `capture` and `checkpoint` read (`what` says which, for messages).
    fn source_vm(&self, vm: &str, what: &str) -> Result<(u64, String, std::sync::Arc<crate::live::Live>), String> {
        let inner = lock(&self.inner);
        let number = *inner.names.get(vm).ok_or_else(|| format!("this server holds no VM {vm}"))?;
        let entry = inner.vms.get(&number).expect("names point at entries");
        if entry.moving.is_some() || entry.reset.load(Ordering::SeqCst) {
            return Err(format!("VM {vm} is moving, or being reset: try again"));
        }
        if entry.extra_connections > 0 {
            return Err(format!("VM {vm} has several connections (multi-conn): leave it one"));
        }
        if entry.grace.is_some() {
            return Err(format!(
                "VM {vm} is not connected: {what} it while its QEMU is (halt or pause the guest, keep QEMU running)"
            ));
        }
        let label = entry.handle.export.clone();
        if !label.contains(':') {
            return Err(format!(
                "VM {vm} runs over {}, not an image of the store (--images): nothing to layer over",
                super::shown_image(&label)
            ));
        }
        let live = entry.live.as_ref().and_then(Weak::upgrade).ok_or_else(|| format!("VM {vm} is connecting"))?;
        Ok((number, label, live))
    }
}

/// An image label's image and version (`IMAGE:VERSION`, the version `@NAME` for a checkpoint).
fn split_label(label: &str) -> (&str, &str) {
    label.split_once(':').unwrap_or((label, ""))
}

/// The VM's overlay under its lock, unless its connection is ending or it is being moved.
fn still<'a>(vm: &str, guard: &'a mut Option<VmOverlay>) -> Result<&'a mut VmOverlay, String> {
    let Some(held) = guard.as_mut() else { return Err(format!("VM {vm}'s connection is ending: try again")) };
    if held.overlay.is_moving() {
        return Err(format!("VM {vm} is moving to a peer: try again once the move is done or given up"));
    }
    Ok(held)
}
