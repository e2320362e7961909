//! Standard output for the commands: a reader that went away (`| head -1`) ends the
//! command quietly, a write that fails (`> /dev/full`) is an error that names stdout.

use std::io::Write;

/// Writes `text` to stdout and flushes it.
pub fn write(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// Whether `e` (or anything in its chain) is a write to a pipe whose reader closed.
pub fn reader_gone(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

/// `println!` that returns the write's error (with "writing to standard output") instead
/// of panicking.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::output::write(&format!("{}\n", format_args!($($arg)*)))
            .map_err(|e| anyhow::Error::new(e).context("writing to standard output"))
    };
}
pub(crate) use say;
