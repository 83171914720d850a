//! Everything off the request path, served on the admin thread: the public HTTP listener
//! (`/healthz`, `/readyz`, `/metrics`), the controller-facing listener (`/snapshot`, `/policy`,
//! `/probe`) behind controller authentication, and the gathers that read every core.

pub mod auth;
mod gather;
mod gojson;
pub mod http;
mod probe;
mod routes;
mod scrape;
mod snapshot;

pub use routes::{Controller, public, set_ready};
pub use scrape::render as render_metrics;
