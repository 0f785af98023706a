//! fhrun: the FastHorovod launcher (work in progress).

fn main() {
    eprintln!("fhrun: not implemented yet");
    std::process::exit(2);
}
