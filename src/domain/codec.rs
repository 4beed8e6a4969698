//! Bounds-checked reading and writing of the binary formats (the token
//! header and the reservation), as rustls's `Codec` and `Reader`: every
//! read names how many bytes it takes, a short input is an error and never
//! a panic, and each format's fields are written and read in one place.

/// A cursor over received bytes.
pub struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, at: 0 }
    }

    /// The next `n` bytes, or `None` (and nothing taken) if fewer are left.
    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let out = self.buf.get(self.at..end)?;
        self.at = end;
        Some(out)
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    pub fn u8(&mut self) -> Option<u8> {
        self.array::<1>().map(|[b]| b)
    }

    pub fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_be_bytes)
    }

    pub fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_be_bytes)
    }

    pub fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_be_bytes)
    }

    /// Bytes read so far.
    pub fn used(&self) -> usize {
        self.at
    }
}

/// A fixed-layout part of a format: written and read by the same type.
pub trait Codec: Sized {
    /// Appends the encoding to `out`.
    fn encode(&self, out: &mut Vec<u8>);
    /// Reads one from `r`; `None` when the bytes are short or not valid.
    fn read(r: &mut Reader<'_>) -> Option<Self>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_big_endian_fields_and_refuses_short_input() {
        let bytes = [1u8, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 4, 9];
        let mut r = Reader::new(&bytes);
        assert_eq!(r.u8(), Some(1));
        assert_eq!(r.u16(), Some(2));
        assert_eq!(r.u32(), Some(3));
        assert_eq!(r.u64(), Some(4));
        assert_eq!(r.used(), 15);
        assert_eq!(r.u16(), None, "one byte left: a u16 is refused");
        assert_eq!(r.used(), 15, "a refused read takes nothing");
        assert_eq!(r.take(1), Some(&[9u8][..]));
        assert_eq!(r.take(0), Some(&[][..]));
        assert_eq!(r.u8(), None);
        assert_eq!(Reader::new(&[]).take(usize::MAX), None);
    }
}
