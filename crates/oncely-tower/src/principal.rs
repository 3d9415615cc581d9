//! Who sent a request: the principal a client's key is bound to.

use http::request::Parts;
use oncely::Tenant;

/// An authenticated caller: the tenant it belongs to and its stable id (a
/// user id, an API key's id; never a secret).
///
/// The effect key of a request is
/// [`EffectKey::for_client`](oncely::EffectKey::for_client)`(tenant, id,
/// kind, client_key)`: the same `Idempotency-Key` sent by another principal
/// is another effect, so nobody can replay or block an operation they do not
/// own by guessing its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    tenant: Tenant,
    id: String,
}

impl Principal {
    /// A principal `id` of `tenant`.
    pub fn new(tenant: Tenant, id: impl Into<String>) -> Self {
        Principal {
            tenant,
            id: id.into(),
        }
    }

    /// The tenant its keys are scoped to.
    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    /// Its stable id.
    pub fn id(&self) -> &str {
        &self.id
    }
}

/// How the layer learns a request's principal; the application implements
/// it (or passes a closure `Fn(&Parts) -> Option<Principal>`).
///
/// It runs after the authentication middleware, which is placed outside
/// (before) the idempotency layer. `None` means "not authenticated": a
/// request that carries an `Idempotency-Key` is then refused with 401
/// ([`Rejection::Unauthenticated`](crate::Rejection::Unauthenticated)), since
/// its key could not be bound to anyone.
pub trait PrincipalSource: Clone + Send + Sync + 'static {
    /// The request's authenticated principal.
    fn principal(&self, request: &Parts) -> Option<Principal>;
}

impl<F> PrincipalSource for F
where
    F: Fn(&Parts) -> Option<Principal> + Clone + Send + Sync + 'static,
{
    fn principal(&self, request: &Parts) -> Option<Principal> {
        self(request)
    }
}

/// The default [`PrincipalSource`]: the [`Principal`] that the
/// authentication middleware put in the request's extensions
/// (`request.extensions_mut().insert(principal)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct FromExtensions;

impl PrincipalSource for FromExtensions {
    fn principal(&self, request: &Parts) -> Option<Principal> {
        request.extensions.get::<Principal>().cloned()
    }
}
