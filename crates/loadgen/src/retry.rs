//! When a failed request is sent again and after how long, decided as the official OpenAI clients
//! decide it (openai-python's `_base_client.py`: `_should_retry`, `_parse_retry_after_header`,
//! `_calculate_retry_timeout`; openai-node's `shouldRetry` and `retryRequest` are the same):
//!
//! - retried: a response 408, 409, 429 or 5xx, unless `x-should-retry: false`, and any status
//!   with `x-should-retry: true`; a request that could not be sent or got no response in time;
//! - not retried: other statuses, and anything that goes wrong once a stream has begun;
//! - the wait: what the server asked for (`retry-after-ms`, else `Retry-After` in seconds or as an
//!   HTTP date) when that is more than 0 and at most 60 s; otherwise `min(0.5 s × 2^retries, 8 s)`
//!   times a jitter factor uniform in `(0.75, 1]`;
//! - the same request again, body and headers, with `x-stainless-retry-count` set to the retries
//!   taken so far (0 on the first attempt).
//!
//! Pure functions: the request path reads the headers, the clock and the random draw and passes
//! them in. Not here: sending and reading (the request module).

use std::time::{Duration, SystemTime};

use crate::http_date;

/// `max_retries` of the official clients when the caller does not set it.
pub const OFFICIAL_MAX_RETRIES: u32 = 2;
/// A wait the server asks for is honoured up to this long; a longer one (or none, or one not
/// above zero) gives way to the backoff.
pub const MAX_SERVER_WAIT_S: f64 = 60.0;
/// The first backoff, doubled with each retry taken.
pub const INITIAL_BACKOFF_S: f64 = 0.5;
/// The backoff stops doubling here.
pub const MAX_BACKOFF_S: f64 = 8.0;

/// The header the official clients send with the number of retries taken so far.
pub const RETRY_COUNT_HEADER: &str = "x-stainless-retry-count";

/// Whether the official clients retry a response with `status` (not 200: the stream never
/// began). `x_should_retry` is that header's value; `"true"` and `"false"` override the status.
pub fn should_retry_status(status: u16, x_should_retry: Option<&str>) -> bool {
    match x_should_retry {
        Some("true") => true,
        Some("false") => false,
        _ => matches!(status, 408 | 409 | 429) || status >= 500,
    }
}

/// The wait a response asks for, in seconds: `retry-after-ms` (milliseconds) if it is a number,
/// else `Retry-After` if it is a number of seconds, else `Retry-After` as an HTTP date minus
/// `now`. It may be negative, zero or huge: [`retry_wait`] decides whether to honour it.
pub fn server_wait_s(
    retry_after_ms: Option<&str>,
    retry_after: Option<&str>,
    now: SystemTime,
) -> Option<f64> {
    if let Some(milliseconds) = retry_after_ms.and_then(|text| text.trim().parse::<f64>().ok()) {
        return Some(milliseconds / 1000.0);
    }
    let retry_after = retry_after?;
    if let Ok(seconds) = retry_after.trim().parse::<f64>() {
        return Some(seconds);
    }
    let date = http_date::parse(retry_after)?;
    Some(match date.duration_since(now) {
        Ok(ahead) => ahead.as_secs_f64(),
        Err(behind) => -behind.duration().as_secs_f64(),
    })
}

/// How long to wait before the next attempt, when `retries_taken` retries were already sent:
/// the server's wait if it is in `(0, 60]` seconds, else the jittered exponential backoff.
/// `unit_random` is uniform in `[0, 1)`.
pub fn retry_wait(retries_taken: u32, server_wait_s: Option<f64>, unit_random: f64) -> Duration {
    if let Some(wait_s) =
        server_wait_s.filter(|&wait_s| wait_s > 0.0 && wait_s <= MAX_SERVER_WAIT_S)
    {
        return Duration::from_secs_f64(wait_s);
    }
    // The exponent is capped as openai-python caps it: beyond 1,000 retries 2^n overflows.
    let exponent = retries_taken.min(1000) as i32;
    let backoff_s = (INITIAL_BACKOFF_S * 2f64.powi(exponent)).min(MAX_BACKOFF_S);
    let jitter = 1.0 - 0.25 * unit_random;
    Duration::try_from_secs_f64(backoff_s * jitter).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::time::UNIX_EPOCH;

    const NOW_S: u64 = 1_445_412_480; // Wed, 21 Oct 2015 07:28:00 GMT

    fn now() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(NOW_S)
    }

    fn seconds(duration: Duration) -> f64 {
        duration.as_secs_f64()
    }

    #[test]
    fn retried_statuses_are_the_official_clients() {
        for status in [408, 409, 429, 500, 502, 503, 504, 599] {
            assert!(should_retry_status(status, None), "{status}");
        }
        for status in [400, 401, 403, 404, 410, 413, 422, 201, 302] {
            assert!(!should_retry_status(status, None), "{status}");
        }
        assert!(!should_retry_status(429, Some("false")));
        assert!(!should_retry_status(503, Some("false")));
        assert!(should_retry_status(400, Some("true")));
        // Only the exact words override.
        assert!(should_retry_status(429, Some("no")));
        assert!(!should_retry_status(400, Some("True")));
    }

    #[test]
    fn retry_after_ms_comes_first_then_seconds_then_a_date() {
        let wait = |ms, s| server_wait_s(ms, s, now());
        assert_eq!(wait(Some("50"), Some("3")), Some(0.05));
        assert_eq!(wait(Some(" 1500.5 "), None), Some(1.5005));
        assert_eq!(wait(Some("soon"), Some("3")), Some(3.0));
        assert_eq!(wait(None, Some("2.5")), Some(2.5));
        assert_eq!(
            wait(None, Some("Wed, 21 Oct 2015 07:28:30 GMT")),
            Some(30.0)
        );
        assert_eq!(
            wait(None, Some("Wed, 21 Oct 2015 07:27:50 GMT")),
            Some(-10.0)
        );
        assert_eq!(wait(None, Some("later")), None);
        assert_eq!(wait(None, None), None);
        assert_eq!(wait(Some("x"), None), None);
    }

    #[test]
    fn a_reasonable_server_wait_is_honoured_exactly() {
        assert_eq!(retry_wait(0, Some(0.05), 0.9), Duration::from_millis(50));
        assert_eq!(retry_wait(7, Some(60.0), 0.0), Duration::from_secs(60));
        assert_eq!(
            retry_wait(3, Some(12.5), 0.5),
            Duration::from_millis(12_500)
        );
    }

    #[test]
    fn waits_over_60_s_or_not_above_0_fall_back_to_the_backoff() {
        // Retry-After: 120 is more than the clients honour: the first retry waits 0.5 s,
        // jittered down by up to a quarter.
        let retry_after_120 = server_wait_s(None, Some("120"), now());
        assert_eq!(retry_after_120, Some(120.0));
        assert_eq!(
            retry_wait(0, retry_after_120, 0.0),
            Duration::from_millis(500)
        );
        assert_eq!(
            retry_wait(0, retry_after_120, 0.5),
            Duration::from_millis(437) + Duration::from_micros(500)
        );
        for server_wait in [
            Some(120.0),
            Some(60.001),
            Some(0.0),
            Some(-3.0),
            Some(f64::NAN),
            Some(f64::INFINITY),
            None,
        ] {
            let wait = seconds(retry_wait(2, server_wait, 0.999_999));
            assert!((1.5..=2.0).contains(&wait), "{server_wait:?}: {wait}");
        }
    }

    #[test]
    fn backoff_doubles_to_8_s_and_jitter_takes_off_at_most_a_quarter() {
        let expected_s = [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0];
        for (retries_taken, &full_s) in expected_s.iter().enumerate() {
            let retries_taken = retries_taken as u32;
            assert_eq!(seconds(retry_wait(retries_taken, None, 0.0)), full_s);
            let shortest = seconds(retry_wait(retries_taken, None, 1.0 - f64::EPSILON));
            assert!(
                shortest > 0.75 * full_s - 1e-9 && shortest < full_s,
                "{retries_taken}: {shortest}"
            );
        }
        assert_eq!(seconds(retry_wait(u32::MAX, None, 0.0)), MAX_BACKOFF_S);
        let mut rng = crate::workload::SplitMix64::new(17);
        for retries_taken in 0..40 {
            let wait = seconds(retry_wait(retries_taken, None, rng.unit_f64()));
            assert!((0.375..=8.0).contains(&wait), "{retries_taken}: {wait}");
        }
    }
}
