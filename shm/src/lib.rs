//! Segment (placeholder)
