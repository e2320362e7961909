//! The socket reader: a task per connection that reads WebSocket messages and hands them
//! over in batches, so the socket read, the WebSocket parsing and the copy of each frame
//! out of the socket's buffer run beside the caller's decoding instead of before it.
//!
//! Read-ahead is bounded: at most [`QUEUED`] batches wait and one more is in hand, each of
//! at most [`BATCH`] messages or [`BATCH_BYTES`] (one message over that is a batch of its
//! own), so a slow caller still pushes back on the relay through TCP. A batch is cut as
//! soon as the socket holds nothing more, so a quiet stream's frames are not held back.

use futures_util::{FutureExt, Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::{self, Message as WsMessage};

/// Messages per batch at most. While catching up the socket always holds more than a
/// batch, so each batch is one hand-over and at most one wake-up of the caller: 256
/// rather than 64 cut context switches by a third and CPU per frame by about 8 % on a
/// 2-core machine (docs/PERFORMANCE.md, fourth round). A live stream's batches are cut
/// when the socket runs dry, so they stay a frame or two and are not delayed.
pub(super) const BATCH: usize = 256;
/// A batch is handed over once it holds this many bytes.
pub(super) const BATCH_BYTES: usize = 1 << 20;
/// Batches read ahead of the caller at most (with [`BATCH_BYTES`], at most 2 MiB).
pub(super) const QUEUED: usize = 2;

/// One WebSocket message as the reader hands it over.
#[derive(Debug)]
pub(super) enum Read {
    /// A binary message, copied out of the socket's buffer.
    Binary(Vec<u8>),
    /// A text message (Jetstream's JSON), copied out of the socket's buffer.
    Text(Vec<u8>),
    /// Anything else; `None` when the stream ended. The reader stops after an error or
    /// the end.
    Other(Option<Result<WsMessage, tungstenite::Error>>),
}

impl Read {
    fn new(msg: Option<Result<WsMessage, tungstenite::Error>>) -> Self {
        match msg {
            Some(Ok(WsMessage::Binary(b))) => Self::Binary(Vec::from(b)),
            Some(Ok(WsMessage::Text(t))) => Self::Text(Vec::from(bytes::Bytes::from(t))),
            other => Self::Other(other),
        }
    }

    /// True when nothing follows it.
    fn ends(&self) -> bool {
        matches!(self, Self::Other(None | Some(Err(_))))
    }

    fn len(&self) -> usize {
        match self {
            Self::Binary(b) | Self::Text(b) => b.len(),
            Self::Other(_) => 0,
        }
    }
}

/// Reads `stream` until it ends, fails, or the receiver is gone: one message awaited,
/// then whatever else the socket already holds, up to a batch.
pub(super) async fn run<S>(mut stream: S, tx: mpsc::Sender<Vec<Read>>)
where
    S: Stream<Item = Result<WsMessage, tungstenite::Error>> + Unpin,
{
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Poll;

    use bytes::Bytes;
    use futures_util::stream;

    use super::*;

    /// What a WebSocket stream yields.
    type Item = Result<WsMessage, tungstenite::Error>;

    fn binary(len: usize) -> WsMessage {
        WsMessage::Binary(Bytes::from(vec![0xa2; len]))
    }

    /// A stream of `n` messages of `len` bytes, counting how many were taken from it.
    fn counted(n: usize, len: usize) -> (impl Stream<Item = Item> + Unpin, Arc<AtomicUsize>) {
        let taken = Arc::new(AtomicUsize::new(0));
        let t = taken.clone();
        let s = stream::iter((0..n).map(move |_| {
            t.fetch_add(1, Ordering::SeqCst);
            Ok(binary(len))
        }));
        (s.chain(stream::pending()), taken)
    }

    /// A reader task over `s` and the receiving end of its queue.
    fn spawn(
        s: impl Stream<Item = Item> + Unpin + Send + 'static,
    ) -> (tokio::task::JoinHandle<()>, mpsc::Receiver<Vec<Read>>) {
        let (tx, rx) = mpsc::channel(QUEUED);
        (tokio::spawn(run(s, tx)), rx)
    }

    #[tokio::test]
    async fn a_busy_socket_is_handed_over_in_full_batches_and_read_ahead_is_bounded() {
        let (s, taken) = counted(10 * BATCH, 100);
        let (reader, mut rx) = spawn(s);
        // Nobody takes the batches: the reader fills the queue, holds one batch more, and stops reading.
        let bound = (QUEUED + 1) * BATCH;
        testkit::eventually("the reader to fill its queue", testkit::WAIT, async || {
            taken.load(Ordering::SeqCst) >= bound
        })
        .await;
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(taken.load(Ordering::SeqCst), bound, "read ahead past {QUEUED} queued batches and one in hand");
        for _ in 0..10 {
            let batch = rx.recv().await.expect("a batch");
            assert_eq!(batch.len(), BATCH, "a busy socket's batch is cut at its bound");
        }
        reader.abort();
    }

    #[tokio::test]
    async fn a_batch_is_cut_at_its_byte_bound() {
        let len = BATCH_BYTES / 4 + 1;
        let (s, _) = counted(8, len);
        let (reader, mut rx) = spawn(s);
        let batch = rx.recv().await.expect("a batch");
        assert_eq!(batch.len(), 4, "four messages of over a quarter of the bound make a batch");
        reader.abort();
    }

    #[tokio::test]
    async fn what_the_socket_holds_is_handed_over_without_waiting_for_a_full_batch() {
        // Three messages ready, then a socket that stays quiet.
        let s = stream::iter((0..3).map(|_| Ok(binary(10)))).chain(stream::pending());
        let (reader, mut rx) = spawn(s);
        let batch = tokio::time::timeout(std::time::Duration::from_secs(10), rx.recv())
            .await
            .expect("handed over while the socket is quiet")
            .expect("a batch");
        assert_eq!(batch.len(), 3);
        reader.abort();
    }

    #[tokio::test]
    async fn the_reader_stops_after_the_end_of_the_stream() {
        let mut n = 0;
        let s = stream::poll_fn(move |_| {
            n += 1;
            Poll::Ready(if n <= 2 { Some(Ok(binary(10))) } else { None })
        });
        let (tx, mut rx) = mpsc::channel(QUEUED);
        tokio::time::timeout(testkit::WAIT, run(s, tx)).await.expect("the reader ended with the stream");
        let batch = rx.recv().await.expect("a batch");
        assert_eq!(batch.len(), 3);
        assert!(batch[2].ends());
        assert!(rx.recv().await.is_none(), "nothing after the end");
    }
}
