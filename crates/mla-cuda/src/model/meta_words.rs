//! Typed sections of a step's metadata: the array of 32-bit words every kernel of a step reads
//! besides weights, cache and activations. A `Section<T>` names where `len` values of `T` sit,
//! so a kernel wrapper gets a `DSlice<T>` of the right element type and length instead of a word
//! offset and a hand-computed width.

use crate::gpu::DSlice;
use crate::ops::SampleParamsRaw;
use std::marker::PhantomData;
use std::ops::Range;

/// Plain data that may be stored in the metadata words and read by a kernel as `T`.
///
/// # Safety
/// Implementors are `repr(C)` (or primitive), have no padding bytes and no invalid bit patterns,
/// their size is a multiple of 4 bytes and their alignment at most 8.
pub unsafe trait MetaValue: Copy + 'static {}

// SAFETY: a primitive of 4 bytes.
unsafe impl MetaValue for i32 {}
// SAFETY: a primitive of 8 bytes; holds device addresses.
unsafe impl MetaValue for u64 {}
// SAFETY: repr(C), 64 bytes: eight 4-byte fields, a u64, six 4-byte fields; no padding (its
// definition asserts the size).
unsafe impl MetaValue for SampleParamsRaw {}

/// Words one value of `T` takes.
pub const fn words_of<T: MetaValue>() -> usize {
    std::mem::size_of::<T>() / 4
}

/// `len` values of `T` starting at word `off` (aligned for `T`) of a step's metadata.
#[derive(Debug, PartialEq, Eq)]
pub struct Section<T> {
    pub off: usize,
    pub len: usize,
    _t: PhantomData<T>,
}

impl<T> Clone for Section<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Section<T> {}

impl<T: MetaValue> Section<T> {
    /// The words the section covers.
    pub fn words(&self) -> Range<usize> {
        self.off..self.off + self.len * words_of::<T>()
    }

    /// Values `start .. start + len` of the section (a mixed step's prompt or decode rows).
    pub fn sub(&self, start: usize, len: usize) -> Section<T> {
        assert!(start + len <= self.len, "values {start}..{} of a section of {}", start + len, self.len);
        Section { off: self.off + start * words_of::<T>(), len, _t: PhantomData }
    }

    /// The section in the device copy of the words.
    ///
    /// Panics when the words do not cover the section (a caller passing another step's words).
    pub fn on<'a>(&self, words: DSlice<'a, i32>) -> DSlice<'a, T> {
        let w = words.sub(self.off, self.len * words_of::<T>());
        assert!(w.ptr.is_multiple_of(std::mem::align_of::<T>() as u64), "metadata section misaligned");
        // SAFETY: the words cover `len` values of `T` (sub checked the range), the address is
        // aligned for `T` (asserted), and `T: MetaValue` may be read from any bit pattern.
        unsafe { w.reinterpret::<T>(self.len) }
    }

    /// The values of the section in host words (tests).
    pub fn read(&self, words: &[i32]) -> Vec<T> {
        words[self.words()].chunks_exact(words_of::<T>()).map(from_words::<T>).collect()
    }
}

/// The words of one value.
pub fn to_words<T: MetaValue>(v: &T) -> &[i32] {
    // SAFETY: T has no padding and a size that is a multiple of 4 (MetaValue), and i32 needs less
    // alignment than T, so its bytes are exactly size_of::<T>() / 4 initialised i32s.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<i32>(), words_of::<T>()) }
}

fn from_words<T: MetaValue>(w: &[i32]) -> T {
    assert_eq!(w.len(), words_of::<T>());
    // SAFETY: exactly size_of::<T>() bytes are read (possibly unaligned), and every bit pattern is
    // a valid T (MetaValue).
    unsafe { std::ptr::read_unaligned(w.as_ptr().cast::<T>()) }
}

/// The metadata words being built: sections are appended, each aligned for its type.
pub struct Arena {
    pub words: Vec<i32>,
}

impl Arena {
    /// A zeroed section of `len` values of `T`.
    pub fn section<T: MetaValue>(&mut self, len: usize) -> Section<T> {
        let align = std::mem::align_of::<T>() / 4;
        let off = self.words.len().next_multiple_of(align.max(1));
        self.words.resize(off + len * words_of::<T>(), 0);
        Section { off, len, _t: PhantomData }
    }

    /// A section holding `values`.
    pub fn push<T: MetaValue>(&mut self, values: &[T]) -> Section<T> {
        let s = self.section::<T>(values.len());
        for (i, v) in values.iter().enumerate() {
            self.set(s, i, v);
        }
        s
    }

    /// Value `i` of section `s`.
    pub fn set<T: MetaValue>(&mut self, s: Section<T>, i: usize, v: &T) {
        assert!(i < s.len, "value {i} of a section of {}", s.len);
        let w = s.off + i * words_of::<T>();
        self.words[w..w + words_of::<T>()].copy_from_slice(to_words(v));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_aligned_and_round_trip() {
        let mut a = Arena { words: vec![7] };
        let ints = a.push(&[1i32, 2]);
        // Two words after one: the u64 skips word 3 to start at an even word.
        let addr = a.push(&[0x1122_3344_5566_7788u64]);
        let params = SampleParamsRaw { temperature: 0.5, top_k: 3, seed: 99, pen_end: 4, ..Default::default() };
        let p = a.push(&[params, SampleParamsRaw::default()]);
        assert_eq!((ints.off, ints.len, addr.off, p.off), (1, 2, 4, 6));
        assert_eq!(a.words[3], 0, "the alignment gap is zeroed");
        assert_eq!(words_of::<SampleParamsRaw>(), 16);
        assert_eq!(a.words.len(), 6 + 32);
        assert_eq!(ints.read(&a.words), vec![1, 2]);
        assert_eq!(addr.read(&a.words), vec![0x1122_3344_5566_7788]);
        assert_eq!(p.read(&a.words)[0], params);
        assert_eq!(p.words(), 6..38);
    }
}
