//! Crash points: the places where a process killed at that instant leaves a different state
//! behind than one killed at the instant before. Those are the stores a recovery reads: page
//! headers, page bytes overwritten in place, and (marked by the files themselves) file writes
//! and punches. The crash simulation (`tests/crash.rs`, feature `crash-points`) sets a hook on
//! its thread that is called just before each such store; at each call it takes what a recovery
//! would find and checks it against a model. Without the feature a point is nothing at all.

#[cfg(feature = "crash-points")]
mod hook {
    use std::cell::RefCell;

    type Hook = Box<dyn FnMut()>;

    thread_local! {
        static HOOK: RefCell<Option<Hook>> = const { RefCell::new(None) };
    }

    /// Calls `hook` at every crash point this thread reaches until [`clear`]. A point reached
    /// from inside the hook is skipped (the hook reads state; it does not make more).
    pub fn set(hook: impl FnMut() + 'static) {
        HOOK.with(|cell| *cell.borrow_mut() = Some(Box::new(hook)));
    }

    pub fn clear() {
        HOOK.with(|cell| *cell.borrow_mut() = None);
    }

    /// The state is about to change in a way a recovery would see.
    pub fn point() {
        HOOK.with(|cell| {
            if let Ok(mut hook) = cell.try_borrow_mut() {
                if let Some(hook) = hook.as_mut() {
                    hook();
                }
            }
        });
    }
}

#[cfg(feature = "crash-points")]
pub use hook::{clear, point, set};

/// The state is about to change in a way a recovery would see (nothing without the feature).
#[cfg(not(feature = "crash-points"))]
#[inline(always)]
pub fn point() {}
