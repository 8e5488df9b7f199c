//! The control socket and `overspill vm`: list the named VMs, reset or drop one.
//!
//! One JSON request per line on a Unix socket (`{"op":"list"}`, `{"op":"reset","vm":"NAME"}`,
//! `{"op":"drop","vm":"NAME"}`), one JSON answer per line. The socket is made mode 0600 (the
//! server's user only: a reset throws a VM's writes away); each connection gets a thread, a
//! read timeout and a cap on its request's length.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use overspill_nbd::{ListenAddr, Listener};
use serde::{Deserialize, Serialize};

use crate::vms::{VmRegistry, VmStatus};
use crate::ServerError;

/// Where `serve` puts its control socket unless told otherwise: inside its default state directory.
pub const DEFAULT_CONTROL_SOCKET: &str = "/var/tmp/overspill/state/control.sock";

/// Longest request line accepted.
const MAX_REQUEST_BYTES: u64 = 4096;
const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    List,
    Reset { vm: String },
    Drop { vm: String },
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Answer {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vms: Option<Vec<VmStatus>>,
}

/// Serves the control socket at `path` on a thread of its own; the socket goes with the
/// returned listener.
pub fn spawn(path: &Path, registry: Arc<VmRegistry>) -> Result<Arc<Listener>, ServerError> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        crate::files::own_directory(dir).map_err(|e| ServerError::io(format!("creating {}", dir.display()), e))?;
    }
    let listener = Arc::new(Listener::bind(&ListenAddr::Unix(path.to_owned())).map_err(|e| {
        ServerError::io(format!("control socket {} (each server needs a --state-dir of its own)", path.display()), e)
    })?);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| ServerError::io(format!("making {} private", path.display()), e))?;
    let Listener::Unix(socket, ..) = listener.as_ref() else { unreachable!("bound a unix address") };
    let socket = socket.try_clone().map_err(|e| ServerError::io("control socket", e))?;
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for stream in socket.incoming() {
                let stream = match stream {
                    Ok(stream) => stream,
                    // Out of file descriptors, most likely: the client waits in the backlog,
                    // and this thread must not spin a core until one is free.
                    Err(error) => {
                        tracing::debug!(%error, "control socket: accept failed");
                        std::thread::sleep(std::time::Duration::from_millis(10));
                        continue;
                    }
                };
                let registry = registry.clone();
                let _ = std::thread::Builder::new().name("control-client".into()).spawn(move || {
                    if let Err(error) = answer(stream, &registry) {
                        tracing::debug!(%error, "control client");
                    }
                });
            }
        })
        .map_err(|e| ServerError::io("starting the control thread", e))?;
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

fn outcome(result: Result<String, ServerError>) -> Answer {
    match result {
        Ok(message) => Answer { ok: true, message: Some(message), ..Answer::default() },
        Err(error) => Answer { ok: false, message: Some(error.to_string()), ..Answer::default() },
    }
}

/// Sends one request to the control socket at `control` and returns the server's answer.
pub fn ask(control: &Path, request: &Request) -> Result<Answer, ServerError> {
    let stream = UnixStream::connect(control).map_err(|e| {
        ServerError::io(format!("connecting to the control socket {} (is serve running?)", control.display()), e)
    })?;
    let io = |e| ServerError::io(format!("talking to {}", control.display()), e);
    stream.set_read_timeout(Some(TIMEOUT)).map_err(io)?;
    let mut text = serde_json::to_string(request).map_err(|e| ServerError::Control(e.to_string()))?;
    text.push('\n');
    (&stream).write_all(text.as_bytes()).map_err(io)?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(io)?;
    serde_json::from_str(&line).map_err(|e| ServerError::Control(format!("the server's answer {line:?}: {e}")))
}
