//! Start-up behaviour of the real binary: malformed flags exit 2
//! quickly with a message naming the flag and no backtrace; an engine address that keeps failing
//! does not spin and the process still stops on SIGTERM; two subscribers with the default
//! metrics address do not collide.

use std::io::Read;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kvevent-subscriber");

/// Kills the child on drop so a failing assertion never leaks a process.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for the child to exit within `limit`; `None` when it is still running.
fn wait_exit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs the binary with the required identity flags plus `extra`; expects it to exit by itself
/// within 10 s. Returns (exit code, stderr).
fn run_bad(extra: &[&str]) -> (i32, String) {
    let child = Command::new(BIN)
        .args(["--replica-id", "r", "--model-id", "m"])
        .args(extra)
        .env_remove("NATS_PASSWORD")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut g = Guard(child);
    let st = wait_exit(&mut g.0, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("{extra:?}: still running after 10 s"));
    let mut err = String::new();
    g.0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (st.code().unwrap_or(-1), err)
}

#[test]
fn malformed_addresses_exit_2_naming_the_flag() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let file = std::env::temp_dir().join(format!("kvevent-startup-{}", std::process::id()));
    std::fs::write(&file, b"").unwrap();
    let not_a_dir = file.join("state").to_string_lossy().into_owned();
    let missing = file.join("missing.pem").to_string_lossy().into_owned();
    // An empty file: no certificate, no token, no credentials in it.
    let file_s = file.to_string_lossy().into_owned();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--endpoint", "127.0.0.1:5557"], "--endpoint"),
        (vec!["--endpoint", "tcp://127.0.0.1:notaport"], "--endpoint"),
        (vec!["--endpoint", "tcp://127.0.0.1:0"], "--endpoint"),
        (
            vec!["--replay-endpoint", "127.0.0.1:5558"],
            "--replay-endpoint",
        ),
        (vec!["--server", "not a url"], "--server"),
        (vec!["--server", "127.0.0.1:notaport"], "--server"),
        // TLS and credentials that cannot work are found before anything connects.
        (
            vec!["--server", "https://127.0.0.1:9090"],
            "--server-ca-file",
        ),
        (
            vec![
                "--server-ca-file",
                &missing,
                "--server",
                "https://127.0.0.1:9090",
            ],
            "--server-ca-file",
        ),
        (
            vec![
                "--server-ca-file",
                &file_s,
                "--server",
                "https://127.0.0.1:9090",
            ],
            "--server-ca-file",
        ),
        (
            vec!["--client-cert-file", &file_s, "--client-key-file", &file_s],
            "--client-cert-file",
        ),
        (vec!["--token-file", &missing], "--token-file"),
        (vec!["--token-file", &file_s], "--token-file"),
        (
            vec!["--nats-url", "nats://127.0.0.1:1", "--nats-user", "u"],
            "--nats-user",
        ),
        (
            vec![
                "--nats-url",
                "nats://127.0.0.1:1",
                "--nats-user",
                "u",
                "--nats-password-file",
                &missing,
            ],
            "--nats-password-file",
        ),
        (
            vec![
                "--nats-url",
                "nats://127.0.0.1:1",
                "--nats-ca-file",
                &missing,
            ],
            "--nats-ca-file",
        ),
        (
            vec![
                "--nats-url",
                "nats://127.0.0.1:1",
                "--nats-creds-file",
                &file_s,
            ],
            "--nats-creds-file",
        ),
        (vec!["--metrics-bind", "localhost"], "--metrics-bind"),
        (vec!["--metrics-bind", "0.0.0.0:99999"], "--metrics-bind"),
        // Parses, but cannot be bound: found at start-up, same exit code and flag name.
        (vec!["--metrics-bind", &taken], "--metrics-bind"),
        (
            vec!["--metrics-url", "127.0.0.1:8000/metrics"],
            "--metrics-url",
        ),
        // A state file that cannot be written (its "directory" is a regular file).
        (vec!["--state-file", &not_a_dir], "--state-file"),
    ];
    for (args, flag) in cases {
        let started = Instant::now();
        let (code, err) = run_bad(&args);
        assert_eq!(code, 2, "{args:?}: exit code, stderr: {err}");
        assert!(
            err.contains(flag),
            "{args:?}: stderr does not name {flag}: {err}"
        );
        assert!(
            !err.contains("backtrace") && !err.contains("panicked"),
            "{args:?}: {err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{args:?}: took {:?}",
            started.elapsed()
        );
    }
    let _ = std::fs::remove_file(&file);
}

/// A peer on the engine port that accepts and hangs up at once (something else listening
/// there): every ZMQ connect fails immediately with a non-retryable error. The subscriber must
/// pause between attempts, log little, and stop promptly on SIGTERM.
#[test]
fn failing_engine_address_does_not_spin_and_sigterm_stops_it() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicUsize::new(0));
    let (acc, stp) = (accepted.clone(), stop.clone());
    let hangup = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        while stp.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            match listener.accept() {
                Ok((s, _)) => {
                    acc.fetch_add(1, Ordering::SeqCst);
                    drop(s);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    });
    let child = Command::new(BIN)
        .args([
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
            "--server",
            &format!("127.0.0.1:{}", free_port()),
            "--metrics-bind",
            "",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut g = Guard(child);
    let mut out = g.0.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = out.read_to_string(&mut text);
        text
    });
    // The 2 s window is the behaviour under test: the connection attempts counted over it.
    std::thread::sleep(Duration::from_secs(2));
    let attempts = accepted.load(Ordering::SeqCst);
    let _ = Command::new("kill")
        .args(["-TERM", &g.0.id().to_string()])
        .status();
    let st = wait_exit(&mut g.0, Duration::from_secs(5));
    stop.store(1, Ordering::SeqCst);
    hangup.join().unwrap();
    assert!(st.is_some(), "did not exit within 5 s of SIGTERM");
    let logs = reader.join().unwrap();
    let warns = logs.lines().filter(|l| l.contains("WARN")).count();
    // 100 ms doubling: about 5 attempts in 2 s (a spinning loop makes thousands).
    assert!(
        (1..=20).contains(&attempts),
        "{attempts} connect attempts in 2 s"
    );
    assert!(warns <= 20, "{warns} WARN lines in 2 s");
}

/// Two subscribers on one host without `--metrics-bind` (one per data-parallel rank): both
/// start, and each serves its own metrics on a different port of the default range.
#[test]
fn two_subscribers_with_default_metrics_bind_both_serve_metrics() {
    let spawn = |rank: u16| {
        Command::new(BIN)
            .args([
                "--replica-id",
                &format!("r{rank}"),
                "--model-id",
                "m",
                "--endpoint",
                &format!("tcp://127.0.0.1:{}", free_port()),
                "--server",
                &format!("127.0.0.1:{}", free_port()),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut a = Guard(spawn(0));
    let mut b = Guard(spawn(1));
    let bound = |g: &mut Guard| {
        // The first log lines name the bound metrics address.
        let mut out = g.0.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let mut byte = [0u8; 1];
            while out.read(&mut byte).map(|n| n == 1).unwrap_or(false) {
                if byte[0] == b'\n' {
                    let line = String::from_utf8_lossy(&buf).into_owned();
                    if line.contains("metrics endpoint listening") {
                        let _ = tx.send(line);
                    }
                    buf.clear();
                } else {
                    buf.push(byte[0]);
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("metrics endpoint listening line")
    };
    let la = bound(&mut a);
    let lb = bound(&mut b);
    let port = |l: &str| -> u16 {
        let i = l.find("\"addr\":\"").expect("addr field") + 8;
        let rest = &l[i..];
        let addr = &rest[..rest.find('"').unwrap()];
        addr.rsplit(':').next().unwrap().parse().unwrap()
    };
    let (pa, pb) = (port(&la), port(&lb));
    assert_ne!(pa, pb);
    for p in [pa, pb] {
        assert!((9102..9102 + 64).contains(&p), "port {p}");
    }
    assert!(wait_exit(&mut a.0, Duration::from_millis(100)).is_none());
    assert!(wait_exit(&mut b.0, Duration::from_millis(100)).is_none());
}
