//! Where `serve` listens: the socket systemd hands over, or one bound at `--listen`, and who may
//! connect to the Unix sockets the server makes (`--socket-mode`, `--socket-group`).

use anyhow::{bail, Context};
use overspill_net::{ListenAddr, Listener, SocketAccess};

use super::ServeArgs;

/// Where the server listens when neither `--listen` nor systemd says.
pub(super) const DEFAULT_LISTEN: &str = "tcp:127.0.0.1:10809";

/// The socket systemd handed over, or one bound at `--listen` with the access asked for.
pub(super) fn listen(args: &ServeArgs, access: SocketAccess, inherited: Option<Listener>) -> anyhow::Result<Listener> {
    // The vhost-user sockets take them too, whatever the NBD socket is.
    let for_nbd_only = (args.socket_mode.is_some() || args.socket_group.is_some())
        && args.vhost_user.is_empty()
        && args.vhost_user_dir.is_none();
    if let Some(listener) = inherited {
        // The socket unit says who may connect (SocketMode=, SocketGroup=).
        if for_nbd_only {
            tracing::warn!("--socket-mode and --socket-group are ignored for a socket handed over by systemd");
        }
        // The socket unit says where (ListenStream=): a `listen` set in the config for another
        // address would otherwise leave its clients refused with no word why.
        if args.listen.to_string() != DEFAULT_LISTEN {
            tracing::warn!(
                listen = %args.listen,
                "--listen is ignored: the socket systemd handed over is served (set ListenStream= in overspill.socket)"
            );
        }
        return Ok(listener);
    }
    let listener = Listener::bind(&args.listen).with_context(|| format!("listening on {}", args.listen))?;
    if let ListenAddr::Unix(path) = &args.listen {
        access.apply(path)?;
    } else if for_nbd_only {
        bail!("--socket-mode and --socket-group apply to a unix: socket, not {}", args.listen);
    }
    Ok(listener)
}

/// The listening socket systemd handed over (socket activation: `LISTEN_FDS` for this
/// process), if any. Only the first is served.
pub(super) fn inherited_listener() -> anyhow::Result<Option<Listener>> {
    use std::os::fd::FromRawFd;
    // The variables stay: unsetting them while other threads run (the memory sampler, the
    // signal thread) races their reads of the environment. They name this pid, which no child
    // has, and a restart in place sets them anew.
    // Variables for another process (a wrapper that started this one as its child) are not
    // ours to judge; sd_notify would still hold their names against no sockets.
    let ours = std::env::var("LISTEN_PID").ok().and_then(|pid| pid.trim().parse::<u32>().ok());
    if ours != Some(std::process::id()) {
        return Ok(None);
    }
    // Variables for this process that do not parse, or name sockets it was not passed, are the
    // service manager's setup gone wrong: serving a socket of our own instead would leave the
    // manager's unanswered.
    let fds = sd_notify::listen_fds_with_names(false)
        .context("the sockets the service manager passed (LISTEN_FDS, LISTEN_FDNAMES) do not add up")?;
    let mut fds = fds.map(|(fd, _name)| fd);
    let Some(fd) = fds.next() else { return Ok(None) };
    if fds.next().is_some() {
        tracing::warn!("systemd passed more than one socket: only the first is served");
    }
    // SAFETY: the service manager passed this descriptor to this process (LISTEN_PID is ours,
    // checked by listen_fds) for it alone to use; nothing else in the process owns it.
    let socket = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let listener = Listener::from_inherited(socket).context("the socket systemd passed (LISTEN_FDS)")?;
    tracing::info!(listen = %listener.local_addr(), "serving the socket systemd passed");
    Ok(Some(listener))
}

pub(super) fn parse_socket_mode(text: &str) -> Result<u32, String> {
    match u32::from_str_radix(text, 8) {
        Ok(mode) if mode <= 0o777 => Ok(mode),
        _ => Err(format!("{text:?}: give permission bits in octal, for example 660")),
    }
}

/// `--socket-mode` and `--socket-group`, the group looked up by name unless it is a number.
pub(super) fn socket_access(args: &ServeArgs) -> anyhow::Result<SocketAccess> {
    let group = match args.socket_group.as_deref() {
        None => None,
        Some(group) => Some(match group.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => nix::unistd::Group::from_name(group)
                .with_context(|| format!("looking up group {group:?}"))?
                .with_context(|| format!("--socket-group {group:?}: no such group"))?
                .gid
                .as_raw(),
        }),
    };
    // Found at the first socket it would fail, and take every VM of the server down with it: a
    // user may give its files only to its own groups (the packaged unit's dynamic user is in
    // none of QEMU's).
    if let (Some(gid), Some(name)) = (group, args.socket_group.as_deref()) {
        let member = nix::unistd::geteuid().is_root()
            || nix::unistd::getegid().as_raw() == gid
            || nix::unistd::getgroups().is_ok_and(|groups| groups.iter().any(|g| g.as_raw() == gid));
        if !member {
            bail!(
                "--socket-group {name}: this server's user is in no such group, so it cannot give its sockets to it; \
                 add the user to the group (the packaged unit: SupplementaryGroups={name} in a drop-in, \
                 systemctl edit overspill)"
            );
        }
    }
    Ok(SocketAccess { mode: args.socket_mode, group })
}
