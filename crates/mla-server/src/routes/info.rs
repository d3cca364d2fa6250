//! The read-only endpoints: `/v1/models`, `/health`, `/metrics`.

use crate::error::ApiError;
use crate::metrics;
use crate::protocol::models::{ModelCard, ModelList};
use crate::state::AppState;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::Arc;

fn card(state: &AppState, name: &str) -> ModelCard {
    ModelCard {
        id: name.to_string(),
        object: "model",
        created: state.started,
        owned_by: "mla-serve",
        root: state.model_root.clone(),
        parent: None,
        max_model_len: state.limits.max_model_len,
    }
}

pub async fn list_models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    let names = std::iter::once(&state.model_name).chain(&state.model_aliases);
    Json(ModelList { object: "list", data: names.map(|n| card(&state, n)).collect() })
}

pub async fn get_model(
    State(state): State<Arc<AppState>>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<ModelCard>, ApiError> {
    // A percent-encoded id that is not UTF-8 is the client's error, answered like the others.
    let Path(id) = id.map_err(|e| ApiError::invalid("model", format!("the model id in the path is invalid: {e}")))?;
    state.check_model(Some(&id))?;
    Ok(Json(card(&state, &id)))
}

/// 200 with an empty body while the server accepts requests (vLLM's convention); 503 with the
/// reason once the engine died (a rank, its thread, a step past the watchdog) or while it
/// drains for shutdown, so a load balancer stops sending traffic that would be refused.
pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.engine.fatal_error() {
        Some(why) => ApiError::Unavailable(why).into_response(),
        None if state.engine.is_shutting_down() => ApiError::ShuttingDown.into_response(),
        None => axum::http::StatusCode::OK.into_response(),
    }
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let text = metrics::render(&state.model_name, &state.metrics, &state.engine.stats(), state.connections.get());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}
