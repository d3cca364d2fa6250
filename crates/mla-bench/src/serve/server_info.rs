//! What the benchmark asks the server before it starts: the model (`/v1/models`, as vLLM's
//! `get_first_model_from_server`) and, from mla-serve, the vocabulary size (see `vocab`).

use super::client::Client;
use super::vocab;
use hyper::{Method, StatusCode};
use serde_json::json;

pub struct ModelCard {
    /// The name requests send (`id`).
    pub id: String,
    /// Where the model came from (`root`, vLLM's field; the id when absent): the tokenizer's default.
    pub root: String,
    pub owned_by: String,
}

/// The first model `/v1/models` lists, or `wanted` when given (its card, if listed).
pub async fn model(client: &Client, wanted: Option<&str>) -> anyhow::Result<ModelCard> {
    let listed = client.json(Method::GET, "/v1/models", None).await;
    let cards: Vec<ModelCard> = match &listed {
        Ok((StatusCode::OK, v)) => v["data"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| {
                let id = m["id"].as_str()?.to_string();
                let root = m["root"].as_str().map_or_else(|| id.clone(), str::to_string);
                Some(ModelCard { id, root, owned_by: m["owned_by"].as_str().unwrap_or("").to_string() })
            })
            .collect(),
        _ => vec![],
    };
    if let Some(w) = wanted {
        let card = cards.into_iter().find(|c| c.id == w);
        return Ok(card.unwrap_or(ModelCard { id: w.into(), root: w.into(), owned_by: String::new() }));
    }
    let why = match listed {
        Err(e) => format!("{e:#}"),
        Ok((status, v)) if status != StatusCode::OK => format!("HTTP {status}: {v}"),
        Ok(_) => "it lists no model".into(),
    };
    cards.into_iter().next().ok_or_else(|| {
        anyhow::anyhow!(
            "fetching the model from {}: {why} (is the server up? or pass --model)",
            client.target.url("/v1/models")
        )
    })
}

/// mla-serve's vocabulary size, read from its refusal of an id past any vocabulary. Asked only
/// of mla-serve: another server might not validate ids, and its answer would not parse anyway.
pub async fn vocab_size(client: &Client, card: &ModelCard) -> Option<u32> {
    if card.owned_by != "mla-serve" {
        return None;
    }
    let body = json!({"model": card.id, "prompt": [i32::MAX], "max_tokens": 1});
    let (status, v) = client.json(Method::POST, "/v1/completions", Some(&body)).await.ok()?;
    (status == StatusCode::BAD_REQUEST).then_some(())?;
    vocab::size_from_refusal(v["error"]["message"].as_str()?)
}
