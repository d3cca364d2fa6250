//! RFC 7396 JSON merge patch, the semantics of `--hf-overrides` on `config.json`.

use serde_json::{Map, Value};

/// Applies `patch` to `target`: a patch object's fields replace `target`'s, objects merging
/// field by field, and `null` removes a field; a patch that is not an object replaces `target`.
/// The text of vLLM's `--hf-overrides`: a JSON object, or an error that says what it must be.
pub fn parse_overrides(text: &str) -> Result<serde_json::Map<String, Value>, String> {
    match serde_json::from_str(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(format!("--hf-overrides must be a JSON object, e.g. '{{\"num_hidden_layers\": 6}}'; got {text}")),
        Err(e) => Err(format!("--hf-overrides is not valid JSON ({e}): {text}")),
    }
}

pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(fields) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let obj = target.as_object_mut().expect("made an object above");
    for (key, value) in fields {
        if value.is_null() {
            obj.remove(key);
        } else {
            merge_patch(obj.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::merge_patch;
    use serde_json::json;

    #[test]
    fn rfc_7396_examples() {
        let mut doc = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        merge_patch(&mut doc, &json!({"a": "z", "c": {"f": null}}));
        assert_eq!(doc, json!({"a": "z", "c": {"d": "e"}}));
        let mut doc = json!({"a": [1, 2]});
        merge_patch(&mut doc, &json!({"a": [3], "b": {"x": 1}}));
        assert_eq!(doc, json!({"a": [3], "b": {"x": 1}}));
        let mut doc = json!({"a": {"b": 1}});
        merge_patch(&mut doc, &json!({"a": 5}));
        assert_eq!(doc, json!({"a": 5}));
    }
}
