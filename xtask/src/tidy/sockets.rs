//! Which crates may open sockets: joining a job (`fh-job`: the elastic session), moving bytes
//! (`fh-transport`), and the tools (`fh-launch`, `fh-bench`, `xtask`). The core, the scheduler
//! and the framework adapter reach other processes only through those, so a socket call in
//! them is a layering break however it got there (a dependency rule cannot see `std::net`).

use std::fs;
use std::path::Path;

/// The crates (package names) that may open sockets.
const SOCKET_CRATES: &[&str] = &["fh-job", "fh-transport", "fh-launch", "fh-bench", "xtask"];

/// What opens or names a socket.
const SOCKET_WORDS: &[&str] = &[
    "TcpStream",
    "TcpListener",
    "UdpSocket",
    "UnixStream",
    "UnixListener",
    "UnixDatagram",
    "rustix::net",
    "libc::socket",
    "socket2",
];

/// A failure for every source file of a crate outside [`SOCKET_CRATES`] that names a socket
/// (comments and trailing test modules left out).
pub(crate) fn check_socket_owners(root: &Path) -> Vec<String> {
    let members = match super::members(root) {
        Ok(m) => m,
        Err(e) => return vec![e],
    };
    let mut out = Vec::new();
    for m in members
        .iter()
        .filter(|m| !SOCKET_CRATES.contains(&m.name.as_str()))
    {
        let mut files = Vec::new();
        super::rust_files(&root.join(&m.dir).join("src"), &mut files);
        for f in files {
            let Ok(text) = fs::read_to_string(&f) else {
                continue;
            };
            for word in socket_words(&text) {
                out.push(format!(
                    "{} names `{word}`: only {} may open sockets ({} reaches other processes \
                     through fh-transport)",
                    f.strip_prefix(root).unwrap_or(&f).display(),
                    SOCKET_CRATES.join(", "),
                    m.name
                ));
            }
        }
    }
    out
}

/// The socket words a source names outside comments and its trailing test module.
pub(crate) fn socket_words(text: &str) -> Vec<&'static str> {
    let code = super::imports::strip_comments(text);
    let code = code.split("#[cfg(test)]").next().unwrap_or("");
    SOCKET_WORDS
        .iter()
        .copied()
        .filter(|w| code.contains(w))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockets_outside_comments_and_tests_are_found() {
        assert_eq!(
            socket_words("use std::net::TcpStream; // UdpSocket\n"),
            vec!["TcpStream"]
        );
        assert!(
            socket_words("/* TcpListener */ fn f() {}\n#[cfg(test)]\nmod t { UdpSocket }")
                .is_empty()
        );
    }

    #[test]
    fn only_the_socket_crates_open_sockets() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("root");
        let found = check_socket_owners(root);
        assert!(found.is_empty(), "{found:#?}");
    }
}
