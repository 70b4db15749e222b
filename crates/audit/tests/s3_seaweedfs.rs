//! The S3 client against a real SeaweedFS (`weed mini`) with Object Lock: signatures are checked
//! for real, and the WORM guarantees the audit log relies on (a locked version cannot be deleted,
//! its retention cannot be shortened, an overwrite keeps the old version) are the server's.
//!
//! Skips when `weed` is not installed, unless `RAMPART_REQUIRE_MODELS=1` (as in `scripts/test.sh`).
//!
//! Where SeaweedFS 4.48 differs from AWS S3 (seen here with this client and with curl):
//! - a version without a retention answers `GET ?retention` with 404
//!   `ObjectLockConfigurationNotFoundError` (AWS: `NoSuchObjectLockConfiguration`; AWS uses the
//!   former for a bucket without Object Lock); the client reads both as "no retention";
//! - deleting a locked version and shortening a retention answer 403 `AccessDenied` "Access
//!   Denied." (AWS: 403 `AccessDenied` too, with a message naming Object Lock);
//! - a retain-until date in the past answers 400 `InvalidRequest` (AWS: 400 `InvalidArgument`);
//! - a PUT with Object Lock headers but no checksum is accepted (AWS requires `Content-MD5` or an
//!   `x-amz-checksum-*`); the client always sends `x-amz-checksum-sha256`;
//! - `x-amz-checksum-sha256` is verified (400 `BadDigest`, with a message about Content-MD5), but the
//!   signed `x-amz-content-sha256` is not compared with the body (AWS: 400
//!   `XAmzContentSHA256Mismatch`), so on SeaweedFS the checksum header is what catches corruption;
//! - ListObjectsV2 continuation tokens are not opaque: `<last key>.versions` in a versioned bucket;
//! - HEAD also returns internal `Seaweed-X-Amz-*` headers.
//!
//! Signatures are checked as on AWS: a wrong secret gets 403 `SignatureDoesNotMatch`.

use std::time::{Duration, SystemTime};

use audit::s3::{LockMode, ObjectLock, Retention, S3Client, S3Config, S3Error};
use audit::testing_s3::SeaweedFs;
use sha2::{Digest, Sha256};

const DAY: Duration = Duration::from_secs(86_400);
const HOUR: Duration = Duration::from_secs(3_600);

fn whole_seconds(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
}

/// A retain-until date as S3 reports it equals the one asked for, rounded up to a whole second.
fn assert_same_second(reported: SystemTime, asked: SystemTime) {
    let asked = whole_seconds(asked + Duration::from_nanos(999_999_999));
    assert_eq!(whole_seconds(reported), asked, "retain-until date");
}

fn checksum_of(body: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(Sha256::digest(body))
}

/// Asserts a refusal: an HTTP 4xx answer (never a transport error or success), and returns it.
fn refused<T: std::fmt::Debug>(outcome: Result<T, S3Error>, what: &str) -> S3Error {
    let err = outcome.expect_err(what);
    match err.status() {
        Some(status) if (400..500).contains(&status) => err,
        _ => panic!("{what}: expected a 4xx refusal, got {err}"),
    }
}

/// Asserts the refusal Object Lock promises (docs/audit.md, as on AWS): 403 `AccessDenied`,
/// not merely any 4xx (a 400 for a malformed request would pass [`refused`] while the lock
/// was never consulted).
fn denied<T: std::fmt::Debug>(outcome: Result<T, S3Error>, what: &str) -> S3Error {
    let err = refused(outcome, what);
    assert_eq!(err.status(), Some(403), "{what}: {err}");
    assert_eq!(err.code(), Some("AccessDenied"), "{what}: {err}");
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_lock_is_enforced_by_a_real_s3() {
    let Some(mut weed) = SeaweedFs::start() else {
        return;
    };
    let client = S3Client::new(weed.config("audit-worm"))
        .expect("valid config")
        .with_list_page_size(1);
    client
        .create_bucket(true)
        .await
        .expect("create a lock-enabled bucket");
    client
        .create_bucket(true)
        .await
        .expect("creating a bucket we already own is fine");
    assert!(client
        .bucket_object_lock_enabled()
        .await
        .expect("read the bucket's Object Lock configuration"));

    // A COMPLIANCE-locked version, legal hold off.
    let key = "segments/2026/12/01/segment-000001.parquet";
    let first_body = b"sealed audit segment one".to_vec();
    let retain_until = SystemTime::now() + DAY;
    let lock = ObjectLock {
        mode: LockMode::Compliance,
        retain_until,
        legal_hold: false,
    };
    let first = client
        .put_object(key, first_body.clone(), Some(&lock))
        .await
        .expect("put a locked object");
    let first_version = first
        .version_id
        .clone()
        .expect("a lock-enabled bucket is versioned, so PUT returns a version id");

    let meta = client
        .head_object(key)
        .await
        .expect("head")
        .expect("the object exists");
    assert_eq!(meta.len, first_body.len() as u64);
    assert_eq!(meta.version_id.as_deref(), Some(first_version.as_str()));
    assert_eq!(meta.lock_mode, Some(LockMode::Compliance));
    assert_same_second(
        meta.retain_until.expect("HEAD reports retain-until"),
        retain_until,
    );
    assert_eq!(meta.legal_hold, Some(false));
    assert_eq!(
        meta.checksum_sha256.as_deref(),
        Some(checksum_of(&first_body).as_str()),
        "HEAD with x-amz-checksum-mode: ENABLED reports the stored SHA-256"
    );
    assert_eq!(client.get_object(key).await.expect("get"), first_body);

    let retention = client
        .get_retention(key, Some(&first_version))
        .await
        .expect("get retention")
        .expect("the version has a retention");
    assert_eq!(retention.mode, LockMode::Compliance);
    assert_same_second(retention.retain_until, retain_until);

    // WORM: the version cannot be deleted, nor its retention shortened or downgraded.
    let err = denied(
        client.delete_object(key, Some(&first_version)).await,
        "deleting a COMPLIANCE-locked version must be refused",
    );
    eprintln!("delete of a locked version: {err}");
    let err = denied(
        client
            .put_retention(
                key,
                Some(&first_version),
                &Retention {
                    mode: LockMode::Compliance,
                    retain_until: SystemTime::now() + HOUR,
                },
            )
            .await,
        "shortening a COMPLIANCE retention must be refused",
    );
    eprintln!("shortening a COMPLIANCE retention: {err}");
    denied(
        client
            .put_retention(
                key,
                Some(&first_version),
                &Retention {
                    mode: LockMode::Governance,
                    retain_until: retain_until + DAY,
                },
            )
            .await,
        "turning COMPLIANCE into GOVERNANCE must be refused",
    );
    // Extending is allowed.
    let extended = retain_until + DAY;
    client
        .put_retention(
            key,
            Some(&first_version),
            &Retention {
                mode: LockMode::Compliance,
                retain_until: extended,
            },
        )
        .await
        .expect("extending a COMPLIANCE retention is allowed");
    let retention = client
        .get_retention(key, Some(&first_version))
        .await
        .expect("get retention")
        .expect("still retained");
    assert_same_second(retention.retain_until, extended);

    // Overwriting the key makes a new version; the old one stays, readable and locked.
    let second_body = b"a different body under the same key".to_vec();
    let second = client
        .put_object(key, second_body.clone(), Some(&lock))
        .await
        .expect("overwrite");
    let second_version = second.version_id.expect("a new version id");
    assert_ne!(second_version, first_version);
    assert_eq!(
        client.get_object(key).await.expect("get current"),
        second_body
    );
    assert_eq!(
        client
            .get_object_version(key, Some(&first_version))
            .await
            .expect("the old version is still readable"),
        first_body
    );
    let old = client
        .head_object_version(key, Some(&first_version))
        .await
        .expect("head old version")
        .expect("the old version is still there");
    assert_eq!(old.len, first_body.len() as u64);
    assert_eq!(old.lock_mode, Some(LockMode::Compliance));
    denied(
        client.delete_object(key, Some(&first_version)).await,
        "the overwritten version is still locked",
    );

    // A delete without a version only adds a delete marker: the key looks gone, the data is not.
    client
        .delete_object(key, None)
        .await
        .expect("a delete marker is allowed under Object Lock");
    assert_eq!(
        client
            .head_object(key)
            .await
            .expect("head after delete marker"),
        None
    );
    assert_eq!(
        client
            .get_object_version(key, Some(&first_version))
            .await
            .expect("the locked version survives a delete marker"),
        first_body
    );

    // GOVERNANCE: without the bypass permission (which this client never asks for), shortening
    // and deleting are refused too.
    let governed = "governed/segment.parquet";
    let governed_lock = ObjectLock {
        mode: LockMode::Governance,
        retain_until: SystemTime::now() + DAY,
        legal_hold: false,
    };
    let governed_version = client
        .put_object(governed, b"governed".to_vec(), Some(&governed_lock))
        .await
        .expect("put a GOVERNANCE object")
        .version_id
        .expect("a version id");
    let meta = client
        .head_object(governed)
        .await
        .expect("head")
        .expect("exists");
    assert_eq!(meta.lock_mode, Some(LockMode::Governance));
    denied(
        client
            .put_retention(
                governed,
                Some(&governed_version),
                &Retention {
                    mode: LockMode::Governance,
                    retain_until: SystemTime::now() + HOUR,
                },
            )
            .await,
        "shortening a GOVERNANCE retention without bypass must be refused",
    );
    denied(
        client
            .delete_object(governed, Some(&governed_version))
            .await,
        "deleting a GOVERNANCE-locked version without bypass must be refused",
    );

    // A legal hold keeps a version after its retention has passed.
    let held = "held/segment.parquet";
    let held_lock = ObjectLock {
        mode: LockMode::Governance,
        retain_until: SystemTime::now() + Duration::from_secs(2),
        legal_hold: true,
    };
    let held_version = client
        .put_object(held, b"held".to_vec(), Some(&held_lock))
        .await
        .expect("put with a legal hold")
        .version_id
        .expect("a version id");
    let meta = client
        .head_object(held)
        .await
        .expect("head")
        .expect("exists");
    assert_eq!(meta.legal_hold, Some(true));
    tokio::time::sleep(Duration::from_secs(4)).await;
    denied(
        client.delete_object(held, Some(&held_version)).await,
        "a legal hold must keep the version after its retention ran out",
    );

    // An unlocked version of a lock-enabled bucket (no default retention) can be deleted.
    let loose = "loose/note.txt";
    let loose_version = client
        .put_object(loose, b"unlocked".to_vec(), None)
        .await
        .expect("put without a lock")
        .version_id
        .expect("a version id");
    assert_eq!(
        client
            .get_retention(loose, None)
            .await
            .expect("get retention of an unlocked object"),
        None
    );
    client
        .delete_object(loose, Some(&loose_version))
        .await
        .expect("an unlocked version can be deleted");
    assert_eq!(
        client
            .head_object_version(loose, Some(&loose_version))
            .await
            .expect("head of a deleted version"),
        None
    );

    // Listing a versioned bucket, one key a page: each live key once; the delete-marked key and
    // the deleted one are not listed. SeaweedFS: its continuation tokens are not opaque, they
    // read `<last key>.versions` in a versioned bucket.
    assert_eq!(
        client.list("").await.expect("list the lock-enabled bucket"),
        [governed, held]
    );

    // The locks survive a restart of the server (same data directory and ports). The client's
    // pooled connections are dead now: the first request may fail on one, and is retried.
    weed.restart();
    assert_eq!(
        client
            .get_object_version(key, Some(&first_version))
            .await
            .expect("the locked version survives a restart"),
        first_body
    );
    let retention = client
        .get_retention(key, Some(&first_version))
        .await
        .expect("get retention after a restart")
        .expect("still retained");
    assert_eq!(retention.mode, LockMode::Compliance);
    assert_same_second(retention.retain_until, extended);
    denied(
        client.delete_object(key, Some(&first_version)).await,
        "a COMPLIANCE-locked version is still locked after a restart",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_paging_key_encoding_and_signatures() {
    let Some(weed) = SeaweedFs::start() else {
        return;
    };
    let client = S3Client::new(weed.config("audit-list"))
        .expect("valid config")
        .with_list_page_size(2);
    client
        .create_bucket(false)
        .await
        .expect("create a plain bucket");
    assert!(!client
        .bucket_object_lock_enabled()
        .await
        .expect("read the Object Lock configuration of a plain bucket"));

    // Keys that exercise the canonical URI encoding: a wrong one fails the server's signature check.
    let under_prefix = [
        "p/a b+c=d&e.txt",
        "p/sub/1.parquet",
        "p/sub/2.parquet",
        "p/ü/ñ(1)!*'.json",
        "p/semi;colon,comma@at$dollar",
        "p/tilde~under_score-dash.x",
        "p/z",
    ];
    let elsewhere = ["q/1", "q/2"];
    for key in under_prefix.iter().chain(&elsewhere) {
        client
            .put_object(key, format!("body of {key}").into_bytes(), None)
            .await
            .unwrap_or_else(|err| panic!("put {key}: {err}"));
    }
    for key in &under_prefix {
        assert_eq!(
            client
                .get_object(key)
                .await
                .unwrap_or_else(|err| panic!("get {key}: {err}")),
            format!("body of {key}").into_bytes()
        );
    }

    let mut expected: Vec<String> = under_prefix.iter().map(|key| key.to_string()).collect();
    expected.sort();
    // The pages really are pages: two keys each, chained by continuation tokens.
    let first_page = client.list_page("p/", None).await.expect("first page");
    assert_eq!(first_page.keys, expected[..2]);
    let token = first_page
        .next_continuation_token
        .expect("7 keys in pages of 2: more pages follow");
    let second_page = client
        .list_page("p/", Some(&token))
        .await
        .expect("second page");
    assert_eq!(second_page.keys, expected[2..4]);
    assert!(second_page.next_continuation_token.is_some());
    assert_eq!(
        client.list("p/").await.expect("list p/ over 4 pages"),
        expected
    );
    assert_eq!(
        client.list("p/sub/").await.expect("list p/sub/"),
        ["p/sub/1.parquet", "p/sub/2.parquet"]
    );
    assert_eq!(
        client.list("").await.expect("list all").len(),
        under_prefix.len() + elsewhere.len()
    );
    assert!(client
        .list("none/")
        .await
        .expect("list an empty prefix")
        .is_empty());

    // Absent objects.
    assert_eq!(
        client
            .head_object("p/missing")
            .await
            .expect("head of a missing key"),
        None
    );
    let err = refused(client.get_object("p/missing").await, "get of a missing key");
    assert_eq!(err.status(), Some(404));
    assert_eq!(err.code(), Some("NoSuchKey"));

    // The server really checks signatures: a wrong secret is refused, and not retried.
    let forged = S3Client::new(S3Config {
        secret_key: "not-the-secret".into(),
        ..weed.config("audit-list")
    })
    .expect("valid config");
    let err = refused(
        forged.get_object("p/z").await,
        "a wrong secret key must be refused",
    );
    assert_eq!(err.status(), Some(403), "{err}");
    eprintln!("wrong secret: {err}");
    refused(
        forged.put_object("p/forged", b"x".to_vec(), None).await,
        "a PUT with a wrong secret key must be refused",
    );
    assert_eq!(client.head_object("p/forged").await.expect("head"), None);
}

/// No server: a transport failure is retried, then reported with the request and the tries.
#[tokio::test]
async fn an_unreachable_endpoint_is_a_transport_error_after_retries() {
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a probe port");
        probe.local_addr().expect("probe address").port()
    };
    let client = S3Client::new(S3Config {
        endpoint: format!("http://127.0.0.1:{port}"),
        bucket: "nowhere".into(),
        access_key: "k".into(),
        secret_key: "s".into(),
        ..S3Config::default()
    })
    .expect("valid config");
    let started = std::time::Instant::now();
    let err = client
        .get_object("k")
        .await
        .expect_err("nothing listens there");
    assert!(matches!(err, S3Error::Transport(_)), "{err}");
    let message = err.to_string();
    assert!(message.contains("GET s3://nowhere/k"), "{message}");
    assert!(message.contains("gave up after 3 tries"), "{message}");
    // Two backoff waits: 200 ms and 400 ms.
    assert!(started.elapsed() >= Duration::from_millis(600));
}
