//! The ledger (`--state-dir`): one small file per named VM with acknowledged writes, made before
//! the first of them is acknowledged and removed when its overlay deliberately ends, so that what
//! a VM wrote outlives the process that served it. A server that starts reads it to know which
//! VMs it can recover, which were lost, and which an earlier boot left (void: removed).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::check_name;
use crate::vms::shown_image;

/// One file per named VM with acknowledged writes: `DIR/vm-NAME.json`.
#[derive(Debug)]
pub(crate) struct Ledger {
    pub(crate) dir: PathBuf,
    pub(crate) boot_id: String,
}

/// The format of a ledger entry and of the state files it names (page slot headers, segment
/// summaries, zero log), which it is written before: 1 for entries without the field (servers
/// before it), 2 since tombstones (`lost`). A server reads every format up to its own and
/// refuses, by VM name, one it does not know (a newer release's, after a downgrade), keeping its
/// files for a server that knows it: never a guess. 3 for entries of a VM moving between
/// servers (`moved`, `incoming`), which a server of format 2 would take for its own; other
/// entries are still written as 2, so that a downgrade refuses only those.
pub const STATE_FORMAT: u32 = 3;

/// The format of entries that are not about a move.
const UNMOVED_FORMAT: u32 = 2;

/// The format of an entry written before the field existed.
pub(crate) fn first_format() -> u32 {
    1
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct LedgerEntry {
    #[serde(default = "first_format")]
    pub(crate) format: u32,
    pub(crate) vm: String,
    pub(crate) image: String,
    /// The TLS identity of the client that made the VM (see [`crate::vms::VmRegistry::claim`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) owner: Option<String>,
    pub(crate) pid: u32,
    /// When that process started (clock ticks since boot, `/proc/PID/stat`): a pid alive now
    /// is the same server only if it started then too; a dead server's pid may be another
    /// process's by the time a next server looks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) pid_start: Option<u64>,
    pub(crate) boot_id: String,
    pub(crate) since_unix_s: u64,
    /// Where the VM's overlay keeps its state, when it outlives the process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) state: Option<StateRecord>,
    /// The state files were being made and the overlay had not stood yet: it had served
    /// nothing, so a next server removes them rather than refuse a VM that has nothing to lose
    /// (files cut short there, a zero log without its header, do not read as a state).
    #[serde(default, skip_serializing_if = "is_false")]
    pub(crate) making: bool,
    /// The VM had written nothing (no write, TRIM or WRITE_ZEROES acknowledged) when this was
    /// written: its state holds nothing of its own, so a state that cannot be rebuilt (its image
    /// replaced, say) costs it nothing, and the VM starts afresh instead of being refused. Set
    /// false before the first change is acknowledged; entries without it count as written.
    #[serde(default, skip_serializing_if = "is_false")]
    pub(crate) unwritten: bool,
    /// A tombstone: the VM's writes were given up (its grace ran out, say) while its guest may
    /// still run, and its name is refused, for this reason, until `vm reset`. `state`, if any,
    /// names files that may still be there (removed by the reset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) lost: Option<String>,
    /// The server cut the VM's connection for idleness (its guest paused or suspended) and it
    /// had not come back when this was written: a next server keeps it waiting with no end too,
    /// rather than lose its writes once a grace meant for lost connections runs out.
    #[serde(default, skip_serializing_if = "is_false")]
    pub(crate) quiet: bool,
    /// The VM was handed to this peer server (live migration), which holds it from then on: its
    /// state here, if any is left, is stale and never resumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) moved: Option<String>,
    /// The VM's state here was being taken from this peer server and the peer had not yet said
    /// the move was done: a next server rebuilds it but serves it only once the peer says its
    /// ledger has the VM moved here (it drops it if the peer kept the VM, and refuses the name
    /// until `vm reset` if the peer cannot tell: never a guess).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) incoming: Option<String>,
}

pub(crate) fn is_false(value: &bool) -> bool {
    !value
}

/// Where a VM's overlay keeps the state a next server rebuilds it from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateRecord {
    /// The image label it was made over (`name:version` for a versioned image).
    pub image_label: String,
    /// The golden image's [`GoldenImage::identity`](overspill_engine::GoldenImage::identity)
    /// when the state was made: a file replaced or rewritten since must not show through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_identity: Option<String>,
    pub mode: String,
    pub disk_bytes: u64,
    pub memory_dir: PathBuf,
    /// The directory of its spill file (mode `ram+disk`) or in-place cache file (`disk`:
    /// the spill directory, `shared`: the shared one); `None` in mode `ram`.
    pub spill_dir: Option<PathBuf>,
}

/// What a ledger entry says of a VM's state beside where it is (see [`LedgerEntry`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct Marks {
    pub(crate) making: bool,
    pub(crate) unwritten: bool,
    pub(crate) lost: Option<String>,
    pub(crate) quiet: bool,
    pub(crate) moved: Option<String>,
    pub(crate) incoming: Option<String>,
}

/// A VM an earlier server of this boot left state for.
#[derive(Debug, Clone)]
pub struct Recoverable {
    pub vm: String,
    /// The image name the VM asked for.
    pub image: String,
    /// The TLS identity that made it, the only one that may resume it.
    pub owner: Option<String>,
    pub state: StateRecord,
    /// It had written nothing (see [`LedgerEntry::unwritten`]).
    pub unwritten: bool,
    /// It was cut for idleness and waits with no end (see [`LedgerEntry::quiet`]).
    pub quiet: bool,
    /// It was moving here from this peer, in doubt (see [`LedgerEntry::incoming`]): whose copy
    /// is the VM's is settled by asking the peer before it is served.
    pub incoming: Option<String>,
}

impl Ledger {
    pub(crate) fn open(dir: &Path) -> std::io::Result<Self> {
        crate::files::own_directory(dir)
            .map_err(|e| std::io::Error::new(e.kind(), format!("state directory {}: {e}", dir.display())))?;
        Ok(Self { dir: dir.to_owned(), boot_id: boot_id() })
    }

    pub(crate) fn path(&self, vm: &str) -> PathBuf {
        self.dir.join(format!("vm-{vm}.json"))
    }

    pub(crate) fn mark_with(
        &self,
        vm: &str,
        image: &str,
        owner: Option<&str>,
        state: Option<StateRecord>,
    ) -> std::io::Result<()> {
        self.write_entry(vm, image, owner, state, Marks::default())
    }

    /// Marks a VM lost for good (until `vm reset`): a server started later refuses its name.
    pub(crate) fn write_tombstone(
        &self,
        vm: &str,
        image: &str,
        owner: Option<&str>,
        state: Option<StateRecord>,
        why: &str,
    ) -> std::io::Result<()> {
        self.write_entry(vm, image, owner, state, Marks { lost: Some(why.to_owned()), ..Marks::default() })
    }

    pub(crate) fn write_entry(
        &self,
        vm: &str,
        image: &str,
        owner: Option<&str>,
        state: Option<StateRecord>,
        Marks { making, unwritten, lost, quiet, moved, incoming }: Marks,
    ) -> std::io::Result<()> {
        let entry = LedgerEntry {
            format: if moved.is_some() || incoming.is_some() { STATE_FORMAT } else { UNMOVED_FORMAT },
            vm: vm.to_owned(),
            image: image.to_owned(),
            owner: owner.map(str::to_owned),
            pid: std::process::id(),
            pid_start: process_start(std::process::id()),
            boot_id: self.boot_id.clone(),
            since_unix_s: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            state,
            making,
            unwritten,
            lost,
            quiet,
            moved,
            incoming,
        };
        let partial = self.dir.join(format!(".vm-{vm}.json.partial"));
        let text = serde_json::to_vec(&entry).map_err(std::io::Error::other)?;
        crate::files::replace_whole(&self.path(vm), &partial, &text, 0o600)
    }

    /// Where the VM's ledger file says its state is, if it says so.
    pub(crate) fn state_of(&self, vm: &str) -> Option<StateRecord> {
        let bytes = std::fs::read(self.path(vm)).ok()?;
        serde_json::from_slice::<LedgerEntry>(&bytes).ok()?.state
    }

    /// The peer a VM was handed to, if its entry here says so (see [`LedgerEntry::moved`]).
    pub(crate) fn moved_to(&self, vm: &str) -> Option<String> {
        let bytes = std::fs::read(self.path(vm)).ok()?;
        serde_json::from_slice::<LedgerEntry>(&bytes).ok()?.moved
    }

    /// Where a VM's ledger entry waits while its state files are removed.
    pub(crate) fn retiring_path(&self, vm: &str) -> PathBuf {
        self.dir.join(format!(".vm-{vm}.json.retiring"))
    }

    /// Ends a persistent VM's entry and removes its state files. The entry is first renamed
    /// out of the ledger (the name is free from then on) to a file that still says where the
    /// state is, removed last: a crash in between leaves neither a ledger entry whose files are
    /// gone (a name refused until reset) nor files that nothing names (the next server removes
    /// what a retiring file names, in [`Self::left_behind`]).
    pub(crate) fn retire<T>(&self, vm: &str, state: &StateRecord, remove_files: impl FnOnce(&str, &StateRecord) -> T) {
        let retiring = self.retiring_path(vm);
        match std::fs::rename(self.path(vm), &retiring) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                tracing::warn!(vm, %error, "could not move the VM's ledger file aside");
                self.unmark(vm);
            }
        }
        remove_files(vm, state);
        remove_unless_gone(&retiring, "could not remove the VM's retiring ledger file");
    }

    /// A retirement a dead server did not finish: its state files go, unless the name has a
    /// ledger entry again (then the files are that VM's, and only the retiring file goes).
    pub(crate) fn finish_retiring(&self, vm: &str, retiring: &Path) {
        if check_name("VM", vm).is_err() {
            return;
        }
        let entry = std::fs::read(retiring).ok().and_then(|bytes| serde_json::from_slice::<LedgerEntry>(&bytes).ok());
        if entry.as_ref().is_some_and(|e| self.held_by_a_live_server(e)) {
            return;
        }
        if !self.path(vm).exists() {
            if let Some(state) = entry.and_then(|e| e.state) {
                tracing::info!(vm, "state files of a VM ended by an earlier server removed");
                remove_leftover_state_files(vm, &state);
            }
        }
        remove_unless_gone(retiring, "could not remove a retiring ledger file");
    }

    /// An entry another server of this boot still runs with (one sharing the directory). A
    /// server that is exiting (killed, its memory still being torn down: a successor started at
    /// once meets it) is waited for, bounded, and a zombie holds nothing.
    pub(crate) fn held_by_a_live_server(&self, entry: &LedgerEntry) -> bool {
        entry.boot_id == self.boot_id
            && entry.pid != std::process::id()
            && match entry.pid_start {
                Some(start) => process_start(entry.pid) == Some(start),
                // Written by a server that did not record it: alive is all there is to go by.
                None => Path::new(&format!("/proc/{}", entry.pid)).exists(),
            }
            && !overspill_net::exiting::wait_until_gone(
                entry.pid,
                "the previous server",
                overspill_net::exiting::EXIT_WAIT,
            )
    }

    /// A VM this server skipped at its start because the server that held it was alive then,
    /// and is gone now: its state to rebuild, if it left one that can be. A tombstone or an entry
    /// without state makes the name lost instead (returned as `Err` with why); one that was
    /// being made goes, with its files.
    pub(crate) fn orphan(&self, vm: &str) -> Option<Result<Recoverable, String>> {
        let entry: LedgerEntry = serde_json::from_slice(&std::fs::read(self.path(vm)).ok()?).ok()?;
        if entry.boot_id != self.boot_id || entry.pid == std::process::id() || self.held_by_a_live_server(&entry) {
            return None;
        }
        self.resolve(vm, entry)
    }

    /// What the entry of a server of this boot that is gone leaves VM `vm`: its state to rebuild
    /// (`Ok`), or why its name is lost (`Err`). An entry whose files were still being made goes
    /// with them (`None`): its VM served nothing.
    pub(crate) fn resolve(&self, vm: &str, entry: LedgerEntry) -> Option<Result<Recoverable, String>> {
        match entry {
            LedgerEntry { format, .. } if !known_format(format) => Some(Err(unknown_format(format))),
            LedgerEntry { lost: Some(why), .. } => Some(Err(why)),
            LedgerEntry { moved: Some(to), state, .. } => {
                // The peer holds the VM: what is left here is stale. The entry stays (without
                // its files), so that this server can say where the VM went.
                if let Some(state) = &state {
                    tracing::info!(vm, peer = to, "state files of a VM handed to a peer removed");
                    remove_leftover_state_files(vm, state);
                }
                None
            }
            LedgerEntry { incoming: Some(from), state: Some(state), image, owner, unwritten, quiet, .. } => {
                Some(Ok(Recoverable { vm: vm.to_owned(), image, owner, state, unwritten, quiet, incoming: Some(from) }))
            }
            LedgerEntry { incoming: Some(from), .. } => Some(Err(format!(
                "it was moving here from peer {from} when its server ended, before the peer said the move was \
                 done: whether its writes are here or there is unknown"
            ))),
            LedgerEntry { state: Some(state), making: true, .. } => {
                if remove_leftover_state_files(vm, &state).is_empty() {
                    tracing::info!(vm, "state files of a VM an earlier server was making removed (it served nothing)");
                    self.unmark(vm);
                } else {
                    // A live process holds files of that name: not what a dead server was making.
                    tracing::warn!(vm, "a VM an earlier server was making has files another process holds: left");
                }
                None
            }
            LedgerEntry { state: Some(state), image, owner, unwritten, quiet, .. } => {
                Some(Ok(Recoverable { vm: vm.to_owned(), image, owner, state, unwritten, quiet, incoming: None }))
            }
            LedgerEntry { pid, image, .. } => {
                Some(Err(format!("server pid {pid} ended while it held them, over {}", shown_image(&image))))
            }
        }
    }

    pub(crate) fn unmark(&self, vm: &str) {
        if let Err(error) = std::fs::remove_file(self.path(vm)) {
            if error.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(vm, %error, "could not remove the VM's ledger file");
            }
        }
    }

    /// What earlier servers of this boot left: names whose writes are gone, and VMs whose state
    /// can be rebuilt. Files of an earlier boot are removed (with the state files they name);
    /// files of a live server are left to it.
    pub(crate) fn left_behind(&self) -> LeftBehind {
        let mut left = LeftBehind::default();
        let LeftBehind { lost, recoverable, earlier_boot_unreadable } = &mut left;
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return left };
        // No server of this boot has started with this ledger: every file in it is older.
        let earlier_boot = std::fs::read_to_string(self.dir.join(BOOT_MARKER)).is_ok_and(|b| b.trim() != self.boot_id);
        for file in entries.flatten() {
            let name = file.file_name();
            if let Some(vm) = name.to_str().and_then(|n| n.strip_prefix(".vm-")?.strip_suffix(".json.retiring")) {
                self.finish_retiring(vm, &file.path());
                continue;
            }
            let Some(vm) = name.to_str().and_then(|n| n.strip_prefix("vm-")?.strip_suffix(".json")) else { continue };
            if check_name("VM", vm).is_err() {
                continue;
            }
            let parsed = std::fs::read(file.path()).map(|bytes| serde_json::from_slice::<LedgerEntry>(&bytes));
            // Read, but not a whole entry: empty or cut short (by a power loss: entries are
            // written without a sync); a file that cannot be read at all is not that.
            let cut_short = matches!(parsed, Ok(Err(_)));
            match parsed.ok().and_then(Result::ok) {
                Some(e) if e.boot_id != self.boot_id => {
                    tracing::info!(vm, "ledger file of an earlier boot removed (its VM ended with the host)");
                    if let Some(state) = &e.state {
                        remove_leftover_state_files(vm, state);
                    }
                    self.unmark(vm);
                }
                Some(e) if self.held_by_a_live_server(&e) => {}
                Some(e) => match self.resolve(vm, e) {
                    Some(Ok(found)) => recoverable.push(found),
                    Some(Err(why)) => {
                        lost.insert(vm.to_owned(), why);
                    }
                    None => {}
                },
                // Written before this boot began and cut short by the crash that ended it: its
                // VM ended with the host, as any VM of an earlier boot. Its file goes once the
                // VM's files where this server makes them have gone (`set_state_places`).
                None if cut_short && (earlier_boot || written_before_this_boot(&file.path())) => {
                    tracing::info!(vm, "ledger file of an earlier boot, cut short: its VM ended with the host");
                    earlier_boot_unreadable.push(vm.to_owned());
                }
                None => {
                    lost.insert(vm.to_owned(), "its ledger file is unreadable".to_owned());
                }
            }
        }
        left
    }

    /// Records that a server of this boot has dealt with what earlier boots left in this ledger:
    /// a cut-short entry found later under another boot's marker is that boot's. (Within a boot
    /// no entry is cut short: each is written whole under another name and renamed.)
    pub(crate) fn mark_boot(&self) -> std::io::Result<()> {
        let marker = self.dir.join(BOOT_MARKER);
        if std::fs::read_to_string(&marker).is_ok_and(|b| b.trim() == self.boot_id) {
            return Ok(());
        }
        let partial = self.dir.join(format!("{BOOT_MARKER}.partial"));
        crate::files::replace_whole_durably(&marker, &partial, format!("{}\n", self.boot_id).as_bytes(), 0o600)
    }
}

pub(crate) fn known_format(format: u32) -> bool {
    (first_format()..=STATE_FORMAT).contains(&format)
}

pub(crate) fn unknown_format(format: u32) -> String {
    format!(
        "its state is in format {format}, which this server (formats 1 to {STATE_FORMAT}) does not know: its files \
         are kept for a server that does; `vm reset` gives them up"
    )
}

/// The state directory's record of the boot its last starting server ran in.
pub(crate) const BOOT_MARKER: &str = ".boot";

/// What earlier servers left in the ledger ([`Ledger::left_behind`]).
#[derive(Default)]
pub(crate) struct LeftBehind {
    /// Names whose writes are gone, and why.
    pub(crate) lost: BTreeMap<String, String>,
    pub(crate) recoverable: Vec<Recoverable>,
    pub(crate) earlier_boot_unreadable: Vec<String>,
}

/// Whether `path` was last written before the host booted (`btime` in /proc/stat). `false`
/// when either cannot be told: an unreadable file of this boot is a lost VM, never forgotten.
pub(crate) fn written_before_this_boot(path: &Path) -> bool {
    let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    match (boot_time_s(), modified.and_then(|m| m.duration_since(std::time::UNIX_EPOCH).ok())) {
        (Some(boot), Some(modified)) => modified.as_secs() < boot,
        _ => false,
    }
}

/// When the host booted, in seconds since the epoch (`btime` in /proc/stat).
pub(crate) fn boot_time_s() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines().find_map(|line| line.strip_prefix("btime ")?.trim().parse().ok())
}

pub(crate) fn remove_unless_gone(path: &Path, what: &str) {
    if let Err(error) = std::fs::remove_file(path) {
        if error.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), %error, "{what}");
        }
    }
}

/// The names of a VM's state files: `vm-NAME` in the memory and spill directories.
pub fn state_file_stem(vm: &str) -> String {
    format!("vm-{vm}")
}

/// Removes the state files the ledger says a VM had (they are named after it, in directories
/// overspill keeps them in).
pub fn remove_state_files(vm: &str, state: &StateRecord) {
    for path in state_file_paths(vm, state) {
        remove_unless_gone(&path, "could not remove a VM's state file");
    }
}

/// Removes VM `vm`'s state files that no live process holds (a server sharing the directory
/// with a VM of the same name holds its own; see [`overspill_engine::store::hold`]); the paths
/// of those it left.
pub fn remove_leftover_state_files(vm: &str, state: &StateRecord) -> Vec<PathBuf> {
    let mut held = Vec::new();
    for path in state_file_paths(vm, state) {
        if overspill_engine::store::held_elsewhere(&path) {
            tracing::warn!(vm, path = %path.display(), "a file named for this VM is held by another process: left alone");
            held.push(path);
        } else {
            remove_unless_gone(&path, "could not remove a VM's state file");
        }
    }
    held
}

pub(crate) fn state_file_paths(vm: &str, state: &StateRecord) -> Vec<PathBuf> {
    let stem = state_file_stem(vm);
    let mut paths: Vec<PathBuf> =
        ["pages", "slots", "segments", "zeros"].iter().map(|s| state.memory_dir.join(format!("{stem}.{s}"))).collect();
    if let Some(dir) = &state.spill_dir {
        // The VM's spill or in-place cache file: whichever its mode made, all named after it.
        paths.extend(["spill", "cache", "diff"].iter().map(|s| dir.join(format!("{stem}.{s}"))));
    }
    paths
}

/// When process `pid` started, in clock ticks since boot (field 22 of `/proc/PID/stat`, counted
/// after the command name, which may hold spaces and parentheses); `None` if it is not running.
pub(crate) fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// This boot of the host; a ledger file from another boot speaks of VMs that no longer run.
pub(crate) fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_owned()).unwrap_or_default()
}
