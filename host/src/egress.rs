//! Where a plugin may send HTTP: its allow-list of destinations, and the
//! guard against requests to loopback, private, link-local and metadata
//! addresses (SSRF), checked on the resolved address, not the name.
//!
//! Pure: parsing and matching only; the HTTP import applies them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

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

/// An IPv4-mapped IPv6 address is judged as the IPv4 address it carries.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
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
        || (s[0] & 0xfe00) == 0xfc00
        || (s[0] & 0xffc0) == 0xfe80
        || (s[0] == 0x2001 && s[1] == 0x0db8)
}

/// A plugin's egress policy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Egress {
    /// Destinations allowed by name.
    pub allowed: Vec<HostPattern>,
    /// Internal networks explicitly allowed anyway.
    pub allowed_internal: Vec<Cidr>,
}

impl Egress {
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
