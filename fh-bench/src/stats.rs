//! Figures with units: a median with its min and max over repeats.

use serde::{Deserialize, Serialize};

/// A measured (or modelled) figure over several repeats, with its unit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Quantity {
    /// Median over the repeats.
    pub median: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
    /// Number of repeats.
    pub n: usize,
    /// Unit (`us`, `ms`, `GB/s`, `B`, `1/s`, ...).
    pub unit: String,
}

impl Quantity {
    /// Summarises `samples` (unsorted). An empty slice gives NaNs and `n = 0`.
    pub fn from_samples(samples: &[f64], unit: &str) -> Self {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = match n {
            0 => f64::NAN,
            _ if n % 2 == 1 => v[n / 2],
            _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        };
        Quantity {
            median,
            min: v.first().copied().unwrap_or(f64::NAN),
            max: v.last().copied().unwrap_or(f64::NAN),
            n,
            unit: unit.to_string(),
        }
    }

    /// A single exact value (a model's output).
    pub fn exact(value: f64, unit: &str) -> Self {
        Quantity {
            median: value,
            min: value,
            max: value,
            n: 1,
            unit: unit.to_string(),
        }
    }

    /// The same figure in another unit: every value multiplied by `factor`.
    pub fn scaled(&self, factor: f64, unit: &str) -> Self {
        let (a, b) = (self.min * factor, self.max * factor);
        Quantity {
            median: self.median * factor,
            min: a.min(b),
            max: a.max(b),
            n: self.n,
            unit: unit.to_string(),
        }
    }

    /// `median [min–max] unit`, with `digits` decimals.
    pub fn display(&self, digits: usize) -> String {
        if self.n <= 1 || self.min == self.max {
            format!("{:.*} {}", digits, self.median, self.unit)
        } else {
            format!(
                "{:.*} [{:.*}–{:.*}] {}",
                digits, self.median, digits, self.min, digits, self.max, self.unit
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_min_max() {
        let q = Quantity::from_samples(&[3.0, 1.0, 2.0], "ms");
        assert_eq!((q.median, q.min, q.max, q.n), (2.0, 1.0, 3.0, 3));
        let q = Quantity::from_samples(&[4.0, 1.0, 2.0, 10.0], "ms");
        assert_eq!(q.median, 3.0);
        assert!(Quantity::from_samples(&[], "ms").median.is_nan());
        assert_eq!(q.scaled(1000.0, "us").max, 10000.0);
        assert_eq!(q.display(1), "3.0 [1.0–10.0] ms");
    }
}
