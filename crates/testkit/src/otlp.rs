//! A small OTLP trace receiver for tests: gRPC `TraceService/Export` and HTTP `POST /v1/traces`
//! (protobuf), both on 127.0.0.1, keeping what they receive so a test can assert on span names,
//! attributes and parent links. No collector can be installed where the tests run; this is the
//! part of one that matters to them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use prost::Message;

/// One span as the receiver got it. Ids are lowercase hex (empty parent: a root).
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub trace_state: String,
    pub name: String,
    /// OTLP's `SpanKind` number (2: server, 1: internal).
    pub kind: i32,
    pub start_unix_nano: u64,
    pub end_unix_nano: u64,
    /// Attribute values rendered as text (arrays as `[a,b]`).
    pub attributes: BTreeMap<String, String>,
    pub events: Vec<(String, BTreeMap<String, String>)>,
    /// OTLP's status code (0 unset, 1 ok, 2 error).
    pub status_code: i32,
    /// The resource's attributes (`service.name`, ...).
    pub resource: BTreeMap<String, String>,
    /// `grpc` or `http`: how it arrived.
    pub transport: &'static str,
}

impl ReceivedSpan {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

#[derive(Default)]
struct Store {
    keep: bool,
    spans: Mutex<Vec<ReceivedSpan>>,
    count: AtomicU64,
    requests: AtomicU64,
}

impl Store {
    fn take(&self, request: ExportTraceServiceRequest, transport: &'static str) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let mut n = 0;
        let mut kept = Vec::new();
        for rs in request.resource_spans {
            let resource = rs
                .resource
                .map(|r| attributes(&r.attributes))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    n += 1;
                    if !self.keep {
                        continue;
                    }
                    kept.push(ReceivedSpan {
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        trace_state: s.trace_state,
                        name: s.name,
                        kind: s.kind,
                        start_unix_nano: s.start_time_unix_nano,
                        end_unix_nano: s.end_time_unix_nano,
                        attributes: attributes(&s.attributes),
                        events: s
                            .events
                            .into_iter()
                            .map(|e| (e.name, attributes(&e.attributes)))
                            .collect(),
                        status_code: s.status.map_or(0, |st| st.code),
                        resource: resource.clone(),
                        transport,
                    });
                }
            }
        }
        self.count.fetch_add(n, Ordering::Relaxed);
        if self.keep {
            self.spans
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(kept);
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), render(kv.value.as_ref())))
        .collect()
}

fn render(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::ArrayValue(a)) => format!(
            "[{}]",
            a.values
                .iter()
                .map(|v| render(Some(v)))
                .collect::<Vec<_>>()
                .join(",")
        ),
        Some(Value::BytesValue(b)) => hex(b),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

struct Grpc(Arc<Store>);

#[tonic::async_trait]
impl TraceService for Grpc {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.take(request.into_inner(), "grpc");
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A running receiver. Its tasks end with the runtime that started it.
#[derive(Clone)]
pub struct Receiver {
    store: Arc<Store>,
    /// The gRPC endpoint (`http://127.0.0.1:PORT`).
    pub grpc_endpoint: String,
    /// The HTTP endpoint, path included (`http://127.0.0.1:PORT/v1/traces`).
    pub http_endpoint: String,
}

impl Receiver {
    /// Starts both listeners on free ports, keeping every span.
    pub async fn start() -> std::io::Result<Receiver> {
        Self::start_on(("127.0.0.1", 0), ("127.0.0.1", 0), true).await
    }

    /// Starts on the given addresses; `keep: false` only counts (a benchmark's receiver).
    pub async fn start_on(
        grpc: impl tokio::net::ToSocketAddrs,
        http: impl tokio::net::ToSocketAddrs,
        keep: bool,
    ) -> std::io::Result<Receiver> {
        let store = Arc::new(Store {
            keep,
            ..Store::default()
        });
        let grpc_listener = tokio::net::TcpListener::bind(grpc).await?;
        let http_listener = tokio::net::TcpListener::bind(http).await?;
        let grpc_addr: SocketAddr = grpc_listener.local_addr()?;
        let http_addr: SocketAddr = http_listener.local_addr()?;
        let service = TraceServiceServer::new(Grpc(Arc::clone(&store)));
        tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(grpc_listener);
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
        });
        let http_store = Arc::clone(&store);
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let store = Arc::clone(&http_store);
                async move {
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(request) => {
                            store.take(request, "http");
                            let reply = ExportTraceServiceResponse {
                                partial_success: None,
                            };
                            (
                                axum::http::StatusCode::OK,
                                [("content-type", "application/x-protobuf")],
                                reply.encode_to_vec(),
                            )
                        }
                        Err(e) => (
                            axum::http::StatusCode::BAD_REQUEST,
                            [("content-type", "text/plain")],
                            e.to_string().into_bytes(),
                        ),
                    }
                }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(http_listener, app).await;
        });
        Ok(Receiver {
            store,
            grpc_endpoint: format!("http://{grpc_addr}"),
            http_endpoint: format!("http://{http_addr}/v1/traces"),
        })
    }

    /// Every span received so far (empty when only counting).
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.store
            .spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Spans received so far (counted even when not kept).
    pub fn span_count(&self) -> u64 {
        self.store.count.load(Ordering::Relaxed)
    }

    /// Export requests received so far.
    pub fn request_count(&self) -> u64 {
        self.store.requests.load(Ordering::Relaxed)
    }

    /// The spans of `trace_id` once `done` holds for them, or what there is after `timeout`.
    pub async fn wait_for_trace(
        &self,
        trace_id: &str,
        timeout: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans: Vec<ReceivedSpan> = self
                .spans()
                .into_iter()
                .filter(|s| s.trace_id == trace_id)
                .collect();
            if done(&spans) || Instant::now() >= deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Why received spans are not one tree (see [`check_tree`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TreeError {
    #[error("two spans share an id")]
    DuplicateId,
    #[error("the root {root:?} has parent {parent:?}, expected {expected:?}")]
    RootParent {
        root: String,
        parent: String,
        expected: String,
    },
    #[error("{count} spans have no parent in the trace: {names:?}", count = .names.len())]
    Roots { names: Vec<String> },
}

/// Checks that `spans` form one tree: exactly one span whose parent is not among them (the
/// root, whose parent must be `root_parent`: empty, or the caller's span id), and every other
/// span's parent present. Returns the root, or what is wrong.
pub fn check_tree<'a>(
    spans: &'a [ReceivedSpan],
    root_parent: &str,
) -> Result<&'a ReceivedSpan, TreeError> {
    let ids: std::collections::BTreeSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    if ids.len() != spans.len() {
        return Err(TreeError::DuplicateId);
    }
    let roots: Vec<&ReceivedSpan> = spans
        .iter()
        .filter(|s| !ids.contains(s.parent_span_id.as_str()))
        .collect();
    match roots.as_slice() {
        [root] if root.parent_span_id == root_parent => Ok(root),
        [root] => Err(TreeError::RootParent {
            root: root.name.clone(),
            parent: root.parent_span_id.clone(),
            expected: root_parent.to_string(),
        }),
        _ => Err(TreeError::Roots {
            names: roots.iter().map(|s| s.name.clone()).collect(),
        }),
    }
}

/// The names of `parent`'s children, in start order.
pub fn children<'a>(spans: &'a [ReceivedSpan], parent: &ReceivedSpan) -> Vec<&'a ReceivedSpan> {
    let mut c: Vec<&ReceivedSpan> = spans
        .iter()
        .filter(|s| s.parent_span_id == parent.span_id)
        .collect();
    c.sort_by_key(|s| s.start_unix_nano);
    c
}
