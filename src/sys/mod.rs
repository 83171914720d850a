//! Small operating-system helpers with no project dependencies: the wall clock the index runs
//! on, the CPUs this process may use, and calendar arithmetic.

pub mod civil;
pub mod clock;
pub mod cpus;
pub mod test_hooks;
