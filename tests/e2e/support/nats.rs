//! A real `nats-server -js` (Debian's `nats-server` package; `.ci/run` installs it) on a free
//! loopback port with a temporary store directory, killed on drop; plus JetStream helpers the
//! replica scenarios publish and inspect the event log with. Scenarios that need it are
//! `#[cfg_attr(not(has_nats_server), ignore = ...)]` (build.rs), so without it the test runner
//! reports them as ignored.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream;

use super::{ScratchDir, free_port, scratch_dir, wait_until};

/// A running `nats-server -js`.
pub struct NatsServer {
    child: Child,
    pub port: u16,
    pub store: ScratchDir,
    /// With [`NatsServer::start_secured`]: what clients must present.
    pub secured: Option<Secured>,
}

/// The TLS and credentials a secured nats-server requires (files in its store directory).
pub struct Secured {
    /// The CA that signed the server's certificate (SANs localhost, 127.0.0.1).
    pub ca_file: std::path::PathBuf,
    /// A client certificate and key from that CA (the server verifies client certificates).
    pub client_cert: std::path::PathBuf,
    pub client_key: std::path::PathBuf,
    pub user: String,
    pub password: String,
}

impl NatsServer {
    /// Starts it and waits until it accepts connections.
    pub fn start() -> NatsServer {
        NatsServer::start_on(free_port())
    }

    /// Starts it on `port`.
    pub fn start_on(port: u16) -> NatsServer {
        let store = scratch_dir("nats-store");
        let child = Command::new("nats-server")
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(store.as_os_str())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nats-server");
        let up = wait_until(Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(up, "nats-server did not listen on {port}");
        NatsServer {
            child,
            port,
            store,
            secured: None,
        }
    }

    /// Starts one that requires TLS with a client certificate (generated certificates) and
    /// user `user` / `password`, from a configuration file written here.
    pub fn start_secured(user: &str, password: &str) -> NatsServer {
        let port = free_port();
        let store = scratch_dir("nats-secured");
        let all = super::pki::gen_pki_with_client("nats", "producer");
        let pki = &all.pki;
        let file = |name: &str, text: &str| {
            let p = store.join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let ca_file = file("ca.pem", &pki.ca_pem);
        let cert = file("server.pem", &pki.cert_pem);
        let key = file("server.key", &pki.key_pem);
        let client_cert = file("client.pem", &all.client_cert_pem);
        let client_key = file("client.key", &all.client_key_pem);
        let js_dir = store.join("js");
        let conf = format!(
            "listen: \"127.0.0.1:{port}\"\n\
             jetstream {{ store_dir: {js:?} }}\n\
             tls {{ cert_file: {cert:?}, key_file: {key:?}, ca_file: {ca:?}, verify: true, \
             timeout: 5 }}\n\
             authorization {{ user: {user:?}, password: {password:?} }}\n",
            js = js_dir.display().to_string(),
            ca = ca_file.display().to_string(),
            cert = cert.display().to_string(),
            key = key.display().to_string(),
        );
        let mut srv = NatsServer::from_config(store, port, &conf);
        srv.secured = Some(Secured {
            ca_file,
            client_cert,
            client_key,
            user: user.into(),
            password: password.into(),
        });
        srv
    }

    /// Starts one from the configuration `conf` (written to `store`/nats.conf) listening on
    /// `port`, and waits until it accepts connections.
    fn from_config(store: ScratchDir, port: u16, conf: &str) -> NatsServer {
        let conf_path = store.join("nats.conf");
        std::fs::write(&conf_path, conf).unwrap();
        let child = Command::new("nats-server")
            .arg("-c")
            .arg(&conf_path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nats-server");
        let up = wait_until(Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(up, "nats-server did not listen on {port}");
        NatsServer {
            child,
            port,
            store,
            secured: None,
        }
    }

    /// Starts one (plain text) whose clients log in as one of `users`, a NATS `users = [...]`
    /// list with permissions (e.g. the one docs/OPERATIONS.md "Securing the event log" shows).
    pub fn start_with_users(users: &str) -> NatsServer {
        let port = free_port();
        let store = scratch_dir("nats-users");
        let conf = format!(
            "listen: \"127.0.0.1:{port}\"\n\
             jetstream {{ store_dir: {js:?} }}\n\
             authorization {{ users = [\n{users}\n] }}\n",
            js = store.join("js").display().to_string(),
        );
        NatsServer::from_config(store, port, &conf)
    }

    /// Starts one (plain text, no authentication) that takes messages of at most `bytes`
    /// (`max_payload`).
    pub fn start_with_max_payload(bytes: usize) -> NatsServer {
        let port = free_port();
        let store = scratch_dir("nats-max-payload");
        let conf = format!(
            "listen: \"127.0.0.1:{port}\"\n\
             max_payload: {bytes}\n\
             jetstream {{ store_dir: {js:?} }}\n",
            js = store.join("js").display().to_string(),
        );
        NatsServer::from_config(store, port, &conf)
    }

    /// The `nats://` URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts one in operator mode (JWT authentication, an in-memory resolver preloaded with
    /// one JetStream-enabled account) and returns it with the text of a user's credentials file
    /// (user JWT + nkey seed, the format `nsc` writes).
    pub fn start_operator_mode() -> (NatsServer, String) {
        let port = free_port();
        let store = scratch_dir("nats-operator");
        let op = nkeys::KeyPair::new_operator();
        let acc = nkeys::KeyPair::new_account();
        // JetStream needs a system account.
        let sys = nkeys::KeyPair::new_account();
        let user = nkeys::KeyPair::new_user();
        let op_jwt = jwt(
            &op,
            &op.public_key(),
            "op",
            serde_json::json!({"type": "operator", "version": 2}),
        );
        let unlimited = serde_json::json!({
            "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
            "wildcards": true, "conn": -1, "leaf": -1,
            "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
        });
        let acc_jwt = jwt(
            &op,
            &acc.public_key(),
            "acc",
            serde_json::json!({"limits": unlimited, "type": "account", "version": 2}),
        );
        let sys_jwt = jwt(
            &op,
            &sys.public_key(),
            "SYS",
            serde_json::json!({"type": "account", "version": 2}),
        );
        let user_jwt = jwt(
            &acc,
            &user.public_key(),
            "producer",
            serde_json::json!({"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
                               "type": "user", "version": 2}),
        );
        let js_dir = store.join("js");
        let conf = format!(
            "listen: \"127.0.0.1:{port}\"\n\
             jetstream {{ store_dir: {js:?} }}\n\
             operator: {op_jwt}\n\
             system_account: {sys_pub}\n\
             resolver: MEMORY\n\
             resolver_preload: {{ {acc_pub}: {acc_jwt}, {sys_pub}: {sys_jwt} }}\n",
            js = js_dir.display().to_string(),
            acc_pub = acc.public_key(),
            sys_pub = sys.public_key(),
        );
        let creds = format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n",
            seed = user.seed().unwrap(),
        );
        (NatsServer::from_config(store, port, &conf), creds)
    }

    /// A JetStream context on a fresh connection (with the TLS and credentials a secured
    /// server requires).
    pub async fn jetstream(&self) -> jetstream::Context {
        let mut opts = async_nats::ConnectOptions::new();
        if let Some(s) = &self.secured {
            opts = opts
                .add_root_certificates(s.ca_file.clone())
                .add_client_certificate(s.client_cert.clone(), s.client_key.clone())
                .require_tls(true)
                .user_and_password(s.user.clone(), s.password.clone());
        }
        let client = opts.connect(self.url()).await.expect("connect nats");
        jetstream::new(client)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A NATS JWT (`ed25519-nkey`) for `sub`, signed by `issuer`, with `nats` as its NATS claims.
fn jwt(issuer: &nkeys::KeyPair, sub: &str, name: &str, nats: serde_json::Value) -> String {
    use base64::Engine;
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let header = b64(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let iat = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = serde_json::json!({
        "jti": format!("{name}{iat}"),
        "iat": iat,
        "iss": issuer.public_key(),
        "name": name,
        "sub": sub,
        "nats": nats,
    });
    let body = b64(claims.to_string().as_bytes());
    let signed = format!("{header}.{body}");
    let sig = issuer.sign(signed.as_bytes()).unwrap();
    format!("{signed}.{}", b64(&sig))
}

/// Creates stream `name` over subjects `<subject>.>` (file storage), with at most `max_msgs`
/// messages kept (-1: unlimited).
pub async fn create_stream(
    js: &jetstream::Context,
    name: &str,
    subject: &str,
    max_msgs: i64,
) -> jetstream::stream::Stream {
    js.create_stream(jetstream::stream::Config {
        name: name.into(),
        subjects: vec![format!("{subject}.>")],
        max_messages: max_msgs,
        ..Default::default()
    })
    .await
    .expect("create stream")
}

/// Publishes protobuf messages on `<subject>.update` / `<subject>.event` (the event log's
/// encoding) with at most `window` unacknowledged, and waits for every acknowledgement.
pub async fn publish_all(js: &jetstream::Context, subject: &str, msgs: Vec<LogMsg>, window: usize) {
    use prost::Message;
    let mut acks = std::collections::VecDeque::new();
    for m in msgs {
        let (suffix, body) = match m {
            LogMsg::Update(u) => ("update", u.encode_to_vec()),
            LogMsg::Event(e) => ("event", e.encode_to_vec()),
        };
        let ack = js
            .publish(format!("{subject}.{suffix}"), body.into())
            .await
            .expect("publish");
        acks.push_back(ack);
        if acks.len() >= window {
            acks.pop_front().unwrap().await.expect("publish ack");
        }
    }
    for a in acks {
        a.await.expect("publish ack");
    }
}

/// Publishes one message as producer `producer` (subject `<subject>.<kind>.<producer>`; the
/// plain `<subject>.<kind>` without one) with `x-producer-epoch: epoch` when given, and waits
/// for its acknowledgement.
pub async fn publish_log_as(
    js: &jetstream::Context,
    subject: &str,
    producer: Option<&str>,
    epoch: Option<&str>,
    msg: LogMsg,
) {
    use prost::Message;
    let (kind, body) = match msg {
        LogMsg::Update(u) => ("update", u.encode_to_vec()),
        LogMsg::Event(e) => ("event", e.encode_to_vec()),
    };
    let subject = match producer {
        Some(p) => format!("{subject}.{kind}.{p}"),
        None => format!("{subject}.{kind}"),
    };
    let mut headers = async_nats::HeaderMap::new();
    if let Some(e) = epoch {
        headers.insert("x-producer-epoch", e);
    }
    js.publish_with_headers(subject, headers, body.into())
        .await
        .expect("publish")
        .await
        .expect("publish ack");
}

/// One event log message.
#[derive(Clone, Debug)]
pub enum LogMsg {
    Update(super::pb::CacheStateUpdate),
    Event(super::pb::CacheEvent),
}

/// The stream's last sequence.
pub async fn last_sequence(js: &jetstream::Context, stream: &str) -> u64 {
    let mut s = js.get_stream(stream).await.expect("get stream");
    s.info().await.expect("stream info").state.last_sequence
}
