//! Model names, versions and `name[@version]` references.

use std::fmt;
use std::str::FromStr;

use crate::error::RepoError;

/// Longest model name we accept.
pub const MAX_NAME_LEN: usize = 64;

/// Checks that a model name is a safe, portable folder name: lowercase ASCII letters, digits,
/// `-`, `_` and `.`, starting with a letter or digit.
pub fn validate_name(name: &str) -> Result<(), RepoError> {
    let invalid = |reason| RepoError::InvalidName {
        name: name.to_string(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("it is empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(invalid("it is longer than 64 characters"));
    }
    if !name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit()) {
        return Err(invalid("it must start with a lowercase letter or a digit"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '_' | '.'))
    {
        return Err(invalid(
            "use lowercase letters, digits, '-', '_' and '.' only",
        ));
    }
    Ok(())
}

/// Parses a version (semver 2.0: `MAJOR.MINOR.PATCH[-pre][+build]`).
pub fn parse_version(version: &str) -> Result<semver::Version, RepoError> {
    let parsed = semver::Version::parse(version).map_err(|e| RepoError::InvalidVersion {
        version: version.to_string(),
        reason: e.to_string(),
    })?;
    if !parsed.build.is_empty() {
        // Build metadata does not take part in semver ordering, so `1.0.0+a` and `1.0.0+b` would
        // be two folders that compare equal: refuse it.
        return Err(RepoError::InvalidVersion {
            version: version.to_string(),
            reason: "build metadata (+...) is not allowed".into(),
        });
    }
    Ok(parsed)
}

/// `name` or `name@version`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRef {
    pub name: String,
    pub version: Option<semver::Version>,
}

impl ModelRef {
    /// A checked reference from a name and an optional version text (a route's path parts, a
    /// command's arguments): the name is a safe folder name ([`validate_name`]), the version a
    /// semver version without build metadata ([`parse_version`]). Everything that reaches the
    /// file system from outside goes through here or [`FromStr`].
    pub fn new(name: &str, version: Option<&str>) -> Result<Self, RepoError> {
        validate_name(name)?;
        Ok(Self {
            name: name.to_string(),
            version: version.map(parse_version).transpose()?,
        })
    }

    /// The version as its canonical text, for file names (`None` for a name alone).
    pub fn version_text(&self) -> Option<String> {
        self.version.as_ref().map(ToString::to_string)
    }
}

impl FromStr for ModelRef {
    type Err = RepoError;

    fn from_str(s: &str) -> Result<Self, RepoError> {
        let (name, version) = match s.split_once('@') {
            Some((name, version)) => {
                if version.is_empty() || version.contains('@') {
                    return Err(RepoError::InvalidRef(s.to_string()));
                }
                (name, Some(parse_version(version)?))
            }
            None => (s, None),
        };
        validate_name(name)?;
        Ok(Self {
            name: name.to_string(),
            version,
        })
    }
}

impl fmt::Display for ModelRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.version {
            Some(v) => write!(f, "{}@{v}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_references() {
        let r: ModelRef = "smollm2-135m@1.2.3".parse().unwrap();
        assert_eq!(r.name, "smollm2-135m");
        assert_eq!(r.version, Some(semver::Version::new(1, 2, 3)));
        assert_eq!(r.to_string(), "smollm2-135m@1.2.3");
        let r: ModelRef = "minilm".parse().unwrap();
        assert_eq!(r.version, None);
    }

    #[test]
    fn rejects_bad_references() {
        for bad in [
            "",
            "@1.0.0",
            "a@",
            "a@1.0",
            "a@1.0.0@2",
            "../x",
            "A",
            "a/b",
            "a b",
            ".hidden",
            "a@1.0.0+build",
        ] {
            assert!(bad.parse::<ModelRef>().is_err(), "{bad:?} accepted");
        }
        assert!(validate_name(&"a".repeat(65)).is_err());
        for (name, version) in [
            ("..", None),
            ("/etc", None),
            ("a\0b", None),
            ("a", Some("../1.0.0")),
            ("a", Some("1.0.0/..")),
            ("a", Some("1.0.0-a/b")),
            ("a", Some("/abs")),
        ] {
            assert!(
                ModelRef::new(name, version).is_err(),
                "{name:?}@{version:?} accepted"
            );
        }
        let r = ModelRef::new("m", Some("1.2.3-rc.1")).unwrap();
        assert_eq!(r.version_text().as_deref(), Some("1.2.3-rc.1"));
        assert!(validate_name("rapid-orientation_v2.onnx").is_ok());
    }
}
