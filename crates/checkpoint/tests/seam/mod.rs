//! The `CursorStore::write` contract, checked against every store through the seam the
//! consumer uses (the stores' own inherent methods are tested beside it).

use checkpoint::{CommitOutcome, CursorStore, Fence, ReadOutcome, Write};

/// `current` is the term holding the lease, `stale` an older term; the relay `seam` has
/// no cursor yet.
pub async fn write_contract(s: &dyn CursorStore, current: Fence<'_>, stale: Fence<'_>) {
    let fp = "seam";
    assert_eq!(s.write(Write::advance(fp, 10, Some(1_000)), current).await, Ok(CommitOutcome::Saved));
    assert_eq!(s.read(fp).await, Ok(ReadOutcome::Found(10)));
    assert_eq!(s.read_time(fp).await, Ok(Some(1_000)), "{}: an advance keeps the relay time", s.name());
    assert_eq!(s.active_relay().await, Ok(Some(fp.to_owned())), "{}: and records the relay", s.name());
    assert_eq!(
        s.write(Write::advance(fp, 9, Some(2_000)), current).await,
        Ok(CommitOutcome::NotNewer { stored: 10 }),
        "{}: an advance never lowers the cursor",
        s.name()
    );
    assert_eq!(s.read_time(fp).await, Ok(Some(1_000)), "{}: a refused advance keeps the old time", s.name());
    for w in [Write::advance(fp, 20, None), Write::rewind(fp, 3)] {
        let out = s.write(w, stale).await;
        assert!(matches!(out, Ok(CommitOutcome::Fenced { .. })), "{}: {w:?} by a stale term: {out:?}", s.name());
    }
    assert_eq!(s.read(fp).await, Ok(ReadOutcome::Found(10)), "{}: fenced writes move nothing", s.name());
    assert_eq!(s.write(Write::rewind(fp, 3), current).await, Ok(CommitOutcome::Saved));
    assert_eq!(s.read(fp).await, Ok(ReadOutcome::Found(3)), "{}: a rewind lowers the cursor", s.name());
    assert_eq!(s.read_time(fp).await, Ok(None), "{}: a rewind has no time of its own", s.name());
}
