//! Mock (placeholder)
