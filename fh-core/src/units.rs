//! Sizes as people write them: the one parser of byte sizes (`64MiB`, `1G`, `4096`) behind every
//! configuration variable, command-line flag and bench option that takes one.

/// Parse a byte size: an integer with an optional suffix `B`, `K`/`KB`/`KiB`, `M`/`MB`/`MiB` or
/// `G`/`GB`/`GiB` (case-insensitive; every multiple is binary). The error says what is accepted.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let mult: u64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => 0,
    };
    num.parse::<u64>()
        .ok()
        .filter(|_| mult > 0)
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            format!(
                "'{text}' is not a byte size; accepted: an integer with an optional suffix K, M \
                 or G (e.g. 67108864, 64MiB)"
            )
        })
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_with_and_without_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size(" 64MiB "), Ok(64 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("8 K"), Ok(8 << 10));
        assert_eq!(parse_size("3B"), Ok(3));
        for bad in ["", "M", "12X", "-1", "1.5M", "99999999999999999999G"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
