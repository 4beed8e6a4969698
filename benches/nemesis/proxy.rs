//! A TCP proxy that delays and loses: this kernel has no `sch_netem`, so
//! latency and loss on the replica↔database and client↔replica paths come
//! from here. Every chunk read waits `delay` before it is written on; with
//! `loss` (per mille) a chunk is held 200 ms more, as a lost segment's
//! retransmission would be, and one in ten of those cuts the connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Default)]
struct Ctl {
    delay_ms: AtomicU64,
    loss_permille: AtomicU64,
    connections: AtomicU64,
}

pub struct Proxy {
    pub addr: SocketAddr,
    ctl: Arc<Ctl>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(listen: SocketAddr, upstream: SocketAddr, seed: u64) -> Proxy {
        let l = TcpListener::bind(listen)
            .await
            .unwrap_or_else(|e| panic!("proxy cannot listen on {listen}: {e}"));
        let addr = l.local_addr().unwrap();
        let ctl = Arc::new(Ctl::default());
        let c = ctl.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((down, _)) = l.accept().await else {
                    continue;
                };
                let n = c.connections.fetch_add(1, Ordering::Relaxed);
                let c = c.clone();
                tokio::spawn(async move {
                    let up = match tokio::time::timeout(
                        Duration::from_secs(2),
                        TcpStream::connect(upstream),
                    )
                    .await
                    {
                        Ok(Ok(up)) => up,
                        _ => return,
                    };
                    let _ = down.set_nodelay(true);
                    let _ = up.set_nodelay(true);
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    let s = seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    // Either direction failing (or cut) drops both.
                    let _ = tokio::try_join!(
                        pipe(dr, uw, c.clone(), s),
                        pipe(ur, dw, c.clone(), s.rotate_left(17))
                    );
                });
            }
        });
        Proxy { addr, ctl, task }
    }

    pub fn set(&self, delay_ms: u64, loss_permille: u64) {
        self.ctl.delay_ms.store(delay_ms, Ordering::Relaxed);
        self.ctl
            .loss_permille
            .store(loss_permille, Ordering::Relaxed);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pipe(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    ctl: Arc<Ctl>,
    seed: u64,
) -> std::io::Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            let _ = w.shutdown().await;
            return Ok(());
        }
        let delay = ctl.delay_ms.load(Ordering::Relaxed);
        let loss = ctl.loss_permille.load(Ordering::Relaxed);
        if loss > 0 {
            let x = rng.gen_range(0..1000);
            if x < loss / 10 {
                return Err(std::io::ErrorKind::ConnectionAborted.into());
            }
            if x < loss {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        w.write_all(&buf[..n]).await?;
    }
}
