//! No production function is over [`MAX_LINES`] lines: a function that long no longer reads at
//! once. Scans the server (`src/`), the shard layer (`shards/*/src`), loadgen, the subscriber and
//! the gateway SDK. A small lexer blanks comments, strings and char literals, then each `fn`
//! item's body is found by matching braces; test code (`#[test]` / `#[cfg(test)]` items and
//! `#[cfg(test)] mod x;` files) is left out.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The longest a production function may be, from its `fn` line to its closing brace.
const MAX_LINES: usize = 100;

/// Functions allowed over the bound for now, by file and name, each with its reason.
const KNOWN: &[(&str, &str, &str)] = &[];

/// The source roots scanned, relative to the workspace root.
fn roots(workspace: &Path) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = [
        "src",
        "loadgen/src",
        "kvevent-subscriber/src",
        "gateway/src",
    ]
    .iter()
    .map(|r| workspace.join(r))
    .collect();
    let shards = std::fs::read_dir(workspace.join("shards")).expect("shards/");
    for crate_dir in shards {
        let src = crate_dir.expect("dir entry").path().join("src");
        if src.is_dir() {
            roots.push(src);
        }
    }
    roots
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` with the contents of comments, string literals and char literals replaced by spaces
/// (newlines kept), so braces and keywords left are code.
fn blank_non_code(text: &str) -> Vec<char> {
    let c: Vec<char> = text.chars().collect();
    let mut out = c.clone();
    let blank = |out: &mut Vec<char>, from: usize, to: usize| {
        for ch in &mut out[from..to.min(c.len())] {
            if *ch != '\n' {
                *ch = ' ';
            }
        }
    };
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            let end = c[i..]
                .iter()
                .position(|&x| x == '\n')
                .map_or(c.len(), |p| i + p);
            blank(&mut out, i, end);
            i = end;
        } else if c[i] == '/' && next == Some('*') {
            let (mut depth, mut j) = (1, i + 2);
            while j < c.len() && depth > 0 {
                if c[j] == '/' && c.get(j + 1) == Some(&'*') {
                    (depth, j) = (depth + 1, j + 2);
                } else if c[j] == '*' && c.get(j + 1) == Some(&'/') {
                    (depth, j) = (depth - 1, j + 2);
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if c[i] == 'r' && (i == 0 || !ident(c[i - 1]) || c[i - 1] == 'b') && {
            let hashes = c[i + 1..].iter().take_while(|&&x| x == '#').count();
            c.get(i + 1 + hashes) == Some(&'"')
        } {
            // A raw string: r"…", r#"…"#, br#"…"#.
            let hashes = c[i + 1..].iter().take_while(|&&x| x == '#').count();
            let open = i + 1 + hashes;
            let close: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            let mut j = open + 1;
            while j < c.len() && !c[j..].starts_with(&close) {
                j += 1;
            }
            blank(&mut out, open + 1, j);
            i = j + close.len();
        } else if c[i] == '"' {
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            blank(&mut out, i + 1, j);
            i = j + 1;
        } else if c[i] == '\'' && (next == Some('\\') || c.get(i + 2) == Some(&'\'')) {
            // A char literal ('x', '\n', '\u{7f}', '\''); a lifetime ('a) has no closing quote.
            let mut j = i + 1;
            while j < c.len() && c[j] != '\'' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            blank(&mut out, i + 1, j);
            i = j + 1;
        } else {
            i += 1;
        }
    }
    out
}

/// Index of the `}` closing the `{` at `open`.
fn closing_brace(code: &[char], open: usize) -> usize {
    let mut depth = 0;
    for (i, &ch) in code.iter().enumerate().skip(open) {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// Whether the attribute starting at `at` (`#[…]`) marks test code, and where it ends.
fn test_attribute(code: &[char], at: usize) -> (bool, usize) {
    let end = code[at..]
        .iter()
        .position(|&x| x == ']')
        .map_or(code.len(), |p| at + p);
    let attr: String = code[at..=end.min(code.len() - 1)]
        .iter()
        .filter(|c| !c.is_whitespace())
        .collect();
    let test = attr == "#[test]"
        || attr.starts_with("#[cfg(test")
        || attr.starts_with("#[cfg(all(test")
        || attr.ends_with("::test]")
        || attr.contains("::test(");
    (test, end)
}

/// One `fn` item with a body.
#[derive(Debug)]
struct Function {
    name: String,
    line: usize,
    lines: usize,
}

/// The production functions of one file (test items left out), and the `#[cfg(test)] mod x;`
/// names it declares.
fn functions(text: &str) -> (Vec<Function>, Vec<String>) {
    let code = blank_non_code(text);
    let line_of = |i: usize| code[..i].iter().filter(|&&c| c == '\n').count() + 1;
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut test_ranges: Vec<(usize, usize)> = Vec::new();
    let mut test_mods = Vec::new();
    let mut found = Vec::new();
    let mut i = 0;
    while i < code.len() {
        if code[i] == '#' && code.get(i + 1) == Some(&'[') {
            let (test, end) = test_attribute(&code, i);
            if test {
                // The item it marks: up to its `;`, or its `{ … }`.
                let stop = code[end..]
                    .iter()
                    .position(|&x| x == '{' || x == ';')
                    .map_or(code.len(), |p| end + p);
                if code.get(stop) == Some(&'{') {
                    test_ranges.push((i, closing_brace(&code, stop)));
                } else {
                    let item: String = code[end + 1..stop].iter().collect();
                    let words: Vec<&str> = item.split_whitespace().collect();
                    if let Some(p) = words.iter().position(|w| *w == "mod") {
                        test_mods.extend(words.get(p + 1).map(|n| n.to_string()));
                    }
                }
            }
            i = end + 1;
            continue;
        }
        let is_fn = code[i..].starts_with(&['f', 'n'])
            && (i == 0 || !ident(code[i - 1]))
            && code.get(i + 2).is_some_and(|c| c.is_whitespace());
        if is_fn {
            let name_at = (i + 2..code.len())
                .find(|&j| !code[j].is_whitespace())
                .unwrap_or(code.len());
            let name: String = code[name_at..]
                .iter()
                .take_while(|&&c| ident(c) || c == '$')
                .collect();
            let stop = code[i..]
                .iter()
                .position(|&x| x == '{' || x == ';')
                .map_or(code.len(), |p| i + p);
            let in_test = test_ranges.iter().any(|&(a, b)| a <= i && i <= b);
            if !name.is_empty() && code.get(stop) == Some(&'{') && !in_test {
                let close = closing_brace(&code, stop);
                let (line, last) = (line_of(i), line_of(close.min(code.len() - 1)));
                found.push(Function {
                    name,
                    line,
                    lines: last - line + 1,
                });
            }
        }
        i += 1;
    }
    (found, test_mods)
}

/// The file a `mod name;` in `file` refers to.
fn module_file(file: &Path, name: &str) -> [PathBuf; 2] {
    let stem = file.file_stem().expect("file name").to_string_lossy();
    let dir = file.parent().expect("parent");
    let base = if ["mod", "lib", "main"].contains(&stem.as_ref()) {
        dir.to_path_buf()
    } else {
        dir.join(stem.as_ref())
    };
    [
        base.join(format!("{name}.rs")),
        base.join(name).join("mod.rs"),
    ]
}

#[test]
fn no_production_function_is_over_the_bound() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for root in roots(workspace) {
        rust_files(&root, &mut files);
    }
    let mut scanned = Vec::new();
    let mut test_files = BTreeSet::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read source");
        let (fns, test_mods) = functions(&text);
        for m in test_mods {
            test_files.extend(module_file(file, &m));
        }
        scanned.push((file, fns));
    }
    let mut too_long = Vec::new();
    let mut counted = 0;
    for (file, fns) in scanned {
        if test_files.contains(file) {
            continue;
        }
        let rel = file
            .strip_prefix(workspace)
            .expect("under the workspace")
            .to_string_lossy()
            .into_owned();
        counted += fns.len();
        for f in fns {
            let known = KNOWN
                .iter()
                .any(|(path, name, _)| rel == *path && f.name == *name);
            if f.lines > MAX_LINES && !known {
                too_long.push(format!(
                    "{rel}:{} fn {} is {} lines",
                    f.line, f.name, f.lines
                ));
            }
        }
    }
    assert!(counted > 1000, "the scan found only {counted} functions");
    assert!(
        too_long.is_empty(),
        "over {MAX_LINES} lines:\n{}",
        too_long.join("\n")
    );
}

#[test]
fn the_scan_measures_bodies_and_skips_tests_comments_and_strings() {
    let text = r##"
/// fn doc() { not code }
fn a(x: fn(u8) -> u8) -> u8 {
    let s = "}{ fn fake() {";
    let r = r#"}"#;
    let c = '}';
    let l: &'static str = "x";
    x(1) // }
}
trait T {
    fn declared(&self);
}
#[cfg(test)]
mod tests {
    fn helper() {
    }
}
#[test]
fn a_test() {}
#[cfg(test)]
mod more;
fn b() {
    /* } /* nested } */ */
}
"##;
    let (fns, test_mods) = functions(text);
    let got: Vec<(&str, usize, usize)> = fns
        .iter()
        .map(|f| (f.name.as_str(), f.line, f.lines))
        .collect();
    assert_eq!(got, [("a", 3, 7), ("b", 22, 3)]);
    assert_eq!(test_mods, ["more"]);
}
