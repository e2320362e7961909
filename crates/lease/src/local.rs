//! The local backend: one host, a lock file. The OS lock (`flock`) is the lease, so a
//! crashed process frees it at once; the fence counter lives in a file beside it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use crate::backend::{Acquire, Backend, BackendError, Renew, Snapshot, parse_holder};

/// A lease held as an exclusive lock on a file.
#[derive(Debug)]
pub struct LocalBackend {
    lock_path: PathBuf,
    fence_path: PathBuf,
    deployment_path: PathBuf,
    held: Mutex<Option<(File, String)>>,
    released: Arc<Notify>,
}

fn io(what: &str, e: std::io::Error) -> BackendError {
    BackendError::Unavailable(causes::io_while(what, e))
}

impl LocalBackend {
    /// Uses `<path>` as the lock file and `<path>.fence` as the counter.
    #[must_use]
    pub fn new(path: &Path) -> Self {
        let beside = |ext: &str| {
            let mut p = path.as_os_str().to_owned();
            p.push(ext);
            PathBuf::from(p)
        };
        Self {
            lock_path: path.to_owned(),
            fence_path: beside(".fence"),
            deployment_path: beside(".deployment"),
            held: Mutex::new(None),
            released: Arc::new(Notify::new()),
        }
    }

    fn read_fence(&self) -> Result<u64, BackendError> {
        match std::fs::read_to_string(&self.fence_path) {
            Ok(s) => s.trim().parse().map_err(|_| BackendError::Protocol(format!("fence file holds {s:?}"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
            Err(e) => Err(io("reading fence file", e)),
        }
    }

    fn write_fence(&self, v: u64) -> Result<(), BackendError> {
        write_durably(&self.fence_path, v.to_string().as_bytes(), "fence file")
    }

    /// The holder named in the lock file, only while a process (this one or another)
    /// holds the lock: a process killed without releasing leaves its name behind.
    fn live_holder(&self) -> Option<String> {
        if let Ok(held) = self.held.lock()
            && let Some((_, v)) = held.as_ref()
        {
            return Some(v.clone());
        }
        let f = OpenOptions::new().read(true).write(true).open(&self.lock_path).ok()?;
        match f.try_lock() {
            Ok(()) => {
                let _ = f.unlock();
                None
            }
            Err(_) => self.read_holder(),
        }
    }

    fn read_holder(&self) -> Option<String> {
        let s = std::fs::read_to_string(&self.lock_path).ok()?;
        let s = s.trim();
        (!s.is_empty()).then(|| s.to_owned())
    }
}

#[async_trait::async_trait]
impl Backend for LocalBackend {
    async fn acquire(&self, instance: &str, _ttl: Duration, floor: u64) -> Result<Acquire, BackendError> {
        let mut held = self.held.lock().map_err(|_| BackendError::Unavailable("lock poisoned".into()))?;
        if let Some((_, v)) = held.as_ref() {
            return Ok(Acquire::Held { holder: v.clone(), expires_in: Some(Duration::ZERO) });
        }
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.lock_path)
            .map_err(|e| io("opening lock file", e))?;
        match f.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut s = String::new();
                let _ = f.read_to_string(&mut s);
                // The OS lock is the lease: its holder leads exactly while it holds it,
                // so there is no expiry to wait out once it is free.
                return Ok(Acquire::Held { holder: s.trim().to_owned(), expires_in: Some(Duration::ZERO) });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io("locking lock file", e)),
        }
        let token = self.read_fence()?.max(floor) + 1;
        self.write_fence(token)?;
        let value = format!("{instance}:{token}");
        f.set_len(0)
            .and_then(|()| f.seek(SeekFrom::Start(0)))
            .and_then(|_| f.write_all(value.as_bytes()))
            .and_then(|()| f.sync_all())
            .map_err(|e| io("writing lock file", e))?;
        *held = Some((f, value));
        Ok(Acquire::Acquired { token })
    }

    async fn renew(&self, instance: &str, token: u64, _ttl: Duration) -> Result<Renew, BackendError> {
        let held = self.held.lock().map_err(|_| BackendError::Unavailable("lock poisoned".into()))?;
        match held.as_ref() {
            Some((_, v)) if *v == format!("{instance}:{token}") => Ok(Renew::Renewed),
            Some((_, v)) => Ok(Renew::TakenBy { holder: v.clone() }),
            None => Ok(Renew::Fenced { fence: self.read_fence().ok() }),
        }
    }

    async fn release(&self, instance: &str) -> Result<bool, BackendError> {
        let mut held = self.held.lock().map_err(|_| BackendError::Unavailable("lock poisoned".into()))?;
        let ours = held.as_ref().and_then(|(_, v)| parse_holder(v)).is_some_and(|(i, _)| i == instance);
        if !ours {
            return Ok(false);
        }
        if let Some((f, _)) = held.take() {
            let _ = f.set_len(0);
            let _ = f.unlock();
        }
        self.released.notify_waiters();
        Ok(true)
    }

    async fn seed_fence(&self, min: u64) -> Result<u64, BackendError> {
        let f = self.read_fence()?;
        if min > f {
            self.write_fence(min)?;
        }
        Ok(f.max(min))
    }

    async fn snapshot(&self) -> Result<Snapshot, BackendError> {
        let fence = self.read_fence()?;
        Ok(Snapshot { holder: self.live_holder(), fence, fence_seen: fence, ttl: None })
    }

    fn release_signal(&self) -> Option<Arc<Notify>> {
        Some(self.released.clone())
    }

    async fn deployment(&self) -> Result<Option<(u64, String)>, BackendError> {
        match std::fs::read_to_string(&self.deployment_path) {
            Ok(s) => crate::backend::split_deployment(&s).map(Some).ok_or_else(|| {
                BackendError::Protocol(format!("{} is not <token>\\n<settings>", self.deployment_path.display()))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("reading the settings record", e)),
        }
    }

    async fn set_deployment(&self, token: u64, record: &str) -> Result<bool, BackendError> {
        if self.deployment().await.ok().flatten().is_some_and(|(t, _)| t > token) {
            return Ok(false);
        }
        write_durably(&self.deployment_path, format!("{token}\n{record}").as_bytes(), "settings record")?;
        Ok(true)
    }
}

/// Writes `bytes` to `path` through a synced temporary file and a rename, then syncs
/// the directory: a crash leaves the old content or the new, never a torn one.
fn write_durably(path: &Path, bytes: &[u8], what: &str) -> Result<(), BackendError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = File::create(&tmp).map_err(|e| io(&format!("writing {what}"), e))?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(|e| io(&format!("writing {what}"), e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(&format!("renaming {what}"), e))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io("syncing lease directory", e))?;
    }
    Ok(())
}
