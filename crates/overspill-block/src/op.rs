//! The operations a guest asks of its disk: one list for the whole workspace (the engine's
//! counters, the metrics, traces, the storm's workloads and the planner).

/// A guest command, whichever frontend brought it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GuestOp {
    Read,
    Write,
    Trim,
    Zero,
    Flush,
}

impl GuestOp {
    pub const ALL: [GuestOp; 5] = [Self::Read, Self::Write, Self::Trim, Self::Zero, Self::Flush];

    pub fn name(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::Trim => "trim",
            Self::Zero => "write_zeroes",
            Self::Flush => "flush",
        }
    }
}
