//! The step contract between a scheduler and a backend: the plan of one step (`plan`), what a
//! backend is (`backend`: the trait, its KV cache layout, its fatal errors), the largest step it
//! runs (`limits`) and the structured-output masks that ride with a plan (`token_mask`). Plain
//! data on top of the model description; no threads, devices or strings.

pub mod backend;
pub mod limits;
pub mod plan;
pub mod token_mask;
