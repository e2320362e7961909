//! Failback: while on the secondary, probe the primary on a timer and ask to switch back
//! after enough good probes in a row.

use std::time::Duration;

use futures_util::StreamExt;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};
use tokio_tungstenite::tungstenite::Message as WsMessage;

use super::{Subscription, ws_config};
use crate::config::{ClientConfig, RelayRole};
use crate::frame::{self, Frame};
use crate::item::SwitchReason;

/// Failback to the primary while on the secondary: probes on a timer and their streak.
#[derive(Default)]
pub(super) struct Failback {
    /// A probe connection in flight.
    pub(super) probe: Option<JoinHandle<bool>>,
    /// When the next probe starts (`None` on the primary, or while one is in flight).
    pub(super) next_at: Option<Instant>,
    /// Consecutive good probes.
    pub(super) streak: u32,
}

impl Failback {
    /// Stops a probe in flight.
    pub(super) fn abort(&mut self) {
        if let Some(p) = self.probe.take() {
            p.abort();
        }
    }

    /// The next probe one interval from now, when on the secondary.
    pub(super) fn schedule(&mut self, active: RelayRole, every: Duration) {
        self.next_at = (active == RelayRole::Secondary).then(|| Instant::now() + every);
    }

    /// When the next probe is due, unless one is in flight.
    pub(super) fn due(&self) -> Option<Instant> {
        if self.probe.is_none() { self.next_at } else { None }
    }
}

impl Subscription {
    pub(super) fn start_probe(&mut self) {
        self.failback.next_at = None;
        let url = self.open_url(RelayRole::Primary, None);
        let cfg = self.cfg.clone();
        self.failback.probe = Some(tokio::spawn(async move { probe(url, &cfg).await }));
    }

    pub(super) fn on_probe(&mut self, ok: bool) {
        let f = &mut self.failback;
        f.next_at = Some(Instant::now() + self.cfg.probe_interval);
        f.streak = if ok { f.streak + 1 } else { 0 };
        tracing::debug!(relay = "primary", ok, streak = f.streak, "failback probe");
        if self.active == RelayRole::Secondary && f.streak >= self.cfg.probe_successes {
            self.request_switch(RelayRole::Primary, SwitchReason::Failback);
        }
    }
}

/// Opens a cursor-less connection to `url` and keeps it for `probe_hold`: good if the
/// handshake works and the relay neither closes nor sends an error frame meanwhile.
async fn probe(url: url::Url, cfg: &ClientConfig) -> bool {
    let conn = timeout(
        cfg.connect_timeout,
        tokio_tungstenite::connect_async_with_config(url.as_str(), Some(ws_config(cfg.max_frame_bytes)), true),
    )
    .await;
    let Ok(Ok((mut ws, _))) = conn else {
        return false;
    };
    let deadline = Instant::now() + cfg.probe_hold;
    let ok = loop {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Err(_) => break true,
            Ok(None | Some(Err(_) | Ok(WsMessage::Close(_)))) => break false,
            Ok(Some(Ok(WsMessage::Binary(b)))) => {
                if matches!(frame::decode(&b), Ok(Frame::Error(_))) {
                    break false;
                }
            }
            Ok(Some(Ok(_))) => {}
        }
    };
    let _ = timeout(Duration::from_millis(500), ws.close(None)).await;
    ok
}
