//! The Kubernetes manifests in deploy/ start the binaries with flags they accept: a renamed or
//! removed flag fails here, not in a cluster. (Schema validation of the YAML is
//! `deploy/validate.sh`, run by CI.)

use crate::support::*;

/// Every manifest, embedded so the test needs no working directory.
const MANIFESTS: [(&str, &str); 2] = [
    ("server.yaml", include_str!("../../deploy/server.yaml")),
    (
        "engine-vllm.yaml",
        include_str!("../../deploy/engine-vllm.yaml"),
    ),
];

/// One container of a manifest: the binary its `command` names and its `args`.
#[derive(Debug)]
struct Container {
    binary: String,
    args: Vec<String>,
}

/// The containers whose `command` is one of our binaries (`/usr/local/bin/...`), with the
/// `- --flag=value` items of the `args:` list that follows. Line-based: the manifests keep one
/// argument per line.
fn our_containers(yaml: &str) -> Vec<Container> {
    let mut found = Vec::new();
    let mut current: Option<Container> = None;
    let mut in_args = false;
    for line in yaml.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("command: [\"/usr/local/bin/") {
            found.extend(current.take());
            let binary = rest.trim_end_matches("\"]").to_string();
            current = Some(Container {
                binary,
                args: Vec::new(),
            });
            in_args = false;
        } else if t == "args:" {
            in_args = current.is_some();
        } else if in_args && let Some(arg) = t.strip_prefix("- ") {
            if !arg.starts_with('#') {
                current
                    .as_mut()
                    .expect("in args")
                    .args
                    .push(arg.to_string());
            }
        } else if !t.starts_with('#') {
            in_args = false;
        }
    }
    found.extend(current);
    found
}

/// `--flag=value` → `--flag`.
fn flag_name(arg: &str) -> &str {
    arg.split('=').next().unwrap_or(arg)
}

#[test]
fn manifests_start_the_binaries_with_flags_they_accept() {
    let server_help = std::process::Command::new(bin())
        .arg("--help")
        .output()
        .expect("run --help");
    let server_help = String::from_utf8_lossy(&server_help.stdout).into_owned();
    let mut checked = 0;
    for (file, yaml) in MANIFESTS {
        for c in our_containers(yaml) {
            assert!(!c.args.is_empty(), "{file}: {} has no args", c.binary);
            match c.binary.as_str() {
                "inference-cache-server" => {
                    for arg in &c.args {
                        let flag = flag_name(arg);
                        assert!(
                            server_help.contains(&format!("{flag} "))
                                || server_help.contains(&format!("{flag}\n")),
                            "{file}: the server has no flag {flag}"
                        );
                    }
                }
                "kvevent-subscriber" => {
                    let args = c.args.iter().map(|a| a.replace("$(POD_IP)", "10.0.0.7"));
                    let parsed = <kvevent_subscriber::cli::Args as clap::Parser>::try_parse_from(
                        std::iter::once("kvevent-subscriber".to_string()).chain(args),
                    );
                    if let Err(e) = parsed {
                        panic!("{file}: kvevent-subscriber refuses its args: {e}");
                    }
                }
                other => panic!("{file}: unknown binary {other}"),
            }
            checked += 1;
        }
    }
    assert_eq!(
        checked, 2,
        "the server and the subscriber sidecar are both checked"
    );
}

#[test]
fn the_args_reader_finds_each_container() {
    let yaml = "      containers:\n        - name: a\n          command: [\"/usr/local/bin/x\"]\n          args:\n            # note\n            - --one=1\n            - --two\n          ports:\n            - name: p\n        - name: b\n          command: [\"/usr/local/bin/y\"]\n          args:\n            - --three=3\n";
    let c = our_containers(yaml);
    assert_eq!(c.len(), 2);
    assert_eq!(
        (c[0].binary.as_str(), c[0].args.clone()),
        ("x", vec!["--one=1".to_string(), "--two".to_string()])
    );
    assert_eq!(
        (c[1].binary.as_str(), c[1].args.clone()),
        ("y", vec!["--three=3".to_string()])
    );
}
