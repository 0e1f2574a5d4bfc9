//! Typed reading of single TOML values, with every problem recorded in a `Diag`.
//!
//! Contract: pure functions over `toml::Value`; a failed read records exactly one entry
//! (error or soft error) naming file and field, and returns `None` so the caller can keep
//! walking the rest of the file.

use std::path::PathBuf;

use super::ConfigError;
/// A short rendering of a value for messages (strings quoted, long values cut).
pub(crate) use crate::util::show_toml as show;

/// Problems found in one file, in three severities.
#[derive(Debug, Default)]
pub(crate) struct Diag {
    pub file: PathBuf,
    /// Problems that stop the configuration from loading.
    pub errors: Vec<ConfigError>,
    /// Problems that let the file load with a default in place (`warmroute check` fails on them).
    pub soft: Vec<ConfigError>,
    /// Accepted, but worth telling the operator.
    pub warnings: Vec<ConfigError>,
}

impl Diag {
    pub fn new(file: impl Into<PathBuf>) -> Diag {
        Diag {
            file: file.into(),
            ..Diag::default()
        }
    }

    fn entry(&self, field: &str, message: String) -> ConfigError {
        ConfigError {
            file: self.file.clone(),
            field: field.to_string(),
            message,
        }
    }

    pub fn error(&mut self, field: &str, message: impl Into<String>) {
        let e = self.entry(field, message.into());
        self.errors.push(e);
    }

    pub fn soft(&mut self, field: &str, message: impl Into<String>) {
        let e = self.entry(field, message.into());
        self.soft.push(e);
    }

    pub fn warn(&mut self, field: &str, message: impl Into<String>) {
        let e = self.entry(field, message.into());
        self.warnings.push(e);
    }

    /// Records a TOML syntax error with its line and column.
    pub fn syntax(&mut self, text: &str, err: &toml::de::Error) {
        let message = match err.span() {
            Some(span) => {
                let (line, col) = line_col(text, span.start);
                format!(
                    "TOML syntax error at line {line}, column {col}: {}",
                    err.message()
                )
            }
            None => format!("TOML syntax error: {}", err.message()),
        };
        self.error("(toml)", message);
    }
}

/// 1-based line and column (in characters) of byte offset `pos` in `text`.
pub(crate) fn line_col(text: &str, pos: usize) -> (usize, usize) {
    let mut pos = pos.min(text.len());
    while !text.is_char_boundary(pos) {
        pos -= 1;
    }
    let before = &text[..pos];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let col = before[line_start..].chars().count() + 1;
    (line, col)
}

/// TOML's name for the type of `v`, for error messages.
pub(crate) fn type_name(v: &toml::Value) -> &'static str {
    match v {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a float",
        toml::Value::Boolean(_) => "a boolean",
        toml::Value::Datetime(_) => "a datetime",
        toml::Value::Array(_) => "an array",
        toml::Value::Table(_) => "a table",
    }
}

/// Reads a boolean. TOML booleans are taken as they are; the strings yes/no, on/off, 1/0 and
/// true/false (any case) are taken with a warning; anything else is a soft error and `None`
/// (the caller keeps the default).
pub(crate) fn boolean(v: &toml::Value, field: &str, d: &mut Diag) -> Option<bool> {
    match v {
        toml::Value::Boolean(b) => Some(*b),
        toml::Value::String(s) => {
            match lenient_bool(s) {
                Some(b) => {
                    d.warn(field, format!("boolean given as the string {s:?}, read as {b}; write {b} without quotes"));
                    Some(b)
                }
                None => {
                    d.soft(
                        field,
                        format!("{s:?} is not a boolean; the default applies"),
                    );
                    None
                }
            }
        }
        other => {
            d.soft(
                field,
                format!(
                    "expected a boolean, found {} ({}); the default applies",
                    type_name(other),
                    show(other)
                ),
            );
            None
        }
    }
}

fn lenient_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" | "1" => Some(true),
        "false" | "no" | "off" | "0" => Some(false),
        _ => None,
    }
}

/// Reads an integer within `min..=max`.
pub(crate) fn integer(
    v: &toml::Value,
    min: i64,
    max: i64,
    field: &str,
    d: &mut Diag,
) -> Option<i64> {
    match v {
        toml::Value::Integer(i) if (min..=max).contains(i) => Some(*i),
        toml::Value::Integer(i) => {
            d.error(field, format!("{i} is out of range {min}..={max}"));
            None
        }
        other => {
            d.error(
                field,
                format!(
                    "expected an integer, found {} ({})",
                    type_name(other),
                    show(other)
                ),
            );
            None
        }
    }
}

/// Reads a number (integer or float) within `min..=max`.
pub(crate) fn number(
    v: &toml::Value,
    min: f64,
    max: f64,
    field: &str,
    d: &mut Diag,
) -> Option<f64> {
    let x = match v {
        toml::Value::Integer(i) => *i as f64,
        toml::Value::Float(f) => *f,
        other => {
            d.error(
                field,
                format!(
                    "expected a number, found {} ({})",
                    type_name(other),
                    show(other)
                ),
            );
            return None;
        }
    };
    if x.is_finite() && x >= min && x <= max {
        Some(x)
    } else {
        d.error(field, format!("{x} is out of range {min}..={max}"));
        None
    }
}

/// Reads a byte size: integer bytes, or a string like "10m", "512K", "1g", "4096".
pub(crate) fn size(v: &toml::Value, field: &str, d: &mut Diag) -> Option<u64> {
    let parsed = match v {
        toml::Value::Integer(i) => u64::try_from(*i).map_err(|_| format!("{i} is negative")),
        toml::Value::String(s) => parse_size(s),
        other => Err(format!(
            "expected a size such as \"10m\" or integer bytes, found {}",
            type_name(other)
        )),
    };
    match parsed {
        Ok(n) => Some(n),
        Err(message) => {
            d.error(field, message);
            None
        }
    }
}

/// Parses "10m", "512k", "1g" (powers of 1024, any case, optional spaces) or plain bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let (digits, mult) = match t.as_bytes().last() {
        Some(b'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some(b'm') => (&t[..t.len() - 1], 1u64 << 20),
        Some(b'g') => (&t[..t.len() - 1], 1u64 << 30),
        _ => (t.as_str(), 1),
    };
    let digits = digits.trim_end();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "{s:?} is not a size (use bytes or a number with k, m or g)"
        ));
    }
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Reads a string.
pub(crate) fn string(v: &toml::Value, field: &str, d: &mut Diag) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        other => {
            d.error(
                field,
                format!(
                    "expected a string, found {} ({})",
                    type_name(other),
                    show(other)
                ),
            );
            None
        }
    }
}

/// Reads a string that must be one of `allowed`.
pub(crate) fn one_of(
    v: &toml::Value,
    allowed: &[&str],
    field: &str,
    d: &mut Diag,
) -> Option<String> {
    let s = string(v, field, d)?;
    if allowed.contains(&s.as_str()) {
        Some(s)
    } else {
        let list: Vec<String> = allowed.iter().map(|a| format!("{a:?}")).collect();
        d.error(field, format!("{s:?} is not one of {}", list.join(", ")));
        None
    }
}

/// Reads a table; records an error for any other type.
pub(crate) fn table<'v>(v: &'v toml::Value, field: &str, d: &mut Diag) -> Option<&'v toml::Table> {
    match v {
        toml::Value::Table(t) => Some(t),
        other => {
            d.error(
                field,
                format!(
                    "expected a table, found {} ({})",
                    type_name(other),
                    show(other)
                ),
            );
            None
        }
    }
}

/// Reads an array; records an error for any other type.
pub(crate) fn array<'v>(
    v: &'v toml::Value,
    field: &str,
    d: &mut Diag,
) -> Option<&'v [toml::Value]> {
    match v {
        toml::Value::Array(a) => Some(a),
        other => {
            d.error(
                field,
                format!(
                    "expected an array, found {} ({})",
                    type_name(other),
                    show(other)
                ),
            );
            None
        }
    }
}

/// `parent.key`, quoting `key` when it is not a bare TOML key.
pub(crate) fn join(parent: &str, key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    let key = if bare {
        key.to_string()
    } else {
        format!("{key:?}")
    };
    if parent.is_empty() {
        key
    } else {
        format!("{parent}.{key}")
    }
}

/// The known key a mistyped `key` most likely meant: the first within two edits.
pub(crate) fn near_key<'k>(key: &str, known: impl IntoIterator<Item = &'k str>) -> Option<&'k str> {
    known.into_iter().find(|k| edit_distance(k, key) <= 2)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("10m"), Ok(10 << 20));
        assert_eq!(parse_size("10M"), Ok(10 << 20));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size(" 2 G "), Ok(2 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("0"), Ok(0));
        for bad in [
            "",
            "m",
            "10x",
            "-1",
            "1.5m",
            "10mb",
            "99999999999999999999g",
            "1 0m",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} should fail");
        }
        let mut d = Diag::new("f.toml");
        assert_eq!(size(&toml::Value::Integer(1234), "s", &mut d), Some(1234));
        assert_eq!(size(&toml::Value::Integer(-1), "s", &mut d), None);
        assert_eq!(size(&toml::Value::Boolean(true), "s", &mut d), None);
        assert_eq!(d.errors.len(), 2);
        assert!(d.errors.iter().all(|e| e.field == "s"));
    }

    #[test]
    fn line_and_column() {
        assert_eq!(line_col("ab\ncd", 0), (1, 1));
        assert_eq!(line_col("ab\ncd", 4), (2, 2));
        assert_eq!(line_col("é\nx", 3), (2, 1));
    }

    #[test]
    fn quoted_keys() {
        assert_eq!(join("", "peers"), "peers");
        assert_eq!(join("peers_by_model", "llama-3"), "peers_by_model.llama-3");
        assert_eq!(join("peers_by_model", "a.b"), "peers_by_model.\"a.b\"");
    }
}
