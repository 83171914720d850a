//! The `/snapshot` body (docs/BEHAVIOUR.md §14), rendered by hand so the bytes match the reference:
//! key order as emitted by Go, `null` for empty arrays, omitted-when-false/zero fields, the
//! zero-time sentinel, float32 formatting and the encoder's trailing newline.

use inferencecache_index::index::{ReplicaRow, SnapshotRows, TenantRow};

use super::gojson::{push_f32, push_str, rfc3339_nano};

fn replica(out: &mut String, r: &ReplicaRow) {
    out.push_str("{\"replicaId\":");
    push_str(out, &r.replica_id);
    if !r.tenant.is_empty() {
        out.push_str(",\"tenant\":");
        push_str(out, &r.tenant);
    }
    out.push_str(&format!(",\"cacheMemoryBytes\":{}", r.cache_memory_bytes));
    out.push_str(",\"hitRate\":");
    push_f32(out, r.hit_rate);
    out.push_str(",\"pressure\":");
    push_f32(out, r.pressure);
    out.push_str(",\"lastUpdate\":");
    push_str(out, &rfc3339_nano(r.last_update));
    out.push_str(&format!(",\"prefixCount\":{}", r.prefix_count));
    out.push_str(",\"lastEventAt\":");
    push_str(out, &rfc3339_nano(r.last_event_at));
    if r.stats_reported {
        out.push_str(",\"statsReported\":true");
    }
    if r.t2_hit_tokens != 0 {
        out.push_str(&format!(",\"t2HitTokens\":{}", r.t2_hit_tokens));
    }
    if r.t2_query_tokens != 0 {
        out.push_str(&format!(",\"t2QueryTokens\":{}", r.t2_query_tokens));
    }
    out.push('}');
}

fn tenant(out: &mut String, t: &TenantRow) {
    out.push_str("{\"tenantId\":");
    push_str(out, &t.tenant_id);
    out.push_str(&format!(",\"indexEntries\":{}", t.index_entries));
    out.push_str(",\"hitRate\":");
    push_f32(out, t.hit_rate);
    if t.hit_rate_reported {
        out.push_str(",\"hitRateReported\":true");
    }
    out.push_str(&format!(",\"memoryUsed\":{}}}", t.memory_used));
}

fn array<T>(out: &mut String, rows: &[T], one: fn(&mut String, &T)) {
    if rows.is_empty() {
        out.push_str("null");
        return;
    }
    out.push('[');
    for (i, r) in rows.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        one(out, r);
    }
    out.push(']');
}

/// The complete response body, including the trailing `\n`.
pub fn render(rows: &SnapshotRows) -> String {
    let mut out = String::with_capacity(128 + 200 * rows.replicas.len());
    out.push_str("{\"replicas\":");
    array(&mut out, &rows.replicas, replica);
    out.push_str(",\"tenants\":");
    array(&mut out, &rows.tenants, tenant);
    out.push_str(&format!(
        ",\"totalPrefixes\":{},\"hotPrefixes\":{}}}\n",
        rows.total_prefixes, rows.hot_prefixes
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_snapshot_uses_null_arrays() {
        assert_eq!(
            render(&SnapshotRows::default()),
            "{\"replicas\":null,\"tenants\":null,\"totalPrefixes\":0,\"hotPrefixes\":0}\n"
        );
    }

    #[test]
    fn rows_in_go_key_order_with_omissions() {
        let rows = SnapshotRows {
            replicas: vec![
                ReplicaRow {
                    replica_id: "replica-a".into(),
                    tenant: "tenant-a".into(),
                    cache_memory_bytes: 1234,
                    hit_rate: 0.75,
                    pressure: 0.0,
                    last_update: Some(1_700_000_000_500_000_000),
                    prefix_count: 1,
                    last_event_at: Some(1_700_000_000_000_000_000),
                    stats_reported: true,
                    t2_hit_tokens: 600,
                    t2_query_tokens: 1000,
                },
                ReplicaRow {
                    replica_id: "b".into(),
                    tenant: String::new(),
                    cache_memory_bytes: 0,
                    hit_rate: 0.0,
                    pressure: 0.0,
                    last_update: None,
                    prefix_count: 2,
                    last_event_at: None,
                    stats_reported: false,
                    t2_hit_tokens: 0,
                    t2_query_tokens: 0,
                },
            ],
            tenants: vec![TenantRow {
                tenant_id: String::new(),
                index_entries: 3,
                hit_rate: 0.0,
                hit_rate_reported: false,
                memory_used: 0,
            }],
            total_prefixes: 3,
            hot_prefixes: 0,
        };
        assert_eq!(
            render(&rows),
            concat!(
                "{\"replicas\":[",
                "{\"replicaId\":\"replica-a\",\"tenant\":\"tenant-a\",\"cacheMemoryBytes\":1234,",
                "\"hitRate\":0.75,\"pressure\":0,\"lastUpdate\":\"2023-11-14T22:13:20.5Z\",",
                "\"prefixCount\":1,\"lastEventAt\":\"2023-11-14T22:13:20Z\",\"statsReported\":true,",
                "\"t2HitTokens\":600,\"t2QueryTokens\":1000},",
                "{\"replicaId\":\"b\",\"cacheMemoryBytes\":0,\"hitRate\":0,\"pressure\":0,",
                "\"lastUpdate\":\"0001-01-01T00:00:00Z\",\"prefixCount\":2,",
                "\"lastEventAt\":\"0001-01-01T00:00:00Z\"}],",
                "\"tenants\":[{\"tenantId\":\"\",\"indexEntries\":3,\"hitRate\":0,\"memoryUsed\":0}],",
                "\"totalPrefixes\":3,\"hotPrefixes\":0}\n"
            )
        );
    }
}
