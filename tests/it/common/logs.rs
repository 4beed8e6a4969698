//! What a future logs, for the tests of an operator's warnings.

use std::sync::{Arc, Mutex, OnceLock};

use tracing::instrument::WithSubscriber;

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `f` with a subscriber that writes to a buffer (the subscriber goes
/// with the future, whichever thread polls it), and returns its output with
/// the log it wrote.
pub async fn captured<T>(f: impl std::future::Future<Output = T>) -> (T, String) {
    // With one dispatcher alive in the process, tracing caches each
    // callsite's interest from the first thread that reaches it: a thread
    // of another test, with no subscriber, would make a warning `never`
    // for the capture too. A second dispatcher kept alive makes every
    // callsite ask the subscriber of the thread at hand each time.
    static KEEP: OnceLock<tracing::Dispatch> = OnceLock::new();
    KEEP.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let out = f.with_subscriber(subscriber).await;
    let log = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    (out, log)
}
