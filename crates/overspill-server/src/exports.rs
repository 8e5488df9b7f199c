//! Wiring: each connection gets a fresh engine overlay over the golden image it asked for.
//!
//! An export name is `IMAGE` or `IMAGE@VM`: the part after `@` names the VM, whose overlay then
//! outlives a lost connection for the reconnect grace (see `vms`) and the process (`ledger`);
//! without it the server numbers connections and each overlay ends with its connection. The empty name is the `--base` image.
//! Anonymous VMs' cache files are named `overspill-<server pid>-<vm number>-<host>.<kind>` so that
//! a restarted server can tell the files of this host's dead servers (removed at start) from those
//! of live ones and other hosts' (left alone); a named VM's are named after it and outlive the
//! process (see `ledger`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use overspill_block::{
    BlockDevice, Capabilities, DeviceError, DeviceErrorKind, ExportInfo, ExportProvider, DEFAULT_BLOCK_SIZES,
};
use overspill_engine::arena::Arena;
use overspill_engine::read_cache::DEFAULT_CHUNK_BYTES;
use overspill_engine::state::StateFiles;
use overspill_engine::{
    BackingFile, BackingKind, CachedImage, EngineError, GoldenImage, HostMemory, Overlay, OverlayConfig, ScratchFile,
    SegmentWriters, SpaceShortages, VmStats, WriteCacheMode, SEGMENT_BYTES,
};

use crate::device::Connection;
use crate::error::device_error;
use crate::golden_budget::Budgeted;
use crate::images::{ImageStore, OpenVersions, ReadCacheList, Stage, Version};
use crate::ledger::{state_file_paths, state_file_stem, Recoverable, StateRecord};
use crate::live::Live;
use crate::migration::{self, Located, Peers};
use crate::vm_limits::HostBudget;
use crate::vm_overlay::VmOverlay;
use crate::vms::{anonymous_label, shown_image, Claim, Lifecycle, VmRegistry};
use crate::{check_name, ServerError};
use overspill_block::limit::GiveUp;
use overspill_block::Recorder;

#[path = "exports_moves.rs"]
mod moves;

/// Where and how every VM's write cache is kept.
/// Spill segments written in the background at once by default, host-wide.
pub const DEFAULT_SPILL_WRITERS: usize = 4;

#[derive(Debug, Clone)]
pub struct CacheSettings {
    pub mode: WriteCacheMode,
    pub ram_target_bytes: u64,
    pub spill_max_bytes: Option<u64>,
    /// Spill segments bypass the page cache (`O_DIRECT`).
    pub spill_direct: bool,
    /// Spill segments written in the background at once, host-wide; 0 writes them in line.
    pub spill_writers: usize,
    pub spill_dir: PathBuf,
    pub shared_dir: PathBuf,
    /// Shared read cache per golden image, in bytes; 0 reads the images directly.
    pub read_cache_bytes: u64,
}

impl CacheSettings {
    /// The directory this mode writes its VMs' cache files in, with the flag that names it:
    /// the spill directory for `ram+disk` and `disk`, the shared one for `shared`, none for `ram`.
    pub fn cache_dir(&self) -> Option<(&'static str, &PathBuf)> {
        self.mode.backing_file().map(|kind| match kind {
            BackingKind::SpillLog | BackingKind::LocalCache => ("--spill-dir", &self.spill_dir),
            BackingKind::SharedDifferencing => ("--shared-dir", &self.shared_dir),
        })
    }
}

pub struct OverlayExports {
    images: BTreeMap<String, Arc<dyn GoldenImage>>,
    versions: Option<OpenVersions>,
    read_caches: Arc<ReadCacheList>,
    settings: CacheSettings,
    host: Arc<HostMemory>,
    registry: Arc<VmRegistry>,
    lifecycle: Lifecycle,
    record_dir: Option<PathBuf>,
    /// Shared by every VM's spill file: how many segments are written in the background at once.
    segment_writers: Arc<SegmentWriters>,
    /// Shared by every VM's files: a full filesystem heard of by one makes the others' spill
    /// logs give back the dead segments they keep for reuse.
    space_shortages: Arc<SpaceShortages>,
    /// Labels of golden images found changed while served, each reported once.
    changed_images: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Connections without a VM name may write (to an overlay that ends with the connection).
    /// Off by default: a reconnect, however short, would silently hand such a guest the golden
    /// image back, so they are served read-only.
    anonymous_writes: bool,
    /// Servers a named VM may be running on when it connects here (live migration).
    peers: Option<Peers>,
}

// Everything, and cheaply: the cache lives as long as the VM's connection by design, so an
// acknowledged write is as durable as it will ever be (FUA and FLUSH cost nothing), and zeroing
// stores no data (it is never slower than writing, so FAST_ZERO always holds).
const CAPABILITIES: Capabilities = Capabilities::ALL;

/// A connection without a VM name, unless anonymous writes are allowed: it reads the image
/// through the overlay machinery (and the read cache) and can change nothing.
const ANONYMOUS_CAPABILITIES: Capabilities =
    Capabilities { read_only: true, can_trim: false, can_zero: false, can_fast_zero: false, ..Capabilities::ALL };

/// What an anonymous connection is told (export description) and the log says, when it is
/// served read-only.
pub const ANONYMOUS_READ_ONLY: &str = "read-only: no VM is named, and writes of an unnamed VM would be lost at its \
     next reconnect; name the VM to write (export IMAGE@NAME, e.g. nbd+unix:///@vm-17?socket=PATH)";

impl OverlayExports {
    pub fn new(
        images: BTreeMap<String, Arc<dyn GoldenImage>>,
        settings: CacheSettings,
        host: Arc<HostMemory>,
    ) -> Result<Self, ServerError> {
        // Checked now, so that a directory that cannot be written stops the start with its name
        // rather than refuse every VM later.
        if let Some((flag, dir)) = settings.cache_dir() {
            writable_directory(dir).map_err(|e| ServerError::io(format!("{flag} {}", dir.display()), e))?;
        }
        // (Later calls would race the creation of this program's own files, between their
        // making and their holding.)
        static FIRST_IN_THIS_PROGRAM: AtomicBool = AtomicBool::new(true);
        let first_in_program = FIRST_IN_THIS_PROGRAM.swap(false, Ordering::Relaxed);
        for dir in [&settings.spill_dir, &settings.shared_dir] {
            if dir.is_dir() {
                remove_stale_cache_files(dir, first_in_program);
            }
        }
        let read_caches = Arc::new(ReadCacheList::default());
        let images = if settings.read_cache_bytes == 0 {
            images
        } else {
            images
                .into_iter()
                .map(|(name, image)| {
                    let chunk_bytes = image.preferred_fetch_bytes().unwrap_or(DEFAULT_CHUNK_BYTES);
                    let source = image.describe();
                    let cached =
                        Arc::new(CachedImage::new(image, settings.read_cache_bytes, chunk_bytes).within(host.clone()));
                    read_caches.add(name.clone(), source, &cached);
                    (name, cached as Arc<dyn GoldenImage>)
                })
                .collect()
        };
        let segment_writers = SegmentWriters::new(settings.spill_writers);
        let registry = VmRegistry::new(Lifecycle::default()).map_err(|e| ServerError::io("VM registry", e))?;
        if spills_through_writers(&settings) {
            registry.limits().use_spill_budget(segment_writers.budget().clone());
        }
        Ok(Self {
            images,
            versions: None,
            read_caches,
            settings,
            host,
            registry,
            lifecycle: Lifecycle::default(),
            record_dir: None,
            segment_writers,
            space_shortages: SpaceShortages::new(),
            changed_images: Default::default(),
            anonymous_writes: false,
            peers: None,
        })
    }

    /// Settles the VMs recovered in doubt (see `ledger`'s `incoming`) by asking the peer each
    /// was moving from: kept, dropped, or refused by name when it cannot tell. Call after
    /// [`Self::with_lifecycle`] and [`Self::with_peers`], before serving.
    pub fn settle_in_doubt(&self) {
        for (vm, peer) in self.registry.in_doubt() {
            let address = migration::recorded_address(&peer);
            let outcome = migration::settle_in_doubt(self.peers.as_ref(), &address, &vm);
            let ours = outcome == Ok(true);
            self.registry.settle_in_doubt(&vm, outcome);
            if let (true, Some(peers)) = (ours, &self.peers) {
                migration::tell_settled(peers, &address, &vm);
            }
        }
    }

    /// Lets connections without a VM name write, each to a private overlay that ends with the
    /// connection (any reconnect reverts it to the golden image): for tests and benchmarks.
    pub fn allow_anonymous_writes(&mut self) {
        self.anonymous_writes = true;
    }

    /// Whether a connection to export `name` is served read-only: it names no VM and anonymous
    /// writes are off.
    fn read_only(&self, name: &str) -> bool {
        !name.contains('@') && !self.anonymous_writes
    }

    /// What a connection to export `name` may do: a VM whose name `--multi-conn` allows is
    /// offered several connections at once, one overlay under them.
    fn capabilities(&self, name: &str) -> Capabilities {
        if self.read_only(name) {
            return ANONYMOUS_CAPABILITIES;
        }
        let multi_conn = name.split_once('@').is_some_and(|(_, vm)| self.registry.multi_conn_allowed(vm));
        Capabilities { can_multi_conn: multi_conn, ..CAPABILITIES }
    }

    /// Keeps named VMs' overlays over lost connections, and their ledger, as `lifecycle` says;
    /// rebuilds the overlays an earlier server left state for, each in grace until its VM
    /// reconnects. Call before serving (and after `with_image_store`): VMs registered before
    /// are forgotten.
    pub fn with_lifecycle(&mut self, lifecycle: Lifecycle) -> std::io::Result<()> {
        if let Some(dir) = lifecycle.memory_dir.as_ref().filter(|_| lifecycle.persistent()) {
            crate::files::own_directory(dir)
                .map_err(|e| std::io::Error::new(e.kind(), format!("memory directory {}: {e}", dir.display())))?;
            std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        }
        self.registry = VmRegistry::new(lifecycle.clone())?;
        if let Some(versions) = &self.versions {
            self.registry.set_image_store(versions.store().clone());
        }
        if spills_through_writers(&self.settings) {
            self.registry.limits().use_spill_budget(self.segment_writers.budget().clone());
        }
        if let Some(memory_dir) = lifecycle.memory_dir.clone().filter(|_| lifecycle.persistent()) {
            self.registry.set_state_places(StateRecord {
                image_label: String::new(),
                image_identity: None,
                mode: self.settings.mode.to_string(),
                disk_bytes: 0,
                memory_dir,
                spill_dir: self.state_file_dir(),
            });
        }
        self.lifecycle = lifecycle;
        for recoverable in self.registry.take_recoverable() {
            let started = Instant::now();
            match self.recover(&recoverable) {
                Ok(()) => tracing::info!(
                    vm = recoverable.vm,
                    image = recoverable.state.image_label,
                    ms = started.elapsed().as_millis() as u64,
                    "VM overlay recovered from the previous server: waiting for its client"
                ),
                Err(why) => self.registry.refuse_unrecoverable(&recoverable, why),
            }
        }
        Ok(())
    }

    /// Rebuilds, before its client is admitted, a VM that a server holding it when this one
    /// started has left since (see [`VmRegistry::take_orphan`]). One at a time: two connections
    /// for the name must not both rebuild it.
    fn adopt_orphan(&self, vm: &str) {
        let _one_at_a_time = self.registry.orphans();
        let Some(orphan) = self.registry.take_orphan(vm) else { return };
        match self.recover(&orphan) {
            Ok(()) => tracing::info!(vm, "VM overlay left by a server gone since this one started: adopted"),
            Err(why) => self.registry.refuse_unrecoverable(&orphan, why),
        }
        if orphan.incoming.is_some() {
            self.settle_in_doubt();
        }
    }

    /// Rebuilds a VM's overlay from the state an earlier server left.
    fn recover(&self, recoverable: &Recoverable) -> Result<(), String> {
        let state = &recoverable.state;
        let (label, image) = self.image_made_over(&recoverable.image, &state.image_label)?;
        let shown = crate::vms::shown_image(&label);
        // A record without an identity comes from a server that did not keep one: nothing to
        // compare, as before.
        if state.image_identity.as_deref().is_some_and(|recorded| !image.matches_identity(recorded)) {
            return Err(format!(
                "{shown} is no longer the image its writes were made over (then: {}, now: {})",
                state.image_identity.as_deref().unwrap_or("unknown"),
                image.identity().as_deref().unwrap_or("unknown")
            ));
        }
        if image.size() != state.disk_bytes {
            return Err(format!("its disk had {} bytes, {shown} has {}", state.disk_bytes, image.size()));
        }
        if state.mode != self.settings.mode.to_string() {
            return Err(format!("it was made in mode {}, this server runs mode {}", state.mode, self.settings.mode));
        }
        let stem = state_file_stem(&recoverable.vm);
        let open = |dir: &Path, suffix: &str| -> Result<Box<ScratchFile>, String> {
            // Held, as the files of a VM that outlives the process are (see persistent_overlay).
            ScratchFile::open(dir, &format!("{stem}.{suffix}"))
                .and_then(ScratchFile::held)
                .map(Box::new)
                .map_err(|e| format!("{}/{stem}.{suffix}: {e}", dir.display()))
        };
        let files =
            StateFiles { segments: open(&state.memory_dir, "segments")?, zeros: open(&state.memory_dir, "zeros")? };
        let (backing, segments): (Option<Box<dyn BackingFile>>, u32) = match (&state.spill_dir, self.settings.mode) {
            (Some(dir), WriteCacheMode::RamDisk) => {
                let spill = open(dir, "spill")?;
                let bytes = spill.logical_size().map_err(|e| e.to_string())?;
                (Some(self.spill_backing(*spill)), u32::try_from(bytes / SEGMENT_BYTES as u64).unwrap_or(u32::MAX))
            }
            (Some(dir), mode) => {
                let kind = mode.backing_file().ok_or("a state record with a file for mode ram")?;
                let file = open(dir, backing_suffix(kind))?;
                let size = file.logical_size().map_err(|e| e.to_string())?;
                if size < state.disk_bytes {
                    return Err(format!("its cache file has {size} bytes, its disk {}", state.disk_bytes));
                }
                (Some(Box::new(file.with_space_shortages(self.space_shortages.clone()))), 0)
            }
            (None, _) => (None, 0),
        };
        let config = self.overlay_config();
        let arena = Arena::open(&state.memory_dir, &stem, Overlay::arena_pages(&config)).map_err(|e| e.to_string())?;
        arena.0.hold().map_err(|e| e.to_string())?;
        let stats = Arc::new(VmStats::default());
        let image = self.budgeted(image, Some(recoverable.vm.clone()));
        let overlay =
            Overlay::recover(image, config, backing, self.host.clone(), stats.clone(), arena, files, segments)
                .map_err(|e| e.to_string())?;
        let parked = VmOverlay { overlay, vm: recoverable.vm.clone(), recorder: None, handed_over: false };
        self.registry.adopt_recovered(recoverable, &label, stats, parked);
        Ok(())
    }

    /// The golden image a recovered VM's writes were made over: the export's image, or for a
    /// versioned image the very version it had (which need not be current any more).
    fn image_made_over(&self, export: &str, label: &str) -> Result<(String, Arc<dyn GoldenImage>), String> {
        let image_name = Self::image_name(export);
        if let Some(image) = self.images.get(image_name) {
            if label != image_name {
                let (was, now) = (crate::vms::shown_image(label), crate::vms::shown_image(image_name));
                return Err(format!("it was made over {was}, and {now} is served now"));
            }
            return Ok((label.to_owned(), image.clone()));
        }
        let version = label
            .strip_prefix(image_name)
            .and_then(|rest| rest.strip_prefix(':'))
            .ok_or_else(|| format!("it was made over {label}, which export {export:?} does not serve"))?;
        let versions = self.versions.as_ref().ok_or_else(|| format!("{label}: this server has no image store"))?;
        let (version, image) = versions.version(image_name, version).map_err(|e| e.to_string())?;
        self.digest_in_background(&image);
        Ok((format!("{image_name}:{version}"), image))
    }

    fn overlay_config(&self) -> OverlayConfig {
        OverlayConfig {
            mode: self.settings.mode,
            ram_target_bytes: self.settings.ram_target_bytes,
            spill_max_bytes: self.settings.spill_max_bytes,
        }
    }

    /// Records every VM's requests to `dir/<vm>-<n>.trace` (see `overspill_block::trace`).
    pub fn record_to(&mut self, dir: PathBuf) -> std::io::Result<()> {
        std::fs::create_dir_all(&dir)?;
        self.record_dir = Some(dir);
        Ok(())
    }

    /// Each golden image's shared read cache, by export name.
    pub fn read_caches(&self) -> Arc<ReadCacheList> {
        self.read_caches.clone()
    }

    /// The stage whose version a new connection to export `name` gets: test for a VM of the
    /// registry's test group (see `images`).
    fn stage_of(&self, name: &str) -> Stage {
        match name.split_once('@') {
            Some((_, vm)) if self.registry.in_test_group(vm) => Stage::Test,
            _ => Stage::Production,
        }
    }

    /// Also serves the images of a versioned store: each connection gets the version of its
    /// VM's stage (production, or test for the test group) and keeps it until its overlay ends.
    pub fn with_image_store(&mut self, dir: &Path) {
        // Absolute: the control socket tells it to commands run from elsewhere.
        let store = ImageStore::new(&std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned()));
        self.registry.set_image_store(store.clone());
        self.versions =
            Some(OpenVersions::new(store, self.settings.read_cache_bytes, self.read_caches.clone(), self.host.clone()));
    }

    /// Checks each golden image VMs are served over (files: their size and modification time,
    /// from the open file) and ends the VMs over one that changed: they would read a mix of old
    /// and new bytes (reads of it are refused from the change on; see
    /// [`GoldenImage::unchanged`]). Called once a second by the server.
    pub fn watch_images(&self) {
        let mut images: Vec<(String, Arc<dyn GoldenImage>)> =
            self.images.iter().map(|(name, image)| (name.clone(), image.clone())).collect();
        images.extend(self.versions.iter().flat_map(OpenVersions::held_now));
        for (label, image) in images {
            let Err(error) = image.unchanged() else { continue };
            if !self.changed_images.lock().unwrap_or_else(|p| p.into_inner()).insert(label.clone()) {
                continue;
            }
            let why = format!("its golden image {} changed while it ran ({error})", shown_image(&label));
            let vms = self.registry.golden_image_changed(&label, &why);
            tracing::error!(
                image = %shown_image(&label),
                %error,
                vms = %vms.join(","),
                "golden image changed while served: the VMs over it are lost (refused until `overspill vm reset`), \
                 new VMs are refused until the server restarts with the image as it is now (`systemctl reload`)"
            );
        }
    }

    pub fn registry(&self) -> Arc<VmRegistry> {
        self.registry.clone()
    }

    pub fn host(&self) -> &Arc<HostMemory> {
        &self.host
    }

    fn image_name(name: &str) -> &str {
        name.split_once('@').map_or(name, |(image, _)| image)
    }

    /// The golden image an export name opens now, with the label it goes by in logs and metrics
    /// (`name:version` for a versioned image).
    fn image(&self, name: &str) -> Result<(String, Arc<dyn GoldenImage>), DeviceError> {
        let image_name = Self::image_name(name);
        let fork = self.fork_of(name);
        if let Some(image) = self.images.get(image_name) {
            if let Some(fork) = fork {
                return Err(Self::fork_refused(name, &fork, "an export of that name shadows the image store's"));
            }
            return Ok((image_name.to_owned(), image.clone()));
        }
        let versions =
            self.versions.as_ref().ok_or_else(|| DeviceError::new(DeviceErrorKind::Invalid, "no such export"))?;
        if let (None, Some((_, vm))) = (&fork, name.split_once('@')) {
            if let Some(gone) = versions.store().maintenance(image_name).filter(|m| m.vm == vm && m.begun) {
                // A new overlay here would be the version alone: the maintenance work, silently gone.
                let message = format!(
                    "VM {vm} is image {image_name}'s maintenance VM and its overlay over {0} is gone (held in the \
                     memory of a server or host that ended): `overspill image maintain {image_name} {vm} {0}` begins \
                     it again from {0}, `overspill image maintain {image_name} --none` ends the stage",
                    gone.version
                );
                tracing::error!(vm, image = image_name, "VM refused: {message}");
                return Err(DeviceError::new(DeviceErrorKind::Refused, message));
            }
        }
        let opened = self.version_for(versions, name).and_then(|version| versions.open(image_name, version));
        let (version, image) = opened.map_err(|e| match &fork {
            // Never the image's version in its place: that would revert the fork.
            Some(fork) => Self::fork_refused(name, fork, &e.to_string()),
            None => DeviceError::new(DeviceErrorKind::Invalid, e.to_string()),
        })?;
        self.digest_in_background(&image);
        Ok((format!("{image_name}:{version}"), image))
    }

    /// The pin of the VM export `name` names, if it is a fork of that image.
    fn fork_of(&self, name: &str) -> Option<crate::forks::Fork> {
        let (image_name, vm) = name.split_once('@')?;
        self.registry.fork_of(vm).filter(|fork| fork.image == image_name)
    }

    fn fork_refused(name: &str, fork: &crate::forks::Fork, why: &str) -> DeviceError {
        let vm = name.split_once('@').map_or(name, |(_, vm)| vm);
        let message =
            format!("VM {vm} is a fork of {}:{} and cannot start from it: {why}", fork.image, fork.checkpoint);
        tracing::warn!(vm, "VM refused: {message}");
        DeviceError::new(DeviceErrorKind::Refused, message)
    }

    /// Marks the image's maintenance stage begun when VM `number` (of export `name`) is its
    /// maintenance VM over the marker's version (a new overlay, or one resumed: a VM made the
    /// maintenance VM while it had an overlay).
    fn note_maintenance_begun(&self, name: &str, number: u64) {
        let (Some(versions), Some((image, vm))) = (&self.versions, name.split_once('@')) else { return };
        if self.images.contains_key(image) || self.fork_of(name).is_some() || !self.registry.maintained(number) {
            return;
        }
        match versions.store().begin_maintenance(image, vm) {
            Ok(true) => tracing::info!(vm, image, "maintenance VM's overlay begun: a start without it is refused"),
            Ok(false) => {}
            Err(error) => tracing::warn!(vm, image, %error, "could not mark the maintenance VM's overlay as begun"),
        }
    }

    /// The version of the store a new overlay for export `name` gets: the maintenance VM's
    /// version (see `image maintain`), a fork's checkpoint (see `vm fork`), else its stage's.
    fn version_for(&self, versions: &OpenVersions, name: &str) -> Result<Version, crate::ServerError> {
        let image_name = Self::image_name(name);
        // A fork's pin first: a maintenance marker naming a fork does not move it.
        if let Some(fork) = self.fork_of(name) {
            return versions.store().version(image_name, &fork.checkpoint);
        }
        if let Some((_, vm)) = name.split_once('@') {
            if let Some(maintenance) = versions.store().maintenance(image_name).filter(|m| m.vm == vm) {
                return versions.store().version(image_name, &maintenance.version);
            }
        }
        versions.store().staged(image_name, self.stage_of(name))
    }

    fn backing(&self, kind: BackingKind, size: u64) -> std::io::Result<Box<dyn BackingFile>> {
        // Numbered per process, not per provider: a storm's configurations each have their own
        // provider on one spill directory, and a departing VM's file may outlive the next start
        // by the time its last segment write takes.
        static NEXT_FILE: AtomicU64 = AtomicU64::new(1);
        let (dir, logical) = self.backing_place(kind, size);
        // Held while open, so that a server sharing the directory (in another PID namespace,
        // where our pid means nothing) leaves it alone. A name still taken was left by this
        // process before a restart in place (same pid, the count begun again) and not yet
        // removed: the next number does.
        let file = loop {
            let number = NEXT_FILE.fetch_add(1, Ordering::Relaxed);
            let name = overspill_engine::store::scratch_file_name(&number.to_string(), backing_suffix(kind));
            match ScratchFile::create(dir, &name, logical) {
                Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => continue,
                created => break created?.held()?,
            }
        };
        Ok(match kind {
            BackingKind::SpillLog => self.spill_backing(file),
            BackingKind::LocalCache | BackingKind::SharedDifferencing => {
                Box::new(file.with_space_shortages(self.space_shortages.clone()))
            }
        })
    }

    /// The directory of a named VM's spill or in-place cache file in this mode (none in `ram`).
    fn state_file_dir(&self) -> Option<PathBuf> {
        self.settings.mode.backing_file().map(|kind| self.backing_place(kind, 0).0.clone())
    }

    /// The directory a VM's backing file of `kind` goes in, and its size at creation.
    fn backing_place(&self, kind: BackingKind, disk_bytes: u64) -> (&PathBuf, u64) {
        let dir = match kind {
            BackingKind::SpillLog | BackingKind::LocalCache => &self.settings.spill_dir,
            BackingKind::SharedDifferencing => &self.settings.shared_dir,
        };
        (dir, if kind == BackingKind::SpillLog { 0 } else { disk_bytes })
    }

    /// A VM's spill file, sharing the host's space-shortage count and segment writers.
    fn spill_backing(&self, file: ScratchFile) -> Box<dyn BackingFile> {
        let file = file.with_space_shortages(self.space_shortages.clone());
        if self.settings.spill_writers > 0 {
            // A VM's requests need not wait for its last segment to reach the disk.
            Box::new(file.with_background_segment_writes(self.segment_writers.clone(), self.settings.spill_direct))
        } else {
            Box::new(file)
        }
    }
}

impl ExportProvider for OverlayExports {
    fn list(&self) -> Vec<ExportInfo> {
        let versioned = self.versions.as_ref().map(OpenVersions::names).unwrap_or_default();
        self.images.keys().cloned().chain(versioned).filter_map(|name| self.info(&name)).collect()
    }

    fn info(&self, name: &str) -> Option<ExportInfo> {
        let image_name = Self::image_name(name);
        let (size, description) = match self.images.get(image_name) {
            Some(image) => (image.size(), image.describe()),
            None => {
                let versions = self.versions.as_ref()?;
                // A VM this server holds opens the version it booted, whatever is staged now: told
                // of that one, an INFO agrees with the GO after it (NBD requires the same answer).
                let booted =
                    name.split_once('@').and_then(|(_, vm)| self.registry.booted_label(vm)).and_then(|label| {
                        let (image, version) = label.split_once(':').filter(|(image, _)| *image == image_name)?;
                        versions.store().version(image, version).ok()
                    });
                let version = match booted {
                    Some(version) => Ok(version),
                    None => self.version_for(versions, name),
                };
                match version.and_then(|version| versions.describe(image_name, version)) {
                    Ok(described) => described,
                    // Offered, so that opening it refuses it by name and says why, rather than
                    // "no such export".
                    Err(error) => {
                        let fork = self.fork_of(name)?;
                        let staged = versions.store().staged(image_name, self.stage_of(name)).ok()?;
                        let (size, _) = versions.describe(image_name, staged).ok()?;
                        (size, format!("a fork of {}:{} that cannot start ({error})", fork.image, fork.checkpoint))
                    }
                }
            }
        };
        let description = if self.read_only(name) {
            format!("{ANONYMOUS_READ_ONLY}; {description}")
        } else {
            format!("{} write cache over {description}", self.settings.mode)
        };
        let capabilities = self.capabilities(name);
        Some(ExportInfo { name: name.to_owned(), description, size, capabilities, block_sizes: DEFAULT_BLOCK_SIZES })
    }

    fn open(&self, name: &str, identity: Option<&str>) -> Result<Box<dyn BlockDevice>, DeviceError> {
        self.open_hurried(name, identity, Arc::new(|| false))
    }

    fn open_hurried(
        &self,
        name: &str,
        identity: Option<&str>,
        hurry: GiveUp,
    ) -> Result<Box<dyn BlockDevice>, DeviceError> {
        let vm_name = match name.split_once('@') {
            Some((_, vm)) => {
                check_name("VM", vm).map_err(|e| DeviceError::new(DeviceErrorKind::Refused, e.to_string()))?;
                Some(vm)
            }
            None => {
                if self.read_only(name) {
                    tracing::info!(export = %shown_image(Self::image_name(name)), "anonymous connection: {ANONYMOUS_READ_ONLY}");
                }
                None
            }
        };
        if let Some(vm) = vm_name {
            self.adopt_orphan(vm);
            let holding = self.registry.holding(vm);
            if let Some(peers) = &self.peers {
                match peers.locate(vm, holding == crate::vms::Holding::Live) {
                    Located::Nowhere => {}
                    Located::Refused(why) => {
                        tracing::warn!(vm, "VM refused: {why}");
                        return Err(DeviceError::new(DeviceErrorKind::Refused, why));
                    }
                    Located::Live(address) => return self.open_incoming(name, vm, identity, peers, &address, hurry),
                }
            }
            // This server's ledger says it moved the VM away, and no peer holds it now (the
            // server it went to lost its state, or is no peer of this one): its writes are
            // somewhere else or nowhere, never a fresh VM's here (the record was written over).
            if let crate::vms::Holding::Moved { to } = holding {
                let why = format!(
                    "VM {vm} was moved from here to {to}, which holds nothing of it now; `overspill vm reset {vm}` \
                     starts it afresh"
                );
                tracing::warn!(vm, "VM refused: {why}");
                return Err(DeviceError::new(DeviceErrorKind::Refused, why));
            }
        }
        // Claimed by image name: a VM that resumes keeps the version it booted, in its overlay.
        let capabilities = self.capabilities(name);
        // Made only for a VM that is served: one made for a name refused would stay (its VM
        // never ends to take it along).
        let limiters = || self.registry.limits().limiters_for(vm_name, Self::image_name(name));
        let mut claimed = self.registry.claim(vm_name, Self::image_name(name), identity)?;
        let (joining_until, held_until) = (Instant::now() + JOIN_WAIT, Instant::now() + HELD_WAIT);
        while match claimed {
            Claim::Connecting => Instant::now() < joining_until,
            Claim::Held => Instant::now() < held_until,
            _ => false,
        } {
            std::thread::sleep(std::time::Duration::from_millis(10));
            claimed = self.registry.claim(vm_name, Self::image_name(name), identity)?;
        }
        let (number, reset, vm, fresh) = match claimed {
            Claim::Join { number, reset, live } => {
                let (registry, connection) = (self.registry.clone(), Connection { number, reset, hurry });
                return crate::device::stack(live, capabilities, connection, registry, limiters(), true);
            }
            Claim::Held => return Err(VmRegistry::already_connected(vm_name.unwrap_or_default(), name)),
            Claim::Connecting => {
                let why =
                    format!("VM {} is still connecting its first connection; try again", vm_name.unwrap_or_default());
                return Err(DeviceError::new(DeviceErrorKind::Refused, why));
            }
            Claim::Resume { number, reset, parked } => {
                self.note_maintenance_begun(name, number);
                (number, reset, *parked, false)
            }
            Claim::Fresh { number, reset } => match self.new_overlay(name, number) {
                Ok(vm) => {
                    if let Some(vm) = vm_name {
                        self.registry.boots().fresh(vm);
                    }
                    self.note_maintenance_begun(name, number);
                    (number, reset, vm, true)
                }
                Err(error) => {
                    self.registry.forget_failed(number);
                    return Err(error);
                }
            },
        };
        let live = Arc::new(Live::new(vm));
        let connection = Connection { number, reset, hurry };
        crate::device::stack(live, capabilities, connection, self.registry.clone(), limiters(), fresh)
    }
}

/// How long a further connection of a multi-conn VM waits for its first to have made the
/// overlay (a golden image's first read may be remote).
const JOIN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a connection of a VM that is connected already waits for that connection to end
/// before it is refused: a client that quits and starts again at once (QEMU sends DISC and
/// closes without waiting for the server) must not find its own last connection in the way.
const HELD_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// What a spilling VM keeps in memory at the least: its open 2 MiB segment, and room for the
/// index of what it spilled (about 0.4 % of it: 256 KiB covers 64 MiB spilled).
pub const SPILLING_VM_MINIMUM_BYTES: u64 = SEGMENT_BYTES as u64 + SEGMENT_BYTES as u64 / 8;

impl OverlayExports {
    /// VM `vm`'s view of `image`, whose fetches the host's golden-image budget paces.
    fn budgeted(&self, image: Arc<dyn GoldenImage>, vm: Option<String>) -> Arc<dyn GoldenImage> {
        let limits = self.registry.limits();
        Budgeted::view(image, limits.host_budget(HostBudget::Golden), self.registry.boots().clone(), vm)
    }

    /// A fresh overlay over the image's current version, with the counters the registry keeps.
    fn new_overlay(&self, name: &str, number: u64) -> Result<VmOverlay, DeviceError> {
        let (image_label, image) = self.image(name)?;
        // Labelled first: the watch, finding the image changed from now on, finds this VM too.
        self.registry.label(number, &image_label);
        self.overlay_over(name, number, &image_label, image, false)
    }

    /// A fresh overlay over `image`. `incoming`: the VM moves here from a peer, and its
    /// ledger entry stays "being made" (removed with its files by a next server) until the
    /// move says otherwise.
    fn overlay_over(
        &self,
        name: &str,
        number: u64,
        image_label: &str,
        image: Arc<dyn GoldenImage>,
        incoming: bool,
    ) -> Result<VmOverlay, DeviceError> {
        if let Err(error) = image.unchanged() {
            return Err(DeviceError::new(
                DeviceErrorKind::Refused,
                format!("{error}; the server serves it again once restarted (systemctl reload)"),
            ));
        }
        let named = name.split_once('@').map(|(_, vm)| vm.to_owned());
        let vm = named.clone().unwrap_or_else(|| anonymous_label(number));
        let image = self.budgeted(image, named);
        let settings = &self.settings;
        // A spilling VM holds its open segment and the index of what it spilled whatever its
        // target: more of them than --ram-total holds would break the cap, so the next is
        // turned away (it may try again later).
        if settings.mode.backing_file() == Some(BackingKind::SpillLog) && !self.host.admits(SPILLING_VM_MINIMUM_BYTES) {
            return Err(DeviceError::new(
                DeviceErrorKind::Exhausted,
                format!(
                    "the host's cache memory cap (--ram-total {} MiB) is full: it holds {} VMs, as each spilling VM keeps 2.25 MiB (its open segment and index) in memory",
                    self.host.cap_bytes() >> 20,
                    self.host.vms_that_fit(SPILLING_VM_MINIMUM_BYTES)
                ),
            ));
        }
        let config = self.overlay_config();
        let stats = self.registry.stats(number).unwrap_or_default();
        let persistent = name.contains('@') && self.lifecycle.persistent();
        let overlay = if persistent {
            self.persistent_overlay(&vm, number, image_label, image.clone(), config, stats)?
        } else {
            let backing = match settings.mode.backing_file() {
                Some(kind) => Some(
                    self.backing(kind, image.size())
                        .map_err(|e| device_error(EngineError::from_io("creating cache file", e)))?,
                ),
                None => None,
            };
            Overlay::new(image.clone(), config, backing, self.host.clone(), stats).map_err(device_error)?
        };
        tracing::info!(export = image_label, vm, mode = %settings.mode, "VM connected");
        let recorder =
            match &self.record_dir {
                Some(dir) => Some(Recorder::create(dir, &vm, number, image.size()).map_err(|e| {
                    DeviceError::new(DeviceErrorKind::Io, format!("cannot record this VM's trace: {e}"))
                })?),
                None => None,
            };
        if persistent && !incoming {
            // The last step that can fail is behind: from here the VM is served.
            let recorded = self.registry.mark_made(number);
            recorded.map_err(|e| device_error(EngineError::from_io("recording the VM in the ledger", e)))?;
        }
        Ok(VmOverlay { overlay, vm, recorder, handed_over: false })
    }
}

impl OverlayExports {
    /// A named VM's overlay whose state outlives the process, in files named after the VM; the
    /// ledger knows of them before they exist (as being made, until the caller has the VM ready
    /// to serve and calls [`VmRegistry::mark_made`]).
    fn persistent_overlay(
        &self,
        vm: &str,
        number: u64,
        image_label: &str,
        image: Arc<dyn GoldenImage>,
        config: OverlayConfig,
        stats: Arc<VmStats>,
    ) -> Result<Overlay, DeviceError> {
        let memory_dir = self.lifecycle.memory_dir.clone().expect("persistent lifecycles have one");
        let kind = self.settings.mode.backing_file();
        let spill_dir = self.state_file_dir();
        let record = StateRecord {
            image_label: image_label.to_owned(),
            image_identity: image.identity(),
            mode: self.settings.mode.to_string(),
            disk_bytes: image.size(),
            memory_dir: memory_dir.clone(),
            spill_dir: spill_dir.clone(),
        };
        // Files of this name that the ledger does not name (a fresh VM has no entry, and an
        // entry is written before its files are made) are not this server's: another server's
        // sharing the directory, holding them while its VM runs or keeping them for its next
        // start to rebuild that VM, or files left by hand. Never removed here.
        if let Some(path) = state_file_paths(vm, &record).into_iter().find(|path| path.exists()) {
            let whose = if overspill_engine::store::held_elsewhere(&path) {
                "another process holds it (a server sharing this directory, with a VM of the same name?)"
            } else {
                "no ledger entry of this server names it: another server's (sharing this directory, with a VM \
                 of the same name, to rebuild at its next start), or left by hand; remove it if no server needs it"
            };
            return Err(device_error(EngineError::Config(format!(
                "{} exists and {whose}: this VM cannot keep its state under that name",
                path.display()
            ))));
        }
        let io = |what: &'static str| move |e| device_error(EngineError::from_io(what, e));
        // A server that stopped with the default memory directory empty removed it (serve does),
        // and its name in /dev/shm is then anyone's to take: one sharing it (and its state
        // directory) makes it again, or checks whoever made it, as at its start.
        crate::files::own_directory(&memory_dir)
            .and_then(|()| std::fs::set_permissions(&memory_dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)))
            .map_err(io("checking the memory directory"))?;
        self.registry.mark_persistent(number, record).map_err(io("recording the VM in the ledger"))?;
        let stem = state_file_stem(vm);
        // Each file held while open: a server sharing the directory leaves it alone (above).
        let create = |dir: &Path, suffix: &str| {
            ScratchFile::create(dir, &format!("{stem}.{suffix}"), 0).and_then(ScratchFile::held)
        };
        let files = StateFiles {
            segments: Box::new(create(&memory_dir, "segments").map_err(io("creating state file"))?),
            zeros: Box::new(create(&memory_dir, "zeros").map_err(io("creating state file"))?),
        };
        let backing: Option<Box<dyn BackingFile>> = match (&spill_dir, kind) {
            (Some(dir), Some(BackingKind::SpillLog)) => {
                Some(self.spill_backing(create(dir, "spill").map_err(io("creating cache file"))?))
            }
            (Some(dir), Some(kind)) => {
                let name = format!("{stem}.{}", backing_suffix(kind));
                let file = ScratchFile::create(dir, &name, image.size())
                    .and_then(ScratchFile::held)
                    .map_err(io("creating cache file"))?;
                Some(Box::new(file.with_space_shortages(self.space_shortages.clone())))
            }
            _ => None,
        };
        let arena = Arena::create(&memory_dir, &stem, Overlay::arena_pages(&config)).map_err(device_error)?;
        arena.hold().map_err(io("holding the memory arena"))?;
        Overlay::persistent(image, config, backing, self.host.clone(), stats, arena, files).map_err(device_error)
    }
}

/// Whether this mode's VMs spill through the host's segment writers, and so pass its spill
/// budget.
fn spills_through_writers(settings: &CacheSettings) -> bool {
    settings.mode.backing_file() == Some(BackingKind::SpillLog) && settings.spill_writers > 0
}

/// The file name suffix of a VM's backing file of `kind` (`vm-NAME.spill`, `.cache`, `.diff`).
pub fn backing_suffix(kind: BackingKind) -> &'static str {
    match kind {
        BackingKind::SpillLog => "spill",
        BackingKind::LocalCache => "cache",
        BackingKind::SharedDifferencing => "diff",
    }
}

/// Makes `dir` if it is missing and checks that files can be made in it.
fn writable_directory(dir: &Path) -> std::io::Result<()> {
    crate::files::own_directory(dir)?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let probe = dir.join(format!(".overspill-probe-{}-{nanos}", std::process::id()));
    // A new file, never one a link planted under this name leads to (a sticky, world-writable
    // spill directory such as /var/tmp is accepted).
    std::os::unix::fs::OpenOptionsExt::custom_flags(
        std::fs::OpenOptions::new().write(true).create_new(true),
        rustix::fs::OFlags::NOFOLLOW.bits() as i32,
    )
    .open(&probe)?;
    std::fs::remove_file(&probe)
}

/// Removes cache files left by servers of this host that are no longer running. Files of live
/// servers (another overspill sharing the directory) are left alone: they hold them (see
/// [`overspill_engine::store::hold`]), or, where the filesystem keeps no locks, their pid runs.
/// Another host's files are never judged here: its pids mean nothing on this host, and its locks
/// may not reach it. Files under this process's own pid were left by its program before a
/// restart in place (the same pid, a new program): removed by the program's first call, if no
/// one holds them. (Files named before names carried a host's mark count as this host's.)
fn remove_stale_cache_files(dir: &Path, first_in_program: bool) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(owner) = name.to_str().and_then(overspill_engine::store::scratch_file_owner) else { continue };
        if !matches!(owner.kind, "spill" | "cache" | "diff" | "golden") || owner.this_host == Some(false) {
            continue;
        }
        let pid = owner.pid;
        let ours = pid == std::process::id();
        // Only candidates are probed: the probe's lock, brief as it is, would make a live
        // server's hold of a file it has just made fail.
        if (ours && !first_in_program) || (!ours && overspill_engine::store::process_alive(pid)) {
            continue;
        }
        let stale = match overspill_engine::store::held(&entry.path()) {
            Some(true) => false,
            Some(false) => true,
            // No locks to tell by: the pid alone (never our own, which may be this program's).
            None => !ours,
        };
        if stale {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => tracing::info!(file = %entry.path().display(), pid, "removed cache file of a dead server"),
                Err(error) => {
                    tracing::warn!(file = %entry.path().display(), %error, "could not remove stale cache file")
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "exports_tests.rs"]
mod tests;
