//! No import circles: within every crate, no module imports one that imports it (directly or
//! through others), and the same for the modules of the Python package. A circle means two
//! modules are one idea split in two files, or that a type lives with the wrong owner; either
//! way a reader cannot read one without the other.
//!
//! An edge is a path that starts at `crate::`, `super::` or `self::` (in a `use` or in code,
//! groups `{a, b::c}` included) and names another module's file: the longest prefix of the
//! path that is a module. A path that names only items of its parent (`use super::*`) is an
//! edge to the parent. A parent's plain `mod child;`/`pub use child::X` is not an edge (it
//! declares, it does not depend), and test code (`tests.rs`, `#[cfg(test)] mod … {}` at a
//! file's end, `tests/`, `src/bin/`) is left out. In Python, every `import`/`from … import` of
//! the package (relative or absolute, at any level of the file) is an edge; a package's
//! `__init__.py` only hands names on and is no node.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Module graph: file → files it imports.
type Graph = BTreeMap<PathBuf, BTreeSet<PathBuf>>;

/// Every import circle of the workspace's crates and of `fh-torch/python`, one failure each.
pub(crate) fn check_import_circles(root: &Path) -> Vec<String> {
    let members = match super::members(root) {
        Ok(m) => m,
        Err(e) => return vec![e],
    };
    let mut graph = Graph::new();
    for m in &members {
        rust_crate_graph(&root.join(&m.dir), &mut graph);
    }
    python_graph(&root.join("fh-torch/python"), &mut graph);
    circles(&graph)
        .into_iter()
        .map(|c| {
            let names: Vec<String> = c
                .iter()
                .map(|p| p.strip_prefix(root).unwrap_or(p).display().to_string())
                .collect();
            format!(
                "import circle among {}: move what they share to the module that owns it",
                names.join(", ")
            )
        })
        .collect()
}

/// A glob import of a module's parent (built so that this file does not contain it).
const GLOB_PARENT: &str = concat!("use super", "::*");

/// No glob import of a parent (`use super::*`) outside test code: a module says by name what
/// it takes from its parent, so that a reader sees the edge and the circle checks see it too.
pub(crate) fn check_no_glob_parent_imports(root: &Path) -> Vec<String> {
    let members = match super::members(root) {
        Ok(m) => m,
        Err(e) => return vec![e],
    };
    let mut out = Vec::new();
    for m in &members {
        let src = root.join(&m.dir).join("src");
        let mut files = Vec::new();
        collect(&src, "rs", &mut files);
        for f in files {
            if module_path(&src, &f).is_none() && !f.ends_with("main.rs") {
                continue;
            }
            let Ok(text) = fs::read_to_string(&f) else {
                continue;
            };
            if strip_tests(&strip_comments(&text)).contains(GLOB_PARENT) {
                out.push(format!(
                    "{} imports its parent by glob (`super::*`): import what it uses by name",
                    f.strip_prefix(root).unwrap_or(&f).display()
                ));
            }
        }
    }
    out
}

/// The strongly connected components of more than one file, each sorted (Tarjan).
pub(crate) fn circles(graph: &Graph) -> Vec<Vec<PathBuf>> {
    struct State<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        out: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a PathBuf) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.graph.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                comp.push(w.clone());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out.sort();
    s.out
}

// ---------------------------------------------------------------------------------------------
// Rust
// ---------------------------------------------------------------------------------------------

fn rust_crate_graph(krate: &Path, graph: &mut Graph) {
    let src = krate.join("src");
    let mut files = Vec::new();
    collect(&src, "rs", &mut files);
    // Module path (names below the crate root) → file.
    let mut modules: BTreeMap<Vec<String>, PathBuf> = BTreeMap::new();
    for f in &files {
        if let Some(m) = module_path(&src, f) {
            modules.insert(m, f.clone());
        }
    }
    for (m, f) in &modules {
        let Ok(text) = fs::read_to_string(f) else {
            continue;
        };
        let code = strip_tests(&strip_comments(&text));
        let mut targets = BTreeSet::new();
        for (start, names) in rust_paths(&code, m) {
            if let Some(t) = resolve(&modules, &start, &names, m) {
                if t != *f {
                    targets.insert(t);
                }
            }
        }
        graph.insert(f.clone(), targets);
    }
}

/// `src/a/b.rs` → `[a, b]`; `mod.rs`, `lib.rs` and `main.rs` name their directory. Test files
/// and `src/bin` are no modules here.
fn module_path(src: &Path, file: &Path) -> Option<Vec<String>> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") || parts.iter().any(|p| p == "tests") {
        return None;
    }
    let last = parts.pop()?;
    let stem = last.strip_suffix(".rs")?;
    if stem == "tests" {
        return None;
    }
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_string());
    }
    Some(parts)
}

fn resolve(
    modules: &BTreeMap<Vec<String>, PathBuf>,
    start: &[String],
    names: &[String],
    own: &[String],
) -> Option<PathBuf> {
    for k in (1..=names.len()).rev() {
        let mut cand = start.to_vec();
        cand.extend_from_slice(&names[..k]);
        if let Some(f) = modules.get(&cand) {
            return Some(f.clone());
        }
    }
    if start != own {
        return modules.get(start).cloned();
    }
    None
}

/// Every path from `crate::`, `super::` or `self::`, as (the module it starts at, the names
/// after it); a group `{a, b::c}` gives one path per member.
fn rust_paths(code: &str, own: &[String]) -> Vec<(Vec<String>, Vec<String>)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let boundary = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        let kw = ["crate::", "super::", "self::"]
            .into_iter()
            .find(|k| boundary && b[i..].starts_with(k.as_bytes()));
        let Some(kw) = kw else {
            i += 1;
            continue;
        };
        let mut start: Vec<String> = match kw {
            "crate::" => Vec::new(),
            "self::" => own.to_vec(),
            _ => own[..own.len().saturating_sub(1)].to_vec(),
        };
        i += kw.len();
        // `super::super::…`
        while b[i..].starts_with(b"super::") {
            start.pop();
            i += "super::".len();
        }
        let (paths, end) = parse_tree(code, i);
        out.extend(paths.into_iter().map(|p| (start.clone(), p)));
        i = end.max(i + 1);
    }
    out
}

/// Parse `a::b::{c, d::e}` (or `*`) at `i`: the paths it names and where it ends.
fn parse_tree(code: &str, mut i: usize) -> (Vec<Vec<String>>, usize) {
    let b = code.as_bytes();
    let mut prefix = Vec::new();
    loop {
        let s = i;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        if i > s {
            prefix.push(code[s..i].to_string());
        }
        let group = b[i..].starts_with(b"{");
        if group || b[i..].starts_with(b"::") {
            if !group {
                i += 2;
            }
            if b[i..].starts_with(b"{") {
                let close = matching_brace(code, i);
                let inner = &code[i + 1..close];
                let mut out = Vec::new();
                for item in split_top(inner) {
                    let (subs, _) = parse_tree(item.trim(), 0);
                    for s in subs {
                        let mut p = prefix.clone();
                        p.extend(s);
                        out.push(p);
                    }
                }
                if out.is_empty() {
                    out.push(prefix);
                }
                return (out, close + 1);
            }
            continue;
        }
        return (vec![prefix], i);
    }
}

fn matching_brace(code: &str, open: usize) -> usize {
    let mut depth = 0usize;
    for (k, c) in code[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return open + k;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// Split a group's inside at its top-level commas.
fn split_top(inner: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut from) = (0usize, 0usize);
    for (k, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.push(&inner[from..k]);
                from = k + 1;
            }
            _ => {}
        }
    }
    out.push(&inner[from..]);
    out.into_iter().filter(|s| !s.trim().is_empty()).collect()
}

/// The code without `//` and `/* */` comments (string literals are kept as they are).
pub(crate) fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("//") {
            rest = r.find('\n').map_or("", |n| &r[n..]);
        } else if let Some(r) = rest.strip_prefix("/*") {
            rest = r.find("*/").map_or("", |n| &r[n + 2..]);
        } else {
            let c = rest.chars().next().expect("not empty");
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// The code before its inline test module (`#[cfg(test)]` then `mod name {`), which the
/// project keeps at the end of a file.
fn strip_tests(code: &str) -> String {
    let mut from = 0;
    while let Some(k) = code[from..].find("#[cfg(") {
        let at = from + k;
        let Some(close) = code[at..].find(")]") else {
            break;
        };
        let attr = &code[at..at + close];
        if !(attr == "#[cfg(test" || attr.starts_with("#[cfg(all(test")) {
            from = at + 1;
            continue;
        }
        let after = code[at + close + 2..].trim_start();
        if after.starts_with("mod ") {
            let line_end = after.find('\n').unwrap_or(after.len());
            if after[..line_end].contains('{') {
                return code[..at].to_string();
            }
        }
        from = at + 1;
    }
    code.to_string()
}

fn collect(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() {
            if !name.starts_with('.') && name != "__pycache__" && name != "target" {
                collect(&p, ext, out);
            }
        } else if p.extension().is_some_and(|x| x == ext) {
            out.push(p);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Python
// ---------------------------------------------------------------------------------------------

fn python_graph(dir: &Path, graph: &mut Graph) {
    let mut files = Vec::new();
    collect(dir, "py", &mut files);
    // Module path → file, for modules inside packages (a package's __init__ excluded).
    let mut modules: BTreeMap<Vec<String>, PathBuf> = BTreeMap::new();
    for f in &files {
        let name = f.file_stem().map(|s| s.to_string_lossy().into_owned());
        let Some(name) = name else { continue };
        if name == "__init__" || name.starts_with("test_") || name == "conftest" {
            continue;
        }
        if f.iter().any(|c| c == "tests") {
            continue;
        }
        let mut parts = vec![name];
        let mut d = f.parent();
        while let Some(p) = d.filter(|p| p.join("__init__.py").exists()) {
            parts.insert(
                0,
                p.file_name().unwrap_or_default().to_string_lossy().into(),
            );
            d = p.parent();
        }
        if parts.len() > 1 {
            modules.insert(parts, f.clone());
        }
    }
    for (m, f) in &modules {
        let Ok(text) = fs::read_to_string(f) else {
            continue;
        };
        let package = &m[..m.len() - 1];
        let mut targets = BTreeSet::new();
        for (base, names) in python_imports(&text, package) {
            // `from a.b import c` may import the module a.b.c or a name of a.b.
            let mut cands: Vec<Vec<String>> = names
                .iter()
                .map(|n| {
                    let mut c = base.clone();
                    c.push(n.clone());
                    c
                })
                .collect();
            cands.push(base.clone());
            for c in cands {
                if let Some(t) = modules.get(&c).filter(|t| *t != f) {
                    targets.insert(t.clone());
                }
            }
        }
        graph.insert(f.clone(), targets);
    }
}

/// Every import of a Python file as (the module, the names imported from it).
fn python_imports(text: &str, package: &[String]) -> Vec<(Vec<String>, Vec<String>)> {
    let mut out = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let l = line.split('#').next().unwrap_or("").trim();
        if let Some(rest) = l.strip_prefix("from ") {
            let Some((module, names)) = rest.split_once(" import ") else {
                continue;
            };
            let mut names = names.trim().to_string();
            if names.starts_with('(') && !names.contains(')') {
                for more in lines.by_ref() {
                    names.push_str(more.split('#').next().unwrap_or(""));
                    if more.contains(')') {
                        break;
                    }
                }
            }
            let names: Vec<String> = names
                .trim_matches(|c| c == '(' || c == ')')
                .split(',')
                .map(|n| n.split_whitespace().next().unwrap_or("").to_string())
                .filter(|n| !n.is_empty())
                .collect();
            let module = module.trim();
            let dots = module.chars().take_while(|&c| c == '.').count();
            let rest: Vec<String> = module[dots..]
                .split('.')
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
            let base = if dots == 0 {
                rest
            } else {
                let keep = package.len().saturating_sub(dots - 1);
                let mut b = package[..keep].to_vec();
                b.extend(rest);
                b
            };
            out.push((base, names));
        } else if let Some(rest) = l.strip_prefix("import ") {
            for m in rest.split(',') {
                let m = m.split_whitespace().next().unwrap_or("");
                out.push((m.split('.').map(String::from).collect(), Vec::new()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    #[test]
    fn finds_a_circle_and_nothing_else() {
        let mut g = Graph::new();
        g.insert(p("a"), [p("b")].into());
        g.insert(p("b"), [p("c")].into());
        g.insert(p("c"), [p("a"), p("d")].into());
        g.insert(p("d"), BTreeSet::new());
        assert_eq!(circles(&g), vec![vec![p("a"), p("b"), p("c")]]);
        g.insert(p("c"), [p("d")].into());
        assert!(circles(&g).is_empty());
    }

    #[test]
    fn rust_paths_follow_groups_and_super() {
        let own = vec!["tcp".to_string(), "comm".to_string()];
        let code = "use crate::{liveness::Watch, hosts};\nuse super::wire::X;\nlet y = self::blame::f();\nuse super::super::z;\nfn notcrate::a() {}";
        let got = rust_paths(code, &own);
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert!(
            got.contains(&(vec![], s(&["liveness", "Watch"]))),
            "{got:?}"
        );
        assert!(got.contains(&(vec![], s(&["hosts"]))), "{got:?}");
        assert!(got.contains(&(s(&["tcp"]), s(&["wire", "X"]))), "{got:?}");
        assert!(got.contains(&(own.clone(), s(&["blame", "f"]))), "{got:?}");
        assert!(got.contains(&(vec![], s(&["z"]))), "{got:?}");
        assert_eq!(got.len(), 5, "{got:?}");
    }

    #[test]
    fn comments_and_trailing_tests_are_no_edges() {
        let code = strip_tests(&strip_comments(
            "use crate::a; // crate::b\n/* crate::c */\n#[cfg(test)]\nmod tests {\n use crate::d;\n}\n",
        ));
        let got = rust_paths(&code, &[]);
        assert_eq!(got, vec![(vec![], vec!["a".to_string()])]);
    }

    #[test]
    fn python_imports_relative_and_absolute() {
        let pkg = vec!["fasthorovod".to_string(), "torch".to_string()];
        let text = "from .reduce_ops import (\n  allreduce,\n  grouped,\n)\nfrom ..common import basics\nimport fasthorovod.torch.x as y\n    from . import gather_ops  # late\n";
        let got = python_imports(text, &pkg);
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            got[0],
            (
                s(&["fasthorovod", "torch", "reduce_ops"]),
                s(&["allreduce", "grouped"])
            )
        );
        assert_eq!(got[1], (s(&["fasthorovod", "common"]), s(&["basics"])));
        assert_eq!(got[2], (s(&["fasthorovod", "torch", "x"]), vec![]));
        assert_eq!(got[3], (s(&["fasthorovod", "torch"]), s(&["gather_ops"])));
    }

    #[test]
    fn no_module_imports_its_parent_by_glob() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("root");
        let found = check_no_glob_parent_imports(root);
        assert!(found.is_empty(), "{found:#?}");
    }

    #[test]
    fn the_workspace_has_no_import_circle() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("root");
        let found = check_import_circles(root);
        assert!(found.is_empty(), "{found:#?}");
    }
}
