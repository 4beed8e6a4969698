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
    /// `skipped` lines: a restart that found lines that did not verify
    /// (before the chain's first line, or at its end) and chained on from
    /// the last line in the chain
    /// (`FILE:LINE: what`).
    pub skipped_at_restart: Vec<String>,
    /// Each as `FILE:LINE: what`.
    pub problems: Vec<String>,
}

/// Opens `p` to read if it is a regular file, not through a symbolic link,
/// without waiting (a FIFO's open would).
pub(crate) fn open_regular(p: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(
            rustix::fs::OFlags::NONBLOCK.bits() as i32 | rustix::fs::OFlags::NOFOLLOW.bits() as i32,
        )
        .open(p)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::other(format!(
            "{}: not a regular file",
            p.display()
        )));
    }
    Ok(f)
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
    // The last line in the chain (or the anchor): its MAC and the seq after
    // it. Kept across lines that cannot be parsed or do not verify, so a
    // planted or changed line never resets the chain and a line after it
    // (a restart skipping a planted tail, or the line after an inserted
    // one) is checked against it. Only a line that verifies against it,
    // with the next seq, takes its place: never one that merely chains on
    // from a line that failed (a planted line can carry any MAC, so a
    // copied run of old genuine lines verifies among itself).
    let mut good: Option<([u8; 32], Option<u64>)> =
        after.map(|(seq, mac)| (mac, Some(seq.saturating_add(1))));
    // Until a line verifies, nothing is known good: the chain is followed
    // line by line from where the files start, each line reported.
    let mut anchored = after.is_some();
    // The last complete line: its MAC, its seq and the seq after it.
    let mut last: Option<([u8; 32], u64, Option<u64>)> = None;
    // Lines in a row that chain on from the line before, which is not in
    // the chain: one problem (its index) for the run, from its first line.
    let mut run: Option<(usize, String, u64)> = None;
    let mut last_event = String::from("stop");
    for file in files {
        // Line by line (one over 1 MiB is not an audit line, and is not held
        // whole), from a regular file only: a FIFO or a link to a device
        // planted among the files must not hang or exhaust verify.
        let mut reader = std::io::BufReader::new(open_regular(file)?);
        let mut buf = Vec::new();
        let mut i = 0usize;
        while let Some((len, _)) = super::next_line(&mut reader, &mut buf)? {
            let raw: &[u8] = &buf;
            i += 1;
            let at = format!("{}:{}", file.display(), i);
            r.lines += 1;
            r.stopped = false;
            let parsed = if len > super::MAX_LINE as u64 {
                Err("longer than any audit line")
            } else {
                parse(raw)
            };
            let (line, mac) = match parsed {
                Ok(p) => p,
                Err(why) => {
                    // The chain goes on from the last good line: the next
                    // one must verify against it.
                    r.problems.push(format!(
                        "{at}: {why} (cut by a crash mid-write, or changed)"
                    ));
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
                    "{at}: the restart above skipped {} line(s) that did not verify ({})",
                    line.count.unwrap_or(0),
                    line.reason.as_deref().unwrap_or("no detail")
                ));
            }
            let stated = line.prev.as_deref().map(|p| unhex32(p.as_bytes()));
            let key = ring.get(KeyId(line.mac_key));
            let body = &raw[..raw.len() - MAC_SUFFIX_LEN];
            let verifies = |from: &[u8; 32]| {
                key.as_ref()
                    .is_some_and(|k| k.audit_keys().chain_mac(from, body) == mac)
            };
            // The line before, when it is not the last good one: a line
            // that chains on from it is not in the chain either.
            let before = last.filter(|(m, _, _)| anchored && good.is_none_or(|(g, _)| g != *m));
            let want = match good {
                Some((_, e)) => e,
                None if after.is_none() && last.is_none() => Some(0),
                None => None,
            };
            let mut ok = false;
            let mut follows = false;
            // Problems of the chain and the MAC, reported after the seq's.
            let mut later = Vec::new();
            match (good, stated) {
                (_, Some(None)) => {
                    later.push(format!("{at}: its prev member is not a MAC"));
                }
                _ if key.is_none() => {
                    later.push(format!(
                        "{at}: its chain key (root key {}) is not in this keyset: verify with a \
                         keyset that still holds it",
                        line.mac_key
                    ));
                }
                (Some((g, _)), Some(Some(s))) if s != g => {
                    if before.is_some_and(|(m, _, _)| m == s) && verifies(&s) {
                        follows = true;
                    } else {
                        later.push(format!(
                            "{at}: its prev member differs from the MAC of the {}: lines \
                             removed, reordered, or from another chain",
                            if anchored {
                                "last line that verified"
                            } else {
                                "line before"
                            }
                        ));
                    }
                }
                (Some((g, _)), _) => {
                    if verifies(&g) {
                        ok = true;
                    } else if before.is_some_and(|(m, _, _)| verifies(&m)) {
                        follows = true;
                    } else {
                        later.push(format!(
                            "{at}: MAC does not match: the line was changed, or a line before \
                             it was removed, inserted or reordered"
                        ));
                    }
                }
                (None, Some(Some(s))) => {
                    if r.lines == 1 && line.seq == 0 && s == [0u8; 32] && after.is_none() {
                        r.genesis = true;
                    }
                    if verifies(&s) {
                        ok = true;
                    } else {
                        later.push(format!(
                            "{at}: MAC does not match: the line was changed, or a line before \
                             it was removed, inserted or reordered"
                        ));
                    }
                }
                (None, None) => {
                    later.push(format!(
                        "{at}: nothing to check it against: the chain does not start here \
                         (the files before it, or its first lines, are missing)"
                    ));
                }
            }
            // A line whose MAC checks against the line before, with the
            // seq after that line's, where that line is not in the chain:
            // a run of lines copied from elsewhere (or the lines after a
            // changed, removed or reordered one). One problem per run.
            let in_run = follows && before.is_some_and(|(_, _, n)| n == Some(line.seq));
            let mut seq_checked = !in_run;
            if in_run {
                let g = good
                    .and_then(|(_, e)| e)
                    .map_or_else(|| "none".to_owned(), |e| (e - 1).to_string());
                match &mut run {
                    Some((idx, first, count)) => {
                        *count += 1;
                        r.problems[*idx] = format!(
                            "{first}: chains on from the line before, which is not in the \
                             chain (the last line that verified is seq {g}), and so do the {} \
                             line(s) after it, to {at}: lines copied from elsewhere, or after a \
                             changed, removed or reordered line",
                            *count
                        );
                    }
                    None => {
                        r.problems.push(format!(
                            "{at}: chains on from the line before, which is not in the chain \
                             (the last line that verified is seq {g}): lines copied from \
                             elsewhere, or after a changed, removed or reordered line"
                        ));
                        run = Some((r.problems.len() - 1, at.clone(), 0));
                    }
                }
            } else {
                run = None;
                if follows {
                    later.push(format!(
                        "{at}: its MAC checks against the line before, which is not in the \
                         chain: lines copied from elsewhere"
                    ));
                }
            }
            if key.is_none() {
                // Nothing about it can be judged: its key is named.
                seq_checked = false;
            }
            if let (true, Some(e)) = (seq_checked, want) {
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
                    ok = false;
                }
            }
            r.problems.extend(later);
            let next = line.seq.checked_add(1);
            if next.is_none() {
                r.problems.push(format!("{at}: seq at its largest value"));
            }
            if ok {
                anchored = true;
            }
            if ok || !anchored {
                good = Some((mac, next));
            }
            last = Some((mac, line.seq, next));
        }
    }
    Ok(r)
}
