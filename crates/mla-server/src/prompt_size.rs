//! Refusing a prompt that cannot fit the context before paying for tokenizing all of it.
//!
//! Tokenizing costs time and memory in proportion to the text (a 31 MB prompt took 39 s and
//! 6.5 GB), while a prompt that fits the context has at most `max_model_len` tokens. So a text
//! far longer than that many tokens usually take is counted piece by piece, and counting stops
//! as soon as it is clearly over: the work done is bounded by the context, not by the text.
//!
//! Pieces are cut after whitespace, where the tokenizer's pre-tokenizer splits anyway, so the
//! sum of the pieces' counts is the whole text's count up to a few tokens at each cut; a slack
//! per cut keeps a prompt that fits from being refused.

use crate::tokenizer::{TextTokenizer, TokenizerError};

/// Below this many bytes per allowed token a text is tokenized whole: it cannot cost more than
/// a few full contexts' worth. (Tokens average 3 to 5 bytes of text.)
const WHOLE_BYTES_PER_TOKEN: usize = 8;
/// Bytes per counted piece: large enough to amortise the tokenizer's per-call cost, small
/// enough that its working memory stays in megabytes.
const PIECE_BYTES: usize = 64 << 10;
/// How far back from the piece end a whitespace cut is looked for.
const CUT_SEARCH_BYTES: usize = 1024;
/// Tokens a cut may add or remove versus tokenizing across it.
const SLACK_PER_CUT: usize = 8;

/// `Some(n)` when `text` has more than `limit` tokens (`n`, a count reached so far, exceeds it);
/// `None` when it may fit, after which the caller tokenizes it whole.
pub fn clearly_exceeds(tokenizer: &TextTokenizer, text: &str, limit: usize) -> Result<Option<usize>, TokenizerError> {
    if text.len() <= limit.saturating_mul(WHOLE_BYTES_PER_TOKEN) {
        return Ok(None);
    }
    let (mut counted, mut cuts, mut rest) = (0usize, 0usize, text);
    while !rest.is_empty() {
        let piece = &rest[..cut_point(rest)];
        counted += tokenizer.encode(piece, false)?.len();
        cuts += 1;
        if counted > limit + cuts * SLACK_PER_CUT {
            return Ok(Some(counted - cuts * SLACK_PER_CUT));
        }
        rest = &rest[piece.len()..];
    }
    Ok(None)
}

/// Where the next piece of `text` ends: after the last whitespace within `CUT_SEARCH_BYTES` of
/// `PIECE_BYTES`, else at the character boundary there; the whole text if it is short.
fn cut_point(text: &str) -> usize {
    if text.len() <= PIECE_BYTES {
        return text.len();
    }
    let mut end = PIECE_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let window = &text.as_bytes()[end.saturating_sub(CUT_SEARCH_BYTES)..end];
    match window.iter().rposition(u8::is_ascii_whitespace) {
        // Cut before the whitespace: byte-level BPE tokenizers attach a space to the next word.
        Some(i) if end - window.len() + i > 0 => end - window.len() + i,
        _ => end,
    }
}

#[cfg(test)]
mod tests {
    use super::cut_point;

    #[test]
    fn cuts_fall_before_whitespace_or_on_a_character_boundary() {
        let text = format!("{} tail", "a".repeat(super::PIECE_BYTES));
        assert_eq!(cut_point(&text), super::PIECE_BYTES);
        assert_eq!(cut_point("short text"), 10);
        let words = "word ".repeat(20_000);
        let cut = cut_point(&words);
        assert!(cut <= super::PIECE_BYTES && words.as_bytes()[cut] == b' ', "{cut}");
        let wide = "é".repeat(super::PIECE_BYTES);
        assert!(wide.is_char_boundary(cut_point(&wide)));
    }
}
