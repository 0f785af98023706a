//! Negotiation messages: what a rank asks for ([`Request`]) and what the ranks agreed on
//! ([`Response`]), plus the validation that turns a full set of requests into a response.
//!
//! These are plain data; [`crate::wire`] encodes them for the network.

use std::fmt;
use std::sync::Arc;

use crate::mismatch::Disagreement;
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

/// A field on which ranks disagreed. Validation checks them in this order (that of
/// [`MismatchField::ALL`]) and reports the first on which not every rank agrees.
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
    /// Every field, in the order validation checks them (and wire order).
    pub const ALL: [MismatchField; 9] = [
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
    /// Ranks submitted the name with different values of one field: the first field, in the
    /// order of [`MismatchField`], on which not every rank agrees.
    Mismatch {
        /// The collective (as submitted by the lowest rank).
        kind: CollectiveKind,
        /// What differed.
        field: MismatchField,
        /// Which ranks sent which value of that field.
        senders: Disagreement,
    },
    /// Any other reason (e.g. an unsupported combination).
    Other(String),
}

impl NegotiationError {
    /// The same error with every rank `r` it names renamed `f(r)` (a process set's engine
    /// numbers its members `0..n`; its errors name world ranks).
    pub fn map_ranks(&self, f: impl FnMut(u32) -> u32) -> NegotiationError {
        match self {
            NegotiationError::Mismatch {
                kind,
                field,
                senders,
            } => NegotiationError::Mismatch {
                kind: *kind,
                field: *field,
                senders: senders.map_ranks(f),
            },
            NegotiationError::Other(s) => NegotiationError::Other(s.clone()),
        }
    }
}

impl fmt::Display for NegotiationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NegotiationError::Mismatch {
                kind,
                field,
                senders,
            } => write!(f, "Mismatched {kind} {}: {senders}", field.describe()),
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

/// A shape as the ranks see it: `[17, 17]`; for allgather and alltoall, whose first
/// dimension may differ per rank, that dimension reads `*` (`[*, 4]`).
fn render_shape(kind: CollectiveKind, shape: &[u64]) -> String {
    let free_first = matches!(kind, CollectiveKind::Allgather | CollectiveKind::Alltoall);
    let parts: Vec<String> = shape
        .iter()
        .enumerate()
        .map(|(i, d)| {
            if i == 0 && free_first {
                "*".to_string()
            } else {
                d.to_string()
            }
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// A scale factor, distinct for distinct bit patterns (`1.0`, `-0.0`, `NaN`, and a NaN
/// other than the usual one with its bits).
fn render_scale(x: f64) -> String {
    if x.is_nan() && x.to_bits() != f64::NAN.to_bits() {
        format!("NaN(0x{:016x})", x.to_bits())
    } else {
        format!("{x:?}")
    }
}

fn render_group(g: Option<&GroupTag>) -> String {
    match g {
        Some(g) => format!("member {} of {} in group '{}'", g.index, g.size, g.name),
        None => "no group".into(),
    }
}

impl MismatchField {
    /// Whether two requests agree on this field (shapes by the rule of `a`'s kind: for
    /// allgather and alltoall the first dimension may differ; scale factors bit for bit).
    pub fn agree(self, a: &Request, b: &Request) -> bool {
        let (x, y) = (&a.sig, &b.sig);
        match self {
            MismatchField::Kind => x.kind == y.kind,
            MismatchField::DType => x.dtype == y.dtype,
            MismatchField::Shape => match x.kind {
                CollectiveKind::Allgather | CollectiveKind::Alltoall => {
                    x.shape.len() == y.shape.len()
                        && x.shape.get(1..).unwrap_or(&[]) == y.shape.get(1..).unwrap_or(&[])
                }
                _ => x.shape == y.shape,
            },
            MismatchField::Op => x.op == y.op,
            MismatchField::Root => x.root == y.root,
            MismatchField::Device => x.device == y.device,
            MismatchField::Prescale => x.prescale.to_bits() == y.prescale.to_bits(),
            MismatchField::Postscale => x.postscale.to_bits() == y.postscale.to_bits(),
            MismatchField::Group => a.group == b.group,
        }
    }

    /// The request's value of this field as error messages show it. Two requests whose
    /// earlier fields agree render the same exactly when they [`agree`](Self::agree) on this
    /// one (shapes of allgather and alltoall show their first dimension as `*`).
    pub fn render(self, r: &Request) -> String {
        let s = &r.sig;
        match self {
            MismatchField::Kind => s.kind.to_string(),
            MismatchField::DType => s.dtype.to_string(),
            MismatchField::Shape => render_shape(s.kind, &s.shape),
            MismatchField::Op => s.op.to_string(),
            MismatchField::Root => s.root.to_string(),
            MismatchField::Device => s.device.to_string(),
            MismatchField::Prescale => render_scale(s.prescale),
            MismatchField::Postscale => render_scale(s.postscale),
            MismatchField::Group => render_group(r.group.as_ref()),
        }
    }
}

/// The first field, in the order of [`MismatchField`], on which two requests for one name
/// disagree (signature fields, then group membership); `None` when they are compatible.
pub fn compare(a: &Request, b: &Request) -> Option<MismatchField> {
    MismatchField::ALL.into_iter().find(|f| !f.agree(a, b))
}

/// Turn the requests of every rank for one name into a response. When the ranks disagree, the
/// response carries an error for the first field, in the order of [`MismatchField`], on which
/// not every rank agrees, naming the ranks that sent each value of it. `requests` must not be
/// empty (`None` otherwise); the outcome does not depend on their order, so every coordinator
/// decides the same.
pub fn validate(requests: &[Request]) -> Option<Response> {
    let mut sorted: Vec<&Request> = requests.iter().collect();
    sorted.sort_by_key(|r| r.rank);
    let first = *sorted.first()?;
    // The first field some rank disagrees with the lowest rank on is the first field on
    // which not every rank agrees.
    let field = sorted
        .iter()
        .skip(1)
        .filter_map(|r| compare(first, r))
        .min_by_key(|f| f.code());
    let error = field.map(|field| NegotiationError::Mismatch {
        kind: first.sig.kind,
        field,
        senders: Disagreement::tally(sorted.iter().map(|r| (r.rank, field.render(r)))),
    });
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

    fn error(reqs: &[Request]) -> String {
        validate(reqs).unwrap().error.unwrap().to_string()
    }

    #[test]
    fn shape_mismatch_names_the_ranks_on_each_side() {
        assert_eq!(
            error(&[req(1, sig(&[18, 18])), req(0, sig(&[17, 17]))]),
            "Mismatched allreduce tensor shapes: rank 0 sent [17, 17]; rank 1 sent [18, 18]"
        );
        assert_eq!(
            error(&[
                req(2, sig(&[1000])),
                req(1, sig(&[1001])),
                req(0, sig(&[1000]))
            ]),
            "Mismatched allreduce tensor shapes: rank 1 sent [1001]; ranks 0 and 2 sent [1000]"
        );
    }

    #[test]
    fn the_first_field_in_check_order_is_reported_whatever_the_rank_order() {
        // Rank 1 differs in the op, rank 2 in the dtype (checked earlier): dtype is reported.
        let mut op = sig(&[2]);
        op.op = ReduceOp::Max;
        let mut dt = sig(&[2]);
        dt.dtype = DType::F64;
        let reqs = [req(0, sig(&[2])), req(1, op), req(2, dt)];
        let want = "Mismatched allreduce data types: rank 2 sent f64; ranks 0 and 1 sent f32";
        assert_eq!(error(&reqs), want);
        let mut rev = reqs.clone();
        rev.reverse();
        assert_eq!(error(&rev), want);
    }

    #[test]
    fn allgather_first_dim_may_differ_and_shows_as_a_star() {
        let mut a = req(0, sig(&[3, 4]));
        a.sig.kind = CollectiveKind::Allgather;
        let mut b = a.clone();
        b.rank = 1;
        b.sig.shape = vec![5, 4];
        assert_eq!(compare(&a, &b), None);
        let mut c = b.clone();
        c.rank = 2;
        c.sig.shape = vec![5, 5];
        assert_eq!(compare(&a, &c), Some(MismatchField::Shape));
        assert_eq!(
            error(&[a, b, c]),
            "Mismatched allgather tensor shapes: rank 2 sent [*, 5]; ranks 0 and 1 sent [*, 4]"
        );
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
        assert_eq!(
            error(&[a.clone(), b]),
            "Mismatched allreduce group memberships: rank 0 sent member 0 of 3 in group 'g'; \
             rank 1 sent member 0 of 2 in group 'g'"
        );
        let e = error(&[a.clone(), req(1, sig(&[2]))]);
        assert!(e.ends_with("rank 1 sent no group"), "{e}");
        assert!(validate(&[a.clone(), Request { rank: 1, ..a }])
            .unwrap()
            .error
            .is_none());
    }

    #[test]
    fn every_field_has_its_message() {
        type Edit = fn(&mut Request);
        let cases: [(MismatchField, Edit, &str); 9] = [
            (
                MismatchField::Kind,
                |r| r.sig.kind = CollectiveKind::Broadcast,
                "operations: rank 1 sent broadcast; ranks 0 and 2 sent allreduce",
            ),
            (
                MismatchField::DType,
                |r| r.sig.dtype = DType::I32,
                "data types: rank 1 sent i32; ranks 0 and 2 sent f32",
            ),
            (
                MismatchField::Shape,
                |r| r.sig.shape = vec![3],
                "tensor shapes: rank 1 sent [3]; ranks 0 and 2 sent [2]",
            ),
            (
                MismatchField::Op,
                |r| r.sig.op = ReduceOp::Min,
                "reduce ops: rank 1 sent min; ranks 0 and 2 sent sum",
            ),
            (
                MismatchField::Root,
                |r| r.sig.root = 1,
                "root ranks: rank 1 sent 1; ranks 0 and 2 sent 0",
            ),
            (
                MismatchField::Device,
                |r| r.sig.device = Device::Gpu(1),
                "devices: rank 1 sent gpu:1; ranks 0 and 2 sent cpu",
            ),
            (
                MismatchField::Prescale,
                |r| r.sig.prescale = 0.5,
                "prescale factors: rank 1 sent 0.5; ranks 0 and 2 sent 1.0",
            ),
            (
                MismatchField::Postscale,
                |r| r.sig.postscale = f64::NAN,
                "postscale factors: rank 1 sent NaN; ranks 0 and 2 sent 1.0",
            ),
            (
                MismatchField::Group,
                |r| {
                    r.group = Some(GroupTag {
                        name: "g".into(),
                        index: 1,
                        size: 2,
                    })
                },
                "group memberships: rank 1 sent member 1 of 2 in group 'g'; ranks 0 and 2 \
                 sent no group",
            ),
        ];
        for (field, edit, want) in cases {
            let mut odd = req(1, sig(&[2]));
            edit(&mut odd);
            let reqs = [req(0, sig(&[2])), odd, req(2, sig(&[2]))];
            let e = validate(&reqs).unwrap().error.unwrap();
            assert!(
                matches!(e, NegotiationError::Mismatch { field: f, .. } if f == field),
                "{e}"
            );
            assert!(e.to_string().ends_with(want), "{field:?}: {e}");
        }
    }

    #[test]
    fn scale_factors_differing_only_in_bits_are_told_apart() {
        let mut a = req(1, sig(&[1]));
        a.sig.prescale = f64::from_bits(f64::NAN.to_bits() | 1);
        let mut b = req(2, sig(&[1]));
        b.sig.prescale = -0.0;
        let mut c = req(0, sig(&[1]));
        c.sig.prescale = f64::NAN;
        let e = error(&[a, b, c]);
        assert!(
            e.contains("rank 0 sent NaN;")
                && e.contains("rank 1 sent NaN(0x7ff8000000000001)")
                && e.contains("rank 2 sent -0.0"),
            "{e}"
        );
    }

    #[test]
    fn errors_rename_their_ranks() {
        let e = validate(&[req(0, sig(&[1])), req(1, sig(&[2])), req(2, sig(&[1]))])
            .unwrap()
            .error
            .unwrap();
        let world = [3u32, 5, 9];
        assert_eq!(
            e.map_ranks(|r| world[r as usize]).to_string(),
            "Mismatched allreduce tensor shapes: rank 5 sent [2]; ranks 3 and 9 sent [1]"
        );
        let other = NegotiationError::Other("x".into());
        assert_eq!(other.map_ranks(|r| r + 1), other);
    }
}
