//! Negotiation messages: what a rank asks for ([`Request`]) and what the ranks agreed on
//! ([`Response`]), plus the validation that turns a full set of requests into a response.
//!
//! These are plain data; [`crate::wire`] encodes them for the network.

use std::fmt;
use std::sync::Arc;

use crate::{DType, ReduceOp};

/// The kind of collective a named tensor takes part in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum CollectiveKind {
    /// Element-wise reduction, result on every rank.
    Allreduce = 0,
    /// Concatenation along the first dimension (which may differ per rank).
    Allgather = 1,
    /// Copy of the root's tensor to every rank.
    Broadcast = 2,
    /// Personalised exchange of first-dimension slices.
    Alltoall = 3,
    /// Reduction whose result is split along the first dimension across the ranks.
    ReduceScatter = 4,
    /// Synchronisation only.
    Barrier = 5,
    /// A rank has run out of data; see the engine's join.
    Join = 6,
}

impl CollectiveKind {
    /// Every kind, in wire order.
    pub const ALL: [CollectiveKind; 7] = [
        CollectiveKind::Allreduce,
        CollectiveKind::Allgather,
        CollectiveKind::Broadcast,
        CollectiveKind::Alltoall,
        CollectiveKind::ReduceScatter,
        CollectiveKind::Barrier,
        CollectiveKind::Join,
    ];

    /// Lower-case name, as used in error messages.
    pub const fn name(self) -> &'static str {
        match self {
            CollectiveKind::Allreduce => "allreduce",
            CollectiveKind::Allgather => "allgather",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Alltoall => "alltoall",
            CollectiveKind::ReduceScatter => "reducescatter",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::Join => "join",
        }
    }

    /// The wire code.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The kind with the given wire code, if any.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(code as usize).copied()
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// A GPU, by its ordinal on the host.
    Gpu(u32),
}

impl Device {
    /// Wire form: `-1` for the CPU, the ordinal for a GPU.
    pub const fn code(self) -> i64 {
        match self {
            Device::Cpu => -1,
            Device::Gpu(i) => i as i64,
        }
    }

    /// The device with the given wire code, if valid.
    pub fn from_code(code: i64) -> Option<Self> {
        match code {
            -1 => Some(Device::Cpu),
            c if (0..=u32::MAX as i64).contains(&c) => Some(Device::Gpu(c as u32)),
            _ => None,
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Gpu(i) => write!(f, "gpu:{i}"),
        }
    }
}

/// The part of a request that must agree across ranks and that the response cache keys on.
#[derive(Debug, Clone, PartialEq)]
pub struct Signature {
    /// The collective.
    pub kind: CollectiveKind,
    /// Element type.
    pub dtype: DType,
    /// Shape (for allgather and alltoall only the dimensions after the first must agree).
    pub shape: Vec<u64>,
    /// Where the tensor lives.
    pub device: Device,
    /// Reduction operator (allreduce, reduce-scatter; `Sum` otherwise).
    pub op: ReduceOp,
    /// Root rank (broadcast; 0 otherwise).
    pub root: u32,
    /// Factor applied to every input before the reduction.
    pub prescale: f64,
    /// Factor applied to the result after the reduction.
    pub postscale: f64,
}

impl Signature {
    /// Number of elements described by the shape (saturating).
    pub fn elements(&self) -> u64 {
        self.shape.iter().fold(1u64, |a, &d| a.saturating_mul(d))
    }

    /// Size in bytes of the tensor (saturating).
    pub fn bytes(&self) -> u64 {
        self.elements().saturating_mul(self.dtype.size() as u64)
    }

    /// Whether two signatures describe the same negotiation outcome; scale factors compare
    /// bit for bit so that the result is the same on every rank.
    pub fn same_as(&self, other: &Signature) -> bool {
        self.kind == other.kind
            && self.dtype == other.dtype
            && self.shape == other.shape
            && self.device == other.device
            && self.op == other.op
            && self.root == other.root
            && self.prescale.to_bits() == other.prescale.to_bits()
            && self.postscale.to_bits() == other.postscale.to_bits()
    }
}

/// Membership of a grouped submission: the members are released together, once all are ready,
/// and fused into one collective when they fit.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupTag {
    /// The group's name.
    pub name: String,
    /// This member's index, `0..size`.
    pub index: u32,
    /// Number of members.
    pub size: u32,
}

/// One rank's announcement that a named tensor is ready locally.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The tensor's name, unique among the rank's in-flight operations. Shared (`Arc<str>`):
    /// the engine keeps the name in several places per step, each a reference count.
    pub name: Arc<str>,
    /// The submitting rank.
    pub rank: u32,
    /// What must agree across ranks.
    pub sig: Signature,
    /// Caller-supplied priority (lower goes first under forward priority ordering).
    pub priority: i64,
    /// Set for the members of a grouped submission.
    pub group: Option<GroupTag>,
}

/// A field on which ranks disagreed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MismatchField {
    /// The collective kind.
    Kind = 0,
    /// The element type.
    DType = 1,
    /// The shape.
    Shape = 2,
    /// The reduce operator.
    Op = 3,
    /// The root rank.
    Root = 4,
    /// The device.
    Device = 5,
    /// The prescale factor.
    Prescale = 6,
    /// The postscale factor.
    Postscale = 7,
    /// Membership of a grouped submission (group name, member index, member count).
    Group = 8,
}

impl MismatchField {
    const ALL: [MismatchField; 9] = [
        MismatchField::Kind,
        MismatchField::DType,
        MismatchField::Shape,
        MismatchField::Op,
        MismatchField::Root,
        MismatchField::Device,
        MismatchField::Prescale,
        MismatchField::Postscale,
        MismatchField::Group,
    ];

    /// The words used in error messages (`"tensor shapes"`, `"data types"`, ...).
    pub const fn describe(self) -> &'static str {
        match self {
            MismatchField::Kind => "operations",
            MismatchField::DType => "data types",
            MismatchField::Shape => "tensor shapes",
            MismatchField::Op => "reduce ops",
            MismatchField::Root => "root ranks",
            MismatchField::Device => "devices",
            MismatchField::Prescale => "prescale factors",
            MismatchField::Postscale => "postscale factors",
            MismatchField::Group => "group memberships",
        }
    }

    /// The wire code.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The field with the given wire code, if any.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(code as usize).copied()
    }
}

/// Why a name could not be negotiated. The same value reaches every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NegotiationError {
    /// Two ranks submitted the name with different values of one field.
    Mismatch {
        /// The collective (as submitted by the lowest rank).
        kind: CollectiveKind,
        /// What differed.
        field: MismatchField,
        /// The value one rank sent (rendered).
        first: String,
        /// The value another rank sent (rendered).
        second: String,
    },
    /// Any other reason (e.g. an unsupported combination).
    Other(String),
}

impl fmt::Display for NegotiationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NegotiationError::Mismatch {
                kind,
                field,
                first,
                second,
            } => write!(
                f,
                "Mismatched {kind} {}: one rank sent {first}, another sent {second}",
                field.describe()
            ),
            NegotiationError::Other(s) => f.write_str(s),
        }
    }
}

/// The agreed outcome for one name: identical on every rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    /// The tensor's name (shared, like [`Request::name`]).
    pub name: Arc<str>,
    /// The agreed signature (the lowest rank's, for allgather/alltoall whose first dimension
    /// may differ).
    pub sig: Signature,
    /// The agreed priority (the lowest rank's).
    pub priority: i64,
    /// The group membership (the lowest rank's).
    pub group: Option<GroupTag>,
    /// Set when validation failed: the name fails on every rank with this error.
    pub error: Option<NegotiationError>,
}

fn render_shape(shape: &[u64]) -> String {
    let parts: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!("[{}]", parts.join(", "))
}

fn mismatch(kind: CollectiveKind, field: MismatchField, a: String, b: String) -> NegotiationError {
    NegotiationError::Mismatch {
        kind,
        field,
        first: a,
        second: b,
    }
}

/// Compare two ranks' signatures for one name; `None` when they are compatible.
pub fn compare(a: &Signature, b: &Signature) -> Option<NegotiationError> {
    let k = a.kind;
    if a.kind != b.kind {
        return Some(mismatch(
            k,
            MismatchField::Kind,
            a.kind.to_string(),
            b.kind.to_string(),
        ));
    }
    if a.dtype != b.dtype {
        return Some(mismatch(
            k,
            MismatchField::DType,
            a.dtype.to_string(),
            b.dtype.to_string(),
        ));
    }
    let shapes_agree = match k {
        // The first dimension may differ per rank.
        CollectiveKind::Allgather | CollectiveKind::Alltoall => {
            a.shape.len() == b.shape.len()
                && a.shape.get(1..).unwrap_or(&[]) == b.shape.get(1..).unwrap_or(&[])
        }
        _ => a.shape == b.shape,
    };
    if !shapes_agree {
        return Some(mismatch(
            k,
            MismatchField::Shape,
            render_shape(&a.shape),
            render_shape(&b.shape),
        ));
    }
    if a.op != b.op {
        return Some(mismatch(
            k,
            MismatchField::Op,
            a.op.to_string(),
            b.op.to_string(),
        ));
    }
    if a.root != b.root {
        return Some(mismatch(
            k,
            MismatchField::Root,
            a.root.to_string(),
            b.root.to_string(),
        ));
    }
    if a.device != b.device {
        return Some(mismatch(
            k,
            MismatchField::Device,
            a.device.to_string(),
            b.device.to_string(),
        ));
    }
    if a.prescale.to_bits() != b.prescale.to_bits() {
        return Some(mismatch(
            k,
            MismatchField::Prescale,
            a.prescale.to_string(),
            b.prescale.to_string(),
        ));
    }
    if a.postscale.to_bits() != b.postscale.to_bits() {
        return Some(mismatch(
            k,
            MismatchField::Postscale,
            a.postscale.to_string(),
            b.postscale.to_string(),
        ));
    }
    None
}

fn render_group(g: Option<&GroupTag>) -> String {
    match g {
        Some(g) => format!("member {} of {} in group '{}'", g.index, g.size, g.name),
        None => "no group".into(),
    }
}

/// Compare two ranks' requests for one name: their signatures, then their group membership.
fn compare_requests(a: &Request, b: &Request) -> Option<NegotiationError> {
    compare(&a.sig, &b.sig).or_else(|| {
        (a.group != b.group).then(|| {
            mismatch(
                a.sig.kind,
                MismatchField::Group,
                render_group(a.group.as_ref()),
                render_group(b.group.as_ref()),
            )
        })
    })
}

/// Turn the requests of every rank for one name into a response: the first disagreement
/// (against the lowest rank's request) becomes an error response. `requests` must not be
/// empty; ranks are compared in ascending rank order so every coordinator decides the same.
pub fn validate(requests: &[Request]) -> Option<Response> {
    let mut sorted: Vec<&Request> = requests.iter().collect();
    sorted.sort_by_key(|r| r.rank);
    let first = *sorted.first()?;
    let error = sorted
        .iter()
        .skip(1)
        .find_map(|r| compare_requests(first, r));
    Some(Response {
        name: first.name.clone(),
        sig: first.sig.clone(),
        priority: first.priority,
        group: first.group.clone(),
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(shape: &[u64]) -> Signature {
        Signature {
            kind: CollectiveKind::Allreduce,
            dtype: DType::F32,
            shape: shape.to_vec(),
            device: Device::Cpu,
            op: ReduceOp::Sum,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
        }
    }

    fn req(rank: u32, s: Signature) -> Request {
        Request {
            name: "w".into(),
            rank,
            sig: s,
            priority: 0,
            group: None,
        }
    }

    #[test]
    fn shape_mismatch_message_names_both_values() {
        let r = validate(&[req(1, sig(&[18, 18])), req(0, sig(&[17, 17]))]).unwrap();
        assert_eq!(
            r.error.unwrap().to_string(),
            "Mismatched allreduce tensor shapes: one rank sent [17, 17], another sent [18, 18]"
        );
    }

    #[test]
    fn allgather_first_dim_may_differ() {
        let mut a = sig(&[3, 4]);
        a.kind = CollectiveKind::Allgather;
        let mut b = a.clone();
        b.shape = vec![5, 4];
        assert!(compare(&a, &b).is_none());
        b.shape = vec![5, 5];
        assert!(compare(&a, &b).is_some());
    }

    #[test]
    fn group_membership_must_agree() {
        let mut a = req(0, sig(&[2]));
        a.group = Some(GroupTag {
            name: "g".into(),
            index: 0,
            size: 3,
        });
        let mut b = req(1, sig(&[2]));
        b.group = Some(GroupTag {
            name: "g".into(),
            index: 0,
            size: 2,
        });
        let e = validate(&[a.clone(), b]).unwrap().error.unwrap();
        assert_eq!(
            e.to_string(),
            "Mismatched allreduce group memberships: one rank sent member 0 of 3 in group 'g', \
             another sent member 0 of 2 in group 'g'"
        );
        let e = validate(&[a.clone(), req(1, sig(&[2]))])
            .unwrap()
            .error
            .unwrap();
        assert!(e.to_string().ends_with("another sent no group"), "{e}");
        assert!(validate(&[a.clone(), Request { rank: 1, ..a }])
            .unwrap()
            .error
            .is_none());
    }

    #[test]
    fn dtype_and_op_mismatches() {
        let a = sig(&[2]);
        let mut b = a.clone();
        b.dtype = DType::F64;
        assert_eq!(
            compare(&a, &b).unwrap().to_string(),
            "Mismatched allreduce data types: one rank sent f32, another sent f64"
        );
        let mut c = a.clone();
        c.op = ReduceOp::Max;
        assert!(compare(&a, &c).unwrap().to_string().contains("reduce ops"));
    }
}
