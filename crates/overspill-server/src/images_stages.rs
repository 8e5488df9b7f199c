//! The stages of an image's versions: production and test (markers naming a version) and the
//! maintenance stage (one VM whose overlay is the next version), and the commands that move them.

use super::{ImageStore, Version};
use crate::{check_name, ServerError};

/// The maintenance stage's marker: `VM VERSION`.
const MAINTENANCE: &str = "maintenance";
/// The maintenance marker whose VM has had its overlay (see [`Maintenance::begun`]).
const MAINTENANCE_BEGUN: &str = "maintenance-begun";

/// An image's maintenance VM: the one VM whose overlay is the next version until it is
/// captured (`vm capture`), served only to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Maintenance {
    pub vm: String,
    pub version: String,
    /// The VM has had its overlay over the version: a later start without that overlay (it was
    /// in the memory of a host that rebooted) is refused by name rather than begun afresh.
    pub begun: bool,
}

/// Which VMs get a version: production (every new VM unless in the test group) or test (new
/// VMs of the test group, while the image has a test version).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Test,
    Production,
}

impl Stage {
    /// The marker file naming the stage's version.
    pub(super) fn marker(self) -> &'static str {
        match self {
            Stage::Test => "test",
            Stage::Production => "current",
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::Test => "test",
            Stage::Production => "production",
        })
    }
}

impl ImageStore {
    /// Image `name`'s maintenance VM, if it has one (its marker alone is read).
    pub fn maintenance(&self, name: &str) -> Option<Maintenance> {
        check_name("image", name).ok()?;
        let dir = self.root.join(name);
        let text = std::fs::read_to_string(dir.join(MAINTENANCE)).ok()?;
        let (vm, version) = text.trim().split_once(' ')?;
        // A file of its own, which servers of before it ignore: it names the marker it began.
        let begun = std::fs::read_to_string(dir.join(MAINTENANCE_BEGUN)).is_ok_and(|b| b.trim() == text.trim());
        Some(Maintenance { vm: vm.to_owned(), version: version.to_owned(), begun })
    }

    /// Makes VM `vm` image `name`'s maintenance VM, over `version` (none: the current one): a
    /// new overlay of it gets that version whatever its stage, and its overlay outlives its
    /// boots (a clean disconnect, a reset, a server restart) until it is captured as the next
    /// version (`vm capture`) or dropped (`vm drop`). One per image: another is refused while
    /// one is named. Naming the same VM again begins its overlay afresh (after it was lost).
    /// Returns the version.
    pub fn maintain(&self, name: &str, vm: &str, version: Option<&str>) -> Result<String, ServerError> {
        check_name("VM", vm)?;
        self.with_lock(name, |store| {
            let image = store.image(name)?;
            if let Some(other) = image.maintenance.filter(|m| m.vm != vm) {
                return Err(ServerError::Stage {
                    image: name.to_owned(),
                    why: format!(
                        "VM {} maintains it already, over {}: capture it or end it (`overspill image maintain {name} \
                         --none`) first",
                        other.vm, other.version
                    ),
                });
            }
            let version = match version {
                Some(version) => version.to_owned(),
                None => store.current(name)?.name,
            };
            store.published(name, &version)?;
            store.mark(name, MAINTENANCE_BEGUN, None)?;
            store.mark(name, MAINTENANCE, Some(&format!("{vm} {version}")))?;
            Ok(version)
        })
    }

    /// Records that VM `vm`, image `name`'s maintenance VM, has its overlay over the marker's
    /// version now; says whether this changed anything. Read first without the image's lock,
    /// which a publish holds for as long as it copies: every named VM's start comes here.
    pub fn begin_maintenance(&self, name: &str, vm: &str) -> Result<bool, ServerError> {
        let unmarked = |store: &Self| store.maintenance(name).filter(|m| m.vm == vm && !m.begun);
        if unmarked(self).is_none() {
            return Ok(false);
        }
        self.with_lock(name, |store| match unmarked(store) {
            Some(m) => store.mark(name, MAINTENANCE_BEGUN, Some(&format!("{vm} {}", m.version))).map(|()| true),
            None => Ok(false),
        })
    }

    /// Forgets that VM `vm`'s maintenance overlay began (it was thrown away on purpose): its next
    /// start begins over the marker's version instead of being refused.
    pub fn restart_maintenance(&self, name: &str, vm: &str) -> Result<bool, ServerError> {
        self.with_lock(name, |store| match store.maintenance(name) {
            Some(m) if m.vm == vm && m.begun => store.mark(name, MAINTENANCE_BEGUN, None).map(|()| true),
            _ => Ok(false),
        })
    }

    /// Ends image `name`'s maintenance stage if VM `vm` (any, if none) holds it; says whether
    /// one was ended.
    pub fn end_maintenance(&self, name: &str, vm: Option<&str>) -> Result<bool, ServerError> {
        self.with_lock(name, |store| match store.image(name)?.maintenance {
            Some(m) if vm.is_none_or(|vm| vm == m.vm) => {
                store.mark(name, MAINTENANCE, None)?;
                store.mark(name, MAINTENANCE_BEGUN, None).map(|()| true)
            }
            _ => Ok(false),
        })
    }

    /// The version new VMs of `stage` get: the test version while there is one, else (and for
    /// production) the current one.
    pub fn staged(&self, name: &str, stage: Stage) -> Result<Version, ServerError> {
        if stage == Stage::Test {
            let image = self.image(name)?;
            if let Some(test) = image.test {
                return match image.versions.into_iter().find(|v| v.name == test) {
                    Some(version) => Ok(version),
                    None => Err(ServerError::Stage {
                        image: name.to_owned(),
                        why: format!("its test version {test} is not published"),
                    }),
                };
            }
        }
        self.current(name)
    }

    /// Makes `version` the test stage's: new VMs of the test group get it, production VMs
    /// keep theirs.
    pub fn test(&self, name: &str, version: &str) -> Result<(), ServerError> {
        self.with_lock(name, |store| {
            store.published(name, version)?;
            store.mark(name, Stage::Test.marker(), Some(version))
        })
    }

    /// The test version becomes production (the one before is kept for a rollback) and the
    /// test stage is empty again: test VMs follow production until the next `test`. Returns
    /// the version promoted.
    pub fn promote(&self, name: &str) -> Result<String, ServerError> {
        self.with_lock(name, |store| {
            let test = store.image(name)?.test.ok_or_else(|| ServerError::Stage {
                image: name.to_owned(),
                why: "it has no test version to promote (`overspill image test IMAGE VERSION` names one)".into(),
            })?;
            store.activate_locked(name, &test)?;
            store.mark(name, Stage::Test.marker(), None)?;
            Ok(test)
        })
    }

    /// Production goes back to the version it was before its last change. Returns it.
    pub fn rollback(&self, name: &str) -> Result<String, ServerError> {
        self.with_lock(name, |store| {
            let previous = store.image(name)?.previous.ok_or_else(|| ServerError::Stage {
                image: name.to_owned(),
                why: "no earlier production version is recorded (one rollback undoes one change)".into(),
            })?;
            store.published(name, &previous)?;
            store.mark(name, Stage::Production.marker(), Some(&previous))?;
            store.mark(name, "previous", None)?;
            Ok(previous)
        })
    }
}
