//! Build facts for `overspill --version` and the `overspill_build_info` metric: the commit the
//! binary was built from (when built from a git checkout) and the optional features in it.

use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|text| text.trim().to_owned())
        .filter(|text| !text.is_empty())
        .unwrap_or_else(|| "unknown".to_owned());
    let features: Vec<&str> =
        [("s3", "CARGO_FEATURE_S3"), ("http", "CARGO_FEATURE_HTTP"), ("rbd", "CARGO_FEATURE_RBD")]
            .into_iter()
            .filter(|(_, var)| std::env::var_os(var).is_some())
            .map(|(name, _)| name)
            .collect();
    println!("cargo:rustc-env=OVERSPILL_COMMIT={commit}");
    println!(
        "cargo:rustc-env=OVERSPILL_FEATURES={}",
        if features.is_empty() { "none".into() } else { features.join(",") }
    );
    // A new commit moves the branch's ref (or HEAD itself when detached).
    for path in ["../../.git/HEAD", "../../.git/refs/heads", "../../.git/packed-refs"] {
        println!("cargo:rerun-if-changed={path}");
    }
}
