//! Clocks for lease deadlines. Production uses a clock that keeps counting while the
//! machine is suspended (Linux `CLOCK_BOOTTIME`), so a laptop or VM that slept past its
//! deadline knows it on waking; tests use tokio's clock, which `pause()` controls.

use std::time::Duration;

/// A monotonic clock: time since an arbitrary fixed origin.
pub trait Clock: Send + Sync + 'static {
    /// Now, as time since the origin.
    fn now(&self) -> Duration;
}

/// `CLOCK_BOOTTIME` where the OS has it (counts suspend), else `CLOCK_MONOTONIC`.
#[derive(Debug, Clone, Copy, Default)]
pub struct BootClock;

impl Clock for BootClock {
    fn now(&self) -> Duration {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        let ts = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        Duration::new(u64::try_from(ts.tv_sec).unwrap_or(0), u32::try_from(ts.tv_nsec).unwrap_or(0))
    }
}

/// tokio's clock, for tests with paused time.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

impl TokioClock {
    /// Origin at the current tokio instant.
    #[must_use]
    pub fn new() -> Self {
        Self { origin: tokio::time::Instant::now() }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// The boot clock plus an offset that only moves forward: jumps time as a freeze or a
/// suspend would (the boot clock runs on while tokio's timers do not), for tests of what
/// a term does once its deadline passed behind the runtime's back.
#[derive(Debug, Default)]
pub struct OffsetClock(std::sync::atomic::AtomicU64);

impl OffsetClock {
    /// Moves this clock `by` ahead of the boot clock (cumulative).
    pub fn advance(&self, by: Duration) {
        let ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.0.fetch_add(ns, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for OffsetClock {
    fn now(&self) -> Duration {
        BootClock.now() + Duration::from_nanos(self.0.load(std::sync::atomic::Ordering::SeqCst))
    }
}
