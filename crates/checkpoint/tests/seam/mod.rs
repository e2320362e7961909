//! The `CursorStore::write` contract, checked against every store through the seam the
//! consumer uses; the helpers below ([`Writes`]) give the store suites the same one path.

use checkpoint::{CommitOutcome, CursorStore, Fence, ReadOutcome, StoreError, Write};

/// `current` is the term holding the lease, `stale` an older term; the relay `seam` has
/// no cursor yet.
pub async fn write_contract(s: &dyn CursorStore, current: Fence<'_>, stale: Fence<'_>) {
    let fp = "seam";
    assert_eq!(
        s.write(Write::advance(fp, 10, Some(1_000)), current).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Saved)
    );
    assert_eq!(s.read(fp).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(10)));
    assert_eq!(
        s.read_time(fp).await.map_err(|e| e.to_string()),
        Ok(Some(1_000)),
        "{}: an advance keeps the relay time",
        s.name()
    );
    assert_eq!(
        s.active_relay().await.map_err(|e| e.to_string()),
        Ok(Some(fp.to_owned())),
        "{}: and records the relay",
        s.name()
    );
    assert_eq!(
        s.write(Write::advance(fp, 9, Some(2_000)), current).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::NotNewer { stored: 10 }),
        "{}: an advance never lowers the cursor",
        s.name()
    );
    assert_eq!(
        s.read_time(fp).await.map_err(|e| e.to_string()),
        Ok(Some(1_000)),
        "{}: a refused advance keeps the old time",
        s.name()
    );
    for w in [Write::advance(fp, 20, None), Write::rewind(fp, 3)] {
        let out = s.write(w, stale).await;
        assert!(matches!(out, Ok(CommitOutcome::Fenced { .. })), "{}: {w:?} by a stale term: {out:?}", s.name());
    }
    assert_eq!(
        s.read(fp).await.map_err(|e| e.to_string()),
        Ok(ReadOutcome::Found(10)),
        "{}: fenced writes move nothing",
        s.name()
    );
    assert_eq!(s.write(Write::rewind(fp, 3), current).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(
        s.read(fp).await.map_err(|e| e.to_string()),
        Ok(ReadOutcome::Found(3)),
        "{}: a rewind lowers the cursor",
        s.name()
    );
    assert_eq!(
        s.read_time(fp).await.map_err(|e| e.to_string()),
        Ok(None),
        "{}: a rewind has no time of its own",
        s.name()
    );
}

/// The repo-state contract: the current term sets, overwrites and clears repo states; a
/// stale term's writes are refused and change nothing; DIDs of every spelling round-trip.
pub async fn repo_contract(s: &dyn CursorStore, current: Fence<'_>, stale: Fence<'_>) {
    use checkpoint::RepoWrite;
    let name = s.name();
    assert!(s.keeps_repos(), "{name} keeps repo states");
    s.on_elected(current, &[]).await.expect("elected");
    let set = |did, value| RepoWrite { did, value: Some(value) };
    let web = "did:web:host.example%3A8080";
    for (w, f) in [
        (set("did:plc:aaa", r#"{"reason":"chain","n":1}"#), current),
        (set("did:plc:bbb", "{}"), current),
        (set("did:plc:aaa", r#"{"reason":"signature","n":2}"#), current),
        (set(web, r#"{"reason":"unresolved"}"#), current),
    ] {
        assert_eq!(s.write_repo(w, f).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved), "{name}: {w:?}");
    }
    let mut want = vec![
        ("did:plc:aaa".to_owned(), r#"{"reason":"signature","n":2}"#.to_owned()),
        ("did:plc:bbb".to_owned(), "{}".to_owned()),
        (web.to_owned(), r#"{"reason":"unresolved"}"#.to_owned()),
    ];
    let sorted = |mut v: Vec<(String, String)>| {
        v.sort();
        v
    };
    assert_eq!(sorted(s.repos().await.expect("repos")), want, "{name}: the last write of each wins");
    for w in [set("did:plc:ccc", "{}"), RepoWrite { did: "did:plc:aaa", value: None }] {
        let out = s.write_repo(w, stale).await;
        assert!(matches!(out, Ok(CommitOutcome::Fenced { .. })), "{name}: {w:?} by a stale term: {out:?}");
    }
    assert_eq!(sorted(s.repos().await.expect("repos")), want, "{name}: fenced writes change nothing");
    let clear = RepoWrite { did: "did:plc:aaa", value: None };
    assert_eq!(s.write_repo(clear, current).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    want.remove(0);
    assert_eq!(sorted(s.repos().await.expect("repos")), want, "{name}: a cleared repo is gone");
}

/// A term's fence as the tests name it: a holder value (`"a:1"`, whose token follows the
/// last colon; a value without one keeps token 0), a [`Fence`], or a bare token.
pub struct Holder {
    holder: String,
    token: u64,
}

impl Holder {
    fn fence(&self) -> Fence<'_> {
        Fence { holder: &self.holder, token: self.token }
    }
}

impl From<&str> for Holder {
    fn from(holder: &str) -> Self {
        let token = holder.rsplit_once(':').and_then(|(_, t)| t.parse().ok()).unwrap_or(0);
        Self { holder: holder.to_owned(), token }
    }
}

impl From<&String> for Holder {
    fn from(holder: &String) -> Self {
        Self::from(holder.as_str())
    }
}

impl From<Fence<'_>> for Holder {
    fn from(f: Fence<'_>) -> Self {
        Self { holder: f.holder.to_owned(), token: f.token }
    }
}

impl From<u64> for Holder {
    fn from(token: u64) -> Self {
        Self { holder: format!("term:{token}"), token }
    }
}

/// The writes the store tests make, each through [`CursorStore::write`] (the one write
/// path every store has): an advance without or with the relay time, and a rewind.
#[allow(async_fn_in_trait, dead_code)] // test helpers; not every suite uses each
pub trait Writes: CursorStore {
    /// A monotonic commit of `cursor` with no relay time.
    async fn commit(&self, fp: &str, cursor: u64, h: impl Into<Holder>) -> Result<CommitOutcome, StoreError> {
        self.write(Write::advance(fp, cursor, None), h.into().fence()).await
    }

    /// A monotonic commit of `cursor` keeping the relay time at it.
    async fn commit_at(
        &self,
        fp: &str,
        cursor: u64,
        time_ms: Option<i64>,
        h: impl Into<Holder>,
    ) -> Result<CommitOutcome, StoreError> {
        self.write(Write::advance(fp, cursor, time_ms), h.into().fence()).await
    }

    /// The election's claim of the store by `token` (what the Postgres fence table sees).
    async fn claim(&self, token: u64) -> Result<(), StoreError> {
        self.on_elected(Holder::from(token).fence(), &[]).await
    }

    /// A fenced rewind to `cursor`.
    async fn reset(&self, fp: &str, cursor: u64, h: impl Into<Holder>) -> Result<CommitOutcome, StoreError> {
        self.write(Write::rewind(fp, cursor), h.into().fence()).await
    }
}

impl<T: CursorStore + ?Sized> Writes for T {}
