//! Configuration (placeholder)
