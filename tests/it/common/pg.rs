//! The shared PostgreSQL database (`STATESEAL_TEST_DATABASE_URL`). The
//! tests that use it run in one process and share one ledger table, and
//! garbage collection removes any expired record or ended lease in it,
//! whichever test made it. So every user holds a claim for its whole run:
//! the ledger contract's tests, which count what collection removes, hold
//! it alone; every other test shares it.
#![allow(dead_code)]

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static TABLE: RwLock<()> = RwLock::const_new(());

/// The database, shared with the other tests that share it.
pub struct Shared {
    pub url: String,
    _claim: RwLockReadGuard<'static, ()>,
}

/// The database, with no other test on it.
pub struct Alone {
    pub url: String,
    _claim: RwLockWriteGuard<'static, ()>,
}

fn url(skip: &str) -> Option<String> {
    let url = std::env::var("STATESEAL_TEST_DATABASE_URL")
        .ok()
        .filter(|s| !s.is_empty());
    if url.is_none() {
        super::skip::skipped(skip, "set STATESEAL_TEST_DATABASE_URL");
    }
    url
}

/// The database, or `None` after a loud skip named `skip`.
pub async fn shared(skip: &str) -> Option<Shared> {
    let url = url(skip)?;
    Some(Shared {
        url,
        _claim: TABLE.read().await,
    })
}

/// The database alone, or `None` after a loud skip named `skip`.
pub async fn alone(skip: &str) -> Option<Alone> {
    let url = url(skip)?;
    Some(Alone {
        url,
        _claim: TABLE.write().await,
    })
}

/// A plain connection to the test database, its connection task spawned.
pub async fn pg_client(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

/// A schema of its own in the test database, created afresh, with the URL
/// that makes it every session's `search_path` (through the URL's
/// `options`): a ledger there sees no other test's table.
pub struct OwnSchema {
    pub client: tokio_postgres::Client,
    pub name: String,
    pub url: String,
}

impl OwnSchema {
    pub async fn create(url: &str, what: &str) -> Self {
        let name = format!("stateseal_{what}_{}", std::process::id());
        let client = pg_client(url).await;
        client
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {name} CASCADE; CREATE SCHEMA {name}"
            ))
            .await
            .unwrap();
        let sep = if url.contains('?') { '&' } else { '?' };
        let url = format!("{url}{sep}options=-c%20search_path%3D{name}");
        OwnSchema { client, name, url }
    }

    pub async fn remove(self) {
        self.client
            .batch_execute(&format!("DROP SCHEMA {} CASCADE", self.name))
            .await
            .unwrap();
    }
}
