//! Incremental detokenization on the demo tokenizer: the deltas always add up to the full decode
//! (the independent reference is `decode` of the whole sequence), and never show a partial
//! character.

use crate::common;

use common::demo_tokenizer;
use mla_server::detokenizer::IncrementalDetokenizer;
use mla_server::tokenizer::TextTokenizer;

/// Deterministic xorshift64*, so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn stream(tokenizer: &TextTokenizer, ids: &[u32], skip_special_tokens: bool) -> Vec<String> {
    let mut detok = IncrementalDetokenizer::new(skip_special_tokens);
    let mut deltas: Vec<String> = ids.iter().map(|&id| detok.push(tokenizer, id).unwrap()).collect();
    deltas.push(detok.finish(tokenizer).unwrap());
    deltas
}

const MULTIBYTE_TEXTS: [&str; 4] = [
    "Emoji 😀😂🚀 and 👩‍👩‍👧 family, flags 🇫🇷!",
    "你好，世界。日本語のテキストも少しあります。",
    "Café naïve façade — “quotes” ±∞ €",
    "mixed: a😀b你c🚀d\u{10FFFF}e",
];

#[test]
fn multibyte_text_streams_without_broken_characters() {
    let tokenizer = demo_tokenizer();
    for text in MULTIBYTE_TEXTS {
        let ids = tokenizer.encode(text, false).unwrap();
        // The test means something only if single tokens cut characters apart.
        let cut = ids.iter().any(|&id| tokenizer.decode(&[id], false).unwrap().contains('\u{FFFD}'));
        assert!(cut, "{text:?}: no token splits a character");
        let deltas = stream(&tokenizer, &ids, false);
        for delta in &deltas {
            assert!(!delta.contains('\u{FFFD}'), "{text:?}: delta {delta:?} shows a partial character");
        }
        assert_eq!(deltas.concat(), text);
    }
}

#[test]
fn random_token_sequences_add_up_to_the_full_decode() {
    let tokenizer = demo_tokenizer();
    let vocab = tokenizer.vocab_size() as u64;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    // Tokens of multi-byte characters (lead and continuation bytes) make cut characters likely.
    let multibyte_pieces = tokenizer.encode("😀你é🚀", false).unwrap();
    for round in 0..400 {
        let len = 1 + rng.below(40) as usize;
        let ids: Vec<u32> = (0..len)
            .map(|_| match rng.below(3) {
                0 => multibyte_pieces[rng.below(multibyte_pieces.len() as u64) as usize],
                _ => rng.below(vocab) as u32,
            })
            .collect();
        for skip in [false, true] {
            let deltas = stream(&tokenizer, &ids, skip);
            let full = tokenizer.decode(&ids, skip).unwrap();
            assert_eq!(deltas.concat(), full, "round {round}, skip {skip}, ids {ids:?}");
            // Before finish, no delta may end inside a character.
            for delta in &deltas[..deltas.len() - 1] {
                assert!(!delta.ends_with('\u{FFFD}'), "round {round}: {delta:?} ends with a partial character");
            }
        }
    }
}

#[test]
fn special_tokens_are_skipped_or_kept_in_the_stream() {
    let tokenizer = demo_tokenizer();
    let ids = tokenizer.encode("<｜Assistant｜>Hi 😀<｜end▁of▁sentence｜>", false).unwrap();
    assert_eq!(stream(&tokenizer, &ids, true).concat(), "Hi 😀");
    assert_eq!(stream(&tokenizer, &ids, false).concat(), "<｜Assistant｜>Hi 😀<｜end▁of▁sentence｜>");
}

#[test]
fn unfinished_character_is_released_at_finish_as_the_full_decode_shows_it() {
    let tokenizer = demo_tokenizer();
    let emoji = tokenizer.encode("😀", false).unwrap();
    assert!(emoji.len() > 1, "the demo tokenizer splits this emoji");
    let partial = &emoji[..emoji.len() - 1];
    let mut detok = IncrementalDetokenizer::new(false);
    for &id in partial {
        assert_eq!(detok.push(&tokenizer, id).unwrap(), "", "nothing until the character is complete");
    }
    assert_eq!(detok.finish(&tokenizer).unwrap(), tokenizer.decode(partial, false).unwrap());
}
