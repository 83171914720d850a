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
        let conf = file("nats.conf", &conf);
        let child = Command::new("nats-server")
            .arg("-c")
            .arg(&conf)
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
            secured: Some(Secured {
                ca_file,
                client_cert,
                client_key,
                user: user.into(),
                password: password.into(),
            }),
        }
    }

    /// The `nats://` URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
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
