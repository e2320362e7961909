//! The term's side of repo sync: the resync worker runs beside intake for the term, and
//! each snapshot it readies is staged in its repo's lane here, where the stream's order
//! is known.

use std::collections::HashMap;

use tokio::sync::mpsc;

use super::{Leader, Stop};
use crate::continuity::Key;
use crate::pipeline::SnapshotWork;
use crate::resync::{Ready, STALE};

/// Snapshots remembered per term for dropping the events they cover; past this many the
/// oldest are forgotten (a late event of such a repo is then handed over as usual).
const COVERED_MAX: usize = 100_000;

/// The resync worker of one term, stopped when the term ends.
pub(super) struct ResyncRun {
    ready: mpsc::Receiver<Ready>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ResyncRun {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts the term's resync worker, when repo sync runs; `memory` (with `lanes` shards)
/// answers what the term handed over, for the reconcile after a gap.
pub(super) fn start(
    cx: &super::Ctx<'_>,
    ctx: crate::handler::BatchCtx,
    memory: Option<std::sync::Arc<crate::continuity::Memory>>,
    lanes: usize,
) -> Option<ResyncRun> {
    let r = cx.shape.resyncer.clone()?;
    let (tx, ready) = mpsc::channel(16);
    let known = memory.map(|m| -> crate::resync::Known {
        std::sync::Arc::new(move |did| m.last_commit(crate::pipeline::lane_of(Some(did), lanes), did))
    });
    let task = tokio::spawn(r.run(cx.status.desync(), cx.shape.store.clone(), ctx, tx, known));
    Some(ResyncRun { ready, task })
}

/// The next snapshot ready; never resolves without a worker.
pub(super) async fn next_ready(r: &mut Option<ResyncRun>) -> Option<Ready> {
    match r {
        Some(r) => r.ready.recv().await,
        None => std::future::pending().await,
    }
}

impl Leader<'_, '_> {
    /// Stages a verified snapshot in its repo's lane, after the events of the repo sent
    /// so far; later events it covers are dropped. A snapshot older than a commit of the
    /// repo already handed over is sent back as stale (fetched again).
    pub(super) async fn stage_snapshot(&mut self, r: Ready) -> Result<(), Stop> {
        let Ready { work, done } = r;
        let did = work.did().to_owned();
        let lane = self.p.lane_of(Some(&did));
        let last = self.memory.as_ref().and_then(|m| m.last_commit(lane, &did));
        let snapshot = match work {
            SnapshotWork::Local(s) => s,
            SnapshotWork::Remote(mut job) => {
                // A shared job: its worker refuses a snapshot older than what went before
                // its turn; the lane drops what it covers once it lands.
                job.min_rev = last;
                return self.push(lane, SnapshotWork::Remote(job), done).await;
            }
        };
        let rev = crate::chain::tid(snapshot.rev());
        if let (Some(last), Some(rev)) = (last, rev)
            && last > rev
        {
            let _ = done.send(Err(STALE.to_owned()));
            return Ok(());
        }
        let repo = snapshot.repo.clone();
        self.push(lane, SnapshotWork::Local(snapshot), done).await?;
        // The repo's chain continues from the snapshot.
        if let Some(m) = &self.memory {
            m.record(lane, Key::Sync { did: &did, rev: &repo.rev });
        }
        if let (Some(v), Some(rev)) = (&self.cx.shape.verifier, rev) {
            v.resynced(lane, &did, rev, &repo.data_cid);
        }
        if let Some(rev) = rev {
            if self.covered.len() >= COVERED_MAX {
                self.covered.clear();
            }
            self.covered.insert(did, rev);
        }
        Ok(())
    }

    /// Hands `work` to its lane after the events staged for it.
    async fn push(&mut self, lane: usize, work: SnapshotWork, done: crate::pipeline::SnapshotDone) -> Result<(), Stop> {
        if self.p.has_staged_in(lane) {
            self.send(lane).await?;
        }
        if !self.p.push_snapshot(lane, work, done) {
            return self.lane_gone().await;
        }
        Ok(())
    }
}

/// Repos whose snapshot this term handed over, and its rev (a TID value).
pub(super) type Covered = HashMap<String, u64>;
