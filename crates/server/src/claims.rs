//! Who a generation request is, for the first-token gate's bookings and weighted fair order
//! (`engine::reservations`): a stable identity per logical request and its tenant's weight.
//!
//! The identity, first found of: the `x-rampart-reservation` token a refusal handed out (a
//! client that echoes it); an `Idempotency-Key`; an `X-Request-Id`; else the input's digest
//! (the record's `input_sha256`, already computed). The official OpenAI clients resend the
//! same body (and the same headers) when they retry a 429, so an unmodified client keeps its
//! booking. Every identity is hashed with the tenant under a key drawn when the process
//! starts: a token is worthless to another tenant (the ledger keys bookings by tenant too) and
//! cannot be forged from an input.

use std::hash::{BuildHasher, Hash};
use std::sync::OnceLock;

use axum::http::HeaderMap;

/// The header a refusal's booking token travels in, both ways.
pub const RESERVATION_HEADER: &str = "x-rampart-reservation";

fn hasher() -> &'static std::collections::hash_map::RandomState {
    static KEYS: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    KEYS.get_or_init(std::collections::hash_map::RandomState::new)
}

fn hash_of(parts: impl Hash) -> u64 {
    hasher().hash_one(parts)
}

/// The claim of a request from `tenant` (weighing `weight`) with these headers and the digest
/// of its input.
pub fn claim(tenant: &str, weight: f64, headers: &HeaderMap, input_sha256: &str) -> engine::Claim {
    let tenant_id = hash_of(("tenant", tenant));
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty() && v.len() <= 256)
    };
    let identity = header(RESERVATION_HEADER)
        .and_then(pipeline::error::parse_reservation_token)
        .unwrap_or_else(|| match header("idempotency-key") {
            Some(key) => hash_of((tenant, "idempotency-key", key)),
            None => match header("x-request-id") {
                Some(id) => hash_of((tenant, "x-request-id", id)),
                None => hash_of((tenant, "input", input_sha256)),
            },
        });
    engine::Claim {
        identity,
        tenant: tenant_id,
        weight,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_retry_is_the_same_claim_and_another_tenant_or_input_is_not() {
        let input = "6f1ed002ab5595859014ebf0951522d9";
        let a = claim("acme", 3.0, &HeaderMap::new(), input);
        assert_eq!(a, claim("acme", 3.0, &HeaderMap::new(), input));
        assert_ne!(
            a.identity,
            claim("other", 1.0, &HeaderMap::new(), input).identity
        );
        assert_ne!(
            a.tenant,
            claim("other", 1.0, &HeaderMap::new(), input).tenant
        );
        assert_ne!(
            a.identity,
            claim("acme", 3.0, &HeaderMap::new(), "44136fa355b3678a").identity
        );
        // An idempotency key or request id names the request whatever the input.
        let keyed = claim("acme", 3.0, &headers(&[("idempotency-key", "k1")]), input);
        assert_eq!(
            keyed.identity,
            claim(
                "acme",
                3.0,
                &headers(&[("idempotency-key", "k1")]),
                "44136fa355b3678a"
            )
            .identity
        );
        let id = claim("acme", 3.0, &headers(&[("x-request-id", "r1")]), input);
        assert_ne!(id.identity, keyed.identity);
        // The token a refusal handed out is the identity itself; a malformed one is ignored.
        let token = pipeline::error::reservation_token(keyed.identity);
        let echoed = claim("acme", 3.0, &headers(&[(RESERVATION_HEADER, &token)]), "x");
        assert_eq!(echoed.identity, keyed.identity);
        let bad = claim("acme", 3.0, &headers(&[(RESERVATION_HEADER, "zz")]), input);
        assert_eq!(bad.identity, a.identity);
    }
}
