//! The one egress guard: where the host may send HTTP (a plugin's
//! requests, inbound key fetches, outcome webhooks, the fee oracle). Each
//! client has a policy ([`Egress`]: an allow-list and the internal networks
//! it may reach anyway); a request's URL is judged by [`Egress::check_url`]
//! (the allow-list, then every IP literal, in any spelling the URL parser
//! accepts, against internal ranges) and every name's resolved addresses are
//! judged again at connect by [`client`]'s resolver, on the first request and
//! on every redirect hop.
//!
//! This module is pure (parsing and matching); [`client`] builds the one
//! kind of HTTP client every caller uses.

pub mod client;

pub use client::{Guarded, Options};

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Why the guard refused a destination. Kept inside the HTTP error a
/// refused request returns (see [`client::refusal`]), so a caller can say
/// why, not just "error sending request".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The URL does not parse or names no host.
    #[error("bad url: {0}")]
    Malformed(String),
    /// Not http or https.
    #[error("scheme {0} is not allowed")]
    Scheme(String),
    /// The allow-list does not name it.
    #[error("{scheme}://{host}:{port} is not in {list}")]
    NotListed {
        /// The URL's scheme.
        scheme: String,
        /// Its host as parsed.
        host: String,
        /// Its port (the scheme's default when none is given).
        port: u16,
        /// The config key of the allow-list, for the message.
        list: String,
    },
    /// An IP literal (in any spelling) or every resolved address is
    /// internal and not explicitly allowed.
    #[error("{host} is an internal address ({addresses}), not in {list}")]
    Internal {
        /// The name or literal.
        host: String,
        /// The addresses it meant.
        addresses: String,
        /// The config key of the internal allowances, for the message.
        list: String,
    },
    /// Too many redirects.
    #[error("more than {0} redirects")]
    TooManyRedirects(usize),
}

/// Whether any of `patterns` (config text; a malformed one allows nothing,
/// and is reported by the config check) lets `scheme://host:port` through.
pub fn listed(patterns: &[String], scheme: &str, host: &str, port: u16) -> bool {
    patterns
        .iter()
        .any(|pattern| HostPattern::parse(pattern).is_ok_and(|p| p.allows(scheme, host, port)))
}

/// One allow-list entry, Spin style: `https://*.example.com`,
/// `http://127.0.0.1:8080`, `*://inbox.example:1000-2000`, `https://*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPattern {
    scheme: Option<String>,
    host: HostMatch,
    ports: PortMatch,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum HostMatch {
    Any,
    Exact(String),
    /// `*.example.com`: any subdomain of the suffix (not the suffix itself).
    Subdomain(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PortMatch {
    /// No port given: the scheme's default port.
    Default,
    Any,
    Range(u16, u16),
}

fn default_port(scheme: &str) -> Option<u16> {
    match scheme {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    }
}

impl HostPattern {
    /// Parses one entry.
    ///
    /// # Errors
    ///
    /// A message saying what is wrong with the entry.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (scheme, rest) = text
            .split_once("://")
            .ok_or_else(|| format!("{text:?} has no scheme (expected e.g. https://host)"))?;
        let scheme = match scheme {
            "*" => None,
            "http" | "https" => Some(scheme.to_owned()),
            other => return Err(format!("{text:?}: scheme {other:?} is not http, https or *")),
        };
        if rest.contains('/') && rest.trim_end_matches('/').contains('/') {
            return Err(format!("{text:?}: an allowed host has no path"));
        }
        let rest = rest.trim_end_matches('/');
        let (host, port) = match rest.rsplit_once(':') {
            // An IPv6 literal's colons are inside brackets.
            Some((h, p)) if !p.contains(']') => (h, Some(p)),
            _ => (rest, None),
        };
        let host = host.to_ascii_lowercase();
        let host = if host == "*" {
            HostMatch::Any
        } else if let Some(suffix) = host.strip_prefix("*.") {
            if suffix.is_empty() || suffix.contains('*') {
                return Err(format!("{text:?}: bad wildcard"));
            }
            HostMatch::Subdomain(suffix.to_owned())
        } else if host.is_empty() || host.contains('*') {
            return Err(format!("{text:?}: bad host"));
        } else {
            HostMatch::Exact(host.trim_start_matches('[').trim_end_matches(']').to_owned())
        };
        let ports = match port {
            None => PortMatch::Default,
            Some("*") => PortMatch::Any,
            Some(p) => {
                let parse = |s: &str| s.parse::<u16>().map_err(|_| format!("{text:?}: bad port {s:?}"));
                match p.split_once('-') {
                    Some((lo, hi)) => PortMatch::Range(parse(lo)?, parse(hi)?),
                    None => {
                        let n = parse(p)?;
                        PortMatch::Range(n, n)
                    }
                }
            }
        };
        if ports == PortMatch::Default && scheme.is_none() {
            return Err(format!("{text:?}: with scheme * the port must be given"));
        }
        Ok(Self { scheme, host, ports })
    }

    /// Does this entry allow `scheme://host:port`?
    pub fn allows(&self, scheme: &str, host: &str, port: u16) -> bool {
        if self.scheme.as_deref().is_some_and(|s| s != scheme) {
            return false;
        }
        let host = host.trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase();
        let host_ok = match &self.host {
            HostMatch::Any => true,
            HostMatch::Exact(h) => *h == host,
            HostMatch::Subdomain(suffix) => host.ends_with(&format!(".{suffix}")),
        };
        let port_ok = match self.ports {
            PortMatch::Any => true,
            PortMatch::Default => default_port(scheme) == Some(port),
            PortMatch::Range(lo, hi) => (lo..=hi).contains(&port),
        };
        host_ok && port_ok
    }
}

/// An IP network in CIDR form, for explicit allowances of otherwise blocked
/// addresses (`127.0.0.1/32` in tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `a.b.c.d/n`, `x::y/n`, or a bare address (a single host).
    ///
    /// # Errors
    ///
    /// A message saying what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{text:?} is not an IP address or network"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{text:?}: bad prefix length"))?,
            None => max,
        };
        Ok(Self { addr, prefix })
    }

    /// Is `ip` inside this network?
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix)).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// An IPv6 address that carries an IPv4 one is judged as that IPv4
/// address: IPv4-mapped (`::ffff:a.b.c.d`), IPv4-compatible (`::a.b.c.d`),
/// NAT64 (`64:ff9b::/96`) and 6to4 (`2002:AABB:CCDD::/48`), since each can
/// reach the IPv4 host it names.
fn canonical(ip: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = ip else {
        return ip;
    };
    let s = v6.segments();
    let v4 = |hi: u16, lo: u16| IpAddr::V4(Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo)));
    if let Some(mapped) = v6.to_ipv4_mapped() {
        return IpAddr::V4(mapped);
    }
    if s[..6] == [0; 6] && !(s[6] == 0 && s[7] <= 1) {
        return v4(s[6], s[7]);
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return v4(s[6], s[7]);
    }
    if s[0] == 0x2002 {
        return v4(s[1], s[2]);
    }
    ip
}

/// Whether an address is not on the public internet: loopback, private,
/// link-local (including cloud metadata at 169.254.169.254), shared
/// (CGNAT), unique-local, unspecified, multicast, broadcast or documentation.
pub fn is_internal(ip: IpAddr) -> bool {
    match canonical(ip) {
        IpAddr::V4(v4) => internal_v4(v4),
        IpAddr::V6(v6) => internal_v6(v6),
    }
}

fn internal_v4(ip: Ipv4Addr) -> bool {
    let o = ip.octets();
    ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_multicast()
        || ip.is_broadcast()
        || ip.is_documentation()
        || o[0] == 0
        || (o[0] == 100 && (64..128).contains(&o[1]))
        || (o[0] == 192 && o[1] == 0 && o[2] == 0)
        || o[0] >= 240
}

fn internal_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        // Unique-local, link-local and the deprecated site-local.
        || (s[0] & 0xfe00) == 0xfc00
        || (s[0] & 0xffc0) == 0xfe80
        || (s[0] & 0xffc0) == 0xfec0
        // Documentation, Teredo (tunnels to any IPv4 host), discard-only.
        || (s[0] == 0x2001 && s[1] == 0x0db8)
        || (s[0] == 0x2001 && s[1] == 0)
        || (s[..4] == [0x100, 0, 0, 0])
}

/// One client's egress policy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Egress {
    /// Destinations allowed by name.
    pub allowed: Vec<HostPattern>,
    /// Internal networks explicitly allowed anyway.
    pub allowed_internal: Vec<Cidr>,
    /// The config section the lists come from (`plugins.ap`, `inbound`), so
    /// a refusal names the key to change.
    pub section: String,
}

impl Egress {
    /// A policy from config text: `allowed_hosts` patterns and
    /// `allowed_internal` networks of the config section `section`.
    ///
    /// # Errors
    ///
    /// The first entry that does not parse, with its key path
    /// (`check-config` reports them all first).
    pub fn from_config(section: &str, allowed_hosts: &[String], allowed_internal: &[String]) -> Result<Self, String> {
        Ok(Self {
            allowed: allowed_hosts
                .iter()
                .map(|h| HostPattern::parse(h).map_err(|e| format!("{section}.allowed_hosts: {e}")))
                .collect::<Result<_, _>>()?,
            allowed_internal: allowed_internal
                .iter()
                .map(|c| Cidr::parse(c).map_err(|e| format!("{section}.allowed_internal: {e}")))
                .collect::<Result<_, _>>()?,
            section: section.to_owned(),
        })
    }

    /// The policy of the entries that parse, for judging before the config
    /// is accepted (`check-config` reports each bad entry on its own key).
    pub fn lenient(section: &str, allowed_hosts: &[String], allowed_internal: &[String]) -> Self {
        Self {
            allowed: allowed_hosts
                .iter()
                .filter_map(|h| HostPattern::parse(h).ok())
                .collect(),
            allowed_internal: allowed_internal.iter().filter_map(|c| Cidr::parse(c).ok()).collect(),
            section: section.to_owned(),
        }
    }

    fn key(&self, list: &str) -> String {
        if self.section.is_empty() {
            list.to_owned()
        } else {
            format!("{}.{list}", self.section)
        }
    }

    /// Judges a URL before anything is sent to it, and on every redirect
    /// hop: http(s) only, on the allow-list, and an IP literal (the URL
    /// parser reads every spelling: `2130706433`, `0177.0.0.1`, `0x7f.1`,
    /// `[::ffff:127.0.0.1]`) outside internal ranges unless allowed. A name
    /// is judged again on what it resolves to, at connect.
    ///
    /// # Errors
    ///
    /// The [`Refusal`].
    pub fn check_url(&self, url: &reqwest::Url) -> Result<(), Refusal> {
        let scheme = url.scheme();
        if !(scheme == "http" || scheme == "https") {
            return Err(Refusal::Scheme(scheme.to_owned()));
        }
        let (Some(host), Some(port)) = (url.host(), url.port_or_known_default()) else {
            return Err(Refusal::Malformed(format!("{url} has no host")));
        };
        let (name, literal) = match host {
            url::Host::Domain(d) => (d.to_owned(), None),
            url::Host::Ipv4(v4) => (v4.to_string(), Some(IpAddr::V4(v4))),
            url::Host::Ipv6(v6) => (v6.to_string(), Some(IpAddr::V6(v6))),
        };
        if !self.allows_destination(scheme, &name, port) {
            return Err(Refusal::NotListed {
                scheme: scheme.to_owned(),
                host: name,
                port,
                list: self.key("allowed_hosts"),
            });
        }
        if let Some(ip) = literal {
            if !self.allows_address(ip) {
                return Err(Refusal::Internal {
                    host: name,
                    addresses: ip.to_string(),
                    list: self.key("allowed_internal"),
                });
            }
        }
        Ok(())
    }

    /// [`Egress::check_url`] of URL text.
    ///
    /// # Errors
    ///
    /// The [`Refusal`]; [`Refusal::Malformed`] for text that is not a URL.
    pub fn check(&self, url: &str) -> Result<reqwest::Url, Refusal> {
        let parsed = reqwest::Url::parse(url).map_err(|e| Refusal::Malformed(format!("{url:?}: {e}")))?;
        self.check_url(&parsed)?;
        Ok(parsed)
    }

    /// Is the URL's destination on the allow-list?
    pub fn allows_destination(&self, scheme: &str, host: &str, port: u16) -> bool {
        self.allowed.iter().any(|p| p.allows(scheme, host, port))
    }

    /// May a connection go to this resolved address?
    pub fn allows_address(&self, ip: IpAddr) -> bool {
        !is_internal(ip) || self.allowed_internal.iter().any(|c| c.contains(ip))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> HostPattern {
        HostPattern::parse(s).unwrap()
    }

    #[test]
    fn patterns_match_scheme_host_and_port() {
        assert!(p("https://inbox.example").allows("https", "inbox.example", 443));
        assert!(!p("https://inbox.example").allows("http", "inbox.example", 80));
        assert!(!p("https://inbox.example").allows("https", "inbox.example", 8443));
        assert!(p("https://*.example.com").allows("https", "a.b.example.com", 443));
        assert!(!p("https://*.example.com").allows("https", "example.com", 443));
        assert!(!p("https://*.example.com").allows("https", "evilexample.com", 443));
        assert!(p("http://127.0.0.1:*").allows("http", "127.0.0.1", 39217));
        assert!(p("*://h:1000-2000").allows("https", "h", 1500));
        assert!(!p("*://h:1000-2000").allows("https", "h", 999));
        assert!(p("https://*").allows("https", "anything.example", 443));
        assert!(p("http://[::1]:8080").allows("http", "[::1]", 8080));
    }

    #[test]
    fn bad_patterns_are_refused() {
        for bad in [
            "inbox.example",
            "ftp://x",
            "https://x/path",
            "*://x",
            "https://a*b",
            "https://x:99999",
        ] {
            assert!(HostPattern::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn internal_addresses_are_blocked_unless_allowed() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fc00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(is_internal(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["93.184.216.34", "2606:4700::1111", "1.1.1.1"] {
            assert!(!is_internal(ip.parse().unwrap()), "{ip}");
        }
        let egress = Egress {
            allowed: vec![],
            allowed_internal: vec![Cidr::parse("127.0.0.1/32").unwrap()],
            section: String::new(),
        };
        assert!(egress.allows_address("127.0.0.1".parse().unwrap()));
        assert!(egress.allows_address("::ffff:127.0.0.1".parse().unwrap()));
        assert!(!egress.allows_address("127.0.0.2".parse().unwrap()));
        assert!(!egress.allows_address("10.0.0.1".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.0/8").unwrap().contains("10.9.9.9".parse().unwrap()));
        assert!(Cidr::parse("nope").is_err());
        assert!(Cidr::parse("10.0.0.0/40").is_err());
    }
}
