//! `overspill vm`: a running server's named VMs, through its control socket.

use std::path::{Path, PathBuf};

use anyhow::bail;
use clap::{Args, Subcommand};
use overspill_server::control::{self, RateChange, Request, DEFAULT_CONTROL_SOCKET};
use overspill_server::vm_limits::HostBudget;
use overspill_server::vms::VmStatus;

use crate::size::format_bytes;

#[derive(Debug, Args)]
pub struct VmArgs {
    /// The server's control socket (`serve --control`), before or after the action. Without it:
    /// $OVERSPILL_CONTROL, then `control` in /etc/overspill/overspill.toml, then
    /// /run/overspill/control.sock if it exists (the unit's), then serve's default.
    #[arg(long, global = true)]
    control: Option<PathBuf>,
    #[command(subcommand)]
    action: VmAction,
}

#[derive(Debug, Subcommand)]
enum VmAction {
    /// Named VMs: image, state (connected, resetting, in-grace, lost, outgoing, incoming, fork,
    /// dropped), memory, spill, age.
    List {
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Throw a VM's overlay away now, whatever its state (a connected VM is disconnected at its
    /// next request, or within 20 s if it sends none); its next connection starts from the golden
    /// image. Also clears a lost VM.
    Reset {
        vm: String,
        /// At the server's peers too (`serve --peer`), each unless the VM is connected there: a
        /// peer's copy in grace (the VM's last run there) would otherwise be taken by the VM's
        /// next connection here. Refused, naming the peer, where it is connected or moving.
        #[arg(long)]
        everywhere: bool,
    },
    /// Throw away the overlay of a VM that is not connected (in grace, or lost), and remove
    /// its vhost-user socket if it has one (a VM `serve --vhost-user` declares gets its socket
    /// again when the server restarts).
    Drop { vm: String },
    /// Declare VM NAME for vhost-user on golden IMAGE (default: the --base image): the server
    /// makes its socket, VHOST_USER_DIR/NAME.sock, at once and after every restart, until
    /// `vm drop NAME`. Declaring a VM again on its image is no error.
    Add {
        vm: String,
        /// The golden image's export name (`serve --export NAME=…`, or an image store's image).
        image: Option<String>,
    },
    /// Capture VM NAME as the next version of its image (an image of `serve --images`): what it
    /// changed over the version it booted becomes a qcow2 layer over that version, vN.qcow2.
    /// Halt the guest first (its disk must be still and consistent); the VM's overlay ends with
    /// the capture (a connected VM's connection closes). The version gets no stage: give it to
    /// the test group with `overspill image test`.
    Capture { vm: String },
    /// Write VM NAME's disk as it is now as a checkpoint of its image (an image of `serve
    /// --images`): a qcow2 layer, IMAGE/checkpoints/CHECKPOINT.qcow2, over what the VM runs
    /// over. The VM is held still while it is read (its requests wait) and goes on after it.
    /// Pause or halt the guest first for a consistent filesystem.
    Checkpoint {
        vm: String,
        /// The checkpoint's name (default: NAME-<unix seconds>).
        #[arg(long = "as", value_name = "CHECKPOINT")]
        name: Option<String>,
        /// Also take it out to a directory or s3://BUCKET/PREFIX, as `overspill image
        /// checkpoint-export` does (this command reads the server's image store).
        #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX")]
        to: Option<String>,
    },
    /// Start new VMs from a checkpoint, copying nothing: FROM is a checkpoint (IMAGE:@NAME), a
    /// checkpoint taken out (its manifest, DIR/IMAGE@NAME.json or s3://…/IMAGE@NAME.json,
    /// brought into the server's store first), or a connected VM, checkpointed first. Each fork starts from the checkpoint at its first
    /// connection (to export IMAGE@FORK), diverges on its own, and starts from it again after
    /// its overlay ends (a clean disconnect, `vm reset`). A fork waits, without end, until
    /// `vm drop FORK`, after which its name is refused until `vm reset FORK`.
    Fork {
        from: String,
        /// The forks' names.
        #[arg(long = "as", value_name = "NAME,…", value_delimiter = ',', required = true)]
        names: Vec<String>,
        /// With FROM a VM: its checkpoint's name (default: FROM-<unix seconds>).
        #[arg(long)]
        checkpoint: Option<String>,
    },
    /// The test group of image stages (`serve --test-vms`): with patterns, replace it live
    /// (VM name patterns, `group:NAME` for a named group's VMs); with --none, empty it; alone,
    /// print it. New VMs of the group get an image's test version (`overspill image test`);
    /// running VMs keep theirs. Lasts while the server runs.
    TestGroup {
        #[arg(value_name = "GLOB")]
        patterns: Vec<String>,
        #[arg(long, conflicts_with = "patterns")]
        none: bool,
    },
    /// Say VM NAME's boot is over (`serve --boot-max`): its boot slot goes to the next VM in
    /// line and its golden-image fetches no longer go first. Without it a boot lasts
    /// `--boot-time`.
    Booted { vm: String },
    /// Set VM NAME's limits, live (its connection holds to them from its next request; a VM not
    /// connected yet gets them when it comes); with neither option, print them. With --group,
    /// NAME is a group (`serve --group`, or `image:IMAGE` for an image's VMs in no named
    /// group), whose VMs share its limits beside their own. They last while the server runs
    /// (not across a restart or reload): put lasting ones in `serve --limit-iops`,
    /// `--group-limit-iops` and the like.
    ///
    /// With --host, NAME is one of the host's budgets, which all VMs share: `golden`
    /// (golden-image fetches: what the read caches miss; booting VMs' fetches go first) or
    /// `spill` (spill segment writes, 2 MiB each: set --bandwidth).
    Limit {
        vm: String,
        /// NAME is a group of VMs, not a VM.
        #[arg(long, conflicts_with = "host")]
        group: bool,
        /// NAME is a budget of the host's: golden or spill.
        #[arg(long)]
        host: bool,
        /// Operations per second, `RATE[:BURST]` (e.g. 1000 or 1000:5000), or `off`.
        #[arg(long, value_name = "RATE[:BURST]|off", value_parser = rate_change(crate::size::parse_ops_rate))]
        iops: Option<RateChange>,
        /// Bytes per second, `SIZE[:BURST]` (e.g. 50M or 50M:200M), or `off`.
        #[arg(long, value_name = "SIZE[:BURST]|off", value_parser = rate_change(crate::size::parse_bytes_rate))]
        bandwidth: Option<RateChange>,
    },
}

/// A limit as the command line changes it: `off`, or a rate.
fn rate_change(
    rate: fn(&str) -> Result<overspill_block::Rate, String>,
) -> impl Fn(&str) -> Result<RateChange, String> + Clone + Send + Sync + 'static {
    move |s: &str| match s {
        "off" => Ok(RateChange::Off),
        s => rate(s).map(|r| RateChange::Set { per_second: r.per_second, burst: r.burst }),
    }
}

pub fn run(args: VmArgs) -> anyhow::Result<()> {
    let request = match &args.action {
        VmAction::List { .. } => Request::List,
        VmAction::Reset { vm, everywhere } => {
            Request::Reset { vm: vm.clone(), unless_connected: false, everywhere: *everywhere }
        }
        VmAction::Drop { vm } => Request::Drop { vm: vm.clone() },
        VmAction::Add { vm, image } => Request::Add { vm: vm.clone(), image: image.clone() },
        VmAction::Booted { vm } => Request::Booted { vm: vm.clone() },
        VmAction::Capture { vm } => Request::Capture { vm: vm.clone() },
        VmAction::Checkpoint { vm, name, .. } => {
            Request::Checkpoint { vm: vm.clone(), name: name.clone().unwrap_or_else(|| default_checkpoint(vm)) }
        }
        VmAction::Fork { from, names, checkpoint } if is_manifest(from) => {
            if checkpoint.is_some() {
                bail!("--checkpoint names a new checkpoint of a VM, and {from} is a checkpoint taken out already");
            }
            let label = bring_in(&control_socket(args.control.as_deref()), from)?;
            Request::Fork { from: label, names: names.clone(), checkpoint: None }
        }
        VmAction::Fork { from, checkpoint: Some(_), .. } if from.contains(':') => {
            bail!("--checkpoint names a new checkpoint of a VM, and {from} is a checkpoint already")
        }
        VmAction::Fork { from, names, checkpoint } => Request::Fork {
            from: from.clone(),
            names: names.clone(),
            checkpoint: (!from.contains(':')).then(|| checkpoint.clone().unwrap_or_else(|| default_checkpoint(from))),
        },
        VmAction::TestGroup { patterns, none } => {
            Request::TestGroup { set: (*none || !patterns.is_empty()).then(|| patterns.clone()) }
        }
        VmAction::Limit { vm, host: true, iops, bandwidth, .. } => Request::HostLimit {
            budget: match vm.as_str() {
                "golden" => HostBudget::Golden,
                "spill" => HostBudget::Spill,
                other => bail!("the host's budgets are golden and spill, not {other:?}"),
            },
            ops: iops.unwrap_or_default(),
            bytes: bandwidth.unwrap_or_default(),
        },
        VmAction::Limit { vm, group, iops, bandwidth, .. } => Request::Limit {
            vm: vm.clone(),
            group: *group,
            ops: iops.unwrap_or_default(),
            bytes: bandwidth.unwrap_or_default(),
        },
    };
    let answer = control::ask(&control_socket(args.control.as_deref()), &request)?;
    if !answer.ok {
        bail!("{}", answer.message.unwrap_or_else(|| "refused".into()));
    }
    match (args.action, answer.vms) {
        (VmAction::List { json: true }, Some(vms)) => println!("{}", serde_json::to_string_pretty(&vms)?),
        (VmAction::List { json: false }, Some(vms)) => print!("{}", table(&vms)),
        (VmAction::Checkpoint { to: Some(to), .. }, _) => {
            println!("{}", answer.message.unwrap_or_default());
            let (Some(images), Some(label)) = (answer.images, answer.checkpoint) else {
                bail!("the server did not say where its image store is: take the checkpoint out with `overspill image checkpoint-export`");
            };
            crate::image::export(&images, &label, &to)?;
        }
        _ => println!("{}", answer.message.unwrap_or_default()),
    }
    Ok(())
}

/// Whether `vm fork FROM` names a checkpoint taken out (a manifest's path or S3 key) rather
/// than a VM or a checkpoint of the store (`IMAGE:@NAME`): names hold no `/`.
fn is_manifest(from: &str) -> bool {
    !from.contains(":@") && (from.starts_with("s3://") || from.contains('/'))
}

/// Brings the checkpoint whose manifest is `manifest` into the store of the server at `control`:
/// its label.
fn bring_in(control: &Path, manifest: &str) -> anyhow::Result<String> {
    let listed = control::ask(control, &Request::List)?;
    let Some(images) = listed.images else {
        bail!("the server serves no image store (--images) to bring {manifest} into");
    };
    let label = crate::image::import(&images, manifest)?;
    Ok(label)
}

/// A checkpoint's name when none is given: the VM's, and when.
fn default_checkpoint(vm: &str) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let suffix = format!("-{now}");
    // Within a name's length whatever the VM's.
    let kept: String = vm.chars().take(overspill_server::error::NAME_MAX.saturating_sub(suffix.len())).collect();
    format!("{kept}{suffix}")
}

/// Where the server to talk to listens for control requests: `given`, else the environment's
/// choice, else the host's configuration's, else the unit's socket if there is one, else the
/// socket a `serve` with no `--control` makes.
pub fn control_socket(given: Option<&Path>) -> PathBuf {
    control_socket_from(given, std::env::var_os(CONTROL_VARIABLE).map(PathBuf::from), Path::new(HOST_CONFIG))
}

/// The environment variable naming the control socket.
const CONTROL_VARIABLE: &str = "OVERSPILL_CONTROL";
/// The host's configuration file (`serve --config`), where `control` may name the socket.
const HOST_CONFIG: &str = "/etc/overspill/overspill.toml";
/// The socket docs/overspill.service's server makes.
const UNIT_CONTROL_SOCKET: &str = "/run/overspill/control.sock";

fn control_socket_from(given: Option<&Path>, variable: Option<PathBuf>, config: &Path) -> PathBuf {
    if let Some(given) = given {
        return given.to_owned();
    }
    if let Some(variable) = variable.filter(|v| !v.as_os_str().is_empty()) {
        return variable;
    }
    // Where serve puts it from that file: `control`, else in the state directory, which is
    // `state-dir`, else `spill-dir`'s `state`.
    let configured = std::fs::read_to_string(config).ok().and_then(|text| {
        let table: toml::Table = text.parse().ok()?;
        let path = |key: &str| table.get(key).and_then(toml::Value::as_str).map(PathBuf::from);
        path("control")
            .or_else(|| path("state-dir").map(|state| state.join("control.sock")))
            .or_else(|| path("spill-dir").map(|spill| spill.join("state").join("control.sock")))
    });
    if let Some(configured) = configured {
        return configured;
    }
    if Path::new(UNIT_CONTROL_SOCKET).exists() {
        return PathBuf::from(UNIT_CONTROL_SOCKET);
    }
    PathBuf::from(DEFAULT_CONTROL_SOCKET)
}

fn table(vms: &[VmStatus]) -> String {
    let mut out = format!(
        "{:<24} {:<16} {:<16} {:<10} {:>10} {:>10} {:>8}  {}\n",
        "VM", "IMAGE", "OWNER", "STATE", "MEMORY", "SPILL", "AGE", ""
    );
    for vm in vms {
        out += &format!(
            "{:<24} {:<16} {:<16} {:<10} {:>10} {:>10} {:>7}s  {}\n",
            vm.vm,
            // The empty export name is --base's image: "default", as `overspill stat` says.
            if vm.image.is_empty() { "default" } else { &vm.image },
            vm.owner.as_deref().unwrap_or("-"),
            vm.state.as_str(),
            format_bytes(vm.memory_bytes),
            format_bytes(vm.spill_bytes),
            vm.age_s,
            vm.detail
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fork_comes_from_a_manifest_only_when_a_path_or_a_key_says_so() {
        for manifest in ["./desk@ready.json", "/srv/out/desk@ready.json", "s3://b/p/desk@ready.json", "out/x.json"] {
            assert!(is_manifest(manifest), "{manifest}");
        }
        for other in ["web.json", "desk:@ready.json", "builder", "desk:@ready"] {
            assert!(!is_manifest(other), "{other}");
        }
    }

    #[test]
    fn a_default_checkpoint_name_is_a_name_whatever_the_vms() {
        let long = "v".repeat(64);
        for vm in ["desk-1", long.as_str()] {
            let name = default_checkpoint(vm);
            assert!(overspill_server::check_name("checkpoint", &name).is_ok(), "{name}");
            assert!(name.starts_with(&vm[..vm.len().min(40)]), "{name}");
        }
    }

    /// `--control` wins, then the variable, then the host's configuration (its `control`, or
    /// its state or spill directory's socket); without any of them, the unit's socket or
    /// serve's default.
    #[test]
    fn the_control_socket_is_the_flag_then_the_variable_then_the_configuration() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("overspill.toml");
        std::fs::write(&config, "control = \"/run/site/control.sock\"\nram = \"256M\"\n").expect("config");
        let flag = Path::new("/flag.sock");
        let variable = || Some(PathBuf::from("/variable.sock"));
        assert_eq!(control_socket_from(Some(flag), variable(), &config), flag);
        assert_eq!(control_socket_from(None, variable(), &config), Path::new("/variable.sock"));
        assert_eq!(control_socket_from(None, None, &config), Path::new("/run/site/control.sock"));
        // Without `control`, where serve makes it from the file's state or spill directory.
        std::fs::write(&config, "spill-dir = \"/srv/spill\"\nstate-dir = \"/srv/state\"\n").expect("config");
        assert_eq!(control_socket_from(None, None, &config), Path::new("/srv/state/control.sock"));
        std::fs::write(&config, "spill-dir = \"/srv/spill\"\n").expect("config");
        assert_eq!(control_socket_from(None, None, &config), Path::new("/srv/spill/state/control.sock"));
        let fallback = control_socket_from(None, None, &dir.path().join("none.toml"));
        let expected =
            if Path::new(UNIT_CONTROL_SOCKET).exists() { UNIT_CONTROL_SOCKET } else { DEFAULT_CONTROL_SOCKET };
        assert_eq!(fallback, Path::new(expected));
    }
}
