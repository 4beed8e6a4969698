//! What the benches read about a process and a directory.

/// A `kB` field of `/proc/PID/status` (`VmRSS:`, `VmHWM:`); `pid` may be
/// `self`.
pub fn status_kib(pid: &str, field: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Bytes a directory tree occupies on disk (allocated blocks, as `du`).
pub fn disk_usage(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => m.blocks() * 512 + disk_usage(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}
