//! Project automation (work in progress).

use std::process::{exit, Command};

fn main() {
    let task = std::env::args().nth(1).unwrap_or_default();
    match task.as_str() {
        "test" => {
            let ok = Command::new(env!("CARGO"))
                .args(["test", "--workspace"])
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            exit(if ok { 0 } else { 1 });
        }
        _ => {
            eprintln!("usage: cargo xtask test");
            exit(2);
        }
    }
}
