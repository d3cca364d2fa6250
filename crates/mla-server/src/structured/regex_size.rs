//! The size of a regex a request hands the grammar compiler, checked before compiling.
//!
//! llguidance matches regexes by derivatives, which pay quadratically for a long run of optional
//! items: each optional item doubles the ways the text so far can be split, and every one of
//! them is followed (`limits` has the figures). So a regex may be at most `MAX_REGEX_BYTES` long
//! and have at most `MAX_OPTIONAL_ITEMS` optional items. Counted repetitions (`(a?){2000}`) are
//! counted once: they stay one compact node in llguidance. A regex this cannot parse is left to
//! llguidance, whose parser (the same `regex-syntax`) reports the error.

use super::limits::{MAX_OPTIONAL_ITEMS, MAX_REGEX_BYTES};
use regex_syntax::ast::{self, Ast, RepetitionKind, RepetitionRange, Visitor};
use serde_json::Value;

/// `Err` names the limit `rx` goes beyond.
pub fn check(rx: &str) -> Result<(), String> {
    if rx.len() > MAX_REGEX_BYTES {
        return Err(format!("a regex may be at most {MAX_REGEX_BYTES} bytes long, this one has {}", rx.len()));
    }
    let Ok(parsed) = ast::parse::Parser::new().parse(rx) else { return Ok(()) };
    let optional = ast::visit(&parsed, OptionalItems(0)).unwrap_or(0);
    if optional > MAX_OPTIONAL_ITEMS {
        return Err(format!(
            "a regex may have at most {MAX_OPTIONAL_ITEMS} optional items (x?, x*, x{{0,n}}, an empty alternative), this one has {optional}: such a regex costs the matcher time and memory quadratic in their number"
        ));
    }
    Ok(())
}

/// The regexes in a JSON schema: `pattern` values and `patternProperties` keys, at any depth
/// (iteratively: the schema may nest deeper than a stack allows).
pub fn schema_patterns(schema: &Value) -> Vec<&str> {
    let mut found = vec![];
    let mut pending = vec![schema];
    while let Some(v) = pending.pop() {
        match v {
            Value::Object(map) => {
                for (key, child) in map {
                    match (key.as_str(), child) {
                        ("pattern", Value::String(rx)) => found.push(rx.as_str()),
                        ("patternProperties", Value::Object(props)) => found.extend(props.keys().map(String::as_str)),
                        _ => {}
                    }
                    pending.push(child);
                }
            }
            Value::Array(items) => pending.extend(items),
            _ => {}
        }
    }
    found
}

/// Counts repetitions that may match nothing and empty alternatives. `ast::visit` walks the
/// tree on the heap, so a deeply nested regex cannot overflow the stack here.
struct OptionalItems(usize);

impl Visitor for OptionalItems {
    type Output = usize;
    type Err = std::convert::Infallible;

    fn finish(self) -> Result<usize, Self::Err> {
        Ok(self.0)
    }

    fn visit_pre(&mut self, ast: &Ast) -> Result<(), Self::Err> {
        match ast {
            Ast::Repetition(r) => {
                let optional = match &r.op.kind {
                    RepetitionKind::ZeroOrOne | RepetitionKind::ZeroOrMore => true,
                    RepetitionKind::OneOrMore => false,
                    RepetitionKind::Range(
                        RepetitionRange::Exactly(m) | RepetitionRange::AtLeast(m) | RepetitionRange::Bounded(m, _),
                    ) => *m == 0,
                };
                self.0 += usize::from(optional);
            }
            Ast::Alternation(a) => self.0 += a.asts.iter().filter(|b| matches!(b, Ast::Empty(_))).count(),
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optional_items_are_counted_once_each() {
        let count = |rx: &str| ast::visit(&ast::parse::Parser::new().parse(rx).unwrap(), OptionalItems(0)).unwrap();
        assert_eq!(count("a?b*c+d{0,3}e{2}f{0}(g|)h{1,}"), 5);
        assert_eq!(count("(a?){2000}"), 1, "a counted repetition is one node");
        assert_eq!(count("[a-z]+@[a-z]+\\.com"), 0);
    }

    #[test]
    fn schema_patterns_are_found_at_any_depth() {
        let schema = serde_json::json!({
            "properties": {"pattern": {"type": "string", "pattern": "a+"}, "b": {"items": {"pattern": "b?"}}},
            "patternProperties": {"^x": {"pattern": "c"}}
        });
        let mut found = schema_patterns(&schema);
        found.sort();
        assert_eq!(found, vec!["^x", "a+", "b?", "c"], "a property named pattern is not a regex");
    }

    #[test]
    fn limits_name_themselves() {
        assert!(check(&"a?".repeat(MAX_OPTIONAL_ITEMS)).is_ok());
        let e = check(&"a?".repeat(MAX_OPTIONAL_ITEMS + 1)).unwrap_err();
        assert!(e.contains(&format!("at most {MAX_OPTIONAL_ITEMS} optional items")), "{e}");
        let e = check(&"a".repeat(MAX_REGEX_BYTES + 1)).unwrap_err();
        assert!(e.contains(&format!("at most {MAX_REGEX_BYTES} bytes")), "{e}");
        assert!(check("(unclosed").is_ok(), "left to llguidance's own error");
    }
}
