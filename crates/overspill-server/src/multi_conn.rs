//! Sets of VMs named by patterns: which may take several connections at once (`serve
//! --multi-conn`), which are the test group of image stages (`serve --test-vms`).

use std::sync::Mutex;

use crate::vms::lock;

/// VM names as shell-style patterns (`*` any run, `?` one character), changed live. For
/// multi-conn: the VMs whose clients may open several connections at once, all serving one
/// overlay (the server cannot tell a second connection of the same client from a second QEMU,
/// so a VM opts in by name).
#[derive(Debug, Default)]
pub(crate) struct NamePatterns(Mutex<Vec<String>>);

impl NamePatterns {
    pub(crate) fn set(&self, patterns: Vec<String>) {
        *lock(&self.0) = patterns;
    }

    pub(crate) fn patterns(&self) -> Vec<String> {
        lock(&self.0).clone()
    }

    pub(crate) fn allows(&self, vm: &str) -> bool {
        lock(&self.0).iter().any(|pattern| glob_matches(pattern.as_bytes(), vm.as_bytes()))
    }
}

/// Whether `name` matches `pattern`, `*` standing for any run of characters and `?` for one.
pub(crate) fn glob_matches(pattern: &[u8], name: &[u8]) -> bool {
    match (pattern.split_first(), name.split_first()) {
        (None, None) => true,
        (Some((b'*', rest)), _) => glob_matches(rest, name) || (!name.is_empty() && glob_matches(pattern, &name[1..])),
        (Some((b'?', rest)), Some((_, tail))) => glob_matches(rest, tail),
        (Some((p, rest)), Some((n, tail))) if p == n => glob_matches(rest, tail),
        _ => false,
    }
}
