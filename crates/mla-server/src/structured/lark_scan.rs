//! What a Lark grammar asks of llguidance's compiler, read before compiling: how deep the
//! compiler can recurse on it, and the regexes in it (which `regex_size` checks).
//!
//! The compiler builds a rule (or token) when it is first referred to, from inside the rule that
//! refers to it, so a chain of rules each naming the next is a chain of nested calls: 700 of them
//! overflowed a 2 MiB stack. Inside one definition it also recurses through the brackets around
//! the reference (llguidance's parser allows 30 levels), and a `%json { ... }` schema is compiled
//! by the JSON-schema compiler at that point (`schema_depth`).
//!
//! Like `schema_depth`, the bound assumes the worst order: every definition met at the deepest
//! point of the one before. So it is, over the whole text, one level per definition plus the
//! deepest bracket nesting inside it, plus the bound of every embedded schema. Definitions are
//! not parsed: every `:` outside strings, regexes, comments and JSON counts as one (rules,
//! tokens and `name[...]` attributes alike), which can only overcount.

use super::{regex_size, schema_depth};
use serde_json::Value;

#[derive(Debug, Default, PartialEq)]
pub struct LarkScan {
    /// Compiler recursion levels the grammar may need at most (see the module doc).
    pub recursion_bound: usize,
    /// The `/regex/` literals (unescaped as llguidance reads them) and the `pattern`s of the
    /// `%json` schemas.
    pub regexes: Vec<String>,
}

/// Reads `lark`. Malformed input (an unterminated string, invalid embedded JSON) ends the scan
/// where llguidance's own lexer fails, before anything is compiled.
pub fn scan(lark: &str) -> LarkScan {
    let bytes = lark.as_bytes();
    let mut regexes = vec![];
    let (mut bound, mut depth, mut deepest, mut i) = (0usize, 0usize, 0usize, 0usize);
    while i < bytes.len() {
        match bytes[i] {
            b'#' => i = line_end(bytes, i),
            b'/' if bytes.get(i + 1) == Some(&b'/') => i = line_end(bytes, i),
            b'/' => {
                let end = regex_end(bytes, i);
                let body = lark[i + 1..end].trim_end_matches(|c: char| "imslux".contains(c));
                regexes.push(body.strip_suffix('/').unwrap_or(body).replace("\\/", "/"));
                i = end;
            }
            b'"' => i = string_end(bytes, i),
            b'<' => i = special_token_end(bytes, i),
            b'%' => match embedded_json(lark, i) {
                Embedded::Json { is_schema, value, end } => {
                    if is_schema {
                        bound = bound.saturating_add(schema_depth::recursion_bound(&value));
                        regexes.extend(regex_size::schema_patterns(&value).into_iter().map(str::to_string));
                    }
                    i = end;
                }
                // llguidance's lexer stops here too: nothing after it is compiled.
                Embedded::Invalid => break,
                Embedded::None => i += 1,
            },
            b':' => {
                // A new definition (or attribute) starts: close the previous one.
                bound = bound.saturating_add(1 + deepest);
                deepest = depth;
                i += 1;
            }
            b'(' | b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
                i += 1;
            }
            b')' | b']' | b'}' => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            _ => i += 1,
        }
    }
    LarkScan { recursion_bound: bound.saturating_add(1 + deepest), regexes }
}

fn line_end(bytes: &[u8], from: usize) -> usize {
    bytes[from..].iter().position(|&b| b == b'\n').map_or(bytes.len(), |p| from + p)
}

/// After a JSON-style string literal (`"..."`, escapes allowed, no line breaks).
fn string_end(bytes: &[u8], open: usize) -> usize {
    let mut i = open + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            b'\n' => return i,
            _ => i += 1,
        }
    }
    bytes.len()
}

/// After a `/regex/flags` literal (escapes allowed; it may span lines, as llguidance's lexer
/// reads it).
fn regex_end(bytes: &[u8], open: usize) -> usize {
    let mut i = open + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'/' => {
                i += 1;
                while i < bytes.len() && b"imslux".contains(&bytes[i]) {
                    i += 1;
                }
                return i;
            }
            _ => i += 1,
        }
    }
    bytes.len()
}

/// After a `<name>` special-token reference (no spaces or angle brackets inside), whose name
/// may hold quotes or brackets that are not Lark syntax; just past `<` otherwise.
fn special_token_end(bytes: &[u8], open: usize) -> usize {
    for (i, &b) in bytes.iter().enumerate().skip(open + 1) {
        match b {
            b'>' if i > open + 1 => return i + 1,
            b'<' | b'>' | b' ' | b'\t' | b'\r' | b'\n' => break,
            _ => {}
        }
    }
    open + 1
}

enum Embedded {
    /// A JSON value after `%json` (a schema), `%regex` or `%llguidance`, ending at `end`.
    Json { is_schema: bool, value: Value, end: usize },
    /// One of those keywords without a valid JSON value after it.
    Invalid,
    /// Another `%` directive.
    None,
}

/// The JSON after `%json`, `%regex` or `%llguidance` at `at`, as llguidance's lexer reads it.
fn embedded_json(lark: &str, at: usize) -> Embedded {
    let rest = &lark[at..];
    let Some(keyword) = ["%json", "%regex", "%llguidance"].into_iter().find(|k| rest.starts_with(k)) else {
        return Embedded::None;
    };
    let after = at + keyword.len();
    let mut stream = serde_json::Deserializer::from_str(&lark[after..]).into_iter::<Value>();
    match stream.next() {
        Some(Ok(value)) => Embedded::Json { is_schema: keyword == "%json", value, end: after + stream.byte_offset() },
        _ => Embedded::Invalid,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(lark: &str) -> usize {
        scan(lark).recursion_bound
    }

    #[test]
    fn each_definition_counts_one_plus_its_nesting() {
        assert_eq!(bound("start: \"a\""), 1 + 1);
        assert_eq!(bound("start: a\na: (\"x\" (b))\nb: \"y\""), 1 + (1 + 2) + 1 + 1);
        let chain = |n: usize| (0..n).map(|i| format!("r{i}: \"a\" r{}\n", i + 1)).collect::<String>();
        assert_eq!(bound(&chain(700)) - bound(&chain(100)), 600);
    }

    #[test]
    fn strings_regexes_comments_and_special_tokens_are_skipped() {
        let g = "start: \"a:(b\\\"[\" /x:(y)\\/[z/i <x:[1]> // c: ((\n# d: [[\nb: \"q\"";
        assert_eq!(bound(g), 1 + 1 + 1);
    }

    #[test]
    fn embedded_schemas_add_their_own_bound() {
        let schema = r##"{"properties": {"a": {"$ref": "#/properties/b"}, "b": {"type": "string"}}}"##;
        let g = format!("start: x\nx: %json {schema}\n");
        let value: Value = serde_json::from_str(schema).unwrap();
        // The schema's braces are not counted as Lark nesting.
        assert_eq!(bound(&g), 1 + 1 + 1 + schema_depth::recursion_bound(&value));
        // Other embedded JSON is skipped, and its colons do not count.
        assert_eq!(bound("%llguidance {\"a\": {\"b\": 1}}\nstart: \"x\""), 1 + 1);
    }

    #[test]
    fn regex_literals_and_schema_patterns_are_collected() {
        let g = r#"start: /a\/b?/i x
x: %json {"properties": {"p": {"type": "string", "pattern": "c+"}}, "patternProperties": {"^d": {}}}
"#;
        let mut found = scan(g).regexes;
        found.sort();
        assert_eq!(found, vec!["^d", "a/b?", "c+"]);
    }

    #[test]
    fn unterminated_input_ends_the_count() {
        assert_eq!(bound("start: \"abc"), 1 + 1);
        assert_eq!(bound("start: x\nx: %json {\"a\": "), 1 + 1 + 1);
    }
}
