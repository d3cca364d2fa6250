//! The minijinja environment that behaves like transformers' jinja2 sandbox for chat templates:
//! `trim_blocks` + `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a `tojson`
//! that is Python's `json.dumps` (no HTML escaping), Python string/dict methods, and values printed
//! the way Python prints them (`None`, `True`, `[1, 'a']`).

use crate::python_format::{json_dumps, python_str, JsonDumpsOptions};
use chrono::format::{Item, StrftimeItems};
use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, UndefinedBehavior};
use std::fmt::Write;

/// The message a template passed to `raise_exception`, kept as the error's source so the renderer
/// can tell "the template refused this conversation" (a client error) from a broken template.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RaisedByTemplate(pub String);

/// A fresh environment configured like transformers' `_compile_jinja_template`.
pub fn chat_template_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // jinja2's default Undefined: prints as "", iterates as empty, fails in arithmetic/concatenation.
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    // Prompts are plain text; HTML escaping would corrupt them.
    env.set_auto_escape_callback(|_| AutoEscape::None);
    // Short errors: they end up in HTTP responses, not in a debugger.
    env.set_debug(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        let text = match value.as_str() {
            Some(s) if value.kind() == ValueKind::String => s.to_string(),
            _ => python_str(value)?,
        };
        out.write_str(&text).map_err(|_| Error::new(ErrorKind::WriteFailure, "write failed"))
    });
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// arguments positional or by keyword.
fn tojson(value: Value, args: Rest<Value>) -> Result<Value, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    let mut positional = args.0;
    let kwargs = match positional.last() {
        Some(last) if last.is_kwargs() => Kwargs::try_from(positional.pop().expect("checked"))?,
        _ => Kwargs::from_iter(std::iter::empty::<(&str, Value)>()),
    };
    if positional.len() > NAMES.len() {
        return Err(Error::new(ErrorKind::TooManyArguments, "tojson takes at most 4 arguments"));
    }
    let mut given: [Option<Value>; 4] = Default::default();
    for (slot, name) in given.iter_mut().zip(NAMES) {
        *slot = kwargs.get::<Option<Value>>(name)?;
    }
    for (i, value) in positional.into_iter().enumerate() {
        if given[i].is_some() {
            return Err(Error::new(
                ErrorKind::TooManyArguments,
                format!("tojson got multiple values for argument '{}'", NAMES[i]),
            ));
        }
        given[i] = Some(value);
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = given;

    let options = JsonDumpsOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent: match indent {
            None => None,
            Some(v) if v.is_none() => None,
            Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            // Python: ' ' * n, so a negative width means no indentation but still newlines.
            Some(v) => Some(" ".repeat(i64::try_from(v)?.max(0) as usize)),
        },
        separators: match separators {
            None => None,
            Some(v) if v.is_none() => None,
            Some(v) => {
                let parts: Vec<Value> = v.try_iter()?.collect();
                match parts.as_slice() {
                    [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                        Some((item.to_string(), key.to_string()))
                    }
                    _ => {
                        return Err(Error::new(
                            ErrorKind::InvalidOperation,
                            "tojson: separators must be a pair of strings",
                        ))
                    }
                }
            }
        },
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    json_dumps(&value, &options).map(Value::from)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedByTemplate(message)))
}

/// `datetime.now().strftime(format)`: local time, C strftime directives.
fn strftime_now(format: String) -> Result<Value, Error> {
    let items: Vec<Item> = StrftimeItems::new(&format).collect();
    if items.iter().any(|item| matches!(item, Item::Error)) {
        return Err(Error::new(ErrorKind::InvalidOperation, format!("strftime_now: unsupported format {format:?}")));
    }
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format_with_items(items.iter()))
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: cannot format {format:?}")))?;
    Ok(Value::from(out))
}

/// The `raise_exception` message behind a render error, if that is what stopped the template.
pub fn raised_message(err: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<RaisedByTemplate>() {
            return Some(raised.0.clone());
        }
        source = e.source();
    }
    None
}
