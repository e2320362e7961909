//! `lease-probe REDIS_URL PREFIX TTL_MS NAME`: a minimal leader for the fault tests.
//!
//! It contends for the lease and, while its term is active, makes a fenced write every
//! 50 ms (RPUSH of its token to `{PREFIX}:writes`, only if the lease still holds that
//! token). It prints one line per event (`elected T`, `write ok T`, `write fenced T`,
//! `lost T REASON`, `released T`) so a test can SIGSTOP it and check what it did after.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use lease::{BootClock, LeaseConfig, LeaseEvent, RedisBackend};

const FENCED_WRITE: &str = r"
local v = redis.call('GET', KEYS[1])
if v and string.match(v, ':(%d+)$') == ARGV[1] then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
";

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, prefix, ttl_ms, name] = &args[..] else {
        eprintln!("usage: lease-probe REDIS_URL PREFIX TTL_MS NAME");
        std::process::exit(2);
    };
    let ttl = Duration::from_millis(ttl_ms.parse().expect("TTL_MS"));
    let cfg =
        LeaseConfig { poll: Duration::from_millis(100), key_prefix: prefix.clone(), ..LeaseConfig::from_ttl(ttl) };
    let backend = Arc::new(RedisBackend::new(url, prefix, cfg.op_timeout).expect("redis url"));
    let keys = backend.keys().clone();
    let (handle, mut events) = lease::spawn_as(backend, cfg, Arc::new(BootClock), name).expect("config");
    let writer = redis::Client::open(url.as_str()).expect("url");
    let mut term_ = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("signal");
    loop {
        tokio::select! {
            ev = events.recv() => match ev {
                Some(LeaseEvent::Elected(term)) => {
                    say(&format!("elected {}", term.token()));
                    let (client, keys) = (writer.clone(), keys.clone());
                    tokio::spawn(async move {
                        let script = redis::Script::new(FENCED_WRITE);
                        let Ok(mut c) = client.get_multiplexed_async_connection().await else { return };
                        while term.is_active() {
                            let r: Result<i64, _> = script.key(&keys.lease).key(format!("{{{}}}:writes", prefix_of(&keys.lease))).arg(term.token()).invoke_async(&mut c).await;
                            let token = term.token();
                            match r {
                                Ok(1) => say(&format!("write ok {token}")),
                                Ok(_) => say(&format!("write fenced {token}")),
                                Err(_) => say(&format!("write error {token}")),
                            }
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    });
                }
                Some(LeaseEvent::Lost { token, reason }) => say(&format!("lost {token} {}", reason.label())),
                Some(LeaseEvent::Released { token }) => say(&format!("released {token}")),
                None => return,
            },
            _ = term_.recv() => {
                let r = handle.step_down_with(async { Ok::<(), String>(()) }, Duration::from_secs(5)).await;
                say(&format!("stepped down {r:?}"));
                return;
            }
        }
    }
}

/// `{prefix}:lease` → `prefix`.
fn prefix_of(lease_key: &str) -> &str {
    lease_key.trim_start_matches('{').split('}').next().unwrap_or_default()
}
