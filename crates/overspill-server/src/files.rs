//! Small files the server writes whole (ledger entries, `current` markers, the pidfile) and the
//! directories it keeps state in. Their defaults sit in places every user may write to
//! (`/var/tmp`, `/dev/shm`), so nothing here follows a link or trusts a directory another user
//! made: as root, a planted symlink would turn a ledger write into a write of any file.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Replaces `target` with `bytes` in one step: written to `partial` (a name of our own beside
/// it), then renamed over it, so a reader sees the old text or the new, never half. A `partial`
/// left by a crash, or planted, is removed first (unlinking never follows a link), and the new
/// one is created exclusively, so the write lands in a file this call made.
pub fn replace_whole(target: &Path, partial: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    drop(write_new(partial, bytes, mode)?);
    std::fs::rename(partial, target)
}

/// As [`replace_whole`], for a file other users' programs read and a host crash must not undo:
/// it has exactly `mode` whatever the writer's umask, and it and its directory are on disk
/// before this returns.
pub fn replace_whole_durably(target: &Path, partial: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    overspill_engine::crash::point();
    let file = write_new(partial, bytes, mode)?;
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
    file.sync_all()?;
    drop(file);
    overspill_engine::crash::point();
    std::fs::rename(partial, target)?;
    sync_directory(target.parent().unwrap_or(Path::new(".")))
}

/// `bytes` in a new file at `partial`, removing whatever was there first (see [`replace_whole`]).
fn write_new(partial: &Path, bytes: &[u8], mode: u32) -> io::Result<File> {
    match std::fs::remove_file(partial) {
        Ok(()) => {}
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    let mut file = OpenOptions::new().write(true).create_new(true).mode(mode).open(partial)?;
    file.write_all(bytes)?;
    Ok(file)
}

/// Makes `dir` (and its parents) if missing, readable and searchable by all: a store's
/// directory, which the server's user reads whoever wrote to it. Each directory made is
/// searchable whatever the umask of whoever made it (a publisher's 077 once left the store's
/// root closed to the server), and its name is on disk in its parent before anything is put in
/// it.
pub fn create_shared_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let missing: Vec<&Path> =
        dir.ancestors().take_while(|path| !path.as_os_str().is_empty() && !path.is_dir()).collect();
    for path in missing.into_iter().rev() {
        match std::fs::create_dir(path) {
            Ok(()) => {}
            // Made meanwhile by another publisher.
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => continue,
            Err(error) => return Err(error),
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
        let parent = path.parent().filter(|parent| !parent.as_os_str().is_empty()).unwrap_or(Path::new("."));
        sync_directory(parent)?;
    }
    Ok(())
}

/// Where this process writes a file before it takes a name in `dir`:
/// `.overspill-PID-WHATN-HOST.partial` (`what` without `-`, `N` counting this process's
/// calls), a name no other writer, in this process, another one or on another host sharing the
/// store, writes at once, so that the writing needs no lock.
pub fn partial_path(dir: &Path, what: &str) -> PathBuf {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    dir.join(format!(".{}", overspill_engine::store::scratch_file_name(&format!("{what}{call}"), "partial")))
}

/// Removes the files [`partial_path`] named for processes of this host that no longer run (a
/// publisher killed mid-copy left up to a whole image). Another host's are left: its pids mean
/// nothing here.
pub fn remove_stale_partials(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(owner) =
            name.to_str().and_then(|name| name.strip_prefix('.')).and_then(overspill_engine::store::scratch_file_owner)
        else {
            continue;
        };
        let stale = owner.kind == "partial"
            && owner.this_host == Some(true)
            && owner.pid != std::process::id()
            && !overspill_engine::store::process_alive(owner.pid);
        if stale {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => tracing::info!(file = %entry.path().display(), "removed a dead publisher's partial file"),
                Err(error) => tracing::warn!(file = %entry.path().display(), %error, "could not remove a partial file"),
            }
        }
    }
}

/// Makes the names in `dir` (a rename, a new file) survive a host crash.
pub fn sync_directory(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Makes `dir` (and its parents) if missing, then refuses it where another user could plant
/// links in it or swap it for one: a link in its place, or any directory on its way, owned by
/// someone other than this user or root; a directory on its way that others may write to
/// without the sticky bit (`/tmp` and `/var/tmp` have it), the directory itself included; the
/// directory itself owned by another user (unless this call made it: on NFS with root squashed,
/// ours belongs to `nobody`). Group-writable is trusted: a group shared with the operator is
/// common.
pub fn own_directory(dir: &Path) -> io::Result<()> {
    let existed = std::fs::symlink_metadata(dir).is_ok();
    std::fs::create_dir_all(dir)?;
    let me = rustix::process::geteuid().as_raw();
    let trusted = |uid: u32| uid == me || uid == 0;
    let refuse = |path: &Path, why: String| {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{}: {why}, so another user could plant links there that turn this server's writes \
                 onto other files; give it to this user ({me}) or root, or pick another directory",
                path.display()
            ),
        ))
    };
    // Links on the way as given (the path resolved below no longer shows them).
    let absolute = std::path::absolute(dir)?;
    for path in absolute.ancestors() {
        let meta = std::fs::symlink_metadata(path)?;
        if meta.file_type().is_symlink() && !trusted(meta.uid()) {
            return refuse(path, format!("a link owned by user {}", meta.uid()));
        }
    }
    let resolved = std::fs::canonicalize(dir)?;
    let meta = std::fs::metadata(&resolved)?;
    if existed && !trusted(meta.uid()) {
        return refuse(&resolved, format!("owned by user {}", meta.uid()));
    }
    // Sticky (a tmpfs mount point's default), others may add names but not replace ours, and
    // every file here is made exclusively.
    if meta.mode() & 0o002 != 0 && meta.mode() & 0o1000 == 0 {
        return refuse(&resolved, "writable by every user (no sticky bit)".to_owned());
    }
    for path in resolved.ancestors().skip(1) {
        let meta = std::fs::metadata(path)?;
        if !trusted(meta.uid()) {
            return refuse(path, format!("on the way to {}, owned by user {}", resolved.display(), meta.uid()));
        }
        if meta.mode() & 0o002 != 0 && meta.mode() & 0o1000 == 0 {
            return refuse(
                path,
                format!("on the way to {}, writable by every user (no sticky bit)", resolved.display()),
            );
        }
    }
    Ok(())
}

/// Takes `lock` (a file made for this) exclusively, waiting for whoever holds it.
pub fn lock_exclusive(lock: &File) -> io::Result<()> {
    loop {
        match rustix::fs::flock(lock, rustix::fs::FlockOperation::LockExclusive) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::NOLCK | rustix::io::Errno::OPNOTSUPP) => return Ok(()),
            Err(error) => return Err(error.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_planted_link_at_the_partial_name_is_replaced_not_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"untouched").expect("victim");
        let partial = dir.path().join(".entry.partial");
        std::os::unix::fs::symlink(&victim, &partial).expect("symlink");
        let target = dir.path().join("entry");
        replace_whole(&target, &partial, b"new text", 0o600).expect("replace");
        assert_eq!(std::fs::read(&victim).expect("victim"), b"untouched");
        assert_eq!(std::fs::read(&target).expect("target"), b"new text");
        assert!(!partial.exists());
        replace_whole(&target, &partial, b"newer", 0o600).expect("replace again");
        assert_eq!(std::fs::read(&target).expect("target"), b"newer");
    }

    #[test]
    fn a_directory_of_this_user_is_taken_and_made_when_missing() {
        let dir = tempfile::tempdir().expect("tempdir");
        own_directory(&dir.path().join("a/b")).expect("made and ours");
        assert!(dir.path().join("a/b").is_dir());
    }

    /// Needs root, to give a directory and a link away (the tests run as root in CI).
    #[test]
    fn a_directory_or_link_another_user_owns_is_refused() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: not root, cannot give files to another user");
            return;
        }
        let nobody = Some(rustix::process::Uid::from_raw(65534));
        let dir = tempfile::tempdir().expect("tempdir");
        let theirs = dir.path().join("theirs");
        std::fs::create_dir(&theirs).expect("dir");
        rustix::fs::chown(&theirs, nobody, None).expect("chown");
        let error = own_directory(&theirs).expect_err("another user's directory");
        assert!(error.to_string().contains("owned by user 65534"), "{error}");
        // Made by this call, it is ours whoever the filesystem says owns it; below another
        // user's directory, nothing is.
        let below = theirs.join("below");
        let error = own_directory(&below).expect_err("below another user's directory");
        assert!(error.to_string().contains("on the way to"), "{error}");
        let open = dir.path().join("open");
        std::fs::create_dir(&open).expect("dir");
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).expect("chmod");
        let error = own_directory(&open).expect_err("a directory every user may write");
        assert!(error.to_string().contains("writable by every user"), "{error}");
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o1777)).expect("chmod");
        own_directory(&open).expect("a sticky directory, as a tmpfs mount point");
        own_directory(&open.join("mine")).expect("below a sticky directory, as /var/tmp");

        let mine = dir.path().join("mine");
        std::fs::create_dir(&mine).expect("dir");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&mine, &link).expect("symlink");
        own_directory(&link).expect("a link of our own to a directory of our own");
        rustix::fs::chownat(rustix::fs::CWD, &link, nobody, None, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
            .expect("lchown");
        let error = own_directory(&link).expect_err("another user's link");
        assert!(error.to_string().contains("a link owned by user 65534"), "{error}");
    }
}
