//! A PLC directory for tests, on loopback: serves `GET /<did>` from documents the test
//! controls, counts requests, and can be made to fail (down, slow, 500, garbage).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;

/// How the directory answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Documents as set; 404 for unknown DIDs.
    Up,
    /// Connections are closed without an answer.
    Down,
    /// Every answer waits this long first.
    Slow(Duration),
    /// `500 Internal Server Error`.
    Error,
    /// `200` with a body that is not JSON.
    Garbage,
}

struct State {
    docs: HashMap<String, String>,
    mode: Mode,
    /// Per path, how long its answer waits.
    delays: HashMap<String, Duration>,
}

/// The running directory; stops when dropped.
pub struct Plc {
    addr: std::net::SocketAddr,
    state: Arc<Mutex<State>>,
    requests: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Plc {
    /// Starts serving `docs` (DID → document JSON).
    pub async fn start(docs: HashMap<String, String>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind PLC");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(Mutex::new(State { docs, mode: Mode::Up, delays: HashMap::new() }));
        let requests = Arc::new(AtomicU64::new(0));
        let (st, rq) = (state.clone(), requests.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else { continue };
                let _ = s.set_nodelay(true);
                let (st, rq) = (st.clone(), rq.clone());
                tokio::spawn(async move {
                    let mut pending = Vec::new();
                    while let Some((line, _)) = crate::http::read_request_with_line(&mut s, &mut pending).await {
                        rq.fetch_add(1, Ordering::SeqCst);
                        let path = line.split_whitespace().nth(1).unwrap_or("/").trim_start_matches('/').to_owned();
                        let (mode, doc, delay) = {
                            let st = st.lock().expect("plc");
                            (st.mode, st.docs.get(&path).cloned(), st.delays.get(&path).copied())
                        };
                        if let Some(d) = delay {
                            tokio::time::sleep(d).await;
                        }
                        let (status, body) = match mode {
                            Mode::Down => return,
                            Mode::Error => ("500 Internal Server Error", "oops".to_owned()),
                            Mode::Garbage => ("200 OK", "<html>not a document".to_owned()),
                            Mode::Slow(d) => {
                                tokio::time::sleep(d).await;
                                doc.map_or(("404 Not Found", String::new()), |d| ("200 OK", d))
                            }
                            Mode::Up => doc.map_or(("404 Not Found", String::new()), |d| ("200 OK", d)),
                        };
                        let head = format!(
                            "HTTP/1.1 {status}\r\ncontent-type: application/did+ld+json\r\ncontent-length: {}\r\n\r\n",
                            body.len()
                        );
                        if s.write_all((head + &body).as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { addr, state, requests, task }
    }

    /// Starts serving the signed capture's DID documents (`fixtures/signed/`).
    pub async fn signed_fixture() -> Self {
        Self::start(signed_fixture_docs()).await
    }

    /// The directory's base URL (`FIREKEEPER_PLC_URL`).
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests answered or refused so far.
    #[must_use]
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    /// Sets how the directory answers from now on.
    pub fn set_mode(&self, mode: Mode) {
        self.state.lock().expect("plc").mode = mode;
    }

    /// Sets (or replaces) the document of `did`.
    pub fn set_doc(&self, did: &str, doc: String) {
        self.state.lock().expect("plc").docs.insert(did.to_owned(), doc);
    }

    /// Makes every answer about `did` (a path) wait `delay` first.
    pub fn set_delay(&self, did: &str, delay: Duration) {
        self.state.lock().expect("plc").delays.insert(did.to_owned(), delay);
    }

    /// Stops serving the document of `did` (404 from now on).
    pub fn remove_doc(&self, did: &str) {
        self.state.lock().expect("plc").docs.remove(did);
    }

    /// The document of `did`, as served.
    #[must_use]
    pub fn doc(&self, did: &str) -> Option<String> {
        self.state.lock().expect("plc").docs.get(did).cloned()
    }
}

impl Drop for Plc {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The signed capture's DID documents, DID → JSON.
#[must_use]
pub fn signed_fixture_docs() -> HashMap<String, String> {
    let text = std::fs::read_to_string(crate::fixture("signed/signed-b.did-docs.json")).expect("did docs");
    let v: HashMap<String, serde_json::Value> = serde_json::from_str(&text).expect("JSON");
    v.into_iter().map(|(k, d)| (k, d.to_string())).collect()
}
