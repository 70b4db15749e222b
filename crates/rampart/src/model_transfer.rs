//! `rampart model push` and `rampart model pull`: a version travels between repositories (S3,
//! or a folder such as a model image's) and arrives only whole and verified.
//!
//! The layout on the far side mirrors a repository: `PREFIX/NAME/VERSION/<file>` for every file
//! of the version's `DIGESTS`, and `DIGESTS` itself. A push uploads the files first and
//! `DIGESTS` last, so a half-pushed version has none and a pull refuses it. A pull reads
//! `DIGESTS` first, checks its version digest against `--digest` when one is pinned (a bucket
//! rewritten with consistent digests is caught before a byte of weights moves), fetches only the
//! files it lists (each checked against its digest as it streams), and renames the folder into the
//! repository: a version is there complete and verified, or not at all. Pulling a version the
//! repository already holds verifies it and succeeds when it is the same one, so an init
//! container can run on every start.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use audit::s3::{S3Client, S3Config};
use repo::digests::{verify_dir, Digests};
use repo::{Manifest, ModelRef, NoProgress, Repository};
use serde_json::json;
use sha2::{Digest, Sha256};

/// Where the S3 service is (for `s3://` locations).
#[derive(Debug, Clone, clap::Args)]
pub struct S3Args {
    /// The S3 service root, `http(s)://host[:port]`.
    #[arg(long, env = "RAMPART_S3_ENDPOINT", value_name = "URL")]
    pub s3_endpoint: Option<String>,
    /// The region requests are signed for.
    #[arg(
        long,
        env = "AWS_REGION",
        default_value = "us-east-1",
        value_name = "REGION"
    )]
    pub s3_region: String,
    /// Virtual-hosted-style addressing instead of path style.
    #[arg(long)]
    pub s3_virtual_hosted: bool,
}

/// The far side: an S3 prefix or a repository folder.
enum Store {
    S3(Box<S3Store>),
    Dir(PathBuf),
}

struct S3Store {
    client: S3Client,
    prefix: String,
    runtime: tokio::runtime::Runtime,
    url: String,
}

impl Store {
    fn open(location: &str, s3: &S3Args) -> Result<Store> {
        if !location.starts_with("s3://") {
            return Ok(Store::Dir(PathBuf::from(location)));
        }
        let (bucket, prefix) = audit::s3::parse_s3_url(location)?;
        let endpoint = s3
            .s3_endpoint
            .clone()
            .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok())
            .filter(|e| !e.is_empty())
            .context(
                "an s3:// location needs --s3-endpoint (or RAMPART_S3_ENDPOINT, AWS_ENDPOINT_URL)",
            )?;
        let credential = |name: &str| {
            std::env::var(name)
                .ok()
                .filter(|v| !v.is_empty())
                .with_context(|| format!("S3 credentials are read from ${name}, which is not set"))
        };
        let client = S3Client::new(S3Config {
            endpoint,
            bucket,
            region: s3.s3_region.clone(),
            access_key: credential("AWS_ACCESS_KEY_ID")?,
            secret_key: credential("AWS_SECRET_ACCESS_KEY")?,
            path_style: !s3.s3_virtual_hosted,
        })?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(Store::S3(Box::new(S3Store {
            client,
            prefix: prefix.trim_end_matches('/').to_string(),
            runtime,
            url: location.trim_end_matches('/').to_string(),
        })))
    }

    /// `NAME/VERSION/<relative>` on this side, for messages.
    fn describe(&self, relative: &str) -> String {
        match self {
            Store::S3(s3) => format!("{}/{relative}", s3.url),
            Store::Dir(dir) => dir.join(relative).display().to_string(),
        }
    }

    /// A small file whole; `None` when it is not there.
    fn read(&self, relative: &str) -> Result<Option<Vec<u8>>> {
        match self {
            Store::S3(s3) => match s3.runtime.block_on(s3.client.get_object(&s3.key(relative))) {
                Ok(body) => Ok(Some(body)),
                Err(e) if e.status() == Some(404) => Ok(None),
                Err(e) => Err(e).with_context(|| format!("reading {}", self.describe(relative))),
            },
            Store::Dir(dir) => match std::fs::read(dir.join(relative)) {
                Ok(body) => Ok(Some(body)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(e).with_context(|| format!("reading {}", self.describe(relative))),
            },
        }
    }

    /// Copies a file to `dest`, hashing it as it streams: (sha256 hex, bytes).
    fn fetch(&self, relative: &str, dest: &Path) -> Result<(String, u64)> {
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let s3 = match self {
            Store::S3(s3) => s3,
            Store::Dir(dir) => {
                return repo::digests::copy_and_hash(&dir.join(relative), dest, &NoProgress)
                    .with_context(|| format!("copying {}", self.describe(relative)));
            }
        };
        let mut file =
            std::fs::File::create(dest).with_context(|| format!("creating {}", dest.display()))?;
        let mut hasher = Sha256::new();
        let mut sink = |chunk: &[u8]| {
            hasher.update(chunk);
            file.write_all(chunk)
        };
        let bytes = s3
            .runtime
            .block_on(s3.client.get_object_into(&s3.key(relative), &mut sink))
            .with_context(|| format!("fetching {}", self.describe(relative)))?;
        file.sync_all()?;
        Ok((hex::encode(hasher.finalize()), bytes))
    }

    fn put(&self, relative: &str, source: &Path) -> Result<()> {
        match self {
            Store::S3(s3) => {
                let len = std::fs::metadata(source)?.len();
                // One PUT per file (S3's single-request limit is 5 GiB); larger files would need
                // a multipart upload, which this client does not speak.
                if len > 5 << 30 {
                    bail!(
                        "{} is {len} bytes, over S3's 5 GiB single-upload limit (multipart uploads \
                         are not supported): copy the version with an S3 tool",
                        source.display()
                    );
                }
                let body = std::fs::read(source)?;
                s3.runtime
                    .block_on(s3.client.put_object(&s3.key(relative), body, None))
                    .with_context(|| format!("uploading {}", self.describe(relative)))?;
                Ok(())
            }
            Store::Dir(dir) => {
                let dest = dir.join(relative);
                if let Some(parent) = dest.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::copy(source, &dest)
                    .with_context(|| format!("copying to {}", dest.display()))?;
                Ok(())
            }
        }
    }
}

impl S3Store {
    /// The object key of `NAME/VERSION/<relative>` under the prefix.
    fn key(&self, relative: &str) -> String {
        audit::ship::remote_key(&self.prefix, relative)
    }
}

/// `sha256:HEX` or `HEX`, lowercased.
fn pinned_digest(text: &str) -> Result<String> {
    let hex = text
        .strip_prefix("sha256:")
        .unwrap_or(text)
        .to_ascii_lowercase();
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!(
            "--digest {text:?}: expected sha256:<64 hex digits> (`rampart model inspect` shows it)"
        );
    }
    Ok(hex)
}

fn exact_version(repo: &Repository, model: &str) -> Result<repo::ModelVersion> {
    let reference: ModelRef = model.parse()?;
    if reference.version.is_none() {
        bail!("{model}: give NAME@VERSION (a transfer names one version)");
    }
    Ok(repo.resolve(&reference)?)
}

pub fn push(repo: &Repository, model: &str, to: &str, s3: &S3Args, json: bool) -> Result<ExitCode> {
    let version = exact_version(repo, model)?;
    let version_digest = repo
        .verified(&version, &NoProgress)
        .with_context(|| format!("{version} does not verify here; nothing was pushed"))?;
    let digests = Digests::read(&version.dir)?;
    let store = Store::open(to, s3)?;
    let base = format!("{}/{}", version.name, version.version);
    let mut bytes = 0u64;
    for relative in digests.files.keys() {
        let source = version.dir.join(relative);
        bytes += std::fs::metadata(&source)?.len();
        store.put(&format!("{base}/{relative}"), &source)?;
    }
    // Last: until it is there, a pull finds no version.
    store.put(
        &format!("{base}/{}", repo::digests::DIGESTS_FILE),
        &version.dir.join(repo::digests::DIGESTS_FILE),
    )?;
    let target = store.describe(&base);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "model": version.to_string(),
                "to": target,
                "files": digests.files.len() + 1,
                "bytes": bytes,
                "version_digest": format!("sha256:{version_digest}"),
            }))?
        );
    } else {
        println!(
            "pushed {version} ({} files, {}) to {target}\nversion digest sha256:{version_digest} (pin it: rampart model pull {version} --from {to} --digest sha256:{version_digest})",
            digests.files.len() + 1,
            crate::render::bytes(bytes),
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Pulls each `NAME@VERSION[=sha256:HEX]` in turn (one store, opened once); stops at the first
/// that fails, keeping the ones already pulled (each is whole and verified).
pub fn pull_all(
    repo: &Repository,
    models: &[String],
    from: &str,
    digest: Option<&str>,
    s3: &S3Args,
    json: bool,
) -> Result<ExitCode> {
    if digest.is_some() && models.len() > 1 {
        bail!("--digest pins one model; pin several as NAME@VERSION=sha256:HEX");
    }
    let mut store = None;
    for spec in models {
        let (model, pin) = match spec.split_once('=') {
            Some((model, pin)) => (model, Some(pin)),
            None => (spec.as_str(), digest),
        };
        pull(repo, model, from, pin, s3, json, &mut store)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn pull(
    repo: &Repository,
    model: &str,
    from: &str,
    digest: Option<&str>,
    s3: &S3Args,
    json: bool,
    store: &mut Option<Store>,
) -> Result<()> {
    let reference: ModelRef = model.parse()?;
    let Some(version) = reference.version.clone() else {
        bail!("{model}: give NAME@VERSION (a transfer names one version)");
    };
    let pinned = digest.map(pinned_digest).transpose()?;
    let base = format!("{}/{version}", reference.name);
    let target = repo.root().join(&reference.name).join(version.to_string());
    let report = |outcome: &str, version_digest: &str, files: usize, bytes: u64| -> Result<()> {
        // A model's first version becomes its stable one, as an import's does.
        let arrived = repo::ModelVersion {
            name: reference.name.clone(),
            version: version.clone(),
            dir: target.clone(),
        };
        let adopted = repo.adopt_first(&arrived)?;
        if json {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({
                    "model": format!("{}@{version}", reference.name),
                    "outcome": outcome,
                    "dir": target,
                    "files": files,
                    "bytes": bytes,
                    "version_digest": format!("sha256:{version_digest}"),
                    "made_stable": adopted.is_some(),
                }))?
            );
        } else {
            println!(
                "{outcome} {}@{version} into {} ({files} files, {}), version digest sha256:{version_digest}",
                reference.name,
                target.display(),
                crate::render::bytes(bytes)
            );
        }
        Ok(())
    };
    // Already here: it must be the same version, whole.
    if target.exists() {
        let here = verify_dir(&target, &NoProgress)?;
        if !here.ok() {
            bail!(
                "{} is in the repository but does not verify ({}); remove it (rampart model remove) and pull again",
                target.display(),
                here.summary()
            );
        }
        if let Some(pin) = &pinned {
            if &here.version_digest != pin {
                bail!(
                    "{}@{version} is in the repository with version digest sha256:{}, not the pinned sha256:{pin}",
                    reference.name,
                    here.version_digest
                );
            }
        }
        return report(
            "verified",
            &here.version_digest,
            here.files_checked,
            here.bytes_checked,
        );
    }
    if store.is_none() {
        *store = Some(Store::open(from, s3)?);
    }
    let store = store.as_ref().expect("opened above");
    let digests_relative = format!("{base}/{}", repo::digests::DIGESTS_FILE);
    let text = store.read(&digests_relative)?.with_context(|| {
        format!(
            "no {} at {} (not pushed, or still being pushed)",
            repo::digests::DIGESTS_FILE,
            store.describe(&base)
        )
    })?;
    let text = String::from_utf8(text).context("DIGESTS is not UTF-8")?;
    let digests = Digests::parse(&text)
        .map_err(|e| anyhow::anyhow!("{}: {e}", store.describe(&digests_relative)))?;
    let version_digest = digests.version_digest();
    if let Some(pin) = &pinned {
        if &version_digest != pin {
            bail!(
                "{} has version digest sha256:{version_digest}, not the pinned sha256:{pin}: nothing was fetched",
                store.describe(&base)
            );
        }
    }
    std::fs::create_dir_all(repo.root())
        .with_context(|| format!("creating {}", repo.root().display()))?;
    let staging = repo.root().join(format!(
        ".pull-{}-{version}-{}",
        reference.name,
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&staging);
    let result = (|| -> Result<(usize, u64)> {
        let mut bytes = 0u64;
        // Digests::parse has checked every path; each file is checked as it streams in, and
        // the staging folder holds nothing else, so the version needs no second hashing pass.
        for (relative, expected) in &digests.files {
            let (actual, length) =
                store.fetch(&format!("{base}/{relative}"), &staging.join(relative))?;
            if &actual != expected {
                bail!(
                    "{} has sha256 {actual}, DIGESTS says {expected}",
                    store.describe(&format!("{base}/{relative}"))
                );
            }
            bytes += length;
        }
        std::fs::write(staging.join(repo::digests::DIGESTS_FILE), &text)?;
        Manifest::read(&staging).context("the fetched version's manifest")?;
        Ok((digests.files.len(), bytes))
    })();
    let (files, bytes) = match result {
        Ok(done) => done,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
    };
    std::fs::create_dir_all(target.parent().expect("NAME/VERSION has a parent"))?;
    if let Err(e) = std::fs::rename(&staging, &target) {
        let _ = std::fs::remove_dir_all(&staging);
        // Another pod pulling into the same volume won the race: take theirs if it is the same.
        let theirs = verify_dir(&target, &NoProgress).ok();
        match theirs {
            Some(r) if r.ok() && r.version_digest == version_digest => {
                return report("verified", &version_digest, files, bytes);
            }
            _ => {
                return Err(e)
                    .with_context(|| format!("moving the version to {}", target.display()))
            }
        }
    }
    report("pulled", &version_digest, files, bytes)
}
