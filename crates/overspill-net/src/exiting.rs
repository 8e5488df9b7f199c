//! A process on its way out, as a server starting at once after its predecessor was killed
//! meets it: the kernel tears down a killed process's memory before it closes its files, so for
//! a moment (long, for a server with gigabytes mapped) its listening sockets still accept and
//! its pid is still alive.

use std::time::{Duration, Instant};

/// The kernel's per-task flag set when a task begins to exit (`PF_EXITING`, include/linux/sched.h).
const PF_EXITING: u64 = 0x4;

/// How long a starting server waits for a predecessor that is exiting.
pub const EXIT_WAIT: Duration = Duration::from_secs(60);

/// What `/proc/PID/task/TID/stat` says of each of a process's threads: its state letter and its
/// flags. Empty when the process is gone.
fn threads(pid: u32) -> Vec<(char, u64)> {
    threads_of(pid, None)
}

/// As [`threads`], only thread `only` when given.
fn threads_of(pid: u32, only: Option<u32>) -> Vec<(char, u64)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .flatten()
        .filter(|task| only.is_none_or(|tid| task.file_name().to_str() == Some(&tid.to_string())))
        .filter_map(|task| {
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            // The command name (field 2) may hold spaces and parentheses: count from its last ')'.
            let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
            let state = fields.next()?.chars().next()?;
            // state is field 3, flags field 9.
            let flags = fields.nth(5)?.parse().ok()?;
            Some((state, flags))
        })
        .collect()
}

fn dead(state: char) -> bool {
    matches!(state, 'Z' | 'X')
}

/// Whether process `pid` has exited but for its entry in the process table (every thread a
/// zombie: its memory, files and sockets are gone), or does not exist at all. A thread-group
/// leader that is a zombie while other threads still exit is not gone: they hold its files.
pub fn gone(pid: u32) -> bool {
    threads(pid).iter().all(|&(state, _)| dead(state))
}

/// Whether process `pid` is exiting and not yet gone: killed, and still tearing down. Told by
/// its main thread (the thread-group leader), which exits with the process: any other thread
/// may end at any time in a process that goes on.
pub fn exiting(pid: u32) -> bool {
    let leader = threads_of(pid, Some(pid));
    let leader_exits = leader.first().is_some_and(|&(state, flags)| dead(state) || flags & PF_EXITING != 0);
    leader_exits && !gone(pid)
}

/// Waits, at most `bound`, for process `pid` to be [`gone`] once it is [`exiting`], saying so in
/// the log (`what` names it). Returns at once for a process that is not exiting; returns whether
/// it is gone.
pub fn wait_until_gone(pid: u32, what: &str, bound: Duration) -> bool {
    if !exiting(pid) {
        return gone(pid);
    }
    tracing::info!(pid, bound_s = bound.as_secs(), "waiting for {what} (pid {pid}), still exiting, to be gone");
    let deadline = Instant::now() + bound;
    while !gone(pid) {
        if Instant::now() >= deadline {
            tracing::warn!(pid, "{what} (pid {pid}) still exiting after {} s: going on without it", bound.as_secs());
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    tracing::info!(pid, "{what} (pid {pid}) is gone");
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_neither_gone_nor_exiting_and_a_reaped_one_is_gone() {
        let me = std::process::id();
        assert!(!gone(me) && !exiting(me));
        let mut child = std::process::Command::new("true").spawn().expect("true");
        let pid = child.id();
        child.wait().expect("reaped");
        assert!(gone(pid) && !exiting(pid));
    }

    #[test]
    fn a_zombie_is_gone() {
        let mut child = std::process::Command::new("true").spawn().expect("true");
        let pid = child.id();
        // Not reaped yet: a zombie once it has exited.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !threads(pid).iter().all(|&(state, _)| state == 'Z') {
            assert!(Instant::now() < deadline, "{pid} never became a zombie");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(gone(pid) && !exiting(pid));
        child.wait().expect("reaped");
    }
}
