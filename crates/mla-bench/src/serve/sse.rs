//! Splits a server-sent-event stream into its `data:` payloads as bytes arrive; comment lines
//! (`: ping`) and other fields are dropped, as vLLM's client skips them.

#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    pub fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(chunk);
        let mut out = vec![];
        while let Some((event, sep)) = find_event_end(&self.buf) {
            let text = String::from_utf8_lossy(&self.buf[..event]).into_owned();
            self.buf.drain(..event + sep);
            for line in text.lines() {
                if let Some(d) = line.strip_prefix("data:") {
                    out.push(d.trim().to_string());
                }
            }
        }
        out
    }
}

/// The end of the first complete event and the length of its blank-line separator.
fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(c)) => Some(if a.0 < c.0 { a } else { c }),
        (a, c) => a.or(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_chunks() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(p.push(b": 1}\n\ndata: [DONE]\n\n"), vec!["{\"a\": 1}".to_string(), "[DONE]".to_string()]);
        assert_eq!(p.push(b"data: x\r\n\r\n"), vec!["x".to_string()]);
        assert!(p.push(b": ping\n\n").is_empty());
    }
}
