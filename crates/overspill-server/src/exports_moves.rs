//! The exports' side of moving VMs between servers: peers to ask, the golden images'
//! digests a move between hosts compares, and the connection of a VM that a peer holds live,
//! which takes it from there (the move itself is `migration`'s).

use std::sync::Arc;

use overspill_block::limit::GiveUp;
use overspill_block::{BlockDevice, DeviceError, DeviceErrorKind};
use overspill_engine::GoldenImage;
use overspill_net::ListenAddr;

use super::{OverlayExports, CAPABILITIES};
use crate::device::Connection;
use crate::images::OpenVersions;
use crate::live::Live;
use crate::migration::{self, Incoming, Peers};
use crate::vms::{shown_image, Offer};

impl OverlayExports {
    /// Asks `peers` for each named VM that connects, and takes it from the one that holds it
    /// live (see `migration`). VMs moving between hosts need the golden images' content digests
    /// (see `image_digest`): each image served is read for it once, in the background, and its
    /// digest kept in the state directory.
    pub fn with_peers(&mut self, peers: Peers) {
        self.peers = Some(peers);
        self.with_image_digests();
    }

    /// Keeps the digests of the images served (see `image_digest`): a server that moves VMs,
    /// as the destination (`with_peers`) or only as the source (`--peer-listen` alone). Call
    /// after [`Self::with_lifecycle`]: the versions its recovered VMs hold are read too.
    pub fn with_image_digests(&mut self) {
        if self.registry.image_digests().is_some() {
            return;
        }
        let cache = self.lifecycle.state_dir.as_ref().map(|dir| dir.join("image-digests.json"));
        let digests = crate::image_digest::ImageDigests::new(cache);
        let versions = self.versions.iter().flat_map(OpenVersions::held_now).map(|(_, image)| image);
        for image in self.images.values().cloned().chain(versions) {
            digests.start_if_host_local(&image);
        }
        self.registry.use_image_digests(digests);
    }

    /// Has the digest of `image`, a version opened from the image store, computed if this server
    /// moves VMs (see [`Self::with_peers`]).
    pub(super) fn digest_in_background(&self, image: &Arc<dyn GoldenImage>) {
        if let Some(digests) = self.registry.image_digests() {
            digests.start_if_host_local(image);
        }
    }
}

/// How long a VM moving in from another host waits for its image's digest here, within the
/// sender's 5 s wait for the offer's answer (opening the overlay comes after it): digests are
/// computed from the server's start, so only a move right after it, or after a new image
/// version, waits.
const DIGEST_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

impl OverlayExports {
    /// Whether `image` (`label` here) holds the very bytes the VM of `offer` runs over at its
    /// peer, whose identity of it differs (another host's copy of the file): by their digests,
    /// never by its name and size alone.
    fn same_contents(&self, offer: &Offer, label: &str, image: &Arc<dyn GoldenImage>) -> Result<(), String> {
        let shown = shown_image(label);
        let theirs = offer.image_digest.as_deref().ok_or_else(|| {
            format!(
                "{shown} here is another file than the one it runs over at the peer, whose digest of it is not \
                 known yet (computed in the background from the peer's start): try again in a while"
            )
        })?;
        let digests = self.registry.image_digests().ok_or_else(|| format!("{shown} here has no digest to compare"))?;
        let ours = digests.wait_for(image, DIGEST_WAIT).map_err(|why| format!("{shown} here: {why}"))?;
        if ours != theirs {
            return Err(format!("{shown} here is not the image it runs over at the peer (their contents differ)"));
        }
        Ok(())
    }

    /// A VM that peer `address` holds live connects here: it is taken from there (see
    /// `migration`), over the very image version it runs on, and its requests wait until it is
    /// this server's.
    pub(super) fn open_incoming(
        &self,
        name: &str,
        vm: &str,
        identity: Option<&str>,
        peers: &Peers,
        address: &ListenAddr,
        hurry: GiveUp,
    ) -> Result<Box<dyn BlockDevice>, DeviceError> {
        let refused = |why: String| {
            tracing::warn!(vm, peer = %address, "VM refused: {why}");
            DeviceError::new(DeviceErrorKind::Refused, why)
        };
        let image_name = Self::image_name(name);
        let (offer, link) = migration::ask_for(peers, address, vm, image_name, identity).map_err(refused)?;
        let image = self.image_made_over(image_name, &offer.image_label).and_then(|(label, image)| {
            if offer.image_identity.as_deref().is_some_and(|recorded| !image.matches_identity(recorded)) {
                self.same_contents(&offer, &label, &image)?;
            }
            if image.size() != offer.disk_bytes {
                return Err(format!(
                    "its disk has {} bytes, {} here {}",
                    offer.disk_bytes,
                    shown_image(&label),
                    image.size()
                ));
            }
            Ok((label, image))
        });
        let (label, image) = match image {
            Ok(found) => found,
            Err(why) => {
                link.refuse(&why);
                return Err(refused(format!("VM {vm} runs on peer {address}, and cannot move here: {why}")));
            }
        };
        let peer = address.to_string();
        let (number, progress, reset) = match self.registry.claim_incoming(vm, image_name, &offer, &peer, identity) {
            Ok(claimed) => claimed,
            Err(error) => {
                link.refuse(&error.message);
                return Err(error);
            }
        };
        self.registry.label(number, &label);
        let overlay = match self.overlay_over(name, number, &label, image, true) {
            Ok(overlay) => overlay,
            Err(error) => {
                link.refuse(&error.message);
                self.registry.incoming_failed(number, None, None);
                return Err(error);
            }
        };
        let elsewhere = Box::new(migration::ReadAtSender::new(peers, address, vm));
        let live = Arc::new(Live::incoming(overlay, elsewhere));
        let incoming = Incoming {
            number,
            live: live.clone(),
            progress,
            registry: self.registry.clone(),
            peers: peers.clone(),
            peer: address.clone(),
            vm: vm.to_owned(),
            image: image_name.to_owned(),
            offer,
        };
        if let Err(error) = incoming.start(link) {
            let overlay = live.vm().take();
            self.registry.incoming_failed(number, overlay, None);
            return Err(DeviceError::new(DeviceErrorKind::Io, format!("taking VM {vm} from its peer: {error}")));
        }
        tracing::info!(vm, peer, image = label, "VM moving here from its peer: pre-copy begins");
        let limiters = self.registry.limits().limiters_for(Some(vm), image_name);
        let connection = Connection { number, reset, hurry };
        crate::device::stack(live, CAPABILITIES, connection, self.registry.clone(), limiters, false)
    }
}
