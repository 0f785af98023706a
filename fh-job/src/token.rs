//! The job token and every key made from it: one key type ([`Key`]), one MAC construction
//! ([`Key::mac`], HMAC-SHA-256 over length-prefixed parts) and one derivation ([`Key::derive`]),
//! through which the per-incarnation, per-group and per-host keys are made. Also the checks an
//! `FH_JOB_TOKEN` must pass ([`check_token`]) and the nonces of the handshakes
//! ([`fresh_nonce`]).
//!
//! The token never crosses the network: peers prove knowledge of it with MACs over fresh
//! nonces ([`proof`]).

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::config;
use crate::Result;

/// Shortest `FH_JOB_TOKEN` accepted, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;

/// Fewest distinct characters an `FH_JOB_TOKEN` must hold: a token of one repeated character
/// (or a short pattern) can be guessed. A random hex token of 32 or more digits always has more
/// (16 random hex digits fall short about once in 40,000 draws).
pub const MIN_TOKEN_DISTINCT: usize = 6;

/// How to make a good token, quoted in the errors about bad ones.
const TOKEN_FIX: &str = "export a random secret in every rank's environment, e.g. \
 `export FH_JOB_TOKEN=$(openssl rand -hex 32)` or, without openssl, \
 `export FH_JOB_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')`, or \
 launch with fhrun, which draws one per job";
/// Longest job token accepted, in bytes.
pub const MAX_TOKEN_LEN: usize = 255;

/// Length of a handshake nonce, in bytes.
pub const NONCE_LEN: usize = 32;

/// Length of a MAC tag ([`Key::mac`]), in bytes.
pub const PROOF_TAG_LEN: usize = 32;

/// The label of every derived key ([`Key::derive`]).
const DERIVE_LABEL: &[u8] = b"fasthorovod derived key";

/// The job's shared secret. Its `Debug` output is redacted; [`JobToken::expose`] is the only
/// way to the text, so that every use is visible in the code.
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken(String);

impl JobToken {
    /// Wrap a token (no checks: [`LaunchInfo::from_vars`](crate::launch::LaunchInfo::from_vars)
    /// checks what comes from the environment, with [`check_token`]).
    pub fn new(token: impl Into<String>) -> Self {
        JobToken(token.into())
    }

    /// The secret itself. Never log or print it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The secret's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// The token as the key of every MAC.
    pub fn key(&self) -> Key {
        Key::new(self.as_bytes())
    }

    /// The token of the process's `incarnation`-th world (0: the first, this token itself;
    /// later ones, after a `shutdown()` and a new `init()`, the key [`JobToken::derive`]s for
    /// the incarnation number). Worlds of different incarnations authenticate with different
    /// keys and name their shared-memory segments differently, so nothing of one can reach
    /// another.
    pub fn for_incarnation(&self, incarnation: u64) -> JobToken {
        if incarnation == 0 {
            return self.clone();
        }
        self.derive(&format!("world incarnation {incarnation}"))
    }

    /// A token for another world formed among ranks that share this token, named by `label`
    /// (which every member knows, and which must differ for every such world: e.g. a group's
    /// name and a nonce drawn for it): [`Key::derive`], as text. It authenticates as well as
    /// this token does, and no world keyed by another label (or by an incarnation,
    /// [`JobToken::for_incarnation`]) shares it.
    pub fn derive(&self, label: &str) -> JobToken {
        JobToken(self.key().derive(label).hex)
    }
}

impl fmt::Debug for JobToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobToken(<redacted>)")
    }
}

impl From<&str> for JobToken {
    fn from(s: &str) -> Self {
        JobToken(s.to_owned())
    }
}

impl From<String> for JobToken {
    fn from(s: String) -> Self {
        JobToken(s)
    }
}

/// A secret key: the job token's bytes ([`JobToken::key`]) or a key derived from them. Its
/// `Debug` never shows it.
#[derive(Clone)]
pub struct Key(Arc<[u8]>);

/// A derived key ([`Key::derive`]) and its text (lowercase hex, a valid job token).
pub struct Derived {
    /// The key.
    pub key: Key,
    /// The same key as the text a [`JobToken`] holds.
    pub hex: String,
}

impl Key {
    /// A key of these bytes.
    pub fn new(bytes: &[u8]) -> Key {
        Key(Arc::from(bytes))
    }

    /// The key's bytes. Never log or print them.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// The one MAC construction of the project: HMAC-SHA-256 keyed with this key over `parts`,
    /// each preceded by its length (8 bytes, little endian), so that no two lists of parts
    /// give the same input.
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; PROOF_TAG_LEN] {
        // HMAC accepts keys of any length; `new_from_slice` cannot fail for it.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(self.bytes())
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        for p in parts {
            mac.update(&(p.len() as u64).to_le_bytes());
            mac.update(p);
        }
        mac.finalize().into_bytes().into()
    }

    /// Whether `tag` is [`Key::mac`] of `parts`, compared in constant time.
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        constant_time_eq(&self.mac(parts), tag)
    }

    /// The one key derivation: the key named `label` under this one, the [`Key::mac`] of the
    /// label in hex (so that it is also a valid job token). Every member of a world derives the
    /// same key from the same label; keys of different labels share nothing.
    pub fn derive(&self, label: &str) -> Derived {
        let tag = self.mac(&[DERIVE_LABEL, label.as_bytes()]);
        let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        Derived {
            key: Key::new(hex.as_bytes()),
            hex,
        }
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Key(<redacted>)")
    }
}

/// The proof that a peer holds the key: [`Key::mac`] over a protocol's `label`, the `hello`
/// the two sides exchanged and the other side's fresh `nonce` (the TCP handshake's and the
/// elastic session's proofs, each with labels of its own).
pub fn proof(
    key: &Key,
    label: &[u8],
    hello: &[u8],
    nonce: &[u8; NONCE_LEN],
) -> [u8; PROOF_TAG_LEN] {
    key.mac(&[label, hello, nonce])
}

/// A fresh random nonce from the operating system's CSPRNG.
pub fn fresh_nonce() -> std::io::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| std::io::Error::other(format!("getrandom: {e}")))?;
    Ok(n)
}

/// Compare two byte strings in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        diff |= x ^ y;
    }
    // Keep the compiler from short-circuiting the loop.
    std::hint::black_box(diff) == 0
}

/// Check a job token as `FH_JOB_TOKEN` must be (the runtime and `fhrun` both apply it): not
/// empty or blank, at most [`MAX_TOKEN_LEN`] printable ASCII
/// bytes without spaces, at least [`MIN_TOKEN_LEN`] bytes of at least [`MIN_TOKEN_DISTINCT`]
/// distinct characters. Surrounding whitespace is ignored. The error names the variable, the
/// problem and the fix (without showing the token).
pub fn check_token(token: &str) -> Result<()> {
    let t = token.trim();
    if t.is_empty() {
        return Err(config(
            "FH_JOB_TOKEN",
            format!(
                "FH_JOB_TOKEN is set but empty{}: an empty token is no secret (was it made by a \
                 command that failed, such as openssl missing?). Unset it, or {TOKEN_FIX}",
                if token.is_empty() {
                    ""
                } else {
                    " (only whitespace)"
                }
            ),
        ));
    }
    if t.len() > MAX_TOKEN_LEN {
        return Err(config(
            "FH_JOB_TOKEN",
            format!(
                "the token is {} bytes long; at most {} are allowed (32 hex digits is plenty)",
                t.len(),
                MAX_TOKEN_LEN
            ),
        ));
    }
    if !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(config(
            "FH_JOB_TOKEN",
            "the token must be printable ASCII without spaces (e.g. hex digits)",
        ));
    }
    if t.len() < MIN_TOKEN_LEN {
        return Err(config(
            "FH_JOB_TOKEN",
            format!(
                "the token is {} bytes long; at least {MIN_TOKEN_LEN} are needed so that it \
                 cannot be guessed (e.g. `export FH_JOB_TOKEN=$(openssl rand -hex 32)`)",
                t.len()
            ),
        ));
    }
    let mut seen = [false; 128];
    for b in t.bytes() {
        seen[usize::from(b & 0x7f)] = true;
    }
    let distinct = seen.iter().filter(|&&x| x).count();
    if distinct < MIN_TOKEN_DISTINCT {
        return Err(config(
            "FH_JOB_TOKEN",
            format!(
                "the token has only {distinct} distinct character(s); at least \
                 {MIN_TOKEN_DISTINCT} are needed, as a repeated character or a short pattern \
                 can be guessed: {TOKEN_FIX}"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_incarnation_has_its_own_key() {
        let t = JobToken::new("0123456789abcdef0123456789abcdef");
        assert_eq!(
            t.for_incarnation(0),
            t,
            "the first world keeps the launcher's token"
        );
        let (one, two) = (t.for_incarnation(1), t.for_incarnation(2));
        assert_ne!(one, t);
        assert_ne!(one, two);
        // The same on every rank (a function of the token and the number only).
        assert_eq!(
            one,
            JobToken::new("0123456789abcdef0123456789abcdef").for_incarnation(1)
        );
        // Another job's token gives another key for the same incarnation.
        assert_ne!(
            one,
            JobToken::new("fedcba9876543210fedcba9876543210").for_incarnation(1)
        );
        assert_eq!(one.expose().len(), 64);
        assert!(one.expose().bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(!format!("{one:?}").contains(one.expose()), "redacted");
    }

    #[test]
    fn each_label_derives_its_own_key() {
        let t = JobToken::new("0123456789abcdef0123456789abcdef");
        let a = t.derive("group 1;nonce 7");
        assert_eq!(
            a,
            t.clone().derive("group 1;nonce 7"),
            "a function of token and label"
        );
        assert_ne!(a, t);
        assert_ne!(a, t.derive("group 1;nonce 8"));
        assert_ne!(a, t.for_incarnation(1));
        assert_ne!(
            a,
            JobToken::new("fedcba9876543210fedcba9876543210").derive("group 1;nonce 7")
        );
        assert_eq!(a.expose().len(), 64);
        check_token(a.expose()).expect("a derived key is a valid token");
    }

    #[test]
    fn one_mac_construction_tells_lists_of_parts_apart() {
        let k = Key::new(b"0123456789abcdef0123456789abcdef");
        assert_ne!(k.mac(&[b"ab", b"c"]), k.mac(&[b"a", b"bc"]));
        assert_ne!(k.mac(&[b"abc"]), k.mac(&[b"abc", b""]));
        let tag = k.mac(&[b"x", b"y"]);
        assert!(k.verify(&[b"x", b"y"], &tag));
        assert!(!k.verify(&[b"x", b"z"], &tag));
        assert!(!Key::new(b"another key").verify(&[b"x", b"y"], &tag));
        assert!(!format!("{k:?}").contains("0123"), "redacted");
    }
}
