//! Request bytes in flight, process-wide: every DATA frame of every request
//! takes permits from one byte budget, held until the response is produced;
//! a frame that does not fit fails its request at once with
//! `RESOURCE_EXHAUSTED` ([`InflightBytesLayer`]).
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};

use crate::net::limits::LimitStats;

/// The server's budget of request bytes in flight.
#[derive(Debug)]
struct Budget {
    used: AtomicUsize,
    max: usize,
    stats: Arc<LimitStats>,
}

impl Budget {
    /// Takes `n` bytes if they fit.
    fn take(&self, n: usize) -> bool {
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let Some(next) = cur.checked_add(n).filter(|v| *v <= self.max) else {
                return false;
            };
            match self
                .used
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(seen) => cur = seen,
            }
        }
    }
}

/// The bytes one request holds: shared by its body (while tonic reads it)
/// and its response future (until the answer exists); given back when the
/// last of the two is dropped.
#[derive(Debug)]
struct Held {
    bytes: AtomicUsize,
    budget: Arc<Budget>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget
            .used
            .fetch_sub(*self.bytes.get_mut(), Ordering::AcqRel);
    }
}

/// A tower layer charging every request's body bytes to one budget.
#[derive(Clone, Debug)]
pub struct InflightBytesLayer {
    budget: Arc<Budget>,
}

impl InflightBytesLayer {
    /// A budget of `max_bytes`, counting refusals into `stats`.
    pub fn new(max_bytes: usize, stats: Arc<LimitStats>) -> Self {
        InflightBytesLayer {
            budget: Arc::new(Budget {
                used: AtomicUsize::new(0),
                max: max_bytes.max(64 * 1024),
                stats,
            }),
        }
    }
}

impl<S> tower_layer::Layer<S> for InflightBytesLayer {
    type Service = InflightBytes<S>;
    fn layer(&self, inner: S) -> InflightBytes<S> {
        InflightBytes {
            inner,
            budget: self.budget.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct InflightBytes<S> {
    inner: S,
    budget: Arc<Budget>,
}

impl<S> tower_service::Service<http::Request<tonic::body::Body>> for InflightBytes<S>
where
    S: tower_service::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = HoldingFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let held = Arc::new(Held {
            bytes: AtomicUsize::new(0),
            budget: self.budget.clone(),
        });
        let (parts, body) = req.into_parts();
        let body = tonic::body::Body::new(Metered {
            inner: body,
            held: held.clone(),
        });
        HoldingFuture {
            inner: self.inner.call(http::Request::from_parts(parts, body)),
            _held: held,
        }
    }
}

pin_project_lite::pin_project! {
    /// The inner response future, holding the request's bytes until it ends.
    pub struct HoldingFuture<F> {
        #[pin]
        inner: F,
        _held: Arc<Held>,
    }
}

impl<F: std::future::Future> std::future::Future for HoldingFuture<F> {
    type Output = F::Output;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.project().inner.poll(cx)
    }
}

pin_project_lite::pin_project! {
    struct Metered {
        #[pin]
        inner: tonic::body::Body,
        held: Arc<Held>,
    }
}

impl HttpBody for Metered {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let n = data.len();
                    if !this.held.budget.take(n) {
                        this.held
                            .budget
                            .stats
                            .inflight_refused
                            .fetch_add(1, Ordering::Relaxed);
                        return Poll::Ready(Some(Err(
                            crate::domain::error::Reject::Overloaded.into()
                        )));
                    }
                    this.held.bytes.fetch_add(n, Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
