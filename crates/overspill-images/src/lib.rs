//! The file formats a golden image comes in, read-only: raw (the engine's [`RawImage`]), qcow2
//! with compressed clusters and backing chains ([`qcow2`]), and VHDX ([`vhdx`]). Each reader
//! refuses at open what it cannot read, so that a VM never meets an unsupported feature as a
//! failed read in the middle of its boot.
//!
//! A format is recognised by its magic, never by the file name; a backing file names its format
//! where the image says it (qcow2's backing format extension), so that a raw layer whose first
//! bytes happen to look like a header is never taken for one.

use std::path::Path;
use std::sync::Arc;

use overspill_engine::{EngineError, GoldenImage, RawImage, Result};

pub mod qcow2;
pub mod qcow2_layer;
pub mod vhdx;

/// The formats an image file can be read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Raw,
    Qcow2,
    Vhdx,
}

impl Format {
    /// The format a file's first bytes say it is: raw when they name no format.
    pub fn probe(path: &Path) -> Result<Self> {
        let mut magic = [0u8; 8];
        let file =
            std::fs::File::open(path).map_err(|source| EngineError::Io { what: "opening golden image", source })?;
        let have = std::os::unix::fs::FileExt::read_at(&file, &mut magic, 0)
            .map_err(|source| EngineError::Io { what: "reading golden image header", source })?;
        Ok(Self::of_header(&magic[..have]))
    }

    /// The format an image's first bytes (eight are enough) say it is: raw when they name none.
    pub fn of_header(first: &[u8]) -> Self {
        if qcow2::has_magic(first) {
            Self::Qcow2
        } else if vhdx::has_magic(first) {
            Self::Vhdx
        } else {
            Self::Raw
        }
    }

    /// The name qemu-img gives the format (and qcow2's backing format extension holds).
    pub fn name(self) -> &'static str {
        match self {
            Self::Raw => "raw",
            Self::Qcow2 => "qcow2",
            Self::Vhdx => "vhdx",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "raw" => Some(Self::Raw),
            "qcow2" => Some(Self::Qcow2),
            "vhdx" => Some(Self::Vhdx),
            _ => None,
        }
    }
}

/// Whether an image file reads through other files (a qcow2 backing file, a VHDX parent), so
/// that a copy of it alone is not the disk. Opens the image, so an image that cannot be read is
/// an error here too.
pub fn has_backing(path: &Path) -> Result<bool> {
    Ok(match Format::probe(path)? {
        Format::Raw => false,
        Format::Qcow2 => qcow2::Qcow2Image::open(path)?.has_backing(),
        Format::Vhdx => vhdx::VhdxImage::open(path)?.has_parent(),
    })
}

/// Opens a golden image file in the format its magic names.
pub fn open_image(path: &Path) -> Result<Arc<dyn GoldenImage>> {
    open_image_as(path, Format::probe(path)?)
}

/// Opens a golden image file as `format`, whatever its first bytes say.
pub fn open_image_as(path: &Path, format: Format) -> Result<Arc<dyn GoldenImage>> {
    open_layer(path, format, &[])
}

/// Opens one layer of a chain, `depth` layers below the image a VM sees.
/// `above`: the (device, inode) of the layers above, for a layer that opens its own backing.
pub(crate) fn open_layer(path: &Path, format: Format, above: &[(u64, u64)]) -> Result<Arc<dyn GoldenImage>> {
    Ok(match format {
        Format::Raw => Arc::new(RawImage::open(path)?),
        Format::Qcow2 => Arc::new(qcow2::Qcow2Image::open_layer(path, above)?),
        Format::Vhdx => Arc::new(vhdx::VhdxImage::open(path)?),
    })
}
