//! `--mpi`: hand the job to Open MPI's `mpirun`, which fhrun runs as its child ([`mod@run`]).
//!
//! The ranks get the job directory's variables ([`crate::observe::JobDir::env`]: the flight
//! directory, the per-rank timeline pattern) exported with `-x` like every other, and fhrun
//! merges and keeps what they wrote when mpirun ends. mpirun gives fhrun no channel to bring
//! files back from other hosts: their ranks write under the same path on their own host, which
//! fhrun sees only when that directory is shared (`TMPDIR` on a shared filesystem).

use std::path::{Path, PathBuf};

use crate::hosts::Host;

mod run;

pub(crate) use run::{run, Supervision};

/// What to run: mpirun's environment additions and its argument vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpiCommand {
    /// Variables set in mpirun's environment and exported to the ranks with `-x NAME`.
    pub env: Vec<(String, String)>,
    /// Variables exported from fhrun's own environment with `-x NAME`.
    pub pass_through: Vec<String>,
    /// `mpirun` and its arguments.
    pub argv: Vec<String>,
}

/// Inputs of [`build`].
#[derive(Debug, Clone)]
pub struct MpiJob<'a> {
    /// Number of ranks.
    pub np: u32,
    /// Host list (empty: mpirun's default, this machine).
    pub hosts: &'a [Host],
    /// All hosts are this machine.
    pub local_only: bool,
    /// Prefix output lines with the rank (`--tag-output`).
    pub tag_output: bool,
    /// Running as root.
    pub as_root: bool,
    /// Variables for every rank.
    pub env: Vec<(String, String)>,
    /// Variables passed from fhrun's environment.
    pub pass_through: Vec<String>,
    /// `--mpi-args`, already split.
    pub extra_args: Vec<String>,
    /// The ranks' command.
    pub command: &'a [String],
}

/// Builds the mpirun command line (Open MPI syntax).
pub fn build(job: &MpiJob<'_>) -> MpiCommand {
    let mut argv = vec!["mpirun".to_string()];
    if job.as_root {
        argv.push("--allow-run-as-root".into());
    }
    argv.push("-np".into());
    argv.push(job.np.to_string());
    if !job.hosts.is_empty() {
        argv.push("-H".into());
        argv.push(
            job.hosts
                .iter()
                .map(|h| h.to_string())
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    argv.extend(["--bind-to", "none", "--map-by", "slot"].map(String::from));
    if job.local_only {
        argv.push("--oversubscribe".into());
    }
    if job.tag_output {
        argv.push("--tag-output".into());
    }
    let mut names: Vec<&str> = job.env.iter().map(|(k, _)| k.as_str()).collect();
    names.extend(job.pass_through.iter().map(String::as_str));
    for name in names {
        argv.push("-x".into());
        argv.push(name.to_string());
    }
    argv.extend(job.extra_args.iter().cloned());
    argv.extend(job.command.iter().cloned());
    MpiCommand {
        env: job.env.clone(),
        pass_through: job.pass_through.clone(),
        argv,
    }
}

/// Finds `prog` on `PATH`.
pub fn which(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(prog))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Splits `--mpi-args` like a POSIX shell would (quotes and backslashes; no expansions).
pub fn split_words(s: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => cur.push(c),
                        None => return Err(format!("--mpi-args: unterminated ' in '{s}'")),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\' | '$' | '`')) => cur.push(c),
                            Some(c) => {
                                cur.push('\\');
                                cur.push(c);
                            }
                            None => return Err(format!("--mpi-args: unterminated \" in '{s}'")),
                        },
                        Some(c) => cur.push(c),
                        None => return Err(format!("--mpi-args: unterminated \" in '{s}'")),
                    }
                }
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some(c) => cur.push(c),
                    None => return Err(format!("--mpi-args: trailing backslash in '{s}'")),
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

/// Quotes a word for display so that a shell would read it back unchanged.
pub fn shell_quote(w: &str) -> String {
    let plain = !w.is_empty()
        && w.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+^".contains(c));
    if plain {
        w.to_string()
    } else {
        format!("'{}'", w.replace('\'', r"'\''"))
    }
}

/// Variables whose values are secrets: shown as [`REDACTED`].
pub const SECRET_VARS: &[&str] = &["FH_JOB_TOKEN"];
/// What is shown instead of a secret value.
pub const REDACTED: &str = "<redacted>";

/// `NAME=value` for display, with secret values (the job token) replaced by [`REDACTED`].
pub fn show_var(name: &str, value: &str) -> String {
    if SECRET_VARS.contains(&name) {
        format!("{name}={REDACTED}")
    } else {
        format!("{name}={value}")
    }
}

/// The command as one shell line: `env A=1 B=2 mpirun ...`, secrets redacted (fhrun passes
/// them through the environment, never on a command line).
pub fn display(cmd: &MpiCommand) -> String {
    let mut parts = Vec::new();
    if !cmd.env.is_empty() {
        parts.push("env".to_string());
        for (k, v) in &cmd.env {
            parts.push(shell_quote(&show_var(k, v)));
        }
    }
    parts.extend(cmd.argv.iter().map(|a| shell_quote(a)));
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hosts::parse_host_list;

    #[test]
    fn openmpi_command() {
        let hosts = parse_host_list("node1:2,node2:2").unwrap();
        let command = vec!["python".to_string(), "train.py".into()];
        let cmd = build(&MpiJob {
            np: 4,
            hosts: &hosts,
            local_only: false,
            tag_output: true,
            as_root: true,
            env: vec![
                ("FH_RENDEZVOUS_ADDR".into(), "node1:29500".into()),
                ("FH_JOB_TOKEN".into(), "ab".into()),
                ("FH_CHANNELS".into(), "2".into()),
            ],
            pass_through: vec!["PATH".into()],
            extra_args: vec!["--mca".into(), "btl".into(), "^openib".into()],
            command: &command,
        });
        assert_eq!(
            cmd.argv.join(" "),
            "mpirun --allow-run-as-root -np 4 -H node1:2,node2:2 --bind-to none --map-by slot \
             --tag-output -x FH_RENDEZVOUS_ADDR -x FH_JOB_TOKEN -x FH_CHANNELS -x PATH --mca btl ^openib \
             python train.py"
        );
        assert_eq!(cmd.env.len(), 3);
        let shown = display(&cmd);
        assert!(shown.contains("'FH_JOB_TOKEN=<redacted>'"), "{shown}");
        assert!(!shown.contains("FH_JOB_TOKEN=ab"), "{shown}");
    }

    #[test]
    fn local_mpi_oversubscribes_and_skips_root_flag() {
        let command = vec!["true".to_string()];
        let cmd = build(&MpiJob {
            np: 2,
            hosts: &[],
            local_only: true,
            tag_output: false,
            as_root: false,
            env: vec![],
            pass_through: vec![],
            extra_args: vec![],
            command: &command,
        });
        assert_eq!(
            cmd.argv.join(" "),
            "mpirun -np 2 --bind-to none --map-by slot --oversubscribe true"
        );
    }

    #[test]
    fn words() {
        assert_eq!(
            split_words(r#"--mca btl '^openib' -x "A=b c" d\ e"#).unwrap(),
            ["--mca", "btl", "^openib", "-x", "A=b c", "d e"]
        );
        assert_eq!(split_words("  ").unwrap(), Vec::<String>::new());
        assert_eq!(split_words("''").unwrap(), [""]);
        assert!(split_words("'open").is_err());
        assert!(split_words("\"open").is_err());
    }

    #[test]
    fn quoting_round_trips_through_split() {
        for w in ["plain", "a b", "it's", "", "$HOME", "x\"y"] {
            assert_eq!(split_words(&shell_quote(w)).unwrap(), [w]);
        }
    }
}
