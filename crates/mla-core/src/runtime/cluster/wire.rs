//! Messages between nodes as frames: a little-endian u32 length, then that many bytes of JSON.
//! JSON because the plans already serialize and a step's plan is small beside its compute;
//! exact for f32 (shortest round-trip decimal).

use serde::de::DeserializeOwned;
use serde::Serialize;
use std::io::{self, Read, Write};

/// Larger frames are refused as corrupt rather than allocated.
const MAX_FRAME: usize = 1 << 30;

pub fn send<T: Serialize>(w: &mut impl Write, msg: &T) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    if body.len() > MAX_FRAME {
        return Err(io::Error::other(format!("a message of {} bytes exceeds the frame limit", body.len())));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)?;
    w.flush()
}

pub fn recv<T: DeserializeOwned>(r: &mut impl Read) -> io::Result<T> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::other(format!("a frame of {len} bytes: the peer is not an mla-serve node")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::other(format!("a malformed message: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_garbage_is_refused() {
        let mut buf = Vec::new();
        send(&mut buf, &(7u32, vec![1.5f32, -0.1, f32::MIN_POSITIVE])).unwrap();
        send(&mut buf, &"next".to_string()).unwrap();
        let mut r = buf.as_slice();
        assert_eq!(recv::<(u32, Vec<f32>)>(&mut r).unwrap(), (7, vec![1.5, -0.1, f32::MIN_POSITIVE]));
        assert_eq!(recv::<String>(&mut r).unwrap(), "next");
        assert!(recv::<String>(&mut r).is_err(), "end of stream");
        let huge = [0xffu8; 8];
        assert!(recv::<String>(&mut huge.as_slice()).unwrap_err().to_string().contains("not an mla-serve node"));
    }
}
