//! Whether log lines carry colour: only on a terminal, and never with `NO_COLOR`.

use std::io::IsTerminal as _;

/// The variable that overrides the terminal check: `always`, `never` or `auto`.
pub const LOG_COLOR_VAR: &str = "FH_LOG_COLOR";

/// Whether log lines written to stderr may carry colour (ANSI escape sequences): never when
/// `NO_COLOR` is set to anything but the empty string (<https://no-color.org>); else as
/// `FH_LOG_COLOR` says — `always`, `never`, or `auto` (the default, also for an unknown
/// value): when stderr is a terminal. Output piped to a file, to `fhrun` or to a CI log
/// stays plain text. Every `tracing` subscriber of FastHorovod's binaries and of the Python
/// extension is built with this.
pub fn log_colour() -> bool {
    colour_for(|k| std::env::var(k).ok(), std::io::stderr().is_terminal())
}

/// [`log_colour`] for any variable source and terminal answer (pure, for tests).
pub fn colour_for(var: impl Fn(&str) -> Option<String>, terminal: bool) -> bool {
    if var("NO_COLOR").is_some_and(|v| !v.is_empty()) {
        return false;
    }
    match var(LOG_COLOR_VAR)
        .map(|v| v.trim().to_ascii_lowercase())
        .as_deref()
    {
        Some("always") => true,
        Some("never") => false,
        _ => terminal,
    }
}

#[cfg(test)]
mod tests {
    use super::colour_for;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn colour_only_on_a_terminal_and_never_with_no_color() {
        assert!(colour_for(env(&[]), true));
        assert!(!colour_for(env(&[]), false));
        assert!(!colour_for(env(&[("NO_COLOR", "1")]), true));
        // An empty NO_COLOR does not count.
        assert!(colour_for(env(&[("NO_COLOR", "")]), true));
        assert!(colour_for(env(&[("FH_LOG_COLOR", "always")]), false));
        assert!(!colour_for(env(&[("FH_LOG_COLOR", "Never")]), true));
        assert!(colour_for(env(&[("FH_LOG_COLOR", "auto")]), true));
        assert!(!colour_for(env(&[("FH_LOG_COLOR", "rainbow")]), false));
        assert!(!colour_for(
            env(&[("FH_LOG_COLOR", "always"), ("NO_COLOR", "yes")]),
            true
        ));
    }
}
