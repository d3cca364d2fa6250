//! CUDA events for timing work on the stream (benchmarks).

use super::{Check, Result};
use cudarc::driver::{result, sys};

pub struct Event(sys::CUevent);

impl Event {
    pub fn new() -> Result<Self> {
        Ok(Event(result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ctx("creating an event")?))
    }

    pub fn record(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the event lives until Drop; the stream is the caller's live stream.
        unsafe { result::event::record(self.0, stream) }.ctx("recording an event")
    }

    /// Milliseconds from `self` to `end` (both recorded and complete).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        // SAFETY: both events live until their Drop.
        unsafe { result::event::synchronize(end.0) }.ctx("waiting for an event")?;
        // SAFETY: both events were recorded and `end` has completed (synchronised above).
        unsafe { result::event::elapsed(self.0, end.0) }.ctx("reading elapsed time")
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroyed once, here.
        unsafe {
            let _ = result::event::destroy(self.0);
        }
    }
}
