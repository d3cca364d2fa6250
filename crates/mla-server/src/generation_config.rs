//! The model's `generation_config.json`: sampling defaults its authors chose, which take
//! precedence over OpenAI's defaults (as in vLLM), and extra end-of-sequence tokens.

use serde::Deserialize;
use std::path::Path;

/// Defaults a request falls back to before OpenAI's; `None` when the file does not set them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub max_new_tokens: Option<usize>,
    /// End-of-sequence ids beyond the model config's (V3's file lists its EOS here too).
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct Raw {
    #[serde(default)]
    do_sample: Option<bool>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    max_new_tokens: Option<usize>,
    eos_token_id: Option<EosIds>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum EosIds {
    One(u32),
    Many(Vec<u32>),
}

impl GenerationDefaults {
    /// Reads `dir/generation_config.json`; a missing file means no defaults.
    pub fn from_model_dir(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path)?;
        Self::from_json(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    pub fn from_json(text: &str) -> anyhow::Result<Self> {
        let raw: Raw = serde_json::from_str(text)?;
        // transformers ignores the sampling knobs when do_sample is false: decoding is greedy.
        let greedy = raw.do_sample == Some(false);
        Ok(GenerationDefaults {
            temperature: if greedy { Some(0.0) } else { raw.temperature },
            top_p: if greedy { None } else { raw.top_p },
            top_k: if greedy { None } else { raw.top_k },
            min_p: if greedy { None } else { raw.min_p },
            repetition_penalty: raw.repetition_penalty,
            max_new_tokens: raw.max_new_tokens,
            eos_token_ids: match raw.eos_token_id {
                None => vec![],
                Some(EosIds::One(t)) => vec![t],
                Some(EosIds::Many(v)) => v,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_deepseek_v3_file() {
        let d = GenerationDefaults::from_json(
            r#"{"_from_model_config": true, "bos_token_id": 0, "eos_token_id": 1, "do_sample": true,
                "temperature": 0.6, "top_p": 0.95, "transformers_version": "4.46.3"}"#,
        )
        .unwrap();
        assert_eq!(d.temperature, Some(0.6));
        assert_eq!(d.top_p, Some(0.95));
        assert_eq!(d.eos_token_ids, vec![1]);
        assert_eq!(d.max_new_tokens, None);
    }

    #[test]
    fn do_sample_false_means_greedy() {
        let d = GenerationDefaults::from_json(r#"{"do_sample": false, "temperature": 0.7, "eos_token_id": [5, 6]}"#)
            .unwrap();
        assert_eq!(d.temperature, Some(0.0));
        assert_eq!(d.eos_token_ids, vec![5, 6]);
    }
}
