//! Golden images: read-only by construction.
//!
//! A [`GoldenImage`] offers only reads, so no code path in the engine can write one. A raw file is
//! opened without write permission as a second line of defence.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use bytes::Bytes;

use crate::error::{EngineError, Result};

/// Reads that reached an image's underlying storage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceReads {
    pub ops: u64,
    pub bytes: u64,
}

/// The shared, never-written base of every overlay. An image that only adds to another is an
/// [`ImageLayer`], which forwards every method; a new method must be forwarded there too.
pub trait GoldenImage: Send + Sync {
    fn size(&self) -> u64;
    /// Fills `buf` from `offset`; bytes past the end of the image read as zero.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Like [`Self::read_at`], and says what it cost the storage behind the image: one read of
    /// `buf.len()` bytes for a plain image, only the misses for a cached one.
    fn read_counted(&self, buf: &mut [u8], offset: u64) -> io::Result<SourceReads> {
        self.read_at(buf, offset)?;
        Ok(SourceReads { ops: 1, bytes: buf.len() as u64 })
    }
    /// Like [`Self::read_counted`] of one buffer as long as all of `bufs`, filled in order: a
    /// read cache fetching a run of chunks reads them straight into the buffers it keeps. The
    /// default reads into one buffer and copies; a file does it in one `preadv`.
    fn read_vectored_counted(&self, bufs: &mut [&mut [u8]], offset: u64) -> io::Result<SourceReads> {
        if let [buf] = bufs {
            return self.read_counted(buf, offset);
        }
        let mut whole = vec![0u8; bufs.iter().map(|buf| buf.len()).sum()];
        let reads = self.read_counted(&mut whole, offset)?;
        let mut rest = whole.as_slice();
        for buf in bufs.iter_mut() {
            let (part, tail) = rest.split_at(buf.len());
            buf.copy_from_slice(part);
            rest = tail;
        }
        Ok(reads)
    }
    /// Like [`Self::read_counted`] of `len` bytes, as pieces to be sent in order rather than
    /// copied into a buffer: a read cache hands out its chunks' bytes themselves. The default
    /// reads into one new buffer.
    fn read_shared(&self, offset: u64, len: usize) -> io::Result<(Vec<Bytes>, SourceReads)> {
        let mut buf = vec![0u8; len];
        let reads = self.read_counted(&mut buf, offset)?;
        Ok((vec![Bytes::from(buf)], reads))
    }
    /// Like [`Self::read_at`], past any cache in front: a read of the whole image (its digest,
    /// `overspill_server::image_digest`) must not push what the VMs read out of the caches.
    fn read_uncached(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_at(buf, offset)
    }
    fn describe(&self) -> String;
    /// What tells these exact contents from other contents under the same name, for state that
    /// outlives the process: a file's device, inode, size and modification time; an S3 object's
    /// ETag; an RBD snapshot's image and snapshot ids (a snapshot never changes, but one deleted
    /// and made again under its name is another). `None`: nothing to compare.
    fn identity(&self) -> Option<String> {
        None
    }
    /// Whether `recorded`, an [`identity`](Self::identity) an earlier server wrote down, names
    /// these contents. Equality, unless a source's identity has grown since (it then still
    /// knows its older, shorter form).
    fn matches_identity(&self, recorded: &str) -> bool {
        self.identity().as_deref() == Some(recorded)
    }
    /// `Err` naming the file once a file under the image was written, cut or grown since it was
    /// opened (its size or modification time moved), found from the open file, not its path (a
    /// file renamed over it leaves the one served untouched). Files check it after every read,
    /// so that no read serves bytes of a change; the server watches it to end the VMs over it.
    /// The default has nothing to check.
    fn unchanged(&self) -> io::Result<()> {
        Ok(())
    }
    /// The chunk a read cache in front should fetch at a time, if not the default: remote
    /// stores, where every request costs a round trip, want large ones.
    fn preferred_fetch_bytes(&self) -> Option<u64> {
        None
    }
    /// How `[offset, offset + len)` is stored, as extents in order from `offset`: they cover
    /// at least one byte and at most `len` (a reader may stop early, at the end of a table, and
    /// be asked again). `offset + len` lies within the image. The default knows nothing and
    /// calls it all data, which is always a true answer, only not a useful one.
    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        let _ = offset;
        Ok(vec![Extent { len, state: Allocation::Data }])
    }
    /// Which of the image's layers holds each part of `[offset, offset + len)`, in order from
    /// `offset` and covering at least one byte of it: 1 for the image itself, 2 for the file
    /// under it (a qcow2 backing file), and so on; 0 where none does (a hole of every layer).
    /// The default: an image of one layer, as its extents say.
    fn layer_runs(&self, offset: u64, len: u64) -> io::Result<Vec<LayerRun>> {
        let extents = self.extents(offset, len)?;
        Ok(extents
            .into_iter()
            .map(|e| LayerRun { len: e.len, depth: u32::from(e.state != Allocation::Hole) })
            .collect())
    }
}

/// A run of an image by the layer that holds it (see [`GoldenImage::layer_runs`], and the
/// overlay's `allocation_depth`, where the VM's own overlay is layer 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRun {
    pub len: u64,
    pub depth: u32,
}

/// An image that is another one with something added (a name in the logs, a hold that logs its
/// release): every method of [`GoldenImage`] goes to the image [`below`](Self::below) through
/// the one impl that follows, so a wrapper cannot lose a fast path by forgetting to forward it
/// (a method added to the trait is added there).
pub trait ImageLayer: Send + Sync {
    fn below(&self) -> &dyn GoldenImage;
    /// What the layer is called, by default the image's own description.
    fn describe(&self) -> String {
        self.below().describe()
    }
}

impl<L: ImageLayer> GoldenImage for L {
    fn size(&self) -> u64 {
        self.below().size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.below().read_at(buf, offset)
    }
    fn read_counted(&self, buf: &mut [u8], offset: u64) -> io::Result<SourceReads> {
        self.below().read_counted(buf, offset)
    }
    fn read_vectored_counted(&self, bufs: &mut [&mut [u8]], offset: u64) -> io::Result<SourceReads> {
        self.below().read_vectored_counted(bufs, offset)
    }
    fn read_shared(&self, offset: u64, len: usize) -> io::Result<(Vec<Bytes>, SourceReads)> {
        self.below().read_shared(offset, len)
    }
    fn read_uncached(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.below().read_uncached(buf, offset)
    }
    fn describe(&self) -> String {
        ImageLayer::describe(self)
    }
    fn identity(&self) -> Option<String> {
        self.below().identity()
    }
    fn matches_identity(&self, recorded: &str) -> bool {
        self.below().matches_identity(recorded)
    }
    fn unchanged(&self) -> io::Result<()> {
        self.below().unchanged()
    }
    fn preferred_fetch_bytes(&self) -> Option<u64> {
        self.below().preferred_fetch_bytes()
    }
    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        self.below().extents(offset, len)
    }
    fn layer_runs(&self, offset: u64, len: u64) -> io::Result<Vec<LayerRun>> {
        self.below().layer_runs(offset, len)
    }
}

/// How a range of an image is stored: what NBD's block status (`base:allocation`) reports, and
/// what lets a copy skip what was never written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocation {
    /// Stored data (which may happen to be zeroes).
    Data,
    /// Stored, but known to read as zeroes: a qcow2 zero cluster, a range a VM wrote zeroes to.
    Zero,
    /// Not stored at all, and reads as zeroes: a hole in a sparse file, an unallocated cluster.
    Hole,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub len: u64,
    pub state: Allocation,
}

/// Appends an extent, merged with the last one when both are stored the same way.
pub fn push_extent(extents: &mut Vec<Extent>, len: u64, state: Allocation) {
    if len == 0 {
        return;
    }
    match extents.last_mut() {
        Some(last) if last.state == state => last.len += len,
        _ => extents.push(Extent { len, state }),
    }
}

/// Appends a run held by layer `depth` to `runs`, merged into the last one if that is the same
/// layer's (nothing for an empty run), as [`push_extent`] does for extents.
pub fn push_layer_run(runs: &mut Vec<LayerRun>, len: u64, depth: u32) {
    match runs.last_mut() {
        _ if len == 0 => {}
        Some(last) if last.depth == depth => last.len += len,
        _ => runs.push(LayerRun { len, depth }),
    }
}

/// Appends the runs of `below` (the layer under an image, `len` bytes from `offset` on, holes
/// past its end) one layer deeper: what a layer does not hold itself, the one under it may.
pub fn push_layer_runs_below(
    runs: &mut Vec<LayerRun>,
    below: &dyn GoldenImage,
    offset: u64,
    len: u64,
) -> io::Result<()> {
    let inside = len.min(below.size().saturating_sub(offset));
    let mut got = 0;
    // A layer may answer a bounded piece at a time.
    while got < inside {
        let parts = below.layer_runs(offset + got, inside - got)?;
        if parts.is_empty() || parts.iter().any(|part| part.len == 0) {
            return Err(io::Error::other("a layer below reported no layer, or an empty one"));
        }
        for part in parts {
            let part_len = part.len.min(inside - got);
            push_layer_run(runs, part_len, if part.depth == 0 { 0 } else { part.depth + 1 });
            got += part_len;
        }
    }
    push_layer_run(runs, len - inside, 0);
    Ok(())
}

/// A raw disk image file.
#[derive(Debug)]
pub struct RawImage {
    file: File,
    size: u64,
    path: PathBuf,
    identity: String,
    opened: FileState,
}

/// What a write into a file moves: its size and modification time, as the open file tells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileState {
    len: u64,
    mtime: (i64, i64),
}

impl FileState {
    pub fn of(metadata: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self { len: metadata.len(), mtime: (metadata.mtime(), metadata.mtime_nsec()) }
    }

    /// `Err` naming `path` if `file` is no longer as it was when it was `self`. A write made
    /// through a shared mapping moves the modification time at its first fault on a clean page
    /// only: further writes to a page already dirty before the open go unseen.
    pub fn check(&self, file: &File, path: &Path) -> io::Result<()> {
        let now = Self::of(&file.metadata()?);
        if now == *self {
            return Ok(());
        }
        let what = if now.len != self.len {
            format!("its size went from {} to {} bytes", self.len, now.len)
        } else {
            "it was written".to_owned()
        };
        Err(io::Error::other(format!(
            "golden image {} changed while served ({what}): reads of it are refused rather than mix old \
             and new bytes",
            path.display()
        )))
    }
}

/// A file's identity for [`GoldenImage::identity`]: replacing the file (a new inode) or writing
/// into it (a new modification time) changes it.
pub fn file_identity(metadata: &std::fs::Metadata) -> String {
    use std::os::unix::fs::MetadataExt;
    format!(
        "file dev {} inode {} size {} mtime {}.{:09}",
        metadata.dev(),
        metadata.ino(),
        metadata.len(),
        metadata.mtime(),
        metadata.mtime_nsec()
    )
}

impl RawImage {
    pub fn open(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .open(path)
            .map_err(|source| EngineError::Io { what: "opening golden image", source })?;
        let metadata = file.metadata().map_err(|source| EngineError::Io { what: "stat golden image", source })?;
        if !metadata.is_file() {
            return Err(EngineError::Config(format!("{} is not a regular file", path.display())));
        }
        Ok(Self {
            file,
            size: metadata.len(),
            path: path.to_path_buf(),
            identity: file_identity(&metadata),
            opened: FileState::of(&metadata),
        })
    }
}

impl RawImage {
    /// The file ended at `at`: past the size it had when opened (a read of the last block,
    /// rounded up) that is zeroes; before, the file was cut short under the server (a `cp` over
    /// it truncates first), and its bytes there are not known.
    fn ended_at(&self, at: u64) -> io::Result<()> {
        if at < self.size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{} ends at byte {at}, but had {} bytes when opened: it was cut short",
                    self.path.display(),
                    self.size
                ),
            ));
        }
        Ok(())
    }
}

impl GoldenImage for RawImage {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let n = match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                self.ended_at(offset + done as u64)?;
                buf[done..].fill(0);
                break;
            }
            done += n;
        }
        // After the read: a write that began before it moved the modification time by now.
        self.opened.check(&self.file, &self.path)
    }

    fn read_vectored_counted(&self, bufs: &mut [&mut [u8]], offset: u64) -> io::Result<SourceReads> {
        let total: usize = bufs.iter().map(|buf| buf.len()).sum();
        let mut slices: Vec<io::IoSliceMut<'_>> = bufs.iter_mut().map(|buf| io::IoSliceMut::new(buf)).collect();
        let mut rest = &mut slices[..];
        let mut at = offset;
        // As `store::write_pages` writes a segment: again from where a short transfer stopped.
        while !rest.is_empty() {
            match rustix::io::preadv(&self.file, rest, at) {
                Ok(0) => {
                    // The end of the file: the rest reads as zero, as in `read_at`.
                    self.ended_at(at)?;
                    rest.iter_mut().for_each(|slice| slice.fill(0));
                    break;
                }
                Ok(n) => {
                    at += n as u64;
                    io::IoSliceMut::advance_slices(&mut rest, n);
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.opened.check(&self.file, &self.path)?;
        Ok(SourceReads { ops: 1, bytes: total as u64 })
    }

    fn unchanged(&self) -> io::Result<()> {
        self.opened.check(&self.file, &self.path)
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    /// The file's holes, from `SEEK_DATA`/`SEEK_HOLE`: a sparse golden image (what `qemu-img
    /// convert` and `cp --sparse` make) tells its clients which parts were never written.
    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        // Checked after the look, as a read is: a map of a file changed under the server
        // would tell holes where the guest reads data.
        let mapped = (|| -> io::Result<Vec<Extent>> {
            use rustix::fs::{seek, SeekFrom};
            let end = offset + len;
            // A file cut short under the server would report a hole, which a client takes for
            // zeroes without reading (as `read_at` refuses to serve them).
            let file_len = self.file.metadata()?.len();
            if end.min(self.size) > file_len {
                self.ended_at(file_len)?;
            }
            let mut extents = Vec::new();
            let mut at = offset;
            while at < end {
                let data = match seek(&self.file, SeekFrom::Data(at)) {
                    Ok(data) => data.min(end),
                    // Past the last data: a hole to the end of the file.
                    Err(rustix::io::Errno::NXIO) => end,
                    // A file system without hole reporting: all data, as the default says.
                    Err(rustix::io::Errno::INVAL | rustix::io::Errno::OPNOTSUPP) => {
                        push_extent(&mut extents, end - at, Allocation::Data);
                        break;
                    }
                    Err(e) => return Err(e.into()),
                };
                push_extent(&mut extents, data - at, Allocation::Hole);
                if data >= end {
                    break;
                }
                let hole = match seek(&self.file, SeekFrom::Hole(data)) {
                    Ok(hole) => hole.min(end),
                    Err(rustix::io::Errno::NXIO) => end,
                    Err(e) => return Err(e.into()),
                };
                push_extent(&mut extents, hole - data, Allocation::Data);
                at = hole;
            }
            Ok(extents)
        })();
        self.opened.check(&self.file, &self.path)?;
        mapped
    }

    fn identity(&self) -> Option<String> {
        Some(self.identity.clone())
    }
}

/// An image of zeroes that stores nothing: the planner's stand-in for a golden image whose
/// contents do not change any figure.
#[derive(Debug, Clone, Copy)]
pub struct ZeroImage {
    pub size: u64,
}

impl GoldenImage for ZeroImage {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], _offset: u64) -> io::Result<()> {
        buf.fill(0);
        Ok(())
    }

    fn describe(&self) -> String {
        format!("zeroes ({} bytes)", self.size)
    }
}

/// A golden image held in memory, for simulations and tests.
#[derive(Debug, Clone)]
pub struct MemImage {
    bytes: Vec<u8>,
}

impl MemImage {
    pub fn new(bytes: Vec<u8>) -> Self {
        Self { bytes }
    }
}

impl GoldenImage for MemImage {
    fn size(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(self.bytes.len());
        let end = start.saturating_add(buf.len()).min(self.bytes.len());
        let n = end - start;
        buf[..n].copy_from_slice(&self.bytes[start..end]);
        buf[n..].fill(0);
        Ok(())
    }

    fn describe(&self) -> String {
        format!("memory ({} bytes)", self.bytes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vectored_read_of_a_file_fills_each_buffer_in_order_and_zeroes_past_the_end() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("golden.raw");
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).expect("written");
        let image = RawImage::open(&path).expect("opened");
        for (offset, lens) in [(0u64, vec![4096, 4096, 1808]), (100, vec![1, 5000, 3000]), (8000, vec![1000, 4096])] {
            let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&len| vec![0xee; len]).collect();
            let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            let reads = image.read_vectored_counted(&mut views, offset).expect("read");
            let total: usize = lens.iter().sum();
            assert_eq!(reads, SourceReads { ops: 1, bytes: total as u64 });
            let mut expected = vec![0u8; total];
            let from = (offset as usize).min(bytes.len());
            let to = (offset as usize + total).min(bytes.len());
            expected[..to - from].copy_from_slice(&bytes[from..to]);
            assert_eq!(bufs.concat(), expected, "offset {offset}, buffers {lens:?}");
            let mut one = vec![0u8; total];
            image.read_at(&mut one, offset).expect("read");
            assert_eq!(one, expected, "read_at agrees");
        }
    }

    /// A golden file cut short under the server (`cp new.img golden.img` truncates it first)
    /// fails reads inside the size it was opened with: its bytes there are not known, and
    /// zeroes served for them would be taken for the image's (and kept by the read cache).
    #[test]
    fn a_file_cut_short_under_the_server_fails_reads_rather_than_read_zeroes() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("golden.raw");
        std::fs::write(&path, vec![0x5a; 5 * 4096 + 100]).expect("written");
        let image = RawImage::open(&path).expect("opened");
        let mut tail = vec![0xee; 8192];
        image.read_at(&mut tail, 4 * 4096).expect("the last block, rounded up past the end");
        assert!(tail[..4196].iter().all(|&b| b == 0x5a) && tail[4196..].iter().all(|&b| b == 0));
        std::fs::File::options().write(true).open(&path).and_then(|f| f.set_len(2 * 4096)).expect("truncated");
        let mut buf = vec![0u8; 4096];
        let error = image.read_at(&mut buf, 4096).expect_err("bytes still there, of a changed file");
        assert!(error.to_string().contains("its size went from 20580 to 8192 bytes"), "{error}");
        let error = image.read_at(&mut buf, 3 * 4096).expect_err("cut short");
        assert!(error.to_string().contains("cut short"), "{error}");
        let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
        image.read_vectored_counted(&mut [&mut a, &mut b], 4096).expect_err("cut short, vectored");
        image.extents(3 * 4096, 4096).expect_err("no hole told where the file was cut");
    }

    /// A golden file written in place under the server (same inode, same size): every read of
    /// it fails from then on, whether or not it touches what changed, and so does the check the
    /// server's watch makes.
    #[test]
    fn a_file_written_in_place_under_the_server_fails_every_read_after() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("golden.raw");
        std::fs::write(&path, vec![0x5a; 4 * 4096]).expect("written");
        let image = RawImage::open(&path).expect("opened");
        let mut buf = vec![0u8; 4096];
        image.read_at(&mut buf, 0).expect("unchanged");
        image.unchanged().expect("unchanged");
        // A modification time of its own, whatever the filesystem's timestamp granularity.
        let file = std::fs::File::options().write(true).open(&path).expect("open");
        file.write_all_at(&[0xee; 4096], 2 * 4096).expect("rewritten");
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(1);
        file.set_modified(later).expect("mtime");
        for offset in [0, 2 * 4096] {
            let error = image.read_at(&mut buf, offset).expect_err("a changed file");
            assert!(error.to_string().contains("it was written"), "{error}");
        }
        let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
        image.read_vectored_counted(&mut [&mut a, &mut b], 0).expect_err("a changed file, vectored");
        // Nor is a map of its holes told (an NBD read sends holes as zeroes without reading).
        image.extents(0, 4 * 4096).expect_err("a changed file's extents");
        assert!(image.unchanged().is_err());
    }

    #[test]
    fn the_default_vectored_read_is_one_read_of_the_whole() {
        let image = MemImage::new((0..=255u8).collect());
        let mut a = [0u8; 100];
        let mut b = [0u8; 200];
        let reads = image.read_vectored_counted(&mut [&mut a, &mut b], 10).expect("read");
        assert_eq!(reads, SourceReads { ops: 1, bytes: 300 });
        assert!(a.iter().enumerate().all(|(i, &x)| x == (10 + i) as u8));
        assert!(b[..146].iter().enumerate().all(|(i, &x)| x == (110 + i) as u8));
        assert!(b[146..].iter().all(|&x| x == 0), "past the end reads as zero");
    }
}
