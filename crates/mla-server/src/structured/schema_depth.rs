//! How deep llguidance's JSON-schema compiler can recurse on a schema, bounded before compiling.
//!
//! The compiler recurses into every subschema, and through every `$ref` into the definition it
//! names the first time that definition is met (later meetings reuse it). A chain of references
//! is therefore a chain of nested calls: a 250-definition chain, each referring to the next,
//! overflowed a 2 MiB stack. Compiling happens on a thread with a known stack
//! (`compile_thread`); this bound is what keeps the recursion inside it.
//!
//! Which definition is met first depends on the compiler's visiting order, so the bound does not
//! follow it: it assumes the worst, every definition met at the deepest point of the one before.
//! That is the nesting depth of the document, plus, for each distinct reference, one level for
//! the reference and the nesting depth of what it names. Without `$ref` it is the nesting depth
//! alone. Everything here is iterative: the values may nest deeper than any stack allows.

use serde_json::Value;
use std::collections::HashSet;

/// Keys whose string value names another schema (draft 2020-12, 2019-09 and earlier).
const REFERENCE_KEYS: [&str; 3] = ["$ref", "$dynamicRef", "$recursiveRef"];

/// Compiler recursion levels `schema` may need at most (see the module doc).
pub fn recursion_bound(schema: &Value) -> usize {
    let root_depth = nesting_depth(schema);
    let references = references(schema);
    references.iter().fold(root_depth, |bound, reference| {
        // Anything the document can name nests no deeper than the document: a reference this
        // cannot resolve (an anchor, a `$id`-relative URI) is charged the whole document.
        let target_depth = local_target(schema, reference).map_or(root_depth, nesting_depth);
        bound.saturating_add(1 + target_depth)
    })
}

/// Levels of objects and arrays in `v` (a scalar is 0, `{}` is 1).
pub fn nesting_depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut pending = vec![(v, 0usize)];
    while let Some((v, depth)) = pending.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match v {
            Value::Object(map) => Box::new(map.values()),
            Value::Array(items) => Box::new(items.iter()),
            _ => continue,
        };
        deepest = deepest.max(depth + 1);
        pending.extend(children.map(|c| (c, depth + 1)));
    }
    deepest
}

/// The distinct reference strings anywhere in `schema`.
fn references(schema: &Value) -> HashSet<&str> {
    let mut found = HashSet::new();
    let mut pending = vec![schema];
    while let Some(v) = pending.pop() {
        match v {
            Value::Object(map) => {
                for (key, child) in map {
                    match child {
                        Value::String(s) if REFERENCE_KEYS.contains(&key.as_str()) => {
                            found.insert(s.as_str());
                        }
                        _ => pending.push(child),
                    }
                }
            }
            Value::Array(items) => pending.extend(items),
            _ => {}
        }
    }
    found
}

/// What a same-document reference (`#`, `#/$defs/a`, percent-encoded or not) points at.
fn local_target<'a>(schema: &'a Value, reference: &str) -> Option<&'a Value> {
    let fragment = reference.strip_prefix('#')?;
    if fragment.is_empty() {
        return Some(schema);
    }
    schema.pointer(&percent_decode(fragment)?)
}

/// `%XX` escapes of a URI fragment decoded (`None` when malformed or not UTF-8).
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn depth_counts_objects_and_arrays() {
        assert_eq!(nesting_depth(&json!(3)), 0);
        assert_eq!(nesting_depth(&json!({})), 1);
        assert_eq!(nesting_depth(&json!({"a": [1, {"b": 2}]})), 3);
    }

    #[test]
    fn a_schema_without_references_is_bounded_by_its_depth() {
        let s = json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}});
        // The root, properties, a, items.
        assert_eq!(recursion_bound(&s), 4);
    }

    #[test]
    fn each_distinct_reference_adds_its_target() {
        let s = json!({
            "$defs": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"$ref": "#/$defs/a"}}},
            "properties": {"x": {"$ref": "#/$defs/b"}, "y": {"$ref": "#/$defs/b"}}
        });
        // The root nests 4 deep (root, $defs, b, items); a is 1 deep, b 2 (its items).
        assert_eq!(recursion_bound(&s), 4 + (1 + 1) + (1 + 2));
    }

    #[test]
    fn unresolvable_references_are_charged_the_whole_document() {
        let s = json!({"properties": {"x": {"$ref": "#anchor"}, "y": {"$ref": "#/nowhere"}}});
        assert_eq!(recursion_bound(&s), 3 + 2 * (1 + 3));
    }

    #[test]
    fn percent_encoded_pointers_resolve() {
        let s = json!({"$defs": {"a b": {"type": "object", "properties": {}}}, "$ref": "#/$defs/a%20b"});
        // The root nests 4 deep (root, $defs, "a b", properties); "a b" 2.
        assert_eq!(recursion_bound(&s), 4 + 1 + 2);
    }

    #[test]
    fn a_reference_chain_grows_the_bound_per_link() {
        let chain = |n: usize| {
            let defs: serde_json::Map<String, Value> = (0..n)
                .map(|i| (format!("d{i}"), json!({"properties": {"x": {"$ref": format!("#/$defs/d{}", i + 1)}}})))
                .collect();
            json!({"$ref": "#/$defs/d0", "$defs": defs})
        };
        // Each link: the reference (1) and a definition 3 deep; d{n} does not resolve.
        let (short, long) = (recursion_bound(&chain(10)), recursion_bound(&chain(20)));
        assert_eq!(long - short, 10 * 4);
    }

    #[test]
    fn deep_values_do_not_recurse() {
        let mut v = json!(1);
        for _ in 0..100_000 {
            v = Value::Array(vec![v]);
        }
        assert_eq!(nesting_depth(&v), 100_000);
        assert_eq!(recursion_bound(&v), 100_000);
        // serde_json's own drop of such a value recurses; leak it rather than overflow.
        std::mem::forget(v);
    }
}
