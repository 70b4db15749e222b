//! Signed checkpoints: the tree size and root at a moment, signed with the log's Ed25519 key.
//!
//! The signed text is a note in the spirit of C2SP's signed-note checkpoints:
//!
//! ```text
//! rampart-audit/v1
//! <origin>
//! <tree size>
//! <root, hex>
//! <time, ms since the Unix epoch>
//! ```
//!
//! The key is generated on the log's first start (`key.ed25519`, mode 0600) and its public half
//! exported as `key.pub` (hex), shipped with the sealed files so a verifier needs nothing else.

use std::fs;
use std::io::Write;
use std::path::Path;

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::merkle::Hash;
use crate::AuditError;

/// The secret key's file in the log directory.
pub const SECRET_KEY_FILE: &str = "key.ed25519";
/// The public key's file (hex), in the log directory and on S3.
pub const PUBLIC_KEY_FILE: &str = "key.pub";

/// One signed tree head.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub origin: String,
    pub size: u64,
    /// The tree's root, hex.
    pub root: String,
    pub time_ms: u64,
    /// The first 8 bytes of sha256(public key), hex: which key signed.
    pub key_id: String,
    /// Ed25519 over [`Checkpoint::note`], hex.
    pub signature: String,
}

impl Checkpoint {
    /// The text the signature covers.
    pub fn note(origin: &str, size: u64, root: &str, time_ms: u64) -> String {
        format!("rampart-audit/v1\n{origin}\n{size}\n{root}\n{time_ms}\n")
    }

    pub fn root_hash(&self) -> Result<Hash, AuditError> {
        parse_hash(&self.root)
            .ok_or_else(|| AuditError::Corrupt(format!("checkpoint {}: bad root", self.size)))
    }

    /// Whether the signature is the given key's over this checkpoint's fields.
    pub fn verify(&self, key: &VerifyingKey) -> bool {
        let Ok(bytes) = hex::decode(&self.signature) else {
            return false;
        };
        let Ok(bytes) = <[u8; 64]>::try_from(bytes.as_slice()) else {
            return false;
        };
        let signature = Signature::from_bytes(&bytes);
        let note = Self::note(&self.origin, self.size, &self.root, self.time_ms);
        key.verify_strict(note.as_bytes(), &signature).is_ok()
    }
}

/// A 32-byte hex digest.
pub fn parse_hash(text: &str) -> Option<Hash> {
    hex::decode(text).ok()?.try_into().ok()
}

/// The id of a public key: the first 8 bytes of its sha256, hex.
pub fn key_id(key: &VerifyingKey) -> String {
    hex::encode(&Sha256::digest(key.to_bytes())[..8])
}

/// The log's signing key.
pub struct Signer25519 {
    key: SigningKey,
    id: String,
}

impl std::fmt::Debug for Signer25519 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer25519")
            .field("key_id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Signer25519 {
    /// Reads the key of `dir`, or makes one (and exports its public half) on the first start.
    pub fn load_or_create(dir: &Path) -> Result<Self, AuditError> {
        let path = dir.join(SECRET_KEY_FILE);
        let key = if path.exists() {
            let text = fs::read_to_string(&path).map_err(|e| AuditError::io(&path, e))?;
            let seed: [u8; 32] = hex::decode(text.trim())
                .ok()
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| {
                    AuditError::Corrupt(format!("{} is not a 32-byte hex key", path.display()))
                })?;
            SigningKey::from_bytes(&seed)
        } else {
            let mut seed = [0u8; 32];
            getrandom::fill(&mut seed)
                .map_err(|e| AuditError::Key(format!("no randomness for the audit key: {e}")))?;
            let key = SigningKey::from_bytes(&seed);
            write_private(&path, &hex::encode(seed))?;
            tracing::info!(path = %path.display(), key_id = %key_id(&key.verifying_key()), "audit signing key created");
            key
        };
        let public = dir.join(PUBLIC_KEY_FILE);
        let hex_public = hex::encode(key.verifying_key().to_bytes());
        let current = fs::read_to_string(&public).ok();
        if current.as_deref().map(str::trim) != Some(hex_public.as_str()) {
            fs::write(&public, format!("{hex_public}\n"))
                .map_err(|e| AuditError::io(&public, e))?;
        }
        let id = key_id(&key.verifying_key());
        Ok(Self { key, id })
    }

    pub fn verifying_key(&self) -> VerifyingKey {
        self.key.verifying_key()
    }

    pub fn key_id(&self) -> &str {
        &self.id
    }

    pub fn sign(&self, origin: &str, size: u64, root: &Hash, time_ms: u64) -> Checkpoint {
        let root = hex::encode(root);
        let note = Checkpoint::note(origin, size, &root, time_ms);
        let signature = self.key.sign(note.as_bytes());
        Checkpoint {
            origin: origin.to_string(),
            size,
            root,
            time_ms,
            key_id: self.id.clone(),
            signature: hex::encode(signature.to_bytes()),
        }
    }
}

/// A public key from its hex text (`key.pub`).
pub fn parse_public_key(text: &str) -> Result<VerifyingKey, AuditError> {
    let bytes: [u8; 32] = hex::decode(text.trim())
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| AuditError::Key("the public key is not 32 bytes of hex".into()))?;
    VerifyingKey::from_bytes(&bytes).map_err(|e| AuditError::Key(format!("bad public key: {e}")))
}

fn write_private(path: &Path, text: &str) -> Result<(), AuditError> {
    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(|e| AuditError::io(path, e))?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|e| AuditError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_verifies_with_its_key_and_not_when_changed() {
        let dir = tempfile::tempdir().unwrap();
        let signer = Signer25519::load_or_create(dir.path()).unwrap();
        let again = Signer25519::load_or_create(dir.path()).unwrap();
        assert_eq!(signer.key_id(), again.key_id(), "the key is kept");
        let c = signer.sign("test", 3, &[7u8; 32], 1_000);
        let key = parse_public_key(&fs::read_to_string(dir.path().join(PUBLIC_KEY_FILE)).unwrap())
            .unwrap();
        assert!(c.verify(&key));
        let mut bigger = c.clone();
        bigger.size = 4;
        assert!(!bigger.verify(&key));
        let mut other_root = c.clone();
        other_root.root = hex::encode([8u8; 32]);
        assert!(!other_root.verify(&key));
        let other = tempfile::tempdir().unwrap();
        let stranger = Signer25519::load_or_create(other.path()).unwrap();
        assert!(!c.verify(&stranger.verifying_key()));
    }
}
