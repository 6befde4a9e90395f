//! Test helpers shared by the modules.
