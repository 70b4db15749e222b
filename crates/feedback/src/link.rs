//! Signed feedback links: a per-response token an end user's client can rate with, without an
//! API key. `v1.<audit id>.<expiry, s since the epoch>.<HMAC-SHA256, base64url>`; the key is
//! the server's (every replica that shares it accepts the others' links).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{KeyInit, Mac};
use sha2::Sha256;

type HmacSha256 = hmac::Hmac<Sha256>;

/// The key feedback tokens are signed with.
#[derive(Clone)]
pub struct LinkKey([u8; 32]);

impl std::fmt::Debug for LinkKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LinkKey(…)")
    }
}

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    #[error("the feedback token is malformed")]
    Malformed,
    #[error("the feedback token's signature does not match (forged, or signed with another key)")]
    Forged,
    #[error("the feedback token expired {0} s ago")]
    Expired(u64),
}

impl LinkKey {
    pub fn new(bytes: [u8; 32]) -> Self {
        LinkKey(bytes)
    }

    /// A key from a secret of any length (the configured or environment secret).
    pub fn from_secret(secret: &[u8]) -> Self {
        use sha2::Digest;
        LinkKey(Sha256::digest(secret).into())
    }

    /// A fresh random key (128 bits of a v4 UUID twice).
    pub fn random() -> Self {
        let mut b = [0u8; 32];
        b[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        b[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        LinkKey(b)
    }

    /// Reads the key file, or makes one (mode 600) when there is none, so that links survive a
    /// restart.
    pub fn load_or_create(path: &std::path::Path) -> std::io::Result<Self> {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let bytes = hex::decode(text.trim()).map_err(|e| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("{}: not a hex key: {e}", path.display()),
                    )
                })?;
                let key: [u8; 32] = bytes.try_into().map_err(|_| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "{}: the key must be 32 bytes (64 hex digits)",
                            path.display()
                        ),
                    )
                })?;
                Ok(LinkKey(key))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = LinkKey::random();
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                let mut options = std::fs::OpenOptions::new();
                options.write(true).create_new(true);
                #[cfg(unix)]
                {
                    use std::os::unix::fs::OpenOptionsExt;
                    options.mode(0o600);
                }
                use std::io::Write;
                let mut f = options.open(path)?;
                f.write_all(hex::encode(key.0).as_bytes())?;
                f.sync_all()?;
                Ok(key)
            }
            Err(e) => Err(e),
        }
    }

    fn mac(&self, message: &str) -> [u8; 32] {
        let mut mac = <HmacSha256 as KeyInit>::new_from_slice(&self.0).expect("any key length");
        mac.update(message.as_bytes());
        mac.finalize().into_bytes().into()
    }

    /// The token for a response, valid until `expires_s` (seconds since the epoch).
    pub fn sign(&self, audit_id: &str, expires_s: u64) -> String {
        let message = format!("v1.{audit_id}.{expires_s}");
        let sig = URL_SAFE_NO_PAD.encode(self.mac(&message));
        format!("{message}.{sig}")
    }

    /// The audit id a token names, when its signature holds and it has not expired at `now_s`.
    pub fn verify(&self, token: &str, now_s: u64) -> Result<String, LinkError> {
        let token = token.trim();
        let (message, sig) = token.rsplit_once('.').ok_or(LinkError::Malformed)?;
        let mut parts = message.splitn(3, '.');
        let (Some("v1"), Some(audit_id), Some(expires)) =
            (parts.next(), parts.next(), parts.next())
        else {
            return Err(LinkError::Malformed);
        };
        let expires: u64 = expires.parse().map_err(|_| LinkError::Malformed)?;
        let sig = URL_SAFE_NO_PAD
            .decode(sig)
            .map_err(|_| LinkError::Malformed)?;
        let mut mac = <HmacSha256 as KeyInit>::new_from_slice(&self.0).expect("any key length");
        mac.update(message.as_bytes());
        // Constant time.
        mac.verify_slice(&sig).map_err(|_| LinkError::Forged)?;
        if now_s > expires {
            return Err(LinkError::Expired(now_s - expires));
        }
        if audit_id.is_empty() {
            return Err(LinkError::Malformed);
        }
        Ok(audit_id.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signed_token_verifies_until_it_expires_and_forgeries_fail() {
        let key = LinkKey::from_secret(b"secret");
        let t = key.sign("0191-abc", 1_000);
        assert_eq!(key.verify(&t, 999).unwrap(), "0191-abc");
        assert_eq!(key.verify(&t, 1_000).unwrap(), "0191-abc");
        assert_eq!(key.verify(&t, 1_060), Err(LinkError::Expired(60)));
        // Another response's id, a later expiry, another key: all forged.
        let other = t.replace("0191-abc", "0191-abd");
        assert_eq!(key.verify(&other, 0), Err(LinkError::Forged));
        let later = t.replace(".1000.", ".9999.");
        assert_eq!(key.verify(&later, 0), Err(LinkError::Forged));
        assert_eq!(
            LinkKey::from_secret(b"other").verify(&t, 0),
            Err(LinkError::Forged)
        );
        for junk in ["", "v1", "v1.a.b.c", "v2.a.1.x", "v1.a.1.!!!"] {
            assert!(key.verify(junk, 0).is_err(), "{junk}");
        }
    }

    #[test]
    fn the_key_file_is_made_once_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/feedback.key");
        let a = LinkKey::load_or_create(&path).unwrap();
        let b = LinkKey::load_or_create(&path).unwrap();
        assert_eq!(a.0, b.0);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        std::fs::write(&path, "zz").unwrap();
        assert!(LinkKey::load_or_create(&path).is_err());
    }
}
