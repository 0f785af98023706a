//! fh-bench: the benchmark suite (work in progress).

fn main() {
    eprintln!("fh-bench: not implemented yet");
    std::process::exit(2);
}
