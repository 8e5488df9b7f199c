//! The control socket and `overspill vm`: list the named VMs, reset or drop one.
//!
//! One JSON request per line on a Unix socket (`{"op":"list"}`, `{"op":"reset","vm":"NAME"}`,
//! `{"op":"drop","vm":"NAME"}`), one JSON answer per line. The socket is made mode 0600 (the
//! server's user only: a reset throws a VM's writes away); each connection gets a thread, a
//! read timeout and a cap on its request's length.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use overspill_nbd::{ListenAddr, Listener};
use serde::{Deserialize, Serialize};

use crate::size::format_bytes;
use crate::vms::{VmRegistry, VmStatus};

/// Where `serve` puts its control socket unless told otherwise: inside its default state directory.
pub const DEFAULT_CONTROL_SOCKET: &str = "/var/tmp/overspill/state/control.sock";

/// Longest request line accepted.
const MAX_REQUEST_BYTES: u64 = 4096;
const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum Request {
    List,
    Reset { vm: String },
    Drop { vm: String },
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Answer {
    ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    vms: Option<Vec<VmStatus>>,
}

/// Serves the control socket at `path` on a thread of its own; the socket goes with the
/// returned listener.
pub fn spawn(path: &Path, registry: Arc<VmRegistry>) -> anyhow::Result<Arc<Listener>> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let listener =
        Arc::new(Listener::bind(&ListenAddr::Unix(path.to_owned())).with_context(|| {
            format!("control socket {} (each server needs a --state-dir of its own)", path.display())
        })?);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} private", path.display()))?;
    let Listener::Unix(socket, ..) = listener.as_ref() else { unreachable!("bound a unix address") };
    let socket = socket.try_clone().context("control socket")?;
    std::thread::Builder::new().name("control".into()).spawn(move || {
        for stream in socket.incoming() {
            let Ok(stream) = stream else { continue };
            let registry = registry.clone();
            let _ = std::thread::Builder::new().name("control-client".into()).spawn(move || {
                if let Err(error) = answer(stream, &registry) {
                    tracing::debug!(%error, "control client");
                }
            });
        }
    })?;
    Ok(listener)
}

fn answer(stream: UnixStream, registry: &VmRegistry) -> std::io::Result<()> {
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    let mut line = String::new();
    BufReader::new((&stream).take(MAX_REQUEST_BYTES)).read_line(&mut line)?;
    let answer = match serde_json::from_str::<Request>(&line) {
        Ok(Request::List) => Answer { ok: true, vms: Some(registry.list()), ..Answer::default() },
        Ok(Request::Reset { vm }) => outcome(registry.reset(&vm)),
        Ok(Request::Drop { vm }) => outcome(registry.drop_vm(&vm)),
        Err(error) => Answer { ok: false, message: Some(format!("bad request: {error}")), ..Answer::default() },
    };
    let mut text = serde_json::to_string(&answer).map_err(std::io::Error::other)?;
    text.push('\n');
    (&stream).write_all(text.as_bytes())
}

fn outcome(result: Result<String, String>) -> Answer {
    match result {
        Ok(message) => Answer { ok: true, message: Some(message), ..Answer::default() },
        Err(message) => Answer { ok: false, message: Some(message), ..Answer::default() },
    }
}

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
    /// next request); its next connection starts from the golden image. Also clears a lost VM.
    Reset { vm: String },
    /// Throw away the overlay of a VM that is not connected (in grace, or lost).
    Drop { vm: String },
}

pub fn run(args: VmArgs) -> anyhow::Result<()> {
    let request = match &args.action {
        VmAction::List { .. } => Request::List,
        VmAction::Reset { vm } => Request::Reset { vm: vm.clone() },
        VmAction::Drop { vm } => Request::Drop { vm: vm.clone() },
    };
    let answer = ask(&args.control, &request)?;
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

fn ask(control: &Path, request: &Request) -> anyhow::Result<Answer> {
    let stream = UnixStream::connect(control)
        .with_context(|| format!("connecting to the control socket {} (is serve running?)", control.display()))?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    let mut text = serde_json::to_string(request)?;
    text.push('\n');
    (&stream).write_all(text.as_bytes())?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line)?;
    serde_json::from_str(&line).with_context(|| format!("the server's answer {line:?}"))
}

fn table(vms: &[VmStatus]) -> String {
    let mut out =
        format!("{:<24} {:<16} {:<10} {:>10} {:>10} {:>8}  {}\n", "VM", "IMAGE", "STATE", "MEMORY", "SPILL", "AGE", "");
    for vm in vms {
        out += &format!(
            "{:<24} {:<16} {:<10} {:>10} {:>10} {:>7}s  {}\n",
            vm.vm,
            vm.image,
            vm.state.as_str(),
            format_bytes(vm.memory_bytes),
            format_bytes(vm.spill_bytes),
            vm.age_s,
            vm.detail
        );
    }
    out
}
