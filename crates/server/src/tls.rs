//! TLS on both front doors (HTTPS and gRPC over TLS), with rustls and its `ring` provider.
//!
//! `[tls]` names a certificate chain and its key (PEM), and optionally a CA that client
//! certificates must chain to (`client_auth` `optional` or `required`). [`Certificates`] holds
//! the rustls configuration of each door (the HTTP door offers ALPN `h2` and `http/1.1`, the
//! gRPC door `h2`); [`listen`] puts a TCP listener behind a task that runs each connection's
//! handshake on its own task, at most `max_pending_handshakes` at once and each within
//! `handshake_timeout_ms`, and hands finished TLS streams to axum ([`TlsListener`] is an axum
//! listener) or tonic ([`TlsListener::into_incoming`]). A slow or failed handshake therefore
//! never holds up the next connection, and neither server sees a connection before its handshake
//! is done; a refused client certificate ends the connection at the handshake.
//!
//! Reload: every `reload_interval_s` the files are read again and hashed (SHA-256 over the
//! three files). When the hash changed, a new configuration is built and taken by the
//! connections accepted from then on; connections already open keep the one they started with,
//! so nothing is dropped. A change that does not build (unreadable file, no certificate, a key
//! that does not match the certificate, a bad CA) keeps the previous configuration, is logged
//! and counted once in `rampart_tls_reloads_total{result="error"}`, and is tried again when the
//! files change again.
//!
//! Not here: who may call what. A client certificate is checked against the CA and nothing
//! more; API keys ([`crate::auth`]) still decide the principal and its scopes.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::config::{ClientAuth, TlsConfig};

/// Why the TLS configuration could not be read or built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("tls.{setting} {}: {source}", path.display())]
    Read {
        setting: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("tls.{setting} {}: {message}", path.display())]
    Pem {
        setting: &'static str,
        path: PathBuf,
        message: String,
    },
    #[error("tls: cert_file and key_file are needed to serve TLS")]
    NotConfigured,
    #[error("tls.client_ca_file {}: {message}", path.display())]
    ClientCa { path: PathBuf, message: String },
    #[error("tls: the certificate and key do not make a server configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Which front door a listener is: what it offers in ALPN and how its metrics are labelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    /// HTTP/1.1 and HTTP/2 (the OpenAI and KServe REST routes, admin, health, metrics).
    Http,
    /// KServe v2 over gRPC (HTTP/2 only).
    Grpc,
}

impl Door {
    pub fn as_str(self) -> &'static str {
        match self {
            Door::Http => "http",
            Door::Grpc => "grpc",
        }
    }

    fn alpn(self) -> Vec<Vec<u8>> {
        match self {
            Door::Http => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
            Door::Grpc => vec![b"h2".to_vec()],
        }
    }
}

/// What a reload found.
#[derive(Debug)]
pub enum Reload {
    /// The files are as they were (or as they were at the last failed reload).
    Unchanged,
    /// New connections get the new configuration.
    Reloaded,
    /// The new files do not build; the previous configuration stays.
    Failed(TlsError),
}

/// The current rustls configuration of each door, rebuilt when the files change.
pub struct Certificates {
    config: TlsConfig,
    current: RwLock<Current>,
}

struct Current {
    /// The hash of the files the configurations were built from.
    digest: Vec<u8>,
    http: Arc<ServerConfig>,
    grpc: Arc<ServerConfig>,
    /// The last failure (the files' hash, or the read error), reported once.
    failure: Option<String>,
}

impl std::fmt::Debug for Certificates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Certificates")
            .field("cert_file", &self.config.cert_file)
            .field("client_auth", &self.config.client_auth)
            .finish_non_exhaustive()
    }
}

impl Certificates {
    /// Reads and builds the configuration (blocking: file reads); a failure here stops the
    /// start.
    pub fn load(config: &TlsConfig) -> Result<Arc<Self>, TlsError> {
        let files = Files::read(config)?;
        let (http, grpc) = build(config, &files)?;
        Ok(Arc::new(Self {
            config: config.clone(),
            current: RwLock::new(Current {
                digest: files.digest(),
                http,
                grpc,
                failure: None,
            }),
        }))
    }

    /// The configuration new connections to `door` get.
    pub fn server_config(&self, door: Door) -> Arc<ServerConfig> {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        match door {
            Door::Http => Arc::clone(&current.http),
            Door::Grpc => Arc::clone(&current.grpc),
        }
    }

    /// Reads the files again and, when they changed, builds and swaps in the new
    /// configuration (blocking: file reads). A failure that repeats the last one (same files,
    /// same read error) is [`Reload::Unchanged`], so it is reported once.
    pub fn reload(&self) -> Reload {
        let (fingerprint, built) = match Files::read(&self.config) {
            Err(e) => (format!("read: {e}"), Err(e)),
            Ok(files) => {
                let digest = files.digest();
                {
                    let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
                    if current.digest == digest {
                        drop(current);
                        self.current
                            .write()
                            .unwrap_or_else(PoisonError::into_inner)
                            .failure = None;
                        return Reload::Unchanged;
                    }
                }
                let fingerprint = hex::encode(&digest);
                (
                    fingerprint,
                    build(&self.config, &files).map(|built| (digest, built)),
                )
            }
        };
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        match built {
            Ok((digest, (http, grpc))) => {
                *current = Current {
                    digest,
                    http,
                    grpc,
                    failure: None,
                };
                Reload::Reloaded
            }
            Err(_) if current.failure.as_deref() == Some(fingerprint.as_str()) => Reload::Unchanged,
            Err(e) => {
                current.failure = Some(fingerprint);
                Reload::Failed(e)
            }
        }
    }

    /// Polls the files every `reload_interval_s` (when not 0) on a blocking thread; logs and
    /// counts what each poll found.
    pub fn spawn_reloader(self: &Arc<Self>) {
        if self.config.reload_interval_s == 0 {
            return;
        }
        let every = Duration::from_secs(self.config.reload_interval_s);
        let certificates = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let polled = Arc::clone(&certificates);
                match tokio::task::spawn_blocking(move || polled.reload()).await {
                    Ok(outcome) => certificates.report(&outcome),
                    Err(e) => tracing::warn!(error = %e, "the TLS reload task failed"),
                }
            }
        });
    }

    fn report(&self, outcome: &Reload) {
        match outcome {
            Reload::Unchanged => {}
            Reload::Reloaded => {
                metrics::counter!("rampart_tls_reloads_total", "result" => "ok").increment(1);
                tracing::info!(
                    cert_file = %self.config.cert_file.as_deref().unwrap_or(Path::new("")).display(),
                    "TLS certificate reloaded: new connections use it"
                );
            }
            Reload::Failed(e) => {
                metrics::counter!("rampart_tls_reloads_total", "result" => "error").increment(1);
                tracing::error!(
                    error = %e,
                    "TLS certificate reload failed: serving the previous certificate"
                );
            }
        }
    }
}

/// The bytes of the configured files.
struct Files {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Files {
    fn read(config: &TlsConfig) -> Result<Self, TlsError> {
        let (Some(cert), Some(key)) = (&config.cert_file, &config.key_file) else {
            return Err(TlsError::NotConfigured);
        };
        let read = |setting: &'static str, path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                setting,
                path: path.to_path_buf(),
                source,
            })
        };
        Ok(Self {
            cert: read("cert_file", cert)?,
            key: read("key_file", key)?,
            client_ca: config
                .client_ca_file
                .as_deref()
                .map(|p| read("client_ca_file", p))
                .transpose()?,
        })
    }

    fn digest(&self) -> Vec<u8> {
        let mut hash = Sha256::new();
        for part in [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()] {
            match part {
                Some(bytes) => {
                    hash.update((bytes.len() as u64).to_le_bytes());
                    hash.update(bytes);
                }
                None => hash.update(u64::MAX.to_le_bytes()),
            }
        }
        hash.finalize().to_vec()
    }
}

/// The two doors' configurations from the files' bytes.
fn build(
    config: &TlsConfig,
    files: &Files,
) -> Result<(Arc<ServerConfig>, Arc<ServerConfig>), TlsError> {
    let path = |p: &Option<PathBuf>| p.clone().unwrap_or_default();
    let pem_error =
        |setting: &'static str, p: &Option<PathBuf>, e: &dyn std::fmt::Display| TlsError::Pem {
            setting,
            path: path(p),
            message: e.to_string(),
        };
    let chain = CertificateDer::pem_slice_iter(&files.cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error("cert_file", &config.cert_file, &e))?;
    if chain.is_empty() {
        return Err(pem_error(
            "cert_file",
            &config.cert_file,
            &"no certificate (a PEM `CERTIFICATE` block) in it",
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(&files.key).map_err(|e| {
        pem_error(
            "key_file",
            &config.key_file,
            &format!("{e} (a PEM private key: PKCS#8, PKCS#1 or SEC1)"),
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()?;
    let builder = match (config.client_auth, &files.client_ca) {
        (ClientAuth::Off, _) | (_, None) => builder.with_no_client_auth(),
        (mode, Some(ca)) => {
            let ca_error = |message: String| TlsError::ClientCa {
                path: path(&config.client_ca_file),
                message,
            };
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(ca) {
                let cert = cert.map_err(|e| ca_error(e.to_string()))?;
                roots.add(cert).map_err(|e| ca_error(e.to_string()))?;
            }
            if roots.is_empty() {
                return Err(ca_error("no certificate in it".into()));
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = if mode == ClientAuth::Optional {
                verifier.allow_unauthenticated()
            } else {
                verifier
            };
            let verifier = verifier.build().map_err(|e| ca_error(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    // `with_single_cert` checks that the key is the certificate's.
    let base = builder.with_single_cert(chain, key)?;
    let door = |door: Door| {
        let mut c = base.clone();
        c.alpn_protocols = door.alpn();
        Arc::new(c)
    };
    Ok((door(Door::Http), door(Door::Grpc)))
}

/// How a listener's connections are accepted.
#[derive(Debug, Clone, Copy)]
pub struct Accepting {
    pub door: Door,
    /// TCP keepalive probes after this much idle time (none: off).
    pub tcp_keepalive: Option<Duration>,
}

/// A TCP listener whose connections come out after their TLS handshake; an axum listener.
pub struct TlsListener {
    local: Option<SocketAddr>,
    connections: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    accepting: tokio::task::AbortHandle,
}

impl Drop for TlsListener {
    /// The server stopped accepting: so does the task behind it (the port closes).
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// Accepts on `listener` and runs each handshake on its own task, with the configuration of
/// `how.door` current at accept time.
pub fn listen(
    listener: TcpListener,
    certificates: Arc<Certificates>,
    how: Accepting,
) -> TlsListener {
    let local = listener.local_addr().ok();
    let timeout = Duration::from_millis(certificates.config.handshake_timeout_ms);
    let pending = Arc::new(Semaphore::new(certificates.config.max_pending_handshakes));
    let (sender, connections) = mpsc::channel(64);
    let task = tokio::spawn(async move {
        loop {
            let Ok(permit) = Arc::clone(&pending).acquire_owned().await else {
                return;
            };
            let (tcp, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: wait, as axum's own listener does.
                    tracing::warn!(error = %e, door = how.door.as_str(), "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            prepare(&tcp, how.tcp_keepalive);
            let acceptor = TlsAcceptor::from(certificates.server_config(how.door));
            let sender = sender.clone();
            tokio::spawn(async move {
                let handshake = tokio::time::timeout(timeout, acceptor.accept(tcp)).await;
                drop(permit);
                match handshake {
                    Ok(Ok(stream)) => {
                        let _ = sender.send((stream, peer)).await;
                    }
                    Ok(Err(e)) => handshake_failed(how.door, failure_reason(&e), &peer, &e),
                    Err(_) => handshake_failed(
                        how.door,
                        "timeout",
                        &peer,
                        &"the handshake did not finish in time",
                    ),
                }
            });
        }
    });
    TlsListener {
        local,
        connections,
        accepting: task.abort_handle(),
    }
}

/// No Nagle delay (a response's TLS records go out at once); TCP keepalive when asked.
fn prepare(tcp: &TcpStream, keepalive: Option<Duration>) {
    let _ = tcp.set_nodelay(true);
    if let Some(idle) = keepalive {
        let probes = socket2::TcpKeepalive::new().with_time(idle);
        let _ = socket2::SockRef::from(tcp).set_tcp_keepalive(&probes);
    }
}

/// `client_certificate` (none presented where one is required, or one the CA did not sign),
/// else `protocol`.
fn failure_reason(e: &io::Error) -> &'static str {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::NoCertificatesPresented | rustls::Error::InvalidCertificate(_)) => {
            "client_certificate"
        }
        _ => "protocol",
    }
}

fn handshake_failed(
    door: Door,
    reason: &'static str,
    peer: &SocketAddr,
    error: &dyn std::fmt::Display,
) {
    metrics::counter!("rampart_tls_handshake_failures_total", "door" => door.as_str(), "reason" => reason)
        .increment(1);
    tracing::debug!(door = door.as_str(), reason, %peer, %error, "TLS handshake failed");
}

impl TlsListener {
    /// The next connection whose handshake finished.
    async fn next(&mut self) -> (TlsStream<TcpStream>, SocketAddr) {
        match self.connections.recv().await {
            Some(connection) => connection,
            // The accepting task ended (it only does when aborted): no more connections.
            None => std::future::pending().await,
        }
    }

    /// The connections as tonic's incoming stream.
    pub fn into_incoming(
        self,
    ) -> impl futures_util::Stream<Item = Result<TlsConnection, Infallible>> + Send {
        futures_util::stream::unfold(self, |mut listener| async move {
            let (stream, _) = listener.next().await;
            Some((Ok(TlsConnection(stream)), listener))
        })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        self.next().await
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.local
            .ok_or_else(|| io::Error::other("the listener's address could not be read"))
    }
}

/// A TLS connection as tonic takes it (its connect info is the TCP connection's).
pub struct TlsConnection(TlsStream<TcpStream>);

impl tonic::transport::server::Connected for TlsConnection {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.0.get_ref().0.connect_info()
    }
}

impl AsyncRead for TlsConnection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConnection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use rustls::pki_types::ServerName;
    use testkit::tls::{Issued, TestCa};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    struct Files {
        dir: tempfile::TempDir,
        config: TlsConfig,
    }

    fn files(ca: &TestCa, server: &Issued, client_auth: ClientAuth) -> Files {
        let dir = tempfile::tempdir().unwrap();
        let config = TlsConfig {
            cert_file: Some(dir.path().join("tls.crt")),
            key_file: Some(dir.path().join("tls.key")),
            client_ca_file: (client_auth != ClientAuth::Off).then(|| dir.path().join("ca.crt")),
            client_auth,
            reload_interval_s: 0,
            handshake_timeout_ms: 2_000,
            ..TlsConfig::default()
        };
        server.write(
            config.cert_file.as_deref().unwrap(),
            config.key_file.as_deref().unwrap(),
        );
        if let Some(ca_file) = &config.client_ca_file {
            std::fs::write(ca_file, ca.pem()).unwrap();
        }
        Files { dir, config }
    }

    async fn serving(certificates: &Arc<Certificates>, door: Door) -> (u16, TlsListener) {
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = tcp.local_addr().unwrap().port();
        let how = Accepting {
            door,
            tcp_keepalive: None,
        };
        (port, listen(tcp, Arc::clone(certificates), how))
    }

    /// A TLS client trusting `ca`, presenting `identity` when given.
    async fn connect(
        port: u16,
        ca: &TestCa,
        identity: Option<&Issued>,
    ) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let mut roots = RootCertStore::empty();
        roots.add(CertificateDer::from(ca.der())).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let mut config = match identity {
            None => builder.with_no_client_auth(),
            Some(id) => builder
                .with_client_auth_cert(
                    vec![CertificateDer::from(id.der.clone())],
                    PrivateKeyDer::from_pem_slice(id.key_pem.as_bytes()).unwrap(),
                )
                .unwrap(),
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let mut tls = connector
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await?;
        // TLS 1.3: the server judges the client's certificate after the client finished; a
        // refusal shows on the first read.
        tls.write_all(b"ping").await?;
        let mut answer = [0u8; 4];
        tls.read_exact(&mut answer).await?;
        assert_eq!(&answer, b"ping");
        Ok(tls)
    }

    fn presented(tls: &tokio_rustls::client::TlsStream<TcpStream>) -> Vec<u8> {
        tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
    }

    /// Echoes what each accepted connection sends, connection by connection.
    fn echo(mut listener: TlsListener) {
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.next().await;
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = stream.read(&mut buf).await {
                        if n == 0 || stream.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
    }

    #[tokio::test]
    async fn a_changed_certificate_serves_new_connections_and_a_bad_one_is_kept_out() {
        let ca = TestCa::new("test CA");
        let first = ca.server(1);
        let f = files(&ca, &first, ClientAuth::Off);
        let certificates = Certificates::load(&f.config).unwrap();
        let (port, listener) = serving(&certificates, Door::Http).await;
        assert_eq!(
            certificates.server_config(Door::Http).alpn_protocols,
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        );
        assert_eq!(
            certificates.server_config(Door::Grpc).alpn_protocols,
            vec![b"h2".to_vec()]
        );
        echo(listener);
        let mut old = connect(port, &ca, None).await.unwrap();
        assert_eq!(presented(&old), first.der);
        assert!(matches!(certificates.reload(), Reload::Unchanged));

        let second = ca.server(2);
        second.write(
            f.config.cert_file.as_deref().unwrap(),
            f.config.key_file.as_deref().unwrap(),
        );
        assert!(matches!(certificates.reload(), Reload::Reloaded));
        let new = connect(port, &ca, None).await.unwrap();
        assert_eq!(presented(&new), second.der, "new connections: the new one");
        // The connection opened before the reload still works.
        old.write_all(b"more").await.unwrap();
        let mut answer = [0u8; 4];
        old.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"more");

        // Not a certificate: refused once, the previous one stays.
        let cert_file = f.config.cert_file.clone().unwrap();
        std::fs::write(&cert_file, "not a certificate").unwrap();
        match certificates.reload() {
            Reload::Failed(e) => assert!(e.to_string().contains("no certificate"), "{e}"),
            other => panic!("{other:?}"),
        }
        assert!(
            matches!(certificates.reload(), Reload::Unchanged),
            "the same failure is reported once"
        );
        let after = connect(port, &ca, None).await.unwrap();
        assert_eq!(presented(&after), second.der);

        // A certificate with another certificate's key.
        let third = ca.server(3);
        std::fs::write(&cert_file, &third.cert_pem).unwrap();
        match certificates.reload() {
            Reload::Failed(TlsError::Rustls(_)) => {}
            other => panic!("a key that is not the certificate's: {other:?}"),
        }
        // A missing key file.
        std::fs::remove_file(f.config.key_file.as_deref().unwrap()).unwrap();
        match certificates.reload() {
            Reload::Failed(TlsError::Read { setting, .. }) => assert_eq!(setting, "key_file"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            presented(&connect(port, &ca, None).await.unwrap()),
            second.der
        );
        // Both files right again: taken.
        third.write(
            f.config.cert_file.as_deref().unwrap(),
            f.config.key_file.as_deref().unwrap(),
        );
        assert!(matches!(certificates.reload(), Reload::Reloaded));
        assert_eq!(
            presented(&connect(port, &ca, None).await.unwrap()),
            third.der
        );
        drop(f.dir);
    }

    #[tokio::test]
    async fn required_client_certificates_refuse_clients_without_one_from_the_ca() {
        let ca = TestCa::new("test CA");
        let f = files(&ca, &ca.server(1), ClientAuth::Required);
        let certificates = Certificates::load(&f.config).unwrap();
        let (port, listener) = serving(&certificates, Door::Grpc).await;
        echo(listener);
        assert!(connect(port, &ca, None).await.is_err(), "no certificate");
        let stranger = TestCa::new("another CA").client("stranger");
        assert!(
            connect(port, &ca, Some(&stranger)).await.is_err(),
            "a certificate the CA did not sign"
        );
        let client = ca.client("client");
        connect(port, &ca, Some(&client)).await.unwrap();

        // Optional: no certificate is fine, a wrong one is not.
        let f = files(&ca, &ca.server(1), ClientAuth::Optional);
        let certificates = Certificates::load(&f.config).unwrap();
        let (port, listener) = serving(&certificates, Door::Http).await;
        echo(listener);
        connect(port, &ca, None).await.unwrap();
        connect(port, &ca, Some(&client)).await.unwrap();
        assert!(connect(port, &ca, Some(&stranger)).await.is_err());
    }

    #[test]
    fn start_up_errors_name_the_file() {
        let ca = TestCa::new("test CA");
        let f = files(&ca, &ca.server(1), ClientAuth::Required);
        std::fs::write(f.config.client_ca_file.as_deref().unwrap(), "").unwrap();
        let e = Certificates::load(&f.config).unwrap_err().to_string();
        assert!(
            e.contains("client_ca_file") && e.contains("no certificate"),
            "{e}"
        );
        let mut missing = f.config.clone();
        missing.cert_file = Some(f.dir.path().join("absent.crt"));
        let e = Certificates::load(&missing).unwrap_err().to_string();
        assert!(
            e.contains("tls.cert_file") && e.contains("absent.crt"),
            "{e}"
        );
        std::fs::write(f.config.key_file.as_deref().unwrap(), "no key here").unwrap();
        let e = Certificates::load(&f.config).unwrap_err().to_string();
        assert!(e.contains("tls.key_file"), "{e}");
    }
}
