//! Relay URLs: only `ws`/`wss`, a stable non-secret fingerprint, and a display form with
//! credentials removed.

use std::fmt;

use sha2::{Digest, Sha256};
use url::Url;

use crate::error::UrlError;

/// The XRPC path of the firehose, appended to a relay URL given as a bare host.
pub const SUBSCRIBE_PATH: &str = "/xrpc/com.atproto.sync.subscribeRepos";

/// A validated relay URL. Its `Debug` and `Display` never show credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct RelayUrl {
    url: Url,
    fingerprint: String,
}

impl RelayUrl {
    /// Parses and validates a relay URL: `ws` or `wss`, a host, no query or fragment.
    pub fn parse(s: &str) -> Result<Self, UrlError> {
        let url = Url::parse(s.trim()).map_err(UrlError::Parse)?;
        match url.scheme() {
            "ws" | "wss" => {}
            other => return Err(UrlError::Scheme(other.to_owned())),
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(UrlError::NoHost);
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(UrlError::QueryOrFragment);
        }
        let fingerprint = fingerprint(&url);
        Ok(Self { url, fingerprint })
    }

    /// sha256 hex of `<scheme>://<lowercase host>:<port or 'default'><path>`: the key
    /// under which this relay's cursor is stored, and its name in logs when it is
    /// neither primary nor secondary. Compatible with the reference TypeScript module.
    #[must_use]
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The host with its explicit port (the legacy cursor key used `<prefix>:<host>`).
    #[must_use]
    pub fn host_port(&self) -> String {
        let host = self.url.host_str().unwrap_or_default();
        match self.url.port() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_owned(),
        }
    }

    /// True when the path is `/`: only then is a legacy host-keyed cursor unambiguous.
    #[must_use]
    pub fn is_root(&self) -> bool {
        self.url.path() == "/"
    }

    /// The URL to open, with the subscribe path and the cursor parameter. It carries the
    /// credentials, so it must never be logged.
    #[must_use]
    pub fn subscribe_url(&self, cursor: Option<u64>) -> Url {
        let mut u = self.url.clone();
        if !u.path().ends_with(SUBSCRIBE_PATH) {
            let p = format!("{}{}", u.path().trim_end_matches('/'), SUBSCRIBE_PATH);
            u.set_path(&p);
        }
        if let Some(c) = cursor {
            u.query_pairs_mut().append_pair("cursor", &c.to_string());
        }
        u
    }

    /// The URL as configured (with its credentials: never logged).
    pub(crate) fn url(&self) -> &Url {
        &self.url
    }

    /// The relay's HTTP origin (`wss://host` as `https://host`, `ws://` as `http://`), for
    /// its XRPC endpoints such as `listRepos`. Never logged (it may carry credentials).
    #[must_use]
    pub fn http_origin(&self) -> Url {
        let mut u = self.url.clone();
        let scheme = if u.scheme() == "wss" { "https" } else { "http" };
        // ws/wss → http/https are both "special" schemes: the change is accepted.
        let _ = u.set_scheme(scheme);
        u.set_path("/");
        u.set_query(None);
        u
    }

    /// The URL with user and password replaced by `***`: safe for
    /// logs and status pages.
    #[must_use]
    pub fn redacted(&self) -> String {
        let mut u = self.url.clone();
        let had_creds = !u.username().is_empty() || u.password().is_some();
        let _ = u.set_username("");
        let _ = u.set_password(None);
        let s = u.to_string();
        if had_creds { s.replacen("://", "://***@", 1) } else { s }
    }
}

fn fingerprint(u: &Url) -> String {
    let port = u.port().map_or_else(|| "default".to_owned(), |p| p.to_string());
    let host = u.host_str().unwrap_or_default().to_lowercase();
    let normalized = format!("{}://{}:{}{}", u.scheme(), host, port, u.path());
    let digest = Sha256::digest(normalized.as_bytes());
    let mut hex = String::with_capacity(64);
    for b in digest {
        use fmt::Write as _;
        let _ = write!(hex, "{b:02x}");
    }
    hex
}

impl fmt::Display for RelayUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl fmt::Debug for RelayUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RelayUrl({})", self.fingerprint)
    }
}

impl std::str::FromStr for RelayUrl {
    type Err = UrlError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(s: &str) -> String {
        Sha256::digest(s.as_bytes()).iter().fold(String::new(), |mut out, b| {
            use std::fmt::Write as _;
            let _ = write!(out, "{b:02x}");
            out
        })
    }

    #[test]
    fn fingerprint_matches_the_reference_normalisation() {
        let a = RelayUrl::parse("wss://bsky.network").expect("url");
        assert_eq!(a.fingerprint(), sha("wss://bsky.network:default/"));
        // Default port, case and credentials do not change the fingerprint.
        let b = RelayUrl::parse("wss://user:secret@BSKY.network:443/").expect("url");
        assert_eq!(a.fingerprint(), b.fingerprint());
        let c = RelayUrl::parse("ws://127.0.0.1:8080/relay").expect("url");
        assert_eq!(c.fingerprint(), sha("ws://127.0.0.1:8080/relay"));
        assert!(!c.is_root());
        assert!(a.is_root());
        assert_eq!(c.host_port(), "127.0.0.1:8080");
    }

    #[test]
    fn rejects_bad_urls() {
        assert!(matches!(RelayUrl::parse("https://bsky.network"), Err(UrlError::Scheme(s)) if s == "https"));
        assert!(matches!(RelayUrl::parse("not a url"), Err(UrlError::Parse(_))));
        assert!(matches!(RelayUrl::parse("wss://h/?cursor=5"), Err(UrlError::QueryOrFragment)));
    }

    #[test]
    fn never_shows_credentials() {
        let u = RelayUrl::parse("wss://alice:hunter2@relay.example/").expect("url");
        assert!(!u.to_string().contains("hunter2"));
        assert!(!u.to_string().contains("alice"));
        assert!(!format!("{u:?}").contains("hunter2"));
        assert_eq!(u.to_string(), "wss://***@relay.example/");
        let s = u.subscribe_url(Some(42));
        assert_eq!(s.path(), SUBSCRIBE_PATH);
        assert_eq!(s.query(), Some("cursor=42"));
        let p = RelayUrl::parse("ws://h:1/xrpc/com.atproto.sync.subscribeRepos").expect("url");
        assert_eq!(p.subscribe_url(None).path(), SUBSCRIBE_PATH);
    }
}
