//! The request fields that ask for structured output, as OpenAI and vLLM spell them, read into
//! one `StructuredOutput`. Both endpoints accept all of them (vLLM takes `response_format` on
//! `/v1/completions` too, though OpenAI's completions API has none).
//!
//! - `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}`,
//!   `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (`strict` is
//!   accepted and ignored: the schema is always enforced, as in vLLM).
//! - vLLM's older fields: `guided_json` (a schema, or a string holding one), `guided_regex`,
//!   `guided_choice` (strings), `guided_grammar` (Lark, llguidance's dialect: vLLM hands EBNF to
//!   xgrammar, which this server does not have), `guided_whitespace_pattern`.
//! - vLLM's newer `structured_outputs: {json | regex | choice | grammar | json_object}` with
//!   `disable_any_whitespace`, `disable_additional_properties` and `whitespace_pattern`.
//!
//! - SGLang's `regex` (the same as `guided_regex`). Its `ebnf` (xgrammar's EBNF dialect) is
//!   refused: llguidance reads Lark, and a converted grammar that accepted a different
//!   language would be a silent difference; `guided_grammar` takes the grammar in Lark.
//!
//! More than one constraint in a request is a 400: vLLM refuses two `guided_*`/structured
//! fields too, and which one would win otherwise is not obvious to a client.

use super::{Author, JsonOptions, StructuredOutput};
use crate::error::ApiError;
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Default, Deserialize)]
pub struct StructuredWire {
    pub response_format: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    pub guided_whitespace_pattern: Option<String>,
    pub structured_outputs: Option<StructuredOutputsWire>,
    /// SGLang's.
    pub regex: Option<String>,
    /// SGLang's, read to refuse it.
    pub ebnf: Option<String>,
}

/// vLLM's `StructuredOutputsParams`.
#[derive(Debug, Default, Deserialize)]
pub struct StructuredOutputsWire {
    pub json: Option<Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
    pub disable_any_whitespace: Option<bool>,
    pub whitespace_pattern: Option<String>,
    pub structural_tag: Option<Value>,
    pub disable_additional_properties: Option<bool>,
}

/// A constraint and the field it came from (errors name it).
#[derive(Debug, Clone, PartialEq)]
pub struct Requested {
    pub output: StructuredOutput,
    pub field: String,
    pub author: Author,
}

/// The request's one constraint, if any.
pub fn requested(w: StructuredWire) -> Result<Option<Requested>, ApiError> {
    let so = w.structured_outputs.unwrap_or_default();
    if so.structural_tag.is_some() {
        return Err(unsupported("structured_outputs.structural_tag"));
    }
    if w.ebnf.is_some() {
        return Err(ApiError::invalid(
            "ebnf",
            "ebnf (xgrammar's EBNF) is not supported by this server; send the grammar in Lark syntax as guided_grammar",
        ));
    }
    let options = JsonOptions {
        compact: so.disable_any_whitespace.unwrap_or(false),
        whitespace_pattern: so.whitespace_pattern.or(w.guided_whitespace_pattern),
        closed_objects: so.disable_additional_properties.unwrap_or(false),
    };
    let mut found: Vec<Requested> = Vec::new();
    let mut add = |field: &str, output: StructuredOutput| {
        found.push(Requested { output, field: field.to_string(), author: Author::Request })
    };
    if let Some(rf) = &w.response_format {
        if let Some(output) = response_format(rf, &options)? {
            add("response_format", output);
        }
    }
    if let Some(schema) = w.guided_json {
        add(
            "guided_json",
            StructuredOutput::Json { schema: schema_value("guided_json", schema)?, options: options.clone() },
        );
    }
    if let Some(schema) = so.json {
        let schema = schema_value("structured_outputs.json", schema)?;
        add("structured_outputs.json", StructuredOutput::Json { schema, options: options.clone() });
    }
    if so.json_object == Some(true) {
        add("structured_outputs.json_object", StructuredOutput::JsonObject { options: options.clone() });
    }
    for (field, rx) in [("guided_regex", w.guided_regex), ("structured_outputs.regex", so.regex), ("regex", w.regex)] {
        if let Some(rx) = rx {
            add(field, StructuredOutput::Regex(rx));
        }
    }
    for (field, choice) in [("guided_choice", w.guided_choice), ("structured_outputs.choice", so.choice)] {
        if let Some(choice) = choice {
            if choice.is_empty() {
                return Err(ApiError::invalid(field, format!("{field} must list at least one choice")));
            }
            add(field, StructuredOutput::Choice(choice));
        }
    }
    for (field, g) in [("guided_grammar", w.guided_grammar), ("structured_outputs.grammar", so.grammar)] {
        if let Some(g) = g {
            add(field, StructuredOutput::Lark(g));
        }
    }
    if found.len() > 1 {
        let fields: Vec<&str> = found.iter().map(|r| r.field.as_str()).collect();
        return Err(ApiError::invalid(
            found[1].field.clone(),
            format!("only one structured-output constraint per request is allowed, got {}", fields.join(" and ")),
        ));
    }
    Ok(found.pop())
}

/// vLLM's `allowed_token_ids` and a structured-output constraint both decide which tokens may
/// be drawn, through one mask; a request may have one of them.
pub fn refuse_with_allowed_tokens(requested: Option<&Requested>, allowed_token_ids: bool) -> Result<(), ApiError> {
    match requested {
        Some(r) if allowed_token_ids => Err(ApiError::invalid(
            "allowed_token_ids",
            format!("allowed_token_ids cannot be combined with {}: both restrict the tokens drawn", r.field),
        )),
        _ => Ok(()),
    }
}

fn unsupported(field: &str) -> ApiError {
    ApiError::invalid(field, format!("{field} is not supported by this server"))
}

/// `response_format`: `None` for plain text.
fn response_format(rf: &Value, options: &JsonOptions) -> Result<Option<StructuredOutput>, ApiError> {
    let kind = rf.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid("response_format.type", "response_format must be an object with a string `type`")
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(StructuredOutput::JsonObject { options: options.clone() })),
        "json_schema" => {
            let field = "response_format.json_schema.schema";
            let schema = rf
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .filter(|s| !s.is_null())
                .ok_or_else(|| ApiError::invalid(field, format!("{field} is required with type json_schema")))?;
            Ok(Some(StructuredOutput::Json { schema: schema_value(field, schema.clone())?, options: options.clone() }))
        }
        "structural_tag" => Err(unsupported("response_format.structural_tag")),
        other => Err(ApiError::invalid(
            "response_format.type",
            format!("response_format.type must be text, json_object or json_schema, got {other:?}"),
        )),
    }
}

/// A JSON schema sent as an object, a boolean, or a string holding either (vLLM's `guided_json`).
fn schema_value(field: &str, v: Value) -> Result<Value, ApiError> {
    let v = match v {
        Value::String(s) => serde_json::from_str(&s)
            .map_err(|e| ApiError::invalid(field, format!("{field} is a string but not JSON: {e}")))?,
        v => v,
    };
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v),
        _ => Err(ApiError::invalid(field, format!("{field} must be a JSON schema (an object)"))),
    }
}
