//! The two HTTP signature schemes the fediverse speaks, built over one
//! request as it is sent: draft-cavage (`Signature`, what every server
//! accepts) and RFC 9421 HTTP Message Signatures (`Signature-Input` +
//! `Signature`, what Mastodon 4.5 verifies and is moving to). Both are
//! signed by the host's signer; only the signing input is built here.

use base64::Engine as _;

/// A signature scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// draft-cavage-http-signatures-12, `rsa-sha256`.
    Cavage,
    /// RFC 9421.
    Rfc9421,
}

impl Scheme {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "cavage" => Some(Scheme::Cavage),
            "rfc9421" => Some(Scheme::Rfc9421),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Cavage => "cavage",
            Scheme::Rfc9421 => "rfc9421",
        }
    }

    pub fn other(self) -> Self {
        match self {
            Scheme::Cavage => Scheme::Rfc9421,
            Scheme::Rfc9421 => Scheme::Cavage,
        }
    }
}

/// The RFC 9421 components signed unless a challenge asks for others:
/// Mastodon's requirements (`@method`, `@target-uri`, a signed
/// `content-digest` on POST) plus the content type.
pub const DEFAULT_COMPONENTS: [&str; 4] = ["@method", "@target-uri", "content-type", "content-digest"];

/// Components this plugin can sign (a challenge asking for another one is
/// answered with the defaults).
const SIGNABLE: [&str; 9] = [
    "@method",
    "@target-uri",
    "@authority",
    "@path",
    "@query",
    "content-digest",
    "content-type",
    "date",
    "host",
];

/// One POST as it is sent.
pub struct Post<'a> {
    /// The canonical URL.
    pub url: &'a str,
    /// `host[:port]`.
    pub authority: &'a str,
    /// The path.
    pub path: &'a str,
    /// The query, without `?`.
    pub query: Option<&'a str>,
    /// Header values by lowercase name.
    pub headers: &'a [(String, String)],
}

impl Post<'_> {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    fn component(&self, name: &str) -> Option<String> {
        Some(match name {
            "@method" => "POST".to_owned(),
            "@target-uri" => self.url.to_owned(),
            "@authority" => self.authority.to_ascii_lowercase(),
            "@path" => self.path.to_owned(),
            "@query" => format!("?{}", self.query.unwrap_or("")),
            header => self.header(header)?.trim().to_owned(),
        })
    }
}

/// The draft-cavage signing string over `(request-target) host date digest
/// content-type`, and the header names it covers.
pub fn cavage_input(post: &Post<'_>) -> String {
    let target = match post.query {
        Some(q) => format!("{}?{q}", post.path),
        None => post.path.to_owned(),
    };
    let h = |name: &str| post.header(name).unwrap_or("");
    format!(
        "(request-target): post {target}\nhost: {}\ndate: {}\ndigest: {}\ncontent-type: {}",
        h("host"),
        h("date"),
        h("digest"),
        h("content-type")
    )
}

/// The draft-cavage `Signature` header.
pub fn cavage_header(key_id: &str, signature: &[u8]) -> String {
    format!(
        "keyId=\"{key_id}\",algorithm=\"rsa-sha256\",headers=\"(request-target) host date digest content-type\",signature=\"{}\"",
        b64(signature)
    )
}

/// An RFC 9421 signature to make: its components and parameters.
pub struct Rfc9421<'a> {
    /// Components, in order.
    pub components: Vec<String>,
    /// `created`, Unix seconds.
    pub created: u64,
    /// The actor's key id URL.
    pub key_id: &'a str,
    /// `rsa-v1_5-sha256` or `ed25519`.
    pub alg: &'a str,
}

impl Rfc9421<'_> {
    /// `("@method" …);created=…;keyid="…";alg="…"`: the `@signature-params`
    /// value and the `Signature-Input` member.
    pub fn params(&self) -> String {
        let list: Vec<String> = self.components.iter().map(|c| format!("\"{c}\"")).collect();
        format!(
            "({});created={};keyid=\"{}\";alg=\"{}\"",
            list.join(" "),
            self.created,
            self.key_id,
            self.alg
        )
    }

    /// The signature base (RFC 9421 §2.5), or the component that cannot be
    /// produced for this request.
    pub fn base(&self, post: &Post<'_>) -> Result<String, String> {
        let mut lines = Vec::with_capacity(self.components.len() + 1);
        for name in &self.components {
            let value = post
                .component(name)
                .ok_or_else(|| format!("component {name:?} is not in the request"))?;
            lines.push(format!("\"{name}\": {value}"));
        }
        lines.push(format!("\"@signature-params\": {}", self.params()));
        Ok(lines.join("\n"))
    }

    /// `Signature-Input` and `Signature` header values.
    pub fn headers(&self, signature: &[u8]) -> (String, String) {
        (format!("sig1={}", self.params()), format!("sig1=:{}:", b64(signature)))
    }
}

/// What an `Accept-Signature` challenge (RFC 9421 §5.1) asks for: the
/// components of its first member, if this plugin can sign them all, and
/// its `alg` if it names one.
pub fn challenge(value: &str) -> Option<(Vec<String>, Option<String>)> {
    let member = value.split_once('=')?.1.trim();
    let open = member.find('(')?;
    let close = member[open..].find(')')? + open;
    let components: Vec<String> = member[open + 1..close]
        .split_whitespace()
        .map(|c| c.trim_matches('"').to_ascii_lowercase())
        .filter(|c| !c.is_empty())
        .collect();
    let alg = member[close + 1..]
        .split(';')
        .filter_map(|p| p.trim().split_once('='))
        .find(|(k, _)| *k == "alg")
        .map(|(_, v)| v.trim_matches('"').to_owned());
    let signable = !components.is_empty() && components.iter().all(|c| SIGNABLE.contains(&c.as_str()));
    Some((
        if signable {
            components
        } else {
            DEFAULT_COMPONENTS.iter().map(|c| (*c).to_owned()).collect()
        },
        alg,
    ))
}

/// A key id that can be written inside a structured-field string.
pub fn key_id_is_plain(key_id: &str) -> bool {
    key_id
        .bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
}

pub fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}
