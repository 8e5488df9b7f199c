//! Checkpoints taken out of an image store and brought into another (`overspill image
//! checkpoint-export`, `checkpoint-import`), through a directory or an S3 bucket.
//!
//! Inside a store a checkpoint is a chain of qcow2 layers over one version, naming each other by
//! names that hold only there. Taken out, it is its layers' files (`IMAGE@NAME.qcow2`) and a
//! manifest, `IMAGE@NAME.json`, written last (its presence says the rest is whole), naming the
//! version the chain lies on by name, size and SHA-256, and each layer by name, size and
//! SHA-256. Brought in, the version must be there with those very bytes (forks would otherwise
//! read another image under their writes), and each layer is fetched under a temporary name,
//! checked against its digest and its backing file's name, sealed, and linked into place bottom
//! first, under the image's lock: a crash leaves the store as before or with the chain's lower
//! layers, each whole and a checkpoint in its own right, never a layer over a missing one. A
//! layer already there with the same bytes is kept (an import run again goes on where it
//! stopped); one with other bytes refuses the import.

use std::io::{self, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::images::{checkpoint_backing, ImageStore, Version};
use crate::{check_name, ServerError};

/// Where checkpoints are taken out to: a directory here ([`DirPlace`]), or a bucket (the
/// command wires S3 in).
pub trait Place {
    /// Stores `name` with the bytes of local file `from`, whole or not at all.
    fn put_file(&self, name: &str, from: &Path) -> io::Result<()>;
    /// Stores `name` with `bytes`, whole or not at all.
    fn put_bytes(&self, name: &str, bytes: &[u8]) -> io::Result<()>;
    /// Fetches `name`, which must be `bytes` long, into local file `to`, which does not exist
    /// yet (a longer or shorter one is refused before more is read).
    fn get_file(&self, name: &str, to: &Path, bytes: u64) -> io::Result<()>;
    /// Fetches `name`, up to `limit` bytes.
    fn get_bytes(&self, name: &str, limit: u64) -> io::Result<Vec<u8>>;
    /// Where it is, for messages (`DIR`, `s3://BUCKET/PREFIX`).
    fn describe(&self) -> String;
}

/// A directory as a [`Place`].
pub struct DirPlace(pub PathBuf);

impl DirPlace {
    fn partial(&self, name: &str) -> PathBuf {
        self.0.join(format!(".{name}.partial"))
    }
}

impl Place for DirPlace {
    fn put_file(&self, name: &str, from: &Path) -> io::Result<()> {
        std::fs::create_dir_all(&self.0)?;
        let partial = self.partial(name);
        let _ = std::fs::remove_file(&partial);
        let written = std::fs::copy(from, &partial)
            .and_then(|_| std::fs::File::open(&partial)?.sync_all())
            .and_then(|()| std::fs::rename(&partial, self.0.join(name)));
        if written.is_err() {
            let _ = std::fs::remove_file(&partial);
        }
        written.and_then(|()| crate::files::sync_directory(&self.0))
    }

    fn put_bytes(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        std::fs::create_dir_all(&self.0)?;
        crate::files::replace_whole_durably(&self.0.join(name), &self.partial(name), bytes, 0o644)
    }

    fn get_file(&self, name: &str, to: &Path, bytes: u64) -> io::Result<()> {
        let from = std::fs::File::open(self.0.join(name))?;
        // Not a FIFO or a device, which would hang or never end.
        let metadata = from.metadata()?;
        if !metadata.is_file() || metadata.len() != bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{name} is not a file of {bytes} bytes as its manifest says"),
            ));
        }
        let mut out = std::fs::OpenOptions::new().write(true).create_new(true).open(to)?;
        io::copy(&mut from.take(bytes), &mut out).map(|_| ())
    }

    fn get_bytes(&self, name: &str, limit: u64) -> io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        std::fs::File::open(self.0.join(name))?.take(limit).read_to_end(&mut bytes)?;
        Ok(bytes)
    }

    fn describe(&self) -> String {
        self.0.display().to_string()
    }
}

/// What a checkpoint taken out is: see the module's doc.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub image: String,
    /// The version under the chain, then each version it reads through (a captured version is
    /// a layer over another), as they must be where the checkpoint is brought in.
    pub versions: Vec<FileDigest>,
    /// The checkpoint's layers, bottom first: the first lies on the version, each next one on
    /// the one before; the last is the checkpoint itself.
    pub layers: Vec<FileDigest>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    pub name: String,
    pub bytes: u64,
    pub sha256: String,
}

const FORMAT: u32 = 1;
/// Longest manifest read: a chain of the deepest qcow2 reads, with room to spare.
const MANIFEST_MAX_BYTES: u64 = 64 << 10;

/// The name a checkpoint's manifest has where it is taken out to.
pub fn manifest_name(image: &str, checkpoint: &str) -> String {
    format!("{image}@{checkpoint}.json")
}

fn layer_name(image: &str, checkpoint: &str) -> String {
    format!("{image}@{checkpoint}.qcow2")
}

fn digest(name: &str, path: &Path) -> Result<FileDigest, ServerError> {
    let hashed = (|| -> io::Result<FileDigest> {
        let mut file = std::fs::File::open(path)?;
        let mut context = ring::digest::Context::new(&ring::digest::SHA256);
        let mut buffer = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            match file.read(&mut buffer) {
                Ok(0) => break,
                Ok(n) => {
                    context.update(&buffer[..n]);
                    bytes += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let sha256 = context.finish().as_ref().iter().map(|b| format!("{b:02x}")).collect();
        Ok(FileDigest { name: name.to_owned(), bytes, sha256 })
    })();
    hashed.map_err(|e| ServerError::io(format!("reading {}", path.display()), e))
}

impl ImageStore {
    /// Takes checkpoint `checkpoint` of `image` out to `place`: its layers, down to the version
    /// under them, then its manifest. Returns the manifest.
    pub fn export_checkpoint(&self, image: &str, checkpoint: &str, place: &dyn Place) -> Result<Manifest, ServerError> {
        let (version, chain) = self.chain(image, checkpoint)?;
        let mut layers = Vec::new();
        for layer in &chain {
            let name = layer.name.trim_start_matches('@');
            layers.push(digest(name, &layer.path)?);
            place
                .put_file(&layer_name(image, name), &layer.path)
                .map_err(|e| ServerError::io(format!("writing {} to {}", layer.name, place.describe()), e))?;
        }
        let versions = self.version_digests(image, &version.name)?;
        let manifest = Manifest { format: FORMAT, image: image.to_owned(), versions, layers };
        let text = serde_json::to_vec_pretty(&manifest).map_err(|e| ServerError::Control(e.to_string()))?;
        place
            .put_bytes(&manifest_name(image, checkpoint), &text)
            .map_err(|e| ServerError::io(format!("writing the manifest to {}", place.describe()), e))?;
        Ok(manifest)
    }

    /// Brings the checkpoint whose manifest is `manifest` at `place` into the store. Returns its
    /// label, `IMAGE:@NAME`. The layers are fetched and checked before the image's lock is
    /// taken (which a capture or a checkpoint of a running VM waits for), and only linked into
    /// place under it.
    pub fn import_checkpoint(&self, place: &dyn Place, manifest: &str) -> Result<String, ServerError> {
        let text = place
            .get_bytes(manifest, MANIFEST_MAX_BYTES)
            .map_err(|e| ServerError::io(format!("reading {manifest} from {}", place.describe()), e))?;
        let manifest: Manifest = serde_json::from_slice(&text)
            .map_err(|e| ServerError::Control(format!("{manifest} is no checkpoint manifest: {e}")))?;
        let image = manifest.image.as_str();
        let refused = |why: String| ServerError::Stage { image: image.to_owned(), why };
        check_manifest(&manifest).map_err(refused)?;
        let version = &manifest.versions[0].name;
        let here = self.version_digests(image, version)?;
        if here != manifest.versions {
            return Err(refused(format!(
                "its version {version} here is not the one the checkpoint lies on (other bytes, in it or in the \
                 versions it reads through: SHA-256 {} here, {} there)",
                here[0].sha256, manifest.versions[0].sha256
            )));
        }
        let checkpoints =
            self.checkpoints_dir(image).map_err(|e| ServerError::io("making the checkpoints' directory", e))?;
        // Each layer fetched under a name of this process's own, before the lock.
        let partials: Vec<PathBuf> =
            manifest.layers.iter().map(|_| crate::files::partial_path(&checkpoints, "import")).collect();
        let mut fetched = Vec::new();
        let mut below = self.version(image, version)?;
        let outcome = (|| {
            for (layer, partial) in manifest.layers.iter().zip(&partials) {
                let target = self.checkpoint(image, &layer.name).ok();
                if target.is_none() {
                    let _ = std::fs::remove_file(partial);
                    fetched.push(partial.clone());
                    fetch_layer(place, image, layer, partial, &checkpoint_backing(&below))
                        .map_err(|e| ServerError::io(format!("bringing in layer {}", layer.name), e))?;
                }
                below = Version {
                    name: format!("@{}", layer.name),
                    path: checkpoints.join(format!("{}.qcow2", layer.name)),
                    bytes: layer.bytes,
                };
            }
            self.with_lock(image, |store| {
                let mut below = store.version(image, version)?;
                for (layer, partial) in manifest.layers.iter().zip(&partials) {
                    match store.checkpoint(image, &layer.name) {
                        Ok(there) => {
                            let backing =
                                overspill_images::qcow2::backing_file_name(&there.path).map_err(|source| {
                                    ServerError::Engine { context: format!("reading {}", there.path.display()), source }
                                })?;
                            if digest(&layer.name, &there.path)? != *layer
                                || backing != Some(checkpoint_backing(&below))
                            {
                                return Err(refused(format!("it has another checkpoint {} already", layer.name)));
                            }
                        }
                        Err(_) => {
                            store.link_checkpoint(image, &layer.name, partial)?;
                        }
                    }
                    below = store.checkpoint(image, &layer.name)?;
                }
                Ok(())
            })
        })();
        for partial in fetched {
            let _ = std::fs::remove_file(partial);
        }
        outcome?;
        Ok(format!("{image}:@{}", manifest.layers[manifest.layers.len() - 1].name))
    }

    /// Name, size and SHA-256 of version `version` of `image` and of each it reads through.
    fn version_digests(&self, image: &str, version: &str) -> Result<Vec<FileDigest>, ServerError> {
        self.version_chain(image, version)?.iter().map(|v| digest(&v.name, &v.path)).collect()
    }

    /// The version checkpoint `checkpoint` of `image` lies on, and its layers bottom first. Each
    /// layer must name what lies under it as `write_checkpoint` names it.
    fn chain(&self, image: &str, checkpoint: &str) -> Result<(Version, Vec<Version>), ServerError> {
        let mut layers = vec![self.checkpoint(image, checkpoint)?];
        loop {
            let top = layers.last().expect("one at least");
            let named = overspill_images::qcow2::backing_file_name(&top.path)
                .map_err(|source| ServerError::Engine { context: format!("reading {}", top.path.display()), source })?
                .unwrap_or_default();
            let below = match named.strip_prefix("../") {
                Some(file) => {
                    self.version(image, Path::new(file).file_stem().and_then(|s| s.to_str()).unwrap_or_default())
                }
                None => self.checkpoint(image, named.strip_suffix(".qcow2").unwrap_or_default()),
            };
            let below = below.ok().filter(|below| checkpoint_backing(below) == named);
            let Some(below) = below.filter(|_| layers.len() < overspill_images::qcow2::MAX_CHAIN_DEPTH) else {
                return Err(ServerError::Stage {
                    image: image.to_owned(),
                    why: format!("checkpoint {} lies on {named:?}, which is no version or checkpoint of it", top.name),
                });
            };
            if below.name.starts_with('@') {
                layers.push(below);
            } else {
                layers.reverse();
                return Ok((below, layers));
            }
        }
    }
}

/// Why `manifest` cannot be brought in as it says, if it cannot: a known format, names that are
/// names (versions no checkpoints), each layer once, a chain a qcow2 reader opens.
fn check_manifest(manifest: &Manifest) -> Result<(), String> {
    if manifest.format > FORMAT {
        return Err(format!("the checkpoint's manifest is of a newer release (format {})", manifest.format));
    }
    check_name("image", &manifest.image).map_err(|e| e.to_string())?;
    if manifest.versions.is_empty() || manifest.layers.is_empty() {
        return Err("the checkpoint's manifest names no version or no layer".into());
    }
    for version in &manifest.versions {
        check_name("version", &version.name).map_err(|e| e.to_string())?;
    }
    let mut seen = std::collections::HashSet::new();
    for layer in &manifest.layers {
        check_name("checkpoint", &layer.name).map_err(|e| e.to_string())?;
        if !seen.insert(&layer.name) {
            return Err(format!("the checkpoint's manifest names layer {} twice", layer.name));
        }
    }
    if manifest.versions.len() + manifest.layers.len() > overspill_images::qcow2::MAX_CHAIN_DEPTH {
        return Err("the checkpoint's chain is deeper than a qcow2 reader opens".into());
    }
    Ok(())
}

/// Fetches `layer` of `image` from `place` into `partial` and checks it: the bytes its manifest
/// says, over the backing file `backing` names.
fn fetch_layer(place: &dyn Place, image: &str, layer: &FileDigest, partial: &Path, backing: &str) -> io::Result<()> {
    place.get_file(&layer_name(image, &layer.name), partial, layer.bytes)?;
    let got = digest(&layer.name, partial).map_err(io::Error::other)?;
    if got != *layer {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "layer {} read from {} is not what its manifest says ({} bytes with SHA-256 {})",
                layer.name,
                place.describe(),
                got.bytes,
                got.sha256
            ),
        ));
    }
    let named = overspill_images::qcow2::backing_file_name(partial).map_err(io::Error::other)?;
    if named.as_deref() != Some(backing) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("layer {} lies on {named:?}, not on {backing:?} as its manifest says", layer.name),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str) -> FileDigest {
        FileDigest { name: name.into(), bytes: 1, sha256: "00".into() }
    }

    #[test]
    fn a_manifest_naming_paths_checkpoints_as_versions_or_a_layer_twice_is_refused() {
        let good =
            Manifest { format: FORMAT, image: "win".into(), versions: vec![file("v1")], layers: vec![file("c1")] };
        assert_eq!(check_manifest(&good), Ok(()));
        let refused = |change: &dyn Fn(&mut Manifest)| {
            let mut manifest = good.clone();
            change(&mut manifest);
            check_manifest(&manifest).expect_err("refused")
        };
        assert!(refused(&|m| m.image = "../etc".into()).contains("not allowed"));
        assert!(refused(&|m| m.versions[0].name = "@c0".into()).contains("not allowed"));
        assert!(refused(&|m| m.layers[0].name = "../../x".into()).contains("not allowed"));
        assert!(refused(&|m| m.layers.push(file("c1"))).contains("twice"));
        assert!(refused(&|m| m.layers.clear()).contains("no layer"));
        assert!(refused(&|m| m.format = FORMAT + 1).contains("newer release"));
        assert!(refused(&|m| m.layers = (0..64).map(|n| file(&format!("c{n}"))).collect()).contains("deeper"));
    }

    #[test]
    fn a_directory_hands_out_only_a_file_of_the_size_expected() {
        let dir = tempfile::tempdir().expect("tempdir");
        let place = DirPlace(dir.path().to_owned());
        place.put_bytes("layer", b"12345678").expect("put");
        let to = dir.path().join("got");
        place.get_file("layer", &to, 8).expect("the size expected");
        assert!(place.get_file("layer", &dir.path().join("short"), 4).is_err(), "a longer file is refused");
        std::os::unix::fs::symlink("/dev/zero", dir.path().join("endless")).expect("link");
        assert!(place.get_file("endless", &dir.path().join("zero"), 8).is_err(), "a device is refused");
        assert_eq!(std::fs::read(&to).expect("read"), b"12345678");
    }
}
