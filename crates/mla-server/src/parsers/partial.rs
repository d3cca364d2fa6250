//! Holding back text that may be the start of a marker split across detokenizer deltas.
//!
//! Markers like `</think>` or `<｜tool▁calls▁begin｜>` can arrive over several deltas (a
//! tokenizer without them as single tokens spells them in pieces, and stop strings or UTF-8
//! boundaries can cut a delta anywhere). A parser must not release text that a later delta could
//! turn into a marker, so it keeps the longest tail that is still a possible marker prefix.

/// Bytes at the end of `text` forming a non-empty proper prefix of `marker` (0 if none): the part
/// to hold until the next delta decides whether the marker follows.
pub fn partial_marker_len(text: &str, marker: &str) -> usize {
    let longest = marker.len().saturating_sub(1).min(text.len());
    (1..=longest)
        .rev()
        .find(|&len| {
            let start = text.len() - len;
            text.is_char_boundary(start) && marker.starts_with(&text[start..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::partial_marker_len;

    #[test]
    fn holds_only_real_prefixes() {
        assert_eq!(partial_marker_len("abc</th", "</think>"), 4);
        assert_eq!(partial_marker_len("abc<", "</think>"), 1);
        assert_eq!(partial_marker_len("abc</think>", "</think>"), 0, "a whole marker is found, not held");
        assert_eq!(partial_marker_len("abc</x", "</think>"), 0);
        assert_eq!(partial_marker_len("", "</think>"), 0);
        // Multi-byte marker characters: the tail is cut on a character boundary.
        assert_eq!(partial_marker_len("x<｜tool", "<｜tool▁sep｜>"), "<｜tool".len());
        assert_eq!(partial_marker_len("｜", "<｜tool▁sep｜>"), 0);
    }
}
