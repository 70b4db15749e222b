//! A real PostgreSQL for tests: `initdb` into a temporary directory and `postgres` on a free
//! port of 127.0.0.1, trust authentication, fsync off; stopped and removed on drop. As root,
//! both run as the `postgres` user (initdb refuses root). Found on PATH or under
//! `/usr/lib/postgresql/<version>/bin` (Debian's `apt-get install postgresql`).

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A running PostgreSQL.
pub struct Postgres {
    child: Child,
    dir: PathBuf,
    pub port: u16,
}

fn bin_dir() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .find(|d| d.join("initdb").is_file() && d.join("postgres").is_file())
    });
    on_path.or_else(|| {
        let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .flatten()
            .map(|e| e.path().join("bin"))
            .filter(|d| d.join("initdb").is_file())
            .collect();
        found.sort();
        found.pop()
    })
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// `program args…`, as the `postgres` user when we are root.
fn command(program: &Path, root: bool) -> Command {
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

impl Postgres {
    /// Starts one, or `None` when PostgreSQL is not installed (the caller skips, unless
    /// `RAMPART_REQUIRE_MODELS=1`, where this panics: the test setup installs it).
    pub fn start() -> Option<Postgres> {
        let Some(bin) = bin_dir() else {
            assert!(
                std::env::var("RAMPART_REQUIRE_MODELS").as_deref() != Ok("1"),
                "PostgreSQL (initdb, postgres) is not installed (scripts/test.sh installs it)"
            );
            eprintln!("skipped: PostgreSQL is not installed");
            return None;
        };
        let root = is_root();
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "rampart-pg-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        if root {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "chown the PostgreSQL directory to postgres");
        }
        let data = dir.join("data");
        let init = command(&bin.join("initdb"), root)
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
                "-D",
            ])
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .expect("initdb runs");
        assert!(
            init.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&init.stderr)
        );
        let port = rand_port();
        let child = command(&bin.join("postgres"), root)
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-k"])
            .arg(&dir)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "max_connections=50",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres starts");
        let pg = Postgres { child, dir, port };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "PostgreSQL did not listen in 20 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // Listening comes a moment before it takes queries; the client retries its connect.
        std::thread::sleep(Duration::from_millis(300));
        Some(pg)
    }

    /// The connection URL of the `postgres` database.
    pub fn url(&self) -> String {
        format!("postgresql://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

fn rand_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // SIGINT: a fast shutdown.
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
