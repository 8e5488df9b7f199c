//! Each VM's I/O limits, kept by name for the server's life: a VM that reconnects keeps its
//! buckets (its debt too), and `vm limit` may set a VM's limits before it connects. The buckets
//! themselves, and the layer that makes requests wait, are overspill-block's ([`Limiter`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use overspill_block::limit::SystemClock;
use overspill_block::{Limiter, Limits, Rate};

#[derive(Default)]
pub struct VmLimits {
    book: Mutex<Book>,
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

    /// The limiter a connection of VM `vm` passes (made with the default limits at the name's
    /// first use, and kept); an unnamed VM gets one of its own, or none without default limits.
    pub fn limiter_for(&self, vm: Option<&str>) -> Option<Arc<Limiter>> {
        let mut book = self.lock();
        let default = book.default;
        match vm {
            Some(vm) => {
                let limiter =
                    book.by_vm.entry(vm.to_owned()).or_insert_with(|| Limiter::new(default, SystemClock::shared()));
                Some(limiter.clone())
            }
            None => (!default.is_none()).then(|| Limiter::new(default, SystemClock::shared())),
        }
    }

    /// Sets VM `vm`'s limits (`None`: that limit unchanged; `Some(None)`: off); its connection
    /// holds to them from its next request. Returns the VM's limits now.
    pub fn set(&self, vm: &str, ops: Option<Option<Rate>>, bytes: Option<Option<Rate>>) -> Limits {
        let limiter = self.limiter_for(Some(vm)).expect("a named VM always has one");
        let mut limits = limiter.limits();
        if let Some(ops) = ops {
            limits.ops = ops;
        }
        if let Some(bytes) = bytes {
            limits.bytes = bytes;
        }
        limiter.set(limits);
        tracing::info!(vm, %limits, "VM limits set");
        limits
    }

    /// Each named VM's time spent waiting for its limits, summed, and its requests waiting now,
    /// for the metrics (VMs never limited are left out).
    pub fn throttling(&self) -> Vec<(String, Duration, u64)> {
        let book = self.lock();
        let mut all: Vec<(String, Duration, u64)> = book
            .by_vm
            .iter()
            .filter_map(|(vm, limiter)| {
                let (waited, waiting) = limiter.throttled();
                (!limiter.limits().is_none() || !waited.is_zero()).then(|| (vm.clone(), waited, waiting))
            })
            .collect();
        all.sort();
        all
    }
}
