//! The two-signal shutdown: the first SIGTERM/SIGINT asks the consumer to drain, commit
//! and release; a second exits at once without a final commit.

use std::future::Future;

use tokio::signal::unix::{Signal, SignalKind, signal};

/// Starts listening for SIGTERM and SIGINT now, and returns what resolves at the first
/// of them (arming the second to exit the process with status 130).
///
/// The listeners are installed before this returns, not when the future is first polled:
/// a replica told to stop while it was still starting (opening stores, building the repo
/// sync client, after its lease was already visible) used to die of the signal's default
/// action instead of draining and releasing.
pub fn listen() -> impl Future<Output = ()> + Send + 'static {
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
        let (mut term, mut int) = match (term, int) {
            (Ok(t), Ok(i)) => (t, i),
            (t, i) => {
                let e = t.err().or(i.err()).map(|e| e.to_string()).unwrap_or_default();
                tracing::error!(error = %e, "cannot listen for SIGTERM/SIGINT; this process stops only when killed");
                return std::future::pending().await;
            }
        };
        first(&mut term, &mut int).await;
        tracing::info!("shutdown requested: draining (signal again to force)");
        tokio::spawn(async move {
            first(&mut term, &mut int).await;
            tracing::warn!("second signal: exiting now without a final commit");
            std::process::exit(130);
        });
    }
}

/// Resolves at the next SIGTERM or SIGINT.
async fn first(term: &mut Signal, int: &mut Signal) {
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
