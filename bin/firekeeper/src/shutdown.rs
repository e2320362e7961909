//! The two-signal shutdown: the first SIGTERM/SIGINT asks the consumer to drain, commit
//! and release; a second exits at once without a final commit.

use tokio::signal::unix::{SignalKind, signal};

/// Resolves at the first SIGTERM or SIGINT, and arms the second one to exit the process
/// with status 130.
pub async fn requested() {
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM; only SIGINT stops this process");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutdown requested: draining (signal again to force)");
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::warn!("second signal: exiting now without a final commit");
        std::process::exit(130);
    });
}
