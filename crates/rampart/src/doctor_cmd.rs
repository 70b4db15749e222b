//! `rampart doctor`: the host preflight (crate `host`) with the Rampart checks fed from the
//! server configuration. Reads only; fixes are printed, never run (docs/doctor.md).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use repo::{NoProgress, Repository};
use server::config::ServerConfig;

/// Check the host for the settings that break AI serving (swap, frequency scaling, NUMA, I/O,
/// limits, kernel and driver, GPU health) and Rampart's own (KV memory, threads, repository,
/// audit directory, ports). Exit 0 when all is ok (or unknown), 1 on warnings, 2 on errors.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Print JSON (the report, docs/doctor.schema.json; or the fingerprint with --fingerprint).
    #[arg(long, conflicts_with = "fix_script")]
    pub json: bool,
    /// Run one area: memory, cpu, numa, storage, network, limits, kernel, gpu, rampart.
    #[arg(long, value_name = "AREA")]
    pub only: Option<host::Area>,
    /// Print a shell script with the fixes of the findings (nothing is run).
    #[arg(long)]
    pub fix_script: bool,
    /// Read the host's files under this directory instead of / (a fixture tree, a copy of
    /// another host's /proc and /sys).
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub root: PathBuf,
    /// Print the hardware fingerprint (CPU, memory, kernel, GPUs, PCIe) instead of the checks.
    #[arg(long, conflicts_with_all = ["only", "fix_script", "gpu_load_sample", "verify"])]
    pub fingerprint: bool,
    /// Judge the GPUs' PCIe links under a short load (about a second, a CUDA context and
    /// 64 MiB per GPU) instead of on one reading.
    #[arg(long)]
    pub gpu_load_sample: bool,
    /// Verify every version's digests in the repository (hashes every file: as slow as
    /// `rampart model verify`).
    #[arg(long)]
    pub verify: bool,
    /// Which findings fail the run: `warning` (exit 1 on warnings, 2 on errors), `error` (exit 2
    /// on errors, 0 on warnings: a pod's init container), `never` (always 0: report only).
    #[arg(long, value_name = "LEVEL", default_value = "warning")]
    pub fail_on: FailOn,
    /// The server configuration (rampart.toml) whose settings the Rampart checks judge.
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The model repository folder (over the config file's `repo`).
    #[arg(long, env = "RAMPART_REPO", value_name = "DIR")]
    pub repo: Option<PathBuf>,
}

pub fn run(args: DoctorArgs) -> Result<ExitCode> {
    let mut config = ServerConfig::load(args.config.as_deref())?;
    if let Some(repo) = args.repo {
        config.repo = repo;
    }
    let mut context = host::Context {
        root: args.root,
        gpu_load_sample: args.gpu_load_sample,
        // What this process's kernels run (the best level the CPU has, or RAMPART_ISA's).
        kernel_isa: kernels::Isa::detect()
            .cpu_features()
            .into_iter()
            .map(String::from)
            .collect(),
        ..server::doctor::context(&config)
    };
    if args.fingerprint {
        let fingerprint = host::fingerprint(&context);
        if args.json {
            println!("{}", serde_json::to_string_pretty(&fingerprint)?);
        } else {
            print!("{}", fingerprint.render_text());
        }
        return Ok(ExitCode::SUCCESS);
    }
    let wants_rampart = args.only.is_none_or(|a| a == host::Area::Rampart);
    if args.verify && wants_rampart {
        context.repository_verification = verify(&config.repo);
    }
    let report = host::run(&context, args.only);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else if args.fix_script {
        print!("{}", report.fix_script());
    } else {
        print!("{}", report.render_text());
    }
    let code = match (args.fail_on, report.exit_code()) {
        (FailOn::Never, _) | (FailOn::Error, 1) => 0,
        (_, code) => code,
    };
    Ok(ExitCode::from(code as u8))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FailOn {
    Warning,
    Error,
    Never,
}

/// Every version's digests, as `rampart model verify` checks them: `Ok(summary)`, or
/// `Err(what differs)`. `None` when there is no repository (its check says so).
fn verify(dir: &Path) -> Option<Result<String, String>> {
    if !dir.is_dir() {
        return None;
    }
    let repository = Repository::open(dir);
    let result = (|| -> Result<String, String> {
        let mut versions = Vec::new();
        for name in repository.models().map_err(|e| e.to_string())? {
            versions.extend(repository.versions(&name).map_err(|e| e.to_string())?);
        }
        let mut failed = Vec::new();
        let (mut files, mut bytes) = (0, 0);
        for v in &versions {
            match repository.verify(v, &NoProgress) {
                Ok(r) if r.ok() => {
                    files += r.files_checked;
                    bytes += r.bytes_checked;
                }
                Ok(r) => failed.push(format!("{v}: {}", r.summary())),
                Err(e) => failed.push(format!("{v}: {e}")),
            }
        }
        if failed.is_empty() {
            Ok(format!(
                "{} version{}, {files} files, {}",
                versions.len(),
                if versions.len() == 1 { "" } else { "s" },
                crate::render::bytes(bytes)
            ))
        } else {
            Err(failed.join("; "))
        }
    })();
    Some(result)
}
