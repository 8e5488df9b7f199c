//! `overspill libvirt-hook`: libvirt's qemu hook for domains with overspill disks, installed as
//! `/etc/libvirt/hooks/qemu.d/overspill` (libvirt 6.5 and later run every script there, so an
//! operator's own hook stays).
//!
//! libvirt runs it as `HOOK DOMAIN OPERATION SUB-OPERATION EXTRA` with the domain's XML on
//! standard input, and a non-zero exit stops the operation, with what the hook wrote to
//! standard error in libvirt's error. An overspill disk is an NBD disk whose export names a VM
//! (`IMAGE@NAME`, `@NAME` for the default image), or a vhost-user disk whose socket is
//! `NAME.sock` in the server's vhost-user directory (given to the hook as `--vhost-user-dir`;
//! without it, any `NAME.sock` is taken for VM NAME where the hook refuses, and only those in
//! the directory the server reports where it declares). What the hook does:
//!
//! - `migrate` (on the destination, before its QEMU starts): refuses, naming the VMs. Their
//!   writes live in the source host's server, and the destination's server would start them
//!   from the golden image under a running guest. libvirt aborts the migration and the guest
//!   runs on at the source.
//! - `restore` (`virsh restore`, a `managedsave` start, libvirt-guests' suspend): refuses. A
//!   saved QEMU ends its disks' connections with NBD_CMD_DISC, which ends their overlays, so the
//!   saved guest's memory would run on golden data; and an overlay waiting under the VM's name
//!   then is another session's (started and killed since the save), not the saved one's.
//! - `prepare begin` of any other start: `vm add` of each vhost-user VM (its socket must exist
//!   before QEMU starts; one declared already keeps its image, others get the default image),
//!   then `vm reset` of each VM, so that every power-on starts from the golden image, as PVS
//!   does (a QEMU killed and started again within the grace would otherwise boot into the old
//!   session's writes). A name the server does not know is fine; a VM still connected refuses
//!   the start (another domain's QEMU has that disk).
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
    let mut xml = String::new();
    std::io::stdin().read_to_string(&mut xml).context("reading the domain XML on standard input")?;
    let disks: Vec<OverspillDisk> = overspill_disks(&xml)
        .context("reading the domain XML")?
        .into_iter()
        .filter(|disk| disk.in_directory(args.vhost_user_dir.as_deref()))
        .collect();
    if disks.is_empty() {
        return Ok(());
    }
    let domain = &args.domain;
    let listed = names(&disks).join(", ");
    match (args.operation.as_str(), args.sub_operation.as_str()) {
        ("migrate", _) => migrate(&args, &disks),
        ("restore", _) => bail!(
            "domain {domain} cannot be restored: the overlay of its overspill VM(s) {listed} ended when it was \
             saved (a saved QEMU ends its disks' connections), and the saved guest would run on golden data. \
             Start it afresh instead (virsh managedsave-remove {domain}, then virsh start {domain})."
        ),
        ("prepare", "begin") => prepare(&args, disks),
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
    for vm in names(disks) {
        // A server that cannot be asked cannot take the VM either: refused, saying why.
        let answer = ask(args, &Request::Locate { vm: vm.clone() }).map_err(|error| {
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
    Ok(())
}

/// Before a domain starts: no VM of it in use elsewhere, each vhost-user VM's socket made, and
/// each VM reset.
fn prepare(args: &LibvirtHookArgs, disks: Vec<OverspillDisk>) -> anyhow::Result<()> {
    let domain = &args.domain;
    let listed = ask(args, &Request::List)?;
    // Without --vhost-user-dir, a vhost-user disk is overspill's only in the server's directory;
    // with it, one there that the server would make elsewhere is a setup to refuse.
    let disks: Vec<OverspillDisk> = match &args.vhost_user_dir {
        Some(_) => disks,
        None => disks.into_iter().filter(|disk| disk.in_directory(listed.vhost_user_dir.as_deref())).collect(),
    };
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
        reset(args, &vm)?;
    }
    Ok(())
}

/// An overspill disk of a domain: the VM it names, and its socket if it is a vhost-user disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverspillDisk {
    pub vm: String,
    pub vhost_user_socket: Option<PathBuf>,
}

impl OverspillDisk {
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

/// The domain's overspill disks: NBD disks whose export is `IMAGE@NAME`, and vhost-user disks
/// whose socket is `NAME.sock`.
pub fn overspill_disks(xml: &str) -> anyhow::Result<Vec<OverspillDisk>> {
    let mut reader = quick_xml::Reader::from_str(xml);
    // Inside a <disk>, and whether it is a vhost-user one.
    let mut disk: Option<bool> = None;
    let mut vms = Vec::new();
    loop {
        match reader.read_event()? {
            Event::Start(e) if e.name().as_ref() == b"disk" => {
                let kind = e.try_get_attribute(b"type")?.map(|a| a.value.into_owned());
                disk = Some(kind.as_deref() == Some(b"vhostuser"));
            }
            Event::End(e) if e.name().as_ref() == b"disk" => disk = None,
            Event::Start(e) | Event::Empty(e) if disk.is_some() && e.name().as_ref() == b"source" => {
                let attribute = |key: &[u8]| -> anyhow::Result<Option<String>> {
                    match e.try_get_attribute(key)? {
                        Some(a) => Ok(Some(a.decode_and_unescape_value(reader.decoder())?.into_owned())),
                        None => Ok(None),
                    }
                };
                let found = if disk == Some(true) {
                    let path = attribute(b"path")?.map(PathBuf::from);
                    path.filter(|p| p.extension().is_some_and(|e| e == "sock")).and_then(|p| {
                        let vm = p.file_stem().and_then(|s| s.to_str()).map(str::to_owned)?;
                        Some(OverspillDisk { vm, vhost_user_socket: Some(p) })
                    })
                } else if attribute(b"protocol")?.as_deref() == Some("nbd") {
                    attribute(b"name")?
                        .as_deref()
                        .and_then(|name| name.split_once('@'))
                        .map(|(_, vm)| OverspillDisk { vm: vm.to_owned(), vhost_user_socket: None })
                } else {
                    None
                };
                if let Some(found) = found.filter(|found| !found.vm.is_empty()) {
                    vms.push(found);
                }
            }
            Event::Eof => break,
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

/// `vm reset VM`; a VM the server does not know has nothing to reset.
fn reset(args: &LibvirtHookArgs, vm: &str) -> anyhow::Result<()> {
    let answer = ask(args, &Request::Reset { vm: vm.to_owned() })?;
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
    }
}
