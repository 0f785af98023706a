//! Reading each run's result (rank 0's JSON summary) and the table of img/s per system.

/// The total img/s of rank 0's JSON summary in `output` (its last `{"benchmark"` line; a
/// launcher's tag before it is ignored) and the number of ranks it counts.
pub(crate) fn summary(output: &str) -> Option<(f64, usize)> {
    let line = output
        .lines()
        .rev()
        .find_map(|l| l.find("{\"benchmark\"").map(|at| &l[at..]))?;
    let ranks = number_after(line, "\"ranks\":")?;
    Some((number_after(line, "\"img_sec_total\":")?, ranks as usize))
}

/// The number after `key` in `line`.
fn number_after(line: &str, key: &str) -> Option<f64> {
    let at = line.find(key)? + key.len();
    let num: String = line[at..]
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '-' | '+'))
        .collect();
    num.parse().ok()
}

/// The median of `xs` (the mean of the middle two for an even count), `None` when empty.
pub(crate) fn median(xs: &[f64]) -> Option<f64> {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// How one system fared: its runs' img/s, or why it was skipped.
pub(crate) struct Row {
    pub name: String,
    pub runs: Vec<Result<f64, String>>,
    pub skipped: Option<String>,
}

/// The table: per system the median total img/s over its successful runs, the range, and how
/// many of the rounds succeeded.
pub(crate) fn table(rows: &[Row], rounds: usize) -> String {
    let mut t =
        String::from("| system | img/s (median) | min-max | runs ok |\n|---|---|---|---|\n");
    for r in rows {
        if let Some(why) = &r.skipped {
            t += &format!("| {} | skipped: {why} | | |\n", r.name);
            continue;
        }
        let ok: Vec<f64> = r
            .runs
            .iter()
            .filter_map(|x| x.as_ref().ok().copied())
            .collect();
        let (lo, hi) = ok
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &x| {
                (l.min(x), h.max(x))
            });
        match median(&ok) {
            Some(m) => {
                t += &format!(
                    "| {} | {m:.2} | {lo:.2}-{hi:.2} | {}/{rounds} |\n",
                    r.name,
                    ok.len()
                )
            }
            None => t += &format!("| {} | failed | | 0/{rounds} |\n", r.name),
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::{median, summary, table, Row};

    #[test]
    fn rank_zeros_summary_is_read_behind_a_tag() {
        let out = "Iter #0: 3.0 img/sec per rank\n\
                   [0]<stdout>:{\"benchmark\": \"pytorch_synthetic\", \"img_sec_total\": 12.5, \
                   \"img_sec_total_conf\": 1.0}\n";
        assert_eq!(summary(out), None, "no rank count");
        let out = out.replace("\"img_sec_total\"", "\"ranks\": 4, \"img_sec_total\"");
        assert_eq!(summary(&out), Some((12.5, 4)));
        assert_eq!(
            summary("{\"benchmark\": 1, \"ranks\": 1, \"img_sec_total\": 3e-1}"),
            Some((0.3, 1))
        );
        assert_eq!(summary("Total img/sec on 4 rank(s): 9.0"), None);
    }

    #[test]
    fn the_table_gives_median_and_range() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        let rows = [
            Row {
                name: "a".into(),
                runs: vec![Ok(10.0), Ok(30.0), Ok(20.0), Err("x".into())],
                skipped: None,
            },
            Row {
                name: "b".into(),
                runs: vec![],
                skipped: Some("no Horovod".into()),
            },
            Row {
                name: "c".into(),
                runs: vec![Err("y".into())],
                skipped: None,
            },
        ];
        let t = table(&rows, 4);
        assert!(t.contains("| a | 20.00 | 10.00-30.00 | 3/4 |"), "{t}");
        assert!(t.contains("| b | skipped: no Horovod |"), "{t}");
        assert!(t.contains("| c | failed | | 0/4 |"), "{t}");
    }
}
