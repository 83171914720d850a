//! Producer identity, authorization and fencing on the ingest RPCs (ReportCacheState,
//! PublishEvent; docs/BEHAVIOUR.md §4.3, docs/OPERATIONS.md "Hardened setup").
//!
//! * **Identity** — a verified client certificate's SAN names (read once at the connection's
//!   handshake, [`identity`]), else a bearer token reviewed with TokenReview under the producer
//!   audience (a username `system:serviceaccount:<ns>:<name>`), else none.
//! * **Authorization** — with `--require-producer-auth` a message without an identity is
//!   refused (`UNAUTHENTICATED`); with `--producer-policy` a message is refused
//!   (`PERMISSION_DENIED`) unless a binding allows one of the caller's names for its replica and
//!   tenant (a policy never allows an anonymous caller) ([`policy`]).
//! * **Fencing** — a message sent under an older `x-producer-epoch` than the newest seen for its
//!   replica is refused (`FENCED`) ([`epochs`]).
//!
//! The check runs in the handler before a message is handed to the index (or, on a log writer,
//! to the event log: [`Caller::admit_for_log`]), so nothing of a refused message reaches the
//! index, the change feed or the JetStream log. LookupRoute and the other read RPCs
//! never get here.

pub mod epochs;
pub mod identity;
pub mod policy;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};

use tonic::Status;

pub use identity::PeerCertificate;

/// Why a token gave no identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenError {
    /// The review said the token is invalid, or not for the producer audience.
    Rejected,
    /// No verdict: the API server failed, timed out, or too many reviews are in flight.
    Unavailable(String),
}

/// A producer token reviewer (installed at start-up from the admin layer).
pub trait TokenReview: Send + Sync {
    /// The cached verdict of `token`, if any (no I/O).
    fn cached(&self, token: &str) -> Option<Result<Arc<str>, TokenError>>;
    /// Reviews `token` (run on the admin runtime).
    fn review(
        &'static self,
        token: String,
    ) -> Pin<Box<dyn Future<Output = Result<Arc<str>, TokenError>> + Send>>;
}

/// The producer checks configured at start-up.
pub struct Config {
    /// `--require-producer-auth`.
    pub require: bool,
    /// `--producer-policy`.
    pub policy: Option<policy::Watched>,
    /// `--producer-token-audience` (with the `--kube-*` review client).
    pub tokens: Option<&'static dyn TokenReview>,
}

static CONFIG: OnceLock<Config> = OnceLock::new();

/// Installs the configuration (once, before serving).
pub fn configure(config: Config) {
    let _ = CONFIG.set(config);
}

/// The policy being watched, for the admin thread's poll.
pub fn watched_policy() -> Option<&'static policy::Watched> {
    CONFIG.get()?.policy.as_ref()
}

/// How a caller identified itself (the `identity` label of
/// `inferencecache_producer_refused_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdentityClass {
    /// No identity.
    None = 0,
    /// A verified client certificate.
    Certificate = 1,
    /// A reviewed bearer token.
    Token = 2,
    /// The producer token of a JetStream log message's subject (`<subject>.update.<producer>`),
    /// which NATS publish permissions bind to the NATS user that may publish it.
    Nats = 3,
    /// A JetStream log message a log-writing server published (`<subject>.admitted.*`) after its
    /// own producer checks admitted the gRPC call: only fencing is checked again, in stream
    /// order; NATS publish permissions let only the servers' NATS user publish it.
    Writer = 4,
}

/// Why a message was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No identity, and one is required.
    Unauthenticated = 0,
    /// The policy does not allow this identity for the message's replica or tenant.
    PermissionDenied = 1,
    /// An older producer epoch than the newest seen for the replica.
    Fenced = 2,
}

impl Refusal {
    /// The `Ack.reason_code` of a ReportCacheState stream with this refusal.
    pub fn reason_code(self) -> &'static str {
        match self {
            Self::Unauthenticated => "UNAUTHENTICATED",
            Self::PermissionDenied => "PERMISSION_DENIED",
            Self::Fenced => "FENCED",
        }
    }

    /// PublishEvent's error status for this refusal.
    pub fn status(self) -> Status {
        match self {
            Self::Unauthenticated => Status::unauthenticated("producer identity required"),
            Self::PermissionDenied => {
                Status::permission_denied("producer not allowed for this replica or tenant")
            }
            Self::Fenced => Status::failed_precondition(
                "producer fenced: a newer x-producer-epoch reported for this replica",
            ),
        }
    }
}

/// The caller of one ingest call: its identity and epoch.
#[derive(Clone, Debug)]
pub struct Caller {
    class: IdentityClass,
    names: Arc<[String]>,
    epoch: Option<epochs::Epoch>,
    /// The `x-producer-epoch` value as sent (at most 85 bytes), which a log writer copies onto
    /// the messages it publishes.
    epoch_text: Option<Arc<str>>,
}

/// The identity a JetStream log message carries: `nats:<producer>` from its subject's producer
/// token (none on the plain `<subject>.update` / `<subject>.event`), and the `x-producer-epoch`
/// header its publisher stamped on it. The token is trusted because NATS only lets a user
/// publish to the subjects its permissions allow (docs/OPERATIONS.md "Securing the event log").
pub fn log_caller(producer: Option<&str>, epoch: Option<epochs::Epoch>) -> Caller {
    match producer {
        Some(p) => Caller {
            class: IdentityClass::Nats,
            names: Arc::from([format!("{LOG_IDENTITY_PREFIX}{p}")]),
            epoch,
            epoch_text: None,
        },
        None => Caller {
            class: IdentityClass::None,
            names: Arc::from([]),
            epoch,
            epoch_text: None,
        },
    }
}

/// The caller of a log message a log-writing server published (`<subject>.admitted.*`): the
/// writer's producer checks admitted it, so only its `x-producer-epoch` is checked again (every
/// replica fences in stream order, so all agree), never the identity or the policy (which the
/// writer applied once: replicas whose policy files differ for a moment still agree).
pub fn admitted_caller(epoch: Option<epochs::Epoch>) -> Caller {
    Caller {
        class: IdentityClass::Writer,
        names: Arc::from([]),
        epoch,
        epoch_text: None,
    }
}

/// What a log producer's identity starts with in a `--producer-policy` binding.
pub const LOG_IDENTITY_PREFIX: &str = "nats:";

/// Resolves the caller of an ingest call from its connection and metadata. `Err` is the call's
/// status: a malformed epoch (INVALID_ARGUMENT), a token the review rejected (UNAUTHENTICATED)
/// or no verdict (UNAVAILABLE).
pub async fn caller<T>(req: &tonic::Request<T>) -> Result<Caller, Status> {
    let (epoch, epoch_text) = match req.metadata().get(epochs::EPOCH_HEADER) {
        None => (None, None),
        Some(v) => {
            let v = v.to_str().unwrap_or("");
            let e = epochs::parse(v).map_err(|e| {
                Status::invalid_argument(format!("malformed {}: {e}", epochs::EPOCH_HEADER))
            })?;
            (Some(e), Some(Arc::from(v)))
        }
    };
    if let Some(PeerCertificate(names)) = req.extensions().get::<PeerCertificate>() {
        return Ok(Caller {
            class: IdentityClass::Certificate,
            names: names.clone(),
            epoch,
            epoch_text,
        });
    }
    let reviewer = CONFIG.get().and_then(|c| c.tokens);
    let token = crate::sys::http_auth::bearer_token(req.metadata().as_ref());
    let (Some(reviewer), Some(token)) = (reviewer, token) else {
        return Ok(Caller {
            class: IdentityClass::None,
            names: Arc::from([]),
            epoch,
            epoch_text,
        });
    };
    let verdict = match reviewer.cached(token) {
        Some(v) => v,
        None => review_off_core(reviewer, token.to_string()).await,
    };
    match verdict {
        Ok(name) => Ok(Caller {
            class: IdentityClass::Token,
            names: Arc::from([name.to_string()]),
            epoch,
            epoch_text,
        }),
        Err(TokenError::Rejected) => {
            crate::metrics::producer::record_token_rejected();
            Err(Status::unauthenticated(
                "producer token rejected by TokenReview",
            ))
        }
        Err(TokenError::Unavailable(why)) => {
            crate::metrics::producer::record_token_unavailable();
            tracing::warn!(error = %why, "producer_token_review_unavailable");
            Err(Status::unavailable(format!(
                "producer token review unavailable: {why}"
            )))
        }
    }
}

/// Runs a review on the admin runtime; the calling core only awaits the answer.
async fn review_off_core(
    reviewer: &'static dyn TokenReview,
    token: String,
) -> Result<Arc<str>, TokenError> {
    let Some(handle) = crate::runtime::admin_thread::handle() else {
        return Err(TokenError::Unavailable("no admin runtime".into()));
    };
    handle
        .spawn(reviewer.review(token))
        .await
        .unwrap_or_else(|_| Err(TokenError::Unavailable("review task failed".into())))
}

impl Caller {
    /// Admits one message for `replica` of `tenant`: authorization first (so a refused caller
    /// never moves an epoch), then fencing. A refusal is counted.
    pub fn admit(&self, tenant: &str, replica: &str) -> Result<(), Refusal> {
        let out = self.check(tenant, replica);
        if let Err(why) = out {
            crate::metrics::producer::record_refused(why as usize, self.class as usize);
        }
        out
    }

    /// A log writer's check before it publishes a message (`--nats-log-writer`): as [`admit`],
    /// but an epoch is only compared, not recorded. The log's consumers record it when they
    /// apply the message in stream order, so every replica's table moves alike (a publish that
    /// fails must not move the writer's). A refusal is counted.
    ///
    /// [`admit`]: Caller::admit
    pub fn admit_for_log(&self, tenant: &str, replica: &str) -> Result<(), Refusal> {
        let out = self
            .authorize(tenant, replica)
            .and_then(|()| match self.epoch {
                Some(e) if !epochs::would_admit(tenant, replica, e) => Err(Refusal::Fenced),
                _ => Ok(()),
            });
        if let Err(why) = out {
            crate::metrics::producer::record_refused(why as usize, self.class as usize);
        }
        out
    }

    /// After a log writer's publish for `replica` of `tenant` was stored: its epoch counts for
    /// this writer's next checks ([`admit_for_log`]) before its consumer applies it.
    ///
    /// [`admit_for_log`]: Caller::admit_for_log
    pub fn note_published(&self, tenant: &str, replica: &str) {
        if let Some(e) = self.epoch {
            epochs::note_published(tenant, replica, e);
        }
    }

    /// The `x-producer-epoch` the call sent, as sent.
    pub fn epoch_text(&self) -> Option<&str> {
        self.epoch_text.as_deref()
    }

    fn check(&self, tenant: &str, replica: &str) -> Result<(), Refusal> {
        self.authorize(tenant, replica)?;
        match self.epoch {
            Some(e) => epochs::admit(tenant, replica, e).map_err(|()| Refusal::Fenced),
            None => Ok(()),
        }
    }

    /// Identity and policy; a writer-admitted log message passed them at its writer.
    fn authorize(&self, tenant: &str, replica: &str) -> Result<(), Refusal> {
        if self.class == IdentityClass::Writer {
            return Ok(());
        }
        if let Some(cfg) = CONFIG.get() {
            let anonymous = self.class == IdentityClass::None;
            if anonymous && (cfg.require || cfg.policy.is_some()) {
                return Err(Refusal::Unauthenticated);
            }
            if let Some(p) = &cfg.policy
                && !p.current().allows(&self.names, tenant, replica)
            {
                return Err(Refusal::PermissionDenied);
            }
        }
        Ok(())
    }
}
