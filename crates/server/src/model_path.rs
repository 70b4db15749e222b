//! Model names and versions taken from a route's path, checked once before a handler sees them.
//!
//! Every route that names a model (`{name}`, `{id}`) or a version (`{version}`) extracts a
//! [`ModelPath`] instead of a bare `String`: the name must be a repository name
//! ([`repo::model_ref::validate_name`]: lowercase letters, digits, `-`, `_`, `.`, at most 64
//! characters, never `.` or `..` alone, no `/`, no NUL) and the version a semver version. The
//! path is percent-decoded first, so `%2e%2e`, `%2F` and `%00` are judged as what they spell.
//! A name that fails is refused with 400 `invalid_request` (param `name` or `version`) before
//! any lookup or file is touched, after `[limits] invalid_path_delay_ms` (a timer: a client
//! looping on bad names gets a few answers a second per connection). Not here: the checks at the file system itself (the paths the
//! monitors, the release plans and the gates build also check what they join).

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;

use crate::error::ApiError;
use crate::state::AppState;

/// A checked model reference from the path: `{name}` (or `{id}`, which may be
/// `name@version`) and, where the route has one, `{version}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelPath(pub repo::ModelRef);

impl ModelPath {
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The version as named in the path, canonical (`None` when the route has none).
    pub fn version(&self) -> Option<String> {
        self.0.version_text()
    }

    /// Checks a name and an optional version the way the routes do.
    pub fn parse(name: &str, version: Option<&str>) -> Result<Self, ApiError> {
        let (name, version) = match (name.split_once('@'), version) {
            (Some((name, inline)), None) => (name, Some(inline)),
            (_, version) => (name, version),
        };
        repo::model_ref::validate_name(name)
            .map_err(|e| ApiError::invalid_param("name", format!("not a model name: {e}")))?;
        let version = match version {
            Some(v) => Some(repo::model_ref::parse_version(v).map_err(|e| {
                ApiError::invalid_param("version", format!("not a model version: {e}"))
            })?),
            None => None,
        };
        Ok(Self(repo::ModelRef {
            name: name.to_string(),
            version,
        }))
    }
}

impl FromRequestParts<Arc<AppState>> for ModelPath {
    type Rejection = crate::error::HttpError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, Self::Rejection> {
        let parsed = async {
            let Path(params) = Path::<HashMap<String, String>>::from_request_parts(parts, state)
                .await
                .map_err(|e| ApiError::invalid_param("name", format!("unreadable path: {e}")))?;
            let name = params
                .get("name")
                .or_else(|| params.get("id"))
                .ok_or_else(|| ApiError::Internal("the route names no model".into()))?;
            Self::parse(name, params.get("version").map(String::as_str))
        }
        .await;
        if parsed.is_err() {
            // Refused before the handler (and its rate limit): the refusal waits on a timer,
            // so a loop of bad names gets a few answers a second per connection, not a core's
            // worth (`[limits] invalid_path_delay_ms`).
            let delay = state.config.limits.invalid_path_delay_ms;
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
            }
        }
        Ok(parsed?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_walk_or_hide_are_refused() {
        let long = "a".repeat(65);
        for (name, version) in [
            ("..", None),
            (".", None),
            ("../models", None),
            ("/etc/passwd", None),
            ("a/b", None),
            ("a\0", None),
            (long.as_str(), None),
            ("m", Some("..")),
            ("m", Some("../../x")),
            ("m", Some("/tmp/x")),
            ("m", Some("1.0.0\0")),
            ("m@..", None),
        ] {
            let e = ModelPath::parse(name, version).unwrap_err();
            assert!(
                matches!(e, ApiError::InvalidRequest { .. }),
                "{name:?} {version:?}: {e:?}"
            );
        }
        let ok = ModelPath::parse("smollm2-135m", Some("1.0.0")).unwrap();
        assert_eq!(ok.version().as_deref(), Some("1.0.0"));
        let inline = ModelPath::parse("smollm2-135m@1.2.0", None).unwrap();
        assert_eq!(inline.name(), "smollm2-135m");
        assert_eq!(inline.version().as_deref(), Some("1.2.0"));
    }
}
