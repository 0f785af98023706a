//! Workloads: the gradient tensors of a model in backward order, with each tensor's share of the
//! backward compute (`fh-bench/workloads/*.json`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fh_core::DType;
use serde::Deserialize;

/// Environment variable naming the workloads directory (overrides the repository's copy).
pub const WORKLOADS_ENV: &str = "FH_BENCH_WORKLOADS";

/// Tolerance on the sum of compute shares (they should add up to 1).
const SHARE_SUM_TOLERANCE: f64 = 1e-3;

/// A model's gradients.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Model name (`resnet50`, `bert-base`, ...).
    pub model: String,
    /// Element type of every gradient.
    pub dtype: DType,
    /// The gradients in backward order (the order in which they become ready).
    pub tensors: Vec<TensorSpec>,
    /// Where it was read from.
    pub path: PathBuf,
}

/// One gradient tensor.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TensorSpec {
    /// Parameter name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Number of elements (the product of the shape).
    pub elements: usize,
    /// Share of the backward compute spent before this gradient is ready, from the previous
    /// one (the shares add up to 1).
    pub compute_share: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWorkload {
    model: String,
    #[serde(default)]
    #[allow(dead_code)]
    source: Option<String>,
    dtype: String,
    #[serde(default)]
    tensors_total: Option<usize>,
    #[serde(default)]
    parameters_total: Option<usize>,
    #[serde(default)]
    #[allow(dead_code)]
    order: Option<String>,
    tensors: Vec<RawTensor>,
}

#[derive(Debug, Deserialize)]
struct RawTensor {
    name: String,
    shape: Vec<usize>,
    #[serde(default)]
    #[allow(dead_code)]
    forward_index: Option<usize>,
    compute_share: f64,
    elements: usize,
}

/// Why a workload file could not be used. The message names the file and the fix.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The file or directory could not be read.
    #[error("cannot read workload {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Not valid JSON, or not the expected structure.
    #[error("workload {path} is not a valid workload JSON file: {detail} (expected {{\"model\", \"dtype\", \"tensors\": [{{\"name\", \"shape\", \"elements\", \"compute_share\"}}, ...]}})")]
    Parse {
        /// The path.
        path: PathBuf,
        /// What serde said (with line and column).
        detail: String,
    },
    /// Parsed, but the content is inconsistent.
    #[error("workload {path}: {detail}")]
    Invalid {
        /// The path.
        path: PathBuf,
        /// What is wrong and where.
        detail: String,
    },
    /// A directory without any `*.json`.
    #[error("no workload files (*.json) in {0}; point --workloads or {WORKLOADS_ENV} at a directory of workload files")]
    Empty(PathBuf),
    /// A workload asked for by name is not in the directory.
    #[error("no workload named '{name}' in {dir} (available: {available})")]
    Unknown {
        /// The requested name.
        name: String,
        /// Where it was looked for.
        dir: PathBuf,
        /// What is there.
        available: String,
    },
}

impl Workload {
    /// Reads and validates one workload file.
    pub fn load(path: &Path) -> Result<Self, WorkloadError> {
        let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses and validates workload JSON; `path` is used in error messages.
    pub fn parse(text: &str, path: &Path) -> Result<Self, WorkloadError> {
        let raw: RawWorkload = serde_json::from_str(text).map_err(|e| WorkloadError::Parse {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
        let invalid = |detail: String| WorkloadError::Invalid {
            path: path.to_path_buf(),
            detail,
        };
        let dtype = parse_dtype(&raw.dtype).ok_or_else(|| {
            invalid(format!(
                "unknown dtype '{}' (use float32, float16, bfloat16, float64, int32, int64, uint8, int8 or bool)",
                raw.dtype
            ))
        })?;
        if raw.model.trim().is_empty() {
            return Err(invalid("\"model\" is empty".into()));
        }
        if raw.tensors.is_empty() {
            return Err(invalid(
                "\"tensors\" is empty: a workload needs at least one gradient".into(),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        let mut share_sum = 0.0;
        let mut tensors = Vec::with_capacity(raw.tensors.len());
        for (i, t) in raw.tensors.into_iter().enumerate() {
            if t.name.is_empty() {
                return Err(invalid(format!("tensor #{i} has an empty name")));
            }
            if !seen.insert(t.name.clone()) {
                return Err(invalid(format!("tensor #{i}: duplicate name '{}'", t.name)));
            }
            let product: usize = t.shape.iter().product();
            if product != t.elements {
                return Err(invalid(format!(
                    "tensor #{i} '{}': \"elements\" is {} but the shape {:?} has {product}",
                    t.name, t.elements, t.shape
                )));
            }
            if !t.compute_share.is_finite() || t.compute_share < 0.0 {
                return Err(invalid(format!(
                    "tensor #{i} '{}': \"compute_share\" must be a finite number >= 0, got {}",
                    t.name, t.compute_share
                )));
            }
            share_sum += t.compute_share;
            tensors.push(TensorSpec {
                name: t.name,
                shape: t.shape,
                elements: t.elements,
                compute_share: t.compute_share,
            });
        }
        if (share_sum - 1.0).abs() > SHARE_SUM_TOLERANCE {
            return Err(invalid(format!(
                "the compute shares add up to {share_sum:.6}, not 1 (within {SHARE_SUM_TOLERANCE})"
            )));
        }
        if let Some(n) = raw.tensors_total {
            if n != tensors.len() {
                return Err(invalid(format!(
                    "\"tensors_total\" is {n} but {} tensors are listed",
                    tensors.len()
                )));
            }
        }
        let params: usize = tensors.iter().map(|t| t.elements).sum();
        if let Some(n) = raw.parameters_total {
            if n != params {
                return Err(invalid(format!(
                    "\"parameters_total\" is {n} but the tensors hold {params} elements"
                )));
            }
        }
        Ok(Workload {
            model: raw.model,
            dtype,
            tensors,
            path: path.to_path_buf(),
        })
    }

    /// All workloads of a directory (`*.json`), sorted by file name.
    pub fn load_dir(dir: &Path) -> Result<Vec<Self>, WorkloadError> {
        let entries = std::fs::read_dir(dir).map_err(|source| WorkloadError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut paths: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(WorkloadError::Empty(dir.to_path_buf()));
        }
        paths.iter().map(|p| Self::load(p)).collect()
    }

    /// The workloads of `dir` whose model name (or file stem) is in `names`, in that order;
    /// all of them when `names` is empty.
    pub fn select(dir: &Path, names: &[String]) -> Result<Vec<Self>, WorkloadError> {
        let all = Self::load_dir(dir)?;
        if names.is_empty() {
            return Ok(all);
        }
        names
            .iter()
            .map(|n| {
                all.iter()
                    .find(|w| &w.model == n || w.path.file_stem().is_some_and(|s| s == n.as_str()))
                    .cloned()
                    .ok_or_else(|| WorkloadError::Unknown {
                        name: n.clone(),
                        dir: dir.to_path_buf(),
                        available: all
                            .iter()
                            .map(|w| w.model.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                    })
            })
            .collect()
    }

    /// Total gradient bytes of one step.
    pub fn total_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| (t.elements * self.dtype.size()) as u64)
            .sum()
    }

    /// Bytes of tensor `i`.
    pub fn bytes(&self, i: usize) -> usize {
        self.tensors[i].elements * self.dtype.size()
    }

    /// When each gradient becomes ready during an emulated backward pass of length `backward`:
    /// `backward × (share₀ + … + shareᵢ)`, clamped to `backward`.
    pub fn deadlines(&self, backward: Duration) -> Vec<Duration> {
        let mut cum = 0.0;
        self.tensors
            .iter()
            .map(|t| {
                cum += t.compute_share;
                backward.mul_f64(cum.min(1.0))
            })
            .collect()
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({} tensors, {:.1} MB {})",
            self.model,
            self.tensors.len(),
            self.total_bytes() as f64 / 1e6,
            self.dtype.name()
        )
    }
}

fn parse_dtype(s: &str) -> Option<DType> {
    s.parse().ok()
}

/// The default workloads directory: `$FH_BENCH_WORKLOADS`, else the repository's
/// `fh-bench/workloads/`.
pub fn default_dir() -> PathBuf {
    std::env::var_os(WORKLOADS_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Workload, WorkloadError> {
        Workload::parse(text, Path::new("test.json"))
    }

    const GOOD: &str = r#"{"model": "tiny", "dtype": "float32", "tensors_total": 2,
        "parameters_total": 7, "tensors": [
        {"name": "b", "shape": [3], "elements": 3, "compute_share": 0.25},
        {"name": "w", "shape": [2, 2], "elements": 4, "compute_share": 0.75}]}"#;

    #[test]
    fn loads_the_repository_workloads() {
        let all =
            Workload::load_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads")).unwrap();
        let names: Vec<&str> = all.iter().map(|w| w.model.as_str()).collect();
        assert_eq!(names, ["bert-base", "gpt2-small", "resnet50", "vgg16"]);
        let resnet = &all[2];
        assert_eq!(resnet.tensors.len(), 161);
        assert_eq!(resnet.total_bytes(), 25_557_032 * 4);
        assert_eq!(resnet.dtype, DType::F32);
    }

    #[test]
    fn deadlines_are_cumulative_shares() {
        let w = parse(GOOD).unwrap();
        assert_eq!(
            w.deadlines(Duration::from_millis(100)),
            [Duration::from_millis(25), Duration::from_millis(100)]
        );
        assert_eq!(w.total_bytes(), 28);
        assert_eq!(w.bytes(1), 16);
    }

    fn err(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn bad_files_give_clear_errors() {
        let e = err("{ not json");
        assert!(
            e.contains("test.json") && e.contains("not a valid workload JSON"),
            "{e}"
        );
        assert!(e.contains("line 1"), "{e}");

        let e = err(r#"{"model": "m", "dtype": "float32"}"#);
        assert!(e.contains("missing field `tensors`"), "{e}");

        let e = err(&GOOD.replace("float32", "complex64"));
        assert!(e.contains("unknown dtype 'complex64'"), "{e}");

        let e = err(&GOOD.replace(r#""elements": 4"#, r#""elements": 5"#));
        assert!(e.contains("tensor #1 'w'") && e.contains("has 4"), "{e}");

        let e = err(&GOOD.replace("0.75", "0.5"));
        assert!(e.contains("add up to 0.75"), "{e}");

        let e = err(&GOOD.replace("0.25", "-0.25"));
        assert!(e.contains(">= 0"), "{e}");

        let e = err(&GOOD.replace(r#""name": "w""#, r#""name": "b""#));
        assert!(e.contains("duplicate name 'b'"), "{e}");

        let e = err(&GOOD.replace(r#""tensors_total": 2"#, r#""tensors_total": 3"#));
        assert!(e.contains("\"tensors_total\" is 3"), "{e}");

        let e = err(&GOOD.replace(r#""parameters_total": 7"#, r#""parameters_total": 8"#));
        assert!(e.contains("\"parameters_total\" is 8"), "{e}");

        let e = err(r#"{"model": "m", "dtype": "float32", "tensors": []}"#);
        assert!(e.contains("\"tensors\" is empty"), "{e}");

        let e = err(&GOOD.replace(r#""model": "tiny""#, r#""modle": "tiny""#));
        assert!(e.contains("modle"), "{e}");
    }

    #[test]
    fn directory_errors_name_the_fix() {
        let dir = std::env::temp_dir().join(format!("fh-bench-wl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = Workload::load_dir(&dir).unwrap_err().to_string();
        assert!(
            e.contains("no workload files") && e.contains(WORKLOADS_ENV),
            "{e}"
        );
        std::fs::write(dir.join("tiny.json"), GOOD).unwrap();
        let e = Workload::select(&dir, &["resnet".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no workload named 'resnet'") && e.contains("tiny"),
            "{e}"
        );
        assert_eq!(Workload::select(&dir, &["tiny".into()]).unwrap().len(), 1);
        let e = Workload::load_dir(&dir.join("missing"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot read workload"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
