//! Records the git commit and compiler of this build for `--version` and model lineage.

use std::path::Path;
use std::process::Command;

fn run(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}

fn main() {
    let commit = std::env::var("RAMPART_GIT_COMMIT")
        .ok()
        .or_else(|| run("git", &["rev-parse", "--short=12", "HEAD"]));
    if let Some(commit) = commit {
        println!("cargo:rustc-env=RAMPART_GIT_COMMIT={commit}");
    }
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    if let Some(version) = run(&rustc, &["--version"]) {
        println!("cargo:rustc-env=RAMPART_RUSTC_VERSION={version}");
    }
    // Rebuild the version string when the checkout moves to another commit.
    if let Some(git_dir) = run("git", &["rev-parse", "--git-dir"]) {
        let git_dir = Path::new(&git_dir);
        println!("cargo:rerun-if-changed={}", git_dir.join("HEAD").display());
        if let Some(head_ref) = std::fs::read_to_string(git_dir.join("HEAD"))
            .ok()
            .and_then(|h| h.strip_prefix("ref: ").map(|r| r.trim().to_string()))
        {
            println!(
                "cargo:rerun-if-changed={}",
                git_dir.join(head_ref).display()
            );
        }
    }
    println!("cargo:rerun-if-env-changed=RAMPART_GIT_COMMIT");
    println!("cargo:rerun-if-changed=build.rs");
}
