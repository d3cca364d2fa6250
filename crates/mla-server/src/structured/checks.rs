//! The checks a constraint passes before llguidance sees it (`limits` says why each exists):
//! how deep the compiler would recurse on it, and how large its regexes and Lark text are.
//! Each failure names its limit; all of them read the input without recursing.

use super::limits::{MAX_LARK_BYTES, MAX_RECURSION};
use super::{lark_scan, regex_size, schema_depth, Author, StructuredOutput};
use serde_json::Value;

/// `Err` says which limit `so` goes beyond. `compiled_schema` is the schema as compiled (with
/// the layout options in it), for the JSON forms.
pub fn check(so: &StructuredOutput, author: Author, compiled_schema: Option<&Value>) -> Result<(), String> {
    match so {
        StructuredOutput::Json { .. } | StructuredOutput::JsonObject { .. } => {
            let schema = compiled_schema.expect("the JSON forms are compiled from a schema");
            recursion(schema_depth::recursion_bound(schema), "schema")?;
            regex_size::schema_patterns(schema).into_iter().try_for_each(regex_size::check)?;
            whitespace_pattern(schema)
        }
        StructuredOutput::Regex(rx) => regex_size::check(rx),
        // Escaped literals: no optional items, and alternatives of literals cost the matcher
        // time linear in their length.
        StructuredOutput::Choice(_) => Ok(()),
        StructuredOutput::Lark(lark) => {
            if author == Author::Request && lark.len() > MAX_LARK_BYTES {
                return Err(format!(
                    "a grammar may be at most {MAX_LARK_BYTES} bytes long, this one has {}",
                    lark.len()
                ));
            }
            let scan = lark_scan::scan(lark);
            recursion(scan.recursion_bound, "grammar")?;
            scan.regexes.iter().try_for_each(|rx| regex_size::check(rx))
        }
    }
}

fn recursion(bound: usize, what: &str) -> Result<(), String> {
    if bound > MAX_RECURSION {
        return Err(format!(
            "the {what} nests too deeply to compile: counting every level of nesting and every definition it refers to (its $ref or rule chain), it could need {bound} levels, and the limit is {MAX_RECURSION}"
        ));
    }
    Ok(())
}

/// The whitespace regex of the layout options (`x-guidance.whitespace_pattern`).
fn whitespace_pattern(schema: &Value) -> Result<(), String> {
    match schema.get("x-guidance").and_then(|g| g.get("whitespace_pattern")).and_then(Value::as_str) {
        Some(rx) => regex_size::check(rx),
        None => Ok(()),
    }
}
