//! The kit's servers start as empty as the tests that use them say (issue 40: a
//! `dump.rdb` left in the shared temp directory was loaded by every test Redis).

use testkit::RedisServer;

fn get(r: &RedisServer, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query(&mut r.admin()).expect("GET")
}

fn dbsize(r: &RedisServer) -> u64 {
    redis::cmd("DBSIZE").query(&mut r.admin()).expect("DBSIZE")
}

/// Leaves a `dump.rdb` holding a fence and a cursor where redis-server would find it if
/// started with the shared temp directory as its `--dir`, as an earlier run did on a
/// review machine.
fn stale_dump_in_shared_temp() {
    let maker = RedisServer::start();
    let mut c = maker.admin();
    let _: () = redis::cmd("SET").arg("{firekeeper}:fence").arg(1).query(&mut c).expect("SET");
    let _: () = redis::cmd("SET").arg("{firekeeper}:fence-seen").arg(1).query(&mut c).expect("SET");
    let _: () = redis::cmd("SET").arg("{firekeeper}:stale-cursor").arg(3504).query(&mut c).expect("SET");
    let _: () = redis::cmd("SAVE").query(&mut c).expect("SAVE");
    let tmp = std::env::temp_dir();
    let staged = tmp.join(format!("dump.rdb.{}", std::process::id()));
    std::fs::copy(maker.dir().join("dump.rdb"), &staged).expect("copy dump");
    std::fs::rename(&staged, tmp.join("dump.rdb")).expect("place dump");
}

#[test]
fn a_test_redis_beside_a_stale_dump_starts_and_restarts_empty() {
    stale_dump_in_shared_temp();
    let mut r = RedisServer::start();
    assert_eq!(dbsize(&r), 0, "started with keys");
    assert_eq!(get(&r, "{firekeeper}:fence"), None);
    let _: () = redis::cmd("SET").arg("k").arg("v").query(&mut r.admin()).expect("SET");
    r.restart();
    assert_eq!(dbsize(&r), 0, "restart() must come back empty");
}

#[test]
fn a_persistent_test_redis_keeps_its_keys_across_a_restart() {
    let mut r = RedisServer::start_persistent();
    assert_eq!(dbsize(&r), 0);
    let _: () = redis::cmd("SET").arg("{firekeeper}:fence").arg(7).query(&mut r.admin()).expect("SET");
    r.restart();
    assert_eq!(get(&r, "{firekeeper}:fence").as_deref(), Some("7"));
}

/// A server asked for a port another test's server holds does not pass that server off
/// as its own: the start says so (`None`), and the kit's starts then take another port.
/// (A NATS store test once paused "its" server, which had exited, and read a cursor
/// from the other test's server that answered on the port.)
#[test]
fn a_server_whose_port_is_taken_is_not_taken_for_the_one_answering_there() {
    let redis = RedisServer::start();
    assert!(RedisServer::start_on(redis.port()).is_none(), "redis: the other server was taken for this one");
    let nats = testkit::NatsServer::start();
    assert!(testkit::NatsServer::start_on(nats.port(), &[]).is_none(), "nats: the other server was taken for this one");
    let pg = testkit::PgServer::start();
    assert!(testkit::PgServer::start_on(pg.port()).is_none(), "postgres: the other server was taken for this one");
    let _ = (redis, nats, pg);
}

/// Every thread of the process is stopped when `sigstop` returns, even on a machine
/// whose CPUs are busy (there the thread chosen to take the signal may wait for a CPU
/// while another thread still runs and answers: a "paused" NATS server answered a read).
#[test]
fn a_paused_server_has_every_thread_stopped_when_pause_returns() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let busy = std::sync::Arc::new(AtomicBool::new(true));
    let spinners: Vec<_> = (0..4)
        .map(|_| {
            let busy = busy.clone();
            std::thread::spawn(move || {
                while busy.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let nats = testkit::NatsServer::start();
    let mut running_after_pause = 0;
    for _ in 0..30 {
        nats.pause();
        let tasks = std::fs::read_dir(format!("/proc/{}/task", nats.pid())).expect("proc");
        let states: Vec<char> = tasks
            .flatten()
            .filter_map(|t| {
                let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
                stat.rsplit_once(')')?.1.trim_start().chars().next()
            })
            .collect();
        running_after_pause += states.iter().filter(|c| !matches!(c, 'T' | 't')).count();
        nats.resume();
    }
    busy.store(false, Ordering::Relaxed);
    for s in spinners {
        s.join().expect("spinner");
    }
    assert_eq!(running_after_pause, 0, "threads still running after pause() returned");
}
