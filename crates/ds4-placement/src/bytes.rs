//! Byte units, human formatting and a size parser.
//!
//! Machine description files are written by people ("62 GiB", "128 GB"), so every byte
//! field in them accepts either a plain integer (bytes) or a string with a unit. Output is
//! always plain bytes in JSON and binary units (KiB/MiB/GiB) in human text, because the
//! numbers users compare against (`hipMemGetInfo`, ds4's logs) are binary.

use serde::{Deserialize, Deserializer, Serializer};
use thiserror::Error;

/// 1 KiB.
pub const KIB: u64 = 1 << 10;
/// 1 MiB.
pub const MIB: u64 = 1 << 20;
/// 1 GiB.
pub const GIB: u64 = 1 << 30;

/// A size string that could not be turned into bytes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SizeError {
    #[error("empty size")]
    Empty,
    #[error("size {0:?}: not a number followed by an optional unit (B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)")]
    Malformed(String),
    #[error("size {0:?}: unknown unit")]
    UnknownUnit(String),
    #[error("size {0:?}: negative or not finite")]
    Negative(String),
    #[error("size {0:?}: does not fit in 64 bits")]
    Overflow(String),
}

/// Parses "123", "123 B", "1.5 GiB", "62GiB", "128 GB", "512 MiB", "8 kB" (kB = 1024 B, as
/// `/proc/meminfo` uses it; `KB`/`KiB` the same), "4 MB" (decimal, 10^6).
///
/// Decimal GB/MB/TB exist because vendors quote RAM and cards that way; kB follows
/// meminfo's (binary) meaning since that is where such numbers are copied from.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(SizeError::Empty);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    if num.is_empty() {
        return Err(SizeError::Malformed(text.to_string()));
    }
    let mult: f64 = match unit {
        "" | "B" | "b" => 1.0,
        "kB" | "KB" | "KiB" | "k" | "K" => KIB as f64,
        "MiB" | "M" => MIB as f64,
        "GiB" | "G" => GIB as f64,
        "TiB" | "T" => (GIB as f64) * 1024.0,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        _ => return Err(SizeError::UnknownUnit(text.to_string())),
    };
    // Integers without a unit must be exact: going through f64 would round above 2^53.
    if unit.is_empty() || unit == "B" || unit == "b" {
        if let Ok(v) = num.parse::<u64>() {
            return Ok(v);
        }
    }
    let v: f64 = num
        .parse()
        .map_err(|_| SizeError::Malformed(text.to_string()))?;
    if !v.is_finite() || v < 0.0 {
        return Err(SizeError::Negative(text.to_string()));
    }
    let bytes = (v * mult).round();
    if bytes >= u64::MAX as f64 {
        return Err(SizeError::Overflow(text.to_string()));
    }
    Ok(bytes as u64)
}

/// Converts a (possibly fractional) GiB count from a flag or variable into bytes.
pub fn gib_to_bytes(gib: f64) -> Option<u64> {
    if !gib.is_finite() || gib < 0.0 {
        return None;
    }
    let b = (gib * GIB as f64).round();
    if b >= u64::MAX as f64 {
        None
    } else {
        Some(b as u64)
    }
}

/// Human form with two decimals in the largest binary unit that keeps the number ≥ 1.
pub fn fmt_bytes(b: u64) -> String {
    if b >= GIB {
        format!("{:.2} GiB", b as f64 / GIB as f64)
    } else if b >= MIB {
        format!("{:.2} MiB", b as f64 / MIB as f64)
    } else if b >= KIB {
        format!("{:.2} KiB", b as f64 / KIB as f64)
    } else {
        format!("{b} B")
    }
}

/// Human GiB with two decimals, for tables where one unit reads best.
pub fn fmt_gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / GIB as f64)
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SizeRepr {
    Int(u64),
    Text(String),
}

fn repr_to_bytes<E: serde::de::Error>(r: SizeRepr) -> Result<u64, E> {
    match r {
        SizeRepr::Int(v) => Ok(v),
        SizeRepr::Text(s) => parse_size(&s).map_err(E::custom),
    }
}

/// `#[serde(with = "crate::bytes::size")]`: a `u64` byte count, written as an integer, read
/// from an integer or a size string.
pub mod size {
    use super::*;

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(*v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        repr_to_bytes(SizeRepr::deserialize(d)?)
    }
}

/// Same as [`size`] for `Option<u64>` (`null` or absent = `None`; use with `#[serde(default)]`).
pub mod opt_size {
    use super::*;

    pub fn serialize<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_some(v),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        match Option::<SizeRepr>::deserialize(d)? {
            None => Ok(None),
            Some(r) => repr_to_bytes(r).map(Some),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("123").unwrap(), 123);
        assert_eq!(parse_size("18446744073709551615").unwrap(), u64::MAX);
        assert_eq!(parse_size("62 GiB").unwrap(), 62 * GIB);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 * GIB / 2);
        assert_eq!(parse_size("512 MiB").unwrap(), 512 * MIB);
        assert_eq!(parse_size("8 kB").unwrap(), 8192);
        assert_eq!(parse_size("128 GB").unwrap(), 128_000_000_000);
        assert_eq!(parse_size(" 2 TiB ").unwrap(), 2048 * GIB);
    }

    #[test]
    fn rejects_bad_sizes() {
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert!(matches!(parse_size("GiB"), Err(SizeError::Malformed(_))));
        assert!(matches!(
            parse_size("12 parsecs"),
            Err(SizeError::UnknownUnit(_))
        ));
        assert!(matches!(parse_size("-1 GiB"), Err(SizeError::Negative(_))));
        assert!(matches!(
            parse_size("1e30 TB"),
            Err(SizeError::UnknownUnit(_))
        ));
        assert!(matches!(
            parse_size("1..2 GiB"),
            Err(SizeError::Malformed(_))
        ));
        assert!(matches!(
            parse_size("99999999999999999999 TiB"),
            Err(SizeError::Overflow(_))
        ));
    }

    #[test]
    fn formats_binary_units() {
        assert_eq!(fmt_bytes(0), "0 B");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
        assert_eq!(fmt_bytes(1792 * MIB), "1.75 GiB");
        assert_eq!(fmt_bytes(86_714_777_664), "80.76 GiB");
        assert_eq!(fmt_gib(GIB / 2), "0.50 GiB");
    }

    #[test]
    fn gib_conversion_bounds() {
        assert_eq!(gib_to_bytes(2.0), Some(2 * GIB));
        assert_eq!(gib_to_bytes(0.0), Some(0));
        assert_eq!(gib_to_bytes(-1.0), None);
        assert_eq!(gib_to_bytes(f64::NAN), None);
        assert_eq!(gib_to_bytes(1e30), None);
    }
}
