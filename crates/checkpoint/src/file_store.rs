//! The embedded default: one small file per relay in a directory, replaced atomically
//! (write a temp file, fsync, rename over, fsync the directory), fenced by the local
//! lease lock file, which holds `<instance>:<token>` of the current holder. The file
//! work (reads, writes, fsyncs) runs on tokio's blocking pool: an fsync takes
//! milliseconds, more on network volumes, and must not stall the task that commits
//! (the consumer's intake, which reads the relay between commits).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use crate::cursor::{self, CommitOutcome, ReadOutcome, StoreError};

/// Cursors in files.
#[derive(Debug)]
pub struct FileStore {
    files: Arc<Files>,
}

/// The directory and the lease file, and the blocking file work on them.
#[derive(Debug)]
struct Files {
    dir: PathBuf,
    lease_file: PathBuf,
    /// Serialises the file work of this process (a read-compare-replace must not
    /// interleave). Taken on the blocking pool around the whole of it: a caller that
    /// gives up (its term ended) does not stop work already started, so the lock must
    /// not be released with the caller's future.
    lock: Mutex<()>,
}

fn io(what: &str, path: &Path, e: &std::io::Error) -> StoreError {
    StoreError::Unavailable(format!("{what} {}: {e}", path.display()))
}

impl FileStore {
    /// Cursors under `dir`, fenced by the lease lock file `lease_file`.
    pub fn new(dir: &Path, lease_file: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| io("creating", dir, &e))?;
        let files = Files { dir: dir.to_owned(), lease_file: lease_file.to_owned(), lock: Mutex::new(()) };
        Ok(Self { files: Arc::new(files) })
    }

    /// Runs `op` on the blocking pool, holding the store's lock throughout.
    async fn blocking<T: Send + 'static>(
        &self,
        op: impl FnOnce(&Files) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let files = Arc::clone(&self.files);
        tokio::task::spawn_blocking(move || {
            let _serial = files.lock.lock().unwrap_or_else(PoisonError::into_inner);
            op(&files)
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("file store task: {e}")))?
    }

    /// Commits `cursor` with the relay time at it, and records the active relay.
    pub async fn commit_at(
        &self,
        fingerprint: &str,
        cursor: u64,
        time_ms: Option<i64>,
        holder: &str,
    ) -> Result<CommitOutcome, StoreError> {
        let (fingerprint, holder) = (fingerprint.to_owned(), holder.to_owned());
        self.blocking(move |f| {
            let out = f.commit_locked(&fingerprint, cursor, &holder)?;
            if out == CommitOutcome::Saved {
                match time_ms {
                    Some(t) => f.write_file(&format!("time-{fingerprint}"), &t.to_string())?,
                    None => f.forget_time(&fingerprint)?,
                }
                f.write_file("active-relay", &fingerprint)?;
            }
            Ok(out)
        })
        .await
    }

    /// Commits `cursor` as lease holder `holder` (`<instance>:<token>`, the whole value
    /// of the lease file).
    pub async fn commit(&self, fingerprint: &str, cursor: u64, holder: &str) -> Result<CommitOutcome, StoreError> {
        let (fingerprint, holder) = (fingerprint.to_owned(), holder.to_owned());
        self.blocking(move |f| f.commit_locked(&fingerprint, cursor, &holder)).await
    }

    /// A fenced rewind: sets the cursor even if lower, as lease holder `holder`.
    pub async fn reset(&self, fingerprint: &str, cursor: u64, holder: &str) -> Result<CommitOutcome, StoreError> {
        cursor::check(cursor)?;
        let (fingerprint, holder) = (fingerprint.to_owned(), holder.to_owned());
        self.blocking(move |f| {
            if let Some(out) = f.fenced(&holder)? {
                return Ok(out);
            }
            f.replace(&fingerprint, cursor)?;
            f.forget_time(&fingerprint)?;
            Ok(CommitOutcome::Saved)
        })
        .await
    }

    /// Operator override (`firekeeper cursor set`).
    pub async fn force(&self, fingerprint: &str, cursor: u64) -> Result<(), StoreError> {
        cursor::check(cursor)?;
        let fingerprint = fingerprint.to_owned();
        self.blocking(move |f| {
            f.replace(&fingerprint, cursor)?;
            f.forget_time(&fingerprint)
        })
        .await
    }
}

impl Files {
    fn path(&self, fingerprint: &str) -> PathBuf {
        self.dir.join(format!("cursor-{fingerprint}"))
    }

    fn read_sync(&self, fingerprint: &str) -> Result<ReadOutcome, StoreError> {
        let p = self.path(fingerprint);
        match std::fs::read(&p) {
            Ok(b) => {
                let out = cursor::classify(Some(&b));
                if let ReadOutcome::Corrupt(v) = &out {
                    tracing::error!(relay = fingerprint, value = %v, "stored cursor is corrupt");
                }
                Ok(out)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(ReadOutcome::Missing),
            Err(e) => Err(io("reading", &p, &e)),
        }
    }

    fn holder(&self) -> Result<Option<String>, StoreError> {
        match std::fs::read_to_string(&self.lease_file) {
            Ok(s) => Ok(Some(s.trim().to_owned())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("reading", &self.lease_file, &e)),
        }
    }

    /// `Some(outcome)` when `holder` is not the lease file's whole value.
    fn fenced(&self, holder: &str) -> Result<Option<CommitOutcome>, StoreError> {
        let current = self.holder()?;
        if current.as_deref() == Some(holder) {
            return Ok(None);
        }
        let current = current.and_then(|h| h.rsplit_once(':').and_then(|(_, t)| t.parse().ok()));
        Ok(Some(CommitOutcome::Fenced { current }))
    }

    fn replace(&self, fingerprint: &str, cursor: u64) -> Result<(), StoreError> {
        self.write_file(&format!("cursor-{fingerprint}"), &cursor.to_string())
    }

    /// Replaces `dir/name` atomically and durably.
    fn write_file(&self, name: &str, contents: &str) -> Result<(), StoreError> {
        let p = self.dir.join(name);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        let mut f = File::create(&tmp).map_err(|e| io("creating", &tmp, &e))?;
        f.write_all(contents.as_bytes()).and_then(|()| f.sync_all()).map_err(|e| io("writing", &tmp, &e))?;
        std::fs::rename(&tmp, &p).map_err(|e| io("renaming", &p, &e))?;
        File::open(&self.dir).and_then(|d| d.sync_all()).map_err(|e| io("syncing", &self.dir, &e))
    }

    fn read_file(&self, name: &str) -> Result<Option<String>, StoreError> {
        let p = self.dir.join(name);
        match std::fs::read_to_string(&p) {
            Ok(s) => Ok(Some(s.trim().to_owned())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("reading", &p, &e)),
        }
    }

    fn commit_locked(&self, fingerprint: &str, cursor: u64, holder: &str) -> Result<CommitOutcome, StoreError> {
        cursor::check(cursor)?;
        if let Some(out) = self.fenced(holder)? {
            return Ok(out);
        }
        if let ReadOutcome::Found(stored) = self.read_sync(fingerprint)?
            && stored >= cursor
        {
            return Ok(CommitOutcome::NotNewer { stored });
        }
        self.replace(fingerprint, cursor)?;
        Ok(CommitOutcome::Saved)
    }

    /// A cursor written without its time must not keep an older cursor's time.
    fn forget_time(&self, fingerprint: &str) -> Result<(), StoreError> {
        let p = self.dir.join(format!("time-{fingerprint}"));
        match std::fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("removing", &p, &e)),
        }
    }
}

#[async_trait::async_trait]
impl crate::CursorStore for FileStore {
    fn name(&self) -> &'static str {
        "file"
    }

    fn cursor_key(&self, fingerprint: &str) -> String {
        format!("the file {}", self.files.path(fingerprint).display())
    }

    async fn read(&self, fingerprint: &str) -> Result<ReadOutcome, StoreError> {
        let fingerprint = fingerprint.to_owned();
        self.blocking(move |f| f.read_sync(&fingerprint)).await
    }

    async fn write(&self, w: crate::Write<'_>, fence: crate::Fence<'_>) -> Result<CommitOutcome, StoreError> {
        match w.kind {
            crate::WriteKind::Advance => Self::commit_at(self, w.fingerprint, w.cursor, w.time_ms, fence.holder).await,
            crate::WriteKind::Rewind => Self::reset(self, w.fingerprint, w.cursor, fence.holder).await,
        }
    }

    async fn read_time(&self, fingerprint: &str) -> Result<Option<i64>, StoreError> {
        let name = format!("time-{fingerprint}");
        Ok(self.blocking(move |f| f.read_file(&name)).await?.and_then(|t| t.parse().ok()))
    }

    async fn active_relay(&self) -> Result<Option<String>, StoreError> {
        self.blocking(|f| f.read_file("active-relay")).await
    }

    async fn force(&self, fingerprint: &str, cursor: u64) -> Result<(), StoreError> {
        Self::force(self, fingerprint, cursor).await
    }
}
