//! Random id sequences through `IncrementalDetokenizer`, checked against the tokenizer's one-shot
//! decode of the whole sequence (the `tokenizers` crate, not the code under test).

use crate::fuzz::values::token_ids;
use crate::fuzz::{config, tokenizer};
use mla_server::detokenizer::IncrementalDetokenizer;
use proptest::prelude::*;

proptest! {
    #![proptest_config(config(1024))]

    /// The module's promise: the deltas of `push` plus `finish` add up to
    /// `decode(ids, skip_special_tokens)` exactly (U+FFFD included where the full decode has
    /// one, e.g. a character cut off by the last token). And it streams: after every token,
    /// whatever the decode of the ids so far holds up to its last complete character has been
    /// released, so a client never waits for text the model has already produced.
    #[test]
    fn deltas_add_up_to_the_whole_decode(ids in token_ids(0..24), skip_special in any::<bool>()) {
        let tokenizer = tokenizer();
        let mut detok = IncrementalDetokenizer::new(skip_special);
        let mut text = String::new();
        for (k, &id) in ids.iter().enumerate() {
            let delta = detok.push(tokenizer, id).unwrap();
            prop_assert!(!delta.ends_with('\u{FFFD}'), "delta {delta:?} may end inside a character");
            text.push_str(&delta);
            let so_far = tokenizer.decode(&ids[..=k], skip_special).unwrap();
            prop_assert!(so_far.starts_with(&text), "released {text:?}, the decode so far is {so_far:?}");
            if !so_far.ends_with('\u{FFFD}') {
                prop_assert_eq!(&text, &so_far, "text held back after token {}", k);
            }
        }
        text.push_str(&detok.finish(tokenizer).unwrap());
        prop_assert_eq!(text, tokenizer.decode(&ids, skip_special).unwrap());
    }
}
