//! A small S3 client for shipping sealed audit files into a bucket with Object Lock (WORM).
//!
//! It speaks just the calls the audit log needs (create a lock-enabled bucket, put with a retention
//! and a legal hold, get, head, list, read and extend a retention, delete) over `reqwest`, signs
//! every request with AWS Signature Version 4 itself, and parses the few XML answers with a tiny
//! tag reader. It is not a general S3 SDK: no multipart upload, no presigned URLs, no credential
//! chain (keys come from configuration), no streaming bodies (an audit file is held in memory).
//!
//! Integrity: every PUT carries `x-amz-checksum-sha256` (S3 recomputes it and refuses a body that
//! does not match) and the signed `x-amz-content-sha256`, so a body corrupted on the way is refused.
//! Real S3 also requires a checksum on any PUT with Object Lock headers.
//!
//! Retries: every call here is idempotent in effect (a repeated PUT adds an identical version, a
//! repeated DELETE of a version finds it gone), so every call retries transport errors and 5xx
//! answers (including 503 SlowDown) with exponential backoff; a 4xx answer is final, in particular
//! an Object Lock refusal. Each retry counts in `rampart_audit_s3_retries_total` (a counter, no
//! labels) and logs a warning.

use std::fmt;
use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use bytes::Bytes;
use hmac::{KeyInit, Mac};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, StatusCode, Url};
use sha2::{Digest, Sha256};
use tracing::Instrument as _;

type HmacSha256 = hmac::Hmac<Sha256>;

/// The hex SHA-256 of an empty body, the payload hash of every request without one.
const EMPTY_SHA256_HEX: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
/// The S3 XML namespace of request bodies.
const S3_XMLNS: &str = "http://s3.amazonaws.com/doc/2006-03-01/";
/// How many times an idempotent call is tried before its error is returned.
const RETRY_ATTEMPTS: u32 = 3;
/// The wait before the first retry; it doubles before each further one.
const RETRY_BASE_DELAY_MS: u64 = 200;
/// How long a TCP (and TLS) connection may take to open.
const CONNECT_TIMEOUT_MS: u64 = 10_000;
/// How long a response may stall between two reads before the request fails as a transport error.
const READ_TIMEOUT_MS: u64 = 60_000;
/// Keys per ListObjectsV2 page; S3's own maximum.
const DEFAULT_LIST_PAGE_SIZE: u32 = 1000;
/// S3's limit on the length of an object key, in bytes.
const MAX_KEY_BYTES: usize = 1024;
/// How much of a non-XML error body is kept in an error message.
const MAX_ERROR_BODY_CHARS: usize = 300;

/// Where the bucket is and who we are to it.
#[derive(Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct S3Config {
    /// The S3 service root, `http(s)://host[:port]`, e.g. `http://127.0.0.1:8333` or
    /// `https://s3.eu-west-1.amazonaws.com`. No path.
    pub endpoint: String,
    /// The bucket audit files go to.
    pub bucket: String,
    /// The region requests are signed for (`us-east-1` unless the bucket lives elsewhere).
    pub region: String,
    pub access_key: String,
    pub secret_key: String,
    /// Path-style addressing (`endpoint/bucket/key`), as SeaweedFS, MinIO and most S3-compatible
    /// stores want; `false` for virtual-hosted style (`bucket.endpoint/key`).
    pub path_style: bool,
}

impl Default for S3Config {
    fn default() -> Self {
        S3Config {
            endpoint: String::new(),
            bucket: String::new(),
            region: "us-east-1".to_string(),
            access_key: String::new(),
            secret_key: String::new(),
            path_style: true,
        }
    }
}

/// The secret key stays out of logs.
impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("access_key", &self.access_key)
            .field("secret_key", &"<redacted>")
            .field("path_style", &self.path_style)
            .finish()
    }
}

/// The two Object Lock retention modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockMode {
    /// Nobody, the root account included, can delete the version or shorten its retention.
    Compliance,
    /// Users with `s3:BypassGovernanceRetention` can; everyone else is refused.
    Governance,
}

impl LockMode {
    pub fn as_str(self) -> &'static str {
        match self {
            LockMode::Compliance => "COMPLIANCE",
            LockMode::Governance => "GOVERNANCE",
        }
    }

    /// Reads the wire spelling, `COMPLIANCE` or `GOVERNANCE` (any case).
    pub fn parse(text: &str) -> Result<Self, S3Error> {
        match text.trim().to_ascii_uppercase().as_str() {
            "COMPLIANCE" => Ok(LockMode::Compliance),
            "GOVERNANCE" => Ok(LockMode::Governance),
            _ => Err(S3Error::Invalid(format!(
                "unknown Object Lock mode `{text}` (expected COMPLIANCE or GOVERNANCE)"
            ))),
        }
    }
}

impl fmt::Display for LockMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The lock a new object version is written with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectLock {
    pub mode: LockMode,
    /// Sent rounded up to the next whole second, so the version is kept at least this long.
    pub retain_until: SystemTime,
    pub legal_hold: bool,
}

/// An object version's retention, as read or written with `?retention`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    pub mode: LockMode,
    pub retain_until: SystemTime,
}

/// What S3 said about a stored object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutOutcome {
    /// `None` when the bucket is not versioned (a lock-enabled bucket always is).
    pub version_id: Option<String>,
    /// As S3 sends it, quotes included.
    pub etag: Option<String>,
}

/// An object version's metadata from HEAD.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    pub len: u64,
    pub version_id: Option<String>,
    /// Base64 SHA-256 of the body, when it was uploaded with one.
    pub checksum_sha256: Option<String>,
    pub lock_mode: Option<LockMode>,
    pub retain_until: Option<SystemTime>,
    pub legal_hold: Option<bool>,
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListPage {
    /// In S3's order (UTF-8 binary).
    pub keys: Vec<String>,
    /// `None` on the last page.
    pub next_continuation_token: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum S3Error {
    /// S3 answered with an error status. `code` is the `<Code>` of the XML error body
    /// (`AccessDenied`, `InvalidRequest`, `NoSuchKey`, `ObjectLocked`, …), or the status's reason
    /// phrase without spaces (`NotFound`) when there is no body, as for HEAD.
    #[error("S3 answered HTTP {status} {code}: {message}")]
    Http {
        status: u16,
        code: String,
        message: String,
    },
    /// No answer: the connection failed, timed out or broke mid-response.
    #[error("S3 could not be reached: {0}")]
    Transport(String),
    /// A bad argument or configuration, or an answer this client cannot read.
    #[error("S3: {0}")]
    Invalid(String),
}

impl S3Error {
    /// The HTTP status, for an answer.
    pub fn status(&self) -> Option<u16> {
        match self {
            S3Error::Http { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The S3 error code, for an answer.
    pub fn code(&self) -> Option<&str> {
        match self {
            S3Error::Http { code, .. } => Some(code),
            _ => None,
        }
    }

    /// Prefixes an `Invalid` message with where it happened; other errors already say.
    fn context(self, context: &str) -> Self {
        match self {
            S3Error::Invalid(message) => S3Error::Invalid(format!("{context}: {message}")),
            other => other,
        }
    }

    /// Whether trying the same request again may succeed: a transport failure or a 5xx answer
    /// (500 InternalError, 503 SlowDown, …). A 4xx is the server's final word.
    pub fn is_retryable(&self) -> bool {
        match self {
            S3Error::Transport(_) => true,
            S3Error::Http { status, .. } => *status >= 500,
            S3Error::Invalid(_) => false,
        }
    }
}

/// Splits `s3://bucket/some/prefix` into `("bucket", "some/prefix")`; the prefix may be empty.
pub fn parse_s3_url(url: &str) -> Result<(String, String), S3Error> {
    let rest = url.strip_prefix("s3://").ok_or_else(|| {
        S3Error::Invalid(format!(
            "`{url}` is not an S3 URL (expected s3://bucket/prefix)"
        ))
    })?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    check_bucket_name(bucket).map_err(|why| S3Error::Invalid(format!("`{url}`: {why}")))?;
    Ok((bucket.to_string(), prefix.to_string()))
}

/// The S3 client for one bucket. Cheap to clone (the connection pool is shared).
#[derive(Clone)]
pub struct S3Client {
    http: reqwest::Client,
    bucket: String,
    region: String,
    access_key: String,
    secret_key: String,
    path_style: bool,
    /// `http` or `https`.
    scheme: String,
    /// `host` or `host:port` as the Host header carries it (no port when it is the default one).
    authority: String,
    /// The endpoint as configured, for messages.
    endpoint: String,
    list_page_size: u32,
    retry: RetryPolicy,
}

impl fmt::Debug for S3Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// One request before signing: the same value is signed afresh on each retry.
struct S3Request<'a> {
    method: Method,
    /// `None` addresses the bucket itself.
    key: Option<&'a str>,
    /// Unencoded name/value pairs; a sub-resource such as `retention` has an empty value.
    query: Vec<(&'static str, String)>,
    /// Extra headers, lowercase names.
    headers: Vec<(&'static str, String)>,
    body: Bytes,
    /// Hex SHA-256 of `body`.
    payload_sha256_hex: String,
}

impl<'a> S3Request<'a> {
    fn new(method: Method, key: Option<&'a str>) -> Self {
        S3Request {
            method,
            key,
            query: Vec::new(),
            headers: Vec::new(),
            body: Bytes::new(),
            payload_sha256_hex: EMPTY_SHA256_HEX.to_string(),
        }
    }

    fn query(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.query.push((name, value.into()));
        self
    }

    fn version(self, version_id: Option<&str>) -> Self {
        match version_id {
            Some(version_id) => self.query("versionId", version_id),
            None => self,
        }
    }

    fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    fn body(self, body: Bytes) -> Self {
        let sha256_hex = hex::encode(Sha256::digest(&body));
        self.body_with_sha256(body, sha256_hex)
    }

    /// For a caller that already hashed the body (large uploads are hashed once).
    fn body_with_sha256(mut self, body: Bytes, sha256_hex: String) -> Self {
        self.payload_sha256_hex = sha256_hex;
        self.body = body;
        self
    }
}

impl S3Client {
    pub fn new(config: S3Config) -> Result<Self, S3Error> {
        let endpoint = config.endpoint.trim_end_matches('/').to_string();
        let url = Url::parse(&endpoint).map_err(|err| {
            S3Error::Invalid(format!("endpoint `{endpoint}` is not a URL: {err}"))
        })?;
        if url.scheme() != "http" && url.scheme() != "https" {
            return Err(S3Error::Invalid(format!(
                "endpoint `{endpoint}` must start with http:// or https://"
            )));
        }
        let host = url
            .host_str()
            .ok_or_else(|| S3Error::Invalid(format!("endpoint `{endpoint}` has no host")))?;
        if url.path() != "/" || url.query().is_some() || url.fragment().is_some() {
            return Err(S3Error::Invalid(format!(
                "endpoint `{endpoint}` must be just scheme://host[:port], without a path or query"
            )));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(S3Error::Invalid(format!(
                "endpoint `{endpoint}` must not carry credentials; set access_key and secret_key"
            )));
        }
        check_bucket_name(&config.bucket).map_err(|e| S3Error::Invalid(e.to_string()))?;
        if !config.path_style && config.bucket.contains('.') && url.scheme() == "https" {
            return Err(S3Error::Invalid(format!(
                "bucket `{}` has a dot, which breaks TLS with virtual-hosted addressing; set path_style",
                config.bucket
            )));
        }
        if config.region.trim().is_empty() {
            return Err(S3Error::Invalid(
                "region is empty (S3's default is us-east-1)".into(),
            ));
        }
        if config.access_key.is_empty() || config.secret_key.is_empty() {
            return Err(S3Error::Invalid(format!(
                "access_key and secret_key must both be set for s3://{}",
                config.bucket
            )));
        }
        let authority = match url.port() {
            Some(port) => format!("{host}:{port}"),
            None => host.to_string(),
        };
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .read_timeout(Duration::from_millis(READ_TIMEOUT_MS))
            .build()
            .map_err(|err| {
                S3Error::Invalid(format!(
                    "cannot build the HTTP client: {}",
                    error_chain(&err)
                ))
            })?;
        Ok(S3Client {
            http,
            scheme: url.scheme().to_string(),
            authority,
            endpoint,
            bucket: config.bucket,
            region: config.region.trim().to_string(),
            access_key: config.access_key,
            secret_key: config.secret_key,
            path_style: config.path_style,
            list_page_size: DEFAULT_LIST_PAGE_SIZE,
            retry: RetryPolicy::DEFAULT,
        })
    }

    /// Keys per ListObjectsV2 page (1..=1000); small pages let tests walk continuation tokens.
    pub fn with_list_page_size(mut self, keys_per_page: u32) -> Self {
        self.list_page_size = keys_per_page.clamp(1, DEFAULT_LIST_PAGE_SIZE);
        self
    }

    /// `s3://bucket at endpoint`, for logs.
    pub fn describe(&self) -> String {
        format!("s3://{} at {}", self.bucket, self.endpoint)
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// Creates the bucket, with Object Lock enabled when asked (which also turns on versioning;
    /// S3 cannot enable it later on a bucket made without). A bucket we already own is fine.
    pub async fn create_bucket(&self, object_lock: bool) -> Result<(), S3Error> {
        let mut request = S3Request::new(Method::PUT, None);
        if object_lock {
            request = request.header("x-amz-bucket-object-lock-enabled", "true");
        }
        // us-east-1 is the one region S3 wants no location constraint for.
        if self.region != "us-east-1" {
            let body = format!(
                "<CreateBucketConfiguration xmlns=\"{S3_XMLNS}\"><LocationConstraint>{}</LocationConstraint></CreateBucketConfiguration>",
                xml_escape(&self.region)
            );
            request = request.body(Bytes::from(body));
        }
        match self.with_retries(|| self.send(&request)).await {
            Ok(_) => Ok(()),
            Err(S3Error::Http { code, .. }) if code == "BucketAlreadyOwnedByYou" => Ok(()),
            Err(err) => Err(err),
        }
    }

    /// Whether the bucket has Object Lock enabled (GET `?object-lock`). A bucket made without it
    /// answers 404 ObjectLockConfigurationNotFoundError, which is `false` here.
    pub async fn bucket_object_lock_enabled(&self) -> Result<bool, S3Error> {
        let request = S3Request::new(Method::GET, None).query("object-lock", "");
        let body = match self.with_retries(|| self.send_read_text(&request)).await {
            Ok(body) => body,
            Err(S3Error::Http { code, .. }) if code == "ObjectLockConfigurationNotFoundError" => {
                return Ok(false)
            }
            Err(err) => return Err(err),
        };
        Ok(xml_text(&body, "ObjectLockEnabled").as_deref() == Some("Enabled"))
    }

    /// Stores `body` at `key` as a new version, locked when `lock` is given. Sends the body's
    /// SHA-256 both as the signed payload hash and as `x-amz-checksum-sha256`, which S3 checks.
    ///
    /// Retried on transport errors and 5xx: if an attempt was stored but its answer lost, the retry
    /// stores a second identical version, which is harmless for write-once audit files.
    pub async fn put_object(
        &self,
        key: &str,
        body: Vec<u8>,
        lock: Option<&ObjectLock>,
    ) -> Result<PutOutcome, S3Error> {
        check_key(key)?;
        let body = Bytes::from(body);
        let digest = Sha256::digest(&body);
        let checksum = base64::engine::general_purpose::STANDARD.encode(digest);
        let mut request = S3Request::new(Method::PUT, Some(key))
            .header("x-amz-checksum-sha256", checksum.clone())
            .body_with_sha256(body, hex::encode(digest));
        if let Some(lock) = lock {
            request = request
                .header("x-amz-object-lock-mode", lock.mode.as_str())
                .header(
                    "x-amz-object-lock-retain-until-date",
                    format_rfc3339(ceil_to_second(lock.retain_until)),
                )
                .header(
                    "x-amz-object-lock-legal-hold",
                    if lock.legal_hold { "ON" } else { "OFF" },
                );
        }
        let headers = self
            .with_retries(|| async {
                let response = self.send(&request).await?;
                Ok(response.headers().clone())
            })
            .await?;
        if let Some(stored) = header_text(&headers, "x-amz-checksum-sha256") {
            if stored != checksum {
                return Err(S3Error::Invalid(format!(
                    "PUT {}: S3 reports checksum {stored} for the stored body, but we sent {checksum}",
                    self.location(key)
                )));
            }
        }
        Ok(PutOutcome {
            version_id: header_text(&headers, "x-amz-version-id"),
            etag: header_text(&headers, "etag"),
        })
    }

    /// The current version's body.
    pub async fn get_object(&self, key: &str) -> Result<Vec<u8>, S3Error> {
        self.get_object_version(key, None).await
    }

    /// A given version's body (the current one for `None`).
    pub async fn get_object_version(
        &self,
        key: &str,
        version_id: Option<&str>,
    ) -> Result<Vec<u8>, S3Error> {
        check_key(key)?;
        let request = S3Request::new(Method::GET, Some(key)).version(version_id);
        self.with_retries(|| async {
            let response = self.send(&request).await?;
            let what = self.what(&request);
            let body = response.bytes().await.map_err(|err| {
                S3Error::Transport(format!("{what}: the body broke off: {}", error_chain(&err)))
            })?;
            Ok(Vec::from(body))
        })
        .await
    }

    /// The current version's body, handed to `sink` a chunk at a time as it arrives (a model
    /// file need not fit in memory); the total length on success. The request is retried as
    /// usual; a body that breaks off midway is a transport error, and the caller starts over
    /// (the sink has seen part of it).
    pub async fn get_object_into(
        &self,
        key: &str,
        sink: &mut (dyn FnMut(&[u8]) -> std::io::Result<()> + Send),
    ) -> Result<u64, S3Error> {
        check_key(key)?;
        let request = S3Request::new(Method::GET, Some(key));
        let mut response = self.with_retries(|| self.send(&request)).await?;
        let what = self.what(&request);
        let mut total = 0u64;
        loop {
            let chunk = response.chunk().await.map_err(|err| {
                S3Error::Transport(format!("{what}: the body broke off: {}", error_chain(&err)))
            })?;
            let Some(chunk) = chunk else {
                return Ok(total);
            };
            sink(&chunk).map_err(|err| S3Error::Invalid(format!("{what}: writing it: {err}")))?;
            total += chunk.len() as u64;
        }
    }

    /// The current version's metadata, `None` when there is no such key (or its current version is
    /// a delete marker).
    pub async fn head_object(&self, key: &str) -> Result<Option<ObjectMeta>, S3Error> {
        self.head_object_version(key, None).await
    }

    /// A given version's metadata (the current one for `None`), `None` when absent. HEAD answers
    /// carry no error body, so a missing bucket reads as a missing key here.
    pub async fn head_object_version(
        &self,
        key: &str,
        version_id: Option<&str>,
    ) -> Result<Option<ObjectMeta>, S3Error> {
        check_key(key)?;
        let request = S3Request::new(Method::HEAD, Some(key))
            .version(version_id)
            .header("x-amz-checksum-mode", "ENABLED");
        let headers = match self
            .with_retries(|| async { Ok(self.send(&request).await?.headers().clone()) })
            .await
        {
            Ok(headers) => headers,
            Err(S3Error::Http { status: 404, .. }) => return Ok(None),
            Err(err) => return Err(err),
        };
        let what = self.what(&request);
        let len = header_text(&headers, "content-length")
            .and_then(|text| text.parse::<u64>().ok())
            .ok_or_else(|| {
                S3Error::Invalid(format!("{what}: the answer has no valid Content-Length"))
            })?;
        let lock_mode = header_text(&headers, "x-amz-object-lock-mode")
            .map(|text| LockMode::parse(&text))
            .transpose()
            .map_err(|err| err.context(&what))?;
        let retain_until = header_text(&headers, "x-amz-object-lock-retain-until-date")
            .map(|text| parse_rfc3339(&text))
            .transpose()
            .map_err(|err| err.context(&format!("{what}: retain-until date")))?;
        let legal_hold = match header_text(&headers, "x-amz-object-lock-legal-hold").as_deref() {
            None => None,
            Some("ON") => Some(true),
            Some("OFF") => Some(false),
            Some(other) => {
                return Err(S3Error::Invalid(format!(
                    "{what}: legal hold `{other}` is neither ON nor OFF"
                )))
            }
        };
        Ok(Some(ObjectMeta {
            len,
            version_id: header_text(&headers, "x-amz-version-id"),
            checksum_sha256: header_text(&headers, "x-amz-checksum-sha256"),
            lock_mode,
            retain_until,
            legal_hold,
        }))
    }

    /// Every key under `prefix` (ListObjectsV2, all pages), sorted.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, S3Error> {
        let mut keys = Vec::new();
        let mut continuation: Option<String> = None;
        loop {
            let page = self.list_page(prefix, continuation.as_deref()).await?;
            keys.extend(page.keys);
            match page.next_continuation_token {
                None => break,
                Some(token) if continuation.as_deref() == Some(token.as_str()) => {
                    return Err(S3Error::Invalid(format!(
                        "listing {} under `{prefix}`: S3 returned the same continuation token twice",
                        self.describe()
                    )))
                }
                Some(token) => continuation = Some(token),
            }
        }
        keys.sort();
        keys.dedup();
        Ok(keys)
    }

    /// One ListObjectsV2 page of at most the list page size keys under `prefix`, starting where
    /// `continuation_token` (from the previous page) says.
    pub async fn list_page(
        &self,
        prefix: &str,
        continuation_token: Option<&str>,
    ) -> Result<ListPage, S3Error> {
        let mut request = S3Request::new(Method::GET, None)
            .query("list-type", "2")
            .query("prefix", prefix)
            .query("max-keys", self.list_page_size.to_string());
        if let Some(token) = continuation_token {
            request = request.query("continuation-token", token);
        }
        let page = self.with_retries(|| self.send_read_text(&request)).await?;
        let keys = xml_elements(&page, "Contents")
            .iter()
            .filter_map(|contents| xml_text(contents, "Key"))
            .collect();
        if xml_text(&page, "IsTruncated").as_deref() != Some("true") {
            return Ok(ListPage {
                keys,
                next_continuation_token: None,
            });
        }
        match xml_text(&page, "NextContinuationToken").filter(|token| !token.is_empty()) {
            Some(token) => Ok(ListPage {
                keys,
                next_continuation_token: Some(token),
            }),
            None => Err(S3Error::Invalid(format!(
                "{}: a truncated page without a continuation token",
                self.what(&request)
            ))),
        }
    }

    /// A version's retention (the current version for `None`); `None` when it has none.
    pub async fn get_retention(
        &self,
        key: &str,
        version_id: Option<&str>,
    ) -> Result<Option<Retention>, S3Error> {
        check_key(key)?;
        let request = S3Request::new(Method::GET, Some(key))
            .query("retention", "")
            .version(version_id);
        let body = match self.with_retries(|| self.send_read_text(&request)).await {
            Ok(body) => body,
            // AWS answers NoSuchObjectLockConfiguration for a version without retention;
            // SeaweedFS answers ObjectLockConfigurationNotFoundError (AWS's code for a bucket
            // without Object Lock, where no version has a retention either).
            Err(S3Error::Http { code, .. })
                if code == "NoSuchObjectLockConfiguration"
                    || code == "ObjectLockConfigurationNotFoundError" =>
            {
                return Ok(None)
            }
            Err(err) => return Err(err),
        };
        let what = self.what(&request);
        let (Some(mode), Some(date)) =
            (xml_text(&body, "Mode"), xml_text(&body, "RetainUntilDate"))
        else {
            return Ok(None);
        };
        Ok(Some(Retention {
            mode: LockMode::parse(&mode).map_err(|err| err.context(&what))?,
            retain_until: parse_rfc3339(&date)
                .map_err(|err| err.context(&format!("{what}: RetainUntilDate")))?,
        }))
    }

    /// Sets a version's retention (the current version for `None`). S3 lets anyone extend a
    /// retention; shortening it, or changing COMPLIANCE to GOVERNANCE, is refused (GOVERNANCE can
    /// be bypassed with a permission this client never asks for).
    pub async fn put_retention(
        &self,
        key: &str,
        version_id: Option<&str>,
        retention: &Retention,
    ) -> Result<(), S3Error> {
        check_key(key)?;
        let body = format!(
            "<Retention xmlns=\"{S3_XMLNS}\"><Mode>{}</Mode><RetainUntilDate>{}</RetainUntilDate></Retention>",
            retention.mode.as_str(),
            format_rfc3339(ceil_to_second(retention.retain_until))
        );
        let checksum = base64::engine::general_purpose::STANDARD.encode(Sha256::digest(&body));
        let request = S3Request::new(Method::PUT, Some(key))
            .query("retention", "")
            .version(version_id)
            .header("x-amz-checksum-sha256", checksum)
            .body(Bytes::from(body));
        self.with_retries(|| self.send(&request)).await.map(drop)
    }

    /// Deletes a version; without `version_id` it only adds a delete marker (the data stays, and
    /// Object Lock allows it). Deleting a locked version is refused by S3.
    pub async fn delete_object(&self, key: &str, version_id: Option<&str>) -> Result<(), S3Error> {
        check_key(key)?;
        let request = S3Request::new(Method::DELETE, Some(key)).version(version_id);
        self.with_retries(|| self.send(&request)).await.map(drop)
    }

    /// Tries `attempt` until it succeeds, fails for good (4xx, bad input), or has been tried
    /// `RETRY_ATTEMPTS` times, waiting `RETRY_BASE_DELAY_MS`, then twice that, between tries.
    async fn with_retries<T, F, Fut>(&self, attempt: F) -> Result<T, S3Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, S3Error>>,
    {
        with_retries(self.retry, attempt).await
    }

    /// Sends and reads the body as text (listings, retention and error documents are small).
    async fn send_read_text(&self, request: &S3Request<'_>) -> Result<String, S3Error> {
        let response = self.send(request).await?;
        response.text().await.map_err(|err| {
            S3Error::Transport(format!(
                "{}: the answer broke off: {}",
                self.what(request),
                error_chain(&err)
            ))
        })
    }

    /// Signs and sends one request; a non-2xx answer becomes `S3Error::Http`.
    async fn send(&self, request: &S3Request<'_>) -> Result<reqwest::Response, S3Error> {
        let (url, canonical_uri, host) = self.address(request.key);
        let canonical_query = canonical_query_string(&request.query);
        let url = if canonical_query.is_empty() {
            url
        } else {
            format!("{url}?{canonical_query}")
        };
        let amz_date = format_amz_date(SystemTime::now());
        let mut headers: Vec<(String, String)> = vec![
            ("host".to_string(), host),
            (
                "x-amz-content-sha256".to_string(),
                request.payload_sha256_hex.clone(),
            ),
            ("x-amz-date".to_string(), amz_date.clone()),
        ];
        headers.extend(
            request
                .headers
                .iter()
                .map(|(name, value)| (name.to_string(), value.clone())),
        );
        let authorization = authorization_header(&SigningInput {
            method: request.method.as_str(),
            canonical_uri: &canonical_uri,
            canonical_query: &canonical_query,
            headers: &headers,
            payload_sha256_hex: &request.payload_sha256_hex,
            amz_date: &amz_date,
            region: &self.region,
            access_key: &self.access_key,
            secret_key: &self.secret_key,
        });
        let mut header_map = HeaderMap::new();
        for (name, value) in headers
            .iter()
            .chain([&("authorization".to_string(), authorization)])
        {
            let name = HeaderName::from_bytes(name.as_bytes()).map_err(|err| {
                S3Error::Invalid(format!("header name `{name}` is not valid: {err}"))
            })?;
            let value = HeaderValue::from_str(value).map_err(|err| {
                S3Error::Invalid(format!("header {name} value `{value}` is not valid: {err}"))
            })?;
            header_map.insert(name, value);
        }
        let mut builder = self
            .http
            .request(request.method.clone(), &url)
            .headers(header_map);
        if request.method == Method::PUT || request.method == Method::POST {
            builder = builder.body(request.body.clone());
        }
        let what = self.what(request);
        let span =
            tracing::debug_span!("s3_request", method = %request.method, bucket = %self.bucket);
        let response = builder
            .send()
            .instrument(span.clone())
            .await
            .map_err(|err| {
                S3Error::Transport(format!(
                    "{what} at {}: {}",
                    self.endpoint,
                    error_chain(&err)
                ))
            })?;
        let status = response.status();
        tracing::debug!(parent: &span, status = status.as_u16(), "{what}");
        if status.is_success() {
            return Ok(response);
        }
        Err(error_from_answer(
            status,
            response.text().await.unwrap_or_default(),
            &what,
        ))
    }

    /// The URL without query, the canonical URI and the Host header of a key (or the bucket).
    fn address(&self, key: Option<&str>) -> (String, String, String) {
        let key_path = key.map(|key| uri_encode(key, true));
        let (host, path) = if self.path_style {
            let bucket = uri_encode(&self.bucket, false);
            let path = match &key_path {
                Some(key) => format!("/{bucket}/{key}"),
                None => format!("/{bucket}"),
            };
            (self.authority.clone(), path)
        } else {
            let path = match &key_path {
                Some(key) => format!("/{key}"),
                None => "/".to_string(),
            };
            (format!("{}.{}", self.bucket, self.authority), path)
        };
        (format!("{}://{host}{path}", self.scheme), path, host)
    }

    /// `s3://bucket/key`, for messages.
    fn location(&self, key: &str) -> String {
        format!("s3://{}/{key}", self.bucket)
    }

    /// `GET s3://bucket/key?versionId=…`, for messages.
    fn what(&self, request: &S3Request<'_>) -> String {
        let mut what = format!(
            "{} {}",
            request.method,
            match request.key {
                Some(key) => self.location(key),
                None => format!("s3://{}", self.bucket),
            }
        );
        let query: Vec<String> = request
            .query
            .iter()
            .map(|(name, value)| {
                if value.is_empty() {
                    name.to_string()
                } else {
                    format!("{name}={value}")
                }
            })
            .collect();
        if !query.is_empty() {
            what.push('?');
            what.push_str(&query.join("&"));
        }
        what
    }
}

/// How often and how patiently idempotent calls are retried.
#[derive(Debug, Clone, Copy)]
struct RetryPolicy {
    attempts: u32,
    base_delay: Duration,
}

impl RetryPolicy {
    const DEFAULT: RetryPolicy = RetryPolicy {
        attempts: RETRY_ATTEMPTS,
        base_delay: Duration::from_millis(RETRY_BASE_DELAY_MS),
    };
}

async fn with_retries<T, F, Fut>(policy: RetryPolicy, mut attempt: F) -> Result<T, S3Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, S3Error>>,
{
    let mut delay = policy.base_delay;
    let mut tried = 1;
    loop {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(err) if err.is_retryable() && tried < policy.attempts => {
                tracing::warn!(
                    attempt = tried,
                    retry_in_ms = delay.as_millis() as u64,
                    "S3 request failed, retrying: {err}"
                );
                metrics::counter!("rampart_audit_s3_retries_total").increment(1);
                tokio::time::sleep(delay).await;
                delay *= 2;
                tried += 1;
            }
            Err(err) if err.is_retryable() => {
                return Err(match err {
                    S3Error::Transport(message) => {
                        S3Error::Transport(format!("{message} (gave up after {tried} tries)"))
                    }
                    S3Error::Http {
                        status,
                        code,
                        message,
                    } => S3Error::Http {
                        status,
                        code,
                        message: format!("{message} (gave up after {tried} tries)"),
                    },
                    other => other,
                })
            }
            Err(err) => return Err(err),
        }
    }
}

/// Turns an error answer into `S3Error::Http`, taking Code and Message from the XML body.
fn error_from_answer(status: StatusCode, body: String, what: &str) -> S3Error {
    let code = xml_text(&body, "Code").unwrap_or_else(|| {
        status
            .canonical_reason()
            .map(|reason| reason.replace([' ', '-'], ""))
            .unwrap_or_else(|| format!("Http{}", status.as_u16()))
    });
    let detail = match xml_text(&body, "Message") {
        Some(message) => message,
        None if body.trim().is_empty() => "no error body".to_string(),
        None => body.trim().chars().take(MAX_ERROR_BODY_CHARS).collect(),
    };
    S3Error::Http {
        status: status.as_u16(),
        code,
        message: format!("{what}: {detail}"),
    }
}

/// An error and its sources, `outer: inner: innermost` (reqwest's Display alone hides the cause).
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

fn header_text(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|value| value.to_str().ok())
        .map(|value| value.trim().to_string())
}

/// A bucket name S3 would refuse.
#[derive(Debug, thiserror::Error)]
#[error(
    "`{bucket}` is not a valid bucket name (3 to 63 lowercase letters, digits, dots and \
     hyphens, starting and ending with a letter or digit)"
)]
struct InvalidBucketName {
    bucket: String,
}

/// S3's bucket naming rules (the ones that matter for addressing).
fn check_bucket_name(bucket: &str) -> Result<(), InvalidBucketName> {
    let valid_chars = bucket
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
    let edges_alnum = bucket
        .bytes()
        .next()
        .zip(bucket.bytes().last())
        .is_some_and(|(first, last)| first.is_ascii_alphanumeric() && last.is_ascii_alphanumeric());
    if (3..=63).contains(&bucket.len()) && valid_chars && edges_alnum && !bucket.contains("..") {
        Ok(())
    } else {
        Err(InvalidBucketName {
            bucket: bucket.to_string(),
        })
    }
}

/// Refuses keys S3 would refuse and keys whose `.`/`..` segments URL normalisation would rewrite
/// into another key.
fn check_key(key: &str) -> Result<(), S3Error> {
    if key.is_empty() {
        return Err(S3Error::Invalid("object key is empty".into()));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(S3Error::Invalid(format!(
            "object key is {} bytes, over S3's limit of {MAX_KEY_BYTES}",
            key.len()
        )));
    }
    if key
        .split('/')
        .any(|segment| segment == "." || segment == "..")
    {
        return Err(S3Error::Invalid(format!(
            "object key `{key}` has a `.` or `..` path segment, which HTTP clients rewrite"
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// AWS Signature Version 4 (header signing, service `s3`).

/// Everything a signature covers.
struct SigningInput<'a> {
    method: &'a str,
    /// The URI-encoded path, exactly as sent.
    canonical_uri: &'a str,
    /// From `canonical_query_string`, exactly as sent.
    canonical_query: &'a str,
    /// Every header sent and signed (names in any case); must include `host` and `x-amz-date`.
    headers: &'a [(String, String)],
    payload_sha256_hex: &'a str,
    /// `YYYYMMDDTHHMMSSZ`.
    amz_date: &'a str,
    region: &'a str,
    access_key: &'a str,
    secret_key: &'a str,
}

/// Lowercase, trimmed, inner runs of spaces collapsed, sorted by name.
fn canonical_headers(headers: &[(String, String)]) -> Vec<(String, String)> {
    let mut canonical: Vec<(String, String)> = headers
        .iter()
        .map(|(name, value)| {
            (
                name.to_ascii_lowercase(),
                value.split_whitespace().collect::<Vec<_>>().join(" "),
            )
        })
        .collect();
    canonical.sort();
    canonical
}

fn canonical_request(input: &SigningInput<'_>) -> (String, String) {
    let headers = canonical_headers(input.headers);
    let signed_headers = headers
        .iter()
        .map(|(name, _)| name.as_str())
        .collect::<Vec<_>>()
        .join(";");
    let mut request = format!(
        "{}\n{}\n{}\n",
        input.method, input.canonical_uri, input.canonical_query
    );
    for (name, value) in &headers {
        request.push_str(name);
        request.push(':');
        request.push_str(value);
        request.push('\n');
    }
    request.push('\n');
    request.push_str(&signed_headers);
    request.push('\n');
    request.push_str(input.payload_sha256_hex);
    (request, signed_headers)
}

fn credential_scope(amz_date: &str, region: &str) -> String {
    format!(
        "{}/{region}/s3/aws4_request",
        &amz_date[..8.min(amz_date.len())]
    )
}

fn string_to_sign(amz_date: &str, scope: &str, canonical_request: &str) -> String {
    format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
        hex::encode(Sha256::digest(canonical_request.as_bytes()))
    )
}

fn hmac_sha256(key: &[u8], data: &[u8]) -> [u8; 32] {
    // HMAC accepts a key of any length, so this cannot fail.
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC-SHA256 takes keys of any length");
    mac.update(data);
    mac.finalize().into_bytes().into()
}

fn signature(secret_key: &str, amz_date: &str, region: &str, string_to_sign: &str) -> String {
    let date = &amz_date[..8.min(amz_date.len())];
    let date_key = hmac_sha256(format!("AWS4{secret_key}").as_bytes(), date.as_bytes());
    let region_key = hmac_sha256(&date_key, region.as_bytes());
    let service_key = hmac_sha256(&region_key, b"s3");
    let signing_key = hmac_sha256(&service_key, b"aws4_request");
    hex::encode(hmac_sha256(&signing_key, string_to_sign.as_bytes()))
}

fn authorization_header(input: &SigningInput<'_>) -> String {
    let (request, signed_headers) = canonical_request(input);
    let scope = credential_scope(input.amz_date, input.region);
    let to_sign = string_to_sign(input.amz_date, &scope, &request);
    format!(
        "AWS4-HMAC-SHA256 Credential={}/{scope},SignedHeaders={signed_headers},Signature={}",
        input.access_key,
        signature(input.secret_key, input.amz_date, input.region, &to_sign)
    )
}

/// Percent-encodes all but RFC 3986's unreserved characters (`A-Z a-z 0-9 - . _ ~`), uppercase
/// hex, as SigV4 wants; `/` is kept when encoding an object key's path.
fn uri_encode(text: &str, keep_slash: bool) -> String {
    let mut encoded = String::with_capacity(text.len());
    for byte in text.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                encoded.push(byte as char)
            }
            b'/' if keep_slash => encoded.push('/'),
            _ => encoded.push_str(&format!("%{byte:02X}")),
        }
    }
    encoded
}

/// `name=value` pairs, each side URI-encoded, sorted by name then value, joined by `&`; used both
/// as the sent query and in the canonical request, so the two cannot differ.
fn canonical_query_string(query: &[(&str, String)]) -> String {
    let mut pairs: Vec<(String, String)> = query
        .iter()
        .map(|(name, value)| (uri_encode(name, false), uri_encode(value, false)))
        .collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect::<Vec<_>>()
        .join("&")
}

// ---------------------------------------------------------------------------------------------
// Dates: SigV4's ISO 8601 basic format and RFC 3339 for Object Lock dates, both UTC.

/// Whole seconds since the Unix epoch (floor), negative before it.
fn unix_seconds(time: SystemTime) -> i64 {
    match time.duration_since(UNIX_EPOCH) {
        Ok(after) => after.as_secs() as i64,
        Err(before) => {
            let before = before.duration();
            -(before.as_secs() as i64) - i64::from(before.subsec_nanos() > 0)
        }
    }
}

fn from_unix_seconds(seconds: i64, nanos: u32) -> SystemTime {
    let whole = if seconds >= 0 {
        UNIX_EPOCH + Duration::from_secs(seconds as u64)
    } else {
        UNIX_EPOCH - Duration::from_secs(seconds.unsigned_abs())
    };
    whole + Duration::from_nanos(u64::from(nanos))
}

/// Rounds up to a whole second, so a retention sent in whole seconds is never shorter than asked.
fn ceil_to_second(time: SystemTime) -> SystemTime {
    let seconds = unix_seconds(time);
    let floor = from_unix_seconds(seconds, 0);
    if floor == time {
        time
    } else {
        from_unix_seconds(seconds + 1, 0)
    }
}

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01 (Howard Hinnant's
/// civil_from_days, proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The inverse of `civil_from_days`.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = year - i64::from(month <= 2);
    let era = year.div_euclid(400);
    let year_of_era = year.rem_euclid(400);
    let month = i64::from(month);
    let day_of_year =
        (153 * (if month > 2 { month - 3 } else { month + 9 }) + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// (year, month, day, hour, minute, second) in UTC.
fn civil_time(time: SystemTime) -> (i64, u32, u32, u32, u32, u32) {
    let seconds = unix_seconds(time);
    let (year, month, day) = civil_from_days(seconds.div_euclid(86_400));
    let second_of_day = seconds.rem_euclid(86_400) as u32;
    (
        year,
        month,
        day,
        second_of_day / 3600,
        second_of_day / 60 % 60,
        second_of_day % 60,
    )
}

/// `20261201T120000Z`: SigV4's `x-amz-date` (sub-seconds dropped).
pub fn format_amz_date(time: SystemTime) -> String {
    let (year, month, day, hour, minute, second) = civil_time(time);
    format!("{year:04}{month:02}{day:02}T{hour:02}{minute:02}{second:02}Z")
}

/// `2033-12-01T12:00:00Z`: RFC 3339 in UTC, whole seconds (sub-seconds dropped).
pub fn format_rfc3339(time: SystemTime) -> String {
    let (year, month, day, hour, minute, second) = civil_time(time);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}Z")
}

/// Reads an RFC 3339 date-time: `2033-12-01T12:00:00Z`, with optional fraction
/// (`…:00.123Z`) and numeric offset (`…:00+01:00`).
pub fn parse_rfc3339(text: &str) -> Result<SystemTime, S3Error> {
    let invalid = |why: &str| {
        S3Error::Invalid(format!(
            "`{text}` is not an RFC 3339 date-time like 2033-12-01T12:00:00Z: {why}"
        ))
    };
    let bytes = text.trim().as_bytes();
    let digits = |range: std::ops::Range<usize>| -> Result<u32, S3Error> {
        let part = bytes.get(range).ok_or_else(|| invalid("too short"))?;
        if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
            return Err(invalid("expected digits"));
        }
        Ok(part
            .iter()
            .fold(0, |acc, digit| acc * 10 + u32::from(digit - b'0')))
    };
    let separator = |at: usize, expected: &[u8]| -> Result<(), S3Error> {
        match bytes.get(at) {
            Some(found) if expected.contains(found) => Ok(()),
            _ => Err(invalid("misplaced separator")),
        }
    };
    let year = digits(0..4)?;
    separator(4, b"-")?;
    let month = digits(5..7)?;
    separator(7, b"-")?;
    let day = digits(8..10)?;
    separator(10, b"Tt ")?;
    let hour = digits(11..13)?;
    separator(13, b":")?;
    let minute = digits(14..16)?;
    separator(16, b":")?;
    let second = digits(17..19)?;
    let mut at = 19;
    let mut nanos: u32 = 0;
    if bytes.get(at) == Some(&b'.') {
        let start = at + 1;
        let mut end = start;
        while bytes.get(end).is_some_and(u8::is_ascii_digit) {
            end += 1;
        }
        if end == start {
            return Err(invalid("empty fraction of a second"));
        }
        for (place, digit) in bytes[start..end].iter().take(9).enumerate() {
            nanos += u32::from(digit - b'0') * 10u32.pow(8 - place as u32);
        }
        at = end;
    }
    let offset_seconds: i64 = match bytes.get(at) {
        Some(b'Z' | b'z') if at + 1 == bytes.len() => 0,
        Some(sign @ (b'+' | b'-')) if at + 6 == bytes.len() => {
            let hours = digits(at + 1..at + 3)?;
            separator(at + 3, b":")?;
            let minutes = digits(at + 4..at + 6)?;
            if hours > 23 || minutes > 59 {
                return Err(invalid("offset out of range"));
            }
            let offset = i64::from(hours * 3600 + minutes * 60);
            if *sign == b'-' {
                -offset
            } else {
                offset
            }
        }
        _ => return Err(invalid("expected Z or a +hh:mm offset at the end")),
    };
    let days_in_month = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        _ => return Err(invalid("month out of range")),
    };
    if day == 0 || day > days_in_month {
        return Err(invalid("day out of range"));
    }
    // 60 allows a leap second; it reads as the first second of the next minute.
    if hour > 23 || minute > 59 || second > 60 {
        return Err(invalid("time of day out of range"));
    }
    let seconds = days_from_civil(i64::from(year), month, day) * 86_400
        + i64::from(hour * 3600 + minute * 60 + second)
        - offset_seconds;
    Ok(from_unix_seconds(seconds, nanos))
}

// ---------------------------------------------------------------------------------------------
// A tiny XML reader: S3's answers here are flat, small and machine-written, so finding an element by
// name is enough. It ignores namespaces and attributes and does not handle CDATA.

/// The inner text of every `<name>` element (not nested in one another), unescaped.
fn xml_elements(xml: &str, name: &str) -> Vec<String> {
    let open = format!("<{name}");
    let close = format!("</{name}>");
    let mut found = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find(&open) {
        let after_name = &rest[start + open.len()..];
        // `<Key>` must not match `<KeyCount>`.
        let Some(tag_end) = after_name.find('>') else {
            break;
        };
        let attributes = &after_name[..tag_end];
        if !(attributes.is_empty()
            || attributes.starts_with(char::is_whitespace)
            || attributes == "/")
        {
            rest = after_name;
            continue;
        }
        if attributes.ends_with('/') {
            found.push(String::new());
            rest = &after_name[tag_end + 1..];
            continue;
        }
        let body = &after_name[tag_end + 1..];
        let Some(end) = body.find(&close) else {
            break;
        };
        found.push(body[..end].to_string());
        rest = &body[end + close.len()..];
    }
    found
}

/// The unescaped text of the first `<name>` element.
fn xml_text(xml: &str, name: &str) -> Option<String> {
    xml_elements(xml, name)
        .into_iter()
        .next()
        .map(|inner| xml_unescape(inner.trim()))
}

fn xml_unescape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        let after = &rest[amp + 1..];
        let Some(semi) = after.find(';').filter(|&semi| semi <= 10) else {
            out.push('&');
            rest = after;
            continue;
        };
        let entity = &after[..semi];
        let decoded = match entity {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            _ => entity
                .strip_prefix("#x")
                .or_else(|| entity.strip_prefix("#X"))
                .map(|hex| u32::from_str_radix(hex, 16))
                .or_else(|| entity.strip_prefix('#').map(str::parse::<u32>))
                .and_then(Result::ok)
                .and_then(char::from_u32),
        };
        match decoded {
            Some(ch) => {
                out.push(ch);
                rest = &after[semi + 1..];
            }
            None => {
                out.push('&');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

fn xml_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    const EXAMPLE_ACCESS_KEY: &str = "AKIAIOSFODNN7EXAMPLE";
    const EXAMPLE_SECRET_KEY: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    const EXAMPLE_HOST: &str = "examplebucket.s3.amazonaws.com";

    fn example_headers(extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut headers = vec![
            ("Host".to_string(), EXAMPLE_HOST.to_string()),
            (
                "x-amz-content-sha256".to_string(),
                EMPTY_SHA256_HEX.to_string(),
            ),
            ("x-amz-date".to_string(), "20130524T000000Z".to_string()),
        ];
        headers.extend(extra.iter().map(|(n, v)| (n.to_string(), v.to_string())));
        headers
    }

    /// The "GET Object" example of AWS's "Signature Calculations for the Authorization Header"
    /// page: its canonical request hash and signature.
    #[test]
    fn sigv4_matches_the_aws_get_object_example() {
        let headers = example_headers(&[("Range", "bytes=0-9")]);
        let input = SigningInput {
            method: "GET",
            canonical_uri: &format!("/{}", uri_encode("test.txt", true)),
            canonical_query: "",
            headers: &headers,
            payload_sha256_hex: EMPTY_SHA256_HEX,
            amz_date: "20130524T000000Z",
            region: "us-east-1",
            access_key: EXAMPLE_ACCESS_KEY,
            secret_key: EXAMPLE_SECRET_KEY,
        };
        let (request, signed_headers) = canonical_request(&input);
        assert_eq!(signed_headers, "host;range;x-amz-content-sha256;x-amz-date");
        let scope = credential_scope(input.amz_date, input.region);
        assert_eq!(scope, "20130524/us-east-1/s3/aws4_request");
        let to_sign = string_to_sign(input.amz_date, &scope, &request);
        assert!(
            to_sign.ends_with("7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972")
        );
        assert_eq!(
            authorization_header(&input),
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,\
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,\
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
    }

    /// The "GET Bucket (List Objects)" example of the same page: a sorted, encoded query string.
    #[test]
    fn sigv4_matches_the_aws_list_objects_example() {
        let headers = example_headers(&[]);
        let query =
            canonical_query_string(&[("prefix", "J".to_string()), ("max-keys", "2".to_string())]);
        assert_eq!(query, "max-keys=2&prefix=J");
        let input = SigningInput {
            method: "GET",
            canonical_uri: "/",
            canonical_query: &query,
            headers: &headers,
            payload_sha256_hex: EMPTY_SHA256_HEX,
            amz_date: "20130524T000000Z",
            region: "us-east-1",
            access_key: EXAMPLE_ACCESS_KEY,
            secret_key: EXAMPLE_SECRET_KEY,
        };
        assert!(authorization_header(&input).ends_with(
            "Signature=34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"
        ));
    }

    #[test]
    fn canonical_headers_are_lowercase_trimmed_and_sorted() {
        let headers = vec![
            ("X-Amz-Meta-B".to_string(), "  two   words ".to_string()),
            ("host".to_string(), "h".to_string()),
            ("X-Amz-Date".to_string(), "d".to_string()),
        ];
        assert_eq!(
            canonical_headers(&headers),
            vec![
                ("host".to_string(), "h".to_string()),
                ("x-amz-date".to_string(), "d".to_string()),
                ("x-amz-meta-b".to_string(), "two words".to_string()),
            ]
        );
    }

    #[test]
    fn uri_encoding_keeps_only_unreserved_characters() {
        assert_eq!(
            uri_encode("a b/ü~x_y-z.txt", true),
            "a%20b/%C3%BC~x_y-z.txt"
        );
        assert_eq!(uri_encode("a/b+c=d&e*", false), "a%2Fb%2Bc%3Dd%26e%2A");
        assert_eq!(
            canonical_query_string(&[
                ("prefix", "logs/2026 12".to_string()),
                ("list-type", "2".to_string()),
                ("continuation-token", "a+b/c=".to_string()),
                ("retention", String::new()),
            ]),
            "continuation-token=a%2Bb%2Fc%3D&list-type=2&prefix=logs%2F2026%2012&retention="
        );
    }

    fn test_client(path_style: bool) -> S3Client {
        S3Client::new(S3Config {
            endpoint: "http://127.0.0.1:8333/".into(),
            bucket: "audit-logs".into(),
            access_key: "k".into(),
            secret_key: "s".into(),
            path_style,
            ..S3Config::default()
        })
        .expect("a valid test configuration")
    }

    #[test]
    fn addresses_are_path_style_or_virtual_hosted() {
        let client = test_client(true);
        assert_eq!(
            client.address(Some("a b/c.parquet")),
            (
                "http://127.0.0.1:8333/audit-logs/a%20b/c.parquet".to_string(),
                "/audit-logs/a%20b/c.parquet".to_string(),
                "127.0.0.1:8333".to_string()
            )
        );
        assert_eq!(client.address(None).1, "/audit-logs");
        assert_eq!(
            client.describe(),
            "s3://audit-logs at http://127.0.0.1:8333"
        );
        let client = test_client(false);
        assert_eq!(
            client.address(Some("k")),
            (
                "http://audit-logs.127.0.0.1:8333/k".to_string(),
                "/k".to_string(),
                "audit-logs.127.0.0.1:8333".to_string()
            )
        );
        let https = S3Client::new(S3Config {
            endpoint: "https://s3.eu-west-1.amazonaws.com".into(),
            bucket: "b12".into(),
            region: "eu-west-1".into(),
            access_key: "k".into(),
            secret_key: "s".into(),
            path_style: false,
        })
        .expect("a valid configuration");
        assert_eq!(https.address(None).2, "b12.s3.eu-west-1.amazonaws.com");
    }

    #[test]
    fn bad_configuration_is_refused_with_a_reason() {
        let base = S3Config {
            endpoint: "http://127.0.0.1:8333".into(),
            bucket: "audit".into(),
            access_key: "k".into(),
            secret_key: "s".into(),
            ..S3Config::default()
        };
        let refused = |config: S3Config| {
            S3Client::new(config)
                .expect_err("must be refused")
                .to_string()
        };
        assert!(refused(S3Config {
            endpoint: "ftp://x".into(),
            ..base.clone()
        })
        .contains("http://"));
        assert!(refused(S3Config {
            endpoint: "http://h/p".into(),
            ..base.clone()
        })
        .contains("path"));
        assert!(refused(S3Config {
            bucket: "Audit".into(),
            ..base.clone()
        })
        .contains("bucket name"));
        assert!(refused(S3Config {
            secret_key: String::new(),
            ..base.clone()
        })
        .contains("secret_key"));
        assert!(
            !format!("{base:?}").contains("\"s\""),
            "Debug must not show the secret key"
        );
        assert!(S3Client::new(base).is_ok());
    }

    #[test]
    fn keys_that_urls_would_rewrite_are_refused() {
        assert!(check_key("a/./b").is_err());
        assert!(check_key("../b").is_err());
        assert!(check_key("").is_err());
        assert!(check_key(&"k".repeat(MAX_KEY_BYTES + 1)).is_err());
        assert!(check_key("a/.hidden/..x").is_ok());
    }

    #[test]
    fn s3_urls_split_into_bucket_and_prefix() {
        assert_eq!(
            parse_s3_url("s3://audit-logs/rampart/prod").expect("valid"),
            ("audit-logs".to_string(), "rampart/prod".to_string())
        );
        assert_eq!(
            parse_s3_url("s3://audit-logs").expect("valid"),
            ("audit-logs".to_string(), String::new())
        );
        assert_eq!(parse_s3_url("s3://audit-logs/").expect("valid").1, "");
        assert!(parse_s3_url("https://audit-logs/x").is_err());
        assert!(parse_s3_url("s3:///x").is_err());
        assert!(parse_s3_url("s3://UPPER/x").is_err());
    }

    fn at(seconds: i64) -> SystemTime {
        from_unix_seconds(seconds, 0)
    }

    #[test]
    fn dates_format_as_aws_writes_them() {
        assert_eq!(format_amz_date(at(1_369_353_600)), "20130524T000000Z");
        assert_eq!(format_rfc3339(at(0)), "1970-01-01T00:00:00Z");
        assert_eq!(format_rfc3339(at(951_782_400)), "2000-02-29T00:00:00Z");
        assert_eq!(format_rfc3339(at(2_017_051_200)), "2033-12-01T12:00:00Z");
        assert_eq!(format_rfc3339(at(-1)), "1969-12-31T23:59:59Z");
        assert_eq!(
            format_rfc3339(at(1_796_126_400) + Duration::from_millis(999)),
            "2026-12-01T12:00:00Z"
        );
    }

    #[test]
    fn rfc3339_parses_fractions_and_offsets() {
        let noon = at(2_017_051_200);
        assert_eq!(parse_rfc3339("2033-12-01T12:00:00Z").expect("valid"), noon);
        assert_eq!(
            parse_rfc3339("2033-12-01T13:00:00.250+01:00").expect("valid"),
            noon + Duration::from_millis(250)
        );
        assert_eq!(
            parse_rfc3339("2033-12-01T11:30:00-00:30").expect("valid"),
            noon
        );
        assert_eq!(
            parse_rfc3339("2033-12-01T12:00:00.000Z").expect("valid"),
            noon
        );
        for bad in [
            "2033-13-01T00:00:00Z",
            "2033-02-29T00:00:00Z",
            "2033-12-01T24:00:00Z",
            "2033-12-01T12:00:00",
            "2033-12-01T12:00:00.Z",
            "2033-12-01 12:00Z",
            "20331201T120000Z",
            "",
        ] {
            assert!(parse_rfc3339(bad).is_err(), "{bad} must be refused");
        }
        assert!(parse_rfc3339("2032-02-29T00:00:00Z").is_ok());
    }

    /// Property-style: formatting then parsing gives back the same second, over a wide spread of
    /// instants (a fixed pseudo-random walk, so failures reproduce).
    #[test]
    fn rfc3339_and_civil_days_round_trip() {
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..20_000 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            // Years 1970..=9999.
            let seconds = (state >> 16) as i64 % 253_402_300_800;
            let time = at(seconds);
            assert_eq!(
                parse_rfc3339(&format_rfc3339(time)).expect("own output parses"),
                time
            );
            let days = seconds / 86_400;
            let (year, month, day) = civil_from_days(days);
            assert_eq!(days_from_civil(year, month, day), days);
        }
        for days in -800_000..800_000 {
            let (year, month, day) = civil_from_days(days);
            assert_eq!(days_from_civil(year, month, day), days);
        }
    }

    #[test]
    fn retention_dates_round_up_to_a_whole_second() {
        assert_eq!(ceil_to_second(at(10) + Duration::from_nanos(1)), at(11));
        assert_eq!(ceil_to_second(at(10)), at(10));
        assert_eq!(unix_seconds(at(-5) + Duration::from_millis(500)), -5);
        assert_eq!(unix_seconds(UNIX_EPOCH - Duration::from_millis(500)), -1);
    }

    #[test]
    fn xml_reader_finds_elements_and_unescapes() {
        let page = "<?xml version=\"1.0\"?><ListBucketResult xmlns=\"x\"><KeyCount>2</KeyCount>\
            <Contents><Key>a&amp;b&lt;c&#x41;&#66;</Key><Size>1</Size></Contents>\
            <Contents><Key>d &gt; e</Key></Contents><IsTruncated>true</IsTruncated>\
            <NextContinuationToken>tok/+=</NextContinuationToken><Empty/></ListBucketResult>";
        let keys: Vec<String> = xml_elements(page, "Contents")
            .iter()
            .filter_map(|contents| xml_text(contents, "Key"))
            .collect();
        assert_eq!(keys, ["a&b<cAB", "d > e"]);
        assert_eq!(xml_text(page, "KeyCount").as_deref(), Some("2"));
        assert_eq!(
            xml_text(page, "NextContinuationToken").as_deref(),
            Some("tok/+=")
        );
        assert_eq!(xml_text(page, "Empty").as_deref(), Some(""));
        assert_eq!(xml_text(page, "Missing"), None);
        assert_eq!(xml_unescape("a & b &bogus; &#xZZ;"), "a & b &bogus; &#xZZ;");
        assert_eq!(xml_escape("<a&'\">"), "&lt;a&amp;&apos;&quot;&gt;");
    }

    #[test]
    fn error_answers_carry_code_message_and_request() {
        let body =
            "<Error><Code>ObjectLocked</Code><Message>Object is WORM protected</Message></Error>";
        let err = error_from_answer(StatusCode::FORBIDDEN, body.into(), "DELETE s3://b/k");
        assert_eq!(err.code(), Some("ObjectLocked"));
        assert_eq!(err.status(), Some(403));
        assert_eq!(
            err.to_string(),
            "S3 answered HTTP 403 ObjectLocked: DELETE s3://b/k: Object is WORM protected"
        );
        let head = error_from_answer(StatusCode::NOT_FOUND, String::new(), "HEAD s3://b/k");
        assert_eq!(head.code(), Some("NotFound"));
        assert!(!head.is_retryable());
        assert!(
            error_from_answer(StatusCode::SERVICE_UNAVAILABLE, String::new(), "x").is_retryable()
        );
    }

    const FAST: RetryPolicy = RetryPolicy {
        attempts: 3,
        base_delay: Duration::from_millis(1),
    };

    fn http(status: u16) -> S3Error {
        S3Error::Http {
            status,
            code: "X".into(),
            message: "m".into(),
        }
    }

    #[tokio::test]
    async fn retries_transport_errors_and_5xx_but_never_4xx() {
        let calls = AtomicU32::new(0);
        let outcome = with_retries(FAST, || async {
            match calls.fetch_add(1, Ordering::SeqCst) {
                0 => Err(S3Error::Transport("reset".into())),
                1 => Err(http(503)),
                _ => Ok(7),
            }
        })
        .await;
        assert_eq!(outcome.expect("third try succeeds"), 7);
        assert_eq!(calls.load(Ordering::SeqCst), 3);

        let calls = AtomicU32::new(0);
        let outcome: Result<(), S3Error> = with_retries(FAST, || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(http(403))
        })
        .await;
        assert_eq!(outcome.expect_err("4xx is final").status(), Some(403));
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        let calls = AtomicU32::new(0);
        let outcome: Result<(), S3Error> = with_retries(FAST, || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(http(500))
        })
        .await;
        let err = outcome.expect_err("gives up");
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        assert!(err.to_string().contains("gave up after 3 tries"), "{err}");
    }

    #[test]
    fn lock_modes_read_and_write_their_wire_names() {
        for mode in [LockMode::Compliance, LockMode::Governance] {
            assert_eq!(LockMode::parse(mode.as_str()).expect("own name"), mode);
        }
        assert_eq!(
            LockMode::parse("governance").expect("any case"),
            LockMode::Governance
        );
        assert!(LockMode::parse("LEGAL").is_err());
    }
}
