//! `serve`'s TLS and access flags, turned into the protocol's [`Security`]: credentials, the TLS
//! mode, and the per-identity export allow-list.
//!
//! An allow-list rule is `IDENTITY=IMAGE[,IMAGE…]`: a client that proved IDENTITY over TLS (its
//! certificate's common name, or its PSK identity) may see and open those images, under any VM
//! name (`IMAGE@VM`), except a VM another identity made while it lives (the server's VM
//! registry keeps it for its maker). `*` as the identity applies to every client, including one
//! without TLS; `*` as an image allows every image. With no rule, every client may open every
//! image.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::Args;
use overspill_block::ExportAccess;
use overspill_nbd::Security;
use overspill_net::{PeerTls, ServerTls, TlsMode};

#[derive(Debug, Args)]
pub struct SecurityArgs {
    /// off, on (clients may upgrade with STARTTLS) or require (nothing but STARTTLS and ABORT
    /// before TLS). Defaults to require when credentials are given, else off.
    #[arg(long)]
    tls: Option<TlsMode>,
    /// The server's x509 certificate chain (PEM).
    #[arg(long, value_name = "PEM", requires = "tls_key", conflicts_with = "tls_psk")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require every client to present a certificate signed by this CA (PEM).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Pre-shared keys instead of certificates: a file of identity:hexkey lines (qemu's
    /// tls-creds-psk keys.psk format).
    #[arg(long, value_name = "FILE")]
    tls_psk: Option<PathBuf>,
    /// IDENTITY=IMAGE[,IMAGE…]: only the images listed may be opened by that identity (repeat
    /// for more identities; `*` matches any identity or any image).
    #[arg(long = "allow", value_name = "IDENTITY=IMAGES")]
    allow: Vec<String>,
    /// The CA that signed every peer server's certificate (PEM), for tcp: peers (--peer,
    /// --peer-listen): each end of a peer link presents --tls-cert and checks the other's
    /// against this CA, and a server is known to its peers by its certificate's common name.
    /// A peer may take any VM: use a CA that signs servers only, not NBD clients.
    #[arg(long, value_name = "PEM")]
    peer_ca: Option<PathBuf>,
}

impl SecurityArgs {
    pub fn security(&self) -> anyhow::Result<Security> {
        let has_credentials = self.tls_cert.is_some() || self.tls_psk.is_some();
        let mode = self.tls.unwrap_or(if has_credentials { TlsMode::Require } else { TlsMode::Off });
        let tls = match (mode, &self.tls_cert, &self.tls_key, &self.tls_psk) {
            (TlsMode::Off, ..) => None,
            (_, Some(cert), Some(key), None) => Some(ServerTls::x509(mode, cert, key, self.tls_client_ca.as_deref())?),
            (_, None, None, Some(psk)) => Some(ServerTls::psk(mode, psk)?),
            _ => bail!("--tls {mode:?} needs credentials: --tls-cert and --tls-key, or --tls-psk"),
        };
        let access = AllowList::parse(&self.allow)?;
        if access.is_some() && mode == TlsMode::Off && !self.allow.iter().any(|rule| rule.starts_with("*=")) {
            tracing::warn!("--allow without TLS: clients have no identity, so only `*=` rules can apply");
        }
        Ok(Security { tls: tls.map(Arc::new), access: access.map(|list| Arc::new(list) as Arc<dyn ExportAccess>) })
    }

    /// The credentials of the peer link between hosts, if the flags give them (whatever --tls
    /// says of NBD clients).
    pub fn peer_tls(&self) -> anyhow::Result<Option<PeerTls>> {
        match (&self.tls_cert, &self.tls_key, &self.peer_ca) {
            (Some(cert), Some(key), Some(ca)) => Ok(Some(PeerTls::new(cert, key, ca)?)),
            (None, _, Some(_)) => bail!("--peer-ca needs this server's certificate: --tls-cert and --tls-key"),
            _ => Ok(None),
        }
    }
}

/// Images per identity.
#[derive(Debug, Default)]
pub struct AllowList {
    rules: HashMap<String, HashSet<String>>,
}

impl AllowList {
    /// `None` when there are no rules: everyone may open everything.
    pub fn parse(rules: &[String]) -> anyhow::Result<Option<Self>> {
        let mut list = Self::default();
        for rule in rules {
            let (identity, images) =
                rule.split_once('=').with_context(|| format!("--allow {rule:?}: use IDENTITY=IMAGE[,IMAGE…]"))?;
            let images: HashSet<String> =
                images.split(',').map(str::trim).filter(|i| !i.is_empty()).map(str::to_owned).collect();
            if identity.is_empty() || images.is_empty() {
                bail!("--allow {rule:?}: needs an identity and at least one image");
            }
            list.rules.entry(identity.to_owned()).or_default().extend(images);
        }
        Ok((!list.rules.is_empty()).then_some(list))
    }
}

impl ExportAccess for AllowList {
    fn allows(&self, identity: Option<&str>, export: &str) -> bool {
        // The VM name after '@' is the client's to choose; access is to the image.
        let image = export.split_once('@').map_or(export, |(image, _)| image);
        let grants =
            |who: &str| self.rules.get(who).is_some_and(|images| images.contains(image) || images.contains("*"));
        identity.is_some_and(grants) || grants("*")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_grant_images_to_identities_under_any_vm_name() {
        let rules = ["alice=golden,win10".to_owned(), "bob=*".to_owned(), "*=public".to_owned()];
        let list = AllowList::parse(&rules).expect("valid").expect("rules given");
        assert!(list.allows(Some("alice"), "golden@vm-3"));
        assert!(list.allows(Some("alice"), "win10"));
        assert!(!list.allows(Some("alice"), "secret"));
        assert!(list.allows(Some("bob"), "secret@x"));
        assert!(list.allows(None, "public@vm-1"), "`*` applies to clients without identity");
        assert!(!list.allows(None, "golden"));
        assert!(!list.allows(Some("mallory"), "golden"));
        assert!(AllowList::parse(&[]).expect("valid").is_none());
        assert!(AllowList::parse(&["alice".to_owned()]).is_err());
        assert!(AllowList::parse(&["=golden".to_owned()]).is_err());
    }
}
