//! TLS and credentials of the event log's NATS connection (`--nats-ca-file`,
//! `--nats-client-cert-file`/`--nats-client-key-file`, `--nats-creds-file`, `--nats-user` with
//! `--nats-password-file` or `NATS_PASSWORD`; docs/OPERATIONS.md "Securing the event log"), one
//! implementation for both ends of the log: the server's consumer and kvevent-subscriber's
//! publisher take the same flags. Every file is checked at start-up (the callers exit 2 with the
//! error, which names the flag); the password is never shown (`Debug` hides it).

use std::path::{Path, PathBuf};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The `--nats-*` flag values (empty = not given).
#[derive(Clone, Copy, Debug, Default)]
pub struct Flags<'a> {
    /// `--nats-url`.
    pub url: &'a str,
    /// `--nats-ca-file`.
    pub ca_file: &'a str,
    /// `--nats-client-cert-file`.
    pub client_cert_file: &'a str,
    /// `--nats-client-key-file`.
    pub client_key_file: &'a str,
    /// `--nats-creds-file`.
    pub creds_file: &'a str,
    /// `--nats-user`.
    pub user: &'a str,
    /// `--nats-password-file`.
    pub password_file: &'a str,
}

/// Environment variable holding the `--nats-user` password when `--nats-password-file` is not
/// given.
pub const PASSWORD_ENV: &str = "NATS_PASSWORD";

/// What the NATS connection authenticates with.
#[derive(Clone, Default)]
pub struct NatsAuth {
    ca_file: Option<PathBuf>,
    client_cert: Option<(PathBuf, PathBuf)>,
    creds_file: Option<PathBuf>,
    user: Option<(String, String)>,
}

impl std::fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAuth")
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("creds_file", &self.creds_file)
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish()
    }
}

fn opt(s: &str) -> Option<PathBuf> {
    (!s.is_empty()).then(|| PathBuf::from(s))
}

/// Reads the PEM certificates of `path` (at least one).
fn read_certs(flag: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{flag} {}: cannot read: {e}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{flag} {}: not PEM certificates: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{flag} {}: no certificate in the file",
            path.display()
        ));
    }
    Ok(certs)
}

/// Checks that the client certificate and key load and belong together (errors name the
/// files, never the key).
fn check_pair(cert: &Path, key: &Path) -> Result<(), String> {
    let certs = read_certs("--nats-client-cert-file", cert)?;
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        format!(
            "--nats-client-key-file {}: not a PEM private key: {e}",
            key.display()
        )
    })?;
    let provider = rustls::crypto::ring::default_provider();
    rustls::sign::CertifiedKey::from_der(certs, key_der, &provider)
        .map(|_| ())
        .map_err(|e| {
            format!("--nats-client-cert-file/--nats-client-key-file: certificate and key do not match: {e}")
        })
}

impl NatsAuth {
    /// From the flags (and `env`, the password variable's value): a usage error names the flag.
    pub fn from_flags(f: Flags<'_>, env: Option<String>) -> Result<Self, String> {
        let ca_file = opt(f.ca_file);
        if let Some(ca) = &ca_file {
            read_certs("--nats-ca-file", ca)?;
        }
        let client_cert = match (opt(f.client_cert_file), opt(f.client_key_file)) {
            (None, None) => None,
            (Some(c), Some(k)) => {
                check_pair(&c, &k)?;
                Some((c, k))
            }
            _ => {
                return Err(
                    "--nats-client-cert-file and --nats-client-key-file must be set together"
                        .into(),
                );
            }
        };
        let creds_file = opt(f.creds_file);
        if let Some(c) = &creds_file {
            std::fs::metadata(c).map_err(|e| format!("--nats-creds-file {}: {e}", c.display()))?;
        }
        let user = match (f.user, opt(f.password_file)) {
            ("", None) => None,
            ("", Some(_)) => return Err("--nats-password-file needs --nats-user".into()),
            (u, file) => Some((u.to_string(), password(file.as_deref(), env)?)),
        };
        if user.is_some() && creds_file.is_some() {
            return Err("--nats-user and --nats-creds-file are alternatives; give one".into());
        }
        let any = ca_file.is_some() || client_cert.is_some() || creds_file.is_some();
        if (any || user.is_some()) && f.url.is_empty() {
            return Err("the --nats-* TLS and credential flags need --nats-url".into());
        }
        Ok(Self {
            ca_file,
            client_cert,
            creds_file,
            user,
        })
    }

    /// `opts` with this TLS and these credentials (reads the creds file).
    pub async fn apply(
        &self,
        mut opts: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions, String> {
        if let Some(ca) = &self.ca_file {
            opts = opts.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some((c, k)) = &self.client_cert {
            opts = opts.add_client_certificate(c.clone(), k.clone());
        }
        if let Some(path) = &self.creds_file {
            opts = opts
                .credentials_file(path)
                .await
                .map_err(|e| format!("--nats-creds-file {}: {e}", path.display()))?;
        }
        if let Some((u, p)) = &self.user {
            opts = opts.user_and_password(u.clone(), p.clone());
        }
        Ok(opts)
    }
}

/// The password: the file's content (trimmed), else the environment variable's value.
fn password(file: Option<&Path>, env: Option<String>) -> Result<String, String> {
    let pass = match file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| format!("--nats-password-file {}: cannot read: {e}", path.display()))?
            .trim()
            .to_string(),
        None => env.ok_or_else(|| {
            format!(
                "--nats-user needs --nats-password-file or the {PASSWORD_ENV} environment variable"
            )
        })?,
    };
    if pass.is_empty() {
        return Err("--nats-user: the password is empty".into());
    }
    Ok(pass)
}

/// Why NATS refused this client (as opposed to being unreachable): the `reason` label of both
/// ends' refusal counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Credentials: wrong user/password or creds, or not authorized.
    Auth,
    /// TLS: the server's certificate, or the client certificate it requires.
    Tls,
}

impl Refusal {
    /// The metric label: `auth` or `tls`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Auth => "auth",
            Self::Tls => "tls",
        }
    }
}

/// Whether a failed connection is NATS refusing this client (credentials, TLS) rather than an
/// unreachable server, which retrying may fix. A TLS alert from the server (e.g.
/// `bad_certificate` when a client certificate is required) or a rejected server certificate
/// arrives as an IO error wrapping rustls' error: it counts as TLS too.
pub fn refusal(e: &async_nats::ConnectError) -> Option<Refusal> {
    use async_nats::ConnectErrorKind as K;
    match e.kind() {
        K::AuthorizationViolation | K::Authentication => Some(Refusal::Auth),
        K::Tls => Some(Refusal::Tls),
        _ => tls_in_chain(e).then_some(Refusal::Tls),
    }
}

/// Whether a rustls error is somewhere in `e`'s source chain (directly or inside an IO error).
fn tls_in_chain(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io
                .get_ref()
                .is_some_and(|inner| inner.is::<rustls::Error>())
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// The same for a background reconnect's event (the client retries those by itself, so they
/// would be silent unless counted from here).
pub fn event_refusal(ev: &async_nats::Event) -> Option<Refusal> {
    use async_nats::ConnectErrorKind as K;
    match ev {
        async_nats::Event::ServerError(async_nats::ServerError::AuthorizationViolation) => {
            Some(Refusal::Auth)
        }
        async_nats::Event::ClientError(async_nats::ClientError::Other(text)) => {
            [K::AuthorizationViolation, K::Authentication, K::Tls]
                .into_iter()
                .find(|k| *text == k.to_string())
                .and_then(|k| refusal(&async_nats::ConnectError::new(k)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Flags with `--nats-url` and `extra` as (flag, value) pairs.
    fn cli<'a>(extra: &[&'a str]) -> Flags<'a> {
        let mut f = Flags {
            url: "nats://127.0.0.1:4222",
            ..Default::default()
        };
        for kv in extra.chunks(2) {
            let v = kv[1];
            match kv[0] {
                "--nats-user" => f.user = v,
                "--nats-password-file" => f.password_file = v,
                "--nats-ca-file" => f.ca_file = v,
                "--nats-client-cert-file" => f.client_cert_file = v,
                other => panic!("{other}"),
            }
        }
        f
    }

    #[test]
    fn password_comes_from_the_file_else_the_environment_and_is_never_shown() {
        let dir = std::env::temp_dir().join(format!("ic-nats-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pw");
        std::fs::write(&file, "s3cret-from-file\n").unwrap();
        let f = file.to_str().unwrap();
        let a = NatsAuth::from_flags(cli(&["--nats-user", "u", "--nats-password-file", f]), None)
            .unwrap();
        assert_eq!(a.user, Some(("u".into(), "s3cret-from-file".into())));
        assert!(!format!("{a:?}").contains("s3cret"), "{a:?}");
        let b = NatsAuth::from_flags(cli(&["--nats-user", "u"]), Some("env-pass".into())).unwrap();
        assert_eq!(b.user, Some(("u".into(), "env-pass".into())));
        let e = NatsAuth::from_flags(cli(&["--nats-user", "u"]), None).unwrap_err();
        assert!(e.contains("NATS_PASSWORD"), "{e}");
        std::fs::write(&file, " \n").unwrap();
        let e = NatsAuth::from_flags(cli(&["--nats-user", "u", "--nats-password-file", f]), None)
            .unwrap_err();
        assert!(e.contains("empty"), "{e}");
        let e = NatsAuth::from_flags(cli(&["--nats-ca-file", f]), None).unwrap_err();
        assert!(e.contains("--nats-ca-file"), "{e}");
        let e = NatsAuth::from_flags(cli(&["--nats-client-cert-file", f]), None).unwrap_err();
        assert!(e.contains("together"), "{e}");
        let none = NatsAuth::from_flags(cli(&[]), None).unwrap();
        assert!(none.user.is_none() && none.ca_file.is_none());
        let no_url = Flags {
            user: "u",
            ..Default::default()
        };
        assert!(NatsAuth::from_flags(no_url, Some("p".into())).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn refusals_are_told_apart_from_an_unreachable_server() {
        use async_nats::{ConnectError, ConnectErrorKind as K};
        assert_eq!(
            refusal(&ConnectError::new(K::AuthorizationViolation)),
            Some(Refusal::Auth)
        );
        assert_eq!(refusal(&ConnectError::new(K::Tls)), Some(Refusal::Tls));
        assert_eq!(refusal(&ConnectError::new(K::Io)), None);
        assert_eq!(refusal(&ConnectError::new(K::TimedOut)), None);
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(refusal(&ConnectError::with_source(K::Io, refused)), None);
        // What a nats-server with `verify: true` answers a client without a certificate.
        let alert = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::AlertReceived(rustls::AlertDescription::BadCertificate),
        );
        assert_eq!(
            refusal(&ConnectError::with_source(K::Io, alert)),
            Some(Refusal::Tls)
        );
        let ev = async_nats::Event::ClientError(async_nats::ClientError::Other(
            K::AuthorizationViolation.to_string(),
        ));
        assert_eq!(event_refusal(&ev), Some(Refusal::Auth));
        let ev = async_nats::Event::ClientError(async_nats::ClientError::Other(K::Io.to_string()));
        assert_eq!(event_refusal(&ev), None);
    }
}
