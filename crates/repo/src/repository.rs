//! The repository on disk: listing, resolving, importing, verifying and removing versions.

use std::path::{Path, PathBuf};

use crate::aliases::{AliasSetting, Aliases, Choice};
use crate::card::{ModelCard, CARD_FILE};
use crate::describe::describe;
use crate::digests::{copy_and_hash, hash_file, verify_dir, Digests, VerifyReport};
use crate::error::RepoError;
use crate::lineage::{
    current_user, now_rfc3339, BuildInfo, Derivation, Environment, Lineage, Source, SourceFile,
};
use crate::manifest::{FileEntry, Kind, Manifest, ModelSection, MANIFEST_FILE, MANIFEST_VERSION};
use crate::model_ref::{parse_version, validate_name, ModelRef};
use crate::progress::Progress;

/// A model repository rooted at a folder (`./models` by default).
#[derive(Debug, Clone)]
pub struct Repository {
    root: PathBuf,
}

/// One version of one model, as found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelVersion {
    pub name: String,
    pub version: semver::Version,
    pub dir: PathBuf,
}

impl std::fmt::Display for ModelVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.name, self.version)
    }
}

/// A version that passed verification, ready to be served.
#[derive(Debug, Clone)]
pub struct LoadedVersion {
    pub version: ModelVersion,
    pub manifest: Manifest,
    /// The version digest from `DIGESTS`, confirmed by re-hashing.
    pub version_digest: String,
}

/// How to import.
pub struct ImportOptions<'a> {
    pub name: String,
    pub version: String,
    /// Overrides the detected kind.
    pub kind: Option<Kind>,
    /// Hard-link the files instead of copying them (same filesystem only).
    pub link: bool,
    /// Commit of the code that produced the model, for the lineage.
    pub git_commit: Option<String>,
    /// Version of the training/evaluation data, for the lineage.
    pub dataset_version: Option<String>,
    /// The model this one was made from (quantization), for the lineage.
    pub derived_from: Option<Derivation>,
    /// The declared serving pipeline (`--manifest FILE`); without it, a `rampart.toml` in a
    /// source folder is read.
    pub pipeline: Option<crate::pipeline::Pipeline>,
    pub build: BuildInfo,
    pub progress: &'a dyn Progress,
    /// Checks rules files (`guard::check_rules_file`); without it a rules file is refused.
    pub rules_check: Option<crate::describe::RulesCheck>,
    /// The host's hardware fingerprint for the lineage (`host::fingerprint`, as JSON).
    pub host_fingerprint: Option<serde_json::Value>,
    /// The model card (`MODEL_CARD.md` in the version); a source folder's own `MODEL_CARD.md`
    /// or `README.md` is imported with it otherwise.
    pub card: Option<PathBuf>,
    /// Make the version the model's stable one (what users get) at once. Without it, only the
    /// first version of a model becomes stable by itself.
    pub stable: bool,
}

/// Removes a staging folder unless the import completed.
struct Staging {
    dir: PathBuf,
    armed: bool,
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.armed {
            let _ = make_writable(&self.dir);
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(unix)]
fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

#[cfg(not(unix))]
fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    let mut perms = std::fs::metadata(path)?.permissions();
    perms.set_readonly(mode & 0o200 == 0);
    std::fs::set_permissions(path, perms)
}

/// Makes every folder below `dir` (and `dir`) writable again, so the tree can be deleted.
fn make_writable(dir: &Path) -> std::io::Result<()> {
    set_mode(dir, 0o755)?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            make_writable(&entry.path())?;
        }
    }
    Ok(())
}

/// Marks a finished version read-only: files 0444 (except hard-linked ones, whose permissions
/// belong to the source too), folders 0555.
fn seal(dir: &Path, linked: &[PathBuf]) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            seal(&path, linked)?;
        } else if !linked.contains(&path) {
            set_mode(&path, 0o444)?;
        }
    }
    set_mode(dir, 0o555)
}

impl Repository {
    /// A repository at `root`. The folder need not exist until the first import.
    pub fn open(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn read_dir_names(dir: &Path) -> Result<Vec<String>, RepoError> {
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(RepoError::io(dir)(e)),
        };
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(RepoError::io(dir))?;
            if !entry.file_type().map_err(RepoError::io(dir))?.is_dir() {
                continue;
            }
            if let Some(name) = entry.file_name().to_str() {
                if !name.starts_with('.') {
                    names.push(name.to_string());
                }
            }
        }
        Ok(names)
    }

    /// Names of the models that have at least one version, sorted.
    pub fn models(&self) -> Result<Vec<String>, RepoError> {
        let mut models = Vec::new();
        for name in Self::read_dir_names(&self.root)? {
            if validate_name(&name).is_ok() && !self.versions(&name)?.is_empty() {
                models.push(name);
            }
        }
        models.sort();
        Ok(models)
    }

    /// Versions of a model, oldest first (semver order). Folders that are not semver versions
    /// with a manifest are ignored.
    pub fn versions(&self, name: &str) -> Result<Vec<ModelVersion>, RepoError> {
        validate_name(name)?;
        let model_dir = self.root.join(name);
        let mut versions: Vec<ModelVersion> = Self::read_dir_names(&model_dir)?
            .into_iter()
            .filter_map(|v| {
                let version = parse_version(&v).ok()?;
                let dir = model_dir.join(&v);
                dir.join(MANIFEST_FILE).is_file().then(|| ModelVersion {
                    name: name.to_string(),
                    version,
                    dir,
                })
            })
            .collect();
        versions.sort_by(|a, b| a.version.cmp(&b.version));
        Ok(versions)
    }

    /// Resolves `name@version`, or `name` to the version users get: the `stable` alias
    /// ([`crate::aliases`]), or the model's only version when it has one and no alias. A model
    /// with several versions and no alias is an error naming the way out, never "the newest".
    pub fn resolve(&self, model: &ModelRef) -> Result<ModelVersion, RepoError> {
        match &model.version {
            Some(_) => self.resolve_exact(model),
            None => self.chosen(&model.name).map(|(v, _)| v),
        }
    }

    fn not_found(&self, name: &str) -> Result<RepoError, RepoError> {
        let models = self.models()?;
        Ok(RepoError::ModelNotFound {
            name: name.to_string(),
            repo: self.root.clone(),
            available: if models.is_empty() {
                "none".into()
            } else {
                models.join(", ")
            },
        })
    }

    fn version_list(versions: &[ModelVersion]) -> String {
        versions
            .iter()
            .map(|v| v.version.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn resolve_exact(&self, model: &ModelRef) -> Result<ModelVersion, RepoError> {
        let versions = self.versions(&model.name)?;
        if versions.is_empty() {
            return Err(self.not_found(&model.name)?);
        }
        versions
            .iter()
            .find(|v| Some(&v.version) == model.version.as_ref())
            .cloned()
            .ok_or_else(|| RepoError::VersionNotFound {
                name: model.name.clone(),
                version: model
                    .version
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
                available: Self::version_list(&versions),
            })
    }

    /// The version users get of a model and why ([`Choice`]).
    pub fn chosen(&self, name: &str) -> Result<(ModelVersion, Choice), RepoError> {
        let versions = self.versions(name)?;
        if versions.is_empty() {
            return Err(self.not_found(name)?);
        }
        if let Some(setting) = self.stable(name)? {
            let broken = |problem: String| RepoError::StableBroken {
                name: name.to_string(),
                version: setting.version.clone(),
                problem,
            };
            let wanted = parse_version(&setting.version)
                .map_err(|_| broken("is not a semver version".into()))?;
            let version = versions
                .iter()
                .find(|v| v.version == wanted)
                .cloned()
                .ok_or_else(|| {
                    broken(format!(
                        "is not in the repository (versions: {})",
                        Self::version_list(&versions)
                    ))
                })?;
            // The alias names the digest it was set on: a version replaced under the same
            // number is not what was chosen.
            let digest = self.version_digest(&version)?;
            if digest != setting.digest {
                return Err(broken(format!(
                    "now has the digest {digest}, not {} as when it was made stable",
                    setting.digest
                )));
            }
            return Ok((version, Choice::Stable { setting }));
        }
        match versions.as_slice() {
            [only] => Ok((only.clone(), Choice::OnlyVersion)),
            _ => Err(RepoError::NoStable {
                name: name.to_string(),
                available: Self::version_list(&versions),
            }),
        }
    }

    /// The `stable` alias of a model, if set.
    pub fn stable(&self, name: &str) -> Result<Option<AliasSetting>, RepoError> {
        validate_name(name)?;
        Ok(Aliases::read(&self.root.join(name))?.stable)
    }

    /// A model's aliases file (the stable alias and its history).
    pub fn aliases(&self, name: &str) -> Result<Aliases, RepoError> {
        validate_name(name)?;
        Aliases::read(&self.root.join(name))
    }

    /// The version digest (`sha256:…`) its `DIGESTS` file records (not re-hashed).
    pub fn version_digest(&self, version: &ModelVersion) -> Result<String, RepoError> {
        Ok(format!(
            "sha256:{}",
            self.digests(version)?.version_digest()
        ))
    }

    /// Makes `version` the stable one of its model: what users get from now on (at a server's
    /// next start, or its next load of the model). Returns the new setting.
    pub fn set_stable(
        &self,
        version: &ModelVersion,
        by: &str,
        cause: &str,
    ) -> Result<AliasSetting, RepoError> {
        let model_dir = self.root.join(&version.name);
        let mut aliases = Aliases::read(&model_dir)?;
        let setting = AliasSetting {
            version: version.version.to_string(),
            digest: self.version_digest(version)?,
            set_at: now_rfc3339(),
            set_by: by.to_string(),
            cause: cause.to_string(),
        };
        aliases.set_stable(setting.clone());
        aliases.write(&model_dir)?;
        Ok(setting)
    }

    /// Makes a version stable when it is its model's first (no alias, no other version): a
    /// new model serves as simply as before. Returns the setting when it made one.
    pub fn adopt_first(&self, version: &ModelVersion) -> Result<Option<AliasSetting>, RepoError> {
        if self.stable(&version.name)?.is_some() || self.versions(&version.name)?.len() != 1 {
            return Ok(None);
        }
        let by = current_user().unwrap_or_else(|| "unknown".into());
        self.set_stable(version, &by, "first version").map(Some)
    }

    /// Versions of a model newer than the one users get: candidates waiting for a release.
    pub fn waiting(&self, name: &str) -> Result<Vec<ModelVersion>, RepoError> {
        let (served, _) = self.chosen(name)?;
        Ok(self
            .versions(name)?
            .into_iter()
            .filter(|v| v.version > served.version)
            .collect())
    }

    /// The model card of a version, if it has one.
    pub fn card(&self, version: &ModelVersion) -> Result<Option<ModelCard>, RepoError> {
        ModelCard::read(&version.dir)
    }

    pub fn manifest(&self, version: &ModelVersion) -> Result<Manifest, RepoError> {
        Manifest::read(&version.dir)
    }

    pub fn digests(&self, version: &ModelVersion) -> Result<Digests, RepoError> {
        Digests::read(&version.dir)
    }

    pub fn lineage(&self, version: &ModelVersion) -> Result<Lineage, RepoError> {
        Lineage::read(&version.dir)
    }

    /// Re-hashes every file of a version against its `DIGESTS`.
    pub fn verify(
        &self,
        version: &ModelVersion,
        progress: &dyn Progress,
    ) -> Result<VerifyReport, RepoError> {
        verify_dir(&version.dir, progress)
    }

    /// Resolves, verifies and reads a version for serving. A version whose files do not match
    /// its digests is refused with the list of what differs.
    pub fn load(
        &self,
        model: &ModelRef,
        progress: &dyn Progress,
    ) -> Result<LoadedVersion, RepoError> {
        let version = self.resolve(model)?;
        let version_digest = self.verified(&version, progress)?;
        let manifest = self.manifest(&version)?;
        Ok(LoadedVersion {
            version,
            manifest,
            version_digest,
        })
    }

    /// Verifies a version and returns its version digest, or the error naming what differs.
    pub fn verified(
        &self,
        version: &ModelVersion,
        progress: &dyn Progress,
    ) -> Result<String, RepoError> {
        let report = self.verify(version, progress)?;
        if !report.ok() {
            return Err(RepoError::VerificationFailed {
                name: version.name.clone(),
                version: version.version.to_string(),
                summary: report.summary(),
            });
        }
        Ok(report.version_digest)
    }

    /// Imports a model file or folder as a new, immutable version.
    ///
    /// The source is read and described first (a corrupt file fails before anything is
    /// written), then copied (or hard-linked) into a hidden staging folder with its manifest,
    /// lineage and digests, and finally renamed into place, so a version folder is either
    /// complete or absent.
    pub fn import(
        &self,
        source: &Path,
        options: &ImportOptions<'_>,
    ) -> Result<LoadedVersion, RepoError> {
        validate_name(&options.name)?;
        let version = parse_version(&options.version)?;
        let model_dir = self.root.join(&options.name);
        let target = model_dir.join(version.to_string());
        let exists = || RepoError::VersionExists {
            name: options.name.clone(),
            version: version.to_string(),
            path: target.clone(),
        };
        if target.exists() {
            return Err(exists());
        }
        let source = std::path::absolute(source).map_err(RepoError::io(source))?;
        let mut description = describe(&source, options.kind, options.rules_check)?;
        let pipeline = declared_pipeline(&source, options.pipeline.as_ref(), &description)?;
        if let Some(card) = &options.card {
            if description.files.iter().any(|f| f.relative == CARD_FILE) {
                return Err(RepoError::UnsupportedSource {
                    path: source.clone(),
                    reason: format!("it has its own {CARD_FILE}; --card would replace it"),
                });
            }
            // Read first: a card that is not one fails before anything is written.
            ModelCard::read_file(card, CARD_FILE)?;
            let bytes = std::fs::metadata(card).map_err(RepoError::io(card))?.len();
            description.files.push(crate::describe::SourceEntry {
                relative: CARD_FILE.to_string(),
                path: card.clone(),
                role: crate::manifest::FileRole::Other,
                bytes,
            });
        }

        std::fs::create_dir_all(&model_dir).map_err(RepoError::io(&model_dir))?;
        let unique = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let mut staging = Staging {
            dir: model_dir.join(format!(
                ".{version}.importing-{}-{unique}",
                std::process::id()
            )),
            armed: true,
        };
        std::fs::create_dir(&staging.dir).map_err(RepoError::io(&staging.dir))?;

        let mut digests = Digests::default();
        let mut source_files = Vec::new();
        let mut linked = Vec::new();
        let mut size_bytes = 0u64;
        for file in &description.files {
            let dst = staging.dir.join(&file.relative);
            if let Some(parent) = dst.parent() {
                std::fs::create_dir_all(parent).map_err(RepoError::io(parent))?;
            }
            let (sha256, bytes) = if options.link {
                std::fs::hard_link(&file.path, &dst).map_err(|source| RepoError::HardLink {
                    path: file.path.clone(),
                    source,
                })?;
                linked.push(dst.clone());
                hash_file(&dst, options.progress)?
            } else {
                copy_and_hash(&file.path, &dst, options.progress)?
            };
            size_bytes += bytes;
            digests.files.insert(file.relative.clone(), sha256.clone());
            source_files.push(SourceFile {
                path: file.relative.clone(),
                sha256,
                bytes,
            });
        }

        let manifest = Manifest {
            manifest_version: MANIFEST_VERSION,
            model: ModelSection {
                name: options.name.clone(),
                version: version.to_string(),
                kind: description.kind,
                format: description.format,
                display_name: description.display_name.clone(),
                parameter_count: description.parameter_count,
                size_bytes,
                weights: description.weights.clone(),
            },
            architecture: description.architecture.clone(),
            tokenizer: description.tokenizer.clone(),
            embedding: description.embedding.clone(),
            onnx: description.onnx.clone(),
            pipeline,
            files: description
                .files
                .iter()
                .map(|f| FileEntry {
                    path: f.relative.clone(),
                    role: f.role,
                    bytes: source_files
                        .iter()
                        .find(|s| s.path == f.relative)
                        .map_or(f.bytes, |s| s.bytes),
                })
                .collect(),
        };
        manifest.write(&staging.dir)?;

        let source_is_folder = source.is_dir();
        let source_digest = if source_is_folder {
            Digests {
                files: digests.files.clone(),
            }
            .version_digest()
        } else {
            source_files
                .first()
                .map(|f| f.sha256.clone())
                .unwrap_or_default()
        };
        let lineage = Lineage {
            lineage_version: 1,
            name: options.name.clone(),
            version: version.to_string(),
            source: Source {
                path: source.display().to_string(),
                kind: if source_is_folder { "folder" } else { "file" }.into(),
                sha256: source_digest,
                files: source_files,
            },
            import_mode: if options.link { "hardlink" } else { "copy" }.into(),
            imported_at: now_rfc3339(),
            imported_by: current_user(),
            rampart: options.build.clone(),
            git_commit: options.git_commit.clone(),
            dataset_version: options.dataset_version.clone(),
            environment: Environment {
                fingerprint: options.host_fingerprint.clone(),
                ..Environment::snapshot()
            },
            derived_from: options.derived_from.clone(),
        };
        lineage.write(&staging.dir)?;
        for own in [MANIFEST_FILE, crate::lineage::LINEAGE_FILE] {
            let (sha256, _) = hash_file(&staging.dir.join(own), &crate::NoProgress)?;
            digests.files.insert(own.to_string(), sha256);
        }
        digests.write(&staging.dir)?;

        match std::fs::rename(&staging.dir, &target) {
            Ok(()) => staging.armed = false,
            Err(_) if target.exists() => return Err(exists()),
            Err(e) => return Err(RepoError::io(&target)(e)),
        }
        let linked: Vec<PathBuf> = linked
            .iter()
            .filter_map(|p| {
                p.strip_prefix(&staging.dir)
                    .ok()
                    .map(|rel| target.join(rel))
            })
            .collect();
        seal(&target, &linked).map_err(RepoError::io(&target))?;
        let imported = ModelVersion {
            name: options.name.clone(),
            version,
            dir: target,
        };
        if options.stable {
            let by = current_user().unwrap_or_else(|| "unknown".into());
            self.set_stable(&imported, &by, "import --stable")?;
        } else {
            self.adopt_first(&imported)?;
        }
        Ok(LoadedVersion {
            version: imported,
            manifest,
            version_digest: digests.version_digest(),
        })
    }

    /// Deletes a version. The stable version goes only when it is the model's last (its alias
    /// with it); the model's folder goes too when nothing else is left in it.
    pub fn remove(&self, version: &ModelVersion) -> Result<(), RepoError> {
        let model_dir = self.root.join(&version.name);
        let last = self.versions(&version.name)?.len() <= 1;
        if let Some(stable) = self.stable(&version.name)? {
            if stable.version == version.version.to_string() {
                if !last {
                    return Err(RepoError::StableInUse {
                        name: version.name.clone(),
                        version: stable.version,
                    });
                }
                let path = Aliases::path(&model_dir);
                std::fs::remove_file(&path).map_err(RepoError::io(&path))?;
            }
        }
        make_writable(&version.dir).map_err(RepoError::io(&version.dir))?;
        std::fs::remove_dir_all(&version.dir).map_err(RepoError::io(&version.dir))?;
        if std::fs::read_dir(&model_dir).is_ok_and(|mut entries| entries.next().is_none()) {
            let _ = std::fs::remove_dir(&model_dir);
        }
        Ok(())
    }
}

/// The pipeline given with the import, or declared by a `rampart.toml` in the source folder,
/// checked against the model.
fn declared_pipeline(
    source: &Path,
    given: Option<&crate::pipeline::Pipeline>,
    description: &crate::describe::Description,
) -> Result<Option<crate::pipeline::Pipeline>, RepoError> {
    let beside = source.join(MANIFEST_FILE);
    let (pipeline, from) = match given {
        Some(p) => (p.clone(), source.to_path_buf()),
        None if source.is_dir() && beside.is_file() => {
            let text = std::fs::read_to_string(&beside).map_err(RepoError::io(&beside))?;
            let declaration =
                crate::pipeline::Declaration::parse(&text).map_err(|e| RepoError::BadManifest {
                    path: beside.clone(),
                    reason: e.to_string(),
                })?;
            (declaration.pipeline, beside)
        }
        None => return Ok(None),
    };
    if pipeline == crate::pipeline::Pipeline::default() {
        return Ok(None);
    }
    let invalid = |reason: String| RepoError::UnsupportedSource {
        path: from.clone(),
        reason,
    };
    match &description.onnx {
        Some(onnx) => {
            let has_file = |name: &str| description.files.iter().any(|f| f.relative == name);
            pipeline
                .validate(onnx, &has_file)
                .map_err(|e| invalid(e.to_string()))?;
        }
        None => {
            if let Some(monitor) = &pipeline.monitor {
                monitor.validate().map_err(|e| invalid(e.to_string()))?;
            }
            if pipeline.preprocess.is_some() || pipeline.postprocess.is_some() {
                return Err(invalid(format!(
                    "pre- and post-processing are declared for ONNX models; this is a {} model",
                    description.kind
                )));
            }
        }
    }
    Ok(Some(pipeline))
}
