//! The shipped systemd units (docs/overspill.service, docs/overspill.socket,
//! docs/overspill-libvirt-reboots.service) as systemd itself
//! reads them: `systemd-analyze verify` finds nothing wrong, `systemd-analyze security` rates
//! the service "OK" (exposure at most 4), and its ExecStart with the conffile it names
//! (packaging/overspill.toml) is a command line `serve` takes.
//! Socket activation and readiness themselves are exercised in operator.rs.

use std::path::{Path, PathBuf};
use std::process::Command;

fn unit(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs").join(name)
}

/// The unit with its ExecStart pointing at the binary under test (verify checks that it exists),
/// in a directory of its own with the socket unit beside it.
fn installed_copy(dir: &Path) -> PathBuf {
    for name in ["overspill.service", "overspill.socket", "overspill-libvirt-reboots.service"] {
        let text = std::fs::read_to_string(unit(name)).expect("unit");
        let text = text.replace("/usr/bin/overspill", env!("CARGO_BIN_EXE_overspill"));
        std::fs::write(dir.join(name), text).expect("copy");
    }
    dir.join("overspill.service")
}

fn analyze(args: &[&str], unit: &Path) -> (bool, String) {
    let out = Command::new("systemd-analyze")
        .args(args)
        .arg(unit)
        .output()
        .expect("systemd-analyze (package systemd) is installed");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn the_units_verify_cleanly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let service = installed_copy(dir.path());
    let reboots = dir.path().join("overspill-libvirt-reboots.service");
    for unit in [service.clone(), dir.path().join("overspill.socket"), reboots] {
        let (ok, text) = analyze(&["verify"], &unit);
        // verify prints nothing for a sound unit; anything it says is a finding.
        let findings: Vec<&str> = text.lines().filter(|l| l.contains(&*unit.to_string_lossy())).collect();
        assert!(ok && findings.is_empty(), "systemd-analyze verify {}:\n{text}", unit.display());
    }
}

#[test]
fn the_service_is_rated_ok_by_systemd_analyze_security() {
    let dir = tempfile::tempdir().expect("tempdir");
    let service = installed_copy(dir.path());
    let (_, text) = analyze(&["security", "--offline=true", "--no-pager"], &service);
    let level = text
        .lines()
        .find_map(|l| l.split("Overall exposure level for ").nth(1))
        .and_then(|rest| rest.split(": ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{text}"));
    assert!(level <= 4.0, "exposure {level} above 4 (OK):\n{text}");
}

/// The ExecStart line and the conffile it names, run as they are: every key must be a flag serve
/// takes with a value it accepts, so the server goes as far as opening the golden image (which is
/// not on this machine) and says so. The commented examples of limits, budgets, pacing and
/// multi-conn too, once uncommented (the peers' need certificates, vhost-user a directory).
#[test]
fn the_service_and_its_conffile_are_ones_serve_takes() {
    let text = std::fs::read_to_string(unit("overspill.service")).expect("unit");
    let exec = text.replace("\\\n", " ");
    let line = exec.lines().find_map(|l| l.strip_prefix("ExecStart=")).expect("ExecStart");
    let mut words = line.split_whitespace();
    assert_eq!(words.next(), Some("/usr/bin/overspill"));
    let args: Vec<&str> = words.collect();
    assert_eq!(args, ["serve", "--config", "/etc/overspill/overspill.toml"]);
    let dir = tempfile::tempdir().expect("tempdir");
    // Paths of the host moved into a scratch directory; everything else as shipped.
    let conffile = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/overspill.toml");
    let settings = std::fs::read_to_string(conffile).expect("conffile");
    let scratch = dir.path().to_string_lossy();
    let settings = settings.replace("\"/var/cache/", &format!("\"{scratch}/var/cache/"));
    let settings = settings.replace("\"/run/", &format!("\"{scratch}/run/"));
    let examples =
        ["limit-", "group", "golden-limit-", "spill-limit-", "boot-", "reconnect-grace", "multi-conn", "test-vms"];
    let mut uncommented = 0;
    let settings: String = settings
        .lines()
        .map(|line| match line.strip_prefix("# ") {
            Some(example) if example.contains(" = ") && examples.iter().any(|key| example.starts_with(key)) => {
                uncommented += 1;
                format!("{example}\n")
            }
            _ => format!("{line}\n"),
        })
        .collect();
    assert!(uncommented >= 12, "the examples were found: {uncommented}");
    let copy = dir.path().join("overspill.toml");
    std::fs::write(&copy, settings).expect("copy");
    let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
        .args(["serve", "--config"])
        .arg(&copy)
        .output()
        .expect("overspill");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "not a usage error (2), not a start:\n{stderr}");
    assert!(stderr.contains("/srv/golden/current.img"), "{stderr}");
}
