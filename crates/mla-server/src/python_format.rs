//! How Python spells template values: `json.dumps` (behind transformers' `tojson` filter) and
//! `str()`/`repr()` (what jinja2 prints for `{{ value }}`).
//!
//! Chat templates are written against Python, and their output is token input: `{"a": 1}` versus
//! `{"a":1}`, `None` versus `none` or `1e+20` versus `1e20` are different prompts. Everything here
//! mirrors CPython's output for the value kinds JSON requests can carry.

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};
use std::fmt::Write;

/// `json.dumps` options transformers' `tojson` exposes (same defaults).
#[derive(Debug, Clone, Default)]
pub struct JsonDumpsOptions {
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(s)`: newline plus `s` repeated per level (Python's `indent`).
    pub indent: Option<String>,
    /// `(item, key)` separators; Python's default depends on `indent`.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

/// Serialises `value` exactly as `json.dumps(value, **options)` would.
pub fn json_dumps(value: &Value, options: &JsonDumpsOptions) -> Result<String, Error> {
    let (item_sep, key_sep) = match (&options.separators, &options.indent) {
        (Some((item, key)), _) => (item.clone(), key.clone()),
        (None, None) => (", ".to_string(), ": ".to_string()),
        (None, Some(_)) => (",".to_string(), ": ".to_string()),
    };
    let mut writer = JsonWriter { options, item_sep, key_sep, out: String::new() };
    writer.value(value, 0)?;
    Ok(writer.out)
}

struct JsonWriter<'a> {
    options: &'a JsonDumpsOptions,
    item_sep: String,
    key_sep: String,
    out: String,
}

impl JsonWriter<'_> {
    fn value(&mut self, value: &Value, depth: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self.out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.out.push_str(&python_number(value, true)?),
            ValueKind::String => {
                let s = value.as_str().unwrap_or_default();
                json_string(&mut self.out, s, self.options.ensure_ascii);
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container('[', ']', items.len(), depth, |w, i, d| w.value(&items[i], d))?;
            }
            ValueKind::Map => {
                let mut pairs = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    pairs.push((json_key(&key)?, item));
                }
                if self.options.sort_keys {
                    pairs.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container('{', '}', pairs.len(), depth, |w, i, d| {
                    json_string(&mut w.out, &pairs[i].0, w.options.ensure_ascii);
                    w.out.push_str(&w.key_sep.clone());
                    w.value(&pairs[i].1, d)
                })?;
            }
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: object of kind {other} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    /// Python puts nothing between the brackets of an empty container, even when indenting.
    fn container(
        &mut self,
        open: char,
        close: char,
        len: usize,
        depth: usize,
        mut item: impl FnMut(&mut Self, usize, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if len > 0 {
            for i in 0..len {
                if i > 0 {
                    self.out.push_str(&self.item_sep.clone());
                }
                self.newline_indent(depth + 1);
                item(self, i, depth + 1)?;
            }
            self.newline_indent(depth);
        }
        self.out.push(close);
        Ok(())
    }

    fn newline_indent(&mut self, depth: usize) {
        if let Some(indent) = &self.options.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(indent);
            }
        }
    }
}

/// Python's json turns non-string keys into strings (`True` → "true", `None` → "null").
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number => python_number(key, true),
        other => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {other}"),
        )),
    }
}

fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                // Python escapes DEL too when ensure_ascii; astral characters become surrogate pairs.
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// An int as decimal digits; a float as Python's `repr` (`1.0`, `1e-07`, `1e+20`). In JSON
/// non-finite floats are `NaN` / `Infinity` (Python's default `allow_nan=True`), in `repr` `nan`/`inf`.
fn python_number(value: &Value, json: bool) -> Result<String, Error> {
    if value.is_integer() {
        return Ok(value.to_string());
    }
    let x = f64::try_from(value.clone())?;
    Ok(match (x.is_nan(), x.is_infinite(), json) {
        (true, _, true) => "NaN".into(),
        (true, _, false) => "nan".into(),
        (_, true, true) => if x > 0.0 { "Infinity" } else { "-Infinity" }.into(),
        (_, true, false) => if x > 0.0 { "inf" } else { "-inf" }.into(),
        _ => python_float_repr(x),
    })
}

/// CPython's `float.__repr__`: the shortest round-tripping digits, positional when the decimal
/// exponent is in [-4, 16), otherwise `d.ddde±XX`.
pub fn python_float_repr(x: f64) -> String {
    // Rust's `{:e}` also yields the shortest round-tripping digits: "-1.2345e-7".
    let sci = format!("{:e}", x);
    let (mantissa, exp) = sci.split_once('e').expect("LowerExp output has an exponent");
    let exp: i32 = exp.parse().expect("LowerExp exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-point) as usize))
        } else if (point as usize) >= digits.len() {
            format!("{sign}{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{sign}{int}.{frac}")
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{exp_sign}{:02}", exp.abs())
    }
}

/// What `str(value)` gives in Python, which is what jinja2 prints for `{{ value }}`.
pub fn python_str(value: &Value) -> Result<String, Error> {
    match value.kind() {
        ValueKind::Undefined => Ok(String::new()),
        ValueKind::String => Ok(value.as_str().unwrap_or_default().to_string()),
        _ => python_repr(value),
    }
}

/// What `repr(value)` gives in Python (how containers print their items).
pub fn python_repr(value: &Value) -> Result<String, Error> {
    let mut out = String::new();
    repr_into(&mut out, value)?;
    Ok(out)
}

fn repr_into(out: &mut String, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&python_number(value, false)?),
        ValueKind::String => repr_string(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr_into(out, &item)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr_into(out, &key)?;
                out.push_str(": ");
                repr_into(out, &value.get_item(&key)?)?;
            }
            out.push('}');
        }
        // Functions, namespaces, bytes: no Python spelling to match; minijinja's own is clearer
        // than inventing one.
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// Python quotes with `'` unless the text has `'` and no `"`. Control characters are escaped;
/// other non-printable classes (format characters, unassigned code points) are printed as is,
/// which Python would escape — they do not occur in chat prompts in practice.
fn repr_string(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected strings are CPython 3.11's repr() of the same literals.
    #[test]
    fn float_repr_matches_cpython() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.25, "-2.25"),
            (1e-7, "1e-07"),
            (1e20, "1e+20"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456789.125, "123456789.125"),
            (1.5e300, "1.5e+300"),
            (-0.0, "-0.0"),
            (5e-324, "5e-324"),
        ];
        for (x, want) in cases {
            assert_eq!(python_float_repr(x), want, "repr({x:e})");
        }
    }

    #[test]
    fn repr_quotes_like_python() {
        let repr = |s: &str| python_repr(&Value::from(s)).unwrap();
        assert_eq!(repr("plain"), "'plain'");
        assert_eq!(repr("it's"), "\"it's\"");
        assert_eq!(repr("it's \"x\""), "'it\\'s \"x\"'");
        assert_eq!(repr("a\nb\\\u{1}"), "'a\\nb\\\\\\x01'");
    }
}
