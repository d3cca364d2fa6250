//! `mla-bench grammar-mask`: the CPU cost of structured output per decode step, i.e. of
//! `GrammarConstraint::fill_mask` (llguidance's mask over the whole vocabulary, copied into the
//! engine's bit words), at a batch of 1 and of 64 constrained completions.
//!
//! With `--tokenizer DIR` it uses that model's tokenizer (a DeepSeek-V3 `tokenizer.json`, with
//! `--vocab-size 129280`). Without one it builds a synthetic byte-level BPE vocabulary of V3's
//! size: 128k distinct tokens (all 256 bytes, English-like words with and without a leading
//! space, numbers, punctuation runs, whitespace runs, CJK characters) plus special tokens up to
//! 129,280 ids. Mask cost depends on the vocabulary's trie, so a synthetic one of the same size
//! and kind is a fair stand-in, not an exact one.
//!
//! Each completion walks its grammar by drawing a random allowed token (half the time among the
//! allowed tokens of at most two bytes, so it gets through the JSON structure instead of staying
//! in one string forever) and starts over when the grammar is complete.

use anyhow::Context;
use mla_engine::{TokenConstraint, MASK_BUDGET};
use mla_server::structured::{Grammars, JsonOptions, StructuredOutput};
use mla_server::text::TextPipeline;
use mla_server::tokenizer::TextTokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

pub struct GrammarMaskArgs {
    pub tokenizer: Option<PathBuf>,
    pub vocab_size: usize,
    pub steps: usize,
    pub batches: Vec<usize>,
}

pub fn run(args: &GrammarMaskArgs) -> anyhow::Result<serde_json::Value> {
    let (dir, source) = match &args.tokenizer {
        Some(d) => (d.clone(), format!("tokenizer {}", d.display())),
        None => (synthetic_tokenizer_dir(args.vocab_size)?, "synthetic DeepSeek-V3-sized byte-level vocabulary".into()),
    };
    let tokenizer = TextTokenizer::from_dir(&dir)?;
    if args.tokenizer.is_none() {
        std::fs::remove_dir_all(&dir).ok();
    }
    let text = Arc::new(TextPipeline::new(tokenizer, None)?);
    let eos = text.tokenizer().eos().map(|t| t.id).unwrap_or(1);
    let started = Instant::now();
    let grammars = Grammars::new(text, args.vocab_size, &[eos])?;
    let setup_ms = started.elapsed().as_secs_f64() * 1e3;
    eprintln!("{source}: {} ids, grammar tables built in {setup_ms:.0} ms", args.vocab_size);

    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]
            },
            "active": {"type": "boolean"}
        },
        "required": ["name", "age", "email", "tags", "address", "active"],
        "additionalProperties": false
    });
    let so = StructuredOutput::Json { schema, options: JsonOptions::default() };
    let started = Instant::now();
    let compiled = grammars.compile(&so).map_err(anyhow::Error::msg)?;
    let compile_ms = started.elapsed().as_secs_f64() * 1e3;
    let factory = compiled.factory(vec![eos], 0);
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let words = args.vocab_size.div_ceil(32);

    let mut results = vec![];
    for &batch in &args.batches {
        let mut rngs: Vec<StdRng> = (0..batch).map(|i| StdRng::seed_from_u64(i as u64)).collect();
        let mut cons: Vec<Box<dyn TokenConstraint>> = (0..batch).map(|_| (factory.0)()).collect();
        let mut per_mask_us = Vec::with_capacity(args.steps * batch);
        let mut step_seq_us = Vec::with_capacity(args.steps);
        let mut masks = vec![vec![0u32; words]; batch];
        for _ in 0..args.steps {
            let step = Instant::now();
            for (c, m) in cons.iter_mut().zip(masks.iter_mut()) {
                m.iter_mut().for_each(|w| *w = 0);
                let t = Instant::now();
                c.fill_mask(m, t + MASK_BUDGET).map_err(anyhow::Error::msg)?;
                per_mask_us.push(t.elapsed().as_secs_f64() * 1e6);
            }
            step_seq_us.push(step.elapsed().as_secs_f64() * 1e6);
            advance(&mut cons, &masks, &mut rngs, &grammars, eos, &factory)?;
        }
        // The engine's way at this batch: the masks split over `threads` threads while the
        // forward pass runs (`Scheduler::fill_masks`); here, the same split, timed alone.
        let mut step_par_us = vec![];
        if batch >= 4 && threads > 1 {
            for _ in 0..args.steps.min(50) {
                let per = batch.div_ceil(threads);
                let t = Instant::now();
                std::thread::scope(|s| {
                    let chunks: Vec<_> = cons
                        .chunks_mut(per)
                        .zip(masks.chunks_mut(per))
                        .map(|(cs, ms)| {
                            s.spawn(move || {
                                for (c, m) in cs.iter_mut().zip(ms.iter_mut()) {
                                    m.iter_mut().for_each(|w| *w = 0);
                                    c.fill_mask(m, Instant::now() + MASK_BUDGET)?;
                                }
                                Ok::<(), String>(())
                            })
                        })
                        .collect();
                    chunks.into_iter().try_for_each(|c| c.join().expect("a mask thread panicked"))
                })
                .map_err(anyhow::Error::msg)?;
                step_par_us.push(t.elapsed().as_secs_f64() * 1e6);
                advance(&mut cons, &masks, &mut rngs, &grammars, eos, &factory)?;
            }
        }
        let r = json!({
            "batch": batch,
            "steps": args.steps,
            "mask_us": stats(&mut per_mask_us),
            "step_us_one_thread": stats(&mut step_seq_us),
            "step_us_threads": if step_par_us.is_empty() { json!(null) } else { stats(&mut step_par_us) },
            "threads": threads,
        });
        eprintln!("{r}");
        results.push(r);
    }
    Ok(json!({
        "vocabulary": source,
        "vocab_size": args.vocab_size,
        "grammar_tables_ms": setup_ms,
        "schema_compile_ms": compile_ms,
        "results": results,
    }))
}

fn stats(v: &mut [f64]) -> serde_json::Value {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    json!({"mean": round(mean), "p50": round(at(0.5)), "p90": round(at(0.9)), "p99": round(at(0.99)), "max": round(at(1.0))})
}

fn round(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// A random allowed token: half the time among the allowed tokens of at most two bytes.
/// Draws each completion's next token from its mask and feeds it back; a completion that drew
/// EOS starts over with a fresh constraint, so the batch stays full.
fn advance(
    cons: &mut [Box<dyn TokenConstraint>],
    masks: &[Vec<u32>],
    rngs: &mut [StdRng],
    grammars: &Grammars,
    eos: u32,
    factory: &mla_engine::ConstraintFactory,
) -> anyhow::Result<()> {
    for ((c, m), rng) in cons.iter_mut().zip(masks).zip(rngs.iter_mut()) {
        let token = draw(m, grammars, rng);
        if token == eos {
            *c = (factory.0)();
        } else {
            c.accept(token).map_err(anyhow::Error::msg)?;
        }
    }
    Ok(())
}

fn draw(mask: &[u32], grammars: &Grammars, rng: &mut StdRng) -> u32 {
    let allowed: Vec<u32> = (0..mask.len() as u32 * 32)
        .filter(|&t| mask.get(t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1))
        .collect();
    let trie = grammars.tok_env().tok_trie();
    if rng.random_bool(0.5) {
        let short: Vec<u32> = allowed.iter().copied().filter(|&t| trie.token(t).len() <= 2).collect();
        if !short.is_empty() {
            return short[rng.random_range(0..short.len())];
        }
    }
    allowed[rng.random_range(0..allowed.len())]
}

/// Writes a `tokenizer.json` with a synthetic V3-sized vocabulary (see the module docs) to a
/// temporary directory.
fn synthetic_tokenizer_dir(vocab_size: usize) -> anyhow::Result<PathBuf> {
    const REGULAR: usize = 128_000;
    anyhow::ensure!(vocab_size > REGULAR, "--vocab-size must exceed {REGULAR} for the synthetic vocabulary");
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut seen = HashSet::new();
    let mut vocab: Vec<String> = vec![];
    let mut push = |s: String, vocab: &mut Vec<String>| {
        if seen.insert(s.clone()) {
            vocab.push(s);
        }
    };
    for b in 0..=255u8 {
        push(byte_level(&[b]), &mut vocab);
    }
    for n in 0..1000 {
        push(byte_level(n.to_string().as_bytes()), &mut vocab);
    }
    let letters = "eeeeeeeeeeeettttttttaaaaaaaooooooiiiiiinnnnnnsssssshhhhhhrrrrrddddllllcccuuummwwffggyyppbbvkjxqz";
    let letters: Vec<char> = letters.chars().collect();
    let punct: Vec<char> = "{}[]\":,.;!?()'-_/\\<>=+*&%$#@|`~".chars().collect();
    // Regular ids 3 .. REGULAR (0, 1, 2 are BOS, EOS and padding, as in V3).
    while vocab.len() < REGULAR - 3 {
        let kind = rng.random_range(0..100);
        let s: String = if kind < 80 {
            let len = rng.random_range(2..=10);
            let mut w: String = (0..len).map(|_| letters[rng.random_range(0..letters.len())]).collect();
            if rng.random_bool(0.15) {
                w = w[..1].to_uppercase() + &w[1..];
            }
            if rng.random_bool(0.55) {
                w.insert(0, ' ');
            }
            w
        } else if kind < 88 {
            let len = rng.random_range(1..=3);
            let mut w: String = (0..len).map(|_| punct[rng.random_range(0..punct.len())]).collect();
            if rng.random_bool(0.3) {
                w.insert(0, ' ');
            }
            w
        } else if kind < 90 {
            let len = rng.random_range(1..=16);
            let c = [" ", "\n", "\t", "  "][rng.random_range(0..4)];
            c.repeat(len)
        } else {
            let len = rng.random_range(1..=3);
            (0..len).map(|_| char::from_u32(rng.random_range(0x4E00..0x9FFF)).unwrap_or('中')).collect()
        };
        push(byte_level(s.as_bytes()), &mut vocab);
    }
    let mut model_vocab = serde_json::Map::new();
    for (i, t) in vocab.iter().enumerate() {
        model_vocab.insert(t.clone(), json!(i + 3));
    }
    let mut added = vec![
        json!({"id": 0, "content": "<｜begin▁of▁sentence｜>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
        json!({"id": 1, "content": "<｜end▁of▁sentence｜>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
        json!({"id": 2, "content": "<｜▁pad▁｜>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
    ];
    for id in REGULAR..vocab_size {
        let content = format!("<｜place▁holder▁no▁{}｜>", id - REGULAR);
        added.push(json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": model_vocab, "merges": []}
    });
    let dir = std::env::temp_dir().join(format!("mla-bench-synthetic-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&tokenizer)?).context("writing tokenizer.json")?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "<｜end▁of▁sentence｜>", "bos_token": "<｜begin▁of▁sentence｜>"}"#,
    )?;
    Ok(dir)
}

/// GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 are
/// shifted to U+0100.. in byte order.
fn byte_level(bytes: &[u8]) -> String {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let shifted: Vec<u32> = (0..=255u32).filter(|&b| !printable(b)).collect();
    bytes
        .iter()
        .map(|&b| {
            let b = b as u32;
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                char::from_u32(256 + shifted.iter().position(|&s| s == b).unwrap_or(0) as u32).unwrap_or('?')
            }
        })
        .collect()
}
