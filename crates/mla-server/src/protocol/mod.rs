//! Wire types: exactly what the OpenAI JSON says, nothing validated yet.
//!
//! Requests are read field group by field group from one parsed `serde_json::Value` (see
//! `parse_fields`), so a type error names its JSON path and unknown fields are ignored.
//! Numbers that must be positive are read as signed integers so that a negative value becomes a
//! validation error naming the field rather than a type error.

pub mod chat;
pub mod common;
pub mod completions;
pub mod extensions;
pub mod ignored_fields;
pub mod models;
pub mod tokenize;

use crate::error::ApiError;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Deserializes one group of fields from a request object, naming the failing path.
pub fn parse_fields<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let param = (path != ".").then_some(path);
        let message = match &param {
            Some(p) => format!("field `{p}`: {}", e.inner()),
            None => format!("invalid request body: {}", e.inner()),
        };
        ApiError::InvalidJson { message, param }
    })
}

/// Seconds since the Unix epoch, for `created`.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A fresh response id such as `chatcmpl-3f9a…`; random so ids from restarts never collide.
pub fn response_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}
