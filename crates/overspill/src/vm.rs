//! `overspill vm`: a running server's named VMs, through its control socket.

use std::path::PathBuf;

use anyhow::bail;
use clap::{Args, Subcommand};
use overspill_server::control::{self, Request, DEFAULT_CONTROL_SOCKET};
use overspill_server::vms::VmStatus;

use crate::size::format_bytes;

#[derive(Debug, Args)]
pub struct VmArgs {
    /// The server's control socket (`serve --control`).
    #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
    control: PathBuf,
    #[command(subcommand)]
    action: VmAction,
}

#[derive(Debug, Subcommand)]
enum VmAction {
    /// Named VMs: image, state (connected, resetting, in-grace, lost), memory, spill, age.
    List {
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Throw a VM's overlay away now, whatever its state (a connected VM is disconnected at its
    /// next request, or within 20 s if it sends none); its next connection starts from the golden
    /// image. Also clears a lost VM.
    Reset { vm: String },
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
}

pub fn run(args: VmArgs) -> anyhow::Result<()> {
    let request = match &args.action {
        VmAction::List { .. } => Request::List,
        VmAction::Reset { vm } => Request::Reset { vm: vm.clone() },
        VmAction::Drop { vm } => Request::Drop { vm: vm.clone() },
        VmAction::Add { vm, image } => Request::Add { vm: vm.clone(), image: image.clone() },
    };
    let answer = control::ask(&args.control, &request)?;
    if !answer.ok {
        bail!("{}", answer.message.unwrap_or_else(|| "refused".into()));
    }
    match (args.action, answer.vms) {
        (VmAction::List { json: true }, Some(vms)) => println!("{}", serde_json::to_string_pretty(&vms)?),
        (VmAction::List { json: false }, Some(vms)) => print!("{}", table(&vms)),
        _ => println!("{}", answer.message.unwrap_or_default()),
    }
    Ok(())
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
