//! Golden images' content digests, for moves between hosts. A VM's state names its image by a
//! local identity (a file's device, inode, size and modification time), which no copy of the
//! file on another host shares: a receiving end whose identity differs compares digests of the
//! images' contents instead, and takes the VM only over the very bytes it ran over. A digest is
//! SHA-256 over the image's virtual disk, read once per identity on a thread of its own (only
//! servers with peers compute any) and kept in the state directory across restarts.

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use overspill_engine::GoldenImage;
use sha2::{Digest, Sha256};

/// What is read at a time.
const CHUNK_BYTES: usize = 1 << 20;

#[derive(Debug, Clone)]
enum State {
    Computing,
    Done(String),
    Failed(String),
}

/// The digests known or being computed, by image identity.
#[derive(Debug)]
pub struct ImageDigests {
    /// Where computed digests are kept (none: not kept across restarts).
    cache: Option<PathBuf>,
    known: Mutex<HashMap<String, State>>,
    settled: Condvar,
}

impl ImageDigests {
    /// Digests kept in `cache` (a JSON file of identity to digest).
    pub fn new(cache: Option<PathBuf>) -> Arc<Self> {
        let known = cache
            .as_ref()
            .and_then(|path| std::fs::read(path).ok())
            .and_then(|bytes| serde_json::from_slice::<HashMap<String, String>>(&bytes).ok())
            .unwrap_or_default()
            .into_iter()
            .map(|(identity, digest)| (identity, State::Done(digest)))
            .collect();
        Arc::new(Self { cache, known: Mutex::new(known), settled: Condvar::new() })
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<String, State>> {
        self.known.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The digest of the image of identity `identity`, if computed.
    pub fn get(&self, identity: &str) -> Option<String> {
        match self.known().get(identity) {
            Some(State::Done(digest)) => Some(digest.clone()),
            _ => None,
        }
    }

    /// [`Self::start`] for an image whose identity holds on this host alone (a file's: device
    /// and inode), the images a move between hosts compares by digest. Another's (an S3
    /// object's ETag, an RBD snapshot's ids) is the same at every host, and its digest would
    /// read the whole image from the shared store for nothing.
    pub fn start_if_host_local(self: &Arc<Self>, image: &Arc<dyn GoldenImage>) {
        if image.identity().is_some_and(|identity| host_local(&identity)) {
            self.start(image.clone());
        }
    }

    /// Begins computing `image`'s digest on a thread of its own, unless it is known, being
    /// computed, or the image has no identity (nothing to key it by).
    pub fn start(self: &Arc<Self>, image: Arc<dyn GoldenImage>) {
        let Some(identity) = image.identity() else { return };
        {
            let mut known = self.known();
            if matches!(known.get(&identity), Some(State::Done(_) | State::Computing)) {
                return;
            }
            known.insert(identity.clone(), State::Computing);
        }
        let digests = self.clone();
        let key = identity.clone();
        let spawned = std::thread::Builder::new().name("image-digest".into()).spawn(move || {
            let began = Instant::now();
            let state = match digest_of(image.as_ref()) {
                Ok(digest) => {
                    tracing::info!(image = image.describe(), seconds = began.elapsed().as_secs_f64(), "image digest computed (for moves between hosts)");
                    State::Done(digest)
                }
                Err(error) => {
                    tracing::warn!(image = image.describe(), %error, "image digest could not be computed: VMs over it cannot move between hosts");
                    State::Failed(error.to_string())
                }
            };
            digests.settle(key, state);
        });
        if let Err(error) = spawned {
            self.settle(identity, State::Failed(format!("no thread to compute it: {error}")));
        }
    }

    fn settle(&self, identity: String, state: State) {
        let mut known = self.known();
        known.insert(identity, state);
        if let Some(path) = &self.cache {
            let done: HashMap<&String, &String> = known
                .iter()
                .filter_map(|(identity, state)| match state {
                    State::Done(digest) => Some((identity, digest)),
                    _ => None,
                })
                .collect();
            if let Err(error) = write_atomically(path, &done) {
                tracing::warn!(path = %path.display(), %error, "could not keep the image digests");
            }
        }
        drop(known);
        self.settled.notify_all();
    }

    /// `image`'s digest, computed now if need be (only for an image whose identity is this
    /// host's: another is never read whole for it), waiting at most `wait` for it.
    pub fn wait_for(self: &Arc<Self>, image: &Arc<dyn GoldenImage>, wait: Duration) -> Result<String, String> {
        let identity = image.identity().ok_or("the image has no identity to compare")?;
        if !host_local(&identity) {
            return Err("its contents are named alike at every host (a remote store): its digest is not read".into());
        }
        self.start(image.clone());
        let until = Instant::now() + wait;
        let mut known = self.known();
        loop {
            match known.get(&identity) {
                Some(State::Done(digest)) => return Ok(digest.clone()),
                Some(State::Failed(why)) => return Err(format!("its digest could not be computed: {why}")),
                _ => {}
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("its digest is still being computed after {} s", wait.as_secs()));
            }
            known = self.settled.wait_timeout(known, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

/// Whether an image identity holds on this host alone: a file's (`golden::file_identity`,
/// also inside a qcow2's or VHDX's).
fn host_local(identity: &str) -> bool {
    identity.contains("file dev ")
}

/// SHA-256 over `image`'s contents, a chunk at a time; a chunk of zeroes counts as a mark of its
/// own (no hashing of the zeroes of a sparse image), which depends on the contents alone, not on
/// how they are stored. The image must not change meanwhile.
pub fn digest_of(image: &dyn GoldenImage) -> io::Result<String> {
    let size = image.size();
    let mut hasher = Sha256::new();
    hasher.update(size.to_le_bytes());
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut offset = 0u64;
    while offset < size {
        let len = (size - offset).min(CHUNK_BYTES as u64) as usize;
        let chunk = &mut buf[..len];
        image.read_uncached(chunk, offset)?;
        if chunk.iter().all(|&b| b == 0) {
            hasher.update([0u8]);
        } else {
            hasher.update([1u8]);
            hasher.update(&*chunk);
        }
        offset += len as u64;
    }
    image.unchanged()?;
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn write_atomically(path: &std::path::Path, digests: &HashMap<&String, &String>) -> io::Result<()> {
    let partial = path.with_extension("json.partial");
    std::fs::write(&partial, serde_json::to_vec_pretty(digests).map_err(io::Error::other)?)?;
    std::fs::rename(&partial, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use overspill_engine::golden::{MemImage, RawImage};

    fn image(bytes: Vec<u8>) -> Arc<dyn GoldenImage> {
        Arc::new(MemImage::new(bytes))
    }

    /// Equal contents give equal digests, however many zero chunks; one byte apart, or one
    /// byte longer, they differ.
    #[test]
    fn a_digest_depends_on_the_contents_alone() {
        let mut bytes = vec![0u8; 3 * CHUNK_BYTES + 17];
        bytes[CHUNK_BYTES + 5] = 9;
        let same = digest_of(image(bytes.clone()).as_ref()).expect("digest");
        assert_eq!(same, digest_of(image(bytes.clone()).as_ref()).expect("digest"));
        let mut other = bytes.clone();
        other[2 * CHUNK_BYTES + 1] = 1;
        assert_ne!(same, digest_of(image(other).as_ref()).expect("digest"));
        let mut longer = bytes.clone();
        longer.push(0);
        assert_ne!(same, digest_of(image(longer).as_ref()).expect("digest"));
    }

    /// A file's digest is computed once: kept in the cache file, a server started again over
    /// the same file knows it at once; a copy of the file (another identity) has the same one.
    #[test]
    fn a_files_digest_is_kept_and_a_copy_has_the_same() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (file, copy) = (dir.path().join("golden.img"), dir.path().join("copy.img"));
        std::fs::write(&file, (0..5 * CHUNK_BYTES).map(|i| (i % 253) as u8).collect::<Vec<_>>()).expect("image");
        std::fs::copy(&file, &copy).expect("copy");
        let cache = dir.path().join("digests.json");
        let digests = ImageDigests::new(Some(cache.clone()));
        let original: Arc<dyn GoldenImage> = Arc::new(RawImage::open(&file).expect("open"));
        let digest = digests.wait_for(&original, Duration::from_secs(30)).expect("digest");
        let identity = original.identity().expect("a file's identity");
        assert_eq!(digests.get(&identity), Some(digest.clone()));
        assert_eq!(ImageDigests::new(Some(cache)).get(&identity), Some(digest.clone()), "not kept");
        let copied: Arc<dyn GoldenImage> = Arc::new(RawImage::open(&copy).expect("open"));
        assert_ne!(copied.identity(), Some(identity));
        assert_eq!(digests.wait_for(&copied, Duration::from_secs(30)), Ok(digest));
    }

    /// The digest reads past the shared read cache: a whole image read for it would push out
    /// what the VMs read.
    #[test]
    fn a_digest_leaves_the_read_cache_as_it_was() {
        use overspill_engine::read_cache::CachedImage;
        let bytes: Vec<u8> = (0..4 * CHUNK_BYTES).map(|i| (i % 251) as u8).collect();
        let cached = CachedImage::new(image(bytes.clone()), 64 << 20, 64 << 10);
        assert_eq!(digest_of(&cached).expect("digest"), digest_of(image(bytes).as_ref()).expect("digest"));
        assert_eq!(cached.held_bytes(), 0, "the digest's reads filled the read cache");
    }
}
