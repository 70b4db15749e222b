//! Choosing and loading a model for the engine commands (`generate`, `bench`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use engine::{Engine, EngineOptions};
use repo::{ModelRef, Repository};

/// Which model, from where, on how many threads.
#[derive(Debug, clap::Args)]
pub struct ModelChoice {
    /// NAME[@VERSION] in the repository (digests are verified before loading), or a path to a
    /// .gguf file.
    #[arg(long, short = 'm')]
    pub model: String,
    /// The model repository folder.
    #[arg(
        long,
        env = "RAMPART_REPO",
        default_value = "models",
        value_name = "DIR"
    )]
    pub repo: PathBuf,
    /// Compute threads (default: physical cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
}

impl ModelChoice {
    /// Loads the engine with a context of at least `context` positions.
    pub fn load(&self, context: Option<usize>) -> Result<Engine> {
        let options = EngineOptions {
            threads: self
                .threads
                .unwrap_or_else(kernels::backend::physical_cores)
                .max(1),
            context,
            ..EngineOptions::default()
        };
        let path = PathBuf::from(&self.model);
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
            && path.is_file()
        {
            return Engine::load(&path, &options)
                .with_context(|| format!("loading {}", path.display()));
        }
        let model: ModelRef = self.model.parse()?;
        let repository = Repository::open(&self.repo);
        Engine::from_repository(&repository, &model, &options)
            .with_context(|| format!("loading {model} from {}", self.repo.display()))
    }
}
