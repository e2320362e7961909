//! Errors that keep their cause. A library error that wraps another keeps it as its
//! `#[source]` (typed, downcastable) instead of flattening it into a `String`, and its
//! message still reads whole (`cursor store unavailable: redis 10.0.0.1:6379: connection
//! refused`) so that a log line printing `%e` says why. [`Report`] prints a chain without
//! repeating what a message already said, for the CLI and for anyhow's context layers.
//! The Redis and NATS clients' own errors are the innermost causes: their messages are
//! built never to hold credentials.

/// What an error wraps: another library's error, a [`While`], or what firekeeper itself
/// saw (a bare message: `"lock poisoned".into()`).
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An I/O error and what was being done when it happened (`locking <path>`).
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct While {
    /// What was being done.
    pub what: String,
    /// The error.
    #[source]
    pub source: std::io::Error,
}

/// Wraps `source` with what was being done.
#[must_use]
pub fn io_while(what: impl Into<String>, source: std::io::Error) -> Cause {
    Box::new(While { what: what.into(), source })
}

/// An error and every error under it, `outer: inner: innermost`, each said once: a
/// cause whose message the text so far already holds is not repeated.
pub struct Report<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut said = self.0.to_string();
        let mut next = self.0.source();
        while let Some(e) = next {
            let this = e.to_string();
            if !said.contains(&this) {
                said.push_str(": ");
                said.push_str(&this);
            }
            next = e.source();
        }
        f.write_str(&said)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wrapper in this project's style: its message holds its cause's.
    #[derive(Debug, thiserror::Error)]
    #[error("cursor store unavailable: {}", Report(.0.as_ref()))]
    struct Outer(#[source] Cause);

    /// A wrapper that says only its own part (anyhow's context layers, some libraries').
    #[derive(Debug, thiserror::Error)]
    #[error("starting")]
    struct Context(#[source] Outer);

    /// A library error whose message leaves its cause out (tokio-postgres: "db error").
    #[derive(Debug, thiserror::Error)]
    #[error("db error")]
    struct Terse(#[source] std::io::Error);

    #[test]
    fn a_report_names_every_cause_once() {
        let e = Outer(io_while("reading /data/cursor", std::io::Error::other("disk on fire")));
        assert_eq!(e.to_string(), "cursor store unavailable: reading /data/cursor: disk on fire");
        assert_eq!(Report(&e).to_string(), e.to_string(), "nothing repeated");
        let outer = Context(e);
        assert_eq!(
            Report(&outer).to_string(),
            "starting: cursor store unavailable: reading /data/cursor: disk on fire"
        );
        let bare = Outer("lock poisoned".into());
        assert_eq!(Report(&bare).to_string(), "cursor store unavailable: lock poisoned");
        let terse = Outer(Box::new(Terse(std::io::Error::other("password authentication failed"))));
        assert_eq!(terse.to_string(), "cursor store unavailable: db error: password authentication failed");
        assert!(
            std::error::Error::source(&terse).and_then(|c| c.downcast_ref::<Terse>()).is_some(),
            "the cause is kept, typed"
        );
    }
}
