//! Who is calling: every request gets exactly one [`Tenant`] in its
//! extensions before it reaches the service, or is refused.

use tonic::{Request, Status};

use crate::binding::Tenant;

/// How callers are identified.
#[derive(Clone, Debug)]
pub enum Authenticator {
    /// No caller authentication: every request belongs to one implicit tenant.
    /// Allowed only on loopback unless explicitly overridden (see `config`).
    Implicit(Tenant),
}

impl Authenticator {
    /// Attaches the caller's tenant to the request, or refuses it.
    pub fn authenticate<T>(&self, mut req: Request<T>) -> Result<Request<T>, Status> {
        match self {
            Authenticator::Implicit(t) => {
                req.extensions_mut().insert(t.clone());
                Ok(req)
            }
        }
    }
}
