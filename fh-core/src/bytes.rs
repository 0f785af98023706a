//! Reading little-endian fields from a byte buffer that may still be arriving: the one byte
//! reader of the wire formats (the TCP handshake, reply, address book and world id, the
//! rendezvous' host list, heartbeats, the elastic session's messages, the engine's codec and
//! the scheduler's control words), and [`DecodeError`], the one error of their decoders. The
//! 4- and 8-byte frame headers of the data paths are read as fixed arrays without it.
//!
//! A read past the end is [`DecodeError::NeedMore`] with the total length the buffer needs so
//! far, so that a caller reading from a stream knows how much to wait for; a malformed field is
//! [`DecodeError::Invalid`], whose text names the field and what is wrong with it. A magic is
//! refused as soon as one of its bytes differs ([`Reader::magic`]), so garbage is turned away
//! without waiting for more of it. A decoder of a message that arrives whole reads to its end
//! ([`Reader::end`]) and reports a shortfall as [`DecodeError::Invalid`]: nothing more will come.

use std::fmt;

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// More bytes are needed: at least this many in total.
    NeedMore(usize),
    /// The bytes are not valid; the reason says why.
    Invalid(String),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::NeedMore(n) => write!(f, "truncated: need {n} bytes"),
            DecodeError::Invalid(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for DecodeError {}

/// A cursor over a byte buffer.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// The bytes read so far.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Whether the unread bytes could start with `prefix`: every byte of it that has arrived
    /// matches (true while none has), so a wrong prefix is seen before all of it is there.
    pub fn could_be(&self, prefix: &[u8]) -> bool {
        let rest = self.buf.get(self.pos..).unwrap_or_default();
        let n = rest.len().min(prefix.len());
        rest[..n] == prefix[..n]
    }

    /// Read `magic`: [`DecodeError::Invalid`] with `bad`'s text as soon as a byte that has
    /// arrived differs from it, [`DecodeError::NeedMore`] while part of it is missing.
    pub fn magic(&mut self, magic: &[u8], bad: impl FnOnce() -> String) -> Result<(), DecodeError> {
        if !self.could_be(magic) {
            return Err(DecodeError::Invalid(bad()));
        }
        self.bytes(magic.len()).map(|_| ())
    }

    /// Ask for `len` more bytes at once, reading none: [`DecodeError::NeedMore`] for all of
    /// them when any is missing (a fixed-size part is then read in one go, not field by field).
    pub fn need(&self, len: usize) -> Result<(), DecodeError> {
        let end = self.pos.saturating_add(len);
        if end > self.buf.len() {
            return Err(DecodeError::NeedMore(end));
        }
        Ok(())
    }

    /// Decode a nested message from the unread bytes with `decode` (which returns the message
    /// and the bytes it used) and read past it; its [`DecodeError::NeedMore`] counts from the
    /// start of this reader's buffer.
    pub fn nested<T>(
        &mut self,
        decode: impl FnOnce(&'a [u8]) -> Result<(T, usize), DecodeError>,
    ) -> Result<T, DecodeError> {
        let rest = self.buf.get(self.pos..).unwrap_or_default();
        match decode(rest) {
            Ok((msg, used)) => {
                self.bytes(used)?;
                Ok(msg)
            }
            Err(DecodeError::NeedMore(n)) => Err(DecodeError::NeedMore(self.pos.saturating_add(n))),
            Err(e) => Err(e),
        }
    }

    /// Check that every byte was read: [`DecodeError::Invalid`] naming how many are left over
    /// otherwise (for a message that must fill its buffer exactly).
    pub fn end(&self) -> Result<(), DecodeError> {
        match self.buf.len().saturating_sub(self.pos) {
            0 => Ok(()),
            n => Err(DecodeError::Invalid(format!("{n} trailing bytes"))),
        }
    }

    /// The next `len` bytes.
    pub fn bytes(&mut self, len: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.saturating_add(len);
        let out = self
            .buf
            .get(self.pos..end)
            .ok_or(DecodeError::NeedMore(end))?;
        self.pos = end;
        Ok(out)
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    /// One byte.
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }

    /// A little-endian `u16`.
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A little-endian two's-complement `i64`.
    pub fn i64(&mut self) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    /// A little-endian IEEE 754 `f64`.
    pub fn f64(&mut self) -> Result<f64, DecodeError> {
        Ok(f64::from_le_bytes(self.array()?))
    }

    /// `len` bytes of UTF-8 text; `what` names the field in the error when they are not.
    pub fn text(&mut self, len: usize, what: &str) -> Result<String, DecodeError> {
        let bytes = self.bytes(len)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| DecodeError::Invalid(format!("{what} that is not UTF-8")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fields_and_says_how_much_more_it_needs() {
        let buf = [1u8, 2, 0, 3, 0, 0, 0, b'h', b'i'];
        let mut r = Reader::new(&buf);
        assert_eq!(r.u8(), Ok(1));
        assert_eq!(r.u16(), Ok(2));
        assert_eq!(r.u32(), Ok(3));
        assert_eq!(r.text(2, "a name").as_deref(), Ok("hi"));
        assert_eq!(r.pos(), 9);
        assert_eq!(r.u32(), Err(DecodeError::NeedMore(13)));
        let buf = [(-2i64).to_le_bytes(), 1.5f64.to_le_bytes()].concat();
        let mut r = Reader::new(&buf);
        assert_eq!(r.i64(), Ok(-2));
        assert_eq!(r.f64(), Ok(1.5));
        assert_eq!(r.i64(), Err(DecodeError::NeedMore(24)));
        assert_eq!(r.end(), Ok(()));
        let mut r = Reader::new(&buf);
        r.i64().unwrap();
        assert_eq!(
            r.end(),
            Err(DecodeError::Invalid("8 trailing bytes".into()))
        );
        let bad = [0xffu8];
        assert!(matches!(
            Reader::new(&bad).text(1, "a name"),
            Err(DecodeError::Invalid(m)) if m == "a name that is not UTF-8"
        ));
    }

    #[test]
    fn a_magic_is_refused_as_soon_as_a_byte_differs() {
        let bad = || "bad magic".to_string();
        // Nothing, or a correct start: wait for the rest.
        assert_eq!(
            Reader::new(b"").magic(b"FHTP", bad),
            Err(DecodeError::NeedMore(4))
        );
        assert_eq!(
            Reader::new(b"FH").magic(b"FHTP", bad),
            Err(DecodeError::NeedMore(4))
        );
        // A wrong first byte is enough.
        assert_eq!(
            Reader::new(b"G").magic(b"FHTP", bad),
            Err(DecodeError::Invalid("bad magic".into()))
        );
        assert_eq!(
            Reader::new(b"FHTX and more").magic(b"FHTP", bad),
            Err(DecodeError::Invalid("bad magic".into()))
        );
        let mut r = Reader::new(b"FHTP!");
        assert_eq!(r.magic(b"FHTP", bad), Ok(()));
        assert_eq!(r.pos(), 4);
        assert!(r.could_be(b"!?"));
        assert!(!r.could_be(b"?"));
        assert_eq!(r.u8(), Ok(b'!'));
        assert!(r.could_be(b"anything"));
    }

    #[test]
    fn need_asks_for_a_whole_part_at_once_and_reads_nothing() {
        let mut r = Reader::new(&[1, 2, 3]);
        r.u8().unwrap();
        assert_eq!(r.need(2), Ok(()));
        assert_eq!(r.need(5), Err(DecodeError::NeedMore(6)));
        assert_eq!(r.need(usize::MAX), Err(DecodeError::NeedMore(usize::MAX)));
        assert_eq!(r.pos(), 1);
    }

    #[test]
    fn a_nested_message_is_read_past_and_its_need_counts_from_the_start() {
        // A nested message: a length byte and that many bytes.
        fn inner(b: &[u8]) -> Result<(Vec<u8>, usize), DecodeError> {
            let mut r = Reader::new(b);
            let n = usize::from(r.u8()?);
            if n > 4 {
                return Err(DecodeError::Invalid(format!("{n} is too long")));
            }
            Ok((r.bytes(n)?.to_vec(), r.pos()))
        }
        let buf = [9u8, 2, 7, 8, 5];
        let mut r = Reader::new(&buf);
        r.u8().unwrap();
        assert_eq!(r.nested(inner), Ok(vec![7, 8]));
        assert_eq!(r.pos(), 4);
        assert_eq!(r.u8(), Ok(5));
        let mut r = Reader::new(&buf[..3]);
        r.u8().unwrap();
        assert_eq!(r.nested(inner), Err(DecodeError::NeedMore(4)));
        assert_eq!(r.pos(), 1);
        let mut r = Reader::new(&[0u8, 9]);
        r.u8().unwrap();
        assert_eq!(
            r.nested(inner),
            Err(DecodeError::Invalid("9 is too long".into()))
        );
    }
}
