//! An object in S3-compatible storage as a golden image, read with ranged GETs through the
//! object_store crate; and a bucket's prefix as a place to put files in and take them from
//! ([`S3Bucket`]: checkpoints taken out of an image store).
//!
//! Endpoint and credentials come from the environment, as every S3 tool takes them:
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT` (or
//! `AWS_ENDPOINT_URL`) for a store that is not AWS (Ceph radosgw, MinIO), and `AWS_ALLOW_HTTP=true`
//! for a plain-HTTP endpoint. Requests are path-style, which every S3-compatible store accepts.
//!
//! The object is read-only here by construction (only HEAD and GET are ever sent), and its size
//! and ETag are taken once at open: every GET is conditional on that ETag and every reply is
//! checked against both (a store may ignore `If-Match`), so if the object is replaced while VMs
//! run, a read fails with EIO rather than mixing two images' blocks. A store that gives no ETag
//! is refused at open: a replaced object could not be told from the one opened.

use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectStore, RetryConfig};

use crate::SourceError;
use overspill_engine::GoldenImage;

/// Tries of a request after its first (a store's transient errors, a dropped connection).
pub const MAX_RETRIES: usize = 3;

pub struct S3Image {
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    size: u64,
    etag: String,
    /// object_store is async; each VM thread blocks on this runtime for its fetch. A few worker
    /// threads are enough: fetches are network waits, and the read cache coalesces them.
    runtime: tokio::runtime::Runtime,
    name: String,
    fetch_bytes: u64,
}

/// A client of `bucket` as the environment configures it, and the runtime its requests run on.
fn client(bucket: &str, name: &str) -> Result<(Arc<dyn ObjectStore>, tokio::runtime::Runtime), SourceError> {
    // object_store's defaults try a request 11 times over up to 3 minutes, each try up to 30 s:
    // a VM's read would wait that long. Tries are bounded here as the HTTP source bounds its
    // own: all of them within 30 s.
    let retry =
        RetryConfig { max_retries: MAX_RETRIES, retry_timeout: Duration::from_secs(30), ..RetryConfig::default() };
    let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket).with_retry(retry);
    // object_store reads AWS_ENDPOINT; AWS_ENDPOINT_URL is what the AWS CLI reads.
    if std::env::var_os("AWS_ENDPOINT").is_none() {
        if let Ok(url) = std::env::var("AWS_ENDPOINT_URL") {
            builder = builder.with_endpoint(url);
        }
    }
    let store: Arc<dyn ObjectStore> =
        Arc::new(builder.build().map_err(|e| SourceError::Remote { what: name.to_owned(), message: e.to_string() })?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("s3-fetch")
        .enable_all()
        .build()
        .map_err(|source| SourceError::Io { what: "starting the S3 client runtime".into(), source })?;
    Ok((store, runtime))
}

/// Copies a reply's body into `buf` as it arrives; how many bytes came. A body longer than
/// `buf` (a store that lies about its length, or never ends) is an error once it runs past, not
/// gathered whole into memory first.
async fn body_into(result: object_store::GetResult, buf: &mut [u8]) -> Result<usize, String> {
    let mut body = result.into_stream();
    let mut got = 0usize;
    while let Some(piece) = body.next().await {
        let piece = piece.map_err(|e| e.to_string())?;
        let room = got.checked_add(piece.len()).and_then(|end| buf.get_mut(got..end));
        let Some(room) = room else {
            return Err(format!("the reply runs past the {} bytes asked for", buf.len()));
        };
        room.copy_from_slice(&piece);
        got += piece.len();
    }
    Ok(got)
}

impl S3Image {
    /// `fetch_bytes`: the chunk a read cache in front should fetch.
    pub fn open_from_env(bucket: &str, key: &str, fetch_bytes: u64) -> Result<Self, SourceError> {
        let name = format!("s3://{bucket}/{key}");
        let remote = |message: String| SourceError::Remote { what: name.clone(), message };
        let (store, runtime) = client(bucket, &name)?;
        let path = ObjectPath::from(key);
        let meta = runtime.block_on(store.head(&path)).map_err(|e| remote(e.to_string()))?;
        let etag = meta.e_tag.ok_or_else(|| {
            remote("the store gives the object no ETag, so a replaced object could not be noticed".into())
        })?;
        tracing::info!(object = %name, size = meta.size, %etag, "S3 golden image opened");
        Ok(Self { store, path, size: meta.size, etag, runtime, name, fetch_bytes })
    }
}

impl GoldenImage for S3Image {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = crate::within_image(buf, offset, self.size);
        if len == 0 {
            return Ok(());
        }
        let end = offset + len as u64;
        let options = GetOptions {
            range: Some(GetRange::Bounded(offset..end)),
            if_match: Some(self.etag.clone()),
            ..GetOptions::default()
        };
        let failed = |e: &dyn std::fmt::Display| io::Error::other(format!("{}: GET {offset}..{end}: {e}", self.name));
        let wanted = &mut buf[..len];
        let got = self.runtime.block_on(async {
            let result = self.store.get_opts(&self.path, options).await.map_err(|e| failed(&e))?;
            match (&result.meta.e_tag, result.meta.size) {
                (Some(etag), size) if *etag == self.etag && size == self.size => {}
                (etag, size) => {
                    return Err(failed(&format!(
                        "the object was replaced in the store: it is now {size} bytes with ETag {}, it was {} with {}",
                        etag.as_deref().unwrap_or("none"),
                        self.size,
                        self.etag
                    )))
                }
            }
            body_into(result, wanted).await.map_err(|e| failed(&e))
        })?;
        if got != len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{}: asked for {len} bytes at {offset}, got {got}", self.name),
            ));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        self.name.clone()
    }

    fn identity(&self) -> Option<String> {
        Some(format!("{} etag {}", self.name, self.etag))
    }

    fn preferred_fetch_bytes(&self) -> Option<u64> {
        Some(self.fetch_bytes)
    }
}

/// Objects under a prefix of a bucket, put whole and fetched whole (a multipart upload
/// completes, or leaves no object).
pub struct S3Bucket {
    store: Arc<dyn ObjectStore>,
    runtime: tokio::runtime::Runtime,
    bucket: String,
    prefix: String,
}

/// Bytes an upload sends per part, and a fetch asks for per GET.
const PART_BYTES: usize = 16 << 20;
/// The most parts an S3 multipart upload may have.
const MAX_PARTS: u64 = 10_000;

impl S3Bucket {
    /// `prefix`: the keys' common start (`a/b` puts `NAME` at `a/b/NAME`); may be empty.
    pub fn from_env(bucket: &str, prefix: &str) -> Result<Self, SourceError> {
        let prefix = prefix.trim_matches('/').to_owned();
        let (store, runtime) = client(bucket, &format!("s3://{bucket}/{prefix}"))?;
        Ok(Self { store, runtime, bucket: bucket.to_owned(), prefix })
    }

    fn path(&self, name: &str) -> ObjectPath {
        match self.prefix.as_str() {
            "" => ObjectPath::from(name),
            prefix => ObjectPath::from(format!("{prefix}/{name}")),
        }
    }

    fn failed(&self, name: &str, e: impl std::fmt::Display) -> io::Error {
        io::Error::other(format!("s3://{}/{}: {e}", self.bucket, self.path(name)))
    }

    /// Uploads local file `from` as `name`, in parts sent one after the other; an upload that
    /// fails is aborted, leaving neither an object nor parts kept (and billed) by the store.
    pub fn put_file(&self, name: &str, from: &Path) -> io::Result<()> {
        let mut file = std::fs::File::open(from)?;
        let size = file.metadata()?.len();
        // S3 takes at most 10,000 parts: larger ones for a file that would need more.
        let part_bytes = (PART_BYTES as u64).max(size.div_ceil(MAX_PARTS)) as usize;
        let path = self.path(name);
        self.runtime.block_on(async {
            let mut upload = self.store.put_multipart(&path).await.map_err(|e| self.failed(name, e))?;
            let sent = async {
                let mut left = size;
                while left > 0 {
                    let mut part = vec![0u8; part_bytes.min(left as usize)];
                    file.read_exact(&mut part)?;
                    left -= part.len() as u64;
                    upload.put_part(object_store::PutPayload::from(part)).await.map_err(|e| self.failed(name, e))?;
                }
                upload.complete().await.map(|_| ()).map_err(|e| self.failed(name, e))
            }
            .await;
            if sent.is_err() {
                upload.abort().await.ok();
            }
            sent
        })
    }

    pub fn put_bytes(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        let payload = object_store::PutPayload::from(bytes.to_vec());
        self.runtime.block_on(self.store.put(&self.path(name), payload)).map(|_| ()).map_err(|e| self.failed(name, e))
    }

    /// Fetches `name`, which must be `bytes` long, into new local file `to`, a range at a time.
    pub fn get_file(&self, name: &str, to: &Path, bytes: u64) -> io::Result<()> {
        let path = self.path(name);
        let size = self.runtime.block_on(self.store.head(&path)).map_err(|e| self.failed(name, e))?.size;
        if size != bytes {
            return Err(self.failed(name, format!("{size} bytes, not the {bytes} expected")));
        }
        let mut out = std::fs::OpenOptions::new().write(true).create_new(true).open(to)?;
        let mut buffer = vec![0u8; PART_BYTES.min(size as usize)];
        let mut at = 0u64;
        while at < size {
            let end = (at + PART_BYTES as u64).min(size);
            let part = &mut buffer[..(end - at) as usize];
            self.get_range_into(name, &path, at, part)?;
            out.write_all(part)?;
            at = end;
        }
        out.sync_all()
    }

    /// Fetches `name` whole, refusing one over `limit` bytes.
    pub fn get_bytes(&self, name: &str, limit: u64) -> io::Result<Vec<u8>> {
        let path = self.path(name);
        let size = self.runtime.block_on(self.store.head(&path)).map_err(|e| self.failed(name, e))?.size;
        if size > limit {
            return Err(self.failed(name, format!("{size} bytes, more than the {limit} expected")));
        }
        let mut bytes = vec![0u8; size as usize];
        self.get_range_into(name, &path, 0, &mut bytes)?;
        Ok(bytes)
    }

    /// A GET of `buf.len()` bytes of `name` at `at` into `buf`, all of them.
    fn get_range_into(&self, name: &str, path: &ObjectPath, at: u64, buf: &mut [u8]) -> io::Result<()> {
        let range = GetRange::Bounded(at..at + buf.len() as u64);
        let options = GetOptions { range: Some(range), ..GetOptions::default() };
        let got = self
            .runtime
            .block_on(async {
                let result = self.store.get_opts(path, options).await.map_err(|e| e.to_string())?;
                body_into(result, buf).await
            })
            .map_err(|e| self.failed(name, e))?;
        if got != buf.len() {
            return Err(self.failed(name, format!("asked for {} bytes at {at}, got {got}", buf.len())));
        }
        Ok(())
    }

    /// `s3://BUCKET/PREFIX`.
    pub fn describe(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.prefix)
    }
}
