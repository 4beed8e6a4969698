//! Criterion micro-benchmarks: seal, open and seal+open against peer token
//! formats on the same payloads, the params digest, and the sled ledger with
//! group commit against one flush per consume. Prints a token-length table.
//!
//!     cargo bench --bench micro
//!     cargo bench --bench micro -- 'seal\+open/256'     (a subset)

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use stateseal::internals::binding::{
    params_digest, params_digest_v2, Binding, Method, ParamsDigest, Tenant,
};
use stateseal::internals::keyring::{Keyring, KeysetFile, TenantKeys};
use stateseal::internals::ledger::sled::SledLedger;
use stateseal::internals::ledger::{Ledger, LedgerKey, TenantTag};
use stateseal::internals::token::{self, Header, UntrustedToken};

const SIZES: [usize; 3] = [64, 256, 4096];

struct Ours {
    keys: Arc<TenantKeys>,
    binding: Binding,
    header: Header,
}

impl Ours {
    fn new() -> Self {
        let ring = Keyring::from_file(&KeysetFile::generate(0)).expect("keyring");
        let binding = Binding {
            tenant: Tenant::new("default"),
            subject: "bench-user".into(),
            method: Method::ToolsCall,
            params: ParamsDigest([7; 32]),
            version: stateseal::internals::binding::BindingVersion::V1,
        };
        Ours {
            keys: ring.primary().tenant_keys(&binding.tenant),
            binding,
            header: Header {
                key_id: ring.primary().id(),
                expires_at: u32::MAX,
                single_use: true,
                binding: stateseal::internals::binding::BindingVersion::V1,
                manifest: false,
            },
        }
    }
    fn seal(&self, m: &[u8]) -> String {
        token::seal(
            &self.keys,
            self.header,
            &self.binding,
            None,
            m,
            token::Nonce::Fresh,
        )
        .expect("seal")
    }
    fn open(&self, t: &str) -> zeroize::Zeroizing<Vec<u8>> {
        UntrustedToken::parse(t, 1 << 20)
            .expect("parse")
            .open(&self.keys, &self.binding)
            .expect("open")
            .state
    }
}

struct Paseto(pasetors::keys::SymmetricKey<pasetors::version4::V4>);

impl Paseto {
    fn new() -> Self {
        Paseto(pasetors::keys::SymmetricKey::from(&[9u8; 32]).expect("key"))
    }
    fn seal(&self, m: &[u8]) -> String {
        pasetors::version4::LocalToken::encrypt(&self.0, m, None, None).expect("paseto encrypt")
    }
    fn open(&self, t: &str) -> Vec<u8> {
        let u =
            pasetors::token::UntrustedToken::<pasetors::Local, pasetors::version4::V4>::try_from(t)
                .expect("paseto parse");
        let trusted = pasetors::version4::LocalToken::decrypt(&self.0, &u, None, None)
            .expect("paseto decrypt");
        trusted.payload().as_bytes().to_vec()
    }
}

fn branca_seal(m: &[u8]) -> String {
    branca::encode(m, &[9u8; 32], 1_900_000_000).expect("branca encode")
}
fn branca_open(t: &str) -> Vec<u8> {
    branca::decode(t, &[9u8; 32], 0).expect("branca decode")
}

fn fernet() -> fernet::Fernet {
    fernet::Fernet::new(&fernet::Fernet::generate_key()).expect("fernet key")
}

/// PASETO payloads must be UTF-8 (pasetors returns the payload as a str).
fn payload(n: usize) -> Vec<u8> {
    (0..n).map(|i| b'a' + (i % 26) as u8).collect()
}

fn token_lengths() {
    let ours = Ours::new();
    let paseto = Paseto::new();
    let f = fernet();
    println!("\ntoken length (characters) by payload size");
    println!(
        "{:<22} {:>8} {:>8} {:>8}",
        "format", "64 B", "256 B", "4096 B"
    );
    let row = |name: &str, g: &dyn Fn(&[u8]) -> String| {
        let l: Vec<usize> = SIZES.iter().map(|&n| g(&payload(n)).len()).collect();
        println!("{:<22} {:>8} {:>8} {:>8}", name, l[0], l[1], l[2]);
    };
    row("stateseal v1", &|m| ours.seal(m));
    row("branca", &|m| branca_seal(m));
    row("pasetors v4.local", &|m| paseto.seal(m));
    row("fernet", &|m| f.encrypt(m));
    println!();
}

fn tokens(c: &mut Criterion) {
    token_lengths();
    let ours = Ours::new();
    let paseto = Paseto::new();
    let f = fernet();
    for op in ["seal", "open", "seal+open"] {
        let mut g = c.benchmark_group(op);
        g.measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(500))
            .sample_size(30);
        for n in SIZES {
            let m = payload(n);
            g.throughput(Throughput::Bytes(n as u64));
            let (t_ours, t_paseto, t_branca, t_fernet) = (
                ours.seal(&m),
                paseto.seal(&m),
                branca_seal(&m),
                f.encrypt(&m),
            );
            match op {
                "seal" => {
                    g.bench_with_input(BenchmarkId::new("stateseal", n), &m, |b, m| {
                        b.iter(|| ours.seal(m))
                    });
                    g.bench_with_input(BenchmarkId::new("pasetors_v4_local", n), &m, |b, m| {
                        b.iter(|| paseto.seal(m))
                    });
                    g.bench_with_input(BenchmarkId::new("branca", n), &m, |b, m| {
                        b.iter(|| branca_seal(m))
                    });
                    g.bench_with_input(BenchmarkId::new("fernet", n), &m, |b, m| {
                        b.iter(|| f.encrypt(m))
                    });
                }
                "open" => {
                    g.bench_function(BenchmarkId::new("stateseal", n), |b| {
                        b.iter(|| ours.open(&t_ours))
                    });
                    g.bench_function(BenchmarkId::new("pasetors_v4_local", n), |b| {
                        b.iter(|| paseto.open(&t_paseto))
                    });
                    g.bench_function(BenchmarkId::new("branca", n), |b| {
                        b.iter(|| branca_open(&t_branca))
                    });
                    g.bench_function(BenchmarkId::new("fernet", n), |b| {
                        b.iter(|| f.decrypt(&t_fernet).expect("fernet"))
                    });
                }
                _ => {
                    g.bench_with_input(BenchmarkId::new("stateseal", n), &m, |b, m| {
                        b.iter(|| ours.open(&ours.seal(m)))
                    });
                    g.bench_with_input(BenchmarkId::new("pasetors_v4_local", n), &m, |b, m| {
                        b.iter(|| paseto.open(&paseto.seal(m)))
                    });
                    g.bench_with_input(BenchmarkId::new("branca", n), &m, |b, m| {
                        b.iter(|| branca_open(&branca_seal(m)))
                    });
                    g.bench_with_input(BenchmarkId::new("fernet", n), &m, |b, m| {
                        b.iter(|| f.decrypt(&f.encrypt(m)).expect("fernet"))
                    });
                }
            }
        }
        g.finish();
    }
}

fn digest(c: &mut Criterion) {
    let mut g = c.benchmark_group("params_digest");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(30);
    for n in SIZES {
        let filler = "x".repeat(n.saturating_sub(60));
        let json = format!(
            r#"{{"name":"transfer","arguments":{{"amount":42,"to":"acct-1","memo":"{filler}"}}}}"#
        );
        g.throughput(Throughput::Bytes(json.len() as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &json, |b, j| {
            b.iter(|| params_digest(j).expect("digest"))
        });
    }
    g.finish();
    // The load bench's `params_json` (`benches/load/clients.rs`, `json_binding`)
    // under the default binding version.
    let json = r#"{"name":"deploy","arguments":{"service":"api","replicas":3,"confirm":true}}"#;
    c.bench_function("params_digest_v2/tools_call_load_bench", |b| {
        b.iter(|| params_digest_v2(Method::ToolsCall, json).expect("digest"))
    });
}

/// One flush (plus fdatasync) per consume: the baseline group commit beats.
struct FlushEach {
    db: sled::Db,
    tree: sled::Tree,
    file: std::fs::File,
}

impl FlushEach {
    fn consume(&self, k: &LedgerKey) {
        if let Ok(Ok(())) =
            self.tree
                .compare_and_swap(k.to_bytes(), None as Option<&[u8]>, Some(&[1u8][..]))
        {
            self.db.flush().expect("flush");
            self.file.sync_data().expect("fdatasync");
        }
    }
}

fn ledger(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut g = c.benchmark_group("ledger_consume");
    g.measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(10);
    let counter = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let next_key = {
        let counter = counter.clone();
        move || {
            let n = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut id = [0u8; 32];
            id[..8].copy_from_slice(&n.to_be_bytes());
            LedgerKey {
                expires_at: 4_000_000_000,
                id,
                tenant: TenantTag::default(),
            }
        }
    };
    for conc in [1usize, 16, 256] {
        g.throughput(Throughput::Elements(conc as u64));
        let dir = tempfile::tempdir().expect("tempdir");
        let grouped: Arc<dyn Ledger> = Arc::new(SledLedger::open(dir.path()).expect("sled"));
        g.bench_function(BenchmarkId::new("group_commit", conc), |b| {
            b.iter_custom(|iters| {
                let l = grouped.clone();
                let next_key = next_key.clone();
                rt.block_on(async move {
                    let t0 = Instant::now();
                    let tasks: Vec<_> = (0..conc)
                        .map(|_| {
                            let (l, next_key) = (l.clone(), next_key.clone());
                            tokio::spawn(async move {
                                for _ in 0..iters {
                                    l.consume(&next_key()).await.expect("consume");
                                }
                            })
                        })
                        .collect();
                    for t in tasks {
                        t.await.expect("task");
                    }
                    t0.elapsed()
                })
            })
        });
        let dir2 = tempfile::tempdir().expect("tempdir");
        let db = sled::Config::new().path(dir2.path()).open().expect("sled");
        let each = Arc::new(FlushEach {
            tree: db.open_tree("t").expect("tree"),
            file: std::fs::File::open(dir2.path().join("db")).expect("db file"),
            db,
        });
        g.bench_function(BenchmarkId::new("flush_per_consume", conc), |b| {
            b.iter_custom(|iters| {
                let each = each.clone();
                let next_key = next_key.clone();
                rt.block_on(async move {
                    let t0 = Instant::now();
                    let tasks: Vec<_> = (0..conc)
                        .map(|_| {
                            let (each, next_key) = (each.clone(), next_key.clone());
                            tokio::task::spawn_blocking(move || {
                                for _ in 0..iters {
                                    each.consume(&next_key());
                                }
                            })
                        })
                        .collect();
                    for t in tasks {
                        t.await.expect("task");
                    }
                    t0.elapsed()
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, tokens, digest, ledger);
criterion_main!(benches);
