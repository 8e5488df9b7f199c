//! `overspill image`: publish golden-image versions and choose the ones new VMs get: production
//! for all, test for the test group (`serve --test-vms`), PVS's way of updating a vDisk; and
//! take checkpoints out of the store and bring them into another, through a directory or S3.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use overspill_server::checkpoints::{manifest_name, DirPlace, Place};
use overspill_server::images::ImageStore;

use crate::size::format_bytes;

#[derive(Debug, Args)]
pub struct ImageArgs {
    /// The image store directory (as `serve --images`); before or after the action.
    #[arg(long, global = true)]
    images: Option<PathBuf>,
    #[command(subcommand)]
    action: ImageAction,
}

#[derive(Debug, Subcommand)]
enum ImageAction {
    /// Images, their versions, and which one new connections get.
    List,
    /// Copy FILE in as IMAGE's next version.
    Publish {
        image: String,
        file: PathBuf,
        /// Also make it the version new connections get.
        #[arg(long)]
        activate: bool,
    },
    /// Make VERSION the one new connections to IMAGE get (production); VMs already running
    /// keep theirs.
    Activate { image: String, version: String },
    /// Make VERSION IMAGE's test version: new VMs of the test group (`serve --test-vms GLOB`)
    /// get it, every other VM keeps getting production.
    Test { image: String, version: String },
    /// The test version becomes production, for every new VM; the test stage is then empty
    /// (test VMs follow production again). Running VMs keep the version they booted.
    Promote { image: String },
    /// Production goes back to the version it was before its last change (a promote or an
    /// activate). Running VMs keep the version they booted.
    Rollback { image: String },
    /// Write VERSION (a captured version is a layer over the one before: a chain of files) as
    /// one flat file, IMAGE's next version, a sparse raw file of the same bytes; the stages that
    /// named VERSION name it from then on (running VMs keep theirs).
    Compact { image: String, version: String },
    /// Make VM IMAGE's maintenance VM, PVS's first stage of an update: connected as IMAGE@VM it
    /// gets VERSION (default: the current one) whatever its stage, and its overlay outlives its
    /// boots (power-offs, resets, server restarts) until `overspill vm capture VM` makes it
    /// IMAGE's next version, or `overspill vm drop VM` throws it away. No other VM sees it.
    /// One per image; --none ends the stage (the VM's overlay is then any VM's).
    Maintain {
        image: String,
        #[arg(required_unless_present = "none")]
        vm: Option<String>,
        version: Option<String>,
        #[arg(long, conflicts_with_all = ["vm", "version"])]
        none: bool,
    },
    /// Take checkpoint IMAGE:@NAME (`overspill vm checkpoint`) out to TO, a directory or
    /// s3://BUCKET/PREFIX: its layers (IMAGE@NAME.qcow2, and those of the checkpoints it lies
    /// on) and last its manifest, IMAGE@NAME.json, which names the version under it by its
    /// SHA-256. S3 credentials and endpoint come from the environment (AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT, AWS_ALLOW_HTTP).
    CheckpointExport {
        #[arg(value_name = "IMAGE:@NAME")]
        checkpoint: String,
        #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX")]
        to: String,
    },
    /// Bring a checkpoint taken out with checkpoint-export into this store, from its manifest
    /// (DIR/IMAGE@NAME.json or s3://BUCKET/PREFIX/IMAGE@NAME.json): refused unless the store
    /// has the version under it with the very same bytes. Then `overspill vm fork IMAGE:@NAME
    /// --as …` starts VMs from it on this host.
    CheckpointImport {
        #[arg(value_name = "MANIFEST")]
        from: String,
    },
}

/// Takes checkpoint `checkpoint` (`IMAGE:@NAME`) of store `images` out to `to`, and says so.
pub fn export(images: &std::path::Path, checkpoint: &str, to: &str) -> anyhow::Result<()> {
    let Some((image, name)) = checkpoint.split_once(":@") else {
        anyhow::bail!("{checkpoint} is no checkpoint: IMAGE:@NAME, as `overspill vm checkpoint` says");
    };
    let place = place(to)?;
    let manifest = ImageStore::new(images).export_checkpoint(image, name, place.as_ref())?;
    let bytes: u64 = manifest.layers.iter().map(|layer| layer.bytes).sum();
    println!(
        "{checkpoint}: {} layer(s), {}, over {image} {} (SHA-256 {}), taken out to {} as {}",
        manifest.layers.len(),
        format_bytes(bytes),
        manifest.versions[0].name,
        manifest.versions[0].sha256,
        place.describe(),
        manifest_name(image, name)
    );
    Ok(())
}

/// Brings the checkpoint whose manifest is `manifest` into store `images`, and says so: its
/// label.
pub fn import(images: &std::path::Path, manifest: &str) -> anyhow::Result<String> {
    let (place, name) = manifest_place(manifest)?;
    let label = ImageStore::new(images).import_checkpoint(place.as_ref(), &name)?;
    println!("{label}: brought in from {}", place.describe());
    Ok(label)
}

/// A place checkpoints are taken out to: a directory, or a bucket's prefix.
fn place(spec: &str) -> anyhow::Result<Box<dyn Place>> {
    let Some(rest) = spec.strip_prefix("s3://") else { return Ok(Box::new(DirPlace(PathBuf::from(spec)))) };
    #[cfg(feature = "s3")]
    {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        Ok(Box::new(S3Place(overspill_sources::s3::S3Bucket::from_env(bucket, prefix)?)))
    }
    #[cfg(not(feature = "s3"))]
    {
        let _ = rest;
        anyhow::bail!("S3 support is not in this build (cargo build --features s3)")
    }
}

/// Where manifest `spec` is (`DIR/NAME`, or `s3://BUCKET/[PREFIX/]NAME`), and its name there.
fn manifest_place(spec: &str) -> anyhow::Result<(Box<dyn Place>, String)> {
    let name_of = |rest: &str| rest.rsplit('/').next().filter(|name| !name.is_empty()).map(str::to_owned);
    if let Some(rest) = spec.strip_prefix("s3://") {
        let (Some((bucket, key)), Some(name)) = (rest.split_once('/'), name_of(rest)) else {
            anyhow::bail!("{spec}: give the manifest's key, s3://BUCKET/[PREFIX/]IMAGE@NAME.json");
        };
        let prefix = key.strip_suffix(name.as_str()).unwrap_or_default();
        return Ok((place(&format!("s3://{bucket}/{prefix}"))?, name));
    }
    let path = std::path::Path::new(spec);
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        anyhow::bail!("{spec}: give the manifest's file, DIR/IMAGE@NAME.json");
    };
    let dir = path.parent().filter(|dir| !dir.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    Ok((Box::new(DirPlace(dir.to_owned())), name.to_owned()))
}

#[cfg(feature = "s3")]
struct S3Place(overspill_sources::s3::S3Bucket);

#[cfg(feature = "s3")]
impl Place for S3Place {
    fn put_file(&self, name: &str, from: &std::path::Path) -> std::io::Result<()> {
        self.0.put_file(name, from)
    }

    fn put_bytes(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        self.0.put_bytes(name, bytes)
    }

    fn get_file(&self, name: &str, to: &std::path::Path, bytes: u64) -> std::io::Result<()> {
        self.0.get_file(name, to, bytes)
    }

    fn get_bytes(&self, name: &str, limit: u64) -> std::io::Result<Vec<u8>> {
        self.0.get_bytes(name, limit)
    }

    fn describe(&self) -> String {
        self.0.describe()
    }
}

/// `3` means `v3`, the name `list` shows.
fn version_name(version: String) -> String {
    if !version.is_empty() && version.bytes().all(|b| b.is_ascii_digit()) {
        format!("v{version}")
    } else {
        version
    }
}

pub fn run(args: ImageArgs) -> anyhow::Result<()> {
    let Some(images) = &args.images else {
        anyhow::bail!("give the image store: overspill image --images DIR ... (as serve --images DIR)");
    };
    let store = ImageStore::new(images);
    match args.action {
        ImageAction::List => {
            for image in store.images()? {
                println!("{}", image.name);
                for v in &image.versions {
                    let is = |marker: &Option<String>| marker.as_deref() == Some(v.name.as_str());
                    let mark = if is(&image.current) { "*" } else { " " };
                    let stage = match (is(&image.current), is(&image.test), is(&image.previous)) {
                        (true, ..) => "production",
                        (_, true, _) => "test",
                        (.., true) => "previous",
                        _ => "",
                    };
                    println!(
                        "  {mark} {:<6} {:<10} {:>10}  {}",
                        v.name,
                        stage,
                        format_bytes(v.bytes),
                        v.path.display()
                    );
                }
                if let Some(m) = &image.maintenance {
                    let begun = if m.begun { ", begun," } else { "" };
                    println!(
                        "    maintenance: VM {} over {} (its overlay{begun} is the next version)",
                        m.vm, m.version
                    );
                }
            }
        }
        ImageAction::Publish { image, file, activate } => {
            let version = store.publish(&image, &file, activate)?;
            println!("{image} {version}{}", if activate { " (current)" } else { "" });
            if !activate {
                match store.current(&image) {
                    Ok(current) => eprintln!(
                        "new VMs still get {image} {}; `overspill image activate {image} {version}` changes that",
                        current.name
                    ),
                    Err(_) => eprintln!(
                        "{image} has no current version, so it is not served yet: `overspill image activate {image} {version}`"
                    ),
                }
            }
        }
        ImageAction::Activate { image, version } => {
            let version = version_name(version);
            store.activate(&image, &version)?;
            println!("{image} {version} (current)");
        }
        ImageAction::Test { image, version } => {
            let version = version_name(version);
            store.test(&image, &version)?;
            println!("{image} {version} (test): new VMs of the test group get it");
        }
        ImageAction::Promote { image } => {
            let version = store.promote(&image)?;
            println!("{image} {version} (current): promoted from test; every new VM gets it");
        }
        ImageAction::Rollback { image } => {
            let version = store.rollback(&image)?;
            println!("{image} {version} (current): rolled back");
        }
        ImageAction::Compact { image, version } => {
            let version = version_name(version);
            let compacted = store.compact(&image, &version)?;
            let stages: Vec<&str> = {
                let entry = store.image(&image)?;
                [("production", entry.current), ("test", entry.test)]
                    .into_iter()
                    .filter(|(_, named)| named.as_deref() == Some(compacted.as_str()))
                    .map(|(stage, _)| stage)
                    .collect()
            };
            let staged = if stages.is_empty() { String::new() } else { format!(" ({})", stages.join(", ")) };
            println!("{image} {compacted}{staged}: {version} in one file");
        }
        ImageAction::Maintain { image, none: true, .. } => {
            let ended = store.end_maintenance(&image, None)?;
            println!("{image}: {}", if ended { "maintenance stage ended" } else { "no maintenance stage" });
        }
        ImageAction::Maintain { image, vm, version, .. } => {
            let vm = vm.unwrap_or_default();
            let version = store.maintain(&image, &vm, version.map(version_name).as_deref())?;
            println!(
                "{image}: VM {vm} maintains it over {version}: connect it as {image}@{vm}; `overspill vm capture {vm}` \
                 makes its writes the next version"
            );
        }
        ImageAction::CheckpointExport { checkpoint, to } => export(images, &checkpoint, &to)?,
        ImageAction::CheckpointImport { from } => {
            let label = import(images, &from)?;
            println!("`overspill vm fork {label} --as NAME,…` starts VMs from it");
        }
    }
    Ok(())
}
