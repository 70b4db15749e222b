//! The `function` label of the tool-call metrics. Function names come from clients, so a key
//! that invents a new name per request could grow the metrics without end: each model keeps
//! the first [`MAX_FUNCTIONS`] names it sees as labels, and counts the rest as `_other`.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, OnceLock};

/// Distinct function labels per model.
pub const MAX_FUNCTIONS: usize = 64;

/// The label `function` counts under for `model`.
pub fn function_label(model: &str, function: &str) -> String {
    static SEEN: OnceLock<Mutex<HashMap<String, HashSet<String>>>> = OnceLock::new();
    let mut seen = SEEN
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let names = seen.entry(model.to_string()).or_default();
    if names.contains(function) {
        return function.to_string();
    }
    if names.len() < MAX_FUNCTIONS {
        names.insert(function.to_string());
        return function.to_string();
    }
    "_other".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_bounded_per_model() {
        for i in 0..MAX_FUNCTIONS {
            assert_eq!(
                function_label("m-bounded", &format!("f{i}")),
                format!("f{i}")
            );
        }
        assert_eq!(function_label("m-bounded", "one_more"), "_other");
        assert_eq!(function_label("m-bounded", "f3"), "f3");
        assert_eq!(function_label("m-other", "one_more"), "one_more");
    }
}
