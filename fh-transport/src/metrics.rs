//! A tiny HTTP endpoint for a rank's figures in Prometheus' text format (`FH_METRICS_ADDR`):
//! every `GET` is answered with what `render` returns, on one thread of its own. It is meant
//! for loopback (the default address) or a trusted network: it serves counters only, reads
//! at most a few KiB of each request, and gives each connection a second.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// What the endpoint serves: called for every request.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Longest a request may take to arrive, and a response to leave.
const IO_TIMEOUT: Duration = Duration::from_secs(1);

/// How often the listening thread looks whether it should stop.
const POLL: Duration = Duration::from_millis(100);

/// Most bytes of a request read.
const MAX_REQUEST: usize = 8 << 10;

/// A running endpoint; dropping it stops it (within its poll interval, 100 ms).
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl MetricsServer {
    /// Listen on `addr` and serve `render`'s text to every `GET`.
    pub fn start(addr: SocketAddr, render: Render) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("fh-metrics".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => answer(stream, &render),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(POLL)
                        }
                        Err(_) => std::thread::sleep(POLL),
                    }
                }
            })?;
        Ok(MetricsServer {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Read the request's head (bounded in size and time) and answer it.
fn answer(mut stream: TcpStream, render: &Render) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while head.len() < MAX_REQUEST && !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let response = if head.starts_with(b"GET ") {
        let body = render();
        format!(
            "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: \
             {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    } else {
        "HTTP/1.0 405 Method Not Allowed\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            .to_string()
    };
    let _ = stream.write_all(response.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_what_render_says_and_stops_when_dropped() {
        let n = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let seen = Arc::clone(&n);
        let server = MetricsServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(move || format!("x_total {}\n", seen.fetch_add(1, Ordering::Relaxed) + 1)),
        )
        .unwrap();
        let addr = server.local_addr();
        let first = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(first.starts_with("HTTP/1.0 200 OK\r\n"), "{first}");
        assert!(first.ends_with("\r\n\r\nx_total 1\n"), "{first}");
        assert!(get(addr, "GET / HTTP/1.0\r\n\r\n").ends_with("x_total 2\n"));
        assert!(get(addr, "POST / HTTP/1.0\r\n\r\n").starts_with("HTTP/1.0 405"));
        drop(server);
        assert!(TcpStream::connect(addr).is_err(), "still listening");
    }
}
