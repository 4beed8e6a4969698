//! A streaming RFC 8785 (JSON Canonicalization Scheme) canonicalizer whose
//! memory is O(input) with a small constant: no tree of values is built.
//!
//! The parser writes each value's canonical form straight into one output
//! buffer. An object's members are written in input order and indexed (three
//! `u32` offsets per member, on one stack shared by every nesting level);
//! when the object closes, its members are re-emitted in RFC 8785 order
//! (UTF-16 code units of the decoded keys) only if they were out of order.
//! Peak memory is bounded by the output (no longer than the input but for
//! numbers, which may write more than they spell: `1e20` is 21 digits), the
//! member index (12 bytes per member of the objects still open) and one
//! copy of the object being reordered — a few times the input, never the
//! ~100× of a `serde_json::Value` tree.
//!
//! Refused as [`CanonError::Malformed`]: anything that is not exactly one
//! JSON text (RFC 8259), duplicate keys in an object (two parsers that keep
//! different duplicates would disagree on what was bound), lone surrogates,
//! numbers a double cannot hold (RFC mode only), nesting deeper than
//! [`MAX_DEPTH`], and an object member that would end past 4 GiB of
//! output.

use std::borrow::Cow;
use std::cmp::Ordering;

/// Deepest nesting of arrays and objects accepted.
pub const MAX_DEPTH: usize = 128;

/// How numbers are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NumberMode {
    /// RFC 8785 exactly: every number becomes an IEEE-754 double, written
    /// as ECMAScript writes it. Lossy past 2^53; numbers beyond the double
    /// range are refused.
    Rfc8785,
    /// Exact (binding profile v2): a number whose value is exactly the
    /// value of the double ECMAScript would print for it is written in RFC
    /// 8785 form; any other number is written in the exact form
    /// `[-]DIGITS` `E` `EXPONENT` (significant digits without leading or
    /// trailing zeros, a capital `E`, a decimal exponent with `-` when
    /// negative), which ECMAScript never produces. So two different numeric
    /// values never share a form, and no valid JSON number is refused.
    Exact,
}

/// Why input was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CanonError {
    /// Not one well-formed JSON text under the rules above.
    Malformed,
}

/// The canonical form of the JSON text `json`.
pub fn canonicalize(json: &str, mode: NumberMode) -> Result<Vec<u8>, CanonError> {
    canonicalize_top(json, mode, &[])
}

/// The canonical form of `json`, which must be an object, without the
/// top-level members named in `skip` (their values are still checked).
pub fn canonicalize_object_without(
    json: &str,
    mode: NumberMode,
    skip: &[&str],
) -> Result<Vec<u8>, CanonError> {
    let start = skip_ws(json.as_bytes(), 0);
    if json.as_bytes().get(start) != Some(&b'{') {
        return Err(CanonError::Malformed);
    }
    canonicalize_top(json, mode, skip)
}

/// Canonical forms of the values of the named top-level members of the
/// object `json` (each `None` when absent), every member checked and
/// duplicates refused. Used by the binding profile's allowlist.
pub fn object_members(
    json: &str,
    mode: NumberMode,
    names: &[&str],
) -> Result<Vec<Option<Vec<u8>>>, CanonError> {
    let b = json.as_bytes();
    let mut p = Parser::new(b, mode, &[]);
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return Err(CanonError::Malformed);
    }
    i += 1;
    let mut found: Vec<Option<Vec<u8>>> = vec![None; names.len()];
    // Every key, decoded; duplicates are looked for once the object ends
    // (sorted, so a large object costs O(n log n), not O(n²)).
    let mut seen: Vec<Cow<'_, str>> = Vec::new();
    i = skip_ws(b, i);
    if b.get(i) == Some(&b'}') {
        i += 1;
    } else {
        loop {
            i = skip_ws(b, i);
            let (key, next) = p.decode_string(i)?;
            i = skip_ws(b, next);
            if b.get(i) != Some(&b':') {
                return Err(CanonError::Malformed);
            }
            i = skip_ws(b, i + 1);
            let slot = names.iter().position(|n| *n == key);
            p.out.clear();
            i = p.value(i, 1)?;
            if let Some(slot) = slot {
                // A copy, so the buffer keeps its capacity for the next value.
                found[slot] = Some(p.out.clone());
            }
            seen.push(key);
            i = skip_ws(b, i);
            match b.get(i) {
                Some(b',') => i += 1,
                Some(b'}') => {
                    i += 1;
                    break;
                }
                _ => return Err(CanonError::Malformed),
            }
        }
    }
    if skip_ws(b, i) != b.len() {
        return Err(CanonError::Malformed);
    }
    seen.sort_unstable();
    if seen.windows(2).any(|w| w[0] == w[1]) {
        return Err(CanonError::Malformed);
    }
    Ok(found)
}

fn canonicalize_top(json: &str, mode: NumberMode, skip: &[&str]) -> Result<Vec<u8>, CanonError> {
    let b = json.as_bytes();
    let mut p = Parser::new(b, mode, skip);
    let i = skip_ws(b, 0);
    let i = p.value(i, 0)?;
    if skip_ws(b, i) != b.len() {
        return Err(CanonError::Malformed);
    }
    Ok(p.out)
}

/// One object member in the output: `[start, key_end)` is the canonical
/// key string (with quotes), `[key_end + 1, end)` the canonical value.
#[derive(Clone, Copy)]
struct Member {
    start: u32,
    key_end: u32,
    end: u32,
}

/// An output offset as a [`Member`] holds it. A canonical form longer
/// than 4 GiB is refused: a number can write more than the input spelled
/// (`1e20` is 21 digits), so no bound on the input keeps every offset in a
/// `u32`.
fn offset(n: usize) -> Result<u32, CanonError> {
    u32::try_from(n).map_err(|_| CanonError::Malformed)
}

struct Parser<'a> {
    b: &'a [u8],
    mode: NumberMode,
    /// Top-level members to leave out.
    skip: &'a [&'a str],
    out: Vec<u8>,
    members: Vec<Member>,
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while let Some(c) = b.get(i) {
        match c {
            b' ' | b'\t' | b'\n' | b'\r' => i += 1,
            _ => break,
        }
    }
    i
}

impl<'a> Parser<'a> {
    fn new(b: &'a [u8], mode: NumberMode, skip: &'a [&'a str]) -> Self {
        Parser {
            b,
            mode,
            skip,
            // The canonical form is never longer than the input, except for
            // escapes RFC 8785 spells longer (a control character written raw
            // can't occur in valid JSON) and numbers: reserve the input size.
            out: Vec::with_capacity(b.len().min(1 << 20)),
            members: Vec::new(),
        }
    }

    /// Parses the value at `i` (no leading whitespace), writes its
    /// canonical form, returns the index after it.
    fn value(&mut self, i: usize, depth: usize) -> Result<usize, CanonError> {
        match self.b.get(i) {
            Some(b'{') => self.object(i, depth + 1),
            Some(b'[') => self.array(i, depth + 1),
            Some(b'"') => {
                let (s, next) = self.decode_string(i)?;
                write_string(&mut self.out, &s);
                Ok(next)
            }
            Some(b't') => self.literal(i, b"true"),
            Some(b'f') => self.literal(i, b"false"),
            Some(b'n') => self.literal(i, b"null"),
            Some(b'-' | b'0'..=b'9') => self.number(i),
            _ => Err(CanonError::Malformed),
        }
    }

    fn literal(&mut self, i: usize, word: &[u8]) -> Result<usize, CanonError> {
        if self.b.get(i..i + word.len()) == Some(word) {
            self.out.extend_from_slice(word);
            Ok(i + word.len())
        } else {
            Err(CanonError::Malformed)
        }
    }

    fn array(&mut self, mut i: usize, depth: usize) -> Result<usize, CanonError> {
        if depth > MAX_DEPTH {
            return Err(CanonError::Malformed);
        }
        self.out.push(b'[');
        i = skip_ws(self.b, i + 1);
        if self.b.get(i) == Some(&b']') {
            self.out.push(b']');
            return Ok(i + 1);
        }
        loop {
            i = self.value(i, depth)?;
            i = skip_ws(self.b, i);
            match self.b.get(i) {
                Some(b',') => {
                    self.out.push(b',');
                    i = skip_ws(self.b, i + 1);
                }
                Some(b']') => {
                    self.out.push(b']');
                    return Ok(i + 1);
                }
                _ => return Err(CanonError::Malformed),
            }
        }
    }

    fn object(&mut self, mut i: usize, depth: usize) -> Result<usize, CanonError> {
        if depth > MAX_DEPTH {
            return Err(CanonError::Malformed);
        }
        let top = depth == 1;
        let first_member = self.members.len();
        let obj_start = self.out.len();
        self.out.push(b'{');
        i = skip_ws(self.b, i + 1);
        if self.b.get(i) == Some(&b'}') {
            self.out.push(b'}');
            return Ok(i + 1);
        }
        loop {
            if self.b.get(i) != Some(&b'"') {
                return Err(CanonError::Malformed);
            }
            if self.members.len() > first_member {
                self.out.push(b',');
            }
            let start = self.out.len();
            let (key, next) = self.decode_string(i)?;
            write_string(&mut self.out, &key);
            let key_end = self.out.len();
            i = skip_ws(self.b, next);
            if self.b.get(i) != Some(&b':') {
                return Err(CanonError::Malformed);
            }
            self.out.push(b':');
            i = skip_ws(self.b, i + 1);
            i = self.value(i, depth)?;
            let drop_it = top && self.skip.contains(&&*key);
            if drop_it {
                // Checked, but left out. Still counts for duplicates.
                self.out.truncate(key_end);
            }
            self.members.push(Member {
                start: offset(start)?,
                key_end: offset(key_end)?,
                end: offset(self.out.len())?,
            });
            i = skip_ws(self.b, i);
            match self.b.get(i) {
                Some(b',') => i = skip_ws(self.b, i + 1),
                Some(b'}') => {
                    i += 1;
                    break;
                }
                _ => return Err(CanonError::Malformed),
            }
        }
        self.finish_object(obj_start, first_member)?;
        Ok(i)
    }

    /// Sorts the members written since `first_member` into RFC 8785 order,
    /// refuses duplicates, drops skipped members, adds commas, closes.
    fn finish_object(&mut self, obj_start: usize, first_member: usize) -> Result<(), CanonError> {
        let out = &self.out;
        let key = |m: &Member| &out[m.start as usize..m.key_end as usize];
        let members = &mut self.members[first_member..];
        let in_order = members
            .windows(2)
            .all(|w| compare_keys(key(&w[0]), key(&w[1])) == Ordering::Less);
        let any_skipped = members.iter().any(|m| m.end == m.key_end);
        if !in_order || any_skipped {
            members.sort_unstable_by(|a, b| compare_keys(key(a), key(b)));
            if members
                .windows(2)
                .any(|w| compare_keys(key(&w[0]), key(&w[1])) == Ordering::Equal)
            {
                return Err(CanonError::Malformed);
            }
            // Re-emit the members in order from a copy of the object's bytes.
            let base = obj_start + 1;
            let region = out[base..].to_vec();
            self.out.truncate(base);
            let mut n = 0;
            for m in &self.members[first_member..] {
                if m.end == m.key_end {
                    continue; // skipped
                }
                if n > 0 {
                    self.out.push(b',');
                }
                n += 1;
                self.out
                    .extend_from_slice(&region[m.start as usize - base..m.end as usize - base]);
            }
        }
        self.out.push(b'}');
        self.members.truncate(first_member);
        Ok(())
    }

    /// Decodes the string starting at the quote at `i`: borrowed from the
    /// input when it holds no escape.
    fn decode_string(&self, i: usize) -> Result<(Cow<'a, str>, usize), CanonError> {
        let b: &'a [u8] = self.b;
        if b.get(i) != Some(&b'"') {
            return Err(CanonError::Malformed);
        }
        // A run of plain characters (the input is a &str, so any run
        // between ASCII delimiters is valid UTF-8), and where it ends.
        let run = |start: usize| -> Result<(&'a str, usize), CanonError> {
            let mut end = start;
            while b.get(end).is_some_and(|&c| plain_in_string(c)) {
                end += 1;
            }
            let text = std::str::from_utf8(&b[start..end]).map_err(|_| CanonError::Malformed)?;
            Ok((text, end))
        };
        let (first, mut j) = run(i + 1)?;
        if b.get(j) == Some(&b'"') {
            return Ok((Cow::Borrowed(first), j + 1));
        }
        let mut s = String::from(first);
        loop {
            match b.get(j) {
                Some(b'"') => return Ok((Cow::Owned(s), j + 1)),
                Some(b'\\') => {
                    let esc = b.get(j + 1).ok_or(CanonError::Malformed)?;
                    j += 2;
                    match esc {
                        b'"' => s.push('"'),
                        b'\\' => s.push('\\'),
                        b'/' => s.push('/'),
                        b'b' => s.push('\u{8}'),
                        b'f' => s.push('\u{c}'),
                        b'n' => s.push('\n'),
                        b'r' => s.push('\r'),
                        b't' => s.push('\t'),
                        b'u' => {
                            let hi = hex4(b, j)?;
                            j += 4;
                            let c = if (0xD800..0xDC00).contains(&hi) {
                                if b.get(j) != Some(&b'\\') || b.get(j + 1) != Some(&b'u') {
                                    return Err(CanonError::Malformed); // lone high surrogate
                                }
                                let lo = hex4(b, j + 2)?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return Err(CanonError::Malformed);
                                }
                                j += 6;
                                0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                            } else if (0xDC00..0xE000).contains(&hi) {
                                return Err(CanonError::Malformed); // lone low surrogate
                            } else {
                                hi
                            };
                            s.push(char::from_u32(c).ok_or(CanonError::Malformed)?);
                        }
                        _ => return Err(CanonError::Malformed),
                    }
                    let (text, end) = run(j)?;
                    s.push_str(text);
                    j = end;
                }
                // End of input, or a raw control character.
                _ => return Err(CanonError::Malformed),
            }
        }
    }

    fn number(&mut self, i: usize) -> Result<usize, CanonError> {
        let b = self.b;
        let mut j = i;
        let negative = b.get(j) == Some(&b'-');
        if negative {
            j += 1;
        }
        let int_start = j;
        match b.get(j) {
            Some(b'0') => j += 1,
            Some(b'1'..=b'9') => {
                while matches!(b.get(j), Some(b'0'..=b'9')) {
                    j += 1;
                }
            }
            _ => return Err(CanonError::Malformed),
        }
        let int_end = j;
        let (mut frac_start, mut frac_end) = (j, j);
        if b.get(j) == Some(&b'.') {
            j += 1;
            frac_start = j;
            while matches!(b.get(j), Some(b'0'..=b'9')) {
                j += 1;
            }
            frac_end = j;
            if frac_end == frac_start {
                return Err(CanonError::Malformed);
            }
        }
        let mut exp_text: &[u8] = b"";
        let mut exp_negative = false;
        if matches!(b.get(j), Some(b'e' | b'E')) {
            j += 1;
            match b.get(j) {
                Some(b'+') => j += 1,
                Some(b'-') => {
                    exp_negative = true;
                    j += 1;
                }
                _ => {}
            }
            let s = j;
            while matches!(b.get(j), Some(b'0'..=b'9')) {
                j += 1;
            }
            if j == s {
                return Err(CanonError::Malformed);
            }
            exp_text = &b[s..j];
        }
        // An integer of at most 15 digits is a double exactly, and both
        // modes write it as ECMAScript does: its digits (-0 as 0).
        if frac_start == frac_end && exp_text.is_empty() && int_end - int_start <= 15 {
            let digits = &b[int_start..int_end];
            if negative && digits != b"0" {
                self.out.push(b'-');
            }
            self.out.extend_from_slice(digits);
            return Ok(j);
        }
        let text = std::str::from_utf8(&b[i..j]).map_err(|_| CanonError::Malformed)?;
        let double: f64 = text.parse().map_err(|_| CanonError::Malformed)?;
        match self.mode {
            NumberMode::Rfc8785 => {
                if !double.is_finite() {
                    return Err(CanonError::Malformed);
                }
                write_es_number(&mut self.out, double);
            }
            NumberMode::Exact => {
                let exact = Decimal::from_parts(
                    negative,
                    &b[int_start..int_end],
                    &b[frac_start..frac_end],
                    exp_negative,
                    exp_text,
                );
                let round_trips = double.is_finite() && {
                    let mut es = ryu_js::Buffer::new();
                    let es = es.format_finite(double);
                    exact.same_value_as_es(es)
                };
                if round_trips {
                    write_es_number(&mut self.out, double);
                } else {
                    exact.write_exact(&mut self.out);
                }
            }
        }
        Ok(j)
    }
}

fn hex4(b: &[u8], i: usize) -> Result<u32, CanonError> {
    let digits = b.get(i..i + 4).ok_or(CanonError::Malformed)?;
    let mut v = 0u32;
    for &d in digits {
        let x = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            b'A'..=b'F' => d - b'A' + 10,
            _ => return Err(CanonError::Malformed),
        };
        v = v * 16 + u32::from(x);
    }
    Ok(v)
}

/// RFC 8785 §3.2.2.2: `"` and `\` escaped, the short escapes for
/// \b \t \n \f \r, other controls as \u00xx (lower-case hex), everything
/// else as is.
fn write_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut run = 0;
    for (i, &c) in bytes.iter().enumerate() {
        if plain_in_string(c) {
            continue;
        }
        out.extend_from_slice(&bytes[run..i]);
        run = i + 1;
        match c {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x09 => out.extend_from_slice(b"\\t"),
            0x0a => out.extend_from_slice(b"\\n"),
            0x0c => out.extend_from_slice(b"\\f"),
            0x0d => out.extend_from_slice(b"\\r"),
            // The other control characters (all that is left).
            c => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(c >> 4)]);
                out.push(HEX[usize::from(c & 0xf)]);
            }
        }
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

/// A byte that stands for itself inside a JSON string, read or written: not
/// the quote, not the backslash, not a control character.
fn plain_in_string(c: u8) -> bool {
    c != b'"' && c != b'\\' && c >= 0x20
}

/// Compares two canonical key strings (with quotes) by the UTF-16 code
/// units of the strings they spell (RFC 8785 §3.2.3).
fn compare_keys(a: &[u8], b: &[u8]) -> Ordering {
    // Without escapes the bytes between the quotes are the key's UTF-8,
    // whose byte order is code point order. That is UTF-16 order too unless
    // a code point above U+FFFF (lead byte 0xF0-0xF4) is involved.
    let plain = |k: &[u8]| !k.iter().any(|&c| c == b'\\' || c >= 0xF0);
    if plain(a) && plain(b) {
        return a[1..a.len() - 1].cmp(&b[1..b.len() - 1]);
    }
    let (a, b) = (unescape_canonical(a), unescape_canonical(b));
    a.encode_utf16().cmp(b.encode_utf16())
}

/// Decodes a key as [`write_string`] wrote it.
fn unescape_canonical(k: &[u8]) -> std::borrow::Cow<'_, str> {
    let inner = &k[1..k.len() - 1];
    // write_string only ever writes valid UTF-8.
    let s = std::str::from_utf8(inner).unwrap_or_default();
    if !s.contains('\\') {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('b') => out.push('\u{8}'),
            Some('t') => out.push('\t'),
            Some('n') => out.push('\n'),
            Some('f') => out.push('\u{c}'),
            Some('r') => out.push('\r'),
            Some('u') => {
                let h: String = chars.by_ref().take(4).collect();
                let v = u32::from_str_radix(h.get(2..).unwrap_or_default(), 16).unwrap_or(0);
                out.push(char::from_u32(v).unwrap_or('\0'));
            }
            Some(other) => out.push(other),
            None => {}
        }
    }
    std::borrow::Cow::Owned(out)
}

fn write_es_number(out: &mut Vec<u8>, v: f64) {
    if v == 0.0 {
        out.push(b'0'); // -0 too (RFC 8785 §3.2.2.3)
        return;
    }
    let mut buf = ryu_js::Buffer::new();
    out.extend_from_slice(buf.format_finite(v).as_bytes());
}

/// A decimal number, exactly: sign, significant digits (no leading or
/// trailing zeros; empty for zero) and the power of ten of the last digit.
#[derive(Debug, PartialEq, Eq)]
struct Decimal {
    negative: bool,
    digits: Vec<u8>,
    /// Decimal digits of the exponent, sign apart (arbitrary size).
    exponent: BigExp,
}

/// A signed integer of any size, as sign and decimal digits.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BigExp {
    negative: bool,
    /// Without leading zeros; empty for zero.
    digits: Vec<u8>,
}

impl BigExp {
    fn parse(negative: bool, text: &[u8]) -> Self {
        let digits: Vec<u8> = text
            .iter()
            .skip_while(|d| **d == b'0')
            .map(|d| d - b'0')
            .collect();
        BigExp {
            negative: negative && !digits.is_empty(),
            digits,
        }
    }

    /// `self + delta` for a small `delta`.
    fn add(&self, delta: i64) -> Self {
        // Work in i128 when it fits; otherwise the magnitude is so far past
        // any delta (< 2^63) that digit-wise adjustment is needed.
        if self.digits.len() <= 30 {
            let mut v: i128 = 0;
            for d in &self.digits {
                v = v * 10 + i128::from(*d);
            }
            if self.negative {
                v = -v;
            }
            let r = v + i128::from(delta);
            let digits: Vec<u8> = if r == 0 {
                Vec::new()
            } else {
                r.unsigned_abs()
                    .to_string()
                    .bytes()
                    .map(|c| c - b'0')
                    .collect()
            };
            return BigExp {
                negative: r < 0,
                digits,
            };
        }
        // |self| ≥ 10^30 > |delta|: the sign stays; add or subtract |delta|
        // from the magnitude digit by digit.
        let grow = self.negative == delta.is_negative();
        let mut mag = self.digits.clone();
        let mut carry = delta.unsigned_abs() as u128;
        for d in mag.iter_mut().rev() {
            if carry == 0 {
                break;
            }
            let c = (carry % 10) as i32;
            carry /= 10;
            let mut v = i32::from(*d) + if grow { c } else { -c };
            if v >= 10 {
                v -= 10;
                carry += 1;
            } else if v < 0 {
                v += 10;
                carry += 1;
            }
            *d = v as u8;
        }
        // What is left of the carry goes in front: digits only when
        // growing, otherwise a 0, which the trim of leading zeros removes.
        let mut all: Vec<u8> = carry.to_string().bytes().map(|c| c - b'0').collect();
        all.extend_from_slice(&mag);
        let first = all.iter().position(|d| *d != 0).unwrap_or(all.len());
        BigExp {
            negative: self.negative,
            digits: all[first..].to_vec(),
        }
    }
}

impl Decimal {
    fn from_parts(negative: bool, int: &[u8], frac: &[u8], exp_negative: bool, exp: &[u8]) -> Self {
        let all: Vec<u8> = int.iter().chain(frac).map(|d| d - b'0').collect();
        let lead = all.iter().position(|d| *d != 0).unwrap_or(all.len());
        let trail = all[lead..].iter().rev().take_while(|d| **d == 0).count();
        let digits = all[lead..all.len() - trail].to_vec();
        if digits.is_empty() {
            return Decimal {
                negative: false,
                digits,
                exponent: BigExp::parse(false, b""),
            };
        }
        // value = 0.DIGITS… → the last kept digit sits at
        // exp - len(frac) + trailing zeros removed.
        let shift = trail as i64 - frac.len() as i64;
        Decimal {
            negative,
            digits,
            exponent: BigExp::parse(exp_negative, exp).add(shift),
        }
    }

    /// Whether ECMAScript's text `es` (from `ryu_js`) has exactly this value.
    fn same_value_as_es(&self, es: &str) -> bool {
        let p = NumberParts::split(es.as_bytes());
        // -0 and 0 are the same value (RFC 8785 writes both as 0).
        p.decimal() == *self
    }

    fn write_exact(&self, out: &mut Vec<u8>) {
        if self.negative {
            out.push(b'-');
        }
        out.extend(self.digits.iter().map(|d| d + b'0'));
        out.push(b'E');
        if self.exponent.negative {
            out.push(b'-');
        }
        if self.exponent.digits.is_empty() {
            out.push(b'0');
        } else {
            out.extend(self.exponent.digits.iter().map(|d| d + b'0'));
        }
    }
}

/// A number's text in its parts: sign, integer and fraction digits,
/// exponent sign and digits (`e` or `E`; no validation).
struct NumberParts<'a> {
    negative: bool,
    int: &'a [u8],
    frac: &'a [u8],
    exp_negative: bool,
    exp: &'a [u8],
    /// Whether a `.` and an exponent marker were present.
    has_point: bool,
    has_exp: bool,
}

impl<'a> NumberParts<'a> {
    fn split(t: &'a [u8]) -> Self {
        let (negative, t) = match t.split_first() {
            Some((b'-', rest)) => (true, rest),
            _ => (false, t),
        };
        let (mantissa, exp_negative, exp, has_exp) =
            match t.iter().position(|c| matches!(c, b'e' | b'E')) {
                Some(e) => {
                    let (m, rest) = (&t[..e], &t[e + 1..]);
                    match rest.split_first() {
                        Some((b'-', x)) => (m, true, x, true),
                        Some((b'+', x)) => (m, false, x, true),
                        _ => (m, false, rest, true),
                    }
                }
                None => (t, false, &b""[..], false),
            };
        let (int, frac, has_point) = match mantissa.iter().position(|c| *c == b'.') {
            Some(p) => (&mantissa[..p], &mantissa[p + 1..], true),
            None => (mantissa, &b""[..], false),
        };
        NumberParts {
            negative,
            int,
            frac,
            exp_negative,
            exp,
            has_point,
            has_exp,
        }
    }

    fn decimal(&self) -> Decimal {
        Decimal::from_parts(
            self.negative,
            self.int,
            self.frac,
            self.exp_negative,
            self.exp,
        )
    }
}

/// A JSON number's exact value: what the answer filter compares schema
/// bounds and integer-ness on (never a double, which would let
/// `9007199254740993` pass `maximum: 9007199254740992`).
#[derive(Debug, PartialEq, Eq)]
pub struct ExactNumber(Decimal);

impl ExactNumber {
    /// Parses a JSON number's text (RFC 8259 grammar); `None` otherwise.
    pub fn parse(text: &str) -> Option<Self> {
        let p = NumberParts::split(text.as_bytes());
        let digits = |d: &[u8]| d.iter().all(u8::is_ascii_digit);
        let int_ok = !p.int.is_empty() && digits(p.int) && (p.int.len() == 1 || p.int[0] != b'0');
        let frac_ok = digits(p.frac) && (!p.has_point || !p.frac.is_empty());
        let exp_ok = digits(p.exp) && (!p.has_exp || !p.exp.is_empty());
        if !(int_ok && frac_ok && exp_ok) {
            return None;
        }
        Some(ExactNumber(p.decimal()))
    }

    /// Whether the value is a whole number (`1.0` and `1e2` are).
    pub fn is_integer(&self) -> bool {
        self.0.digits.is_empty() || !self.0.exponent.negative
    }

    /// The power of ten of the leading digit plus one: the magnitude order.
    fn order(&self) -> BigExp {
        self.0.exponent.add(self.0.digits.len() as i64)
    }
}

impl BigExp {
    fn cmp_value(&self, other: &BigExp) -> std::cmp::Ordering {
        use std::cmp::Ordering;
        match (self.negative, other.negative) {
            (false, true) => Ordering::Greater,
            (true, false) => Ordering::Less,
            (neg, _) => {
                let mag = self
                    .digits
                    .len()
                    .cmp(&other.digits.len())
                    .then_with(|| self.digits.cmp(&other.digits));
                if neg {
                    mag.reverse()
                } else {
                    mag
                }
            }
        }
    }
}

impl Ord for ExactNumber {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        use std::cmp::Ordering;
        let sign = |n: &ExactNumber| match (n.0.digits.is_empty(), n.0.negative) {
            (true, _) => 0,
            (false, true) => -1,
            (false, false) => 1,
        };
        let (sa, sb) = (sign(self), sign(other));
        if sa != sb || sa == 0 {
            return sa.cmp(&sb);
        }
        // Same sign, both non-zero: by magnitude order, then digit by digit
        // from the leading one (a missing digit is a zero).
        let mag = self.order().cmp_value(&other.order()).then_with(|| {
            let n = self.0.digits.len().max(other.0.digits.len());
            (0..n)
                .map(|i| {
                    let a = self.0.digits.get(i).copied().unwrap_or(0);
                    let b = other.0.digits.get(i).copied().unwrap_or(0);
                    a.cmp(&b)
                })
                .find(|o| *o != Ordering::Equal)
                .unwrap_or(Ordering::Equal)
        });
        // Both negative: the larger magnitude is the smaller number.
        if self.0.negative {
            mag.reverse()
        } else {
            mag
        }
    }
}

impl PartialOrd for ExactNumber {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_numbers_compare_by_value() {
        let n = |s: &str| ExactNumber::parse(s).unwrap();
        assert!(n("9007199254740993") > n("9007199254740992"));
        assert!(n("100.0000000000000001") > n("100"));
        assert!(!n("100.0000000000000001").is_integer());
        assert!(n("1e2").is_integer() && n("1.0").is_integer() && n("-0").is_integer());
        assert_eq!(n("1e2"), n("100.00"));
        assert_eq!(n("-0.0"), n("0"));
        assert!(n("-1") < n("0") && n("-2") < n("-1") && n("-1e-999") > n("-1e-998"));
        // Opposite signs decide alone, whatever the magnitudes; zeros are equal.
        assert!(n("-1") < n("1") && n("1") > n("-1") && n("-5") < n("3e-9"));
        assert!(n("0") < n("1e-999") && n("0") > n("-1e-999") && n("0") > n("-7"));
        assert_eq!(n("0").cmp(&n("-0.0")), std::cmp::Ordering::Equal);
        assert!(n("1e99999999999999999999999") > n("9e99999999999999999999998"));
        assert!(n("0.1") < n("0.10000000000000000001"));
        assert!(n("12") > n("9.99") && n("0.012") < n("0.1"));
        for bad in ["", "-", "01", "1.", ".5", "1e", "+1", "0x1", "1e+", "NaN"] {
            assert!(ExactNumber::parse(bad).is_none(), "{bad}");
        }
    }

    fn c(s: &str) -> String {
        String::from_utf8(canonicalize(s, NumberMode::Rfc8785).unwrap()).unwrap()
    }
    fn x(s: &str) -> String {
        String::from_utf8(canonicalize(s, NumberMode::Exact).unwrap()).unwrap()
    }

    #[test]
    fn sorts_by_utf16_and_escapes() {
        assert_eq!(c(r#"{"b":1,"a":2}"#), r#"{"a":2,"b":1}"#);
        assert_eq!(c(r#"{ "a" : [ 1 , 2 ] }"#), r#"{"a":[1,2]}"#);
        // U+10000 (surrogates D800 DC00) sorts before U+FFFF in UTF-16.
        assert_eq!(
            c("{\"\u{ffff}\":1,\"\u{10000}\":2}"),
            "{\"\u{10000}\":2,\"\u{ffff}\":1}"
        );
        assert_eq!(c(r#""\u0041\/\u001f\n""#), r#""A/\u001f\n""#);
    }

    #[test]
    fn refuses_what_it_must() {
        for bad in [
            r#"{"a":1,"a":2}"#,
            r#"{"b":1,"a":2,"b":3}"#,
            r#""\ud800""#,
            r#""\udc00x""#,
            "[1,]",
            "01",
            "1.",
            "-",
            "1e",
            "{} {}",
            "",
            "nul",
            "\"a\u{1}\"",
            "1e400",
        ] {
            assert_eq!(
                canonicalize(bad, NumberMode::Rfc8785),
                Err(CanonError::Malformed),
                "{bad:?}"
            );
        }
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert!(canonicalize(&deep, NumberMode::Rfc8785).is_err());
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(canonicalize(&ok, NumberMode::Rfc8785).is_ok());
        // A high surrogate whose next escape is not `\u`, though a `u` and
        // a low surrogate's digits follow: refused.
        assert!(canonicalize(r#"["\uD800xuDC00"]"#, NumberMode::Rfc8785).is_err());
        assert!(canonicalize(r#"["\uD800\uDC00"]"#, NumberMode::Rfc8785).is_ok());
        // Objects hold at the same depth.
        let objects = |n: usize| format!("{}1{}", r#"{"a":"#.repeat(n), "}".repeat(n));
        assert!(canonicalize(&objects(MAX_DEPTH), NumberMode::Rfc8785).is_ok());
        assert!(canonicalize(&objects(MAX_DEPTH + 1), NumberMode::Rfc8785).is_err());
    }

    #[test]
    fn big_exponents_add_as_integers_do() {
        // Past 30 digits `add` works digit by digit (carries, borrows, a
        // new leading digit, leading zeros trimmed); up to 38 digits an
        // i128 checks it.
        let big = |v: i128| BigExp::parse(v < 0, v.unsigned_abs().to_string().as_bytes());
        let e30 = 10i128.pow(30);
        for magnitude in [
            e30,
            e30 + 5,
            10 * e30 - 1,
            10i128.pow(37),
            12_345_678_901_234_567_890_123_456_789_012_345,
            10i128.pow(38) - 1,
        ] {
            for v in [magnitude, -magnitude] {
                assert!(big(v).digits.len() > 30);
                for delta in [0, 1, -1, 9, -9, 10, -10, 11, -11, 99, -99, 1000, -1000]
                    .into_iter()
                    .chain([i64::MAX, -i64::MAX, i64::MIN])
                {
                    assert_eq!(
                        big(v).add(delta),
                        big(v + i128::from(delta)),
                        "{v} + {delta}"
                    );
                }
            }
        }
    }

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn member_offsets_past_u32_are_refused_not_truncated() {
        assert_eq!(offset(0), Ok(0));
        assert_eq!(offset(u32::MAX as usize), Ok(u32::MAX));
        assert_eq!(offset(u32::MAX as usize + 1), Err(CanonError::Malformed));
    }

    #[test]
    fn exact_numbers_never_collide() {
        let pairs = [
            ("9007199254740993", "9007199254740992"),
            ("1e20", "100000000000000000001"),
            ("18446744073709551615", "18446744073709551616"),
            ("1", "1.00000000000000001"),
            ("1e400", "1e401"),
            ("-1e400", "1e400"),
            ("1e-400", "0"),
        ];
        for (a, b) in pairs {
            assert_ne!(x(a), x(b), "{a} vs {b}");
        }
        // Same values, other spellings.
        for (a, b) in [
            ("1.0", "1"),
            ("10e-1", "1"),
            ("-0", "0"),
            ("0.1", "1e-1"),
            ("9007199254740993", "9007199254740993.000"),
            ("1e400", "10e399"),
            (
                "123e100000000000000000000000000000000000",
                "1230e99999999999999999999999999999999999",
            ),
        ] {
            assert_eq!(x(a), x(b), "{a} vs {b}");
        }
        assert_eq!(x("9007199254740993"), "9007199254740993E0");
        assert_eq!(x("1e400"), "1E400");
        assert_eq!(x("1.00000000000000001"), "100000000000000001E-17");
        assert_eq!(x("4.50"), "4.5");
        assert_eq!(x("1e21"), "1e+21");
        assert_eq!(x("0.000001"), "0.000001");
    }

    #[test]
    fn skipping_top_level_members() {
        let out = canonicalize_object_without(
            r#"{"z":1,"_meta":{"a":[1]},"a":2}"#,
            NumberMode::Rfc8785,
            &["_meta"],
        )
        .unwrap();
        assert_eq!(out, br#"{"a":2,"z":1}"#);
        // A skipped member still counts for duplicates.
        assert!(canonicalize_object_without(
            r#"{"_meta":1,"_meta":2}"#,
            NumberMode::Rfc8785,
            &["_meta"]
        )
        .is_err());
        assert!(canonicalize_object_without("[1]", NumberMode::Rfc8785, &[]).is_err());
    }

    #[test]
    fn members() {
        let m = object_members(
            r#"{"name":"t","arguments":{"b":1,"a":2},"x":[1]}"#,
            NumberMode::Exact,
            &["name", "arguments", "uri"],
        )
        .unwrap();
        assert_eq!(m[0].as_deref(), Some(&br#""t""#[..]));
        assert_eq!(m[1].as_deref(), Some(&br#"{"a":2,"b":1}"#[..]));
        assert_eq!(m[2], None);
        assert!(object_members(r#"{"x":1,"x":1}"#, NumberMode::Exact, &["x"]).is_err());
        // A duplicate spelled with an escape is still a duplicate, and one
        // among many members is found too.
        assert!(object_members(r#"{"x":1,"\u0078":2}"#, NumberMode::Exact, &[]).is_err());
        let many: Vec<String> = (0..200).map(|i| format!("\"k{i}\":{i}")).collect();
        let dup = format!("{{{},\"k7\":0}}", many.join(","));
        assert!(object_members(&dup, NumberMode::Exact, &[]).is_err());
        assert!(object_members(&format!("{{{}}}", many.join(",")), NumberMode::Exact, &[]).is_ok());
        // An empty object (with space after it) has none of the members;
        // anything after it is refused.
        for empty in ["{}", " { } "] {
            let m = object_members(empty, NumberMode::Exact, &["name"]).unwrap();
            assert_eq!(m, vec![None], "{empty:?}");
        }
        assert!(object_members("{}x", NumberMode::Exact, &["name"]).is_err());
    }

    /// The shortcuts (strings without escapes borrowed and copied as runs,
    /// keys compared as bytes, short integers copied) give what the general
    /// paths give at each of their edges.
    #[test]
    fn shortcuts_agree_with_the_general_paths() {
        // Integers: -0 is 0; 15 digits copied; 16 and more through the double.
        assert_eq!(c("-0"), "0");
        assert_eq!(x("-0"), "0");
        assert_eq!(c("[0,-7,999999999999999]"), "[0,-7,999999999999999]");
        assert_eq!(c("9999999999999999"), "10000000000000000");
        assert_eq!(x("9999999999999999"), "9999999999999999E0");
        assert_eq!(c("-123456789012345"), "-123456789012345");
        // Byte order is UTF-16 order below U+10000, also past ASCII...
        assert_eq!(
            c("{\"\u{e000}\":1,\"\u{7ff}\":2,\"z\":3}"),
            "{\"z\":3,\"\u{7ff}\":2,\"\u{e000}\":1}"
        );
        // ...and a prefix sorts first.
        assert_eq!(c(r#"{"ab":1,"a":2}"#), r#"{"a":2,"ab":1}"#);
        // A key with an escape against one without.
        assert_eq!(c(r#"{"b":1,"\u0061":2}"#), r#"{"a":2,"b":1}"#);
        assert_eq!(c(r#"{"a\n":1,"a":2}"#), r#"{"a":2,"a\n":1}"#);
        // Escapes written around runs of plain characters.
        assert_eq!(c(r#""ab\"cd\\ef\u0001g""#), r#""ab\"cd\\ef\u0001g""#);
    }
}
