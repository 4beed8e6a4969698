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
    /// The last line's MAC: with `last_seq`, the anchor to verify what is
    /// written after it (`--after SEQ:MAC`).
    pub last_mac: Option<[u8; 32]>,
    /// `start` lines after a run that did not end with `stop` (a crash, a
    /// `kill -9` — or lines cut from that run's end): `FILE:LINE`.
    pub unclean_restarts: Vec<String>,
    /// `skipped` lines: a restart that found lines at the log's end that
    /// did not verify and chained on from the last line that did
    /// (`FILE:LINE: what`).
    pub skipped_at_restart: Vec<String>,
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

/// 64 lowercase hex digits, as the writer writes them (nothing else: a MAC
/// has one spelling).
pub fn unhex32(h: &[u8]) -> Option<[u8; 32]> {
    if h.len() != 64 || !h.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
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
/// sort, then the live file), against the keys of `ring`. Without `after`,
/// the chain must start at its beginning (seq 0); with `after` (a seq and
/// its line's MAC, from a verified copy), right after it.
pub fn verify(
    files: &[PathBuf],
    ring: &Keyring,
    after: Option<(u64, [u8; 32])>,
) -> std::io::Result<Report> {
    let mut r = Report {
        files: files.len(),
        ..Report::default()
    };
    let mut prev: Option<[u8; 32]> = after.map(|(_, mac)| mac);
    let mut expect: Option<u64> = match after {
        Some((seq, _)) => Some(seq.saturating_add(1)),
        None => Some(0),
    };
    // The last line whose MAC verified (or the anchor), and the seq after
    // it: kept across lines that cannot be parsed or do not verify, so a
    // planted or changed line never resets the chain, and a line after it
    // that chains on from the last good one (a restart skipping a planted
    // tail, or the line after an inserted one) is checked against it.
    let mut good: Option<([u8; 32], Option<u64>)> = prev.map(|p| (p, expect));
    let mut after_bad = false;
    let mut last_event = String::from("stop");
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
                    // The chain goes on from the last good line: the next
                    // one must verify against it.
                    r.problems.push(format!(
                        "{at}: {why} (cut by a crash mid-write, or changed)"
                    ));
                    after_bad = true;
                    continue;
                }
            };
            r.first_seq.get_or_insert(line.seq);
            r.last_seq = Some(line.seq);
            r.last_mac = Some(mac);
            r.stopped = line.event == "stop";
            if line.event == "start" && r.lines > 1 && last_event != "stop" {
                r.unclean_restarts.push(at.clone());
            }
            last_event.clone_from(&line.event);
            if line.event == "skipped" {
                r.skipped_at_restart.push(format!(
                    "{at}: the restart above skipped {} line(s) at the end of the log that did \
                     not verify ({})",
                    line.count.unwrap_or(0),
                    line.reason.as_deref().unwrap_or("no detail")
                ));
            }
            let stated = line.prev.as_deref().map(|p| unhex32(p.as_bytes()));
            // Where this line may chain on from: the line before, or (after
            // one that failed) the last good line.
            let rejoin = good.filter(|(g, _)| after_bad && Some(*g) != prev);
            let key = ring.get(KeyId(line.mac_key));
            let body = &raw[..raw.len() - MAC_SUFFIX_LEN];
            let verifies = |from: &[u8; 32]| {
                key.as_ref()
                    .is_some_and(|k| k.audit_keys().chain_mac(from, body) == mac)
            };
            let mut rejoined = false;
            // Problems of the chain and the MAC, reported after the seq's.
            let mut later = Vec::new();
            let chain_prev = match (prev, stated) {
                (_, Some(None)) => {
                    later.push(format!("{at}: its prev member is not a MAC"));
                    None
                }
                (Some(p), Some(Some(s))) if p != s => {
                    if rejoin.is_some_and(|(g, _)| g == s) {
                        rejoined = true;
                        Some(s)
                    } else {
                        later.push(format!(
                            "{at}: its prev member differs from the line before: lines removed, \
                             reordered, or from another chain"
                        ));
                        Some(p)
                    }
                }
                (Some(p), _) => Some(p),
                (None, Some(Some(s))) => {
                    if r.lines == 1 && line.seq == 0 && s == [0u8; 32] && after.is_none() {
                        r.genesis = true;
                    }
                    Some(s)
                }
                (None, None) => {
                    later.push(format!(
                        "{at}: nothing to check it against: the chain does not start here \
                         (the files before it, or its first lines, are missing)"
                    ));
                    None
                }
            };
            // The MAC first, to know where the line chains on from; its
            // problem is reported after the seq's.
            let mut ok = false;
            if let Some(from) = chain_prev {
                if key.is_none() {
                    later.push(format!(
                        "{at}: its chain key (root key {}) is not in this keyset: verify with a \
                         keyset that still holds it",
                        line.mac_key
                    ));
                } else if verifies(&from) {
                    ok = true;
                } else if rejoin.is_some_and(|(g, _)| !rejoined && verifies(&g)) {
                    // Chained on from the last good line: the line(s)
                    // between were inserted (each already reported).
                    rejoined = true;
                    ok = true;
                } else {
                    later.push(format!(
                        "{at}: MAC does not match: the line was changed, or a line before it \
                         was removed, inserted or reordered"
                    ));
                }
            }
            let want = if rejoined {
                rejoin.and_then(|(_, e)| e)
            } else {
                expect
            };
            if let Some(e) = want {
                if line.seq != e {
                    r.problems.push(if r.lines == 1 && after.is_none() {
                        format!(
                            "{at}: the chain does not start here (seq {}): the lines or files \
                             before it are missing (to check a log whose earlier files were \
                             removed, give --after SEQ:MAC of the line before, from a \
                             verified copy)",
                            line.seq
                        )
                    } else {
                        format!(
                            "{at}: seq {} where {e} was expected: lines removed, inserted or \
                             reordered",
                            line.seq
                        )
                    });
                }
            }
            r.problems.extend(later);
            expect = line.seq.checked_add(1);
            if expect.is_none() {
                r.problems.push(format!("{at}: seq at its largest value"));
            }
            prev = Some(mac);
            if ok || good.is_none() {
                good = Some((mac, expect));
            }
            after_bad = !ok;
        }
    }
    Ok(r)
}
