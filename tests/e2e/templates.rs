//! RenderTemplate with tenant templates registered on the controller-facing listener
//! (`PUT|GET|DELETE /templates/{tenant}/{ref}`, docs/BEHAVIOUR.md §11): rendering, the stable
//! prefix fingerprint, both reason codes, the sandbox bounds (oversize, runaway, output), the
//! metrics they record, authentication, and the reference's stub answer whenever no template is
//! registered.

use crate::support::tiny_model::*;
use crate::support::*;

const TOKEN: &str = "templates-controller-token-0001";

fn put(srv: &Server, path: &str, body: &str) -> HttpResponse {
    http_full(srv.admin_port, "PUT", path, &[], body.as_bytes()).expect("put")
}

fn delete(srv: &Server, path: &str) -> u16 {
    http_full(srv.admin_port, "DELETE", path, &[], b"")
        .expect("delete")
        .status
}

fn body(template: &str, revision: &str, model: &str) -> String {
    serde_json::json!({"template": template, "revision": revision, "model": model}).to_string()
}

async fn render(
    c: &mut pb::inference_cache_client::InferenceCacheClient<tonic::transport::Channel>,
    tenant: &str,
    reference: &str,
    vars: &[(&str, &str)],
) -> pb::RenderTemplateResponse {
    c.render_template(pb::RenderTemplateRequest {
        template_ref: reference.into(),
        variables: vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        tenant_id: tenant.into(),
    })
    .await
    .expect("RenderTemplate never fails")
    .into_inner()
}

fn reference_stub() -> pb::RenderTemplateResponse {
    pb::RenderTemplateResponse {
        reason_code: "OK".into(),
        ..Default::default()
    }
}

/// Register, render (with the stable prefix hash usable as a LookupRoute prefix_hash), list,
/// both reason codes, delete; the reference's stub before the first and after the last
/// registration.
async fn render_template_lifecycle(shards: usize) {
    let root = model_root("templates");
    check_tokenizer(&root);
    let srv = Server::start(shards, &["--tokenizer-models-dir", root.to_str().unwrap()]);
    let mut c = srv.client().await;
    let mut c2 = srv.client().await;
    // Nothing registered: exactly the reference's answer, whatever the request.
    assert_eq!(
        render(&mut c, "team-a", "greet", &[]).await,
        reference_stub()
    );

    // The stable prefix "w0 … w80 " tokenizes to 1000..=1080; the last token is dropped, so
    // the hash is the fingerprint of the five full blocks 1000..=1079 (80 tokens: over the
    // default matched-tokens floor of 64).
    let source = format!("{} {{{{ q }}}} GEN", words(81));
    let r = put(
        &srv,
        "/templates/team-a/greet",
        &body(&source, "rev-1", MODEL),
    );
    assert_eq!(r.status, 204, "{}", r.body);
    let stable: Vec<u32> = (1000..1080).collect();
    let (hashes, _) = fingerprint_chain(&stable, 16);

    for client in [&mut c, &mut c2] {
        let r = render(client, "team-a", "greet", &[("q", "w40")]).await;
        assert_eq!(r.reason_code, "OK");
        assert_eq!(
            String::from_utf8(r.rendered_prompt.clone()).unwrap(),
            format!("{} w40 GEN", words(81))
        );
        assert_eq!(r.template_revision, "rev-1");
        assert_eq!(r.tenant_namespace, b"team-a");
        assert_eq!(r.stable_prefix_hash, hashes[4]);
    }
    // The same hash whatever the variables.
    let r = render(&mut c, "team-a", "greet", &[("q", "something else")]).await;
    assert_eq!(r.stable_prefix_hash, hashes[4]);

    // A gateway looks the stable prefix up before it has the whole prompt: a producer that
    // reports the blocks of the rendered prompt makes it a PREFIX_MATCH.
    let mut full: Vec<u32> = (1000..1081).collect();
    full.extend([1040, 7]);
    assert!(
        report(
            &mut c,
            vec![per_block_update("engine-1", "team-a", "chat", &full)]
        )
        .await
        .accepted
    );
    let lr = lookup(
        &mut c,
        exact_lookup("team-a", "chat", "vllm", &r.stable_prefix_hash, 80),
    )
    .await;
    assert_eq!(lr.reason_code, "PREFIX_MATCH");
    assert_eq!(lr.replica_scores[0].replica_id, "engine-1");
    assert_eq!(lr.replica_scores[0].matched_tokens, 80);

    // A template without a model renders without a stable prefix hash.
    assert_eq!(
        put(
            &srv,
            "/templates/team-a/plain",
            &body("Hi {{ name }}!", "p1", "")
        )
        .status,
        204
    );
    let r = render(&mut c2, "team-a", "plain", &[("name", "Ann")]).await;
    assert_eq!(r.rendered_prompt, b"Hi Ann!");
    assert!(r.stable_prefix_hash.is_empty());

    // Listing (no sources) and one template (with its source).
    let (st, list) = http_get(srv.admin_port, "/templates/team-a").unwrap();
    assert_eq!(st, 200);
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 2);
    assert_eq!(list[0]["templateRef"], "greet");
    assert_eq!(list[0]["revision"], "rev-1");
    assert_eq!(list[0]["stablePrefixTokens"], 80);
    assert!(list[0].get("template").is_none());
    let (st, one) = http_get(srv.admin_port, "/templates/team-a/greet").unwrap();
    assert_eq!(st, 200);
    let one: serde_json::Value = serde_json::from_str(&one).unwrap();
    assert_eq!(one["template"], source.as_str());
    assert_eq!(
        http_get(srv.admin_port, "/templates/team-b").unwrap().1,
        "[]"
    );

    // TEMPLATE_NOT_FOUND: another ref, or the same ref for another tenant.
    for (tenant, reference) in [("team-a", "missing"), ("team-b", "greet")] {
        let r = render(&mut c, tenant, reference, &[]).await;
        assert_eq!(r.reason_code, "TEMPLATE_NOT_FOUND");
        assert!(r.rendered_prompt.is_empty() && r.stable_prefix_hash.is_empty());
    }

    // A new revision replaces the old one.
    assert_eq!(
        put(
            &srv,
            "/templates/team-a/plain",
            &body("Bye {{ name }}", "p2", "")
        )
        .status,
        204
    );
    let r = render(&mut c, "team-a", "plain", &[("name", "Bo")]).await;
    assert_eq!(
        (r.rendered_prompt.as_slice(), r.template_revision.as_str()),
        (&b"Bye Bo"[..], "p2")
    );

    let text = metrics_text(&srv);
    assert_metric_line(
        &text,
        r#"inferencecache_rpc_calls_total{reason_code="OK",rpc="RenderTemplate"} 5"#,
    );
    assert_metric_line(
        &text,
        r#"inferencecache_rpc_calls_total{reason_code="TEMPLATE_NOT_FOUND",rpc="RenderTemplate"} 2"#,
    );

    // Delete; once nothing is registered the reference's answer comes back.
    assert_eq!(delete(&srv, "/templates/team-a/greet"), 204);
    assert_eq!(delete(&srv, "/templates/team-a/greet"), 404);
    assert_eq!(
        render(&mut c, "team-a", "greet", &[]).await.reason_code,
        "TEMPLATE_NOT_FOUND"
    );
    assert_eq!(delete(&srv, "/templates/team-a/plain"), 204);
    assert_eq!(
        render(&mut c, "team-a", "greet", &[]).await,
        reference_stub()
    );
    let _ = std::fs::remove_dir_all(root);
}
shards_1_and_2!(render_template_lifecycle);

/// RENDER_ERROR and the sandbox bounds: a runaway template runs out of fuel, a render past the
/// output bound, `raise_exception`, no filesystem; an oversize or invalid template is refused at
/// registration. Each bound hit is counted in `inferencecache_limit_hits_total{limit}`.
async fn render_template_errors_and_limits(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut c = srv.client().await;
    let runaway =
        "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}";
    assert_eq!(
        put(&srv, "/templates/t/runaway", &body(runaway, "r1", "")).status,
        204
    );
    let started = std::time::Instant::now();
    let r = render(&mut c, "t", "runaway", &[]).await;
    // Generous, for debug builds on a loaded machine: only a render the fuel did not stop
    // (hours of work) fails it.
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    assert_eq!(r.reason_code, "RENDER_ERROR");
    assert_eq!(r.template_revision, "r1");
    assert!(r.rendered_prompt.is_empty());

    let big = "{% for a in range(100) %}{{ v }}{% endfor %}";
    assert_eq!(
        put(&srv, "/templates/t/big", &body(big, "b1", "")).status,
        204
    );
    let v = "y".repeat(64 * 1024);
    assert_eq!(
        render(&mut c, "t", "big", &[("v", &v)]).await.reason_code,
        "RENDER_ERROR"
    );
    assert_eq!(
        render(&mut c, "t", "big", &[("v", "z")])
            .await
            .rendered_prompt
            .len(),
        100
    );

    for (name, source) in [
        ("raise", "{{ raise_exception('nope') }}"),
        ("include", "{% include '/etc/passwd' %}"),
    ] {
        assert_eq!(
            put(
                &srv,
                &format!("/templates/t/{name}"),
                &body(source, "x", "")
            )
            .status,
            204
        );
        assert_eq!(
            render(&mut c, "t", name, &[]).await.reason_code,
            "RENDER_ERROR"
        );
    }

    // Refused at registration: 400, and nothing stored.
    let oversize = "a".repeat(64 * 1024 + 1);
    let r = put(&srv, "/templates/t/oversize", &body(&oversize, "o", ""));
    assert_eq!(r.status, 400, "{}", r.body);
    let r = put(&srv, "/templates/t/syntax", &body("{% if %}", "s", ""));
    assert_eq!(r.status, 400);
    assert!(r.body.starts_with("template: "), "{}", r.body);
    assert_eq!(put(&srv, "/templates/t/json", "{not json").status, 400);
    assert_eq!(
        put(
            &srv,
            "/templates/t/unknown-field",
            r#"{"template":"x","revision":"r","extra":1}"#
        )
        .status,
        400
    );
    assert_eq!(
        put(&srv, "/templates/t/model", &body("x", "r", "no/such")).status,
        400
    );
    assert_eq!(
        render(&mut c, "t", "oversize", &[]).await.reason_code,
        "TEMPLATE_NOT_FOUND"
    );
    // Bad paths and methods.
    assert_eq!(put(&srv, "/templates/t", &body("x", "r", "")).status, 405);
    assert_eq!(put(&srv, "/templates//x", &body("x", "r", "")).status, 404);
    assert_eq!(
        http_full(srv.admin_port, "POST", "/templates/t/x", &[], b"")
            .unwrap()
            .status,
        405
    );

    // 256 templates per tenant: the 257th is refused (409); replacing one still works.
    for i in 0..256 {
        let r = put(&srv, &format!("/templates/full/t{i}"), &body("x", "r", ""));
        assert_eq!(r.status, 204, "{i}: {}", r.body);
    }
    let r = put(&srv, "/templates/full/one-more", &body("x", "r", ""));
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(
        put(&srv, "/templates/full/t0", &body("y", "r2", "")).status,
        204
    );
    assert_eq!(
        put(&srv, "/templates/other/t0", &body("y", "r2", "")).status,
        204
    );

    let text = metrics_text(&srv);
    assert_metric_line(
        &text,
        r#"inferencecache_limit_hits_total{limit="templates_per_tenant"} 1"#,
    );
    for limit in [
        "template_render_fuel",
        "template_rendered_bytes",
        "template_bytes",
    ] {
        assert_metric_line(
            &text,
            &format!(r#"inferencecache_limit_hits_total{{limit="{limit}"}} 1"#),
        );
    }
    assert_metric_line(
        &text,
        r#"inferencecache_rpc_calls_total{reason_code="RENDER_ERROR",rpc="RenderTemplate"} 4"#,
    );
}
shards_1_and_2!(render_template_errors_and_limits);

/// `/templates` is authenticated exactly like `/policy` (its authenticator and counters).
fn templates_endpoints_need_the_controller_token(shards: usize) {
    let dir = scratch_dir("templates-auth");
    let f = dir.join("controller-token");
    std::fs::write(&f, TOKEN).unwrap();
    let srv = Server::start_opts(
        shards,
        StartOpts {
            flags: &["--controller-token-file", f.to_str().unwrap()],
            no_insecure: true,
            ..Default::default()
        },
    );
    let p = srv.admin_port;
    let b = body("Hi {{ n }}", "r1", "");
    let bearer = format!("Bearer {TOKEN}");
    let auth: &[(&str, &str)] = &[("Authorization", &bearer)];
    let bad: &[(&str, &str)] = &[("Authorization", "Bearer wrong-token-wrong-token")];
    assert_eq!(
        http_full(p, "PUT", "/templates/t/a", &[], b.as_bytes())
            .unwrap()
            .status,
        401
    );
    assert_eq!(
        http_full(p, "PUT", "/templates/t/a", bad, b.as_bytes())
            .unwrap()
            .status,
        401
    );
    assert_eq!(
        http_full(p, "GET", "/templates/t", &[], b"")
            .unwrap()
            .status,
        401
    );
    assert_eq!(
        http_full(p, "DELETE", "/templates/t/a", &[], b"")
            .unwrap()
            .status,
        401
    );
    assert_eq!(
        http_full(p, "PUT", "/templates/t/a", auth, b.as_bytes())
            .unwrap()
            .status,
        204
    );
    assert_eq!(
        http_full(p, "GET", "/templates/t", auth, b"")
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        http_full(p, "DELETE", "/templates/t/a", auth, b"")
            .unwrap()
            .status,
        204
    );
    let text = metrics_text(&srv);
    assert_metric_line(
        &text,
        r#"inferencecache_policy_auth_total{result="unauth"} 4"#,
    );
    assert_metric_line(&text, r#"inferencecache_policy_auth_total{result="ok"} 3"#);
}
shards_1_and_2!(blocking templates_endpoints_need_the_controller_token);
