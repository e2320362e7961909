//! The ends of a term that keep what was delivered: settle (drain and commit before a
//! switch or a fatal stop), stop at an invalid event, and the voluntary step-down.

use std::time::Duration;

use super::commit::{Commit, commit};
use super::{Leader, Stop, TermEnd, guarded};
use crate::error::Fatal;
use crate::handler::HandlerError;
use crate::pipeline::LaneStop;
use crate::status::Role;

impl Leader<'_, '_> {
    /// Drains what was delivered and commits it (final). `Err` when the term ended or
    /// shutdown came first (the step-down path drains again, within its budget).
    pub(super) async fn settle(&mut self) -> Result<(), Stop> {
        match guarded(self.cx, &self.term, self.p.drain()).await {
            Ok(Ok(())) => {}
            Ok(Err(LaneStop::Handler(e @ HandlerError::Fatal { .. }))) => return Err(self.stop(Fatal::Sink(e)).await),
            Ok(Err(_)) => return Err(Stop::End(TermEnd::Lost)),
            Err(stop) => return Err(stop),
        }
        self.land().await?;
        if commit(self.cx, &self.term, &mut self.p, true).await == Commit::Fenced {
            return Err(Stop::End(TermEnd::Lost));
        }
        Ok(())
    }

    /// A lane stopped for good (an event failed verification under the `fail` policy, or
    /// the sink cannot go on): take in what the other lanes finish, commit up to just
    /// before what it did not hand over, and end the term with an operator-facing error.
    pub(super) async fn stop(&mut self, e: Fatal) -> Stop {
        tracing::error!(error = %e, "stopping: this needs an operator");
        self.sub.close().await;
        if let Err(stop) = guarded(self.cx, &self.term, self.p.wind_down()).await {
            return stop;
        }
        if let Err(stop) = self.land().await {
            return stop;
        }
        if commit(self.cx, &self.term, &mut self.p, true).await == Commit::Fenced {
            return Stop::End(TermEnd::Lost);
        }
        Stop::End(TermEnd::Fatal(e))
    }

    /// Settles what was delivered, then ends the term with an operator-facing error.
    pub(super) async fn fatal(&mut self, e: Fatal) -> Stop {
        tracing::error!(error = %e, "stopping: this needs an operator");
        match self.settle().await {
            Ok(()) | Err(Stop::End(_)) => Stop::End(TermEnd::Fatal(e)),
            Err(Stop::Shutdown) => Stop::Shutdown,
        }
    }

    /// Voluntary step-down: keep renewing while the lanes drain, commit, then release.
    pub(super) async fn step_down(mut self) -> TermEnd {
        let cx = self.cx;
        cx.status.update(|s| s.role = Role::SteppingDown);
        tracing::info!(token = self.term.token(), in_flight = self.p.in_flight(), "draining before release");
        self.sub.close().await;
        let Leader { term, mut p, flight, .. } = self;
        let drain = async {
            p.drain().await.map_err(causes::Cause::from)?;
            // The tick's write lands before the final one is made.
            if let Some(f) = flight
                && f.land(cx, &mut p).await == Commit::Fenced
            {
                return Err("commit fenced or the term ended".into());
            }
            // A store that is briefly away does not make the step-down unclean: retry the
            // final commit while the term lasts (the drain budget bounds it too).
            loop {
                if commit(cx, &term, &mut p, true).await == Commit::Fenced {
                    return Err("final commit fenced or the term ended".into());
                }
                if p.committed() == p.committable() {
                    return Ok::<(), causes::Cause>(());
                }
                tracing::warn!(
                    cursor = p.committable(),
                    retry_ms = 100,
                    "final commit did not land yet; retrying while the term lasts"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        TermEnd::Shutdown(cx.lease.step_down_with(drain, cx.settings.options.drain_budget).await)
    }
}
