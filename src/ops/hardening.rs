//! Process hardening at start: no core dumps (a core of this process would
//! hold root keys, derived subkeys and decrypted state), and panic output
//! that says where, never what.

/// Replaces the panic hook: a panic message may quote the value it tripped
/// on (a slice of a parsed file, a key's bytes in a failed assertion), so
/// only the location is reported.
pub fn withhold_panic_details() {
    std::panic::set_hook(Box::new(|info| {
        let at = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("stateseal: internal error (panic) at {at}; details withheld");
    }));
}

/// Sets `RLIMIT_CORE` to 0 (soft and hard) and, on Linux, marks the process
/// non-dumpable (`PR_SET_DUMPABLE` 0), which also keeps other processes of
/// the same user from attaching with ptrace or reading its memory through
/// `/proc`.
#[cfg(unix)]
pub fn disable_core_dumps() -> std::io::Result<()> {
    use rustix::process::{setrlimit, Resource, Rlimit};
    setrlimit(
        Resource::Core,
        Rlimit {
            current: Some(0),
            maximum: Some(0),
        },
    )?;
    #[cfg(target_os = "linux")]
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(target_os = "linux")]
    fn the_process_becomes_non_dumpable_with_no_core_limit() {
        super::disable_core_dumps().unwrap();
        assert_eq!(
            rustix::process::dumpable_behavior().unwrap(),
            rustix::process::DumpableBehavior::NotDumpable
        );
        let l = rustix::process::getrlimit(rustix::process::Resource::Core);
        assert_eq!((l.current, l.maximum), (Some(0), Some(0)));
    }
}
