pub mod error;
pub mod generation_config;
pub mod protocol;
pub mod sse;
pub mod validate;
pub mod metrics;
pub mod extract;
