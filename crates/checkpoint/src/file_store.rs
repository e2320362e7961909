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

fn io(what: &str, path: &Path, e: std::io::Error) -> StoreError {
    StoreError::Unavailable(causes::io_while(format!("{what} {}", path.display()), e))
}

impl FileStore {
    /// Cursors under `dir`, fenced by the lease lock file `lease_file`.
    pub fn new(dir: &Path, lease_file: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| io("creating", dir, e))?;
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
        .map_err(|e| StoreError::Unavailable(Box::new(e)))?
    }

    /// The one fenced cursor write ([`crate::CursorStore::write`]), as lease holder
    /// `holder` (`<instance>:<token>`, the whole value of the lease file): a saved advance
    /// keeps the relay time and records the active relay; a rewind may lower the cursor
    /// and forgets the time.
    async fn put(&self, w: crate::Write<'_>, holder: &str) -> Result<CommitOutcome, StoreError> {
        cursor::check(w.cursor)?;
        let (fingerprint, holder) = (w.fingerprint.to_owned(), holder.to_owned());
        let crate::Write { cursor, time_ms, kind, .. } = w;
        self.blocking(move |f| match kind {
            crate::WriteKind::Advance => {
                let out = f.commit_locked(&fingerprint, cursor, &holder)?;
                if out == CommitOutcome::Saved {
                    match time_ms {
                        Some(t) => f.write_file(&format!("time-{fingerprint}"), &t.to_string())?,
                        None => f.forget_time(&fingerprint)?,
                    }
                    f.write_file("active-relay", &fingerprint)?;
                }
                Ok(out)
            }
            crate::WriteKind::Rewind => {
                if let Some(out) = f.fenced(&holder)? {
                    return Ok(out);
                }
                f.replace(&fingerprint, cursor)?;
                f.forget_time(&fingerprint)?;
                Ok(CommitOutcome::Saved)
            }
        })
        .await
    }

    /// Operator override (`firekeeper cursor set`).
    async fn force_cursor(&self, fingerprint: &str, cursor: u64) -> Result<(), StoreError> {
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
            Err(e) => Err(io("reading", &p, e)),
        }
    }

    fn holder(&self) -> Result<Option<String>, StoreError> {
        match std::fs::read_to_string(&self.lease_file) {
            Ok(s) => Ok(Some(s.trim().to_owned())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("reading", &self.lease_file, e)),
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

    /// The repo log: one line per change, `<did>\t<value>` (empty: cleared), the last
    /// line of a DID winning.
    fn repos_path(&self) -> PathBuf {
        self.dir.join("repos.log")
    }

    fn read_repos(&self) -> Result<(Vec<(String, String)>, usize), StoreError> {
        let p = self.repos_path();
        let text = match std::fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
            Err(e) => return Err(io("reading", &p, e)),
        };
        let mut map: std::collections::BTreeMap<&str, &str> = std::collections::BTreeMap::new();
        let mut lines = 0;
        // A torn last line (a crash mid-append) has no newline: it never happened.
        for line in text.split_inclusive('\n').filter(|l| l.ends_with('\n')) {
            lines += 1;
            let Some((did, value)) = line.trim_end_matches('\n').split_once('\t') else { continue };
            if value.is_empty() {
                map.remove(did);
            } else {
                map.insert(did, value);
            }
        }
        Ok((map.into_iter().map(|(d, v)| (d.to_owned(), v.to_owned())).collect(), lines))
    }

    /// Appends one change durably (fsync).
    fn append_repo(&self, did: &str, value: &str) -> Result<(), StoreError> {
        let p = self.repos_path();
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&p).map_err(|e| io("opening", &p, e))?;
        let line = format!("{did}\t{value}\n");
        f.write_all(line.as_bytes()).and_then(|()| f.sync_data()).map_err(|e| io("appending to", &p, e))
    }

    fn replace(&self, fingerprint: &str, cursor: u64) -> Result<(), StoreError> {
        self.write_file(&format!("cursor-{fingerprint}"), &cursor.to_string())
    }

    /// Replaces `dir/name` atomically and durably. The temporary file is this write's
    /// own (process id and a counter): another process writing the same file at once (an
    /// operator's `cursor set --force` beside a leader) renames its own, never ours.
    fn write_file(&self, name: &str, contents: &str) -> Result<(), StoreError> {
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = self.dir.join(name);
        let tmp = self.dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()));
        let mut f = File::create(&tmp).map_err(|e| io("creating", &tmp, e))?;
        f.write_all(contents.as_bytes()).and_then(|()| f.sync_all()).map_err(|e| io("writing", &tmp, e))?;
        std::fs::rename(&tmp, &p).map_err(|e| io("renaming", &p, e))?;
        File::open(&self.dir).and_then(|d| d.sync_all()).map_err(|e| io("syncing", &self.dir, e))
    }

    fn read_file(&self, name: &str) -> Result<Option<String>, StoreError> {
        let p = self.dir.join(name);
        match std::fs::read_to_string(&p) {
            Ok(s) => Ok(Some(s.trim().to_owned())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("reading", &p, e)),
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
            Err(e) => Err(io("removing", &p, e)),
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

    fn keeps_repos(&self) -> bool {
        true
    }

    async fn write_repo(&self, w: crate::RepoWrite<'_>, fence: crate::Fence<'_>) -> Result<CommitOutcome, StoreError> {
        if w.did.contains(['\t', '\n']) || w.value.is_some_and(|v| v.contains('\n') || v.is_empty()) {
            return Err(StoreError::Protocol(format!("repo state of {:?} cannot be kept as a line", w.did)));
        }
        let (did, value, holder) = (w.did.to_owned(), w.value.unwrap_or("").to_owned(), fence.holder.to_owned());
        self.blocking(move |f| {
            if let Some(out) = f.fenced(&holder)? {
                return Ok(out);
            }
            f.append_repo(&did, &value)?;
            Ok(CommitOutcome::Saved)
        })
        .await
    }

    async fn repos(&self) -> Result<Vec<(String, String)>, StoreError> {
        self.blocking(|f| {
            let (repos, lines) = f.read_repos()?;
            // Compact a log that grew well past what it holds.
            if lines > 1024 && lines > 2 * repos.len() {
                let mut text = String::new();
                for (d, v) in &repos {
                    text.push_str(d);
                    text.push('\t');
                    text.push_str(v);
                    text.push('\n');
                }
                f.write_file("repos.log", &text)?;
            }
            Ok(repos)
        })
        .await
    }

    async fn write(&self, w: crate::Write<'_>, fence: crate::Fence<'_>) -> Result<CommitOutcome, StoreError> {
        self.put(w, fence.holder).await
    }

    async fn read_time(&self, fingerprint: &str) -> Result<Option<i64>, StoreError> {
        let name = format!("time-{fingerprint}");
        Ok(self.blocking(move |f| f.read_file(&name)).await?.and_then(|t| t.parse().ok()))
    }

    async fn active_relay(&self) -> Result<Option<String>, StoreError> {
        self.blocking(|f| f.read_file("active-relay")).await
    }

    async fn force(&self, fingerprint: &str, cursor: u64) -> Result<(), StoreError> {
        self.force_cursor(fingerprint, cursor).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two processes writing the same cursor file at once (a leader's commit and an
    /// operator's `cursor set --force`) must each replace it whole: they used one
    /// temporary name, so one renamed the other's file away and failed with ENOENT
    /// (seen in CI). Two `Files` with their own locks stand for the two processes.
    #[test]
    fn concurrent_writers_of_one_file_never_trip_over_each_others_temporary() {
        let dir = std::env::temp_dir().join(format!("fk-file-race-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let writer = |n: u64| {
            let f = Files { dir: dir.clone(), lease_file: dir.join("lease"), lock: Mutex::new(()) };
            std::thread::spawn(move || {
                for i in 0..300 {
                    f.write_file("cursor-x", &(n * 1000 + i).to_string()).expect("a whole write");
                }
            })
        };
        let (a, b) = (writer(1), writer(2));
        a.join().expect("a");
        b.join().expect("b");
        let last: u64 = std::fs::read_to_string(dir.join("cursor-x")).expect("read").parse().expect("a cursor");
        assert!(last == 1299 || last == 2299, "one writer's last value: {last}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
