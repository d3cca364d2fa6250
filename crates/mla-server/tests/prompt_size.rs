//! `prompt_size::clearly_exceeds` with the demo tokenizer: it refuses only prompts that really
//! are over the limit, and decides a huge one from a bounded prefix.

use crate::common;

use common::demo_tokenizer;
use mla_server::prompt_size::clearly_exceeds;
use rand::{Rng, SeedableRng};

/// Words of random letters and lengths, with the odd newline and multibyte character.
fn random_text(rng: &mut rand::rngs::StdRng, bytes: usize) -> String {
    let mut text = String::with_capacity(bytes + 16);
    while text.len() < bytes {
        let len = rng.random_range(1..12);
        text.extend((0..len).map(|_| rng.random_range(b'a'..=b'z') as char));
        text.push(match rng.random_range(0..20) {
            0 => '\n',
            1 => 'é',
            _ => ' ',
        });
    }
    text
}

#[test]
fn never_refuses_a_prompt_that_fits() {
    let tokenizer = demo_tokenizer();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for bytes in [10_000, 100_000, 300_000] {
        let text = random_text(&mut rng, bytes);
        let real = tokenizer.encode(&text, false).unwrap().len();
        // Limits just above, at and just below the real count, and far below it.
        for limit in [real + 1, real, real.saturating_sub(1), real / 2, 100] {
            match clearly_exceeds(&tokenizer, &text, limit).unwrap() {
                Some(counted) => {
                    assert!(real > limit, "refused {real} tokens at limit {limit}");
                    assert!(counted > limit && counted <= real + 64, "counted {counted}, real {real}");
                }
                // Deciding is allowed to fall back to whole tokenization near the limit only.
                None => assert!(real <= limit * 2 || bytes <= limit * 8, "{real} tokens passed limit {limit}"),
            }
        }
    }
}

#[test]
fn a_huge_prompt_is_decided_from_its_beginning() {
    let tokenizer = demo_tokenizer();
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    let head = random_text(&mut rng, 200_000);
    // 30 MB of text: tokenizing it whole would take seconds and gigabytes; the answer must come
    // from the first pieces. The tail is one unbroken "word" that would be costly to tokenize.
    let huge = head + &"x".repeat(30 << 20);
    let counted = clearly_exceeds(&tokenizer, &huge, 1000).unwrap().expect("over the limit");
    assert!(counted < 200_000, "counted {counted} tokens: it read past the first pieces");
}
