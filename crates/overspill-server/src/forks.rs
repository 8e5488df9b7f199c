//! Forks (`overspill vm fork`): named VMs that start from a checkpoint of another VM's disk
//! (`IMAGE:@CHECKPOINT`, a layer of the image store) instead of from their image's staged
//! version. A fork holds no data of its own until it writes: it is a name pinned to a
//! checkpoint, so making a hundred copies nothing. Its overlay ends as any VM's does (a clean
//! disconnect, a reset) and its next connection starts from the checkpoint again; the pin lasts
//! until `vm drop`, after which the name is refused (never started from the image as if it had
//! been no fork) until `vm reset` clears it.
//!
//! The book of forks is one file in the state directory, `forks.json`, replaced whole and
//! durably: forks made by one command appear together or not at all, and they outlive the
//! server, its restarts and the host's (a fork holds nothing that a reboot throws away). Each
//! change is made to the book as it is on disk, under a lock (`.forks.lock`): a server still
//! exiting beside its successor changes it too, and neither erases the other's forks.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A fork's pin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fork {
    /// The image it is served as (the export it connects to).
    pub image: String,
    /// The checkpoint it starts from, `@NAME`.
    pub checkpoint: String,
    /// Dropped (`vm drop`): the name is refused until `vm reset`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dropped: bool,
}

#[derive(Serialize, Deserialize)]
struct BookFile {
    format: u32,
    forks: BTreeMap<String, Fork>,
}

const FORMAT: u32 = 1;
const FILE: &str = "forks.json";
const LOCK: &str = ".forks.lock";

/// The forks a server knows, kept in its state directory (none without one: forks are refused).
#[derive(Debug, Default)]
pub(crate) struct ForkBook {
    dir: Option<PathBuf>,
    forks: BTreeMap<String, Fork>,
}

impl ForkBook {
    /// The book in `dir`; empty if it has none yet. An unreadable book is an error: the forks
    /// it names would otherwise start from their image's version, as if they were none.
    pub(crate) fn open(dir: Option<&Path>) -> io::Result<Self> {
        let Some(dir) = dir else { return Ok(Self::default()) };
        Ok(Self { dir: Some(dir.to_owned()), forks: read(dir)? })
    }

    /// Whether forks can be recorded: the server has a state directory.
    pub(crate) fn can_record(&self) -> bool {
        self.dir.is_some()
    }

    pub(crate) fn get(&self, vm: &str) -> Option<&Fork> {
        self.forks.get(vm)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&String, &Fork)> {
        self.forks.iter()
    }

    /// Adds `forks` together, on disk before in memory: all or none.
    pub(crate) fn add(&mut self, forks: Vec<(String, Fork)>) -> io::Result<()> {
        self.update(|book| {
            book.extend(forks);
            true
        })
    }

    /// Marks fork `vm` dropped; `false` if it is no fork (or was dropped already).
    pub(crate) fn drop_fork(&mut self, vm: &str) -> io::Result<bool> {
        let mut dropped = false;
        self.update(|book| {
            if let Some(fork) = book.get_mut(vm).filter(|fork| !fork.dropped) {
                fork.dropped = true;
                dropped = true;
            }
            dropped
        })?;
        Ok(dropped)
    }

    /// Forgets fork `vm`, dropped or not (it moved to a peer); `false` if it is no fork.
    pub(crate) fn remove(&mut self, vm: &str) -> io::Result<bool> {
        let mut removed = false;
        self.update(|book| {
            removed = book.remove(vm).is_some();
            removed
        })?;
        Ok(removed)
    }

    /// Forgets dropped fork `vm` (its name is free again); `false` if it is no dropped fork.
    pub(crate) fn forget_dropped(&mut self, vm: &str) -> io::Result<bool> {
        if !self.forks.get(vm).is_some_and(|fork| fork.dropped) {
            return Ok(false);
        }
        let mut forgotten = false;
        self.update(|book| {
            forgotten = book.get(vm).is_some_and(|fork| fork.dropped) && book.remove(vm).is_some();
            forgotten
        })?;
        Ok(forgotten)
    }

    /// Applies `change` to the book as it is on disk, under its lock, and writes it if
    /// `change` says it changed; this server's copy is the book as it is then.
    fn update(&mut self, change: impl FnOnce(&mut BTreeMap<String, Fork>) -> bool) -> io::Result<()> {
        let dir = self.dir.clone().ok_or_else(|| {
            io::Error::new(io::ErrorKind::Unsupported, "forks need a state directory (serve --state-dir)")
        })?;
        let lock =
            std::fs::OpenOptions::new().create(true).truncate(false).write(true).mode(0o600).open(dir.join(LOCK))?;
        crate::files::lock_exclusive(&lock)?;
        let mut forks = read(&dir)?;
        if change(&mut forks) {
            let book = BookFile { format: FORMAT, forks };
            let bytes = serde_json::to_vec_pretty(&book).map_err(io::Error::other)?;
            crate::files::replace_whole_durably(&dir.join(FILE), &dir.join(format!(".{FILE}.partial")), &bytes, 0o600)?;
            forks = book.forks;
        }
        self.forks = forks;
        drop(lock);
        Ok(())
    }
}

/// The book in `dir`, empty if there is none.
fn read(dir: &Path) -> io::Result<BTreeMap<String, Fork>> {
    let path = dir.join(FILE);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(io::Error::new(e.kind(), format!("the forks' book {}: {e}", path.display()))),
    };
    let book: BookFile = serde_json::from_slice(&bytes)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("the forks' book {}: {e}", path.display())))?;
    if book.format > FORMAT {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the forks' book {} is of a newer release (format {})", path.display(), book.format),
        ));
    }
    Ok(book.forks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fork(checkpoint: &str) -> Fork {
        Fork { image: "golden".into(), checkpoint: checkpoint.into(), dropped: false }
    }

    #[test]
    fn forks_outlive_the_book_that_made_them_and_a_drop_is_kept_until_forgotten() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut book = ForkBook::open(Some(dir.path())).expect("open");
        book.add(vec![("a".to_owned(), fork("@c1")), ("b".to_owned(), fork("@c1"))]).expect("add");
        assert!(book.drop_fork("a").expect("drop"));
        assert!(!book.drop_fork("a").expect("drop again"), "a second drop finds it dropped");
        assert!(!book.drop_fork("nobody").expect("drop no fork"));

        let mut again = ForkBook::open(Some(dir.path())).expect("reopen");
        assert_eq!(again.get("b"), Some(&fork("@c1")));
        assert!(again.get("a").is_some_and(|f| f.dropped), "the drop is on disk");
        assert!(!again.forget_dropped("b").expect("b is not dropped"), "only a dropped fork is forgotten");
        assert!(again.forget_dropped("a").expect("forget"));
        assert_eq!(ForkBook::open(Some(dir.path())).expect("reopen").get("a"), None);
    }

    #[test]
    fn two_servers_on_one_state_directory_keep_each_others_forks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut exiting = ForkBook::open(Some(dir.path())).expect("open");
        let mut starting = ForkBook::open(Some(dir.path())).expect("open");
        exiting.add(vec![("a".to_owned(), fork("@c1"))]).expect("add a");
        starting.add(vec![("b".to_owned(), fork("@c2"))]).expect("add b");
        let book = ForkBook::open(Some(dir.path())).expect("reopen");
        assert_eq!((book.get("a"), book.get("b")), (Some(&fork("@c1")), Some(&fork("@c2"))));
        assert!(exiting.drop_fork("b").expect("drop"), "a fork the other server made is found on disk");
    }

    #[test]
    fn without_a_state_directory_no_fork_is_made_and_a_torn_book_is_an_error() {
        let mut book = ForkBook::open(None).expect("open");
        assert!(book.add(vec![("a".to_owned(), fork("@c"))]).is_err());
        assert_eq!(book.get("a"), None, "nothing in memory that is not on disk");

        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(FILE), b"{\"format\":1,\"forks\":{\"a\":").expect("write");
        let error = ForkBook::open(Some(dir.path())).expect_err("a torn book");
        assert!(error.to_string().contains("forks.json"), "{error}");
    }
}
