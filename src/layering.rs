//! Keeps `src/` layered: a module may import only modules of a lower layer (or leaves), so
//! there is no import circle and a reader can follow a request downwards. The test reads every
//! source file and checks each `crate::<module>` path against the table below.

/// Layers from the top; a module may use modules of later layers, never of earlier ones.
const LAYERS: &[&[&str]] = &[
    &["main", "lib", "perf_harness"],
    &["startup"],
    &["cli"],
    &["admin"],
    &["grpc"],
    &["nats"],
    &["http2"],
    &["ingest"],
    &["templates", "pd", "feeds", "snapshot"],
    &["producer"],
    &["tenant_registry"],
    &["lookup"],
    &["tokenizer"],
    &["runtime"],
    &["shard"],
    &["metrics", "logging"],
    &["sys", "limits"],
];

fn layer_of(module: &str) -> usize {
    LAYERS
        .iter()
        .position(|layer| layer.contains(&module))
        .unwrap_or_else(|| panic!("module {module} is missing from the LAYERS table"))
}

/// Top-level module of a source file path relative to `src/`.
fn module_of(rel: &std::path::Path) -> String {
    let first = rel.components().next().expect("non-empty path");
    let name = first.as_os_str().to_string_lossy();
    name.trim_end_matches(".rs").to_string()
}

fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The `crate::<module>` names a source text refers to (also inside `use crate::{a, b}`).
fn crate_refs(text: &str) -> Vec<String> {
    let mut refs = Vec::new();
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + "crate::".len()..];
        let names: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            group[..end].split(',').collect()
        } else {
            vec![rest]
        };
        for name in names {
            let name: String = name
                .trim()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() && name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                refs.push(name);
            }
        }
    }
    refs
}

#[test]
fn imports_only_point_down() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut upward = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&src).expect("under src");
        let module = module_of(rel);
        if module == "layering" {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("read source");
        for used in crate_refs(&text) {
            if used != module && layer_of(&used) <= layer_of(&module) {
                upward.push(format!("{}: {module} uses {used}", rel.display()));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports pointing up or sideways:\n{}",
        upward.join("\n")
    );
}

#[test]
fn crate_refs_reads_paths_and_groups() {
    let refs = crate_refs("use crate::{grpc, logging};\nlet x = crate::shard::owner();");
    assert_eq!(refs, ["grpc", "logging", "shard"]);
}
