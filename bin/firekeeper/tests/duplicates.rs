//! The README's promise about duplicates, checked per cursor store through the binary:
//! the store stops answering for 8 s while the relay serves 200 events a second, the
//! leader is then killed (SIGKILL), the store comes back and a new leader finishes. What
//! comes twice is what the killed leader handed over after its last commit, and that is
//! bounded: a store that is also the lease (Redis, NATS) ends the term at its deadline;
//! any store that takes no commit for `FIREKEEPER_UNCOMMITTED_MAX_MS` (2 s here) makes
//! intake wait. The review's Postgres store never reconnected: every event since the
//! restart came again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use relay_sim::{RelaySim, SimConfig};
use testkit::http::http_get;
use testkit::proc::{base_env, firekeeper, run_once, sigterm_and_wait};
use testkit::{NatsServer, PgServer, RedisServer, WAIT, eventually, free_port, tmpdir};

/// Events a second the relay serves.
const RATE: u32 = 200;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Store {
    Redis,
    Nats,
    Postgres,
    File,
}

/// A cursor store that can stop answering and come back.
struct Outage {
    store: Store,
    redis: Option<RedisServer>,
    nats: Option<NatsServer>,
    pg: Option<PgServer>,
    /// The file store's directory, on a tmpfs that a filler file can fill.
    tmpfs: Option<PathBuf>,
}

impl Outage {
    fn start(store: Store, dir: &Path) -> Option<Self> {
        let tmpfs = if store == Store::File {
            let at = dir.join("data").join("cursors");
            std::fs::create_dir_all(&at).ok()?;
            let ok = Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"]).arg(&at).status();
            if !ok.is_ok_and(|s| s.success()) {
                return None;
            }
            Some(at)
        } else {
            None
        };
        Some(Self {
            store,
            // Postgres cursors need a shared lease: Redis.
            redis: matches!(store, Store::Redis | Store::Postgres).then(RedisServer::start),
            nats: (store == Store::Nats).then(NatsServer::start),
            pg: (store == Store::Postgres).then(PgServer::start),
            tmpfs,
        })
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        match self.store {
            Store::Redis => vec![("REDIS_URL", self.redis.as_ref().expect("redis").url())],
            Store::Nats => vec![("NATS_URL", self.nats.as_ref().expect("nats").url())],
            Store::Postgres => vec![
                ("REDIS_URL", self.redis.as_ref().expect("redis").url()),
                ("FIREKEEPER_CURSOR_STORE", "postgres".into()),
                ("DATABASE_URL", self.pg.as_ref().expect("pg").url()),
            ],
            Store::File => vec![],
        }
    }

    /// The store stops answering (commits fail).
    fn stop(&mut self) {
        match self.store {
            Store::Redis => self.redis.as_ref().expect("redis").pause(),
            Store::Nats => self.nats.as_ref().expect("nats").pause(),
            Store::Postgres => self.pg.as_mut().expect("pg").kill(),
            Store::File => {
                let filler = self.tmpfs.as_ref().expect("tmpfs").join("filler");
                let _ = Command::new("dd")
                    .arg("if=/dev/zero")
                    .arg(format!("of={}", filler.display()))
                    .args(["bs=64k"])
                    .status();
            }
        }
    }

    /// The store answers again, with its data.
    fn resume(&mut self) {
        match self.store {
            Store::Redis => self.redis.as_ref().expect("redis").resume(),
            Store::Nats => self.nats.as_ref().expect("nats").resume(),
            Store::Postgres => self.pg.as_mut().expect("pg").restart(),
            Store::File => {
                let _ = std::fs::remove_file(self.tmpfs.as_ref().expect("tmpfs").join("filler"));
            }
        }
    }
}

impl Drop for Outage {
    fn drop(&mut self) {
        if let Some(t) = &self.tmpfs {
            let _ = Command::new("umount").arg("-l").arg(t).status();
        }
    }
}

/// seq → how many lines carry it.
fn lines(path: &Path) -> BTreeMap<u64, usize> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let whole = text.rfind('\n').map_or("", |i| &text[..=i]);
    let mut m = BTreeMap::new();
    for l in whole.lines() {
        let v: serde_json::Value = serde_json::from_str(l).expect("JSON line");
        *m.entry(v["seq"].as_u64().expect("seq")).or_insert(0) += 1;
    }
    m
}

async fn status(http: &str) -> serde_json::Value {
    let body = http_get(http, "/status").await.map(|r| r.1).unwrap_or_default();
    serde_json::from_str(&body).unwrap_or(serde_json::Value::Null)
}

async fn after_a_store_outage_and_a_crash_what_comes_twice_is_bounded(store: Store) {
    let dir = tmpdir(&format!("dups-{store:?}"));
    let Some(mut outage) = Outage::start(store, &dir) else {
        eprintln!("SKIPPED: mounting a tmpfs is not allowed here; the file store's outage needs it");
        return;
    };
    let frames = relay_sim::capture::repeat_in_time(&testkit::fixture_frames(), 2);
    let total = frames.len() as u64;
    let relay = RelaySim::start_with(
        frames,
        SimConfig { initial_head: Some(0), rate: Some(RATE), ..SimConfig::default() },
        "127.0.0.1:0".parse().expect("addr"),
    )
    .await
    .expect("sim");
    let mut env = base_env(&relay.url(), &dir);
    let out = dir.join("out.jsonl");
    let http = format!("127.0.0.1:{}", free_port());
    for (k, v) in outage.env() {
        env.insert(k.into(), v);
    }
    env.insert("FIREKEEPER_JSONL_PATH".into(), out.to_string_lossy().into_owned());
    env.insert("FIREKEEPER_HTTP_ADDR".into(), http.clone());
    env.insert("FIREKEEPER_UNCOMMITTED_MAX_MS".into(), "2000".into());
    let o = run_once(&env, &["cursor", "set", "0"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut a = firekeeper(&env, &[], &dir.join("a.log"));
    eventually("300 committed", WAIT, async || status(&http).await["committed"].as_u64() >= Some(300)).await;
    outage.stop();
    tokio::time::sleep(Duration::from_secs(8)).await;
    a.kill().expect("SIGKILL");
    let _ = a.wait();
    outage.resume();
    let b = firekeeper(&env, &[], &dir.join("b.log"));
    eventually("every event committed", WAIT, async || status(&http).await["committed"].as_u64() == Some(total)).await;
    assert!(sigterm_and_wait(b).success());
    let got = lines(&out);
    let missing = (1..=total).filter(|s| !got.contains_key(s)).count();
    assert_eq!(missing, 0, "{store:?}: nothing lost");
    let twice = got.values().filter(|n| **n > 1).count();
    // What was handed over in one bound (2 s) and a commit interval at 200 a second, and
    // a batch in flight.
    let bound = usize::try_from(RATE).expect("rate") * 21 / 10 + 200;
    eprintln!("{store:?}: {twice} events came twice (bound {bound})");
    assert!(twice <= bound, "{store:?}: {twice} events came twice, more than {bound}");
}

macro_rules! per_store {
    ($($name:ident: $store:expr;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                after_a_store_outage_and_a_crash_what_comes_twice_is_bounded($store).await;
            }
        )*
    };
}

per_store! {
    duplicates_are_bounded_on_redis: Store::Redis;
    duplicates_are_bounded_on_nats: Store::Nats;
    duplicates_are_bounded_on_postgres: Store::Postgres;
    duplicates_are_bounded_on_the_file_store: Store::File;
}
