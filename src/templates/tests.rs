//! Unit tests of the template engine wrapper: the stable prefix, the sandbox and its bounds.
//! (The registry is process-global; the end-to-end tests in tests/e2e/templates.rs drive it.)

use std::time::{Duration, Instant};

use super::*;

fn compiled(source: &str) -> Template {
    compile(
        PutBody {
            template: source.into(),
            revision: "r1".into(),
            model: String::new(),
        },
        16,
    )
    .expect("compiles")
}

fn vars(pairs: &[(&str, &str)]) -> Value {
    let m: BTreeMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Value::from(m)
}

#[test]
fn common_prefix_stops_at_a_character_boundary() {
    assert_eq!(common_prefix("ab\u{E000}", "ab\u{E001}"), "ab");
    assert_eq!(common_prefix("abc", "abd"), "ab");
    assert_eq!(common_prefix("", "x"), "");
    assert_eq!(common_prefix("same", "same"), "same");
}

#[test]
fn the_stable_prefix_is_the_text_before_the_first_variable() {
    let t = compiled("System: be brief.\nUser: {{ question }}\nAssistant:");
    assert_eq!(t.stable_prefix, "System: be brief.\nUser: ");
    let out = render_bounded(&t.env, vars(&[("question", "why?")])).unwrap();
    assert_eq!(out, "System: be brief.\nUser: why?\nAssistant:");
    assert!(out.starts_with(&t.stable_prefix));
}

#[test]
fn a_branch_on_a_variable_ends_the_stable_prefix() {
    let t = compiled("Intro. {% if lang == 'fr' %}Bonjour{% else %}Hello{% endif %} {{ name }}");
    // Both sentinels take the else branch: the prefix runs up to the variable.
    assert_eq!(t.stable_prefix, "Intro. Hello ");
    let t = compiled("{{ greeting }} and the rest");
    assert_eq!(t.stable_prefix, "");
}

#[test]
fn globals_keep_working_in_the_probe_render() {
    let t = compiled("{% for i in range(3) %}{{ i }}{% endfor %}|{{ x }}");
    assert_eq!(t.stable_prefix, "012|");
}

#[test]
fn without_a_model_there_is_no_stable_prefix_hash() {
    let t = compiled("a long enough stable prefix {{ q }}");
    assert!(t.stable_prefix_hash.is_empty());
    assert_eq!(t.stable_prefix_tokens, 0);
}

#[test]
fn a_syntax_error_is_refused_at_registration_without_quoting_the_source() {
    let err = compile(
        PutBody {
            template: "secret-system-prompt {% if %}".into(),
            revision: "r".into(),
            model: String::new(),
        },
        16,
    )
    .unwrap_err();
    assert!(err.starts_with("template: "), "{err}");
    assert!(!err.contains("secret-system-prompt"), "{err}");
}

#[test]
fn an_unknown_model_is_refused_at_registration() {
    let err = compile(
        PutBody {
            template: "prefix text {{ q }}".into(),
            revision: "r".into(),
            model: "no/such-model".into(),
        },
        16,
    )
    .unwrap_err();
    assert!(err.contains("no/such-model"), "{err}");
}

#[test]
fn a_runaway_template_runs_out_of_fuel_quickly() {
    let t = compiled(
        "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
    );
    let started = Instant::now();
    assert_eq!(render_bounded(&t.env, vars(&[])), Err(RenderFailure::Fuel));
    eprintln!("runaway render stopped after {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[test]
fn output_past_the_bound_fails() {
    // Each iteration writes a 64 KiB variable: little fuel, a lot of output.
    let t = compiled("{% for a in range(100) %}{{ big }}{% endfor %}");
    let big = "y".repeat(64 * 1024);
    assert_eq!(
        render_bounded(&t.env, vars(&[("big", &big)])),
        Err(RenderFailure::Output)
    );
    let small = render_bounded(&t.env, vars(&[("big", "z")])).unwrap();
    assert_eq!(small.len(), 100);
}

#[test]
fn no_filesystem_and_raise_exception_fail_the_render() {
    let t = compiled("{% include '/etc/passwd' %}");
    assert_eq!(
        render_bounded(&t.env, vars(&[])),
        Err(RenderFailure::Template)
    );
    let t = compiled("{{ raise_exception('no') }}");
    assert_eq!(
        render_bounded(&t.env, vars(&[])),
        Err(RenderFailure::Template)
    );
}

#[test]
fn a_render_that_does_not_start_with_the_stable_prefix_gets_no_hash() {
    // The sentinels are always defined, so the probe renders take the first branch.
    let mut t = compiled("{% if q is defined %}Question: {% else %}Nothing{% endif %}{{ q }}");
    assert_eq!(t.stable_prefix, "Question: ");
    t.stable_prefix_hash = vec![7; 8];
    let vars = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<HashMap<String, String>>()
    };
    let (r, code) = answer(&t, "t".into(), vars(&[("q", "why")]));
    assert_eq!(
        (code, r.rendered_prompt.as_slice()),
        ("OK", &b"Question: why"[..])
    );
    assert_eq!(r.stable_prefix_hash, vec![7; 8]);
    let (r, code) = answer(&t, "t".into(), vars(&[]));
    assert_eq!(
        (code, r.rendered_prompt.as_slice()),
        ("OK", &b"Nothing"[..])
    );
    assert!(
        r.stable_prefix_hash.is_empty(),
        "another branch: no stable prefix hash"
    );
}
