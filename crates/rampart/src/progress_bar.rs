//! Progress bars for hashing and copying, drawn on stderr only when it is a terminal.

use std::io::IsTerminal;
use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressStyle};
use repo::{NoProgress, Progress};

/// Files smaller than this finish too fast for a bar to help.
const MIN_BAR_BYTES: u64 = 8 << 20;

/// A byte progress bar per large file.
pub struct TerminalProgress {
    current: Mutex<Option<ProgressBar>>,
}

impl Progress for TerminalProgress {
    fn begin(&self, label: &str, total_bytes: u64) {
        if total_bytes < MIN_BAR_BYTES {
            return;
        }
        let bar = ProgressBar::new(total_bytes);
        bar.set_style(
            ProgressStyle::with_template(
                "{msg:30!} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_message(label.to_string());
        if let Ok(mut current) = self.current.lock() {
            *current = Some(bar);
        }
    }

    fn advance(&self, bytes: u64) {
        if let Ok(current) = self.current.lock() {
            if let Some(bar) = current.as_ref() {
                bar.inc(bytes);
            }
        }
    }

    fn end(&self) {
        if let Ok(mut current) = self.current.lock() {
            if let Some(bar) = current.take() {
                bar.finish_and_clear();
            }
        }
    }
}

/// Bars on a terminal, silence otherwise (pipes, CI logs, `--json`).
pub fn for_stderr(quiet: bool) -> Box<dyn Progress> {
    if !quiet && std::io::stderr().is_terminal() {
        Box::new(TerminalProgress {
            current: Mutex::new(None),
        })
    } else {
        Box::new(NoProgress)
    }
}
