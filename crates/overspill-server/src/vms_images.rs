//! The registry's part in golden images: VMs lost when their image changes under them, the
//! image store VMs are served from, the test group of image stages (which VMs boot a test
//! version), and capturing a VM's overlay as the next version of its image (`overspill vm
//! capture`): what the VM changed over the version it booted, written by the image store as a
//! layer over that version. The VM stays still while it is read (its lock held; a connected
//! guest's requests wait), and its overlay ends with the capture: a connected VM's connection
//! closes at its next request, as after `vm reset`, and its next boot gets whatever version its
//! stage names.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use overspill_engine::MovedRun;
use overspill_images::qcow2_layer::LayerWriter;

use super::{lock, Grace, VmRegistry};
use crate::images::ImageStore;
use crate::live::Live;

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
        enum Held {
            Parked(Box<Grace>),
            Connected(Arc<Live>),
        }
        let (number, label, held) = {
            let mut inner = lock(&self.inner);
            let number = *inner.names.get(vm).ok_or_else(|| format!("this server holds no VM {vm}"))?;
            let entry = inner.vms.get_mut(&number).expect("names point at entries");
            if entry.moving.is_some() || entry.reset.load(Ordering::SeqCst) {
                return Err(format!("VM {vm} is moving, or being reset: try again"));
            }
            if entry.extra_connections > 0 {
                return Err(format!("VM {vm} has several connections (multi-conn): leave it one"));
            }
            let label = entry.handle.export.clone();
            let Some((_, _)) = label.split_once(':') else {
                return Err(format!(
                    "VM {vm} runs over {}, not an image of the store (--images): nothing to layer over",
                    super::shown_image(&label)
                ));
            };
            let held = match entry.grace.take() {
                Some(grace) => Held::Parked(Box::new(grace)),
                None => Held::Connected(
                    entry.live.as_ref().and_then(Weak::upgrade).ok_or_else(|| format!("VM {vm} is connecting"))?,
                ),
            };
            (number, label, held)
        };
        let (image, below) = label.split_once(':').map(|(i, v)| (i.to_owned(), v.to_owned())).unwrap_or_default();
        match held {
            Held::Parked(mut grace) => {
                let captured = write_layer(store, &image, &below, &mut grace.parked.overlay);
                let mut inner = lock(&self.inner);
                if captured.is_ok() {
                    let parked = self.forget(&mut inner, number, Some(grace.parked));
                    drop(inner);
                    drop(parked);
                } else if let Some(entry) = inner.vms.get_mut(&number) {
                    // The VM goes on waiting for its client, as it was.
                    entry.grace = Some(*grace);
                }
                self.captured(vm, &image, &label, captured)
            }
            Held::Connected(live) => {
                let captured = match live.vm().as_mut() {
                    Some(overlay) => write_layer(store, &image, &below, &mut overlay.overlay),
                    None => Err(format!("VM {vm}'s connection is ending: try again")),
                };
                if captured.is_ok() {
                    // Its connection closes at its next request; its overlay ends with it.
                    let _ = self.reset(vm);
                }
                self.captured(vm, &image, &label, captured)
            }
        }
    }

    fn captured(
        &self,
        vm: &str,
        image: &str,
        below: &str,
        captured: Result<String, String>,
    ) -> Result<(String, String), String> {
        let version = captured?;
        tracing::info!(vm, image, version, below, "VM captured as a new image version; its overlay ends");
        Ok((image.to_owned(), version))
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
