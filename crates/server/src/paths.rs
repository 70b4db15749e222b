//! Route paths.

pub const LIVE: &str = "/health/live";
pub const READY: &str = "/health/ready";
pub const METRICS: &str = "/metrics";
pub const OPENAPI: &str = "/openapi.json";
pub const MODELS: &str = "/v1/models";
pub const MODEL: &str = "/v1/models/{id}";
pub const CHAT: &str = "/v1/chat/completions";
pub const COMPLETIONS: &str = "/v1/completions";
pub const EMBEDDINGS: &str = "/v1/embeddings";
pub const TOKENIZE: &str = "/tokenize";
pub const DETOKENIZE: &str = "/detokenize";
// KServe v2 / Open Inference Protocol.
pub const V2: &str = "/v2";
pub const V2_LIVE: &str = "/v2/health/live";
pub const V2_READY: &str = "/v2/health/ready";
pub const V2_MODEL: &str = "/v2/models/{name}";
pub const V2_MODEL_READY: &str = "/v2/models/{name}/ready";
pub const V2_MODEL_INFER: &str = "/v2/models/{name}/infer";
pub const V2_VERSION: &str = "/v2/models/{name}/versions/{version}";
pub const V2_VERSION_READY: &str = "/v2/models/{name}/versions/{version}/ready";
pub const V2_VERSION_INFER: &str = "/v2/models/{name}/versions/{version}/infer";
pub const V2_REPOSITORY_INDEX: &str = "/v2/repository/index";
pub const V2_REPOSITORY_LOAD: &str = "/v2/repository/models/{name}/load";
pub const V2_REPOSITORY_UNLOAD: &str = "/v2/repository/models/{name}/unload";
// The admin API (scope `admin`).
pub const ADMIN_BACKENDS: &str = "/admin/backends";
pub const ADMIN_HANDOFF: &str = "/admin/models/{name}/handoff";
pub const ADMIN_MATURITY: &str = "/admin/models/{name}/maturity";
pub const ADMIN_FAULTS: &str = "/admin/faults";
pub const ADMIN_FAULT: &str = "/admin/faults/{id}";
pub const ADMIN_DOCTOR: &str = "/admin/doctor";
pub const ADMIN_MONITORS: &str = "/admin/monitors";
pub const ADMIN_DEGRADATION: &str = "/admin/degradation";
pub const ADMIN_RELEASES: &str = "/admin/releases";
pub const ADMIN_RELEASE: &str = "/admin/releases/{name}";
pub const ADMIN_RELEASE_ACTION: &str = "/admin/releases/{name}/{action}";
pub const ADMIN_FLEET: &str = "/admin/fleet";
pub const ADMIN_MONITOR_BASELINE: &str = "/admin/monitors/{name}/versions/{version}/baseline";
// The audit log's routes (scope `audit`).
pub const ADMIN_AUDIT: &str = "/admin/audit";
pub const ADMIN_AUDIT_ENTRY: &str = "/admin/audit/{audit_id}";
pub const ADMIN_AUDIT_PROOF: &str = "/admin/audit/{audit_id}/proof";
pub const ADMIN_AUDIT_CONSISTENCY: &str = "/admin/audit/consistency";
pub const ADMIN_AUDIT_CHECKPOINT: &str = "/admin/audit/checkpoint";
pub const ADMIN_AUDIT_STATUS: &str = "/admin/audit/status";
