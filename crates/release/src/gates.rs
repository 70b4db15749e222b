//! (being built: gates and golden sets)
