//! mla-server's integration tests, one module per concern (each module's doc says what it
//! checks), in one test binary: `cargo test -p mla-server --test server -- http_errors::` runs
//! one module. `common` is the scripted engine and test server they share.

mod chat_template_fixtures;
mod common;
mod demo_tokenizer;
mod detokenizer;
mod fuzz;
mod http_admission;
mod http_errors;
mod http_finish;
mod http_parsers;
mod http_responses;
mod http_stream;
mod http_tokenize;
mod http_transport;
mod metrics_scrape;
mod output_parsers;
mod prometheus;
mod prompt_size;
mod stop_strings;
