//! `tokenizer_config.json` (and the chat template files next to it), read the way transformers 5
//! reads them.

use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// Named special tokens transformers exposes as template variables when they are set.
pub const NAMED_SPECIAL_TOKENS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

#[derive(Debug, thiserror::Error)]
#[error("{source_name}: {message}")]
pub struct TokenizerConfigError {
    pub source_name: String,
    pub message: String,
}

/// The model's chat template(s): one string, or named templates (the list-of-`{name, template}`
/// form of `tokenizer_config.json`, or `additional_chat_templates/*.jinja`).
#[derive(Debug, Clone, PartialEq, Default)]
pub enum ChatTemplates {
    #[default]
    None,
    Single(String),
    Named(BTreeMap<String, String>),
}

impl ChatTemplates {
    /// transformers' `get_chat_template`: a requested name, else `tool_use` when tools are given
    /// and such a template exists, else `default`.
    pub fn select(&self, name: Option<&str>, has_tools: bool) -> Result<&str, String> {
        match (self, name) {
            (ChatTemplates::None, _) => Err("the model has no chat template".into()),
            (ChatTemplates::Single(t), None) => Ok(t),
            (ChatTemplates::Single(_), Some(n)) => Err(format!("the model has no chat template named {n:?}")),
            (ChatTemplates::Named(map), Some(n)) => {
                map.get(n).map(String::as_str).ok_or_else(|| format!("the model has no chat template named {n:?}"))
            }
            (ChatTemplates::Named(map), None) => {
                let pick = if has_tools && map.contains_key("tool_use") { "tool_use" } else { "default" };
                map.get(pick).map(String::as_str).ok_or_else(|| {
                    format!("the model has several chat templates and none is `default`: {:?}", map.keys())
                })
            }
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct TokenizerConfig {
    /// Set named special tokens in `NAMED_SPECIAL_TOKENS` order: ("bos_token", "<｜begin▁of▁sentence｜>").
    pub special_tokens: Vec<(String, String)>,
    /// Recorded for reference only: transformers 5 ignores both when `tokenizer.json` exists and
    /// lets its post-processor decide, and so do we.
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub clean_up_tokenization_spaces: bool,
    pub chat_templates: ChatTemplates,
    pub model_max_length: Option<u64>,
}

impl TokenizerConfig {
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens.iter().find(|(n, _)| n == name).map(|(_, t)| t.as_str())
    }

    /// Reads `dir/tokenizer_config.json` if present, then lets `chat_template.jinja` and
    /// `additional_chat_templates/*.jinja` override its template, as transformers does.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerConfigError> {
        let path = dir.join("tokenizer_config.json");
        let mut config = if path.exists() {
            let text = read(&path)?;
            Self::from_json_str(&text, &path.display().to_string())?
        } else {
            Self::default()
        };
        let mut files = BTreeMap::new();
        let default_file = dir.join("chat_template.jinja");
        if default_file.exists() {
            files.insert("default".to_string(), read(&default_file)?);
        }
        let extra_dir = dir.join("additional_chat_templates");
        if extra_dir.is_dir() {
            let entries = std::fs::read_dir(&extra_dir).map_err(|e| io_error(&extra_dir, e))?;
            for entry in entries {
                let file = entry.map_err(|e| io_error(&extra_dir, e))?.path();
                if let (Some(stem), Some("jinja")) =
                    (file.file_stem().and_then(|s| s.to_str()), file.extension().and_then(|s| s.to_str()))
                {
                    files.insert(stem.to_string(), read(&file)?);
                }
            }
        }
        if files.len() == 1 && files.contains_key("default") {
            config.chat_templates = ChatTemplates::Single(files.remove("default").expect("checked"));
        } else if !files.is_empty() {
            config.chat_templates = ChatTemplates::Named(files);
        }
        Ok(config)
    }

    pub fn from_json_str(text: &str, source_name: &str) -> Result<Self, TokenizerConfigError> {
        let err = |message: String| TokenizerConfigError { source_name: source_name.into(), message };
        let value: Value = serde_json::from_str(text).map_err(|e| err(format!("not valid JSON: {e}")))?;
        let obj = value.as_object().ok_or_else(|| err("the top level is not an object".into()))?;

        let mut special_tokens = Vec::new();
        for name in NAMED_SPECIAL_TOKENS {
            if let Some(token) = token_content(obj, name).map_err(err)? {
                special_tokens.push((name.to_string(), token));
            }
        }
        let flag = |name: &str| -> Result<Option<bool>, TokenizerConfigError> {
            match obj.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Bool(b)) => Ok(Some(*b)),
                Some(other) => Err(err(format!("`{name}` must be true or false, found {other}"))),
            }
        };
        let chat_templates = match obj.get("chat_template") {
            None | Some(Value::Null) => ChatTemplates::None,
            Some(Value::String(t)) => ChatTemplates::Single(t.clone()),
            Some(Value::Array(items)) => ChatTemplates::Named(named_templates(items).map_err(err)?),
            Some(other) => return Err(err(format!("`chat_template` must be a string or a list, found {other}"))),
        };
        Ok(Self {
            special_tokens,
            add_bos_token: flag("add_bos_token")?,
            add_eos_token: flag("add_eos_token")?,
            // transformers 5's default when the key is absent.
            clean_up_tokenization_spaces: flag("clean_up_tokenization_spaces")?.unwrap_or(false),
            chat_templates,
            model_max_length: obj.get("model_max_length").and_then(Value::as_u64),
        })
    }
}

/// A special token is spelled `"text"` or `{"__type": "AddedToken", "content": "text", ...}`.
fn token_content(obj: &Map<String, Value>, name: &str) -> Result<Option<String>, String> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(format!("`{name}` has no string `content`")),
        },
        Some(other) => Err(format!("`{name}` must be a string or an AddedToken object, found {other}")),
    }
}

fn named_templates(items: &[Value]) -> Result<BTreeMap<String, String>, String> {
    items
        .iter()
        .map(|item| match (item.get("name").and_then(Value::as_str), item.get("template").and_then(Value::as_str)) {
            (Some(name), Some(template)) => Ok((name.to_string(), template.to_string())),
            _ => Err(format!("`chat_template` list entries need string `name` and `template`, found {item}")),
        })
        .collect()
}

fn read(path: &Path) -> Result<String, TokenizerConfigError> {
    std::fs::read_to_string(path).map_err(|e| io_error(path, e))
}

fn io_error(path: &Path, e: std::io::Error) -> TokenizerConfigError {
    TokenizerConfigError { source_name: path.display().to_string(), message: format!("cannot read: {e}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_tokens_in_both_spellings() {
        let config = TokenizerConfig::from_json_str(
            r#"{"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
                "eos_token": "</s>", "pad_token": null, "add_bos_token": true}"#,
            "test",
        )
        .unwrap();
        assert_eq!(
            config.special_tokens,
            vec![("bos_token".into(), "<s>".into()), ("eos_token".into(), "</s>".into())]
        );
        assert_eq!(config.add_bos_token, Some(true));
        assert_eq!(config.add_eos_token, None);
        assert!(!config.clean_up_tokenization_spaces);
    }

    #[test]
    fn named_templates_select_like_transformers() {
        let config = TokenizerConfig::from_json_str(
            r#"{"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}"#,
            "test",
        )
        .unwrap();
        let t = &config.chat_templates;
        assert_eq!(t.select(None, false), Ok("D"));
        assert_eq!(t.select(None, true), Ok("T"));
        assert_eq!(t.select(Some("tool_use"), false), Ok("T"));
        assert!(t.select(Some("rag"), false).is_err());

        let only_tools = ChatTemplates::Named([("tool_use".to_string(), "T".to_string())].into());
        assert!(only_tools.select(None, false).is_err(), "no default and no tools: transformers refuses");
    }

    #[test]
    fn bad_fields_are_named_in_errors() {
        let err = TokenizerConfig::from_json_str(r#"{"add_bos_token": "yes"}"#, "cfg.json").unwrap_err();
        assert!(err.to_string().contains("cfg.json") && err.to_string().contains("add_bos_token"), "{err}");
        let err = TokenizerConfig::from_json_str(r#"{"chat_template": 3}"#, "cfg.json").unwrap_err();
        assert!(err.to_string().contains("chat_template"), "{err}");
    }

    #[test]
    fn template_files_override_the_config_template() {
        let dir = std::env::temp_dir().join(format!("mla-tokcfg-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("additional_chat_templates")).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": "from config"}"#).unwrap();
        let single = TokenizerConfig::from_dir(&dir).unwrap();
        assert_eq!(single.chat_templates, ChatTemplates::Single("from config".into()));

        std::fs::write(dir.join("chat_template.jinja"), "from file\n").unwrap();
        let file = TokenizerConfig::from_dir(&dir).unwrap();
        assert_eq!(file.chat_templates, ChatTemplates::Single("from file\n".into()));

        std::fs::write(dir.join("additional_chat_templates/tool_use.jinja"), "tools").unwrap();
        let named = TokenizerConfig::from_dir(&dir).unwrap();
        assert_eq!(named.chat_templates.select(None, true), Ok("tools"));
        assert_eq!(named.chat_templates.select(None, false), Ok("from file\n"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
