//! `overspill libvirt-reboots`: starts again the libvirt domains with overspill disks whose guest
//! rebooted, for `<on_reboot>destroy</on_reboot>` (docs/lifecycle.md, "Reset at reboot"): libvirt
//! then runs QEMU with `-no-reboot`, so a guest's reboot ends QEMU, its disks' connections end
//! with NBD_CMD_DISC and their overlays with them, and the domain stays off. Run as a service
//! (docs/overspill-libvirt-reboots.service) beside libvirtd.
//!
//! A reboot is told from a power-off by QEMU's own SHUTDOWN event (`"reason": "guest-reset"`,
//! through `virsh qemu-monitor-event`): libvirt's lifecycle events and its hook say "shutdown"
//! for both. A hook cannot start the domain itself: libvirt is waiting for it.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;

use crate::libvirt_hook::overspill_vms;

#[derive(Debug, Args)]
pub struct LibvirtRebootsArgs {
    /// libvirt's connection URI.
    #[arg(long, default_value = "qemu:///system")]
    connect: String,
    /// How long a rebooted domain may take to be shut off before it is started again.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    stop_wait: Duration,
}

pub fn run(args: LibvirtRebootsArgs) -> anyhow::Result<()> {
    let mut events = virsh_command()
        .args(["-c", &args.connect, "qemu-monitor-event", "--loop", "--event", "SHUTDOWN"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("running virsh qemu-monitor-event (libvirt-clients)")?;
    let Some(out) = events.stdout.take() else { bail!("virsh's output is not a pipe") };
    tracing::info!(connect = args.connect, "watching for guests that reboot");
    for line in BufReader::new(out).lines() {
        let line = line.context("reading virsh's events")?;
        let Some(domain) = rebooted_domain(&line) else { continue };
        let (connect, stop_wait) = (args.connect.clone(), args.stop_wait);
        // The next events are read meanwhile: one slow domain must not hold the others up.
        std::thread::spawn(move || {
            if let Err(error) = start_again(&connect, &domain, stop_wait) {
                tracing::error!(domain, "could not start the domain again after its guest rebooted: {error:#}");
            }
        });
    }
    let status = events.wait()?;
    bail!("virsh qemu-monitor-event ended ({status}): is libvirtd running?")
}

/// The domain of a `virsh qemu-monitor-event` line that reports a guest's reboot:
/// `event SHUTDOWN at 1764342622.133000 for domain 'NAME': {"guest":true,"reason":"guest-reset"}`.
pub fn rebooted_domain(line: &str) -> Option<String> {
    let rest = line.strip_prefix("event SHUTDOWN ")?;
    let (_, rest) = rest.split_once(" for domain '")?;
    let (domain, details) = rest.rsplit_once("': ")?;
    let details: serde_json::Value = serde_json::from_str(details).ok()?;
    (details["reason"] == "guest-reset").then(|| domain.to_owned())
}

/// virsh as this program reads it: in the C locale (its events and `domstate` are translated,
/// and the system's locale, which systemd passes to services, made "shut off" "ausgeschaltet").
fn virsh_command() -> Command {
    let mut virsh = Command::new("virsh");
    virsh.env("LC_ALL", "C");
    virsh
}

fn virsh(connect: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = virsh_command()
        .args(["-c", connect])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running virsh {}", args.join(" ")))?;
    if !out.status.success() {
        bail!("virsh {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Once the rebooted domain is shut off, starts it again if it has overspill disks (the hook
/// resets them at the start).
fn start_again(connect: &str, domain: &str, stop_wait: Duration) -> anyhow::Result<()> {
    let xml = virsh(connect, &["dumpxml", domain])?;
    let vms = overspill_vms(&xml)?;
    if vms.is_empty() {
        return Ok(());
    }
    let deadline = Instant::now() + stop_wait;
    while virsh(connect, &["domstate", domain])?.trim() != "shut off" {
        if Instant::now() >= deadline {
            bail!("still not shut off after {} s", stop_wait.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    virsh(connect, &["start", domain])?;
    tracing::info!(domain, vms = vms.join(","), "guest rebooted: domain started again, from the golden image");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_guest_reset_is_a_reboot() {
        let event = |reason: &str| {
            format!(
                "event SHUTDOWN at 1764342622.133000 for domain 'desk 1': {{\"guest\":true,\"reason\":\"{reason}\"}}"
            )
        };
        assert_eq!(rebooted_domain(&event("guest-reset")).as_deref(), Some("desk 1"));
        assert_eq!(rebooted_domain(&event("guest-shutdown")), None);
        assert_eq!(rebooted_domain(&event("host-signal")), None);
        assert_eq!(rebooted_domain("event RESET at 1 for domain 'x': {}"), None);
    }
}
