//! `overspill image`: publish golden-image versions and choose the ones new VMs get: production
//! for all, test for the test group (`serve --test-vms`), PVS's way of updating a vDisk.

use std::path::PathBuf;

use clap::{Args, Subcommand};
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
    }
    Ok(())
}
