//! What a VM's overlay leaves behind so that the next process can rebuild it: with the pages in
//! its arena (each stamped with the block it holds and the sequence number of the write that put
//! it there) and its spill file, a summary of each spill segment and a log of zeroed ranges.
//!
//! Recovery is a log-structured file system's roll-forward in miniature. Every copy of a block
//! the overlay makes gets a new sequence number (a write placing it anew, a compaction moving it)
//! except the one that only changes its medium (a segment's pages going to disk keep theirs, the
//! data being the same); a block is overwritten in place only where it has no other copy. So
//! for each block, the copy with the highest number is its current contents, unless a zeroed
//! range with a higher number covers it. Released copies need no record: a newer copy or a zero
//! record outranks them, and a trimmed block may read as anything (NBD leaves its contents
//! unspecified until it is written again). Nothing is synced: the state outlives the process in
//! the page cache and tmpfs, not a host crash, which takes the VMs with it.
//!
//! - **Segment summaries**: 8 KiB per segment, at `segment × 8 KiB` in their file, a 16-byte
//!   entry per slot (block, sequence number; 0 for none), written once the segment's data is
//!   written and before its pages are freed. A summary torn by a crash mixes entries of the
//!   segment's present with entries of its past; those name copies that were all outranked
//!   before the segment was reused.
//! - **Zero log**: 32-byte records (first block, end block, sequence number, check) appended
//!   before a WRITE_ZEROES takes effect, each once an end marker is behind it. It is rewritten
//!   whole, as the zeroed ranges less the blocks written since, when it grows long: into the
//!   other of two regions, then the header (one 32-byte write, which a crash cannot tear)
//!   switches to it.

use std::collections::{BTreeMap, HashMap};

use crate::arena::{Owner, Page};
use crate::error::{EngineError, Result};
use crate::store::BackingFile;
use crate::units::{BlockIndex, BLOCKS_PER_SEGMENT};

/// Bytes of one segment's summary.
pub const SUMMARY_BYTES: u64 = (BLOCKS_PER_SEGMENT * 16) as u64;

const ZERO_LOG_MAGIC: u64 = 0x6f76_7370_7a65_726f; // "ovspzero"
const RECORD_BYTES: u64 = 32;
/// Where each region of the zero log starts: the second far out in a sparse file.
const REGION_OFFSETS: [u64; 2] = [4096, 1 << 40];

/// The files beside a VM's arena and spill file that a recovery reads.
pub struct StateFiles {
    pub segments: Box<dyn BackingFile>,
    pub zeros: Box<dyn BackingFile>,
}

/// One zeroing: blocks `[first, end)` read as zeroes from write `seq` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroRecord {
    pub first: u64,
    pub end: u64,
    pub seq: u64,
}

fn check(words: [u64; 3], generation: u64) -> u64 {
    (words[0] ^ words[1].rotate_left(17) ^ words[2].rotate_left(41) ^ generation.rotate_left(7)) ^ ZERO_LOG_MAGIC
}

fn encode(words: [u64; 4]) -> [u8; 32] {
    let mut bytes = [0u8; 32];
    for (chunk, word) in bytes.chunks_exact_mut(8).zip(words) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    bytes
}

fn decode(bytes: &[u8]) -> [u64; 4] {
    let mut words = [0u64; 4];
    for (word, chunk) in words.iter_mut().zip(bytes.chunks_exact(8)) {
        *word = u64::from_le_bytes(chunk.try_into().expect("8-byte chunks"));
    }
    words
}

fn record_bytes(record: ZeroRecord, generation: u64) -> [u8; 32] {
    let words = [record.first, record.end, record.seq];
    encode([words[0], words[1], words[2], check(words, generation)])
}

/// The log of zeroed ranges.
pub(crate) struct ZeroLog {
    file: Box<dyn BackingFile>,
    region: usize,
    generation: u64,
    records: u64,
    /// Records the last rewrite left (0 before any).
    rewritten_to: u64,
}

impl ZeroLog {
    pub fn create(file: Box<dyn BackingFile>) -> Result<Self> {
        let mut log = Self { file, region: 0, generation: 1, records: 0, rewritten_to: 0 };
        log.write_header()?;
        Ok(log)
    }

    /// Opens a log a previous process left, with its records in the order they were made.
    pub fn open(mut file: Box<dyn BackingFile>) -> Result<(Self, Vec<ZeroRecord>)> {
        let mut header = [0u8; 32];
        let [magic, region, generation, sum] = match file.read_at(&mut header, 0) {
            Ok(()) => decode(&header),
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => [0; 4],
            Err(error) => return Err(EngineError::from_io("reading the zero log", error)),
        };
        if magic != ZERO_LOG_MAGIC || region > 1 || sum != check([magic, region, generation], 0) {
            return Err(EngineError::Corrupt("the zero log's header is not one overspill wrote".into()));
        }
        let region = region as usize;
        let mut records = Vec::new();
        let mut bytes = [0u8; RECORD_BYTES as usize];
        loop {
            let offset = REGION_OFFSETS[region] + records.len() as u64 * RECORD_BYTES;
            match file.read_at(&mut bytes, offset) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => break,
                Err(error) => return Err(EngineError::from_io("reading the zero log", error)),
            }
            let [first, end, seq, sum] = decode(&bytes);
            // The first record that does not check out ends the log: never written, or left
            // from the region's previous use.
            if sum != check([first, end, seq], generation) || seq == 0 || first >= end {
                break;
            }
            records.push(ZeroRecord { first, end, seq });
        }
        let count = records.len() as u64;
        Ok((Self { file, region, generation, records: count, rewritten_to: 0 }, records))
    }

    fn write_header(&mut self) -> Result<()> {
        let words = [ZERO_LOG_MAGIC, self.region as u64, self.generation];
        let header = encode([words[0], words[1], words[2], check(words, 0)]);
        self.file.write_at(&header, 0).map_err(|e| EngineError::from_io("writing the zero log", e))
    }

    /// Appends `record`, with a record that cannot check out after it, written first: the
    /// region may hold, beyond the log's end, records of this generation that a rewrite killed
    /// before its header switch left (a later process rewrites into the same region with the
    /// same generation), which must never read as part of the log. Two writes of 32 bytes, each
    /// within a page, so that a kill cannot land the record and not the marker (a kill between
    /// the pages of one write can).
    pub fn append(&mut self, record: ZeroRecord) -> Result<()> {
        let offset = REGION_OFFSETS[self.region] + self.records * RECORD_BYTES;
        let io = |e| EngineError::from_io("writing the zero log", e);
        self.file.write_at(&[0u8; RECORD_BYTES as usize], offset + RECORD_BYTES).map_err(io)?;
        self.file.write_at(&record_bytes(record, self.generation), offset).map_err(io)?;
        self.records += 1;
        Ok(())
    }

    pub fn records(&self) -> u64 {
        self.records
    }

    /// The records the last rewrite left: a log is worth rewriting again only once it has grown
    /// well past them.
    pub fn rewritten_to(&self) -> u64 {
        self.rewritten_to
    }

    /// Replaces the log by `records`: written into the other region, then switched to. On
    /// error the log is as it was.
    pub fn rewrite(&mut self, records: &[ZeroRecord]) -> Result<()> {
        let (region, generation) = (1 - self.region, self.generation + 1);
        let mut bytes = Vec::with_capacity((records.len() + 1) * RECORD_BYTES as usize);
        for record in records {
            bytes.extend_from_slice(&record_bytes(*record, generation));
        }
        // A record that cannot check out ends the region, whatever was there before.
        bytes.extend_from_slice(&[0u8; RECORD_BYTES as usize]);
        let io = |e| EngineError::from_io("rewriting the zero log", e);
        self.file.write_at(&bytes, REGION_OFFSETS[region]).map_err(io)?;
        let before = (self.region, self.generation, self.records);
        (self.region, self.generation, self.records) = (region, generation, records.len() as u64);
        if let Err(error) = self.write_header() {
            (self.region, self.generation, self.records) = before;
            return Err(error);
        }
        self.rewritten_to = self.records;
        // The old region is dead now; a failed punch only keeps its memory.
        let len = ((before.2 + 1) * RECORD_BYTES).next_multiple_of(4096);
        if let Err(error) = self.file.punch_hole(REGION_OFFSETS[before.0], len) {
            tracing::debug!(%error, "could not punch the zero log's old region");
        }
        Ok(())
    }

    pub fn keep(&mut self) {
        self.file.keep();
    }

    pub fn own(&mut self) {
        self.file.own();
    }
}

/// The summaries of a VM's spill segments.
pub(crate) struct SegmentSummaries {
    file: Box<dyn BackingFile>,
}

impl SegmentSummaries {
    pub fn new(file: Box<dyn BackingFile>) -> Self {
        Self { file }
    }

    /// Records which block (and copy) each page of segment `id` holds.
    pub fn write(&mut self, id: u32, pages: &[Page]) -> std::io::Result<()> {
        let mut bytes = vec![0u8; SUMMARY_BYTES as usize];
        for (entry, page) in bytes.chunks_exact_mut(16).zip(pages) {
            if let Some(owner) = page.owner() {
                entry[..8].copy_from_slice(&owner.block.0.to_le_bytes());
                entry[8..].copy_from_slice(&owner.seq.to_le_bytes());
            }
        }
        self.file.write_at(&bytes, u64::from(id) * SUMMARY_BYTES)
    }

    /// Forgets a segment that holds nothing any more.
    pub fn clear(&mut self, id: u32) {
        if let Err(error) = self.file.punch_hole(u64::from(id) * SUMMARY_BYTES, SUMMARY_BYTES) {
            tracing::debug!(%error, segment = id, "could not clear a segment's summary");
        }
    }

    /// Every segment's slots as summarised, for `segments` segments.
    pub fn read(&mut self, segments: u32) -> Result<Vec<Vec<Option<Owner>>>> {
        let mut bytes = vec![0u8; SUMMARY_BYTES as usize];
        (0..segments)
            .map(|id| {
                match self.file.read_at(&mut bytes, u64::from(id) * SUMMARY_BYTES) {
                    Ok(()) => {}
                    // A segment written by a process killed before its summary was: its pages
                    // are still in the arena (they are freed only after the summary is written).
                    Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => bytes.fill(0),
                    Err(error) => return Err(EngineError::from_io("reading a segment summary", error)),
                }
                Ok(bytes
                    .chunks_exact(16)
                    .map(|entry| {
                        let block = u64::from_le_bytes(entry[..8].try_into().expect("8 bytes"));
                        let seq = u64::from_le_bytes(entry[8..].try_into().expect("8 bytes"));
                        (seq != 0).then_some(Owner { block: BlockIndex(block), seq })
                    })
                    .collect())
            })
            .collect()
    }

    pub fn keep(&mut self) {
        self.file.keep();
    }

    pub fn own(&mut self) {
        self.file.own();
    }
}

/// Where a copy of a block found by a recovery is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyAt {
    /// A page of the arena, by index in the list of live pages.
    Page(usize),
    /// A slot of a spill segment on disk.
    Spill { segment: u32, slot: u16 },
}

/// The outcome of a recovery's scan, before anything is rebuilt: each block's current copy and
/// the zeroed ranges. Pure, so that the crash simulation checks exactly what a server rebuilds.
#[derive(Debug, Default)]
pub struct Resolution {
    pub current: HashMap<u64, (u64, CopyAt)>,
    pub zeros: Vec<(u64, u64)>,
    pub max_seq: u64,
}

/// The latest zeroing of each block, as disjoint ranges `start → (end, seq)`.
#[derive(Default)]
struct Painted(BTreeMap<u64, (u64, u64)>);

impl Painted {
    fn paint(&mut self, first: u64, end: u64, seq: u64) {
        // Cut what overlaps [first, end), keeping the parts outside it.
        let overlapping: Vec<(u64, (u64, u64))> =
            self.0.range(..end).rev().take_while(|(_, (e, _))| *e > first).map(|(&s, &v)| (s, v)).collect();
        for (start, (stop, old)) in overlapping {
            self.0.remove(&start);
            if start < first {
                self.0.insert(start, (first, old));
            }
            if stop > end {
                self.0.insert(end, (stop, old));
            }
        }
        self.0.insert(first, (end, seq));
    }

    fn seq_at(&self, block: u64) -> u64 {
        self.0.range(..=block).next_back().filter(|(_, (end, _))| block < *end).map_or(0, |(_, (_, seq))| *seq)
    }
}

/// Decides every block's current contents from the copies found and the zero records.
/// `disk_blocks` bounds block numbers: a copy beyond the disk is corrupt state.
pub fn resolve(
    copies: impl IntoIterator<Item = (Owner, CopyAt)>,
    zero_records: &[ZeroRecord],
    disk_blocks: u64,
) -> Result<Resolution> {
    let mut painted = Painted::default();
    let mut max_seq = 0;
    for record in zero_records {
        if record.end > disk_blocks {
            return Err(EngineError::Corrupt(format!(
                "a zeroed range ends at block {}, beyond the disk's {disk_blocks}",
                record.end
            )));
        }
        painted.paint(record.first, record.end, record.seq);
        max_seq = max_seq.max(record.seq);
    }
    let mut current: HashMap<u64, (u64, CopyAt)> = HashMap::new();
    for (owner, at) in copies {
        if owner.block.0 >= disk_blocks {
            return Err(EngineError::Corrupt(format!(
                "a copy of block {} found, beyond the disk's {disk_blocks} blocks",
                owner.block.0
            )));
        }
        max_seq = max_seq.max(owner.seq);
        let entry = current.entry(owner.block.0).or_insert((owner.seq, at));
        // Ties are a page and its own segment on disk: the same bytes; the disk's frees memory.
        if owner.seq > entry.0 || (owner.seq == entry.0 && matches!(at, CopyAt::Spill { .. })) {
            *entry = (owner.seq, at);
        }
    }
    current.retain(|&block, (seq, _)| painted.seq_at(block) < *seq);
    let mut zeros: Vec<(u64, u64)> = Vec::new();
    for (&start, &(end, _)) in &painted.0 {
        match zeros.last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ => zeros.push((start, end)),
        }
    }
    Ok(Resolution { current, zeros, max_seq })
}

/// What a recovery finds in a VM's state files beside its arena, and what it decides from it.
pub struct Found {
    pub resolution: Resolution,
    /// Each spill segment's slots, as summarised (empty without a spill log).
    pub summary: Vec<Vec<Option<Owner>>>,
    pub(crate) zero_log: ZeroLog,
    pub(crate) summaries: SegmentSummaries,
}

/// Reads a VM's state files and resolves every block: `pages` are what the headers of the
/// arena's pages in use say, in the order [`CopyAt::Page`] counts them; `spill_segments` is the
/// spill file's length in whole segments, `None` for a VM without a spill log. Exactly what a
/// recovery rebuilds from, so that the crash simulation can check it at every crash point.
pub fn scan(pages: &[Owner], files: StateFiles, spill_segments: Option<u32>, disk_blocks: u64) -> Result<Found> {
    let (zero_log, zero_records) = ZeroLog::open(files.zeros)?;
    let mut summaries = SegmentSummaries::new(files.segments);
    let summary = match spill_segments {
        Some(segments) => summaries.read(segments)?,
        None => Vec::new(),
    };
    let copies = pages.iter().enumerate().map(|(i, owner)| (*owner, CopyAt::Page(i))).chain(
        summary.iter().enumerate().flat_map(|(segment, slots)| {
            slots.iter().enumerate().filter_map(move |(slot, owner)| {
                // Segments are below MAX_SPILL_SEGMENTS (checked when the log is rebuilt) and
                // slots below 512.
                owner.map(|owner| (owner, CopyAt::Spill { segment: segment as u32, slot: slot as u16 }))
            })
        }),
    );
    let resolution = resolve(copies, &zero_records, disk_blocks)?;
    Ok(Found { resolution, summary, zero_log, summaries })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemFile;

    #[test]
    fn the_latest_copy_wins_unless_a_later_zeroing_covers_it() {
        let owner = |block, seq| Owner { block: BlockIndex(block), seq };
        let copies = [
            (owner(1, 5), CopyAt::Spill { segment: 0, slot: 0 }),
            (owner(1, 9), CopyAt::Page(0)),
            (owner(2, 3), CopyAt::Page(1)),
            (owner(3, 12), CopyAt::Page(2)),
            (owner(4, 7), CopyAt::Page(3)),
            (owner(4, 7), CopyAt::Spill { segment: 1, slot: 4 }),
        ];
        let zeros = [ZeroRecord { first: 2, end: 10, seq: 10 }, ZeroRecord { first: 0, end: 3, seq: 4 }];
        let resolved = resolve(copies, &zeros, 100).expect("resolved");
        assert_eq!(resolved.current.get(&1), Some(&(9, CopyAt::Page(0))), "the newer copy");
        assert_eq!(resolved.current.get(&2), None, "zeroed at 10 after its copy at 3");
        assert_eq!(resolved.current.get(&3), Some(&(12, CopyAt::Page(2))), "written after the zeroing");
        assert_eq!(resolved.current.get(&4), None, "zeroed after its copy at 7");
        assert_eq!(resolved.zeros, vec![(0, 10)]);
        assert_eq!(resolved.max_seq, 12);
        assert!(matches!(resolve([(owner(100, 1), CopyAt::Page(0))], &[], 100), Err(EngineError::Corrupt(_))));
        let tie =
            resolve([(owner(4, 7), CopyAt::Page(3)), (owner(4, 7), CopyAt::Spill { segment: 1, slot: 4 })], &[], 9);
        assert_eq!(tie.expect("resolved").current[&4].1, CopyAt::Spill { segment: 1, slot: 4 });
    }

    /// One file that each process of a test opens anew.
    struct Shared(std::sync::Arc<std::sync::Mutex<MemFile>>);

    impl BackingFile for Shared {
        fn write_at(&mut self, data: &[u8], offset: u64) -> std::io::Result<()> {
            self.0.lock().expect("lock").write_at(data, offset)
        }
        fn read_at(&mut self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.0.lock().expect("lock").read_at(buf, offset)
        }
        fn punch_hole(&mut self, offset: u64, len: u64) -> std::io::Result<()> {
            self.0.lock().expect("lock").punch_hole(offset, len)
        }
        fn allocated_bytes(&self) -> std::io::Result<u64> {
            self.0.lock().expect("lock").allocated_bytes()
        }
        fn path(&self) -> Option<&std::path::Path> {
            None
        }
    }

    #[test]
    fn the_zero_log_reads_back_what_was_appended_and_what_a_rewrite_left() {
        let memory = std::sync::Arc::new(std::sync::Mutex::new(MemFile::default()));
        let file = || Box::new(Shared(memory.clone()));
        let mut log = ZeroLog::create(file()).expect("log");
        let records: Vec<ZeroRecord> = (1..200).map(|i| ZeroRecord { first: i, end: i + 5, seq: i * 2 }).collect();
        for record in &records {
            log.append(*record).expect("append");
        }
        let (_, read) = ZeroLog::open(file()).expect("open");
        assert_eq!(read, records);
        log.rewrite(&records[..3]).expect("rewrite");
        log.append(ZeroRecord { first: 7, end: 8, seq: 999 }).expect("append");
        let (reopened, read) = ZeroLog::open(file()).expect("open");
        assert_eq!(read.len(), 4);
        assert_eq!(read[3].seq, 999);
        assert_eq!(reopened.records(), 4);
        // Twice rewritten: back in the first region, whose old records must not come back.
        let mut log = reopened;
        log.rewrite(&records[..1]).expect("rewrite");
        let (_, read) = ZeroLog::open(file()).expect("open");
        assert_eq!(read, records[..1]);
    }

    /// A process killed in a rewrite, after the records and before the header switch, leaves
    /// them in the other region under the next generation. The next process rewrites into that
    /// region under that same generation, fewer records, then appends over its end marker:
    /// the killed rewrite's records beyond must not come back with the appended one (their
    /// zeroes would outrank the first write after the recovery, which reuses their number).
    #[test]
    fn a_rewrite_killed_before_its_switch_leaves_nothing_a_later_log_reads() {
        let memory = std::sync::Arc::new(std::sync::Mutex::new(MemFile::default()));
        let file = || Box::new(Shared(memory.clone()));
        let mut first = ZeroLog::create(file()).expect("log");
        first.append(ZeroRecord { first: 0, end: 8, seq: 1 }).expect("append");
        // The killed rewrite: its records written, the header never switched.
        let killed: Vec<u8> = (0..6)
            .flat_map(|i| record_bytes(ZeroRecord { first: 100 + 10 * i, end: 105 + 10 * i, seq: 2 }, 2))
            .collect();
        memory.lock().expect("lock").write_at(&killed, REGION_OFFSETS[1]).expect("killed rewrite");

        let (mut second, read) = ZeroLog::open(file()).expect("open after the kill");
        assert_eq!(read, [ZeroRecord { first: 0, end: 8, seq: 1 }]);
        second.rewrite(&[ZeroRecord { first: 0, end: 4, seq: 2 }]).expect("rewrite");
        second.append(ZeroRecord { first: 50, end: 60, seq: 3 }).expect("append");
        let (_, read) = ZeroLog::open(file()).expect("open after a second kill");
        assert_eq!(read, [ZeroRecord { first: 0, end: 4, seq: 2 }, ZeroRecord { first: 50, end: 60, seq: 3 }]);
    }
}

#[cfg(test)]
mod summary_tests {
    use super::*;
    use crate::arena::Arena;
    use crate::store::ScratchFile;

    #[test]
    fn a_segment_killed_before_its_summary_reads_as_unsummarised() {
        let dir = tempfile::tempdir().expect("tempdir");
        let arena = Arena::in_memory(8).expect("arena");
        let page = arena.alloc().expect("page");
        page.set_owner(Owner { block: BlockIndex(42), seq: 7 });
        let file = ScratchFile::create(dir.path(), "segments", 0).expect("file");
        let mut summaries = SegmentSummaries::new(Box::new(file));
        summaries.write(0, std::slice::from_ref(&page)).expect("summary of segment 0");
        // The spill file holds three segments; the process died before summarising 1 and 2.
        let read = summaries.read(3).expect("read");
        assert_eq!(read[0][0], Some(Owner { block: BlockIndex(42), seq: 7 }));
        assert!(read[1].iter().chain(&read[2]).all(Option::is_none));
    }
}
