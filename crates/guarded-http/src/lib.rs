//! HTTP toward addresses taken from the network: a `did:web` host, a PDS endpoint from a
//! DID document, a redirect. Such an address is the network's choice, not the
//! operator's, so by default it never reaches this machine, its network or the cloud's
//! metadata service: loopback, private, link-local, shared and unspecified addresses
//! are refused, whether written as an IP or reached through DNS (every address a name
//! resolves to is checked, so a name cannot point at loopback) or through a redirect
//! (each hop is checked, at most [`Guard::max_redirects`] hops). Tests and private
//! deployments allow them with [`Guard::allow_private`].
//!
//! Bodies are read with a size bound ([`read_bounded`]): a host cannot make this process
//! buffer more than the caller allows.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// What addresses taken from the network may reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guard {
    /// Loopback and private addresses are allowed (tests, private networks).
    pub allow_private: bool,
    /// Redirects followed at most (each target checked like the first).
    pub max_redirects: usize,
}

impl Default for Guard {
    fn default() -> Self {
        Self { allow_private: false, max_redirects: 3 }
    }
}

/// Why a guarded request did not happen or its body was not read.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// The address is loopback, private or otherwise not public.
    #[error("{0} is not a public address (private and loopback addresses are refused unless allowed)")]
    NotPublic(String),
    /// The body is larger than allowed.
    #[error("the body is larger than {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// Reading the body failed (without its URL: it may carry credentials).
    #[error("reading the body: {0}")]
    Body(String),
}

/// True for an address a host on the public internet has: not loopback, private (RFC
/// 1918, unique-local), link-local, shared (100.64/10), documentation, benchmarking,
/// multicast, broadcast or unspecified.
#[must_use]
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v) => {
            let o = v.octets();
            !(v.is_loopback()
                || v.is_private()
                || v.is_link_local()
                || v.is_unspecified()
                || v.is_broadcast()
                || v.is_multicast()
                || v.is_documentation()
                || o[0] == 0
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
                || (o[0] == 198 && (o[1] & 0xfe) == 18)
                || o[0] >= 240)
        }
        IpAddr::V6(v) => {
            if let Some(v4) = v.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let s = v.segments();
            !(v.is_loopback()
                || v.is_unspecified()
                || v.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] == 0x2001 && s[1] == 0x0db8))
        }
    }
}

/// Checks the host of `url` when it is an IP literal (names are checked when resolved).
pub fn check_url(guard: Guard, url: &url::Url) -> Result<(), GuardError> {
    if guard.allow_private {
        return Ok(());
    }
    let ip = match url.host() {
        Some(url::Host::Ipv4(v)) => IpAddr::V4(v),
        Some(url::Host::Ipv6(v)) => IpAddr::V6(v),
        Some(url::Host::Domain(d)) if d.eq_ignore_ascii_case("localhost") || d.ends_with(".localhost") => {
            return Err(GuardError::NotPublic(d.to_owned()));
        }
        _ => return Ok(()),
    };
    if is_public(ip) { Ok(()) } else { Err(GuardError::NotPublic(ip.to_string())) }
}

/// Resolves names and keeps only public addresses (none left: an error naming the host).
#[derive(Debug, Clone, Copy)]
struct PublicOnly;

impl Resolve for PublicOnly {
    fn resolve(&self, name: Name) -> Resolving {
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let all: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let public: Vec<SocketAddr> = all.into_iter().filter(|a| is_public(a.ip())).collect();
            if public.is_empty() {
                return Err(Box::new(GuardError::NotPublic(host)) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(public.into_iter()) as Addrs)
        })
    }
}

/// `builder` with the guard installed: the DNS resolver that drops non-public addresses
/// and a redirect policy that checks every hop (unless private addresses are allowed,
/// when only the hop count is bounded).
pub fn install(guard: Guard, builder: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
    let max = guard.max_redirects;
    let policy = reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() >= max {
            return attempt.error(format!("more than {max} redirects"));
        }
        match check_url(guard, attempt.url()) {
            Ok(()) => attempt.follow(),
            Err(e) => attempt.error(e),
        }
    });
    let builder = builder.redirect(policy);
    if guard.allow_private { builder } else { builder.dns_resolver(Arc::new(PublicOnly)) }
}

/// An HTTP client for addresses taken from the network: every request's own host is
/// checked (an IP literal here, a name when resolved), and every redirect's.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    guard: Guard,
}

impl Client {
    /// A client from `builder` (timeouts, user agent) with `guard` installed.
    ///
    /// # Errors
    /// When the client cannot be built (no TLS provider).
    pub fn new(guard: Guard, builder: reqwest::ClientBuilder) -> Result<Self, reqwest::Error> {
        Ok(Self { http: install(guard, builder).build()?, guard })
    }

    /// A GET of `url`, refused before anything is sent when its host is not allowed.
    pub fn get(&self, url: &str) -> Result<reqwest::RequestBuilder, GuardError> {
        let parsed = url::Url::parse(url).map_err(|e| GuardError::NotPublic(format!("an unreadable URL ({e})")))?;
        check_url(self.guard, &parsed)?;
        Ok(self.http.get(parsed))
    }
}

/// Reads `resp`'s body, at most `limit` bytes (a larger body, announced or not, is an
/// error as soon as it shows).
pub async fn read_bounded(mut resp: reqwest::Response, limit: usize) -> Result<Vec<u8>, GuardError> {
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(GuardError::TooLarge { limit });
    }
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| GuardError::Body(kind(&e).to_owned()))? {
        if out.len() + chunk.len() > limit {
            return Err(GuardError::TooLarge { limit });
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// What kind of failure a request error is, without its URL (it may carry credentials).
#[must_use]
pub fn kind(e: &reqwest::Error) -> &'static str {
    if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else if e.is_redirect() {
        "a redirect was refused"
    } else if e.is_body() || e.is_decode() {
        "the body broke off"
    } else {
        "request failed"
    }
}

/// The guard's reason, when a request error came from it (a refused address).
#[must_use]
pub fn refused(e: &reqwest::Error) -> Option<String> {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = src {
        if let Some(g) = s.downcast_ref::<GuardError>() {
            return Some(g.to_string());
        }
        src = s.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_are_public() {
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
            "224.0.0.1",
            "198.18.0.1",
        ] {
            assert!(!is_public(ip.parse().expect("ip")), "{ip}");
        }
        for ip in ["1.1.1.1", "8.8.8.8", "2606:4700::1111", "100.128.0.1"] {
            assert!(is_public(ip.parse().expect("ip")), "{ip}");
        }
    }

    #[test]
    fn ip_literal_urls_are_checked_and_names_left_to_the_resolver() {
        let g = Guard::default();
        let u = |s: &str| url::Url::parse(s).expect("url");
        assert!(check_url(g, &u("http://127.0.0.1:8080/x")).is_err());
        assert!(check_url(g, &u("http://[::1]/x")).is_err());
        assert!(check_url(g, &u("http://localhost/x")).is_err());
        assert!(check_url(g, &u("https://example.com/x")).is_ok());
        assert!(check_url(Guard { allow_private: true, ..g }, &u("http://127.0.0.1/x")).is_ok());
    }

    #[tokio::test]
    async fn a_name_that_resolves_to_loopback_is_refused() {
        let r = PublicOnly.resolve("localhost".parse().expect("name")).await;
        let err = r.err().expect("refused").to_string();
        assert!(err.contains("not a public address"), "{err}");
    }
}
