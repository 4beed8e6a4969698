//! `stateseal audit verify`: checks an audit log's chain, file by file, and
//! says where it breaks.
//!
//! Each line's MAC is HMAC-SHA256, under the audit chain key of the root
//! key `mac_key` names, over the previous line's MAC and the line's bytes
//! up to its `,"mac":` member. A changed line fails its own MAC; a removed,
//! inserted or reordered line fails the MAC of the line after it, and its
//! `seq` breaks the count. What a chain cannot show is lines cut from its
//! end: the report says whether the log ends with the `stop` line of a
//! clean shutdown, and docs/security.md says how to keep a copy off the
//! host.

use std::path::PathBuf;

use super::{Line, MAC_SUFFIX_LEN};
use crate::domain::keyring::{KeyId, Keyring};

/// What a verification found.
#[derive(Debug, Default)]
pub struct Report {
    pub files: usize,
    pub lines: u64,
    pub first_seq: Option<u64>,
    pub last_seq: Option<u64>,
    /// The first line checked starts the chain (seq 0 over no previous MAC).
    pub genesis: bool,
    /// The last line is the `stop` line of a clean shutdown.
    pub stopped: bool,
    /// Each as `FILE:LINE: what`.
    pub problems: Vec<String>,
}

/// A line and its MAC, or why it is not a complete audit line.
pub fn parse(raw: &[u8]) -> Result<(Line, [u8; 32]), &'static str> {
    if raw.len() <= MAC_SUFFIX_LEN || !raw.starts_with(b"{") {
        return Err("not a complete audit line");
    }
    let suffix = &raw[raw.len() - MAC_SUFFIX_LEN..];
    if !suffix.starts_with(b",\"mac\":\"") || !suffix.ends_with(b"\"}") {
        return Err("not a complete audit line");
    }
    let mac = unhex32(&suffix[8..8 + 64]).ok_or("not a complete audit line")?;
    let line: Line = serde_json::from_slice(raw).map_err(|_| "not an audit line")?;
    Ok((line, mac))
}

fn unhex32(h: &[u8]) -> Option<[u8; 32]> {
    if h.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in h.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

/// Checks `files`, in chain order (rotated files first, as their names
/// sort, then the live file), against the keys of `ring`.
pub fn verify(files: &[PathBuf], ring: &Keyring) -> std::io::Result<Report> {
    let mut r = Report {
        files: files.len(),
        ..Report::default()
    };
    let mut prev: Option<[u8; 32]> = None;
    let mut expect: Option<u64> = None;
    for file in files {
        let bytes = std::fs::read(file)?;
        let mut lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
        if lines.last().is_some_and(|l| l.is_empty()) {
            lines.pop();
        }
        for (i, raw) in lines.into_iter().enumerate() {
            let at = format!("{}:{}", file.display(), i + 1);
            r.lines += 1;
            r.stopped = false;
            let (line, mac) = match parse(raw) {
                Ok(p) => p,
                Err(why) => {
                    r.problems.push(format!(
                        "{at}: {why} (cut by a crash mid-write, or changed)"
                    ));
                    prev = None;
                    continue;
                }
            };
            r.first_seq.get_or_insert(line.seq);
            r.last_seq = Some(line.seq);
            r.stopped = line.event == "stop";
            if let Some(e) = expect {
                if line.seq != e {
                    r.problems.push(format!(
                        "{at}: seq {} where {e} was expected: lines removed, inserted or reordered",
                        line.seq
                    ));
                }
            }
            expect = Some(line.seq + 1);
            let stated = line.prev.as_deref().map(|p| unhex32(p.as_bytes()));
            let chain_prev = match (prev, stated) {
                (_, Some(None)) => {
                    r.problems
                        .push(format!("{at}: its prev member is not a MAC"));
                    prev = Some(mac);
                    continue;
                }
                (Some(p), Some(Some(s))) if p != s => {
                    r.problems.push(format!(
                        "{at}: its prev member differs from the line before: lines removed, \
                         reordered, or from another chain"
                    ));
                    p
                }
                (Some(p), _) => p,
                (None, Some(Some(s))) => {
                    if r.lines == 1 && line.seq == 0 && s == [0u8; 32] {
                        r.genesis = true;
                    }
                    s
                }
                (None, None) => {
                    r.problems.push(format!(
                        "{at}: nothing to check it against: the chain does not start here \
                         (the files before it, or its first lines, are missing)"
                    ));
                    prev = Some(mac);
                    continue;
                }
            };
            let Some(key) = ring.get(KeyId(line.mac_key)) else {
                r.problems.push(format!(
                    "{at}: its chain key (root key {}) is not in this keyset: verify with a \
                     keyset that still holds it",
                    line.mac_key
                ));
                prev = Some(mac);
                continue;
            };
            let body = &raw[..raw.len() - MAC_SUFFIX_LEN];
            if key.audit_keys().chain_mac(&chain_prev, body) != mac {
                r.problems.push(format!(
                    "{at}: MAC does not match: the line was changed, or a line before it \
                     was removed, inserted or reordered"
                ));
            }
            prev = Some(mac);
        }
    }
    Ok(r)
}
