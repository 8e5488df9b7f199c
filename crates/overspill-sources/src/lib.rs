//! Golden images kept somewhere other than a local file, behind the engine's read-only
//! [`GoldenImage`] trait: an object in S3-compatible storage read with ranged GETs ([`s3`]), a
//! file on a web server (or a presigned S3 URL) read with ranged GETs ([`http`]), a
//! snapshot of a Ceph RBD image read through librbd ([`rbd`], a build feature), and a local disk
//! tier ([`local_tier`]) that keeps what was fetched from a remote source so that a read cache
//! that evicted it does not fetch it again (the tier starts empty with each server).
//!
//! A source is named by a string, so that `serve --export NAME=SOURCE` takes any of them:
//! a path (raw, qcow2 or VHDX file), `s3://BUCKET/KEY`, `http(s)://HOST/PATH?QUERY`, or
//! `rbd:POOL/IMAGE@SNAPSHOT`. A URL's query and user:password may be credentials (a presigned
//! URL's signature): they are shown only as [`redact`] writes them, never in logs or errors.
//! Remote sources are meant to be read through the engine's shared read cache, which turns a
//! storm of small reads into one fetch per chunk; they ask it for larger chunks than a local
//! file does ([`REMOTE_FETCH_BYTES`] unless set), since every request to them costs a round trip.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use overspill_engine::GoldenImage;
use overspill_images::open_image;

#[cfg(feature = "http")]
pub mod http;
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
    Http { url: HttpUrl },
    Rbd { pool: String, image: String, snapshot: String },
}

/// An `http://` or `https://` URL as given, which may carry credentials in its query or
/// user:password. Its `Debug` and `Display` show it redacted, so that printing a [`Source`]
/// cannot leak them; only [`HttpUrl::expose`] gives it whole, for the request itself.
#[derive(Clone, PartialEq, Eq)]
pub struct HttpUrl(String);

impl HttpUrl {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for HttpUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HttpUrl({:?})", redact(&self.0))
    }
}

impl fmt::Display for HttpUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&self.0))
    }
}

/// `http(s)://` at the start, in any case, as URL schemes are.
fn http_scheme(spec: &str) -> Option<usize> {
    ["http://", "https://"]
        .into_iter()
        .find(|scheme| spec.get(..scheme.len()).is_some_and(|s| s.eq_ignore_ascii_case(scheme)))
        .map(str::len)
}

/// A source spec fit for logs and errors: an HTTP(S) URL loses any user:password and has its
/// query replaced by `?REDACTED` (a presigned URL's signature is a credential until it
/// expires); the fragment, never sent, goes too. Any other spec is returned as it is.
pub fn redact(spec: &str) -> String {
    let Some(scheme_len) = http_scheme(spec) else {
        return spec.to_owned();
    };
    let (scheme, rest) = spec.split_at(scheme_len);
    let (before_fragment, _) = rest.split_once('#').unwrap_or((rest, ""));
    let (before_query, query) = match before_fragment.split_once('?') {
        Some((before, query)) => (before, Some(query)),
        None => (before_fragment, None),
    };
    let (authority, path) = before_query.split_at(before_query.find('/').unwrap_or(before_query.len()));
    let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    let query = if query.is_some() { "?REDACTED" } else { "" };
    format!("{scheme}{host}{path}{query}")
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(path) => write!(f, "{}", path.display()),
            Self::S3 { bucket, key } => write!(f, "s3://{bucket}/{key}"),
            Self::Http { url } => write!(f, "{url}"),
            Self::Rbd { pool, image, snapshot } => write!(f, "rbd:{pool}/{image}@{snapshot}"),
        }
    }
}

impl Source {
    pub fn parse(spec: &str) -> Result<Self, SourceError> {
        let bad = |message: &str| SourceError::Spec { spec: redact(spec), message: message.to_owned() };
        if let Some(rest) = spec.strip_prefix("s3://") {
            let (bucket, key) = rest.split_once('/').ok_or_else(|| bad("use s3://BUCKET/KEY"))?;
            if bucket.is_empty() || key.is_empty() {
                return Err(bad("use s3://BUCKET/KEY"));
            }
            Ok(Self::S3 { bucket: bucket.to_owned(), key: key.to_owned() })
        } else if let Some(scheme_len) = http_scheme(spec) {
            let rest = &spec[scheme_len..];
            let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
            let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
            if host.is_empty() {
                return Err(bad("use http://HOST/PATH or https://HOST/PATH"));
            }
            Ok(Self::Http { url: HttpUrl(spec.to_owned()) })
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
/// usual `AWS_*` environment variables (see [`s3`]); HTTPS trusts the system's CA roots, or
/// those in `SSL_CERT_FILE` (see [`http`]).
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
        Source::Http { url } => open_http(url, fetch_bytes)?,
        Source::Rbd { pool, image, snapshot } => open_rbd(pool, image, snapshot, settings, fetch_bytes)?,
    };
    refuse_a_container(remote.as_ref())?;
    // What the remote end says the size is: checked here, before a local tier sizes its file
    // and tables from it (every VM would be refused such a disk anyway).
    if remote.size() > overspill_engine::MAX_DISK_BYTES {
        return Err(SourceError::Remote {
            what: remote.describe(),
            message: format!("{} bytes, more than the 16 TiB a VM's overlay maps", remote.size()),
        });
    }
    match &settings.local_tier_dir {
        None => Ok(remote),
        Some(dir) => Ok(Arc::new(local_tier::LocalTier::new(remote, dir)?)),
    }
}

/// Remote images are served as raw disks: a qcow2 or VHDX object served so would give every VM
/// the container's bytes (headers, tables) as its disk. Refused at start, with what to do.
fn refuse_a_container(remote: &dyn GoldenImage) -> Result<(), SourceError> {
    let mut first = [0u8; 8];
    let have = first.len().min(remote.size() as usize);
    remote
        .read_at(&mut first[..have], 0)
        .map_err(|source| SourceError::Io { what: format!("reading the start of {}", remote.describe()), source })?;
    match overspill_images::Format::of_header(&first[..have]) {
        overspill_images::Format::Raw => Ok(()),
        format => Err(SourceError::Remote {
            what: remote.describe(),
            message: format!(
                "this is a {} image, and remote images are served as raw disks: convert it first \
                 (qemu-img convert -O raw), or keep it as a local file",
                format.name()
            ),
        }),
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

#[cfg(feature = "http")]
fn open_http(url: &HttpUrl, fetch_bytes: u64) -> Result<Arc<dyn GoldenImage>, SourceError> {
    Ok(Arc::new(http::HttpImage::open(url, fetch_bytes)?))
}

#[cfg(not(feature = "http"))]
fn open_http(_: &HttpUrl, _: u64) -> Result<Arc<dyn GoldenImage>, SourceError> {
    Err(SourceError::NotBuilt("HTTP(S)", "http"))
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

    #[test]
    fn http_urls_parse_and_show_no_credentials() {
        let spec = "https://user:hunter2@cdn.example:8443/golden/v3.img?X-Amz-Signature=feedface&X-Amz-Expires=60#top";
        let source = Source::parse(spec).expect("https");
        let Source::Http { url } = &source else { panic!("{source:?} is not an HTTP source") };
        assert_eq!(url.expose(), spec, "the URL is kept whole for the requests");
        for shown in [source.to_string(), format!("{source:?}"), redact(spec)] {
            assert!(!shown.contains("hunter2") && !shown.contains("feedface") && !shown.contains("user"), "{shown}");
            assert!(shown.contains("https://cdn.example:8443/golden/v3.img?REDACTED"), "{shown}");
        }
        assert_eq!(redact("HTTP://h/a.img"), "HTTP://h/a.img", "nothing to hide");
        assert_eq!(redact("http://h?sig=1"), "http://h?REDACTED");
        assert_eq!(redact("/srv/a?b.img"), "/srv/a?b.img", "a file path is not a URL");
        assert!(matches!(Source::parse("HTTPS://h/x").expect("scheme in capitals"), Source::Http { .. }));
        for bad in ["http://", "https:///path", "http://user:pw@/x?sig=secret"] {
            let error = Source::parse(bad).expect_err(bad).to_string();
            assert!(error.contains("HOST") && !error.contains("secret") && !error.contains("pw"), "{error}");
        }
    }
}
