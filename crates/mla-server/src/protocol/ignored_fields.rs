//! Request fields nothing reads. They are accepted (clients send extras freely), but silently
//! dropping one can hide a typo or a feature this server lacks, so each unknown name is logged,
//! once per endpoint and name rather than on every request, as vLLM logs "The following fields
//! were present in the request but ignored".
//!
//! The known names come from the wire structs themselves (`field_names`), so a field added to
//! one of them is known without a second list to keep in step.

use serde::de::{self, Deserialize, Deserializer, Visitor};
use serde_json::Value;
use std::collections::BTreeSet;
use std::sync::Mutex;

/// OpenAI fields that do not change the output; no struct reads them, and that is intended.
const NOT_OUTPUT: [&str; 5] = ["user", "metadata", "store", "service_tier", "parallel_tool_calls"];
/// Distinct names remembered at most: a client inventing names must not grow memory or logs.
const MAX_REMEMBERED: usize = 1024;

static LOGGED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// The JSON field names `T`'s derived `Deserialize` reads (renames applied).
pub fn field_names<T: for<'de> Deserialize<'de>>() -> &'static [&'static str] {
    let mut names = None;
    let _ = T::deserialize(FieldCapture(&mut names));
    names.unwrap_or(&[])
}

/// Logs the fields of `body` that none of `known` reads and that have not been logged yet.
pub fn log_ignored(endpoint: &str, body: &Value, known: &[&[&str]]) {
    let Some(fields) = body.as_object() else { return };
    let unknown =
        fields.keys().filter(|k| !NOT_OUTPUT.contains(&k.as_str()) && !known.iter().any(|s| s.contains(&k.as_str())));
    let mut fresh = vec![];
    {
        let mut logged = LOGGED.lock().unwrap_or_else(|e| e.into_inner());
        for name in unknown {
            let key = format!("{endpoint} {name}");
            if logged.len() < MAX_REMEMBERED && !logged.contains(&key) {
                logged.insert(key);
                fresh.push(name.as_str());
            }
        }
    }
    if !fresh.is_empty() {
        tracing::warn!(
            "{endpoint}: the following fields were present in the request but ignored: {} (each is logged once)",
            fresh.join(", ")
        );
    }
}

/// A deserializer that only records the field list a struct asks for, then fails.
struct FieldCapture<'a>(&'a mut Option<&'static [&'static str]>);

impl<'de> Deserializer<'de> for FieldCapture<'_> {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a struct"))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        *self.0 = Some(fields);
        Err(de::Error::custom("fields captured"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option
        unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::chat::ChatWire;
    use crate::protocol::common::SamplingWire;

    #[test]
    fn names_come_from_the_structs() {
        assert!(field_names::<SamplingWire>().contains(&"temperature"));
        assert!(field_names::<SamplingWire>().contains(&"include_stop_str_in_output"));
        assert!(field_names::<ChatWire>().contains(&"messages"));
    }

    #[test]
    fn each_unknown_name_is_remembered_once() {
        let body = serde_json::json!({"temperature": 1, "user": "u", "frobnicate": 1});
        log_ignored("test-endpoint", &body, &[field_names::<SamplingWire>()]);
        log_ignored("test-endpoint", &body, &[field_names::<SamplingWire>()]);
        let logged = LOGGED.lock().unwrap();
        let mine: Vec<_> = logged.iter().filter(|k| k.starts_with("test-endpoint ")).collect();
        assert_eq!(mine, vec!["test-endpoint frobnicate"]);
    }
}
