//! What a future logs, for the tests of an operator's warnings.

use std::sync::{Arc, Mutex};

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

/// Runs `f` with a subscriber that writes to a buffer on this thread (so
/// the future must run here: the test's own body, not a spawned task), and
/// returns its output with the log it wrote.
pub async fn captured<T>(f: impl std::future::Future<Output = T>) -> (T, String) {
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let out = {
        let _guard = tracing::subscriber::set_default(subscriber);
        f.await
    };
    let log = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    (out, log)
}
