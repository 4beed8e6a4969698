//! TLS to PostgreSQL against private instances this test starts itself
//! (`initdb` into a temporary directory, its own port, `ssl = on` with a
//! throwaway CA made here): verify-full works; a wrong CA or host name fails
//! closed with a fixed message; verify-ca ignores the name only; a client
//! certificate authenticates; a plaintext-only server is refused when TLS is
//! required. Needs root (initdb runs as the `postgres` user via runuser) and
//! PostgreSQL's server binaries; without them it prints SKIPPED.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use crate::common::pki::Ca;
use crate::common::private_pg::{pg_bin, PrivatePg};
use rcgen::SanType;
use stateseal::internals::ledger::pgtls::{PgTlsFlags, SslMode};
use stateseal::internals::ledger::postgres::{PgLedger, PgOptions};
use stateseal::internals::ledger::{Consumed, Ledger, LedgerKey, TenantTag};

fn skip(why: &str) {
    crate::common::skip::skipped("tls-to-postgresql", why);
}

fn write(dir: &Path, name: &str, pem: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, pem).unwrap();
    p
}

async fn connect(url: &str, tls: PgTlsFlags) -> Result<PgLedger, String> {
    connect_logged(url, tls).await.0
}

/// Connects, and returns what the start logged too (its sslmode warnings).
async fn connect_logged(url: &str, tls: PgTlsFlags) -> (Result<PgLedger, String>, String) {
    let (l, log) = crate::common::logs::captured(PgLedger::connect(
        url,
        PgOptions {
            timeout: std::time::Duration::from_secs(5),
            pool_size: 2,
            tls,
            ..PgOptions::default()
        },
    ))
    .await;
    (l.map_err(|e| e.to_string()), log)
}

const UNVERIFIED: &str = "certificate is not verified";
const PLAINTEXT: &str = "is not encrypted";

async fn consumes(l: &PgLedger) {
    let key = LedgerKey {
        expires_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 600,
        id: rand::random(),
        tenant: TenantTag::default(),
    };
    assert_eq!(l.consume(&key).await.unwrap(), Consumed::Now);
    assert_eq!(l.consume(&key).await.unwrap(), Consumed::Before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_postgresql_libpq_modes() {
    let Some(bin) = pg_bin() else {
        return skip("no PostgreSQL server binaries under /usr/lib/postgresql");
    };
    if !rustix::process::geteuid().is_root() {
        return skip("not root: initdb must run as the postgres user");
    }
    let ca = Ca::new("stateseal test CA");
    let other_ca = Ca::new("another CA");
    // The server certificate names localhost only, not 127.0.0.1.
    let (cert, key) = ca.issue_named(
        "server",
        vec![SanType::DnsName("localhost".try_into().unwrap())],
    );
    let pg = PrivatePg::start(&bin, Some((&cert, &key, &ca.pem())), "");
    let files = tempfile::tempdir().unwrap();
    let ca_file = write(files.path(), "ca.pem", &ca.pem());
    let other_file = write(files.path(), "other.pem", &other_ca.pem());
    let (ccert, ckey) = ca.issue_named("certuser", vec![]);
    let ccert = write(files.path(), "client.pem", &ccert);
    let ckey = write(files.path(), "client.key", &ckey);
    let port = pg.port;
    let url =
        |host: &str, extra: &str| format!("postgres://postgres@{host}:{port}/postgres?{extra}");

    // verify-full, from the URL: works, and warns of nothing.
    let (l, log) = connect_logged(
        &url(
            "localhost",
            &format!("sslmode=verify-full&sslrootcert={}", ca_file.display()),
        ),
        PgTlsFlags::default(),
    )
    .await;
    let l = l.unwrap();
    consumes(&l).await;
    l.close().await.unwrap();
    assert!(
        !log.contains(UNVERIFIED) && !log.contains(PLAINTEXT),
        "{log}"
    );

    // require checks the chain when it is given a root certificate (as
    // libpq does), so only require without one warns that the server's
    // certificate is not verified.
    for (extra, warned) in [
        (String::new(), true),
        (format!("&sslrootcert={}", ca_file.display()), false),
    ] {
        let (l, log) = connect_logged(
            &url("localhost", &format!("sslmode=require{extra}")),
            PgTlsFlags::default(),
        )
        .await;
        l.unwrap().close().await.unwrap();
        assert_eq!(log.contains(UNVERIFIED), warned, "require{extra}: {log}");
        assert!(!log.contains(PLAINTEXT), "{log}");
    }

    // verify-full, from the flags, over a URL that says nothing: works.
    let l = connect(
        &url("localhost", ""),
        PgTlsFlags {
            mode: Some(SslMode::VerifyFull),
            root_cert: Some(ca_file.clone()),
            ..PgTlsFlags::default()
        },
    )
    .await
    .unwrap();
    l.close().await.unwrap();

    // A wrong CA: refused, with a fixed message.
    let e = connect(
        &url(
            "localhost",
            &format!("sslmode=verify-full&sslrootcert={}", other_file.display()),
        ),
        PgTlsFlags::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(
        e,
        "ledger unavailable: connect: the PostgreSQL server's certificate failed verification (sslmode=verify-full)"
    );
    // The wrong host name: verify-full refuses, verify-ca (chain only) works.
    let e = connect(
        &url(
            "127.0.0.1",
            &format!("sslmode=verify-full&sslrootcert={}", ca_file.display()),
        ),
        PgTlsFlags::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(
        e,
        "ledger unavailable: connect: the PostgreSQL server's certificate failed verification (sslmode=verify-full)"
    );
    let l = connect(
        &url(
            "127.0.0.1",
            &format!("sslmode=verify-ca&sslrootcert={}", ca_file.display()),
        ),
        PgTlsFlags::default(),
    )
    .await
    .unwrap();
    l.close().await.unwrap();
    // verify-ca with the wrong CA still fails.
    let e = connect(
        &url(
            "127.0.0.1",
            &format!("sslmode=verify-ca&sslrootcert={}", other_file.display()),
        ),
        PgTlsFlags::default(),
    )
    .await
    .unwrap_err();
    assert!(e.contains("failed verification (sslmode=verify-ca)"), "{e}");

    // A client certificate authenticates (pg_hba: `hostssl … certuser … cert`).
    let l = connect(
        &format!(
            "postgres://certuser@localhost:{port}/postgres?sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
            ca_file.display(),
            ccert.display(),
            ckey.display()
        ),
        PgTlsFlags::default(),
    )
    .await
    .unwrap();
    consumes(&l).await;
    l.close().await.unwrap();
    // ... and without it, certuser is refused.
    let e = connect(
        &format!(
            "postgres://certuser@localhost:{port}/postgres?sslmode=verify-full&sslrootcert={}",
            ca_file.display()
        ),
        PgTlsFlags::default(),
    )
    .await
    .unwrap_err();
    assert!(e.starts_with("ledger unavailable: connect:"), "{e}");

    // A plaintext-only server.
    let plain = PrivatePg::start(&bin, None, "");
    let purl = |mode: &str| {
        format!(
            "postgres://postgres@localhost:{}/postgres?sslmode={mode}",
            plain.port
        )
    };
    for mode in ["require", "verify-full"] {
        let extra = if mode == "verify-full" {
            format!("&sslrootcert={}", ca_file.display())
        } else {
            String::new()
        };
        let e = connect(&format!("{}{extra}", purl(mode)), PgTlsFlags::default())
            .await
            .unwrap_err();
        assert_eq!(
            e,
            format!(
                "ledger unavailable: connect: the PostgreSQL server does not offer TLS, which sslmode={mode} requires"
            )
        );
    }
    // prefer (libpq's default) falls back to plaintext; disable never tries.
    // Neither asks for TLS, so a connection that fails for another reason
    // gets the database's own words, never "does not offer TLS".
    for mode in ["prefer", "disable"] {
        let l = connect(&purl(mode), PgTlsFlags::default()).await.unwrap();
        consumes(&l).await;
        l.close().await.unwrap();
        let e = connect(
            &purl(mode).replace("/postgres?", "/no_such_database?"),
            PgTlsFlags::default(),
        )
        .await
        .unwrap_err();
        assert!(
            e.starts_with("ledger unavailable: connect:") && e.contains("does not exist"),
            "sslmode={mode}: {e}"
        );
        assert!(!e.contains("TLS"), "sslmode={mode}: {e}");
    }
}
