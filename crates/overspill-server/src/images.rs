//! Golden images with versions, the way provisioning servers keep them: a directory per image,
//! one immutable file per version, and markers naming the version of each stage (PVS's
//! production and test): production is what new VMs get, test what new VMs of the test group
//! (`serve --test-vms`) get while there is one.
//!
//! ```text
//! DIR/<image>/v1.img  v2.qcow2  …   published versions, never changed once there
//! DIR/<image>/current                production: the version new connections get ("v2")
//! DIR/<image>/test                   test: the version new test VMs get, until promoted
//! DIR/<image>/previous               the production version before the last change (rollback)
//! DIR/<image>/checkpoints/<name>.qcow2  a VM's changes over a version (`vm checkpoint`, `vm
//!                                     fork`), a layer whose backing file is that version
//! ```
//!
//! A checkpoint goes by `@<name>` where a version goes by its name (`image:@name` in labels):
//! forks of a VM run over it as over a version, and it is never a stage's.
//!
//! Markers are replaced whole and atomically, under the image's lock.
//!
//! A VM keeps the version it connected to until it reconnects: its overlay holds that version
//! open. The server keeps one open copy (and one shared read cache) per version while any VM uses
//! it, and lets go of it when the last one leaves.

use std::collections::HashMap;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use overspill_engine::read_cache::{ReadCacheStats, DEFAULT_CHUNK_BYTES};
use overspill_engine::{CachedImage, GoldenImage, HostMemory, ImageLayer};
use overspill_images::open_image;

use crate::{check_name, ServerError};

#[path = "images_stages.rs"]
mod stages;
pub use stages::{Maintenance, Stage};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    pub name: String,
    pub path: PathBuf,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageEntry {
    pub name: String,
    pub versions: Vec<Version>,
    /// Production.
    pub current: Option<String>,
    pub test: Option<String>,
    pub previous: Option<String>,
    /// The maintenance stage: the VM that writes the next version, and the version it writes
    /// over (see [`ImageStore::maintain`]).
    pub maintenance: Option<Maintenance>,
}

#[derive(Debug, Clone)]
pub struct ImageStore {
    root: PathBuf,
}

fn version_number(name: &str) -> Option<u64> {
    name.strip_prefix('v')?.parse().ok()
}

impl ImageStore {
    pub fn new(root: &Path) -> Self {
        Self { root: root.to_path_buf() }
    }

    pub fn images(&self) -> Result<Vec<ImageEntry>, ServerError> {
        let mut images = Vec::new();
        let entries = match std::fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(images),
            Err(e) => return Err(ServerError::io(format!("reading {}", self.root.display()), e)),
        };
        for entry in entries.flatten() {
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
            if entry.path().is_dir() && check_name("image", &name).is_ok() {
                // One image that cannot be read (another user's, removed meanwhile) hides no other.
                match self.image(&name) {
                    Ok(image) => images.push(image),
                    Err(error) => tracing::warn!(image = name, %error, "image left out: it cannot be read"),
                }
            }
        }
        images.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(images)
    }

    pub fn image(&self, name: &str) -> Result<ImageEntry, ServerError> {
        check_name("image", name)?;
        let dir = self.root.join(name);
        let mut versions = Vec::new();
        let entries = std::fs::read_dir(&dir).map_err(|e| ServerError::io(format!("reading {}", dir.display()), e))?;
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else { continue };
            if version_number(stem).is_some()
                && path.extension().is_some_and(|e| e == "img" || e == "qcow2" || e == "vhdx")
            {
                let bytes = entry.metadata().map(|m| m.len()).unwrap_or(0);
                versions.push(Version { name: stem.to_owned(), path: path.clone(), bytes });
            }
        }
        versions.sort_by_key(|v| version_number(&v.name));
        let marker = |file: &str| {
            std::fs::read_to_string(dir.join(file)).ok().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())
        };
        Ok(ImageEntry {
            name: name.to_owned(),
            versions,
            current: marker("current"),
            test: marker("test"),
            previous: marker("previous"),
            maintenance: self.maintenance(name),
        })
    }

    /// Runs `work` with image `name`'s lock held (see [`lock_image`]).
    pub(crate) fn with_lock<T>(
        &self,
        name: &str,
        work: impl FnOnce(&Self) -> Result<T, ServerError>,
    ) -> Result<T, ServerError> {
        check_name("image", name)?;
        let lock = lock_image(&self.root.join(name))?;
        let done = work(self);
        drop(lock);
        done
    }

    /// `Err` unless `version` of `name` is published.
    fn published(&self, name: &str, version: &str) -> Result<(), ServerError> {
        check_name("version", version)?;
        if self.image(name)?.versions.iter().any(|v| v.name == version) {
            Ok(())
        } else {
            Err(ServerError::NoSuchVersion { image: name.to_owned(), version: version.to_owned() })
        }
    }

    /// Replaces marker `file` of `name` whole (`None`: removes it), durably.
    fn mark(&self, name: &str, file: &str, version: Option<&str>) -> Result<(), ServerError> {
        let dir = self.root.join(name);
        let io = |e| ServerError::io(format!("marking {file} in {}", dir.display()), e);
        match version {
            // Readable by the server whatever the umask of whoever ran this, and on disk.
            Some(version) => crate::files::replace_whole_durably(
                &dir.join(file),
                &dir.join(format!(".{file}.partial")),
                format!("{version}\n").as_bytes(),
                0o644,
            )
            .map_err(io),
            None => match std::fs::remove_file(dir.join(file)) {
                Ok(()) => crate::files::sync_directory(&dir).map_err(io),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(error) => Err(io(error)),
            },
        }
    }

    /// The version new connections to `name` get, and its file.
    pub fn current(&self, name: &str) -> Result<Version, ServerError> {
        let image = self.image(name)?;
        let current = image.current.ok_or_else(|| ServerError::NoCurrentVersion(name.to_owned()))?;
        match image.versions.into_iter().find(|v| v.name == current) {
            Some(version) => Ok(version),
            None => Err(ServerError::CurrentNotPublished { image: name.to_owned(), version: current }),
        }
    }

    /// A published version of `name`, current or not, or a checkpoint (`@NAME`).
    pub fn version(&self, name: &str, version: &str) -> Result<Version, ServerError> {
        if let Some(checkpoint) = version.strip_prefix('@') {
            return self.checkpoint(name, checkpoint);
        }
        let image = self.image(name)?;
        match image.versions.into_iter().find(|v| v.name == version) {
            Some(found) => Ok(found),
            None => Err(ServerError::NoSuchVersion { image: name.to_owned(), version: version.to_owned() }),
        }
    }

    /// Copies `file` in as the next version (`v1`, `v2`, …) and returns its name. The copy lands
    /// under a temporary name and is linked into place, so a reader never sees half a version.
    pub fn publish(&self, name: &str, file: &Path, activate: bool) -> Result<String, ServerError> {
        check_name("image", name)?;
        // Before anything opens it: opening a FIFO waits for a writer (with the image locked),
        // and a block device reads as empty.
        match std::fs::metadata(file) {
            Ok(metadata) if metadata.is_file() => {}
            Ok(_) => {
                let error = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file");
                return Err(ServerError::io(format!("publishing {}", file.display()), error));
            }
            Err(error) => return Err(ServerError::io(format!("publishing {}", file.display()), error)),
        }
        let dir = self.root.join(name);
        crate::files::create_shared_dir(&dir).map_err(|e| ServerError::io(format!("creating {}", dir.display()), e))?;
        // A version is one immutable file: a layer whose backing file or parent lies elsewhere
        // would change when that file does.
        let layered = overspill_images::has_backing(file)
            .map_err(|source| ServerError::Engine { context: format!("publishing {}", file.display()), source })?;
        if layered {
            return Err(ServerError::Layered(file.display().to_string()));
        }
        let format = overspill_images::Format::probe(file).ok();
        let ext = match format {
            Some(overspill_images::Format::Qcow2) => "qcow2",
            Some(overspill_images::Format::Vhdx) => "vhdx",
            _ => "img",
        };
        // Copied before the image's lock is taken, under a name of this process's own: a
        // capture or checkpoint of a running VM waits for the lock holding its VM still, and a
        // copy may take minutes.
        let partial = crate::files::partial_path(&dir, "publish");
        let io = |e| ServerError::io(format!("publishing {} into {}", file.display(), dir.display()), e);
        let _ = std::fs::remove_file(&partial);
        if let Err(error) = copy_sparse(file, &partial).and_then(|()| seal(&partial)) {
            let _ = std::fs::remove_file(&partial);
            return Err(io(error));
        }
        // The copy is what is served, and `file` may have changed since it was checked (an
        // uploader still writing it could turn it into a layer over any file the server reads):
        // the copy is checked again, as it is, before it becomes a version.
        if !matches!(overspill_images::has_backing(&partial), Ok(false))
            || overspill_images::Format::probe(&partial).ok() != format
        {
            let _ = std::fs::remove_file(&partial);
            let changed = std::io::Error::other("it changed while it was copied: publish a file nothing writes");
            return Err(ServerError::io(format!("publishing {}", file.display()), changed));
        }
        let published = self.with_lock(name, |store| {
            let next = store.next_number(name, &dir)?;
            let version = format!("v{next}");
            install(&dir, &partial, &dir.join(format!("{version}.{ext}")), next).map_err(io)?;
            if activate {
                store.activate_locked(name, &version)?;
            }
            Ok(version)
        });
        let _ = std::fs::remove_file(&partial);
        published
    }

    /// Writes the next version of `name` as a qcow2 layer over version `below` (its backing file,
    /// named relative to the image's directory, which is where it stays): `write` gets the
    /// path to create the layer at, the backing file's name and its format. The layer lands
    /// under a temporary name and becomes a version only once written and synced (a crash
    /// leaves no version), and is never a stage's until one is given it. Returns its name.
    pub fn publish_layer(
        &self,
        name: &str,
        below: &str,
        write: impl FnOnce(&Path, &str, overspill_images::Format) -> std::io::Result<()>,
    ) -> Result<String, ServerError> {
        check_name("image", name)?;
        // A version's backing file is another version (one directory): never a checkpoint.
        check_name("version", below)?;
        let dir = self.root.join(name);
        // A version never changes: read without the lock, as the layer is written (the lock
        // is taken only to give it its number).
        let below = self.version(name, below)?;
        let backing = below.path.file_name().and_then(|n| n.to_str()).map(str::to_owned).unwrap_or_default();
        let format = overspill_images::Format::probe(&below.path)
            .map_err(|source| ServerError::Engine { context: format!("reading {}", below.path.display()), source })?;
        let partial = crate::files::partial_path(&dir, "layer");
        write_sealed(&partial, |partial| write(partial, &backing, format))
            .map_err(|e| ServerError::io(format!("writing a layer over {}", below.path.display()), e))?;
        let published = self.with_lock(name, |store| {
            let next = store.next_number(name, &dir)?;
            let version = format!("v{next}");
            let target = dir.join(format!("{version}.qcow2"));
            install(&dir, &partial, &target, next)
                .map_err(|e| ServerError::io(format!("writing {}", target.display()), e))?;
            Ok(version)
        });
        let _ = std::fs::remove_file(&partial);
        published
    }

    /// Checkpoint `checkpoint` of `name` (`@checkpoint`): a layer over one of its versions.
    pub fn checkpoint(&self, name: &str, checkpoint: &str) -> Result<Version, ServerError> {
        check_name("image", name)?;
        check_name("checkpoint", checkpoint)?;
        let path = self.checkpoint_path(name, checkpoint);
        match std::fs::metadata(&path) {
            Ok(metadata) if metadata.is_file() => {
                Ok(Version { name: format!("@{checkpoint}"), path, bytes: metadata.len() })
            }
            _ => Err(ServerError::NoSuchVersion { image: name.to_owned(), version: format!("@{checkpoint}") }),
        }
    }

    fn checkpoint_path(&self, name: &str, checkpoint: &str) -> PathBuf {
        self.root.join(name).join(CHECKPOINTS).join(format!("{checkpoint}.qcow2"))
    }

    /// Writes checkpoint `checkpoint` of `name`, a qcow2 layer over version `below` (or over
    /// another checkpoint): `write` as for [`Self::publish_layer`]. It appears whole, synced,
    /// or not at all, and a name is never written twice. Returns it.
    pub fn write_checkpoint(
        &self,
        name: &str,
        below: &str,
        checkpoint: &str,
        write: impl FnOnce(&Path, &str, overspill_images::Format) -> std::io::Result<()>,
    ) -> Result<Version, ServerError> {
        check_name("checkpoint", checkpoint)?;
        check_name("image", name)?;
        let taken = || ServerError::Stage {
            image: name.to_owned(),
            why: format!("it has a checkpoint {checkpoint} already: a checkpoint is written once"),
        };
        // Written before the image's lock is taken (see `publish`); linked into place under it,
        // never over one another writer put there meanwhile.
        let below = self.version(name, below)?;
        if self.checkpoint_path(name, checkpoint).exists() {
            return Err(taken());
        }
        let format = overspill_images::Format::probe(&below.path)
            .map_err(|source| ServerError::Engine { context: format!("reading {}", below.path.display()), source })?;
        let target = self.checkpoint_path(name, checkpoint);
        let io = |e| ServerError::io(format!("writing {}", target.display()), e);
        let checkpoints = self.checkpoints_dir(name).map_err(io)?;
        let partial = crate::files::partial_path(&checkpoints, "checkpoint");
        write_sealed(&partial, |partial| write(partial, &checkpoint_backing(&below), format)).map_err(io)?;
        let linked = self.with_lock(name, |_| match link_into_place(&partial, &target) {
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Err(taken()),
            linked => linked.map_err(io),
        });
        let _ = std::fs::remove_file(&partial);
        linked?;
        self.checkpoint(name, checkpoint)
    }

    /// Makes sealed file `partial` (on the store's filesystem) checkpoint `checkpoint` of `name`;
    /// under the image's lock.
    pub(crate) fn link_checkpoint(&self, name: &str, checkpoint: &str, partial: &Path) -> Result<(), ServerError> {
        let target = self.checkpoint_path(name, checkpoint);
        let io = |e| ServerError::io(format!("writing {}", target.display()), e);
        self.checkpoints_dir(name).map_err(io)?;
        seal(partial).and_then(|()| link_into_place(partial, &target)).map_err(io)
    }

    /// Image `name`'s checkpoints' directory, made (and on disk) if missing.
    pub(crate) fn checkpoints_dir(&self, name: &str) -> std::io::Result<PathBuf> {
        let dir = self.root.join(name);
        let checkpoints = dir.join(CHECKPOINTS);
        if !checkpoints.is_dir() {
            crate::files::create_shared_dir(&checkpoints)?;
            crate::files::sync_directory(&dir)?;
        }
        Ok(checkpoints)
    }

    /// The versions version `version` of `name` reads through, itself first: a captured
    /// version is a layer over the one it was captured over (see [`Self::publish_layer`]).
    pub fn version_chain(&self, name: &str, version: &str) -> Result<Vec<Version>, ServerError> {
        let mut chain = vec![self.version(name, version)?];
        loop {
            let top = chain.last().expect("one at least");
            if overspill_images::Format::probe(&top.path).ok() != Some(overspill_images::Format::Qcow2) {
                return Ok(chain);
            }
            let named = overspill_images::qcow2::backing_file_name(&top.path)
                .map_err(|source| ServerError::Engine { context: format!("reading {}", top.path.display()), source })?;
            let Some(named) = named else { return Ok(chain) };
            // As publish_layer names it: a version's file beside it.
            let below = Path::new(&named).file_stem().and_then(|s| s.to_str()).unwrap_or_default();
            let below = self.version(name, below).ok().filter(|below| below.path.file_name() == Some(named.as_ref()));
            let Some(below) = below.filter(|_| chain.len() < overspill_images::qcow2::MAX_CHAIN_DEPTH) else {
                return Err(ServerError::Stage {
                    image: name.to_owned(),
                    why: format!("version {} lies on {named:?}, which is no version of it", top.name),
                });
            };
            chain.push(below);
        }
    }

    /// The store's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Writes version `version` of `name`, with whatever it reads through (a captured version
    /// is a chain of layers), as one flat file, the next version: a sparse raw file of the same
    /// bytes. The stages that named `version` name the flat one from then on (new VMs get it;
    /// running VMs keep theirs); `version` stays, as every version does until it is removed.
    /// Returns the new version's name.
    pub fn compact(&self, name: &str, version: &str) -> Result<String, ServerError> {
        check_name("version", version)?;
        let source = self.version(name, version)?;
        let image = open_image(&source.path)
            .map_err(|source| ServerError::Engine { context: format!("opening {name} {version}"), source })?;
        let dir = self.root.join(name);
        // Written before the image's lock is taken (a capture or checkpoint of a running VM
        // waits for it, holding its VM still), under a name of this process's own.
        let partial = crate::files::partial_path(&dir, &format!("compact{version}"));
        let _ = std::fs::remove_file(&partial);
        let written = flatten(image.as_ref(), &partial).and_then(|()| {
            // Versions are told by their first bytes: a flat copy whose first bytes (the
            // guest's) read as a qcow2 or VHDX header would be taken for one, backing file and all.
            match overspill_images::Format::probe(&partial) {
                Ok(overspill_images::Format::Raw) => seal(&partial),
                _ => Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{version}'s first bytes read as an image header: it cannot be a raw file"),
                )),
            }
        });
        let installed =
            written.map_err(|e| ServerError::io(format!("compacting {name} {version}"), e)).and_then(|()| {
                self.with_lock(name, |store| {
                    let next = store.next_number(name, &dir)?;
                    let compacted = format!("v{next}");
                    let target = dir.join(format!("{compacted}.img"));
                    install(&dir, &partial, &target, next)
                        .map_err(|e| ServerError::io(format!("writing {}", target.display()), e))?;
                    // The same bytes: every marker that named the chain names the flat file.
                    let entry = store.image(name)?;
                    for (marker, named) in [
                        (Stage::Production.marker(), &entry.current),
                        (Stage::Test.marker(), &entry.test),
                        ("previous", &entry.previous),
                    ] {
                        if named.as_deref() == Some(version) {
                            store.mark(name, marker, Some(&compacted))?;
                        }
                    }
                    Ok(compacted)
                })
            });
        if installed.is_err() {
            let _ = std::fs::remove_file(&partial);
        }
        installed
    }

    /// Marks `version` as the one new connections get.
    pub fn activate(&self, name: &str, version: &str) -> Result<(), ServerError> {
        self.with_lock(name, |store| store.activate_locked(name, version))
    }

    /// Makes `version` production, keeping the one it replaces as `previous` (for a rollback).
    fn activate_locked(&self, name: &str, version: &str) -> Result<(), ServerError> {
        self.published(name, version)?;
        let before = self.image(name)?.current;
        if let Some(before) = before.filter(|before| before != version) {
            self.mark(name, "previous", Some(&before))?;
        }
        self.mark(name, Stage::Production.marker(), Some(version))
    }
}

impl ImageStore {
    /// The number the next version of `name` (in `dir`, locked) gets: never one given before,
    /// even if its file has been removed since: a server still holding the removed version open
    /// (VMs on it) would otherwise hand it out under the new one's name, and a restarted VM
    /// recorded on it would find another image there.
    fn next_number(&self, name: &str, dir: &Path) -> Result<u64, ServerError> {
        let highest = self.image(name)?.versions.iter().filter_map(|v| version_number(&v.name)).max().unwrap_or(0);
        Ok(highest.max(read_highest_given(dir)) + 1)
    }
}

/// Makes a version's file read-only and readable by the server whatever the source file's mode
/// or the publisher's umask (a server running as its own user found a 0600 copy, made by root,
/// unreadable), and puts it on disk before it has a version's name: a host crash must not leave
/// a version (and `current` naming it) with its bytes lost.
fn seal(partial: &Path) -> std::io::Result<()> {
    overspill_engine::crash::point();
    std::fs::set_permissions(partial, std::os::unix::fs::PermissionsExt::from_mode(0o444))?;
    std::fs::File::open(partial).and_then(|f| f.sync_all())
}

/// Writes `image`'s bytes to new file `path`, sparse: only what its extents call data is
/// written (zeroes and holes are left unwritten, and read as zeroes).
fn flatten(image: &dyn overspill_engine::GoldenImage, path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    const CHUNK: u64 = 1 << 20;
    let file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    let size = image.size();
    file.set_len(size)?;
    let mut buffer = vec![0u8; CHUNK as usize];
    let mut at = 0;
    while at < size {
        let extents = image.extents(at, size - at)?;
        if extents.is_empty() || extents.iter().any(|e| e.len == 0) {
            return Err(std::io::Error::other("the image reported no extent, or an empty one"));
        }
        for extent in extents {
            let end = (at + extent.len).min(size);
            if extent.state == overspill_engine::Allocation::Data {
                let mut pos = at;
                while pos < end {
                    let n = (end - pos).min(CHUNK) as usize;
                    image.read_at(&mut buffer[..n], pos)?;
                    overspill_engine::crash::point();
                    file.write_all_at(&buffer[..n], pos)?;
                    pos += n as u64;
                }
            }
            at = end;
        }
    }
    Ok(())
}

/// Where an image keeps its checkpoints.
const CHECKPOINTS: &str = "checkpoints";

/// Gives sealed `partial` the name `target` (`link` fails rather than replace a file another
/// writer put there; `partial` goes either way), durably.
fn link_into_place(partial: &Path, target: &Path) -> std::io::Result<()> {
    overspill_engine::crash::point();
    let linked = std::fs::hard_link(partial, target);
    overspill_engine::crash::point();
    let _ = std::fs::remove_file(partial);
    linked?;
    crate::files::sync_directory(target.parent().unwrap_or(Path::new(".")))
}

/// The name a checkpoint's file gives its backing file `below`, from the checkpoints'
/// directory: a version's file one level up, or a checkpoint's beside it.
pub(crate) fn checkpoint_backing(below: &Version) -> String {
    let file_name = below.path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    if below.name.starts_with('@') {
        file_name.to_owned()
    } else {
        format!("../{file_name}")
    }
}

/// Has `write` make a layer at `partial` (a name of this writer's own, [`crate::files::partial_path`]),
/// then seals it (read-only, on disk), for the caller to give the file its name under the
/// image's lock. One that failed is removed.
fn write_sealed(partial: &Path, write: impl FnOnce(&Path) -> std::io::Result<()>) -> std::io::Result<()> {
    let _ = std::fs::remove_file(partial);
    match write(partial).and_then(|()| seal(partial)) {
        Ok(()) => Ok(()),
        Err(error) => {
            let _ = std::fs::remove_file(partial);
            Err(error)
        }
    }
}

/// Gives sealed file `partial` its version's name `target`, number `next` taken for good first.
/// Linked, never renamed over a file of that name: where the filesystem keeps no locks, two
/// publishers may pick one number, and the second fails rather than replace the first's version.
fn install(dir: &Path, partial: &Path, target: &Path, next: u64) -> std::io::Result<()> {
    record_highest_given(dir, next)?;
    overspill_engine::crash::point();
    link_into_place(partial, target).map_err(|error| match error.kind() {
        std::io::ErrorKind::AlreadyExists => std::io::Error::new(
            error.kind(),
            format!("{} was published meanwhile by another publisher: publish again", target.display()),
        ),
        _ => error,
    })
}

/// The image directory's record of the highest version number ever published in it.
const HIGHEST_GIVEN: &str = ".highest-version";

/// The highest version number `publish` has given in `dir`: 0 when none was recorded (a store
/// from before the record, whose files still tell), or when the record cannot be read.
fn read_highest_given(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join(HIGHEST_GIVEN)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

fn record_highest_given(dir: &Path, number: u64) -> std::io::Result<()> {
    let record = dir.join(HIGHEST_GIVEN);
    let partial = dir.join(format!("{HIGHEST_GIVEN}.partial"));
    // Readable by every publisher whatever this one's umask: one that could not read it would
    // give a number again.
    crate::files::replace_whole_durably(&record, &partial, format!("{number}\n").as_bytes(), 0o644)
}

/// One numbering or activation at a time per image, across processes: two publishers would pick
/// the same next number, two activations share the `current` marker's temporary name. The
/// image's directory itself is locked (`flock`), so no lock file needs a mode every publisher
/// may open. Held briefly: files are written before it is taken. Taking it also removes the
/// partial files this host's dead publishers left.
fn lock_image(dir: &Path) -> Result<std::fs::File, ServerError> {
    let lock = std::fs::File::open(dir)
        .and_then(|lock| crate::files::lock_exclusive(&lock).map(|()| lock))
        .map_err(|e| ServerError::io(format!("locking {}", dir.display()), e))?;
    crate::files::remove_stale_partials(dir);
    crate::files::remove_stale_partials(&dir.join(CHECKPOINTS));
    Ok(lock)
}

/// The versions a server has open: one copy (and one read cache) per version in use.
pub struct OpenVersions {
    store: ImageStore,
    read_cache_bytes: u64,
    /// With the file's stamp when it was opened: a version whose file was removed and whose
    /// name was published again (by hand, or by a store from before `publish` kept its record
    /// of numbers given) is another image, opened afresh.
    open: Mutex<HeldVersions>,
    /// What [`Self::describe`] found for versions no VM held: a version never changes, and
    /// NBD_OPT_LIST and NBD_OPT_INFO (which any client may send, again and again) would
    /// otherwise open it, tables and all, each time. Kept with the file's inode and
    /// modification time, in case a version was removed by hand and its name published again.
    described: Mutex<HashMap<(String, String), Description>>,
    caches: Arc<ReadCacheList>,
    /// The memory budget each version's read cache holds within.
    host: Arc<HostMemory>,
}

/// A shared read cache, for metrics: the export (and version) it serves, what it reads from
/// (the golden image's description: file, format, the chain of layers under it), its figures.
pub type CacheEntry = (String, String, Arc<ReadCacheStats>);

/// Every shared read cache a server has, for metrics; entries of released versions fade out.
#[derive(Debug, Default)]
pub struct ReadCacheList {
    caches: Mutex<Vec<(String, String, Weak<CachedImage>)>>,
}

impl ReadCacheList {
    pub fn add(&self, label: String, source: String, cache: &Arc<CachedImage>) {
        self.lock().push((label, source, Arc::downgrade(cache)));
    }

    /// The caches still alive, dropping the others.
    pub fn live(&self) -> Vec<CacheEntry> {
        self.caches().into_iter().map(|(label, source, cache)| (label, source, cache.stats().clone())).collect()
    }

    /// The caches still alive themselves (the memory pass has them give back and grow back).
    pub fn caches(&self) -> Vec<(String, String, Arc<CachedImage>)> {
        let mut caches = self.lock();
        caches.retain(|(_, _, weak)| weak.strong_count() > 0);
        caches
            .iter()
            .filter_map(|(label, source, weak)| Some((label.clone(), source.clone(), weak.upgrade()?)))
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(String, String, Weak<CachedImage>)>> {
        self.caches.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A version in use; logs when the last VM using it has gone.
struct HeldVersion {
    inner: Arc<dyn GoldenImage>,
    label: String,
}

impl Drop for HeldVersion {
    fn drop(&mut self) {
        tracing::info!(image = %self.label, "golden image version released: its last VM left");
    }
}

impl ImageLayer for HeldVersion {
    fn below(&self) -> &dyn GoldenImage {
        self.inner.as_ref()
    }

    fn describe(&self) -> String {
        format!("{} ({})", self.label, self.inner.describe())
    }
}

/// A file's device, inode, length and change times: a write changes the modification time, a
/// rename into place the change time, so a file put in an earlier one's place differs even where
/// the filesystem reused its inode within one timestamp tick. `None` if it cannot be read.
type FileStamp = Option<Stamp>;

type Stamp = (u64, u64, u64, i64, i64, i64, i64);

fn stamp_of(m: &std::fs::Metadata) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    (m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec())
}

/// The versions VMs hold, by image and version name, with their files' stamps when opened.
type HeldVersions = HashMap<(String, String), (FileStamp, Weak<dyn GoldenImage>)>;

/// What NBD_OPT_INFO tells of a version (size, description), and of which file.
type Description = (FileStamp, u64, String);

fn file_stamp(path: &Path) -> FileStamp {
    std::fs::metadata(path).ok().map(|m| stamp_of(&m))
}

impl OpenVersions {
    pub fn new(store: ImageStore, read_cache_bytes: u64, caches: Arc<ReadCacheList>, host: Arc<HostMemory>) -> Self {
        Self { store, read_cache_bytes, open: Mutex::default(), described: Mutex::default(), caches, host }
    }

    pub fn store(&self) -> &ImageStore {
        &self.store
    }

    pub fn names(&self) -> Vec<String> {
        self.store.images().map(|images| images.into_iter().map(|i| i.name).collect()).unwrap_or_default()
    }

    /// Version `version` of `name`, as NBD_OPT_INFO describes it (size, description), without
    /// holding it open.
    pub fn describe(&self, name: &str, version: Version) -> Result<(u64, String), ServerError> {
        let key = (name.to_owned(), version.name.clone());
        let stamp = file_stamp(&version.path);
        if let Some(image) = self.held(&key, stamp) {
            return Ok((image.size(), image.describe()));
        }
        let mut described = self.described.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, size, description)) = described.get(&key).filter(|(was, ..)| stamp.is_some() && *was == stamp) {
            return Ok((*size, description.clone()));
        }
        let image = open_image(&version.path)
            .map_err(|source| ServerError::Engine { context: format!("opening {name}:{}", version.name), source })?;
        let description = format!("{name}:{} ({})", version.name, image.describe());
        described.insert(key, (stamp, image.size(), description.clone()));
        Ok((image.size(), description))
    }

    /// The versions VMs hold now, each with its label (`name:version`, as VMs show it).
    pub fn held_now(&self) -> Vec<(String, Arc<dyn GoldenImage>)> {
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.iter()
            .filter_map(|((name, version), (_, weak))| Some((format!("{name}:{version}"), weak.upgrade()?)))
            .collect()
    }

    /// Version `version` of `name`, current or not: a VM recovered after a restart goes on with
    /// the version its writes were made over.
    pub fn version(&self, name: &str, version: &str) -> Result<(String, Arc<dyn GoldenImage>), ServerError> {
        self.open(name, self.store.version(name, version)?)
    }

    /// Version `version` of `name`, shared with the VMs already on it.
    pub fn open(&self, name: &str, version: Version) -> Result<(String, Arc<dyn GoldenImage>), ServerError> {
        let key = (name.to_owned(), version.name.clone());
        // Taken before the file is opened: a file replaced between the two is opened with the
        // older stamp, so the next caller opens it again rather than sharing a wrong copy.
        let stamp = file_stamp(&version.path);
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(image) = Self::held_in(&open, &key, stamp) {
            return Ok((version.name, image));
        }
        let label = format!("{name}:{}", version.name);
        let mut image = open_image(&version.path)
            .map_err(|source| ServerError::Engine { context: format!("opening {label}"), source })?;
        if self.read_cache_bytes > 0 {
            let source = image.describe();
            let cached =
                Arc::new(CachedImage::new(image, self.read_cache_bytes, DEFAULT_CHUNK_BYTES).within(self.host.clone()));
            self.caches.add(label.clone(), source, &cached);
            image = cached;
        }
        let held: Arc<dyn GoldenImage> = Arc::new(HeldVersion { inner: image, label });
        open.retain(|_, (_, weak)| weak.strong_count() > 0);
        open.insert(key, (stamp, Arc::downgrade(&held)));
        Ok((version.name, held))
    }

    /// The open copy of a version, if VMs still hold it and its file is still the one opened.
    fn held(&self, key: &(String, String), stamp: FileStamp) -> Option<Arc<dyn GoldenImage>> {
        Self::held_in(&self.open.lock().unwrap_or_else(|p| p.into_inner()), key, stamp)
    }

    fn held_in(open: &HeldVersions, key: &(String, String), stamp: FileStamp) -> Option<Arc<dyn GoldenImage>> {
        open.get(key).filter(|(was, _)| stamp.is_some() && *was == stamp).and_then(|(_, weak)| weak.upgrade())
    }
}

/// Copies `from` into a new file `to`, leaving holes where `from` has them: a golden image is
/// mostly unallocated (a 100 GiB qcow2 or raw disk holding 20 GiB), and a copy that wrote its
/// holes out as zeroes filled the store's disk (`std::fs::copy` did).
fn copy_sparse(from: &Path, to: &Path) -> std::io::Result<()> {
    use rustix::fs::SeekFrom;
    let source = std::fs::File::open(from)?;
    let before = source.metadata()?;
    // A block device's length reads as 0 here (an empty version); a pipe has none.
    if !before.is_file() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"));
    }
    let len = before.len();
    let target = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(to)?;
    target.set_len(len)?;
    let mut at = 0;
    while at < len {
        let data = match rustix::fs::seek(&source, SeekFrom::Data(at)) {
            Ok(data) => data,
            // Nothing but a hole from here to the end.
            Err(rustix::io::Errno::NXIO) => break,
            // A kernel or filesystem that cannot tell: all of it is data.
            Err(rustix::io::Errno::INVAL | rustix::io::Errno::OPNOTSUPP) if at == 0 => {
                copy_range(&source, &target, 0, len)?;
                break;
            }
            Err(errno) => return Err(errno.into()),
        };
        if data >= len {
            break;
        }
        let hole = rustix::fs::seek(&source, SeekFrom::Hole(data))?.min(len);
        copy_range(&source, &target, data, hole)?;
        at = hole;
    }
    // Written (or cut, or grown) while it was copied: the copy may mix two files. The holes
    // found past a cut end would have read as zeroes, and bytes past the length taken first
    // were never copied.
    let after = source.metadata()?;
    if stamp_of(&before) != stamp_of(&after) {
        return Err(std::io::Error::other("it changed while it was copied: publish a file nothing writes"));
    }
    Ok(())
}

/// Copies bytes `[from, end)` of `source` to the same place in `target`: in the kernel where
/// it can (a reflink on filesystems that share blocks), through a buffer where it cannot.
fn copy_range(source: &std::fs::File, target: &std::fs::File, from: u64, end: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let shrank = || std::io::Error::other("it changed while it was copied: publish a file nothing writes");
    let mut at = from;
    while at < end {
        let (mut read_at, mut write_at) = (at, at);
        let want = usize::try_from(end - at).unwrap_or(usize::MAX).min(1 << 30);
        match rustix::fs::copy_file_range(source, Some(&mut read_at), target, Some(&mut write_at), want) {
            Ok(0) => return Err(shrank()),
            Ok(copied) => at += copied as u64,
            Err(
                rustix::io::Errno::XDEV
                | rustix::io::Errno::INVAL
                | rustix::io::Errno::NOSYS
                | rustix::io::Errno::OPNOTSUPP,
            ) => {
                let mut buffer = vec![0u8; (1 << 20).min(end - at) as usize];
                while at < end {
                    let take = buffer.len().min((end - at) as usize);
                    let read = source.read_at(&mut buffer[..take], at)?;
                    if read == 0 {
                        return Err(shrank());
                    }
                    target.write_all_at(&buffer[..read], at)?;
                    at += read as u64;
                }
            }
            Err(errno) => return Err(errno.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "images_tests.rs"]
mod tests;
