//! Small operating-system helpers with no project dependencies: the wall clock the index runs
//! on, the CPUs this process may use, huge-page advice, and calendar arithmetic.

pub mod civil;
pub mod clock;
pub mod cpus;
pub mod eventfd_kick;
pub mod http_auth;
pub mod memory;
pub mod test_hooks;
pub mod worker_threads;
