//! Reading little-endian fields from a byte buffer that may still be arriving: the one byte
//! reader of the wire formats that are decoded as their bytes come in (the rendezvous' host
//! list, the elastic session's messages).
//!
//! A read past the end is [`DecodeError::NeedMore`] with the total length the buffer needs so
//! far, so that a caller reading from a stream knows how much to wait for; a malformed field is
//! [`DecodeError::Invalid`].

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
        let bad = [0xffu8];
        assert!(matches!(
            Reader::new(&bad).text(1, "a name"),
            Err(DecodeError::Invalid(m)) if m == "a name that is not UTF-8"
        ));
    }
}
