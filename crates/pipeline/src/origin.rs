//! Who acts and in which trace: the request's origin, set for the whole request by the
//! protocol's front door from its headers (or metadata) and read where records and actions are
//! made.

/// Who acts and in which trace, from the request's headers: `X-Operator-Id` (the person
/// behind an admin call or a request) and the W3C `traceparent` (its trace id, the caller's span
/// and sampled flag) with its `tracestate`. Set for the whole request by the front door and read
/// where records and actions are made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Origin {
    pub operator: Option<String>,
    pub trace_id: Option<String>,
    /// The caller's span id (16 hex), from the `traceparent`.
    pub parent_span_id: Option<String>,
    /// The `traceparent`'s sampled flag.
    pub sampled: Option<bool>,
    /// The `tracestate`, kept only with a valid `traceparent` (as the W3C spec says).
    pub tracestate: Option<String>,
    /// The end user named by the `[releases] user_header` (the release route's sticky key when
    /// the request body names no `user`).
    pub routing_user: Option<String>,
    /// The A/B group named by the `[releases] group_header`.
    pub routing_group: Option<String>,
}

tokio::task_local! {
    static ORIGIN: Origin;
}

impl Origin {
    /// With the release route's user and group headers (insane values are ignored).
    pub fn with_routing(mut self, user: Option<&str>, group: Option<&str>) -> Self {
        let sane = |v: &str| {
            let v = v.trim();
            (!v.is_empty()
                && v.len() <= 256
                && v.bytes().all(|b| b.is_ascii_graphic() || b == b' '))
            .then(|| v.to_string())
        };
        self.routing_user = user.and_then(sane);
        self.routing_group = group.and_then(sane);
        self
    }
}

/// The current request's origin (empty outside a request).
pub fn origin() -> Origin {
    ORIGIN.try_with(Clone::clone).unwrap_or_default()
}

/// Runs `f` with `origin` as the request's origin.
pub async fn with_origin<F: std::future::Future>(origin: Origin, f: F) -> F::Output {
    ORIGIN.scope(origin, f).await
}

/// A fresh W3C trace id (32 hex, never all zeros).
pub fn new_trace_id() -> String {
    let id = uuid::Uuid::new_v4().as_u128().max(1);
    format!("{id:032x}")
}
