//! warmroute: a session-affinity router for LLM inference backends.
//!
//! Map, in lifecycle order: `config` turns the server and route files into a validated
//! `Config`; `snapshot` binds it to the shared segment's slots; `worker` runs one monoio
//! runtime per core with its listeners; `pipeline` is the request lifecycle (dispatch,
//! body, peer selection, forwarding, relay) built on the pure `http` codec; `upstream`
//! pools peer connections per worker; `admin` answers the endpoints the router serves
//! itself; `limits` holds every fixed bound.
pub mod admin;
pub mod auth;
pub mod bodylog;
pub mod bytescan;
pub mod cells;
pub mod config;
pub mod control;
pub mod demo;
pub mod http;
pub mod lenient_json;
pub mod limits;
pub mod measure;
pub mod pipeline;
pub mod postprocess;
pub mod rules;
pub mod server;
pub mod snapshot;
pub mod status;
#[cfg(test)]
mod testutil;
pub mod transform;
pub mod upstream;
pub mod usage;
pub mod util;
pub mod worker;
