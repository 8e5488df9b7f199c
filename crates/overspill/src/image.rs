//! `overspill image`: publish golden-image versions and choose the one new VMs get.

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
    /// Make VERSION the one new connections to IMAGE get; VMs already running keep theirs.
    Activate { image: String, version: String },
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
                    let mark = if image.current.as_deref() == Some(&v.name) { "*" } else { " " };
                    println!("  {mark} {:<6} {:>10}  {}", v.name, format_bytes(v.bytes), v.path.display());
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
            // `activate win 3` means v3, the name `list` shows.
            let version = if !version.is_empty() && version.bytes().all(|b| b.is_ascii_digit()) {
                format!("v{version}")
            } else {
                version
            };
            store.activate(&image, &version)?;
            println!("{image} {version} (current)");
        }
    }
    Ok(())
}
