//! Compact binary encoding of negotiation messages.
//!
//! Every message starts with a three-byte magic (`FHq` for a request list, `FHr` for a
//! response list, `FHn` for a name list) and a version byte ([`VERSION`]). Integers are little
//! endian; strings and sequences are prefixed by a `u32` length; a set of ranks is a
//! sequence of inclusive `(first, last)` runs, checked to be ascending and separated on decoding. The decoders check every
//! length against the bytes actually present before allocating, so arbitrary input yields
//! [`CoreError::Decode`], never a panic or a huge allocation.

use bytes::BufMut;

use crate::bytes::DecodeError;
use crate::message::{
    CollectiveKind, Device, GroupTag, MismatchField, NegotiationError, Request, Response, Signature,
};
use crate::mismatch::{Disagreement, RankSet, Sent};
use crate::{CoreError, DType, ReduceOp};

/// Version of the wire format; decoders refuse any other. Version 2: a mismatch names the
/// ranks that sent each value ([`Disagreement`]) instead of two values.
pub const VERSION: u8 = 2;

const REQUESTS: &[u8; 3] = b"FHq";
const RESPONSES: &[u8; 3] = b"FHr";
const NAMES: &[u8; 3] = b"FHn";

/// Longest name accepted (bytes).
pub const MAX_NAME: usize = 64 * 1024;
/// Most dimensions accepted in a shape.
pub const MAX_DIMS: usize = 64;

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.put_u32_le(s.len() as u32);
    out.put_slice(s.as_bytes());
}

fn put_sig(out: &mut Vec<u8>, s: &Signature) {
    out.put_u8(s.kind.code());
    out.put_u8(s.dtype.code());
    out.put_u32_le(s.shape.len() as u32);
    for &d in &s.shape {
        out.put_u64_le(d);
    }
    out.put_i64_le(s.device.code());
    out.put_u8(s.op.code());
    out.put_u32_le(s.root);
    out.put_f64_le(s.prescale);
    out.put_f64_le(s.postscale);
}

fn put_group(out: &mut Vec<u8>, g: &Option<GroupTag>) {
    match g {
        None => out.put_u8(0),
        Some(g) => {
            out.put_u8(1);
            put_str(out, &g.name);
            out.put_u32_le(g.index);
            out.put_u32_le(g.size);
        }
    }
}

/// A rank set: the number of runs, then each run's first and last rank.
fn put_ranks(out: &mut Vec<u8>, r: &RankSet) {
    out.put_u32_le(r.runs().len() as u32);
    for &(a, b) in r.runs() {
        out.put_u32_le(a);
        out.put_u32_le(b);
    }
}

/// A disagreement: the number of values shown, each value and its ranks, then the number of
/// values left out and their ranks.
fn put_disagreement(out: &mut Vec<u8>, d: &Disagreement) {
    out.put_u32_le(d.sent().len() as u32);
    for s in d.sent() {
        put_str(out, &s.value);
        put_ranks(out, &s.ranks);
    }
    out.put_u32_le(d.more_values());
    put_ranks(out, d.more_ranks());
}

fn header(out: &mut Vec<u8>, magic: &[u8; 3], count: usize) {
    out.put_slice(magic);
    out.put_u8(VERSION);
    out.put_u32_le(count as u32);
}

/// Encode a list of requests.
pub fn encode_requests(reqs: &[Request]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + reqs.len() * 64);
    header(&mut out, REQUESTS, reqs.len());
    for r in reqs {
        put_str(&mut out, &r.name);
        out.put_u32_le(r.rank);
        put_sig(&mut out, &r.sig);
        out.put_i64_le(r.priority);
        put_group(&mut out, &r.group);
    }
    out
}

/// Encode a list of responses.
pub fn encode_responses(resps: &[Response]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + resps.len() * 64);
    header(&mut out, RESPONSES, resps.len());
    for r in resps {
        put_str(&mut out, &r.name);
        put_sig(&mut out, &r.sig);
        out.put_i64_le(r.priority);
        put_group(&mut out, &r.group);
        match &r.error {
            None => out.put_u8(0),
            Some(NegotiationError::Mismatch {
                kind,
                field,
                senders,
            }) => {
                out.put_u8(1);
                out.put_u8(kind.code());
                out.put_u8(field.code());
                put_disagreement(&mut out, senders);
            }
            Some(NegotiationError::Other(s)) => {
                out.put_u8(2);
                put_str(&mut out, s);
            }
        }
    }
    out
}

/// Encode a list of (name, number) pairs (used to compare pending names across ranks).
pub fn encode_names(items: &[(String, u64)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + items.len() * 24);
    header(&mut out, NAMES, items.len());
    for (n, v) in items {
        put_str(&mut out, n);
        out.put_u64_le(*v);
    }
    out
}

/// The engine codec's view of the one byte reader ([`crate::bytes::Reader`]): a message
/// arrives whole, so a short one is malformed ([`DecodeError::Invalid`], never
/// [`DecodeError::NeedMore`]: nothing more will come), in an error naming the message kind.
struct Reader<'a> {
    inner: crate::bytes::Reader<'a>,
    len: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader {
            inner: crate::bytes::Reader::new(buf),
            len: buf.len(),
            what,
        }
    }

    /// Bytes not read yet.
    fn left(&self) -> usize {
        self.len - self.inner.pos()
    }

    fn err(&self, detail: impl Into<String>) -> CoreError {
        self.decode_err(DecodeError::Invalid(detail.into()))
    }

    /// The reader's error in this message's [`CoreError::Decode`]; a read past the end is
    /// "truncated" with how many bytes the read wanted and how many were left.
    fn decode_err(&self, e: DecodeError) -> CoreError {
        let detail = match e {
            DecodeError::NeedMore(end) => DecodeError::Invalid(format!(
                "truncated: needed {} more bytes, {} left",
                end.saturating_sub(self.inner.pos()),
                self.left()
            )),
            e => e,
        };
        CoreError::Decode {
            what: self.what,
            detail,
        }
    }

    /// A field read with `read` from the one byte reader.
    fn read<T>(
        &mut self,
        read: impl FnOnce(&mut crate::bytes::Reader<'a>) -> Result<T, DecodeError>,
    ) -> Result<T, CoreError> {
        read(&mut self.inner).map_err(|e| self.decode_err(e))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], CoreError> {
        self.read(|r| r.bytes(n))
    }

    fn u8(&mut self) -> Result<u8, CoreError> {
        self.read(crate::bytes::Reader::u8)
    }
    fn u32(&mut self) -> Result<u32, CoreError> {
        self.read(crate::bytes::Reader::u32)
    }
    fn u64(&mut self) -> Result<u64, CoreError> {
        self.read(crate::bytes::Reader::u64)
    }
    fn i64(&mut self) -> Result<i64, CoreError> {
        self.read(crate::bytes::Reader::i64)
    }
    fn f64(&mut self) -> Result<f64, CoreError> {
        self.read(crate::bytes::Reader::f64)
    }

    fn string(&mut self) -> Result<String, CoreError> {
        let len = self.u32()? as usize;
        if len > MAX_NAME {
            return Err(self.err(format!("string of {len} bytes exceeds {MAX_NAME}")));
        }
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err("string is not UTF-8"))
    }

    /// Read a count and check that `count * min_item` bytes could follow.
    fn count(&mut self, min_item: usize) -> Result<usize, CoreError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_item) > self.left() {
            return Err(self.err(format!(
                "count {n} cannot fit in the {} remaining bytes",
                self.left()
            )));
        }
        Ok(n)
    }

    fn header(&mut self, magic: &[u8; 3]) -> Result<(), CoreError> {
        let m = self.take(3)?;
        if m != magic {
            return Err(self.err(format!("bad magic {m:?}")));
        }
        let v = self.u8()?;
        if v != VERSION {
            return Err(self.err(format!(
                "wire version {v}, this build speaks {VERSION}; run the same FastHorovod version on every rank"
            )));
        }
        Ok(())
    }

    fn sig(&mut self) -> Result<Signature, CoreError> {
        let kc = self.u8()?;
        let kind = CollectiveKind::from_code(kc)
            .ok_or_else(|| self.err(format!("unknown collective kind {kc}")))?;
        let dtype = DType::from_code(self.u8()?)?;
        let ndims = self.u32()? as usize;
        if ndims > MAX_DIMS {
            return Err(self.err(format!("{ndims} dimensions exceed {MAX_DIMS}")));
        }
        if ndims.saturating_mul(8) > self.left() {
            return Err(self.err("shape truncated"));
        }
        let mut shape = Vec::with_capacity(ndims);
        for _ in 0..ndims {
            shape.push(self.u64()?);
        }
        let dc = self.i64()?;
        let device =
            Device::from_code(dc).ok_or_else(|| self.err(format!("bad device code {dc}")))?;
        let op = ReduceOp::from_code(self.u8()?)?;
        let root = self.u32()?;
        let prescale = self.f64()?;
        let postscale = self.f64()?;
        Ok(Signature {
            kind,
            dtype,
            shape,
            device,
            op,
            root,
            prescale,
            postscale,
        })
    }

    fn group(&mut self) -> Result<Option<GroupTag>, CoreError> {
        match self.u8()? {
            0 => Ok(None),
            1 => {
                let name = self.string()?;
                let index = self.u32()?;
                let size = self.u32()?;
                if index >= size {
                    return Err(self.err(format!("group member {index} of {size}")));
                }
                Ok(Some(GroupTag { name, index, size }))
            }
            t => Err(self.err(format!("unknown group tag {t}"))),
        }
    }

    fn ranks(&mut self) -> Result<RankSet, CoreError> {
        let n = self.count(8)?;
        let mut runs = Vec::with_capacity(n);
        for _ in 0..n {
            runs.push((self.u32()?, self.u32()?));
        }
        RankSet::from_runs(runs).map_err(|e| self.err(e))
    }

    fn disagreement(&mut self) -> Result<Disagreement, CoreError> {
        let n = self.count(4 + 4)?;
        if n > Disagreement::MAX_SHOWN {
            return Err(self.err(format!(
                "{n} values in a mismatch, at most {} are sent",
                Disagreement::MAX_SHOWN
            )));
        }
        let mut sent = Vec::with_capacity(n);
        for _ in 0..n {
            let value = self.string()?;
            let ranks = self.ranks()?;
            sent.push(Sent { value, ranks });
        }
        let more_values = self.u32()?;
        let more_ranks = self.ranks()?;
        Disagreement::from_parts(sent, more_values, more_ranks).map_err(|e| self.err(e))
    }

    fn finish(&self) -> Result<(), CoreError> {
        self.inner.end().map_err(|e| self.decode_err(e))
    }
}

/// Smallest possible encoded signature: kind, dtype, ndims, device, op, root, two scales.
const MIN_SIG: usize = 1 + 1 + 4 + 8 + 1 + 4 + 8 + 8;

/// Decode a list of requests.
pub fn decode_requests(bytes: &[u8]) -> Result<Vec<Request>, CoreError> {
    let mut r = Reader::new(bytes, "request list");
    r.header(REQUESTS)?;
    let n = r.count(4 + 4 + MIN_SIG + 8 + 1)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.string()?.into();
        let rank = r.u32()?;
        let sig = r.sig()?;
        let priority = r.i64()?;
        let group = r.group()?;
        out.push(Request {
            name,
            rank,
            sig,
            priority,
            group,
        });
    }
    r.finish()?;
    Ok(out)
}

/// Decode a list of responses.
pub fn decode_responses(bytes: &[u8]) -> Result<Vec<Response>, CoreError> {
    let mut r = Reader::new(bytes, "response list");
    r.header(RESPONSES)?;
    let n = r.count(4 + MIN_SIG + 8 + 1 + 1)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.string()?.into();
        let sig = r.sig()?;
        let priority = r.i64()?;
        let group = r.group()?;
        let error = match r.u8()? {
            0 => None,
            1 => {
                let kc = r.u8()?;
                let kind = CollectiveKind::from_code(kc)
                    .ok_or_else(|| r.err(format!("unknown collective kind {kc}")))?;
                let fc = r.u8()?;
                let field = MismatchField::from_code(fc)
                    .ok_or_else(|| r.err(format!("unknown mismatch field {fc}")))?;
                let senders = r.disagreement()?;
                Some(NegotiationError::Mismatch {
                    kind,
                    field,
                    senders,
                })
            }
            2 => Some(NegotiationError::Other(r.string()?)),
            t => return Err(r.err(format!("unknown error tag {t}"))),
        };
        out.push(Response {
            name,
            sig,
            priority,
            group,
            error,
        });
    }
    r.finish()?;
    Ok(out)
}

/// Decode a list of (name, number) pairs.
pub fn decode_names(bytes: &[u8]) -> Result<Vec<(String, u64)>, CoreError> {
    let mut r = Reader::new(bytes, "name list");
    r.header(NAMES)?;
    let n = r.count(4 + 8)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.string()?;
        let v = r.u64()?;
        out.push((name, v));
    }
    r.finish()?;
    Ok(out)
}

#[cfg(test)]
mod tests;
