//! Test helpers shared by the modules.

pub mod fake;
pub mod model;
