//! Each VM's I/O limits, and its group's, kept by name: a VM that reconnects keeps its buckets
//! (its debt too), and `vm limit` may set a VM's or a group's limits before it connects; a VM's
//! own goes with the VM unless `vm limit` set it (see [`VmLimits::forget_vm`]). A VM's requests pass its own limits and its group's, which all
//! the group's VMs share. A VM's group is the first named group (`serve --group
//! NAME=GLOB,…`) whose patterns match its name, else its image's (`image:NAME`). The buckets
//! themselves, and the layer that makes requests wait, are overspill-block's ([`Limiter`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use overspill_block::limit::SystemClock;
use overspill_block::{Limiter, Limits, Rate};

use crate::multi_conn::glob_matches;

/// The prefix of an image's group, which holds the VMs of that image in no named group.
pub const IMAGE_GROUP_PREFIX: &str = "image:";

/// Whether `group` names a group: a named one's name, or an image's (`image:` and the image's
/// export name, `image:` alone for the default image).
pub fn check_group(group: &str) -> Result<(), crate::ServerError> {
    match group.strip_prefix(IMAGE_GROUP_PREFIX) {
        Some("") => Ok(()),
        Some(image) => crate::check_name("image", image),
        None => crate::check_name("group", group),
    }
}

pub struct VmLimits {
    book: Mutex<Book>,
    /// The host's budget for golden-image fetches, which every VM's reads share
    /// (`golden_budget`).
    golden: Arc<Limiter>,
    /// The host's budget for spill segment writes: the segment writers' own, once the exports
    /// say which (`overspill_engine::SegmentWriters::budget`).
    spill: Mutex<Arc<Limiter>>,
    spill_paced: std::sync::atomic::AtomicBool,
}

impl Default for VmLimits {
    fn default() -> Self {
        let unlimited = || Limiter::new(Limits::default(), SystemClock::shared());
        Self {
            book: Mutex::default(),
            golden: unlimited(),
            spill: Mutex::new(unlimited()),
            spill_paced: Default::default(),
        }
    }
}

/// A budget of the host's, as `vm limit --host` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HostBudget {
    /// Golden-image fetches of every VM together.
    Golden,
    /// Spill segment writes of every VM together.
    Spill,
}

impl std::fmt::Display for HostBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Golden => "golden-image fetches",
            Self::Spill => "spill writes",
        })
    }
}

impl std::fmt::Debug for VmLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmLimits").field("vms", &self.lock().by_vm.len()).finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Book {
    default: Limits,
    by_vm: HashMap<String, Arc<Limiter>>,
    /// Named groups and their VM name patterns, in the order given: the first match wins.
    groups: Vec<(String, Vec<String>)>,
    by_group: HashMap<String, Arc<Limiter>>,
}

impl Book {
    fn group_limiter(&mut self, group: &str) -> Arc<Limiter> {
        self.by_group
            .entry(group.to_owned())
            .or_insert_with(|| Limiter::new(Limits::default(), SystemClock::shared()))
            .clone()
    }
}

impl VmLimits {
    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The limits every VM gets until `vm limit` says otherwise (`serve --limit-iops`,
    /// `--limit-bandwidth`).
    pub fn set_default(&self, limits: Limits) {
        self.lock().default = limits;
    }

    /// Sets the named groups: each a name and the VM name patterns (`*`, `?`) of its members.
    pub fn set_groups(&self, groups: Vec<(String, Vec<String>)>) {
        self.lock().groups = groups;
    }

    /// The group of VM `vm` (none: an unnamed VM) over image `image`.
    pub fn group_of(&self, vm: Option<&str>, image: &str) -> String {
        vm.and_then(|vm| self.named_group_of(vm)).unwrap_or_else(|| format!("{IMAGE_GROUP_PREFIX}{image}"))
    }

    /// The named group (`serve --group`) VM `vm` is in, if any.
    pub fn named_group_of(&self, vm: &str) -> Option<String> {
        let book = self.lock();
        let found =
            book.groups.iter().find(|(_, patterns)| patterns.iter().any(|p| glob_matches(p.as_bytes(), vm.as_bytes())));
        found.map(|(group, _)| group.clone())
    }

    /// The limiters a connection of VM `vm` over image `image` passes: the VM's own (made with
    /// the default limits at the name's first use, kept while the VM is; an unnamed VM gets one of its own
    /// only with default limits), then its group's. A limiter without limits lets requests by
    /// without a lock, so the group's is always there, for `vm limit --group` to set live.
    pub fn limiters_for(&self, vm: Option<&str>, image: &str) -> Vec<Arc<Limiter>> {
        let group = self.group_of(vm, image);
        let mut book = self.lock();
        let default = book.default;
        let own = match vm {
            Some(vm) => Some(
                book.by_vm.entry(vm.to_owned()).or_insert_with(|| Limiter::new(default, SystemClock::shared())).clone(),
            ),
            None => (!default.is_none()).then(|| Limiter::new(default, SystemClock::shared())),
        };
        own.into_iter().chain([book.group_limiter(&group)]).collect()
    }

    /// Whether any VM can be in `group`: an image's group, or one `serve --group` names (a
    /// limit set on another name, a typo most likely, would hold no VM).
    pub fn group_known(&self, group: &str) -> bool {
        group.starts_with(IMAGE_GROUP_PREFIX) || self.lock().groups.iter().any(|(name, _)| name == group)
    }

    /// Sets group `group`'s limits, shared by its VMs (`None`: unchanged; `Some(None)`: off).
    /// Returns the group's limits now.
    pub fn set_group(&self, group: &str, ops: Option<Option<Rate>>, bytes: Option<Option<Rate>>) -> Limits {
        let limiter = self.lock().group_limiter(group);
        let limits = changed(limiter.limits(), ops, bytes);
        limiter.set(limits);
        tracing::info!(group, %limits, "group limits set");
        limits
    }

    /// Sets VM `vm`'s limits (`None`: that limit unchanged; `Some(None)`: off); its connection
    /// holds to them from its next request. Returns the VM's limits now.
    pub fn set(&self, vm: &str, ops: Option<Option<Rate>>, bytes: Option<Option<Rate>>) -> Limits {
        let limiter = {
            let mut book = self.lock();
            let default = book.default;
            book.by_vm.entry(vm.to_owned()).or_insert_with(|| Limiter::new(default, SystemClock::shared())).clone()
        };
        let limits = changed(limiter.limits(), ops, bytes);
        limiter.set(limits);
        tracing::info!(vm, %limits, "VM limits set");
        limits
    }

    /// VM `vm` has ended: its limiter goes, unless `vm limit` gave it limits of its own (kept
    /// for its next run) or a connection still holds it. Without this every name ever served
    /// kept a limiter and, under default limits, its own metrics series.
    pub fn forget_vm(&self, vm: &str) {
        let mut book = self.lock();
        let default = book.default;
        if book.by_vm.get(vm).is_some_and(|limiter| Arc::strong_count(limiter) == 1 && limiter.limits() == default) {
            book.by_vm.remove(vm);
        }
    }

    /// The host's budget `which`, shared by every VM.
    pub fn host_budget(&self, which: HostBudget) -> Arc<Limiter> {
        match which {
            HostBudget::Golden => self.golden.clone(),
            HostBudget::Spill => self.spill.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone(),
        }
    }

    /// The spill budget is `budget` (the segment writers' own, with its limits as they are)
    /// from now on: the exports say so when their VMs spill through background writers.
    pub fn use_spill_budget(&self, budget: Arc<Limiter>) {
        *self.spill.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = budget;
        self.spill_paced.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether anything passes the spill budget here (see [`Self::use_spill_budget`]).
    pub fn spill_paced(&self) -> bool {
        self.spill_paced.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets the host's budget `which` (`None`: unchanged; `Some(None)`: off). Returns it now.
    pub fn set_host(&self, which: HostBudget, ops: Option<Option<Rate>>, bytes: Option<Option<Rate>>) -> Limits {
        let limiter = self.host_budget(which);
        let limits = changed(limiter.limits(), ops, bytes);
        limiter.set(limits);
        tracing::info!(budget = %which, %limits, "host budget set");
        limits
    }

    /// Time waited at each host budget that is or was limited, with requests waiting now.
    pub fn host_throttling(&self) -> Vec<(String, Duration, u64)> {
        let limiters = [("golden", HostBudget::Golden), ("spill", HostBudget::Spill)]
            .into_iter()
            .map(|(name, which)| (name.to_owned(), self.host_budget(which)))
            .collect();
        throttling(&limiters)
    }

    /// Each named VM's time spent waiting for its limits, summed, and its requests waiting now,
    /// for the metrics (VMs never limited are left out).
    pub fn throttling(&self) -> Vec<(String, Duration, u64)> {
        throttling(&self.lock().by_vm)
    }

    /// The same for each group.
    pub fn group_throttling(&self) -> Vec<(String, Duration, u64)> {
        throttling(&self.lock().by_group)
    }
}

/// `limits` with the changes `vm limit` asked for.
fn changed(mut limits: Limits, ops: Option<Option<Rate>>, bytes: Option<Option<Rate>>) -> Limits {
    if let Some(ops) = ops {
        limits.ops = ops;
    }
    if let Some(bytes) = bytes {
        limits.bytes = bytes;
    }
    limits
}

/// Time waited and requests waiting of each limiter that is or was ever limited, by name.
fn throttling(limiters: &HashMap<String, Arc<Limiter>>) -> Vec<(String, Duration, u64)> {
    let mut all: Vec<(String, Duration, u64)> = limiters
        .iter()
        .filter_map(|(name, limiter)| {
            let (waited, waiting) = limiter.throttled();
            (!limiter.limits().is_none() || !waited.is_zero()).then(|| (name.clone(), waited, waiting))
        })
        .collect();
    all.sort();
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(per_second: u64) -> Option<Option<Rate>> {
        Some(Some(Rate { per_second, burst: per_second }))
    }

    #[test]
    fn a_vm_is_in_the_first_named_group_that_matches_else_its_images() {
        let limits = VmLimits::default();
        limits.set_groups(vec![
            ("office".into(), vec!["desk-*".into(), "kiosk-?".into()]),
            ("all-desks".into(), vec!["desk-*".into()]),
        ]);
        assert_eq!(limits.group_of(Some("desk-7"), "win10"), "office");
        assert_eq!(limits.group_of(Some("kiosk-1"), "win10"), "office");
        assert_eq!(limits.group_of(Some("kiosk-12"), "win10"), "image:win10");
        assert_eq!(limits.group_of(None, "win10"), "image:win10", "an unnamed VM: its image's");
        assert!(limits.group_known("office") && limits.group_known("image:anything"));
        assert!(!limits.group_known("ofice"), "a name no --group gives holds no VM");
    }

    #[test]
    fn a_groups_vms_share_one_limiter_set_live() {
        let limits = VmLimits::default();
        limits.set_groups(vec![("pair".into(), vec!["a".into(), "b".into()])]);
        let (a, b, c) = (
            limits.limiters_for(Some("a"), "img"),
            limits.limiters_for(Some("b"), "img"),
            limits.limiters_for(Some("c"), "img"),
        );
        assert_eq!((a.len(), b.len(), c.len()), (2, 2, 2), "each its own, then its group's");
        assert!(Arc::ptr_eq(&a[1], &b[1]), "a and b share their group's");
        assert!(!Arc::ptr_eq(&a[1], &c[1]) && !Arc::ptr_eq(&a[0], &b[0]));
        assert_eq!(limits.limiters_for(None, "img").len(), 1, "an unnamed VM without defaults: its group's only");
        limits.set_group("pair", rate(1000), None);
        assert_eq!(a[1].limits().ops.map(|r| r.per_second), Some(1000), "a connected VM's group limiter changed live");
        assert!(a[0].limits().is_none(), "its own untouched");
        assert_eq!(limits.group_throttling().len(), 1, "the limited group is listed");
        limits.set_group("pair", Some(None), None);
        assert!(b[1].limits().is_none());
    }

    /// Under default limits every named VM gets a limiter of its own: it goes with the VM (its
    /// metrics series too), unless the operator set the VM's limits.
    #[test]
    fn an_ended_vms_limiter_goes_unless_its_limits_were_set() {
        let limits = VmLimits::default();
        limits.set_default(Limits { ops: Some(Rate { per_second: 100, burst: 100 }), bytes: None });
        let listed = |limits: &VmLimits| {
            let mut names: Vec<String> = limits.throttling().into_iter().map(|(name, ..)| name).collect();
            names.sort();
            names
        };
        let (a, b) = (limits.limiters_for(Some("a"), "img"), limits.limiters_for(Some("b"), "img"));
        limits.set("b", rate(5), None);
        assert_eq!(listed(&limits), ["a", "b"]);
        limits.forget_vm("a");
        assert_eq!(listed(&limits), ["a", "b"], "a connection still holds a's");
        drop((a, b));
        limits.forget_vm("a");
        limits.forget_vm("b");
        assert_eq!(listed(&limits), ["b"], "a's went with it; b's limits were the operator's");
    }
}
