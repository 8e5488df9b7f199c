//! Golden images kept somewhere other than a local file, behind the engine's read-only
//! [`GoldenImage`] trait: an object in S3-compatible storage read with ranged GETs ([`s3`]), a
//! snapshot of a Ceph RBD image read through librbd ([`rbd`], a build feature), and a local disk
//! tier ([`local_tier`]) that keeps what was fetched from a remote source so that a restart or a
//! cold read cache does not fetch it again.
//!
//! A source is named by a string, so that `serve --export NAME=SOURCE` takes any of them:
//! a path (raw or qcow2 file), `s3://BUCKET/KEY`, or `rbd:POOL/IMAGE@SNAPSHOT`.
//! Remote sources are meant to be read through the engine's shared read cache, which turns a
//! storm of small reads into one fetch per chunk; they ask it for larger chunks than a local
//! file does ([`REMOTE_FETCH_BYTES`] unless set), since every request to them costs a round trip.

use std::path::PathBuf;
use std::sync::Arc;

use overspill_engine::GoldenImage;
use overspill_images::open_image;

pub mod local_tier;
#[cfg(feature = "rbd")]
pub mod rbd;
#[cfg(feature = "s3")]
pub mod s3;

/// The chunk fetched from a remote store at a time. Measured with `bench/sources` (a Linux boot
/// storm whose reads are scattered over 2 GiB): 1 MiB chunks fetched 9x the bytes the VMs read in
/// 956 requests, 256 KiB chunks 5x in 2,016; larger chunks pay off only for clustered reads.
pub const REMOTE_FETCH_BYTES: u64 = 256 << 10;

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{spec:?}: {message}")]
    Spec { spec: String, message: String },
    #[error("{0}")]
    Engine(#[from] overspill_engine::EngineError),
    #[error("{what}: {message}")]
    Remote { what: String, message: String },
    #[error("{0} support is not in this build (cargo build --features {1})")]
    NotBuilt(&'static str, &'static str),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

/// The part of a read of `buf.len()` bytes at `offset` that lies within an image of `size`
/// bytes: zeroes the rest of `buf` (past the end reads as zero) and returns the part's length.
fn within_image(buf: &mut [u8], offset: u64, size: u64) -> usize {
    let len = size.saturating_sub(offset).min(buf.len() as u64) as usize;
    buf[len..].fill(0);
    len
}

/// Where a golden image is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    File(PathBuf),
    S3 { bucket: String, key: String },
    Rbd { pool: String, image: String, snapshot: String },
}

impl Source {
    pub fn parse(spec: &str) -> Result<Self, SourceError> {
        let bad = |message: &str| SourceError::Spec { spec: spec.to_owned(), message: message.to_owned() };
        if let Some(rest) = spec.strip_prefix("s3://") {
            let (bucket, key) = rest.split_once('/').ok_or_else(|| bad("use s3://BUCKET/KEY"))?;
            if bucket.is_empty() || key.is_empty() {
                return Err(bad("use s3://BUCKET/KEY"));
            }
            Ok(Self::S3 { bucket: bucket.to_owned(), key: key.to_owned() })
        } else if let Some(rest) = spec.strip_prefix("rbd:") {
            let (pool, image_snap) = rest.split_once('/').ok_or_else(|| bad("use rbd:POOL/IMAGE@SNAPSHOT"))?;
            // A golden image must not change under its VMs: only a snapshot will do.
            let (image, snapshot) = image_snap
                .split_once('@')
                .ok_or_else(|| bad("name a snapshot (rbd:POOL/IMAGE@SNAPSHOT): a live image can change"))?;
            if [pool, image, snapshot].iter().any(|s| s.is_empty()) {
                return Err(bad("use rbd:POOL/IMAGE@SNAPSHOT"));
            }
            Ok(Self::Rbd { pool: pool.to_owned(), image: image.to_owned(), snapshot: snapshot.to_owned() })
        } else {
            Ok(Self::File(PathBuf::from(spec)))
        }
    }
}

/// Settings remote sources need; local files need none.
#[derive(Debug, Clone, Default)]
pub struct SourceSettings {
    /// Ceph configuration file (default: `CEPH_CONF`, then librados' own search).
    pub ceph_conf: Option<PathBuf>,
    /// Ceph client id, without `client.` (default `admin`).
    pub ceph_id: Option<String>,
    /// A directory for the local disk tier of remote sources; none keeps no local copy.
    pub local_tier_dir: Option<PathBuf>,
    /// The chunk remote sources are fetched in (default [`REMOTE_FETCH_BYTES`]).
    pub remote_fetch_bytes: Option<u64>,
}

/// Opens a golden image from wherever it is kept. S3 takes its endpoint and credentials from the
/// usual `AWS_*` environment variables (see [`s3`]).
pub fn open_source(source: &Source, settings: &SourceSettings) -> Result<Arc<dyn GoldenImage>, SourceError> {
    let fetch_bytes = settings.remote_fetch_bytes.unwrap_or(REMOTE_FETCH_BYTES);
    if !fetch_bytes.is_power_of_two() || fetch_bytes < 4096 {
        return Err(SourceError::Spec {
            spec: fetch_bytes.to_string(),
            message: "the remote fetch size must be a power of two of at least 4 KiB".into(),
        });
    }
    let remote: Arc<dyn GoldenImage> = match source {
        Source::File(path) => return Ok(open_image(path)?),
        Source::S3 { bucket, key } => open_s3(bucket, key, fetch_bytes)?,
        Source::Rbd { pool, image, snapshot } => open_rbd(pool, image, snapshot, settings, fetch_bytes)?,
    };
    match &settings.local_tier_dir {
        None => Ok(remote),
        Some(dir) => Ok(Arc::new(local_tier::LocalTier::new(remote, dir)?)),
    }
}

#[cfg(feature = "s3")]
fn open_s3(bucket: &str, key: &str, fetch_bytes: u64) -> Result<Arc<dyn GoldenImage>, SourceError> {
    Ok(Arc::new(s3::S3Image::open_from_env(bucket, key, fetch_bytes)?))
}

#[cfg(not(feature = "s3"))]
fn open_s3(_: &str, _: &str, _: u64) -> Result<Arc<dyn GoldenImage>, SourceError> {
    Err(SourceError::NotBuilt("S3", "s3"))
}

#[cfg(feature = "rbd")]
fn open_rbd(
    pool: &str,
    image: &str,
    snapshot: &str,
    settings: &SourceSettings,
    fetch_bytes: u64,
) -> Result<Arc<dyn GoldenImage>, SourceError> {
    let conf = settings.ceph_conf.clone().or_else(|| std::env::var_os("CEPH_CONF").map(PathBuf::from));
    let id = settings.ceph_id.as_deref().unwrap_or("admin");
    Ok(Arc::new(rbd::RbdImage::open(conf.as_deref(), id, pool, image, snapshot, fetch_bytes)?))
}

#[cfg(not(feature = "rbd"))]
fn open_rbd(_: &str, _: &str, _: &str, _: &SourceSettings, _: u64) -> Result<Arc<dyn GoldenImage>, SourceError> {
    Err(SourceError::NotBuilt("Ceph RBD", "rbd"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_past_the_end_are_zero() {
        let mut buf = [0xffu8; 10];
        assert_eq!(within_image(&mut buf, 95, 100), 5);
        assert_eq!(buf[5..], [0; 5]);
        assert_eq!(buf[..5], [0xff; 5]);
        assert_eq!(within_image(&mut buf, 100, 100), 0);
        assert_eq!(within_image(&mut [0u8; 4], u64::MAX, 100), 0);
    }

    #[test]
    fn specs_parse_and_live_rbd_images_are_refused() {
        assert_eq!(
            Source::parse("s3://golden/win10/v3.img").expect("s3"),
            Source::S3 { bucket: "golden".into(), key: "win10/v3.img".into() }
        );
        assert_eq!(
            Source::parse("rbd:rbd/golden@v3").expect("rbd"),
            Source::Rbd { pool: "rbd".into(), image: "golden".into(), snapshot: "v3".into() }
        );
        assert_eq!(Source::parse("/srv/golden.img").expect("file"), Source::File("/srv/golden.img".into()));
        let live = Source::parse("rbd:rbd/golden").expect_err("no snapshot").to_string();
        assert!(live.contains("snapshot"), "{live}");
        assert!(Source::parse("s3://bucket-only").is_err());
        assert!(Source::parse("rbd:/x@y").is_err());
    }
}
