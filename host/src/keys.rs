//! Signing keys held by the host. Plugins name a key by id and get back a
//! signature or a public key; no function here returns private material.
//!
//! Keys come from files or environment variables named in the config, never
//! from the config text itself: PEM (PKCS#8; PKCS#1 for RSA), or for
//! Ed25519 a Stellar secret seed (`S…`), the way Stellar operators hold them.

use std::collections::HashMap;
use std::fmt;

use ed25519_dalek::pkcs8::DecodePrivateKey as _;
use ed25519_dalek::Signer as _;
use rsa::pkcs1::{DecodeRsaPrivateKey as _, EncodeRsaPublicKey as _};
use rsa::signature::SignatureEncoding as _;
use serde::Deserialize;

/// A signature algorithm a key supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Algorithm {
    /// Ed25519 (Stellar accounts, HTTP Signatures `ed25519`).
    Ed25519,
    /// RSASSA-PKCS1-v1_5 with SHA-256 (HTTP Signatures `rsa-sha256`).
    RsaSha256,
    /// HMAC-SHA256 with a shared secret (Standard Webhooks `v1`): the key
    /// text is `whsec_` and the secret in base64.
    HmacSha256,
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Algorithm::Ed25519 => "ed25519",
            Algorithm::RsaSha256 => "rsa-sha256",
            Algorithm::HmacSha256 => "hmac-sha256",
        })
    }
}

/// `[keys.ID]`: where one key comes from.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct KeySource {
    /// The key's algorithm.
    pub algorithm: Algorithm,
    /// A file holding the key: PEM (PKCS#8; PKCS#1 also accepted for RSA),
    /// or a Stellar secret seed (`S…`) for Ed25519.
    pub file: Option<std::path::PathBuf>,
    /// An environment variable holding the same text.
    pub env: Option<String>,
}

enum Secret {
    Ed25519(ed25519_dalek::SigningKey),
    Rsa(RsaSigner, Vec<u8>),
    Hmac(Box<aws_lc_rs::hmac::Key>),
}

/// RSASSA-PKCS1-v1_5 with SHA-256. aws-lc-rs signs (ActivityPub signs every
/// request, and AWS-LC's constant-time assembly signs in about half ring's
/// time and a quarter of the pure-Rust bignum's: BENCHMARKS.md, "Signing");
/// keys it refuses (under 2048 bits) are signed by the `rsa` crate. Both
/// produce the same bytes: the scheme is deterministic.
enum RsaSigner {
    Native(aws_lc_rs::signature::RsaKeyPair, aws_lc_rs::rand::SystemRandom),
    Portable(Box<rsa::pkcs1v15::SigningKey<sha2::Sha256>>),
}

impl RsaSigner {
    fn new(key: rsa::RsaPrivateKey) -> Self {
        use rsa::pkcs8::EncodePrivateKey as _;
        let native = key
            .to_pkcs8_der()
            .ok()
            .and_then(|der| aws_lc_rs::signature::RsaKeyPair::from_pkcs8(der.as_bytes()).ok());
        match native {
            Some(pair) => RsaSigner::Native(pair, aws_lc_rs::rand::SystemRandom::new()),
            None => RsaSigner::Portable(Box::new(rsa::pkcs1v15::SigningKey::new(key))),
        }
    }

    /// `None` only when AWS-LC cannot read the system RNG it blinds with.
    fn sign(&self, data: &[u8]) -> Option<Vec<u8>> {
        match self {
            RsaSigner::Native(pair, rng) => {
                let mut signature = vec![0u8; pair.public_modulus_len()];
                pair.sign(&aws_lc_rs::signature::RSA_PKCS1_SHA256, rng, data, &mut signature)
                    .ok()
                    .map(|()| signature)
            }
            RsaSigner::Portable(key) => Some(key.sign(data).to_vec()),
        }
    }
}

/// A loaded key. Its `Debug` output never shows the secret.
pub struct Key {
    secret: Secret,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key")
            .field("algorithm", &self.algorithm())
            .finish_non_exhaustive()
    }
}

/// Why a signing request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignError {
    /// No key with that id is loaded.
    #[error("no key {0:?}")]
    UnknownKey(String),
    /// The key is of another algorithm.
    #[error("key {key:?} is {actual}, not {requested}")]
    WrongAlgorithm {
        /// The key.
        key: String,
        /// What was asked for.
        requested: Algorithm,
        /// What it is.
        actual: Algorithm,
    },
    /// The signing itself failed.
    #[error("signing failed: {0}")]
    Failed(String),
}

impl Key {
    /// Parses a key of the given algorithm: PEM, or for Ed25519 also a
    /// Stellar secret seed (`S…`).
    ///
    /// # Errors
    ///
    /// A message saying why the text is not a key of that algorithm (never
    /// quoting the text).
    pub fn from_pem(algorithm: Algorithm, pem: &str) -> Result<Self, String> {
        let text = pem.trim();
        let secret = match algorithm {
            Algorithm::Ed25519 if text.starts_with('S') && !text.contains("-----") => {
                let seed = stellar_strkey::ed25519::PrivateKey::from_string(text)
                    .map_err(|_| "not a Stellar secret seed (S…, 56 characters with a valid checksum)".to_owned())?;
                Secret::Ed25519(ed25519_dalek::SigningKey::from_bytes(&seed.0))
            }
            Algorithm::Ed25519 => Secret::Ed25519(
                ed25519_dalek::SigningKey::from_pkcs8_pem(text)
                    .map_err(|e| format!("not a PKCS#8 Ed25519 private key or a Stellar secret seed: {e}"))?,
            ),
            Algorithm::HmacSha256 => {
                use base64::Engine as _;
                let encoded = text
                    .strip_prefix("whsec_")
                    .ok_or_else(|| "not a webhook secret (whsec_ followed by base64)".to_owned())?;
                let secret = base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .map_err(|_| "not a webhook secret: the part after whsec_ is not base64".to_owned())?;
                if secret.len() < 24 {
                    return Err(format!(
                        "a webhook secret of {} bytes is too short (at least 24)",
                        secret.len()
                    ));
                }
                Secret::Hmac(Box::new(aws_lc_rs::hmac::Key::new(
                    aws_lc_rs::hmac::HMAC_SHA256,
                    &secret,
                )))
            }
            Algorithm::RsaSha256 => {
                let key = rsa::RsaPrivateKey::from_pkcs8_pem(pem)
                    .or_else(|_| rsa::RsaPrivateKey::from_pkcs1_pem(pem))
                    .map_err(|e| format!("not a PKCS#8 or PKCS#1 RSA private key: {e}"))?;
                let public = key
                    .to_public_key()
                    .to_pkcs1_der()
                    .map_err(|e| format!("cannot encode the public key: {e}"))?
                    .as_bytes()
                    .to_vec();
                Secret::Rsa(RsaSigner::new(key), public)
            }
        };
        Ok(Self { secret })
    }

    /// The key's algorithm.
    pub fn algorithm(&self) -> Algorithm {
        match self.secret {
            Secret::Ed25519(_) => Algorithm::Ed25519,
            Secret::Rsa(..) => Algorithm::RsaSha256,
            Secret::Hmac(_) => Algorithm::HmacSha256,
        }
    }

    /// The Stellar account (`G…`) of an Ed25519 key.
    pub fn stellar_account(&self) -> Option<String> {
        match &self.secret {
            Secret::Ed25519(k) => Some(
                stellar_strkey::ed25519::PublicKey(k.verifying_key().to_bytes())
                    .to_string()
                    .as_str()
                    .to_owned(),
            ),
            Secret::Rsa(..) | Secret::Hmac(_) => None,
        }
    }

    /// The public half: 32 raw bytes (Ed25519) or PKCS#1 DER (RSA); a
    /// shared secret has none (empty).
    pub fn public_key(&self) -> Vec<u8> {
        match &self.secret {
            Secret::Ed25519(k) => k.verifying_key().to_bytes().to_vec(),
            Secret::Rsa(_, public) => public.clone(),
            Secret::Hmac(_) => Vec::new(),
        }
    }

    /// The public half as an SPKI PEM (`-----BEGIN PUBLIC KEY-----`), as an
    /// actor document's `publicKeyPem` carries it; none for a shared secret.
    pub fn public_key_pem(&self) -> Option<String> {
        use ed25519_dalek::pkcs8::EncodePublicKey as _;
        use rsa::pkcs1::DecodeRsaPublicKey as _;
        match &self.secret {
            Secret::Ed25519(k) => k.verifying_key().to_public_key_pem(Default::default()).ok(),
            Secret::Rsa(_, public) => rsa::RsaPublicKey::from_pkcs1_der(public)
                .ok()?
                .to_public_key_pem(Default::default())
                .ok(),
            Secret::Hmac(_) => None,
        }
    }

    fn sign(&self, data: &[u8]) -> Option<Vec<u8>> {
        match &self.secret {
            Secret::Ed25519(k) => Some(k.sign(data).to_bytes().to_vec()),
            Secret::Rsa(k, _) => k.sign(data),
            Secret::Hmac(k) => Some(aws_lc_rs::hmac::sign(k, data).as_ref().to_vec()),
        }
    }
}

/// Every key the host holds, by id.
#[derive(Debug, Default)]
pub struct KeyStore {
    keys: HashMap<String, Key>,
}

impl KeyStore {
    /// Loads every configured key; returns each problem with its key path.
    ///
    /// # Errors
    ///
    /// `(key path, message)` pairs for keys that could not be loaded.
    pub fn load(sources: &std::collections::BTreeMap<String, KeySource>) -> Result<Self, Vec<(String, String)>> {
        match Self::load_partial(sources) {
            (store, problems) if problems.is_empty() => Ok(store),
            (_, problems) => Err(problems),
        }
    }

    /// Loads every key that loads, and returns the problems of the others
    /// (with their key paths) beside them, so that everything that depends
    /// on the good keys can still be checked.
    pub fn load_partial(sources: &std::collections::BTreeMap<String, KeySource>) -> (Self, Vec<(String, String)>) {
        let mut keys = HashMap::new();
        let mut problems = Vec::new();
        for (id, source) in sources {
            let text = match (&source.file, &source.env) {
                (Some(path), None) => {
                    std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
                }
                (None, Some(var)) => std::env::var(var).map_err(|_| format!("environment variable {var} is not set")),
                _ => Err("give exactly one of `file` or `env`".to_owned()),
            };
            match text.and_then(|text| Key::from_pem(source.algorithm, &text)) {
                Ok(key) => {
                    keys.insert(id.clone(), key);
                }
                Err(message) => problems.push((format!("keys.{id}"), message)),
            }
        }
        (Self { keys }, problems)
    }

    /// A store holding exactly these keys (tests, examples).
    pub fn from_keys(keys: impl IntoIterator<Item = (String, Key)>) -> Self {
        Self {
            keys: keys.into_iter().collect(),
        }
    }

    /// Whether a key id is loaded.
    pub fn contains(&self, id: &str) -> bool {
        self.keys.contains_key(id)
    }

    /// A loaded key, for its public parts.
    pub fn get(&self, id: &str) -> Option<&Key> {
        self.keys.get(id)
    }

    /// Signs `data` with key `id`.
    ///
    /// # Errors
    ///
    /// [`SignError`] for an unknown key or the wrong algorithm.
    pub fn sign(&self, id: &str, algorithm: Algorithm, data: &[u8]) -> Result<Vec<u8>, SignError> {
        let key = self.keys.get(id).ok_or_else(|| SignError::UnknownKey(id.to_owned()))?;
        if key.algorithm() != algorithm {
            return Err(SignError::WrongAlgorithm {
                key: id.to_owned(),
                requested: algorithm,
                actual: key.algorithm(),
            });
        }
        key.sign(data)
            .ok_or_else(|| SignError::Failed("the system random number generator failed".to_owned()))
    }

    /// The public half of key `id`.
    ///
    /// # Errors
    ///
    /// [`SignError::UnknownKey`].
    pub fn public_key(&self, id: &str) -> Result<Vec<u8>, SignError> {
        self.keys
            .get(id)
            .map(Key::public_key)
            .ok_or_else(|| SignError::UnknownKey(id.to_owned()))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use ed25519_dalek::pkcs8::EncodePrivateKey as _;
    use ed25519_dalek::Verifier as _;

    pub(crate) fn ed25519_pem(seed: [u8; 32]) -> String {
        let key = ed25519_dalek::SigningKey::from_bytes(&seed);
        key.to_pkcs8_pem(Default::default()).unwrap().to_string()
    }

    #[test]
    fn ed25519_signs_verifiably_and_never_returns_the_seed() {
        let seed = [42u8; 32];
        let key = Key::from_pem(Algorithm::Ed25519, &ed25519_pem(seed)).unwrap();
        let store = KeyStore::from_keys([("stellar".to_owned(), key)]);
        let signature = store.sign("stellar", Algorithm::Ed25519, b"tx").unwrap();
        let public = store.public_key("stellar").unwrap();
        let verifying = ed25519_dalek::VerifyingKey::from_bytes(&public.clone().try_into().unwrap()).unwrap();
        let sig = ed25519_dalek::Signature::from_slice(&signature).unwrap();
        assert!(verifying.verify(b"tx", &sig).is_ok());
        for output in [&signature, &public] {
            assert!(!output.windows(32).any(|w| w == seed), "secret bytes escaped");
        }
        assert!(!format!("{store:?}").contains("42"), "Debug shows secret material");
    }

    #[test]
    fn wrong_algorithm_and_unknown_keys_are_refused() {
        let key = Key::from_pem(Algorithm::Ed25519, &ed25519_pem([1; 32])).unwrap();
        let store = KeyStore::from_keys([("k".to_owned(), key)]);
        assert!(matches!(
            store.sign("k", Algorithm::RsaSha256, b"x"),
            Err(SignError::WrongAlgorithm { .. })
        ));
        assert_eq!(
            store.sign("nope", Algorithm::Ed25519, b"x"),
            Err(SignError::UnknownKey("nope".into()))
        );
        assert!(Key::from_pem(Algorithm::RsaSha256, &ed25519_pem([1; 32])).is_err());
        assert!(Key::from_pem(Algorithm::Ed25519, "garbage").is_err());
    }

    #[test]
    fn rsa_signatures_are_the_same_from_aws_lc_and_the_portable_signer() {
        use rsa::pkcs8::EncodePrivateKey as _;
        use rsa::signature::Verifier as _;
        for bits in [2048, 1024] {
            let private = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), bits).unwrap();
            let pem = private.to_pkcs8_pem(Default::default()).unwrap();
            let key = Key::from_pem(Algorithm::RsaSha256, &pem).unwrap();
            let Secret::Rsa(signer, _) = &key.secret else {
                panic!("not an RSA key")
            };
            assert_eq!(
                matches!(signer, RsaSigner::Native(..)),
                bits >= 2048,
                "AWS-LC signs keys of 2048 bits and more, the portable signer the rest"
            );
            let signature = key.sign(b"(request-target): post /inbox").unwrap();
            let portable = rsa::pkcs1v15::SigningKey::<sha2::Sha256>::new(private.clone());
            assert_eq!(
                signature,
                portable.sign(b"(request-target): post /inbox").to_vec(),
                "PKCS#1 v1.5 is deterministic: both signers agree"
            );
            let verifying = rsa::pkcs1v15::VerifyingKey::<sha2::Sha256>::new(private.to_public_key());
            let parsed = rsa::pkcs1v15::Signature::try_from(signature.as_slice()).unwrap();
            assert!(verifying.verify(b"(request-target): post /inbox", &parsed).is_ok());
        }
    }

    /// Stellar's documented key pair (SEP-0005 test 1, index 0).
    const SEED: &str = "SBGWSG6BTNCKCOB3DIFBGCVMUPQFYPA2G4O34RMTB343OYPXU5DJDVMN";
    const ACCOUNT: &str = "GDRXE2BQUC3AZNPVFSCEZ76NJ3WWL25FYFK6RGZGIEKWE4SOOHSUJUJ6";

    #[test]
    fn a_stellar_secret_seed_is_an_ed25519_key_with_its_account() {
        let key = Key::from_pem(Algorithm::Ed25519, &format!("{SEED}\n")).unwrap();
        assert_eq!(key.stellar_account().as_deref(), Some(ACCOUNT));
        let pem_key = Key::from_pem(
            Algorithm::Ed25519,
            &ed25519_pem(stellar_strkey::ed25519::PrivateKey::from_string(SEED).unwrap().0),
        )
        .unwrap();
        assert_eq!(
            key.public_key(),
            pem_key.public_key(),
            "the seed and its PEM are one key"
        );
        // A mistyped seed fails its checksum, and the error never echoes it.
        let typo = SEED.replace("SBGW", "SBGX");
        let err = Key::from_pem(Algorithm::Ed25519, &typo).unwrap_err();
        assert!(!err.contains(&typo), "{err}");
        assert!(Key::from_pem(Algorithm::RsaSha256, SEED).is_err());
    }
}
