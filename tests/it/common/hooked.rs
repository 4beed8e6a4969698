//! A real sled ledger behind hooks: what a test puts in front of it — a
//! failing disk, a stalled consumption, a count of collection rounds. Every
//! call goes to the real ledger unless its hook fails it first.

use std::sync::Arc;

use stateseal::internals::ledger::sled::SledLedger;
use stateseal::internals::ledger::{
    Consumed, Held, LeaseAsk, Ledger, LedgerError, LedgerKey, Reserved,
};

#[async_trait::async_trait]
pub trait Hooks: Send + Sync + 'static {
    /// Before a consumption: may wait, or fail it.
    async fn consume(&self) -> Result<(), LedgerError> {
        Ok(())
    }
    /// Before a reserve, renew, commit or release.
    fn write(&self) -> Result<(), LedgerError> {
        Ok(())
    }
    /// Before a collection round.
    fn collect(&self) -> Result<(), LedgerError> {
        Ok(())
    }
    /// Whether the ledger may report ready.
    fn ready(&self) -> bool {
        true
    }
}

pub struct Hooked<H> {
    pub inner: Arc<SledLedger>,
    pub hooks: H,
}

/// No clock of its own (as sled): the guard's monotonic anchor.
impl<H: Hooks> stateseal::internals::clock::guard::Reference for Hooked<H> {}

#[async_trait::async_trait]
impl<H: Hooks> Ledger for Hooked<H> {
    async fn consume_as(
        &self,
        key: &LedgerKey,
        attempt: Option<[u8; 16]>,
    ) -> Result<Consumed, LedgerError> {
        self.hooks.consume().await?;
        self.inner.consume_as(key, attempt).await
    }
    async fn reserve(&self, key: &LedgerKey, ask: LeaseAsk) -> Result<Reserved, LedgerError> {
        self.hooks.write()?;
        self.inner.reserve(key, ask).await
    }
    async fn renew(
        &self,
        key: &LedgerKey,
        rid: [u8; 16],
        seconds: u32,
        cap: u64,
    ) -> Result<Held, LedgerError> {
        self.hooks.write()?;
        self.inner.renew(key, rid, seconds, cap).await
    }
    async fn commit(&self, key: &LedgerKey, rid: [u8; 16]) -> Result<Held, LedgerError> {
        self.hooks.write()?;
        self.inner.commit(key, rid).await
    }
    async fn release(&self, key: &LedgerKey, rid: [u8; 16]) -> Result<(), LedgerError> {
        self.hooks.write()?;
        self.inner.release(key, rid).await
    }
    async fn ready(&self) -> bool {
        self.hooks.ready() && self.inner.ready().await
    }
    async fn remove_expired(&self, before: u64, limit: usize) -> Result<usize, LedgerError> {
        self.hooks.collect()?;
        self.inner.remove_expired(before, limit).await
    }
    async fn close(&self) -> Result<(), LedgerError> {
        self.inner.close().await
    }
    fn backend(&self) -> &'static str {
        "hooked-sled"
    }
}
