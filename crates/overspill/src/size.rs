//! Byte sizes on the command line: `512K`, `256M`, `1.5G`, `2TiB` (binary units), `4096B`, and
//! `0`. Any other bare number is refused: `--ram 256` meant 256 bytes, silently, where its
//! writer meant 256 MiB.

pub use overspill_storm::report::format_bytes;

pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let value: f64 = number.parse().map_err(|_| format!("{s:?} is not a size like 256M or 8G"))?;
    let unit = unit.trim().to_ascii_uppercase();
    if unit.is_empty() && value != 0.0 {
        return Err(format!("{s:?} has no unit: write {s}M for {s} MiB, {s}G for GiB, or {s}B for bytes"));
    }
    let shift = match unit.trim_end_matches("IB").trim_end_matches('B') {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        other => return Err(format!("unknown size unit {other:?} in {s:?}: use K, M, G or T")),
    };
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("{s:?} is too large"));
    }
    Ok(bytes.round() as u64)
}

/// A VM's operations per second as `serve --limit-iops` and `vm limit --iops` take it:
/// `1000` (a burst of one second's worth) or `1000:5000`.
pub fn parse_ops_rate(s: &str) -> Result<overspill_block::Rate, String> {
    parse_rate(s, |n| n.trim().parse::<u64>().map_err(|_| format!("{n:?} is not a number of operations")))
}

/// A VM's bytes per second: `50M` (a burst of one second's worth) or `50M:200M`.
pub fn parse_bytes_rate(s: &str) -> Result<overspill_block::Rate, String> {
    parse_rate(s, parse_bytes)
}

fn parse_rate(s: &str, amount: impl Fn(&str) -> Result<u64, String>) -> Result<overspill_block::Rate, String> {
    let (rate, burst) = match s.split_once(':') {
        Some((rate, burst)) => (amount(rate)?, Some(amount(burst)?)),
        None => (amount(s)?, None),
    };
    if rate == 0 {
        return Err(format!("{s:?}: a rate of 0 would stop the VM; leave the limit out (or `off`) for none"));
    }
    Ok(overspill_block::Rate { per_second: rate, burst: burst.unwrap_or(rate).max(1) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_take_a_burst_or_a_seconds_worth() {
        assert_eq!(parse_ops_rate("1000"), Ok(overspill_block::Rate { per_second: 1000, burst: 1000 }));
        assert_eq!(parse_ops_rate("1000:50"), Ok(overspill_block::Rate { per_second: 1000, burst: 50 }));
        assert_eq!(parse_bytes_rate("50M:1G"), Ok(overspill_block::Rate { per_second: 50 << 20, burst: 1 << 30 }));
        assert!(parse_bytes_rate("50").expect_err("no unit").contains("no unit"));
        assert!(parse_ops_rate("0").expect_err("zero").contains("stop the VM"));
    }

    #[test]
    fn parses_binary_units() {
        assert_eq!(parse_bytes("4096B"), Ok(4096));
        assert_eq!(parse_bytes("0"), Ok(0));
        let bare = parse_bytes("256").expect_err("a bare number");
        assert!(bare.contains("no unit") && bare.contains("256M"), "{bare}");
        assert_eq!(parse_bytes("256M"), Ok(256 << 20));
        assert_eq!(parse_bytes("1.5G"), Ok(3 << 29));
        assert_eq!(parse_bytes("2TiB"), Ok(2 << 40));
        assert_eq!(parse_bytes("8g"), Ok(8 << 30));
        assert!(parse_bytes("12Q").is_err());
        assert!(parse_bytes("M").is_err());
        assert_eq!(format_bytes(3 << 29), "1.5 GiB");
    }
}
