//! warmroute: a session-affinity router for LLM inference backends.
pub mod config;
