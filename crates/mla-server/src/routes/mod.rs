//! HTTP handlers, one file per endpoint family; `output` holds what they share.

pub mod chat;
pub mod chat_parsed;
pub mod completions;
pub mod info;
pub mod output;
pub mod tokenize;
