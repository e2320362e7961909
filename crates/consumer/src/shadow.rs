//! What a replica keeps on its own disk about the lease and cursor store: the highest
//! token it has seen and the last cursor it saw committed per relay.
//!
//! The store is the authority; this is what survives when the store does not (a Redis
//! restarted without persistence, a `FLUSHALL`, a restored old backup). A replica that
//! starts again on the same disk then takes tokens above every one it saw, and resumes
//! where the last commit it saw left off instead of refusing (or, worse, skipping).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// The remembered state.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Recollection {
    /// The highest lease token seen (held or observed on another holder).
    pub token: u64,
    /// Relay fingerprint → the last cursor seen committed.
    pub cursors: BTreeMap<String, u64>,
}

/// Why the recollection could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum ShadowError {
    /// The file could not be read, written or renamed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a recollection (it is then ignored, never trusted in part).
    #[error("{path} is not a firekeeper shadow file: {source}")]
    Format {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
}

/// Where a recollection is kept: a file in the binary, memory in tests.
pub trait Shadow: Send + Sync {
    /// The last saved recollection; `None` when there is none yet.
    ///
    /// # Errors
    /// When it exists and cannot be read or parsed.
    fn load(&self) -> Result<Option<Recollection>, ShadowError>;

    /// Replaces the saved recollection; durable when it returns.
    ///
    /// # Errors
    /// When it cannot be written.
    fn save(&self, r: &Recollection) -> Result<(), ShadowError>;
}

/// A JSON file, replaced atomically (written beside it, fsynced, renamed).
#[derive(Debug, Clone)]
pub struct ShadowFile {
    path: PathBuf,
}

impl ShadowFile {
    /// The shadow kept at `path` (its directory is created on the first save).
    #[must_use]
    pub fn new(path: &Path) -> Self {
        Self { path: path.to_owned() }
    }

    fn io(&self, source: std::io::Error) -> ShadowError {
        ShadowError::Io { path: self.path.clone(), source }
    }
}

impl Shadow for ShadowFile {
    fn load(&self) -> Result<Option<Recollection>, ShadowError> {
        match std::fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|source| ShadowError::Format { path: self.path.clone(), source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.io(e)),
        }
    }

    fn save(&self, r: &Recollection) -> Result<(), ShadowError> {
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| self.io(e))?;
        }
        // Unique per process: replicas sharing a data directory never write one temp file.
        let tmp = self.path.with_extension(format!("tmp.{}", std::process::id()));
        let body = serde_json::to_vec(r).map_err(|source| ShadowError::Format { path: self.path.clone(), source })?;
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&body)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.path)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            self.io(e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_recollection_loads_back_and_a_torn_one_is_an_error() {
        let dir = std::env::temp_dir().join(format!("fk-shadow-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let s = ShadowFile::new(&dir.join("sub").join("shadow.json"));
        assert!(s.load().expect("absent is fine").is_none());
        let r = Recollection { token: 9, cursors: [("abc".to_owned(), 1234)].into() };
        s.save(&r).expect("save");
        assert_eq!(s.load().expect("load"), Some(r));
        std::fs::write(dir.join("sub").join("shadow.json"), b"{\"token\": 9, \"curs").expect("tear");
        assert!(matches!(s.load(), Err(ShadowError::Format { .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
