//! Who sent what when ranks disagree on a tensor: a compact set of ranks ([`RankSet`]) and the
//! ranks grouped by the value they sent ([`Disagreement`]), rendered the same way on every
//! rank, e.g. `rank 1 sent [1001]; ranks 0 and 2 sent [1000]`.

use std::collections::BTreeMap;
use std::fmt;

/// A set of ranks, kept as ascending runs of consecutive ranks (so a thousand ranks that agree
/// cost one run).
///
/// Displayed as a phrase: `rank 1`, `ranks 0 and 2`, `ranks 0, 2 and 5`, runs of three or more
/// as ranges (`ranks 0-7 and 9`), and at most [`RankSet::MAX_ITEMS`] items followed by how many
/// ranks were left out (`ranks 0, 2, ..., 28 and 485 more`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct RankSet {
    /// Inclusive `(first, last)` runs: ascending, non-empty, with a gap between neighbours.
    runs: Vec<(u32, u32)>,
}

impl RankSet {
    /// The most items (single ranks or ranges) a displayed set names before it says how many
    /// more ranks there are.
    pub const MAX_ITEMS: usize = 16;

    /// The empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// The set of `ranks` (any order; repeats count once).
    pub fn from_ranks(ranks: impl IntoIterator<Item = u32>) -> Self {
        let mut v: Vec<u32> = ranks.into_iter().collect();
        v.sort_unstable();
        v.dedup();
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for r in v {
            match runs.last_mut() {
                Some((_, last)) if last.checked_add(1) == Some(r) => *last = r,
                _ => runs.push((r, r)),
            }
        }
        RankSet { runs }
    }

    /// The set made of the inclusive `(first, last)` runs, which must be in canonical form:
    /// ascending, each `first <= last`, and a gap of at least one rank between neighbours (the
    /// form [`RankSet::runs`] returns). Anything else is an error saying what is wrong; used
    /// by decoders of untrusted input.
    pub fn from_runs(runs: Vec<(u32, u32)>) -> Result<Self, String> {
        for (i, &(a, b)) in runs.iter().enumerate() {
            if a > b {
                return Err(format!("rank run {a}-{b} is reversed"));
            }
            if let Some(&(_, prev)) = i.checked_sub(1).and_then(|j| runs.get(j)) {
                if u64::from(a) <= u64::from(prev) + 1 {
                    return Err(format!(
                        "rank run {a}-{b} does not start after the previous run's end {prev} \
                         with a gap"
                    ));
                }
            }
        }
        Ok(RankSet { runs })
    }

    /// The inclusive `(first, last)` runs of consecutive ranks, ascending.
    pub fn runs(&self) -> &[(u32, u32)] {
        &self.runs
    }

    /// Number of ranks in the set.
    pub fn len(&self) -> u64 {
        self.runs.iter().map(|&(a, b)| u64::from(b - a) + 1).sum()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// The lowest rank, if any.
    pub fn first(&self) -> Option<u32> {
        self.runs.first().map(|&(a, _)| a)
    }

    /// Whether `rank` is in the set.
    pub fn contains(&self, rank: u32) -> bool {
        // The last run starting at or before `rank`.
        let i = self.runs.partition_point(|&(a, _)| a <= rank);
        i > 0 && self.runs[i - 1].1 >= rank
    }

    /// The ranks, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.runs.iter().flat_map(|&(a, b)| a..=b)
    }

    /// The set of `f(r)` for every rank `r` (e.g. a process set's ranks renumbered as world
    /// ranks).
    pub fn map(&self, f: impl FnMut(u32) -> u32) -> RankSet {
        RankSet::from_ranks(self.iter().map(f))
    }

    /// Whether the two sets share a rank.
    pub fn intersects(&self, other: &RankSet) -> bool {
        let (mut i, mut j) = (0, 0);
        while let (Some(&(a, b)), Some(&(c, d))) = (self.runs.get(i), other.runs.get(j)) {
            if b < c {
                i += 1;
            } else if d < a {
                j += 1;
            } else {
                return true;
            }
        }
        false
    }
}

impl FromIterator<u32> for RankSet {
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        RankSet::from_ranks(iter)
    }
}

impl fmt::Display for RankSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Items: single ranks, and ranges for runs of three or more (a run of two reads better
        // as two ranks).
        let mut items: Vec<(u32, u32)> = Vec::new();
        for &(a, b) in &self.runs {
            if b - a == 1 {
                items.push((a, a));
                items.push((b, b));
            } else {
                items.push((a, b));
            }
        }
        let item = |&(a, b): &(u32, u32)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        };
        match items.as_slice() {
            [] => f.write_str("no ranks"),
            [(a, b)] if a == b => write!(f, "rank {a}"),
            _ if items.len() > Self::MAX_ITEMS => {
                let shown = &items[..Self::MAX_ITEMS - 1];
                let named: u64 = shown.iter().map(|&(a, b)| u64::from(b - a) + 1).sum();
                let list: Vec<String> = shown.iter().map(item).collect();
                write!(
                    f,
                    "ranks {} and {} more",
                    list.join(", "),
                    self.len() - named
                )
            }
            [init @ .., last] => {
                let list: Vec<String> = init.iter().map(item).collect();
                if list.is_empty() {
                    write!(f, "ranks {}", item(last))
                } else {
                    write!(f, "ranks {} and {}", list.join(", "), item(last))
                }
            }
        }
    }
}

/// The ranks that sent one value.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Sent {
    /// The value, rendered (shortened to [`Disagreement::MAX_VALUE`] bytes).
    pub value: String,
    /// The ranks that sent it.
    pub ranks: RankSet,
}

/// Every rank's value of one field, grouped by value: the ranks that sent each distinct value,
/// ordered fewest ranks first (ties: lowest rank first), so the odd ones out come first and
/// the most common value last. At most [`Disagreement::MAX_SHOWN`] values are kept; the rest
/// are counted, with their ranks.
///
/// Displayed as `rank 1 sent [1001]; ranks 0 and 2 sent [1000]`, with `; and 3 more values
/// from ranks 16-18` at the end when values were left out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Disagreement {
    sent: Vec<Sent>,
    more_values: u32,
    more_ranks: RankSet,
}

impl Disagreement {
    /// The most distinct values kept: the `MAX_SHOWN - 1` sent by the fewest ranks and the
    /// most common one.
    pub const MAX_SHOWN: usize = 16;
    /// The longest rendered value kept, in bytes; longer ones are cut (at a character
    /// boundary) and end in `...`.
    pub const MAX_VALUE: usize = 256;

    /// Group `(rank, value)` pairs by value. Each rank should appear once; a rank given
    /// again is counted with its first value.
    pub fn tally<V: Into<String>>(values: impl IntoIterator<Item = (u32, V)>) -> Self {
        let mut by_rank: BTreeMap<u32, String> = BTreeMap::new();
        for (rank, value) in values {
            by_rank.entry(rank).or_insert_with(|| value.into());
        }
        let mut by_value: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for (rank, value) in by_rank {
            by_value.entry(value).or_default().push(rank);
        }
        let groups = by_value
            .into_iter()
            .map(|(value, ranks)| Sent {
                value: shorten(value),
                ranks: RankSet::from_ranks(ranks),
            })
            .collect();
        Self::from_groups(groups)
    }

    /// Order the groups and keep at most [`Self::MAX_SHOWN`] of them.
    fn from_groups(mut groups: Vec<Sent>) -> Self {
        groups.sort_by_key(|s| (s.ranks.len(), s.ranks.first()));
        let mut more_values = 0u32;
        let mut more_ranks = RankSet::new();
        if groups.len() > Self::MAX_SHOWN {
            let last = groups.pop();
            let hidden = groups.split_off(Self::MAX_SHOWN - 1);
            more_values = hidden.len() as u32;
            more_ranks = hidden.iter().flat_map(|s| s.ranks.iter()).collect();
            groups.extend(last);
        }
        Disagreement {
            sent: groups,
            more_values,
            more_ranks,
        }
    }

    /// A disagreement from its parts, checked: at most [`Self::MAX_SHOWN`] values, each sent
    /// by some rank and at most [`Self::MAX_VALUE`] bytes long, no rank in two places, and values left out (`more_values`) exactly when
    /// `more_ranks` has ranks, no more of them than ranks, and only once `MAX_SHOWN` values
    /// are shown. Used by decoders of untrusted input; the error says what is wrong.
    pub fn from_parts(
        sent: Vec<Sent>,
        more_values: u32,
        more_ranks: RankSet,
    ) -> Result<Self, String> {
        if sent.len() > Self::MAX_SHOWN {
            return Err(format!(
                "{} values shown, at most {} allowed",
                sent.len(),
                Self::MAX_SHOWN
            ));
        }
        if sent.iter().any(|s| s.ranks.is_empty()) {
            return Err("a value sent by no rank".into());
        }
        if let Some(s) = sent.iter().find(|s| s.value.len() > Self::MAX_VALUE) {
            return Err(format!(
                "a value of {} bytes, at most {} allowed",
                s.value.len(),
                Self::MAX_VALUE
            ));
        }
        if (more_values == 0) != more_ranks.is_empty() {
            return Err(format!(
                "{more_values} more values from {} ranks",
                more_ranks.len()
            ));
        }
        if u64::from(more_values) > more_ranks.len() {
            return Err(format!(
                "{more_values} more values from only {} ranks",
                more_ranks.len()
            ));
        }
        if more_values > 0 && sent.len() < Self::MAX_SHOWN {
            return Err(format!(
                "values left out while only {} are shown",
                sent.len()
            ));
        }
        let sets: Vec<&RankSet> = sent
            .iter()
            .map(|s| &s.ranks)
            .chain(std::iter::once(&more_ranks))
            .collect();
        for (i, a) in sets.iter().enumerate() {
            if sets[i + 1..].iter().any(|b| a.intersects(b)) {
                return Err(format!("{a} appear with two values"));
            }
        }
        Ok(Disagreement {
            sent,
            more_values,
            more_ranks,
        })
    }

    /// The values kept and the ranks that sent each, fewest ranks first.
    pub fn sent(&self) -> &[Sent] {
        &self.sent
    }

    /// How many distinct values were left out (beyond [`Self::MAX_SHOWN`]).
    pub fn more_values(&self) -> u32 {
        self.more_values
    }

    /// The ranks that sent the values left out.
    pub fn more_ranks(&self) -> &RankSet {
        &self.more_ranks
    }

    /// Whether the ranks sent more than one distinct value.
    pub fn disagrees(&self) -> bool {
        self.sent.len() + self.more_values as usize > 1
    }

    /// The value `rank` sent, if it is among those kept.
    pub fn value_of(&self, rank: u32) -> Option<&str> {
        self.sent
            .iter()
            .find(|s| s.ranks.contains(rank))
            .map(|s| s.value.as_str())
    }

    /// The same disagreement with every rank `r` renamed `f(r)` (e.g. a process set's ranks
    /// as world ranks), reordered for the new names. `f` should be one-to-one.
    pub fn map_ranks(&self, mut f: impl FnMut(u32) -> u32) -> Disagreement {
        let groups: Vec<Sent> = self
            .sent
            .iter()
            .map(|s| Sent {
                value: s.value.clone(),
                ranks: s.ranks.map(&mut f),
            })
            .collect();
        let more_values = self.more_values;
        let more_ranks = self.more_ranks.map(&mut f);
        // Keep which values are shown: reorder the shown ones, the most common still last.
        let mut d = Self::from_groups(groups);
        d.more_values = more_values;
        d.more_ranks = more_ranks;
        d
    }
}

impl fmt::Display for Disagreement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.sent.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{} sent {}", s.ranks, s.value)?;
        }
        if self.more_values > 0 {
            let plural = if self.more_values == 1 { "" } else { "s" };
            write!(
                f,
                "; and {} more value{plural} from {}",
                self.more_values, self.more_ranks
            )?;
        }
        Ok(())
    }
}

/// `value` cut to at most [`Disagreement::MAX_VALUE`] bytes (at a character boundary).
fn shorten(mut value: String) -> String {
    if value.len() <= Disagreement::MAX_VALUE {
        return value;
    }
    let mut end = Disagreement::MAX_VALUE - 3;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    value.truncate(end);
    value.push_str("...");
    value
}
