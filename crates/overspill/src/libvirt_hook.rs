//! `overspill libvirt-hook`: libvirt's qemu hook for domains with overspill disks, installed as
//! `/etc/libvirt/hooks/qemu.d/overspill` (libvirt 6.5 and later run every script there, so an
//! operator's own hook stays).
//!
//! libvirt runs it as `HOOK DOMAIN OPERATION SUB-OPERATION EXTRA` with the domain's XML on
//! standard input, and a non-zero exit stops the operation, with what the hook wrote to
//! standard error in libvirt's error. An overspill disk is an NBD disk whose export names a VM
//! (`IMAGE@NAME`, `@NAME` for the default image) at the socket or TCP port the server listens
//! on, or a vhost-user disk whose socket is `NAME.sock` in the server's vhost-user directory
//! (given to the hook as `--vhost-user-dir`, or as the server reports it). Another NBD server's
//! disk or another backend's vhost-user disk is left alone. Where the server cannot be asked,
//! every disk that looks like one counts as overspill's, so that a migration or restore is
//! refused rather than let through onto golden data. What the hook does:
//!
//! - `migrate` (on the destination, before its QEMU starts): refuses, naming the VMs, unless a
//!   peer of this host's server holds each VM live (the server then takes it from there as the
//!   destination QEMU connects). Otherwise their writes live in the source host's server, and
//!   the destination's server would start them from the golden image under a running guest:
//!   libvirt aborts the migration and the guest runs on at the source. A migration let through
//!   is noted in `--run-dir` for the `prepare` that follows.
//! - `restore` (`virsh restore`, a `managedsave` start, libvirt-guests' suspend): refuses. A
//!   saved QEMU ends its disks' connections with NBD_CMD_DISC, which ends their overlays, so the
//!   saved guest's memory would run on golden data; and an overlay waiting under the VM's name
//!   then is another session's (started and killed since the save), not the saved one's.
//! - `prepare begin` of any other start: `vm add` of each vhost-user VM (its socket must exist
//!   before QEMU starts; one declared already keeps its image, others get the default image),
//!   then `vm reset --everywhere` of each VM, so that every power-on starts from the golden
//!   image, as PVS does: a QEMU killed and started again within the grace, on this host or on
//!   a peer's, would otherwise boot into the old session's writes (on a peer's, the next user of
//!   a pooled desktop into the last one's files). A name no server knows is fine; a VM still
//!   connected, here or at a peer, refuses the start (another domain's QEMU has that disk). The
//!   `prepare` of a migration the hook let through (its note in `--run-dir`) resets this
//!   server's copy only: the peer's is the running guest's.
//! - anything else (`reconnect` and `attach` of running domains among them): nothing.
//!
//! Everything it prints goes to standard error: libvirt takes a `migrate` or `restore` hook's
//! standard output for the domain's new XML.

use std::io::Read;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use overspill_server::control::{self, Request};
use overspill_server::vms::VmState;
use quick_xml::events::Event;

#[derive(Debug, Args)]
pub struct LibvirtHookArgs {
    /// The server's control socket (`serve --control`); found as `overspill vm` finds it when
    /// not given.
    #[arg(long)]
    control: Option<PathBuf>,
    /// How long to keep trying a server that does not answer (restarting, say) before a start
    /// or restore is refused.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    wait: Duration,
    /// The server's vhost-user directory (`serve --vhost-user-dir`): a vhost-user disk is an
    /// overspill VM's when its socket is NAME.sock there.
    #[arg(long, value_name = "DIR")]
    vhost_user_dir: Option<PathBuf>,
    /// Where a migration let through at `migrate` is noted for the `prepare` that follows
    /// (libvirt runs the two as separate hooks). Not under the server's /run/overspill, which
    /// its unit makes for its own user.
    #[arg(long, value_name = "DIR", default_value = "/run/overspill-libvirt-hook")]
    run_dir: PathBuf,
    /// The domain's name.
    domain: String,
    /// libvirt's operation: prepare, start, started, stopped, release, migrate, restore,
    /// reconnect, attach.
    operation: String,
    /// begin or end (or -).
    sub_operation: String,
    /// What libvirt adds (or -).
    extra: Option<String>,
}

pub fn run(args: LibvirtHookArgs) -> anyhow::Result<()> {
    let acts = matches!(
        (args.operation.as_str(), args.sub_operation.as_str()),
        ("migrate" | "restore", _) | ("prepare", "begin")
    );
    // Read whole, whatever the operation (libvirt writes it all), but failing only where the
    // hook acts: libvirt takes a failed hook at `reconnect` or `attach` (its restart finding the
    // domain running) as a reason to kill the guest's QEMU.
    let mut input = Vec::new();
    let read = std::io::stdin().read_to_end(&mut input);
    if !acts {
        return Ok(());
    }
    read.context("reading the domain XML on standard input")?;
    let xml = String::from_utf8(input).context("the domain XML on standard input is not UTF-8")?;
    let disks: Vec<OverspillDisk> = overspill_disks(&xml)
        .context("reading the domain XML")?
        .into_iter()
        .filter(|disk| disk.in_directory(args.vhost_user_dir.as_deref()))
        .collect();
    if disks.is_empty() {
        return Ok(());
    }
    // Which of them are this server's: another NBD server's export may hold an '@', another
    // backend's vhost-user socket may end in .sock.
    let server = ask(&args, &Request::List);
    let disks: Vec<OverspillDisk> = match &server {
        Ok(answer) => disks.into_iter().filter(|disk| disk.served_by(answer, args.vhost_user_dir.is_some())).collect(),
        Err(_) => disks,
    };
    if disks.is_empty() {
        return Ok(());
    }
    let domain = &args.domain;
    let listed = names(&disks).join(", ");
    match (args.operation.as_str(), args.sub_operation.as_str()) {
        ("migrate", _) => match &server {
            Ok(_) => migrate(&args, &disks),
            // Asked once already, for as long as --wait allows.
            Err(error) => bail!(
                "domain {domain} cannot be migrated: the writes of its overspill VM(s) {listed} live in the \
                 overspill server of the host it runs on, and this host's server cannot be asked whether a peer \
                 holds them ({error:#}); the guest stays where it is."
            ),
        },
        ("restore", _) => bail!(
            "domain {domain} cannot be restored: the overlay of its overspill VM(s) {listed} ended when it was \
             saved (a saved QEMU ends its disks' connections), and the saved guest would run on golden data. \
             Start it afresh instead (virsh managedsave-remove {domain}, then virsh start {domain})."
        ),
        ("prepare", "begin") => prepare(&args, disks, server?),
        _ => Ok(()),
    }
}

/// A live migration to this host: let through only if every overspill VM of the domain is an
/// NBD VM that a peer of this host's server holds live (the server then takes it from there as
/// the destination QEMU connects); refused otherwise, the guest staying where it is.
fn migrate(args: &LibvirtHookArgs, disks: &[OverspillDisk]) -> anyhow::Result<()> {
    let domain = &args.domain;
    if let Some(disk) = disks.iter().find(|disk| disk.vhost_user_socket.is_some()) {
        bail!(
            "domain {domain} cannot be migrated: its overspill VM {} is a vhost-user disk, which QEMU cannot \
             migrate (no dirty logging); shut it down to move it",
            disk.vm
        );
    }
    let vms = names(disks);
    for vm in &vms {
        // A server that cannot be asked cannot take the VM either: refused, saying why.
        let answer = ask(args, &Request::Locate { vm: vm.to_owned() }).map_err(|error| {
            anyhow::anyhow!(
                "domain {domain} cannot be migrated: the writes of its overspill VM {vm} live in the overspill \
                 server of the host it runs on, and this host's server cannot be asked whether a peer holds \
                 them ({error:#}); the guest stays where it is."
            )
        })?;
        match (answer.ok, answer.peer) {
            (true, Some(peer)) => eprintln!("overspill: VM {vm} moves here from peer {peer}"),
            (ok, _) => bail!(
                "domain {domain} cannot be migrated: the writes of its overspill VM {vm} live in the overspill \
                 server of the host it runs on, and this host's server cannot take them from there ({}). Give \
                 each server the other as a peer (serve --peer, --peer-listen) to migrate it; the guest stays \
                 where it is.",
                if ok { "no peer of this server holds it".to_owned() } else { answer.message.unwrap_or_default() }
            ),
        }
    }
    for vm in &vms {
        note_migration(&args.run_dir, vm).with_context(|| {
            format!(
                "domain {domain} cannot be migrated: noting VM {vm}'s migration in {} for the start that follows",
                args.run_dir.display()
            )
        })?;
    }
    Ok(())
}

/// How long a migration's note stands for the `prepare` that follows it (a moment later, as
/// libvirt runs them); an older one is a migration that never started, and a plain start finds
/// it.
const MIGRATION_NOTE_STANDS: Duration = Duration::from_secs(60);

fn migration_note(run_dir: &std::path::Path, vm: &str) -> PathBuf {
    run_dir.join(format!("{vm}.migrating"))
}

fn note_migration(run_dir: &std::path::Path, vm: &str) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(run_dir)?;
    std::fs::write(migration_note(run_dir, vm), b"")
}

/// Whether VM `vm` starts here as a migration's destination (its note is taken).
fn take_migration_note(run_dir: &std::path::Path, vm: &str) -> bool {
    let note = migration_note(run_dir, vm);
    let fresh = std::fs::metadata(&note)
        .and_then(|m| m.modified())
        .is_ok_and(|at| at.elapsed().is_ok_and(|age| age < MIGRATION_NOTE_STANDS));
    // Taken whatever its age: it stands for one start.
    let _ = std::fs::remove_file(&note);
    fresh
}

/// Before a domain starts: no VM of it in use elsewhere, each vhost-user VM's socket made, and
/// each VM reset.
fn prepare(args: &LibvirtHookArgs, disks: Vec<OverspillDisk>, listed: control::Answer) -> anyhow::Result<()> {
    let domain = &args.domain;
    let states = listed.vms.unwrap_or_default();
    for vm in names(&disks) {
        let state = states.iter().find(|s| s.vm == vm).map(|s| s.state);
        if let Some(state @ (VmState::Connected | VmState::Resetting)) = state {
            bail!(
                "domain {domain} cannot start: its overspill VM {vm} is {state}, in use by another QEMU \
                 (a second domain with the same disk?); stop that one first"
            );
        }
    }
    for disk in &disks {
        let Some(socket) = &disk.vhost_user_socket else { continue };
        if let Some(dir) = listed.vhost_user_dir.as_deref().filter(|dir| !disk.in_directory(Some(dir))) {
            bail!(
                "domain {domain} cannot start: its vhost-user disk {} is in the hook's --vhost-user-dir, but the \
                 server makes its sockets in {} (give both the same directory)",
                socket.display(),
                dir.display()
            );
        }
        declare(args, &disk.vm, socket)?;
    }
    for vm in names(&disks) {
        let migrating = take_migration_note(&args.run_dir, &vm);
        reset(args, &vm, !migrating)?;
    }
    Ok(())
}

/// An overspill disk of a domain: the VM it names, and its socket if it is a vhost-user disk,
/// or where its NBD server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverspillDisk {
    pub vm: String,
    pub vhost_user_socket: Option<PathBuf>,
    pub nbd_server: Option<NbdServer>,
}

/// Where an NBD disk's `<host>` says its server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdServer {
    Unix(PathBuf),
    /// libvirt's default port is NBD's, 10809.
    Tcp {
        port: u16,
    },
}

impl OverspillDisk {
    /// Whether the server that `listed` answered serves this disk: an NBD disk at one of its
    /// listen addresses (any, for a server too old to say), a vhost-user disk in its
    /// directory (already checked when the hook was given one: `dir_given`).
    fn served_by(&self, listed: &control::Answer, dir_given: bool) -> bool {
        if self.vhost_user_socket.is_some() {
            return dir_given || listed.vhost_user_dir.as_deref().is_some_and(|dir| self.in_directory(Some(dir)));
        }
        let Some(addresses) = &listed.nbd_listen else { return true };
        addresses.iter().any(|address| match (&self.nbd_server, address.parse::<overspill_net::ListenAddr>()) {
            (Some(NbdServer::Unix(socket)), Ok(overspill_net::ListenAddr::Unix(path))) => same_path(socket, &path),
            (Some(NbdServer::Tcp { port }), Ok(overspill_net::ListenAddr::Tcp(bound))) => {
                bound.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok()) == Some(*port)
            }
            _ => false,
        })
    }

    /// An NBD disk, or a vhost-user disk whose socket is in `dir` (any, if `None`).
    fn in_directory(&self, dir: Option<&std::path::Path>) -> bool {
        match (&self.vhost_user_socket, dir) {
            (Some(socket), Some(dir)) => socket.parent().is_some_and(|parent| same_path(parent, dir)),
            _ => true,
        }
    }
}

/// Whether two paths name the same place, through symbolic links where they resolve.
fn same_path(a: &std::path::Path, b: &std::path::Path) -> bool {
    let resolved = |p: &std::path::Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned());
    a == b || resolved(a) == resolved(b)
}

/// The VM names, each once, in order.
fn names(disks: &[OverspillDisk]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for disk in disks {
        if !names.contains(&disk.vm) {
            names.push(disk.vm.clone());
        }
    }
    names
}

/// The VM names of the domain's overspill disks (see [`overspill_disks`]).
pub fn overspill_vms(xml: &str) -> anyhow::Result<Vec<String>> {
    Ok(names(&overspill_disks(xml)?))
}

/// `vm add VM`, and the socket the server made must be the one the domain names.
fn declare(args: &LibvirtHookArgs, vm: &str, socket: &std::path::Path) -> anyhow::Result<()> {
    let answer = ask(args, &Request::Add { vm: vm.to_owned(), image: None })?;
    let message = answer.message.unwrap_or_default();
    if !answer.ok {
        bail!("cannot make the vhost-user socket of VM {vm}: {message}");
    }
    match answer.socket {
        Some(made) if same_path(&made, socket) => {
            eprintln!("overspill: {message}");
            Ok(())
        }
        made => bail!(
            "the domain's vhost-user disk is {}, but the server made VM {vm}'s socket at {} (give the hook \
             --vhost-user-dir as serve's)",
            socket.display(),
            made.as_deref().unwrap_or(std::path::Path::new("?")).display()
        ),
    }
}

/// The domain's overspill disks: NBD disks whose export is `IMAGE@NAME` (with where their
/// `<host>` says the server is), and vhost-user disks whose socket is `NAME.sock`.
pub fn overspill_disks(xml: &str) -> anyhow::Result<Vec<OverspillDisk>> {
    let mut reader = quick_xml::Reader::from_str(xml);
    // Inside a <disk>, and whether it is a vhost-user one.
    let mut disk: Option<bool> = None;
    // An NBD source naming a VM, whose <host> may follow.
    let mut nbd: Option<OverspillDisk> = None;
    let mut vms = Vec::new();
    let default_server = NbdServer::Tcp { port: 10809 };
    loop {
        let event = reader.read_event()?;
        let (element, empty) = match &event {
            Event::Start(e) => (Some(e), false),
            Event::Empty(e) => (Some(e), true),
            _ => (None, false),
        };
        match (&event, element) {
            (_, Some(e)) if e.name().as_ref() == b"disk" => {
                let kind = e.try_get_attribute(b"type")?.map(|a| a.value.into_owned());
                disk = Some(kind.as_deref() == Some(b"vhostuser"));
            }
            (_, Some(e)) if disk.is_some() && e.name().as_ref() == b"source" => {
                let attribute = |key: &[u8]| -> anyhow::Result<Option<String>> {
                    match e.try_get_attribute(key)? {
                        Some(a) => Ok(Some(a.decode_and_unescape_value(reader.decoder())?.into_owned())),
                        None => Ok(None),
                    }
                };
                if disk == Some(true) {
                    let path = attribute(b"path")?.map(PathBuf::from);
                    let found = path.filter(|p| p.extension().is_some_and(|e| e == "sock")).and_then(|p| {
                        let vm = p.file_stem().and_then(|s| s.to_str()).map(str::to_owned)?;
                        Some(OverspillDisk { vm, vhost_user_socket: Some(p), nbd_server: None })
                    });
                    vms.extend(found.filter(|found| !found.vm.is_empty()));
                } else if attribute(b"protocol")?.as_deref() == Some("nbd") {
                    let vm = attribute(b"name")?
                        .as_deref()
                        .and_then(|name| name.split_once('@'))
                        .map(|(_, vm)| vm.to_owned());
                    let found = vm.filter(|vm| !vm.is_empty()).map(|vm| OverspillDisk {
                        vm,
                        vhost_user_socket: None,
                        nbd_server: None,
                    });
                    match (found, empty) {
                        (Some(mut found), true) => {
                            found.nbd_server = Some(default_server.clone());
                            vms.push(found);
                        }
                        (found, _) => nbd = found,
                    }
                }
            }
            (_, Some(e)) if nbd.is_some() && e.name().as_ref() == b"host" => {
                let attribute = |key: &[u8]| -> anyhow::Result<Option<String>> {
                    match e.try_get_attribute(key)? {
                        Some(a) => Ok(Some(a.decode_and_unescape_value(reader.decoder())?.into_owned())),
                        None => Ok(None),
                    }
                };
                let server = match (attribute(b"transport")?.as_deref(), attribute(b"socket")?) {
                    (Some("unix"), Some(socket)) => NbdServer::Unix(socket.into()),
                    _ => NbdServer::Tcp { port: attribute(b"port")?.and_then(|p| p.parse().ok()).unwrap_or(10809) },
                };
                if let Some(found) = nbd.as_mut() {
                    found.nbd_server.get_or_insert(server);
                }
            }
            (Event::End(e), _) if e.name().as_ref() == b"source" => {
                if let Some(mut found) = nbd.take() {
                    found.nbd_server.get_or_insert(default_server.clone());
                    vms.push(found);
                }
            }
            (Event::End(e), _) if e.name().as_ref() == b"disk" => disk = None,
            (Event::Eof, _) => break,
            _ => {}
        }
    }
    Ok(vms)
}

/// Asks the server, for at most `--wait` while it does not answer.
fn ask(args: &LibvirtHookArgs, request: &Request) -> anyhow::Result<control::Answer> {
    let control_socket = crate::vm::control_socket(args.control.as_deref());
    let deadline = Instant::now() + args.wait;
    loop {
        match control::ask(&control_socket, request) {
            Ok(answer) => return Ok(answer),
            Err(error) if Instant::now() < deadline => {
                tracing::debug!(%error, "the overspill server does not answer yet");
                std::thread::sleep(Duration::from_millis(250));
            }
            Err(error) => {
                return Err(anyhow::Error::from(error)
                    .context(format!("the server's control socket {}", control_socket.display())))
            }
        }
    }
}

/// `vm reset VM`, at the server's peers too if `everywhere`; a VM the server does not know has
/// nothing to reset.
fn reset(args: &LibvirtHookArgs, vm: &str, everywhere: bool) -> anyhow::Result<()> {
    let answer = ask(args, &Request::Reset { vm: vm.to_owned(), unless_connected: true, everywhere })?;
    let message = answer.message.unwrap_or_default();
    if answer.ok {
        eprintln!("overspill: {message}");
    } else if !message.contains("no VM named") {
        bail!("cannot start VM {vm} from the golden image: {message}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A migration's note stands for the one start that follows it, soon after: a note taken is
    /// gone, and an old one (a migration that never started) counts for nothing.
    #[test]
    fn a_migrations_note_stands_for_one_start_soon_after() {
        let dir = tempfile::tempdir().expect("tempdir");
        let run_dir = dir.path().join("run");
        assert!(!take_migration_note(&run_dir, "desk"), "no note, no migration");
        note_migration(&run_dir, "desk").expect("note");
        assert!(take_migration_note(&run_dir, "desk"));
        assert!(!take_migration_note(&run_dir, "desk"), "a note stands for one start");
        note_migration(&run_dir, "desk").expect("note");
        let old = std::time::SystemTime::now() - MIGRATION_NOTE_STANDS - Duration::from_secs(1);
        std::fs::File::options()
            .write(true)
            .open(migration_note(&run_dir, "desk"))
            .and_then(|note| note.set_modified(old))
            .expect("age the note");
        assert!(!take_migration_note(&run_dir, "desk"), "an old note counts");
        assert!(!migration_note(&run_dir, "desk").exists(), "an old note stays");
    }

    #[test]
    fn nbd_disks_that_name_a_vm_and_vhost_user_disks_on_a_named_socket_are_overspill_disks() {
        let xml = r#"<domain type='kvm'><name>d</name><devices>
            <disk type='network' device='disk'><driver name='qemu' type='raw'/>
              <source protocol='nbd' name='win7@vm-17'><host transport='unix' socket='/run/overspill.sock'/></source>
              <target dev='vda' bus='virtio'/></disk>
            <disk type='network' device='disk'><source protocol='nbd' name='@vm-18'/></disk>
            <disk type='network' device='disk'><source protocol='nbd' name='plain'/></disk>
            <disk type='network' device='disk'><source protocol='rbd' name='pool/img@snap'/></disk>
            <disk type='vhostuser' device='disk'><source type='unix' path='/run/overspill/vhost/desk-3.sock'/></disk>
            <disk type='vhostuser' device='disk'><source type='unix' path='/run/other/socket'/></disk>
            <disk type='file' device='cdrom'><source file='/x@y.iso'/></disk>
            <interface type='network'><source network='default'/></interface>
          </devices></domain>"#;
        assert_eq!(overspill_vms(xml).expect("parsed"), ["vm-17", "vm-18", "desk-3"]);
        let disks = overspill_disks(xml).expect("parsed");
        let socket = disks[2].vhost_user_socket.as_deref().expect("a vhost-user disk");
        assert_eq!(socket, std::path::Path::new("/run/overspill/vhost/desk-3.sock"));
        assert!(disks[2].in_directory(Some(std::path::Path::new("/run/overspill/vhost"))));
        assert!(!disks[2].in_directory(Some(std::path::Path::new("/run/qsd"))));
        assert!(disks[0].in_directory(Some(std::path::Path::new("/run/qsd"))), "an NBD disk is in no directory");
        assert_eq!(disks[0].nbd_server, Some(NbdServer::Unix("/run/overspill.sock".into())));
        assert_eq!(disks[1].nbd_server, Some(NbdServer::Tcp { port: 10809 }), "libvirt's default");
    }

    /// Only the disks of the server that answers are overspill's: NBD disks at its socket or
    /// TCP port, vhost-user disks in its directory.
    #[test]
    fn the_disks_of_another_nbd_server_or_vhost_user_backend_are_not_overspills() {
        let xml = r#"<domain type='kvm'><name>d</name><devices>
            <disk type='network' device='disk'><source protocol='nbd' name='@a'><host transport='unix' socket='/run/overspill.sock'/></source></disk>
            <disk type='network' device='disk'><source protocol='nbd' name='img@b'><host transport='unix' socket='/run/other-nbd.sock'/></source></disk>
            <disk type='network' device='disk'><source protocol='nbd' name='@c'><host name='storage1' port='10900'/></source></disk>
            <disk type='vhostuser' device='disk'><source type='unix' path='/run/overspill/vhost/d.sock'/></disk>
            <disk type='vhostuser' device='disk'><source type='unix' path='/var/tmp/spdk/e.sock'/></disk>
          </devices></domain>"#;
        let disks = overspill_disks(xml).expect("parsed");
        let answer = |listen: &[&str]| control::Answer {
            ok: true,
            nbd_listen: Some(listen.iter().map(|a| a.to_string()).collect()),
            vhost_user_dir: Some("/run/overspill/vhost".into()),
            ..control::Answer::default()
        };
        let served = |answer: &control::Answer| -> Vec<&str> {
            disks.iter().filter(|d| d.served_by(answer, false)).map(|d| d.vm.as_str()).collect()
        };
        assert_eq!(served(&answer(&["unix:/run/overspill.sock"])), ["a", "d"]);
        assert_eq!(served(&answer(&["tcp:0.0.0.0:10900"])), ["c", "d"]);
        // A server too old to say where it listens: every NBD disk naming a VM counts.
        let old = control::Answer { nbd_listen: None, ..answer(&[]) };
        assert_eq!(served(&old), ["a", "b", "c", "d"]);
    }
}
