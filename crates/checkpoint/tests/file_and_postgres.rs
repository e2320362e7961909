//! The file store (embedded default) and the Postgres store against a real server.

use std::sync::Arc;
use std::time::Duration;

use checkpoint::{CommitOutcome, CursorStore as _, Fence, FileStore, PostgresStore, ReadOutcome, StoreError, Write};
use testkit::PgServer;

const FP: &str = "0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c";

use testkit::tmpdir;

mod seam;
use seam::Writes as _;

#[tokio::test]
async fn the_file_write_seam_advances_rewinds_and_fences() {
    let dir = tmpdir("seam");
    let lease = dir.join("lease");
    std::fs::write(&lease, "x:3").expect("lease");
    let s = FileStore::new(&dir.join("c"), &lease).expect("store");
    let (current, stale) =
        (checkpoint::Fence { holder: "x:3", token: 3 }, checkpoint::Fence { holder: "w:2", token: 2 });
    seam::write_contract(&s, current, stale).await;
    seam::repo_contract(&s, current, stale).await;
    // A new process reads the log the last one appended.
    let again = FileStore::new(&dir.join("c"), &lease).expect("store");
    assert_eq!(checkpoint::CursorStore::repos(&again).await.expect("repos").len(), 2);
}

/// A file store that cannot write keeps the I/O error as the cause (its kind can be
/// asked), and says what it was doing and where.
#[tokio::test]
async fn a_file_store_error_keeps_its_io_cause() {
    let dir = tmpdir("io-cause");
    let lease = dir.join("lease");
    std::fs::write(&lease, "x:3").expect("lease");
    let s = FileStore::new(&dir.join("c"), &lease).expect("store");
    // The cursor's file is a directory: it cannot be written.
    std::fs::create_dir_all(dir.join("c").join(format!("cursor-{FP}"))).expect("dir");
    let e = s.write(Write::advance(FP, 5, None), Fence { holder: "x:3", token: 3 }).await.expect_err("not writable");
    let StoreError::Unavailable(cause) = &e else { panic!("{e:?}") };
    let io = cause.downcast_ref::<causes::While>().map(|w| w.source.kind());
    assert!(io.is_some(), "{cause:?}");
    assert!(e.to_string().contains(&format!("cursor-{FP}")), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_write_seam_advances_rewinds_and_fences() {
    let pg = PgServer::start();
    let s = PostgresStore::connect(&pg.url(), Duration::from_secs(5)).await.expect("connect");
    assert_eq!(s.claim(3).await.map_err(|e| e.to_string()), Ok(()));
    let (current, stale) =
        (checkpoint::Fence { holder: "x:3", token: 3 }, checkpoint::Fence { holder: "w:2", token: 2 });
    seam::write_contract(&s, current, stale).await;
    seam::repo_contract(&s, current, stale).await;
}

/// The file work runs off the runtime's threads: a commit whose file I/O blocks (here the
/// lease file is a FIFO no one has opened for writing yet; in life an fsync on a slow
/// volume) leaves the runtime free for the rest of the consumer. One runtime thread, so a
/// blocked thread would stop everything.
#[tokio::test(flavor = "current_thread")]
async fn a_commit_blocked_in_file_io_does_not_stall_the_runtime() {
    let dir = tmpdir("file-fifo");
    let lease_file = dir.join("lease.lock");
    let made = std::process::Command::new("mkfifo").arg(&lease_file).status().expect("mkfifo");
    assert!(made.success());
    let s = Arc::new(FileStore::new(&dir.join("cursors"), &lease_file).expect("store"));
    // The writer end opens when the test says so, or after a while in any case (so a
    // store that blocks the runtime fails the test instead of hanging it).
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let fifo = lease_file.clone();
    let writer = std::thread::spawn(move || {
        let _ = wait.recv_timeout(Duration::from_secs(5));
        std::fs::write(fifo, "a:1").expect("write the FIFO");
    });
    let store = s.clone();
    let commit = tokio::spawn(async move { store.commit(FP, 5, "a:1").await });
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!commit.is_finished(), "other tasks ran while the commit waited in its file I/O");
    go.send(()).expect("writer thread");
    assert_eq!(commit.await.expect("join").map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    writer.join().expect("writer");
}

/// A caller that gives up on a commit (its term ended) does not stop the file work it
/// started, so the store's lock must outlive the caller: the next commit waits for that
/// work instead of interleaving its read-compare-replace with it. Here the first commit's
/// cursor file is a FIFO, so its read blocks until the test writes to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_caller_gave_up_still_holds_the_store_until_its_work_is_done() {
    const FP2: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    let dir = tmpdir("file-abandoned");
    let lease_file = dir.join("lease.lock");
    std::fs::write(&lease_file, "a:1").expect("lease");
    let s = Arc::new(FileStore::new(&dir.join("cursors"), &lease_file).expect("store"));
    let fifo = dir.join("cursors").join(format!("cursor-{FP}"));
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo").success());
    // The FIFO's writer: when the test says so, or after a while in any case (a failing
    // test must not leave the read blocked forever).
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let writer = std::thread::spawn(move || {
        let _ = wait.recv_timeout(Duration::from_secs(5));
        std::fs::write(fifo, "7").expect("write the FIFO");
    });
    let given_up = tokio::time::timeout(Duration::from_millis(200), s.commit(FP, 9, "a:1")).await;
    assert!(given_up.is_err(), "the first commit is still reading its FIFO when its caller gives up");
    let store = s.clone();
    let second = tokio::spawn(async move { store.commit(FP2, 5, "a:1").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!second.is_finished(), "the second commit waits for the abandoned one's file work");
    go.send(()).expect("writer thread");
    writer.join().expect("writer");
    assert_eq!(second.await.expect("join").map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(
        s.read(FP).await.map_err(|e| e.to_string()),
        Ok(ReadOutcome::Found(9)),
        "the abandoned commit finished its work"
    );
}

#[tokio::test]
async fn file_store_is_fenced_by_the_lease_file_monotonic_and_atomic() {
    let dir = tmpdir("file");
    let lease_file = dir.join("lease.lock");
    let s = FileStore::new(&dir.join("cursors"), &lease_file).expect("store");
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Missing));
    assert_eq!(
        s.commit(FP, 5, "a:1").await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: None }),
        "no lease held"
    );
    std::fs::write(&lease_file, "a:1").expect("lease");
    assert_eq!(s.commit(FP, 5, "a:1").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.commit(FP, 4, "a:1").await.map_err(|e| e.to_string()), Ok(CommitOutcome::NotNewer { stored: 5 }));
    std::fs::write(&lease_file, "b:2").expect("lease");
    assert_eq!(
        s.commit(FP, 9, "a:1").await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: Some(2) }),
        "stale token"
    );
    assert_eq!(
        s.commit(FP, 9, "a:2").await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: Some(2) }),
        "the same token number under another instance is not the holder"
    );
    assert_eq!(s.commit(FP, 9, "b:2").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(
        s.reset(FP, 3, "a:2").await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: Some(2) }),
        "a rewind is fenced too"
    );
    assert_eq!(s.reset(FP, 3, "b:2").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(3)), "a fenced rewind may go lower");
    assert_eq!(s.commit(FP, 9, "b:2").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(9)));
    let names: Vec<_> =
        std::fs::read_dir(dir.join("cursors")).expect("dir").map(|e| e.expect("entry").file_name()).collect();
    assert_eq!(names.len(), 2, "the cursor and the active relay, no temp file left behind: {names:?}");
    std::fs::write(dir.join("cursors").join(format!("cursor-{FP}")), "12abc").expect("corrupt");
    assert!(matches!(s.read(FP).await, Ok(ReadOutcome::Corrupt(_))));
    assert!(
        matches!(s.commit(FP, checkpoint::MAX_SEQ + 1, "b:2").await, Err(StoreError::OutOfRange(n)) if n == checkpoint::MAX_SEQ + 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_fences_by_highest_token_and_commits_inside_a_callers_transaction() {
    let mut pg = PgServer::start();
    let s = PostgresStore::connect(&pg.url(), Duration::from_secs(5)).await.expect("connect");
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Missing));
    assert_eq!(s.claim(3).await.map_err(|e| e.to_string()), Ok(()));
    assert_eq!(s.commit(FP, 100, 3).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.commit(FP, 90, 3).await.map_err(|e| e.to_string()), Ok(CommitOutcome::NotNewer { stored: 100 }));
    // A new term claims; the old one is refused from then on.
    assert_eq!(s.fence_floor().await.map_err(|e| e.to_string()), Ok(Some(3)));
    assert_eq!(s.claim(4).await.map_err(|e| e.to_string()), Ok(()));
    assert_eq!(s.commit(FP, 200, 3).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Fenced { current: Some(4) }));
    assert!(matches!(s.claim(3).await, Err(StoreError::Protocol(m)) if m.contains("Some(4)")), "a newer term claimed");
    assert_eq!(s.commit(FP, 150, 4).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(150)));
    assert_eq!(
        s.reset(FP, 40, 3).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: Some(4) }),
        "a rewind is fenced"
    );
    assert_eq!(s.reset(FP, 40, 4).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(40)), "a fenced rewind may go lower");
    assert_eq!(s.commit(FP, 150, 4).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));

    // Inside a caller's transaction with its own rows: a fenced commit means rollback,
    // and neither the rows nor the cursor land.
    let (mut client, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls).await.expect("client");
    tokio::spawn(conn);
    client.batch_execute("CREATE TABLE events (seq bigint PRIMARY KEY)").await.expect("table");
    let tx = client.transaction().await.expect("tx");
    tx.execute("INSERT INTO events VALUES (151)", &[]).await.expect("row");
    let out = PostgresStore::write_in(&tx, Write::advance(FP, 151, None), Fence { holder: "t:3", token: 3 })
        .await
        .expect("write_in");
    assert_eq!(out, CommitOutcome::Fenced { current: Some(4) });
    tx.rollback().await.expect("rollback");
    let tx = client.transaction().await.expect("tx");
    tx.execute("INSERT INTO events VALUES (151)", &[]).await.expect("row");
    assert_eq!(
        PostgresStore::write_in(&tx, Write::advance(FP, 151, None), Fence { holder: "t:4", token: 4 })
            .await
            .map_err(|e| e.to_string()),
        Ok(CommitOutcome::Saved)
    );
    tx.commit().await.expect("commit");
    let n: i64 = client.query_one("SELECT count(*) FROM events", &[]).await.expect("count").get(0);
    assert_eq!(n, 1);
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(151)));

    // Concurrent committers on separate connections: the maximum wins, stale never lands.
    let stores: Vec<Arc<PostgresStore>> = futures(4, &pg.url()).await;
    let mut tasks = Vec::new();
    for i in 0..80u64 {
        let st = stores[(i % 4) as usize].clone();
        tasks.push(tokio::spawn(async move {
            let token = if i % 5 == 0 { 3 } else { 4 };
            (token, st.commit(FP, 1000 + i, token).await.expect("commit"))
        }));
    }
    for t in tasks {
        let (token, out) = t.await.expect("task");
        if token == 3 {
            assert!(matches!(out, CommitOutcome::Fenced { .. }), "stale token landed: {out:?}");
        }
    }
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(1079)));

    // Down: fail closed. Back: the same store works again (issue 39: it never reconnected,
    // and 50 commits in 10 s after a restart all failed).
    pg.kill();
    assert!(matches!(s.read(FP).await, Err(StoreError::Unavailable(_))));
    pg.restart();
    testkit::eventually("the store reads again", testkit::WAIT, async || s.read(FP).await.is_ok()).await;
    assert_eq!(s.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(1079)), "durable across a restart");
    assert_eq!(s.commit(FP, 2000, 4).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved), "and commits again");
}

async fn futures(n: usize, url: &str) -> Vec<Arc<PostgresStore>> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(Arc::new(PostgresStore::connect(url, Duration::from_secs(5)).await.expect("connect")));
    }
    v
}

/// As for Redis: time and active relay move only with a saved, fenced commit.
#[tokio::test]
async fn file_commit_at_keeps_time_and_active_relay_fenced() {
    let dir = tmpdir("time");
    let lease = dir.join("lease");
    std::fs::write(&lease, "x:3").expect("lease");
    let s = FileStore::new(&dir.join("c"), &lease).expect("store");
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(None));
    assert_eq!(s.commit_at(FP, 10, Some(77), "x:3").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(Some(77)));
    assert_eq!(s.active_relay().await.map_err(|e| e.to_string()), Ok(Some(FP.to_owned())));
    assert!(matches!(s.commit_at("other", 11, Some(5), "x:2").await, Ok(CommitOutcome::Fenced { .. })));
    assert_eq!(s.active_relay().await.map_err(|e| e.to_string()), Ok(Some(FP.to_owned())));
    assert_eq!(s.reset(FP, 4, "x:3").await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(None));
}

/// As for Redis and files: time and active relay move only with a saved, fenced commit;
/// a rewind or an operator's `cursor set` forgets the time; cursors stored by a version
/// before the time column keep their seq.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_commit_at_keeps_time_and_active_relay_fenced_and_old_cursors_migrate() {
    let pg = PgServer::start();
    // A database as the previous version left it: cursors without a time column.
    let (old, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls).await.expect("client");
    tokio::spawn(conn);
    old.batch_execute(include_str!("../../../migrations/0001_cursors.sql")).await.expect("old schema");
    old.execute("INSERT INTO firekeeper_cursors (relay, cursor, token) VALUES ($1, 42, 2)", &[&FP])
        .await
        .expect("old cursor");
    let s = PostgresStore::connect(&pg.url(), Duration::from_secs(5)).await.expect("connect migrates");
    assert_eq!(
        s.read(FP).await.map_err(|e| e.to_string()),
        Ok(ReadOutcome::Found(42)),
        "the old cursor survives the migration"
    );
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(None), "with no time");
    assert_eq!(s.active_relay().await.map_err(|e| e.to_string()), Ok(None));
    assert_eq!(s.claim(3).await.map_err(|e| e.to_string()), Ok(()));
    assert_eq!(s.commit_at(FP, 50, Some(77), 3).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(Some(77)));
    assert_eq!(s.active_relay().await.map_err(|e| e.to_string()), Ok(Some(FP.to_owned())));
    assert_eq!(
        s.commit_at(FP, 49, Some(99), 3).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::NotNewer { stored: 50 })
    );
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(Some(77)), "a refused commit leaves the time");
    assert_eq!(s.claim(4).await.map_err(|e| e.to_string()), Ok(()));
    assert_eq!(
        s.commit_at("other", 11, Some(5), 3).await.map_err(|e| e.to_string()),
        Ok(CommitOutcome::Fenced { current: Some(4) })
    );
    assert_eq!(
        s.active_relay().await.map_err(|e| e.to_string()),
        Ok(Some(FP.to_owned())),
        "a fenced commit moves nothing"
    );
    assert_eq!(s.read_time("other").await.map_err(|e| e.to_string()), Ok(None));
    assert_eq!(s.commit_at("other", 11, Some(5), 4).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(
        s.active_relay().await.map_err(|e| e.to_string()),
        Ok(Some("other".to_owned())),
        "the relay the leader is on"
    );
    assert_eq!(s.commit_at(FP, 60, None, 4).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(
        s.read_time(FP).await.map_err(|e| e.to_string()),
        Ok(None),
        "a commit without a time forgets the older one"
    );
    assert_eq!(s.commit_at(FP, 70, Some(80), 4).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.reset(FP, 40, 4).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(None), "a rewind forgets the time");
    assert_eq!(s.commit_at(FP, 45, Some(81), 4).await.map_err(|e| e.to_string()), Ok(CommitOutcome::Saved));
    s.force(FP, 10).await.expect("force");
    assert_eq!(s.read_time(FP).await.map_err(|e| e.to_string()), Ok(None), "cursor set forgets the time");
    // Connecting again applies the migration again, harmlessly.
    let s2 = PostgresStore::connect(&pg.url(), Duration::from_secs(5)).await.expect("again");
    assert_eq!(s2.read(FP).await.map_err(|e| e.to_string()), Ok(ReadOutcome::Found(10)));
}
