//! The registry's part in golden images: VMs lost when their image changes under them, the
//! image store VMs are served from, the test group of image stages (which VMs boot a test
//! version), and capturing a VM's overlay as the next version of its image (`overspill vm
//! capture`): what the VM changed over the version it booted, written by the image store as a
//! layer over that version. The VM stays still while it is read (its lock held; a connected
//! guest's requests wait), and its overlay ends with the capture: a connected VM's connection
//! closes at its next request, as after `vm reset`, and its next boot gets whatever version its
//! stage names.

use std::sync::atomic::Ordering;
use std::sync::Weak;

use overspill_engine::MovedRun;
use overspill_images::qcow2_layer::LayerWriter;

use super::{lock, VmRegistry};
use crate::images::ImageStore;

/// Data blocks read at a time: the writer is handed 16 MiB at most at once.
const BLOCKS_PER_TAKE: u64 = 4096;

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
        let (number, label, live) = {
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
                    "VM {vm} is not connected: capture it while its QEMU is (halt the guest, keep QEMU running)"
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
            (number, label, live)
        };
        let (image, below) = label.split_once(':').map(|(i, v)| (i.to_owned(), v.to_owned())).unwrap_or_default();
        // The VM's lock is held from the read of its overlay to its end: no request of it is
        // served in between (none acknowledged that the layer would lack).
        let mut guard = live.vm();
        let Some(held) = guard.as_mut() else { return Err(format!("VM {vm}'s connection is ending: try again")) };
        if held.overlay.is_moving() {
            return Err(format!("VM {vm} is moving to a peer: try again once the move is done or given up"));
        }
        let version = write_layer(store, &image, &below, &mut held.overlay)?;
        // Its connection closes at its next request (the slot is empty); its entry, ledger and
        // state files go now, by number (the VM's lock first, then the registry's, as a move).
        let overlay = guard.take();
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
        Ok((image, version))
    }
}

/// Writes what `overlay` changed over version `below` of `image` as the image's next version.
fn write_layer(
    store: &ImageStore,
    image: &str,
    below: &str,
    overlay: &mut overspill_engine::Overlay,
) -> Result<String, String> {
    let size = overlay.size();
    let written = store.publish_layer(image, below, |path, backing, format| {
        let mut writer = LayerWriter::create(path, size, backing, format)?;
        overlay.start_moving();
        let copied = (|| -> std::io::Result<()> {
            loop {
                let runs = overlay.take_moved(BLOCKS_PER_TAKE).map_err(std::io::Error::other)?;
                if runs.is_empty() {
                    return Ok(());
                }
                for run in runs {
                    match run {
                        MovedRun::Data { first, data } => writer.data(first, &data)?,
                        MovedRun::Zero { first, end } => writer.zeroes(first, end)?,
                        // Reads the version below: nothing of the VM's.
                        MovedRun::Golden { .. } => {}
                    }
                }
            }
        })();
        overlay.stop_moving();
        copied?;
        writer.finish()
    });
    written.map_err(|e| e.to_string())
}
