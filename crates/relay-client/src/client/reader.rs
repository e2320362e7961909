//! The socket reader: a task per connection that reads WebSocket messages and hands them
//! over in batches, so the socket read, the WebSocket parsing and the copy of each frame
//! out of the socket's buffer run beside the caller's decoding instead of before it.
//!
//! Read-ahead is bounded: at most [`QUEUED`] batches wait, each of at most [`BATCH`]
//! messages or [`BATCH_BYTES`] (one message over that is a batch of its own), so a slow
//! caller still pushes back on the relay through TCP.

use futures_util::stream::SplitStream;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::{self, Message as WsMessage};

use super::Ws;

/// Messages per batch at most.
pub(super) const BATCH: usize = 64;
/// A batch is handed over once it holds this many bytes.
pub(super) const BATCH_BYTES: usize = 1 << 20;
/// Batches read ahead of the caller at most.
pub(super) const QUEUED: usize = 4;

/// One WebSocket message as the reader hands it over.
#[derive(Debug)]
pub(super) enum Read {
    /// A binary message, copied out of the socket's buffer.
    Binary(Vec<u8>),
    /// Anything else; `None` when the stream ended. The reader stops after an error or
    /// the end.
    Other(Option<Result<WsMessage, tungstenite::Error>>),
}

impl Read {
    fn new(msg: Option<Result<WsMessage, tungstenite::Error>>) -> Self {
        match msg {
            Some(Ok(WsMessage::Binary(b))) => Self::Binary(Vec::from(b)),
            other => Self::Other(other),
        }
    }

    /// True when nothing follows it.
    fn ends(&self) -> bool {
        matches!(self, Self::Other(None | Some(Err(_))))
    }

    fn len(&self) -> usize {
        match self {
            Self::Binary(b) => b.len(),
            Self::Other(_) => 0,
        }
    }
}

/// Reads `stream` until it ends, fails, or the receiver is gone: one message awaited,
/// then whatever else the socket already holds, up to a batch.
pub(super) async fn run(mut stream: SplitStream<Ws>, tx: mpsc::Sender<Vec<Read>>) {
    loop {
        let first = Read::new(stream.next().await);
        let mut ended = first.ends();
        let mut bytes = first.len();
        let mut batch = Vec::with_capacity(BATCH);
        batch.push(first);
        while !ended && batch.len() < BATCH && bytes < BATCH_BYTES {
            let Some(msg) = stream.next().now_or_never() else { break };
            let r = Read::new(msg);
            ended = r.ends();
            bytes += r.len();
            batch.push(r);
        }
        if tx.send(batch).await.is_err() || ended {
            return;
        }
    }
}
